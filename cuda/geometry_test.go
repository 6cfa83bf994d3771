package cuda

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/runtime"
)

func TestLoopDims(t *testing.T) {
	cases := []struct {
		n    int64
		sms  int
		grid int
	}{
		{1, 132, 1},
		{256, 132, 1},
		{257, 132, 2},
		{132 * 32 * 256, 132, 132 * 32},
		{132*32*256 + 1, 132, 132 * 32}, // capped: the loop strides
		{1 << 40, 132, 132 * 32},
		{1000, 0, 4}, // no multiprocessor count: at least one
		{1 << 40, 1, 32},
	}
	for _, c := range cases {
		d := loopDims(c.n, c.sms)
		if d.grid != [3]int{c.grid, 1, 1} || d.block != [3]int{blockSize, 1, 1} {
			t.Errorf("loopDims(%d, %d) = %+v, want grid %d", c.n, c.sms, d, c.grid)
		}
		if err := d.validate(); err != nil {
			t.Errorf("loopDims(%d, %d): %v", c.n, c.sms, err)
		}
		// A grid-stride loop covers n when the grid does or the grid is
		// at its cap (the loop takes the rest).
		threads := int64(d.grid[0]) * blockSize
		if threads < c.n && d.grid[0] != max(c.sms, 1)*loopBlocksPerSM {
			t.Errorf("loopDims(%d, %d): %d threads neither cover n nor reach the cap", c.n, c.sms, threads)
		}
	}
}

// TestVecDims: an elementwise kernel needs a block even when n < 4 (the
// tail is done by block 0's first threads), and one thread per float4.
func TestVecDims(t *testing.T) {
	for _, c := range []struct {
		n    int64
		grid int
	}{{1, 1}, {3, 1}, {4, 1}, {1024, 1}, {1027, 1}, {1028, 2}, {4 * 256 * 5, 5}} {
		if d := vecDims(c.n, 132); d.grid[0] != c.grid {
			t.Errorf("vecDims(%d) grid %d, want %d", c.n, d.grid[0], c.grid)
		}
	}
}

func TestSplitsFor(t *testing.T) {
	cases := []struct {
		c     int
		units int64
		sms   int
		want  int
	}{
		{64, 1 << 24, 132, (132*32 + 63) / 64}, // few channels, big planes: 4 waves
		{2048, 392, 132, 2},                    // many channels, small planes: capped by units
		{8192, 392, 132, 1},                    // the channels alone make four waves
		{1, 100, 132, 1},                       // fewer units than a block's threads
		{1, 1 << 30, 132, 1024},
		{3, 0, 132, 1},
	}
	for _, c := range cases {
		if got := splitsFor(c.c, c.units, c.sms); got != c.want {
			t.Errorf("splitsFor(%d, %d, %d) = %d, want %d", c.c, c.units, c.sms, got, c.want)
		}
		s := splitsFor(c.c, c.units, c.sms)
		if c.units > 0 && int64(s) > (c.units+blockSize-1)/blockSize {
			t.Errorf("splitsFor(%d, %d): %d splits leave blocks without a unit per thread", c.c, c.units, s)
		}
	}
}

func TestReduceDims(t *testing.T) {
	d, err := reduceDims(64, 9)
	if err != nil || d.grid != [3]int{9, 64, 1} {
		t.Errorf("reduceDims(64, 9) = %+v, %v", d, err)
	}
	if _, err := reduceDims(maxGridYZ, 1); err != nil {
		t.Errorf("reduceDims at the limit: %v", err)
	}
	if _, err := reduceDims(maxGridYZ+1, 1); err == nil {
		t.Error("reduceDims over the grid's y limit accepted")
	}
}

func TestGemmDims(t *testing.T) {
	cases := []struct {
		m, n, batch int
		grid        [3]int
		err         string
	}{
		{1, 1, 1, [3]int{1, 1, 1}, ""},
		{64, 64, 1, [3]int{1, 1, 1}, ""},
		{65, 129, 3, [3]int{3, 2, 3}, ""},
		{64 * maxGridYZ, 10, 1, [3]int{1, maxGridYZ, 1}, ""},
		{64*maxGridYZ + 1, 10, 1, [3]int{}, "rows"},
		{10, 10, maxGridYZ + 1, [3]int{}, "grid"},
	}
	for _, c := range cases {
		d, err := gemmDims(c.m, c.n, c.batch)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("gemmDims(%d, %d, %d): error %v, want %q", c.m, c.n, c.batch, err, c.err)
			}
			continue
		}
		if err != nil || d.grid != c.grid {
			t.Errorf("gemmDims(%d, %d, %d) = %v, %v; want %v", c.m, c.n, c.batch, d.grid, err, c.grid)
		}
	}
}

func TestChunks(t *testing.T) {
	cases := []struct {
		n          int
		per, limit int64
		want       [][2]int
		err        bool
	}{
		{0, 10, 100, nil, false},
		{5, 10, 100, [][2]int{{0, 5}}, false},
		{10, 10, 100, [][2]int{{0, 10}}, false},
		{11, 10, 100, [][2]int{{0, 10}, {10, 11}}, false},
		{7, 30, 100, [][2]int{{0, 3}, {3, 6}, {6, 7}}, false},
		{3, 100, 100, [][2]int{{0, 1}, {1, 2}, {2, 3}}, false},
		{3, 101, 100, nil, true},
		{4, 0, 100, [][2]int{{0, 4}}, false},
	}
	for _, c := range cases {
		got, err := chunks(c.n, c.per, c.limit)
		if c.err {
			if err == nil {
				t.Errorf("chunks(%d, %d, %d) accepted", c.n, c.per, c.limit)
			}
			continue
		}
		if err != nil || len(got) != len(c.want) {
			t.Errorf("chunks(%d, %d, %d) = %v, %v; want %v", c.n, c.per, c.limit, got, err, c.want)
			continue
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Errorf("chunks(%d, %d, %d) = %v, want %v", c.n, c.per, c.limit, got, c.want)
				break
			}
		}
	}
}

func TestValidate(t *testing.T) {
	ok := []launchDims{
		{grid: [3]int{1, 1, 1}, block: [3]int{32, 1, 1}},
		{grid: [3]int{maxGridX, maxGridYZ, maxGridYZ}, block: [3]int{1024, 1, 1}},
		{grid: [3]int{1, 1, 1}, block: [3]int{16, 16, 1}},
	}
	bad := []launchDims{
		{grid: [3]int{0, 1, 1}, block: [3]int{256, 1, 1}},
		{grid: [3]int{1, maxGridYZ + 1, 1}, block: [3]int{256, 1, 1}},
		{grid: [3]int{1, 1, 1}, block: [3]int{2048, 1, 1}},
		{grid: [3]int{1, 1, 1}, block: [3]int{100, 1, 1}}, // not whole warps
		{grid: [3]int{1, 1, 1}, block: [3]int{256, 0, 1}},
	}
	for _, d := range ok {
		if err := d.validate(); err != nil {
			t.Errorf("%+v: %v", d, err)
		}
	}
	for _, d := range bad {
		if err := d.validate(); err == nil {
			t.Errorf("%+v accepted", d)
		}
	}
}

// TestConvRuns: the batch is cut so that each run's scratch stays within
// colBudget, and a single image too large for it runs alone.
func TestConvRuns(t *testing.T) {
	p3 := runtime.ConvParams{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 1}, Groups: 1}
	p1 := runtime.ConvParams{Stride: [2]int{1, 1}, Dilation: [2]int{1, 1}, Groups: 1}
	cases := []struct {
		name    string
		x, w, y []int
		p       runtime.ConvParams
		perRun  int // images per run
		runs    int
	}{
		// K = 576, L = 3136: 1.8M floats of columns per image.
		{"3x3", []int{32, 64, 56, 56}, []int{64, 64, 3, 3}, []int{32, 64, 56, 56}, p3, 9, 4},
		// Direct: no columns; the weight-gradient products (512 x 2048).
		{"1x1", []int{256, 2048, 7, 7}, []int{512, 2048, 1, 1}, []int{256, 512, 7, 7}, p1, 16, 16},
		// One image's columns (K = 4608, L = 12544) exceed the budget.
		{"one image over budget", []int{3, 512, 112, 112}, []int{512, 512, 3, 3}, []int{3, 512, 112, 112}, p3, 1, 3},
	}
	for _, c := range cases {
		g, err := convGeometry(c.x, c.w, c.y, c.p)
		if err != nil {
			t.Fatal(err)
		}
		r, err := g.runs()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if len(r) != c.runs || r[0] != [2]int{0, c.perRun} || r[len(r)-1][1] != c.x[0] {
			t.Errorf("%s: runs %v, want %d of %d images", c.name, r, c.runs, c.perRun)
		}
	}
}
