// Package onnx reads ONNX models (opsets 9 to 21) losslessly into
// abnconvert's IR and writes them back after a rewrite, with the InPlace-ABN
// family either as nodes of the custom domain ai.abnconvert (DOMAIN.md) or
// as standard ops only.
//
// The model is kept as the protobuf it was read from (generated types keep
// every field, known or not), plus a map from IR nodes to the ONNX nodes
// they stand for. Ops the IR models become IR ops; every other node becomes
// an opaque IR node (op "onnx.<OpType>") that the rewrite passes treat as an
// unknown reader or producer, so that conversion still runs wherever the
// BatchNorm + activation pattern matched, and the writer emits the original
// node unchanged. Nodes and initializers the rewrite did not touch are
// written back as the very same messages, byte for byte.
//
// Multi-input and multi-output graphs: the first graph input that is not an
// initializer is the IR's input, the first graph output the IR's output.
// Further graph inputs become source nodes (op "onnx:graph_input"), further
// graph outputs sink nodes (op "onnx:graph_output") reading the value, and
// further outputs of an opaque node projection nodes (op "onnx:output"), so
// that the passes see every reader of every value and never fuse or
// overwrite one that something outside the modelled path still reads.
package onnx

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// Ops of the IR nodes that stand for ONNX constructs the IR does not model.
const (
	// OpaquePrefix starts the op of an ONNX node carried through untouched:
	// "onnx.Sigmoid", or "onnx.<domain>.<OpType>" outside the default domain.
	OpaquePrefix = "onnx."
	// OpGraphInput is a graph input other than the first.
	OpGraphInput graph.Op = "onnx:graph_input"
	// OpGraphOutput reads a graph output other than the first.
	OpGraphOutput graph.Op = "onnx:graph_output"
	// OpOutput is output k >= 1 of an opaque node; it reads output 0.
	OpOutput graph.Op = "onnx:output"
)

// IsOpaque reports whether op stands for something the IR does not model
// (an ONNX node carried through, or one of the graph-boundary nodes above):
// emitters and runtimes cannot execute such a node.
func IsOpaque(op graph.Op) bool {
	return strings.HasPrefix(string(op), OpaquePrefix) || strings.HasPrefix(string(op), "onnx:")
}

// Opsets this package reads: the default domain's versions whose
// definitions of the modelled ops it follows.
const (
	MinOpset = 9
	MaxOpset = 21
)

// Model is an ONNX model read into the IR.
type Model struct {
	// Path is the file the model was read from.
	Path string
	// Graph is the IR: modelled ops as IR ops, everything else opaque.
	Graph *graph.Graph
	// Weights is the parameter store (see Weights for what a key is).
	Weights *Weights
	// Opset is the version of the default ONNX domain the model imports.
	Opset int64

	proto *pb.ModelProto
	dir   string
	infos []*nodeInfo // one per ONNX node, by index
	byIR  map[*graph.Node]*nodeInfo
	// special are the IR nodes of graph inputs and outputs beyond the first
	// and of opaque nodes' further outputs.
	special map[*graph.Node]*special
	// valueName is the ONNX name of every IR value, as read.
	valueName map[*graph.Value]string
	params    map[string]*paramSrc
	// producer is the node that outputs each value name.
	producer map[string]*nodeInfo
	// lowered is set when nodes were dropped for running (DropZeroPads):
	// the graph no longer mirrors the file, so Write refuses.
	lowered bool
}

type nodeKind int

const (
	kindModelled nodeKind = iota
	kindOpaque
	kindParam // a parameter source: Constant, or Identity of a parameter
	kindConst // a constant this package cannot decode (e.g. a string)
	// kindFused is an inner node of an activation torch exports as several
	// nodes (see fuse): the pattern's last node stands for it in the IR.
	kindFused
)

// nodeInfo ties one ONNX node to the IR.
type nodeInfo struct {
	index int
	proto *pb.NodeProto
	kind  nodeKind
	ir    *graph.Node
	// op and attr are the IR node's as read, to detect rewrites the writer
	// cannot express.
	op   graph.Op
	attr graph.Attr
	// data[i] is the ONNX input index that IR input i stands for; -1 for an
	// implicit input (a value a subgraph of the node reads by name).
	data []int
	// implicit names the implicit inputs, in order.
	implicit []string
	// params maps a role to the ONNX input index holding that parameter.
	params map[string]int
	// why says, for an opaque node, why it is not modelled.
	why string
	// absorbed are the inner nodes of a fused pattern this node ends.
	absorbed []*nodeInfo
	// lowered: LowerLayout replaced the opaque node by IR ops, or removed
	// it (a shape computation it evaluated).
	lowered bool
}

type specialKind int

const (
	specialInput specialKind = iota
	specialOutput
	specialProjection
)

type special struct {
	kind specialKind
	name string // the ONNX value name it stands for
	info *nodeInfo
}

// paramSrc is a value whose data this package can decode: an initializer,
// a Constant's value, or an Identity of either.
type paramSrc struct {
	root string // the initializer or Constant output that holds the data
	td   *tensorData
	// node is the index of the Constant or Identity node that produces the
	// value, -1 for an initializer.
	node int
}

// ReadOptions steer Read.
type ReadOptions struct {
	// AllowEvalExport reads an eval-mode export (see EvalExportError)
	// instead of refusing it, for commands that only inspect a model.
	AllowEvalExport bool
}

// Read parses an ONNX file. It refuses eval-mode exports with an
// *EvalExportError (errors.Is(err, ErrEvalExport)).
func Read(path string) (*Model, error) { return ReadWith(path, ReadOptions{}) }

// ReadWith parses an ONNX file with options.
func ReadWith(path string, opt ReadOptions) (m *Model, err error) {
	defer func() {
		// The builder checks what it reads; a panic here is a bug, and a
		// bad file must not take the whole program down with it.
		if r := recover(); r != nil {
			m, err = nil, failure.Panic(path+": reading ONNX", r)
		}
	}()
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("onnx: %w", err)
	}
	return parse(path, b, opt)
}

func parse(path string, b []byte, opt ReadOptions) (*Model, error) {
	mp := &pb.ModelProto{}
	if err := proto.Unmarshal(b, mp); err != nil {
		return nil, fmt.Errorf("%s: %w: %v", path, ErrMalformed, err)
	}
	if mp.Graph == nil {
		return nil, fmt.Errorf("%s: %w: no graph", path, ErrMalformed)
	}
	opset, err := defaultOpset(mp)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	m := &Model{
		Path: path, Opset: opset, proto: mp, dir: filepath.Dir(path),
		byIR: map[*graph.Node]*nodeInfo{}, special: map[*graph.Node]*special{},
		valueName: map[*graph.Value]string{}, producer: map[string]*nodeInfo{},
	}
	if err := m.build(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if !opt.AllowEvalExport {
		if e := m.evalExport(); e != nil {
			return nil, e
		}
	}
	if err := m.Graph.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w: %v", path, ErrMalformed, err)
	}
	return m, nil
}

func defaultOpset(mp *pb.ModelProto) (int64, error) {
	found := false
	var v int64
	for _, o := range mp.OpsetImport {
		if o.GetDomain() == "" || o.GetDomain() == "ai.onnx" {
			if found && o.GetVersion() != v {
				return 0, fmt.Errorf("%w: two opset imports for the default domain (%d and %d)", ErrMalformed, v, o.GetVersion())
			}
			found, v = true, o.GetVersion()
		}
	}
	if !found {
		return 0, fmt.Errorf("%w: no opset import for the default ONNX domain", ErrMalformed)
	}
	if v < MinOpset || v > MaxOpset {
		return 0, fmt.Errorf("%w: opset %d of the default domain (this reader follows opsets %d to %d)", ErrUnsupported, v, MinOpset, MaxOpset)
	}
	return v, nil
}

// evalExport recognises torch's eval-mode export: Conv nodes with biases
// and no BatchNormalization fed by a Conv (torch folds every such pair; a
// BN after a pooling layer survives), with either no BN at all or Conv
// parameters named by constant folding.
func (m *Model) evalExport() error {
	e := &EvalExportError{Path: m.Path}
	bnAfterConv := 0
	for _, info := range m.infos {
		if info.proto.GetDomain() == Domain {
			return nil // converted by this tool: its BNs became ai.abnconvert nodes
		}
		switch info.proto.GetOpType() {
		case "Conv":
			if info.proto.GetDomain() != "" && info.proto.GetDomain() != "ai.onnx" {
				continue
			}
			e.Convs++
			in := info.proto.Input
			if len(in) > 2 && in[2] != "" {
				e.BiasedConvs++
			}
			for _, name := range in[min(1, len(in)):] {
				if strings.HasPrefix(name, "onnx::Conv_") || strings.HasPrefix(m.rootName(name), "onnx::Conv_") {
					e.Folded++
				}
			}
		case "BatchNormalization":
			e.BatchNorms++
			if len(info.proto.Input) > 0 {
				if p := m.producerOf(info.proto.Input[0]); p != nil && p.proto.GetOpType() == "Conv" {
					bnAfterConv++
				}
			}
		}
	}
	if e.BatchNorms == 0 && e.Folded == 0 {
		// No BN, and no Conv parameter renamed by BN folding: a network
		// without BatchNorm, not an eval export of one. It reads; a
		// conversion says there is nothing to convert (NoBatchNorm).
		return nil
	}
	if e.BiasedConvs > 0 && bnAfterConv == 0 && (e.BatchNorms == 0 || e.Folded > 0) {
		return e
	}
	return nil
}

// NoBatchNorm is a *NoBatchNormError for a network without
// BatchNormalization nodes (naming its other normalisation nodes and its
// FrozenBatchNorm2d layers), nil for one with any: what a conversion says
// instead of writing a copy.
func (m *Model) NoBatchNorm() error {
	for _, info := range m.infos {
		if info.proto.GetOpType() == "BatchNormalization" || info.proto.GetDomain() == Domain {
			return nil
		}
	}
	e := &NoBatchNormError{Path: m.Path, Frozen: m.FrozenBN()}
	count := map[string]int{}
	var ops []string
	for _, info := range m.infos {
		switch op := info.proto.GetOpType(); op {
		case "Conv":
			e.Convs++
		case "LayerNormalization", "InstanceNormalization", "GroupNormalization", "LpNormalization", "MeanVarianceNormalization":
			if count[op] == 0 {
				ops = append(ops, op)
			}
			count[op]++
		}
	}
	sort.Strings(ops)
	for _, op := range ops {
		what := ""
		if op == "InstanceNormalization" {
			what = ", GroupNorm or InstanceNorm as torch exports them"
		}
		e.Norms = append(e.Norms, fmt.Sprintf("%s x%d%s", op, count[op], what))
	}
	return e
}

// FrozenBN lists, by module path, the FrozenBatchNorm2d layers of the
// export (torchvision.ops.misc.FrozenBatchNorm2d, detection backbones):
// initializers NAME.running_mean and NAME.running_var that no
// BatchNormalization reads, which torch exports as Reshape, Add, Sqrt,
// Div and Mul on the buffers. Their statistics never move: nothing to
// convert.
func (m *Model) FrozenBN() []string {
	readByBN := map[string]bool{}
	for _, info := range m.infos {
		if info.proto.GetOpType() != "BatchNormalization" {
			continue
		}
		for _, in := range info.proto.Input {
			readByBN[in] = true
			if p, ok := m.params[in]; ok {
				readByBN[p.root] = true
			}
		}
	}
	var out []string
	for _, t := range m.proto.GetGraph().GetInitializer() {
		mod, ok := strings.CutSuffix(t.GetName(), ".running_var")
		if !ok || readByBN[t.GetName()] || mod == "" {
			continue
		}
		if len(m.Readers(t.GetName())) > 0 {
			out = append(out, mod)
		}
	}
	sort.Strings(out)
	return out
}

// producerOf is the node that outputs name, nil for graph inputs,
// initializers and unknown names.
func (m *Model) producerOf(name string) *nodeInfo { return m.producer[name] }

func (m *Model) rootName(value string) string {
	if p, ok := m.params[value]; ok {
		return p.root
	}
	return ""
}

// Initializer names the initializer (or Constant output) that really holds
// a key's data, after following Identity chains: torch's exporter
// deduplicates equal tensors, so several parameter names may share one.
func (m *Model) Initializer(key string) (string, bool) {
	p, ok := m.Weights.byKey[key]
	if !ok {
		return "", false
	}
	return p.src.root, true
}

// Shared lists the groups of keys whose data is one and the same tensor in
// the file (deduplicated by the exporter, or tied), each sorted, ordered by
// their first key. Writing one key of a group un-shares it (see Write).
func (m *Model) Shared() [][]string {
	byRoot := map[string][]string{}
	var roots []string
	for _, k := range m.Weights.order {
		r := m.Weights.byKey[k].src.root
		if _, ok := byRoot[r]; !ok {
			roots = append(roots, r)
		}
		byRoot[r] = append(byRoot[r], k)
	}
	var out [][]string
	for _, r := range roots {
		if len(byRoot[r]) > 1 {
			g := append([]string(nil), byRoot[r]...)
			sort.Strings(g)
			out = append(out, g)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out
}

// Source says which ONNX node an IR node stands for: its name (as written
// in the file, possibly empty) and op type. ok is false for IR nodes that
// stand for no ONNX node (the input, the graph-boundary nodes, nodes a
// rewrite added).
func (m *Model) Source(n *graph.Node) (name, opType string, ok bool) {
	info, ok := m.byIR[n]
	if !ok {
		return "", "", false
	}
	return info.proto.GetName(), info.proto.GetOpType(), true
}

// Opaque lists the ONNX op types carried through without being modelled,
// with how many nodes of each and why the first was not modelled.
func (m *Model) Opaque() []string {
	count := map[string]int{}
	why := map[string]string{}
	var ops []string
	for _, info := range m.infos {
		if info.kind != kindOpaque || info.lowered {
			continue
		}
		op := info.proto.GetOpType()
		if d := info.proto.GetDomain(); d != "" && d != "ai.onnx" {
			op = d + "." + op
		}
		if count[op] == 0 {
			ops = append(ops, op)
			why[op] = info.why
		}
		count[op]++
	}
	sort.Strings(ops)
	out := make([]string, len(ops))
	for i, op := range ops {
		out[i] = fmt.Sprintf("%s x%d (%s)", op, count[op], why[op])
	}
	return out
}

// ExportMode tells how torch exported the model: "train" when a
// BatchNormalization computes batch statistics (training_mode=1, or the
// running-statistics outputs of opsets before 14), "eval" when every one
// uses its running statistics, "" when it has none. torch.onnx.export with
// training=PRESERVE keeps Dropout only in train mode: an eval-mode export
// has lost every Dropout (and StochasticDepth) the network had.
func (m *Model) ExportMode() string {
	mode := ""
	for _, n := range m.proto.GetGraph().GetNode() {
		if n.GetOpType() != "BatchNormalization" || (n.GetDomain() != "" && n.GetDomain() != "ai.onnx") {
			continue
		}
		train := len(n.Output) > 1
		for _, a := range n.Attribute {
			if a.GetName() == "training_mode" && a.GetI() == 1 {
				train = true
			}
		}
		if train {
			return "train"
		}
		mode = "eval"
	}
	return mode
}

// ModulePath is the PyTorch module path of a node's parameters, read off
// its keys: "layer1.0.bn1" for a node whose keys are "layer1.0.bn1.weight",
// "layer1.0.bn1.bias", ... (torch names initializers after the parameters
// they export). It is "" when the node has no parameters or its keys do not
// agree on one path. ONNX node names ("/layer1/layer1.0/bn1/BatchNormalization")
// are scope paths, not module paths.
func ModulePath(n *graph.Node) string {
	path := ""
	for role, key := range n.Params {
		p, ok := strings.CutSuffix(key, "."+role)
		if !ok || p == "" || (path != "" && p != path) {
			return ""
		}
		path = p
	}
	return path
}
