package cuda

import (
	"fmt"

	"github.com/abnconvert/abnconvert/runtime"
)

// normShape is an NCHW tensor as the normalisation kernels see it: n
// images of c channels of hw values, in units of vec floats (4 when hw is
// a multiple of 4).
type normShape struct {
	n, c, hw, vec int
	hwDiv         fastDiv // by units per plane
	cDiv          fastDiv // by c
}

func (s normShape) hw4() int { return s.hw / s.vec }

// chanUnits is the units of one channel (bn_stats' loop).
func (s normShape) chanUnits() int64 { return int64(s.n) * int64(s.hw4()) }

func newNormShape(shape []int) (normShape, error) {
	if len(shape) < 2 {
		return normShape{}, fmt.Errorf("cuda: normalisation of shape %v without channels", shape)
	}
	n, c, hw := planes(shape)
	s := normShape{n: n, c: c, hw: hw, vec: 1}
	if hw%4 == 0 {
		s.vec = 4
	}
	if s.chanUnits() > maxUnits {
		return s, fmt.Errorf("cuda: normalisation of %v: %d values per channel, over the %d the kernels take", shape, int64(n)*int64(hw), int64(maxUnits))
	}
	if c > maxGridYZ {
		return s, fmt.Errorf("cuda: normalisation of %v: more than %d channels", shape, maxGridYZ)
	}
	var err error
	if s.hwDiv, err = newFastDiv(max(s.hw4(), 1)); err != nil {
		return s, err
	}
	if s.cDiv, err = newFastDiv(max(c, 1)); err != nil {
		return s, err
	}
	return s, nil
}

// vectors checks that every non-nil tensor has c elements.
func vectors(c int, ts ...*tensor) error {
	for _, t := range ts {
		if t != nil && t.numel() != int64(c) {
			return fmt.Errorf("cuda: normalisation: vector of %d for %d channels", t.numel(), c)
		}
	}
	return nil
}

// partials returns the reduction scratch for c channels of splits blocks.
func (b *Backend) partials(c, splits int) (uint64, error) {
	return b.getScratch(scrPartial, int64(c)*int64(splits)*2*8)
}

func (b *Backend) BatchStats(mean, variance, x, sign runtime.Tensor) error {
	t, err := b.floats(mean, variance, x, sign)
	if err != nil {
		return err
	}
	mt, vt, xt, st := t[0], t[1], t[2], t[3]
	if mt == nil || vt == nil || xt == nil {
		return fmt.Errorf("cuda: batch statistics of a nil tensor")
	}
	s, err := newNormShape(xt.shape)
	if err != nil {
		return err
	}
	if err := vectors(s.c, mt, vt, st); err != nil {
		return err
	}
	if s.c == 0 {
		return nil
	}
	if s.chanUnits() == 0 {
		return fmt.Errorf("cuda: batch statistics of %v: no values per channel", xt.shape)
	}
	splits := splitsFor(s.c, s.chanUnits(), b.sms)
	part, err := b.partials(s.c, splits)
	if err != nil {
		return err
	}
	d, err := reduceDims(s.c, splits)
	if err != nil {
		return err
	}
	if err := b.launch(kBNStats, d, ptr(part), tp(xt), i32(s.n), i32(s.c), i32(s.hw), boolArg(s.vec == 4),
		u32(s.hwDiv.m), u32(s.hwDiv.s), i32(splits)); err != nil {
		return err
	}
	return b.launch(kBNStatsFinal, loopDims(int64(s.c), b.sms), tp(mt), tp(vt), ptr(part), tp(xt), tp(st),
		i32(s.c), i32(s.hw), i32(splits), f64(float64(int64(s.n)*int64(s.hw))))
}

func (b *Backend) UpdateRunning(runMean, runVar, mean, variance runtime.Tensor, factor float64, count int) error {
	t, err := b.nonNil("update running", runMean, runVar, mean, variance)
	if err != nil {
		return err
	}
	if err := sameLen("update running", t...); err != nil {
		return err
	}
	if count < 2 {
		return fmt.Errorf("cuda: running variance from %d values per channel", count)
	}
	c := t[0].numel()
	if c == 0 {
		return nil
	}
	return b.launch(kBNUpdateRunning, loopDims(c, b.sms), tp(t[0]), tp(t[1]), tp(t[2]), tp(t[3]), i32(int(c)),
		f64(factor), f64(float64(count)/float64(count-1)))
}

// apply launches bn_apply or bn_bwd_apply (bwd) over the whole tensor, in
// runs of images that keep each launch's units within fdiv's range.
func (b *Backend) apply(s normShape, bwd bool, mode int, act runtime.Act, coef uint64, dst, u, g *tensor) error {
	perImage := int64(s.c) * int64(s.hw4())
	if perImage == 0 || s.n == 0 {
		return nil
	}
	runs, err := chunks(s.n, perImage, maxUnits)
	if err != nil {
		return fmt.Errorf("cuda: normalisation of %v: %w", u.shape, err)
	}
	for _, r := range runs {
		units := int64(r[1]-r[0]) * perImage
		off := int64(r[0]) * perImage * int64(s.vec)
		common := []arg{i64(units), i32(s.c), u32(s.hwDiv.m), u32(s.hwDiv.s), u32(s.cDiv.m), u32(s.cDiv.s), boolArg(s.vec == 4)}
		if bwd {
			args := append([]arg{ptr(dst.at(off)), ptr(u.at(off)), ptr(g.at(off)), ptr(coef)}, common...)
			args = append(args, i32(mode), i32(int(act.Kind)), f32(float32(act.Param)))
			err = b.launch(kBNBwdApply, loopDims(units, b.sms), args...)
		} else {
			args := append([]arg{ptr(dst.at(off)), ptr(u.at(off)), ptr(coef)}, common...)
			args = append(args, i32(int(act.Kind)), f32(float32(act.Param)))
			err = b.launch(kBNApply, loopDims(units, b.sms), args...)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// normAct refuses the activations bn_apply does not compute: InPlace-ABN's
// are identity, ReLU, leaky ReLU and ELU; the others run as their own op
// after an identity one.
func normAct(act runtime.Act) error {
	if act.Kind > runtime.ActELU {
		return fmt.Errorf("cuda: normalize with %s: the batch-norm kernels apply identity, relu, leaky_relu or elu", act)
	}
	return nil
}

func (b *Backend) Normalize(y, x, sign, mean, variance, weight, bias runtime.Tensor, p runtime.NormParams) error {
	if err := normAct(p.Act); err != nil {
		return err
	}
	t, err := b.floats(y, x, sign, mean, variance, weight, bias)
	if err != nil {
		return err
	}
	yt, xt, st, mt, vt, wt, bt := t[0], t[1], t[2], t[3], t[4], t[5], t[6]
	if yt == nil || xt == nil || mt == nil || vt == nil {
		return fmt.Errorf("cuda: normalize of a nil tensor")
	}
	s, err := newNormShape(xt.shape)
	if err != nil {
		return err
	}
	if err := sameLen("normalize", xt, yt); err != nil {
		return err
	}
	if err := vectors(s.c, st, mt, vt, wt, bt); err != nil {
		return err
	}
	if s.c == 0 || xt.numel() == 0 {
		return nil
	}
	coef, err := b.getScratch(scrCoef, int64(s.c)*16)
	if err != nil {
		return err
	}
	if err := b.launch(kBNCoeffs, loopDims(int64(s.c), b.sms), ptr(coef), tp(st), tp(mt), tp(vt), tp(wt), tp(bt),
		i32(s.c), f64(p.Eps), boolArg(p.AbsWeight)); err != nil {
		return err
	}
	return b.apply(s, false, 0, p.Act, coef, yt, xt, nil)
}

// normBackward is the two backward passes: mode 0 from the input x (center
// is the mean), mode 1 from InPlace-ABN's output z (center is the bias).
func (b *Backend) normBackward(mode int, dx, dweight, dbias, g, u, sign, center, variance, weight runtime.Tensor, p runtime.NormParams, training bool) error {
	t, err := b.floats(dx, dweight, dbias, g, u, sign, center, variance, weight)
	if err != nil {
		return err
	}
	dxt, dwt, dbt, gt, ut, st, ct, vt, wt := t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]
	if gt == nil || ut == nil || vt == nil || (mode == 0 && ct == nil) {
		return fmt.Errorf("cuda: normalize backward of a nil tensor")
	}
	s, err := newNormShape(ut.shape)
	if err != nil {
		return err
	}
	if err := sameLen("normalize backward", ut, gt); err != nil {
		return err
	}
	if dxt != nil {
		if err := sameLen("normalize backward", ut, dxt); err != nil {
			return err
		}
	}
	if err := vectors(s.c, dwt, dbt, st, ct, vt, wt); err != nil {
		return err
	}
	if s.c == 0 {
		return nil
	}
	splits := splitsFor(s.c, s.chanUnits(), b.sms)
	part, err := b.partials(s.c, splits)
	if err != nil {
		return err
	}
	coef, err := b.getScratch(scrCoef, int64(s.c)*16)
	if err != nil {
		return err
	}
	act := p.Act
	if mode == 0 {
		act = runtime.Act{}
	}
	d, err := reduceDims(s.c, splits)
	if err != nil {
		return err
	}
	if err := b.launch(kBNBwdReduce, d, ptr(part), tp(ut), tp(gt), tp(st), tp(ct), i32(s.n), i32(s.c), i32(s.hw), boolArg(s.vec == 4),
		u32(s.hwDiv.m), u32(s.hwDiv.s), i32(splits), i32(mode), i32(int(act.Kind)), f32(float32(act.Param))); err != nil {
		return err
	}
	if err := b.launch(kBNBwdFinal, loopDims(int64(s.c), b.sms), ptr(coef), tp(dwt), tp(dbt), ptr(part), tp(st), tp(ct), tp(vt), tp(wt),
		i32(s.c), i32(splits), f64(float64(s.chanUnits()*int64(s.vec))), f64(p.Eps), boolArg(p.AbsWeight), i32(mode), boolArg(training)); err != nil {
		return err
	}
	if dxt == nil {
		return nil
	}
	return b.apply(s, true, mode, act, coef, dxt, ut, gt)
}

func (b *Backend) NormalizeBackward(dx, dweight, dbias, dy, x, sign, mean, variance, weight runtime.Tensor, p runtime.NormParams, training bool) error {
	if p.Act.Kind != runtime.ActIdentity {
		return fmt.Errorf("cuda: normalize backward from the input takes an identity activation, not %s", p.Act)
	}
	return b.normBackward(0, dx, dweight, dbias, dy, x, sign, mean, variance, weight, p, training)
}

func (b *Backend) NormalizeBackwardFromOutput(dx, dweight, dbias, dz, z, sign, variance, weight, bias runtime.Tensor, p runtime.NormParams, training bool) error {
	if err := normAct(p.Act); err != nil {
		return err
	}
	switch {
	case p.Act.Kind == runtime.ActReLU:
		return fmt.Errorf("cuda: relu is not invertible: InPlace-ABN's backward cannot recover its input")
	case p.Act.Kind != runtime.ActIdentity && !(p.Act.Param > 0):
		return fmt.Errorf("cuda: %s is not invertible", p.Act)
	}
	return b.normBackward(1, dx, dweight, dbias, dz, z, sign, bias, variance, weight, p, training)
}
