package cuda

import (
	"fmt"
	"slices"

	"github.com/abnconvert/abnconvert/runtime"
)

// The broadcasting binary ops (runtime.Broadcasting), kernels/broadcast.cu.
// The host reduces every broadcast to at most four dimensions: those of size
// 1 in the result are dropped, and neighbours that the result and both
// operands walk as one (contiguous in each, or broadcast in each) are
// merged. Squeeze-and-excitation's (N, C, H, W) * (N, C, 1, 1) becomes
// (N·C, H·W) with the gate's strides (1, 0); only broadcasts alternating
// between the operands along more than four dimensions are refused.

var _ runtime.Broadcasting = (*Backend)(nil)

// maxBroadcastDims is the dimensions the kernels split a flat index into.
const maxBroadcastDims = 4

// bgeoParams are the kernels' geometry parameters: size, fdiv multiplier
// and shift of the inner three dimensions, then the four strides of the
// result, of a and of b.
const bgeoParams = "iiiiiiiii" + "llll" + "llll" + "llll"

// bdim is one dimension of a collapsed broadcast: its size and the strides
// of the result and of both operands along it (0 where broadcast).
type bdim struct {
	n          int
	so, sa, sb int64
}

// alignedStrides are the strides of a row-major operand of shape s inside a
// result of shape out, zero along the dimensions it is broadcast along.
func alignedStrides(out, s []int) []int64 {
	st := make([]int64, len(out))
	stride := int64(1)
	for i := len(out) - 1; i >= 0; i-- {
		k := len(s) - len(out) + i
		if k < 0 {
			continue
		}
		if s[k] != 1 {
			st[i] = stride
		}
		stride *= int64(s[k])
	}
	return st
}

// collapse returns the broadcast of a and b into out as its fewest
// dimensions, outermost first.
func collapse(out, a, b []int) []bdim {
	so, sa, sb := alignedStrides(out, out), alignedStrides(out, a), alignedStrides(out, b)
	var ds []bdim
	for i, n := range out {
		if n == 1 {
			continue
		}
		d := bdim{n: n, so: so[i], sa: sa[i], sb: sb[i]}
		if k := len(ds) - 1; k >= 0 && joins(ds[k].so, d.so, n) && joins(ds[k].sa, d.sa, n) && joins(ds[k].sb, d.sb, n) {
			ds[k] = bdim{n: ds[k].n * n, so: d.so, sa: d.sa, sb: d.sb}
			continue
		}
		ds = append(ds, d)
	}
	return ds
}

// joins says whether an outer dimension of stride outer and the inner one
// of size n and stride inner are walked as one.
func joins(outer, inner int64, n int) bool {
	if inner == 0 {
		return outer == 0
	}
	return outer == inner*int64(n)
}

// geoArgs are the kernel arguments of a broadcast's dimensions (at most
// maxBroadcastDims, padded on the outside with dimensions of size 1).
func geoArgs(ds []bdim) ([]arg, error) {
	if len(ds) > maxBroadcastDims {
		return nil, fmt.Errorf("the broadcast walks %d independent dimensions, the kernels at most %d", len(ds), maxBroadcastDims)
	}
	padded := make([]bdim, maxBroadcastDims-len(ds), maxBroadcastDims)
	for i := range padded {
		padded[i].n = 1
	}
	padded = append(padded, ds...)
	var out []arg
	for _, d := range padded[1:] {
		fd, err := newFastDiv(d.n)
		if err != nil {
			return nil, err
		}
		out = append(out, u32(fd.d), u32(fd.m), u32(fd.s))
	}
	for _, pick := range []func(bdim) int64{
		func(d bdim) int64 { return d.so }, func(d bdim) int64 { return d.sa }, func(d bdim) int64 { return d.sb }} {
		for _, d := range padded {
			out = append(out, i64(pick(d)))
		}
	}
	return out, nil
}

// broadcastShape checks that out is the broadcast of a and b and that the
// kernels can index it.
func broadcastShape(what string, out, a, b []int) error {
	want, err := runtime.BroadcastShape(a, b)
	if err != nil {
		return fmt.Errorf("cuda: %s: %w", what, err)
	}
	if !slices.Equal(want, out) {
		return fmt.Errorf("cuda: %s: %v and %v broadcast to %v, not %v", what, a, b, want, out)
	}
	if n := numel(out); n > maxDividend {
		return fmt.Errorf("cuda: %s: %v has %d elements, over the %d the broadcasting kernels index", what, out, n, int64(maxDividend))
	}
	return nil
}

func binaryOp(op runtime.BinaryOp) error {
	if op > runtime.BinaryDiv {
		return fmt.Errorf("cuda: binary op %d", op)
	}
	return nil
}

func (b *Backend) Binary(dst, x, y runtime.Tensor, op runtime.BinaryOp) error {
	if err := binaryOp(op); err != nil {
		return err
	}
	t, err := b.nonNil(op.String(), dst, x, y)
	if err != nil {
		return err
	}
	if err := broadcastShape(op.String(), t[0].shape, t[1].shape, t[2].shape); err != nil {
		return err
	}
	n := t[0].numel()
	if n == 0 {
		return nil
	}
	geo, err := geoArgs(collapse(t[0].shape, t[1].shape, t[2].shape))
	if err != nil {
		return fmt.Errorf("cuda: %s of %v and %v: %w", op, t[1].shape, t[2].shape, err)
	}
	return b.launch(kBinary, loopDims(n, b.sms), append([]arg{tp(t[0]), tp(t[1]), tp(t[2]), i64(n), i32(int(op))}, geo...)...)
}

// BinaryBackward writes both gradients: each broadcast operand's by
// bc_binary_sum (a block per gradient element, summing in double as the
// CPU backend does), then the others' in one elementwise pass, so that a
// gradient written over dy is written after every read of dy.
func (b *Backend) BinaryBackward(da, db, dy, x, y runtime.Tensor, op runtime.BinaryOp) error {
	if err := binaryOp(op); err != nil {
		return err
	}
	what := op.String() + " backward"
	needOperands := op == runtime.BinaryMul || op == runtime.BinaryDiv
	if needOperands && (x == nil || y == nil) {
		return fmt.Errorf("cuda: %s needs both operands", what)
	}
	t, err := b.floats(da, db, dy, x, y)
	if err != nil {
		return err
	}
	dat, dbt, gt, xt, yt := t[0], t[1], t[2], t[3], t[4]
	if dat == nil || dbt == nil || gt == nil {
		return fmt.Errorf("cuda: %s: nil gradient", what)
	}
	if err := broadcastShape(what, gt.shape, dat.shape, dbt.shape); err != nil {
		return err
	}
	if needOperands && (!slices.Equal(xt.shape, dat.shape) || !slices.Equal(yt.shape, dbt.shape)) {
		return fmt.Errorf("cuda: %s: operands %v, %v for gradients %v, %v", what, xt.shape, yt.shape, dat.shape, dbt.shape)
	}
	n := gt.numel()
	if n == 0 {
		// Sums over nothing.
		for _, g := range []*tensor{dat, dbt} {
			if g.numel() > 0 {
				if err := b.dev.memset32(g.ptr, 0, g.numel()); err != nil {
					return err
				}
			}
		}
		return nil
	}
	ds := collapse(gt.shape, dat.shape, dbt.shape)
	if len(ds) > maxBroadcastDims {
		_, err := geoArgs(ds)
		return fmt.Errorf("cuda: %s of %v and %v: %w", what, dat.shape, dbt.shape, err)
	}
	full := [2]bool{dat.numel() == n, dbt.numel() == n}
	for which, g := range []*tensor{dat, dbt} {
		if full[which] {
			continue
		}
		// The gradient's own dimensions first, then those it sums over:
		// flat index j*r + k is term k of element j, and j is the
		// operand's own flat index.
		var kept, summed []bdim
		m, r := int64(1), int64(1)
		for _, d := range ds {
			s := d.sa
			if which == 1 {
				s = d.sb
			}
			if s != 0 {
				kept = append(kept, d)
				m *= int64(d.n)
			} else {
				summed = append(summed, d)
				r *= int64(d.n)
			}
		}
		geo, err := geoArgs(append(kept, summed...))
		if err != nil {
			return fmt.Errorf("cuda: %s: %w", what, err)
		}
		grid := blocks1(int(min(m, int64(b.sms)*loopBlocksPerSM)))
		if err := b.launch(kBinarySum, grid, append([]arg{tp(g), tp(gt), tp(xt), tp(yt), i64(m), i64(r), i32(int(op)), i32(which)}, geo...)...); err != nil {
			return err
		}
	}
	if !full[0] && !full[1] {
		return nil
	}
	geo, err := geoArgs(ds)
	if err != nil {
		return fmt.Errorf("cuda: %s: %w", what, err)
	}
	var pa, pb *tensor
	if full[0] {
		pa = dat
	}
	if full[1] {
		pb = dbt
	}
	return b.launch(kBinaryBwd, loopDims(n, b.sms), append([]arg{tp(pa), tp(pb), tp(gt), tp(xt), tp(yt), i64(n), i32(int(op))}, geo...)...)
}
