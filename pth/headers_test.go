package pth

import (
	"archive/zip"
	"bytes"
	"fmt"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// checkRecords finds each record's data offset through headerReader's
// read-ahead window; they must be the offsets archive/zip finds reading
// each local header from the file, on an archive of runs of small records
// between large ones, with extra fields of varying length (which move the
// data) and compressed records.
func TestRecordOffsetsThroughWindow(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for i := 0; i < 300; i++ {
		size := rng.Intn(4 << 10)
		if i%7 == 0 {
			size = 20<<10 + rng.Intn(100<<10) // a large record: read alone
		}
		method := zip.Store
		if i%11 == 0 {
			method = zip.Deflate
		}
		h := &zip.FileHeader{Name: fmt.Sprintf("archive/data/%d", i), Method: method}
		h.Extra = make([]byte, 4+rng.Intn(60)) // an unknown extra field, as torch pads
		h.Extra[0], h.Extra[1] = 0x34, 0x12
		h.Extra[2] = byte(len(h.Extra) - 4)
		w, err := zw.CreateHeader(h)
		if err != nil {
			t.Fatal(err)
		}
		data := make([]byte, size)
		rng.Read(data)
		if _, err := w.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "many.zip")
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	size := int64(buf.Len())
	hr := &headerReader{f: f, size: size}
	z, err := zip.NewReader(hr, size)
	if err != nil {
		t.Fatal(err)
	}
	offsets, err := checkRecords(z, size, hr)
	if err != nil {
		t.Fatal(err)
	}
	if hr.win != nil || hr.ahead != 0 {
		t.Errorf("checkRecords left the window set (%d bytes, ahead %d)", len(hr.win), hr.ahead)
	}
	plain, err := zip.NewReader(bytes.NewReader(buf.Bytes()), size)
	if err != nil {
		t.Fatal(err)
	}
	if len(offsets) != len(plain.File) {
		t.Fatalf("%d offsets for %d records", len(offsets), len(plain.File))
	}
	for i, zf := range plain.File {
		want, err := zf.DataOffset()
		if err != nil {
			t.Fatal(err)
		}
		if got := offsets[z.File[i]]; got != want {
			t.Errorf("%s: data offset %d, want %d", zf.Name, got, want)
		}
	}
}

// headerReader returns the file's bytes whether a read is served from the
// window or not, including reads that straddle its end and reads at the
// end of the file.
func TestHeaderReaderBytes(t *testing.T) {
	data := make([]byte, 200<<10)
	rand.New(rand.NewSource(2)).Read(data)
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	hr := &headerReader{f: f, size: int64(len(data))}
	rng := rand.New(rand.NewSource(3))
	for i := 0; i < 5000; i++ {
		hr.ahead = rng.Intn(70 << 10)
		n := 1 + rng.Intn(maxHeaderRead+8)
		off := int64(rng.Intn(len(data) + 10))
		p := make([]byte, n)
		got, err := hr.ReadAt(p, off)
		want, werr := f.ReadAt(make([]byte, n), off)
		if got != want || (err == nil) != (werr == nil) {
			t.Fatalf("ReadAt(%d bytes at %d) = %d, %v; the file gives %d, %v", n, off, got, err, want, werr)
		}
		if off < int64(len(data)) && !bytes.Equal(p[:got], data[off:off+int64(got)]) {
			t.Fatalf("ReadAt(%d bytes at %d): bytes differ from the file's", n, off)
		}
	}
}

// AppendValues appends exactly what Values returns, after what dst holds,
// for every tensor of the fixtures (every dtype, strided and offset views,
// legacy files), and after SetValues and NegateChannels too.
func TestAppendValuesMatchesValues(t *testing.T) {
	prefix := []float64{7, -7}
	check := func(c *Checkpoint, name string) {
		t.Helper()
		for _, k := range c.Keys() {
			want, werr := c.Values(k)
			got, gerr := c.AppendValues(append(make([]float64, 0, 1), prefix...), k)
			if (werr == nil) != (gerr == nil) {
				t.Fatalf("%s %s: Values error %v, AppendValues error %v", name, k, werr, gerr)
			}
			if werr != nil {
				if len(got) != len(prefix) {
					t.Errorf("%s %s: AppendValues changed dst on error", name, k)
				}
				continue
			}
			if len(got) != len(prefix)+len(want) || got[0] != prefix[0] || got[1] != prefix[1] {
				t.Fatalf("%s %s: %d values after the prefix, want %d", name, k, len(got)-len(prefix), len(want))
			}
			for i, w := range want {
				if g := got[len(prefix)+i]; math.Float64bits(g) != math.Float64bits(w) && !(g != g && w != w) {
					t.Fatalf("%s %s[%d]: %v, Values says %v", name, k, i, g, w)
				}
			}
		}
	}
	for _, name := range []string{"dtypes", "dtypes_legacy", "views", "views_legacy", "convbn_zip", "shared"} {
		c := openFixture(t, name)
		check(c, name)
		for i, k := range c.Keys() {
			shape, _ := c.Shape(k)
			if len(shape) == 0 || shape[0] == 0 || !isFloat(c.state.vals[c.state.strs[k]].(*Tensor).DType()) {
				continue
			}
			if i%2 == 0 {
				if _, err := c.NegateChannels(k, []int{0}); err != nil {
					t.Fatal(err)
				}
			} else if v, err := c.Values(k); err == nil {
				for j := range v {
					v[j] += 1
				}
				if err := c.SetValues(k, v); err != nil {
					t.Fatal(err)
				}
			}
		}
		check(c, name+" changed")
	}
}

// readWhole reads a run of small stored records with one read; each
// record's bytes are still the file's, and each is still checked against
// its own CRC-32 on its first read: a corrupt record read ahead with a
// sound one is refused when it is read, and the sound one is not.
func TestReadAheadKeepsEachRecordsCRC(t *testing.T) {
	orig, err := os.ReadFile(filepath.Join("testdata", "convbn_zip.pth"))
	if err != nil {
		t.Fatal(err)
	}
	c := openFixture(t, "convbn_zip")
	keys := c.Keys()
	var storages []*Storage
	for _, k := range keys {
		tt, _ := c.Tensor(k)
		storages = append(storages, tt.Storage)
	}
	sort.Slice(storages, func(i, j int) bool { return storages[i].rec.offset < storages[j].rec.offset })
	// Corrupt the third record in file order; read the first.
	bad := storages[2]
	data := append([]byte(nil), orig...)
	data[bad.rec.offset] ^= 0x40
	path := filepath.Join(t.TempDir(), "corrupt.pth")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	cc, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	first := cc.storages[storages[0].Key]
	if _, err := cc.readRange(first, 0, first.rec.size); err != nil {
		t.Fatalf("reading the first record: %v", err)
	}
	// Read ahead with it: by readSmallRecord, or by the prefetch of the
	// small records that opening starts.
	ahead := len(cc.ahead.pre)
	for _, st := range cc.storages {
		if st.ahead != nil {
			ahead++
		}
	}
	if ahead == 0 {
		t.Fatal("reading the first small record read none of the others ahead")
	}
	for _, s := range storages[1:] {
		st := cc.storages[s.Key]
		got, err := cc.readRange(st, 0, st.rec.size)
		if st.Key == bad.Key {
			if err == nil || !strings.Contains(err.Error(), "is corrupt") {
				t.Errorf("corrupt record %s read ahead: error %v, want a CRC-32 mismatch", st.rec.name, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", st.rec.name, err)
		}
		if want := data[st.rec.offset : st.rec.offset+st.rec.size]; !bytes.Equal(got, want) {
			t.Errorf("%s: read-ahead bytes differ from the file's", st.rec.name)
		}
		if cap(got) != len(got) {
			t.Errorf("%s: its bytes reach past its end (cap %d, len %d)", st.rec.name, cap(got), len(got))
		}
	}
}
