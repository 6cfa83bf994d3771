package onnx

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
)

// An export made without dynamic axes declares its input at the export's
// shape, and torch writes every x.size() it traced as a constant: a
// channel shuffle's x.view(n, 2, c // 2, h, w) becomes Reshape to
// [2, 2, 58, 8, 8], which the converted network and the emitted module
// then run only at that batch size (any other fails in a reshape, far
// from the cause). FixedShape finds such an export at conversion time.

// shapeOperands are the ops whose operand (by index) is a shape torch
// writes from x.size() without dynamic axes.
var shapeOperands = map[string]int{"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Tile": 1}

// FixedShape reports an export whose input has no symbolic dimension and
// whose shape constants (or, after LowerLayout, the IR Reshapes it
// evaluated) hold its batch size: the input's declared dims,
// and the nodes (op, name and constant) that bake them. nil dims when the
// input has a symbolic dimension or no shape constant holds the batch size.
func (m *Model) FixedShape() (dims []int64, uses []string) {
	g := m.proto.GetGraph()
	if g == nil {
		return nil, nil
	}
	inits := map[string]bool{}
	for _, t := range g.GetInitializer() {
		inits[t.GetName()] = true
	}
	for _, in := range g.GetInput() {
		if inits[in.GetName()] {
			continue // an initializer listed as an input (old exporters)
		}
		tt := in.GetType().GetTensorType()
		if tt == nil || tt.GetShape() == nil {
			return nil, nil
		}
		for _, d := range tt.GetShape().GetDim() {
			if d.GetDimParam() != "" || d.GetDimValue() <= 0 {
				return nil, nil // symbolic: dynamic axes were given
			}
			dims = append(dims, d.GetDimValue())
		}
		break // the network's input: the first that is not an initializer
	}
	if len(dims) < 2 {
		return nil, nil
	}
	for _, info := range m.infos {
		k, ok := shapeOperands[info.proto.GetOpType()]
		if !ok || len(info.proto.Input) <= k {
			continue
		}
		name := info.proto.Input[k]
		v, err := m.Weights.Values(name)
		if err != nil || len(v) < 2 || int64(v[0]) != dims[0] {
			continue
		}
		ints := make([]string, len(v))
		for i, x := range v {
			ints[i] = fmt.Sprint(int64(x))
		}
		uses = append(uses, fmt.Sprintf("%s (%s) to [%s]", info.proto.GetOpType(), readerOf(info).Node, strings.Join(ints, ", ")))
	}
	// After LowerLayout, shapes torch computed from constants (a Concat
	// of Unsqueezed sizes) are IR Reshapes with constant entries.
	for _, n := range m.Graph.Nodes {
		if n.Op != graph.OpReshape || n.Attr.Layout == nil || len(n.Attr.Layout.Shape) < 2 {
			continue
		}
		d := n.Attr.Layout.Shape
		if d[0].Ref >= 0 || d[0].Const != dims[0] {
			continue
		}
		ints := make([]string, len(d))
		for i, e := range d {
			if e.Ref < 0 {
				ints[i] = fmt.Sprint(e.Const)
			} else {
				ints[i] = "?"
			}
		}
		name := n.Name
		if src, _, ok := m.Source(n); ok && src != "" {
			name = src
		}
		uses = append(uses, fmt.Sprintf("Reshape (%s) to [%s]", name, strings.Join(ints, ", ")))
	}
	if len(uses) == 0 {
		return nil, nil
	}
	return dims, uses
}

// FixedShapeWarning is the conversion's warning for FixedShape, "" when
// the export has dynamic axes or nothing depends on the fixed shape.
func (m *Model) FixedShapeWarning() string {
	dims, uses := m.FixedShape()
	if dims == nil {
		return ""
	}
	shape := make([]string, len(dims))
	for i, d := range dims {
		shape[i] = fmt.Sprint(d)
	}
	more := ""
	if len(uses) > 3 {
		more = fmt.Sprintf(" and %d more", len(uses)-3)
		uses = uses[:3]
	}
	axes := `{0: "n"}`
	if len(dims) == 4 {
		axes = `{0: "n", 2: "h", 3: "w"}`
	}
	return fmt.Sprintf("%s was exported without dynamic axes: its input is fixed at [%s] and torch wrote shapes computed from it as constants (%s%s), so the converted network and the emitted module run only at batch size %d (another fails in a reshape); re-export with dynamic axes: torch.onnx.export(model, x, %q, input_names=[\"x\"], dynamic_axes={\"x\": %s}, ...), the README's recipe",
		m.Path, strings.Join(shape, ", "), strings.Join(uses, "; "), more, dims[0], m.Path, axes)
}
