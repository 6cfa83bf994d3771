package runtime

import (
	"fmt"
	"math"
	goruntime "runtime"
	"sync"
)

// NewCPU returns the pure-Go CPU backend: float32 tensors in Go memory,
// statistics accumulated in float64, work split over threads goroutines
// (over images, channels or rows; threads <= 0 means GOMAXPROCS).
// Convolutions are im2col followed by the package's blocked GEMM.
func NewCPU(threads int) Backend {
	if threads <= 0 {
		threads = goruntime.GOMAXPROCS(0)
	}
	return &cpu{threads: threads}
}

type cpu struct {
	counter
	threads int
	// mu guards the counter and the pools: the executor allocates from one
	// goroutine, but a backend may serve several executors.
	mu sync.Mutex
	// Freed buffers are kept by length and handed out again: a training
	// loop allocates the same sizes every step, and reusing them spares
	// the garbage collector and the zeroing of fresh memory. The pools
	// hold at most as many bytes as the peak of live ones, so the process
	// never holds more than twice the measured peak. Pooling changes
	// nothing in the counts: they are of live tensors.
	floatPool map[int][][]float32
	intPool   map[int][][]int64
	pooled    int64
}

type cpuTensor struct {
	shape []int
	dt    DType
	f     []float32
	i     []int64
	// h holds BFloat16 and Float16 data. Ops compute on a float32 copy
	// (see floats) that is scratch space, like im2col buffers.
	h     []uint16
	root  *cpuTensor // nil for an allocation
	freed bool
}

func (t *cpuTensor) Shape() []int { return t.shape }
func (t *cpuTensor) DType() DType { return t.dt }

func (*cpu) Name() string   { return "cpu" }
func (*cpu) Executes() bool { return true }

func (c *cpu) Alloc(shape []int, dt DType) (Tensor, error) {
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	n := numel(shape)
	t := &cpuTensor{shape: append([]int(nil), shape...), dt: dt}
	size := int64(n) * dt.Size()
	if dt.Is16() {
		// Not pooled: only the Options.Half runs, small ones, use them.
		t.h = make([]uint16, n)
		c.mu.Lock()
		c.add(size)
		c.mu.Unlock()
		return t, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if dt == Int64 {
		if l := c.intPool[n]; len(l) > 0 {
			t.i, c.intPool[n] = l[len(l)-1], l[:len(l)-1]
			c.pooled -= size
		} else {
			t.i = make([]int64, n)
		}
	} else {
		if l := c.floatPool[n]; len(l) > 0 {
			t.f, c.floatPool[n] = l[len(l)-1], l[:len(l)-1]
			c.pooled -= size
		} else {
			t.f = make([]float32, n)
		}
	}
	c.add(size)
	return t, nil
}

// adopter is a backend that can make a float32 tensor of a slice itself,
// without allocating and copying (the CPU backend, for parameters).
type adopter interface {
	adopt(shape []int, v []float32) (Tensor, error)
}

// adopt makes a float32 tensor whose storage is v, which the caller gives
// up (a parameter's values, computed into a fresh slice): Alloc and Upload
// allocated, zeroed and filled a second copy of every parameter, 553 MB
// for vgg16_bn, for each network verify builds.
func (c *cpu) adopt(shape []int, v []float32) (Tensor, error) {
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	if len(v) != numel(shape) {
		return nil, fmt.Errorf("cpu: %d values for shape %v", len(v), shape)
	}
	t := &cpuTensor{shape: append([]int(nil), shape...), dt: Float32, f: v}
	c.mu.Lock()
	c.add(int64(len(v)) * 4)
	c.mu.Unlock()
	return t, nil
}

func (c *cpu) View(t Tensor, shape []int) (Tensor, error) {
	ct, err := c.get(t)
	if err != nil {
		return nil, err
	}
	root := ct
	if ct.root != nil {
		root = ct.root
	}
	n := numel(shape)
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	if n > numel(root.shape) {
		return nil, fmt.Errorf("cpu: view %v is larger than its storage %v", shape, root.shape)
	}
	v := &cpuTensor{shape: append([]int(nil), shape...), dt: root.dt, root: root}
	switch {
	case root.dt == Int64:
		v.i = root.i[:n]
	case root.dt.Is16():
		v.h = root.h[:n]
	default:
		v.f = root.f[:n]
	}
	return v, nil
}

func (c *cpu) Free(t Tensor) error {
	ct, ok := t.(*cpuTensor)
	if !ok {
		return fmt.Errorf("cpu: foreign tensor %T", t)
	}
	if ct.root != nil {
		return fmt.Errorf("cpu: freeing a view")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if ct.freed {
		return fmt.Errorf("cpu: double free of a %v tensor", ct.shape)
	}
	ct.freed = true
	n := numel(ct.shape)
	size := int64(n) * ct.dt.Size()
	c.sub(size)
	if ct.h != nil {
		ct.h = nil
		return nil
	}
	if c.pooled+size <= c.peakEver {
		if c.floatPool == nil {
			c.floatPool, c.intPool = map[int][][]float32{}, map[int][][]int64{}
		}
		if ct.f != nil {
			c.floatPool[n] = append(c.floatPool[n], ct.f)
		} else {
			c.intPool[n] = append(c.intPool[n], ct.i)
		}
		c.pooled += size
	}
	ct.f, ct.i = nil, nil
	return nil
}

func (c *cpu) Stats() AllocStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.counter.Stats()
}

func (c *cpu) ResetPeak() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.counter.ResetPeak()
}

// get checks that t is a live tensor of this backend.
func (c *cpu) get(t Tensor) (*cpuTensor, error) {
	ct, ok := t.(*cpuTensor)
	if !ok || ct == nil {
		return nil, fmt.Errorf("cpu: foreign or nil tensor %T", t)
	}
	if ct.freed || (ct.root != nil && ct.root.freed) {
		return nil, fmt.Errorf("cpu: use of a freed %v tensor", ct.shape)
	}
	return ct, nil
}

// floats returns the float32 data of tensors, all of which must be live
// float tensors of this backend; nil tensors give nil slices. A 16-bit
// tensor is decoded into a float32 copy (one per storage, which views
// share), and done writes every such copy back, rounded: every op calls
// done when it has finished writing, so that its outputs may be 16-bit
// while it computes in float32. Inputs survive the round trip unchanged,
// since a decoded 16-bit value encodes to itself. done is never nil.
func (c *cpu) floats(ts ...Tensor) (f [][]float32, done func(), err error) {
	out := make([][]float32, len(ts))
	var decoded map[*cpuTensor][]float32
	done = func() {
		for root, v := range decoded {
			encode16(root.dt, root.h, v)
		}
		decoded = nil
	}
	for k, t := range ts {
		if t == nil {
			continue
		}
		ct, err := c.get(t)
		if err != nil {
			done()
			return nil, func() {}, err
		}
		switch {
		case ct.dt == Float32:
			out[k] = ct.f
		case ct.dt.Is16():
			root := ct
			if ct.root != nil {
				root = ct.root
			}
			v, ok := decoded[root]
			if !ok {
				if decoded == nil {
					decoded = map[*cpuTensor][]float32{}
				}
				v = make([]float32, len(root.h))
				decode16(root.dt, v, root.h)
				decoded[root] = v
			}
			out[k] = v[:len(ct.h)]
		default:
			done()
			return nil, func() {}, fmt.Errorf("cpu: %v tensor where a float one is needed", ct.dt)
		}
	}
	return out, done, nil
}

func (c *cpu) Upload(dst Tensor, src []float32) error {
	ct, err := c.get(dst)
	if err != nil {
		return err
	}
	if len(src) != numel(ct.shape) {
		return fmt.Errorf("cpu: upload of %d values into %v", len(src), ct.shape)
	}
	switch {
	case ct.dt == Int64:
		for k, v := range src {
			ct.i[k] = int64(v)
		}
	case ct.dt.Is16():
		encode16(ct.dt, ct.h, src)
	default:
		copy(ct.f, src)
	}
	return nil
}

func (c *cpu) Download(src Tensor, dst []float32) error {
	ct, err := c.get(src)
	if err != nil {
		return err
	}
	if len(dst) != numel(ct.shape) {
		return fmt.Errorf("cpu: download of %v into %d values", ct.shape, len(dst))
	}
	switch {
	case ct.dt == Int64:
		for k, v := range ct.i {
			dst[k] = float32(v)
		}
	case ct.dt.Is16():
		decode16(ct.dt, dst, ct.h)
	default:
		copy(dst, ct.f)
	}
	return nil
}

// parallel runs fn over [0, n) split into at most c.threads contiguous
// ranges; work is the rough cost of the whole, below which one goroutine
// does it all.
func (c *cpu) parallel(n int, work int, fn func(lo, hi int)) {
	t := c.threads
	if t > n {
		t = n
	}
	if t <= 1 || work < 1<<15 {
		fn(0, n)
		return
	}
	var wg sync.WaitGroup
	for k := 0; k < t; k++ {
		lo, hi := n*k/t, n*(k+1)/t
		if lo == hi {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(lo, hi)
		}()
	}
	wg.Wait()
}

// sameLen checks that slices have equal length.
func sameLen(op string, vs ...[]float32) error {
	for _, v := range vs[1:] {
		if len(v) != len(vs[0]) {
			return fmt.Errorf("cpu: %s: %d and %d elements", op, len(vs[0]), len(v))
		}
	}
	return nil
}

func (c *cpu) Copy(dst, src Tensor) error {
	f, done, err := c.floats(dst, src)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("copy", f...); err != nil {
		return err
	}
	copy(f[0], f[1])
	return nil
}

func (c *cpu) Sum(dst Tensor, srcs ...Tensor) error {
	f, done, err := c.floats(append([]Tensor{dst}, srcs...)...)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("sum", f...); err != nil {
		return err
	}
	d := f[0]
	c.parallel(len(d), len(d)*len(srcs), func(lo, hi int) {
		if len(f) >= 3 {
			// One pass for the first two (a residual add).
			dd, a, b := d[lo:hi], f[1][lo:hi], f[2][lo:hi]
			for k := range dd {
				dd[k] = a[k] + b[k]
			}
		} else {
			copy(d[lo:hi], f[1][lo:hi])
		}
		for _, s := range f[min(3, len(f)):] {
			s := s[lo:hi]
			dd := d[lo:hi]
			for k := range dd {
				dd[k] += s[k]
			}
		}
	})
	return nil
}

func (c *cpu) Accumulate(dst, src Tensor) error {
	f, done, err := c.floats(dst, src)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("accumulate", f...); err != nil {
		return err
	}
	d, s := f[0], f[1]
	c.parallel(len(d), len(d), func(lo, hi int) {
		dd, ss := d[lo:hi], s[lo:hi]
		for k := range dd {
			dd[k] += ss[k]
		}
	})
	return nil
}

func (c *cpu) Mul(dst, a, b Tensor) error {
	f, done, err := c.floats(dst, a, b)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("mul", f...); err != nil {
		return err
	}
	d, x, y := f[0], f[1], f[2]
	c.parallel(len(d), len(d), func(lo, hi int) {
		for k := lo; k < hi; k++ {
			d[k] = x[k] * y[k]
		}
	})
	return nil
}

func (c *cpu) Activation(dst, src Tensor, act Act) error {
	f, done, err := c.floats(dst, src)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("activation", f...); err != nil {
		return err
	}
	d, s := f[0], f[1]
	c.parallel(len(d), len(d), func(lo, hi int) { activate(d[lo:hi], s[lo:hi], act) })
	return nil
}

// activate applies act elementwise with PyTorch's branch conventions. The
// ReLU and leaky-ReLU loops are branch-free: on activations, whose signs are
// a coin toss, a branch per element costs several times the arithmetic.
func activate(d, s []float32, act Act) {
	d = d[:len(s)]
	switch act.Kind {
	case ActReLU:
		for k, v := range s {
			d[k] = max(v, 0) // NaN stays NaN, as in PyTorch
		}
	case ActLeakyReLU:
		a := float32(act.Param)
		for k, v := range s {
			// Pick v*a where v's sign bit is set (-0 gives -0, as
			// PyTorch's v > 0 ? v : v*a does).
			u := math.Float32bits(v)
			m := uint32(int32(u) >> 31)
			d[k] = math.Float32frombits(u&^m | math.Float32bits(v*a)&m)
		}
	case ActELU:
		a := act.Param
		for k, v := range s {
			if v > 0 {
				d[k] = v
			} else {
				d[k] = float32(a * math.Expm1(float64(v)))
			}
		}
	case ActHardtanh, ActSigmoid, ActSiLU, ActHardsigmoid, ActHardswish, ActGELU, ActTanh, ActSELU, ActCELU, ActSoftplus, ActMish:
		activateSmooth(d, s, act)
	default:
		copy(d, s)
	}
}

func (c *cpu) ActivationBackward(dx, dy, saved Tensor, act Act, fromOutput bool) error {
	f, done, err := c.floats(dx, dy, saved)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("activation backward", f...); err != nil {
		return err
	}
	d, g, s := f[0], f[1], f[2]
	c.parallel(len(d), len(d), func(lo, hi int) { activateBackward(d[lo:hi], g[lo:hi], s[lo:hi], act, fromOutput) })
	return nil
}

// activateBackward writes d = g * act'(x), where s is the activation's input
// x or, when fromOutput, its output. d may be g.
func activateBackward(d, g, s []float32, act Act, fromOutput bool) {
	d, g = d[:len(s)], g[:len(s)]
	switch act.Kind {
	case ActReLU:
		for k, v := range s {
			d[k] = math.Float32frombits(math.Float32bits(g[k]) &^ notPositive(v))
		}
	case ActLeakyReLU:
		a := float32(act.Param)
		for k, v := range s {
			m := notPositive(v)
			d[k] = math.Float32frombits(math.Float32bits(g[k])&^m | math.Float32bits(g[k]*a)&m)
		}
	case ActELU:
		a := act.Param
		for k, v := range s {
			switch {
			case v > 0:
				d[k] = g[k]
			case fromOutput:
				d[k] = g[k] * float32(float64(v)+a)
			default:
				d[k] = g[k] * float32(a*math.Exp(float64(v)))
			}
		}
	case ActHardtanh, ActSigmoid, ActSiLU, ActHardsigmoid, ActHardswish, ActGELU, ActTanh, ActSELU, ActCELU, ActSoftplus, ActMish:
		activateSmoothBackward(d, g, s, act)
	default:
		copy(d, g)
	}
}

// notPositive is all ones when v <= 0 (either zero, or the sign bit set)
// and zero when v > 0, without a branch.
func notPositive(v float32) uint32 {
	u := int32(math.Float32bits(v))
	return uint32((u | (u - 1)) >> 31)
}

func (c *cpu) DropoutMask(mask Tensor, p float64, seed uint64) error {
	f, done, err := c.floats(mask)
	defer done()
	if err != nil {
		return err
	}
	m := f[0]
	scale := float32(0)
	if p < 1 {
		scale = float32(1 / (1 - p))
	}
	c.parallel(len(m), len(m)*8, func(lo, hi int) {
		for k := lo; k < hi; k++ {
			if p < 1 && DropoutKeep(seed, k, p) {
				m[k] = scale
			} else {
				m[k] = 0
			}
		}
	})
	return nil
}

// planes returns n (the leading dimension) and the per-item size of a
// channel-sliced tensor: the element count per channel (H*W) and the
// channel count.
func planes(shape []int) (n, c, hw int) {
	n, c, hw = shape[0], 1, 1
	if len(shape) > 1 {
		c = shape[1]
	}
	for _, d := range shape[2:] {
		hw *= d
	}
	return n, c, hw
}

func (c *cpu) Concat(dst Tensor, srcs ...Tensor) error {
	return c.concat(dst, srcs, true)
}

func (c *cpu) Split(src Tensor, dsts ...Tensor) error {
	return c.concat(src, dsts, false)
}

// concat copies parts into whole (join) or whole into parts, along
// dimension 1.
func (c *cpu) concat(whole Tensor, parts []Tensor, join bool) error {
	f, done, err := c.floats(append([]Tensor{whole}, parts...)...)
	defer done()
	if err != nil {
		return err
	}
	n, cw, hw := planes(whole.Shape())
	total := 0
	for _, p := range parts {
		pn, pc, phw := planes(p.Shape())
		if pn != n || phw != hw {
			return fmt.Errorf("cpu: concat: part %v does not fit %v", p.Shape(), whole.Shape())
		}
		total += pc
	}
	if total != cw {
		return fmt.Errorf("cpu: concat: parts have %d channels, the whole %d", total, cw)
	}
	w := f[0]
	c.parallel(n, len(w), func(lo, hi int) {
		for i := lo; i < hi; i++ {
			off := i * cw * hw
			for k, p := range parts {
				_, pc, _ := planes(p.Shape())
				sz := pc * hw
				ps := f[k+1][i*sz : (i+1)*sz]
				if join {
					copy(w[off:off+sz], ps)
				} else {
					copy(ps, w[off:off+sz])
				}
				off += sz
			}
		}
	})
	return nil
}
