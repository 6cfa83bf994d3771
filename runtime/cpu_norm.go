package runtime

import (
	"fmt"
	"math"
)

// channelIter calls fn with each (image, channel) plane of an NCHW tensor's
// data for channel ch.
func channelIter(n, c, hw, ch int, fn func(off int)) {
	for i := 0; i < n; i++ {
		fn((i*c + ch) * hw)
	}
}

// signOf returns the sign of channel ch (1 without a sign vector).
func signOf(sign []float32, ch int) float64 {
	if sign == nil {
		return 1
	}
	return float64(sign[ch])
}

// gammaOf is a channel's scale: the weight, |weight| + eps for InPlace-ABN,
// 1 without weights.
func gammaOf(w []float32, ch int, p NormParams) float64 {
	if w == nil {
		if p.AbsWeight {
			return 1 + p.Eps
		}
		return 1
	}
	if p.AbsWeight {
		return math.Abs(float64(w[ch])) + p.Eps
	}
	return float64(w[ch])
}

func (c *cpu) normArgs(x Tensor, vs ...Tensor) (n, ch, hw int, f [][]float32, done func(), err error) {
	f, done, err = c.floats(append([]Tensor{x}, vs...)...)
	if err != nil {
		return
	}
	n, ch, hw = planes(x.Shape())
	if len(x.Shape()) < 2 {
		err = fmt.Errorf("cpu: normalisation of shape %v without channels", x.Shape())
		return
	}
	for k, v := range f[1:] {
		if vs[k] == nil {
			continue
		}
		if len(v) != ch && len(v) != len(f[0]) {
			err = fmt.Errorf("cpu: normalisation: vector of %d for %d channels", len(v), ch)
			return
		}
	}
	return
}

func (c *cpu) BatchStats(mean, variance, x, sign Tensor) error {
	n, ch, hw, f, done, err := c.normArgs(x, mean, variance, sign)
	defer done()
	if err != nil {
		return err
	}
	xd, md, vd, sd := f[0], f[1], f[2], f[3]
	count := float64(n * hw)
	c.parallel(ch, len(xd), func(lo, hi int) {
		for k := lo; k < hi; k++ {
			var sum float64
			channelIter(n, ch, hw, k, func(off int) { sum += sum64(xd[off : off+hw]) })
			m := sum / count
			var sq float64
			channelIter(n, ch, hw, k, func(off int) { sq += sqDev64(xd[off:off+hw], m) })
			md[k] = float32(m * signOf(sd, k))
			vd[k] = float32(sq / count)
		}
	})
	return nil
}

func (c *cpu) UpdateRunning(runMean, runVar, mean, variance Tensor, factor float64, count int) error {
	f, done, err := c.floats(runMean, runVar, mean, variance)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("update running", f...); err != nil {
		return err
	}
	if count < 2 {
		return fmt.Errorf("cpu: running variance from %d values per channel", count)
	}
	unbias := float64(count) / float64(count-1)
	rm, rv, m, v := f[0], f[1], f[2], f[3]
	for k := range rm {
		rm[k] = float32((1-factor)*float64(rm[k]) + factor*float64(m[k]))
		rv[k] = float32((1-factor)*float64(rv[k]) + factor*float64(v[k])*unbias)
	}
	return nil
}

func (c *cpu) Normalize(y, x, sign, mean, variance, weight, bias Tensor, p NormParams) error {
	n, ch, hw, f, done, err := c.normArgs(x, y, sign, mean, variance, weight, bias)
	defer done()
	if err != nil {
		return err
	}
	if err := sameLen("normalize", f[0], f[1]); err != nil {
		return err
	}
	xd, yd, sd, md, vd, wd, bd := f[0], f[1], f[2], f[3], f[4], f[5], f[6]
	c.parallel(ch, len(xd), func(lo, hi int) {
		for k := lo; k < hi; k++ {
			invstd := 1 / math.Sqrt(float64(vd[k])+p.Eps)
			scale := gammaOf(wd, k, p) * invstd
			shift := -float64(md[k]) * scale
			if bd != nil {
				shift += float64(bd[k])
			}
			s32, b32 := float32(scale*signOf(sd, k)), float32(shift)
			channelIter(n, ch, hw, k, func(off int) {
				src, dst := xd[off:off+hw], yd[off:off+hw]
				for j, v := range src {
					dst[j] = v*s32 + b32
				}
				if p.Act.Kind != ActIdentity {
					activate(dst, dst, p.Act)
				}
			})
		}
	})
	return nil
}

func (c *cpu) NormalizeBackward(dx, dweight, dbias, dy, x, sign, mean, variance, weight Tensor, p NormParams, training bool) error {
	if p.Act.Kind != ActIdentity {
		return fmt.Errorf("cpu: normalize backward from the input takes an identity activation, not %s", p.Act)
	}
	n, ch, hw, f, done, err := c.normArgs(x, dx, dweight, dbias, dy, sign, mean, variance, weight)
	defer done()
	if err != nil {
		return err
	}
	xd, dxd, dwd, dbd, dyd, sd, md, vd, wd := f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8]
	if err := sameLen("normalize backward", xd, dyd); err != nil {
		return err
	}
	count := float64(n * hw)
	c.parallel(ch, len(xd), func(lo, hi int) {
		for k := lo; k < hi; k++ {
			s := signOf(sd, k)
			invstd := 1 / math.Sqrt(float64(vd[k])+p.Eps)
			m := float64(md[k])
			var sumDy, sumDyXhat float64
			channelIter(n, ch, hw, k, func(off int) {
				a, b := dotSums(xd[off:off+hw], dyd[off:off+hw], s, m, invstd)
				sumDy += a
				sumDyXhat += b
			})
			if dbd != nil {
				dbd[k] = float32(sumDy)
			}
			if dwd != nil {
				dw := sumDyXhat
				if p.AbsWeight {
					dw *= signum(float64(wd[k]))
				}
				dwd[k] = float32(dw)
			}
			if dxd == nil {
				continue
			}
			scale := gammaOf(wd, k, p) * invstd * s
			mDy, mDyXhat := 0.0, 0.0
			if training {
				mDy, mDyXhat = sumDy/count, sumDyXhat/count
			}
			// dx = scale*(dy - mDy - xhat*mDyXhat) with xhat = (s*x - m)*invstd,
			// folded into dx = a*dy + b*x + c in float32.
			a := float32(scale)
			b := float32(-scale * mDyXhat * s * invstd)
			cc := float32(scale * (-mDy + m*invstd*mDyXhat))
			channelIter(n, ch, hw, k, func(off int) {
				xs, gs, ds := xd[off:off+hw], dyd[off:off+hw], dxd[off:off+hw]
				for j, v := range xs {
					ds[j] = a*gs[j] + b*v + cc
				}
			})
		}
	})
	return nil
}

// sum64 sums v in float64 with four partial sums, so that additions do not
// wait on one another.
func sum64(v []float32) float64 {
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(v); i += 4 {
		s0 += float64(v[i])
		s1 += float64(v[i+1])
		s2 += float64(v[i+2])
		s3 += float64(v[i+3])
	}
	for ; i < len(v); i++ {
		s0 += float64(v[i])
	}
	return (s0 + s1) + (s2 + s3)
}

// sqDev64 is the sum of (v - m)² in float64, four partial sums.
func sqDev64(v []float32, m float64) float64 {
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(v); i += 4 {
		d0, d1, d2, d3 := float64(v[i])-m, float64(v[i+1])-m, float64(v[i+2])-m, float64(v[i+3])-m
		s0 += d0 * d0
		s1 += d1 * d1
		s2 += d2 * d2
		s3 += d3 * d3
	}
	for ; i < len(v); i++ {
		d := float64(v[i]) - m
		s0 += d * d
	}
	return (s0 + s1) + (s2 + s3)
}

// dotSums returns Σg and Σg·(s·x - m)·invstd in float64, two partial sums
// each.
func dotSums(x, g []float32, s, m, invstd float64) (sumG, sumGX float64) {
	g = g[:len(x)]
	var a0, a1, b0, b1 float64
	i := 0
	for ; i+2 <= len(x); i += 2 {
		g0, g1 := float64(g[i]), float64(g[i+1])
		a0 += g0
		a1 += g1
		b0 += g0 * (s*float64(x[i]) - m)
		b1 += g1 * (s*float64(x[i+1]) - m)
	}
	for ; i < len(x); i++ {
		g0 := float64(g[i])
		a0 += g0
		b0 += g0 * (s*float64(x[i]) - m)
	}
	return a0 + a1, (b0 + b1) * invstd
}

// signum is torch.sign: -1, 0 or 1.
func signum(v float64) float64 {
	switch {
	case v > 0:
		return 1
	case v < 0:
		return -1
	}
	return 0
}

// invert undoes an InPlace-ABN activation: from the output z and its
// gradient dz it returns the pre-activation y and its gradient dy.
func invert(z, dz float64, act Act) (y, dy float64) {
	if z >= 0 {
		return z, dz
	}
	switch act.Kind {
	case ActLeakyReLU:
		return z / act.Param, dz * act.Param
	case ActELU:
		return math.Log1p(z / act.Param), dz * (z + act.Param)
	}
	return z, dz
}

func (c *cpu) NormalizeBackwardFromOutput(dx, dweight, dbias, dz, z, sign, variance, weight, bias Tensor, p NormParams, training bool) error {
	switch {
	case p.Act.Kind == ActReLU:
		return fmt.Errorf("cpu: relu is not invertible: InPlace-ABN's backward cannot recover its input")
	case p.Act.Kind != ActIdentity && !(p.Act.Param > 0):
		return fmt.Errorf("cpu: %s is not invertible", p.Act)
	}
	n, ch, hw, f, done, err := c.normArgs(z, dx, dweight, dbias, dz, sign, variance, weight, bias)
	defer done()
	if err != nil {
		return err
	}
	zd, dxd, dwd, dbd, dzd, sd, vd, wd, bd := f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8]
	if err := sameLen("normalize backward", zd, dzd); err != nil {
		return err
	}
	count := float64(n * hw)
	c.parallel(ch, len(zd), func(lo, hi int) {
		for k := lo; k < hi; k++ {
			gamma := gammaOf(wd, k, p)
			beta := 0.0
			if bd != nil {
				beta = float64(bd[k])
			}
			var sumDy, sumDyXhat float64
			channelIter(n, ch, hw, k, func(off int) {
				zs, gs := zd[off:off+hw], dzd[off:off+hw]
				for j, v := range zs {
					y, dy := invert(float64(v), float64(gs[j]), p.Act)
					sumDy += dy
					sumDyXhat += dy * (y - beta) / gamma
				}
			})
			if dbd != nil {
				dbd[k] = float32(sumDy)
			}
			if dwd != nil {
				dw := sumDyXhat
				if p.AbsWeight {
					dw *= signum(float64(wd[k]))
				}
				dwd[k] = float32(dw)
			}
			if dxd == nil {
				continue
			}
			scale := gamma / math.Sqrt(float64(vd[k])+p.Eps) * signOf(sd, k)
			mDy, mDyXhat := 0.0, 0.0
			if training {
				mDy, mDyXhat = sumDy/count, sumDyXhat/count
			}
			channelIter(n, ch, hw, k, func(off int) {
				zs, gs, ds := zd[off:off+hw], dzd[off:off+hw], dxd[off:off+hw]
				for j, v := range zs {
					y, dy := invert(float64(v), float64(gs[j]), p.Act)
					xhat := (y - beta) / gamma
					ds[j] = float32(scale * (dy - mDy - xhat*mDyXhat))
				}
			})
		}
	})
	return nil
}
