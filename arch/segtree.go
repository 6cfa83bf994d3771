package arch

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// torchvision's segmentation models over MobileNetV3 (lraspp_mobilenet_v3_large,
// deeplabv3_mobilenet_v3_large), rebuilt from their module trees: the
// backbone is an IntermediateLayerGetter over MobileNetV3's features that
// hands the head one ("out") or two ("low", "high") intermediate outputs,
// which the IR holds as values with several consumers.

const (
	classLayerGetter = "torchvision.models._utils.IntermediateLayerGetter"
	classDeepLabV3   = "torchvision.models.segmentation.deeplabv3.DeepLabV3"
	classLRASPP      = "torchvision.models.segmentation.lraspp.LRASPP"
)

// registerSegmentationTrees adds the segmentation classes to the tree
// builder's tables (from tree.go's init, which makes them).
func registerSegmentationTrees() {
	treeRoots[classLRASPP] = treeRoot{title: "lraspp", build: lrasppForward}
	seq := func(b *chainBuilder, m *pth.Module, path string) error { return b.chain(m, path+".") }
	blocks["torchvision.models.segmentation.deeplabv3.DeepLabHead"] = seq
	blocks["torchvision.models.segmentation.fcn.FCNHead"] = seq
	blocks["torchvision.models.segmentation.deeplabv3.ASPPConv"] = seq
	blocks["torchvision.models.segmentation.deeplabv3.ASPP"] = asppTree
	blocks["torchvision.models.segmentation.deeplabv3.ASPPPooling"] = asppPoolingTree
}

// deeplabMobileTree is DeepLabV3's forward over a MobileNetV3 backbone.
var deeplabMobileTree = treeRoot{title: "deeplabv3", attrs: []string{"aux_classifier"}, build: deeplabMobileForward}

// mobileBackbone says whether a DeepLabV3's backbone is MobileNetV3's
// features (children "0", "1", ... of torchvision's block classes) rather
// than a ResNet's.
func mobileBackbone(m *pth.Module) bool {
	for _, c := range m.Children {
		if c.Name == "backbone" && c.Module.Class == classLayerGetter && len(c.Module.Children) > 1 {
			return c.Module.Children[1].Module.Class == "torchvision.models.mobilenetv3.InvertedResidual"
		}
	}
	return false
}

// layerGetter is IntermediateLayerGetter's forward: its children in order,
// the outputs of those return_layers names returned by their new names.
// Every child runs (torchvision keeps only the layers up to the last one
// returned).
func (b *chainBuilder) layerGetter(m *pth.Module, path string, want ...string) (map[string]*graph.Value, error) {
	if m.Class != classLayerGetter {
		return nil, failure.Unsupportedf("%s is a %s, not torchvision's IntermediateLayerGetter", path, m.ShortClass())
	}
	if err := checkAttrs(m, "return_layers"); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	d, ok := m.Attr("return_layers").(*pth.Dict)
	if !ok {
		return nil, fmt.Errorf("%s: return_layers is %s", path, describe(m.Attr("return_layers")))
	}
	names := map[string]string{}
	var got []string
	for i := 0; i < d.Len(); i++ {
		k, v := d.Entry(i)
		ks, ok1 := k.(string)
		vs, ok2 := v.(string)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("%s: return_layers is %s", path, describe(d))
		}
		names[ks] = vs
		got = append(got, vs)
	}
	if len(got) != len(want) {
		return nil, failure.Unsupportedf("%s: return_layers %s: the head reads %v", path, describe(d), want)
	}
	for _, w := range want {
		if !contains(got, w) {
			return nil, failure.Unsupportedf("%s: return_layers %s: the head reads %v", path, describe(d), want)
		}
	}
	out := map[string]*graph.Value{}
	for _, c := range m.Children {
		p := join(path, c.Name)
		if err := b.layer(c.Module, p); err != nil {
			return nil, fmt.Errorf("%s (%s): %w", p, c.Module.ShortClass(), err)
		}
		if n, ok := names[c.Name]; ok {
			out[n] = b.cur
		}
	}
	if len(out) != len(want) {
		return nil, failure.Unsupportedf("%s: return_layers %s names layers it does not hold", path, describe(d))
	}
	return out, nil
}

// resizeTo adds F.interpolate(x, size=ref.shape[-2:], mode="bilinear",
// align_corners=False).
func (b *chainBuilder) resizeTo(name string, x, ref *graph.Value) *graph.Value {
	c := x.Channels
	v := b.g.Add(name, graph.OpResize, graph.Attr{Mode: "bilinear"}, nil, x, ref)
	v.Channels = c
	return v
}

// startGraph makes the graph for a forward whose first layer is a Conv2d
// somewhere below: the input has 3 channels, as every torchvision model's.
func (b *chainBuilder) startGraph() {
	if b.g == nil {
		b.g = graph.New("", 3)
		b.cur = b.g.Input
	}
}

// lrasppForward is LRASPP's forward: backbone (low, high), LRASPPHead,
// then the result resized to the input's size.
func lrasppForward(b *chainBuilder, m *pth.Module) error {
	kids, err := children(m, "backbone", "classifier")
	if err != nil {
		return err
	}
	if kids["backbone"] == nil || kids["classifier"] == nil {
		return fmt.Errorf("LRASPP needs a backbone and a classifier")
	}
	b.startGraph()
	outs, err := b.layerGetter(kids["backbone"], "backbone", "low", "high")
	if err != nil {
		return err
	}
	head := kids["classifier"]
	if head.Class != "torchvision.models.segmentation.lraspp.LRASPPHead" {
		return failure.Unsupportedf("classifier is a %s, not torchvision's LRASPPHead", head.ShortClass())
	}
	if err := checkAttrs(head); err != nil {
		return fmt.Errorf("classifier: %w", err)
	}
	hk, err := children(head, "cbr", "scale", "low_classifier", "high_classifier")
	if err != nil {
		return fmt.Errorf("classifier: %w", err)
	}
	low, high := outs["low"], outs["high"]
	run := func(name string, x *graph.Value) (*graph.Value, error) {
		b.cur = x
		if err := b.run(head, hk, "classifier", name); err != nil {
			return nil, err
		}
		return b.cur, nil
	}
	x, err := run("cbr", high)
	if err != nil {
		return err
	}
	s, err := run("scale", high)
	if err != nil {
		return err
	}
	c := x.Channels
	x = b.g.Add("classifier.mul", graph.OpMul, graph.Attr{}, nil, x, s)
	x.Channels = c
	x = b.resizeTo("classifier.interpolate", x, low)
	lo, err := run("low_classifier", low)
	if err != nil {
		return err
	}
	hi, err := run("high_classifier", x)
	if err != nil {
		return err
	}
	if lo.Channels != hi.Channels {
		return fmt.Errorf("classifier: low_classifier gives %d classes, high_classifier %d", lo.Channels, hi.Channels)
	}
	out := b.g.Add("classifier.add", graph.OpAdd, graph.Attr{}, nil, lo, hi)
	out.Channels = lo.Channels
	b.cur = b.resizeTo("interpolate", out, b.g.Input)
	return nil
}

// deeplabMobileForward is DeepLabV3's forward over a MobileNetV3
// backbone: backbone "out", classifier, resized to the input's size; with
// an auxiliary classifier (aux_loss=True), that FCNHead on the backbone's
// "aux" output, resized the same way, as the auxiliary output "aux" (the
// model returns {"out": ..., "aux": ...} in eval and training alike).
func deeplabMobileForward(b *chainBuilder, m *pth.Module) error {
	if err := noAux(m); err != nil {
		return failure.Unsupportedf("%v: want an FCNHead child or None", err)
	}
	kids, err := children(m, "backbone", "classifier", "aux_classifier")
	if err != nil {
		return err
	}
	want := []string{"out"}
	if kids["aux_classifier"] != nil {
		want = append(want, "aux")
	}
	b.startGraph()
	outs, err := b.layerGetter(kids["backbone"], "backbone", want...)
	if err != nil {
		return err
	}
	b.cur = outs["out"]
	if err := b.run(m, kids, "", "classifier"); err != nil {
		return err
	}
	out := b.resizeTo("interpolate", b.cur, b.g.Input)
	if kids["aux_classifier"] != nil {
		b.cur = outs["aux"]
		if err := b.run(m, kids, "", "aux_classifier"); err != nil {
			return err
		}
		if b.cur.Channels != out.Channels {
			return fmt.Errorf("aux_classifier gives %d classes, classifier %d", b.cur.Channels, out.Channels)
		}
		aux := b.resizeTo("aux_interpolate", b.cur, b.g.Input)
		b.g.Output = out
		b.g.OutputName = "out"
		b.g.SetAux("aux", aux, false)
	}
	b.cur = out
	return nil
}

// asppTree is ASPP's forward: every branch of convs over the input,
// concatenated, then project.
func asppTree(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m); err != nil {
		return err
	}
	kids, err := children(m, "convs", "project")
	if err != nil {
		return err
	}
	convs := kids["convs"]
	if convs == nil || convs.Class != "torch.nn.modules.container.ModuleList" || len(convs.Children) == 0 {
		return fmt.Errorf("convs is not a ModuleList of branches")
	}
	x := b.cur
	var outs []*graph.Value
	for _, c := range convs.Children {
		b.cur = x
		p := path + ".convs." + c.Name
		if err := b.layer(c.Module, p); err != nil {
			return fmt.Errorf("%s (%s): %w", p, c.Module.ShortClass(), err)
		}
		outs = append(outs, b.cur)
	}
	b.cur = b.g.Add(path+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, outs...)
	b.cur.Channels = sumChannels(outs)
	return b.run(m, kids, path, "project")
}

// asppPoolingTree is ASPPPooling's forward: its layers in order, then the
// result resized to the input's size.
func asppPoolingTree(b *chainBuilder, m *pth.Module, path string) error {
	x := b.cur
	if err := b.chain(m, path+"."); err != nil {
		return err
	}
	b.cur = b.resizeTo(path+".interpolate", b.cur, x)
	return nil
}

// segmentationBackboneNote says what the MobileNetV3 segmentation models'
// state dicts are assumed to be built with.
const segmentationBackboneNote = "the backbone is mobilenet_v3_large(dilated=True) as torchvision's segmentation builders make it (the last three blocks dilated by 2 at stride 1)"

// synthMobileSegmentation mirrors _lraspp_mobilenetv3 and
// _deeplabv3_mobilenetv3 over mobilenet_v3_large(dilated=True).
func synthMobileSegmentation(s *synth, keys []string, _ string) (*pth.Module, error) {
	aux := false
	for _, k := range keys {
		aux = aux || strings.HasPrefix(k, "aux_classifier.")
	}
	n := count(keys, "backbone")
	lraspp := s.has("classifier.cbr.0.weight")
	if aux && lraspp {
		return nil, fmt.Errorf("aux_classifier.* beside an LRASPP head: torchvision's lraspp_mobilenet_v3_large has no auxiliary head")
	}
	if n != 17 {
		return nil, fmt.Errorf("backbone has %d modules with tensors, torchvision's mobilenet_v3_large features 17", n)
	}
	feats, err := s.mobileNetV3Features("backbone", mobilenetV3Blocks[15], 3)
	if err != nil {
		return nil, err
	}
	getter := func(returns ...string) *pth.Module {
		d := pth.NewDict(false)
		for i := 0; i+1 < len(returns); i += 2 {
			_ = d.Set(returns[i], returns[i+1])
		}
		m := seq(classLayerGetter, map[string]pth.Value{"return_layers": d}, feats...)
		return m
	}
	const eps, mom = 1e-5, 0.1
	high := 0
	if sh := s.shape("backbone.16.0.weight"); len(sh) == 4 {
		high = sh[0]
	}
	if lraspp {
		low, _ := integer(feats[4].Attr("out_channels"))
		cc, inter := s.conv("classifier.cbr.0", high, 1, noPad)
		sc, _ := s.conv("classifier.scale.1", high, 1, noPad)
		lc, _ := s.conv("classifier.low_classifier", low, 1, noPad)
		hc, _ := s.conv("classifier.high_classifier", inter, 1, noPad)
		relu := act("ReLU")
		head := tree("torchvision.models.segmentation.lraspp.LRASPPHead", nil,
			kid("cbr", seq(classSequential, nil, cc, s.bn("classifier.cbr.1", eps, mom), relu)),
			kid("scale", seq(classSequential, nil, adaptive(int64(1)), sc, act("Sigmoid"))),
			kid("low_classifier", lc), kid("high_classifier", hc))
		return tree(classLRASPP, nil, kid("backbone", getter("4", "low", "16", "high")), kid("classifier", head)), nil
	}
	// DeepLabHead(960, num_classes): ASPP with rates 12, 24, 36.
	a := "classifier.0"
	var branches []*pth.Module
	c0, w := s.conv(a+".convs.0.0", high, 1, noPad)
	branches = append(branches, seq(classSequential, nil, c0, s.bn(a+".convs.0.1", eps, mom), act("ReLU")))
	for i, r := range asppRates {
		p := fmt.Sprintf("%s.convs.%d", a, i+1)
		c, _ := s.dilatedConv(p+".0", high, r)
		branches = append(branches, seq("torchvision.models.segmentation.deeplabv3.ASPPConv", nil, c, s.bn(p+".1", eps, mom), act("ReLU")))
	}
	pp := fmt.Sprintf("%s.convs.%d", a, len(asppRates)+1)
	pc, _ := s.conv(pp+".1", high, 1, noPad)
	branches = append(branches, seq("torchvision.models.segmentation.deeplabv3.ASPPPooling", nil, adaptive(int64(1)), pc, s.bn(pp+".2", eps, mom), act("ReLU")))
	proj, _ := s.conv(a+".project.0", w*len(branches), 1, noPad)
	d := dropout(0.5)
	d.Attrs["inplace"] = false
	aspp := tree("torchvision.models.segmentation.deeplabv3.ASPP", nil,
		kid("convs", seq("torch.nn.modules.container.ModuleList", nil, branches...)),
		kid("project", seq(classSequential, nil, proj, s.bn(a+".project.1", eps, mom), act("ReLU"), d)))
	c1, hw := s.conv("classifier.1", w, 1, same)
	c4, _ := s.conv("classifier.4", hw, 1, noPad)
	head := seq("torchvision.models.segmentation.deeplabv3.DeepLabHead", nil, aspp, c1, s.bn("classifier.2", eps, mom), act("ReLU"), c4)
	if aux {
		// aux_loss=True: FCNHead(40, num_classes) on features[4], the
		// output of the fourth stage from the end (torchvision's aux_pos).
		in, _ := integer(feats[4].Attr("out_channels"))
		a0, mid := s.conv("aux_classifier.0", int(in), 1, same)
		a4, _ := s.conv("aux_classifier.4", mid, 1, noPad)
		ad := dropout(0.1)
		ad.Attrs["inplace"] = false
		fcn := seq("torchvision.models.segmentation.fcn.FCNHead", nil, a0, s.bn("aux_classifier.1", eps, mom), act("ReLU"), ad, a4)
		return tree(classDeepLabV3, nil, kid("backbone", getter("16", "out", "4", "aux")), kid("classifier", head), kid("aux_classifier", fcn)), nil
	}
	return tree(classDeepLabV3, map[string]pth.Value{"aux_classifier": nil}, kid("backbone", getter("16", "out")), kid("classifier", head)), nil
}

// dilatedConv is a 3x3 convolution with padding and dilation rate.
func (s *synth) dilatedConv(path string, in, rate int) (*pth.Module, int) {
	m, out := s.conv(path, in, 1, same)
	m.Attrs["dilation"] = tuple2([2]int{rate, rate})
	k := [2]int{3, 3}
	if sh, ok := s.w.Shape(path + ".weight"); ok && len(sh) == 4 {
		k = [2]int{sh[2], sh[3]}
	}
	m.Attrs["padding"] = tuple2(same(k, [2]int{rate, rate}))
	return m, out
}
