package pth

import (
	"bytes"
	"encoding/binary"
	"math"
	"slices"
	"sort"
	"strings"
)

// fastLoad decodes the pickles torch.save writes (protocol 2 and the
// opcodes it emits) straight into this package's Values, in one pass over
// the bytes. It declines (ok false) whatever it does not take on exactly
// as gopickle and convertTree do together, and load then decodes it that
// way: other opcodes, other callables, anything that would be an error,
// a mutable object fetched from the memo (sharing and cycles), a tree
// deeper than fastMaxHeight. So its errors are never its own, and where
// it succeeds its tree is the one the general path builds
// (TestFastPickleSame, FuzzFastPickle).
//
// Why: gopickle allocates on every opcode (each read makes a buffer, each
// MARK a stack), keeps ordered dicts as a map and a linked list, and its
// result is then converted again into Values. On densenet201 (202 KB of
// pickle, 1,208 tensors) Open took 8.6 ms and 65,400 allocations that
// way, 6.6 ms and 37,700 this way (best of 20), and a whole conversion
// made 400 fewer page faults (2026-12-02). The pickle was checked first
// on both paths (scanPickle: globals against the allowlist, sizes,
// duplicate keys).
func (u *unpickler) fastLoad(data []byte) (root Value, ok bool) {
	if u.storages == nil {
		u.storages = map[string]*Storage{}
	}
	// Room for the whole memo at once: the scan counted it, and torch
	// stores an entry in about every 19 bytes otherwise.
	n := u.memo
	if n <= 0 {
		n = len(data)/16 + 16
	}
	d := fastDecoder{data: data, u: u, memo: make([]fastEntry, 0, n)}
	root, ok = d.run()
	if !ok {
		// As it was: the general path resolves them again.
		for _, k := range d.added {
			delete(u.storages, k)
		}
		return nil, false
	}
	return root, true
}

// fastMaxHeight bounds the height of the trees fastLoad builds, far below
// convertTree's maxDepth, so that no tree it takes is one the general path
// would refuse for its depth (a state dict's is about 5).
const fastMaxHeight = 64

// fastEntry is a value on the decoder's stack or in its memo: h is its
// height in the tree (0 for a leaf), raw that it is or holds a value
// convertTree refuses in the tree, which only its consumer may take: a
// storage reference (a tensor rebuild) or gopickle's OrderedDict class
// (REDUCE).
type fastEntry struct {
	v   any
	h   int
	raw bool
	set bool // (in the memo: the index was PUT)
}

// odClass is collections.OrderedDict before it is called: gopickle's own
// class, not a *Global.
type odClass struct{}

var theODClass = &odClass{}

type fastDecoder struct {
	data  []byte
	pos   int
	u     *unpickler
	stack []fastEntry
	marks []int // stack lengths at each MARK
	memo  []fastEntry
	added []string // the storages resolved, in u.storages
}

// base is where the current MARK's part of the stack begins.
func (d *fastDecoder) base() int {
	if len(d.marks) == 0 {
		return 0
	}
	return d.marks[len(d.marks)-1]
}

func (d *fastDecoder) push(e fastEntry) { d.stack = append(d.stack, e) }

// pop takes the top of the current MARK's part of the stack (gopickle's
// stack is only that part).
func (d *fastDecoder) pop() (fastEntry, bool) {
	if len(d.stack) <= d.base() {
		return fastEntry{}, false
	}
	e := d.stack[len(d.stack)-1]
	d.stack = d.stack[:len(d.stack)-1]
	return e, true
}

// popMark returns the entries above the last MARK and removes them and it.
// The slice is valid until the next push.
func (d *fastDecoder) popMark() ([]fastEntry, bool) {
	if len(d.marks) == 0 {
		return nil, false
	}
	b := d.marks[len(d.marks)-1]
	d.marks = d.marks[:len(d.marks)-1]
	items := d.stack[b:]
	d.stack = d.stack[:b]
	return items, true
}

func (d *fastDecoder) take(n int) ([]byte, bool) {
	if n < 0 || n > len(d.data)-d.pos {
		return nil, false
	}
	b := d.data[d.pos : d.pos+n]
	d.pos += n
	return b, true
}

func (d *fastDecoder) line() (string, bool) {
	i := bytes.IndexByte(d.data[d.pos:], '\n')
	if i < 0 {
		return "", false
	}
	s := string(d.data[d.pos : d.pos+i])
	d.pos += i + 1
	return s, true
}

// plain reports whether e may go into a container: a Value that neither is
// nor holds a raw one.
func plain(e fastEntry) bool { return !e.raw }

func (d *fastDecoder) put(i int) bool {
	top, ok := d.peek()
	if !ok || i < 0 || i > len(d.memo) {
		return false // (gopickle takes sparse indices; torch writes none)
	}
	top.set = true
	if i == len(d.memo) {
		d.memo = append(d.memo, top)
		return true
	}
	d.memo[i] = top
	return true
}

func (d *fastDecoder) peek() (fastEntry, bool) {
	if len(d.stack) <= d.base() {
		return fastEntry{}, false
	}
	return d.stack[len(d.stack)-1], true
}

func (d *fastDecoder) get(i int) bool {
	if i < 0 || i >= len(d.memo) || !d.memo[i].set {
		return false
	}
	e := d.memo[i]
	e.set = false
	switch e.v.(type) {
	case *List, *Dict:
		// Shared mutable objects can form cycles and change after being
		// shared; the general path handles them.
		return false
	}
	d.push(e) // (a raw one stays out of containers: plain)
	return true
}

func (d *fastDecoder) run() (Value, bool) {
	for d.pos < len(d.data) {
		op := d.data[d.pos]
		d.pos++
		switch op {
		case opProto:
			b, ok := d.take(1)
			if !ok || b[0] > 5 {
				return nil, false
			}
		case opStop:
			e, ok := d.pop()
			if !ok || !plain(e) || e.h > fastMaxHeight {
				return nil, false
			}
			return e.v, true
		case opMark:
			d.marks = append(d.marks, len(d.stack))
		case opEmptyDict:
			d.push(fastEntry{v: newDictSized(false, 0)})
		case opEmptyList:
			d.push(fastEntry{v: &List{Items: []Value{}}})
		case opEmptyTuple:
			d.push(fastEntry{v: &Tuple{Items: []Value{}}})
		case opBinPut:
			b, ok := d.take(1)
			if !ok || !d.put(int(b[0])) {
				return nil, false
			}
		case opLongBinPut:
			b, ok := d.take(4)
			if !ok || !d.put(int(binary.LittleEndian.Uint32(b))) {
				return nil, false
			}
		case opBinGet:
			b, ok := d.take(1)
			if !ok || !d.get(int(b[0])) {
				return nil, false
			}
		case opLongBinGet:
			b, ok := d.take(4)
			if !ok || !d.get(int(binary.LittleEndian.Uint32(b))) {
				return nil, false
			}
		case opBinUnicode:
			b, ok := d.take(4)
			if !ok {
				return nil, false
			}
			s, ok := d.take(int(binary.LittleEndian.Uint32(b)))
			if !ok {
				return nil, false
			}
			d.push(fastEntry{v: string(s)})
		case 0x8c: // SHORT_BINUNICODE
			b, ok := d.take(1)
			if !ok {
				return nil, false
			}
			s, ok := d.take(int(b[0]))
			if !ok {
				return nil, false
			}
			d.push(fastEntry{v: string(s)})
		case opGlobal:
			if !d.global() {
				return nil, false
			}
		case opBinInt:
			b, ok := d.take(4)
			if !ok {
				return nil, false
			}
			d.push(fastEntry{v: int64(int32(binary.LittleEndian.Uint32(b)))})
		case opBinInt1:
			b, ok := d.take(1)
			if !ok {
				return nil, false
			}
			d.push(fastEntry{v: int64(b[0])})
		case opBinInt2:
			b, ok := d.take(2)
			if !ok {
				return nil, false
			}
			d.push(fastEntry{v: int64(binary.LittleEndian.Uint16(b))})
		case opLong1:
			b, ok := d.take(1)
			if !ok || b[0] == 0 || b[0] > 8 {
				return nil, false // (empty: gopickle panics; longer: a big.Int)
			}
			v, _ := d.take(int(b[0]))
			if len(v) != int(b[0]) {
				return nil, false
			}
			var x uint64
			for i := len(v) - 1; i >= 0; i-- {
				x = x<<8 | uint64(v[i])
			}
			shift := 64 - 8*uint(len(v))
			d.push(fastEntry{v: int64(x<<shift) >> shift}) // sign-extended
		case opBinFloat:
			b, ok := d.take(8)
			if !ok {
				return nil, false
			}
			d.push(fastEntry{v: math.Float64frombits(binary.BigEndian.Uint64(b))})
		case opNone:
			d.push(fastEntry{v: nil})
		case opNewTrue:
			d.push(fastEntry{v: true})
		case opNewFalse:
			d.push(fastEntry{v: false})
		case opTuple:
			items, ok := d.popMark()
			if !ok {
				return nil, false
			}
			d.push(tupleOf(items))
		case opTuple1, opTuple2, opTuple3:
			n := int(op-opTuple1) + 1
			if len(d.stack)-d.base() < n {
				return nil, false
			}
			at := len(d.stack) - n
			e := tupleOf(d.stack[at:])
			d.stack = d.stack[:at]
			d.push(e)
		case opAppend:
			v, ok1 := d.pop()
			l, ok2 := d.pop()
			list, ok3 := l.v.(*List)
			if !ok1 || !ok2 || !ok3 || !plain(v) {
				return nil, false
			}
			list.Items = append(list.Items, v.v)
			l.h = max(l.h, v.h+1)
			d.push(l)
		case opAppends:
			items, ok := d.popMark()
			if !ok {
				return nil, false
			}
			l, ok1 := d.pop()
			list, ok2 := l.v.(*List)
			if !ok1 || !ok2 {
				return nil, false
			}
			list.Items = slices.Grow(list.Items, len(items))
			for _, it := range items {
				if !plain(it) {
					return nil, false
				}
				list.Items = append(list.Items, it.v)
				l.h = max(l.h, it.h+1)
			}
			d.push(l)
		case opSetItem:
			v, ok1 := d.pop()
			k, ok2 := d.pop()
			if !ok1 || !ok2 || len(d.stack) <= d.base() {
				return nil, false
			}
			top := &d.stack[len(d.stack)-1]
			if !setItem(top, k, v) {
				return nil, false
			}
		case opSetItems:
			items, ok := d.popMark()
			if !ok || len(items)%2 != 0 {
				return nil, false
			}
			// items stays valid: nothing is pushed before the dict is.
			e, ok := d.pop()
			if !ok {
				return nil, false
			}
			// gopickle refuses SETITEMS on what is not a dict even with
			// no items to set (the fuzzer found an empty one on a list).
			dict, ok := e.v.(*Dict)
			if !ok {
				return nil, false
			}
			dict.grow(len(items) / 2)
			for i := 0; i < len(items); i += 2 {
				if !setItem(&e, items[i], items[i+1]) {
					return nil, false
				}
			}
			d.push(e)
		case opBuild:
			if !d.build() {
				return nil, false
			}
		case opReduce:
			if !d.reduce() {
				return nil, false
			}
		case opBinPersID:
			if !d.persistent() {
				return nil, false
			}
		default:
			return nil, false
		}
	}
	return nil, false // no STOP
}

// grow makes room for n more entries (SETITEMS says how many follow).
func (d *Dict) grow(n int) {
	d.keys = slices.Grow(d.keys, n)
	d.vals = slices.Grow(d.vals, n)
}

// tupleOf makes a tuple of entries, which holds a storage if one of them
// is or holds one.
func tupleOf(items []fastEntry) fastEntry {
	t := &Tuple{Items: make([]Value, len(items))}
	e := fastEntry{v: t}
	for i, it := range items {
		t.Items[i] = it.v
		e.h = max(e.h, it.h+1)
		e.raw = e.raw || it.raw
	}
	return e
}

// setItem sets k: v in the dict of *de, refusing (false) a key set twice
// (gopickle keeps both in a dict, for convertTree to refuse, and the last
// in an ordered dict) and a key the dict cannot hash.
func setItem(de *fastEntry, k, v fastEntry) bool {
	dict, ok := de.v.(*Dict)
	if !ok || !plain(k) || !plain(v) {
		return false
	}
	switch k.v.(type) {
	case *List, *Dict: // (gopickle panics on an ordered dict's)
		return false
	}
	if dup, err := dict.add(k.v, v.v); dup || err != nil {
		return false
	}
	de.h = max(de.h, k.h+1, v.h+1)
	return true
}

// global is GLOBAL: what gopickle's findClass and unpickler.findClass
// resolve, as the *Global convertTree makes of it.
func (d *fastDecoder) global() bool {
	module, ok1 := d.line()
	name, ok2 := d.line()
	if !ok1 || !ok2 {
		return false
	}
	switch module + "." + name {
	case "collections.OrderedDict":
		d.push(fastEntry{v: theODClass, raw: true})
		return true
	case "__builtin__.object", "copy_reg._reconstructor":
		return false // gopickle's own classes
	}
	full := normalizeGlobal(module, name)
	if !allowedGlobal(full) {
		return false
	}
	i := strings.LastIndexByte(full, '.')
	d.push(fastEntry{v: &Global{Module: full[:i], Name: full[i+1:]}})
	return true
}

// globalKind says what unpickler.findClass makes of a global: a tensor
// rebuild function, Parameter, _codecs.encode, or a plain reference ("").
func globalKind(g *Global) string {
	full := g.String()
	switch {
	case g.Module == "torch._utils" || full == "torch._tensor._rebuild_from_type_v2":
		return "rebuild"
	case full == "torch.nn.parameter.Parameter":
		return "param"
	case full == "_codecs.encode":
		return "codecs"
	}
	return ""
}

// build is BUILD on an ordered dict with a dict of attributes (a state
// dict's _metadata), the one BUILD torch writes: convertTree keeps the
// attributes as the dict's State, in name order.
func (d *fastDecoder) build() bool {
	state, ok := d.pop()
	if !ok || len(d.stack) <= d.base() {
		return false
	}
	inst := &d.stack[len(d.stack)-1]
	od, ok1 := inst.v.(*Dict)
	sd, ok2 := state.v.(*Dict)
	if !ok1 || !od.Ordered || od.State != nil || !ok2 || sd.Ordered || sd.State != nil || !plain(state) {
		return false
	}
	n := sd.Len()
	if n == 0 {
		return true
	}
	names := make([]string, n)
	for i := range n {
		k, _ := sd.Entry(i)
		s, ok := k.(string)
		if !ok {
			return false
		}
		names[i] = s
	}
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return names[idx[a]] < names[idx[b]] })
	od.State = NewDict(false)
	for _, i := range idx {
		_, v := sd.Entry(i)
		if dup, err := od.State.add(names[i], v); dup || err != nil {
			return false
		}
	}
	inst.h = max(inst.h, state.h) // (the state's entries sit one level down, as its own did)
	return true
}

// reduce is REDUCE with the callables unpickler.findClass resolves.
func (d *fastDecoder) reduce() bool {
	a, ok1 := d.pop()
	f, ok2 := d.pop()
	args, ok3 := a.v.(*Tuple)
	if !ok1 || !ok2 || !ok3 {
		return false
	}
	if f.v == theODClass {
		if len(args.Items) != 0 {
			return false
		}
		d.push(fastEntry{v: newDictSized(true, 0)})
		return true
	}
	g, ok := f.v.(*Global)
	if !ok {
		return false
	}
	switch globalKind(g) {
	case "rebuild":
		t, ok := d.rebuild(g, args.Items)
		if !ok {
			return false
		}
		e := fastEntry{v: t}
		if t.Metadata != nil {
			e.h = a.h // (the metadata was an argument)
		}
		d.push(e)
		return true
	case "codecs":
		if a.raw || len(args.Items) != 2 {
			return false
		}
		s, ok1 := args.Items[0].(string)
		enc, ok2 := args.Items[1].(string)
		if !ok1 || !ok2 || (enc != "latin1" && enc != "latin-1") {
			return false
		}
		out := make(Bytes, 0, len(s))
		for _, r := range s {
			if r > 0xff {
				return false
			}
			out = append(out, byte(r))
		}
		d.push(fastEntry{v: out})
		return true
	case "":
		if a.raw {
			return false
		}
		d.push(fastEntry{v: &Call{Func: g, Args: &Tuple{Items: append([]Value{}, args.Items...)}}, h: a.h})
		return true
	}
	return false // Parameter takes NEWOBJ, which the general path handles
}

// rebuild is rebuildFunc.Call on decoded arguments.
func (d *fastDecoder) rebuild(g *Global, args []Value) (*Tensor, bool) {
	switch g.String() {
	case "torch._utils._rebuild_tensor_v2":
		if len(args) != 6 && len(args) != 7 {
			return nil, false
		}
		t, ok := fastTensor(args[0], args[1], args[2], args[3])
		rg, ok2 := args[4].(bool)
		if !ok || !ok2 || !fastEmpty(args[5]) {
			return nil, false
		}
		t.RequiresGrad = rg
		if len(args) == 7 {
			if holdsRaw(args[6], 0) {
				return nil, false // (convertTree refuses a bare storage)
			}
			t.Metadata = args[6]
		}
		return t, true
	case "torch._utils._rebuild_tensor":
		if len(args) != 4 {
			return nil, false
		}
		return fastTensor(args[0], args[1], args[2], args[3])
	case "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state":
		if len(args) != 3 && len(args) != 4 {
			return nil, false
		}
		if len(args) == 4 && !fastEmpty(args[3]) {
			return nil, false
		}
		rg, ok := args[1].(bool)
		if !ok || !fastEmpty(args[2]) {
			return nil, false
		}
		return fastParam(args[0], rg)
	case "torch._tensor._rebuild_from_type_v2":
		if len(args) != 4 {
			return nil, false
		}
		fn, ok1 := args[0].(*Global)
		fargs, ok2 := args[2].(*Tuple)
		if !ok1 || !ok2 || globalKind(fn) != "rebuild" || !fastEmpty(args[3]) {
			return nil, false
		}
		res, ok := d.rebuild(fn, fargs.Items)
		if !ok {
			return nil, false
		}
		nt, ok := args[1].(*Global)
		if !ok {
			return nil, false
		}
		switch {
		case nt.String() == "torch.Tensor" && globalKind(nt) == "":
			return res, true
		case globalKind(nt) == "param":
			if res.Param {
				return res, true
			}
			return fastParam(res, true)
		}
	}
	return nil, false
}

// holdsRaw reports whether v is raw (see fastEntry) or a tuple that holds
// one: the only container that can (plain keeps them out of the others),
// no deeper than the tree's bound.
func holdsRaw(v Value, depth int) bool {
	switch v := v.(type) {
	case *storageRef, *odClass:
		return true
	case *Tuple:
		if depth > fastMaxHeight {
			return true
		}
		for _, it := range v.Items {
			if holdsRaw(it, depth+1) {
				return true
			}
		}
	}
	return false
}

func fastParam(data Value, requiresGrad bool) (*Tensor, bool) {
	t, ok := data.(*Tensor)
	if !ok {
		return nil, false
	}
	p := *t
	p.Param, p.ParamRequiresGrad = true, requiresGrad
	return &p, true
}

// fastEmpty is emptyHooks and emptyState: None or an empty dict.
func fastEmpty(v Value) bool {
	switch v := v.(type) {
	case nil:
		return true
	case *Dict:
		return v.Len() == 0
	}
	return false
}

func fastTensor(storage, offset, size, stride Value) (*Tensor, bool) {
	ref, ok := storage.(*storageRef)
	off, ok2 := offset.(int64)
	if !ok || !ok2 || off < 0 {
		return nil, false
	}
	shape, ok := fastInts(size)
	strides, ok2 := fastInts(stride)
	if !ok || !ok2 || len(shape) != len(strides) {
		return nil, false
	}
	t := &Tensor{Storage: ref.st, Offset: int(off), Shape: shape, Stride: strides}
	if t.checkBounds() != nil {
		return nil, false
	}
	return t, true
}

// fastInts is intTuple: a tuple of ints, or torch.Size of one.
func fastInts(v Value) ([]int, bool) {
	switch v := v.(type) {
	case *Tuple:
		out := make([]int, len(v.Items))
		for i, it := range v.Items {
			n, ok := it.(int64)
			if !ok {
				return nil, false
			}
			out[i] = int(n)
		}
		return out, true
	case *Call:
		if v.Func.String() == "torch.Size" && globalKind(v.Func) == "" && len(v.Args.Items) == 1 {
			return fastInts(v.Args.Items[0])
		}
	}
	return nil, false
}

// persistent is BINPERSID: unpickler.persistentLoad on decoded values.
func (d *fastDecoder) persistent() bool {
	e, ok := d.pop()
	t, ok2 := e.v.(*Tuple)
	if !ok || !ok2 || e.raw || len(t.Items) < 5 || len(t.Items) > 6 {
		return false
	}
	if s, _ := t.Items[0].(string); s != "storage" {
		return false
	}
	cls, ok := t.Items[1].(*Global)
	if !ok || globalKind(cls) != "" {
		return false
	}
	dtype, ok := storageDTypes[cls.Name]
	if cls.Name == "UntypedStorage" {
		dtype, ok = Uint8, true
	}
	key, ok1 := t.Items[2].(string)
	loc, ok2 := t.Items[3].(string)
	numel, ok3 := t.Items[4].(int64)
	if !ok || !ok1 || !ok2 || !ok3 || numel < 0 || key == "" {
		return false
	}
	if len(t.Items) == 6 && t.Items[5] != nil {
		return false
	}
	if st, ok := d.u.storages[key]; ok { // (this pickle's or an earlier one's, as in persistentLoad)
		if st.DType != dtype || st.Numel != int(numel) {
			return false
		}
		d.push(fastEntry{v: &storageRef{st}, raw: true})
		return true
	}
	st, err := d.u.resolve(key, dtype, int(numel), loc, cls)
	if err != nil {
		return false
	}
	d.u.storages[key] = st
	d.added = append(d.added, key)
	d.push(fastEntry{v: &storageRef{st}, raw: true})
	return true
}
