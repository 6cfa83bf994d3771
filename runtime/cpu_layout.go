package runtime

import (
	"fmt"
)

// strides are the row-major element strides of shape.
func strides(shape []int) []int {
	s := make([]int, len(shape))
	acc := 1
	for d := len(shape) - 1; d >= 0; d-- {
		s[d] = acc
		acc *= shape[d]
	}
	return s
}

func (c *cpu) Permute(dst, src Tensor, perm []int) error {
	f, done, err := c.floats(dst, src)
	defer done()
	if err != nil {
		return err
	}
	ss, ds := src.Shape(), dst.Shape()
	if len(perm) != len(ss) || len(ds) != len(ss) {
		return fmt.Errorf("cpu: permute %v by %v into %v", ss, perm, ds)
	}
	for i, p := range perm {
		if ds[i] != ss[p] {
			return fmt.Errorf("cpu: permute %v by %v into %v", ss, perm, ds)
		}
	}
	sst := strides(ss)
	// pst[i] is the source stride of destination dimension i.
	pst := make([]int, len(perm))
	for i, p := range perm {
		pst[i] = sst[p]
	}
	y, x := f[0], f[1]
	idx := make([]int, len(ds))
	off := 0
	for o := range y {
		y[o] = x[off]
		for d := len(ds) - 1; d >= 0; d-- {
			idx[d]++
			off += pst[d]
			if idx[d] < ds[d] {
				break
			}
			off -= pst[d] * idx[d]
			idx[d] = 0
		}
	}
	return nil
}

func (c *cpu) Fill(dst Tensor, v float32) error {
	f, done, err := c.floats(dst)
	defer done()
	if err != nil {
		return err
	}
	for i := range f[0] {
		f[0][i] = v
	}
	return nil
}

func (c *cpu) CopyBox(dst, src Tensor, dstOff, srcOff, size []int, add bool) error {
	if err := checkBox(dst.Shape(), src.Shape(), dstOff, srcOff, size); err != nil {
		return fmt.Errorf("cpu: %w", err)
	}
	f, done, err := c.floats(dst, src)
	defer done()
	if err != nil {
		return err
	}
	if numel(size) == 0 {
		return nil
	}
	y, x := f[0], f[1]
	rank := len(size)
	ds, ss := strides(dst.Shape()), strides(src.Shape())
	// Rows: the last dimension is contiguous in both.
	row := size[rank-1]
	idx := make([]int, rank)
	for {
		do, so := 0, 0
		for d := 0; d < rank; d++ {
			do += (dstOff[d] + idx[d]) * ds[d]
			so += (srcOff[d] + idx[d]) * ss[d]
		}
		if add {
			for k := 0; k < row; k++ {
				y[do+k] += x[so+k]
			}
		} else {
			copy(y[do:do+row], x[so:so+row])
		}
		d := rank - 2
		for ; d >= 0; d-- {
			idx[d]++
			if idx[d] < size[d] {
				break
			}
			idx[d] = 0
		}
		if d < 0 {
			return nil
		}
	}
}

// resizeTaps are, for each output position along axis, the two input
// positions it reads and the weight of the second, as torch's upsample
// kernels compute them (aten/src/ATen/native/UpSample.h): nearest reads
// NearestIndex (exact as it says); bilinear reads around (o + 0.5) * step - 0.5, clamped at
// 0, or o * step with align_corners (Interp.Step).
func resizeTaps(axis, in, out int, how Interp, exact bool) (i0, i1 []int, l1 []float32) {
	i0, i1, l1 = make([]int, out), make([]int, out), make([]float32, out)
	step := how.Step(axis, in, out)
	for o := 0; o < out; o++ {
		if !how.Bilinear {
			s := NearestIndex(o, in, out, step, exact)
			i0[o], i1[o] = s, s
			continue
		}
		var src float32
		if how.AlignCorners {
			src = step * float32(o)
		} else {
			src = max(step*(float32(o)+0.5)-0.5, 0)
		}
		a := min(int(src), in-1)
		b := a
		if a < in-1 {
			b = a + 1
		}
		i0[o], i1[o], l1[o] = a, b, src-float32(a)
	}
	return i0, i1, l1
}

func (c *cpu) Resize(dst, src Tensor, how Interp) error {
	return c.resize(dst, src, how, false)
}

func (c *cpu) ResizeBackward(dx, dy Tensor, how Interp) error {
	return c.resize(dy, dx, how, true)
}

// resize interpolates x into y, or (adjoint) scatters y's gradient into x.
func (c *cpu) resize(y, x Tensor, how Interp, adjoint bool) error {
	if err := checkResize(y, x); err != nil {
		return fmt.Errorf("cpu: %w", err)
	}
	f, done, err := c.floats(y, x)
	defer done()
	if err != nil {
		return err
	}
	ys, xs := y.Shape(), x.Shape()
	planes := ys[0] * ys[1]
	ih, iw, oh, ow := xs[2], xs[3], ys[2], ys[3]
	exact := adjoint || ys[1] == 1 // see NearestIndex
	h0, h1, hl := resizeTaps(0, ih, oh, how, exact)
	w0, w1, wl := resizeTaps(1, iw, ow, how, exact)
	yv, xv := f[0], f[1]
	if adjoint {
		for i := range xv {
			xv[i] = 0
		}
	}
	c.parallel(planes, planes*oh*ow*4, func(lo, hi int) {
		for p := lo; p < hi; p++ {
			xp, yp := xv[p*ih*iw:(p+1)*ih*iw], yv[p*oh*ow:(p+1)*oh*ow]
			for i := 0; i < oh; i++ {
				a, b, lh := h0[i], h1[i], hl[i]
				for j := 0; j < ow; j++ {
					u, v, lw := w0[j], w1[j], wl[j]
					if !adjoint {
						yp[i*ow+j] = (1-lh)*((1-lw)*xp[a*iw+u]+lw*xp[a*iw+v]) + lh*((1-lw)*xp[b*iw+u]+lw*xp[b*iw+v])
						continue
					}
					g := yp[i*ow+j]
					xp[a*iw+u] += (1 - lh) * (1 - lw) * g
					xp[a*iw+v] += (1 - lh) * lw * g
					xp[b*iw+u] += lh * (1 - lw) * g
					xp[b*iw+v] += lh * lw * g
				}
			}
		}
	})
	return nil
}
