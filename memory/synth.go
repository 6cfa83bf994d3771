package memory

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// DenseNetConfig is the shape of a torchvision DenseNet: growth rate,
// bottleneck factor, dense layers per block, stem width.
type DenseNetConfig struct {
	Name   string
	Growth int
	BNSize int
	Blocks []int
	Init   int
}

// Depth is the network's layer count as DenseNet names count it: two
// convolutions per dense layer, the stem convolution, the three transition
// convolutions and the classifier (121 for blocks 6, 12, 24, 16; the
// configuration known as DenseNet-264 counts 265 this way).
func (c DenseNetConfig) Depth() int {
	n := 0
	for _, b := range c.Blocks {
		n += b
	}
	return 2*n + len(c.Blocks) + 1
}

// DepthSeries are the DenseNet-BC configurations of the memory-efficient
// DenseNet report's depth comparison: torchvision's densenet121, 169 and
// 201, and the deeper (6, 12, 64, 48) of Huang et al., which torchvision does
// not name.
var DepthSeries = []DenseNetConfig{
	{"densenet121", 32, 4, []int{6, 12, 24, 16}, 64},
	{"densenet169", 32, 4, []int{6, 12, 32, 32}, 64},
	{"densenet201", 32, 4, []int{6, 12, 48, 32}, 64},
	{"densenet264", 32, 4, []int{6, 12, 64, 48}, 64},
}

// Weights synthesises the state dict torchvision's DenseNet class writes for
// c (1000 classes), as shapes: BN layers get values (gamma 1, beta 0, mean 0,
// variance 1, which is what the conversion reads to choose signs), the
// convolution and linear weights none, since only the shape-only backend
// runs them.
func (c DenseNetConfig) Weights() *graph.MemWeights {
	w := graph.NewMemWeights()
	bn := func(m string, ch int) {
		w.Put(m+".weight", []int{ch}, fill(ch, 1))
		w.Put(m+".bias", []int{ch}, fill(ch, 0))
		w.Put(m+".running_mean", []int{ch}, fill(ch, 0))
		w.Put(m+".running_var", []int{ch}, fill(ch, 1))
		w.Put(m+".num_batches_tracked", []int{}, []float64{0})
	}
	w.Put("features.conv0.weight", []int{c.Init, 3, 7, 7}, nil)
	bn("features.norm0", c.Init)
	n := c.Init
	inner := c.BNSize * c.Growth
	for b, layers := range c.Blocks {
		for i := 0; i < layers; i++ {
			m := fmt.Sprintf("features.denseblock%d.denselayer%d.", b+1, i+1)
			in := n + i*c.Growth
			bn(m+"norm1", in)
			w.Put(m+"conv1.weight", []int{inner, in, 1, 1}, nil)
			bn(m+"norm2", inner)
			w.Put(m+"conv2.weight", []int{c.Growth, inner, 3, 3}, nil)
		}
		n += layers * c.Growth
		if b != len(c.Blocks)-1 {
			m := fmt.Sprintf("features.transition%d.", b+1)
			bn(m+"norm", n)
			w.Put(m+"conv.weight", []int{n / 2, n, 1, 1}, nil)
			n /= 2
		}
	}
	bn("features.norm5", n)
	w.Put("classifier.weight", []int{1000, n}, nil)
	w.Put("classifier.bias", []int{1000}, nil)
	return w
}

func fill(n int, v float64) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = v
	}
	return out
}
