package cuda

import (
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/abnconvert/abnconvert/runtime"
)

// Backend is the CUDA implementation of runtime.Backend. Every Backend on a
// device shares its caching pool and stream; each keeps its own count of
// live tensors (Stats), as separate CPU backends do. A Backend serves one
// executor at a time, like the CPU backend.
type Backend struct {
	dev  device
	pool *pool
	sms  int

	mu sync.Mutex
	counter
	// scratch holds per-op device buffers (partial sums, coefficients,
	// im2col columns) between ops, grown on demand. Like the CPU backend's
	// scratch, it is not counted in Stats; it is in the pool's reserved
	// bytes.
	scratch [numScratch]scratchBuf
	// baseline is the driver's used-memory figure when the device was
	// opened (see MemCheck).
	baseline int64
}

type scratchSlot int

const (
	scrPartial scratchSlot = iota // reduction partials (doubles)
	scrCoef                       // per-channel coefficients (float4)
	scrCol                        // im2col columns
	scrGemm                       // per-image GEMM products
	numScratch
)

type scratchBuf struct {
	ptr   uint64
	bytes int64
}

// newBackend makes a backend on dev, allocating through p.
func newBackend(dev device, p *pool, baseline int64) *Backend {
	return &Backend{dev: dev, pool: p, sms: max(dev.props().sms, 1), baseline: baseline}
}

var _ runtime.Backend = (*Backend)(nil)

type tensor struct {
	shape []int
	dt    runtime.DType
	ptr   uint64
	root  *tensor // nil for an allocation
	owner *Backend
	freed bool
}

func (t *tensor) Shape() []int         { return t.shape }
func (t *tensor) DType() runtime.DType { return t.dt }

func (t *tensor) numel() int64 { return numel(t.shape) }

// at is the device address of element i.
func (t *tensor) at(i int64) uint64 { return t.ptr + uint64(i)*uint64(t.dt.Size()) }

func numel(shape []int) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= int64(d)
	}
	return n
}

func (*Backend) Name() string   { return "cuda" }
func (*Backend) Executes() bool { return true }

func checkShape(shape []int) error {
	n := int64(1)
	for _, d := range shape {
		if d < 0 {
			return fmt.Errorf("cuda: negative dimension in shape %v", shape)
		}
		if d > 0 && n > math.MaxInt64/8/int64(d) {
			return fmt.Errorf("cuda: shape %v is too large", shape)
		}
		n *= int64(d)
	}
	return nil
}

func (b *Backend) Alloc(shape []int, dt runtime.DType) (runtime.Tensor, error) {
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	if dt != runtime.Float32 && dt != runtime.Int64 {
		return nil, fmt.Errorf("cuda: allocation of unknown type %v", dt)
	}
	size := numel(shape) * dt.Size()
	ptr, err := b.pool.get(size)
	if err != nil {
		return nil, fmt.Errorf("cuda: tensor %v %v: %w", shape, dt, err)
	}
	b.mu.Lock()
	b.add(size)
	b.mu.Unlock()
	return &tensor{shape: append([]int(nil), shape...), dt: dt, ptr: ptr, owner: b}, nil
}

func (b *Backend) View(t runtime.Tensor, shape []int) (runtime.Tensor, error) {
	ct, err := b.get(t)
	if err != nil {
		return nil, err
	}
	root := ct
	if ct.root != nil {
		root = ct.root
	}
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	if numel(shape) > root.numel() {
		return nil, fmt.Errorf("cuda: view %v is larger than its storage %v", shape, root.shape)
	}
	return &tensor{shape: append([]int(nil), shape...), dt: root.dt, ptr: root.ptr, root: root, owner: b}, nil
}

func (b *Backend) Free(t runtime.Tensor) error {
	ct, ok := t.(*tensor)
	if !ok || ct == nil || ct.owner != b {
		return fmt.Errorf("cuda: freeing a foreign tensor %T", t)
	}
	if ct.root != nil {
		return fmt.Errorf("cuda: freeing a view")
	}
	b.mu.Lock()
	if ct.freed {
		b.mu.Unlock()
		return fmt.Errorf("cuda: double free of a %v tensor", ct.shape)
	}
	ct.freed = true
	b.sub(ct.numel() * ct.dt.Size())
	b.mu.Unlock()
	return b.pool.put(ct.ptr)
}

func (b *Backend) Stats() runtime.AllocStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return runtime.AllocStats{LiveBytes: b.live, PeakBytes: b.peak, Allocs: b.allocs}
}

func (b *Backend) ResetPeak() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.peak = b.live
}

// Close gives the backend's scratch buffers back to the pool. Tensors are
// the executor's to free.
func (b *Backend) Close() error {
	var first error
	for i := range b.scratch {
		if err := b.pool.put(b.scratch[i].ptr); err != nil && first == nil {
			first = err
		}
		b.scratch[i] = scratchBuf{}
	}
	return first
}

// get checks that t is a live tensor of this backend.
func (b *Backend) get(t runtime.Tensor) (*tensor, error) {
	ct, ok := t.(*tensor)
	if !ok || ct == nil {
		return nil, fmt.Errorf("cuda: foreign or nil tensor %T", t)
	}
	if ct.owner != b {
		return nil, fmt.Errorf("cuda: tensor %v belongs to another backend", ct.shape)
	}
	if ct.freed || (ct.root != nil && ct.root.freed) {
		return nil, fmt.Errorf("cuda: use of a freed %v tensor", ct.shape)
	}
	return ct, nil
}

// floats returns the tensors, all of which must be live Float32 tensors of
// this backend; nil stays nil.
func (b *Backend) floats(ts ...runtime.Tensor) ([]*tensor, error) {
	out := make([]*tensor, len(ts))
	for k, t := range ts {
		if t == nil {
			continue
		}
		ct, err := b.get(t)
		if err != nil {
			return nil, err
		}
		if ct.dt != runtime.Float32 {
			return nil, fmt.Errorf("cuda: %v tensor where float32 is needed", ct.dt)
		}
		out[k] = ct
	}
	return out, nil
}

func (b *Backend) Upload(dst runtime.Tensor, src []float32) error {
	ct, err := b.get(dst)
	if err != nil {
		return err
	}
	if int64(len(src)) != ct.numel() {
		return fmt.Errorf("cuda: upload of %d values into %v", len(src), ct.shape)
	}
	if len(src) == 0 {
		return nil
	}
	if ct.dt == runtime.Int64 {
		v := make([]int64, len(src))
		for k, x := range src {
			v[k] = int64(x)
		}
		return b.dev.upload(ct.ptr, unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), len(v)*8))
	}
	return b.dev.upload(ct.ptr, unsafe.Slice((*byte)(unsafe.Pointer(&src[0])), len(src)*4))
}

func (b *Backend) Download(src runtime.Tensor, dst []float32) error {
	ct, err := b.get(src)
	if err != nil {
		return err
	}
	if int64(len(dst)) != ct.numel() {
		return fmt.Errorf("cuda: download of %v into %d values", ct.shape, len(dst))
	}
	if len(dst) == 0 {
		return nil
	}
	if ct.dt == runtime.Int64 {
		v := make([]int64, len(dst))
		if err := b.dev.download(unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), len(v)*8), ct.ptr); err != nil {
			return err
		}
		for k, x := range v {
			dst[k] = float32(x)
		}
		return nil
	}
	return b.dev.download(unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), len(dst)*4), ct.ptr)
}

// getScratch returns scratch buffer slot of at least bytes.
func (b *Backend) getScratch(slot scratchSlot, bytes int64) (uint64, error) {
	s := &b.scratch[slot]
	if s.bytes >= bytes && s.ptr != 0 {
		return s.ptr, nil
	}
	// Work already queued on the old buffer runs before anything queued
	// on the block that replaces it: one stream orders them.
	if err := b.pool.put(s.ptr); err != nil {
		return 0, err
	}
	*s = scratchBuf{}
	ptr, err := b.pool.get(bytes)
	if err != nil {
		return 0, fmt.Errorf("cuda: scratch space: %w", err)
	}
	*s = scratchBuf{ptr: ptr, bytes: bytes}
	return ptr, nil
}

// arg is one kernel argument: its kind (a kernelSpec letter) and its value
// widened to 64 bits, as cuLaunchKernel reads it from the low bytes.
type arg struct {
	kind byte
	bits uint64
	bad  string // why the value does not fit its kind
}

func ptr(p uint64) arg { return arg{kind: 'p', bits: p} }

// tp is a tensor's address, or null for a nil tensor.
func tp(t *tensor) arg {
	if t == nil {
		return ptr(0)
	}
	return ptr(t.ptr)
}

func i32(v int) arg {
	if v < math.MinInt32 || v > math.MaxInt32 {
		return arg{kind: 'i', bad: fmt.Sprintf("%d does not fit 32 bits", v)}
	}
	return arg{kind: 'i', bits: uint64(uint32(int32(v)))}
}

func u32(v uint32) arg  { return arg{kind: 'i', bits: uint64(v)} }
func i64(v int64) arg   { return arg{kind: 'l', bits: uint64(v)} }
func u64(v uint64) arg  { return arg{kind: 'l', bits: v} }
func f32(v float32) arg { return arg{kind: 'f', bits: uint64(math.Float32bits(v))} }
func f64(v float64) arg { return arg{kind: 'd', bits: math.Float64bits(v)} }
func boolArg(v bool) arg {
	if v {
		return i32(1)
	}
	return i32(0)
}

// launch checks the arguments against the kernel's spec and the geometry
// against the driver's limits, then queues the kernel.
func (b *Backend) launch(k kernelID, d launchDims, args ...arg) error {
	if k < 0 || k >= numKernels {
		return fmt.Errorf("cuda: unknown kernel %d", int(k))
	}
	spec := kernelSpecs[k].params
	if len(args) != len(spec) {
		return fmt.Errorf("cuda: %s: %d arguments, the kernel takes %d", k, len(args), len(spec))
	}
	vals := make([]uint64, len(args))
	for i, a := range args {
		if a.kind != spec[i] {
			return fmt.Errorf("cuda: %s: argument %d is of kind %c, the kernel takes %c", k, i, a.kind, spec[i])
		}
		if a.bad != "" {
			return fmt.Errorf("cuda: %s: argument %d: %s", k, i, a.bad)
		}
		vals[i] = a.bits
	}
	if err := d.validate(); err != nil {
		return fmt.Errorf("cuda: %s: %w", k, err)
	}
	if err := b.dev.launch(k, d, vals); err != nil {
		return fmt.Errorf("cuda: %s: %w", k, err)
	}
	return nil
}

// Sync waits for the queued work and returns its first error.
func (b *Backend) Sync() error { return b.dev.sync() }

// MemCheck compares the backend's own count of device memory with the
// driver's free-memory figure.
type MemCheck struct {
	// LiveBytes and PeakBytes are this backend's tensors, as Stats
	// reports them (the runtime's memory measurement).
	LiveBytes int64 `json:"live_bytes"`
	PeakBytes int64 `json:"peak_bytes"`
	// ReservedBytes is what the device's caching pool holds from the
	// driver: the live tensors of every backend on the device, rounded up
	// to 512 bytes each, their scratch buffers and the cached free blocks
	// (CachedBytes). PeakReservedBytes is its peak since the device was
	// opened.
	ReservedBytes     int64 `json:"reserved_bytes"`
	PeakReservedBytes int64 `json:"peak_reserved_bytes"`
	CachedBytes       int64 `json:"cached_bytes"`
	// DriverUsedBytes is total minus free memory now, as the driver
	// reports it; DriverBaselineBytes was that figure when the device was
	// opened (the context, the loaded modules, other processes).
	DriverUsedBytes     int64 `json:"driver_used_bytes"`
	DriverBaselineBytes int64 `json:"driver_baseline_bytes"`
	DriverTotalBytes    int64 `json:"driver_total_bytes"`
}

// DriverDelta is what the driver says was taken since the device was
// opened; it should be ReservedBytes plus the driver's page rounding.
func (m MemCheck) DriverDelta() int64 { return m.DriverUsedBytes - m.DriverBaselineBytes }

// MemCheck reads the counts and the driver's figure (after the queued work
// has run).
func (b *Backend) MemCheck() (MemCheck, error) {
	if err := b.dev.sync(); err != nil {
		return MemCheck{}, err
	}
	free, total, err := b.dev.memInfo()
	if err != nil {
		return MemCheck{}, fmt.Errorf("cuda: driver memory figure: %w", err)
	}
	st := b.Stats()
	ps := b.pool.stats()
	return MemCheck{LiveBytes: st.LiveBytes, PeakBytes: st.PeakBytes,
		ReservedBytes: ps.reserved, PeakReservedBytes: ps.peakReserved, CachedBytes: ps.cached,
		DriverUsedBytes: total - free, DriverBaselineBytes: b.baseline, DriverTotalBytes: total}, nil
}

// DeviceMemory implements runtime.DeviceMemory from MemCheck.
func (b *Backend) DeviceMemory() (runtime.DeviceFigures, error) {
	m, err := b.MemCheck()
	if err != nil {
		return runtime.DeviceFigures{}, err
	}
	return runtime.DeviceFigures{LiveBytes: m.LiveBytes, ReservedBytes: m.ReservedBytes, PeakReservedBytes: m.PeakReservedBytes,
		DriverUsedBytes: m.DriverDelta(), TotalBytes: m.DriverTotalBytes}, nil
}

// TrimCache gives the cached free blocks of the device's pool back to the
// driver (so that DriverDelta tracks what is live) and restarts the peak
// of reserved bytes from what is left.
func (b *Backend) TrimCache() error { return b.pool.trim() }
