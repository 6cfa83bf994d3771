package rewrite

import (
	"fmt"
	"math"

	"github.com/abnconvert/abnconvert/graph"
)

// A float64 reference evaluator for the graphs these tests build: eval mode,
// running statistics, dense loops. It models InPlace-ABN faithfully: the
// layer multiplies its input by Node.Sign and then overwrites it with its
// output, and Flatten and Dropout return views, so a conversion that runs a
// layer in place on a tensor someone else still reads gives wrong numbers
// here, as it would in PyTorch.

type tensor struct {
	shape []int
	data  []float64
}

func newTensor(shape ...int) *tensor {
	return &tensor{shape: append([]int(nil), shape...), data: make([]float64, graph.Numel(shape))}
}

// spatial returns N, C, H, W of a 4-d tensor, or of a 2-d one seen as
// [N, C, 1, 1].
func (t *tensor) spatial() (n, c, h, w int) {
	switch len(t.shape) {
	case 4:
		return t.shape[0], t.shape[1], t.shape[2], t.shape[3]
	case 2:
		return t.shape[0], t.shape[1], 1, 1
	}
	return 0, 0, 0, 0
}

func evaluate(g *graph.Graph, w graph.Weights, x *tensor) (*tensor, error) {
	vals := map[*graph.Value]*tensor{}
	param := func(n *graph.Node, role string) ([]float64, error) {
		key, ok := n.Params[role]
		if !ok {
			return nil, nil
		}
		return w.Values(key)
	}
	for _, n := range g.Nodes {
		var in *tensor
		if len(n.Inputs) > 0 {
			in = vals[n.Inputs[0]]
		}
		var out *tensor
		var err error
		switch n.Op {
		case graph.OpInput:
			out = &tensor{shape: x.shape, data: append([]float64(nil), x.data...)}
		case graph.OpConv:
			out, err = conv2d(n, in, param)
		case graph.OpLinear:
			out, err = linear(n, in, param)
		case graph.OpBatchNorm, graph.OpABN, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
			out, err = batchNorm(n, in, param)
			if r := n.Residual(); r != nil && err == nil {
				if len(vals[r].data) != len(out.data) {
					return nil, fmt.Errorf("%s: adding residual %v to %v", n.Name, vals[r].shape, out.shape)
				}
				for k, v := range vals[r].data {
					out.data[k] += v
				}
			}
		case graph.OpReLU:
			out = mapTensor(in, func(v float64) float64 { return math.Max(v, 0) })
		case graph.OpLeakyReLU:
			out = mapTensor(in, func(v float64) float64 { return leaky(v, n.Attr.ActParam) })
		case graph.OpELU:
			out = mapTensor(in, func(v float64) float64 { return elu(v, n.Attr.ActParam) })
		case graph.OpAdd:
			out = mapTensor(in, func(v float64) float64 { return v })
			for _, v := range n.Inputs[1:] {
				o := vals[v]
				if len(o.data) != len(out.data) {
					return nil, fmt.Errorf("%s: adding %v to %v", n.Name, o.shape, out.shape)
				}
				for i := range out.data {
					out.data[i] += o.data[i]
				}
			}
		case graph.OpConcat:
			var parts []*tensor
			for _, v := range n.Inputs {
				parts = append(parts, vals[v])
			}
			out, err = concat(parts)
		case graph.OpMaxPool, graph.OpAvgPool:
			out = pool(n, in)
		case graph.OpAdaptiveAvgPool:
			out = adaptiveAvg(n, in)
		case graph.OpFlatten:
			nn, c, h, ww := in.spatial()
			out = &tensor{shape: []int{nn, c * h * ww}, data: in.data} // a view
		case graph.OpDropout:
			out = in // eval mode: the same tensor
		default:
			return nil, fmt.Errorf("evaluator: no %s (%s)", n.Op, n.Name)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", n.Name, err)
		}
		vals[n.Out] = out
	}
	return vals[g.Output], nil
}

func mapTensor(t *tensor, f func(float64) float64) *tensor {
	out := newTensor(t.shape...)
	for i, v := range t.data {
		out.data[i] = f(v)
	}
	return out
}

func leaky(v, a float64) float64 {
	if v >= 0 {
		return v
	}
	return v * a
}

func elu(v, a float64) float64 {
	if v >= 0 {
		return v
	}
	return a * math.Expm1(v)
}

func or1(v int) int {
	if v == 0 {
		return 1
	}
	return v
}

func conv2d(n *graph.Node, in *tensor, param func(*graph.Node, string) ([]float64, error)) (*tensor, error) {
	wt, err := param(n, graph.RoleWeight)
	if err != nil {
		return nil, err
	}
	bias, err := param(n, graph.RoleBias)
	if err != nil {
		return nil, err
	}
	a := n.Attr
	N, C, H, W := in.spatial()
	groups := or1(a.Groups)
	kh, kw := a.KernelSize[0], a.KernelSize[1]
	sh, sw := or1(a.Stride[0]), or1(a.Stride[1])
	dh, dw := or1(a.Dilation[0]), or1(a.Dilation[1])
	ph, pw := a.Padding[0], a.Padding[1]
	O := a.OutChannels
	if C != a.InChannels || len(wt) != O*(C/groups)*kh*kw {
		return nil, fmt.Errorf("conv shapes: input %v, %d weights", in.shape, len(wt))
	}
	OH := (H+2*ph-dh*(kh-1)-1)/sh + 1
	OW := (W+2*pw-dw*(kw-1)-1)/sw + 1
	out := newTensor(N, O, OH, OW)
	cg, og := C/groups, O/groups
	for b := 0; b < N; b++ {
		for o := 0; o < O; o++ {
			gi := o / og
			for y := 0; y < OH; y++ {
				for x := 0; x < OW; x++ {
					s := 0.0
					if bias != nil {
						s = bias[o]
					}
					for ci := 0; ci < cg; ci++ {
						c := gi*cg + ci
						for i := 0; i < kh; i++ {
							yy := y*sh - ph + i*dh
							if yy < 0 || yy >= H {
								continue
							}
							for j := 0; j < kw; j++ {
								xx := x*sw - pw + j*dw
								if xx < 0 || xx >= W {
									continue
								}
								s += wt[((o*cg+ci)*kh+i)*kw+j] * in.data[((b*C+c)*H+yy)*W+xx]
							}
						}
					}
					out.data[((b*O+o)*OH+y)*OW+x] = s
				}
			}
		}
	}
	return out, nil
}

func linear(n *graph.Node, in *tensor, param func(*graph.Node, string) ([]float64, error)) (*tensor, error) {
	wt, err := param(n, graph.RoleWeight)
	if err != nil {
		return nil, err
	}
	bias, err := param(n, graph.RoleBias)
	if err != nil {
		return nil, err
	}
	N, F := in.shape[0], len(in.data)/in.shape[0]
	O := n.Attr.OutChannels
	if len(wt) != O*F {
		return nil, fmt.Errorf("linear: %d weights for %d->%d", len(wt), F, O)
	}
	out := newTensor(N, O)
	for b := 0; b < N; b++ {
		for o := 0; o < O; o++ {
			s := 0.0
			if bias != nil {
				s = bias[o]
			}
			for f := 0; f < F; f++ {
				s += wt[o*F+f] * in.data[b*F+f]
			}
			out.data[b*O+o] = s
		}
	}
	return out, nil
}

// batchNorm evaluates the BN family in eval mode. BatchNorm2d and ABN scale
// by the weight as stored; InPlace-ABN by |weight| + eps, after flipping its
// input by Sign, and it writes over its input.
func batchNorm(n *graph.Node, in *tensor, param func(*graph.Node, string) ([]float64, error)) (*tensor, error) {
	var vecs [4][]float64
	for i, role := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
		v, err := param(n, role)
		if err != nil {
			return nil, err
		}
		vecs[i] = v
	}
	gamma, beta, mean, variance := vecs[0], vecs[1], vecs[2], vecs[3]
	N, C, H, W := in.spatial()
	if len(gamma) != C {
		return nil, fmt.Errorf("bn: %d gammas for %d channels", len(gamma), C)
	}
	eps := n.Attr.Eps
	inPlace := n.Op == graph.OpInPlaceABN || n.Op == graph.OpInPlaceABNSync
	out := in
	if !inPlace {
		out = newTensor(in.shape...)
	}
	act := func(v float64) float64 { return v }
	if n.Op != graph.OpBatchNorm {
		switch n.Attr.Activation {
		case graph.ActReLU:
			if inPlace {
				return nil, fmt.Errorf("InPlaceABN cannot run relu")
			}
			act = func(v float64) float64 { return math.Max(v, 0) }
		case graph.ActLeakyReLU:
			act = func(v float64) float64 { return leaky(v, n.Attr.ActParam) }
		case graph.ActELU:
			act = func(v float64) float64 { return elu(v, n.Attr.ActParam) }
		case graph.ActIdentity:
		default:
			return nil, fmt.Errorf("unknown activation %q", n.Attr.Activation)
		}
	}
	for c := 0; c < C; c++ {
		scale := gamma[c]
		if inPlace {
			scale = math.Abs(gamma[c]) + eps
		}
		sign := 1.0
		if n.Sign != nil {
			sign = float64(n.Sign[c])
		}
		inv := 1 / math.Sqrt(variance[c]+eps)
		for b := 0; b < N; b++ {
			for i := 0; i < H*W; i++ {
				k := (b*C+c)*H*W + i
				v := in.data[k] * sign
				if inPlace {
					in.data[k] = v // the in-place flip
				}
				out.data[k] = act((v-mean[c])*inv*scale + beta[c])
			}
		}
	}
	return out, nil
}

func concat(parts []*tensor) (*tensor, error) {
	N, _, H, W := parts[0].spatial()
	C := 0
	for _, p := range parts {
		n, c, h, w := p.spatial()
		if n != N || h != H || w != W {
			return nil, fmt.Errorf("concat of %v and %v", parts[0].shape, p.shape)
		}
		C += c
	}
	out := newTensor(N, C, H, W)
	for b := 0; b < N; b++ {
		off := 0
		for _, p := range parts {
			_, c, _, _ := p.spatial()
			copy(out.data[(b*C+off)*H*W:(b*C+off+c)*H*W], p.data[b*c*H*W:(b+1)*c*H*W])
			off += c
		}
	}
	return out, nil
}

// poolSize is PyTorch's output size rule, ceil_mode included.
func poolSize(in, k, s, p, d int, ceil bool) int {
	num := in + 2*p - d*(k-1) - 1
	out := num/s + 1
	if ceil {
		out = (num+s-1)/s + 1
		if (out-1)*s >= in+p {
			out--
		}
	}
	return out
}

func pool(n *graph.Node, in *tensor) *tensor {
	a := n.Attr
	N, C, H, W := in.spatial()
	kh, kw := a.KernelSize[0], a.KernelSize[1]
	sh, sw := or1(a.Stride[0]), or1(a.Stride[1])
	ph, pw := a.Padding[0], a.Padding[1]
	dh, dw := 1, 1
	if n.Op == graph.OpMaxPool {
		dh, dw = or1(a.Dilation[0]), or1(a.Dilation[1])
	}
	OH, OW := poolSize(H, kh, sh, ph, dh, a.CeilMode), poolSize(W, kw, sw, pw, dw, a.CeilMode)
	out := newTensor(N, C, OH, OW)
	for b := 0; b < N; b++ {
		for c := 0; c < C; c++ {
			base := (b*C + c) * H * W
			for y := 0; y < OH; y++ {
				for x := 0; x < OW; x++ {
					var v float64
					if n.Op == graph.OpMaxPool {
						v = math.Inf(-1)
						for i := 0; i < kh; i++ {
							for j := 0; j < kw; j++ {
								yy, xx := y*sh-ph+i*dh, x*sw-pw+j*dw
								if yy >= 0 && yy < H && xx >= 0 && xx < W {
									v = math.Max(v, in.data[base+yy*W+xx])
								}
							}
						}
					} else {
						y0, x0 := y*sh-ph, x*sw-pw
						y1, x1 := min(y0+kh, H+ph), min(x0+kw, W+pw)
						size := (y1 - y0) * (x1 - x0)
						y0, x0, y1, x1 = max(y0, 0), max(x0, 0), min(y1, H), min(x1, W)
						if !a.CountIncludePad {
							size = (y1 - y0) * (x1 - x0)
						}
						s := 0.0
						for yy := y0; yy < y1; yy++ {
							for xx := x0; xx < x1; xx++ {
								s += in.data[base+yy*W+xx]
							}
						}
						v = s / float64(size)
					}
					out.data[((b*C+c)*OH+y)*OW+x] = v
				}
			}
		}
	}
	return out
}

func adaptiveAvg(n *graph.Node, in *tensor) *tensor {
	N, C, H, W := in.spatial()
	OH, OW := or1(n.Attr.OutputSize[0]), or1(n.Attr.OutputSize[1])
	out := newTensor(N, C, OH, OW)
	for b := 0; b < N; b++ {
		for c := 0; c < C; c++ {
			base := (b*C + c) * H * W
			for y := 0; y < OH; y++ {
				y0, y1 := y*H/OH, ((y+1)*H+OH-1)/OH
				for x := 0; x < OW; x++ {
					x0, x1 := x*W/OW, ((x+1)*W+OW-1)/OW
					s := 0.0
					for yy := y0; yy < y1; yy++ {
						for xx := x0; xx < x1; xx++ {
							s += in.data[base+yy*W+xx]
						}
					}
					out.data[((b*C+c)*OH+y)*OW+x] = s / float64((y1-y0)*(x1-x0))
				}
			}
		}
	}
	return out
}

// maxAbsDiff compares two evaluator outputs.
func maxAbsDiff(a, b *tensor) float64 {
	if len(a.data) != len(b.data) {
		return math.Inf(1)
	}
	d := 0.0
	for i := range a.data {
		d = math.Max(d, math.Abs(a.data[i]-b.data[i]))
	}
	return d
}
