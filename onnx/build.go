package onnx

import (
	"fmt"
	"strconv"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// builder turns the protobuf graph into the IR.
type builder struct {
	m      *Model
	g      *graph.Graph
	values map[string]*graph.Value // data values by ONNX name
	params map[string]*paramSrc
	consts map[string]bool // constants that are not decodable
	// defined records what defines each value name, to refuse a name
	// defined twice (ONNX graphs are in SSA form).
	defined map[string]string
	uses    map[string]int
	names   map[string]bool // IR node names in use
	types   map[string]*pb.TypeProto
	w       *Weights
	claims  map[string]*param // value name -> the plain key reading it
}

func (m *Model) build() error {
	gp := m.proto.Graph
	b := &builder{
		m: m, values: map[string]*graph.Value{}, params: map[string]*paramSrc{},
		consts: map[string]bool{}, defined: map[string]string{}, uses: map[string]int{},
		names: map[string]bool{"input": true}, types: map[string]*pb.TypeProto{},
		w: newWeights(), claims: map[string]*param{},
	}
	for _, list := range [][]*pb.ValueInfoProto{gp.Input, gp.Output, gp.ValueInfo} {
		for _, vi := range list {
			if vi.Type != nil {
				b.types[vi.GetName()] = vi.Type
			}
		}
	}
	if err := b.initializers(); err != nil {
		return err
	}
	b.countUses()
	if err := b.inputs(); err != nil {
		return err
	}
	for i, n := range gp.Node {
		if err := b.node(i, n); err != nil {
			name := n.GetName()
			if name == "" {
				name = fmt.Sprintf("#%d", i)
			}
			return fmt.Errorf("node %s (%s): %w", name, n.GetOpType(), err)
		}
	}
	if err := b.outputs(); err != nil {
		return err
	}
	b.keys()
	b.channels()
	b.fuse()
	m.Graph = b.g
	m.Weights = b.w
	m.params = b.params
	return nil
}

func (b *builder) define(name, what string) error {
	if name == "" {
		return nil
	}
	if prev, ok := b.defined[name]; ok {
		return fmt.Errorf("%w: value %q defined twice (by %s and by %s)", ErrMalformed, name, prev, what)
	}
	b.defined[name] = what
	return nil
}

func (b *builder) initializers() error {
	gp := b.m.proto.Graph
	for i, t := range gp.Initializer {
		name := t.GetName()
		if name == "" {
			return fmt.Errorf("%w: initializer #%d has no name", ErrMalformed, i)
		}
		if err := b.define(name, "an initializer"); err != nil {
			return err
		}
		td, err := inspectTensor(t, b.m.dir)
		if err != nil {
			return fmt.Errorf("initializer %q: %w", name, err)
		}
		b.params[name] = &paramSrc{root: name, td: td, node: -1}
		b.w.add(&param{key: name, value: name, src: b.params[name]})
	}
	for i, s := range gp.SparseInitializer {
		name := s.GetValues().GetName()
		if name == "" {
			return fmt.Errorf("%w: sparse initializer #%d has no name", ErrMalformed, i)
		}
		if err := b.define(name, "a sparse initializer"); err != nil {
			return err
		}
		b.consts[name] = true
	}
	return nil
}

// countUses counts the readers of every value: node inputs, names that
// subgraphs read from the enclosing graph, and graph outputs.
func (b *builder) countUses() {
	gp := b.m.proto.Graph
	for _, n := range gp.Node {
		for _, in := range n.Input {
			if in != "" {
				b.uses[in]++
			}
		}
		for _, in := range outerRefs(n) {
			b.uses[in]++
		}
	}
	for _, o := range gp.Output {
		b.uses[o.GetName()]++
	}
}

func (b *builder) inputs() error {
	gp := b.m.proto.Graph
	var main *pb.ValueInfoProto
	for _, in := range gp.Input {
		name := in.GetName()
		if _, ok := b.params[name]; ok {
			// An initializer listed as an input (IR version < 4, or an
			// overridable default): a parameter.
			continue
		}
		if name == "" {
			return fmt.Errorf("%w: a graph input has no name", ErrMalformed)
		}
		if err := b.define(name, "a graph input"); err != nil {
			return err
		}
		if main == nil {
			main = in
			arch := "onnx"
			if gp.GetName() != "" {
				arch = "onnx:" + gp.GetName()
			}
			b.g = graph.New(arch, b.channelsOf(name))
			b.values[name] = b.g.Input
			b.m.valueName[b.g.Input] = name
			continue
		}
		v := b.g.Add(b.unique("input:"+name), OpGraphInput, graph.Attr{}, nil)
		b.values[name] = v
		b.m.valueName[v] = name
		b.m.special[v.Producer] = &special{kind: specialInput, name: name}
	}
	if main == nil {
		return fmt.Errorf("%w: the graph has no input other than initializers", ErrUnsupported)
	}
	return nil
}

func (b *builder) outputs() error {
	gp := b.m.proto.Graph
	if len(gp.Output) == 0 {
		return fmt.Errorf("%w: the graph has no output", ErrMalformed)
	}
	var main *graph.Value
	for i, o := range gp.Output {
		name := o.GetName()
		v, ok := b.values[name]
		if !ok {
			if _, isParam := b.params[name]; isParam || b.consts[name] {
				if i == 0 {
					return fmt.Errorf("%w: graph output %q is a constant; nothing to convert", ErrUnsupported, name)
				}
				continue
			}
			return fmt.Errorf("%w: graph output %q is not computed by any node", ErrMalformed, name)
		}
		if i == 0 {
			main = v
			continue
		}
		if v == main {
			continue
		}
		sink := b.g.Add(b.unique("output:"+name), OpGraphOutput, graph.Attr{}, nil, v)
		b.m.special[sink.Producer] = &special{kind: specialOutput, name: name}
	}
	b.g.Output = main
	return nil
}

// unique returns name, or name_<k> if taken, and reserves it.
func (b *builder) unique(name string) string {
	base := name
	for k := 1; b.names[name]; k++ {
		name = base + "_" + strconv.Itoa(k)
	}
	b.names[name] = true
	return name
}

// node adds one ONNX node.
func (b *builder) node(i int, n *pb.NodeProto) error {
	info := &nodeInfo{index: i, proto: n}
	b.m.infos = append(b.m.infos, info)
	what := fmt.Sprintf("node %q", n.GetName())
	for _, o := range n.Output {
		if err := b.define(o, what); err != nil {
			return err
		}
		if o != "" {
			b.m.producer[o] = info
		}
	}
	for k, in := range n.Input {
		if in == "" {
			continue
		}
		if _, ok := b.values[in]; ok {
			continue
		}
		if _, ok := b.params[in]; ok || b.consts[in] {
			continue
		}
		return fmt.Errorf("%w: input %d %q is defined by no earlier node, initializer or graph input", ErrMalformed, k, in)
	}
	if src, ok := b.paramSource(i, n); ok {
		info.kind = kindParam
		if src != nil {
			b.params[n.Output[0]] = src
			b.w.add(&param{key: n.Output[0], value: n.Output[0], src: src})
		} else {
			info.kind = kindConst
			for _, o := range n.Output {
				if o != "" {
					b.consts[o] = true
				}
			}
		}
		return nil
	}

	op, attr, why := b.modelled(info)
	if why != "" {
		info.kind, info.why = kindOpaque, why
		op = opaqueOp(n)
		info.params = nil
		info.data = info.data[:0]
		for k, in := range n.Input {
			if _, ok := b.values[in]; ok && in != "" {
				info.data = append(info.data, k)
			}
		}
	}
	var inputs []*graph.Value
	for _, k := range info.data {
		inputs = append(inputs, b.values[n.Input[k]])
	}
	if info.kind == kindOpaque {
		for _, ref := range outerRefs(n) {
			v, ok := b.values[ref]
			if !ok {
				if _, isParam := b.params[ref]; isParam || b.consts[ref] {
					continue
				}
				return fmt.Errorf("%w: a subgraph reads %q, which nothing defines", ErrMalformed, ref)
			}
			inputs = append(inputs, v)
			info.data = append(info.data, -1)
			info.implicit = append(info.implicit, ref)
		}
	}
	name := n.GetName()
	if name == "" {
		name = fmt.Sprintf("%s_%d", n.GetOpType(), i)
	}
	out := b.g.Add(b.unique(name), op, attr, nil, inputs...)
	node := out.Producer
	info.ir, info.op, info.attr = node, op, attr
	if info.kind == kindModelled {
		node.Params = map[string]string{}
	}
	b.m.byIR[node] = info
	if len(n.Output) > 0 && n.Output[0] != "" {
		b.values[n.Output[0]] = out
		b.m.valueName[out] = n.Output[0]
	}
	for k := 1; k < len(n.Output); k++ {
		o := n.Output[k]
		if o == "" {
			continue
		}
		if info.kind == kindModelled {
			// modelled() checked that nothing reads it.
			continue
		}
		pv := b.g.Add(b.unique(node.Name+":"+strconv.Itoa(k)), OpOutput, graph.Attr{}, nil, out)
		b.values[o] = pv
		b.m.valueName[pv] = o
		b.m.special[pv.Producer] = &special{kind: specialProjection, name: o, info: info}
	}
	return nil
}

func opaqueOp(n *pb.NodeProto) graph.Op {
	if d := n.GetDomain(); d != "" && d != "ai.onnx" {
		return graph.Op(OpaquePrefix + d + "." + n.GetOpType())
	}
	return graph.Op(OpaquePrefix + n.GetOpType())
}

// paramSource recognises nodes that only produce parameters: a Constant,
// or an Identity of a parameter (torch's deduplication). ok with a nil
// source means a constant that cannot be decoded.
func (b *builder) paramSource(i int, n *pb.NodeProto) (src *paramSrc, ok bool) {
	if d := n.GetDomain(); d != "" && d != "ai.onnx" {
		return nil, false
	}
	switch n.GetOpType() {
	case "Identity":
		if len(n.Input) != 1 || len(n.Output) != 1 {
			return nil, false
		}
		if p, isParam := b.params[n.Input[0]]; isParam {
			return &paramSrc{root: p.root, td: p.td, node: i}, true
		}
		if b.consts[n.Input[0]] {
			return nil, true
		}
	case "Constant":
		if len(n.Output) != 1 || len(n.Attribute) != 1 {
			return nil, false
		}
		t := constantTensor(n.Attribute[0])
		if t == nil {
			return nil, true
		}
		td, err := inspectTensor(t, b.m.dir)
		if err != nil || td.ext != nil || elemSize(t.GetDataType()) == 0 {
			return nil, true
		}
		return &paramSrc{root: n.Output[0], td: td, node: i}, true
	}
	return nil, false
}

// constantTensor is the value of a Constant node as a tensor, nil for the
// kinds this package does not decode (sparse tensors, strings).
func constantTensor(a *pb.AttributeProto) *pb.TensorProto {
	f, i64 := dtFloat, dtInt64
	switch a.GetName() {
	case "value":
		return a.T
	case "value_float":
		return &pb.TensorProto{DataType: &f, FloatData: []float32{a.GetF()}}
	case "value_floats":
		return &pb.TensorProto{DataType: &f, Dims: []int64{int64(len(a.Floats))}, FloatData: a.Floats}
	case "value_int":
		return &pb.TensorProto{DataType: &i64, Int64Data: []int64{a.GetI()}}
	case "value_ints":
		return &pb.TensorProto{DataType: &i64, Dims: []int64{int64(len(a.Ints))}, Int64Data: a.Ints}
	}
	return nil
}

// outerRefs lists the names a node's subgraphs read from enclosing scopes.
func outerRefs(n *pb.NodeProto) []string {
	var refs []string
	seen := map[string]bool{}
	var walk func(g *pb.GraphProto, outer map[string]bool)
	walk = func(g *pb.GraphProto, outer map[string]bool) {
		local := map[string]bool{}
		for k := range outer {
			local[k] = true
		}
		for _, t := range g.Initializer {
			local[t.GetName()] = true
		}
		for _, in := range g.Input {
			local[in.GetName()] = true
		}
		for _, sn := range g.Node {
			for _, o := range sn.Output {
				local[o] = true
			}
		}
		for _, sn := range g.Node {
			for _, in := range sn.Input {
				if in != "" && !local[in] && !seen[in] {
					seen[in] = true
					refs = append(refs, in)
				}
			}
			for _, a := range sn.Attribute {
				for _, sg := range subgraphs(a) {
					walk(sg, local)
				}
			}
		}
		for _, o := range g.Output {
			if name := o.GetName(); !local[name] && !seen[name] {
				seen[name] = true
				refs = append(refs, name)
			}
		}
	}
	for _, a := range n.Attribute {
		for _, sg := range subgraphs(a) {
			walk(sg, nil)
		}
	}
	return refs
}

func subgraphs(a *pb.AttributeProto) []*pb.GraphProto {
	var out []*pb.GraphProto
	if a.G != nil {
		out = append(out, a.G)
	}
	return append(out, a.Graphs...)
}
