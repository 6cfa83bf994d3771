package arch

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// segShape is what the state dict says about a segmentation model.
type segShape struct {
	backbone *resnetShape
	head     string // "fcn" or "deeplabv3"
	rates    []int  // ASPP atrous rates
	classes  int
	aux      bool // an auxiliary FCNHead (aux_loss=True)
}

// The constructors' dilation: torchvision's fcn_resnet50/101 and
// deeplabv3_resnet50/101 build their backbones with
// replace_stride_with_dilation=[False, True, True] (output stride 8), and
// DeepLabHead's ASPP with atrous rates 12, 24, 36.
var (
	segDilation = [3]bool{false, true, true}
	asppRates   = []int{12, 24, 36}
)

// buildSegmentation mirrors torchvision 0.14's _SimpleSegmentationModel
// forward for FCN and DeepLabV3 with a ResNet backbone: the backbone
// (IntermediateLayerGetter over conv1..layer4, no avgpool or fc), the
// classifier head on layer4's output, then a bilinear resize
// (align_corners=False) to the input's size. The model returns
// {"out": ...}; the graph's output is that tensor. anyRates lets a whole
// module supply ASPP rates other than torchvision's (its modules' dilations
// then replace the placeholder 1), where a state dict must have three
// branches, whose rates are assumed.
func buildSegmentation(b *builder, anyRates bool) (*segShape, error) {
	p := b.prefix
	if !b.present(p + "backbone.conv1.weight") {
		if b.has(p + "backbone.0") {
			// Those state dicts are recognised by the tree families
			// (synth.go), which detection tries first.
			return nil, fmt.Errorf("%sbackbone is a MobileNetV3, not a ResNet: this builder is the ResNet-based FCN's and DeepLabV3's; deeplabv3_mobilenet_v3_large and lraspp_mobilenet_v3_large are recognised with --arch auto", p)
		}
		return nil, fmt.Errorf("missing %sbackbone.conv1.weight: not a ResNet backbone", p)
	}
	sh := &segShape{}
	var err error
	var outs [4]*graph.Value
	if sh.backbone, outs, err = resnetBody(b, resnetOpts{module: "backbone.", dilate: segDilation}); err != nil {
		return nil, err
	}
	x := outs[3]
	h := p + "classifier."
	switch {
	case b.has(h + "0.convs"):
		sh.head = "deeplabv3"
		if x, sh.rates, err = deepLabHead(b, h, x, anyRates); err != nil {
			return nil, err
		}
	case b.present(h + "0.weight"):
		sh.head = "fcn"
		if x, err = fcnHead(b, h, x); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("missing %s0.weight (FCNHead) or %s0.convs (DeepLabHead)", h, h)
	}
	sh.classes = x.Channels
	out := b.add(p+"interpolate", graph.OpResize, graph.Attr{Mode: "bilinear"}, nil, x.Channels, x, b.g.Input)
	if b.has(p + "aux_classifier") {
		// aux_loss=True: an FCNHead on layer3's output ("aux"), resized
		// the same way; the model returns {"out": ..., "aux": ...} in
		// eval and training alike.
		a, err := fcnHead(b, p+"aux_classifier.", outs[2])
		if err != nil {
			return nil, err
		}
		if a.Channels != sh.classes {
			return nil, fmt.Errorf("%saux_classifier gives %d classes, classifier %d", p, a.Channels, sh.classes)
		}
		a = b.add(p+"aux_interpolate", graph.OpResize, graph.Attr{Mode: "bilinear"}, nil, a.Channels, a, b.g.Input)
		b.g.Output = out
		b.g.OutputName = "out"
		b.g.SetAux("aux", a, false)
		sh.aux = true
	}
	return sh, nil
}

// fcnHead is torchvision's FCNHead: 3x3 conv to in/4 channels, BN, ReLU,
// Dropout(0.1), 1x1 conv with bias to the classes.
func fcnHead(b *builder, h string, x *graph.Value) (*graph.Value, error) {
	x, err := b.conv(h+"0", x, 3, 1, 1, false)
	if err != nil {
		return nil, err
	}
	if x, err = b.bn(h+"1", x); err != nil {
		return nil, err
	}
	x = b.relu(h+"2", x)
	x = b.add(h+"3", graph.OpDropout, graph.Attr{P: 0.1}, nil, x.Channels, x)
	return b.conv(h+"4", x, 1, 1, 0, false)
}

// deepLabHead is torchvision's DeepLabHead: ASPP (a 1x1 branch, one dilated
// 3x3 branch per rate, an image-pooling branch resized back, concatenated
// and projected with Dropout(0.5)), then 3x3 conv, BN, ReLU, 1x1 conv with
// bias.
func deepLabHead(b *builder, h string, x *graph.Value, anyRates bool) (*graph.Value, []int, error) {
	aspp := h + "0."
	var branches []*graph.Value
	var rates []int
	n := 0
	for ; b.has(fmt.Sprintf("%sconvs.%d", aspp, n)); n++ {
	}
	if n < 2 {
		return nil, nil, fmt.Errorf("%sconvs has %d branches, want a 1x1 branch, dilated branches and a pooling branch", aspp, n)
	}
	for i := 0; i < n; i++ {
		m := fmt.Sprintf("%sconvs.%d.", aspp, i)
		var y *graph.Value
		var err error
		switch {
		case i == 0:
			y, err = b.conv(m+"0", x, 1, 1, 0, false)
		case i < n-1:
			r := 1
			if len(rates) < len(asppRates) {
				r = asppRates[len(rates)]
			}
			rates = append(rates, r)
			y, err = b.convDilated(m+"0", x, 3, 1, r, r, false)
		default:
			// ASPPPooling: AdaptiveAvgPool2d(1), conv, BN, ReLU, then
			// F.interpolate(size=x.shape[-2:], mode="bilinear",
			// align_corners=False).
			pool := b.add(m+"0", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, nil, x.Channels, x)
			if y, err = b.conv(m+"1", pool, 1, 1, 0, false); err != nil {
				return nil, nil, err
			}
			if y, err = b.bn(m+"2", y); err != nil {
				return nil, nil, err
			}
			y = b.relu(m+"3", y)
			y = b.add(m+"interpolate", graph.OpResize, graph.Attr{Mode: "bilinear"}, nil, y.Channels, y, x)
			branches = append(branches, y)
			continue
		}
		if err != nil {
			return nil, nil, err
		}
		if y, err = b.bn(m+"1", y); err != nil {
			return nil, nil, err
		}
		branches = append(branches, b.relu(m+"2", y))
	}
	if len(rates) != len(asppRates) && !anyRates {
		return nil, nil, fmt.Errorf("%sconvs has %d dilated branches; torchvision's DeepLabHead has %d (rates %v), and a state dict does not hold other rates: convert the whole pickled module or use --graph",
			aspp, len(rates), len(asppRates), asppRates)
	}
	cat := b.add(aspp+"cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, sumChannels(branches), branches...)
	y, err := b.conv(aspp+"project.0", cat, 1, 1, 0, false)
	if err != nil {
		return nil, nil, err
	}
	if y, err = b.bn(aspp+"project.1", y); err != nil {
		return nil, nil, err
	}
	y = b.relu(aspp+"project.2", y)
	y = b.add(aspp+"project.3", graph.OpDropout, graph.Attr{P: 0.5}, nil, y.Channels, y)
	if y, err = b.conv(h+"1", y, 3, 1, 1, false); err != nil {
		return nil, nil, err
	}
	if y, err = b.bn(h+"2", y); err != nil {
		return nil, nil, err
	}
	y = b.relu(h+"3", y)
	y, err = b.conv(h+"4", y, 1, 1, 0, false)
	return y, rates, err
}

// describe names the model after torchvision's constructor when the
// backbone is its resnet50 or resnet101.
func (s *segShape) describe() (string, bool) {
	bb := s.backbone
	if s.aux {
		d, ok := (&segShape{backbone: s.backbone, head: s.head, rates: s.rates, classes: s.classes}).describe()
		return d + " (aux_loss=True)", ok
	}
	std := bb.bottleneck && bb.stem == 64 && !bb.irregular && bb.groups == [4]int{1, 1, 1, 1} && bb.inner == [4]int{64, 128, 256, 512}
	switch {
	case std && bb.layers == [4]int{3, 4, 6, 3}:
		return s.head + "_resnet50", true
	case std && bb.layers == [4]int{3, 4, 23, 3}:
		return s.head + "_resnet101", true
	}
	return fmt.Sprintf("%s (backbone %s, %d classes)", s.head, bb.describe(), s.classes), false
}
