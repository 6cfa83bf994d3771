package pth

import (
	"bytes"
	"errors"
	"fmt"
	"math/big"
	"sort"
	"strings"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"

	"github.com/abnconvert/abnconvert/failure"
)

// maxDepth bounds the nesting of the object tree, so that a hostile pickle
// cannot exhaust the stack of the converter.
const maxDepth = 2000

// storageResolver returns the storage a persistent id names; it is called
// once per distinct key.
type storageResolver func(key string, dtype DType, numel int, location string, class *Global) (*Storage, error)

// unpickler runs gopickle's unpickler over one pickle whose globals were
// already checked against the allowlist, with hooks that build this
// package's values instead of calling anything.
type unpickler struct {
	resolve  storageResolver
	storages map[string]*Storage
	// memo, when above 0, is how many memo entries the pickle stores
	// (scanPickle counted them), for fastLoad's memo.
	memo int
	// contentErr is the last error a hook reported about the checkpoint's
	// content (a missing record, a tensor outside its storage), which is
	// not a malformed pickle and is reported without that label.
	contentErr error
}

// content records err as a content error and returns it.
func (u *unpickler) content(err error) error {
	u.contentErr = err
	return err
}

// load decodes data into an object tree. gopickle panics on some malformed
// inputs (an empty LONG1, an unhashable dict key); recover turns those into
// errors.
func (u *unpickler) load(data []byte) (Value, error) {
	if !noFastPickle {
		if root, ok := u.fastLoad(data); ok {
			return root, nil
		}
	}
	raw, err := u.run(data)
	if err != nil {
		return nil, err
	}
	return convertTree(raw)
}

// noFastPickle turns fastLoad's path off (tests compare the two).
var noFastPickle bool

// run is gopickle's part, the one that panics on some malformed inputs.
func (u *unpickler) run(data []byte) (raw any, err error) {
	defer func() {
		if r := recover(); r != nil {
			raw, err = nil, fmt.Errorf("malformed pickle: %v", r)
		}
	}()
	if u.storages == nil {
		u.storages = map[string]*Storage{}
	}
	p := pickle.NewUnpickler(bytes.NewReader(data))
	p.FindClass = u.findClass
	p.PersistentLoad = u.persistentLoad
	raw, err = p.Load()
	if err != nil {
		if err == u.contentErr {
			return nil, err
		}
		return nil, fmt.Errorf("malformed pickle: %w", err)
	}
	return raw, nil
}

// errInternal marks a panic in this package's own code, contained so that
// a bug cannot crash a conversion; the fuzz tests fail on it. It carries
// the class failure.Internal (exit code 3). A panic inside gopickle (run)
// is not one: gopickle panics on some malformed pickles (a truncated
// stack, a bad memo index) instead of returning an error, so those stay
// "malformed pickle", bad input.
var errInternal = failure.As(failure.Internal, errors.New("internal error decoding the pickle (please report it)"))

// convertTree is this package's part. It should never panic; if it does,
// the panic becomes an error that says it is a bug.
func convertTree(raw any) (root Value, err error) {
	defer func() {
		if r := recover(); r != nil {
			root, err = nil, fmt.Errorf("%w: %v", errInternal, r)
		}
	}()
	c := converter{memo: map[any]Value{}, busy: map[any]bool{}}
	return c.convert(raw, 0)
}

// globalRef is what a GLOBAL opcode pushes for an allowlisted global that
// this package keeps as it is (a dtype, a storage class, torch.Size...).
// Applied to arguments it becomes a *Call.
type globalRef struct{ g *Global }

func (r *globalRef) Call(args ...any) (any, error) { return &rawCall{fn: r.g, args: args}, nil }

// rawCall is a *Call whose arguments are still gopickle values.
type rawCall struct {
	fn   *Global
	args []any
}

// rebuildFunc is one of torch's tensor rebuild functions.
type rebuildFunc struct {
	g *Global
	u *unpickler
}

// paramClass is torch.nn.parameter.Parameter.
type paramClass struct{ g *Global }

// codecsEncode is _codecs.encode, through which protocol 2 pickles bytes.
type codecsEncode struct{ g *Global }

// storageRef is what a storage persistent id loads to.
type storageRef struct{ st *Storage }

func (u *unpickler) findClass(module, name string) (any, error) {
	full := normalizeGlobal(module, name)
	// Every global was checked before decoding; this is a second line of
	// defence in case the scan and gopickle ever disagree.
	if !allowedGlobal(full) {
		return nil, fmt.Errorf("global %s is not allowed", full)
	}
	i := strings.LastIndexByte(full, '.')
	g := &Global{Module: full[:i], Name: full[i+1:]}
	switch {
	case g.Module == "torch._utils" || full == "torch._tensor._rebuild_from_type_v2":
		return &rebuildFunc{g, u}, nil
	case full == "torch.nn.parameter.Parameter":
		return &paramClass{g}, nil
	case full == "_codecs.encode":
		return &codecsEncode{g}, nil
	}
	return &globalRef{g}, nil
}

func (u *unpickler) persistentLoad(pid any) (any, error) {
	t, ok := pid.(*types.Tuple)
	if !ok || t.Len() < 5 || t.Len() > 6 {
		return nil, fmt.Errorf("persistent id %v is not a storage tuple", pid)
	}
	if s, _ := t.Get(0).(string); s != "storage" {
		return nil, fmt.Errorf("persistent id of kind %v, want \"storage\"", t.Get(0))
	}
	cls, ok := t.Get(1).(*globalRef)
	if !ok {
		return nil, fmt.Errorf("persistent id names storage class %v, not a storage class global", t.Get(1))
	}
	dtype, ok := storageDTypes[cls.g.Name]
	if cls.g.Name == "UntypedStorage" {
		dtype, ok = Uint8, true
	}
	if !ok {
		return nil, u.content(fmt.Errorf("unsupported storage class %s", cls.g))
	}
	key, ok1 := t.Get(2).(string)
	loc, ok2 := t.Get(3).(string)
	numel, ok3 := t.Get(4).(int)
	if !ok1 || !ok2 || !ok3 || numel < 0 || key == "" {
		return nil, fmt.Errorf("malformed storage persistent id %v", pid)
	}
	if t.Len() == 6 && t.Get(5) != nil {
		// Storage views come from pre-1.0 torch; their offset units differ
		// between versions, so guessing would risk wrong values.
		return nil, fmt.Errorf("storage %q is a storage view (pre-1.0 legacy format), which is not supported", key)
	}
	if st, ok := u.storages[key]; ok {
		if st.DType != dtype || st.Numel != numel {
			return nil, fmt.Errorf("storage %q is referenced both as %d×%s and %d×%s", key, st.Numel, st.DType, numel, dtype)
		}
		return &storageRef{st}, nil
	}
	st, err := u.resolve(key, dtype, numel, loc, cls.g)
	if err != nil {
		return nil, u.content(err)
	}
	u.storages[key] = st
	return &storageRef{st}, nil
}

func (f *rebuildFunc) Call(args ...any) (any, error) {
	switch f.g.String() {
	case "torch._utils._rebuild_tensor_v2":
		if len(args) != 6 && len(args) != 7 {
			return nil, fmt.Errorf("_rebuild_tensor_v2 with %d arguments", len(args))
		}
		t, err := newTensor(args[0], args[1], args[2], args[3])
		if err != nil {
			return nil, f.u.content(err)
		}
		rg, ok := args[4].(bool)
		if !ok {
			return nil, fmt.Errorf("_rebuild_tensor_v2: requires_grad is %T, not bool", args[4])
		}
		t.RequiresGrad = rg
		if err := emptyHooks(args[5]); err != nil {
			return nil, err
		}
		if len(args) == 7 {
			t.Metadata = args[6]
		}
		return t, nil
	case "torch._utils._rebuild_tensor":
		if len(args) != 4 {
			return nil, fmt.Errorf("_rebuild_tensor with %d arguments", len(args))
		}
		t, err := newTensor(args[0], args[1], args[2], args[3])
		if err != nil {
			return nil, f.u.content(err)
		}
		return t, nil
	case "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state":
		if len(args) != 3 && len(args) != 4 {
			return nil, fmt.Errorf("%s with %d arguments", f.g.Name, len(args))
		}
		if len(args) == 4 && !emptyState(args[3]) {
			return nil, fmt.Errorf("%s: parameters with Python attributes are not supported", f.g.Name)
		}
		rg, ok := args[1].(bool)
		if !ok {
			return nil, fmt.Errorf("%s: requires_grad is %T, not bool", f.g.Name, args[1])
		}
		if err := emptyHooks(args[2]); err != nil {
			return nil, err
		}
		return asParam(args[0], rg)
	case "torch._tensor._rebuild_from_type_v2":
		// (func, new_type, args, state): torch 2.x wraps tensors that carry
		// Python attributes or are subclasses; only the plain cases are
		// state-dict material.
		if len(args) != 4 {
			return nil, fmt.Errorf("_rebuild_from_type_v2 with %d arguments", len(args))
		}
		fn, ok := args[0].(*rebuildFunc)
		fargs, ok2 := args[2].(*types.Tuple)
		if !ok || !ok2 {
			return nil, fmt.Errorf("_rebuild_from_type_v2: unsupported arguments")
		}
		if !emptyState(args[3]) {
			return nil, fmt.Errorf("_rebuild_from_type_v2: tensors with Python attributes are not supported")
		}
		res, err := fn.Call(*fargs...)
		if err != nil {
			return nil, err
		}
		switch nt := args[1].(type) {
		case *globalRef:
			if nt.g.String() == "torch.Tensor" {
				return res, nil
			}
		case *paramClass:
			t, ok := res.(*Tensor)
			if ok && t.Param {
				return t, nil
			}
			return asParam(res, true)
		}
		return nil, fmt.Errorf("_rebuild_from_type_v2: tensor subclass %v is not supported", args[1])
	}
	return nil, fmt.Errorf("%s: sparse, quantized, meta and subclass tensors are not supported", f.g)
}

// PyNew is NEWOBJ on Parameter: Parameter(data, requires_grad).
func (p *paramClass) PyNew(args ...any) (any, error) {
	rg := true
	if len(args) > 1 {
		b, ok := args[1].(bool)
		if !ok {
			return nil, fmt.Errorf("Parameter: requires_grad is %T, not bool", args[1])
		}
		rg = b
	}
	if len(args) == 0 || len(args) > 2 {
		return nil, fmt.Errorf("Parameter with %d arguments", len(args))
	}
	return asParam(args[0], rg)
}

func (c *codecsEncode) Call(args ...any) (any, error) {
	if len(args) != 2 {
		return nil, fmt.Errorf("_codecs.encode with %d arguments", len(args))
	}
	s, ok1 := args[0].(string)
	enc, ok2 := args[1].(string)
	if !ok1 || !ok2 || (enc != "latin1" && enc != "latin-1") {
		return nil, fmt.Errorf("_codecs.encode: only latin1 strings are supported")
	}
	out := make(Bytes, 0, len(s))
	for _, r := range s {
		if r > 0xff {
			return nil, fmt.Errorf("_codecs.encode: rune %U is not latin1", r)
		}
		out = append(out, byte(r))
	}
	return out, nil
}

func asParam(data any, requiresGrad bool) (*Tensor, error) {
	t, ok := data.(*Tensor)
	if !ok {
		return nil, fmt.Errorf("Parameter of %T, not a tensor", data)
	}
	// A copy: the inner tensor object may be shared through the memo.
	p := *t
	p.Param, p.ParamRequiresGrad = true, requiresGrad
	return &p, nil
}

func emptyHooks(h any) error {
	switch h := h.(type) {
	case nil:
		return nil
	case *types.OrderedDict:
		if h.Len() == 0 {
			return nil
		}
	case *types.Dict:
		if h.Len() == 0 {
			return nil
		}
	}
	return fmt.Errorf("tensor with backward hooks is not supported")
}

func emptyState(s any) bool {
	switch s := s.(type) {
	case nil:
		return true
	case *types.Dict:
		return s.Len() == 0
	case *types.OrderedDict:
		return s.Len() == 0
	}
	return false
}

func newTensor(storage, offset, size, stride any) (*Tensor, error) {
	ref, ok := storage.(*storageRef)
	if !ok {
		return nil, fmt.Errorf("tensor rebuilt from %T, not a storage", storage)
	}
	off, ok := offset.(int)
	if !ok || off < 0 {
		return nil, fmt.Errorf("tensor storage offset %v is not a non-negative int", offset)
	}
	shape, err := intTuple(size, "size")
	if err != nil {
		return nil, err
	}
	strides, err := intTuple(stride, "stride")
	if err != nil {
		return nil, err
	}
	if len(shape) != len(strides) {
		return nil, fmt.Errorf("tensor size %v and stride %v differ in rank", shape, strides)
	}
	t := &Tensor{Storage: ref.st, Offset: off, Shape: shape, Stride: strides}
	if err := t.checkBounds(); err != nil {
		return nil, err
	}
	return t, nil
}

// limitElems bounds sizes, strides and offsets so that index arithmetic
// cannot overflow.
const limitElems = 1 << 50

// checkBounds verifies that every element the tensor views lies inside its
// storage.
func (t *Tensor) checkBounds() error {
	// Every dimension is checked before an empty one ends the walk, so
	// that a zero cannot hide a negative or huge size behind it.
	for i, d := range t.Shape {
		if d < 0 {
			return fmt.Errorf("tensor size %v has a negative dimension", t.Shape)
		}
		if t.Stride[i] < 0 {
			return fmt.Errorf("tensor stride %v is negative (size %v)", t.Stride, t.Shape)
		}
		if d > limitElems || t.Stride[i] > limitElems {
			return fmt.Errorf("tensor size %v / stride %v out of range", t.Shape, t.Stride)
		}
	}
	if t.Offset > limitElems {
		return fmt.Errorf("tensor storage offset %d out of range", t.Offset)
	}
	n, hi := 1, t.Offset
	for i, d := range t.Shape {
		if d == 0 {
			return nil
		}
		if n > limitElems/d {
			return fmt.Errorf("tensor size %v too large", t.Shape)
		}
		n *= d
		hi += (d - 1) * t.Stride[i]
		if hi > limitElems {
			return fmt.Errorf("tensor size %v / stride %v out of range", t.Shape, t.Stride)
		}
	}
	if hi >= t.Storage.Numel {
		return fmt.Errorf("tensor (offset %d, size %v, stride %v) reaches element %d of storage %q, which has %d", t.Offset, t.Shape, t.Stride, hi, t.Storage.Key, t.Storage.Numel)
	}
	return nil
}

// span returns the first and one-past-last storage elements the tensor
// touches (equal when it is empty).
func (t *Tensor) span() (lo, hi int) {
	hi = t.Offset + 1
	for i, d := range t.Shape {
		if d == 0 {
			return t.Offset, t.Offset
		}
		hi += (d - 1) * t.Stride[i]
	}
	return t.Offset, hi
}

func intTuple(v any, what string) ([]int, error) {
	var items []any
	switch v := v.(type) {
	case *types.Tuple:
		items = *v
	case *rawCall: // torch.Size((...))
		if v.fn.String() == "torch.Size" && len(v.args) == 1 {
			return intTuple(v.args[0], what)
		}
		return nil, fmt.Errorf("tensor %s is %s(...), not a tuple", what, v.fn)
	default:
		return nil, fmt.Errorf("tensor %s is %T, not a tuple", what, v)
	}
	out := make([]int, len(items))
	for i, it := range items {
		n, ok := it.(int)
		if !ok {
			return nil, fmt.Errorf("tensor %s %v holds a non-int", what, items)
		}
		out[i] = n
	}
	return out, nil
}

// converter turns gopickle's values into this package's Values, keeping
// shared objects shared and refusing cycles.
type converter struct {
	memo map[any]Value
	busy map[any]bool
}

func (c *converter) convert(v any, depth int) (Value, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("object tree nested deeper than %d levels", maxDepth)
	}
	switch v := v.(type) {
	case nil, bool, float64, string, Bytes:
		return v, nil
	case int:
		return int64(v), nil
	case *big.Int:
		if v.IsInt64() {
			return v.Int64(), nil
		}
		return v, nil
	case []byte:
		return Bytes(v), nil
	case *globalRef:
		return v.g, nil
	case *rebuildFunc:
		return v.g, nil
	case *paramClass:
		return v.g, nil
	case *codecsEncode:
		return v.g, nil
	case *storageRef:
		return nil, fmt.Errorf("a bare storage (%q) outside a tensor is not supported", v.st.Key)
	}
	if t, ok := v.(*Tensor); ok && t.Metadata == nil {
		// A leaf, its own conversion: neither the memo nor the cycle
		// check can change what it becomes, and a state dict has a
		// thousand of them.
		return t, nil
	}
	switch v.(type) {
	case *types.List, *types.Tuple, *types.Dict, *types.OrderedDict, *Tensor, *rawCall:
	default:
		// Sets, generic objects and the like: no state dict holds them.
		return nil, fmt.Errorf("unsupported Python object of type %T in the pickle", v)
	}
	if out, ok := c.memo[v]; ok {
		return out, nil
	}
	if c.busy[v] {
		return nil, fmt.Errorf("the object tree contains a cycle")
	}
	c.busy[v] = true
	defer delete(c.busy, v)
	var out Value
	var err error
	switch v := v.(type) {
	case *types.List:
		l := &List{Items: make([]Value, len(*v))}
		for i, it := range *v {
			if l.Items[i], err = c.convert(it, depth+1); err != nil {
				return nil, err
			}
		}
		out = l
	case *types.Tuple:
		t := &Tuple{Items: make([]Value, len(*v))}
		for i, it := range *v {
			if t.Items[i], err = c.convert(it, depth+1); err != nil {
				return nil, err
			}
		}
		out = t
	case *types.Dict:
		d := newDictSized(false, len(*v))
		for _, e := range *v {
			if err := c.setItem(d, e.Key, e.Value, depth); err != nil {
				return nil, err
			}
		}
		out = d
	case *types.OrderedDict:
		d := newDictSized(true, v.Len())
		for e := v.List.Front(); e != nil; e = e.Next() {
			entry := e.Value.(*types.OrderedDictEntry)
			if err := c.setItem(d, entry.Key, entry.Value, depth); err != nil {
				return nil, err
			}
		}
		if len(v.PyDict) > 0 {
			// Python keeps attribute order; gopickle keeps a map, so sort
			// for deterministic output ("_metadata" is the usual only one).
			names := make([]string, 0, len(v.PyDict))
			for k := range v.PyDict {
				names = append(names, k)
			}
			sort.Strings(names)
			d.State = NewDict(false)
			for _, k := range names {
				if err := c.setItem(d.State, k, v.PyDict[k], depth); err != nil {
					return nil, err
				}
			}
		}
		out = d
	case *Tensor:
		if v.Metadata != nil {
			if v.Metadata, err = c.convert(v.Metadata, depth+1); err != nil {
				return nil, err
			}
		}
		out = v
	case *rawCall:
		args := &Tuple{Items: make([]Value, len(v.args))}
		for i, a := range v.args {
			if args.Items[i], err = c.convert(a, depth+1); err != nil {
				return nil, err
			}
		}
		out = &Call{Func: v.fn, Args: args}
	default:
		return nil, fmt.Errorf("unsupported Python object of type %T in the pickle", v)
	}
	c.memo[v] = out
	return out, nil
}

func (c *converter) setItem(d *Dict, k, v any, depth int) error {
	ck, err := c.convert(k, depth+1)
	if err != nil {
		return err
	}
	cv, err := c.convert(v, depth+1)
	if err != nil {
		return err
	}
	// Python merges a key set twice; the scan refuses plain keys set twice,
	// and this catches the rest (tuple keys, 1 and True).
	dup, err := d.add(ck, cv)
	if dup {
		return fmt.Errorf("dict key %s is set twice in one dict", keyString(ck))
	}
	return err
}
