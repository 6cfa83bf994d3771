package onnx

import (
	"math"

	"github.com/abnconvert/abnconvert/graph"
)

// fuse merges the activations torch exports as several ONNX nodes into the
// one IR op PyTorch ran, so that the runtime keeps for backward what
// PyTorch keeps (SiLU its input, not a sigmoid's output and both operands
// of a product) and the emitted module calls the same function:
//
//   - SiLU: Mul(x, Sigmoid(x)), how torch exports nn.SiLU before opset 14
//     (and in 1.13 at every opset);
//   - Hardswish: Mul(x, HardSigmoid(x)) with alpha 1/6 and beta 1/2, how
//     torch exports nn.Hardswish before opset 14;
//   - GELU: Mul(Mul(x, Add(Erf(Div(x, sqrt 2)), 1)), 0.5), how torch
//     exports the exact nn.GELU before opset 20;
//   - Mish: Mul(x, Tanh(Softplus(x))), how torch 1.13 exports nn.Mish
//     (ONNX's Mish is opset 18's);
//   - Softplus(beta): Div(Softplus(Mul(x, beta)), beta), how torch exports
//     nn.Softplus with beta other than 1 (its threshold is not exported:
//     the node is read with torch's default 20, as a bare Softplus is).
//
// The last node of a pattern stands for it in the IR; the others leave the
// IR, and the writer writes all of them as read (a rewrite that renames x
// is refused). Each inner value must have no reader outside the pattern.
func (b *builder) fuse() {
	for _, n := range append([]*graph.Node(nil), b.g.Nodes...) {
		if b.g.Node(n.Name) != n {
			continue // absorbed by an earlier match
		}
		switch {
		case n.Op == graph.OpMul:
			for k := 0; k < 2; k++ {
				x, gate := n.Inputs[k], n.Inputs[1-k].Producer
				if b.fuseMish(n, x, gate) {
					break
				}
				if len(gate.Inputs) != 1 || gate.Inputs[0] != x || !b.onlyReader(gate.Out, n) {
					continue
				}
				if gate.Op == graph.OpSigmoid {
					b.absorb(n, x, graph.OpSiLU, gate)
					break
				}
				if gate.Op == graph.OpHardsigmoid && gate.Attr.ActParam == 1.0/6 && gate.Attr.ActParam2 == 0.5 {
					b.absorb(n, x, graph.OpHardswish, gate)
					break
				}
			}
		case n.Op == graph.Op(OpaquePrefix+"Mul"):
			b.fuseGELU(n)
		case n.Op == graph.Op(OpaquePrefix+"Div"):
			b.fuseSoftplusBeta(n)
		}
	}
}

// fuseMish matches Mul(x, Tanh(Softplus(x))) ending in n, gate the Tanh,
// and absorbs it.
func (b *builder) fuseMish(n *graph.Node, x *graph.Value, gate *graph.Node) bool {
	if gate.Op != graph.OpTanh || len(gate.Inputs) != 1 || !b.onlyReader(gate.Out, n) {
		return false
	}
	sp := gate.Inputs[0].Producer
	if sp.Op != graph.OpSoftplus || sp.Attr.ActParam != 1 || len(sp.Inputs) != 1 || sp.Inputs[0] != x || !b.onlyReader(sp.Out, gate) {
		return false
	}
	b.absorb(n, x, graph.OpMish, sp, gate)
	return true
}

// fuseSoftplusBeta matches Div(Softplus(Mul(x, beta)), beta) ending in n,
// the two constants equal.
func (b *builder) fuseSoftplusBeta(n *graph.Node) {
	beta, ok := b.constScalar(n, "Div")
	if !ok || beta == 0 {
		return
	}
	// Div reads the softplus as its first ONNX input: not beta / softplus.
	if info := b.m.byIR[n]; len(info.data) != 1 || info.data[0] != 0 {
		return
	}
	sp := n.Inputs[0].Producer
	if sp.Op != graph.OpSoftplus || sp.Attr.ActParam != 1 || len(sp.Inputs) != 1 || !b.onlyReader(sp.Out, n) {
		return
	}
	mul := sp.Inputs[0].Producer
	if m, ok := b.constScalar(mul, "Mul"); !ok || float32(m) != float32(beta) || !b.onlyReader(mul.Out, sp) {
		return
	}
	b.absorb(n, mul.Inputs[0], graph.OpSoftplus, mul, sp)
	// absorb leaves the node attribute-free; Softplus carries beta and
	// torch's default threshold.
	n.Attr = graph.Attr{ActParam: decimal32(float32(beta)), ActParam2: 20}
	b.m.byIR[n].attr = n.Attr
}

// fuseGELU matches the exact GELU ending in n, Mul(·, 0.5).
func (b *builder) fuseGELU(n *graph.Node) {
	if !b.constOperand(n, "Mul", 0.5) {
		return
	}
	m1 := n.Inputs[0].Producer
	if m1.Op != graph.OpMul || !b.onlyReader(m1.Out, n) {
		return
	}
	for k := 0; k < 2; k++ {
		x, add := m1.Inputs[k], m1.Inputs[1-k].Producer
		if !b.constOperand(add, "Add", 1) || !b.onlyReader(add.Out, m1) {
			continue
		}
		erf := add.Inputs[0].Producer
		if erf.Op != graph.Op(OpaquePrefix+"Erf") || len(erf.Inputs) != 1 || !b.onlyReader(erf.Out, add) {
			continue
		}
		div := erf.Inputs[0].Producer
		if !b.constOperand(div, "Div", math.Sqrt2) || div.Inputs[0] != x || !b.onlyReader(div.Out, erf) {
			continue
		}
		// Div reads x as its first ONNX input: x / sqrt 2, not sqrt 2 / x.
		if info := b.m.byIR[div]; info == nil || len(info.data) != 1 || info.data[0] != 0 {
			continue
		}
		b.absorb(n, x, graph.OpGELU, div, erf, add, m1)
		return
	}
}

// constOperand reports whether n is the opaque ONNX op with one computed
// input and, as its other input, a scalar constant within float32
// rounding of want.
func (b *builder) constOperand(n *graph.Node, op string, want float64) bool {
	v, ok := b.constScalar(n, op)
	return ok && math.Abs(v-want) <= 1e-6*want
}

// constScalar returns the scalar constant operand of n, the opaque ONNX op
// with one computed input and a constant one.
func (b *builder) constScalar(n *graph.Node, op string) (float64, bool) {
	info := b.m.byIR[n]
	if n.Op != graph.Op(OpaquePrefix+op) || info == nil || len(n.Inputs) != 1 || len(info.data) != 1 {
		return 0, false
	}
	p := info.proto
	if len(p.Input) != 2 || len(p.Attribute) != 0 || len(p.Output) != 1 {
		return 0, false
	}
	src, ok := b.param(p, 1-info.data[0])
	if !ok {
		return 0, false
	}
	v, err := src.td.values()
	if err != nil || len(v) != 1 {
		return 0, false
	}
	return v[0], true
}

// onlyReader reports whether n is v's one reader (in the IR, which counts
// further graph outputs as readers too) and v is not the graph output.
func (b *builder) onlyReader(v *graph.Value, n *graph.Node) bool {
	if b.g.IsOutput(v) || len(v.Consumers) != 1 || v.Consumers[0] != n {
		return false
	}
	info := b.m.byIR[v.Producer]
	return info != nil && len(info.proto.Output) == 1 && b.uses[info.proto.Output[0]] == 1
}

// absorb makes last the one IR node of a pattern computing op(x), and takes
// the inner nodes (in graph order) out of the IR.
func (b *builder) absorb(last *graph.Node, x *graph.Value, op graph.Op, inner ...*graph.Node) {
	info := b.m.byIR[last]
	for _, in := range last.Inputs {
		in.Consumers = removeFirst(in.Consumers, last)
	}
	last.Op, last.Attr, last.Params = op, graph.Attr{}, map[string]string{}
	last.Inputs = []*graph.Value{x}
	x.Consumers = append(x.Consumers, last)
	for _, n := range inner {
		n.Out.Consumers = nil
	}
	for k := len(inner) - 1; k >= 0; k-- {
		n := inner[k]
		ni := b.m.byIR[n]
		ni.kind, ni.ir = kindFused, nil
		delete(b.m.byIR, n)
		b.g.Remove(n)
		info.absorbed = append(info.absorbed, ni)
	}
	info.kind, info.why = kindModelled, ""
	info.op, info.attr = op, graph.Attr{}
	info.params = map[string]int{}
	// x is read by name by the absorbed nodes, which the writer keeps as
	// read: an implicit input, whose renaming the writer refuses.
	info.data = []int{-1}
	info.implicit = []string{b.m.valueName[x]}
}

func removeFirst(list []*graph.Node, n *graph.Node) []*graph.Node {
	for i, m := range list {
		if m == n {
			return append(list[:i:i], list[i+1:]...)
		}
	}
	return list
}
