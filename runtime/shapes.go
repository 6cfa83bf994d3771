package runtime

import "fmt"

// NewShapes returns a backend that computes nothing: it allocates through a
// counting allocator and checks that every op's operands have the shapes the
// op needs. The executor runs the same plan on it as on a computing backend,
// so its memory figures are the same, in a fraction of the time.
func NewShapes() Backend { return &shapes{} }

type shapes struct {
	counter
}

type shapeTensor struct {
	shape []int
	dt    DType
	root  *shapeTensor // nil for an allocation
	freed bool
}

func (t *shapeTensor) Shape() []int { return t.shape }
func (t *shapeTensor) DType() DType { return t.dt }

func (*shapes) Name() string   { return "shapes" }
func (*shapes) Executes() bool { return false }

// counter is the byte count every backend's allocator keeps.
type counter struct {
	live, peak int64
	// peakEver is the peak since the backend was made (ResetPeak leaves
	// it).
	peakEver int64
	allocs   int
}

func (c *counter) add(n int64) {
	c.live += n
	c.allocs++
	c.peak = max(c.peak, c.live)
	c.peakEver = max(c.peakEver, c.live)
}

func (c *counter) sub(n int64) { c.live -= n }

func (c *counter) Stats() AllocStats {
	return AllocStats{LiveBytes: c.live, PeakBytes: c.peak, Allocs: c.allocs}
}

func (c *counter) ResetPeak() { c.peak = c.live }

func checkShape(shape []int) error {
	for _, d := range shape {
		if d < 0 {
			return fmt.Errorf("negative dimension in shape %v", shape)
		}
	}
	return nil
}

func (s *shapes) Alloc(shape []int, dt DType) (Tensor, error) {
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	t := &shapeTensor{shape: append([]int(nil), shape...), dt: dt}
	s.add(int64(numel(shape)) * dt.Size())
	return t, nil
}

func (s *shapes) View(t Tensor, shape []int) (Tensor, error) {
	st, ok := t.(*shapeTensor)
	if !ok {
		return nil, fmt.Errorf("shapes: foreign tensor %T", t)
	}
	root := st
	if st.root != nil {
		root = st.root
	}
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	if numel(shape) > numel(root.shape) {
		return nil, fmt.Errorf("shapes: view %v is larger than its storage %v", shape, root.shape)
	}
	return &shapeTensor{shape: append([]int(nil), shape...), dt: st.dt, root: root}, nil
}

func (s *shapes) Free(t Tensor) error {
	st, ok := t.(*shapeTensor)
	if !ok {
		return fmt.Errorf("shapes: foreign tensor %T", t)
	}
	if st.root != nil {
		return fmt.Errorf("shapes: freeing a view")
	}
	if st.freed {
		return fmt.Errorf("shapes: double free of a %v tensor", st.shape)
	}
	st.freed = true
	s.sub(int64(numel(st.shape)) * st.dt.Size())
	return nil
}

func (s *shapes) Upload(dst Tensor, src []float32) error {
	return same("upload", dst)
}

func (s *shapes) Download(src Tensor, dst []float32) error {
	return same("download", src)
}

// same checks that tensors are live and of one shape.
func same(op string, ts ...Tensor) error {
	for _, t := range ts {
		if t == nil {
			return fmt.Errorf("%s: nil tensor", op)
		}
		if err := live(t); err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
	}
	for _, t := range ts[1:] {
		if numel(t.Shape()) != numel(ts[0].Shape()) {
			return fmt.Errorf("%s: shapes %v and %v differ", op, ts[0].Shape(), t.Shape())
		}
	}
	return nil
}

func live(t Tensor) error {
	st, ok := t.(*shapeTensor)
	if !ok {
		return nil
	}
	root := st
	if st.root != nil {
		root = st.root
	}
	if root.freed {
		return fmt.Errorf("use of a freed %v tensor", root.shape)
	}
	return nil
}

func (s *shapes) Copy(dst, src Tensor) error { return same("copy", dst, src) }
func (s *shapes) Sum(dst Tensor, srcs ...Tensor) error {
	return same("sum", append([]Tensor{dst}, srcs...)...)
}
func (s *shapes) Accumulate(dst, src Tensor) error          { return same("accumulate", dst, src) }
func (s *shapes) Activation(dst, src Tensor, act Act) error { return same("activation", dst, src) }
func (s *shapes) ActivationBackward(dx, dy, saved Tensor, act Act, fromOutput bool) error {
	return same("activation backward", dx, dy, saved)
}
func (s *shapes) DropoutMask(mask Tensor, p float64, seed uint64) error {
	return same("dropout mask", mask)
}
func (s *shapes) Mul(dst, a, b Tensor) error { return same("mul", dst, a, b) }

func (s *shapes) Concat(dst Tensor, srcs ...Tensor) error {
	return checkConcat("concat", dst, srcs)
}

func (s *shapes) Split(src Tensor, dsts ...Tensor) error {
	return checkConcat("split", src, dsts)
}

// checkConcat checks that parts joined along dimension 1 make whole.
func checkConcat(op string, whole Tensor, parts []Tensor) error {
	if err := same(op, whole); err != nil {
		return err
	}
	ws := whole.Shape()
	if len(ws) < 2 {
		return fmt.Errorf("%s: shape %v has no channel dimension", op, ws)
	}
	c := 0
	for _, p := range parts {
		if err := same(op, p); err != nil {
			return err
		}
		ps := p.Shape()
		if len(ps) != len(ws) || ps[0] != ws[0] || numel(ps[2:]) != numel(ws[2:]) {
			return fmt.Errorf("%s: part %v does not fit %v", op, ps, ws)
		}
		c += ps[1]
	}
	if c != ws[1] {
		return fmt.Errorf("%s: parts have %d channels, the whole %d", op, c, ws[1])
	}
	return nil
}

func (s *shapes) Conv2d(y, x, w, b Tensor, p ConvParams) error {
	return checkConv("conv2d", y, x, w, b, p)
}

func (s *shapes) Conv2dBackward(dx, dw, db, dy, x, w Tensor, p ConvParams) error {
	if err := checkConv("conv2d backward", dy, x, w, db, p); err != nil {
		return err
	}
	if dx != nil {
		if err := same("conv2d backward", dx, x); err != nil {
			return err
		}
	}
	if dw != nil {
		return same("conv2d backward", dw, w)
	}
	return nil
}

func checkConv(op string, y, x, w, b Tensor, p ConvParams) error {
	if err := same(op, y); err != nil {
		return err
	}
	if err := same(op, x); err != nil {
		return err
	}
	xs, ws, ys := x.Shape(), w.Shape(), y.Shape()
	if len(xs) != 4 || len(ws) != 4 || len(ys) != 4 {
		return fmt.Errorf("%s: shapes %v, %v, %v: want 4 dimensions", op, xs, ws, ys)
	}
	g := p.Groups
	if g < 1 || xs[1] != ws[1]*g || ws[0]%g != 0 || ys[1] != ws[0] || ys[0] != xs[0] {
		return fmt.Errorf("%s: input %v, weight %v, output %v, groups %d do not fit", op, xs, ws, ys, g)
	}
	for d := 0; d < 2; d++ {
		if ys[2+d] != ConvOutSize(xs[2+d], ws[2+d], p.Stride[d], p.Padding[d], p.Dilation[d]) {
			return fmt.Errorf("%s: input %v with kernel %v gives output %v, not %v", op, xs, ws[2:], ys, ys)
		}
	}
	if b != nil && numel(b.Shape()) != ws[0] {
		return fmt.Errorf("%s: bias %v for %d channels", op, b.Shape(), ws[0])
	}
	return nil
}

func (s *shapes) Linear(y, x, w, b Tensor) error { return checkLinear("linear", y, x, w, b) }

func (s *shapes) LinearBackward(dx, dw, db, dy, x, w Tensor) error {
	if err := checkLinear("linear backward", dy, x, w, db); err != nil {
		return err
	}
	if dx != nil {
		if err := same("linear backward", dx, x); err != nil {
			return err
		}
	}
	if dw != nil {
		return same("linear backward", dw, w)
	}
	return nil
}

func checkLinear(op string, y, x, w, b Tensor) error {
	if err := same(op, y); err != nil {
		return err
	}
	if err := same(op, x); err != nil {
		return err
	}
	xs, ws, ys := x.Shape(), w.Shape(), y.Shape()
	if len(xs) != 2 || len(ws) != 2 || len(ys) != 2 || xs[1] != ws[1] || ys[1] != ws[0] || ys[0] != xs[0] {
		return fmt.Errorf("%s: input %v, weight %v, output %v do not fit", op, xs, ws, ys)
	}
	if b != nil && numel(b.Shape()) != ws[0] {
		return fmt.Errorf("%s: bias %v for %d features", op, b.Shape(), ws[0])
	}
	return nil
}

// checkChannels checks per-channel vectors against x's channel count.
func checkChannels(op string, x Tensor, vs ...Tensor) error {
	if err := same(op, x); err != nil {
		return err
	}
	xs := x.Shape()
	if len(xs) < 2 {
		return fmt.Errorf("%s: shape %v has no channel dimension", op, xs)
	}
	for _, v := range vs {
		if v == nil {
			continue
		}
		if err := same(op, v); err != nil {
			return err
		}
		if numel(v.Shape()) != xs[1] {
			return fmt.Errorf("%s: per-channel vector %v for %d channels", op, v.Shape(), xs[1])
		}
	}
	return nil
}

func (s *shapes) BatchStats(mean, variance, x, sign Tensor) error {
	return checkChannels("batch stats", x, mean, variance, sign)
}

func (s *shapes) UpdateRunning(rm, rv, mean, variance Tensor, factor float64, count int) error {
	if count < 2 {
		return fmt.Errorf("update running: %d values per channel", count)
	}
	return same("update running", rm, rv, mean, variance)
}

func (s *shapes) Normalize(y, x, sign, mean, variance, w, b Tensor, p NormParams) error {
	if err := same("normalize", y, x); err != nil {
		return err
	}
	return checkChannels("normalize", x, sign, mean, variance, w, b)
}

func (s *shapes) NormalizeBackward(dx, dw, db, dy, x, sign, mean, variance, w Tensor, p NormParams, training bool) error {
	if err := same("normalize backward", dy, x); err != nil {
		return err
	}
	if dx != nil {
		if err := same("normalize backward", dx, x); err != nil {
			return err
		}
	}
	return checkChannels("normalize backward", x, sign, mean, variance, w, dw, db)
}

func (s *shapes) NormalizeBackwardFromOutput(dx, dw, db, dz, z, sign, variance, w, b Tensor, p NormParams, training bool) error {
	if err := same("normalize backward", dz, z); err != nil {
		return err
	}
	if dx != nil {
		if err := same("normalize backward", dx, z); err != nil {
			return err
		}
	}
	return checkChannels("normalize backward", z, sign, variance, w, b, dw, db)
}

func checkPool(op string, y, x Tensor) error {
	if err := same(op, y); err != nil {
		return err
	}
	if err := same(op, x); err != nil {
		return err
	}
	xs, ys := x.Shape(), y.Shape()
	if len(xs) != 4 || len(ys) != 4 || xs[0] != ys[0] || xs[1] != ys[1] {
		return fmt.Errorf("%s: input %v and output %v do not fit", op, xs, ys)
	}
	return nil
}

func (s *shapes) MaxPool(y, idx, x Tensor, p PoolParams) error {
	if idx != nil {
		if err := same("max pool", y, idx); err != nil {
			return err
		}
	}
	return checkPool("max pool", y, x)
}

func (s *shapes) MaxPoolBackward(dx, dy, idx Tensor) error {
	if err := same("max pool backward", dy, idx); err != nil {
		return err
	}
	return checkPool("max pool backward", dy, dx)
}

func (s *shapes) AvgPool(y, x Tensor, p PoolParams) error { return checkPool("avg pool", y, x) }
func (s *shapes) AvgPoolBackward(dx, dy Tensor, p PoolParams) error {
	return checkPool("avg pool backward", dy, dx)
}
func (s *shapes) AdaptiveAvgPool(y, x Tensor) error { return checkPool("adaptive avg pool", y, x) }
func (s *shapes) AdaptiveAvgPoolBackward(dx, dy Tensor) error {
	return checkPool("adaptive avg pool backward", dy, dx)
}
