package runtime

import "math"

// activateSmooth applies the activations InPlace-ABN cannot invert, with
// PyTorch 1.13's formulas (computed in float64, rounded once).
func activateSmooth(d, s []float32, act Act) {
	if act.Kind == ActSiLU {
		silu(d, s)
		return
	}
	lo, hi := act.Param, act.Param2
	for k, v := range s {
		x := float64(v)
		var y float64
		switch act.Kind {
		case ActHardtanh:
			// min(max(x, lo), hi), NaN kept as PyTorch's clamp does.
			y = x
			if x < lo {
				y = lo
			} else if x > hi {
				y = hi
			}
		case ActSigmoid:
			y = sigmoid(x)
		case ActHardsigmoid:
			y = min(max(act.Param*x+act.Param2, 0), 1)
			if x != x {
				y = x
			}
		case ActHardswish:
			y = x * min(max(x+3, 0), 6) / 6
		case ActGELU:
			y = 0.5 * x * (1 + math.Erf(x/math.Sqrt2))
		case ActTanh:
			y = math.Tanh(x)
		case ActSELU:
			y = seluScale * x
			if !(x > 0) {
				y = seluScale * seluAlpha * math.Expm1(x)
			}
		case ActCELU:
			// elu(x, alpha, scale 1, input_scale 1/alpha).
			y = x
			if !(x > 0) {
				y = act.Param * math.Expm1(x/act.Param)
			}
		case ActSoftplus:
			// softplus: linear above the threshold (of beta*x).
			y = x
			if !(x*act.Param > act.Param2) {
				y = math.Log1p(math.Exp(x*act.Param)) / act.Param
			}
		case ActMish:
			y = x * math.Tanh(math.Log1p(math.Exp(x)))
		}
		d[k] = float32(y)
	}
}

// activateSmoothBackward writes d = g * act'(x); s is the input x, or for
// Sigmoid and Tanh their output (PyTorch keeps the output of sigmoid and
// tanh and the input of the others). The branch conventions at the kinks are PyTorch's.
func activateSmoothBackward(d, g, s []float32, act Act) {
	if act.Kind == ActSiLU {
		siluGrad(d, g, s)
		return
	}
	for k, v := range s {
		x, dy := float64(v), float64(g[k])
		var dx float64
		switch act.Kind {
		case ActHardtanh:
			// hardtanh_backward: the gradient passes strictly inside.
			if x > act.Param && x < act.Param2 {
				dx = dy
			}
		case ActSigmoid:
			dx = dy * x * (1 - x)
		case ActHardsigmoid:
			// hardsigmoid_backward passes alpha strictly inside (torch:
			// -3 < x < 3 for its alpha 1/6, beta 1/2).
			if t := act.Param*x + act.Param2; t > 0 && t < 1 {
				dx = dy * act.Param
			}
		case ActHardswish:
			switch {
			case x < -3:
			case x <= 3:
				dx = dy * (x/3 + 0.5)
			default:
				dx = dy
			}
		case ActGELU:
			cdf := 0.5 * (1 + math.Erf(x/math.Sqrt2))
			pdf := math.Exp(-0.5*x*x) / math.Sqrt(2*math.Pi)
			dx = dy * (cdf + x*pdf)
		case ActTanh:
			// tanh_backward from the output.
			dx = dy * (1 - x*x)
		case ActSELU:
			// elu_backward from the input: x <= 0 takes the exponential.
			dx = dy * seluScale
			if x <= 0 {
				dx = dy * seluScale * seluAlpha * math.Exp(x)
			}
		case ActCELU:
			dx = dy
			if x <= 0 {
				dx = dy * math.Exp(x/act.Param)
			}
		case ActSoftplus:
			dx = dy
			if z := math.Exp(x * act.Param); !(x*act.Param > act.Param2) {
				dx = dy * z / (z + 1)
			}
		case ActMish:
			ts := math.Tanh(math.Log1p(math.Exp(x)))
			dx = dy * (ts + x*sigmoid(x)*(1-ts*ts))
		}
		d[k] = float32(dx)
	}
}

// SELU's constants, torch's (the SELU paper's).
const (
	seluAlpha = 1.6732632423543772848170429916717
	seluScale = 1.0507009873554804934193349852946
)

func sigmoid(x float64) float64 {
	if x >= 0 {
		return 1 / (1 + math.Exp(-x))
	}
	e := math.Exp(x)
	return e / (1 + e)
}

// siluScalar is silu one element at a time: x·σ(x) in float64, rounded
// once.
func siluScalar(d, s []float32) {
	for k, v := range s {
		x := float64(v)
		d[k] = float32(x * sigmoid(x))
	}
}

// siluGradScalar is siluGrad one element at a time.
func siluGradScalar(d, g, s []float32) {
	for k, v := range s {
		x := float64(v)
		sg := sigmoid(x)
		d[k] = float32(float64(g[k]) * sg * (1 + x*(1-sg)))
	}
}
