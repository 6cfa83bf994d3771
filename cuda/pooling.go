package cuda

import (
	"fmt"

	"github.com/abnconvert/abnconvert/runtime"
)

// poolDims checks x and y for a pool and returns N*C planes and the
// spatial sizes.
func poolDims(x, y *tensor) (planes, h, w, oh, ow int, err error) {
	xs, ys := x.shape, y.shape
	if len(xs) != 4 || len(ys) != 4 || xs[0] != ys[0] || xs[1] != ys[1] {
		return 0, 0, 0, 0, 0, fmt.Errorf("cuda: pool from %v to %v", xs, ys)
	}
	return xs[0] * xs[1], xs[2], xs[3], ys[2], ys[3], nil
}

func poolArgs(p runtime.PoolParams) []arg {
	return []arg{i32(p.Kernel[0]), i32(p.Kernel[1]), i32(p.Stride[0]), i32(p.Stride[1]), i32(p.Padding[0]), i32(p.Padding[1])}
}

func checkPool(p runtime.PoolParams) error {
	if p.Kernel[0] < 1 || p.Kernel[1] < 1 || p.Stride[0] < 1 || p.Stride[1] < 1 || p.Padding[0] < 0 || p.Padding[1] < 0 {
		return fmt.Errorf("cuda: pool kernel %v, stride %v, padding %v out of range", p.Kernel, p.Stride, p.Padding)
	}
	return nil
}

func (b *Backend) MaxPool(y, idx, x runtime.Tensor, p runtime.PoolParams) error {
	t, err := b.nonNil("max pool", y, x)
	if err != nil {
		return err
	}
	if err := checkPool(p); err != nil {
		return err
	}
	np, h, w, oh, ow, err := poolDims(t[1], t[0])
	if err != nil {
		return err
	}
	var it *tensor
	if idx != nil {
		if it, err = b.get(idx); err != nil {
			return err
		}
		if it.dt != runtime.Int64 || it.numel() != t[0].numel() {
			return fmt.Errorf("cuda: max pool indices %v %v for output %v", it.dt, it.shape, t[0].shape)
		}
	}
	total := t[0].numel()
	if total == 0 {
		return nil
	}
	if h == 0 || w == 0 {
		return fmt.Errorf("cuda: max pool of empty planes %v", t[1].shape)
	}
	_ = np
	args := []arg{tp(t[0]), tp(it), tp(t[1]), i64(total), i32(h), i32(w), i32(oh), i32(ow)}
	return b.launch(kMaxPool, loopDims(total, b.sms), append(args, poolArgs(p)...)...)
}

func (b *Backend) MaxPoolBackward(dx, dy, idx runtime.Tensor) error {
	t, err := b.nonNil("max pool backward", dx, dy)
	if err != nil {
		return err
	}
	_, h, w, oh, ow, err := poolDims(t[0], t[1])
	if err != nil {
		return err
	}
	it, err := b.get(idx)
	if err != nil {
		return err
	}
	if it.dt != runtime.Int64 || it.numel() != t[1].numel() {
		return fmt.Errorf("cuda: max pool indices %v %v for gradient %v", it.dt, it.shape, t[1].shape)
	}
	if n := t[0].numel(); n > 0 {
		if err := b.dev.memset32(t[0].ptr, 0, n); err != nil {
			return err
		}
	}
	total := t[1].numel()
	if total == 0 {
		return nil
	}
	return b.launch(kMaxPoolBwd, loopDims(total, b.sms), tp(t[0]), tp(t[1]), tp(it), i64(total), i32(h*w), i32(oh*ow))
}

func (b *Backend) AvgPool(y, x runtime.Tensor, p runtime.PoolParams) error {
	return b.avgPool(y, x, p, false)
}

func (b *Backend) AvgPoolBackward(dx, dy runtime.Tensor, p runtime.PoolParams) error {
	return b.avgPool(dy, dx, p, true)
}

// avgPool runs the forward (y from x) or, with back, the backward (x is the
// input gradient, y the output gradient): one thread per value written.
func (b *Backend) avgPool(y, x runtime.Tensor, p runtime.PoolParams, back bool) error {
	t, err := b.nonNil("average pool", y, x)
	if err != nil {
		return err
	}
	if err := checkPool(p); err != nil {
		return err
	}
	_, h, w, oh, ow, err := poolDims(t[1], t[0])
	if err != nil {
		return err
	}
	k, out, in := kAvgPool, t[0], t[1]
	if back {
		k, out, in = kAvgPoolBwd, t[1], t[0]
	}
	total := out.numel()
	if total == 0 {
		return nil
	}
	args := []arg{tp(out), tp(in), i64(total), i32(h), i32(w), i32(oh), i32(ow)}
	args = append(append(args, poolArgs(p)...), boolArg(p.CountIncludePad))
	return b.launch(k, loopDims(total, b.sms), args...)
}

func (b *Backend) AdaptiveAvgPool(y, x runtime.Tensor) error { return b.adaptive(y, x, false) }

func (b *Backend) AdaptiveAvgPoolBackward(dx, dy runtime.Tensor) error {
	return b.adaptive(dy, dx, true)
}

func (b *Backend) adaptive(y, x runtime.Tensor, back bool) error {
	t, err := b.nonNil("adaptive pool", y, x)
	if err != nil {
		return err
	}
	_, h, w, oh, ow, err := poolDims(t[1], t[0])
	if err != nil {
		return err
	}
	if h > 0 && w > 0 && (oh == 0 || ow == 0) && back {
		return fmt.Errorf("cuda: adaptive pool backward to %v from an empty output", t[1].shape)
	}
	if (h == 0 || w == 0) && oh*ow > 0 {
		return fmt.Errorf("cuda: adaptive pool of empty planes %v", t[1].shape)
	}
	k, out, in := kAdaptivePool, t[0], t[1]
	if back {
		k, out, in = kAdaptivePoolBwd, t[1], t[0]
	}
	total := out.numel()
	if total == 0 {
		return nil
	}
	return b.launch(k, loopDims(total, b.sms), tp(out), tp(in), i64(total), i32(h), i32(w), i32(oh), i32(ow))
}
