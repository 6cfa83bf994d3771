package pth

import (
	"bytes"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The streamed sign flip must write exactly the bytes that decoding,
// negating and encoding again writes, for every dtype, layout (views,
// shared storages, legacy files) and channel selection, and read back as
// the negated values.
func TestNegateChannelsSameBytesAsDecoding(t *testing.T) {
	files := []string{"dtypes.pth", "dtypes_legacy.pth", "views.pth", "views_legacy.pth", "shared.pth", "convbn_zip.pth", "convbn_legacy.pth", "nested.pth", "adam.pth"}
	// vecCalls counts the vectored writes of flipped chunks over every
	// file: some (zip, streamed, mapped) must take that path.
	vecCalls := 0
	defer func() {
		if vecCalls == 0 && !t.Failed() {
			t.Errorf("no file took the vectored copy of flipped chunks")
		}
	}()
	for _, name := range files {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join("testdata", name)
			lazy, err := Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer lazy.Close()
			eager, err := Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer eager.Close()
			negated := 0
			for _, key := range lazy.Keys() {
				shape, _ := lazy.Shape(key)
				tn, _ := lazy.Tensor(key)
				if len(shape) == 0 || shape[0] == 0 {
					continue
				}
				if !isFloat(tn.DType()) {
					continue
				}
				chans := []int{shape[0] - 1, 0, shape[0] - 1}
				if shape[0] > 2 {
					chans = append(chans, 1)
				}
				before, err := lazy.Values(key)
				if err != nil {
					t.Fatal(err)
				}
				changed, err := lazy.NegateChannels(key, chans)
				if err != nil {
					t.Fatalf("%s: %v", key, err)
				}
				// The reference: decode, negate, encode (what rewrite did).
				v, err := eager.Values(key)
				if err != nil {
					t.Fatal(err)
				}
				inner := len(v) / shape[0]
				nz := false
				for _, ch := range uniq(chans) {
					for i := ch * inner; i < (ch+1)*inner; i++ {
						nz = nz || v[i] != 0
						v[i] = -v[i]
					}
				}
				if changed != nz {
					t.Errorf("%s: changed = %v, want %v", key, changed, nz)
				}
				if nz {
					if err := eager.SetValues(key, v); err != nil {
						t.Fatal(err)
					}
					negated++
				}
				after, err := lazy.Values(key)
				if err != nil {
					t.Fatal(err)
				}
				for i := range after {
					want := before[i]
					if nz && inChannel(i, inner, chans) {
						want = -want
					}
					if math.Float64bits(after[i]) != math.Float64bits(want) && !(math.IsNaN(after[i]) && math.IsNaN(want)) {
						t.Fatalf("%s[%d] = %v after negation, want %v", key, i, after[i], want)
					}
				}
			}
			if negated == 0 {
				t.Fatal("no tensor negated: the test checks nothing")
			}
			streamed := 0
			for _, key := range lazy.Keys() {
				if tn, _ := lazy.Tensor(key); tn.negate != nil {
					streamed++
				}
			}
			t.Logf("%d tensors negated, %d of them streamed", negated, streamed)
			var a, b bytes.Buffer
			if _, err := lazy.WriteTo(&a); err != nil {
				t.Fatal(err)
			}
			if _, err := eager.WriteTo(&b); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a.Bytes(), b.Bytes()) {
				t.Fatalf("streamed negation wrote %d bytes that differ from decoding's %d", a.Len(), b.Len())
			}
			// A writer that takes the chunks as pieces (output.File's
			// writev) gets the same bytes.
			var v vecBuffer
			if _, err := lazy.WriteTo(&v); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a.Bytes(), v.Bytes()) {
				t.Fatalf("the vectored copy (%d calls) wrote %d bytes that differ from the plain writer's %d", v.calls, v.Len(), a.Len())
			}
			vecCalls += v.calls
			// Records copied in many map windows, a few in flight at once:
			// the same bytes.
			func(size int64) {
				defer func() { mapWindowSize = size }()
				mapWindowSize = 200
				var m vecBuffer
				if _, err := lazy.WriteTo(&m); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(a.Bytes(), m.Bytes()) {
					t.Fatalf("the copy in windows of %d bytes wrote %d bytes that differ from the plain writer's %d", mapWindowSize, m.Len(), a.Len())
				}
			}(mapWindowSize)
			// The batched copy (records under mapMin) and the
			// record-by-record one (compressed records) write the same
			// bytes as the mapped one, to a plain and a vectored writer.
			mapCopy = false
			defer func(buf int64) { mapCopy, batchCopy, batchBuf = true, true, buf }(batchBuf)
			for _, mode := range []struct {
				batched bool
				buf     int64 // group size: 1 KiB splits the runs into many groups
			}{{true, batchBuf}, {true, 1 << 10}, {false, batchBuf}} {
				batched := mode.batched
				batchCopy, batchBuf = mode.batched, mode.buf
				var u bytes.Buffer
				if _, err := lazy.WriteTo(&u); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(a.Bytes(), u.Bytes()) {
					t.Fatalf("the buffered copy (batched %v, groups of %d) wrote %d bytes that differ from the mapped copy's %d", batched, batchBuf, u.Len(), a.Len())
				}
				var v vecBuffer
				if _, err := lazy.WriteTo(&v); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(a.Bytes(), v.Bytes()) {
					t.Fatalf("the vectored buffered copy (batched %v, groups of %d) wrote %d bytes that differ from the mapped copy's %d", batched, batchBuf, v.Len(), a.Len())
				}
			}
		})
	}
}

func uniq(s []int) []int {
	seen := map[int]bool{}
	var out []int
	for _, x := range s {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

func inChannel(i, inner int, chans []int) bool {
	for _, c := range chans {
		if i/inner == c {
			return true
		}
	}
	return false
}

// A corrupt record is caught on the streamed path too, and nothing written
// passes for a good checkpoint.
func TestNegateChannelsCorruptRecord(t *testing.T) {
	src := filepath.Join("testdata", "convbn_zip.pth")
	c, err := Open(src)
	if err != nil {
		t.Fatal(err)
	}
	var key string
	for _, k := range c.Keys() {
		if s, _ := c.Shape(k); len(s) == 4 {
			key = k
		}
	}
	tn, _ := c.Tensor(key)
	off := tn.Storage.rec.offset
	c.Close()
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	data[off+5] ^= 0x01
	bad := filepath.Join(t.TempDir(), "bad.pth")
	if err := os.WriteFile(bad, data, 0o644); err != nil {
		t.Fatal(err)
	}
	c, err = Open(bad)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.NegateChannels(key, []int{0}); err != nil {
		t.Fatal(err)
	}
	if tn, _ := c.Tensor(key); tn.negate == nil {
		t.Fatal("the conv weight did not take the streamed path")
	}
	for _, mode := range []struct{ mapped, batched bool }{{true, true}, {false, true}, {false, false}} {
		mapCopy, batchCopy = mode.mapped, mode.batched
		_, err = c.WriteTo(io.Discard)
		if err == nil || !strings.Contains(err.Error(), "corrupt") {
			t.Errorf("WriteTo (mapped %v, batched %v) = %v, want a corrupt-record error", mode.mapped, mode.batched, err)
		}
	}
	mapCopy, batchCopy = true, true
}

// vecBuffer is a bytes.Buffer that also takes vectored writes, as
// output.File does, and counts them.
type vecBuffer struct {
	bytes.Buffer
	calls int
}

func (v *vecBuffer) WriteVec(bufs [][]byte) (int, error) {
	v.calls++
	n := 0
	for _, b := range bufs {
		k, _ := v.Write(b)
		n += k
	}
	return n, nil
}
