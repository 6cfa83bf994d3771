package pth

import (
	"archive/zip"
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// pipeCopy copies each source whole with its CRC, reusing the same buffers
// from one call to the next, whatever the size against the buffers'.
func TestPipeCopyReusesBuffers(t *testing.T) {
	const bufLen = 64
	bufs := make([][]byte, pipeBuffers)
	for i := range bufs {
		bufs[i] = make([]byte, bufLen)
	}
	rng := rand.New(rand.NewSource(1))
	for _, size := range []int{0, 1, bufLen - 1, bufLen, bufLen + 1, 7*bufLen + 5, 2 * bufLen} {
		src := make([]byte, size)
		rng.Read(src)
		var dst bytes.Buffer
		n, crc, err := pipeCopy(&dst, bytes.NewReader(append(src, 0xAA)), int64(size), bufs, true)
		if err != nil || n != int64(size) || !bytes.Equal(dst.Bytes(), src) || crc != crc32.ChecksumIEEE(src) {
			t.Fatalf("size %d: copied %d bytes (equal %v), crc %08x want %08x, err %v", size, n, bytes.Equal(dst.Bytes(), src), crc, crc32.ChecksumIEEE(src), err)
		}
	}
	// A writer's error ends the copy and is returned; the buffers serve
	// the next copy all the same.
	boom := errors.New("disk full")
	if _, _, err := pipeCopy(&failWriter{err: boom}, bytes.NewReader(make([]byte, 5*bufLen)), 5*bufLen, bufs, true); !errors.Is(err, boom) {
		t.Fatalf("err %v, want %v", err, boom)
	}
	var dst bytes.Buffer
	if n, crc, err := pipeCopy(&dst, bytes.NewReader(make([]byte, 3*bufLen)), 3*bufLen, bufs, false); err != nil || n != 3*bufLen || crc != 0 {
		t.Fatalf("after an error: %d bytes, %v", n, err)
	}
}

// failWriter takes left bytes, then fails with err.
type failWriter struct {
	left int
	err  error
}

func (w *failWriter) Write(p []byte) (int, error) {
	if len(p) > w.left {
		n := w.left
		w.left = 0
		return n, w.err
	}
	w.left -= len(p)
	return len(p), nil
}

// Records larger than the copy buffer go through pipeCopy, whose buffers
// the writer keeps: two of them in a row come out whole.
func TestZipWriterLargeRecords(t *testing.T) {
	rng := rand.New(rand.NewSource(2))
	recs := map[string][]byte{"a": make([]byte, copyBufLen+3), "b": make([]byte, 2*copyBufLen+1)}
	for _, b := range recs {
		rng.Read(b)
	}
	var out bytes.Buffer
	z := newZipWriter(&out)
	for _, name := range []string{"a", "b"} {
		crc, err := z.add(name, int64(len(recs[name])), bytes.NewReader(recs[name]))
		if err != nil || crc != crc32.ChecksumIEEE(recs[name]) {
			t.Fatalf("%s: crc %08x, err %v", name, crc, err)
		}
	}
	if len(z.pipe) != pipeBuffers {
		t.Fatalf("the writer keeps %d pipe buffers, want %d", len(z.pipe), pipeBuffers)
	}
	if err := z.close(); err != nil {
		t.Fatal(err)
	}
	zr, err := zip.NewReader(bytes.NewReader(out.Bytes()), int64(out.Len()))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range zr.File {
		rc, err := f.Open()
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(rc)
		if err != nil || !bytes.Equal(got, recs[f.Name]) {
			t.Errorf("%s: %d bytes back (err %v), want %d equal", f.Name, len(got), err, len(recs[f.Name]))
		}
	}
}

// The probe chooses maps or reads for the large records once per
// checkpoint, and the copy writes the same bytes whichever it chose, with
// negations too. Under mapProbeMin it does not probe: reads.
func TestChooseMaps(t *testing.T) {
	defer func(min int64) { mapProbe, mapProbeMin, chunkCopy = false, min, true }(mapProbeMin)
	chunkCopy = false // the record by record copy's choice
	dir := t.TempDir()
	src := NewStateDict(filepath.Join(dir, "in.pth"))
	big := make([]float64, 3<<18) // 3 MiB of float32: past the 1 MiB a probed record needs
	for i := range big {
		big[i] = float64(i%251) - 125
	}
	if err := src.AddTensor("conv.weight", Float32, []int{6, len(big) / 6}, big); err != nil {
		t.Fatal(err)
	}
	if err := src.AddTensor("bn.weight", Float32, []int{6}, []float64{1, -1, 2, -2, 3, -3}); err != nil {
		t.Fatal(err)
	}
	in := filepath.Join(dir, "in.pth")
	if err := src.Write(in, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	var outs [][]byte
	modes := []struct {
		probe    bool
		probeMin int64 // the large records' bytes that make it probe
		reads    bool  // chosen without the probe; with it, below probeMin
	}{
		{false, 0, false}, {false, 0, true},
		{true, 1, false},       // the probe decides
		{true, 64 << 20, true}, // 3 MiB: too little to probe
	}
	for i, mode := range modes {
		mapProbe, mapProbeMin = mode.probe, mode.probeMin
		c, err := Open(in)
		if err != nil {
			t.Fatal(err)
		}
		if !mode.probe {
			c.maps.once.Do(func() { c.maps.reads = mode.reads })
		}
		if _, err := c.NegateChannels("conv.weight", []int{1, 4}); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, fmt.Sprintf("out%d.pth", i))
		if err := c.Write(out, WriteOptions{}); err != nil {
			t.Fatal(err)
		}
		st := c.storageOf(t, "conv.weight")
		if c.mappable(st) == c.maps.reads {
			t.Errorf("mode %+v: mappable %v with reads chosen %v", mode, c.mappable(st), c.maps.reads)
		}
		switch {
		case mode.probe && mode.reads && !c.maps.reads:
			t.Errorf("mode %+v: maps chosen for 3 MiB of large records, under the probe's minimum", mode)
		case mode.probe && !mode.reads:
			t.Logf("the probe chose %s", map[bool]string{false: "maps", true: "reads"}[c.maps.reads])
		}
		c.Close()
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		outs = append(outs, b)
	}
	if !bytes.Equal(outs[0], outs[1]) || !bytes.Equal(outs[0], outs[2]) || !bytes.Equal(outs[0], outs[3]) {
		t.Errorf("the outputs differ between maps, reads and the probe's choice")
	}
}

func (c *Checkpoint) storageOf(t *testing.T, key string) *Storage {
	tn, ok := c.Tensor(key)
	if !ok {
		t.Fatalf("no tensor %q", key)
	}
	return tn.Storage
}

// No window of the input stays mapped once a copy from maps returns,
// written whole or stopped by a failing writer: the mapper unmaps the
// windows the writer hands back, and close the last ones, which the
// mapper, done, did not take.
func TestMapsUnmapped(t *testing.T) {
	if _, err := os.Stat("/proc/self/maps"); err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	defer func(size int64) { mapWindowSize = size }(mapWindowSize)
	mapWindowSize = 4096 // several windows a record
	in := filepath.Join(t.TempDir(), "in.pth")
	src := NewStateDict(in)
	w := make([]float64, 8*4096)
	for i := range w {
		w[i] = float64(i%97) - 48
	}
	if err := src.AddTensor("conv.weight", Float32, []int{8, 4096}, w); err != nil {
		t.Fatal(err)
	}
	if err := src.AddTensor("fc.weight", Float32, []int{4, 4096}, w[:4*4096]); err != nil {
		t.Fatal(err)
	}
	if err := src.Write(in, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	mapped := func() int {
		b, err := os.ReadFile("/proc/self/maps")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(string(b), in)
	}
	for _, failAfter := range []int{-1, 100 << 10} {
		c, err := Open(in)
		if err != nil {
			t.Fatal(err)
		}
		if !c.mappable(c.storageOf(t, "conv.weight")) {
			t.Fatal("conv.weight is not copied from maps")
		}
		if _, err := c.NegateChannels("conv.weight", []int{1, 6}); err != nil {
			t.Fatal(err)
		}
		var dst io.Writer = io.Discard
		if failAfter >= 0 {
			dst = &failWriter{left: failAfter, err: errors.New("disk full")}
		}
		_, err = c.WriteTo(dst)
		if (err != nil) != (failAfter >= 0) {
			t.Fatalf("writer failing after %d bytes: error %v", failAfter, err)
		}
		if n := mapped(); n != 0 {
			t.Errorf("writer failing after %d bytes: %d maps of the input left after the copy", failAfter, n)
		}
		c.Close()
	}
}
