package arch

import (
	"fmt"
	"math"
	"sort"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// Whole pickled modules (torch.save(model)) become IR in three ways. A
// torchvision model whose state dict the recogniser knows (ResNet,
// DenseNet, VGG, and the ResNet-based FCN and DeepLabV3) has a forward
// fixed by its class: its topology is recognised from its state dict, as a
// checkpoint of it would be, and then every node whose module the tree
// holds takes that module's attributes (a Conv2d's stride, padding and
// dilation, a pool's geometry, a BN's eps and momentum...), which a state
// dict does not hold: a dilated ResNet has the same keys as a plain one.
// Other torchvision models (RegNet, MNASNet, MobileNetV2/V3, EfficientNet, ShuffleNetV2,
// GoogLeNet, Inception3, LRASPP and DeepLabV3 over MobileNetV3), and
// ResNet, DenseNet and VGG instances whose modules are not torchvision's (a
// fine-tuned head), are rebuilt from the tree alone (tree.go): the class's
// forward over its children, each torchvision block with its own forward,
// each torch.nn layer read as in a chain. An nn.Sequential is a chain: each
// child, in order, becomes one node (a nested Sequential its own chain,
// Identity nothing). Every way, every module of the tree must be one the
// rebuilt forward uses, and every public attribute of every module must be
// one abnconvert understands, with a value it models: anything else is an
// error naming the module's path and the attribute, never ignored.

const (
	classSequential = "torch.nn.modules.container.Sequential"
	classIdentity   = "torch.nn.modules.linear.Identity"
	// classStochasticDepth is torchvision.ops' StochasticDepth module.
	classStochasticDepth = "torchvision.ops.stochastic_depth.StochasticDepth"
)

// moduleFamily maps the torchvision model classes whose forward is rebuilt
// to their family.
var moduleFamily = map[string]string{
	"torchvision.models.resnet.ResNet":                    FamilyResNet,
	"torchvision.models.densenet.DenseNet":                FamilyDenseNet,
	"torchvision.models.vgg.VGG":                          FamilyVGG,
	"torchvision.models.segmentation.fcn.FCN":             FamilySegmentation,
	"torchvision.models.segmentation.deeplabv3.DeepLabV3": FamilySegmentation,
}

// containers lists, per family, the classes whose modules hold no node of
// their own (their forward is the family builder's), with the public
// attributes each may carry. check, when set, refuses values the rebuilt
// forward does not follow.
type container struct {
	attrs []string
	check func(m *pth.Module) error
}

var containers = map[string]map[string]container{
	FamilyResNet: {
		"torchvision.models.resnet.ResNet": {attrs: []string{"inplanes", "dilation", "groups", "base_width"}},
		// Block.stride duplicates its convolutions' strides, which are
		// read from them.
		"torchvision.models.resnet.BasicBlock": {attrs: []string{"stride", "downsample"}, check: noDownsampleAttr},
		"torchvision.models.resnet.Bottleneck": {attrs: []string{"stride", "downsample"}, check: noDownsampleAttr},
		classSequential:                        {},
	},
	FamilyDenseNet: {
		"torchvision.models.densenet.DenseNet":    {},
		"torchvision.models.densenet._DenseBlock": {},
		"torchvision.models.densenet._DenseLayer": {attrs: []string{"drop_rate", "memory_efficient"}, check: denseLayerCheck},
		"torchvision.models.densenet._Transition": {},
		classSequential: {},
	},
	FamilyVGG: {
		"torchvision.models.vgg.VGG": {},
		classSequential:              {},
	},
	FamilySegmentation: {
		// aux_classifier is an attribute only when it is None; a head
		// (aux_loss=True) is a child, an FCNHead the builder reads.
		"torchvision.models.segmentation.fcn.FCN":               {attrs: []string{"aux_classifier"}, check: noAux},
		"torchvision.models.segmentation.deeplabv3.DeepLabV3":   {attrs: []string{"aux_classifier"}, check: noAux},
		"torchvision.models._utils.IntermediateLayerGetter":     {attrs: []string{"return_layers"}, check: returnsLayers},
		"torchvision.models.resnet.BasicBlock":                  {attrs: []string{"stride", "downsample"}, check: noDownsampleAttr},
		"torchvision.models.resnet.Bottleneck":                  {attrs: []string{"stride", "downsample"}, check: noDownsampleAttr},
		"torchvision.models.segmentation.fcn.FCNHead":           {},
		"torchvision.models.segmentation.deeplabv3.DeepLabHead": {},
		"torchvision.models.segmentation.deeplabv3.ASPP":        {},
		"torchvision.models.segmentation.deeplabv3.ASPPConv":    {},
		"torchvision.models.segmentation.deeplabv3.ASPPPooling": {},
		"torch.nn.modules.container.ModuleList":                 {},
		classSequential:                                         {},
	},
}

func noAux(m *pth.Module) error {
	if v, ok := m.Attrs["aux_classifier"]; ok && v != nil {
		return fmt.Errorf("aux_classifier is %s", describe(v))
	}
	return nil
}

// returnsLayers checks that the backbone hands layer4's output to the head
// as "out", and layer3's as "aux" if it hands two, which the builder
// assumes (torchvision's _segm_model with and without aux_loss).
func returnsLayers(m *pth.Module) error {
	d, ok := m.Attr("return_layers").(*pth.Dict)
	if ok && (d.Len() == 1 || d.Len() == 2) {
		out, _ := d.Get("layer4")
		aux, _ := d.Get("layer3")
		if out == "out" && (d.Len() == 1 || aux == "aux") {
			return nil
		}
	}
	return failure.Unsupportedf("return_layers %s: the heads are built on {'layer4': 'out'} and, with an auxiliary head, {'layer3': 'aux'}", describe(m.Attr("return_layers")))
}

// denseLayerCheck refuses a dense layer with dropout: torchvision applies
// F.dropout after conv2 when drop_rate > 0, which the DenseNet builder does
// not model. memory_efficient (checkpointing) changes no value.
func denseLayerCheck(m *pth.Module) error {
	r, ok := number(m.Attr("drop_rate"))
	if !ok {
		return fmt.Errorf("drop_rate is %s", describe(m.Attr("drop_rate")))
	}
	if r != 0 {
		return failure.Unsupportedf("drop_rate %g: dropout inside dense layers is not modelled", r)
	}
	if _, ok := m.Attr("memory_efficient").(bool); !ok {
		return fmt.Errorf("memory_efficient is %s", describe(m.Attr("memory_efficient")))
	}
	return nil
}

// FromModule builds the graph of the whole pickled module m, whose state
// dict (model.state_dict()) is w. force is as for Recognize and applies to
// the torchvision classes.
func FromModule(m *pth.Module, w graph.Weights, force string) (*graph.Graph, *Match, error) {
	if m.Class == classDeepLabV3 && mobileBackbone(m) {
		return fromTree(m, w, deeplabMobileTree)
	}
	if fam, ok := moduleFamily[m.Class]; ok {
		var (
			g     *graph.Graph
			match *Match
			err   error
		)
		if fam == FamilySegmentation {
			g, match, err = recognizeSegmentation(w, w.Keys())
		} else {
			g, match, err = recognize(w, force)
		}
		tree, hasTree := treeFallback[fam]
		if err != nil && hasTree {
			// Not torchvision's layout (a replaced head, say): the
			// forward is still the class's, over whatever modules it has.
			g, match, terr := fromTree(m, w, tree)
			if terr != nil {
				return nil, nil, fmt.Errorf("whole pickled %s: its state dict is not torchvision's layout (%w), and its module tree does not fit ResNet's forward: %w", m.ShortClass(), err, terr)
			}
			match.Notes = append(match.Notes, fmt.Sprintf("the state dict is not torchvision's layout (%v): the %s forward rebuilt over the modules the tree holds", err, m.ShortClass()))
			return g, match, nil
		}
		if err != nil {
			return nil, nil, fmt.Errorf("whole pickled %s: %w", m.ShortClass(), err)
		}
		if match.Family != fam {
			return nil, nil, fmt.Errorf("whole pickled %s: its state dict was recognised as %s, another family", m.ShortClass(), match.Arch)
		}
		if err := overlay(g, m, containers[fam]); err != nil {
			if hasTree {
				// A replaced layer (an AvgPool2d for the max pool, say):
				// the class's forward over the modules the tree holds.
				if tg, tm, terr := fromTree(m, w, tree); terr == nil {
					tm.Notes = append(tm.Notes, fmt.Sprintf("not torchvision's layers (%v): the %s forward rebuilt over the modules the tree holds", err, m.ShortClass()))
					return tg, tm, nil
				}
			}
			return nil, nil, fmt.Errorf("whole pickled %s: %w", m.ShortClass(), err)
		}
		// The state dict's assumption no longer applies: drop its note.
		notes := match.Notes[:0]
		for _, n := range match.Notes {
			if !strings.HasPrefix(n, assumedPrefix) {
				notes = append(notes, n)
			}
		}
		match.Notes = append(notes, fmt.Sprintf("structure from the pickled %s instance: every layer's attributes (strides, paddings, dilations, groups, pool geometry, BN eps and momentum, dropout rates) read from its modules", m.Class))
		if d := dilations(g); d != "" {
			match.Notes = append(match.Notes, d)
			if fam != FamilySegmentation {
				// Not the network torchvision's name alone describes.
				match.Arch += " (dilated)"
				g.Arch = match.Arch
			}
		}
		return g, match, nil
	}
	if root, ok := treeRoots[m.Class]; ok {
		return fromTree(m, w, root)
	}
	if why, ok := notBuilt[m.Class]; ok {
		return nil, nil, failure.Unsupportedf("a whole pickled %s was read as data, but %s; until then, export it with torch.onnx.export(..., training=torch.onnx.TrainingMode.PRESERVE) and use --graph", m.ShortClass(), why)
	}
	if m.Class != classSequential {
		return nil, nil, failure.Unsupportedf("a whole pickled %s: abnconvert rebuilds the forward of nn.Sequential chains and of torchvision's BatchNorm classification and segmentation classes only; "+
			"for anything else export the model to ONNX with training=torch.onnx.TrainingMode.PRESERVE and convert its state_dict with --graph model.onnx", m.Class)
	}
	b := &chainBuilder{w: w, used: map[string]bool{}}
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
		return nil, nil, fmt.Errorf("the state dict holds tensors no layer of the chain uses: %s", firstFew(extra, 6))
	}
	match := &Match{Arch: fmt.Sprintf("nn.Sequential (%d layers)", b.layers), Family: "sequential", Exact: true,
		Notes: []string{"structure from the pickled nn.Sequential: its children applied in order, each with the attributes its module holds"}}
	b.g.Arch = match.Arch
	return b.g, match, nil
}

// treeFallback is, per family, the class's forward over the module tree,
// used when the state dict or a module is not torchvision's.
var treeFallback = map[string]treeRoot{FamilyResNet: resnetTree, FamilyDenseNet: densenetTree, FamilyVGG: vggTree}

// notBuilt names the allowlisted torchvision models whose forward is not
// rebuilt yet, and what they need.
var notBuilt = map[string]string{}

// dilations notes the dilated convolutions, the structure a state dict
// cannot show.
func dilations(g *graph.Graph) string {
	n := 0
	for _, nd := range g.Nodes {
		if nd.Op == graph.OpConv && (nd.Attr.Dilation[0] > 1 || nd.Attr.Dilation[1] > 1) {
			n++
		}
	}
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("%d dilated convolutions (dilation read from the modules)", n)
}

// overlay gives every node whose module is in the tree that module's
// attributes, and checks that the tree holds nothing the graph does not
// use. A node named "layer1.0.relu:2" is the second use of module
// layer1.0.relu.
func overlay(g *graph.Graph, root *pth.Module, kinds map[string]container) error {
	mods := map[string]*pth.Module{}
	var order []string
	var walk func(m *pth.Module, path string)
	walk = func(m *pth.Module, path string) {
		mods[path] = m
		order = append(order, path)
		for _, c := range m.Children {
			p := c.Name
			if path != "" {
				p = path + "." + c.Name
			}
			walk(c.Module, p)
		}
	}
	walk(root, "")
	used := map[string]bool{}
	for _, n := range g.Nodes {
		path, _, _ := strings.Cut(n.Name, ":")
		m := mods[path]
		if m == nil || n.Op == graph.OpInput {
			continue
		}
		if _, isContainer := kinds[m.Class]; isContainer {
			continue
		}
		used[path] = true
		if err := apply(n, m); err != nil {
			return fmt.Errorf("%s (%s): %w", path, m.ShortClass(), err)
		}
	}
	for _, path := range order {
		m := mods[path]
		if used[path] {
			continue
		}
		name := path
		if name == "" {
			name = "the root module"
		}
		k, ok := kinds[m.Class]
		if !ok {
			return failure.Unsupportedf("%s (%s): not a module torchvision's forward uses as abnconvert rebuilds it (a replaced or added layer?); export the model with --graph instead", name, m.Class)
		}
		if err := checkAttrs(m, k.attrs...); err != nil {
			return fmt.Errorf("%s (%s): %w", name, m.ShortClass(), err)
		}
		if k.check != nil {
			if err := k.check(m); err != nil {
				return fmt.Errorf("%s (%s): %w", name, m.ShortClass(), err)
			}
		}
	}
	return nil
}

// apply replaces n's attributes by those of its module m, after checking
// that they agree with what the recogniser read from the tensors' shapes.
func apply(n *graph.Node, m *pth.Module) error {
	op, a, err := readLayer(m)
	if err != nil {
		return err
	}
	switch {
	case op == n.Op:
	case isActivation(op) && isActivation(n.Op):
		// torchvision calls the module, whatever it is: a ReLU replaced by
		// a LeakyReLU is followed.
		n.Op = op
	default:
		return failure.Unsupportedf("a %s where torchvision's forward has a %s; abnconvert rebuilds the class's own forward, so a replaced layer needs --graph", op, n.Op)
	}
	had := n.Attr
	switch op {
	case graph.OpConv:
		a.Bias = had.Bias
		if a.InChannels != had.InChannels || a.OutChannels != had.OutChannels || a.KernelSize != had.KernelSize || a.Groups != had.Groups {
			return fmt.Errorf("in_channels %d, out_channels %d, kernel_size %v, groups %d, but its weight gives %d, %d, %v, %d",
				a.InChannels, a.OutChannels, a.KernelSize, a.Groups, had.InChannels, had.OutChannels, had.KernelSize, had.Groups)
		}
	case graph.OpLinear:
		a.Bias = had.Bias
		if a.InChannels != had.InChannels || a.OutChannels != had.OutChannels {
			return fmt.Errorf("in_features %d, out_features %d, but its weight gives %d, %d", a.InChannels, a.OutChannels, had.InChannels, had.OutChannels)
		}
	case graph.OpBatchNorm:
		if a.Features != had.Features {
			return fmt.Errorf("num_features %d, but its tensors have %d", a.Features, had.Features)
		}
	}
	n.Attr = a
	return nil
}

func isActivation(op graph.Op) bool { return op.IsActivation() }

// checkAttrs refuses a public attribute outside known: one abnconvert does
// not know may change the computation. training and the underscored
// attributes (hooks, torch's bookkeeping, derived copies such as
// Conv2d._reversed_padding_repeated_twice) change no value.
func checkAttrs(m *pth.Module, known ...string) error {
	var bad []string
	for name, v := range m.Attrs {
		if !public(name) || contains(known, name) {
			continue
		}
		bad = append(bad, fmt.Sprintf("%s = %s", name, describe(v)))
	}
	for _, name := range m.Opaque {
		if public(name) && !contains(known, name) {
			bad = append(bad, name+" (not plain data)")
		}
	}
	if len(bad) == 0 {
		return nil
	}
	sort.Strings(bad)
	return failure.Unsupportedf("attribute %s is not one abnconvert understands for a %s, and it may change the computation", strings.Join(bad, ", "), m.ShortClass())
}

func public(name string) bool { return name != "training" && !strings.HasPrefix(name, "_") }

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// readLayer reads a leaf module into the op and attributes of its node.
// Conv2d's and Linear's Bias is left to the caller, which knows the
// tensors.
func readLayer(m *pth.Module) (graph.Op, graph.Attr, error) {
	var a graph.Attr
	switch m.ShortClass() {
	case "Conv2d":
		a, err := convAttrs(m)
		return graph.OpConv, a, err
	case "BatchNorm2d":
		return graph.OpBatchNorm, a, bnAttrs(m, &a)
	case "ReLU":
		return graph.OpReLU, a, activation(m)
	case "LeakyReLU":
		if err := activation(m, "negative_slope"); err != nil {
			return "", a, err
		}
		var ok bool
		if a.ActParam, ok = number(m.Attr("negative_slope")); !ok {
			return "", a, fmt.Errorf("negative_slope is %s", describe(m.Attr("negative_slope")))
		}
		return graph.OpLeakyReLU, a, nil
	case "ELU":
		if err := activation(m, "alpha"); err != nil {
			return "", a, err
		}
		var ok bool
		if a.ActParam, ok = number(m.Attr("alpha")); !ok {
			return "", a, fmt.Errorf("alpha is %s", describe(m.Attr("alpha")))
		}
		return graph.OpELU, a, nil
	case "MaxPool2d", "AvgPool2d":
		return poolAttrs(m)
	case "AdaptiveAvgPool2d":
		if err := checkAttrs(m, "output_size"); err != nil {
			return "", a, err
		}
		var err error
		if a.OutputSize, err = pairAttr(m, "output_size"); err != nil {
			return "", a, err
		}
		if a.OutputSize[0] <= 0 || a.OutputSize[1] <= 0 {
			return "", a, fmt.Errorf("output_size %v: want positive sizes", a.OutputSize)
		}
		return graph.OpAdaptiveAvgPool, a, nil
	case "Flatten":
		if err := checkAttrs(m, "start_dim", "end_dim"); err != nil {
			return "", a, err
		}
		s, ok1 := integer(m.Attr("start_dim"))
		e, ok2 := integer(m.Attr("end_dim"))
		if !ok1 || !ok2 || s != 1 || e != -1 {
			return "", a, failure.Unsupportedf("only Flatten(start_dim=1, end_dim=-1) is modelled, not (%s, %s)", describe(m.Attr("start_dim")), describe(m.Attr("end_dim")))
		}
		a.StartDim = 1
		return graph.OpFlatten, a, nil
	case "Linear":
		// stddev: Inception3 sets it on AuxLogits.fc for its weight
		// initialisation (init_weights) only; the forward never reads it.
		if err := checkAttrs(m, "in_features", "out_features", "stddev"); err != nil {
			return "", a, err
		}
		in, ok1 := integer(m.Attr("in_features"))
		out, ok2 := integer(m.Attr("out_features"))
		if !ok1 || !ok2 || in <= 0 || out <= 0 {
			return "", a, fmt.Errorf("in_features %s, out_features %s", describe(m.Attr("in_features")), describe(m.Attr("out_features")))
		}
		a.InChannels, a.OutChannels = in, out
		return graph.OpLinear, a, nil
	case "Dropout":
		if err := activation(m, "p"); err != nil {
			return "", a, err
		}
		var ok bool
		if a.P, ok = number(m.Attr("p")); !ok || a.P < 0 || a.P > 1 {
			return "", a, fmt.Errorf("p is %s, not a probability", describe(m.Attr("p")))
		}
		return graph.OpDropout, a, nil
	case "StochasticDepth":
		if err := checkAttrs(m, "p", "mode"); err != nil {
			return "", a, err
		}
		var ok bool
		if a.P, ok = number(m.Attr("p")); !ok || a.P < 0 || a.P > 1 {
			return "", a, fmt.Errorf("p is %s, not a probability", describe(m.Attr("p")))
		}
		switch mode, _ := m.Attr("mode").(string); mode {
		case "row":
		case "batch":
			a.Mode = graph.StochasticBatch
		default:
			return "", a, failure.Unsupportedf("mode %s: want row or batch", describe(m.Attr("mode")))
		}
		return graph.OpStochasticDepth, a, nil
	case "ReLU6", "Hardtanh":
		// ReLU6 is Hardtanh(0, 6), and holds those bounds.
		if err := activation(m, "min_val", "max_val"); err != nil {
			return "", a, err
		}
		lo, ok1 := number(m.Attr("min_val"))
		hi, ok2 := number(m.Attr("max_val"))
		if !ok1 || !ok2 || lo > hi {
			return "", a, fmt.Errorf("min_val %s, max_val %s", describe(m.Attr("min_val")), describe(m.Attr("max_val")))
		}
		a.ActParam, a.ActParam2 = lo, hi
		return graph.OpHardtanh, a, nil
	case "Sigmoid":
		return graph.OpSigmoid, a, checkAttrs(m)
	case "SiLU":
		return graph.OpSiLU, a, activation(m)
	case "Hardswish":
		return graph.OpHardswish, a, activation(m)
	case "Hardsigmoid":
		// torch's: relu6(x + 3) / 6, ONNX's HardSigmoid(1/6, 0.5).
		a.ActParam, a.ActParam2 = 1.0/6, 0.5
		return graph.OpHardsigmoid, a, activation(m)
	case "GELU":
		if err := checkAttrs(m, "approximate"); err != nil {
			return "", a, err
		}
		if ap, _ := m.Attr("approximate").(string); ap != "none" {
			return "", a, failure.Unsupportedf("approximate %s: only the exact GELU is modelled", describe(m.Attr("approximate")))
		}
		return graph.OpGELU, a, nil
	case "Tanh":
		return graph.OpTanh, a, checkAttrs(m)
	case "SELU":
		return graph.OpSELU, a, activation(m)
	case "Mish":
		return graph.OpMish, a, activation(m)
	case "CELU":
		if err := activation(m, "alpha"); err != nil {
			return "", a, err
		}
		var ok bool
		if a.ActParam, ok = number(m.Attr("alpha")); !ok || a.ActParam == 0 {
			return "", a, fmt.Errorf("alpha is %s: want a finite, nonzero number", describe(m.Attr("alpha")))
		}
		return graph.OpCELU, a, nil
	case "Softplus":
		// No inplace: nn.Softplus has none.
		if err := checkAttrs(m, "beta", "threshold"); err != nil {
			return "", a, err
		}
		var ok1, ok2 bool
		a.ActParam, ok1 = number(m.Attr("beta"))
		a.ActParam2, ok2 = number(m.Attr("threshold"))
		if !ok1 || !ok2 || a.ActParam == 0 {
			return "", a, fmt.Errorf("beta %s, threshold %s: want finite numbers, beta nonzero", describe(m.Attr("beta")), describe(m.Attr("threshold")))
		}
		return graph.OpSoftplus, a, nil
	case "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d":
		// The two subclasses only set mode and align_corners in their
		// __init__; Upsample's forward reads every attribute.
		a, err := upsampleAttrs(m)
		return graph.OpResize, a, err
	}
	return "", a, failure.Unsupportedf("%s is not a layer abnconvert's IR models yet", m.Class)
}

// upsampleAttrs reads nn.Upsample's attributes into a one-input Resize,
// as its forward calls F.interpolate(x, size, scale_factor, mode,
// align_corners, recompute_scale_factor=...). What torch 1.13 would raise
// on is bad input; what the IR does not model is unsupported, named.
func upsampleAttrs(m *pth.Module) (graph.Attr, error) {
	var a graph.Attr
	if err := checkAttrs(m, "name", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor"); err != nil {
		return a, err
	}
	mode, ok := m.Attr("mode").(string)
	if !ok {
		return a, fmt.Errorf("mode is %s, not a string", describe(m.Attr("mode")))
	}
	if mode != "nearest" && mode != "bilinear" {
		return a, failure.Unsupportedf("mode %s: only nearest and bilinear resizing of (N, C, H, W) are modelled", describe(mode))
	}
	a.Mode = mode
	switch ac := m.Attr("align_corners").(type) {
	case nil: // bilinear: torch uses False
	case bool:
		if mode == "nearest" {
			return a, fmt.Errorf("align_corners %s with mode 'nearest': torch's interpolate raises", describe(ac))
		}
		a.AlignCorners = ac
	default:
		return a, fmt.Errorf("align_corners is %s, not a bool or None", describe(ac))
	}
	size, scale := m.Attr("size"), m.Attr("scale_factor")
	if (size == nil) == (scale == nil) {
		return a, fmt.Errorf("size %s and scale_factor %s: torch's interpolate wants exactly one", describe(size), describe(scale))
	}
	recompute := false
	switch r := m.Attr("recompute_scale_factor").(type) {
	case nil:
	case bool:
		recompute = r
	default:
		return a, fmt.Errorf("recompute_scale_factor is %s, not a bool or None", describe(r))
	}
	if size != nil {
		if recompute {
			return a, fmt.Errorf("recompute_scale_factor=True with a size: torch's interpolate raises")
		}
		var err error
		if a.Size, err = pairAttr(m, "size"); err != nil {
			return a, err
		}
		if a.Size[0] <= 0 || a.Size[1] <= 0 {
			return a, fmt.Errorf("size %v is not positive", a.Size)
		}
		return a, nil
	}
	var items []pth.Value
	switch t := scale.(type) {
	case *pth.Tuple:
		items = t.Items
	case *pth.List:
		items = t.Items
	default:
		items = []pth.Value{t, t}
	}
	if len(items) != 2 {
		return a, fmt.Errorf("scale_factor is %s, not a positive number or a pair of them", describe(scale))
	}
	for d, it := range items {
		f, ok := number(it)
		if !ok || !(f > 0 && f < 1e6) {
			return a, fmt.Errorf("scale_factor is %s, not a positive number or a pair of them", describe(scale))
		}
		a.Scale[d] = f
	}
	// recompute_scale_factor=True resizes to floor(in * scale) and steps
	// by in/out, which is 1/scale for an integer factor only.
	if recompute && (a.Scale[0] != math.Trunc(a.Scale[0]) || a.Scale[1] != math.Trunc(a.Scale[1])) {
		return a, failure.Unsupportedf("recompute_scale_factor=True with scale_factor %s: stepping by in/out rather than 1/scale for a non-integer factor is not modelled", describe(scale))
	}
	return a, nil
}

// activation checks a module whose only attribute besides extra is
// inplace. In place or not changes no value: the IR's memory plan decides
// what is kept.
func activation(m *pth.Module, extra ...string) error {
	if err := checkAttrs(m, append(extra, "inplace")...); err != nil {
		return err
	}
	if _, ok := m.Attr("inplace").(bool); !ok {
		return fmt.Errorf("inplace is %s, not a bool", describe(m.Attr("inplace")))
	}
	return nil
}

func convAttrs(m *pth.Module) (graph.Attr, error) {
	a := graph.Attr{}
	if err := checkAttrs(m, "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
		"transposed", "output_padding", "groups", "padding_mode"); err != nil {
		return a, err
	}
	var ok bool
	if a.InChannels, ok = integer(m.Attr("in_channels")); !ok || a.InChannels <= 0 {
		return a, fmt.Errorf("in_channels is %s", describe(m.Attr("in_channels")))
	}
	if a.OutChannels, ok = integer(m.Attr("out_channels")); !ok || a.OutChannels <= 0 {
		return a, fmt.Errorf("out_channels is %s", describe(m.Attr("out_channels")))
	}
	if a.Groups, ok = integer(m.Attr("groups")); !ok || a.Groups <= 0 || a.InChannels%a.Groups != 0 || a.OutChannels%a.Groups != 0 {
		return a, fmt.Errorf("groups is %s for %d input and %d output channels", describe(m.Attr("groups")), a.InChannels, a.OutChannels)
	}
	switch pm := m.Attr("padding_mode").(type) {
	case string:
		if pm != "zeros" {
			return a, failure.Unsupportedf("padding_mode %q: only zero padding ('zeros') is modelled", pm)
		}
	default:
		return a, fmt.Errorf("padding_mode is %s, not a string", describe(pm))
	}
	switch tr := m.Attr("transposed").(type) {
	case bool:
		if tr {
			return a, failure.Unsupportedf("transposed=True: a transposed convolution is not modelled")
		}
	default:
		return a, fmt.Errorf("transposed is %s, not a bool", describe(tr))
	}
	if op, err := pairAttr(m, "output_padding"); err != nil {
		return a, err
	} else if op != [2]int{0, 0} {
		return a, failure.Unsupportedf("output_padding %v: only a transposed convolution has one", op)
	}
	var err error
	for _, f := range []struct {
		name string
		dst  *[2]int
	}{{"kernel_size", &a.KernelSize}, {"stride", &a.Stride}, {"dilation", &a.Dilation}} {
		if *f.dst, err = pairAttr(m, f.name); err != nil {
			return a, err
		}
		if f.dst[0] <= 0 || f.dst[1] <= 0 {
			return a, fmt.Errorf("%s %v: want positive values", f.name, *f.dst)
		}
	}
	switch p := m.Attr("padding").(type) {
	case string:
		// padding="same" pads asymmetrically when (kernel-1)*dilation is
		// odd; the IR's symmetric padding holds it only when it is even
		// (PyTorch allows "same" only at stride 1).
		switch {
		case p == "valid":
		case p == "same" && a.Stride == [2]int{1, 1} && (a.KernelSize[0]-1)*a.Dilation[0]%2 == 0 && (a.KernelSize[1]-1)*a.Dilation[1]%2 == 0:
			a.Padding = [2]int{(a.KernelSize[0] - 1) * a.Dilation[0] / 2, (a.KernelSize[1] - 1) * a.Dilation[1] / 2}
		case p == "same":
			return a, failure.Unsupportedf("padding 'same' with kernel %v, dilation %v, stride %v pads asymmetrically, which is not modelled", a.KernelSize, a.Dilation, a.Stride)
		default:
			return a, fmt.Errorf("padding %q is neither 'same' nor 'valid'", p)
		}
	default:
		if a.Padding, err = pairAttr(m, "padding"); err != nil {
			return a, err
		}
		if a.Padding[0] < 0 || a.Padding[1] < 0 {
			return a, fmt.Errorf("padding %v: want non-negative values", a.Padding)
		}
	}
	return a, nil
}

func bnAttrs(m *pth.Module, a *graph.Attr) error {
	if err := checkAttrs(m, "num_features", "eps", "momentum", "affine", "track_running_stats"); err != nil {
		return err
	}
	var ok bool
	if a.Features, ok = integer(m.Attr("num_features")); !ok || a.Features <= 0 {
		return fmt.Errorf("num_features is %s", describe(m.Attr("num_features")))
	}
	if a.Eps, ok = number(m.Attr("eps")); !ok || !(a.Eps > 0) {
		return fmt.Errorf("eps is %s, not a positive number", describe(m.Attr("eps")))
	}
	if m.Attr("momentum") == nil {
		a.Momentum, a.MomentumNone = 0, true
	} else if a.Momentum, ok = number(m.Attr("momentum")); !ok || a.Momentum < 0 || a.Momentum > 1 {
		return fmt.Errorf("momentum is %s", describe(m.Attr("momentum")))
	}
	switch affine := m.Attr("affine").(type) {
	case bool:
		if !affine {
			return failure.Unsupportedf("affine=False is not modelled (InPlace-ABN needs weight and bias)")
		}
	default:
		return fmt.Errorf("affine is %s, not a bool", describe(affine))
	}
	switch track := m.Attr("track_running_stats").(type) {
	case bool:
		if !track {
			return failure.Unsupportedf("track_running_stats=False is not modelled (eval would use batch statistics)")
		}
	default:
		return fmt.Errorf("track_running_stats is %s, not a bool", describe(track))
	}
	return nil
}

func poolAttrs(m *pth.Module) (graph.Op, graph.Attr, error) {
	a := graph.Attr{}
	maxPool := m.ShortClass() == "MaxPool2d"
	known := []string{"kernel_size", "stride", "padding", "ceil_mode"}
	if maxPool {
		known = append(known, "dilation", "return_indices")
	} else {
		known = append(known, "count_include_pad", "divisor_override")
	}
	if err := checkAttrs(m, known...); err != nil {
		return "", a, err
	}
	var err error
	if a.KernelSize, err = pairAttr(m, "kernel_size"); err != nil {
		return "", a, err
	}
	// nn.MaxPool2d(k, stride=None) stores None: the kernel size.
	if m.Attr("stride") == nil {
		a.Stride = a.KernelSize
	} else if a.Stride, err = pairAttr(m, "stride"); err != nil {
		return "", a, err
	}
	if a.Padding, err = pairAttr(m, "padding"); err != nil {
		return "", a, err
	}
	for d := 0; d < 2; d++ {
		if a.KernelSize[d] <= 0 || a.Stride[d] <= 0 || a.Padding[d] < 0 || 2*a.Padding[d] > a.KernelSize[d] {
			return "", a, fmt.Errorf("kernel_size %v, stride %v, padding %v: want positive sizes and padding at most half the kernel", a.KernelSize, a.Stride, a.Padding)
		}
	}
	var ok bool
	if a.CeilMode, ok = m.Attr("ceil_mode").(bool); !ok {
		return "", a, fmt.Errorf("ceil_mode is %s, not a bool", describe(m.Attr("ceil_mode")))
	}
	if maxPool {
		switch ri := m.Attr("return_indices").(type) {
		case bool:
			if ri {
				return "", a, failure.Unsupportedf("return_indices=True is not modelled")
			}
		default:
			return "", a, fmt.Errorf("return_indices is %s, not a bool", describe(ri))
		}
		if a.Dilation, err = pairAttr(m, "dilation"); err != nil {
			return "", a, err
		}
		if a.Dilation != [2]int{1, 1} {
			// The runtime's max pooling (verify, memory) has no dilation.
			return "", a, failure.Unsupportedf("dilation %v: dilated max pooling is not modelled", a.Dilation)
		}
		return graph.OpMaxPool, a, nil
	}
	if m.Attr("divisor_override") != nil {
		return "", a, failure.Unsupportedf("divisor_override %s is not modelled", describe(m.Attr("divisor_override")))
	}
	if a.CountIncludePad, ok = m.Attr("count_include_pad").(bool); !ok {
		return "", a, fmt.Errorf("count_include_pad is %s, not a bool", describe(m.Attr("count_include_pad")))
	}
	return graph.OpAvgPool, a, nil
}

// pairAttr reads an int or a pair of ints (PyTorch's _pair arguments).
func pairAttr(m *pth.Module, name string) ([2]int, error) {
	v := m.Attr(name)
	if n, ok := integer(v); ok {
		return [2]int{n, n}, nil
	}
	var items []pth.Value
	switch t := v.(type) {
	case *pth.Tuple:
		items = t.Items
	case *pth.List:
		items = t.Items
	}
	if len(items) == 2 {
		a, ok1 := integer(items[0])
		b, ok2 := integer(items[1])
		if ok1 && ok2 {
			return [2]int{a, b}, nil
		}
	}
	return [2]int{}, fmt.Errorf("%s is %s, not an int or a pair of ints", name, describe(v))
}

func integer(v pth.Value) (int, bool) {
	if v, ok := v.(int64); ok && v >= math.MinInt32 && v <= math.MaxInt32 {
		return int(v), true
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

// describe writes a value as Python would.
func describe(v pth.Value) string {
	switch v := v.(type) {
	case nil:
		return "None"
	case bool:
		if v {
			return "True"
		}
		return "False"
	case string:
		return fmt.Sprintf("'%s'", v)
	case *pth.Tuple:
		var s []string
		for _, it := range v.Items {
			s = append(s, describe(it))
		}
		if len(s) == 1 {
			return "(" + s[0] + ",)"
		}
		return "(" + strings.Join(s, ", ") + ")"
	case *pth.List:
		var s []string
		for _, it := range v.Items {
			s = append(s, describe(it))
		}
		return "[" + strings.Join(s, ", ") + "]"
	case *pth.Dict:
		var s []string
		for i := 0; i < v.Len(); i++ {
			k, x := v.Entry(i)
			s = append(s, describe(k)+": "+describe(x))
		}
		return "{" + strings.Join(s, ", ") + "}"
	}
	return fmt.Sprint(v)
}

// chainBuilder turns an nn.Sequential chain into nodes.
type chainBuilder struct {
	w      graph.Weights
	g      *graph.Graph
	cur    *graph.Value
	used   map[string]bool
	layers int
}

func (b *chainBuilder) chain(m *pth.Module, prefix string, known ...string) error {
	if err := checkAttrs(m, known...); err != nil {
		return fmt.Errorf("%s (%s): %w", strings.TrimSuffix(prefix, "."), m.ShortClass(), err)
	}
	for _, c := range m.Children {
		path := prefix + c.Name
		if err := b.layer(c.Module, path); err != nil {
			return fmt.Errorf("%s (%s): %w", path, c.Module.ShortClass(), err)
		}
	}
	return nil
}

func (b *chainBuilder) layer(m *pth.Module, path string) error {
	if m.Class == classSequential {
		return b.chain(m, path+".")
	}
	if f, ok := blocks[m.Class]; ok {
		return f(b, m, path)
	}
	if why, ok := notModelled[m.Class]; ok {
		return failure.Unsupportedf("%s", why)
	}
	if len(m.Children) > 0 {
		return failure.Unsupportedf("a %s with children inside nn.Sequential is not a chain layer; save the torchvision model itself, or use --graph", m.Class)
	}
	// StochasticDepth is torchvision's, but a layer like torch.nn's.
	if !strings.HasPrefix(m.Class, "torch.nn.modules.") && m.Class != classStochasticDepth {
		return failure.Unsupportedf("%s inside nn.Sequential is not a chain layer; save the torchvision model itself, or use --graph", m.Class)
	}
	if m.Class == classIdentity {
		return checkAttrs(m)
	}
	if b.g == nil {
		if m.ShortClass() != "Conv2d" {
			return fmt.Errorf("the chain must start with a Conv2d (the input's channel count comes from it), not %s", m.ShortClass())
		}
		in, ok := integer(m.Attr("in_channels"))
		if !ok || in <= 0 {
			return fmt.Errorf("in_channels is %s", describe(m.Attr("in_channels")))
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
	op, attr, err := readLayer(m)
	if err != nil {
		return err
	}
	ch := b.cur.Channels
	switch op {
	case graph.OpConv:
		attr.Bias = params[graph.RoleBias] != ""
		if ch != 0 && attr.InChannels != ch {
			return fmt.Errorf("in_channels %d, but %d channels reach it", attr.InChannels, ch)
		}
		ch = attr.OutChannels
	case graph.OpBatchNorm:
		if ch != 0 && attr.Features != ch {
			return fmt.Errorf("num_features %d, but %d channels reach it", attr.Features, ch)
		}
	case graph.OpFlatten:
		ch = 0
	case graph.OpLinear:
		attr.Bias = params[graph.RoleBias] != ""
		if ch != 0 && attr.InChannels != ch {
			return fmt.Errorf("in_features %d, but %d features reach it", attr.InChannels, ch)
		}
		ch = attr.OutChannels
	}
	for role := range params {
		if !roleOf(op, role) {
			return fmt.Errorf("has a tensor %q, which a %s does not own", role, op)
		}
	}
	if err := checkShapes(b.w, op, attr, params); err != nil {
		return err
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

// recognizeSegmentation reads the state dict of a pickled FCN or
// DeepLabV3, whose keys sit at the top level.
func recognizeSegmentation(w graph.Weights, keys []string) (*graph.Graph, *Match, error) {
	for _, k := range keys {
		if _, ok := w.Shape(k); !ok {
			return nil, nil, fmt.Errorf("state dict lists %q but has no shape for it", k)
		}
	}
	g, m, err := buildFrom(w, keys, FamilySegmentation, "", true)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrUnrecognised, err)
	}
	return g, m, nil
}

// noDownsampleAttr: a block without a downsample branch holds
// downsample = None as a plain attribute (a branch is a child).
func noDownsampleAttr(m *pth.Module) error {
	if v, ok := m.Attrs["downsample"]; ok && v != nil {
		return fmt.Errorf("downsample is %s", describe(v))
	}
	return nil
}

// checkShapes compares a layer's tensors with the shapes its attributes
// imply: the module's attributes, not its tensors, give the graph, so a
// module whose two disagree is refused here rather than in the runtime.
func checkShapes(w graph.Weights, op graph.Op, a graph.Attr, params map[string]string) error {
	want := map[string][]int{}
	switch op {
	case graph.OpConv:
		want[graph.RoleWeight] = []int{a.OutChannels, a.InChannels / a.Groups, a.KernelSize[0], a.KernelSize[1]}
		want[graph.RoleBias] = []int{a.OutChannels}
	case graph.OpLinear:
		want[graph.RoleWeight] = []int{a.OutChannels, a.InChannels}
		want[graph.RoleBias] = []int{a.OutChannels}
	case graph.OpBatchNorm:
		for _, r := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
			want[r] = []int{a.Features}
		}
	}
	for role, s := range want {
		key, ok := params[role]
		if !ok {
			if role == graph.RoleBias && (op == graph.OpConv || op == graph.OpLinear) {
				continue
			}
			return fmt.Errorf("has no tensor %q", role)
		}
		got, ok := w.Shape(key)
		if !ok {
			return fmt.Errorf("%s is not in the state dict", key)
		}
		if !sameShape(got, s) {
			return fmt.Errorf("%s has shape %v, but the module's attributes give %v", key, got, s)
		}
	}
	if op.IsBNFamily() {
		if key, ok := params[graph.RoleNumBatches]; ok {
			if got, _ := w.Shape(key); graph.Numel(got) != 1 || len(got) > 1 {
				return fmt.Errorf("%s has shape %v, expected a scalar", key, got)
			}
		}
	}
	if op == graph.OpConv || op == graph.OpLinear {
		if _, ok := params[graph.RoleWeight]; !ok {
			return fmt.Errorf("has no tensor %q", graph.RoleWeight)
		}
	}
	return nil
}
