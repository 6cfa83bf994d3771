package cuda

import (
	"fmt"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/runtime"
)

// sameLen checks that tensors have equal element counts.
func sameLen(op string, ts ...*tensor) error {
	for _, t := range ts[1:] {
		if t.numel() != ts[0].numel() {
			return fmt.Errorf("cuda: %s: %d and %d elements", op, ts[0].numel(), t.numel())
		}
	}
	return nil
}

func (b *Backend) Copy(dst, src runtime.Tensor) error {
	t, err := b.floats(dst, src)
	if err != nil {
		return err
	}
	if t[0] == nil || t[1] == nil {
		return fmt.Errorf("cuda: copy of a nil tensor")
	}
	if err := sameLen("copy", t...); err != nil {
		return err
	}
	if t[0].numel() == 0 || t[0].ptr == t[1].ptr {
		return nil
	}
	return b.dev.copy(t[0].ptr, t[1].ptr, t[0].numel()*4)
}

func (b *Backend) Sum(dst runtime.Tensor, srcs ...runtime.Tensor) error {
	if len(srcs) == 0 {
		return fmt.Errorf("cuda: sum of nothing")
	}
	t, err := b.nonNil("sum", append([]runtime.Tensor{dst}, srcs...)...)
	if err != nil {
		return err
	}
	if err := sameLen("sum", t...); err != nil {
		return err
	}
	n := t[0].numel()
	if n == 0 {
		return nil
	}
	if len(srcs) == 1 {
		return b.dev.copy(t[0].ptr, t[1].ptr, n*4)
	}
	// One pass for the first two (a residual add), then one per extra.
	if err := b.launch(kAdd, vecDims(n, b.sms), tp(t[0]), tp(t[1]), tp(t[2]), i64(n)); err != nil {
		return err
	}
	for _, s := range t[3:] {
		if err := b.launch(kAcc, vecDims(n, b.sms), tp(t[0]), tp(s), i64(n)); err != nil {
			return err
		}
	}
	return nil
}

// nonNil is floats for ops whose operands are all required.
func (b *Backend) nonNil(op string, ts ...runtime.Tensor) ([]*tensor, error) {
	t, err := b.floats(ts...)
	if err != nil {
		return nil, err
	}
	for k, x := range t {
		if x == nil {
			return nil, fmt.Errorf("cuda: %s: operand %d is nil", op, k)
		}
	}
	return t, nil
}

func (b *Backend) Accumulate(dst, src runtime.Tensor) error {
	t, err := b.nonNil("accumulate", dst, src)
	if err != nil {
		return err
	}
	if err := sameLen("accumulate", t...); err != nil {
		return err
	}
	if n := t[0].numel(); n > 0 {
		return b.launch(kAcc, vecDims(n, b.sms), tp(t[0]), tp(t[1]), i64(n))
	}
	return nil
}

func (b *Backend) Mul(dst, x, y runtime.Tensor) error {
	t, err := b.nonNil("mul", dst, x, y)
	if err != nil {
		return err
	}
	if err := sameLen("mul", t...); err != nil {
		return err
	}
	if n := t[0].numel(); n > 0 {
		return b.launch(kMul, vecDims(n, b.sms), tp(t[0]), tp(t[1]), tp(t[2]), i64(n))
	}
	return nil
}

// kernelAct refuses activation kinds the kernels do not know (their switch
// would pass them through as identity), by name and as unsupported (exit
// 4): Tanh, SELU, CELU, Softplus and Mish run on the CPU backend only.
func kernelAct(act runtime.Act) error {
	if act.Kind > runtime.ActGELU {
		return failure.Unsupportedf("cuda: activation %s (kind %d) has no CUDA kernel yet; run with --device cpu", act, int(act.Kind))
	}
	return nil
}

func (b *Backend) Activation(dst, src runtime.Tensor, act runtime.Act) error {
	if err := kernelAct(act); err != nil {
		return err
	}
	t, err := b.nonNil("activation", dst, src)
	if err != nil {
		return err
	}
	if err := sameLen("activation", t...); err != nil {
		return err
	}
	if n := t[0].numel(); n > 0 {
		return b.launch(kAct, vecDims(n, b.sms), tp(t[0]), tp(t[1]), i64(n), i32(int(act.Kind)), f32(float32(act.Param)), f32(float32(act.Param2)))
	}
	return nil
}

func (b *Backend) ActivationBackward(dx, dy, saved runtime.Tensor, act runtime.Act, fromOutput bool) error {
	if err := kernelAct(act); err != nil {
		return err
	}
	t, err := b.nonNil("activation backward", dx, dy, saved)
	if err != nil {
		return err
	}
	if err := sameLen("activation backward", t...); err != nil {
		return err
	}
	if n := t[0].numel(); n > 0 {
		return b.launch(kActBwd, vecDims(n, b.sms), tp(t[0]), tp(t[1]), tp(t[2]), i64(n),
			i32(int(act.Kind)), f32(float32(act.Param)), f32(float32(act.Param2)), boolArg(fromOutput))
	}
	return nil
}

func (b *Backend) DropoutMask(mask runtime.Tensor, p float64, seed uint64) error {
	t, err := b.nonNil("dropout mask", mask)
	if err != nil {
		return err
	}
	n := t[0].numel()
	if n == 0 {
		return nil
	}
	if !(p < 1) {
		return b.dev.memset32(t[0].ptr, 0, n)
	}
	return b.launch(kDropout, loopDims(n, b.sms), tp(t[0]), i64(n), u64(seed), f64(p), f32(float32(1/(1-p))))
}

// planes returns n (the leading dimension), the channel count and the
// size of each channel's plane, as the CPU backend reads a shape.
func planes(shape []int) (n, c, hw int) {
	if len(shape) == 0 {
		return 1, 1, 1
	}
	n, c, hw = shape[0], 1, 1
	if len(shape) > 1 {
		c = shape[1]
	}
	for _, d := range shape[2:] {
		hw *= d
	}
	return n, c, hw
}

func (b *Backend) Concat(dst runtime.Tensor, srcs ...runtime.Tensor) error {
	return b.slices(dst, srcs, true)
}

func (b *Backend) Split(src runtime.Tensor, dsts ...runtime.Tensor) error {
	return b.slices(src, dsts, false)
}

// slices copies parts into whole (join) or whole into parts, along
// dimension 1, one launch per part.
func (b *Backend) slices(whole runtime.Tensor, parts []runtime.Tensor, join bool) error {
	t, err := b.nonNil("concat", append([]runtime.Tensor{whole}, parts...)...)
	if err != nil {
		return err
	}
	n, cw, hw := planes(t[0].shape)
	total := 0
	for _, p := range t[1:] {
		pn, pc, phw := planes(p.shape)
		if pn != n || phw != hw {
			return fmt.Errorf("cuda: concat: part %v does not fit %v", p.shape, t[0].shape)
		}
		total += pc
	}
	if total != cw {
		return fmt.Errorf("cuda: concat: parts have %d channels, the whole %d", total, cw)
	}
	// float4 units when every block and offset is a multiple of 4 floats,
	// which a plane size of a multiple of 4 guarantees.
	unit := int64(1)
	if hw%4 == 0 {
		unit = 4
	}
	offset := int64(0)
	for _, p := range t[1:] {
		_, pc, _ := planes(p.shape)
		partLen, wholeLen := int64(pc)*int64(hw)/unit, int64(cw)*int64(hw)/unit
		if partLen > 0 && n > 0 {
			div, err := newFastDiv(int(min(partLen, 1<<31)))
			if err != nil {
				return err
			}
			runs, err := chunks(n, partLen, maxUnits)
			if err != nil {
				return fmt.Errorf("cuda: concat of %v: %w", p.shape, err)
			}
			for _, r := range runs {
				units := int64(r[1]-r[0]) * partLen
				// Offsets in floats to the run's first image.
				wp := t[0].at(int64(r[0]) * wholeLen * unit)
				pp := p.at(int64(r[0]) * partLen * unit)
				if err := b.launch(kSlices, loopDims(units, b.sms), ptr(wp), ptr(pp), i64(units), i64(partLen), i64(wholeLen),
					i64(offset), u32(div.m), u32(div.s), boolArg(unit == 4), boolArg(join)); err != nil {
					return err
				}
			}
		}
		offset += int64(pc) * int64(hw) / unit
	}
	return nil
}
