package pth

import (
	"archive/zip"
	"bytes"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/output/outputtest"
)

// noFloats lists the fixtures whose pickle holds no Python float, which
// torch 1.13's weights_only loader must accept as they are.
var noFloats = map[string]bool{"convbn_zip": true, "convbn_legacy": true, "dtypes": true, "dtypes_legacy": true, "shared": true, "views": true, "views_legacy": true}

func readZip(t *testing.T, path string) map[string][]byte {
	t.Helper()
	z, err := zip.OpenReader(path)
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	out := map[string][]byte{}
	for _, f := range z.File {
		rc, err := f.Open()
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(rc) // checks the CRC
		rc.Close()
		if err != nil {
			t.Fatalf("%s: %v", f.Name, err)
		}
		off, _ := f.DataOffset()
		if off%64 != 0 || f.Method != zip.Store || !strings.HasPrefix(f.Name, "archive/") {
			t.Errorf("%s: data at %d (want 64-byte aligned), method %d, want stored under archive/", f.Name, off, f.Method)
		}
		out[f.Name] = b
	}
	if string(out["archive/version"]) != "3\n" || string(out["archive/byteorder"]) != "little" {
		t.Errorf("version %q, byteorder %q", out["archive/version"], out["archive/byteorder"])
	}
	return out
}

// TestRoundTrip writes every fixture back unchanged: torch must load it
// with weights_only and find the same tree, tensors included (values,
// dtypes, offsets, strides, which tensors share a storage); every storage
// record must hold exactly the input's bytes; records are aligned.
func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	for _, name := range fixtures {
		t.Run(name, func(t *testing.T) {
			c := openFixture(t, name)
			out := filepath.Join(dir, name+".pth")
			if err := c.Write(out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			recs := readZip(t, out)
			for key, st := range c.storages {
				want, err := c.readRange(st, 0, st.rec.size)
				if err != nil {
					t.Fatal(err)
				}
				if got, ok := recs["archive/data/"+key]; !ok || !bytes.Equal(got, want) {
					t.Errorf("storage %q: output record differs from the input's bytes", key)
				}
			}
			if len(recs) != len(c.storages)+3 {
				t.Errorf("%d records, want %d storages + data.pkl, byteorder, version", len(recs), len(c.storages))
			}
			mode := verifyWithTorch(t, c, out)
			if noFloats[name] && mode != "strict" {
				t.Errorf("torch.load(weights_only=True) needed mode %q, want strict", mode)
			}
			// And this package reads its own output back identically.
			back, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer back.Close()
			if !reflect.DeepEqual(back.Keys(), c.Keys()) || !reflect.DeepEqual(back.StatePath, c.StatePath) {
				t.Errorf("read back keys %q at %q", back.Keys(), back.StatePath)
			}
		})
	}
}

// changes applies deterministic float32-representable changes.
func change(t *testing.T, c *Checkpoint, key string) []float64 {
	t.Helper()
	v, err := c.Values(key)
	if err != nil {
		t.Fatal(err)
	}
	for i := range v {
		switch c.DType(key) {
		case "bool":
			v[i] = 1 - v[i]
		case "int64", "int32", "int16", "int8", "uint8":
			v[i] = math.Max(0, math.Min(100, v[i]+float64(i)+1))
		default:
			v[i] = float64(float32(-2*v[i] + 0.5))
		}
	}
	if err := c.SetValues(key, v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestRoundTripChanged changes tensors of each kind (owning its storage,
// sharing one, viewing one with an offset or strides, tied under two keys
// (the other key keeps its values), every dtype) and checks with torch that the changes, and only they,
// arrive, and that storages are reused or created as the rules say.
func TestRoundTripChanged(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		fixture string
		keys    []string
		// sameKey: the changed tensor owned its storage, whose record keeps
		// its key; others get a new storage.
		sameKey map[string]bool
	}{
		{"convbn_zip", []string{"0.weight", "1.running_var", "1.num_batches_tracked"}, map[string]bool{"0.weight": true, "1.running_var": true, "1.num_batches_tracked": true}},
		{"convbn_legacy", []string{"1.weight", "4.bias"}, map[string]bool{"1.weight": true, "4.bias": true}},
		{"dtypes", []string{"f16", "bf16", "f64", "i8", "u8", "bool", "i64", "scalar"}, map[string]bool{"f16": true, "bf16": true, "f64": true, "i8": true, "u8": true, "bool": true, "i64": true, "scalar": true}},
		// tied.x and tied.y are one tensor object: a change through
		// tied.x reaches tied.x only, written to a record of its own.
		{"shared", []string{"a.bias", "tied.x"}, nil},
		{"views", []string{"m.off", "m.col"}, nil},
		{"views_legacy", []string{"m.base"}, nil},
		{"nested", []string{"module.0.weight"}, map[string]bool{"module.0.weight": true}},
	}
	for _, tc := range cases {
		t.Run(tc.fixture, func(t *testing.T) {
			c := openFixture(t, tc.fixture)
			want := map[string][]float64{}
			oldKey := map[string]string{}
			for _, k := range tc.keys {
				want[k] = change(t, c, k)
				tn, _ := c.Tensor(k)
				oldKey[k] = tn.Storage.Key
			}
			out := filepath.Join(dir, tc.fixture+".pth")
			if err := c.Write(out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			verifyWithTorch(t, c, out)
			back, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer back.Close()
			for _, k := range c.Keys() {
				got, err := back.Values(k)
				if err != nil {
					t.Fatal(err)
				}
				exp, changed := want[k]
				if !changed {
					if exp, err = c.Values(k); err != nil {
						t.Fatal(err)
					}
				} else if dt := c.DType(k); dt == "float16" || dt == "bfloat16" {
					exp = rounded(t, DType(dt), exp)
				}
				if !reflect.DeepEqual(got, exp) {
					t.Errorf("%s: read back %v, want %v", k, got, exp)
				}
				bt, _ := back.Tensor(k)
				if ok, isChanged := tc.sameKey[k], want[k] != nil; isChanged && (bt.Storage.Key == oldKey[k]) != ok {
					t.Errorf("%s: storage key %q (was %q), same key wanted: %v", k, bt.Storage.Key, oldKey[k], ok)
				}
				if _, isChanged := want[k]; isChanged && !tc.sameKey[k] && (bt.Offset != 0 || !bt.Contiguous()) {
					t.Errorf("%s: new storage should be contiguous from 0, got offset %d stride %v", k, bt.Offset, bt.Stride)
				}
			}
			// Unchanged storages are copied byte for byte.
			recs := readZip(t, out)
			for _, k := range c.Keys() {
				tn, _ := c.Tensor(k)
				if tn.Changed() {
					continue
				}
				in, err := c.readRange(tn.Storage, 0, tn.Storage.rec.size)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(recs["archive/data/"+tn.Storage.Key], in) {
					t.Errorf("%s: unchanged storage %q not copied byte for byte", k, tn.Storage.Key)
				}
			}
		})
	}
}

func rounded(t *testing.T, d DType, v []float64) []float64 {
	b, err := encode(d, v)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]float64, len(v))
	if err := decode(d, b, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestDeterministic: the same input with the same changes gives the same
// bytes, whether written twice from one Checkpoint or from two.
func TestDeterministic(t *testing.T) {
	write := func(c *Checkpoint) []byte {
		var b bytes.Buffer
		if _, err := c.WriteTo(&b); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	for _, name := range []string{"nested", "nested_legacy", "views"} {
		a, b := openFixture(t, name), openFixture(t, name)
		for _, c := range []*Checkpoint{a, b} {
			change(t, c, c.Keys()[0])
			change(t, c, c.Keys()[2])
		}
		first := write(a)
		if !bytes.Equal(first, write(a)) || !bytes.Equal(first, write(b)) {
			t.Errorf("%s: output bytes differ between identical writes", name)
		}
	}
}

// TestWriteRefusals: never the input (directly or through a symlink, force
// or not), never an existing file without force.
func TestWriteRefusals(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "in.pth")
	copyFile(t, filepath.Join("testdata", "convbn_zip.pth"), in)
	c, err := Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	link := filepath.Join(dir, "link.pth")
	if err := os.Symlink(in, link); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{in, link} {
		if err := c.Write(p, WriteOptions{Force: true}); err == nil || !strings.Contains(err.Error(), "input") {
			t.Errorf("Write(%s): %v, want a refusal to overwrite the input", p, err)
		}
	}
	existing := filepath.Join(dir, "existing.pth")
	if err := os.WriteFile(existing, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.Write(existing, WriteOptions{}); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Errorf("Write over an existing file without force: %v", err)
	}
	if b, _ := os.ReadFile(existing); string(b) != "keep me" {
		t.Errorf("existing file was modified")
	}
	if err := c.Write(existing, WriteOptions{Force: true}); err != nil {
		t.Errorf("Write with force: %v", err)
	}
	readZip(t, existing)
	assertOnly(t, dir, "in.pth", "link.pth", "existing.pth")
}

// TestFailedWriteLeavesNothing corrupts a storage record of a zip input
// after Open, and truncates a legacy input: the copy must fail (CRC-32
// mismatch, short record) and leave neither the output nor a temporary
// file.
func TestFailedWriteLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	c, _ := openCorrupted(t, dir, "1.running_mean", 2, []byte{0xde, 0xad})
	out := filepath.Join(dir, "out.pth")
	if err := c.Write(out, WriteOptions{}); err == nil || !strings.Contains(err.Error(), "CRC-32") {
		t.Errorf("Write from a corrupted record: %v, want a CRC-32 error", err)
	}
	assertOnly(t, dir, "in.pth")

	legacy := filepath.Join(dir, "legacy.pth")
	copyFile(t, filepath.Join("testdata", "convbn_legacy.pth"), legacy)
	l, err := Open(legacy)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := os.Truncate(legacy, 400); err != nil {
		t.Fatal(err)
	}
	if err := l.Write(out, WriteOptions{}); err == nil {
		t.Errorf("Write from a truncated legacy file succeeded")
	}
	assertOnly(t, dir, "in.pth", "legacy.pth")
}

// TestZip64 forces zip64 records and end records, as files over 4 GiB
// need, and checks that archive/zip and torch read the result.
func TestZip64(t *testing.T) {
	dir := t.TempDir()
	c := openFixture(t, "nested")
	change(t, c, "module.1.weight")
	out := filepath.Join(dir, "z64.pth")
	if err := c.write(out, WriteOptions{}, true); err != nil {
		t.Fatal(err)
	}
	readZip(t, out)
	verifyWithTorch(t, c, out)
}

// openCorrupted copies convbn_zip.pth to dir/in.pth, opens the copy, then
// overwrites bytes of key's record, at offset at, with b: a checkpoint
// whose structure read fine and whose record no longer matches its CRC.
// The checkpoint is closed when the test ends.
func openCorrupted(t *testing.T, dir, key string, at int64, b []byte) (*Checkpoint, string) {
	t.Helper()
	in := filepath.Join(dir, "in.pth")
	copyFile(t, filepath.Join("testdata", "convbn_zip.pth"), in)
	// Where the record lies, from a first open; the bytes are changed
	// before the open returned, since opening reads small records ahead.
	c, err := Open(in)
	if err != nil {
		t.Fatal(err)
	}
	tn, ok := c.Tensor(key)
	if !ok {
		t.Fatalf("fixture has no %s", key)
	}
	off := tn.Storage.rec.offset + at
	c.Close()
	f, err := os.OpenFile(in, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if c, err = Open(in); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, in
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func assertOnly(t *testing.T, dir string, names ...string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".expected.json") {
			got = append(got, e.Name())
		}
	}
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	if len(got) != len(names) {
		t.Errorf("directory holds %q, want only %q", got, names)
		return
	}
	for _, g := range got {
		if !want[g] {
			t.Errorf("directory holds %q, want only %q", got, names)
		}
	}
}

// TestVerifierCatchesMismatch makes sure the torch comparison is not
// vacuous: a wrong expected value must be reported.
func TestVerifierCatchesMismatch(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	c := openFixture(t, "nested")
	out := filepath.Join(dir, "out.pth")
	if err := c.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.SetValues("module.1.bias", make([]float64, 4)) // the file keeps the old values
	want, err := flattenTree(c)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(want)
	exp := out + ".expected.json"
	os.WriteFile(exp, b, 0o644)
	res, err := torchCheck(out, exp)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(res, "MISMATCH") || !strings.Contains(res, "module.1.bias") {
		t.Errorf("verify.py answered %q, want a mismatch on module.1.bias", res)
	}
}

// TestMemoryDoesNotScale writes a 128 MiB legacy checkpoint (its storage a
// sparse run of zeros, so that the test is quick) back as a zip and checks
// that the write allocated a small fraction of that: unchanged storages
// are streamed, never held.
func TestMemoryDoesNotScale(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 256 MiB to disk")
	}
	const numel = 1 << 25
	le32 := func(n int) string { return string([]byte{byte(n), byte(n >> 8), byte(n >> 16), byte(n >> 24)}) }
	main := "\x80\x02}(X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuJ" +
		le32(numel) + "tQK\x00J" + le32(numel) + "\x85K\x01\x85\x89NtRu."
	head := legacyFile([]byte(main), []byte("\x80\x02]X\x01\x00\x00\x000a."))
	head = append(head, le32(numel)+"\x00\x00\x00\x00"...)
	dir := t.TempDir()
	in := filepath.Join(dir, "big.pth")
	if err := os.WriteFile(in, head, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(in, int64(len(head))+4*numel); err != nil {
		t.Fatal(err)
	}
	c, err := Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if err := c.Write(filepath.Join(dir, "out.pth"), WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("write allocated %d KiB", alloc>>10)
	if alloc > 8<<20 {
		t.Errorf("writing a %d MiB checkpoint allocated %d MiB", 4*numel>>20, alloc>>20)
	}
	recs, err := zip.OpenReader(filepath.Join(dir, "out.pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer recs.Close()
	for _, f := range recs.File {
		if f.Name == "archive/data/0" && f.UncompressedSize64 != 4*numel {
			t.Errorf("storage record of %d bytes, want %d", f.UncompressedSize64, 4*numel)
		}
	}
}

// reserveBuffer is an output that records what the writer reserves
// (output.File.Reserve).
type reserveBuffer struct {
	bytes.Buffer
	reserved []int64
}

func (b *reserveBuffer) Reserve(n int64) { b.reserved = append(b.reserved, n) }

// TestWriteReserves: a write reserves its output's blocks once, ahead of
// the writes, for at least every record's bytes and never past the end
// of the archive it writes (blocks reserved past the end would stay
// allocated in the output).
func TestWriteReserves(t *testing.T) {
	for _, name := range fixtures {
		for _, changed := range []bool{false, true} {
			c := openFixture(t, name)
			if changed {
				change(t, c, c.Keys()[0])
			}
			var b reserveBuffer
			if _, err := c.WriteTo(&b); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			z, err := zip.NewReader(bytes.NewReader(b.Bytes()), int64(b.Len()))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			var records int64
			for _, f := range z.File {
				if strings.Contains(f.Name, "/data/") || strings.HasSuffix(f.Name, "/data.pkl") {
					records += int64(f.UncompressedSize64)
				}
			}
			if len(b.reserved) != 1 {
				t.Fatalf("%s (changed %v): reserved %v, want one reservation", name, changed, b.reserved)
			}
			if n := b.reserved[0]; n < records || n > int64(b.Len()) {
				t.Errorf("%s (changed %v): reserved %d bytes; the records hold %d, the archive %d", name, changed, n, records, b.Len())
			}
		}
	}
}

// TestWriteLeavesNoBlocksPastTheEnd: the file a write leaves holds no
// more blocks than its size needs (the reserve was not too large).
func TestWriteLeavesNoBlocksPastTheEnd(t *testing.T) {
	out := filepath.Join(t.TempDir(), "out.pth")
	c := openFixture(t, "nested")
	change(t, c, c.Keys()[0])
	if err := c.Write(out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	outputtest.NoBlocksPastEnd(t, out)
}

// TestRecordEnd: where recordEnd, which measures a record's local header
// and descriptor without building them, says a record ends is where
// begin, its data and finish leave the writer, for names of every length
// modulo the alignment, at offsets around it, with and without zip64.
func TestRecordEnd(t *testing.T) {
	for _, force64 := range []bool{false, true} {
		for _, size := range []int64{0, 1, 63, 64, 1000} {
			for nameLen := 1; nameLen <= 2*zipAlign; nameLen++ {
				for _, start := range []int64{0, 1, 17, zipAlign - 1, 3*zipAlign + 5} {
					var out bytes.Buffer
					out.Write(make([]byte, start))
					z := newZipWriter(&out)
					z.off, z.force64 = start, force64
					name := strings.Repeat("n", nameLen)
					want := z.recordEnd(name, size, start)
					e, err := z.begin(name, size)
					if err != nil {
						t.Fatal(err)
					}
					z.w.Write(make([]byte, size))
					z.off += size
					if err := z.finish(e, 0); err != nil {
						t.Fatal(err)
					}
					if z.off != want || int64(out.Len()) != want {
						t.Fatalf("zip64 %v, %d bytes named %d bytes at %d: recordEnd %d, written to %d (%d in the buffer)", force64, size, nameLen, start, want, z.off, out.Len())
					}
				}
			}
		}
	}
}
