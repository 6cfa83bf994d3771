package runtime

import (
	"fmt"
	"math"
)

// poolDims checks x and y for a pool and returns N*C planes and the
// spatial sizes.
func poolDims(x, y Tensor) (planes, h, w, oh, ow int, err error) {
	xs, ys := x.Shape(), y.Shape()
	if len(xs) != 4 || len(ys) != 4 || xs[0] != ys[0] || xs[1] != ys[1] {
		return 0, 0, 0, 0, 0, fmt.Errorf("cpu: pool from %v to %v", xs, ys)
	}
	return xs[0] * xs[1], xs[2], xs[3], ys[2], ys[3], nil
}

func (c *cpu) MaxPool(y, idx, x Tensor, p PoolParams) error {
	f, done, err := c.floats(y, x)
	defer done()
	if err != nil {
		return err
	}
	np, h, w, oh, ow, err := poolDims(x, y)
	if err != nil {
		return err
	}
	var id []int64
	if idx != nil {
		it, err := c.get(idx)
		if err != nil {
			return err
		}
		if it.dt != Int64 || len(it.i) != len(f[0]) {
			return fmt.Errorf("cpu: max pool indices %v %v for output %v", it.dt, it.shape, y.Shape())
		}
		id = it.i
	}
	yd, xd := f[0], f[1]
	c.parallel(np, len(xd), func(lo, hi int) {
		for pl := lo; pl < hi; pl++ {
			src := xd[pl*h*w : (pl+1)*h*w]
			for i := 0; i < oh; i++ {
				h0 := i*p.Stride[0] - p.Padding[0]
				h1 := min(h0+p.Kernel[0], h)
				h0 = max(h0, 0)
				for j := 0; j < ow; j++ {
					w0 := j*p.Stride[1] - p.Padding[1]
					w1 := min(w0+p.Kernel[1], w)
					w0 = max(w0, 0)
					// PyTorch's rule: the first maximum wins, NaN
					// propagates.
					best := float32(math.Inf(-1))
					at := h0*w + w0
					for a := h0; a < h1; a++ {
						for b := w0; b < w1; b++ {
							v := src[a*w+b]
							if v > best || v != v {
								best, at = v, a*w+b
							}
						}
					}
					o := pl*oh*ow + i*ow + j
					yd[o] = best
					if id != nil {
						id[o] = int64(at)
					}
				}
			}
		}
	})
	return nil
}

func (c *cpu) MaxPoolBackward(dx, dy, idx Tensor) error {
	f, done, err := c.floats(dx, dy)
	defer done()
	if err != nil {
		return err
	}
	np, h, w, oh, ow, err := poolDims(dx, dy)
	if err != nil {
		return err
	}
	it, err := c.get(idx)
	if err != nil {
		return err
	}
	if it.dt != Int64 || len(it.i) != len(f[1]) {
		return fmt.Errorf("cpu: max pool indices %v %v for gradient %v", it.dt, it.shape, dy.Shape())
	}
	dxd, dyd, id := f[0], f[1], it.i
	c.parallel(np, len(dxd), func(lo, hi int) {
		for pl := lo; pl < hi; pl++ {
			dst := dxd[pl*h*w : (pl+1)*h*w]
			clear(dst)
			for o := pl * oh * ow; o < (pl+1)*oh*ow; o++ {
				if k := id[o]; k >= 0 && int(k) < len(dst) {
					dst[k] += dyd[o]
				}
			}
		}
	})
	return nil
}

// avgWindow is PyTorch's average-pool window for output index i along one
// axis: the clipped range and the divisor's extent.
func avgWindow(i, in, k, stride, pad int, includePad bool) (lo, hi, size int) {
	lo = i*stride - pad
	hi = min(lo+k, in+pad)
	size = hi - lo
	lo, hi = max(lo, 0), min(hi, in)
	if !includePad {
		size = hi - lo
	}
	return lo, hi, size
}

func (c *cpu) AvgPool(y, x Tensor, p PoolParams) error {
	return c.avgPool(y, x, p, false)
}

func (c *cpu) AvgPoolBackward(dx, dy Tensor, p PoolParams) error {
	return c.avgPool(dy, dx, p, true)
}

// avgPool runs the forward (y from x) or, with back, the backward (x is the
// input gradient, y the output gradient).
func (c *cpu) avgPool(y, x Tensor, p PoolParams, back bool) error {
	f, done, err := c.floats(y, x)
	defer done()
	if err != nil {
		return err
	}
	np, h, w, oh, ow, err := poolDims(x, y)
	if err != nil {
		return err
	}
	yd, xd := f[0], f[1]
	c.parallel(np, len(xd), func(lo, hi int) {
		for pl := lo; pl < hi; pl++ {
			plane := xd[pl*h*w : (pl+1)*h*w]
			if back {
				clear(plane)
			}
			for i := 0; i < oh; i++ {
				h0, h1, hs := avgWindow(i, h, p.Kernel[0], p.Stride[0], p.Padding[0], p.CountIncludePad)
				for j := 0; j < ow; j++ {
					w0, w1, ws := avgWindow(j, w, p.Kernel[1], p.Stride[1], p.Padding[1], p.CountIncludePad)
					o := pl*oh*ow + i*ow + j
					if h0 >= h1 || w0 >= w1 {
						if !back {
							yd[o] = 0
						}
						continue
					}
					windowMean(plane, w, h0, h1, w0, w1, float32(hs*ws), &yd[o], back)
				}
			}
		}
	})
	return nil
}

// windowMean sets *y to the sum of the window [h0,h1)x[w0,w1) of a plane w
// wide over div or, with back, spreads *y/div over the window's gradients:
// the arithmetic average and adaptive pooling share.
func windowMean(plane []float32, w, h0, h1, w0, w1 int, div float32, y *float32, back bool) {
	if back {
		g := *y / div
		for a := h0; a < h1; a++ {
			row := plane[a*w+w0 : a*w+w1]
			for b := range row {
				row[b] += g
			}
		}
		return
	}
	var sum float32
	for a := h0; a < h1; a++ {
		for _, v := range plane[a*w+w0 : a*w+w1] {
			sum += v
		}
	}
	*y = sum / div
}

func (c *cpu) AdaptiveAvgPool(y, x Tensor) error { return c.adaptive(y, x, false) }

func (c *cpu) AdaptiveAvgPoolBackward(dx, dy Tensor) error { return c.adaptive(dy, dx, true) }

func (c *cpu) adaptive(y, x Tensor, back bool) error {
	f, done, err := c.floats(y, x)
	defer done()
	if err != nil {
		return err
	}
	np, h, w, oh, ow, err := poolDims(x, y)
	if err != nil {
		return err
	}
	yd, xd := f[0], f[1]
	c.parallel(np, len(xd), func(lo, hi int) {
		for pl := lo; pl < hi; pl++ {
			plane := xd[pl*h*w : (pl+1)*h*w]
			if back {
				clear(plane)
			}
			for i := 0; i < oh; i++ {
				h0, h1 := AdaptiveWindow(i, h, oh)
				for j := 0; j < ow; j++ {
					w0, w1 := AdaptiveWindow(j, w, ow)
					o := pl*oh*ow + i*ow + j
					windowMean(plane, w, h0, h1, w0, w1, float32((h1-h0)*(w1-w0)), &yd[o], back)
				}
			}
		}
	})
	return nil
}
