package onnx

import (
	"fmt"
	"path/filepath"

	"google.golang.org/protobuf/proto"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
	"github.com/abnconvert/abnconvert/output"
)

// Domain is the custom operator domain of the InPlace-ABN family
// (DOMAIN.md), imported at DomainVersion.
const (
	Domain        = "ai.abnconvert"
	DomainVersion = 1
	// MetaRecompute is the metadata_props key listing the DenseNet
	// recomputation groups: a JSON object from group name to the names of
	// the ONNX nodes in it.
	MetaRecompute = "ai.abnconvert.recompute_groups"
)

// WriteOptions steer Write.
type WriteOptions struct {
	// StandardOps writes standard ONNX ops only: each ABN-family node
	// becomes [Mul by its sign vector] + BatchNormalization (scale
	// |weight| + eps for the in-place ops, weight as stored for ABN) + its
	// activation (LeakyRelu, Elu, Relu, or nothing for identity). The
	// result computes what the converted network computes and runs
	// anywhere; the in-place memory saving is the training runtime's.
	StandardOps bool
	// FoldForInference (implies StandardOps) folds each BN into the Conv
	// before it where that Conv feeds nothing else: an inference graph.
	FoldForInference bool
	// Force overwrites an existing output file. The model's own file is
	// never overwritten.
	Force bool
	// Sync flushes the file to disk before renaming it into place (see
	// output.Options).
	Sync bool
	// Metadata are metadata_props entries to write, replacing those of the
	// same key the model has (abnconvert's provenance record).
	Metadata map[string]string
}

// Metadata is the model's metadata_props entry key, as read.
func (m *Model) Metadata(key string) (string, bool) {
	for _, kv := range m.proto.GetMetadataProps() {
		if kv.GetKey() == key {
			return kv.GetValue(), true
		}
	}
	return "", false
}

// maxProto is protobuf's 2 GiB message limit.
const maxProto = 1<<31 - 1

// Write writes the model, with whatever rewrite its Graph and Weights went
// through, to path as a one-file output set (package output): atomically (a
// temporary file renamed into place, removed on failure or a signal), never
// over the input model, and over another existing file only with Force.
//
// What changes and what does not:
//   - Nodes the rewrite did not touch are written as read, and initializers
//     whose values did not change keep their bytes. External data stays
//     external when path is in the model's directory (the output then
//     refers to the same data files) and is inlined otherwise.
//   - A BatchNormalization that became an ABN-family node is written as one
//     ai.abnconvert node replacing it and the activation fused into it
//     (which takes the activation's output name, so readers are
//     unchanged), or as standard ops (see WriteOptions). One that adds a
//     residual (graph.Node.Residual, the Add the rewrite fused into it) is
//     written so, then the model's own Add after it, as read.
//   - A key whose values changed is written where only its own readers see
//     it: in place when nothing else reads its value; otherwise, when the
//     exporter deduplicated that tensor (the same initializer read by
//     several parameters, directly or through Identity chains) or weights
//     are tied, the changed tensor gets a new initializer "<name>_abn" and
//     the nodes that own the key are re-pointed to it, so that the other
//     readers keep the original values.
//   - DenseNet recomputation marks are the recompute_group attribute of the
//     ai.abnconvert nodes and the MetaRecompute metadata entry.
//
// Rewrites the writer cannot express (nodes a rewrite added, changed
// attributes, ops changed other than BN to the ABN family) are refused
// with an error naming the node.
func (m *Model) Write(path string, opt WriteOptions) error {
	set := output.New(output.Options{Force: opt.Force, Sync: opt.Sync})
	defer set.Abort()
	if err := m.Stage(set, path, opt); err != nil {
		return err
	}
	return set.Commit()
}

// Stage writes the model (see Write) into a new output of set at path; it
// is renamed into place when the set commits. opt.Force and opt.Sync are
// the set's to decide and are ignored here. Neither the model's file nor
// any external data file it reads can be an output.
func (m *Model) Stage(set *output.Set, path string, opt WriteOptions) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = failure.Panic(path+": writing ONNX", r)
		}
	}()
	if opt.FoldForInference {
		opt.StandardOps = true
	}
	if m.lowered {
		return fmt.Errorf("%s: writing %s: the model was lowered for running (DropZeroPads); read it again to write it", m.Path, path)
	}
	set.Protect(m.Path)
	for _, p := range m.params {
		if p.td.ext != nil {
			set.Protect(p.td.ext.path)
		}
	}
	// Refuse the destination before the work of assembling the output.
	f, err := set.Create(path)
	if err != nil {
		return err
	}
	dataName := filepath.Base(path) + ".data"
	out, writes, err := m.output(filepath.Dir(path), dataName, opt)
	if err != nil {
		return fmt.Errorf("%s: writing %s: %w", m.Path, path, err)
	}
	if len(writes) > 0 {
		if err := writeExternal(set, filepath.Join(filepath.Dir(path), dataName), writes); err != nil {
			return err
		}
	}
	b, err := proto.Marshal(out)
	if err != nil {
		return fmt.Errorf("%s: encoding: %w", path, err)
	}
	if len(b) > maxProto {
		return fmt.Errorf("%s: %w: the model is %d bytes, over protobuf's 2 GiB limit", path, ErrUnsupported, len(b))
	}
	if _, err := f.Write(b); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// slotRef is input k of ONNX node i.
type slotRef struct{ node, input int }

// writer assembles the output model.
type writer struct {
	m   *Model
	opt WriteOptions
	g   *graph.Graph

	alive map[*graph.Node]bool
	// name is the ONNX name of every live IR value in the output.
	name map[*graph.Value]string
	// act is the activation node fused into each ABN-family node, if any.
	act map[*graph.Node]*nodeInfo
	// fold maps a folded ABN-family node to the Conv it folds into.
	fold map[*graph.Node]*graph.Node
	// residual maps an InPlaceABN node that adds a residual
	// (graph.Node.Residual) to the ONNX Add it replaced, which is written
	// after it again: ONNX consumers see InPlaceABN (or its standard or
	// folded form) then Add, the same function.
	residual map[*graph.Node]*nodeInfo

	taken    map[string]bool // value and node names in use
	repoint  map[slotRef]string
	drop     map[int]bool               // ONNX nodes not written
	replace  map[int][]*pb.NodeProto    // ONNX node i written as these instead
	inPlace  map[string]*pb.TensorProto // initializer replaced under its own name
	newInits []*pb.TensorProto          // appended initializers
	derived  map[slotRef][]float64      // slots whose data the writer computes
	outputs  map[string]bool            // graph output names
	custom   bool                       // an ai.abnconvert node was written
	groups   map[string][]string        // recompute group -> ONNX node names

	// external maps a changed initializer whose source is external data
	// to its parameter: its bytes are made when written. dataName is the
	// output's own data file (beside it) and extWrites what goes there.
	external  map[*pb.TensorProto]*param
	dataName  string
	extWrites []extWrite
}

// extWrite is one changed tensor of the output's data file: its bytes (the
// source's, sign flips applied) at offset.
type extWrite struct {
	p      *param
	offset int64
}

// output assembles the model to write into outDir; dataName is the file
// beside it that changed external tensors are written to (w.extWrites).
func (m *Model) output(outDir, dataName string, opt WriteOptions) (*pb.ModelProto, []extWrite, error) {
	w := &writer{
		external: map[*pb.TensorProto]*param{}, dataName: dataName,
		m: m, opt: opt, g: m.Graph,
		alive: map[*graph.Node]bool{}, name: map[*graph.Value]string{}, act: map[*graph.Node]*nodeInfo{},
		fold: map[*graph.Node]*graph.Node{}, residual: map[*graph.Node]*nodeInfo{},
		taken: map[string]bool{}, repoint: map[slotRef]string{},
		drop: map[int]bool{}, replace: map[int][]*pb.NodeProto{}, inPlace: map[string]*pb.TensorProto{},
		derived: map[slotRef][]float64{}, outputs: map[string]bool{}, groups: map[string][]string{},
	}
	if m.Graph == nil || m.Weights == nil {
		return nil, nil, fmt.Errorf("model has no graph")
	}
	if err := m.Graph.Validate(); err != nil {
		return nil, nil, fmt.Errorf("rewritten graph: %w", err)
	}
	w.reserveNames()
	steps := []func() error{w.check, w.names, w.folds, w.bindParams, w.nodes}
	for _, step := range steps {
		if err := step(); err != nil {
			return nil, nil, err
		}
	}
	mp, err := w.assemble(outDir)
	return mp, w.extWrites, err
}

func (w *writer) reserveNames() {
	gp := w.m.proto.Graph
	for _, t := range gp.Initializer {
		w.taken[t.GetName()] = true
	}
	for _, list := range [][]*pb.ValueInfoProto{gp.Input, gp.Output, gp.ValueInfo} {
		for _, vi := range list {
			w.taken[vi.GetName()] = true
		}
	}
	for _, o := range gp.Output {
		w.outputs[o.GetName()] = true
	}
	for _, n := range gp.Node {
		w.taken[n.GetName()] = true
		for _, o := range n.Output {
			w.taken[o] = true
		}
		for _, in := range n.Input {
			w.taken[in] = true
		}
	}
}

// fresh returns an unused name built from base.
func (w *writer) fresh(base string) string {
	name := base
	for k := 1; w.taken[name]; k++ {
		name = fmt.Sprintf("%s_%d", base, k)
	}
	w.taken[name] = true
	return name
}

// check refuses rewrites the writer cannot express.
func (w *writer) check() error {
	for _, n := range w.g.Nodes {
		w.alive[n] = true
	}
	for _, n := range w.g.Nodes {
		if n.Op == graph.OpInput {
			continue
		}
		if sp := w.m.special[n]; sp != nil {
			continue
		}
		info := w.m.byIR[n]
		if info == nil || info.ir != n {
			return fmt.Errorf("%w: node %s (%s) was added by a rewrite; the ONNX writer only writes nodes read from the model", ErrUnsupported, n.Name, n.Op)
		}
		what := fmt.Sprintf("node %s (ONNX node %q)", n.Name, info.proto.GetName())
		switch {
		case n.Op == info.op:
			if n.Attr != info.attr {
				return fmt.Errorf("%w: %s: a rewrite changed its attributes, which the writer cannot express", ErrUnsupported, what)
			}
		case info.op == graph.OpBatchNorm && n.Op.IsBNFamily():
			if n.Attr.Features != info.attr.Features {
				return fmt.Errorf("%w: %s: feature count changed from %d to %d", ErrUnsupported, what, info.attr.Features, n.Attr.Features)
			}
		default:
			return fmt.Errorf("%w: %s: a rewrite turned %s into %s, which the writer cannot express", ErrUnsupported, what, info.op, n.Op)
		}
		if n.Sign != nil && !n.Op.IsBNFamily() {
			return fmt.Errorf("%w: %s: a sign vector on a %s node", ErrUnsupported, what, n.Op)
		}
		if len(n.Inputs) != len(info.data) && !(n.Residual() != nil && len(n.Inputs) == len(info.data)+1) {
			return fmt.Errorf("%w: %s: a rewrite changed its number of inputs from %d to %d", ErrUnsupported, what, len(info.data), len(n.Inputs))
		}
		if info.kind == kindModelled {
			for role := range info.params {
				key, ok := n.Params[role]
				if !ok {
					return fmt.Errorf("%w: %s: no %s parameter any more", ErrUnsupported, what, role)
				}
				if _, ok := w.m.Weights.byKey[key]; !ok {
					return fmt.Errorf("%w: %s: %s parameter %q is not a tensor of the model", ErrUnsupported, what, role, key)
				}
			}
		}
	}
	// Removed nodes: an activation fused into an ABN-family node, or a node
	// whose readers the rewrite re-pointed to its input.
	for _, info := range w.m.infos {
		if info.ir == nil || w.alive[info.ir] {
			continue
		}
		r := info.ir
		if len(r.Inputs) == 1 {
			if p := r.Inputs[0].Producer; w.alive[p] && p.Op.IsBNFamily() && p.Op != graph.OpBatchNorm {
				if pi := w.m.byIR[p]; pi != nil && pi.op == graph.OpBatchNorm && isActivation(info.op) {
					if prev := w.act[p]; prev != nil {
						return fmt.Errorf("%w: node %s: two activations fused into it", ErrUnsupported, p.Name)
					}
					w.act[p] = info
				}
			}
		}
	}
	return w.checkResiduals()
}

// checkResiduals finds, for each InPlaceABN node that adds a residual, the
// ONNX Add the rewrite removed for it: a binary Add of the node's own
// output and the residual, whose readers now read the node. The node is
// written as before the rewrite, into the BatchNormalization's output name,
// and the Add after it, as read; a residual without such an Add (a node
// order to invent, names to make up) is refused.
func (w *writer) checkResiduals() error {
	for _, n := range w.g.Nodes {
		r := n.Residual()
		if r == nil {
			continue
		}
		if !w.abnFromBN(n) {
			return fmt.Errorf("%w: node %s: adds a residual but was not a BatchNormalization of the model", ErrUnsupported, n.Name)
		}
		if w.act[n] != nil {
			return fmt.Errorf("%w: node %s: adds a residual after a fused activation", ErrUnsupported, n.Name)
		}
		for _, info := range w.m.infos {
			a := info.ir
			if a == nil || w.alive[a] || info.op != graph.OpAdd || len(a.Inputs) != 2 || len(info.proto.Input) != 2 || len(info.proto.Output) != 1 {
				continue
			}
			if (a.Inputs[0] == n.Out && a.Inputs[1] == r) || (a.Inputs[0] == r && a.Inputs[1] == n.Out) {
				w.residual[n] = info
				break
			}
		}
		if w.residual[n] == nil {
			return fmt.Errorf("%w: node %s: adds residual %s, but no Add of the model that computed that sum was removed for it", ErrUnsupported, n.Name, r.Name)
		}
	}
	return nil
}

// isActivation says whether op fuses into a BatchNorm as the ABN family's
// activation (the op table's ABNAct).
func isActivation(op graph.Op) bool {
	info, _ := op.Info()
	return info.ABNAct != ""
}

// names gives every live IR value its ONNX name in the output. A fused
// ABN-family node takes its activation's output name, so that the
// activation's readers need no change.
func (w *writer) names() error {
	for _, n := range w.g.Nodes {
		w.name[n.Out] = w.m.valueName[n.Out]
	}
	for n, a := range w.act {
		w.name[n.Out] = a.proto.Output[0]
	}
	// A residual node's readers read the sum: the Add's output.
	for n, a := range w.residual {
		w.name[n.Out] = a.proto.Output[0]
	}
	return nil
}

// inPlaceOp: the InPlace-ABN ops scale by |weight| + eps.
func inPlaceOp(op graph.Op) bool { return op == graph.OpInPlaceABN || op == graph.OpInPlaceABNSync }

// abnFromBN reports whether n is an ABN-family node the rewrite made from a
// BatchNormalization (the nodes the writer re-expresses).
func (w *writer) abnFromBN(n *graph.Node) bool {
	info := w.m.byIR[n]
	return info != nil && info.ir == n && info.op == graph.OpBatchNorm && n.Op.IsBNFamily() && n.Op != graph.OpBatchNorm
}

// writeExternal stages the output's data file: the changed tensors of an
// external-data model, each made from its source's bytes with the sign
// flips applied and written at its offset, one tensor in memory at a time.
// Writing them inline instead would hold them all and, for the models that
// use external data, pass protobuf's 2 GiB limit.
func writeExternal(set *output.Set, path string, writes []extWrite) error {
	f, err := set.Create(path)
	if err != nil {
		return err
	}
	// The file reaches at least the last tensor's offset: those blocks
	// are allocated at once (output.File.Reserve).
	var last int64
	for _, wr := range writes {
		last = max(last, wr.offset)
	}
	f.Reserve(last)
	var at int64
	for _, wr := range writes {
		if pad := wr.offset - at; pad > 0 {
			if _, err := f.Write(make([]byte, pad)); err != nil {
				return fmt.Errorf("%s: %w", path, err)
			}
			at += pad
		}
		b, err := wr.p.negatedRaw()
		if err != nil {
			return fmt.Errorf("%s: tensor %q: %w", path, wr.p.key, err)
		}
		if _, err := f.Write(b); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		at += int64(len(b))
	}
	return nil
}
