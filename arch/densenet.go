package arch

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// densenetShape is what the state dict says about a DenseNet.
type densenetShape struct {
	init   int
	blocks []int
	growth int
	inner  int // bn_size * growth
	// irregular is set when dense layers disagree on growth or bottleneck
	// width, or a transition does not halve the channels: torchvision's
	// DenseNet class cannot build such a network, though the graph is sound.
	irregular bool
}

// buildDenseNet mirrors torchvision 0.14's DenseNet forward: features.conv0
// 7x7/2 → norm0 → relu0 → pool0 (max 3/2/1) → dense blocks separated by
// transitions (norm, relu, 1x1 conv, avg pool 2/2) → norm5 → functional relu
// → adaptive avg pool (1,1) → flatten → classifier.
//
// Every dense layer starts with a Concat of the block's features so far, even
// a single one: torchvision's torch.cat copies a lone tensor too, and the
// memory-efficient rewrite needs that buffer to exist. Each block ends with a
// Concat of its input and every layer output.
func buildDenseNet(b *builder) (*densenetShape, error) {
	f := b.prefix + "features."
	x, err := b.conv(f+"conv0", b.g.Input, 7, 2, 3, false)
	if err != nil {
		return nil, err
	}
	if x, err = b.bn(f+"norm0", x); err != nil {
		return nil, err
	}
	x = b.relu(f+"relu0", x)
	x = b.maxpool(f+"pool0", x, 3, 2, 1)
	sh := &densenetShape{init: x.Channels}

	for i := 1; b.has(fmt.Sprintf("%sdenseblock%d", f, i)); i++ {
		block := fmt.Sprintf("%sdenseblock%d", f, i)
		if i > 1 {
			// A block after the first is reached through a transition.
			if x, err = transition(b, fmt.Sprintf("%stransition%d", f, i-1), x, sh); err != nil {
				return nil, err
			}
		}
		features := []*graph.Value{x}
		n := 0
		for j := 1; b.has(fmt.Sprintf("%s.denselayer%d", block, j)); j++ {
			y, err := denseLayer(b, fmt.Sprintf("%s.denselayer%d", block, j), features, sh)
			if err != nil {
				return nil, err
			}
			features = append(features, y)
			n++
		}
		if n == 0 {
			return nil, fmt.Errorf("missing %s.denselayer1.norm1.weight: %s has no dense layers", block, block)
		}
		sh.blocks = append(sh.blocks, n)
		x = b.add(block+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, sumChannels(features), features...)
	}
	if len(sh.blocks) == 0 {
		return nil, fmt.Errorf("missing %sdenseblock1.denselayer1.norm1.weight", f)
	}
	if x, err = b.bn(f+"norm5", x); err != nil {
		return nil, err
	}
	x = b.relu(f+"relu5", x)
	x = b.head(b.prefix+"avgpool", x, 1)
	if _, err := b.linear(b.prefix+"classifier", x); err != nil {
		return nil, err
	}
	return sh, nil
}

// denseLayer adds one _DenseLayer at module path m reading features. Node
// names follow the keys as found: norm1/conv1/... or, in checkpoints older
// than torchvision 0.3, norm.1/conv.1/... (relu named to match).
func denseLayer(b *builder, m string, features []*graph.Value, sh *densenetShape) (*graph.Value, error) {
	sep := ""
	if b.has(m+".norm.1") || b.has(m+".conv.1") {
		sep = "."
		b.legacy++
	}
	name := func(mod string, k int) string { return fmt.Sprintf("%s.%s%s%d", m, mod, sep, k) }
	x := b.add(m+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, sumChannels(features), features...)
	x, err := b.bn(name("norm", 1), x)
	if err != nil {
		return nil, err
	}
	x = b.relu(name("relu", 1), x)
	if x, err = b.conv(name("conv", 1), x, 1, 1, 0, false); err != nil {
		return nil, err
	}
	inner := x.Channels
	if x, err = b.bn(name("norm", 2), x); err != nil {
		return nil, err
	}
	x = b.relu(name("relu", 2), x)
	if x, err = b.conv(name("conv", 2), x, 3, 1, 1, false); err != nil {
		return nil, err
	}
	if sh.growth == 0 {
		sh.growth, sh.inner = x.Channels, inner
	} else if sh.growth != x.Channels || sh.inner != inner {
		sh.irregular = true
	}
	return x, nil
}

// transition adds a _Transition at module path m. torchvision's transitions
// halve the channels; one that does not still makes a sound graph, only not a
// torchvision DenseNet.
func transition(b *builder, m string, x *graph.Value, sh *densenetShape) (*graph.Value, error) {
	in := x.Channels
	x, err := b.bn(m+".norm", x)
	if err != nil {
		return nil, err
	}
	x = b.relu(m+".relu", x)
	if x, err = b.conv(m+".conv", x, 1, 1, 0, false); err != nil {
		return nil, err
	}
	attr := graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}, CountIncludePad: true}
	if x.Channels != in/2 {
		sh.irregular = true
	}
	return b.add(m+".pool", graph.OpAvgPool, attr, nil, x.Channels, x), nil
}

func sumChannels(vs []*graph.Value) int {
	n := 0
	for _, v := range vs {
		n += v.Channels
	}
	return n
}

// describe names a non-standard DenseNet after torchvision's constructor
// arguments, e.g. "densenet (growth 4, bn_size 2, blocks [2 2], init 8)".
func (s *densenetShape) describe() string {
	if s.irregular || s.growth == 0 || s.inner%s.growth != 0 {
		return fmt.Sprintf("densenet (blocks %s, init %d, irregular widths)", joinInts(s.blocks), s.init)
	}
	return fmt.Sprintf("densenet (growth %d, bn_size %d, blocks %s, init %d)", s.growth, s.inner/s.growth, joinInts(s.blocks), s.init)
}
