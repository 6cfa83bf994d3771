package onnx

import (
	"fmt"
	"slices"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// nodes decides how each ONNX node is written.
func (w *writer) nodes() error {
	for _, info := range w.m.infos {
		if w.drop[info.index] {
			continue
		}
		n := info.ir
		switch {
		case n == nil:
			// A parameter source: written as read.
		case !w.alive[n]:
			if err := w.removed(info); err != nil {
				return err
			}
		case w.abnFromBN(n):
			if err := w.abn(n, info); err != nil {
				return err
			}
		default:
			node, err := w.wired(info, w.name[n.Out])
			if err != nil {
				return err
			}
			if bn := w.foldTarget(n); bn != nil {
				// The Conv takes over the folded BN's output name, which the
				// BN's readers (its activation, or the BN's own readers) read.
				node = cloneNode(node)
				node.Output[0] = w.m.byIR[bn].proto.Output[0]
			}
			if node != info.proto {
				w.replace[info.index] = []*pb.NodeProto{node}
			}
			if n.Recompute != "" {
				w.groups[n.Recompute] = append(w.groups[n.Recompute], info.proto.GetName())
			}
		}
	}
	return nil
}

// foldTarget is the BN folded into Conv n, nil if none.
func (w *writer) foldTarget(n *graph.Node) *graph.Node {
	for bn, c := range w.fold {
		if c == n {
			return bn
		}
	}
	return nil
}

// removed handles an ONNX node whose IR node the rewrite removed: a fused
// activation disappears into the ai.abnconvert node, or is rewritten as
// the activation the ABN node chose under standard ops; any other removed
// node is dropped (its readers were re-pointed in the IR).
func (w *writer) removed(info *nodeInfo) error {
	for n, a := range w.residual {
		if a == info {
			return w.residualAdd(n, info)
		}
	}
	var owner *graph.Node
	for n, a := range w.act {
		if a == info {
			owner = n
		}
	}
	if owner == nil || !w.opt.StandardOps {
		w.drop[info.index] = true
		for _, a := range info.absorbed {
			w.drop[a.index] = true
		}
		return nil
	}
	node, err := w.activation(owner, info, w.m.byIR[owner].proto.Output[0], info.proto.Output[0])
	if err != nil {
		return err
	}
	if node == nil {
		w.drop[info.index] = true
		return nil
	}
	if node != info.proto {
		w.replace[info.index] = []*pb.NodeProto{node}
	}
	return nil
}

// residualAdd writes the Add that residual node n replaced, where it was:
// the residual plus n's output without it, which every form of n (custom,
// standard, folded into its Conv) writes under the BatchNormalization's
// output name.
func (w *writer) residualAdd(n *graph.Node, info *nodeInfo) error {
	in := append([]string(nil), info.proto.Input...)
	for i, k := range info.data {
		if k < 0 || k >= len(in) {
			return fmt.Errorf("%w: node %s: its Add reads an implicit input", ErrUnsupported, n.Name)
		}
		if info.ir.Inputs[i] == n.Out {
			in[k] = w.m.byIR[n].proto.Output[0]
		} else {
			in[k] = w.name[n.Residual()]
		}
	}
	if slices.Equal(in, info.proto.Input) {
		return nil
	}
	node := cloneNode(info.proto)
	node.Input = in
	w.replace[info.index] = []*pb.NodeProto{node}
	return nil
}

// activation is the standard node computing n's activation from in to
// out; orig is the activation node that was fused, reused unchanged when it
// already computes that. nil for identity without a fused node.
func (w *writer) activation(n *graph.Node, orig *nodeInfo, in, out string) (*pb.NodeProto, error) {
	var op string
	var attr []*pb.AttributeProto
	switch n.Attr.Activation {
	case graph.ActIdentity, "":
		if orig == nil {
			return nil, nil
		}
		op = "Identity"
	case graph.ActReLU:
		op = "Relu"
	case graph.ActLeakyReLU:
		op = "LeakyRelu"
		attr = []*pb.AttributeProto{floatAttr("alpha", float32(n.Attr.ActParam))}
	case graph.ActELU:
		op = "Elu"
		attr = []*pb.AttributeProto{floatAttr("alpha", float32(n.Attr.ActParam))}
	default:
		return nil, fmt.Errorf("%w: node %s: activation %q", ErrUnsupported, n.Name, n.Attr.Activation)
	}
	if orig != nil && orig.proto.GetOpType() == op && len(orig.proto.Input) == 1 && orig.proto.Input[0] == in {
		same := op == "Relu" || op == "Identity" || float32(orig.attr.ActParam) == float32(n.Attr.ActParam)
		if same {
			return orig.proto, nil
		}
	}
	name := n.Name + "/" + op
	if orig != nil {
		name = orig.proto.GetName()
	} else {
		name = w.fresh(name)
	}
	return &pb.NodeProto{Name: strp(name), OpType: strp(op), Input: []string{in}, Output: []string{out}, Attribute: attr}, nil
}

// wired returns node info's proto with its data inputs named after the IR
// edges and its parameter inputs re-pointed, the original message itself
// when nothing changed.
func (w *writer) wired(info *nodeInfo, out string) (*pb.NodeProto, error) {
	n := info.ir
	in := append([]string(nil), info.proto.Input...)
	implicit := 0
	for i, k := range info.data {
		name := w.name[n.Inputs[i]]
		if k < 0 {
			if want := info.implicit[implicit]; name != want && len(info.absorbed) > 0 {
				return nil, fmt.Errorf("%w: node %s: it stands for %d ONNX nodes that read %q, which the rewrite renamed to %q", ErrUnsupported, n.Name, len(info.absorbed)+1, want, name)
			} else if name != want {
				return nil, fmt.Errorf("%w: node %s: its subgraph reads %q by name, which the rewrite renamed to %q", ErrUnsupported, n.Name, want, name)
			}
			implicit++
			continue
		}
		in[k] = name
	}
	for k := range in {
		if r, ok := w.repoint[slotRef{info.index, k}]; ok {
			in[k] = r
		}
	}
	// A slot past the inputs present: the bias a folded Conv gains.
	for k := len(in); ; k++ {
		r, ok := w.repoint[slotRef{info.index, k}]
		if !ok {
			break
		}
		in = append(in, r)
	}
	changed := len(in) != len(info.proto.Input)
	for k := range info.proto.Input {
		if in[k] != info.proto.Input[k] {
			changed = true
		}
	}
	if len(info.proto.Output) > 0 && out != "" && info.proto.Output[0] != out {
		changed = true
	}
	if !changed {
		return info.proto, nil
	}
	node := cloneNode(info.proto)
	node.Input = in
	if out != "" && len(node.Output) > 0 {
		node.Output[0] = out
	}
	return node, nil
}

// cloneNode copies a node's input and output lists (attributes are shared:
// they are never changed in place).
func cloneNode(n *pb.NodeProto) *pb.NodeProto {
	c := shallow(n)
	c.Input = append([]string(nil), n.Input...)
	c.Output = append([]string(nil), n.Output...)
	return c
}

// abn writes an ABN-family node made from a BatchNormalization.
func (w *writer) abn(n *graph.Node, info *nodeInfo) error {
	if n.Recompute != "" {
		w.groups[n.Recompute] = append(w.groups[n.Recompute], info.proto.GetName())
	}
	if w.fold[n] != nil {
		// Folded into its Conv; the activation node stays (removed()).
		w.drop[info.index] = true
		return nil
	}
	bn, err := w.wired(info, "")
	if err != nil {
		return err
	}
	params := bn.Input[1:5]
	x := bn.Input[0]
	if !w.opt.StandardOps {
		return w.customNode(n, info, x, params)
	}
	var out []*pb.NodeProto
	if n.Sign != nil {
		mul, signed, err := w.signMul(n, info, x)
		if err != nil {
			return err
		}
		out = append(out, mul...)
		x = signed
	}
	if bn == info.proto && x == bn.Input[0] {
		out = append(out, bn)
	} else {
		c := cloneNode(bn)
		c.Input[0] = x
		out = append(out, c)
	}
	if w.act[n] == nil && n.Attr.Activation != graph.ActIdentity && n.Attr.Activation != "" {
		// An activation without a fused node: the BN writes a new value,
		// the activation takes the BN's output name.
		last := out[len(out)-1]
		if last == info.proto {
			last = cloneNode(last)
			out[len(out)-1] = last
		}
		orig := last.Output[0]
		last.Output[0] = w.fresh(orig + "_bn")
		a, err := w.activation(n, nil, last.Output[0], orig)
		if err != nil {
			return err
		}
		out = append(out, a)
	}
	if len(out) == 1 && out[0] == info.proto {
		return nil
	}
	w.replace[info.index] = out
	return nil
}

// customNode writes n as one ai.abnconvert node (DOMAIN.md).
func (w *writer) customNode(n *graph.Node, info *nodeInfo, x string, params []string) error {
	a := nodeAttrs(info.proto)
	eps := float32(n.Attr.Eps)
	if at, ok := a["epsilon"]; ok && at.F != nil && decimal32(at.GetF()) == n.Attr.Eps {
		eps = at.GetF() // keep the file's bits
	}
	attrs := []*pb.AttributeProto{floatAttr("epsilon", eps)}
	if !n.Attr.MomentumNone {
		attrs = append(attrs, floatAttr("momentum", float32(n.Attr.Momentum)))
	}
	act := n.Attr.Activation
	if act == "" {
		act = graph.ActIdentity
	}
	attrs = append(attrs, stringAttr("activation", act), floatAttr("activation_param", float32(n.Attr.ActParam)))
	if n.Sign != nil {
		s := make([]int64, len(n.Sign))
		for i, v := range n.Sign {
			s[i] = int64(v)
		}
		attrs = append(attrs, intsAttr("sign", s))
	}
	if n.Recompute != "" {
		attrs = append(attrs, stringAttr("recompute_group", n.Recompute))
	}
	out := w.name[n.Out]
	if n.Residual() != nil {
		// The residual is added by the Add after it (residualAdd).
		out = info.proto.Output[0]
	}
	node := &pb.NodeProto{
		Name:      info.proto.Name,
		OpType:    strp(string(n.Op)),
		Domain:    strp(Domain),
		Input:     append([]string{x}, params...),
		Output:    []string{out},
		Attribute: attrs,
		DocString: info.proto.DocString,
	}
	w.replace[info.index] = []*pb.NodeProto{node}
	w.custom = true
	return nil
}

// signMul multiplies x by n's sign vector, a constant shaped to broadcast
// over dimension 1.
func (w *writer) signMul(n *graph.Node, info *nodeInfo, x string) ([]*pb.NodeProto, string, error) {
	rank := w.rank(n.Inputs[0])
	dims := []int64{int64(len(n.Sign))}
	for i := 2; i < rank; i++ {
		dims = append(dims, 1)
	}
	dt := w.elemType(n.Inputs[0], n)
	v := make([]float64, len(n.Sign))
	for i, s := range n.Sign {
		v[i] = float64(s)
	}
	t, err := encodeTensor(&pb.TensorProto{DataType: &dt, Dims: dims, RawData: []byte{}}, v)
	if err != nil {
		return nil, "", fmt.Errorf("node %s: sign: %w", n.Name, err)
	}
	base := info.proto.GetName()
	if base == "" {
		base = n.Name
	}
	t.Name = strp(w.fresh(base + ".sign"))
	w.newInits = append(w.newInits, t)
	out := w.fresh(x + "_signed")
	mul := &pb.NodeProto{Name: strp(w.fresh(base + "/sign")), OpType: strp("Mul"), Input: []string{x, t.GetName()}, Output: []string{out}}
	return []*pb.NodeProto{mul}, out, nil
}

// rank is a value's rank: declared, or from the ops that made it (4 for
// the 2-D convolution family, which is what BN-family nodes mostly read).
func (w *writer) rank(v *graph.Value) int {
	for depth := 0; v != nil && depth < 10000; depth++ {
		if t := w.m.typeOf(w.m.valueName[v]); t != nil && t.Shape != nil {
			return len(t.Shape.Dim)
		}
		p := v.Producer
		if info, _ := p.Op.Info(); info.Shape.Rank() != 0 {
			return info.Shape.Rank()
		}
		if len(p.Inputs) == 0 {
			return 4
		}
		v = p.Inputs[0]
	}
	return 4
}

// elemType is a value's element type: declared, else the data type of the
// node's weight (the usual case: one type throughout).
func (w *writer) elemType(v *graph.Value, n *graph.Node) int32 {
	if t := w.m.typeOf(w.m.valueName[v]); t != nil && t.ElemType != nil {
		return t.GetElemType()
	}
	return w.m.Weights.byKey[n.Params[graph.RoleWeight]].src.td.t.GetDataType()
}

// typeOf is the declared tensor type of a value, nil when none.
func (m *Model) typeOf(name string) *pb.TypeProto_Tensor {
	gp := m.proto.Graph
	for _, list := range [][]*pb.ValueInfoProto{gp.Input, gp.ValueInfo, gp.Output} {
		for _, vi := range list {
			if vi.GetName() == name {
				return vi.GetType().GetTensorType()
			}
		}
	}
	return nil
}
