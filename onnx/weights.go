package onnx

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
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
	return v, nil
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
		if w.byKey[k].set != nil {
			out = append(out, k)
		}
	}
	return out
}
