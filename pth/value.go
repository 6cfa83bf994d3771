package pth

import (
	"fmt"
	"io"
	"math"
	"math/big"
	"strconv"
	"strings"
)

// Value is one node of a checkpoint's object tree. It holds one of:
// nil (Python None), bool, int64, *big.Int (integers beyond int64), float64,
// string, Bytes, *List, *Tuple, *Dict, *Tensor, *Global (a bare allowlisted
// global such as torch.float32) or *Call (an allowlisted callable applied to
// arguments, kept as it is, such as torch.Size((3, 4))).
type Value = any

// Bytes is a Python bytes object.
type Bytes []byte

// List is a Python list.
type List struct{ Items []Value }

// Tuple is a Python tuple.
type Tuple struct{ Items []Value }

// Global names a module-level Python object referenced by the pickle.
type Global struct{ Module, Name string }

func (g *Global) String() string { return g.Module + "." + g.Name }

// Call is an allowlisted callable applied to arguments (pickle REDUCE) that
// this package does not interpret; it is written back unchanged.
type Call struct {
	Func *Global
	Args *Tuple
}

// Dict is a Python dict or collections.OrderedDict. It keeps insertion
// order, as both do, and accepts any hashable key (optimizer states are
// keyed by int).
type Dict struct {
	// Ordered marks a collections.OrderedDict.
	Ordered bool
	// State holds the attributes set through BUILD on an OrderedDict: a
	// state dict's "_metadata". Nil when none.
	State *Dict

	keys []Value
	vals []Value
	// strs indexes the string keys, index the others: a state dict is
	// looked up by string thousands of times per conversion, and a string
	// map hashes only the string.
	strs  map[string]int
	index map[hashKey]int
}

// NewDict returns an empty dict.
func NewDict(ordered bool) *Dict { return &Dict{Ordered: ordered} }

// newDictSized is NewDict with room for n entries: the pickle says how
// many a dict it decodes holds, and a state dict's thousand keys grew
// its index a dozen times otherwise.
func newDictSized(ordered bool, n int) *Dict {
	return &Dict{Ordered: ordered, keys: make([]Value, 0, n), vals: make([]Value, 0, n)}
}

// Len is the number of entries.
func (d *Dict) Len() int { return len(d.keys) }

// Keys lists the keys in insertion order.
func (d *Dict) Keys() []Value { return append([]Value(nil), d.keys...) }

// Entry returns the i-th key and value in insertion order.
func (d *Dict) Entry(i int) (Value, Value) { return d.keys[i], d.vals[i] }

// Get looks a key up.
func (d *Dict) Get(k Value) (Value, bool) {
	if s, ok := k.(string); ok {
		return d.getString(s)
	}
	h, err := hashOf(k)
	if err != nil {
		return nil, false
	}
	i, ok := d.index[h]
	if !ok {
		return nil, false
	}
	return d.vals[i], true
}

// getString is Get of a string key, without boxing it.
func (d *Dict) getString(s string) (Value, bool) {
	i, ok := d.strs[s]
	if !ok {
		return nil, false
	}
	return d.vals[i], true
}

// find returns where key k is, or that it is absent; it fails for an
// unhashable key.
func (d *Dict) find(k Value) (int, bool, error) {
	if s, ok := k.(string); ok {
		i, ok := d.strs[s]
		return i, ok, nil
	}
	h, err := hashOf(k)
	if err != nil {
		return 0, false, err
	}
	i, ok := d.index[h]
	return i, ok, nil
}

// place records that key k (hashable) is at position i.
func (d *Dict) place(k Value, i int) {
	if s, ok := k.(string); ok {
		if d.strs == nil {
			d.strs = make(map[string]int, cap(d.keys))
		}
		d.strs[s] = i
		return
	}
	h, _ := hashOf(k)
	if d.index == nil {
		d.index = map[hashKey]int{}
	}
	d.index[h] = i
}

// add adds an entry whose key is new, and reports a key already present
// (leaving the dict as it was) or unhashable.
func (d *Dict) add(k, v Value) (dup bool, err error) {
	_, dup, err = d.find(k)
	if err != nil || dup {
		return dup, err
	}
	d.place(k, len(d.keys))
	d.keys = append(d.keys, k)
	d.vals = append(d.vals, v)
	return false, nil
}

// Set adds or replaces an entry; a replaced entry keeps its position, as in
// Python. It fails for an unhashable key.
func (d *Dict) Set(k, v Value) error {
	i, ok, err := d.find(k)
	if err != nil {
		return err
	}
	if ok {
		d.vals[i] = v
		return nil
	}
	d.place(k, len(d.keys))
	d.keys = append(d.keys, k)
	d.vals = append(d.vals, v)
	return nil
}

// Delete removes a key and reports whether it was present.
func (d *Dict) Delete(k Value) bool {
	i, ok, err := d.find(k)
	if err != nil || !ok {
		return false
	}
	d.keys = append(d.keys[:i], d.keys[i+1:]...)
	d.vals = append(d.vals[:i], d.vals[i+1:]...)
	if s, ok := k.(string); ok {
		delete(d.strs, s)
	} else {
		h, _ := hashOf(k)
		delete(d.index, h)
	}
	for j := i; j < len(d.keys); j++ {
		d.place(d.keys[j], j)
	}
	return true
}

// hashKey is a comparable stand-in for a Python key. Like Python, it makes
// True equal 1 and 2.0 equal 2.
type hashKey struct {
	kind byte
	s    string
	i    int64
	f    float64
}

func hashOf(k Value) (hashKey, error) {
	switch k := k.(type) {
	case nil:
		return hashKey{kind: 'n'}, nil
	case bool:
		if k {
			return hashKey{kind: 'i', i: 1}, nil
		}
		return hashKey{kind: 'i'}, nil
	case int64:
		return hashKey{kind: 'i', i: k}, nil
	case *big.Int:
		if k.IsInt64() {
			return hashKey{kind: 'i', i: k.Int64()}, nil
		}
		return hashKey{kind: 'b', s: k.String()}, nil
	case float64:
		if k == math.Trunc(k) && math.Abs(k) < 1<<62 {
			return hashKey{kind: 'i', i: int64(k)}, nil
		}
		return hashKey{kind: 'f', f: k}, nil
	case string:
		return hashKey{kind: 's', s: k}, nil
	case Bytes:
		return hashKey{kind: 'y', s: string(k)}, nil
	case *Global:
		return hashKey{kind: 'g', s: k.String()}, nil
	case *Tuple:
		budget := maxKeyItems
		return hashTuple(k, &budget)
	}
	return hashKey{}, fmt.Errorf("unhashable dict key of type %s", typeName(k))
}

// maxKeyItems bounds the items of a tuple key, nested tuples included: a
// pickle can share one tuple many times inside another, and hashing such a
// key would otherwise take time exponential in its nesting.
const maxKeyItems = 1 << 12

// hashTuple encodes a tuple key with length-prefixed fields, so that the
// encoding grows linearly with nesting (quoting would double it per level).
func hashTuple(k *Tuple, budget *int) (hashKey, error) {
	var b strings.Builder
	for _, it := range k.Items {
		if *budget--; *budget < 0 {
			return hashKey{}, fmt.Errorf("dict key tuple has more than %d items", maxKeyItems)
		}
		var h hashKey
		var err error
		if t, ok := it.(*Tuple); ok {
			h, err = hashTuple(t, budget)
		} else {
			h, err = hashOf(it)
		}
		if err != nil {
			return hashKey{}, err
		}
		fmt.Fprintf(&b, "%c%d:%s/%d/%v;", h.kind, len(h.s), h.s, h.i, h.f)
	}
	return hashKey{kind: 't', s: b.String()}, nil
}

// typeName names a Value's Python type, for error messages.
func typeName(v Value) string {
	switch v := v.(type) {
	case nil:
		return "None"
	case bool:
		return "bool"
	case int64, *big.Int:
		return "int"
	case float64:
		return "float"
	case string:
		return "str"
	case Bytes:
		return "bytes"
	case *List:
		return "list"
	case *Tuple:
		return "tuple"
	case *Dict:
		if v.Ordered {
			return "OrderedDict"
		}
		return "dict"
	case *Tensor:
		return "Tensor"
	case *Global:
		return v.String()
	case *Call:
		return v.Func.String() + "(...)"
	}
	return fmt.Sprintf("%T", v)
}

// keyString renders a dict key for paths in messages and warnings.
func keyString(k Value) string {
	switch k := k.(type) {
	case string:
		return k
	case int64:
		return strconv.FormatInt(k, 10)
	}
	return fmt.Sprint(k)
}

// Tensor is a tensor of the checkpoint: a strided view of a storage. Its
// bytes stay in the file until they are asked for.
type Tensor struct {
	Storage *Storage
	// Offset is the element offset into the storage.
	Offset int
	Shape  []int
	Stride []int
	// RequiresGrad is _rebuild_tensor_v2's requires_grad argument.
	RequiresGrad bool
	// Param marks a torch.nn.Parameter (rebuilt through _rebuild_parameter),
	// whose own requires_grad is ParamRequiresGrad.
	Param             bool
	ParamRequiresGrad bool
	// Metadata is _rebuild_tensor_v2's optional seventh argument (torch
	// 2.x); nil when absent.
	Metadata Value

	pending []float64 // replacement values set through SetValues
	// negate lists the dim-0 slices whose signs are flipped as the record
	// is written (see negate.go); non-nil marks the tensor changed.
	negate []int
	// stream writes the bytes of a tensor AddStreamedTensor added.
	stream func(io.Writer) error
	// twin is the tensor object this one was copied from, where the input
	// held that one object under two state-dict keys (separate); nil
	// otherwise.
	twin *Tensor
	// keyed marks a tensor met under a key while separate walks a dict.
	keyed bool
}

// DType is the tensor's element type.
func (t *Tensor) DType() DType { return t.Storage.DType }

// Numel is the number of elements (1 for a scalar).
func (t *Tensor) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Contiguous reports whether the tensor is laid out row-major without gaps.
func (t *Tensor) Contiguous() bool {
	want := 1
	for i := len(t.Shape) - 1; i >= 0; i-- {
		if t.Shape[i] != 1 && t.Stride[i] != want {
			return false
		}
		want *= t.Shape[i]
	}
	return true
}

// Changed reports whether SetValues replaced the tensor's values.
func (t *Tensor) Changed() bool { return t.pending != nil || t.negate != nil || t.stream != nil }

// Storage is one storage record of the checkpoint, shared by every tensor
// that views it.
type Storage struct {
	Key   string
	DType DType
	// Numel is the element count the persistent id declares.
	Numel    int
	Location string
	// Class is the storage class global of the persistent id
	// (torch.FloatStorage).
	Class *Global

	rec record
	// verified is set once a read has checked the whole record's CRC-32;
	// kept then holds a small record's bytes (readWhole), which readers
	// share and never modify. Apart from rec, which never changes once
	// open, so that a copy of the records running beside the reads
	// (Prewrite) shares nothing that changes.
	verified bool
	kept     []byte
	// ahead holds a small stored record's bytes read along with another
	// record's, not yet checked (readSmallRecord; guarded by its mutex).
	ahead []byte
}

// record locates a storage's bytes in the input file.
type record struct {
	name   string // zip record name, or a description for legacy files
	offset int64  // start of the bytes in the file (stored records)
	size   int64
	crc    uint32
	hasCRC bool
	zf     zipOpener // non-nil for a compressed zip record
}
