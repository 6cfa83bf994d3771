package pth

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/big"
	"slices"
	"unicode/utf8"
)

// pickler writes an object tree as a protocol-2 pickle with the opcode
// sequence torch.save produces, using only opcodes that torch's
// weights_only unpickler accepts (BINFLOAT needs torch >= 2.0 there; torch
// 1.13 refuses it even in files torch 1.13 wrote).
//
// Its memo is kept in typed maps, and only for what may be met again:
// every conversion pickles the tree twice (the early copy and Finish), and
// a memo of interface keys, with a fresh key for each of the slots torch's
// pickler fills but never reads back (a tensor's persistent id, its
// rebuild call...), was most of that time: densenet201's 1,200 tensors
// took 3.3 ms and 13,500 allocations a pickle.
type pickler struct {
	buf     bytes.Buffer
	next    int               // the next memo index
	ptrs    map[any]int       // trees' nodes (*Tensor, *Dict, *List, *Call, *Tuple), by pointer
	strs    map[string]int    // strings, by value
	blobs   map[string]int    // Bytes, by value
	globals map[globalKey]int // globals, by module and name
	plan    *writePlan
}

type globalKey struct{ module, name string }

func newPickler(plan *writePlan) *pickler {
	// Sized so that the memo does not rehash as it grows through a
	// checkpoint of thousands of tensors: a node for each tensor and
	// about one more for each (a module's metadata dict), a string for
	// each tensor's key, its storage's and, about as many, its module's
	// name. Sized for the tensors alone, both grew, at 13% of the dump
	// of densenet201 (BenchmarkPickle, 2026-12-06).
	n := len(plan.tensors)
	p := &pickler{
		ptrs: make(map[any]int, 2*n+16), strs: make(map[string]int, 3*n+16),
		blobs: map[string]int{}, globals: make(map[globalKey]int, 8), plan: plan,
	}
	p.buf.Grow(192*n + 256) // densenet201: 202 KB for 1,208 tensors
	return p
}

func (p *pickler) op(b ...byte) { p.buf.Write(b) }

// uint32 writes v little-endian.
func (p *pickler) uint32(v uint32) {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	p.buf.Write(b[:])
}

// slot writes a PUT of the next memo index and returns that index.
func (p *pickler) slot() int {
	i := p.next
	p.next++
	if i < 256 {
		p.op(opBinPut, byte(i))
	} else {
		p.op(opLongBinPut)
		p.uint32(uint32(i))
	}
	return i
}

// put memoizes a node of the tree by pointer.
func (p *pickler) put(key any) { p.ptrs[key] = p.slot() }

// ref emits a memo reference to slot i, if ok.
func (p *pickler) ref(i int, ok bool) bool {
	if !ok {
		return false
	}
	if i < 256 {
		p.op(opBinGet, byte(i))
	} else {
		p.op(opLongBinGet)
		p.uint32(uint32(i))
	}
	return true
}

// get emits a memo reference if the node key was memoized before.
func (p *pickler) get(key any) bool {
	i, ok := p.ptrs[key]
	return p.ref(i, ok)
}

func (p *pickler) dump(v Value) ([]byte, error) {
	p.op(opProto, 2)
	if err := p.save(v, 0); err != nil {
		return nil, err
	}
	p.op(opStop)
	return p.buf.Bytes(), nil
}

func (p *pickler) global(module, name string) {
	k := globalKey{module, name}
	if i, ok := p.globals[k]; p.ref(i, ok) {
		return
	}
	p.op(opGlobal)
	p.buf.WriteString(module)
	p.buf.WriteByte('\n')
	p.buf.WriteString(name)
	p.buf.WriteByte('\n')
	p.globals[k] = p.slot()
}

func (p *pickler) str(s string) {
	if i, ok := p.strs[s]; p.ref(i, ok) {
		return
	}
	p.op(opBinUnicode)
	p.uint32(uint32(len(s)))
	p.buf.WriteString(s)
	p.strs[s] = p.slot()
}

func (p *pickler) int(n int64) {
	switch {
	case n >= 0 && n <= 0xff:
		p.op(opBinInt1, byte(n))
	case n >= 0 && n <= 0xffff:
		p.op(opBinInt2, byte(n), byte(n>>8))
	case n >= math.MinInt32 && n <= math.MaxInt32:
		p.op(opBinInt)
		p.uint32(uint32(int32(n)))
	default:
		p.long(big.NewInt(n))
	}
}

// long writes LONG1: minimal little-endian two's complement, as Python's
// encode_long does.
func (p *pickler) long(n *big.Int) error {
	if n.IsInt64() && n.Int64() >= math.MinInt32 && n.Int64() <= math.MaxInt32 {
		p.int(n.Int64())
		return nil
	}
	nbytes := n.BitLen()/8 + 1
	// Two's complement of n in nbytes bytes.
	mod := new(big.Int).Lsh(big.NewInt(1), uint(8*nbytes))
	v := new(big.Int).Set(n)
	if v.Sign() < 0 {
		v.Add(v, mod)
	}
	be := v.FillBytes(make([]byte, nbytes))
	le := make([]byte, nbytes)
	for i := range be {
		le[i] = be[nbytes-1-i]
	}
	if n.Sign() < 0 && nbytes > 1 && le[nbytes-1] == 0xff && le[nbytes-2]&0x80 != 0 {
		le = le[:nbytes-1]
	}
	if len(le) > 255 {
		return fmt.Errorf("integer of %d bytes is too large for LONG1", len(le))
	}
	p.op(opLong1, byte(len(le)))
	p.buf.Write(le)
	return nil
}

func (p *pickler) tuple(items []Value, depth int, key any) error {
	if len(items) == 0 {
		p.op(opEmptyTuple)
		return nil
	}
	if key != nil && p.get(key) {
		return nil
	}
	if len(items) > 3 {
		p.op(opMark)
	}
	for _, it := range items {
		if err := p.save(it, depth+1); err != nil {
			return err
		}
	}
	p.endTuple(len(items))
	if key == nil {
		p.slot() // a fresh, never-repeated memo slot
	} else {
		p.put(key)
	}
	return nil
}

// endTuple closes a tuple of n (> 0) items: TUPLE1-3 take their items off
// the stack, TUPLE takes those since the MARK written before them.
func (p *pickler) endTuple(n int) {
	switch n {
	case 1:
		p.op(opTuple1)
	case 2:
		p.op(opTuple2)
	case 3:
		p.op(opTuple3)
	default:
		p.op(opTuple)
	}
}

// ints writes xs as a tuple of ints in a memo slot never read back (a
// tensor's shape and stride), as tuple does with a nil key for the same
// ints as values, without making those.
func (p *pickler) ints(xs []int) {
	if len(xs) == 0 {
		p.op(opEmptyTuple)
		return
	}
	if len(xs) > 3 {
		p.op(opMark)
	}
	for _, x := range xs {
		p.int(int64(x))
	}
	p.endTuple(len(xs))
	p.slot()
}

const batch = 1000 // items per APPENDS/SETITEMS, as Python's pickler batches

func (p *pickler) save(v Value, depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("object tree nested deeper than %d levels", maxDepth)
	}
	switch v := v.(type) {
	case nil:
		p.op(opNone)
	case bool:
		if v {
			p.op(opNewTrue)
		} else {
			p.op(opNewFalse)
		}
	case int64:
		p.int(v)
	case *big.Int:
		return p.long(v)
	case float64:
		var b [9]byte
		b[0] = opBinFloat
		binary.BigEndian.PutUint64(b[1:], math.Float64bits(v))
		p.buf.Write(b[:])
	case string:
		p.str(v)
	case Bytes:
		// Protocol 2 from Python 3 pickles bytes as
		// _codecs.encode(latin1 text, "latin1").
		if i, ok := p.blobs[string(v)]; p.ref(i, ok) {
			return nil
		}
		p.global("_codecs", "encode")
		runes := make([]byte, 0, len(v))
		for _, b := range v {
			runes = utf8.AppendRune(runes, rune(b))
		}
		p.str(string(runes))
		p.str("latin1")
		p.op(opTuple2)
		p.slot()
		p.op(opReduce)
		p.blobs[string(v)] = p.slot()
	case *Global:
		p.global(v.Module, v.Name)
	case *Call:
		if p.get(v) {
			return nil
		}
		p.global(v.Func.Module, v.Func.Name)
		if err := p.tuple(v.Args.Items, depth, v.Args); err != nil {
			return err
		}
		p.op(opReduce)
		p.put(v)
	case *Tuple:
		return p.tuple(v.Items, depth, v)
	case *List:
		if p.get(v) {
			return nil
		}
		p.op(opEmptyList)
		p.put(v)
		for i := 0; i < len(v.Items); i += batch {
			chunk := v.Items[i:min(i+batch, len(v.Items))]
			if len(chunk) > 1 {
				p.op(opMark)
			}
			for _, it := range chunk {
				if err := p.save(it, depth+1); err != nil {
					return err
				}
			}
			if len(chunk) > 1 {
				p.op(opAppends)
			} else {
				p.op(opAppend)
			}
		}
	case *Dict:
		return p.dict(v, depth)
	case *Tensor:
		return p.tensor(v, depth)
	default:
		return fmt.Errorf("cannot pickle a value of type %T", v)
	}
	return nil
}

func (p *pickler) dict(d *Dict, depth int) error {
	if p.get(d) {
		return nil
	}
	if d.Ordered {
		p.global("collections", "OrderedDict")
		p.op(opEmptyTuple, opReduce)
	} else {
		p.op(opEmptyDict)
	}
	p.put(d)
	if err := p.items(d, depth); err != nil {
		return err
	}
	if d.State != nil && d.State.Len() > 0 {
		p.op(opEmptyDict)
		p.put(d.State)
		if err := p.items(d.State, depth); err != nil {
			return err
		}
		p.op(opBuild)
	}
	return nil
}

func (p *pickler) items(d *Dict, depth int) error {
	for i := 0; i < d.Len(); i += batch {
		end := min(i+batch, d.Len())
		if end-i > 1 {
			p.op(opMark)
		}
		for j := i; j < end; j++ {
			if err := p.save(d.keys[j], depth+1); err != nil {
				return err
			}
			if err := p.save(d.vals[j], depth+1); err != nil {
				return err
			}
		}
		if end-i > 1 {
			p.op(opSetItems)
		} else {
			p.op(opSetItem)
		}
	}
	return nil
}

// tensor writes _rebuild_tensor_v2(storage, offset, size, stride,
// requires_grad, OrderedDict()[, metadata]), wrapped in
// _rebuild_parameter(..., requires_grad, OrderedDict()) for a Parameter,
// with the storage, offset and stride the write plan gives the tensor.
func (p *pickler) tensor(t *Tensor, depth int) error {
	if p.get(t) {
		return nil
	}
	out, ok := p.plan.tensors[t]
	if !ok {
		return fmt.Errorf("internal error: tensor without a write plan")
	}
	// A copy that the plan places where its twin is (neither changed) is
	// written, as the input wrote it, as a reference to the twin.
	if t.twin != nil {
		if tw, ok := p.plan.tensors[t.twin]; ok && tw.st == out.st && tw.offset == out.offset && slices.Equal(tw.stride, out.stride) && p.get(t.twin) {
			return nil
		}
	}
	if t.Param {
		p.global("torch._utils", "_rebuild_parameter")
	}
	p.global("torch._utils", "_rebuild_tensor_v2")
	p.op(opMark)
	// Persistent id ("storage", class, key, location, numel).
	st := out.st
	p.op(opMark)
	p.str("storage")
	p.global(st.class.Module, st.class.Name)
	p.str(st.key)
	p.str(st.location)
	p.int(int64(st.numel))
	p.op(opTuple)
	p.slot()
	p.op(opBinPersID)
	p.int(int64(out.offset))
	p.ints(t.Shape)
	p.ints(out.stride)
	p.save(t.RequiresGrad, depth+1)
	p.emptyOrderedDict()
	if t.Metadata != nil {
		if err := p.save(t.Metadata, depth+1); err != nil {
			return err
		}
	}
	p.op(opTuple)
	p.slot()
	p.op(opReduce)
	if t.Param {
		p.slot()
		p.save(t.ParamRequiresGrad, depth+1)
		p.emptyOrderedDict()
		p.op(opTuple3)
		p.slot()
		p.op(opReduce)
	}
	p.put(t)
	return nil
}

func (p *pickler) emptyOrderedDict() {
	p.global("collections", "OrderedDict")
	p.op(opEmptyTuple, opReduce)
	p.slot()
}
