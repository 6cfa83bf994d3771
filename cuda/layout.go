package cuda

import (
	"fmt"
	"math"

	"github.com/abnconvert/abnconvert/runtime"
)

// The layout ops, kernels/layout.cu: runtime.Layout (Permute, Fill, CopyBox,
// Resize, ResizeBackward), with which the executor
// runs Transpose, Pad, Slice, Concat along any axis and Resize. Permute and
// CopyBox are one strided copy, collapsed like a broadcast to at most four
// dimensions.

var _ runtime.Layout = (*Backend)(nil)

// rowMajor are the element strides of a row-major shape.
func rowMajor(shape []int) []int64 {
	s := make([]int64, len(shape))
	acc := int64(1)
	for d := len(shape) - 1; d >= 0; d-- {
		s[d] = acc
		acc *= int64(shape[d])
	}
	return s
}

// strided merges a walk over sizes with the strides so (destination) and
// sa (source) into its fewest dimensions.
func strided(sizes []int, so, sa []int64) []bdim {
	var ds []bdim
	for i, n := range sizes {
		if n == 1 {
			continue
		}
		d := bdim{n: n, so: so[i], sa: sa[i]}
		if k := len(ds) - 1; k >= 0 && joins(ds[k].so, d.so, n) && joins(ds[k].sa, d.sa, n) {
			ds[k] = bdim{n: ds[k].n * n, so: d.so, sa: d.sa}
			continue
		}
		ds = append(ds, d)
	}
	return ds
}

// copyWalk launches lay_copy over n elements at y and x.
func (b *Backend) copyWalk(what string, y, x uint64, n int64, ds []bdim, add bool) error {
	if n == 0 {
		return nil
	}
	if n > maxDividend {
		return fmt.Errorf("cuda: %s of %d elements, over the %d the layout kernels index", what, n, int64(maxDividend))
	}
	geo, err := geoArgs(ds)
	if err != nil {
		return fmt.Errorf("cuda: %s: %w", what, err)
	}
	return b.launch(kLayCopy, loopDims(n, b.sms), append([]arg{ptr(y), ptr(x), i64(n), boolArg(add)}, geo...)...)
}

func (b *Backend) Permute(dst, src runtime.Tensor, perm []int) error {
	t, err := b.nonNil("permute", dst, src)
	if err != nil {
		return err
	}
	ds, ss := t[0].shape, t[1].shape
	if len(perm) != len(ss) || len(ds) != len(ss) {
		return fmt.Errorf("cuda: permute %v by %v into %v", ss, perm, ds)
	}
	seen := make([]bool, len(ss))
	for i, p := range perm {
		if p < 0 || p >= len(ss) || seen[p] || ds[i] != ss[p] {
			return fmt.Errorf("cuda: permute %v by %v into %v", ss, perm, ds)
		}
		seen[p] = true
	}
	sst := rowMajor(ss)
	pst := make([]int64, len(perm))
	for i, p := range perm {
		pst[i] = sst[p]
	}
	return b.copyWalk("permute", t[0].ptr, t[1].ptr, t[0].numel(), strided(ds, rowMajor(ds), pst), false)
}

func (b *Backend) Fill(dst runtime.Tensor, v float32) error {
	t, err := b.nonNil("fill", dst)
	if err != nil {
		return err
	}
	if n := t[0].numel(); n > 0 {
		return b.dev.memset32(t[0].ptr, math.Float32bits(v), n)
	}
	return nil
}

func (b *Backend) CopyBox(dst, src runtime.Tensor, dstOff, srcOff, size []int, add bool) error {
	t, err := b.nonNil("copy box", dst, src)
	if err != nil {
		return err
	}
	ds, ss := t[0].shape, t[1].shape
	r := len(size)
	if len(ds) != r || len(ss) != r || len(dstOff) != r || len(srcOff) != r {
		return fmt.Errorf("cuda: box %v at %v of %v into %v at %v: ranks differ", size, srcOff, ss, ds, dstOff)
	}
	for d := range size {
		if size[d] < 0 || dstOff[d] < 0 || srcOff[d] < 0 || dstOff[d]+size[d] > ds[d] || srcOff[d]+size[d] > ss[d] {
			return fmt.Errorf("cuda: box %v at %v of %v into %v at %v: out of bounds", size, srcOff, ss, ds, dstOff)
		}
	}
	n := numel(size)
	if n == 0 {
		return nil
	}
	dst0, src0 := rowMajor(ds), rowMajor(ss)
	var do, so int64
	for d := range size {
		do += int64(dstOff[d]) * dst0[d]
		so += int64(srcOff[d]) * src0[d]
	}
	return b.copyWalk("copy box", t[0].at(do), t[1].at(so), n, strided(size, dst0, src0), add)
}

// resizeArgs checks a resize of x (N, C, H, W) to y and returns its
// kernel arguments after the element count: the steps between source
// positions are the CPU backend's (runtime.Interp.Step), and exact says
// whether nearest takes torch's nearest_idx special cases
// (runtime.NearestIndex: always backward, forward for one channel).
func resizeArgs(y, x *tensor, how runtime.Interp, adjoint bool) ([]arg, error) {
	ys, xs := y.shape, x.shape
	if len(ys) != 4 || len(xs) != 4 || ys[0] != xs[0] || ys[1] != xs[1] || xs[2] < 1 || xs[3] < 1 {
		return nil, fmt.Errorf("cuda: resize of %v to %v", xs, ys)
	}
	if n := y.numel(); n > maxDividend {
		return nil, fmt.Errorf("cuda: resize to %v: %d elements, over the %d the kernels index", ys, n, int64(maxDividend))
	}
	w, err := newFastDiv(max(ys[3], 1))
	if err != nil {
		return nil, err
	}
	h, err := newFastDiv(max(ys[2], 1))
	if err != nil {
		return nil, err
	}
	return []arg{i32(xs[2]), i32(xs[3]), i32(ys[2]), i32(ys[3]), u32(w.m), u32(w.s), u32(h.m), u32(h.s),
		boolArg(how.Bilinear), boolArg(how.AlignCorners), f32(how.Step(0, xs[2], ys[2])), f32(how.Step(1, xs[3], ys[3])),
		boolArg(adjoint || ys[1] == 1)}, nil
}

func (b *Backend) Resize(dst, src runtime.Tensor, how runtime.Interp) error {
	t, err := b.nonNil("resize", dst, src)
	if err != nil {
		return err
	}
	geo, err := resizeArgs(t[0], t[1], how, false)
	if err != nil {
		return err
	}
	n := t[0].numel()
	if n == 0 {
		return nil
	}
	return b.launch(kResize, loopDims(n, b.sms), append([]arg{tp(t[0]), tp(t[1]), i64(n)}, geo...)...)
}

func (b *Backend) ResizeBackward(dx, dy runtime.Tensor, how runtime.Interp) error {
	t, err := b.nonNil("resize backward", dx, dy)
	if err != nil {
		return err
	}
	geo, err := resizeArgs(t[1], t[0], how, true)
	if err != nil {
		return err
	}
	if m := t[0].numel(); m > 0 {
		if err := b.dev.memset32(t[0].ptr, 0, m); err != nil {
			return err
		}
	}
	n := t[1].numel()
	if n == 0 {
		return nil
	}
	return b.launch(kResizeBwd, loopDims(n, b.sms), append([]arg{tp(t[0]), tp(t[1]), i64(n)}, geo...)...)
}
