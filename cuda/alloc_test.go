package cuda

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/runtime"
)

// mapMemory is device memory as a table of blocks with a capacity.
type mapMemory struct {
	next     uint64
	blocks   map[uint64]int64
	used     int64
	capacity int64
	allocs   int
	frees    int
}

func newMapMemory(capacity int64) *mapMemory {
	return &mapMemory{next: 0x1000, blocks: map[uint64]int64{}, capacity: capacity}
}

var errOOM = errors.New("out of memory")

func (m *mapMemory) alloc(n int64) (uint64, error) {
	if m.capacity > 0 && m.used+n > m.capacity {
		return 0, errOOM
	}
	p := m.next
	m.next += uint64(n) + 256
	m.blocks[p] = n
	m.used += n
	m.allocs++
	return p, nil
}

func (m *mapMemory) free(p uint64) error {
	n, ok := m.blocks[p]
	if !ok {
		return fmt.Errorf("free of %#x", p)
	}
	delete(m.blocks, p)
	m.used -= n
	m.frees++
	return nil
}

func TestPoolReuseAndAccounting(t *testing.T) {
	mem := newMapMemory(0)
	p := newPool(mem)
	want := func(what string, reserved, cached, peak int64, hits, misses int) {
		t.Helper()
		s := p.stats()
		if s.reserved != reserved || s.cached != cached || s.peakReserved != peak || s.hits != hits || s.misses != misses {
			t.Fatalf("%s: %+v, want reserved %d cached %d peak %d hits %d misses %d", what, s, reserved, cached, peak, hits, misses)
		}
		if s.reserved != mem.used {
			t.Fatalf("%s: pool reserves %d, the device has %d allocated", what, s.reserved, mem.used)
		}
	}
	a, err := p.get(100)
	if err != nil || a == 0 {
		t.Fatal(a, err)
	}
	want("first block", 512, 0, 512, 0, 1)
	if err := p.put(a); err != nil {
		t.Fatal(err)
	}
	want("cached", 512, 512, 512, 0, 1)
	b, err := p.get(400) // rounds to the same 512: the cached block
	if err != nil || b != a {
		t.Fatalf("get(400) = %#x, %v; want the cached %#x", b, err, a)
	}
	want("reused", 512, 0, 512, 1, 1)
	c, err := p.get(513)
	if err != nil || c == a {
		t.Fatal(c, err)
	}
	want("second block", 512+1024, 0, 1536, 1, 2)
	if z, err := p.get(0); z != 0 || err != nil {
		t.Fatalf("get(0) = %#x, %v", z, err)
	}
	if err := p.put(0); err != nil {
		t.Fatalf("put(0): %v", err)
	}
	if err := p.put(c); err != nil {
		t.Fatal(err)
	}
	if err := p.put(c); err == nil || !strings.Contains(err.Error(), "took back") {
		t.Fatalf("double put: %v", err)
	}
	if err := p.put(0xdead); err == nil {
		t.Fatal("put of an unknown block accepted")
	}
	if _, err := p.get(-1); err == nil {
		t.Fatal("negative size accepted")
	}
	want("after frees", 1536, 1024, 1536, 1, 2)
	if err := p.put(b); err != nil {
		t.Fatal(err)
	}
	if err := p.trim(); err != nil {
		t.Fatal(err)
	}
	want("trimmed", 0, 0, 0, 1, 2)
	if mem.allocs != mem.frees {
		t.Fatalf("%d device allocations, %d frees", mem.allocs, mem.frees)
	}
}

// TestPoolOutOfMemory: a failed allocation releases the cache and tries
// once more; with nothing cached it reports the device's error.
func TestPoolOutOfMemory(t *testing.T) {
	mem := newMapMemory(2048)
	p := newPool(mem)
	a, err := p.get(1024)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.put(a); err != nil {
		t.Fatal(err)
	}
	b, err := p.get(1536) // 1024 cached + 1536 > 2048: trim, retry
	if err != nil {
		t.Fatalf("allocation after releasing the cache: %v", err)
	}
	if s := p.stats(); s.reserved != 1536 || s.cached != 0 {
		t.Fatalf("after the retry: %+v", s)
	}
	if _, err := p.get(1024); !errors.Is(err, errOOM) {
		t.Fatalf("out of memory with an empty cache: %v", err)
	}
	if err := p.put(b); err != nil {
		t.Fatal(err)
	}
}

// TestAccountingMatchesCPU runs one sequence of allocator calls on the CPU
// backend and on the CUDA backend (fake device) and compares their counts
// after every step: the CUDA backend's memory figures are the CPU's.
func TestAccountingMatchesCPU(t *testing.T) {
	cpu := runtime.NewCPU(1)
	gpu, _ := newFakeBackend(t)
	type pair struct{ c, g runtime.Tensor }
	var live []pair
	step := func(what string) {
		t.Helper()
		if c, g := cpu.Stats(), gpu.Stats(); c != g {
			t.Fatalf("%s: cpu %+v, cuda %+v", what, c, g)
		}
	}
	alloc := func(shape []int, dt runtime.DType) pair {
		t.Helper()
		c, err1 := cpu.Alloc(shape, dt)
		g, err2 := gpu.Alloc(shape, dt)
		if err1 != nil || err2 != nil {
			t.Fatalf("alloc %v: %v, %v", shape, err1, err2)
		}
		step(fmt.Sprintf("alloc %v %v", shape, dt))
		return pair{c, g}
	}
	free := func(p pair) {
		t.Helper()
		if err1, err2 := cpu.Free(p.c), gpu.Free(p.g); err1 != nil || err2 != nil {
			t.Fatalf("free: %v, %v", err1, err2)
		}
		step("free")
	}
	shapes := [][]int{{2, 3, 5, 5}, {7}, {0, 4}, {1}, {8, 64, 56, 56}, {2, 3, 5, 5}, {}}
	for i, s := range shapes {
		dt := runtime.Float32
		if i%3 == 1 {
			dt = runtime.Int64
		}
		live = append(live, alloc(s, dt))
	}
	free(live[1])
	free(live[4])
	cpu.ResetPeak()
	gpu.ResetPeak()
	step("reset peak")
	live = append(live, alloc([]int{3, 3}, runtime.Float32))
	live = append(live, alloc([]int{8, 64, 56, 56}, runtime.Float32))
	for _, p := range []pair{live[0], live[2], live[3], live[5], live[6], live[7], live[8]} {
		free(p)
	}
	if s := gpu.Stats(); s.LiveBytes != 0 {
		t.Fatalf("all freed, %d bytes live", s.LiveBytes)
	}
}

// TestTensorErrors: the CUDA backend refuses what the CPU backend refuses.
func TestTensorErrors(t *testing.T) {
	gpu, _ := newFakeBackend(t)
	other, _ := newFakeBackend(t)
	x, err := gpu.Alloc([]int{2, 4}, runtime.Float32)
	if err != nil {
		t.Fatal(err)
	}
	v, err := gpu.View(x, []int{8})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gpu.View(x, []int{9}); err == nil {
		t.Error("view larger than its storage accepted")
	}
	if _, err := gpu.View(v, []int{2, 2}); err != nil {
		t.Errorf("view of a view: %v", err)
	}
	if err := gpu.Free(v); err == nil {
		t.Error("freeing a view accepted")
	}
	if _, err := gpu.Alloc([]int{-1, 3}, runtime.Float32); err == nil {
		t.Error("negative dimension accepted")
	}
	if _, err := gpu.Alloc([]int{1 << 40, 1 << 30}, runtime.Float32); err == nil {
		t.Error("overflowing shape accepted")
	}
	cpuT, _ := runtime.NewCPU(1).Alloc([]int{2}, runtime.Float32)
	if err := gpu.Free(cpuT); err == nil {
		t.Error("freeing a CPU tensor accepted")
	}
	if err := other.Upload(x, make([]float32, 8)); err == nil {
		t.Error("another backend's tensor accepted")
	}
	if err := gpu.Upload(x, make([]float32, 7)); err == nil {
		t.Error("upload of the wrong length accepted")
	}
	if err := gpu.Free(x); err != nil {
		t.Fatal(err)
	}
	if err := gpu.Free(x); err == nil {
		t.Error("double free accepted")
	}
	if err := gpu.Upload(v, make([]float32, 8)); err == nil {
		t.Error("upload into a view of a freed tensor accepted")
	}
	if err := gpu.Download(x, make([]float32, 8)); err == nil {
		t.Error("download of a freed tensor accepted")
	}
}

// TestTransfers round-trips float32 and int64 tensors through device
// memory.
func TestTransfers(t *testing.T) {
	gpu, _ := newFakeBackend(t)
	src := []float32{1.5, -2, 3, 0, 1e-30, -7}
	f, _ := gpu.Alloc([]int{2, 3}, runtime.Float32)
	i, _ := gpu.Alloc([]int{6}, runtime.Int64)
	if err := gpu.Upload(f, src); err != nil {
		t.Fatal(err)
	}
	if err := gpu.Upload(i, src); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, 6)
	if err := gpu.Download(f, got); err != nil {
		t.Fatal(err)
	}
	for k := range src {
		if got[k] != src[k] {
			t.Fatalf("float32 round trip: %v, want %v", got, src)
		}
	}
	if err := gpu.Download(i, got); err != nil {
		t.Fatal(err)
	}
	for k, want := range []float32{1, -2, 3, 0, 0, -7} { // truncated as int64(x)
		if got[k] != want {
			t.Fatalf("int64 round trip: %v", got)
		}
	}
	empty, _ := gpu.Alloc([]int{0, 3}, runtime.Float32)
	if err := gpu.Upload(empty, nil); err != nil {
		t.Fatalf("empty upload: %v", err)
	}
}

// TestMemCheck: the backend's own count against the (fake) driver's.
func TestMemCheck(t *testing.T) {
	gpu, dev := newFakeBackend(t)
	x, _ := gpu.Alloc([]int{1000}, runtime.Float32)
	y, _ := gpu.Alloc([]int{10}, runtime.Int64)
	m, err := gpu.MemCheck()
	if err != nil {
		t.Fatal(err)
	}
	if m.LiveBytes != 4080 || m.ReservedBytes != 4096+512 || m.DriverDelta() != dev.used || m.DriverDelta() != m.ReservedBytes {
		t.Fatalf("%+v (driver delta %d, device used %d)", m, m.DriverDelta(), dev.used)
	}
	gpu.Free(x)
	gpu.Free(y)
	if err := gpu.TrimCache(); err != nil {
		t.Fatal(err)
	}
	m, _ = gpu.MemCheck()
	if m.LiveBytes != 0 || m.ReservedBytes != 0 || m.DriverDelta() != 0 || m.PeakReservedBytes != 0 {
		t.Fatalf("after freeing and trimming: %+v", m)
	}
}
