package arch

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// State dicts of the families whose forward is rebuilt from a module tree
// (MobileNetV2, MobileNetV3, MNASNet, RegNet, GoogLeNet, Inception3):
// the tree a torchvision 0.14 constructor would have built is synthesised
// from the keys and shapes (block counts from module indices, widths,
// kernels and groups from weight shapes, squeeze-and-excitation and
// projection branches from which keys exist), and what a state dict
// cannot hold (strides, paddings, activations, BN eps and momentum,
// dropout rates) is taken from the constructor's configuration table for
// that family. The tree then goes through the same builder as a whole
// pickled module (tree.go), so both paths give one graph.

// synth builds pth.Module trees whose tensors are the state dict's.
type synth struct {
	w       graph.Weights
	missing []string
}

const (
	nnConv        = "torch.nn.modules.conv.Conv2d"
	nnBN          = "torch.nn.modules.batchnorm.BatchNorm2d"
	nnLinear      = "torch.nn.modules.linear.Linear"
	nnDropout     = "torch.nn.modules.dropout.Dropout"
	nnMaxPool     = "torch.nn.modules.pooling.MaxPool2d"
	nnAdaptive    = "torch.nn.modules.pooling.AdaptiveAvgPool2d"
	nnActivations = "torch.nn.modules.activation."
	tvConvNormAct = "torchvision.ops.misc.Conv2dNormActivation"
	tvSE          = "torchvision.ops.misc.SqueezeExcitation"
)

func tuple2(a [2]int) *pth.Tuple {
	return &pth.Tuple{Items: []pth.Value{int64(a[0]), int64(a[1])}}
}

func (s *synth) shape(key string) []int {
	sh, ok := s.w.Shape(key)
	if !ok {
		if !contains(s.missing, key) {
			s.missing = append(s.missing, key)
		}
		return nil
	}
	return sh
}

func (s *synth) has(key string) bool {
	_, ok := s.w.Shape(key)
	return ok
}

// tensors lists the roles whose keys path.role the state dict has
// (num_batches_tracked and a bias are optional), and notes the required
// ones it lacks.
func (s *synth) tensors(path string, required []string, optional ...string) []pth.NamedTensor {
	var out []pth.NamedTensor
	for _, r := range required {
		s.shape(path + "." + r)
		out = append(out, pth.NamedTensor{Name: r})
	}
	for _, r := range optional {
		if s.has(path + "." + r) {
			out = append(out, pth.NamedTensor{Name: r})
		}
	}
	return out
}

// pad says a convolution's padding from its kernel and dilation.
type pad func(k, d [2]int) [2]int

// same is torchvision's usual (k - 1) / 2 * d.
func same(k, d [2]int) [2]int { return [2]int{(k[0] - 1) / 2 * d[0], (k[1] - 1) / 2 * d[1]} }

func noPad(k, d [2]int) [2]int { return [2]int{} }

// conv is the Conv2d at path over in channels: out channels, kernel and
// groups from its weight's shape.
func (s *synth) conv(path string, in, stride int, p pad) (*pth.Module, int) {
	sh := s.shape(path + ".weight")
	if len(sh) != 4 || sh[1] <= 0 || in%sh[1] != 0 {
		if sh != nil {
			s.missing = append(s.missing, fmt.Sprintf("%s.weight of shape [out, %d/groups, kh, kw] (has %v)", path, in, sh))
		}
		sh = []int{1, 1, 1, 1}
	}
	k, d := [2]int{sh[2], sh[3]}, [2]int{1, 1}
	m := &pth.Module{Class: nnConv, Attrs: map[string]pth.Value{
		"in_channels": int64(in), "out_channels": int64(sh[0]), "kernel_size": tuple2(k), "stride": tuple2([2]int{stride, stride}),
		"padding": tuple2(p(k, d)), "dilation": tuple2(d), "transposed": false, "output_padding": tuple2([2]int{}),
		"groups": int64(in / sh[1]), "padding_mode": "zeros"},
		Params: s.tensors(path, []string{"weight"}, "bias")}
	return m, sh[0]
}

func (s *synth) bn(path string, eps, momentum float64) *pth.Module {
	n := 0
	if sh := s.shape(path + ".weight"); len(sh) == 1 {
		n = sh[0]
	}
	m := &pth.Module{Class: nnBN, Attrs: map[string]pth.Value{"num_features": int64(n), "eps": eps, "momentum": momentum,
		"affine": true, "track_running_stats": true},
		Params: s.tensors(path, []string{"weight", "bias"})}
	m.Buffers = s.tensors(path, []string{"running_mean", "running_var"}, "num_batches_tracked")
	return m
}

func (s *synth) linear(path string) (*pth.Module, int) {
	sh := s.shape(path + ".weight")
	if len(sh) != 2 {
		sh = []int{1, 1}
	}
	return &pth.Module{Class: nnLinear, Attrs: map[string]pth.Value{"in_features": int64(sh[1]), "out_features": int64(sh[0])},
		Params: s.tensors(path, []string{"weight"}, "bias")}, sh[0]
}

// act is a torch.nn activation: ReLU, ReLU6, Hardswish, Hardsigmoid,
// Sigmoid, SiLU.
func act(name string) *pth.Module {
	m := &pth.Module{Class: nnActivations + name, Attrs: map[string]pth.Value{"inplace": true}}
	switch name {
	case "ReLU6":
		m.Attrs["min_val"], m.Attrs["max_val"] = 0.0, 6.0
	case "Sigmoid":
		delete(m.Attrs, "inplace")
	case "Hardsigmoid":
		m.Attrs["inplace"] = false
	}
	return m
}

func dropout(p float64) *pth.Module {
	return &pth.Module{Class: nnDropout, Attrs: map[string]pth.Value{"p": p, "inplace": true}}
}

func maxPool(k, stride, padding int, ceil bool) *pth.Module {
	return &pth.Module{Class: nnMaxPool, Attrs: map[string]pth.Value{"kernel_size": int64(k), "stride": int64(stride), "padding": int64(padding),
		"dilation": int64(1), "return_indices": false, "ceil_mode": ceil}}
}

func adaptive(out pth.Value) *pth.Module {
	return &pth.Module{Class: nnAdaptive, Attrs: map[string]pth.Value{"output_size": out}}
}

// tree is a module with named children.
func tree(class string, attrs map[string]pth.Value, kids ...pth.Child) *pth.Module {
	if attrs == nil {
		attrs = map[string]pth.Value{}
	}
	return &pth.Module{Class: class, Attrs: attrs, Children: kids}
}

func kid(name string, m *pth.Module) pth.Child { return pth.Child{Name: name, Module: m} }

// seq is an nn.Sequential of mods, named 0, 1, ...
func seq(class string, attrs map[string]pth.Value, mods ...*pth.Module) *pth.Module {
	var kids []pth.Child
	for i, m := range mods {
		kids = append(kids, kid(strconv.Itoa(i), m))
	}
	return tree(class, attrs, kids...)
}

// convNormAct is torchvision's Conv2dNormActivation at path: conv, BN,
// then the activation unless it is "".
func (s *synth) convNormAct(path string, in, stride int, eps, momentum float64, activation string) (*pth.Module, int) {
	c, out := s.conv(path+".0", in, stride, same)
	mods := []*pth.Module{c, s.bn(path+".1", eps, momentum)}
	if activation != "" {
		mods = append(mods, act(activation))
	}
	return seq(tvConvNormAct, map[string]pth.Value{"out_channels": int64(out)}, mods...), out
}

// count returns how many consecutive indices path.0, path.1, ... have a
// key below them.
func count(keys []string, path string) int {
	n := 0
	for _, k := range keys {
		rest, ok := strings.CutPrefix(k, path+".")
		if !ok {
			continue
		}
		i, _, _ := strings.Cut(rest, ".")
		if v, err := strconv.Atoi(i); err == nil && v >= n {
			n = v + 1
		}
	}
	return n
}

// withPrefix copies g with prefix in front of every node name and
// parameter key, as the state-dict recognisers name a prefixed dict's
// nodes.
func withPrefix(g *graph.Graph, prefix string) *graph.Graph {
	out := graph.New(g.Arch, g.Input.Channels)
	vals := map[*graph.Value]*graph.Value{g.Input: out.Input}
	for _, n := range g.Nodes {
		if n.Op == graph.OpInput {
			continue
		}
		var ins []*graph.Value
		for _, in := range n.Inputs {
			ins = append(ins, vals[in])
		}
		var params map[string]string
		if n.Params != nil {
			params = map[string]string{}
			for r, k := range n.Params {
				params[r] = prefix + k
			}
		}
		v := out.Add(prefix+n.Name, n.Op, n.Attr, params, ins...)
		nn := v.Producer
		keep := *nn
		*nn = *n
		nn.Name, nn.Inputs, nn.Out, nn.Params = keep.Name, keep.Inputs, keep.Out, keep.Params
		v.Channels = n.Out.Channels
		vals[n.Out] = v
	}
	out.Output = vals[g.Output]
	for _, a := range g.Aux {
		out.SetAux(a.Name, vals[a.Value], a.TrainOnly)
	}
	return out
}

// treeFamily is a family recognised by synthesising its module tree.
type treeFamily struct {
	// anchor is a key every state dict of the family has.
	anchor string
	// root is the synthesised tree's class (a family may build more than
	// one: the MobileNetV3 segmentation models).
	root string
	// make synthesises the tree and names the torchvision configuration
	// ("" for none) it matches.
	make func(s *synth, keys []string, name string) (*pth.Module, error)
	// head holds the modules whose shapes follow num_classes, left out of
	// the signature.
	head    []string
	assumed string
}

var treeFamilies = []treeFamily{
	{anchor: "features.1.conv.0.0.weight", root: "torchvision.models.mobilenetv2.MobileNetV2", make: synthMobileNetV2, head: []string{"classifier.1"},
		assumed: "MobileNetV2's inverted_residual_setting (strides 1, 2, 2, 2, 1, 2, 1 per stage), ReLU6, Dropout(0.2), BN eps 1e-5 and momentum 0.1"},
	{anchor: "features.1.block.0.0.weight", root: "torchvision.models.mobilenetv3.MobileNetV3", make: synthMobileNetV3, head: []string{"classifier.3"},
		assumed: "mobilenet_v3_large's or mobilenet_v3_small's block table (strides and ReLU or Hardswish per block, chosen by the block count), no dilation, Hardsigmoid gates, Dropout(0.2), BN eps 0.001 and momentum 0.01"},
	{anchor: "layers.8.0.layers.0.weight", root: "torchvision.models.mnasnet.MNASNet", make: synthMNASNet, head: []string{"classifier.1"},
		assumed: "MNASNet's stack table (strides 2, 2, 2, 1, 2, 1), ReLU, Dropout(0.2), BN eps 1e-5 and momentum 1 - 0.9997"},
	{anchor: "trunk_output.block1.block1-0.f.a.0.weight", root: "torchvision.models.regnet.RegNet", make: synthRegNet, head: []string{"fc"},
		assumed: "stride 2 in the stem and the first block of every stage, 3x3 group convolutions with padding 1, ReLU, Sigmoid gates, bottleneck_multiplier 1, BN eps 1e-5 and momentum 0.1"},
	{anchor: "features.1.0.block.0.0.weight", root: "torchvision.models.efficientnet.EfficientNet", make: synthEfficientNet, head: []string{"classifier.1"},
		assumed: "EfficientNet's stage table (strides 1, 2, 2, 2, 1, 2, 1), SiLU, Sigmoid gates, StochasticDepth(0.2 * block index / blocks, \"row\") on every residual branch, and the variant's classifier dropout and BN eps and momentum"},
	{anchor: "backbone.1.block.0.0.weight", make: synthMobileSegmentation, head: []string{"classifier.low_classifier", "classifier.high_classifier", "classifier.4"},
		assumed: segmentationBackboneNote + ", and the head as torchvision's builder makes it (LRASPPHead with bilinear resizing; or DeepLabHead with ASPP rates 12, 24, 36 and Dropout(0.5)), BN eps 0.001 and momentum 0.01 in the backbone, 1e-5 and 0.1 in the head"},
	{anchor: "stage2.0.branch2.0.weight", root: "torchvision.models.shufflenetv2.ShuffleNetV2", make: synthShuffleNetV2, head: []string{"fc"},
		assumed: "ShuffleNetV2's strides (2 in conv1, the max pool and the first block of each stage), channel split and shuffle in two groups, ReLU, BN eps 1e-5 and momentum 0.1"},
	{anchor: "inception3a.branch1.conv.weight", root: "torchvision.models.googlenet.GoogLeNet", make: synthGoogLeNet, head: []string{"fc"},
		assumed: "GoogLeNet's strides and paddings, MaxPool2d(3, 2, ceil_mode=True) between stages, aux_logits=False, transform_input=False (torchvision sets it when built with pretrained weights: normalise the input yourself, or convert the whole module), Dropout(0.2), BN eps 0.001 and momentum 0.1"},
	{anchor: "Mixed_5b.branch1x1.conv.weight", root: "torchvision.models.inception.Inception3", make: synthInception3, head: []string{"fc"},
		assumed: "Inception3's strides and paddings, aux_logits=False, transform_input=False (torchvision sets it when built with pretrained weights: normalise the input yourself, or convert the whole module), Dropout(0.5), BN eps 0.001 and momentum 0.1"},
}

// prefixed is a state dict seen below prefix: Keys strips it where
// present (a key without it is left, and then refused as unused).
type prefixed struct {
	graph.Weights
	prefix string
}

func (p prefixed) Keys() []string {
	keys := p.Weights.Keys()
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = strings.TrimPrefix(k, p.prefix)
	}
	return out
}

func (p prefixed) Shape(key string) ([]int, bool) { return p.Weights.Shape(p.prefix + key) }

// recognizeTree tries the tree families on a state dict; ok is false when
// no family's anchor is among the keys.
func recognizeTree(w graph.Weights, keys []string) (*graph.Graph, *Match, bool, error) {
	for _, f := range treeFamilies {
		for _, k := range keys {
			prefix, found := strings.CutSuffix(k, f.anchor)
			if !found || (prefix != "" && !strings.HasSuffix(prefix, ".")) {
				continue
			}
			g, m, err := buildTree(w, prefix, f)
			return g, m, true, err
		}
	}
	return nil, nil, false, nil
}

func buildTree(w graph.Weights, prefix string, f treeFamily) (*graph.Graph, *Match, error) {
	pw := prefixed{w, prefix}
	s := &synth{w: pw}
	keys := pw.Keys()
	name := treeNames[treeSignature(pw, f.head)]
	m, err := f.make(s, keys, name)
	root, ok := treeRoots[f.root]
	if !ok {
		root = treeRoot{title: "lraspp or deeplabv3 over MobileNetV3"}
	}
	if m != nil {
		root = treeRoots[m.Class]
		if m.Class == classDeepLabV3 {
			root = deeplabMobileTree
		}
	}
	if err == nil && len(s.missing) > 0 {
		err = fmt.Errorf("the %s layout lacks %d keys: %s", root.title, len(s.missing), firstFew(s.missing, 8))
	}
	if err != nil {
		return nil, nil, fmt.Errorf("%w: not a torchvision %s state dict: %w", ErrUnrecognised, root.title, err)
	}
	g, match, err := fromTree(m, pw, root)
	if err != nil {
		// The tree is synthesised: "whole pickled" would mislead. The
		// error's kind (unsupported or bad input) is kept.
		msg := fmt.Errorf("%w: not a torchvision %s state dict: %s", ErrUnrecognised, root.title, strings.TrimPrefix(err.Error(), "whole pickled "+m.ShortClass()+": "))
		if failure.Of(err) == failure.Unsupported {
			msg = failure.As(failure.Unsupported, msg)
		}
		return nil, nil, msg
	}
	if prefix != "" {
		g = withPrefix(g, prefix)
	}
	match.Prefix = prefix
	if name != "" {
		match.Arch, match.Exact = name, true
		g.Arch = name
	}
	match.Notes = []string{}
	if prefix != "" {
		match.Notes = append(match.Notes, fmt.Sprintf("key prefix %q", prefix))
	}
	if m.Class == classLRASPP || m.Class == classDeepLabV3 {
		match.Notes = append(match.Notes, "the graph's output is the model's \"out\" tensor (torchvision returns {\"out\": ...})")
	}
	match.Notes = append(match.Notes, fmt.Sprintf("num_classes %d", g.Output.Channels),
		fmt.Sprintf("%s from torchvision 0.14's %s constructor: %s; a state dict holds no strides, paddings, dilations or activations, so a network built otherwise "+
			"has the same keys and shapes and would be converted wrongly: for anything else give the structure with "+
			"--graph model.onnx (torch.onnx.export with training=torch.onnx.TrainingMode.PRESERVE) or convert the whole pickled module (torch.save(model))",
			assumedPrefix, m.ShortClass(), f.assumed))
	return g, match, nil
}

// synthMobileNetV2 mirrors MobileNetV2.__init__ with the default
// inverted_residual_setting: 17 blocks.
func synthMobileNetV2(s *synth, keys []string, _ string) (*pth.Module, error) {
	strides := []int{1, 2, 1, 2, 1, 1, 2, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1}
	if n := count(keys, "features"); n != len(strides)+2 {
		return nil, fmt.Errorf("features has %d modules, torchvision's inverted_residual_setting gives %d", n, len(strides)+2)
	}
	const eps, mom = 1e-5, 0.1
	first, c := s.convNormAct("features.0", 3, 2, eps, mom, "ReLU6")
	feats := []*pth.Module{first}
	for i, st := range strides {
		p := fmt.Sprintf("features.%d.conv", i+1)
		in := c
		var body []*pth.Module
		if sh := s.shape(p + ".0.0.weight"); len(sh) == 4 && sh[2] == 1 {
			e, hidden := s.convNormAct(p+".0", c, 1, eps, mom, "ReLU6")
			body, c = append(body, e), hidden
		}
		j := len(body)
		dw, _ := s.convNormAct(fmt.Sprintf("%s.%d", p, j), c, st, eps, mom, "ReLU6")
		pw, out := s.conv(fmt.Sprintf("%s.%d", p, j+1), c, 1, noPad)
		body = append(body, dw, pw, s.bn(fmt.Sprintf("%s.%d", p, j+2), eps, mom))
		feats = append(feats, tree("torchvision.models.mobilenetv2.InvertedResidual",
			map[string]pth.Value{"stride": int64(st), "use_res_connect": st == 1 && in == out, "out_channels": int64(out)},
			kid("conv", seq(classSequential, nil, body...))))
		c = out
	}
	last, lc := s.convNormAct(fmt.Sprintf("features.%d", len(strides)+1), c, 1, eps, mom, "ReLU6")
	feats = append(feats, last)
	fc, _ := s.linear("classifier.1")
	return tree("torchvision.models.mobilenetv2.MobileNetV2", map[string]pth.Value{"last_channel": int64(lc)},
		kid("features", seq(classSequential, nil, feats...)),
		kid("classifier", seq(classSequential, nil, dropout(0.2), fc))), nil
}

// mobilenetV3Blocks: per block, stride and Hardswish (else ReLU), from
// torchvision's _mobilenet_v3_conf.
var mobilenetV3Blocks = map[int][]struct {
	stride int
	hs     bool
}{
	15: {{1, false}, {2, false}, {1, false}, {2, false}, {1, false}, {1, false}, {2, true}, {1, true}, {1, true}, {1, true}, {1, true}, {1, true}, {2, true}, {1, true}, {1, true}},
	11: {{2, false}, {2, false}, {1, false}, {2, true}, {1, true}, {1, true}, {1, true}, {1, true}, {2, true}, {1, true}, {1, true}},
}

func synthMobileNetV3(s *synth, keys []string, _ string) (*pth.Module, error) {
	n := count(keys, "features") - 2
	table, ok := mobilenetV3Blocks[n]
	if !ok {
		return nil, fmt.Errorf("features has %d blocks; torchvision's mobilenet_v3_large has 15, mobilenet_v3_small 11", n)
	}
	feats, err := s.mobileNetV3Features("features", table, 0)
	if err != nil {
		return nil, err
	}
	fc1, _ := s.linear("classifier.0")
	fc2, _ := s.linear("classifier.3")
	return tree("torchvision.models.mobilenetv3.MobileNetV3", nil,
		kid("features", seq(classSequential, nil, feats...)),
		kid("avgpool", adaptive(int64(1))),
		kid("classifier", seq(classSequential, nil, fc1, act("Hardswish"), dropout(0.2), fc2))), nil
}

// mobileNetV3Features is MobileNetV3's features below prefix: the stem,
// the blocks of table, the last 1x1 convolution. The last dilatedTail
// blocks are built as with dilated=True: stride 1, their depthwise
// convolutions dilated by 2.
func (s *synth) mobileNetV3Features(prefix string, table []struct {
	stride int
	hs     bool
}, dilatedTail int) ([]*pth.Module, error) {
	const eps, mom = 0.001, 0.01
	first, c := s.convNormAct(prefix+".0", 3, 2, eps, mom, "Hardswish")
	feats := []*pth.Module{first}
	for i, b := range table {
		p := fmt.Sprintf("%s.%d.block", prefix, i+1)
		a := "ReLU"
		if b.hs {
			a = "Hardswish"
		}
		stride, dil := b.stride, 1
		if i >= len(table)-dilatedTail {
			stride, dil = 1, 2
		}
		in := c
		var body []*pth.Module
		j := 0
		if sh := s.shape(p + ".0.0.weight"); len(sh) == 4 && sh[2] == 1 {
			e, exp := s.convNormAct(p+".0", c, 1, eps, mom, a)
			body, c, j = append(body, e), exp, 1
		}
		dw, _ := s.convNormAct(fmt.Sprintf("%s.%d", p, j), c, stride, eps, mom, a)
		if dil > 1 {
			conv := dw.Children[0].Module
			k := [2]int{3, 3}
			if sh, ok := s.w.Shape(fmt.Sprintf("%s.%d.0.weight", p, j)); ok && len(sh) == 4 {
				k = [2]int{sh[2], sh[3]}
			}
			conv.Attrs["dilation"] = tuple2([2]int{dil, dil})
			conv.Attrs["padding"] = tuple2(same(k, [2]int{dil, dil}))
		}
		body = append(body, dw)
		j++
		if sp := fmt.Sprintf("%s.%d", p, j); s.has(sp + ".fc1.weight") {
			body = append(body, s.squeeze(sp, c, "ReLU", "Hardsigmoid"))
			j++
		}
		proj, out := s.convNormAct(fmt.Sprintf("%s.%d", p, j), c, 1, eps, mom, "")
		body = append(body, proj)
		feats = append(feats, tree("torchvision.models.mobilenetv3.InvertedResidual",
			map[string]pth.Value{"use_res_connect": b.stride == 1 && in == out, "out_channels": int64(out)},
			kid("block", seq(classSequential, nil, body...))))
		c = out
	}
	last, _ := s.convNormAct(fmt.Sprintf("%s.%d", prefix, len(table)+1), c, 1, eps, mom, "Hardswish")
	return append(feats, last), nil
}

// squeeze is torchvision's SqueezeExcitation over c channels.
func (s *synth) squeeze(path string, c int, activation, scale string) *pth.Module {
	fc1, sq := s.conv(path+".fc1", c, 1, noPad)
	fc2, _ := s.conv(path+".fc2", sq, 1, noPad)
	return tree(tvSE, nil, kid("avgpool", adaptive(int64(1))), kid("fc1", fc1), kid("activation", act(activation)),
		kid("fc2", fc2), kid("scale_activation", act(scale)))
}

func synthMNASNet(s *synth, keys []string, _ string) (*pth.Module, error) {
	// layers.16, the last ReLU, holds no tensor.
	if n := count(keys, "layers"); n != 16 {
		return nil, fmt.Errorf("layers has %d modules with tensors, torchvision's MNASNet 16", n)
	}
	const eps = 1e-5
	// Python's 1 - 0.9997 in float64, as torchvision computes it (a Go
	// constant expression would be exact).
	decay := 0.9997
	mom := 1 - decay
	c0, c := s.conv("layers.0", 3, 2, same)
	dw, _ := s.conv("layers.3", c, 1, same)
	pw, c1 := s.conv("layers.6", c, 1, noPad)
	mods := []*pth.Module{c0, s.bn("layers.1", eps, mom), act("ReLU"), dw, s.bn("layers.4", eps, mom), act("ReLU"), pw, s.bn("layers.7", eps, mom)}
	c = c1
	for i, st := range []int{2, 2, 2, 1, 2, 1} {
		p := fmt.Sprintf("layers.%d", 8+i)
		var blocks []*pth.Module
		for j := 0; j < count(keys, p); j++ {
			bp := fmt.Sprintf("%s.%d.layers", p, j)
			stride := 1
			if j == 0 {
				stride = st
			}
			e, mid := s.conv(bp+".0", c, 1, noPad)
			d, _ := s.conv(bp+".3", mid, stride, same)
			o, out := s.conv(bp+".6", mid, 1, noPad)
			blocks = append(blocks, tree("torchvision.models.mnasnet._InvertedResidual", map[string]pth.Value{"apply_residual": c == out && stride == 1},
				kid("layers", seq(classSequential, nil, e, s.bn(bp+".1", eps, mom), act("ReLU"), d, s.bn(bp+".4", eps, mom), act("ReLU"), o, s.bn(bp+".7", eps, mom)))))
			c = out
		}
		if len(blocks) == 0 {
			return nil, fmt.Errorf("%s has no blocks", p)
		}
		mods = append(mods, seq(classSequential, nil, blocks...))
	}
	last, _ := s.conv("layers.14", c, 1, noPad)
	mods = append(mods, last, s.bn("layers.15", eps, mom), act("ReLU"))
	fc, _ := s.linear("classifier.1")
	return tree("torchvision.models.mnasnet.MNASNet", nil,
		kid("layers", seq(classSequential, nil, mods...)),
		kid("classifier", seq(classSequential, nil, dropout(0.2), fc))), nil
}

func synthRegNet(s *synth, keys []string, _ string) (*pth.Module, error) {
	const eps, mom = 1e-5, 0.1
	stem, c := s.convNormAct("stem", 3, 2, eps, mom, "ReLU")
	stem.Class = "torchvision.models.regnet.SimpleStemIN"
	var stages []pth.Child
	for i := 1; ; i++ {
		sp := fmt.Sprintf("trunk_output.block%d", i)
		var blocks []pth.Child
		for j := 0; ; j++ {
			name := fmt.Sprintf("block%d-%d", i, j)
			bp := sp + "." + name
			if !s.has(bp + ".f.a.0.weight") {
				break
			}
			stride := 1
			if j == 0 {
				stride = 2
			}
			var kids []pth.Child
			if s.has(bp + ".proj.0.weight") {
				pr, _ := s.convNormAct(bp+".proj", c, stride, eps, mom, "")
				kids = append(kids, kid("proj", pr))
			}
			a, wb := s.convNormAct(bp+".f.a", c, 1, eps, mom, "ReLU")
			b, _ := s.convNormAct(bp+".f.b", wb, stride, eps, mom, "ReLU")
			f := []pth.Child{kid("a", a), kid("b", b)}
			if s.has(bp + ".f.se.fc1.weight") {
				f = append(f, kid("se", s.squeeze(bp+".f.se", wb, "ReLU", "Sigmoid")))
			}
			cc, out := s.convNormAct(bp+".f.c", wb, 1, eps, mom, "")
			f = append(f, kid("c", cc))
			kids = append(kids, kid("f", tree("torchvision.models.regnet.BottleneckTransform", nil, f...)), kid("activation", act("ReLU")))
			blocks = append(blocks, kid(name, tree("torchvision.models.regnet.ResBottleneckBlock", nil, kids...)))
			c = out
		}
		if len(blocks) == 0 {
			break
		}
		stages = append(stages, kid(fmt.Sprintf("block%d", i), tree("torchvision.models.regnet.AnyStage", nil, blocks...)))
	}
	fc, _ := s.linear("fc")
	return tree("torchvision.models.regnet.RegNet", nil, kid("stem", stem), kid("trunk_output", tree(classSequential, nil, stages...)),
		kid("avgpool", adaptive(tuple2([2]int{1, 1}))), kid("fc", fc)), nil
}

// basicConv2d is GoogLeNet's and Inception3's BasicConv2d (BN eps 0.001).
func (s *synth) basicConv2d(class, path string, in, stride int, p pad) (*pth.Module, int) {
	c, out := s.conv(path+".conv", in, stride, p)
	return tree(class, nil, kid("conv", c), kid("bn", s.bn(path+".bn", 0.001, 0.1))), out
}

func synthGoogLeNet(s *synth, keys []string, _ string) (*pth.Module, error) {
	// aux1.* and aux2.* keys: googlenet(aux_logits=True), the
	// constructor's default, with both InceptionAux heads.
	aux := s.has("aux1.conv.conv.weight")
	const bc = "torchvision.models.googlenet.BasicConv2d"
	conv1, c := s.basicConv2d(bc, "conv1", 3, 2, same)
	conv2, c := s.basicConv2d(bc, "conv2", c, 1, same)
	conv3, c := s.basicConv2d(bc, "conv3", c, 1, same)
	kids := []pth.Child{kid("conv1", conv1), kid("maxpool1", maxPool(3, 2, 0, true)), kid("conv2", conv2), kid("conv3", conv3),
		kid("maxpool2", maxPool(3, 2, 0, true))}
	for _, name := range []string{"inception3a", "inception3b", "maxpool3", "inception4a", "inception4b", "inception4c", "inception4d", "inception4e",
		"maxpool4", "inception5a", "inception5b"} {
		switch name {
		case "maxpool3":
			kids = append(kids, kid(name, maxPool(3, 2, 0, true)))
			continue
		case "maxpool4":
			kids = append(kids, kid(name, maxPool(2, 2, 0, true)))
			continue
		}
		b1, o1 := s.basicConv2d(bc, name+".branch1", c, 1, same)
		b2a, m2 := s.basicConv2d(bc, name+".branch2.0", c, 1, same)
		b2b, o2 := s.basicConv2d(bc, name+".branch2.1", m2, 1, same)
		b3a, m3 := s.basicConv2d(bc, name+".branch3.0", c, 1, same)
		b3b, o3 := s.basicConv2d(bc, name+".branch3.1", m3, 1, same)
		b4, o4 := s.basicConv2d(bc, name+".branch4.1", c, 1, same)
		kids = append(kids, kid(name, tree("torchvision.models.googlenet.Inception", nil, kid("branch1", b1),
			kid("branch2", seq(classSequential, nil, b2a, b2b)), kid("branch3", seq(classSequential, nil, b3a, b3b)),
			kid("branch4", seq(classSequential, nil, maxPool(3, 1, 1, true), b4)))))
		c = o1 + o2 + o3 + o4
	}
	if aux {
		for _, name := range []string{"aux1", "aux2"} {
			in := 0
			if sh := s.shape(name + ".conv.conv.weight"); len(sh) == 4 {
				in = sh[1]
			}
			conv, _ := s.basicConv2d(bc, name+".conv", in, 1, same)
			fc1, _ := s.linear(name + ".fc1")
			fc2, _ := s.linear(name + ".fc2")
			drop := dropout(0.7)
			drop.Attrs["inplace"] = false
			kids = append(kids, kid(name, tree("torchvision.models.googlenet.InceptionAux", nil,
				kid("conv", conv), kid("fc1", fc1), kid("fc2", fc2), kid("dropout", drop))))
		}
	}
	fc, _ := s.linear("fc")
	kids = append(kids, kid("avgpool", adaptive(tuple2([2]int{1, 1}))), kid("dropout", dropout(0.2)), kid("fc", fc))
	kids[len(kids)-2].Module.Attrs["inplace"] = false
	return tree("torchvision.models.googlenet.GoogLeNet", map[string]pth.Value{"aux_logits": aux, "transform_input": false}, kids...), nil
}

// inception3Unpadded are Inception3's convolutions without padding (the
// rest pad to keep the size); inception3Strided those with stride 2.
var (
	inception3Unpadded = map[string]bool{"Conv2d_1a_3x3": true, "Conv2d_2a_3x3": true, "Conv2d_4a_3x3": true,
		"Mixed_6a.branch3x3": true, "Mixed_6a.branch3x3dbl_3": true, "Mixed_7a.branch3x3_2": true, "Mixed_7a.branch7x7x3_4": true}
	inception3Strided = map[string]bool{"Conv2d_1a_3x3": true,
		"Mixed_6a.branch3x3": true, "Mixed_6a.branch3x3dbl_3": true, "Mixed_7a.branch3x3_2": true, "Mixed_7a.branch7x7x3_4": true}
)

func synthInception3(s *synth, keys []string, _ string) (*pth.Module, error) {
	// AuxLogits.* keys: inception_v3(aux_logits=True), the constructor's
	// default, with its InceptionAux head.
	aux := s.has("AuxLogits.conv0.conv.weight")
	const bc = "torchvision.models.inception.BasicConv2d"
	basic := func(path string, in int) (*pth.Module, int) {
		p, st := same, 1
		if inception3Unpadded[path] {
			p = noPad
		}
		if inception3Strided[path] {
			st = 2
		}
		return s.basicConv2d(bc, path, in, st, p)
	}
	c := 3
	var kids []pth.Child
	for _, name := range []string{"Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "maxpool1", "Conv2d_3b_1x1", "Conv2d_4a_3x3", "maxpool2"} {
		if strings.HasPrefix(name, "maxpool") {
			kids = append(kids, kid(name, maxPool(3, 2, 0, false)))
			continue
		}
		var m *pth.Module
		m, c = basic(name, c)
		kids = append(kids, kid(name, m))
	}
	blocks := []struct{ name, class string }{{"Mixed_5b", "InceptionA"}, {"Mixed_5c", "InceptionA"}, {"Mixed_5d", "InceptionA"}, {"Mixed_6a", "InceptionB"},
		{"Mixed_6b", "InceptionC"}, {"Mixed_6c", "InceptionC"}, {"Mixed_6d", "InceptionC"}, {"Mixed_6e", "InceptionC"}, {"Mixed_7a", "InceptionD"},
		{"Mixed_7b", "InceptionE"}, {"Mixed_7c", "InceptionE"}}
	for _, blk := range blocks {
		var bk []pth.Child
		out := 0
		for _, br := range inceptionV3Branches[blk.class] {
			in := c
			for _, st := range br {
				switch {
				case st.pool == 'm':
					out += in
				case st.pair[0] != "":
					for _, n := range st.pair {
						m, o := basic(blk.name+"."+n, in)
						bk = append(bk, kid(n, m))
						out += o
					}
				case st.mod != "":
					m, o := basic(blk.name+"."+st.mod, in)
					bk = append(bk, kid(st.mod, m))
					in = o
				}
			}
			if last := br[len(br)-1]; last.mod != "" {
				out += in
			}
		}
		kids = append(kids, kid(blk.name, tree("torchvision.models.inception."+blk.class, nil, bk...)))
		c = out
	}
	if aux {
		in := 0
		if sh := s.shape("AuxLogits.conv0.conv.weight"); len(sh) == 4 {
			in = sh[1]
		}
		conv0, m := s.basicConv2d(bc, "AuxLogits.conv0", in, 1, noPad)
		conv1, _ := s.basicConv2d(bc, "AuxLogits.conv1", m, 1, noPad)
		afc, _ := s.linear("AuxLogits.fc")
		kids = append(kids, kid("AuxLogits", tree("torchvision.models.inception.InceptionAux", nil,
			kid("conv0", conv0), kid("conv1", conv1), kid("fc", afc))))
	}
	fc, _ := s.linear("fc")
	d := dropout(0.5)
	d.Attrs["inplace"] = false
	kids = append(kids, kid("avgpool", adaptive(tuple2([2]int{1, 1}))), kid("dropout", d), kid("fc", fc))
	return tree("torchvision.models.inception.Inception3", map[string]pth.Value{"aux_logits": aux, "transform_input": false}, kids...), nil
}

// treeSignature digests a state dict's keys and shapes, the final
// classifier's (head) and num_batches_tracked aside (num_classes varies, old
// checkpoints lack the counters), for naming the torchvision
// configuration a synthesised tree matches.
func treeSignature(w graph.Weights, head []string) string {
	var lines []string
	for _, k := range w.Keys() {
		if strings.HasSuffix(k, ".num_batches_tracked") {
			continue
		}
		skip := false
		for _, h := range head {
			skip = skip || strings.HasPrefix(k, h+".")
		}
		if skip {
			continue
		}
		sh, _ := w.Shape(k)
		lines = append(lines, fmt.Sprintf("%s %v", k, sh))
	}
	sort.Strings(lines)
	h := sha256.Sum256([]byte(strings.Join(lines, "\n")))
	return hex.EncodeToString(h[:8])
}

// treeNames maps treeSignature to torchvision's name for the default
// configurations (testdata/gen_tree_keys.py prints this table).
var treeNames = map[string]string{
	"4f416d2b10f25a5c": "mobilenet_v2",
	"5ced493c91e912d4": "mobilenet_v3_large",
	"ed454272471c1fa3": "mobilenet_v3_small",
	"67c59206a1cb3617": "mnasnet0_5",
	"583729a31b6dea2a": "mnasnet0_75",
	"a8f08dec91d3faeb": "mnasnet1_0",
	"4f9b34cef9c78b29": "mnasnet1_3",
	"1420285a243dacd6": "regnet_x_400mf",
	"95f5227638356369": "regnet_x_800mf",
	"5bb080f3b91f9550": "regnet_x_1_6gf",
	"d00417f14cd8f6c2": "regnet_x_3_2gf",
	"6ee467ef84a42a8d": "regnet_x_8gf",
	"8449f52af46140f3": "regnet_x_16gf",
	"bab203d4fe466ff2": "regnet_x_32gf",
	"ac948f9ce1fa5db6": "regnet_y_400mf",
	"220095c1d95e141b": "regnet_y_800mf",
	"701f70dcaa82e8b5": "regnet_y_1_6gf",
	"67cc27bd0ef3944c": "regnet_y_3_2gf",
	"0d9010602d6169da": "regnet_y_8gf",
	"c7fe7fedc9f7932d": "regnet_y_16gf",
	"906c30d100c1bf66": "regnet_y_32gf",
	"3d0d14e27e176f17": "regnet_y_128gf",
	"589c386ac6d2458d": "googlenet",
	"0d8f4a297c2443e9": "inception_v3",
	"6d379568055400b7": "shufflenet_v2_x0_5",
	"5ed09930a1c3e1f6": "shufflenet_v2_x1_0",
	"5ad1252c745862af": "shufflenet_v2_x1_5",
	"267dc5df437202ff": "shufflenet_v2_x2_0",
	"d87c3cb1a1e6e897": "efficientnet_b0",
	"a668e8f961f05ca1": "efficientnet_b1",
	"3a366b1ad3e30dd2": "efficientnet_b2",
	"c2e6f48a83014059": "efficientnet_b3",
	"7ef0d709144cd552": "efficientnet_b4",
	"ac3ccf7e317d0c2c": "efficientnet_b5",
	"06ed385922118032": "efficientnet_b6",
	"0179c2200333f0eb": "efficientnet_b7",
	"a1bafb8b72b81b57": "efficientnet_v2_s",
	"4fb1876a1bfddf52": "efficientnet_v2_m",
	"ae68fc3a48ff6e9d": "efficientnet_v2_l",
	"ba7458ef2166c8c6": "lraspp_mobilenet_v3_large",
	"fe40d486d1812195": "deeplabv3_mobilenet_v3_large",
}

func isTreeName(name string) bool {
	for _, n := range treeNames {
		if n == name {
			return true
		}
	}
	return false
}

// forceTree recognises a state dict that must be the tree family's
// configuration name.
func forceTree(w graph.Weights, keys []string, name string) (*graph.Graph, *Match, error) {
	g, m, ok, err := recognizeTree(w, keys)
	switch {
	case !ok:
		return nil, nil, fmt.Errorf("%w: the state dict is not %s: none of its keys is one a torchvision %s has", ErrMismatch, name, name)
	case err != nil:
		return nil, nil, fmt.Errorf("%w: the state dict is not %s: %w", ErrMismatch, name, err)
	case m.Arch != name:
		return nil, nil, fmt.Errorf("%w: the state dict is not %s but %s", ErrMismatch, name, m.Arch)
	}
	return g, m, nil
}

// efficientNetVariant holds what torchvision's efficientnet_* builders
// pass besides the block table: the classifier's dropout and the BN
// layer's eps and momentum.
var efficientNetVariant = map[string]struct{ dropout, eps, momentum float64 }{
	"efficientnet_b0": {0.2, 1e-5, 0.1}, "efficientnet_b1": {0.2, 1e-5, 0.1}, "efficientnet_b2": {0.3, 1e-5, 0.1},
	"efficientnet_b3": {0.3, 1e-5, 0.1}, "efficientnet_b4": {0.4, 1e-5, 0.1}, "efficientnet_b5": {0.4, 0.001, 0.01},
	"efficientnet_b6": {0.5, 0.001, 0.01}, "efficientnet_b7": {0.5, 0.001, 0.01},
	"efficientnet_v2_s": {0.2, 0.001, 0.1}, "efficientnet_v2_m": {0.3, 0.001, 0.1}, "efficientnet_v2_l": {0.4, 0.001, 0.1},
}

// synthEfficientNet mirrors EfficientNet.__init__ for one of torchvision's
// configurations: MBConv blocks (with squeeze-and-excitation) and, in V2,
// FusedMBConv ones (without), told apart by their keys.
func synthEfficientNet(s *synth, keys []string, name string) (*pth.Module, error) {
	v, ok := efficientNetVariant[name]
	if !ok {
		return nil, fmt.Errorf("its shapes are not those of one of torchvision's efficientnet_b0..b7 or efficientnet_v2_s/m/l, whose BN eps and classifier dropout differ per variant and cannot be read from a state dict; convert the whole pickled module (torch.save(model)) or use --graph")
	}
	stages := count(keys, "features") - 2
	strides := []int{1, 2, 2, 2, 1, 2, 1}
	if stages < 6 || stages > 7 {
		return nil, fmt.Errorf("features has %d stages, torchvision's EfficientNets 6 or 7", stages)
	}
	total := 0
	for i := 1; i <= stages; i++ {
		total += count(keys, fmt.Sprintf("features.%d", i))
	}
	first, c := s.convNormAct("features.0", 3, 2, v.eps, v.momentum, "SiLU")
	feats := []*pth.Module{first}
	id := 0
	for i := 1; i <= stages; i++ {
		sp := fmt.Sprintf("features.%d", i)
		var blocks []*pth.Module
		for j := 0; j < count(keys, sp); j++ {
			p := fmt.Sprintf("%s.%d.block", sp, j)
			stride := 1
			if j == 0 {
				stride = strides[i-1]
			}
			in := c
			var body []*pth.Module
			class := "torchvision.models.efficientnet.MBConv"
			switch {
			case s.has(p+".1.fc1.weight") || s.has(p+".2.fc1.weight"):
				k := 0
				if s.has(p + ".2.fc1.weight") {
					e, exp := s.convNormAct(p+".0", c, 1, v.eps, v.momentum, "SiLU")
					body, c, k = append(body, e), exp, 1
				}
				dw, _ := s.convNormAct(fmt.Sprintf("%s.%d", p, k), c, stride, v.eps, v.momentum, "SiLU")
				se := s.squeeze(fmt.Sprintf("%s.%d", p, k+1), c, "SiLU", "Sigmoid")
				proj, out := s.convNormAct(fmt.Sprintf("%s.%d", p, k+2), c, 1, v.eps, v.momentum, "")
				body, c = append(body, dw, se, proj), out
			default:
				class = "torchvision.models.efficientnet.FusedMBConv"
				if s.has(p + ".1.0.weight") {
					e, exp := s.convNormAct(p+".0", c, stride, v.eps, v.momentum, "SiLU")
					proj, out := s.convNormAct(p+".1", exp, 1, v.eps, v.momentum, "")
					body, c = append(body, e, proj), out
				} else {
					e, out := s.convNormAct(p+".0", c, stride, v.eps, v.momentum, "SiLU")
					body, c = append(body, e), out
				}
			}
			sd := &pth.Module{Class: classStochasticDepth,
				Attrs: map[string]pth.Value{"p": 0.2 * float64(id) / float64(total), "mode": "row"}}
			blocks = append(blocks, tree(class, map[string]pth.Value{"use_res_connect": stride == 1 && in == c, "out_channels": int64(c)},
				kid("block", seq(classSequential, nil, body...)), kid("stochastic_depth", sd)))
			id++
		}
		feats = append(feats, seq(classSequential, nil, blocks...))
	}
	last, _ := s.convNormAct(fmt.Sprintf("features.%d", stages+1), c, 1, v.eps, v.momentum, "SiLU")
	feats = append(feats, last)
	fc, _ := s.linear("classifier.1")
	return tree("torchvision.models.efficientnet.EfficientNet", nil,
		kid("features", seq(classSequential, nil, feats...)),
		kid("avgpool", adaptive(int64(1))),
		kid("classifier", seq(classSequential, nil, dropout(v.dropout), fc))), nil
}

// TreeNames lists, sorted, the torchvision configurations recognised by
// synthesising their module trees (Names lists the others).
func TreeNames() []string {
	var out []string
	for _, n := range treeNames {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// synthShuffleNetV2 mirrors ShuffleNetV2.__init__ (stages 2-4 of
// InvertedResidual blocks, the first of each at stride 2).
func synthShuffleNetV2(s *synth, keys []string, _ string) (*pth.Module, error) {
	const eps, mom = 1e-5, 0.1
	c1, c := s.conv("conv1.0", 3, 2, same)
	kids := []pth.Child{kid("conv1", seq(classSequential, nil, c1, s.bn("conv1.1", eps, mom), act("ReLU"))),
		kid("maxpool", maxPool(3, 2, 1, false))}
	const block = "torchvision.models.shufflenetv2.InvertedResidual"
	for st := 2; st <= 4; st++ {
		sp := fmt.Sprintf("stage%d", st)
		n := count(keys, sp)
		if n == 0 {
			return nil, fmt.Errorf("%s has no blocks", sp)
		}
		var blocks []*pth.Module
		for j := 0; j < n; j++ {
			p := fmt.Sprintf("%s.%d", sp, j)
			stride := 1
			branch1 := tree(classSequential, nil)
			in := c / 2
			if j == 0 {
				stride, in = 2, c
				dw, _ := s.conv(p+".branch1.0", c, 2, same)
				pw, _ := s.conv(p+".branch1.2", c, 1, noPad)
				branch1 = seq(classSequential, nil, dw, s.bn(p+".branch1.1", eps, mom), pw, s.bn(p+".branch1.3", eps, mom), act("ReLU"))
			}
			a, bf := s.conv(p+".branch2.0", in, 1, noPad)
			dw, _ := s.conv(p+".branch2.3", bf, stride, same)
			pw, _ := s.conv(p+".branch2.5", bf, 1, noPad)
			branch2 := seq(classSequential, nil, a, s.bn(p+".branch2.1", eps, mom), act("ReLU"), dw, s.bn(p+".branch2.4", eps, mom),
				pw, s.bn(p+".branch2.6", eps, mom), act("ReLU"))
			blocks = append(blocks, tree(block, map[string]pth.Value{"stride": int64(stride)}, kid("branch1", branch1), kid("branch2", branch2)))
			c = 2 * bf
		}
		kids = append(kids, kid(sp, seq(classSequential, nil, blocks...)))
	}
	c5, _ := s.conv("conv5.0", c, 1, noPad)
	fc, _ := s.linear("fc")
	kids = append(kids, kid("conv5", seq(classSequential, nil, c5, s.bn("conv5.1", eps, mom), act("ReLU"))), kid("fc", fc))
	return tree("torchvision.models.shufflenetv2.ShuffleNetV2", nil, kids...), nil
}
