package onnx

import (
	"fmt"
	"math"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// param reports whether input k of n is a decodable parameter, and its
// shape.
func (b *builder) param(n *pb.NodeProto, k int) (*paramSrc, bool) {
	if k >= len(n.Input) || n.Input[k] == "" {
		return nil, false
	}
	p, ok := b.params[n.Input[k]]
	return p, ok
}

func (b *builder) isData(n *pb.NodeProto, k int) bool {
	if k >= len(n.Input) || n.Input[k] == "" {
		return false
	}
	_, ok := b.values[n.Input[k]]
	return ok
}

// unusedFrom reports whether outputs k.. of n are read by nothing.
func (b *builder) unusedFrom(n *pb.NodeProto, k int) bool {
	for ; k < len(n.Output); k++ {
		if o := n.Output[k]; o != "" && b.uses[o] > 0 {
			return false
		}
	}
	return true
}

// modelled maps a node to an IR op, filling info.data and info.params; it
// returns why not where the node must be carried as an opaque node.
func (b *builder) modelled(info *nodeInfo) (graph.Op, graph.Attr, string) {
	n := info.proto
	if d := n.GetDomain(); d != "" && d != "ai.onnx" {
		return "", graph.Attr{}, "custom domain " + d
	}
	if len(n.Output) == 0 || n.Output[0] == "" {
		return "", graph.Attr{}, "no output"
	}
	a := nodeAttrs(n)
	info.params = map[string]int{}
	info.data = nil
	data := func(ks ...int) string {
		for _, k := range ks {
			if !b.isData(n, k) {
				return fmt.Sprintf("input %d is not a computed value", k)
			}
			info.data = append(info.data, k)
		}
		return ""
	}
	arity := func(lo, hi int) string {
		if len(n.Input) < lo || len(n.Input) > hi {
			return fmt.Sprintf("%d inputs", len(n.Input))
		}
		return ""
	}
	unary := func(op graph.Op, attr graph.Attr, names ...string) (graph.Op, graph.Attr, string) {
		if !a.only(names...) {
			return "", attr, "attributes not modelled"
		}
		if why := arity(1, 1); why != "" {
			return "", attr, why
		}
		if !b.unusedFrom(n, 1) {
			return "", attr, "a second output is used"
		}
		if why := data(0); why != "" {
			return "", attr, why
		}
		return op, attr, ""
	}
	if op, ok := graph.ONNXOp(n.GetOpType()); ok {
		// The op table's attribute-free ops: one input, or two computed
		// operands of a broadcasting binary op.
		if !op.IsBinary() {
			return unary(op, graph.Attr{})
		}
		if !a.only() || len(n.Input) != 2 || !b.unusedFrom(n, 1) {
			return "", graph.Attr{}, "not a two-input " + n.GetOpType()
		}
		if why := data(0, 1); why != "" {
			return "", graph.Attr{}, "an operand is a constant"
		}
		return op, graph.Attr{}, ""
	}
	switch n.GetOpType() {
	case "LeakyRelu":
		return unary(graph.OpLeakyReLU, graph.Attr{ActParam: decimal32(a.float("alpha", 0.01))}, "alpha")
	case "Elu":
		return unary(graph.OpELU, graph.Attr{ActParam: decimal32(a.float("alpha", 1))}, "alpha")
	case "Selu":
		// torch exports nn.SELU with ONNX's default alpha and gamma, its
		// own constants rounded to float32; other values are another
		// function.
		if a.float("alpha", seluAlpha32) != seluAlpha32 || a.float("gamma", seluGamma32) != seluGamma32 {
			return "", graph.Attr{}, "alpha or gamma other than torch's SELU constants"
		}
		return unary(graph.OpSELU, graph.Attr{}, "alpha", "gamma")
	case "Celu":
		alpha := decimal32(a.float("alpha", 1))
		if alpha == 0 {
			return "", graph.Attr{}, "alpha 0"
		}
		return unary(graph.OpCELU, graph.Attr{ActParam: alpha}, "alpha")
	case "Softplus":
		// ONNX's Softplus has no threshold: torch's default 20 gives the
		// same float32 values (above it log1p(exp(-x)) is below x's
		// rounding), and torch exports nn.Softplus(beta=1) as this node.
		return unary(graph.OpSoftplus, graph.Attr{ActParam: 1, ActParam2: 20})
	case "GlobalAveragePool":
		return unary(graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}})
	case "HardSigmoid":
		return unary(graph.OpHardsigmoid, graph.Attr{ActParam: hardSigmoidAlpha(a.float("alpha", 0.2)), ActParam2: decimal32(a.float("beta", 0.5))}, "alpha", "beta")
	case "Clip":
		return b.clip(info, a, data)
	case "ReduceMean":
		return b.reduceMean(info, a, data)
	case "Flatten":
		if a.int("axis", 1) != 1 {
			return "", graph.Attr{}, "Flatten with axis other than 1 also collapses the batch dimension"
		}
		return unary(graph.OpFlatten, graph.Attr{StartDim: 1}, "axis")
	case "Add":
		if !a.only() || len(n.Input) != 2 || !b.unusedFrom(n, 1) {
			return "", graph.Attr{}, "not a two-input Add"
		}
		if why := data(0, 1); why != "" {
			return "", graph.Attr{}, "adds a constant"
		}
		return graph.OpAdd, graph.Attr{}, ""
	case "Concat":
		if _, ok := a["axis"]; !ok || !a.only("axis") || len(n.Input) == 0 || !b.unusedFrom(n, 1) {
			return "", graph.Attr{}, "not a Concat with an axis"
		}
		for k := range n.Input {
			if why := data(k); why != "" {
				return "", graph.Attr{}, "concatenates a constant"
			}
		}
		return graph.OpConcat, graph.Attr{Axis: int(a.int("axis", 0))}, ""
	case "Conv":
		return b.conv(info, a, data)
	case "BatchNormalization":
		return b.batchNorm(info, a, data)
	case "MaxPool", "AveragePool":
		return b.pool(info, a, data)
	case "Gemm":
		return b.gemm(info, a, data)
	case "Reshape":
		return b.reshape(info, a, data)
	case "Dropout":
		return b.dropout(info, a, data)
	case "MatMul":
		return "", graph.Attr{}, "the IR has no MatMul (torch exports nn.Linear on 2-D inputs as Gemm)"
	}
	return "", graph.Attr{}, "not modelled by the IR"
}

// hardSigmoidAlpha is HardSigmoid's alpha, exactly 1/6 when it is the
// float32 nearest 1/6: torch exports its Hardsigmoid (and the gate of its
// Hardswish) so.
// ONNX Selu's default alpha and gamma: torch's SELU constants in float32.
const (
	seluAlpha32 float32 = 1.67326319217681884765625
	seluGamma32 float32 = 1.05070102214813232421875
)

func hardSigmoidAlpha(f float32) float64 {
	if f == float32(1.0/6) {
		return 1.0 / 6
	}
	return decimal32(f)
}

// clip models Clip with both bounds constant and finite as Hardtanh
// (ReLU6 is Clip(0, 6)): attributes before opset 11, inputs since.
func (b *builder) clip(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	if !a.only("min", "max") || len(n.Input) < 1 || len(n.Input) > 3 || !b.unusedFrom(n, 1) {
		return "", graph.Attr{}, "attributes not modelled"
	}
	bound := func(k int, attr string) (float64, string) {
		if _, ok := a[attr]; ok {
			return decimal32(a.float(attr, 0)), ""
		}
		if k >= len(n.Input) || n.Input[k] == "" {
			return 0, "a Clip without both bounds"
		}
		p, ok := b.param(n, k)
		if !ok {
			return 0, "a bound is computed"
		}
		v, err := p.td.values()
		if err != nil || len(v) != 1 {
			return 0, "a bound is not a scalar"
		}
		if math.IsNaN(v[0]) || math.IsInf(v[0], 0) {
			return 0, "a bound is not finite"
		}
		return decimal32(float32(v[0])), ""
	}
	lo, why := bound(1, "min")
	if why != "" {
		return "", graph.Attr{}, why
	}
	hi, why := bound(2, "max")
	if why != "" {
		return "", graph.Attr{}, why
	}
	if !(lo <= hi) {
		return "", graph.Attr{}, fmt.Sprintf("bounds [%g, %g] are empty", lo, hi)
	}
	if why := data(0); why != "" {
		return "", graph.Attr{}, why
	}
	return graph.OpHardtanh, graph.Attr{ActParam: lo, ActParam2: hi}, ""
}

// reduceMean models the mean over H and W with kept dimensions (a
// squeeze-and-excitation squeeze written x.mean((2, 3), keepdim=True)) as
// a 1x1 adaptive average pool: the same values and, in PyTorch, the same
// tensor kept for backward (its input). The runtime checks the input is
// 4-D, which makes axes -2, -1 the same as 2, 3.
func (b *builder) reduceMean(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	if !a.only("axes", "keepdims", "noop_with_empty_axes") || !b.unusedFrom(n, 1) {
		return "", graph.Attr{}, "attributes not modelled"
	}
	if a.int("keepdims", 1) != 1 {
		return "", graph.Attr{}, "keepdims 0 (only the squeeze of squeeze-and-excitation, keepdims 1, is modelled)"
	}
	axes := a.ints("axes")
	if len(n.Input) == 2 && n.Input[1] != "" {
		p, ok := b.param(n, 1)
		if !ok || axes != nil {
			return "", graph.Attr{}, "the axes are computed"
		}
		v, err := p.td.values()
		if err != nil {
			return "", graph.Attr{}, "the axes cannot be read"
		}
		for _, x := range v {
			axes = append(axes, int64(x))
		}
	} else if len(n.Input) != 1 {
		return "", graph.Attr{}, fmt.Sprintf("%d inputs", len(n.Input))
	}
	if len(axes) != 2 || !((axes[0] == 2 && axes[1] == 3) || (axes[0] == -2 && axes[1] == -1)) {
		return "", graph.Attr{}, fmt.Sprintf("a mean over axes %v (only over H and W is modelled)", axes)
	}
	if why := data(0); why != "" {
		return "", graph.Attr{}, why
	}
	return graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, ""
}

// pads2 turns ONNX's [top, left, bottom, right] into PyTorch's symmetric
// (h, w) padding; asymmetric padding has no PyTorch layer equivalent.
func pads2(a attrs) ([2]int, string) {
	p := a.ints("pads")
	switch len(p) {
	case 0:
		return [2]int{}, ""
	case 4:
		if p[0] != p[2] || p[1] != p[3] {
			return [2]int{}, fmt.Sprintf("asymmetric pads %v", p)
		}
		if p[0] < 0 || p[1] < 0 {
			return [2]int{}, fmt.Sprintf("negative pads %v", p)
		}
		return [2]int{int(p[0]), int(p[1])}, ""
	}
	return [2]int{}, fmt.Sprintf("pads %v is not 2-D", p)
}

// pair reads a 2-D attribute list, def where absent.
func pair(a attrs, name string, def int) ([2]int, string) {
	v := a.ints(name)
	switch len(v) {
	case 0:
		return [2]int{def, def}, ""
	case 2:
		if v[0] < 1 || v[1] < 1 {
			return [2]int{}, fmt.Sprintf("%s %v", name, v)
		}
		return [2]int{int(v[0]), int(v[1])}, ""
	}
	return [2]int{}, fmt.Sprintf("%s %v is not 2-D", name, v)
}

func autoPad(a attrs) string {
	switch ap := a.str("auto_pad", "NOTSET"); ap {
	case "NOTSET", "":
		return ""
	case "VALID":
		if p := a.ints("pads"); len(p) > 0 {
			for _, x := range p {
				if x != 0 {
					return "auto_pad VALID with pads"
				}
			}
		}
		return ""
	default:
		return "auto_pad " + ap
	}
}

type dataFn func(ks ...int) string

func (b *builder) conv(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	var attr graph.Attr
	if !a.only("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides") {
		return "", attr, "attributes not modelled"
	}
	if len(n.Input) < 2 || len(n.Input) > 3 || !b.unusedFrom(n, 1) {
		return "", attr, fmt.Sprintf("%d inputs", len(n.Input))
	}
	if why := data(0); why != "" {
		return "", attr, why
	}
	w, ok := b.param(n, 1)
	if !ok {
		return "", attr, "the weight is not a constant"
	}
	ws := w.td.shape
	if len(ws) != 4 {
		return "", attr, fmt.Sprintf("weight of shape %v: not a 2-D convolution", ws)
	}
	if why := autoPad(a); why != "" {
		return "", attr, why
	}
	if ks := a.ints("kernel_shape"); len(ks) > 0 && (len(ks) != 2 || int(ks[0]) != ws[2] || int(ks[1]) != ws[3]) {
		return "", attr, fmt.Sprintf("kernel_shape %v disagrees with weight shape %v", ks, ws)
	}
	var why string
	if attr.Padding, why = pads2(a); why != "" {
		return "", attr, why
	}
	if attr.Stride, why = pair(a, "strides", 1); why != "" {
		return "", attr, why
	}
	if attr.Dilation, why = pair(a, "dilations", 1); why != "" {
		return "", attr, why
	}
	groups := a.int("group", 1)
	if groups < 1 || ws[0]%int(groups) != 0 {
		return "", attr, fmt.Sprintf("group %d", groups)
	}
	attr.KernelSize = [2]int{ws[2], ws[3]}
	attr.Groups = int(groups)
	attr.InChannels = ws[1] * int(groups)
	attr.OutChannels = ws[0]
	info.params[graph.RoleWeight] = 1
	if len(n.Input) == 3 && n.Input[2] != "" {
		bias, ok := b.param(n, 2)
		if !ok {
			return "", attr, "the bias is not a constant"
		}
		if len(bias.td.shape) != 1 || bias.td.shape[0] != ws[0] {
			return "", attr, fmt.Sprintf("bias of shape %v for %d output channels", bias.td.shape, ws[0])
		}
		attr.Bias = true
		info.params[graph.RoleBias] = 2
	}
	return graph.OpConv, attr, ""
}

// bnRoles are BatchNormalization's parameter inputs 1-4, in order.
var bnRoles = []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar}

func (b *builder) batchNorm(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	var attr graph.Attr
	if !a.only("epsilon", "momentum", "training_mode") {
		return "", attr, "attributes not modelled"
	}
	if len(n.Input) != 5 {
		return "", attr, fmt.Sprintf("%d inputs", len(n.Input))
	}
	if !b.unusedFrom(n, 1) {
		// The running-statistics outputs of training mode feed something:
		// the IR's BN has one output.
		return "", attr, "its running-statistics outputs are used"
	}
	if why := data(0); why != "" {
		return "", attr, why
	}
	c := -1
	for k, role := range bnRoles {
		p, ok := b.param(n, k+1)
		if !ok {
			return "", attr, role + " is not a constant"
		}
		if len(p.td.shape) != 1 || (c >= 0 && p.td.shape[0] != c) {
			return "", attr, fmt.Sprintf("%s of shape %v", role, p.td.shape)
		}
		c = p.td.shape[0]
		info.params[role] = k + 1
	}
	attr.Features = c
	attr.Eps = decimal32(a.float("epsilon", 1e-5))
	attr.Momentum = oneMinus32(a.float("momentum", 0.9))
	return graph.OpBatchNorm, attr, ""
}

// CumulativeFactor reports whether momentum, a BatchNormalization's as read
// (1 - its ONNX momentum attribute), is the factor torch writes for a
// BatchNorm2d(momentum=None) whose num_batches_tracked is n at the
// export's train-mode forward: torch's forward adds one to the count and
// takes the factor 1/n as a Python float, and the exporter writes 1 - 1/n
// rounded to float32. A real momentum equal to that value reads the same.
func CumulativeFactor(momentum float64, n int64) bool {
	if n < 1 {
		return false
	}
	return oneMinus32(float32(1-1/float64(n))) == momentum
}

func (b *builder) pool(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	var attr graph.Attr
	max := n.GetOpType() == "MaxPool"
	allowed := []string{"auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides"}
	if max {
		allowed = append(allowed, "storage_order")
	} else {
		allowed = append(allowed, "count_include_pad")
	}
	if !a.only(allowed...) {
		return "", attr, "attributes not modelled"
	}
	if len(n.Input) != 1 || !b.unusedFrom(n, 1) {
		return "", attr, "indices output used"
	}
	if why := data(0); why != "" {
		return "", attr, why
	}
	ks := a.ints("kernel_shape")
	if len(ks) != 2 || ks[0] < 1 || ks[1] < 1 {
		return "", attr, fmt.Sprintf("kernel_shape %v is not 2-D", ks)
	}
	if why := autoPad(a); why != "" {
		return "", attr, why
	}
	var why string
	if attr.Padding, why = pads2(a); why != "" {
		return "", attr, why
	}
	if attr.Stride, why = pair(a, "strides", 1); why != "" {
		return "", attr, why
	}
	dil, why := pair(a, "dilations", 1)
	if why != "" {
		return "", attr, why
	}
	attr.KernelSize = [2]int{int(ks[0]), int(ks[1])}
	attr.CeilMode = a.int("ceil_mode", 0) != 0
	if max {
		if a.int("storage_order", 0) != 0 {
			return "", attr, "storage_order 1"
		}
		attr.Dilation = dil
		return graph.OpMaxPool, attr, ""
	}
	if dil != [2]int{1, 1} {
		return "", attr, "dilated average pooling"
	}
	attr.CountIncludePad = a.int("count_include_pad", 0) != 0
	return graph.OpAvgPool, attr, ""
}

func (b *builder) gemm(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	var attr graph.Attr
	if !a.only("alpha", "beta", "transA", "transB") {
		return "", attr, "attributes not modelled"
	}
	if a.int("transA", 0) != 0 || a.int("transB", 0) != 1 || a.float("alpha", 1) != 1 {
		return "", attr, "not a Linear layer (needs transB=1, transA=0, alpha=1)"
	}
	if len(n.Input) < 2 || len(n.Input) > 3 || !b.unusedFrom(n, 1) {
		return "", attr, fmt.Sprintf("%d inputs", len(n.Input))
	}
	if why := data(0); why != "" {
		return "", attr, why
	}
	w, ok := b.param(n, 1)
	if !ok || len(w.td.shape) != 2 {
		return "", attr, "the weight is not a 2-D constant"
	}
	attr.OutChannels, attr.InChannels = w.td.shape[0], w.td.shape[1]
	info.params[graph.RoleWeight] = 1
	if len(n.Input) == 3 && n.Input[2] != "" {
		if a.float("beta", 1) != 1 {
			return "", attr, "beta other than 1"
		}
		bias, ok := b.param(n, 2)
		if !ok || len(bias.td.shape) != 1 || bias.td.shape[0] != attr.OutChannels {
			return "", attr, "the bias is not a constant of one entry per output"
		}
		attr.Bias = true
		info.params[graph.RoleBias] = 2
	}
	return graph.OpLinear, attr, ""
}

// reshape models Reshape(x, [0, -1]), torch's x.view(x.size(0), -1) with a
// constant shape, as a flatten from dimension 1.
func (b *builder) reshape(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	if !a.only("allowzero") || a.int("allowzero", 0) != 0 || len(n.Input) != 2 {
		return "", graph.Attr{}, "attributes not modelled"
	}
	shape, ok := b.param(n, 1)
	if !ok {
		return "", graph.Attr{}, "the shape is computed"
	}
	v, err := shape.td.values()
	if err != nil || len(v) != 2 || v[0] != 0 || v[1] != -1 {
		return "", graph.Attr{}, "a reshape other than to [0, -1]"
	}
	if why := data(0); why != "" {
		return "", graph.Attr{}, why
	}
	return graph.OpFlatten, graph.Attr{StartDim: 1}, ""
}

func (b *builder) dropout(info *nodeInfo, a attrs, data dataFn) (graph.Op, graph.Attr, string) {
	n := info.proto
	if !a.only("ratio", "seed") {
		return "", graph.Attr{}, "attributes not modelled"
	}
	if !b.unusedFrom(n, 1) {
		return "", graph.Attr{}, "its mask output is used"
	}
	p := float64(0.5)
	if r, ok := a["ratio"]; ok {
		p = decimal32(r.GetF())
	}
	if len(n.Input) > 1 && n.Input[1] != "" {
		r, ok := b.param(n, 1)
		if !ok {
			return "", graph.Attr{}, "the ratio is computed"
		}
		v, err := r.td.values()
		if err != nil || len(v) != 1 {
			return "", graph.Attr{}, "the ratio is not a scalar"
		}
		p = decimal32(float32(v[0]))
	}
	if len(n.Input) > 2 && n.Input[2] != "" {
		if _, ok := b.param(n, 2); !ok {
			return "", graph.Attr{}, "training_mode is computed"
		}
	}
	if len(n.Input) > 3 {
		return "", graph.Attr{}, fmt.Sprintf("%d inputs", len(n.Input))
	}
	if why := data(0); why != "" {
		return "", graph.Attr{}, why
	}
	return graph.OpDropout, graph.Attr{P: p}, ""
}
