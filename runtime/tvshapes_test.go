package runtime

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// The state-dict shapes torchvision 0.14 writes for the networks the memory
// figures are calibrated on; copied, trimmed, from the arch package's
// generator (arch/configs.go), which its tests check against real
// torchvision key lists.

type tvTensor struct {
	key   string
	shape []int
}

func tvBN(module string, c int) []tvTensor {
	return []tvTensor{
		{module + ".weight", []int{c}}, {module + ".bias", []int{c}},
		{module + ".running_mean", []int{c}}, {module + ".running_var", []int{c}},
		{module + ".num_batches_tracked", []int{}},
	}
}

// tvResNet is a Bottleneck ResNet (groups 1) with the given blocks per layer.
func tvResNet(layers [4]int, width, numClasses int) []tvTensor {
	ts := []tvTensor{{"conv1.weight", []int{width, 3, 7, 7}}}
	ts = append(ts, tvBN("bn1", width)...)
	inplanes := width
	for l, n := range layers {
		planes := width << l
		out := planes * 4
		for i := 0; i < n; i++ {
			m := fmt.Sprintf("layer%d.%d.", l+1, i)
			ts = append(ts, tvTensor{m + "conv1.weight", []int{planes, inplanes, 1, 1}})
			ts = append(ts, tvBN(m+"bn1", planes)...)
			ts = append(ts, tvTensor{m + "conv2.weight", []int{planes, planes, 3, 3}})
			ts = append(ts, tvBN(m+"bn2", planes)...)
			ts = append(ts, tvTensor{m + "conv3.weight", []int{out, planes, 1, 1}})
			ts = append(ts, tvBN(m+"bn3", out)...)
			if i == 0 {
				ts = append(ts, tvTensor{m + "downsample.0.weight", []int{out, inplanes, 1, 1}})
				ts = append(ts, tvBN(m+"downsample.1", out)...)
			}
			inplanes = out
		}
	}
	return append(ts, tvTensor{"fc.weight", []int{numClasses, inplanes}}, tvTensor{"fc.bias", []int{numClasses}})
}

func tvDenseNet(growth int, blocks []int, init, bnSize, numClasses int) []tvTensor {
	ts := []tvTensor{{"features.conv0.weight", []int{init, 3, 7, 7}}}
	ts = append(ts, tvBN("features.norm0", init)...)
	n := init
	inner := bnSize * growth
	for b, layers := range blocks {
		for i := 0; i < layers; i++ {
			m := fmt.Sprintf("features.denseblock%d.denselayer%d.", b+1, i+1)
			in := n + i*growth
			ts = append(ts, tvBN(m+"norm1", in)...)
			ts = append(ts, tvTensor{m + "conv1.weight", []int{inner, in, 1, 1}})
			ts = append(ts, tvBN(m+"norm2", inner)...)
			ts = append(ts, tvTensor{m + "conv2.weight", []int{growth, inner, 3, 3}})
		}
		n += layers * growth
		if b != len(blocks)-1 {
			m := fmt.Sprintf("features.transition%d.", b+1)
			ts = append(ts, tvBN(m+"norm", n)...)
			ts = append(ts, tvTensor{m + "conv.weight", []int{n / 2, n, 1, 1}})
			n /= 2
		}
	}
	ts = append(ts, tvBN("features.norm5", n)...)
	return append(ts, tvTensor{"classifier.weight", []int{numClasses, n}}, tvTensor{"classifier.bias", []int{numClasses}})
}

// tvVGG is a VGG with batch norm; -1 in cfg is a max pool.
func tvVGG(cfg []int, hidden, numClasses int) []tvTensor {
	var ts []tvTensor
	in, idx := 3, 0
	for _, v := range cfg {
		if v < 0 {
			idx++
			continue
		}
		ts = append(ts, tvTensor{fmt.Sprintf("features.%d.weight", idx), []int{v, in, 3, 3}})
		ts = append(ts, tvTensor{fmt.Sprintf("features.%d.bias", idx), []int{v}})
		ts = append(ts, tvBN(fmt.Sprintf("features.%d", idx+1), v)...)
		in, idx = v, idx+3
	}
	return append(ts,
		tvTensor{"classifier.0.weight", []int{hidden, in * 7 * 7}}, tvTensor{"classifier.0.bias", []int{hidden}},
		tvTensor{"classifier.3.weight", []int{hidden, hidden}}, tvTensor{"classifier.3.bias", []int{hidden}},
		tvTensor{"classifier.6.weight", []int{numClasses, hidden}}, tvTensor{"classifier.6.bias", []int{numClasses}},
	)
}

// tvModels are the calibration networks by torchvision name.
var tvModels = map[string]func() []tvTensor{
	"resnet50":    func() []tvTensor { return tvResNet([4]int{3, 4, 6, 3}, 64, 1000) },
	"densenet121": func() []tvTensor { return tvDenseNet(32, []int{6, 12, 24, 16}, 64, 4, 1000) },
	"vgg16_bn": func() []tvTensor {
		return tvVGG([]int{64, 64, -1, 128, 128, -1, 256, 256, 256, -1, 512, 512, 512, -1, 512, 512, 512, -1}, 4096, 1000)
	},
}

// shapeWeights builds a state dict of shapes. BN tensors get values (gamma
// 1, beta 0, mean 0, variance 1: what the rewrite reads to choose signs);
// convolution and linear weights have none, as nothing reads them when the
// shape-only backend runs.
func shapeWeights(ts []tvTensor) *graph.MemWeights {
	w := graph.NewMemWeights()
	for _, t := range ts {
		var v []float64
		switch {
		case len(t.shape) == 1 && (hasSuffix(t.key, ".running_var") || bnWeight(ts, t.key)):
			v = fill(t.shape[0], 1)
		case len(t.shape) <= 1 && !isLinearBias(t.key):
			v = fill(graph.Numel(t.shape), 0)
		}
		w.Put(t.key, t.shape, v)
	}
	return w
}

func hasSuffix(s, suf string) bool { return len(s) >= len(suf) && s[len(s)-len(suf):] == suf }

// bnWeight reports whether key is a BN weight: module.weight with a
// running_var beside it.
func bnWeight(ts []tvTensor, key string) bool {
	if !hasSuffix(key, ".weight") {
		return false
	}
	rv := key[:len(key)-len("weight")] + "running_var"
	for _, t := range ts {
		if t.key == rv {
			return true
		}
	}
	return false
}

func isLinearBias(key string) bool {
	return hasSuffix(key, "fc.bias") || hasSuffix(key, "classifier.bias") || (len(key) > 11 && key[:11] == "classifier." && hasSuffix(key, ".bias"))
}

func fill(n int, v float64) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = v
	}
	return out
}
