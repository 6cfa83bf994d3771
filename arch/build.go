package arch

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
)

// builder adds nodes to a graph while reading their parameter shapes from the
// weights. It checks every shape against the channels that reach the module,
// so that a graph it finishes is one torchvision's forward could run, and it
// records which keys it consumed so that leftovers can be reported.
type builder struct {
	w       graph.Weights
	g       *graph.Graph
	prefix  string
	used    map[string]bool
	missing []string
	// modules holds every dotted path that is a proper prefix of a key
	// ("layer1", "layer1.0", "layer1.0.bn1"), so that the family parsers can
	// ask whether a module exists without scanning the keys.
	modules map[string]bool
	// legacy counts DenseNet layers spelled norm.1/conv.1/...
	legacy int
	// noBatches counts BN modules without num_batches_tracked.
	noBatches int
	bns       int
}

func newBuilder(w graph.Weights, keys []string, prefix string) *builder {
	b := &builder{w: w, prefix: prefix, used: map[string]bool{}, modules: map[string]bool{}}
	for _, k := range keys {
		for i := 0; i < len(k); i++ {
			if k[i] == '.' {
				b.modules[k[:i]] = true
			}
		}
	}
	return b
}

// has reports whether module path m (prefix included) owns any key.
func (b *builder) has(m string) bool { return b.modules[m] }

func (b *builder) shape(key string) ([]int, bool) {
	s, ok := b.w.Shape(key)
	return s, ok
}

// add appends a node and sets its output's channel count.
func (b *builder) add(name string, op graph.Op, attr graph.Attr, params map[string]string, channels int, in ...*graph.Value) *graph.Value {
	v := b.g.Add(name, op, attr, params, in...)
	v.Channels = channels
	return v
}

// conv adds Conv2d module m (a full module path) with torchvision's
// hyper-parameters, which the state dict does not hold: a square kernel k
// whose size must match the weight's, the given stride and padding,
// dilation 1 (convDilated for another). Groups are inferred from the weight when allowGroups is set;
// otherwise its in_channels must equal the channels reaching it.
func (b *builder) conv(m string, in *graph.Value, k, stride, pad int, allowGroups bool) (*graph.Value, error) {
	return b.convDilated(m, in, k, stride, pad, 1, allowGroups)
}

// convDilated is conv with a dilation.
func (b *builder) convDilated(m string, in *graph.Value, k, stride, pad, dil int, allowGroups bool) (*graph.Value, error) {
	key := m + "." + graph.RoleWeight
	s, ok := b.shape(key)
	if !ok {
		return nil, fmt.Errorf("missing %s", key)
	}
	if len(s) != 4 {
		return nil, fmt.Errorf("%s has shape %v, expected a 4-d Conv2d weight", key, s)
	}
	if s[2] != k || s[3] != k {
		return nil, fmt.Errorf("%s has shape %v, expected a %dx%d kernel", key, s, k, k)
	}
	c := in.Channels
	groups := 1
	switch {
	case s[0] <= 0 || s[1] <= 0:
		return nil, fmt.Errorf("%s has shape %v, expected positive channel counts", key, s)
	case s[1] == c:
	case allowGroups && c%s[1] == 0 && s[0]%(c/s[1]) == 0:
		groups = c / s[1]
	case allowGroups:
		return nil, fmt.Errorf("%s has shape %v, expected in_channels/groups dividing the %d channels reaching it", key, s, c)
	default:
		return nil, fmt.Errorf("%s has shape %v, expected in_channels %d (the channels reaching it)", key, s, c)
	}
	params := map[string]string{graph.RoleWeight: key}
	b.used[key] = true
	bias := false
	if bk := m + "." + graph.RoleBias; b.present(bk) {
		bs, _ := b.shape(bk)
		if !sameShape(bs, []int{s[0]}) {
			return nil, fmt.Errorf("%s has shape %v, expected [%d]", bk, bs, s[0])
		}
		params[graph.RoleBias] = bk
		b.used[bk] = true
		bias = true
	}
	attr := graph.Attr{
		InChannels: c, OutChannels: s[0], KernelSize: [2]int{k, k},
		Stride: [2]int{stride, stride}, Padding: [2]int{pad, pad}, Dilation: [2]int{dil, dil},
		Groups: groups, Bias: bias,
	}
	return b.add(m, graph.OpConv, attr, params, s[0], in), nil
}

func (b *builder) present(key string) bool {
	_, ok := b.w.Shape(key)
	return ok
}

// bn adds BatchNorm2d module m. The state dict does not store eps or
// momentum; torchvision uses PyTorch's defaults everywhere. Missing affine
// or running-statistics entries are collected, not fatal, so that all of them
// can be reported at once; a BN with none of them is a structural error.
func (b *builder) bn(m string, in *graph.Value) (*graph.Value, error) {
	c := in.Channels
	params := map[string]string{}
	var absent []string
	for _, role := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
		key := m + "." + role
		s, ok := b.shape(key)
		if !ok {
			absent = append(absent, key)
			continue
		}
		if !sameShape(s, []int{c}) {
			return nil, fmt.Errorf("%s has shape %v, expected [%d] (the channels reaching it)", key, s, c)
		}
		params[role] = key
	}
	if len(params) == 0 {
		return nil, fmt.Errorf("missing %s.%s", m, graph.RoleWeight)
	}
	b.missing = append(b.missing, absent...)
	key := m + "." + graph.RoleNumBatches
	if s, ok := b.shape(key); ok {
		if graph.Numel(s) != 1 || len(s) > 1 {
			return nil, fmt.Errorf("%s has shape %v, expected a scalar", key, s)
		}
		params[graph.RoleNumBatches] = key
	} else {
		b.noBatches++
	}
	b.bns++
	for _, k := range params {
		b.used[k] = true
	}
	return b.add(m, graph.OpBatchNorm, graph.Attr{Features: c, Eps: 1e-5, Momentum: 0.1}, params, c, in), nil
}

// linear adds Linear module m reading the flattened features in.
func (b *builder) linear(m string, in *graph.Value) (*graph.Value, error) {
	key := m + "." + graph.RoleWeight
	s, ok := b.shape(key)
	if !ok {
		return nil, fmt.Errorf("missing %s", key)
	}
	if len(s) != 2 || s[0] <= 0 {
		return nil, fmt.Errorf("%s has shape %v, expected a 2-d Linear weight", key, s)
	}
	if s[1] != in.Channels {
		return nil, fmt.Errorf("%s has shape %v, expected in_features %d (the features reaching it)", key, s, in.Channels)
	}
	params := map[string]string{graph.RoleWeight: key}
	b.used[key] = true
	bias := false
	if bk := m + "." + graph.RoleBias; b.present(bk) {
		bs, _ := b.shape(bk)
		if !sameShape(bs, []int{s[0]}) {
			return nil, fmt.Errorf("%s has shape %v, expected [%d]", bk, bs, s[0])
		}
		params[graph.RoleBias] = bk
		b.used[bk] = true
		bias = true
	}
	attr := graph.Attr{InChannels: s[1], OutChannels: s[0], Bias: bias}
	return b.add(m, graph.OpLinear, attr, params, s[0], in), nil
}

func (b *builder) relu(name string, in *graph.Value) *graph.Value {
	return b.add(name, graph.OpReLU, graph.Attr{}, nil, in.Channels, in)
}

func (b *builder) maxpool(name string, in *graph.Value, k, stride, pad int) *graph.Value {
	attr := graph.Attr{KernelSize: [2]int{k, k}, Stride: [2]int{stride, stride}, Padding: [2]int{pad, pad}}
	return b.add(name, graph.OpMaxPool, attr, nil, in.Channels, in)
}

// head adds the adaptive average pool and the flatten that precede every
// family's classifier. Flatten's channel count is what reaches the Linear.
func (b *builder) head(pool string, in *graph.Value, size int) *graph.Value {
	p := b.add(pool, graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{size, size}}, nil, in.Channels, in)
	return b.add(b.prefix+"flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, in.Channels*size*size, p)
}

// unused lists the keys the graph did not consume, in file order.
func (b *builder) unused(keys []string) []string {
	var out []string
	for _, k := range keys {
		if !b.used[k] {
			out = append(out, k)
		}
	}
	return out
}

// notes describes what the caller should know about how the keys were read.
func (b *builder) notes() []string {
	var n []string
	if b.prefix != "" {
		n = append(n, fmt.Sprintf("key prefix %q kept in node names and parameter keys", b.prefix))
	}
	if b.legacy > 0 {
		n = append(n, fmt.Sprintf("%d dense layers use the legacy key names (norm.1, conv.1, norm.2, conv.2), kept as found", b.legacy))
	}
	if b.noBatches > 0 {
		n = append(n, fmt.Sprintf("%d of %d BatchNorm2d layers have no num_batches_tracked (PyTorch before 0.4.1); loading fills in 0", b.noBatches, b.bns))
	}
	return n
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return "[" + strings.Join(s, " ") + "]"
}
