package arch

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// resnetShape is what the state dict says about a ResNet: enough to name it
// when it is not one of torchvision's configurations.
type resnetShape struct {
	bottleneck bool
	layers     [4]int
	stem       int
	out        [4]int // block output channels of each layer
	inner      [4]int // Bottleneck conv2 width of each layer
	groups     [4]int
	irregular  bool // blocks of one layer disagree on widths
	dilate     [3]bool
}

// buildResNet mirrors torchvision 0.14's ResNet forward: conv1 7x7/2 → bn1 →
// relu → maxpool 3/2/1 → layer1..4 → avgpool (1,1) → flatten → fc. Bottleneck
// blocks stride on conv2 (ResNet v1.5). Each block computes its main branch,
// then the downsample branch, then adds them in that order, as torchvision
// does; the block's shared relu module appears once per use (relu, relu:2,
// relu:3).
func buildResNet(b *builder) (*resnetShape, error) {
	sh, _, err := resnetBody(b, resnetOpts{head: true})
	return sh, err
}

// resnetOpts says where a ResNet sits and how it was constructed, which its
// keys cannot say.
type resnetOpts struct {
	// module is the ResNet's module path after the prefix ("backbone." in
	// a segmentation model), ending in a dot when not empty.
	module string
	// dilate is replace_stride_with_dilation: layer2..4 replace their
	// stride 2 by dilation, as torchvision's _make_layer does.
	dilate [3]bool
	// head adds avgpool, flatten and fc.
	head bool
}

// resnetBody adds a ResNet and returns the outputs of layer1..4.
func resnetBody(b *builder, o resnetOpts) (*resnetShape, [4]*graph.Value, error) {
	var outs [4]*graph.Value
	p := b.prefix + o.module
	x, err := b.conv(p+"conv1", b.g.Input, 7, 2, 3, false)
	if err != nil {
		return nil, outs, err
	}
	if x, err = b.bn(p+"bn1", x); err != nil {
		return nil, outs, err
	}
	x = b.relu(p+"relu", x)
	x = b.maxpool(p+"maxpool", x, 3, 2, 1)

	sh := &resnetShape{stem: x.Channels, bottleneck: b.present(p + "layer1.0.conv3.weight"), dilate: o.dilate}
	dilation := 1
	for l := 0; l < 4; l++ {
		layer := fmt.Sprintf("%slayer%d", p, l+1)
		for i := 0; b.has(fmt.Sprintf("%s.%d", layer, i)); i++ {
			sh.layers[l]++
		}
		if sh.layers[l] == 0 {
			return nil, outs, fmt.Errorf("missing %s.0.conv1.weight: %s has no blocks", layer, layer)
		}
		stride, previous := 1, dilation
		if l > 0 {
			stride = 2
			if o.dilate[l-1] {
				dilation *= stride
				stride = 1
			}
		}
		for i := 0; i < sh.layers[l]; i++ {
			s, d := stride, previous
			if i > 0 {
				s, d = 1, dilation
			}
			m := fmt.Sprintf("%s.%d.", layer, i)
			y, inner, err := resnetBlock(b, m, x, s, d, sh.bottleneck)
			if err != nil {
				return nil, outs, err
			}
			if i == 0 {
				sh.out[l], sh.inner[l] = y.Channels, inner.Channels
				if conv := inner.Producer.Inputs[0].Producer; conv.Op == graph.OpConv {
					sh.groups[l] = conv.Attr.Groups
				}
			} else if y.Channels != sh.out[l] || inner.Channels != sh.inner[l] {
				sh.irregular = true
			}
			x = y
		}
		outs[l] = x
	}
	if o.head {
		x = b.head(p+"avgpool", x, 1)
		if _, err := b.linear(p+"fc", x); err != nil {
			return nil, outs, err
		}
	}
	return sh, outs, nil
}

// resnetBlock adds one BasicBlock or Bottleneck at module path m (ending in
// "."), whose 3x3 convolution (conv2 of a Bottleneck) has the given dilation
// and, as torchvision's conv3x3, padding equal to it. It returns the block output and the output of its grouped 3x3
// convolution's BN (bn2 in a Bottleneck, bn1 in a BasicBlock), whose width
// describes the block.
func resnetBlock(b *builder, m string, x *graph.Value, stride, dilation int, bottleneck bool) (out, inner *graph.Value, err error) {
	if bottleneck != b.present(m+"conv3.weight") {
		kind := "BasicBlock"
		if bottleneck {
			kind = "Bottleneck"
		}
		return nil, nil, fmt.Errorf("%s does not match the %s of %slayer1.0 (conv3 present in one, absent in the other)", m[:len(m)-1], kind, b.prefix)
	}
	// The main branch, as torchvision's forward runs it.
	type step struct {
		kind                byte // 'c' conv, 'b' BN, 'r' relu
		name                string
		k, stride, pad, dil int
	}
	if !bottleneck && dilation > 1 {
		// torchvision's BasicBlock raises NotImplementedError.
		return nil, nil, fmt.Errorf("%s: a BasicBlock cannot be dilated (torchvision refuses dilation > 1 in BasicBlock)", m[:len(m)-1])
	}
	steps := []step{{'c', "conv1", 3, stride, 1, 1}, {'b', "bn1", 0, 0, 0, 0}, {'r', "relu", 0, 0, 0, 0},
		{'c', "conv2", 3, 1, 1, 1}, {'b', "bn2", 0, 0, 0, 0}}
	innerBN := "bn1"
	if bottleneck {
		steps = []step{{'c', "conv1", 1, 1, 0, 1}, {'b', "bn1", 0, 0, 0, 0}, {'r', "relu", 0, 0, 0, 0},
			{'c', "conv2", 3, stride, dilation, dilation}, {'b', "bn2", 0, 0, 0, 0}, {'r', "relu:2", 0, 0, 0, 0},
			{'c', "conv3", 1, 1, 0, 1}, {'b', "bn3", 0, 0, 0, 0}}
		innerBN = "bn2"
	}
	y := x
	for _, s := range steps {
		switch s.kind {
		case 'c':
			// Only a Bottleneck's conv2 may be grouped (ResNeXt);
			// torchvision's BasicBlock refuses groups.
			y, err = b.convDilated(m+s.name, y, s.k, s.stride, s.pad, s.dil, bottleneck && s.name == "conv2")
		case 'b':
			y, err = b.bn(m+s.name, y)
		default:
			y = b.relu(m+s.name, y)
		}
		if err != nil {
			return nil, nil, err
		}
		if s.name == innerBN {
			inner = y
		}
	}
	identity := x
	if b.has(m + "downsample") {
		if identity, err = b.conv(m+"downsample.0", x, 1, stride, 0, false); err != nil {
			return nil, nil, err
		}
		if identity, err = b.bn(m+"downsample.1", identity); err != nil {
			return nil, nil, err
		}
	} else if stride != 1 || x.Channels != y.Channels {
		return nil, nil, fmt.Errorf("missing %sdownsample.0.weight: the block maps %d channels to %d with stride %d, so torchvision gives it a downsample branch", m, x.Channels, y.Channels, stride)
	}
	if identity.Channels != y.Channels {
		return nil, nil, fmt.Errorf("%sdownsample.0.weight gives %d channels, the main branch %d", m, identity.Channels, y.Channels)
	}
	sum := b.add(m+"add", graph.OpAdd, graph.Attr{}, nil, y.Channels, y, identity)
	last := "relu:3"
	if !bottleneck {
		last = "relu:2"
	}
	return b.relu(m+last, sum), inner, nil
}

// describe names a non-standard ResNet after torchvision's constructor
// arguments where they fit, e.g. "resnet (BasicBlock [1 1 1 1], width 8)".
func (s *resnetShape) describe() string {
	block, expansion := "BasicBlock", 1
	if s.bottleneck {
		block, expansion = "Bottleneck", 4
	}
	d := fmt.Sprintf("resnet (%s %s, width %d", block, joinInts(s.layers[:]), s.stem)
	if s.dilate != [3]bool{} {
		py := map[bool]string{false: "False", true: "True"}
		d += fmt.Sprintf(", replace_stride_with_dilation [%s, %s, %s]", py[s.dilate[0]], py[s.dilate[1]], py[s.dilate[2]])
	}
	if s.irregular {
		return d + ", widths differ between blocks of one layer)"
	}
	planes := make([]int, 4)
	doubling := true
	for l := range planes {
		planes[l] = s.out[l] / expansion
		if planes[l] != s.stem<<l || s.out[l]%expansion != 0 {
			doubling = false
		}
	}
	if !doubling {
		d += fmt.Sprintf(", outputs %s", joinInts(s.out[:]))
	}
	if !s.bottleneck {
		return d + ")"
	}
	g := s.groups[0]
	for _, x := range s.groups {
		if x != g {
			return d + fmt.Sprintf(", groups %s, inner widths %s)", joinInts(s.groups[:]), joinInts(s.inner[:]))
		}
	}
	if g != 1 {
		d += fmt.Sprintf(", groups %d", g)
	}
	// Recover width_per_group from layer1 and check that torchvision's
	// formula, int(planes * wpg/64) * groups, reproduces every layer.
	wpg := s.inner[0] / g * 64 / max(planes[0], 1)
	fits := wpg > 0
	for l := range planes {
		if planes[l]*wpg/64*g != s.inner[l] {
			fits = false
		}
	}
	switch {
	case !fits:
		d += fmt.Sprintf(", inner widths %s", joinInts(s.inner[:]))
	case wpg != 64:
		d += fmt.Sprintf(", width_per_group %d", wpg)
	}
	return d + ")"
}
