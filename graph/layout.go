package graph

import (
	"fmt"
	"strings"
)

// The layout ops: they move or reshape elements without arithmetic
// (channel shuffle, inception's padding, segmentation heads' crops).
const (
	// OpReshape gives its first input the shape Attr.Shape, computed at run
	// time: the entries may read the dimensions of the node's inputs
	// (input 0 itself, or further inputs read for their shape alone), as
	// torch code computes x.view(n, g, c // g, h, w) from x.size(). Like
	// x.view, its output is a view of its input.
	OpReshape Op = "Reshape"
	// OpTranspose permutes its input's dimensions by Attr.Perm (output
	// dimension i is input dimension Perm[i]); the result is contiguous.
	OpTranspose Op = "Transpose"
	// OpPad pads with the constant Attr.PadValue: Attr.Pads lists, as ONNX
	// does, the elements added before each dimension, then after each.
	OpPad Op = "Pad"
	// OpSlice keeps elements Attr.Start up to Attr.End (exclusive; clamped
	// to the dimension, negative counts from its end, as Python slices do)
	// of dimension Attr.Axis, with step 1.
	OpSlice Op = "Slice"
)

// Layout holds the attributes of the layout ops.
type Layout struct {
	// Reshape.
	Shape []Dim `json:"shape,omitempty"`
	// Transpose.
	Perm []int `json:"perm,omitempty"`
	// Pad.
	Pads     []int   `json:"pads,omitempty"`
	PadValue float64 `json:"pad_value,omitempty"`
	// Slice (with Attr.Axis).
	Start int `json:"start,omitempty"`
	End   int `json:"end,omitempty"`
}

// Lay returns the layout attributes, zero when unset.
func (a Attr) Lay() Layout {
	if a.Layout == nil {
		return Layout{}
	}
	return *a.Layout
}

// Dim is one entry of a shape computed at run time. With Ref >= 0 it is
// Mul * (the product of dimensions From..To-1 of the node's input Ref) /
// Div, floor division, Mul and Div 1 when zero: x.size(1) // 2 is {Ref: 0,
// From: 1, To: 2, Div: 2}. With Ref < 0 it is the constant Const, -1 meaning
// "whatever makes the element count right", as in x.view(n, -1).
type Dim struct {
	Ref   int   `json:"ref"`
	From  int   `json:"from,omitempty"`
	To    int   `json:"to,omitempty"`
	Mul   int64 `json:"mul,omitempty"`
	Div   int64 `json:"div,omitempty"`
	Const int64 `json:"const,omitempty"`
}

// ConstDim is the constant entry c.
func ConstDim(c int64) Dim { return Dim{Ref: -1, Const: c} }

// RefDim is dimension axis of input ref.
func RefDim(ref, axis int) Dim { return Dim{Ref: ref, From: axis, To: axis + 1} }

// Eval computes the entry from the shapes of the node's inputs; -1 stays -1.
func (d Dim) Eval(ins [][]int) (int, error) {
	if d.Ref < 0 {
		return int(d.Const), nil
	}
	if d.Ref >= len(ins) {
		return 0, fmt.Errorf("shape entry reads input %d of %d", d.Ref, len(ins))
	}
	s := ins[d.Ref]
	if d.From < 0 || d.To > len(s) || d.From > d.To {
		return 0, fmt.Errorf("shape entry reads dimensions %d..%d of a %d-dimensional input", d.From, d.To-1, len(s))
	}
	v := int64(1)
	for _, x := range s[d.From:d.To] {
		v *= int64(x)
	}
	if d.Mul != 0 {
		v *= d.Mul
	}
	if d.Div != 0 {
		if d.Div < 0 {
			return 0, fmt.Errorf("shape entry divides by %d", d.Div)
		}
		v /= d.Div
	}
	return int(v), nil
}

// String renders the entry as the Python that computes it, with in naming
// the inputs: "x.shape[1] // 2", "x.shape[2:4].numel()", "-1".
func (d Dim) String(in func(int) string) string {
	if d.Ref < 0 {
		return fmt.Sprint(d.Const)
	}
	s := fmt.Sprintf("%s.shape[%d]", in(d.Ref), d.From)
	if d.To != d.From+1 {
		s = fmt.Sprintf("%s.shape[%d:%d].numel()", in(d.Ref), d.From, d.To)
	}
	if d.Mul != 0 && d.Mul != 1 {
		s = fmt.Sprintf("%s * %d", s, d.Mul)
	}
	if d.Div != 0 && d.Div != 1 {
		s = fmt.Sprintf("%s // %d", s, d.Div)
	}
	return s
}

func (a Attr) layoutSummary(op Op) string {
	l := a.Lay()
	switch op {
	case OpReshape:
		var parts []string
		for _, d := range l.Shape {
			parts = append(parts, d.String(func(k int) string { return fmt.Sprintf("in%d", k) }))
		}
		return "(" + strings.Join(parts, ", ") + ")"
	case OpTranspose:
		return fmt.Sprintf("perm=%v", l.Perm)
	case OpPad:
		return fmt.Sprintf("pads=%v value=%g", l.Pads, l.PadValue)
	case OpSlice:
		return fmt.Sprintf("axis=%d %d:%d", a.Axis, l.Start, l.End)
	}
	return ""
}

// Ranks infers the number of dimensions of every value from the input's,
// 0 where it cannot tell (opaque nodes). Emitters use it to choose, say,
// BatchNorm1d for a BN on (N, C).
func Ranks(g *Graph, input int) map[*Value]int {
	r := map[*Value]int{}
	for _, n := range g.Nodes {
		ins := make([]int, len(n.Inputs))
		for k, in := range n.Inputs {
			ins[k] = r[in]
		}
		r[n.Out] = rankOf(n, ins, input)
	}
	return r
}

// RankOf is the rank of one value (see Ranks), found by walking back
// through its producers.
func RankOf(v *Value, input int) int {
	memo := map[*Value]int{}
	var walk func(v *Value) int
	walk = func(v *Value) int {
		if r, ok := memo[v]; ok {
			return r
		}
		n := v.Producer
		ins := make([]int, len(n.Inputs))
		for k, in := range n.Inputs {
			ins[k] = walk(in)
		}
		memo[v] = rankOf(n, ins, input)
		return memo[v]
	}
	return walk(v)
}

func rankOf(n *Node, ins []int, input int) int {
	in0 := 0
	if len(ins) > 0 {
		in0 = ins[0]
	}
	switch n.Op {
	case OpInput:
		return input
	case OpFlatten:
		if n.Attr.StartDim >= 0 {
			return n.Attr.StartDim + 1
		}
		if in0 > 0 {
			return in0 + n.Attr.StartDim + 1
		}
		return 0
	case OpLinear:
		return 2
	case OpReshape:
		return len(n.Attr.Lay().Shape)
	case OpConv, OpMaxPool, OpAvgPool, OpAdaptiveAvgPool, OpResize:
		return 4
	}
	if strings.Contains(string(n.Op), ".") || strings.Contains(string(n.Op), ":") {
		return 0 // opaque: unknown
	}
	for _, r := range ins {
		in0 = max(in0, r)
	}
	return in0
}
