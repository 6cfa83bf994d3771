package onnx

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/negate"
)

// Weights is a graph.Weights over a model's parameters.
//
// A key is a value name as the model's nodes read it, not necessarily the
// initializer that holds the data: torch's exporter deduplicates equal
// tensors, so in a freshly initialised network "bn1.running_var" is an
// Identity of the initializer "bn1.weight" (both all ones). Each key is its
// own copy-on-write view of the tensor it resolves to, so that a rewrite
// changing bn1.weight (InPlace-ABN stores |gamma| - eps) does not change
// bn1.running_var with it; Write un-shares what changed (see Write), and
// Model.Initializer / Model.Shared say what resolves to what.
//
// The keys are: every initializer (file order), then every Constant output
// and every Identity output of a parameter (node order). Two BN-family
// nodes never share a key: where they read the very same value, the second
// gets the key "<value>@<node>.<role>", so that a per-node rewrite (which
// would otherwise apply |gamma| - eps twice to one tensor) stays per node.
// Conv and Linear nodes reading one value share its key, which tells the
// rewrite passes that the weights are tied.
type Weights struct {
	order []string
	byKey map[string]*param
}

// param is one key.
type param struct {
	key   string
	value string // the ONNX value name its readers read
	src   *paramSrc
	// owners are the IR parameter slots that use the key.
	owners []slot
	set    []float64 // replaced contents; nil while unchanged
	// negate lists dim-0 slices whose sign bits the writer flips in the
	// tensor's raw bytes (NegateChannels); non-nil marks the key changed.
	negate []int
	// exclusive: the key belongs to a BN-family node and is shared with no
	// other slot. split: the key is "<value>@<node>.<role>", a second
	// BN-family reader of a value that already has a key.
	exclusive, split bool
}

// slot is one parameter input of one ONNX node.
type slot struct {
	info  *nodeInfo
	input int
	role  string
}

var _ graph.Weights = (*Weights)(nil)

func newWeights() *Weights { return &Weights{byKey: map[string]*param{}} }

func (w *Weights) add(p *param) {
	w.order = append(w.order, p.key)
	w.byKey[p.key] = p
}

// Keys lists the keys in file order.
func (w *Weights) Keys() []string { return append([]string(nil), w.order...) }

// Shape reports a key's shape.
func (w *Weights) Shape(key string) ([]int, bool) {
	p, ok := w.byKey[key]
	if !ok {
		return nil, false
	}
	return append([]int{}, p.src.td.shape...), true
}

// Values decodes a key's tensor into float64 (float, float16, bfloat16,
// double and the integer types; external data is read from its file).
func (w *Weights) Values(key string) ([]float64, error) {
	p, ok := w.byKey[key]
	if !ok {
		return nil, fmt.Errorf("no tensor %q", key)
	}
	if p.set != nil {
		return append([]float64(nil), p.set...), nil
	}
	v, err := p.src.td.values()
	if err != nil {
		return nil, fmt.Errorf("tensor %q (initializer %q): %w", key, p.src.root, err)
	}
	if p.negate != nil {
		negate.Values(v, p.src.td.shape[0], p.negate)
	}
	return v, nil
}

func (p *param) changed() bool { return p.set != nil || p.negate != nil }

// rawLayout is the sign-bit layout of a key's tensor when its elements are
// raw little-endian floats (raw_data or external data).
func (p *param) rawLayout() (negate.Layout, bool) {
	td := p.src.td
	if td.ext == nil && td.t.RawData == nil {
		return negate.Layout{}, false
	}
	dt := td.t.GetDataType()
	float := dt == dtFloat || dt == dtDouble || dt == dtFloat16 || dt == dtBfloat16
	return negate.FloatLayout(float, elemSize(dt), td.shape)
}

// NegateChannels negates slices of dim 0 of a key's tensor
// (graph.ChannelNegater): for raw float data by flipping sign bits in a copy
// of the bytes when the model is written, nothing decoded; otherwise
// through Values and SetValues. It reports false, changing nothing, when
// the channels are all zero.
func (w *Weights) NegateChannels(key string, channels []int) (bool, error) {
	p, ok := w.byKey[key]
	if !ok {
		return false, fmt.Errorf("no tensor %q", key)
	}
	shape := p.src.td.shape
	if len(shape) == 0 {
		return false, fmt.Errorf("tensor %q: a scalar has no channels to negate", key)
	}
	chans, bad, ok := negate.Set(channels, shape[0])
	if !ok {
		return false, fmt.Errorf("tensor %q: channel %d out of range [0, %d)", key, bad, shape[0])
	}
	if len(chans) == 0 {
		return false, nil
	}
	l, lazy := p.rawLayout()
	if !lazy || p.set != nil {
		v, err := w.Values(key)
		if err != nil {
			return false, err
		}
		inner := len(v) / shape[0]
		nz := false
		for _, ch := range chans {
			for i := ch * inner; i < (ch+1)*inner && !nz; i++ {
				nz = v[i] != 0
			}
		}
		if !nz {
			return false, nil
		}
		negate.Values(v, shape[0], chans)
		return true, w.SetValues(key, v)
	}
	raw, err := p.src.td.rawBytes()
	if err != nil {
		return false, fmt.Errorf("tensor %q (initializer %q): %w", key, p.src.root, err)
	}
	nz := false
	for _, ch := range chans {
		if end := int64(ch+1) * l.ChannelBytes; end <= int64(len(raw)) && l.AnyNonzero(raw[int64(ch)*l.ChannelBytes:end]) {
			nz = true
			break
		}
	}
	if !nz {
		return false, nil
	}
	p.negate = negate.Xor(p.negate, chans)
	return true, nil
}

// negatedRaw is a key's raw bytes with its pending sign flips applied, in
// a copy.
func (p *param) negatedRaw() ([]byte, error) {
	raw, err := p.src.td.rawBytes()
	if err != nil {
		return nil, err
	}
	out := append([]byte(nil), raw...)
	l, _ := p.rawLayout()
	l.Apply(p.negate, 0, out)
	return out, nil
}

// SetValues replaces a key's contents; the tensor keeps its data type when
// written. Other keys that resolve to the same initializer are unaffected.
func (w *Weights) SetValues(key string, v []float64) error {
	p, ok := w.byKey[key]
	if !ok {
		return fmt.Errorf("no tensor %q", key)
	}
	if elemSize(p.src.td.t.GetDataType()) == 0 {
		return fmt.Errorf("tensor %q: %w: cannot encode %s", key, ErrUnsupported, dtypeName(p.src.td.t.GetDataType()))
	}
	if len(v) != p.src.td.numel {
		return fmt.Errorf("tensor %q has %d elements, got %d values", key, p.src.td.numel, len(v))
	}
	p.set = append([]float64(nil), v...)
	p.negate = nil
	return nil
}

// DataType names a key's ONNX data type ("FLOAT", "FLOAT16", ...).
func (w *Weights) DataType(key string) (string, bool) {
	p, ok := w.byKey[key]
	if !ok {
		return "", false
	}
	return dtypeName(p.src.td.t.GetDataType()), true
}

// Changed lists the keys whose contents SetValues replaced, in key order.
func (w *Weights) Changed() []string {
	var out []string
	for _, k := range w.order {
		if w.byKey[k].changed() {
			out = append(out, k)
		}
	}
	return out
}
