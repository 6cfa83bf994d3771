package pth

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strconv"
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

// scanPickle walks one pickle from r up to and including its STOP opcode,
// without executing it, and returns the pickle's bytes and every global it
// references (normalised as torch normalises protocol-2 names, in order of
// first appearance). It refuses any length that runs past limit bytes, so
// that a hostile length field cannot make the decoder allocate gigabytes.
func scanPickle(r *bufio.Reader, limit int64) (data []byte, globals []string, err error) {
	var buf []byte
	seen := map[string]bool{}
	addGlobal := func(name string) {
		if !seen[name] {
			seen[name] = true
			globals = append(globals, name)
		}
	}
	read := func(n int64) ([]byte, error) {
		if n < 0 || int64(len(buf))+n > limit {
			return nil, fmt.Errorf("pickle field of %d bytes at offset %d runs past the end of the data", n, len(buf))
		}
		start := len(buf)
		buf = append(buf, make([]byte, n)...)
		if _, err := io.ReadFull(r, buf[start:]); err != nil {
			return nil, fmt.Errorf("pickle truncated at offset %d: %w", start, err)
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
	// STACK_GLOBAL takes module and name from the stack. Python's pickler
	// pushes both right before it (as strings or memo gets), so tracking the
	// last pushed values and the memo's strings resolves it; anything else
	// is reported as unresolved, which the allowlist refuses.
	type pushed struct {
		s  string
		ok bool
	}
	var recent []pushed
	memo := map[uint64]pushed{}
	push := func(p pushed) {
		recent = append(recent, p)
		if len(recent) > 8 {
			recent = recent[1:]
		}
	}
	top := func() pushed {
		if len(recent) == 0 {
			return pushed{}
		}
		return recent[len(recent)-1]
	}
	for {
		b, err := read(1)
		if err != nil {
			return nil, globals, err
		}
		op := b[0]
		info, ok := opcodes[op]
		if !ok {
			return nil, globals, fmt.Errorf("unknown pickle opcode 0x%02x at offset %d", op, len(buf)-1)
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
				arg, err = read(n)
			}
		case argLen8:
			var l []byte
			if l, err = read(8); err == nil {
				n := binary.LittleEndian.Uint64(l)
				if n > uint64(limit) {
					return nil, globals, fmt.Errorf("pickle field of %d bytes runs past the end of the data", n)
				}
				arg, err = read(int64(n))
			}
		}
		if err != nil {
			return nil, globals, err
		}
		switch op {
		case 'c', 'i':
			addGlobal(normalizeGlobal(lines[0], lines[1]))
			push(pushed{})
		case opStackGlobal:
			if len(recent) >= 2 && recent[len(recent)-2].ok && recent[len(recent)-1].ok {
				addGlobal(normalizeGlobal(recent[len(recent)-2].s, recent[len(recent)-1].s))
			} else {
				addGlobal(unresolvedGlobal)
			}
			push(pushed{})
		case 0x82, 0x83, 0x84:
			// The copyreg extension registry maps codes to globals.
			addGlobal("<extension registry code>")
			push(pushed{})
		case 'X', 'U', 0x8c, 0x8d, 'T':
			push(pushed{string(arg), true})
		case 'V', 'S':
			push(pushed{lines[0], true})
		case 'h':
			push(memo[uint64(arg[0])])
		case 'j':
			push(memo[uint64(binary.LittleEndian.Uint32(arg))])
		case 'g':
			i, _ := strconv.ParseUint(lines[0], 10, 64)
			push(memo[i])
		case 'q':
			memo[uint64(arg[0])] = top()
		case 'r':
			memo[uint64(binary.LittleEndian.Uint32(arg))] = top()
		case 'p':
			i, _ := strconv.ParseUint(lines[0], 10, 64)
			memo[i] = top()
		case opMemoize:
			memo[uint64(len(memo))] = top()
		case opStop:
			return buf, globals, nil
		default:
			push(pushed{})
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
