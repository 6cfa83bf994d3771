package pth

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unsafe"
)

// Pickle opcodes this package reads or writes by name.
const (
	opMark           = '('
	opStop           = '.'
	opBinFloat       = 'G'
	opBinInt         = 'J'
	opBinInt1        = 'K'
	opBinInt2        = 'M'
	opNone           = 'N'
	opBinPersID      = 'Q'
	opReduce         = 'R'
	opBinUnicode     = 'X'
	opAppend         = 'a'
	opBuild          = 'b'
	opGlobal         = 'c'
	opEmptyDict      = '}'
	opAppends        = 'e'
	opBinGet         = 'h'
	opLongBinGet     = 'j'
	opEmptyList      = ']'
	opBinPut         = 'q'
	opLongBinPut     = 'r'
	opSetItem        = 's'
	opTuple          = 't'
	opEmptyTuple     = ')'
	opSetItems       = 'u'
	opProto          = 0x80
	opTuple1         = 0x85
	opTuple2         = 0x86
	opTuple3         = 0x87
	opNewTrue        = 0x88
	opNewFalse       = 0x89
	opLong1          = 0x8a
	opStackGlobal    = 0x93
	opMemoize        = 0x94
	maxLine          = 1 << 16
	unresolvedGlobal = "<unresolved STACK_GLOBAL>"
)

// argKind says how an opcode's inline argument is laid out.
type argKind int

const (
	argNone   argKind = iota
	argFixed          // n bytes
	argLine           // one newline-terminated line
	argLines2         // two lines (module, name)
	argLen1           // 1-byte length, then that many bytes
	argLen4           // 4-byte little-endian length, then bytes
	argLen8           // 8-byte little-endian length, then bytes
)

type opInfo struct {
	kind argKind
	n    int
}

// opcodes lists every opcode of pickle protocols 0 to 5 with its argument
// layout, so that a pickle can be walked without being executed.
var opcodes = map[byte]opInfo{
	'(': {}, '.': {}, '0': {}, '1': {}, '2': {},
	'F': {argLine, 0}, 'I': {argLine, 0}, 'J': {argFixed, 4}, 'K': {argFixed, 1},
	'L': {argLine, 0}, 'M': {argFixed, 2}, 'N': {}, 'P': {argLine, 0}, 'Q': {},
	'R': {}, 'S': {argLine, 0}, 'T': {argLen4, 0}, 'U': {argLen1, 0},
	'V': {argLine, 0}, 'X': {argLen4, 0}, 'a': {}, 'b': {}, 'c': {argLines2, 0},
	'd': {}, '}': {}, 'e': {}, 'g': {argLine, 0}, 'h': {argFixed, 1},
	'i': {argLines2, 0}, 'j': {argFixed, 4}, 'l': {}, ']': {}, 'o': {},
	'p': {argLine, 0}, 'q': {argFixed, 1}, 'r': {argFixed, 4}, 's': {}, 't': {},
	')': {}, 'u': {}, 'G': {argFixed, 8},
	0x80: {argFixed, 1}, 0x81: {}, 0x82: {argFixed, 1}, 0x83: {argFixed, 2},
	0x84: {argFixed, 4}, 0x85: {}, 0x86: {}, 0x87: {}, 0x88: {}, 0x89: {},
	0x8a: {argLen1, 0}, 0x8b: {argLen4, 0},
	'B': {argLen4, 0}, 'C': {argLen1, 0},
	0x8c: {argLen1, 0}, 0x8d: {argLen8, 0}, 0x8e: {argLen8, 0}, 0x8f: {},
	0x90: {}, 0x91: {}, 0x92: {}, 0x93: {}, 0x94: {}, 0x95: {argFixed, 8},
	0x96: {argLen8, 0}, 0x97: {}, 0x98: {},
}

// opTable is opcodes indexed by opcode (known: listed), which the scanner
// looks up once per opcode.
var opTable = func() (t [256]struct {
	opInfo
	known bool
}) {
	for op, info := range opcodes {
		t[op].opInfo, t[op].known = info, true
	}
	return t
}()

// memoTable is the scanner's memo. Picklers number entries 0, 1, 2, ...,
// so those live in a slice, which grows by one PUT at a time; any other
// index (a hand-made pickle's) goes to a map.
type memoTable struct {
	dense  []memoEntry
	sparse map[int]sval
	n      int // distinct indices stored (MEMOIZE's next index)
}

type memoEntry struct {
	v  sval
	ok bool
}

func (m *memoTable) get(i int) (sval, bool) {
	if i >= 0 && i < len(m.dense) {
		return m.dense[i].v, m.dense[i].ok
	}
	v, ok := m.sparse[i]
	return v, ok
}

func (m *memoTable) put(i int, v sval) {
	if _, ok := m.get(i); !ok {
		m.n++
	}
	switch {
	case i >= 0 && i < len(m.dense):
		m.dense[i] = memoEntry{v, true}
	case i == len(m.dense) && !m.inSparse(i):
		// (dense never grows past an index the map holds, so that each
		// index lives in one place)
		m.dense = append(m.dense, memoEntry{v, true})
	default:
		if m.sparse == nil {
			m.sparse = map[int]sval{}
		}
		m.sparse[i] = v
	}
}

func (m *memoTable) inSparse(i int) bool {
	_, ok := m.sparse[i]
	return ok
}

// Bounds on what the scanner accepts; real checkpoints are far below them.
const (
	// maxLong bounds LONG4 integers (in bytes) and maxDigits text integers
	// (INT, LONG): Python writes LONG4 only for integers of more than 255
	// bytes, which no checkpoint holds; Python 3.11 itself refuses to parse
	// integers of more than 4300 digits, because converting huge integers
	// between binary and decimal takes quadratic time.
	maxLong   = 1 << 12
	maxDigits = 4300
	// maxKeyString bounds the strings the scanner remembers; longer ones
	// are neither module nor class names nor state-dict keys.
	maxKeyString = 1 << 12
	// readChunk is the most the scanner allocates ahead of data actually
	// read, so that a length field alone cannot claim memory.
	readChunk = 1 << 20
)

// sval is what the scanner knows of one stack value: a short string, an
// integer, or the identity of a mutable object, which is enough to resolve
// STACK_GLOBAL exactly and to see a dict key set twice. It is kept small
// (one word of kind, one of number, a string), because the stack and the
// memo hold tens of thousands of them.
type sval struct {
	kind byte // 's' string, 'i' integer, 'o' object, 0 anything else
	// n is an integer's value, or an object's identity.
	n int64
	// s is a string's value, or, for an object, how it came to be (made).
	s string
}

// made says how an object came to be, for the checks torch's weights_only
// unpickler makes on the value an opcode acts on (see event): "list"
// (EMPTY_LIST), "global NAME", "call NAME" (REDUCE or NEWOBJ of the global
// NAME), "" for anything else, and for anything but an object.
func (v sval) made() string {
	if v.kind == 'o' {
		return v.s
	}
	return ""
}

// dictKey is a plain key set in one dict (the dict's identity, the key's
// kind and value), for the scanner's duplicate-key check.
type dictKey struct {
	dict int64
	kind byte
	n    int64
	s    string
}

// memoEntrySize is the size of a memoEntry, for presizing the memo.
const memoEntrySize = int64(unsafe.Sizeof(memoEntry{}))

// dupKeyError reports a dict key set twice (see scanned.dupKey).
type dupKeyError struct{ msg string }

func (e *dupKeyError) Error() string { return e.msg }

// scanned is the result of walking one pickle.
type scanned struct {
	data    []byte
	globals []string
	// dupKey reports a dict key set twice in the same dict, which Python's
	// dict silently merges: a reader that keeps the first value and one
	// that keeps the last would then disagree about the checkpoint. It is
	// Open's business to refuse; Scan still lists the globals.
	dupKey error
	// protocol is the argument of the pickle's PROTO opcode, 0 without one.
	protocol int
	// memo is the number of memo entries the pickle stores, for sizing a
	// decoder's memo.
	memo int
	// events lists, in stream order, the first occurrence of every opcode,
	// global and checked operand of the pickle (see event).
	events []event
	// frameReach is the furthest offset a FRAME opcode said its frame
	// ends at (0 without one): a scan with a smaller limit refuses a
	// frame that ends past it (loadZip's pickle read ahead).
	frameReach int64
}

// scanPickle walks one pickle from r up to and including its STOP opcode,
// without executing it: it simulates the unpickler's stack with opaque
// values, exactly as Python's unpickler moves them, so that STACK_GLOBAL
// operands (strings pushed directly or fetched from the memo) resolve as
// they would when loading. It returns the pickle's bytes and every global
// referenced (normalised as torch normalises protocol-2 names, in order of
// first appearance).
//
// It refuses, before allocating for them, length fields and frames that
// run past limit bytes, memo references to entries never stored, stack
// underflows, and integers larger than maxLong bytes; everything it refuses
// Python's unpickler refuses too, except the last.
func scanPickle(r *bufio.Reader, limit int64) (res scanned, err error) {
	return scan(r, nil, limit)
}

// scanPickleBytes is scanPickle of a pickle read whole beforehand, b (its
// limit len(b)): the same walk and the same answers, without reading the
// bytes one at a time through a reader. The result's data is a prefix of
// b. On densenet201's 202 KB pickle, the first thing on a conversion's
// path, the reads were a third of the scan (BenchmarkScan).
func scanPickleBytes(b []byte) (scanned, error) {
	return scan(nil, b, int64(len(b)))
}

// scan is scanPickle, reading from r, or from mem where that is not nil.
func scan(r *bufio.Reader, mem []byte, limit int64) (res scanned, err error) {
	var buf []byte
	if mem != nil {
		buf = mem[:0:len(mem)]
	} else {
		buf = make([]byte, 0, min(max(limit, 0), readChunk))
	}
	seen := map[string]bool{}
	addGlobal := func(name string) {
		if !seen[name] {
			seen[name] = true
			res.globals = append(res.globals, name)
		}
	}
	read := func(n int64) ([]byte, error) {
		if n < 0 || n > limit-int64(len(buf)) {
			return nil, fmt.Errorf("pickle field of %d bytes at offset %d runs past the end of the data", n, len(buf))
		}
		start := len(buf)
		if mem != nil { // the whole pickle in hand: n is within it (above)
			buf = buf[:start+int(n)]
			return buf[start:], nil
		}
		if n == 1 { // an opcode: most reads
			b, err := r.ReadByte()
			if err != nil {
				return nil, fmt.Errorf("pickle truncated at offset %d: %w", start, err) // io.EOF, as io.ReadFull says
			}
			buf = append(buf, b)
			return buf[start:], nil
		}
		if n <= 8 { // fixed arguments and length fields, byte by byte
			for k := int64(0); k < n; k++ {
				b, err := r.ReadByte()
				if err != nil {
					if err == io.EOF && k > 0 {
						err = io.ErrUnexpectedEOF // as io.ReadFull says
					}
					return nil, fmt.Errorf("pickle truncated at offset %d: %w", start, err)
				}
				buf = append(buf, b)
			}
			return buf[start:], nil
		}
		// Grow as bytes arrive, so that a length the data cannot back
		// costs at most one chunk.
		for left := n; left > 0; {
			c := min(left, readChunk)
			buf = append(buf, make([]byte, c)...)
			if _, err := io.ReadFull(r, buf[len(buf)-int(c):]); err != nil {
				return nil, fmt.Errorf("pickle truncated at offset %d: %w", start, err)
			}
			left -= c
		}
		return buf[start:], nil
	}
	readLine := func() (string, error) {
		start := len(buf)
		for {
			b, err := read(1)
			if err != nil {
				return "", err
			}
			if b[0] == '\n' {
				return string(buf[start : len(buf)-1]), nil
			}
			if len(buf)-start > maxLine {
				return "", fmt.Errorf("pickle line at offset %d longer than %d bytes", start, maxLine)
			}
		}
	}

	// The stack is one slice; MARK records where the current frame starts
	// (Python's metastack), so that a frame costs no slice of its own.
	var (
		stack  = make([]sval, 0, 64)
		marks  []int
		base   = 0 // where the current frame starts in stack
		memo   memoTable
		nextID = int64(0)
		// keys is sized for a dict key per 64 bytes of pickle, more than a
		// state dict holds (densenet201: 2,633 in 202 KB, its metadata's
		// included), and at most 4,096 keys (about 200 KB), since limit may
		// be a whole legacy file's size: grown from empty it rehashed, 0.2
		// ms of a scan of 1.5 (BenchmarkAnalysis).
		keys      = make(map[dictKey]struct{}, min(max(limit, 0)/64, 1<<12))
		calls     = map[string]string{} // "global NAME" -> "call NAME", made once
		frameEnd  = int64(0)
		opStart   = 0
		malformed = func(format string, args ...any) error {
			return fmt.Errorf("malformed pickle at offset %d: %s", opStart, fmt.Sprintf(format, args...))
		}
	)
	seenEvent := map[event]bool{}
	var seenOp [256]bool // the opcode events, one per opcode: the common case, without hashing an event
	// note adds e where its kind and operands are new. Opcode events,
	// one per opcode of the stream, are looked up by opcode alone
	// (seenOp) before one is made.
	note := func(e event) {
		e.offset = int64(opStart)
		key := e
		key.offset = 0
		if !seenEvent[key] {
			seenEvent[key] = true
			res.events = append(res.events, e)
		}
	}
	// Picklers memoize nearly every object they write; one entry per 16
	// bytes of pickle is more than torch writes, and the guess is bounded
	// like any allocation made ahead of the data (readChunk).
	memo.dense = make([]memoEntry, 0, min(max(limit, 0)/16, readChunk/memoEntrySize))
	object := func() sval { nextID++; return sval{kind: 'o', n: nextID} }
	// global lists a global and makes the value GLOBAL pushes.
	global := func(module, name string) sval {
		raw := module + "." + name
		if module == "" {
			raw = name
		} else {
			name = normalizeGlobal(module, name)
		}
		addGlobal(name)
		note(event{kind: evGlobal, name: name, raw: raw})
		g := object()
		g.s = "global " + name
		return g
	}
	// called marks obj as made by calling (REDUCE, NEWOBJ, INST) fn.
	called := func(obj, fn sval) sval {
		made := fn.made()
		if call, ok := calls[made]; ok {
			obj.s = call
		} else if name, ok := strings.CutPrefix(made, "global "); ok {
			obj.s = "call " + name
			calls[made] = obj.s
		}
		return obj
	}
	push := func(v sval) { stack = append(stack, v) }
	// pop and top see the current frame only, as Python's unpickler does.
	pop := func(what string) (sval, error) {
		if len(stack) == base {
			return sval{}, malformed("%s on an empty stack", what)
		}
		v := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		return v, nil
	}
	top := func(what string) (sval, error) {
		if len(stack) == base {
			return sval{}, malformed("%s on an empty stack", what)
		}
		return stack[len(stack)-1], nil
	}
	// popMark ends the current frame and returns its items, which stay
	// valid until the next push.
	popMark := func(what string) ([]sval, error) {
		if len(marks) == 0 {
			return nil, malformed("%s without a MARK", what)
		}
		items := stack[base:]
		stack = stack[:base]
		base = marks[len(marks)-1]
		marks = marks[:len(marks)-1]
		return items, nil
	}
	setKey := func(d, k sval) {
		if d.kind != 'o' || (k.kind != 's' && k.kind != 'i') || res.dupKey != nil {
			return
		}
		hk := dictKey{dict: d.n, kind: k.kind, n: k.n, s: k.s}
		if _, dup := keys[hk]; dup {
			name := strconv.FormatInt(k.n, 10)
			if k.kind == 's' {
				name = strconv.Quote(k.s)
			}
			res.dupKey = &dupKeyError{fmt.Sprintf("dict key %s is set twice in one dict (pickle offset %d)", name, opStart)}
			return
		}
		keys[hk] = struct{}{}
	}
	str := func(s string) sval {
		if len(s) > maxKeyString {
			return sval{}
		}
		return sval{kind: 's', s: s}
	}
	integer := func(n int64) sval { return sval{kind: 'i', n: n} }
	memoIndex := func(line string) (int, error) {
		i, err := strconv.Atoi(line)
		if err != nil || i < 0 {
			return 0, malformed("memo index %q", line)
		}
		return i, nil
	}
	get := func(i int) error {
		v, ok := memo.get(i)
		if !ok {
			return malformed("memo entry %d was never stored", i)
		}
		push(v)
		return nil
	}
	put := func(i int) error {
		v, err := top("PUT")
		if err != nil {
			return err
		}
		memo.put(i, v)
		return nil
	}

	for {
		opStart = len(buf)
		b, err := read(1)
		if err != nil {
			return res, err
		}
		op := b[0]
		info := opTable[op]
		if !info.known {
			return res, fmt.Errorf("unknown pickle opcode 0x%02x at offset %d", op, opStart)
		}
		if !seenOp[op] {
			seenOp[op] = true
			note(event{kind: evOpcode, op: op})
		}
		var arg []byte
		var lines [2]string
		switch info.kind {
		case argFixed:
			arg, err = read(int64(info.n))
		case argLine:
			lines[0], err = readLine()
		case argLines2:
			if lines[0], err = readLine(); err == nil {
				lines[1], err = readLine()
			}
		case argLen1:
			var l []byte
			if l, err = read(1); err == nil {
				arg, err = read(int64(l[0]))
			}
		case argLen4:
			var l []byte
			if l, err = read(4); err == nil {
				n := int64(binary.LittleEndian.Uint32(l))
				if op == 'T' || op == 0x8b {
					n = int64(int32(binary.LittleEndian.Uint32(l)))
				}
				if op == 0x8b && n > maxLong {
					return res, fmt.Errorf("pickle integer of %d bytes at offset %d: larger than any checkpoint holds", n, opStart)
				}
				arg, err = read(n)
			}
		case argLen8:
			var l []byte
			if l, err = read(8); err == nil {
				n := binary.LittleEndian.Uint64(l)
				if n > uint64(limit) {
					return res, fmt.Errorf("pickle field of %d bytes at offset %d runs past the end of the data", n, opStart)
				}
				arg, err = read(int64(n))
			}
		}
		if err != nil {
			return res, err
		}
		if (op == 'I' || op == 'L') && len(lines[0]) > maxDigits+2 {
			return res, fmt.Errorf("pickle integer of %d digits at offset %d: more than the %d Python accepts", len(lines[0]), opStart, maxDigits)
		}
		le := binary.LittleEndian
		switch op {
		case opMark:
			marks = append(marks, base)
			base = len(stack)
		case opStop:
			if _, err := pop("STOP"); err != nil {
				return res, err
			}
			if frameEnd > int64(len(buf)) {
				return res, fmt.Errorf("pickle FRAME ends at offset %d, after the STOP at offset %d", frameEnd, opStart)
			}
			res.data, res.memo = buf, memo.n
			return res, nil
		case '0': // POP: pops the mark when the frame is empty
			if len(stack) == base {
				_, err = popMark("POP")
			} else {
				stack = stack[:len(stack)-1]
			}
		case '1': // POP_MARK
			_, err = popMark("POP_MARK")
		case '2': // DUP
			var v sval
			if v, err = top("DUP"); err == nil {
				push(v)
			}
		case 'I':
			switch lines[0] {
			case "00":
				push(integer(0))
			case "01":
				push(integer(1))
			default:
				if n, perr := strconv.ParseInt(lines[0], 10, 64); perr == nil {
					push(integer(n))
				} else {
					push(sval{})
				}
			}
		case 'L':
			if n, perr := strconv.ParseInt(strings.TrimSuffix(lines[0], "L"), 10, 64); perr == nil {
				push(integer(n))
			} else {
				push(sval{})
			}
		case opBinInt:
			push(integer(int64(int32(le.Uint32(arg)))))
		case opBinInt1:
			push(integer(int64(arg[0])))
		case opBinInt2:
			push(integer(int64(le.Uint16(arg))))
		case opLong1, 0x8b:
			if len(arg) <= 8 {
				var n int64
				for i := len(arg) - 1; i >= 0; i-- {
					n = n<<8 | int64(arg[i])
				}
				if len(arg) > 0 && len(arg) < 8 && arg[len(arg)-1]&0x80 != 0 {
					n -= 1 << (8 * len(arg))
				}
				push(integer(n))
			} else {
				push(sval{})
			}
		case opNewTrue:
			push(integer(1))
		case opNewFalse:
			push(integer(0))
		case 'F', opBinFloat, opNone, 'P', 'S', 'B', 'C', 0x8e, 0x96, 0x97, opEmptyTuple:
			push(sval{})
		case opBinUnicode, 'U', 'T', 0x8c, 0x8d:
			push(str(string(arg)))
		case 'V':
			push(str(lines[0]))
		case opBinPersID:
			if _, err = pop("BINPERSID"); err == nil {
				push(object())
			}
		case opReduce:
			if _, err = pop("REDUCE"); err == nil {
				var fn sval
				if fn, err = pop("REDUCE"); err == nil {
					note(event{kind: evReduce, made: fn.made()})
					push(called(object(), fn))
				}
			}
		case opAppend:
			if _, err = pop("APPEND"); err == nil {
				var l sval
				if l, err = top("APPEND"); err == nil {
					note(event{kind: evAppend, made: l.made()})
				}
			}
		case opBuild:
			if _, err = pop("BUILD"); err == nil {
				var inst sval
				if inst, err = top("BUILD"); err == nil {
					note(event{kind: evBuild, made: inst.made()})
				}
			}
		case opGlobal:
			push(global(lines[0], lines[1]))
		case 'i': // INST
			g := global(lines[0], lines[1])
			if _, err = popMark("INST"); err == nil {
				push(called(object(), g))
			}
		case 'd': // DICT
			var items []sval
			if items, err = popMark("DICT"); err == nil {
				if len(items)%2 != 0 {
					err = malformed("DICT with an odd number of items")
					break
				}
				d := object()
				for i := 0; i+1 < len(items); i += 2 {
					setKey(d, items[i])
				}
				push(d)
			}
		case opEmptyDict, 0x8f:
			push(object())
		case opEmptyList:
			l := object()
			l.s = "list"
			push(l)
		case opAppends, 0x90: // APPENDS, ADDITEMS
			if _, err = popMark("APPENDS"); err == nil {
				var l sval
				if l, err = top("APPENDS"); err == nil && op == opAppends {
					note(event{kind: evAppend, made: l.made()})
				}
			}
		case 'g':
			var i int
			if i, err = memoIndex(lines[0]); err == nil {
				err = get(i)
			}
		case opBinGet:
			err = get(int(arg[0]))
		case opLongBinGet:
			err = get(int(le.Uint32(arg)))
		case 'l', opTuple, 0x91: // LIST, TUPLE, FROZENSET
			if _, err = popMark("LIST/TUPLE"); err == nil {
				push(object())
			}
		case 'o': // OBJ
			var items []sval
			if items, err = popMark("OBJ"); err == nil {
				if len(items) == 0 {
					err = malformed("OBJ without a class")
					break
				}
				push(object())
			}
		case 'p':
			var i int
			if i, err = memoIndex(lines[0]); err == nil {
				err = put(i)
			}
		case opBinPut:
			err = put(int(arg[0]))
		case opLongBinPut:
			err = put(int(le.Uint32(arg)))
		case opMemoize:
			err = put(memo.n)
		case opSetItem:
			var k, v, d sval
			if v, err = pop("SETITEM"); err == nil {
				if k, err = pop("SETITEM"); err == nil {
					if d, err = top("SETITEM"); err == nil {
						setKey(d, k)
					}
				}
			}
			_ = v
		case opSetItems:
			var items []sval
			if items, err = popMark("SETITEMS"); err == nil {
				if len(items)%2 != 0 {
					err = malformed("SETITEMS with an odd number of items")
					break
				}
				var d sval
				if d, err = top("SETITEMS"); err == nil {
					for i := 0; i+1 < len(items); i += 2 {
						setKey(d, items[i])
					}
				}
			}
		case opProto:
			if res.protocol == 0 {
				res.protocol = int(arg[0])
			}
		case 0x81: // NEWOBJ
			if _, err = pop("NEWOBJ"); err == nil {
				var cls sval
				if cls, err = pop("NEWOBJ"); err == nil {
					note(event{kind: evNewObj, made: cls.made()})
					push(called(object(), cls))
				}
			}
		case 0x92: // NEWOBJ_EX
			for i := 0; i < 3 && err == nil; i++ {
				_, err = pop("NEWOBJ_EX")
			}
			if err == nil {
				push(object())
			}
		case 0x82, 0x83, 0x84:
			// The copyreg extension registry maps codes to globals.
			push(global("", "<extension registry code>"))
		case opTuple1, opTuple2, opTuple3:
			for i := 0; i < int(op-opTuple1)+1 && err == nil; i++ {
				_, err = pop("TUPLE1/2/3")
			}
			if err == nil {
				push(object())
			}
		case opStackGlobal:
			var name, module sval
			if name, err = pop("STACK_GLOBAL"); err == nil {
				if module, err = pop("STACK_GLOBAL"); err == nil {
					if name.kind == 's' && module.kind == 's' {
						push(global(module.s, name.s))
					} else {
						// Python refuses non-string operands; listing the
						// global as unresolved makes the allowlist refuse too.
						push(global("", unresolvedGlobal))
					}
				}
			}
		case 0x95: // FRAME: the frame's bytes must follow within the data
			n := le.Uint64(arg)
			if n > uint64(limit-int64(len(buf))) {
				return res, fmt.Errorf("pickle FRAME of %d bytes at offset %d runs past the end of the data", n, opStart)
			}
			frameEnd = int64(len(buf)) + int64(n)
			res.frameReach = max(res.frameReach, frameEnd)
		case 0x98: // READONLY_BUFFER
			_, err = top("READONLY_BUFFER")
		default:
			return res, fmt.Errorf("internal error: pickle opcode 0x%02x has no stack rule", op)
		}
		if err != nil {
			return res, err
		}
	}
}

// normalizeGlobal applies the renames Python 3 applies to protocol-2
// pickles written by Python 2 (and torch's loader applies too), so that the
// allowlist sees one spelling.
func normalizeGlobal(module, name string) string {
	switch module {
	case "__builtin__", "exceptions":
		module = "builtins"
	case "copy_reg":
		module = "copyreg"
	}
	return module + "." + name
}

// RefusedError reports a pickle that references globals outside the
// allowlist of torch.load(weights_only=True). Nothing of it was executed or
// decoded.
type RefusedError struct {
	File string
	// Part names the pickle: "data.pkl" in a zip checkpoint, "the pickle"
	// in a legacy one.
	Part string
	// Refused lists the globals outside the allowlist; Globals lists every
	// global the pickle references.
	Refused []string
	Globals []string
}

func (e *RefusedError) Error() string {
	what := "global"
	if len(e.Refused) > 1 {
		what = "globals"
	}
	names := ""
	for i, g := range e.Refused {
		if i > 0 {
			names += ", "
		}
		names += g
	}
	return fmt.Sprintf("%s: %s references %s %s, which torch.load(weights_only=True) refuses", e.File, e.Part, what, names)
}

// refused returns the globals of list that the allowlist does not accept.
func refused(list []string) []string {
	var out []string
	for _, g := range list {
		if !allowedGlobal(g) {
			out = append(out, g)
		}
	}
	return out
}

var errNotPickle = errors.New("not a PyTorch checkpoint (neither a zip archive nor a legacy pickle)")
