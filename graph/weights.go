package graph

import (
	"fmt"
	"sort"
)

// Weights is the store a graph's parameter keys index into: a state dict.
// Format readers implement it over a checkpoint without decoding tensor
// bytes until Values is called; rewrite passes read and replace values
// through it, and the writer copies untouched tensors byte for byte.
type Weights interface {
	// Keys lists the state-dict keys in file order.
	Keys() []string
	// Shape reports a tensor's shape; ok is false for an unknown key.
	Shape(key string) (shape []int, ok bool)
	// Values decodes a tensor (any dtype) into float64, in row-major order.
	Values(key string) ([]float64, error)
	// SetValues replaces a tensor's contents; the length must match its
	// shape. The tensor keeps its dtype when written out.
	SetValues(key string, v []float64) error
}

// Float32Valuer is implemented by a Weights that can give a tensor's
// values as float32 without a float64 copy (a float32 tensor decoded
// straight from its bytes). The values must be Values' rounded to float32,
// in a slice of the caller's own (the CPU backend keeps it as the tensor).
// The runtime computes in float32: loading a network through Values
// allocated, filled and converted a float64 copy of every parameter (822 MB
// for vgg16_bn's first classifier weight), for each network verify builds.
type Float32Valuer interface {
	Float32Values(key string) ([]float32, error)
}

// Float32Values gives a tensor's values rounded to float32: through
// w's Float32Values where it has one, else through Values.
func Float32Values(w Weights, key string) ([]float32, error) {
	if f, ok := w.(Float32Valuer); ok {
		return f.Float32Values(key)
	}
	v, err := w.Values(key)
	if err != nil {
		return nil, err
	}
	return Round32(v), nil
}

// Round32 is v rounded to float32, in a new slice: a Float32Valuer's
// answer for tensors it has no faster way to give.
func Round32(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// ChannelNegater is implemented by a Weights that negates dim-0 slices of
// a tensor (a convolution's output channels, the one change a sign fold
// makes to it) without decoding it: for float data that is a flip of sign
// bits, which a format's writer applies while it streams the tensor out, so
// the values are never held. changed is false when every selected element
// is zero (nothing to change); a channel listed twice is negated once.
type ChannelNegater interface {
	NegateChannels(key string, channels []int) (changed bool, err error)
}

// MemWeights is an in-memory Weights, for tests and hand-built graphs.
type MemWeights struct {
	order  []string
	shapes map[string][]int
	vals   map[string][]float64
}

// NewMemWeights returns an empty store.
func NewMemWeights() *MemWeights {
	return &MemWeights{shapes: map[string][]int{}, vals: map[string][]float64{}}
}

// Put adds or replaces a tensor.
func (w *MemWeights) Put(key string, shape []int, v []float64) {
	if _, ok := w.shapes[key]; !ok {
		w.order = append(w.order, key)
	}
	w.shapes[key] = append([]int(nil), shape...)
	w.vals[key] = append([]float64(nil), v...)
}

func (w *MemWeights) Keys() []string { return append([]string(nil), w.order...) }

func (w *MemWeights) Shape(key string) ([]int, bool) {
	s, ok := w.shapes[key]
	return s, ok
}

func (w *MemWeights) Values(key string) ([]float64, error) {
	v, ok := w.vals[key]
	if !ok {
		return nil, fmt.Errorf("no tensor %q", key)
	}
	return append([]float64(nil), v...), nil
}

func (w *MemWeights) SetValues(key string, v []float64) error {
	s, ok := w.shapes[key]
	if !ok {
		return fmt.Errorf("no tensor %q", key)
	}
	if n := Numel(s); n != len(v) {
		return fmt.Errorf("tensor %q has %d elements, got %d values", key, n, len(v))
	}
	w.vals[key] = append([]float64(nil), v...)
	return nil
}

// SortedKeys is a convenience for tests.
func (w *MemWeights) SortedKeys() []string {
	k := w.Keys()
	sort.Strings(k)
	return k
}

// Numel is the element count of a shape (1 for a scalar).
func Numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
