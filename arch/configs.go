package arch

import (
	"fmt"
	"regexp"
	"strings"
	"sync"

	"github.com/abnconvert/abnconvert/graph"
)

// Family names, as reported in Match.Family.
const (
	FamilyResNet   = "resnet"
	FamilyDenseNet = "densenet"
	FamilyVGG      = "vgg"
	// FamilySegmentation is torchvision's FCN and DeepLabV3 with a ResNet
	// backbone (fcn_resnet50/101, deeplabv3_resnet50/101).
	FamilySegmentation = "segmentation"
)

// families lists the families in the order detection prefers them on a tie.
var families = []string{FamilyResNet, FamilyDenseNet, FamilyVGG, FamilySegmentation}

// tensor is one expected state-dict entry.
type tensor struct {
	key   string
	shape []int
}

// resnetConfig holds the arguments of torchvision's ResNet constructor that
// shape the state dict, plus the stem width that torchvision fixes at 64 (the
// planes of layer L are Width<<(L-1)); tests vary it to build tiny networks.
type resnetConfig struct {
	Bottleneck    bool
	Layers        [4]int
	Width         int
	Groups        int
	WidthPerGroup int
}

// densenetConfig holds the arguments of torchvision's DenseNet constructor.
type densenetConfig struct {
	Growth int
	Blocks []int
	Init   int
	BNSize int
}

// vggConfig holds a torchvision VGG cfg (vggPool for "M") and the widths of
// the two hidden classifier layers (4096 in torchvision).
type vggConfig struct {
	Cfg    []int
	Hidden [2]int
}

const vggPool = -1

// config is one supported torchvision architecture.
type config struct {
	name     string
	family   string
	resnet   resnetConfig
	densenet densenetConfig
	vgg      vggConfig
}

var (
	vggA = []int{64, vggPool, 128, vggPool, 256, 256, vggPool, 512, 512, vggPool, 512, 512, vggPool}
	vggB = []int{64, 64, vggPool, 128, 128, vggPool, 256, 256, vggPool, 512, 512, vggPool, 512, 512, vggPool}
	vggD = []int{64, 64, vggPool, 128, 128, vggPool, 256, 256, 256, vggPool, 512, 512, 512, vggPool, 512, 512, 512, vggPool}
	vggE = []int{64, 64, vggPool, 128, 128, vggPool, 256, 256, 256, 256, vggPool, 512, 512, 512, 512, vggPool, 512, 512, 512, 512, vggPool}
)

func rn(name string, bottleneck bool, layers [4]int, groups, wpg int) config {
	return config{name: name, family: FamilyResNet, resnet: resnetConfig{bottleneck, layers, 64, groups, wpg}}
}

func dn(name string, growth int, blocks []int, init int) config {
	return config{name: name, family: FamilyDenseNet, densenet: densenetConfig{growth, blocks, init, 4}}
}

func vg(name string, cfg []int) config {
	return config{name: name, family: FamilyVGG, vgg: vggConfig{cfg, [2]int{4096, 4096}}}
}

// configs mirrors the model builders of torchvision 0.14
// (torchvision/models/{resnet,densenet,vgg}.py).
var configs = []config{
	rn("resnet18", false, [4]int{2, 2, 2, 2}, 1, 64),
	rn("resnet34", false, [4]int{3, 4, 6, 3}, 1, 64),
	rn("resnet50", true, [4]int{3, 4, 6, 3}, 1, 64),
	rn("resnet101", true, [4]int{3, 4, 23, 3}, 1, 64),
	rn("resnet152", true, [4]int{3, 8, 36, 3}, 1, 64),
	rn("resnext50_32x4d", true, [4]int{3, 4, 6, 3}, 32, 4),
	rn("resnext101_32x8d", true, [4]int{3, 4, 23, 3}, 32, 8),
	rn("resnext101_64x4d", true, [4]int{3, 4, 23, 3}, 64, 4),
	rn("wide_resnet50_2", true, [4]int{3, 4, 6, 3}, 1, 128),
	rn("wide_resnet101_2", true, [4]int{3, 4, 23, 3}, 1, 128),
	dn("densenet121", 32, []int{6, 12, 24, 16}, 64),
	dn("densenet161", 48, []int{6, 12, 36, 24}, 96),
	dn("densenet169", 32, []int{6, 12, 32, 32}, 64),
	dn("densenet201", 32, []int{6, 12, 48, 32}, 64),
	vg("vgg11_bn", vggA),
	vg("vgg13_bn", vggB),
	vg("vgg16_bn", vggD),
	vg("vgg19_bn", vggE),
}

// Names lists the torchvision architectures Recognize knows, in
// torchvision's order.
func Names() []string {
	out := make([]string, len(configs))
	for i, c := range configs {
		out[i] = c.name
	}
	return out
}

func lookup(name string) (config, bool) {
	for _, c := range configs {
		if c.name == name {
			return c, true
		}
	}
	return config{}, false
}

// tensors lists the state dict torchvision would write for c, in its order.
func (c config) tensors(numClasses int) []tensor {
	switch c.family {
	case FamilyResNet:
		return c.resnet.tensors(numClasses)
	case FamilyDenseNet:
		return c.densenet.tensors(numClasses)
	default:
		return c.vgg.tensors(numClasses)
	}
}

// bnTensors lists a BatchNorm2d's entries; num_batches_tracked is 0-d.
func bnTensors(module string, c int) []tensor {
	return []tensor{
		{module + ".weight", []int{c}},
		{module + ".bias", []int{c}},
		{module + ".running_mean", []int{c}},
		{module + ".running_var", []int{c}},
		{module + ".num_batches_tracked", []int{}},
	}
}

func (c resnetConfig) tensors(numClasses int) []tensor {
	ts := []tensor{{"conv1.weight", []int{c.Width, 3, 7, 7}}}
	ts = append(ts, bnTensors("bn1", c.Width)...)
	inplanes := c.Width
	expansion := 1
	if c.Bottleneck {
		expansion = 4
	}
	for l, n := range c.Layers {
		planes := c.Width << l
		out := planes * expansion
		for i := 0; i < n; i++ {
			m := fmt.Sprintf("layer%d.%d.", l+1, i)
			if c.Bottleneck {
				// torchvision: width = int(planes * (base_width / 64.0)) * groups.
				width := planes * c.WidthPerGroup / 64 * c.Groups
				ts = append(ts, tensor{m + "conv1.weight", []int{width, inplanes, 1, 1}})
				ts = append(ts, bnTensors(m+"bn1", width)...)
				ts = append(ts, tensor{m + "conv2.weight", []int{width, width / c.Groups, 3, 3}})
				ts = append(ts, bnTensors(m+"bn2", width)...)
				ts = append(ts, tensor{m + "conv3.weight", []int{out, width, 1, 1}})
				ts = append(ts, bnTensors(m+"bn3", out)...)
			} else {
				ts = append(ts, tensor{m + "conv1.weight", []int{planes, inplanes, 3, 3}})
				ts = append(ts, bnTensors(m+"bn1", planes)...)
				ts = append(ts, tensor{m + "conv2.weight", []int{planes, planes, 3, 3}})
				ts = append(ts, bnTensors(m+"bn2", planes)...)
			}
			if i == 0 && (l > 0 || inplanes != out) {
				ts = append(ts, tensor{m + "downsample.0.weight", []int{out, inplanes, 1, 1}})
				ts = append(ts, bnTensors(m+"downsample.1", out)...)
			}
			inplanes = out
		}
	}
	return append(ts, tensor{"fc.weight", []int{numClasses, inplanes}}, tensor{"fc.bias", []int{numClasses}})
}

func (c densenetConfig) tensors(numClasses int) []tensor {
	ts := []tensor{{"features.conv0.weight", []int{c.Init, 3, 7, 7}}}
	ts = append(ts, bnTensors("features.norm0", c.Init)...)
	n := c.Init
	inner := c.BNSize * c.Growth
	for b, layers := range c.Blocks {
		for i := 0; i < layers; i++ {
			m := fmt.Sprintf("features.denseblock%d.denselayer%d.", b+1, i+1)
			in := n + i*c.Growth
			ts = append(ts, bnTensors(m+"norm1", in)...)
			ts = append(ts, tensor{m + "conv1.weight", []int{inner, in, 1, 1}})
			ts = append(ts, bnTensors(m+"norm2", inner)...)
			ts = append(ts, tensor{m + "conv2.weight", []int{c.Growth, inner, 3, 3}})
		}
		n += layers * c.Growth
		if b != len(c.Blocks)-1 {
			m := fmt.Sprintf("features.transition%d.", b+1)
			ts = append(ts, bnTensors(m+"norm", n)...)
			ts = append(ts, tensor{m + "conv.weight", []int{n / 2, n, 1, 1}})
			n /= 2
		}
	}
	ts = append(ts, bnTensors("features.norm5", n)...)
	return append(ts, tensor{"classifier.weight", []int{numClasses, n}}, tensor{"classifier.bias", []int{numClasses}})
}

func (c vggConfig) tensors(numClasses int) []tensor {
	var ts []tensor
	in, idx := 3, 0
	for _, v := range c.Cfg {
		if v == vggPool {
			idx++
			continue
		}
		ts = append(ts, tensor{fmt.Sprintf("features.%d.weight", idx), []int{v, in, 3, 3}})
		ts = append(ts, tensor{fmt.Sprintf("features.%d.bias", idx), []int{v}})
		ts = append(ts, bnTensors(fmt.Sprintf("features.%d", idx+1), v)...)
		in, idx = v, idx+3
	}
	h1, h2 := c.Hidden[0], c.Hidden[1]
	return append(ts,
		tensor{"classifier.0.weight", []int{h1, in * 7 * 7}}, tensor{"classifier.0.bias", []int{h1}},
		tensor{"classifier.3.weight", []int{h2, h1}}, tensor{"classifier.3.bias", []int{h2}},
		tensor{"classifier.6.weight", []int{numClasses, h2}}, tensor{"classifier.6.bias", []int{numClasses}},
	)
}

// classifierKey is the key whose first dimension is num_classes.
func classifierKey(family string) string {
	switch family {
	case FamilyResNet:
		return "fc.weight"
	case FamilyDenseNet:
		return "classifier.weight"
	default:
		return "classifier.6.weight"
	}
}

// legacyDenseKey matches the pre-0.3 torchvision DenseNet spelling
// (denselayerN.norm.1.weight); torchvision's own loader renames these with the
// same pattern.
// modernDenseKey spells a DenseNet key of torchvision's legacy form
// ("denselayer1.norm.1.weight") the modern way ("denselayer1.norm1.weight")
// and returns any other key as it is. The regular expression runs only on
// keys that can be legacy ones: on every key of a densenet201 it took a
// tenth of a conversion.
func modernDenseKey(k string) string {
	if !strings.Contains(k, ".norm.") && !strings.Contains(k, ".relu.") && !strings.Contains(k, ".conv.") {
		return k
	}
	return legacyDenseKey().ReplaceAllString(k, "$1$2")
}

var legacyDenseKey = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^(.*denselayer\d+\.(?:norm|relu|conv))\.([12]\.(?:weight|bias|running_mean|running_var|num_batches_tracked))$`)
})

// view is a state dict seen through a key prefix, with legacy DenseNet names
// mapped to the modern ones so that it can be compared with a generated
// configuration. orig maps a normalised key back to the key as found.
type view struct {
	order  []string
	shapes map[string][]int
	orig   map[string]string
}

func newView(w graph.Weights, keys []string, prefix string) view {
	// Sized for every key: grown from empty, the maps were rehashed
	// several times over (a view is made per candidate prefix).
	v := view{shapes: make(map[string][]int, len(keys)), orig: make(map[string]string, len(keys))}
	for _, k := range keys {
		if !strings.HasPrefix(k, prefix) {
			continue
		}
		s, ok := w.Shape(k)
		if !ok {
			continue
		}
		n := modernDenseKey(k[len(prefix):])
		if _, dup := v.shapes[n]; dup {
			// Both spellings present: keep the first; the second shows up as
			// unexpected through orig.
			continue
		}
		v.order = append(v.order, n)
		v.shapes[n] = s
		v.orig[n] = k
	}
	return v
}

// numClasses reads num_classes from the classifier, 1000 when absent.
func (v view) numClasses(family string) int {
	if s := v.shapes[classifierKey(family)]; len(s) == 2 {
		return s[0]
	}
	return 1000
}

// diff lists how the state dict (all of keys, prefix applied) departs from
// configuration c: missing entries, shape disagreements, then entries c does
// not have. A missing num_batches_tracked is no disagreement: checkpoints
// written before PyTorch 0.4.1 lack it, and loading fills it in.
func diff(w graph.Weights, keys []string, prefix string, c config) []string {
	return diffView(newView(w, keys, prefix), keys, prefix, c, false)
}

// diffView is diff over a view made once; first stops at the first
// difference (exactName only asks whether there is one).
func diffView(v view, keys []string, prefix string, c config, first bool) []string {
	want := c.tensors(v.numClasses(c.family))
	expected := map[string]bool{}
	var out []string
	for _, t := range want {
		expected[t.key] = true
		got, ok := v.shapes[t.key]
		switch {
		case !ok && strings.HasSuffix(t.key, "."+graph.RoleNumBatches):
		case !ok:
			out = append(out, fmt.Sprintf("missing %s%s (%s has shape %v)", prefix, t.key, c.name, t.shape))
		case !sameShape(got, t.shape):
			out = append(out, fmt.Sprintf("%s has shape %v, %s has %v", v.orig[t.key], got, c.name, t.shape))
		}
		if first && len(out) > 0 {
			return out
		}
	}
	var extra []string
	for _, k := range keys {
		if !strings.HasPrefix(k, prefix) {
			extra = append(extra, k)
			continue
		}
		n := modernDenseKey(k[len(prefix):])
		if !expected[n] || v.orig[n] != k {
			extra = append(extra, k)
			if first {
				break
			}
		}
	}
	for _, k := range extra {
		out = append(out, fmt.Sprintf("unexpected %s (not in %s)", k, c.name))
	}
	return out
}

func sameShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// exactName returns the configuration of family whose state dict the weights
// match exactly (num_classes aside, which is a constructor argument), or "".
func exactName(w graph.Weights, keys []string, prefix, family string) string {
	v := newView(w, keys, prefix)
	cls := v.shapes[classifierKey(family)]
	for _, c := range configs {
		if c.family != family {
			continue
		}
		// The classifier's input width first: a configuration whose
		// classifier the state dict's does not fit differs from it, and
		// listing its tensors (diffView) is most of the cost (on
		// densenet201 three other DenseNets were listed in full).
		if len(cls) != 2 || cls[1] != c.inFeatures() {
			continue
		}
		if len(diffView(v, keys, prefix, c, true)) == 0 {
			return c.name
		}
	}
	return ""
}

// inFeatures is the input width of c's classifier (the second dimension
// of its classifierKey tensor in tensors), worked out without listing the
// tensors.
func (c config) inFeatures() int {
	switch c.family {
	case FamilyResNet:
		r := c.resnet
		if r.Bottleneck {
			return r.Width << 3 * 4 // layer4's planes times expansion 4
		}
		return r.Width << 3
	case FamilyDenseNet:
		d := c.densenet
		n := d.Init
		for b, layers := range d.Blocks {
			n += layers * d.Growth
			if b != len(d.Blocks)-1 {
				n /= 2 // a transition halves the channels
			}
		}
		return n
	default:
		return c.vgg.Hidden[1]
	}
}

// firstFew joins at most n items, saying how many were left out.
func firstFew(items []string, n int) string {
	if len(items) <= n {
		return strings.Join(items, "; ")
	}
	return fmt.Sprintf("%s; and %d more", strings.Join(items[:n], "; "), len(items)-n)
}
