package onnx

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// assemble builds the output model around the input's untouched parts.
func (w *writer) assemble(outDir string) (*pb.ModelProto, error) {
	src := w.m.proto
	gp := src.Graph
	var nodes []*pb.NodeProto
	for i, n := range gp.Node {
		if w.drop[i] {
			continue
		}
		if r, ok := w.replace[i]; ok {
			nodes = append(nodes, r...)
			continue
		}
		nodes = append(nodes, n)
	}
	// Graph outputs whose value the rewrite moved to a differently named
	// value keep their name through an Identity.
	produced := map[string]bool{}
	for _, n := range nodes {
		for _, o := range n.Output {
			produced[o] = true
		}
	}
	outVals := map[string]*graph.Value{}
	if len(gp.Output) > 0 {
		outVals[gp.Output[0].GetName()] = w.g.Output
	}
	for n, sp := range w.m.special {
		if sp.kind == specialOutput && w.alive[n] {
			outVals[sp.name] = n.Inputs[0]
		}
	}
	for _, o := range gp.Output {
		v := outVals[o.GetName()]
		if v == nil || w.name[v] == o.GetName() {
			continue
		}
		if produced[o.GetName()] {
			return nil, fmt.Errorf("%w: graph output %q: the rewrite moved it to %q, but a node still computes it", ErrUnsupported, o.GetName(), w.name[v])
		}
		nodes = append(nodes, &pb.NodeProto{Name: strp(w.fresh(o.GetName() + "/identity")), OpType: strp("Identity"), Input: []string{w.name[v]}, Output: []string{o.GetName()}})
	}

	// Initializers: replaced in place, new ones appended, and those only
	// the dropped nodes read removed (with the Identity chains that only
	// led to them).
	var inits []*pb.TensorProto
	for _, t := range gp.Initializer {
		if r, ok := w.inPlace[t.GetName()]; ok {
			inits = append(inits, r)
			continue
		}
		inits = append(inits, t)
	}
	inits = append(inits, w.newInits...)
	nodes, inits = w.prune(nodes, inits)

	// External data: kept when the output sits next to the input model,
	// inlined otherwise. A changed external tensor goes to the output's
	// own data file beside it, or is inlined too when the output is
	// elsewhere.
	sameDir := sameDirectory(outDir, w.m.dir)
	total := 0
	// inline counts bytes moved into the model file against protobuf's
	// limit.
	inline := func(raw []byte) error {
		if total += len(raw); total > maxProto {
			return fmt.Errorf("%w: inlining external data would pass protobuf's 2 GiB limit; write the output into the model's directory (%s) to keep the data external", ErrUnsupported, w.m.dir)
		}
		return nil
	}
	var dataLen int64
	for i, t := range inits {
		if p := w.external[t]; p != nil {
			length := int64(p.src.td.ext.length)
			if sameDir {
				dataLen = (dataLen + 63) &^ 63 // 64-byte aligned, as torch aligns records
				w.extWrites = append(w.extWrites, extWrite{p: p, offset: dataLen})
				t.DataLocation = pb.TensorProto_EXTERNAL.Enum()
				t.RawData = nil
				t.ExternalData = []*pb.StringStringEntryProto{
					{Key: strp("location"), Value: strp(w.dataName)},
					{Key: strp("offset"), Value: strp(strconv.FormatInt(dataLen, 10))},
					{Key: strp("length"), Value: strp(strconv.FormatInt(length, 10))},
				}
				dataLen += length
				continue
			}
			raw, err := p.negatedRaw()
			if err != nil {
				return nil, fmt.Errorf("initializer %q: %w", t.GetName(), err)
			}
			if err := inline(raw); err != nil {
				return nil, err
			}
			t.RawData, t.ExternalData, t.DataLocation = raw, nil, nil
			continue
		}
		if t.GetDataLocation() != pb.TensorProto_EXTERNAL {
			total += len(t.RawData)
			continue
		}
		if sameDir {
			continue
		}
		p := w.m.params[t.GetName()]
		if p == nil || p.td.t != t {
			return nil, fmt.Errorf("initializer %q: external data not read", t.GetName())
		}
		raw, err := p.td.rawBytes()
		if err != nil {
			return nil, fmt.Errorf("initializer %q: %w", t.GetName(), err)
		}
		if err := inline(raw); err != nil {
			return nil, err
		}
		c := shallowTensor(t)
		c.RawData, c.ExternalData, c.DataLocation = raw, nil, nil
		inits[i] = c
	}

	og := shallow(gp)
	og.Node = nodes
	og.Initializer = inits
	defined := map[string]bool{}
	for _, t := range inits {
		defined[t.GetName()] = true
	}
	for _, in := range gp.Input {
		defined[in.GetName()] = true
	}
	for _, n := range nodes {
		for _, o := range n.Output {
			defined[o] = true
		}
	}
	og.ValueInfo = nil
	for _, vi := range gp.ValueInfo {
		if defined[vi.GetName()] {
			og.ValueInfo = append(og.ValueInfo, vi)
		}
	}
	if src.GetIrVersion() < 4 {
		// Before IR version 4 every initializer is also a graph input.
		og.Input = append([]*pb.ValueInfoProto(nil), gp.Input...)
		listed := map[string]bool{}
		for _, in := range gp.Input {
			listed[in.GetName()] = true
		}
		for _, t := range inits {
			if !listed[t.GetName()] {
				og.Input = append(og.Input, tensorInput(t))
			}
		}
	}
	if err := checkOrder(og); err != nil {
		return nil, err
	}

	out := shallow(src)
	out.Graph = og
	if w.custom {
		found := false
		for _, o := range src.OpsetImport {
			if o.GetDomain() == Domain {
				found = true
			}
		}
		if !found {
			out.OpsetImport = append(append([]*pb.OperatorSetIdProto(nil), src.OpsetImport...),
				&pb.OperatorSetIdProto{Domain: strp(Domain), Version: i64p(DomainVersion)})
		}
	}
	if len(w.groups) > 0 && !w.opt.FoldForInference {
		// (An inference graph has nothing to recompute.)
		for g := range w.groups {
			sort.Strings(w.groups[g])
		}
		b, err := json.Marshal(w.groups)
		if err != nil {
			return nil, err
		}
		var meta []*pb.StringStringEntryProto
		for _, kv := range src.MetadataProps {
			if kv.GetKey() != MetaRecompute {
				meta = append(meta, kv)
			}
		}
		out.MetadataProps = append(meta, &pb.StringStringEntryProto{Key: strp(MetaRecompute), Value: strp(string(b))})
	}
	if len(w.opt.Metadata) > 0 {
		// The given entries replace those of the same key, after the
		// others, in key order: the output depends on nothing else.
		var meta []*pb.StringStringEntryProto
		for _, kv := range out.MetadataProps {
			if _, ok := w.opt.Metadata[kv.GetKey()]; !ok {
				meta = append(meta, kv)
			}
		}
		keys := make([]string, 0, len(w.opt.Metadata))
		for k := range w.opt.Metadata {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			meta = append(meta, &pb.StringStringEntryProto{Key: strp(k), Value: strp(w.opt.Metadata[k])})
		}
		out.MetadataProps = meta
	}
	return out, nil
}

// prune removes the parameter nodes (Identity, Constant) and initializers
// that had readers in the input and have none left, repeatedly: what the
// rewrite made dead, and nothing that was already unused.
func (w *writer) prune(nodes []*pb.NodeProto, inits []*pb.TensorProto) ([]*pb.NodeProto, []*pb.TensorProto) {
	before := map[string]int{}
	for _, n := range w.m.proto.Graph.Node {
		for _, in := range n.Input {
			before[in]++
		}
		for _, ref := range outerRefs(n) {
			before[ref]++
		}
	}
	protected := map[string]bool{}
	for _, o := range w.m.proto.Graph.Output {
		protected[o.GetName()] = true
	}
	for _, in := range w.m.proto.Graph.Input {
		protected[in.GetName()] = true
	}
	paramNode := map[*pb.NodeProto]bool{}
	for _, info := range w.m.infos {
		if info.kind == kindParam || info.kind == kindConst {
			paramNode[info.proto] = true
		}
	}
	for {
		after := map[string]int{}
		for _, n := range nodes {
			for _, in := range n.Input {
				after[in]++
			}
			for _, ref := range outerRefs(n) {
				after[ref]++
			}
		}
		dead := func(name string) bool {
			return before[name] > 0 && after[name] == 0 && !protected[name]
		}
		changed := false
		kept := nodes[:0:0]
		for _, n := range nodes {
			if paramNode[n] && len(n.Output) == 1 && dead(n.Output[0]) {
				changed = true
				continue
			}
			kept = append(kept, n)
		}
		nodes = kept
		keptInits := inits[:0:0]
		for _, t := range inits {
			if dead(t.GetName()) {
				changed = true
				continue
			}
			keptInits = append(keptInits, t)
		}
		inits = keptInits
		if !changed {
			return nodes, inits
		}
	}
}

func tensorInput(t *pb.TensorProto) *pb.ValueInfoProto {
	dims := make([]*pb.TensorShapeProto_Dimension, len(t.Dims))
	for i, d := range t.Dims {
		dims[i] = &pb.TensorShapeProto_Dimension{Value: &pb.TensorShapeProto_Dimension_DimValue{DimValue: d}}
	}
	return &pb.ValueInfoProto{Name: t.Name, Type: &pb.TypeProto{Value: &pb.TypeProto_TensorType{TensorType: &pb.TypeProto_Tensor{
		ElemType: t.DataType, Shape: &pb.TensorShapeProto{Dim: dims},
	}}}}
}

// checkOrder verifies the written graph: every input defined before use,
// every value defined once, every graph output defined. A failure is a bug
// in the writer or a rewrite it cannot express, never a file to write.
func checkOrder(g *pb.GraphProto) error {
	defined := map[string]bool{}
	for _, t := range g.Initializer {
		defined[t.GetName()] = true
	}
	for _, s := range g.SparseInitializer {
		defined[s.GetValues().GetName()] = true
	}
	for _, in := range g.Input {
		defined[in.GetName()] = true
	}
	for _, n := range g.Node {
		for _, in := range n.Input {
			if in != "" && !defined[in] {
				return fmt.Errorf("%w: written node %q reads %q before anything defines it", ErrUnsupported, n.GetName(), in)
			}
		}
		for _, ref := range outerRefs(n) {
			if !defined[ref] {
				return fmt.Errorf("%w: a subgraph of written node %q reads %q, which nothing defines", ErrUnsupported, n.GetName(), ref)
			}
		}
		for _, o := range n.Output {
			if o == "" {
				continue
			}
			if defined[o] {
				return fmt.Errorf("%w: written node %q defines %q a second time", ErrUnsupported, n.GetName(), o)
			}
			defined[o] = true
		}
	}
	for _, o := range g.Output {
		if !defined[o.GetName()] {
			return fmt.Errorf("%w: graph output %q is no longer computed", ErrUnsupported, o.GetName())
		}
	}
	return nil
}

func sameDirectory(a, b string) bool {
	ra, err1 := filepath.EvalSymlinks(a)
	rb, err2 := filepath.EvalSymlinks(b)
	if err1 != nil || err2 != nil {
		return filepath.Clean(a) == filepath.Clean(b)
	}
	if ra == rb {
		return true
	}
	fa, err1 := os.Stat(ra)
	fb, err2 := os.Stat(rb)
	return err1 == nil && err2 == nil && os.SameFile(fa, fb)
}
