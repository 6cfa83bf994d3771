package emit

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// builder makes small graphs the way a format reader would: parameter
// owners named by module path, their keys in a weight store with shapes.
type builder struct {
	g *graph.Graph
	w *graph.MemWeights
	// signs records the sign vector of each flipped layer by module path,
	// for the Python reference computations.
	signs map[string][]int8
}

func newBuilder(arch string, in int) *builder {
	return &builder{g: graph.New(arch, in), w: graph.NewMemWeights(), signs: map[string][]int8{}}
}

func (b *builder) put(node string, role string, shape ...int) string {
	key := node + "." + role
	b.w.Put(key, shape, make([]float64, graph.Numel(shape)))
	return key
}

func (b *builder) conv(name string, in *graph.Value, cout, k, stride, pad, groups int, bias bool) *graph.Value {
	cin := in.Channels
	params := map[string]string{graph.RoleWeight: b.put(name, graph.RoleWeight, cout, cin/groups, k, k)}
	if bias {
		params[graph.RoleBias] = b.put(name, graph.RoleBias, cout)
	}
	v := b.g.Add(name, graph.OpConv, graph.Attr{
		KernelSize: [2]int{k, k}, Stride: [2]int{stride, stride}, Padding: [2]int{pad, pad},
		Dilation: [2]int{1, 1}, Groups: groups, InChannels: cin, OutChannels: cout, Bias: bias,
	}, params, in)
	v.Channels = cout
	return v
}

// norm adds a BN-family node; act is "" for BatchNorm2d.
func (b *builder) norm(op graph.Op, name string, in *graph.Value, act string, param float64) *graph.Value {
	c := in.Channels
	params := map[string]string{
		graph.RoleWeight:      b.put(name, graph.RoleWeight, c),
		graph.RoleBias:        b.put(name, graph.RoleBias, c),
		graph.RoleRunningMean: b.put(name, graph.RoleRunningMean, c),
		graph.RoleRunningVar:  b.put(name, graph.RoleRunningVar, c),
		graph.RoleNumBatches:  b.put(name, graph.RoleNumBatches),
	}
	v := b.g.Add(name, op, graph.Attr{Features: c, Eps: 1e-5, Momentum: 0.1, Activation: act, ActParam: param}, params, in)
	v.Channels = c
	return v
}

// flip gives the node of v a sign vector negating the listed channels.
func (b *builder) flip(v *graph.Value, channels ...int) {
	n := v.Producer
	s := make([]int8, n.Attr.Features)
	for i := range s {
		s[i] = 1
	}
	for _, c := range channels {
		s[c] = -1
	}
	n.Sign = s
	b.signs[n.Name] = s
}

func (b *builder) op(name string, op graph.Op, attr graph.Attr, channels int, ins ...*graph.Value) *graph.Value {
	v := b.g.Add(name, op, attr, nil, ins...)
	v.Channels = channels
	return v
}

func (b *builder) linear(name string, in *graph.Value, out int) *graph.Value {
	v := b.g.Add(name, graph.OpLinear, graph.Attr{InChannels: in.Channels, OutChannels: out, Bias: true},
		map[string]string{
			graph.RoleWeight: b.put(name, graph.RoleWeight, out, in.Channels),
			graph.RoleBias:   b.put(name, graph.RoleBias, out),
		}, in)
	v.Channels = out
	return v
}

func (b *builder) mark(group string, vs ...*graph.Value) {
	for _, v := range vs {
		v.Producer.Recompute = group
	}
}

// convBNAct: conv -> BatchNorm2d -> ReLU, max pool, then a grouped dilated
// conv -> InPlaceABN(elu) -> LeakyReLU.
func convBNAct() *builder {
	b := newBuilder("conv-bn-act", 3)
	x := b.conv("conv1", b.g.Input, 6, 3, 1, 1, 1, true)
	x = b.norm(graph.OpBatchNorm, "bn1", x, "", 0)
	x = b.op("relu1", graph.OpReLU, graph.Attr{}, 6, x)
	x = b.op("pool1", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, 6, x)
	in := x
	x = b.g.Add("conv2", graph.OpConv, graph.Attr{
		KernelSize: [2]int{3, 3}, Stride: [2]int{1, 1}, Padding: [2]int{2, 2}, Dilation: [2]int{2, 2},
		Groups: 2, InChannels: 6, OutChannels: 4,
	}, map[string]string{graph.RoleWeight: b.put("conv2", graph.RoleWeight, 4, 3, 3, 3)}, in)
	x.Channels = 4
	x = b.norm(graph.OpInPlaceABN, "bn2", x, graph.ActELU, 1.0)
	b.op("act2", graph.OpLeakyReLU, graph.Attr{ActParam: 0.2}, 4, x)
	return b
}

// residual: inplace_abn-zoo style blocks under a DataParallel "module."
// prefix: the last norm of a block has the identity activation, the
// shortcut is added, then the activation. Includes a downsample branch with
// InPlaceABNSync, sign flips on a private and on a shared input, and an
// in-place layer whose input is shared (so it must be copied).
func residual() *builder {
	b := newBuilder("resnet-tiny", 3)
	stem := b.conv("module.conv1", b.g.Input, 8, 3, 1, 1, 1, false)
	stem = b.norm(graph.OpInPlaceABN, "module.bn1", stem, graph.ActLeakyReLU, 0.01)

	// layer1.0: identity shortcut.
	x := b.conv("module.layer1.0.conv1", stem, 8, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABN, "module.layer1.0.bn1", x, graph.ActLeakyReLU, 0.01)
	b.flip(x, 0, 3, 7)
	x = b.conv("module.layer1.0.conv2", x, 8, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABN, "module.layer1.0.bn2", x, graph.ActIdentity, 0.01)
	x = b.op("module.layer1.0.add", graph.OpAdd, graph.Attr{}, 8, x, stem)
	blk := b.op("module.layer1.0.act", graph.OpLeakyReLU, graph.Attr{ActParam: 0.01}, 8, x)

	// layer1.1: strided, with a projection shortcut.
	x = b.conv("module.layer1.1.conv1", blk, 6, 3, 2, 1, 1, false)
	x = b.norm(graph.OpInPlaceABNSync, "module.layer1.1.bn1", x, graph.ActLeakyReLU, 0.01)
	x = b.conv("module.layer1.1.conv2", x, 6, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABNSync, "module.layer1.1.bn2", x, graph.ActIdentity, 0.01)
	sc := b.conv("module.layer1.1.downsample.0", blk, 6, 1, 2, 0, 1, false)
	sc = b.norm(graph.OpInPlaceABNSync, "module.layer1.1.downsample.1", sc, graph.ActIdentity, 0.01)
	x = b.op("module.layer1.1.add", graph.OpAdd, graph.Attr{}, 6, x, sc)
	y := b.op("module.layer1.1.relu", graph.OpReLU, graph.Attr{}, 6, x)

	// layer2.0: pre-activation; y feeds the norm and the shortcut, and is a
	// ReLU output (saved by autograd), so the sign flip cannot be in place.
	x = b.norm(graph.OpInPlaceABN, "module.layer2.0.bn1", y, graph.ActLeakyReLU, 0.01)
	b.flip(x, 1, 2)
	x = b.conv("module.layer2.0.conv1", x, 6, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABN, "module.layer2.0.bn2", x, graph.ActLeakyReLU, 0.01)
	x = b.conv("module.layer2.0.conv2", x, 6, 3, 1, 1, 1, false)
	z := b.op("module.layer2.0.add", graph.OpAdd, graph.Attr{}, 6, x, y)

	// layer2.1: the norm's input is also the shortcut: it must be copied.
	x = b.norm(graph.OpInPlaceABN, "module.layer2.1.bn1", z, graph.ActIdentity, 0.01)
	x = b.conv("module.layer2.1.conv1", x, 6, 1, 1, 0, 1, true)
	b.op("module.layer2.1.add", graph.OpAdd, graph.Attr{}, 6, x, z)
	return b
}

// denseNet: a tiny torchvision-style DenseNet with legacy "norm.1" names:
// two dense layers marked for recomputation (concatenation, norm.1, conv.1),
// a sign flip inside the second group, a transition, and a head.
// growth 3, bottleneck 12; the second layer's concatenation is the only
// 13-channel tensor, which the execution test looks for among saved tensors.
func denseNet() *builder {
	b := newBuilder("densenet-tiny", 3)
	x := b.conv("features.conv0", b.g.Input, 10, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABN, "features.norm0", x, graph.ActLeakyReLU, 0.01)
	x = b.op("features.pool0", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, 10, x)
	feats := []*graph.Value{x}
	for i := 1; i <= 2; i++ {
		p := fmt.Sprintf("features.denseblock1.denselayer%d", i)
		c := 0
		for _, f := range feats {
			c += f.Channels
		}
		cat := b.op(p+".cat", graph.OpConcat, graph.Attr{Axis: 1}, c, feats...)
		n1 := b.norm(graph.OpInPlaceABN, p+".norm.1", cat, graph.ActLeakyReLU, 0.01)
		if i == 2 {
			b.flip(n1, 0, 4, 11, 12)
		}
		c1 := b.conv(p+".conv.1", n1, 12, 1, 1, 0, 1, false)
		b.mark(p, cat, n1, c1)
		act := graph.ActLeakyReLU
		if i == 2 {
			act = graph.ActELU
		}
		n2 := b.norm(graph.OpInPlaceABN, p+".norm.2", c1, act, map[string]float64{graph.ActLeakyReLU: 0.01, graph.ActELU: 1}[act])
		feats = append(feats, b.conv(p+".conv.2", n2, 3, 3, 1, 1, 1, false))
	}
	x = b.op("features.denseblock1.cat", graph.OpConcat, graph.Attr{Axis: 1}, 16, feats...)
	x = b.norm(graph.OpInPlaceABN, "features.transition1.norm", x, graph.ActLeakyReLU, 0.01)
	x = b.conv("features.transition1.conv", x, 8, 1, 1, 0, 1, false)
	x = b.op("features.transition1.pool", graph.OpAvgPool, graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}, CountIncludePad: true}, 8, x)
	x = b.norm(graph.OpABN, "features.norm5", x, graph.ActReLU, 0)
	x.Producer.Attr.MomentumNone = true
	x = b.op("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 8, x)
	x = b.op("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, 8, x)
	b.linear("classifier", x, 5)
	return b
}

// abnLinear: ABN(relu), a plain BatchNorm2d without affine parameters and
// with a cumulative average, whose sign flip reads a saved (relu) output,
// then pools, dropout and a Linear head.
func abnLinear() *builder {
	b := newBuilder("abn-linear", 3)
	x := b.conv("body.conv", b.g.Input, 4, 3, 1, 1, 1, true)
	x = b.norm(graph.OpABN, "body.abn", x, graph.ActReLU, 0)
	in := x
	x = b.g.Add("body.bn", graph.OpBatchNorm, graph.Attr{Features: 4, Eps: 1e-3, MomentumNone: true},
		map[string]string{
			graph.RoleRunningMean: b.put("body.bn", graph.RoleRunningMean, 4),
			graph.RoleRunningVar:  b.put("body.bn", graph.RoleRunningVar, 4),
			graph.RoleNumBatches:  b.put("body.bn", graph.RoleNumBatches),
		}, in)
	x.Channels = 4
	b.flip(x, 2)
	x = b.op("body.act", graph.OpELU, graph.Attr{ActParam: 0.5}, 4, x)
	x = b.op("body.pool", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{2, 2}}, 4, x)
	x = b.op("body.avg", graph.OpAvgPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, CeilMode: true}, 4, x)
	x = b.op("head.pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 4, x)
	x = b.op("head.flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, 4, x)
	x = b.op("head.drop", graph.OpDropout, graph.Attr{P: 0.3}, 4, x)
	b.linear("head.fc", x, 3)
	return b
}

// tvResNet18 is torchvision's resnet18, as a format reader would build it
// from its checkpoint: plain BatchNorm2d and ReLU, torchvision's key names.
func tvResNet18() *builder {
	b := newBuilder("resnet18", 3)
	x := b.conv("conv1", b.g.Input, 64, 7, 2, 3, 1, false)
	x = b.norm(graph.OpBatchNorm, "bn1", x, "", 0)
	x = b.op("relu", graph.OpReLU, graph.Attr{}, 64, x)
	x = b.op("maxpool", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, 64, x)
	for i, width := range []int{64, 128, 256, 512} {
		for j := 0; j < 2; j++ {
			p := fmt.Sprintf("layer%d.%d.", i+1, j)
			stride := 1
			if i > 0 && j == 0 {
				stride = 2
			}
			in := x
			y := b.conv(p+"conv1", in, width, 3, stride, 1, 1, false)
			y = b.norm(graph.OpBatchNorm, p+"bn1", y, "", 0)
			y = b.op(p+"relu1", graph.OpReLU, graph.Attr{}, width, y)
			y = b.conv(p+"conv2", y, width, 3, 1, 1, 1, false)
			y = b.norm(graph.OpBatchNorm, p+"bn2", y, "", 0)
			sc := in
			if stride != 1 || in.Channels != width {
				sc = b.conv(p+"downsample.0", in, width, 1, stride, 0, 1, false)
				sc = b.norm(graph.OpBatchNorm, p+"downsample.1", sc, "", 0)
			}
			y = b.op(p+"add", graph.OpAdd, graph.Attr{}, width, y, sc)
			x = b.op(p+"relu2", graph.OpReLU, graph.Attr{}, width, y)
		}
	}
	x = b.op("avgpool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 512, x)
	x = b.op("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, 512, x)
	b.linear("fc", x, 1000)
	return b
}

// tvDenseNet121 is torchvision's densenet121 (plain BatchNorm2d and ReLU);
// with recompute, each dense layer's concatenation, norm1, relu1 and conv1
// form one recompute group, as the rewrite marks them.
func tvDenseNet121(recompute bool) func() *builder {
	return func() *builder {
		b := newBuilder("densenet121", 3)
		x := b.conv("features.conv0", b.g.Input, 64, 7, 2, 3, 1, false)
		x = b.norm(graph.OpBatchNorm, "features.norm0", x, "", 0)
		x = b.op("features.relu0", graph.OpReLU, graph.Attr{}, 64, x)
		x = b.op("features.pool0", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, 64, x)
		for bi, layers := range []int{6, 12, 24, 16} {
			feats := []*graph.Value{x}
			c := x.Channels
			for li := 1; li <= layers; li++ {
				p := fmt.Sprintf("features.denseblock%d.denselayer%d", bi+1, li)
				cat := b.op(p+".cat", graph.OpConcat, graph.Attr{Axis: 1}, c, feats...)
				n1 := b.norm(graph.OpBatchNorm, p+".norm1", cat, "", 0)
				r1 := b.op(p+".relu1", graph.OpReLU, graph.Attr{}, c, n1)
				c1 := b.conv(p+".conv1", r1, 128, 1, 1, 0, 1, false)
				if recompute {
					b.mark(p, cat, n1, r1, c1)
				}
				y := b.norm(graph.OpBatchNorm, p+".norm2", c1, "", 0)
				y = b.op(p+".relu2", graph.OpReLU, graph.Attr{}, 128, y)
				feats = append(feats, b.conv(p+".conv2", y, 32, 3, 1, 1, 1, false))
				c += 32
			}
			x = b.op(fmt.Sprintf("features.denseblock%d.cat", bi+1), graph.OpConcat, graph.Attr{Axis: 1}, c, feats...)
			if bi < 3 {
				p := fmt.Sprintf("features.transition%d", bi+1)
				x = b.norm(graph.OpBatchNorm, p+".norm", x, "", 0)
				x = b.op(p+".relu", graph.OpReLU, graph.Attr{}, c, x)
				x = b.conv(p+".conv", x, c/2, 1, 1, 0, 1, false)
				x = b.op(p+".pool", graph.OpAvgPool, graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}, CountIncludePad: true}, c/2, x)
			}
		}
		x = b.norm(graph.OpBatchNorm, "features.norm5", x, "", 0)
		x = b.op("relu", graph.OpReLU, graph.Attr{}, 1024, x)
		x = b.op("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 1024, x)
		x = b.op("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, 1024, x)
		b.linear("classifier", x, 1000)
		return b
	}
}

// activations: the activations InPlace-ABN cannot invert, as MobileNet,
// EfficientNet and RegNetY use them, and a squeeze-and-excitation gate:
// BN + ReLU6, InPlace-ABN(identity) + SiLU out of place, SE (pool, 1x1
// convs, ReLU, sigmoid, broadcasting Mul), BN + Hardswish, BN + GELU,
// Hardsigmoid in torch's and in ONNX's default form, a Hardtanh, and
// broadcasting Sub, Div and Add.
func activations() *builder {
	b := newBuilder("activations", 3)
	x := b.conv("c1", b.g.Input, 8, 3, 1, 1, 1, false)
	x = b.norm(graph.OpBatchNorm, "b1", x, "", 0)
	x = b.op("a1", graph.OpHardtanh, graph.Attr{ActParam: 0, ActParam2: 6}, 8, x)
	x = b.conv("c2", x, 8, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABN, "b2", x, graph.ActIdentity, 0)
	x = b.op("a2", graph.OpSiLU, graph.Attr{}, 8, x)
	s := b.op("se.pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 8, x)
	s = b.conv("se.fc1", s, 4, 1, 1, 0, 1, true)
	s = b.op("se.relu", graph.OpReLU, graph.Attr{}, 4, s)
	s = b.conv("se.fc2", s, 8, 1, 1, 0, 1, true)
	gate := b.op("se.gate", graph.OpSigmoid, graph.Attr{}, 8, s)
	x = b.op("se.mul", graph.OpMul, graph.Attr{}, 8, x, gate)
	x = b.conv("c3", x, 8, 3, 1, 1, 1, false)
	x = b.norm(graph.OpBatchNorm, "b3", x, "", 0)
	x = b.op("a3", graph.OpHardswish, graph.Attr{}, 8, x)
	x = b.conv("c4", x, 8, 1, 1, 0, 1, false)
	x = b.norm(graph.OpBatchNorm, "b4", x, "", 0)
	x = b.op("a4", graph.OpGELU, graph.Attr{}, 8, x)
	h := b.op("a5", graph.OpHardsigmoid, graph.Attr{ActParam: 1.0 / 6, ActParam2: 0.5}, 8, x)
	h2 := b.op("a6", graph.OpHardsigmoid, graph.Attr{ActParam: 0.2, ActParam2: 0.5}, 8, x)
	x = b.op("sub", graph.OpSub, graph.Attr{}, 8, h, gate)
	x = b.op("div", graph.OpDiv, graph.Attr{}, 8, x, b.op("a7", graph.OpHardtanh, graph.Attr{ActParam: 0.5, ActParam2: 2}, 8, gate))
	b.op("add", graph.OpAdd, graph.Attr{}, 8, x, h2)
	return b
}

// addResidual makes v's InPlaceABN(identity) node add r to its output
// (graph.Node.Residual), as the rewrite does at the end of an inverted
// residual block.
func addResidual(v, r *graph.Value) *graph.Value {
	n := v.Producer
	n.Inputs = append(n.Inputs, r)
	r.Consumers = append(r.Consumers, n)
	return v
}

// invertedResidual: MobileNet-style inverted residual blocks (expand,
// depthwise, project) whose last norm, InPlaceABN(identity), adds the
// block's input itself. Block 1's norm reads a private input and flips
// signs on it in place; block 2's norm has momentum None and reads an input
// that a later Add reads too (so it works on a copy), with a residual that
// is an InPlaceABN output; block 3 is on (N, C), after pooling, its residual
// a view (flatten) of the pooled features.
func invertedResidual() *builder {
	b := newBuilder("inverted-residual", 3)
	stem := b.conv("stem.conv", b.g.Input, 6, 3, 1, 1, 1, false)
	stem = b.norm(graph.OpInPlaceABN, "stem.bn", stem, graph.ActLeakyReLU, 0.01)

	x := b.conv("block1.expand", stem, 12, 1, 1, 0, 1, false)
	x = b.norm(graph.OpInPlaceABN, "block1.bn1", x, graph.ActLeakyReLU, 0.01)
	x = b.conv("block1.dw", x, 12, 3, 1, 1, 12, false)
	x = b.norm(graph.OpInPlaceABN, "block1.bn2", x, graph.ActELU, 1)
	x = b.conv("block1.project", x, 6, 1, 1, 0, 1, false)
	blk := addResidual(b.norm(graph.OpInPlaceABN, "block1.bn3", x, graph.ActIdentity, 0), stem)
	b.flip(blk, 1, 4)

	p := b.conv("block2.project", blk, 6, 1, 1, 0, 1, true)
	x = addResidual(b.norm(graph.OpInPlaceABN, "block2.bn", p, graph.ActIdentity, 0), blk)
	x.Producer.Attr.MomentumNone = true
	x = b.op("block2.tap", graph.OpAdd, graph.Attr{}, 6, x, p)

	x = b.op("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 6, x)
	f := b.op("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, 6, x)
	x = b.linear("block3.fc", f, 6)
	x = addResidual(b.norm(graph.OpInPlaceABN, "block3.bn", x, graph.ActIdentity, 0), f)
	b.linear("head", x, 3)
	return b
}
