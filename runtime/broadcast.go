package runtime

import "fmt"

// bcast maps the flat index of a broadcast result to its operands' flat
// indices: the operands' strides, aligned on the result's dimensions, with
// a zero stride along every dimension an operand is broadcast.
type bcast struct {
	out    []int
	sa, sb []int
}

func newBcast(out, a, b []int) (*bcast, error) {
	want, err := BroadcastShape(a, b)
	if err != nil {
		return nil, err
	}
	if !sameInts(want, out) {
		return nil, fmt.Errorf("%v and %v broadcast to %v, not %v", a, b, want, out)
	}
	return &bcast{out: out, sa: alignedStrides(out, a), sb: alignedStrides(out, b)}, nil
}

// alignedStrides are the strides of an operand of shape s inside a result
// of shape out (len(out) >= len(s)), zero along broadcast dimensions.
func alignedStrides(out, s []int) []int {
	st := make([]int, len(out))
	stride := 1
	for i := len(out) - 1; i >= 0; i-- {
		k := len(s) - len(out) + i
		if k >= 0 && s[k] != 1 {
			st[i] = stride
		}
		if k >= 0 {
			stride *= s[k]
		}
	}
	return st
}

// each calls fn for every result element, in order, with the operands'
// offsets. The innermost dimension runs as a loop of its own.
func (bc *bcast) each(fn func(o, ia, ib int)) {
	n := len(bc.out)
	if n == 0 {
		fn(0, 0, 0)
		return
	}
	total := numel(bc.out)
	if total == 0 {
		return
	}
	last := bc.out[n-1]
	la, lb := bc.sa[n-1], bc.sb[n-1]
	idx := make([]int, n-1)
	ia, ib := 0, 0
	for o := 0; o < total; o += last {
		for j := 0; j < last; j++ {
			fn(o+j, ia+j*la, ib+j*lb)
		}
		// Advance the outer counter.
		for d := n - 2; d >= 0; d-- {
			idx[d]++
			ia += bc.sa[d]
			ib += bc.sb[d]
			if idx[d] < bc.out[d] {
				break
			}
			ia -= bc.sa[d] * idx[d]
			ib -= bc.sb[d] * idx[d]
			idx[d] = 0
		}
	}
}

func (c *cpu) Binary(dst, a, b Tensor, op BinaryOp) error {
	f, done, err := c.floats(dst, a, b)
	defer done()
	if err != nil {
		return err
	}
	bc, err := newBcast(dst.Shape(), a.Shape(), b.Shape())
	if err != nil {
		return fmt.Errorf("cpu: %s: %w", op, err)
	}
	d, x, y := f[0], f[1], f[2]
	switch op {
	case BinaryAdd:
		bc.each(func(o, i, j int) { d[o] = x[i] + y[j] })
	case BinarySub:
		bc.each(func(o, i, j int) { d[o] = x[i] - y[j] })
	case BinaryMul:
		bc.each(func(o, i, j int) { d[o] = x[i] * y[j] })
	case BinaryDiv:
		bc.each(func(o, i, j int) { d[o] = x[i] / y[j] })
	default:
		return fmt.Errorf("cpu: binary op %d", op)
	}
	return nil
}

func (c *cpu) BinaryBackward(da, db, dy, a, b Tensor, op BinaryOp) error {
	needOperands := op == BinaryMul || op == BinaryDiv
	if needOperands && (a == nil || b == nil) {
		return fmt.Errorf("cpu: %s backward needs both operands", op)
	}
	f, done, err := c.floats(da, db, dy, a, b)
	defer done()
	if err != nil {
		return err
	}
	if da == nil || db == nil {
		return fmt.Errorf("cpu: %s backward: nil gradient", op)
	}
	bc, err := newBcast(dy.Shape(), da.Shape(), db.Shape())
	if err != nil {
		return fmt.Errorf("cpu: %s backward: %w", op, err)
	}
	if needOperands && (!sameInts(a.Shape(), da.Shape()) || !sameInts(b.Shape(), db.Shape())) {
		return fmt.Errorf("cpu: %s backward: operands %v, %v for gradients %v, %v", op, a.Shape(), b.Shape(), da.Shape(), db.Shape())
	}
	// A gradient whose operand was broadcast is a sum over the broadcast
	// dimensions, accumulated in float64 as the BN statistics are; one of
	// the result's shape is written as it is computed.
	g, x, y := f[2], f[3], f[4]
	n := len(g)
	var sa, sb []float64
	if len(f[0]) != n {
		sa = make([]float64, len(f[0]))
	}
	if len(f[1]) != n {
		sb = make([]float64, len(f[1]))
	}
	put := func(acc []float64, dst []float32, i int, v float64) {
		if acc != nil {
			acc[i] += v
		} else {
			dst[i] = float32(v)
		}
	}
	da32, db32 := f[0], f[1]
	switch op {
	case BinaryAdd:
		bc.each(func(o, i, j int) { put(sa, da32, i, float64(g[o])); put(sb, db32, j, float64(g[o])) })
	case BinarySub:
		bc.each(func(o, i, j int) { put(sa, da32, i, float64(g[o])); put(sb, db32, j, -float64(g[o])) })
	case BinaryMul:
		bc.each(func(o, i, j int) {
			put(sa, da32, i, float64(g[o])*float64(y[j]))
			put(sb, db32, j, float64(g[o])*float64(x[i]))
		})
	case BinaryDiv:
		bc.each(func(o, i, j int) {
			q := float64(g[o]) / float64(y[j])
			put(sa, da32, i, q)
			put(sb, db32, j, -q*float64(x[i])/float64(y[j]))
		})
	default:
		return fmt.Errorf("cpu: binary op %d", op)
	}
	for k, v := range sa {
		da32[k] = float32(v)
	}
	for k, v := range sb {
		db32[k] = float32(v)
	}
	return nil
}

func (s *shapes) Binary(dst, a, b Tensor, op BinaryOp) error {
	if err := same(op.String(), dst); err != nil {
		return err
	}
	if err := same(op.String(), a); err != nil {
		return err
	}
	if err := same(op.String(), b); err != nil {
		return err
	}
	if _, err := newBcast(dst.Shape(), a.Shape(), b.Shape()); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	return nil
}

func (s *shapes) BinaryBackward(da, db, dy, a, b Tensor, op BinaryOp) error {
	what := op.String() + " backward"
	for _, t := range []Tensor{da, db, dy} {
		if err := same(what, t); err != nil {
			return err
		}
	}
	if op == BinaryMul || op == BinaryDiv {
		if err := same(what, a, da); err != nil {
			return err
		}
		if err := same(what, b, db); err != nil {
			return err
		}
	}
	if _, err := newBcast(dy.Shape(), da.Shape(), db.Shape()); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}
