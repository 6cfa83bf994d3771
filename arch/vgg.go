package arch

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
)

// vggShape is what the state dict says about a VGG with batch norm.
type vggShape struct {
	cfg    []int // torchvision cfg, vggPool for "M"
	hidden [2]int
}

// buildVGG mirrors torchvision 0.14's VGG forward for the _bn variants:
// features (conv 3x3 p1 → bn → relu, with max pools 2/2 between) → avgpool
// (7,7) → flatten → classifier (Linear, ReLU, Dropout, Linear, ReLU, Dropout,
// Linear at classifier.0..6).
//
// The cfg is read from the features.N indices: each conv takes three slots
// (conv, bn, relu) and a max pool one, so a gap of one slot before a conv is
// a pool. A pool after the last conv owns no parameters and leaves no trace
// in the state dict; every torchvision cfg ends with one, and the adaptive
// pool makes the classifier's shape independent of it, so it is assumed.
func buildVGG(b *builder) (*vggShape, []string, error) {
	f := b.prefix + "features."
	idx := map[int]bool{}
	for m := range b.modules {
		rest, ok := strings.CutPrefix(m, f)
		if !ok || strings.Contains(rest, ".") {
			continue
		}
		if i, err := strconv.Atoi(rest); err == nil && i >= 0 && strconv.Itoa(i) == rest {
			idx[i] = true
		}
	}
	if len(idx) == 0 {
		return nil, nil, fmt.Errorf("missing %s0.weight", f)
	}
	sh := &vggShape{}
	x := b.g.Input
	pos := 0 // index of the next module in features
	for _, i := range sortedInts(idx) {
		if i < pos {
			continue // a BN slot, consumed with its conv
		}
		switch i - pos {
		case 0:
		case 1:
			x = b.maxpool(fmt.Sprintf("%s%d", f, pos), x, 2, 2, 0)
			sh.cfg = append(sh.cfg, vggPool)
		default:
			return nil, nil, fmt.Errorf("expected a Conv2d at %s%d, or a MaxPool2d there and a Conv2d at %s%d; found no parameters until %s%d", f, pos, f, pos+1, f, i)
		}
		if s, _ := b.shape(fmt.Sprintf("%s%d.weight", f, i)); len(s) != 4 {
			return nil, nil, fmt.Errorf("%s%d is not a Conv2d (weight shape %v), expected one after %s%d", f, i, s, f, pos-1)
		}
		var err error
		if x, err = b.conv(fmt.Sprintf("%s%d", f, i), x, 3, 1, 1, false); err != nil {
			return nil, nil, err
		}
		if !idx[i+1] {
			return nil, nil, fmt.Errorf("missing %s%d.weight: a BatchNorm2d after %s%d (plain VGG without batch norm is not supported: it has nothing to convert)", f, i+1, f, i)
		}
		if x, err = b.bn(fmt.Sprintf("%s%d", f, i+1), x); err != nil {
			return nil, nil, err
		}
		x = b.relu(fmt.Sprintf("%s%d", f, i+2), x)
		sh.cfg = append(sh.cfg, x.Channels)
		pos = i + 3
	}
	x = b.maxpool(fmt.Sprintf("%s%d", f, pos), x, 2, 2, 0)
	sh.cfg = append(sh.cfg, vggPool)
	notes := []string{fmt.Sprintf("the final MaxPool2d %s%d owns no parameters; assumed as in every torchvision cfg", f, pos)}

	x = b.head(b.prefix+"avgpool", x, 7)
	c := b.prefix + "classifier."
	for i := 0; i <= 6; i += 3 {
		var err error
		if x, err = b.linear(fmt.Sprintf("%s%d", c, i), x); err != nil {
			return nil, nil, err
		}
		if i == 6 {
			break
		}
		sh.hidden[i/3] = x.Channels
		x = b.relu(fmt.Sprintf("%s%d", c, i+1), x)
		x = b.add(fmt.Sprintf("%s%d", c, i+2), graph.OpDropout, graph.Attr{P: 0.5}, nil, x.Channels, x)
	}
	return sh, notes, nil
}

// describe names a non-standard VGG, e.g.
// "vgg_bn (cfg [8 M 16 M], classifier 32 24)" or, when only the classifier
// differs, "vgg_bn (vgg16_bn features, classifier 512 512)".
func (s *vggShape) describe() string {
	features := "cfg " + cfgString(s.cfg)
	for _, c := range configs {
		if c.family == FamilyVGG && cfgString(c.vgg.Cfg) == cfgString(s.cfg) {
			features = c.name + " features"
		}
	}
	return fmt.Sprintf("vgg_bn (%s, classifier %d %d)", features, s.hidden[0], s.hidden[1])
}

func cfgString(cfg []int) string {
	parts := make([]string, len(cfg))
	for i, v := range cfg {
		if v == vggPool {
			parts[i] = "M"
		} else {
			parts[i] = strconv.Itoa(v)
		}
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// sortedInts lists a set of module indices in order.
func sortedInts(set map[int]bool) []int {
	var out []int
	for i := range set {
		out = append(out, i)
	}
	sort.Ints(out)
	return out
}
