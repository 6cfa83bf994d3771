package rewrite

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sort"
	"unsafe"

	"github.com/abnconvert/abnconvert/graph"
)

// tensors is a cache over the weight store for the small per-channel
// vectors of BN sites, plus a queue of whole-channel negations for producer
// weights, which can be large: those are applied one tensor at a time when
// the pass ends, so that at most one convolution's weights are held in
// memory. It also keeps the report's bookkeeping of what changed. Each pass
// ends with flush, after which the store holds what the cache holds: the
// vectors stay cached for the next pass, rather than being read and
// decoded again by every pass.
type tensors struct {
	w     graph.Weights
	cache map[string]*cached
	// negate marks, per key, the dim-0 indices to negate at flush; flips
	// says, per key and dim-0 index, whether the sign was flipped an odd
	// number of times (those are reported). Both are indexed by channel
	// (grown as needed): a fold touches thousands of channels, which maps
	// of maps made the largest cost of the pass.
	negate map[string]*[]bool
	// flips are pointers, which the cached vectors keep, so that negating
	// a vector's entry costs one lookup rather than two.
	flips   map[string]*[]bool
	changed map[string]bool
	// app is w's AppendValues where it has one: flush then compares a
	// vector with the store's values, decoded again into scratch, rather
	// than with a copy taken when it was read. On densenet201 the copies
	// were 1.9 MB of the 33 MB a conversion allocates, each page of it a
	// fault (11 µs on a VM measured 2026-12-02), against a decode of a
	// vector already in memory.
	app     valueAppender
	scratch []float64
	// cmp is w's CompareValues where it has one: the comparison then
	// reads the store's values as they lie, rather than decoding them
	// into scratch first.
	cmp valueComparer
}

// valueComparer is a Weights that compares a vector with the values it
// holds (pth.Checkpoint).
type valueComparer interface {
	CompareValues(key string, v []float64) (differ, sameBits bool, err error)
}

// valueAppender is a Weights that decodes into a caller's buffer
// (pth.Checkpoint).
type valueAppender interface {
	AppendValues(dst []float64, key string) ([]float64, error)
}

func newTensors(w graph.Weights) *tensors {
	app, _ := w.(valueAppender)
	cmp, _ := w.(valueComparer)
	return &tensors{
		w: w, cache: map[string]*cached{},
		negate: map[string]*[]bool{}, flips: map[string]*[]bool{}, changed: map[string]bool{},
		app: app, cmp: cmp,
	}
}

// toggleAt flips index i (not negative) of *b, growing it as needed, by
// doubling: the channels of a key come in increasing order.
func toggleAt(b *[]bool, i int) {
	if i >= len(*b) {
		nb := make([]bool, max(i+1, 2*len(*b), 64))
		copy(nb, *b)
		*b = nb
	}
	(*b)[i] = !(*b)[i]
}

// flipsOf is key's flips, made on first use.
func (t *tensors) flipsOf(key string) *[]bool {
	p := t.flips[key]
	if p == nil {
		p = new([]bool)
		t.flips[key] = p
	}
	return p
}

// cached is a vector of the cache: cur is what the pass sees and may
// change, orig what the store holds (nil where the store decodes it again
// at flush: tensors.app); touched says that this pass was handed cur, so
// that flush compares only those.
type cached struct {
	cur, orig []float64
	touched   bool
	flips     *[]bool // the vector's flips (flipsOf), nil until negated
}

// vec returns the cached, mutable values of a per-channel vector.
func (t *tensors) vec(key string) ([]float64, error) {
	c, err := t.entry(key)
	if err != nil {
		return nil, err
	}
	return c.cur, nil
}

// entry is vec's cache entry, marked touched.
func (t *tensors) entry(key string) (*cached, error) {
	if c, ok := t.cache[key]; ok {
		c.touched = true
		return c, nil
	}
	v, err := t.w.Values(key)
	if err != nil {
		return nil, fmt.Errorf("reading %q: %w", key, err)
	}
	c := &cached{cur: v, touched: true}
	if t.app == nil {
		c.orig = append([]float64(nil), v...)
	}
	t.cache[key] = c
	return c, nil
}

// cachedFlips is a cached vector's flips.
func (t *tensors) cachedFlips(key string, c *cached) *[]bool {
	if c.flips == nil {
		c.flips = t.flipsOf(key)
	}
	return c.flips
}

// negateVec flips the sign of v[i] for the vector at key now.
func (t *tensors) negateVec(key string, i int) error {
	n, err := t.vecNegation(key)
	if err != nil {
		return err
	}
	return n.negate(i)
}

// negateVecAt is negateVec for each index of idx, with one lookup of the
// vector: flip-signs negates thousands of channels of a DenseNet, each a
// handful of map lookups otherwise.
func (t *tensors) negateVecAt(key string, idx []int) error {
	if len(idx) == 0 {
		return nil
	}
	n, err := t.vecNegation(key)
	if err != nil {
		return err
	}
	for _, i := range idx {
		if err := n.negate(i); err != nil {
			return err
		}
	}
	return nil
}

// sliceNegation queues negations of slices along dim 0 of one key, looked
// up once: fold-signs negates thousands of channels of the same producers.
type sliceNegation struct {
	key           string
	queued, flips *[]bool
}

// sliceNegation is key's queue of slice negations, applied at flush.
func (t *tensors) sliceNegation(key string) *sliceNegation {
	q := t.negate[key]
	if q == nil {
		q = new([]bool)
		t.negate[key] = q
	}
	return &sliceNegation{key: key, queued: q, flips: t.flipsOf(key)}
}

// toggle queues the negation of slice i, or takes it back.
func (n *sliceNegation) toggle(i int) error {
	if i < 0 {
		return fmt.Errorf("%q has no slice %d", n.key, i)
	}
	// Queued twice means flipped twice: no change at all.
	toggleAt(n.queued, i)
	toggleAt(n.flips, i)
	return nil
}

// vecNegation negates entries of one cached vector, looked up once.
type vecNegation struct {
	t   *tensors
	key string
	c   *cached
}

// vecNegation reads the vector at key into the cache (marking it touched).
func (t *tensors) vecNegation(key string) (*vecNegation, error) {
	c, err := t.entry(key)
	if err != nil {
		return nil, err
	}
	return &vecNegation{t: t, key: key, c: c}, nil
}

// negate flips the sign of entry i now.
func (n *vecNegation) negate(i int) error {
	v := n.c.cur
	if i < 0 || i >= len(v) {
		return fmt.Errorf("%q has %d entries, no index %d", n.key, len(v), i)
	}
	v[i] = -v[i]
	toggleAt(n.t.cachedFlips(n.key, n.c), i)
	return nil
}

// flush writes every changed vector and applies the queued negations. What
// stays cached is what the store holds.
func (t *tensors) flush() error {
	return t.flushThen(nil)
}

// flushThen is flush, calling settled (when not nil) once the queued
// negations are in the store and before the vectors are compared and
// written: a writer waiting for the negations (Options.SignsSettled) then
// starts without waiting for the comparison, which decodes every vector the
// pass was handed again (3-14 ms of a trained resnext101_32x8d's 30-40 ms
// before its copy starts). The order changes nothing stored: a negated
// producer's parameters are not BN vectors (fold-signs refuses parameters
// that two nodes share), and where a key is both, the vectors go first as
// in flush.
func (t *tensors) flushThen(settled func() error) error {
	if settled != nil && !t.negatesCachedKey() {
		if err := t.flushNegations(); err != nil {
			return err
		}
		if err := settled(); err != nil {
			return err
		}
		return t.flushVectors()
	}
	if err := t.flushVectors(); err != nil {
		return err
	}
	if err := t.flushNegations(); err != nil {
		return err
	}
	if settled != nil {
		return settled()
	}
	return nil
}

// negatesCachedKey reports whether a queued negation is of a cached vector.
func (t *tensors) negatesCachedKey() bool {
	for k := range t.negate {
		if _, ok := t.cache[k]; ok {
			return true
		}
	}
	return false
}

// flushVectors writes every changed vector the pass was handed.
func (t *tensors) flushVectors() error {
	var keys []string
	for k, c := range t.cache {
		if c.touched {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		c := t.cache[k]
		c.touched = false
		var differs, same bool
		switch {
		case t.cmp != nil:
			var err error
			if differs, same, err = t.cmp.CompareValues(k, c.cur); err != nil {
				return fmt.Errorf("reading %q: %w", k, err)
			}
		case t.app != nil:
			var err error
			if t.scratch, err = t.app.AppendValues(t.scratch[:0], k); err != nil {
				return fmt.Errorf("reading %q: %w", k, err)
			}
			differs, same = differ(c.cur, t.scratch), sameBits(c.cur, t.scratch)
		default:
			differs, same = differ(c.cur, c.orig), sameBits(c.cur, c.orig)
		}
		if !differs {
			if !same {
				// A -0 (a negated zero) the store does not hold: read
				// the vector again rather than keep it.
				delete(t.cache, k)
			}
			continue
		}
		if err := t.w.SetValues(k, c.cur); err != nil {
			return fmt.Errorf("writing %q: %w", k, err)
		}
		if t.app == nil {
			c.orig = append(c.orig[:0], c.cur...)
		}
		t.changed[k] = true
	}
	return nil
}

// flushNegations applies the queued negations.
func (t *tensors) flushNegations() error {
	var keys []string
	for k := range t.negate {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if err := t.applyNegation(k, *t.negate[k]); err != nil {
			return err
		}
		delete(t.cache, k) // (a producer's weights are not cached: no-op)
	}
	t.negate = map[string]*[]bool{}
	return nil
}

// sameBits reports whether a and b hold the same float64 bits.
func sameBits(a, b []float64) bool {
	for i := range a {
		if math.Float64bits(a[i]) != math.Float64bits(b[i]) {
			return false
		}
	}
	return true
}

func (t *tensors) applyNegation(key string, idx []bool) error {
	if n, ok := t.w.(graph.ChannelNegater); ok {
		changed, err := n.NegateChannels(key, appendTrue(nil, idx))
		if err != nil {
			return fmt.Errorf("negating channels of %q: %w", key, err)
		}
		if changed {
			t.changed[key] = true
		}
		return nil
	}
	shape, ok := t.w.Shape(key)
	if !ok || len(shape) == 0 {
		return fmt.Errorf("negating channels of %q: no such tensor, or a scalar", key)
	}
	v, err := t.w.Values(key)
	if err != nil {
		return fmt.Errorf("reading %q: %w", key, err)
	}
	if shape[0] == 0 || len(v)%shape[0] != 0 {
		return fmt.Errorf("negating channels of %q: %d values for shape %v", key, len(v), shape)
	}
	stride := len(v) / shape[0]
	changed := false
	for i, on := range idx {
		if !on {
			continue
		}
		if i >= shape[0] {
			return fmt.Errorf("negating channel %d of %q, which has %d", i, key, shape[0])
		}
		for j := i * stride; j < (i+1)*stride; j++ {
			if v[j] != 0 {
				changed = true
			}
			v[j] = -v[j]
		}
	}
	if !changed {
		return nil
	}
	if err := t.w.SetValues(key, v); err != nil {
		return fmt.Errorf("writing %q: %w", key, err)
	}
	t.changed[key] = true
	return nil
}

// differ compares numerically: negating a zero gives -0, which is no change.
func differ(a, b []float64) bool {
	for i := range a {
		if a[i] != b[i] && !(a[i] != a[i] && b[i] != b[i]) {
			return true
		}
	}
	return false
}

// appendTrue appends to dst the indices of b's true entries, in order.
// It reads b eight entries at a time (a bool is one byte, 0 or 1) and
// skips the words with none: the report's flips of densenet201 trained
// are 326,000 entries over 506 vectors, most of them false, where a
// branch on each entry cost 0.5 ms of the rewrite's 7.
func appendTrue(dst []int, b []bool) []int {
	i := 0
	if len(b) >= 8 {
		raw := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(b))), len(b))
		for ; i+8 <= len(b); i += 8 {
			for w := binary.LittleEndian.Uint64(raw[i:]); w != 0; w &= w - 1 {
				dst = append(dst, i+bits.TrailingZeros64(w)/8)
			}
		}
	}
	for ; i < len(b); i++ {
		if b[i] {
			dst = append(dst, i)
		}
	}
	return dst
}

// flipReport returns the odd-count flips per key, sorted.
func (t *tensors) flipReport() map[string][]int {
	out := make(map[string][]int, len(t.flips))
	var scratch []int // gathered once, then copied at its size
	for k, odd := range t.flips {
		scratch = appendTrue(scratch[:0], *odd)
		if len(scratch) > 0 {
			out[k] = slices.Clone(scratch)
		}
	}
	return out
}

func (t *tensors) changedKeys() []string {
	out := make([]string, 0, len(t.changed))
	for k := range t.changed {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
