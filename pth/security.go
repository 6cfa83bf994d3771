package pth

import (
	"bufio"
	"embed"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// Allowed reports whether this package's reader accepts a global, spelled
// "module.name" as Scan lists it: torch 1.13's allowlist, plus what torch
// 2.x added that state-dict checkpoints use (see allowedExact). Modules
// torch blocks outright (os, posix, nt, sys) are refused whatever the name.
// What a given torch release accepts is Release.Verdict's business.
func Allowed(global string) bool { return allowedGlobal(global) }

// The weights_only unpickler of each torch release, as the release itself
// lists it: fixtures/weights_only.py writes weightsonly/torch-X.Y.txt from
// the opcodes its Unpickler.load dispatches on and its
// _get_allowed_globals(), run in torch 1.13 and in torch 2.6. Data, not
// code, so that a new release is one more file.
//
//go:embed weightsonly/torch-*.txt
var weightsOnlyFiles embed.FS

// Release is one torch release's torch.load(weights_only=True).
type Release struct {
	// Torch is the release, "1.13" or "2.6".
	Torch   string
	opcodes map[byte]bool
	globals map[string]bool
	// renames: the release maps Python 2 module names (__builtin__) to
	// Python 3 ones before looking a global up; blocked modules are
	// refused whatever the allowlist holds.
	renames bool
	blocked []string
}

// Releases lists the torch releases whose weights_only unpickler is known,
// oldest first. Parsed on first need (the security command), not at every
// start.
var Releases = sync.OnceValue(mustReleases)

func mustReleases() []*Release {
	names, err := weightsOnlyFiles.ReadDir("weightsonly")
	if err != nil {
		panic(err) // embedded at build time: cannot fail at run time
	}
	var out []*Release
	for _, n := range names {
		data, err := weightsOnlyFiles.ReadFile(path.Join("weightsonly", n.Name()))
		if err != nil {
			panic(err)
		}
		r, err := parseRelease(strings.TrimSuffix(strings.TrimPrefix(n.Name(), "torch-"), ".txt"), string(data))
		if err != nil {
			panic(fmt.Sprintf("weightsonly/%s: %v", n.Name(), err))
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return versionLess(out[i].Torch, out[j].Torch) })
	return out
}

func versionLess(a, b string) bool {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) && i < len(bs); i++ {
		x, _ := strconv.Atoi(as[i])
		y, _ := strconv.Atoi(bs[i])
		if x != y {
			return x < y
		}
	}
	return len(as) < len(bs)
}

func parseRelease(name, text string) (*Release, error) {
	r := &Release{Torch: name, opcodes: map[byte]bool{}, globals: map[string]bool{}}
	for i, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) == 0 || strings.HasPrefix(f[0], "#"):
		case f[0] == "opcode" && len(f) == 3:
			v, err := strconv.ParseUint(f[1], 0, 8)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", i+1, err)
			}
			r.opcodes[byte(v)] = true
		case f[0] == "global" && len(f) == 2:
			r.globals[f[1]] = true
		case f[0] == "renames-python2-globals" && len(f) == 1:
			r.renames = true
		case f[0] == "blocked-module" && len(f) == 2:
			r.blocked = append(r.blocked, f[1])
		default:
			return nil, fmt.Errorf("line %d: %q", i+1, line)
		}
	}
	if len(r.opcodes) == 0 || len(r.globals) == 0 {
		return nil, fmt.Errorf("no opcodes or no globals")
	}
	return r, nil
}

// eventKind is what the scanner saw that torch's weights_only unpickler
// decides on.
type eventKind byte

const (
	evOpcode eventKind = iota // an opcode: refused unless dispatched on
	evGlobal                  // GLOBAL module.name: refused unless allowlisted
	evReduce                  // REDUCE: the callable must be an allowlisted global
	evNewObj                  // NEWOBJ: the class must be allowed (1.13: Parameter only)
	evBuild                   // BUILD: the target must be a tensor, parameter or OrderedDict
	evAppend                  // APPEND(S): the target must be a list
)

// event is the first occurrence in a pickle of an opcode, a global, or an
// operand kind of the opcodes torch checks (made, as in sval).
type event struct {
	kind eventKind
	op   byte
	// name is a global as Python 3 spells it, raw as the pickle does.
	name, raw string
	made      string
	offset    int64
}

// refusal says why r refuses e, "" when it does not.
func (r *Release) refusal(e event) string {
	callee, isCall := strings.CutPrefix(e.made, "call ")
	class, isGlobal := strings.CutPrefix(e.made, "global ")
	switch e.kind {
	case evOpcode:
		if !r.opcodes[e.op] {
			return fmt.Sprintf("opcode %s (Unsupported operand %d)", opName(e.op), e.op)
		}
	case evGlobal:
		name := e.raw
		if r.renames || name == "" {
			name = e.name
		}
		mod, _, _ := strings.Cut(name, ".")
		for _, b := range r.blocked {
			if mod == b {
				return fmt.Sprintf("global %s (module %s is blocked)", name, b)
			}
		}
		if !r.globals[name] {
			return "global " + name
		}
	case evReduce:
		if !isGlobal {
			return "REDUCE on a callable that is not an allowlisted global"
		}
	case evNewObj:
		switch {
		case !isGlobal:
			return "NEWOBJ on a class that is not an allowlisted global"
		case r.Torch == "1.13" && class != "torch.nn.parameter.Parameter":
			// 1.13's NEWOBJ builds torch.nn.Parameter and nothing else.
			return "NEWOBJ of " + class + " (only torch.nn.Parameter)"
		}
	case evBuild:
		if !isCall || !r.buildable(callee) {
			what := "a value that is not a tensor, parameter or OrderedDict"
			if isCall {
				what = "the result of " + callee
			}
			return "BUILD on " + what
		}
	case evAppend:
		if e.made != "list" {
			return "APPEND to a value that is not a list"
		}
	}
	return ""
}

// Allows reports whether r's weights_only unpickler accepts a global.
func (r *Release) Allows(global string) bool {
	return r.refusal(event{kind: evGlobal, name: global}) == ""
}

// buildable reports whether BUILD may set the state of what callee
// returns: torch 1.13 builds a Tensor, a Parameter or an OrderedDict only;
// 2.x also any instance of an allowlisted class, and whatever an
// allowlisted rebuild function returns (a tensor). bytes, from
// _codecs.encode, is neither.
func (r *Release) buildable(callee string) bool {
	if !r.globals[callee] || callee == "_codecs.encode" {
		return false
	}
	if r.Torch != "1.13" {
		return true
	}
	return callee == "collections.OrderedDict" || callee == "torch.nn.parameter.Parameter" ||
		callee == "torch.Tensor" || strings.HasPrefix(callee, "torch._utils._rebuild_")
}

// Verdict is one release's torch.load(weights_only=True) on a checkpoint.
type Verdict struct {
	Torch    string `json:"torch"`
	Accepted bool   `json:"accepted"`
	// Reason is the first thing, in the order torch reads the file, that
	// it refuses ("opcode FRAME (0x95, 149)...", "global argparse.Namespace").
	Reason string `json:"reason,omitempty"`
	// Opcode (its pickletools name) or Global is what Reason refuses, when
	// it is an opcode or a global.
	Opcode string `json:"opcode,omitempty"`
	Global string `json:"global,omitempty"`
	// Part names the pickle it is in and Offset where in it.
	Part   string `json:"part,omitempty"`
	Offset int64  `json:"offset,omitempty"`
}

// Verdict tells whether r's torch.load(weights_only=True) accepts what the
// audit saw, and if not, the first reason.
func (r *Release) Verdict(a *Audit) Verdict {
	for _, p := range a.pickles {
		for _, e := range p.events {
			if why := r.refusal(e); why != "" {
				v := Verdict{Torch: r.Torch, Reason: why, Part: p.part, Offset: e.offset}
				switch e.kind {
				case evOpcode:
					v.Opcode = opName(e.op)
				case evGlobal:
					v.Global = e.name
					if !r.renames && e.raw != "" {
						v.Global = e.raw
					}
				}
				return v
			}
		}
	}
	if a.Stopped != "" {
		// Nothing refused up to where the file stops being a
		// checkpoint; torch.load fails there (a bare pickle's dict is
		// no magic number: "Invalid magic number; corrupt file?").
		return Verdict{Torch: r.Torch, Reason: "not a whole checkpoint: " + a.Stopped}
	}
	return Verdict{Torch: r.Torch, Accepted: true}
}

// Audit is what torch.load(weights_only=True) meets in a checkpoint's
// pickles, walked without being decoded or executed.
type Audit struct {
	Path   string
	Format Format
	// Protocol is the pickle protocol of the main pickle (data.pkl, or the
	// legacy format's main object), 0 when it has no PROTO opcode.
	Protocol int
	// Globals lists every global referenced, in order of first appearance.
	Globals []string
	// Stopped, when not empty, says where the file stops being a
	// checkpoint (a bare pickle, a truncated legacy file): the audit
	// covers the pickles before that point, which torch.load reads first.
	Stopped string
	pickles []auditedPickle
}

type auditedPickle struct {
	part   string
	events []event
}

// AuditFile walks a checkpoint's pickles, in the order torch.load reads
// them, for Release.Verdict. It works on files that Open refuses; err
// reports a file that cannot be walked.
func AuditFile(path string) (*Audit, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	c := &Checkpoint{Path: path, f: f, stat: st}
	a, err := c.audit()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return a, nil
}

func (c *Checkpoint) audit() (*Audit, error) {
	format, detectErr := c.detect()
	if detectErr != nil {
		// Not a checkpoint by its first bytes, but torch.load reads any
		// file that is not a zip as the legacy format, whose first pickle
		// (the magic number) it unpickles before it can tell: a bare
		// pickle named .pth runs whatever it calls. So the audit walks
		// what it can: protocols 0 and 1 (no PROTO opcode; a legacy
		// checkpoint written with them starts with the magic number as a
		// text LONG), and a bare pickle of any protocol, up to the first
		// pickle that does not parse.
		format = FormatLegacy
	}
	a := &Audit{Path: c.Path, Format: format}
	seen := map[string]bool{}
	add := func(part string, res scanned) {
		a.pickles = append(a.pickles, auditedPickle{part, res.events})
		for _, g := range res.globals {
			if !seen[g] {
				seen[g] = true
				a.Globals = append(a.Globals, g)
			}
		}
	}
	if format == FormatZip {
		z, err := c.openZip()
		if err != nil {
			return nil, err
		}
		res, err := z.readPickle(nil)
		if err != nil {
			return nil, err
		}
		a.Protocol = res.protocol
		add(z.prefix+"data.pkl", res)
		return a, nil
	}
	// The legacy format: five pickles, every one read by the weights_only
	// unpickler (magic number, protocol version, system info, the object,
	// the storage keys), then raw storages.
	size := c.stat.Size()
	br := bufio.NewReader(io.NewSectionReader(c.f, 0, size))
	var pos int64
	for i, name := range []string{"magic number", "protocol version", "system info", "main object", "storage key list"} {
		res, err := scanPickle(br, size-pos)
		if err != nil {
			if detectErr != nil && i == 0 {
				return nil, detectErr // not a pickle at all
			}
			if detectErr != nil || i > 0 {
				// What torch.load would meet up to here is judged;
				// it stops here too (an error), after running
				// whatever the pickles before called.
				before := "the one before it"
				if i > 1 {
					before = fmt.Sprintf("the %d before it", i)
				}
				a.Stopped = fmt.Sprintf("the %s pickle at byte %d does not parse (%v): torch.load stops there with an error, after unpickling %s", name, pos, err, before)
				if detectErr != nil || i == 1 {
					// One pickle and no more: no checkpoint's
					// magic number, a pickle.dump.
					a.Format = FormatBarePickle
				}
				return a, nil
			}
			return nil, fmt.Errorf("legacy %s pickle at offset %d: %w", name, pos, err)
		}
		if i == 0 || i == 3 {
			// The main object's; the first pickle's until then (a bare
			// pickle has no other).
			a.Protocol = res.protocol
		}
		add(fmt.Sprintf("the legacy %s pickle at byte %d", name, pos), res)
		pos += int64(len(res.data))
	}
	return a, nil
}

// opName is the name pickletools gives an opcode.
func opName(op byte) string {
	if n, ok := opNames[op]; ok {
		return n
	}
	return fmt.Sprintf("0x%02x", op)
}

var opNames = map[byte]string{
	'(': "MARK", '.': "STOP", '0': "POP", '1': "POP_MARK", '2': "DUP", 'F': "FLOAT", 'I': "INT",
	'J': "BININT", 'K': "BININT1", 'L': "LONG", 'M': "BININT2", 'N': "NONE", 'P': "PERSID",
	'Q': "BINPERSID", 'R': "REDUCE", 'S': "STRING", 'T': "BINSTRING", 'U': "SHORT_BINSTRING",
	'V': "UNICODE", 'X': "BINUNICODE", 'a': "APPEND", 'b': "BUILD", 'c': "GLOBAL", 'd': "DICT",
	'}': "EMPTY_DICT", 'e': "APPENDS", 'g': "GET", 'h': "BINGET", 'i': "INST", 'j': "LONG_BINGET",
	'l': "LIST", ']': "EMPTY_LIST", 'o': "OBJ", 'p': "PUT", 'q': "BINPUT", 'r': "LONG_BINPUT",
	's': "SETITEM", 't': "TUPLE", ')': "EMPTY_TUPLE", 'u': "SETITEMS", 'G': "BINFLOAT",
	0x80: "PROTO", 0x81: "NEWOBJ", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x85: "TUPLE1",
	0x86: "TUPLE2", 0x87: "TUPLE3", 0x88: "NEWTRUE", 0x89: "NEWFALSE", 0x8a: "LONG1", 0x8b: "LONG4",
	'B': "BINBYTES", 'C': "SHORT_BINBYTES", 0x8c: "SHORT_BINUNICODE", 0x8d: "BINUNICODE8",
	0x8e: "BINBYTES8", 0x8f: "EMPTY_SET", 0x90: "ADDITEMS", 0x91: "FROZENSET", 0x92: "NEWOBJ_EX",
	0x93: "STACK_GLOBAL", 0x94: "MEMOIZE", 0x95: "FRAME", 0x96: "BYTEARRAY8",
	0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}
