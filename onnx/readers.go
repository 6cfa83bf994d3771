package onnx

import (
	"fmt"
	"sort"
	"strings"
)

// What reads a parameter, for messages a user can act on: a state-dict
// tensor that the graph reads, but through ops that do not tie it to a
// modelled layer (GroupNorm's Unsqueeze and Mul, FrozenBatchNorm2d's
// Reshape, Sqrt and Div), is not "missing from the graph"; the message
// names the op and the node instead.

// Reader is one ONNX node, as a message names it.
type Reader struct {
	Node string // the node's name in the file ("/gn/Mul")
	Op   string // its op type ("Mul"), domain-qualified outside ai.onnx
	// Opaque: the IR does not model the node; Why says why.
	Opaque bool
	Why    string
}

func (r Reader) String() string {
	s := fmt.Sprintf("%s (%s)", r.Op, r.Node)
	if r.Opaque && r.Why != "" {
		s += ": " + r.Why
	}
	return s
}

func readerOf(info *nodeInfo) Reader {
	op := info.proto.GetOpType()
	if d := info.proto.GetDomain(); d != "" && d != "ai.onnx" {
		op = d + "." + op
	}
	name := info.proto.GetName()
	if name == "" {
		name = fmt.Sprintf("node %d", info.index)
	}
	return Reader{Node: name, Op: op, Opaque: info.kind == kindOpaque && !info.lowered, Why: info.why}
}

// Readers lists the nodes that compute with the initializer (or Constant)
// named value: its readers, and past nodes that read nothing but
// parameters and constants (Identity, Reshape, Unsqueeze, a Sqrt of a
// buffer), the first ones that also read a computed value. Empty when
// nothing reads it.
func (m *Model) Readers(value string) []Reader {
	seen := map[string]bool{value: true}
	frontier := []string{value}
	var out []Reader
	done := map[*nodeInfo]bool{}
	memo := map[*nodeInfo]bool{}
	for len(frontier) > 0 {
		v := frontier[0]
		frontier = frontier[1:]
		for _, info := range m.infos {
			if done[info] || !reads(info, v) {
				continue
			}
			done[info] = true
			if m.paramOnlyMemo(info, memo) {
				for _, o := range info.proto.Output {
					if o != "" && !seen[o] {
						seen[o] = true
						frontier = append(frontier, o)
					}
				}
				continue
			}
			out = append(out, readerOf(info))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Node < out[j].Node })
	return out
}

func reads(info *nodeInfo, v string) bool {
	for _, in := range info.proto.Input {
		if in == v {
			return true
		}
	}
	return false
}

// paramOnly reports a node all of whose inputs are parameters, constants
// or outputs of such nodes: a computation on parameters, not on the
// network's values.
func (m *Model) paramOnly(info *nodeInfo) bool {
	return m.paramOnlyMemo(info, map[*nodeInfo]bool{})
}

func (m *Model) paramOnlyMemo(info *nodeInfo, memo map[*nodeInfo]bool) bool {
	if v, ok := memo[info]; ok {
		return v
	}
	memo[info] = false // a cycle (malformed) is not a parameter computation
	v := m.paramOnlyInputs(info, memo)
	memo[info] = v
	return v
}

func (m *Model) paramOnlyInputs(info *nodeInfo, memo map[*nodeInfo]bool) bool {
	if info.kind == kindParam || info.kind == kindConst {
		return true
	}
	for _, in := range info.proto.Input {
		if in == "" {
			continue
		}
		if _, ok := m.params[in]; ok {
			continue
		}
		if m.isInitializer(in) {
			continue
		}
		p := m.producer[in]
		if p == nil || !m.paramOnlyMemo(p, memo) {
			return false
		}
	}
	return true
}

func (m *Model) isInitializer(name string) bool {
	for _, t := range m.proto.GetGraph().GetInitializer() {
		if t.GetName() == name {
			return true
		}
	}
	return false
}

// OpaqueInScope lists the nodes the IR does not model whose names lie in
// the scope of node (torch names a module's nodes "/gn/InstanceNormalization",
// "/gn/Mul": the scope is "/gn/"), one per op type, with a count; those
// that compute on parameters alone only with params.
func (m *Model) OpaqueInScope(node string, params bool) []string {
	i := strings.LastIndex(node, "/")
	if i <= 0 {
		return nil
	}
	scope := node[:i+1]
	count := map[string]int{}
	first := map[string]Reader{}
	memo := map[*nodeInfo]bool{}
	var ops []string
	for _, info := range m.infos {
		r := readerOf(info)
		if !r.Opaque || !strings.HasPrefix(r.Node, scope) || (!params && m.paramOnlyMemo(info, memo)) {
			continue
		}
		if count[r.Op] == 0 {
			ops = append(ops, r.Op)
			first[r.Op] = r
		}
		count[r.Op]++
	}
	sort.Strings(ops)
	out := make([]string, len(ops))
	for k, op := range ops {
		out[k] = fmt.Sprintf("%s x%d (first %s: %s)", op, count[op], first[op].Node, first[op].Why)
	}
	return out
}

// SplitKey takes apart a key the reader gave a BN-family node that reads
// the very same value as an earlier one ("bn.weight@/bn_1/BatchNormalization.weight",
// see Weights): the value and the node. ok is false for other keys.
func SplitKey(key string) (value, node string, ok bool) {
	v, rest, found := strings.Cut(key, "@")
	if !found || v == "" {
		return "", "", false
	}
	if i := strings.LastIndex(rest, "."); i > 0 {
		rest = rest[:i]
	}
	return v, rest, true
}
