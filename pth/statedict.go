package pth

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/negate"
)

var (
	_ graph.Weights       = (*Checkpoint)(nil)
	_ graph.Float32Valuer = (*Checkpoint)(nil)
)

// preferredState lists the keys under which training scripts commonly nest
// the state dict, tried first at each level of the search.
var preferredState = []string{"state_dict", "model_state_dict", "model", "model_state", "net", "network", "module", "weights", "params", "ema", "state"}

// findState locates the state dict: Root itself, or the first dict, in
// breadth-first order with preferred keys first, whose values are mostly
// tensors under dotted keys. Optimizer state dicts are skipped.
func (c *Checkpoint) findState() {
	type item struct {
		d    *Dict
		path []string
	}
	root, ok := c.Root.(*Dict)
	if !ok {
		return
	}
	queue := []item{{root, []string{}}}
	// Each dict is visited once: a pickle can share one dict under many
	// keys at every level, and without this the queue grows exponentially.
	seen := map[*Dict]bool{root: true}
	for depth := 0; depth < 5 && len(queue) > 0; depth++ {
		var next []item
		for _, it := range queue {
			if isOptimizer(it.d) {
				continue
			}
			if isStateDict(it.d) {
				c.setState(it.d, it.path)
				return
			}
			for _, k := range childOrder(it.d) {
				v, _ := it.d.Get(k)
				if d, ok := v.(*Dict); ok && !seen[d] {
					seen[d] = true
					next = append(next, item{d, append(append([]string{}, it.path...), k)})
				}
			}
		}
		queue = next
	}
}

// childOrder lists a dict's string keys, the preferred names first.
func childOrder(d *Dict) []string {
	var first, rest []string
	for _, p := range preferredState {
		if _, ok := d.Get(p); ok {
			first = append(first, p)
		}
	}
	for _, k := range d.keys {
		s, ok := k.(string)
		if !ok {
			continue
		}
		pref := false
		for _, p := range preferredState {
			pref = pref || p == s
		}
		if !pref {
			rest = append(rest, s)
		}
	}
	return append(first, rest...)
}

func isOptimizer(d *Dict) bool {
	_, s := d.Get("state")
	_, p := d.Get("param_groups")
	return s && p
}

// isStateDict: string keys only, at least half of the values tensors, and
// either dotted keys or nothing but tensors (a bare module such as a single
// Linear has undotted keys).
func isStateDict(d *Dict) bool {
	tensors, dotted := 0, false
	for i, k := range d.keys {
		s, ok := k.(string)
		if !ok {
			return false
		}
		if _, ok := d.vals[i].(*Tensor); ok {
			tensors++
			dotted = dotted || strings.Contains(s, ".")
		}
	}
	return tensors > 0 && 2*tensors >= d.Len() && (dotted || tensors == d.Len())
}

func (c *Checkpoint) setState(d *Dict, path []string) {
	separate(d)
	c.state, c.StatePath = d, path
	c.keys, c.Carried = nil, nil
	for i, k := range d.keys {
		if _, ok := d.vals[i].(*Tensor); ok {
			c.keys = append(c.keys, k.(string))
		}
	}
	if k := averagedCount(d, c.keys); k != "" {
		c.Carried = []string{k}
		c.keys = without(c.keys, k)
	}
	c.Prefix = CommonPrefix(c.keys)
}

// averagedCount finds the averaging count of a
// torch.optim.swa_utils.AveragedModel state dict (an EMA or SWA model):
// the 0-dim integer tensor "n_averaged" beside the averaged network, whose
// keys all sit under "module.". It is no weight of the network, so it is
// left out of Keys (the structure is recognised from the others) and
// written back unchanged. "" when d is not laid out so.
func averagedCount(d *Dict, keys []string) string {
	const count = "n_averaged"
	v, ok := d.Get(count)
	t, isTensor := v.(*Tensor)
	if !ok || !isTensor || len(t.Shape) != 0 || !isIntegerDType(t.DType()) || len(keys) < 2 {
		return ""
	}
	for _, k := range keys {
		if k != count && !strings.HasPrefix(k, "module.") {
			return ""
		}
	}
	return count
}

func without(keys []string, drop string) []string {
	var out []string
	for _, k := range keys {
		if k != drop {
			out = append(out, k)
		}
	}
	return out
}

// CommonPrefix is the longest run of whole dotted components that every key
// starts with and that leaves each key at least one component of its own
// ("module." of a DataParallel state dict), "" when none.
func CommonPrefix(keys []string) string {
	if len(keys) < 2 {
		return ""
	}
	prefix := keys[0]
	for _, k := range keys[1:] {
		for !strings.HasPrefix(k, prefix) {
			prefix = prefix[:len(prefix)-1]
		}
	}
	i := strings.LastIndexByte(prefix, '.')
	if i < 0 {
		return ""
	}
	prefix = prefix[:i+1]
	for _, k := range keys {
		if k == prefix[:len(prefix)-1] {
			return ""
		}
	}
	return prefix
}

// StateDict returns the state dict, nil when the checkpoint has none.
func (c *Checkpoint) StateDict() *Dict { return c.state }

// Tensor returns the state-dict tensor under key.
func (c *Checkpoint) Tensor(key string) (*Tensor, bool) {
	if c.state == nil {
		return nil, false
	}
	v, _ := c.state.getString(key)
	t, ok := v.(*Tensor)
	return t, ok
}

// Keys lists the state-dict keys that hold tensors, in file order.
func (c *Checkpoint) Keys() []string { return append([]string(nil), c.keys...) }

// Shape reports a state-dict tensor's shape.
func (c *Checkpoint) Shape(key string) ([]int, bool) {
	t, ok := c.Tensor(key)
	if !ok {
		return nil, false
	}
	return append([]int{}, t.Shape...), true
}

// DType reports a state-dict tensor's element type ("float32"), "" for an
// unknown key.
func (c *Checkpoint) DType(key string) string {
	t, ok := c.Tensor(key)
	if !ok {
		return ""
	}
	return string(t.DType())
}

// Values decodes a state-dict tensor into float64, row-major, honouring its
// offset and strides; after SetValues it returns the new values.
func (c *Checkpoint) Values(key string) ([]float64, error) {
	t, ok := c.Tensor(key)
	if !ok {
		return nil, fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	v, err := c.TensorValues(t)
	if err != nil {
		return nil, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	return v, nil
}

// Float32Values is Values rounded to float32 (graph.Float32Valuer): a
// contiguous float32 tensor read as it is stored, without the float64
// copy; any other (another dtype, strided, negated, or set by SetValues)
// through Values.
func (c *Checkpoint) Float32Values(key string) ([]float32, error) {
	t, ok := c.Tensor(key)
	if !ok {
		return nil, fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	n := t.Numel()
	lo, hi := t.span()
	if t.pending != nil || t.negate != nil || t.DType() != Float32 || !t.Contiguous() || n > maxDecode || n == 0 || hi == lo {
		v, err := c.Values(key)
		if err != nil {
			return nil, err
		}
		return graph.Round32(v), nil
	}
	raw, err := c.readRange(t.Storage, int64(lo)*4, int64(hi-lo)*4)
	if err != nil {
		return nil, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	if len(raw) < 4*n {
		return nil, fmt.Errorf("%s: tensor %q: %d bytes for %d float32 values", c.Path, key, len(raw), n)
	}
	out := make([]float32, n)
	le := binary.LittleEndian
	for i := range out {
		out[i] = math.Float32frombits(le.Uint32(raw[4*i:]))
	}
	return out, nil
}

// SetValues replaces a state-dict tensor's values; Write re-encodes them in
// the tensor's own dtype.
func (c *Checkpoint) SetValues(key string, v []float64) error {
	t, ok := c.Tensor(key)
	if !ok {
		return fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	if err := c.SetTensorValues(t, v); err != nil {
		return fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	return nil
}

// maxDecode bounds the elements TensorValues allocates (16 GiB of float64);
// maxExpand bounds those of a tensor that views fewer storage elements than
// it has (overlapping strides), 128 MiB of float64.
const (
	maxDecode = 1 << 31
	maxExpand = 1 << 24
)

// AppendValues is Values appending to dst, so that a reader that only
// looks at the values (validation, over every BN vector) can reuse one
// buffer instead of allocating a slice per tensor.
func (c *Checkpoint) AppendValues(dst []float64, key string) ([]float64, error) {
	t, ok := c.Tensor(key)
	if !ok {
		return dst, fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	v, err := c.appendTensorValues(dst, t)
	if err != nil {
		return dst, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	return v, nil
}

// CompareValues reports whether v differs from the values of key's tensor
// (as Values gives them; a NaN equals a NaN) and whether it holds the
// same bits, without decoding them into memory where the tensor's bytes
// are a contiguous float32 run, or it holds values set since it was read.
// Package rewrite's cache compares every vector it handed out with the
// store after each pass: on densenet201 trained about 500 vectors of
// 115,000 values each kind, decoded, copied and compared in 1.5-2 ms of
// the rewrite's 7.
func (c *Checkpoint) CompareValues(key string, v []float64) (differ, sameBits bool, err error) {
	t, ok := c.Tensor(key)
	if !ok {
		return false, false, fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	sameBits = true
	switch {
	case t.pending != nil:
		if len(t.pending) != len(v) {
			return true, false, nil
		}
		for i, x := range t.pending {
			if d, same := compareFloat(x, v[i]); d {
				return true, false, nil
			} else if !same {
				sameBits = false
			}
		}
		return false, sameBits, nil
	case t.DType() == Float32 && t.Contiguous() && t.negate == nil && t.Numel() == len(v):
		lo, hi := t.span()
		raw, err := c.readRange(t.Storage, int64(lo)*4, int64(hi-lo)*4)
		if err != nil {
			return false, false, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
		}
		le := binary.LittleEndian
		for i := range v {
			if d, same := compareFloat(float64(math.Float32frombits(le.Uint32(raw[4*i:]))), v[i]); d {
				return true, false, nil
			} else if !same {
				sameBits = false
			}
		}
		return false, sameBits, nil
	}
	vals, err := c.appendTensorValues(nil, t)
	if err != nil {
		return false, false, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	if len(vals) != len(v) {
		return true, false, nil
	}
	for i, x := range vals {
		if d, same := compareFloat(x, v[i]); d {
			return true, false, nil
		} else if !same {
			sameBits = false
		}
	}
	return false, sameBits, nil
}

// compareFloat reports whether x and y differ as values (two NaNs do not)
// and whether they are the same bits.
func compareFloat(x, y float64) (differ, sameBits bool) {
	return x != y && !(x != x && y != y), math.Float64bits(x) == math.Float64bits(y)
}

// FirstInvalid returns the index of the first element of key's tensor
// that is not finite, or, where nonNegative, that is below zero, and
// true; false where every element passes. A float32 tensor's bytes are
// tested as they lie, without decoding them (validation tests every BN
// vector before the rewrite: 520,000 values on densenet201, whose
// decoding was 0.6 ms of validation's 1.0); any other is decoded.
func (c *Checkpoint) FirstInvalid(key string, nonNegative bool) (int, bool, error) {
	t, ok := c.Tensor(key)
	if !ok {
		return 0, false, fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	lo, hi := t.span()
	if t.pending != nil || t.negate != nil || t.DType() != Float32 || !t.Contiguous() || hi-lo != t.Numel() {
		v, err := c.AppendValues(nil, key)
		if err != nil {
			return 0, false, err
		}
		for i, x := range v {
			if x-x != 0 || nonNegative && x < 0 {
				return i, true, nil
			}
		}
		return 0, false, nil
	}
	raw, err := c.readRange(t.Storage, int64(lo)*4, int64(hi-lo)*4)
	if err != nil {
		return 0, false, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	for i := 0; i+4 <= len(raw); i += 4 {
		b := binary.LittleEndian.Uint32(raw[i:])
		// Exponent all ones: an infinity or a NaN. Sign set on
		// anything but -0: below zero.
		if b&0x7f800000 == 0x7f800000 || nonNegative && b > 0x80000000 {
			return i / 4, true, nil
		}
	}
	return 0, false, nil
}

// TensorValues decodes any tensor of the checkpoint (optimizer buffers
// included) into float64, row-major.
func (c *Checkpoint) TensorValues(t *Tensor) ([]float64, error) {
	return c.appendTensorValues(nil, t)
}

// appendTensorValues is TensorValues appending to dst; on error it returns
// dst unchanged.
func (c *Checkpoint) appendTensorValues(dst []float64, t *Tensor) ([]float64, error) {
	if t.pending != nil {
		return append(dst, t.pending...), nil
	}
	es := t.DType().Size()
	if es == 0 || t.DType() == Complex64 || t.DType() == Complex128 {
		return dst, fmt.Errorf("dtype %s cannot be decoded to real numbers", t.DType())
	}
	n := t.Numel()
	if n > maxDecode || (n > t.Storage.Numel && n > maxExpand) {
		// A stride-0 (expanded) tensor can claim any size over a tiny
		// storage; refuse rather than allocate for elements the file does
		// not hold.
		return dst, fmt.Errorf("tensor of %d elements over a storage of %d is more than this package decodes", n, t.Storage.Numel)
	}
	lo, hi := t.span()
	if n == 0 || hi == lo {
		if dst == nil {
			return make([]float64, n), nil // never nil, as before
		}
		return append(dst, make([]float64, n)...), nil
	}
	// Read first: the bytes prove the elements exist before the float64
	// copy is allocated.
	raw, err := c.readRange(t.Storage, int64(lo)*int64(es), int64(hi-lo)*int64(es))
	if err != nil {
		return dst, err
	}
	all := slices.Grow(dst, n)[:len(dst)+n]
	out := all[len(dst):]
	if t.Contiguous() {
		if err := decode(t.DType(), raw, out); err != nil {
			return dst, err
		}
		if t.negate != nil {
			negate.Values(out, t.Shape[0], t.negate)
		}
		return all, nil
	}
	// Walk the multi-index in row-major order, gathering through strides.
	idx := make([]int, len(t.Shape))
	for i := 0; i < n; i++ {
		at := 0
		for d, j := range idx {
			at += j * t.Stride[d]
		}
		if err := decode(t.DType(), raw[at*es:(at+1)*es], out[i:i+1]); err != nil {
			return dst, err
		}
		for d := len(idx) - 1; d >= 0; d-- {
			idx[d]++
			if idx[d] < t.Shape[d] {
				break
			}
			idx[d] = 0
		}
	}
	return all, nil
}

// SetTensorValues replaces any tensor's values (see SetValues). It checks
// that the values fit the dtype now, so that Write cannot fail on them.
func (c *Checkpoint) SetTensorValues(t *Tensor, v []float64) error {
	if n := t.Numel(); n != len(v) {
		return fmt.Errorf("shape %v has %d elements, got %d values", t.Shape, n, len(v))
	}
	// Any real number encodes as a float (rounded, or to an infinity), so
	// only the other dtypes are encoded here, to refuse what they cannot
	// hold now rather than when writing.
	if !isFloat(t.DType()) {
		if _, err := encode(t.DType(), v); err != nil {
			return err
		}
	}
	// The pending buffer is reused: each pass of a rewrite sets the
	// vectors it changed again, and nothing else holds it (readers get
	// copies).
	t.pending = append(t.pending[:0:len(t.pending)], v...)
	if t.pending == nil {
		t.pending = []float64{}
	}
	t.negate = nil
	return nil
}

func isIntegerDType(d DType) bool {
	switch d {
	case Int64, Int32, Int16, Int8, Uint8:
		return true
	}
	return false
}
