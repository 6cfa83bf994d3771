package emit

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// isLayout reports whether checkLayout and layoutExpr handle op.
func isLayout(op graph.Op) bool {
	switch op {
	case graph.OpReshape, graph.OpTranspose, graph.OpPad, graph.OpSlice:
		return true
	}
	return false
}

// checkLayout checks the attributes of the layout ops (graph/layout.go);
// any other op is not supported by the emitter. (Resize is emitted with
// the other ops, in python.go.)
func checkLayout(n *graph.Node) error {
	l := n.Attr.Lay()
	switch n.Op {
	case graph.OpReshape:
		if len(l.Shape) == 0 {
			return fmt.Errorf("no target shape")
		}
		for _, d := range l.Shape {
			if d.Ref >= len(n.Inputs) {
				return fmt.Errorf("a shape entry reads input %d of %d", d.Ref, len(n.Inputs))
			}
		}
	case graph.OpTranspose:
		seen := map[int]bool{}
		for _, p := range l.Perm {
			if p < 0 || p >= len(l.Perm) || seen[p] {
				return fmt.Errorf("perm %v is not a permutation", l.Perm)
			}
			seen[p] = true
		}
	case graph.OpPad:
		if len(l.Pads) == 0 || len(l.Pads)%2 != 0 {
			return fmt.Errorf("pads %v", l.Pads)
		}
		for _, p := range l.Pads {
			if p < 0 {
				return fmt.Errorf("negative pads %v", l.Pads)
			}
		}
	case graph.OpSlice:
	default:
		return failure.Unsupportedf("op %s not supported by the Python emitter", n.Op)
	}
	return nil
}

// layoutExpr is the Python expression of a layout op. Computed
// shapes read the tensors' own sizes (x.shape), so the module runs at any
// batch size and resolution.
func (p *program) layoutExpr(n *graph.Node) (string, bool) {
	a, l := n.Attr, n.Attr.Lay()
	in := func(i int) string { return p.vars[n.Inputs[i]] }
	switch n.Op {
	case graph.OpReshape:
		var dims []string
		for _, d := range l.Shape {
			dims = append(dims, d.String(in))
		}
		expr := fmt.Sprintf("%s.reshape(%s)", in(0), strings.Join(dims, ", "))
		if numel, ok := constNumel(l.Shape); ok && len(p.g.FixedInput) > 0 {
			// An export without dynamic axes: the shape is the export's
			// constant, and at another input the reshape's own error
			// ("shape '[2, 2, 4, 8, 8]' is invalid for input of size
			// 2048") says nothing of the cause. An expression, so that
			// it stays one line of forward (a generator's throw raises).
			msg := fmt.Sprintf("this module was converted from an ONNX export made without dynamic axes, at input shape (%s): its reshape to (%s) fits that shape only; the tensor here is ", joinInts(p.g.FixedInput), strings.Join(dims, ", "))
			cond := fmt.Sprintf("%s.numel() == %d", in(0), numel)
			if int64(p.g.FixedInput[0]) == l.Shape[0].Const {
				// The export's batch size, baked in: at another batch
				// with as many elements the reshape would mix samples.
				cond = fmt.Sprintf("%s.shape[0] == %d and %s", in(0), l.Shape[0].Const, cond)
			}
			expr = fmt.Sprintf("(%s if %s else (_ for _ in ()).throw(RuntimeError(%s + str(tuple(%s.shape)) + %s)))",
				expr, cond, pyStr(msg), in(0), pyStr(": re-export with dynamic_axes (the abnconvert README's recipe) and convert again"))
		}
		return expr, true
	case graph.OpTranspose:
		return fmt.Sprintf("%s.permute(%s).contiguous()", in(0), joinInts(l.Perm)), true
	case graph.OpPad:
		// F.pad lists the last dimension first, before then after.
		r := len(l.Pads) / 2
		var tp []int
		for d := r - 1; d >= 0; d-- {
			tp = append(tp, l.Pads[d], l.Pads[r+d])
		}
		// Trailing zero pairs of the leading dimensions say nothing.
		for len(tp) > 2 && tp[len(tp)-1] == 0 && tp[len(tp)-2] == 0 {
			tp = tp[:len(tp)-2]
		}
		return fmt.Sprintf("F.pad(%s, (%s), value=%s)", in(0), joinInts(tp), pyFloat(l.PadValue)), true
	case graph.OpSlice:
		bound := func(v int) string {
			if v >= 1<<40 || v <= -(1<<40) {
				return ""
			}
			return fmt.Sprint(v)
		}
		start := bound(l.Start)
		if l.Start == 0 {
			start = ""
		}
		s := start + ":" + bound(l.End)
		var idx string
		if a.Axis >= 0 {
			idx = strings.Repeat(":, ", a.Axis) + s
		} else {
			idx = "..., " + s + strings.Repeat(", :", -a.Axis-1)
		}
		return fmt.Sprintf("%s[%s]", in(0), idx), true
	}
	return "", false
}

// constNumel is the element count of a shape whose entries are all
// positive constants; ok is false for shapes read from a tensor or with -1.
func constNumel(shape []graph.Dim) (int64, bool) {
	n := int64(1)
	for _, d := range shape {
		if d.Ref >= 0 || d.Const <= 0 {
			return 0, false
		}
		n *= d.Const
	}
	return n, len(shape) > 0
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	out := strings.Join(s, ", ")
	if len(v) == 1 {
		out += ","
	}
	return out
}

// bnClass is the torch class of a plain BN node: BatchNorm1d on (N, C)
// (after a Linear), BatchNorm2d otherwise.
func bnClass(n *graph.Node) string {
	if len(n.Inputs) == 1 && graph.RankOf(n.Inputs[0], 4) == 2 {
		return "torch.nn.BatchNorm1d"
	}
	return "torch.nn.BatchNorm2d"
}
