package model

import (
	"fmt"
	"math"
	"math/big"
	"strings"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// Whole pickled modules become IR in two ways. A torchvision model (ResNet,
// DenseNet, VGG) is recognised from its state dict, as a checkpoint of it
// would be, and must be recognised as its own family; the BN and dropout
// hyper-parameters, which a state dict does not hold, are then taken from
// the modules themselves. An nn.Sequential is a chain: each child, in
// order, becomes one node (a nested Sequential its own chain, Identity
// nothing), with the hyper-parameters its module holds. Anything else has a
// forward the tree does not describe and is refused.

// torchvisionFamily maps the torchvision model classes to their family.
var torchvisionFamily = map[string]string{
	"torchvision.models.resnet.ResNet":     arch.FamilyResNet,
	"torchvision.models.densenet.DenseNet": arch.FamilyDenseNet,
	"torchvision.models.vgg.VGG":           arch.FamilyVGG,
}

const sequentialClass = "torch.nn.modules.container.Sequential"

func moduleGraph(m *pth.Module, w graph.Weights, force string) (*graph.Graph, *arch.Match, error) {
	if fam, ok := torchvisionFamily[m.Class]; ok {
		g, match, err := arch.Recognize(w, force)
		if err != nil {
			return nil, nil, fmt.Errorf("whole pickled %s: %w", m.ShortClass(), err)
		}
		if match.Family != fam {
			return nil, nil, fmt.Errorf("whole pickled %s: its state dict was recognised as %s, another family", m.ShortClass(), match.Arch)
		}
		if err := moduleHyperParams(g, m); err != nil {
			return nil, nil, fmt.Errorf("whole pickled %s: %w", m.ShortClass(), err)
		}
		match.Notes = append(match.Notes, fmt.Sprintf("structure from the pickled %s instance; BN eps and momentum, dropout rates from its modules", m.Class))
		return g, match, nil
	}
	if m.Class != sequentialClass {
		return nil, nil, fmt.Errorf("a whole pickled %s: only nn.Sequential chains and the torchvision ResNet, DenseNet and VGG classes are rebuilt from a pickled module; "+
			"for anything else export the model to ONNX with training=torch.onnx.TrainingMode.PRESERVE and convert its state_dict with --graph model.onnx", m.Class)
	}
	b := &seqBuilder{w: w, used: map[string]bool{}}
	if err := b.chain(m, ""); err != nil {
		return nil, nil, err
	}
	if b.g == nil {
		return nil, nil, fmt.Errorf("the pickled nn.Sequential has no layer with parameters")
	}
	var extra []string
	for _, k := range w.Keys() {
		if !b.used[k] {
			extra = append(extra, k)
		}
	}
	if len(extra) > 0 {
		return nil, nil, fmt.Errorf("the state dict holds tensors no layer of the chain uses: %s", summarize(extra, 6))
	}
	match := &arch.Match{Arch: fmt.Sprintf("nn.Sequential (%d layers)", b.layers), Family: "sequential", Exact: true,
		Notes: []string{"structure from the pickled nn.Sequential: its children applied in order"}}
	b.g.Arch = match.Arch
	return b.g, match, nil
}

// moduleHyperParams sets the BN eps and momentum and the dropout rate of
// every node whose module the tree holds (the recogniser assumed
// torchvision's defaults).
func moduleHyperParams(g *graph.Graph, root *pth.Module) error {
	mods := map[string]*pth.Module{}
	var walk func(m *pth.Module, prefix string)
	walk = func(m *pth.Module, prefix string) {
		mods[strings.TrimSuffix(prefix, ".")] = m
		for _, c := range m.Children {
			walk(c.Module, prefix+c.Name+".")
		}
	}
	walk(root, "")
	for _, n := range g.Nodes {
		m := mods[n.Name]
		if m == nil {
			continue
		}
		switch {
		case n.Op.IsBNFamily() && m.ShortClass() == "BatchNorm2d":
			if err := bnAttrs(m, &n.Attr); err != nil {
				return fmt.Errorf("%s: %w", n.Name, err)
			}
		case n.Op == graph.OpDropout && m.ShortClass() == "Dropout":
			p, ok := number(m.Attr("p"))
			if !ok {
				return fmt.Errorf("%s: dropout p is %v", n.Name, m.Attr("p"))
			}
			n.Attr.P = p
		}
	}
	return nil
}

// seqBuilder turns a Sequential chain into nodes.
type seqBuilder struct {
	w      graph.Weights
	g      *graph.Graph
	cur    *graph.Value
	used   map[string]bool
	layers int
}

func (b *seqBuilder) chain(m *pth.Module, prefix string) error {
	for _, c := range m.Children {
		path := prefix + c.Name
		if err := b.layer(c.Module, path); err != nil {
			return fmt.Errorf("%s (%s): %w", path, c.Module.ShortClass(), err)
		}
	}
	return nil
}

func (b *seqBuilder) layer(m *pth.Module, path string) error {
	if m.Class == sequentialClass {
		return b.chain(m, path+".")
	}
	if len(m.Children) > 0 {
		return fmt.Errorf("a %s with children inside nn.Sequential is not a chain layer; save the torchvision model itself, or use --graph", m.Class)
	}
	if !strings.HasPrefix(m.Class, "torch.nn.modules.") {
		return fmt.Errorf("%s inside nn.Sequential is not a chain layer; save the torchvision model itself, or use --graph", m.Class)
	}
	name := m.ShortClass()
	if b.g == nil {
		if name != "Conv2d" {
			return fmt.Errorf("the chain must start with a Conv2d (the input's channel count comes from it), not %s", name)
		}
		in, ok := integer(m.Attr("in_channels"))
		if !ok || in <= 0 {
			return fmt.Errorf("in_channels is %v", m.Attr("in_channels"))
		}
		b.g = graph.New("", in)
		b.cur = b.g.Input
	}
	params := map[string]string{}
	for _, t := range append(append([]pth.NamedTensor{}, m.Params...), m.Buffers...) {
		key := path + "." + t.Name
		params[t.Name] = key
		b.used[key] = true
	}
	var (
		op   graph.Op
		attr graph.Attr
		ch   = b.cur.Channels
		err  error
	)
	switch name {
	case "Conv2d":
		op = graph.OpConv
		attr, err = convAttrs(m, b.cur.Channels)
		ch = attr.OutChannels
		attr.Bias = params[graph.RoleBias] != ""
	case "BatchNorm2d":
		op = graph.OpBatchNorm
		err = bnAttrs(m, &attr)
		if err == nil && ch != 0 && attr.Features != ch {
			err = fmt.Errorf("num_features %d, but %d channels reach it", attr.Features, ch)
		}
	case "ReLU":
		op = graph.OpReLU
	case "LeakyReLU":
		op = graph.OpLeakyReLU
		var ok bool
		if attr.ActParam, ok = number(m.Attr("negative_slope")); !ok {
			err = fmt.Errorf("negative_slope is %v", m.Attr("negative_slope"))
		}
	case "ELU":
		op = graph.OpELU
		var ok bool
		if attr.ActParam, ok = number(m.Attr("alpha")); !ok {
			err = fmt.Errorf("alpha is %v", m.Attr("alpha"))
		}
	case "MaxPool2d", "AvgPool2d":
		op, attr, err = poolAttrs(m)
	case "AdaptiveAvgPool2d":
		op = graph.OpAdaptiveAvgPool
		attr.OutputSize, err = pairAttr(m, "output_size")
	case "Flatten":
		op = graph.OpFlatten
		s, ok1 := integer(m.Attr("start_dim"))
		e, ok2 := integer(m.Attr("end_dim"))
		if !ok1 || !ok2 || s != 1 || e != -1 {
			err = fmt.Errorf("only Flatten(start_dim=1, end_dim=-1) is modelled, not (%v, %v)", m.Attr("start_dim"), m.Attr("end_dim"))
		}
		attr.StartDim = 1
		ch = 0
	case "Linear":
		op = graph.OpLinear
		in, ok1 := integer(m.Attr("in_features"))
		out, ok2 := integer(m.Attr("out_features"))
		if !ok1 || !ok2 {
			err = fmt.Errorf("in_features %v, out_features %v", m.Attr("in_features"), m.Attr("out_features"))
		}
		attr = graph.Attr{InChannels: in, OutChannels: out, Bias: params[graph.RoleBias] != ""}
		ch = out
	case "Dropout":
		op = graph.OpDropout
		var ok bool
		if attr.P, ok = number(m.Attr("p")); !ok {
			err = fmt.Errorf("p is %v", m.Attr("p"))
		}
	case "Identity":
		return nil
	default:
		err = fmt.Errorf("not a layer the IR models")
	}
	if err != nil {
		return err
	}
	for role := range params {
		if !roleOf(op, role) {
			return fmt.Errorf("has a tensor %q, which a %s does not own", role, op)
		}
	}
	if len(params) == 0 {
		params = nil
	}
	b.cur = b.g.Add(path, op, attr, params, b.cur)
	b.cur.Channels = ch
	b.layers++
	return nil
}

func roleOf(op graph.Op, role string) bool {
	switch op {
	case graph.OpConv, graph.OpLinear:
		return role == graph.RoleWeight || role == graph.RoleBias
	case graph.OpBatchNorm:
		switch role {
		case graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar, graph.RoleNumBatches:
			return true
		}
	}
	return false
}

func convAttrs(m *pth.Module, inCh int) (graph.Attr, error) {
	a := graph.Attr{}
	var ok bool
	if a.InChannels, ok = integer(m.Attr("in_channels")); !ok {
		return a, fmt.Errorf("in_channels is %v", m.Attr("in_channels"))
	}
	if a.OutChannels, ok = integer(m.Attr("out_channels")); !ok {
		return a, fmt.Errorf("out_channels is %v", m.Attr("out_channels"))
	}
	if a.Groups, ok = integer(m.Attr("groups")); !ok || a.Groups <= 0 {
		return a, fmt.Errorf("groups is %v", m.Attr("groups"))
	}
	if inCh != 0 && a.InChannels != inCh {
		return a, fmt.Errorf("in_channels %d, but %d channels reach it", a.InChannels, inCh)
	}
	if pm, _ := m.Attr("padding_mode").(string); pm != "zeros" {
		return a, fmt.Errorf("padding_mode %q: only zero padding is modelled", pm)
	}
	if tr, _ := m.Attr("transposed").(bool); tr {
		return a, fmt.Errorf("a transposed convolution is not modelled")
	}
	var err error
	if a.KernelSize, err = pairAttr(m, "kernel_size"); err != nil {
		return a, err
	}
	if a.Stride, err = pairAttr(m, "stride"); err != nil {
		return a, err
	}
	if a.Dilation, err = pairAttr(m, "dilation"); err != nil {
		return a, err
	}
	switch p := m.Attr("padding").(type) {
	case string:
		// padding="same" pads asymmetrically for even kernels; the IR's
		// symmetric padding holds it only for odd ones at stride 1.
		switch {
		case p == "valid":
		case p == "same" && a.Stride == [2]int{1, 1} && (a.KernelSize[0]-1)*a.Dilation[0]%2 == 0 && (a.KernelSize[1]-1)*a.Dilation[1]%2 == 0:
			a.Padding = [2]int{(a.KernelSize[0] - 1) * a.Dilation[0] / 2, (a.KernelSize[1] - 1) * a.Dilation[1] / 2}
		default:
			return a, fmt.Errorf("padding %q with kernel %v, stride %v: not expressible as symmetric padding", p, a.KernelSize, a.Stride)
		}
	default:
		if a.Padding, err = pairAttr(m, "padding"); err != nil {
			return a, err
		}
	}
	return a, nil
}

func bnAttrs(m *pth.Module, a *graph.Attr) error {
	var ok bool
	if a.Features, ok = integer(m.Attr("num_features")); !ok || a.Features <= 0 {
		return fmt.Errorf("num_features is %v", m.Attr("num_features"))
	}
	if a.Eps, ok = number(m.Attr("eps")); !ok || !(a.Eps > 0) {
		return fmt.Errorf("eps is %v", m.Attr("eps"))
	}
	if m.Attr("momentum") == nil {
		a.Momentum, a.MomentumNone = 0, true
	} else if a.Momentum, ok = number(m.Attr("momentum")); !ok {
		return fmt.Errorf("momentum is %v", m.Attr("momentum"))
	}
	if affine, _ := m.Attr("affine").(bool); !affine {
		return fmt.Errorf("affine=False is not modelled (InPlace-ABN needs weight and bias)")
	}
	if track, _ := m.Attr("track_running_stats").(bool); !track {
		return fmt.Errorf("track_running_stats=False is not modelled")
	}
	return nil
}

func poolAttrs(m *pth.Module) (graph.Op, graph.Attr, error) {
	a := graph.Attr{}
	var err error
	if a.KernelSize, err = pairAttr(m, "kernel_size"); err != nil {
		return "", a, err
	}
	if m.Attr("stride") == nil {
		a.Stride = a.KernelSize
	} else if a.Stride, err = pairAttr(m, "stride"); err != nil {
		return "", a, err
	}
	if a.Padding, err = pairAttr(m, "padding"); err != nil {
		return "", a, err
	}
	a.CeilMode, _ = m.Attr("ceil_mode").(bool)
	if m.ShortClass() == "MaxPool2d" {
		if ri, _ := m.Attr("return_indices").(bool); ri {
			return "", a, fmt.Errorf("return_indices=True is not modelled")
		}
		if a.Dilation, err = pairAttr(m, "dilation"); err != nil {
			return "", a, err
		}
		return graph.OpMaxPool, a, nil
	}
	if m.Attr("divisor_override") != nil {
		return "", a, fmt.Errorf("divisor_override is not modelled")
	}
	a.CountIncludePad, _ = m.Attr("count_include_pad").(bool)
	return graph.OpAvgPool, a, nil
}

// pairAttr reads an int or a pair of ints (PyTorch's _pair arguments).
func pairAttr(m *pth.Module, name string) ([2]int, error) {
	v := m.Attr(name)
	if n, ok := integer(v); ok {
		return [2]int{n, n}, nil
	}
	if t, ok := v.(*pth.Tuple); ok && len(t.Items) == 2 {
		a, ok1 := integer(t.Items[0])
		b, ok2 := integer(t.Items[1])
		if ok1 && ok2 {
			return [2]int{a, b}, nil
		}
	}
	return [2]int{}, fmt.Errorf("%s is %v, not an int or a pair of ints", name, describe(v))
}

func integer(v pth.Value) (int, bool) {
	switch v := v.(type) {
	case int64:
		if v >= math.MinInt32 && v <= math.MaxInt32 {
			return int(v), true
		}
	case *big.Int:
	}
	return 0, false
}

func number(v pth.Value) (float64, bool) {
	switch v := v.(type) {
	case float64:
		return v, !math.IsNaN(v) && !math.IsInf(v, 0)
	case int64:
		return float64(v), true
	}
	return 0, false
}

func describe(v pth.Value) string {
	switch v := v.(type) {
	case nil:
		return "None"
	case *pth.Tuple:
		var s []string
		for _, it := range v.Items {
			s = append(s, describe(it))
		}
		return "(" + strings.Join(s, ", ") + ")"
	}
	return fmt.Sprint(v)
}
