package cuda

import (
	"fmt"
	"sync"
	"testing"
)

// fakeDevice is a device without a GPU: memory is host memory at made-up
// addresses, so that uploads and downloads round-trip, and kernels are
// not run but checked and recorded. Every launch must name a kernel of the
// embedded PTX, pass as many arguments as its entry declares, of the
// declared types (checked once against the PTX in TestKernelSpecsMatchPTX;
// the backend's launcher checks each call against the spec), point every
// non-null pointer argument into a live allocation, and stay within the
// driver's grid limits.
type fakeDevice struct {
	t        testing.TB
	sms      int
	mu       sync.Mutex
	next     uint64
	blocks   map[uint64][]byte
	capacity int64 // bytes; 0 is unlimited
	used     int64
	launches []fakeLaunch
	counts   map[string]int
	fails    int // alloc calls that failed
}

type fakeLaunch struct {
	kernel string
	dims   launchDims
	args   []uint64
}

func newFakeDevice(t testing.TB) *fakeDevice {
	return &fakeDevice{t: t, sms: 4, next: 1 << 32, blocks: map[uint64][]byte{}, counts: map[string]int{}}
}

func (f *fakeDevice) props() deviceProps {
	return deviceProps{name: "fake", sms: f.sms, cc: [2]int{9, 0}}
}

func (f *fakeDevice) alloc(bytes int64) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if bytes <= 0 {
		return 0, fmt.Errorf("fake: alloc of %d bytes", bytes)
	}
	if f.capacity > 0 && f.used+bytes > f.capacity {
		f.fails++
		return 0, fmt.Errorf("fake: out of memory (%d of %d used, %d asked)", f.used, f.capacity, bytes)
	}
	p := f.next
	// 256-byte aligned, with a gap so that an address one past a block
	// is not inside the next.
	f.next += uint64((bytes+255)/256*256) + 256
	f.blocks[p] = make([]byte, bytes)
	f.used += bytes
	return p, nil
}

func (f *fakeDevice) free(ptr uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, ok := f.blocks[ptr]
	if !ok {
		return fmt.Errorf("fake: free of %#x, not allocated", ptr)
	}
	f.used -= int64(len(b))
	delete(f.blocks, ptr)
	return nil
}

func (f *fakeDevice) memInfo() (int64, int64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	total := f.capacity
	if total == 0 {
		total = 1 << 40
	}
	return total - f.used, total, nil
}

// find returns the block holding [p, p+n) and p's offset in it.
func (f *fakeDevice) find(p uint64, n int64) ([]byte, int64, error) {
	for base, b := range f.blocks {
		if p >= base && p+uint64(n) <= base+uint64(len(b)) {
			return b, int64(p - base), nil
		}
	}
	return nil, 0, fmt.Errorf("fake: [%#x, +%d) is not inside a live allocation", p, n)
}

func (f *fakeDevice) upload(dst uint64, src []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, off, err := f.find(dst, int64(len(src)))
	if err != nil {
		return err
	}
	copy(b[off:], src)
	return nil
}

func (f *fakeDevice) download(dst []byte, src uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, off, err := f.find(src, int64(len(dst)))
	if err != nil {
		return err
	}
	copy(dst, b[off:])
	return nil
}

func (f *fakeDevice) copy(dst, src uint64, n int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, do, err := f.find(dst, n)
	if err != nil {
		return err
	}
	s, so, err := f.find(src, n)
	if err != nil {
		return err
	}
	copy(d[do:do+n], s[so:so+n])
	return nil
}

func (f *fakeDevice) memset32(dst uint64, v uint32, n int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, off, err := f.find(dst, n*4)
	if err != nil {
		return err
	}
	for i := int64(0); i < n; i++ {
		p := d[off+4*i:]
		p[0], p[1], p[2], p[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	}
	return nil
}

func (f *fakeDevice) launch(k kernelID, d launchDims, args []uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if k < 0 || k >= numKernels {
		return fmt.Errorf("fake: unknown kernel %d", k)
	}
	spec := kernelSpecs[k]
	if err := d.validate(); err != nil {
		return fmt.Errorf("fake: %s: %w", spec.name, err)
	}
	if len(args) != len(spec.params) {
		return fmt.Errorf("fake: %s: %d arguments for %d parameters", spec.name, len(args), len(spec.params))
	}
	for i, c := range []byte(spec.params) {
		if c != 'p' || args[i] == 0 {
			continue
		}
		if _, _, err := f.find(args[i], 1); err != nil {
			return fmt.Errorf("fake: %s: argument %d: %w", spec.name, i, err)
		}
	}
	f.launches = append(f.launches, fakeLaunch{kernel: spec.name, dims: d, args: append([]uint64(nil), args...)})
	f.counts[spec.name]++
	return nil
}

func (f *fakeDevice) sync() error { return nil }

// names returns the kernels launched since the last reset, in order.
func (f *fakeDevice) names() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, len(f.launches))
	for i, l := range f.launches {
		out[i] = l.kernel
	}
	return out
}

func (f *fakeDevice) reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.launches = nil
}

// launched is every kernel any fake device of the test binary launched,
// for TestEveryKernelLaunched.
var launched = struct {
	sync.Mutex
	m map[string]bool
}{m: map[string]bool{}}

func (f *fakeDevice) record() {
	f.mu.Lock()
	defer f.mu.Unlock()
	launched.Lock()
	defer launched.Unlock()
	for k := range f.counts {
		launched.m[k] = true
	}
}

// newFakeBackend returns a backend over a fresh fake device; the device's
// launches are added to the binary's record when the test ends.
func newFakeBackend(t testing.TB) (*Backend, *fakeDevice) {
	f := newFakeDevice(t)
	t.Cleanup(f.record)
	return newBackend(f, newPool(f), 0), f
}
