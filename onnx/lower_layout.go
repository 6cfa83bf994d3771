package onnx

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// LowerLayout turns, for running and emitting, the shape-computing
// subgraphs torch exports (Shape, Gather, Unsqueeze, Concat, Cast, Slice,
// Add/Sub/Mul/Div on shape tensors, ConstantOfShape, Constant) and the
// layout nodes they feed into IR ops whose shapes are computed from the
// input at hand: Reshape, Transpose, Pad, Slice, Resize to another value's
// size, Unsqueeze/Squeeze/Flatten as Reshape, and MatMul by a transposed
// parameter (Linear(bias=False)) as Linear. A shape entry that depends on
// the batch or spatial size stays a reference to that dimension of the
// value it was read from (graph.Dim); a channel count, fixed by the
// weights, becomes a constant. A Pad of zeros that only feeds an
// AveragePool becomes the pool's count_include_pad padding, as torch's own
// avg_pool2d(padding=p) is.
//
// Nodes it cannot lower stay opaque (and the emitter and runtime refuse
// them by name). Like DropZeroPads it is for running only: the model
// refuses to be written afterwards. It returns the number of ONNX nodes
// lowered.
func (m *Model) LowerLayout() (int, error) {
	l := &lowering{m: m, g: m.Graph, sym: map[*graph.Value]*symT{}, byName: map[string]*graph.Value{}, dead: map[*graph.Node]bool{}}
	for v, name := range m.valueName {
		l.byName[name] = v
	}
	l.declared = map[string]int{}
	l.shapes = map[*graph.Value][]*sx{}
	gp := m.proto.Graph
	for _, list := range [][]*pb.ValueInfoProto{gp.Input, gp.Output, gp.ValueInfo} {
		for _, vi := range list {
			if tt := vi.GetType().GetTensorType(); tt != nil && tt.Shape != nil && len(tt.Shape.Dim) >= 2 {
				if c := tt.Shape.Dim[1].GetDimValue(); c > 0 {
					l.declared[vi.GetName()] = int(c)
				}
			}
		}
	}
	l.inRank = 4
	for _, in := range m.proto.Graph.Input {
		if in.GetName() == m.valueName[m.Graph.Input] {
			if tt := in.GetType().GetTensorType(); tt != nil && tt.Shape != nil {
				l.inRank = len(tt.Shape.Dim)
			}
		}
	}
	for _, n := range append([]*graph.Node(nil), m.Graph.Nodes...) {
		info := m.byIR[n]
		if info == nil {
			continue
		}
		if err := l.node(n, info.proto); err != nil {
			return l.count, fmt.Errorf("node %s (%s): %w", info.proto.GetName(), info.proto.GetOpType(), err)
		}
	}
	// Shape nodes no longer read by anything go, last first.
	for i := len(l.g.Nodes) - 1; i >= 0; i-- {
		n := l.g.Nodes[i]
		if l.dead[n] && len(n.Out.Consumers) == 0 && !l.g.IsOutput(n.Out) {
			l.g.Remove(n)
		}
	}
	if l.count > 0 {
		m.lowered = true
	}
	inGraph := map[*graph.Node]bool{}
	for _, n := range l.g.Nodes {
		inGraph[n] = true
	}
	for _, info := range m.infos {
		if info.kind == kindOpaque && info.ir != nil && !inGraph[info.ir] {
			info.lowered = true
		}
	}
	l.auxOutputs()
	if err := l.g.Validate(); err != nil {
		return l.count, fmt.Errorf("lowering the layout ops: %w", err)
	}
	return l.count, nil
}

// auxOutputs turns the graph outputs after the first (a segmentation
// model's "aux", a train-mode export's auxiliary logits), which the reader
// holds as sink nodes so that writing keeps them, into the graph's
// auxiliary outputs: the runtime, verify and the emitter then compute and
// check them as the model's own.
func (l *lowering) auxOutputs() {
	g := l.g
	if gp := l.m.proto.Graph; len(gp.Output) > 1 {
		g.OutputName = gp.Output[0].GetName()
	}
	for _, n := range append([]*graph.Node(nil), g.Nodes...) {
		sp := l.m.special[n]
		if n.Op != OpGraphOutput || sp == nil || sp.kind != specialOutput {
			continue
		}
		v := n.Inputs[0]
		g.Remove(n)
		if v != g.Output {
			g.SetAux(sp.name, v, false)
		}
	}
}

type lowering struct {
	m      *Model
	g      *graph.Graph
	sym    map[*graph.Value]*symT
	byName map[string]*graph.Value
	dead   map[*graph.Node]bool // shape-computing nodes, removed once unread
	// declared is dimension 1 of the shapes the exporter declared
	// (value_info), where concrete.
	declared map[string]int
	// shapes are the symbolic shapes of lowered values, where they say
	// more than their dimensions do (a Reshape's target, a Transpose's
	// permutation of it).
	shapes map[*graph.Value][]*sx
	inRank int
	count  int
}

// sx is a symbolic integer: a constant, a dimension of an IR value, or an
// arithmetic combination.
type sx struct {
	op   byte // 'c', 'd', '+', '-', '*', '/'
	c    int64
	v    *graph.Value
	axis int
	a, b *sx
}

func sc(c int64) *sx { return &sx{op: 'c', c: c} }

func (e *sx) isConst() bool { return e.op == 'c' }

func arith(op byte, a, b *sx) (*sx, error) {
	if a.isConst() && b.isConst() {
		switch op {
		case '+':
			return sc(a.c + b.c), nil
		case '-':
			return sc(a.c - b.c), nil
		case '*':
			return sc(a.c * b.c), nil
		case '/':
			if b.c == 0 {
				return nil, fmt.Errorf("division by zero in a shape computation")
			}
			q := a.c / b.c
			if (a.c%b.c != 0) && ((a.c < 0) != (b.c < 0)) {
				q-- // floor, as torch's integer division of sizes
			}
			return sc(q), nil
		}
	}
	switch {
	case (op == '*' || op == '/') && b.isConst() && b.c == 1:
		return a, nil
	case op == '*' && a.isConst() && a.c == 1:
		return b, nil
	case (op == '+' || op == '-') && b.isConst() && b.c == 0:
		return a, nil
	}
	return &sx{op: op, a: a, b: b}, nil
}

// symT is a small integer tensor whose elements are symbolic.
type symT struct {
	shape []int
	v     []*sx
	// f holds the exact values of a constant, where known (a Constant,
	// or a Concat or Cast of them): v truncates them to integers, and a
	// Resize's scales are not integers.
	f []float64
}

func constT(shape []int, vals []float64) *symT {
	t := &symT{shape: shape, f: append([]float64(nil), vals...)}
	for _, x := range vals {
		t.v = append(t.v, sc(int64(x)))
	}
	return t
}

// fractional reports whether t is a constant with a value that is not an
// integer, which v cannot hold.
func (t *symT) fractional() bool {
	for _, x := range t.f {
		if x != math.Trunc(x) {
			return true
		}
	}
	return false
}

func (t *symT) ints() ([]int64, bool) {
	out := make([]int64, len(t.v))
	for i, e := range t.v {
		if !e.isConst() {
			return nil, false
		}
		out[i] = e.c
	}
	return out, true
}

// shapeOps are the ONNX ops evaluated on shape tensors.
var shapeOps = map[string]bool{
	"Shape": true, "Gather": true, "Unsqueeze": true, "Squeeze": true, "Concat": true, "Cast": true,
	"Slice": true, "Add": true, "Sub": true, "Mul": true, "Div": true, "ConstantOfShape": true,
	"Reshape": true, "Transpose": true, "Identity": true, "Floor": true,
}

// arg is input k of p: a symbolic tensor (a shape tensor or a small
// constant), or an IR data value.
func (l *lowering) arg(p *pb.NodeProto, k int) (*symT, *graph.Value, bool) {
	if k >= len(p.Input) || p.Input[k] == "" {
		return nil, nil, false
	}
	name := p.Input[k]
	if src, ok := l.m.params[name]; ok {
		if src.td.numel > 1024 || src.td.ext != nil {
			return nil, nil, false
		}
		vals, err := src.td.values()
		if err != nil {
			return nil, nil, false
		}
		return constT(append([]int(nil), src.td.shape...), vals), nil, true
	}
	v := l.byName[name]
	if v == nil {
		return nil, nil, false
	}
	if s := l.sym[v]; s != nil {
		return s, v, true
	}
	return nil, v, true
}

func (l *lowering) node(n *graph.Node, p *pb.NodeProto) error {
	l.fillChannels(n)
	if d := p.GetDomain(); d != "" && d != "ai.onnx" {
		return nil
	}
	op := p.GetOpType()
	a := nodeAttrs(p)
	// A shape computation: every input symbolic (Shape: of anything).
	if shapeOps[op] {
		allSym := len(p.Input) > 0
		for k := range p.Input {
			if p.Input[k] == "" {
				continue
			}
			s, _, ok := l.arg(p, k)
			if !ok || (s == nil && !(op == "Shape" && k == 0)) {
				allSym = false
			}
		}
		if allSym {
			out, err := l.eval(op, p, a)
			if err != nil {
				return err
			}
			if out != nil {
				l.sym[n.Out] = out
				l.dead[n] = true
				l.count++
				return nil
			}
		}
	}
	// torchvision's stochastic_depth in a train-mode export: random noise
	// times x (lower_stochdepth.go).
	if n.Op == graph.OpMul && l.stochasticDepth(n, p) {
		return nil
	}
	if randomOps[op] {
		return l.why(n, "random: of the random ops, only torchvision's stochastic_depth noise is recognised (RandomUniformLike, Less, Cast, Div by the survival rate, Mul)")
	}
	if !IsOpaque(n.Op) {
		if n.Op == graph.OpAvgPool {
			l.foldPadIntoPool(n)
		}
		return nil
	}
	x, xv, ok := l.arg(p, 0)
	if !ok || x != nil || xv == nil {
		return nil
	}
	rank := graph.Ranks(l.g, l.inRank)[xv]
	switch op {
	case "Reshape":
		s, _, ok := l.arg(p, 1)
		if !ok || s == nil || a.int("allowzero", 0) != 0 {
			return nil
		}
		var dims []*sx
		for i, e := range s.v {
			if e.isConst() && e.c == 0 {
				// ONNX: 0 copies the input's dimension.
				if rank == 0 || i >= rank {
					return nil
				}
				e = l.dim(xv, i)
			}
			dims = append(dims, e)
		}
		return l.reshape(n, xv, dims)
	case "Unsqueeze", "Squeeze":
		axes := a.ints("axes")
		if s, _, ok := l.arg(p, 1); ok && s != nil {
			c, isConst := s.ints()
			if !isConst {
				return nil
			}
			axes = c
		}
		if rank == 0 || (op == "Unsqueeze" && len(axes) == 0) {
			return nil
		}
		out := rank
		if op == "Unsqueeze" {
			out += len(axes)
		}
		mark := map[int]bool{}
		for _, ax := range axes {
			r := rank
			if op == "Unsqueeze" {
				r = out
			}
			if ax < 0 {
				ax += int64(r)
			}
			mark[int(ax)] = true
		}
		var dims []*sx
		if op == "Unsqueeze" {
			src := 0
			for i := 0; i < out; i++ {
				if mark[i] {
					dims = append(dims, sc(1))
				} else {
					dims = append(dims, l.dim(xv, src))
					src++
				}
			}
		} else {
			if len(axes) == 0 {
				return l.why(n, "without axes it squeezes whatever is 1 at run time")
			}
			for i := 0; i < rank; i++ {
				if !mark[i] {
					dims = append(dims, l.dim(xv, i))
				}
			}
		}
		return l.reshape(n, xv, dims)
	case "Flatten":
		ax := int(a.int("axis", 1))
		if rank == 0 {
			return nil
		}
		if ax < 0 {
			ax += rank
		}
		return l.reshapeDims(n, xv, []graph.Dim{{Ref: 0, From: 0, To: ax}, {Ref: 0, From: ax, To: rank}})
	case "Transpose":
		perm := a.ints("perm")
		if rank == 0 {
			return nil
		}
		attr := graph.Attr{Layout: &graph.Layout{}}
		for i := range rank {
			if len(perm) == 0 {
				attr.Layout.Perm = append(attr.Layout.Perm, rank-1-i)
			} else {
				attr.Layout.Perm = append(attr.Layout.Perm, int(perm[i]))
			}
		}
		nd := l.replace(n, graph.OpTranspose, attr, nil, xv)
		in := l.shapeOf(xv, rank)
		var sh []*sx
		for _, p := range attr.Layout.Perm {
			sh = append(sh, in[p])
		}
		l.shapes[nd.Out] = sh
		if c := sh[1]; len(sh) > 1 && c.isConst() {
			nd.Out.Channels = int(c.c)
		}
	case "Pad":
		if a.str("mode", "constant") != "constant" || rank == 0 {
			return l.why(n, "mode %s: only constant padding is modelled", a.str("mode", "constant"))
		}
		pads := a.ints("pads")
		if s, _, ok := l.arg(p, 1); ok && s != nil {
			c, isConst := s.ints()
			if !isConst {
				return nil
			}
			pads = c
		}
		value := float64(a.float("value", 0))
		if len(p.Input) > 2 && p.Input[2] != "" {
			src, ok := l.m.params[p.Input[2]]
			if !ok {
				return nil
			}
			v, err := src.td.values()
			if err != nil || len(v) != 1 {
				return nil
			}
			value = v[0]
		}
		if len(pads) != 2*rank {
			return nil
		}
		attr := graph.Attr{Layout: &graph.Layout{PadValue: value}}
		for _, x := range pads {
			attr.Layout.Pads = append(attr.Layout.Pads, int(x))
		}
		l.replace(n, graph.OpPad, attr, nil, xv)
	case "Slice":
		return l.slice(n, p, xv, rank)
	case "Resize":
		return l.resize(n, p, a, xv)
	case "MatMul":
		return l.matmul(n, p, xv, rank)
	case "ReduceMean":
		return l.mean(n, p, a, xv, rank)
	case "Split":
		return l.split(n, p, a, xv, rank)
	}
	return nil
}

// dim is dimension axis of v: a constant when it is a known channel count.
func (l *lowering) dim(v *graph.Value, axis int) *sx {
	if axis == 1 && v.Channels > 0 {
		return sc(int64(v.Channels))
	}
	if c := l.declared[l.m.valueName[v]]; axis == 1 && c > 0 {
		return sc(int64(c))
	}
	return &sx{op: 'd', v: v, axis: axis}
}

// eval computes a shape op's symbolic output; nil when it cannot.
func (l *lowering) eval(op string, p *pb.NodeProto, a attrs) (*symT, error) {
	in := func(k int) *symT { s, _, _ := l.arg(p, k); return s }
	switch op {
	case "Identity", "Concat", "Cast", "Floor":
		// These carry exact constant values (symT.f) through.
	default:
		// The others compute on v, the values truncated to integers:
		// F.interpolate(recompute_scale_factor=True) multiplies a size
		// by 1.5, which would read as 1. Such a computation stays opaque.
		for k := range p.Input {
			if s := in(k); s != nil && s.fractional() {
				return nil, nil
			}
		}
	}
	ints := func(k int, name string) ([]int64, bool) {
		if s := in(k); s != nil {
			return s.ints()
		}
		v := a.ints(name)
		return v, v != nil
	}
	switch op {
	case "Identity":
		return in(0), nil
	case "Cast", "Floor":
		x := in(0)
		if x.f == nil {
			return x, nil
		}
		out := &symT{shape: x.shape, v: x.v, f: make([]float64, len(x.f))}
		switch to := a.int("to", 1); {
		case op == "Floor":
			for i, v := range x.f {
				out.f[i] = math.Floor(v)
			}
		case to == 1 || to == 10 || to == 11 || to == 16: // float, float16, double, bfloat16
			copy(out.f, x.f)
		default: // to an integer: truncated, as v holds them
			for i, v := range x.f {
				out.f[i] = math.Trunc(v)
			}
		}
		if op == "Floor" {
			out.v = nil
			for _, v := range out.f {
				out.v = append(out.v, sc(int64(v)))
			}
		}
		return out, nil
	case "Shape":
		var dims []*sx
		if s := in(0); s != nil {
			for _, d := range s.shape {
				dims = append(dims, sc(int64(d)))
			}
		} else {
			_, v, _ := l.arg(p, 0)
			r := graph.Ranks(l.g, l.inRank)[v]
			if r == 0 {
				return nil, nil
			}
			for i := range r {
				dims = append(dims, l.dim(v, i))
			}
		}
		lo, hi := sliceBounds64(a.int("start", 0), a.int("end", int64(len(dims))), len(dims))
		return &symT{shape: []int{hi - lo}, v: dims[lo:hi]}, nil
	case "ConstantOfShape":
		s, ok := in(0).ints()
		if !ok {
			return nil, nil
		}
		fill := 0.0
		if at, ok := a["value"]; ok && at.T != nil {
			td, err := inspectTensor(at.T, l.m.dir)
			if err != nil {
				return nil, nil
			}
			v, err := td.values()
			if err != nil || len(v) != 1 {
				return nil, nil
			}
			fill = v[0]
		}
		shape := make([]int, len(s))
		n := 1
		for i, d := range s {
			shape[i] = int(d)
			n *= int(d)
		}
		if n > 1024 {
			return nil, nil
		}
		vals := make([]float64, n)
		for i := range vals {
			vals[i] = fill
		}
		return constT(shape, vals), nil
	case "Gather":
		x, idx := in(0), in(1)
		ix, ok := idx.ints()
		if !ok || len(x.shape) != 1 || a.int("axis", 0) != 0 || len(idx.shape) > 1 {
			return nil, nil
		}
		out := &symT{shape: append([]int(nil), idx.shape...)}
		for _, i := range ix {
			if i < 0 {
				i += int64(len(x.v))
			}
			if i < 0 || int(i) >= len(x.v) {
				return nil, fmt.Errorf("gathers index %d of a shape of %d", i, len(x.v))
			}
			out.v = append(out.v, x.v[i])
		}
		return out, nil
	case "Unsqueeze", "Squeeze":
		x := in(0)
		axes, _ := ints(1, "axes")
		shape := append([]int(nil), x.shape...)
		if op == "Unsqueeze" {
			for range axes {
				shape = append(shape, 1)
			}
			if len(shape) > 1 && len(x.v) != 1 && len(x.shape) > 0 {
				return nil, nil // only scalars and vectors of one are unsqueezed here
			}
			if len(x.v) == 1 {
				shape = make([]int, len(x.shape)+len(axes))
				for i := range shape {
					shape[i] = 1
				}
			}
		} else {
			shape = nil
			for _, d := range x.shape {
				if d != 1 {
					shape = append(shape, d)
				}
			}
		}
		return &symT{shape: shape, v: x.v}, nil
	case "Concat":
		out := &symT{}
		n, exact := 0, true
		for k := range p.Input {
			s := in(k)
			if s == nil || len(s.shape) != 1 {
				return nil, nil
			}
			out.v = append(out.v, s.v...)
			out.f = append(out.f, s.f...)
			exact = exact && s.f != nil
			n += s.shape[0]
		}
		if !exact {
			out.f = nil
		}
		out.shape = []int{n}
		return out, nil
	case "Add", "Sub", "Mul", "Div":
		x, y := in(0), in(1)
		if len(x.v) != len(y.v) && len(x.v) != 1 && len(y.v) != 1 {
			return nil, nil
		}
		out := &symT{shape: x.shape}
		if len(y.v) > len(x.v) {
			out.shape = y.shape
		}
		sym := map[string]byte{"Add": '+', "Sub": '-', "Mul": '*', "Div": '/'}[op]
		for i := range max(len(x.v), len(y.v)) {
			e, err := arith(sym, x.v[min(i, len(x.v)-1)], y.v[min(i, len(y.v)-1)])
			if err != nil {
				return nil, err
			}
			out.v = append(out.v, e)
		}
		return out, nil
	case "Reshape":
		x := in(0)
		s, ok := in(1).ints()
		if !ok {
			return nil, nil
		}
		shape := make([]int, len(s))
		infer, known := -1, 1
		for i, d := range s {
			switch {
			case d == 0 && i < len(x.shape):
				shape[i] = x.shape[i]
			case d == -1:
				infer = i
				continue
			default:
				shape[i] = int(d)
			}
			known *= shape[i]
		}
		if infer >= 0 && known > 0 {
			shape[infer] = len(x.v) / known
		}
		return &symT{shape: shape, v: x.v}, nil
	case "Transpose":
		x := in(0)
		if len(x.shape) == 1 {
			return x, nil
		}
		if len(x.shape) != 2 {
			return nil, nil
		}
		r, c := x.shape[0], x.shape[1]
		out := &symT{shape: []int{c, r}}
		for j := 0; j < c; j++ {
			for i := 0; i < r; i++ {
				out.v = append(out.v, x.v[i*c+j])
			}
		}
		return out, nil
	case "Slice":
		return l.evalSlice(p, a, in)
	}
	return nil, nil
}

// evalSlice slices a shape tensor along one axis, with any step (torch's
// F.pad reverses its pads with a step of -1).
func (l *lowering) evalSlice(p *pb.NodeProto, a attrs, in func(int) *symT) (*symT, error) {
	x := in(0)
	get := func(k int, name string) ([]int64, bool) {
		if len(p.Input) > 1 { // opset 10+: inputs
			if k >= len(p.Input) || p.Input[k] == "" {
				return nil, true
			}
			s := in(k)
			if s == nil {
				return nil, false
			}
			return s.ints()
		}
		return a.ints(name), true
	}
	starts, ok1 := get(1, "starts")
	ends, ok2 := get(2, "ends")
	axes, ok3 := get(3, "axes")
	steps, ok4 := get(4, "steps")
	if !(ok1 && ok2 && ok3 && ok4) || len(starts) != 1 || len(ends) != 1 {
		return nil, nil
	}
	ax := int64(0)
	if len(axes) == 1 {
		ax = axes[0]
	}
	step := int64(1)
	if len(steps) == 1 {
		step = steps[0]
	}
	if ax < 0 {
		ax += int64(len(x.shape))
	}
	if ax < 0 || int(ax) >= len(x.shape) || step == 0 {
		return nil, nil
	}
	n := int64(x.shape[ax])
	idx := sliceIndices(starts[0], ends[0], step, n)
	inner := 1
	for _, d := range x.shape[ax+1:] {
		inner *= d
	}
	outer := len(x.v) / (int(n) * inner)
	out := &symT{shape: append([]int(nil), x.shape...)}
	out.shape[ax] = len(idx)
	for o := 0; o < outer; o++ {
		for _, i := range idx {
			base := (o*int(n) + int(i)) * inner
			out.v = append(out.v, x.v[base:base+inner]...)
		}
	}
	return out, nil
}

// sliceIndices are the indices of start:end:step over n, as ONNX Slice
// (and Python) clamp them.
func sliceIndices(start, end, step, n int64) []int64 {
	if start < 0 {
		start += n
	}
	if end < 0 {
		end += n
	}
	var idx []int64
	if step > 0 {
		start, end = min(max(start, 0), n), min(max(end, 0), n)
		for i := start; i < end; i += step {
			idx = append(idx, i)
		}
	} else {
		start, end = min(max(start, -1), n-1), min(max(end, -1), n-1)
		for i := start; i > end; i += step {
			idx = append(idx, i)
		}
	}
	return idx
}

func sliceBounds64(start, end int64, n int) (int, int) {
	c := func(v int64) int {
		if v < 0 {
			v += int64(n)
		}
		return int(min(max(v, 0), int64(n)))
	}
	return c(start), c(end)
}

// reshape replaces n by a Reshape of x to dims.
func (l *lowering) reshape(n *graph.Node, x *graph.Value, dims []*sx) error {
	refs := []*graph.Value{x}
	dims = l.resolveInfer(x, dims)
	var out []graph.Dim
	for _, e := range dims {
		d, ok := toDim(e, &refs)
		if !ok {
			return l.why(n, "a shape entry is not a product of dimensions, scaled or divided by constants")
		}
		out = append(out, d)
	}
	if err := l.reshapeDims(n, x, out, refs[1:]...); err != nil {
		return err
	}
	l.shapes[l.byName[l.m.valueName[n.Out]]] = dims
	return nil
}

func (l *lowering) reshapeDims(n *graph.Node, x *graph.Value, dims []graph.Dim, refs ...*graph.Value) error {
	nd := l.replace(n, graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: dims}}, nil, append([]*graph.Value{x}, refs...)...)
	if len(dims) > 1 && dims[1].Ref < 0 && dims[1].Const > 0 {
		nd.Out.Channels = int(dims[1].Const)
	} else if len(dims) > 1 && dims[1].Ref == 0 && dims[1].From == 1 && dims[1].To == 2 && dims[1].Mul == 0 && dims[1].Div == 0 {
		nd.Out.Channels = x.Channels
	}
	return nil
}

// toDim turns a symbolic entry into a graph.Dim, adding the values it reads
// to refs.
func toDim(e *sx, refs *[]*graph.Value) (graph.Dim, bool) {
	ref := func(v *graph.Value) int {
		for i, r := range *refs {
			if r == v {
				return i
			}
		}
		*refs = append(*refs, v)
		return len(*refs) - 1
	}
	switch e.op {
	case 'c':
		return graph.ConstDim(e.c), true
	case 'd':
		return graph.RefDim(ref(e.v), e.axis), true
	case '*':
		if e.b.isConst() && e.b.c > 0 {
			d, ok := toDim(e.a, refs)
			if ok && d.Ref >= 0 && d.Mul == 0 && d.Div == 0 {
				d.Mul = e.b.c
				return d, true
			}
		}
		if e.a.isConst() && !e.b.isConst() {
			return toDim(&sx{op: '*', a: e.b, b: e.a}, refs)
		}
		da, oka := toDim(e.a, refs)
		db, okb := toDim(e.b, refs)
		if oka && okb && da.Ref >= 0 && da.Ref == db.Ref && da.To == db.From && da.Mul == 0 && da.Div == 0 && db.Mul == 0 && db.Div == 0 {
			da.To = db.To
			return da, true
		}
	case '/':
		if e.b.isConst() && e.b.c > 0 {
			d, ok := toDim(e.a, refs)
			if ok && d.Ref >= 0 && d.Div == 0 {
				d.Div = e.b.c
				return d, true
			}
		}
	}
	return graph.Dim{}, false
}

// replace puts a new node computing op in n's place, under n's name.
func (l *lowering) replace(n *graph.Node, op graph.Op, attr graph.Attr, params map[string]string, inputs ...*graph.Value) *graph.Node {
	g := l.g
	tmp := n.Name + "#lowered"
	keep := g.Output // Add makes the new node the output
	out := g.Add(tmp, op, attr, params, inputs...)
	g.Output = keep
	nd := out.Producer
	// Move it from the end to just after n.
	g.Nodes = g.Nodes[:len(g.Nodes)-1]
	for i, m := range g.Nodes {
		if m == n {
			g.Nodes = append(g.Nodes[:i+1], append([]*graph.Node{nd}, g.Nodes[i+1:]...)...)
			break
		}
	}
	out.Channels = n.Out.Channels
	g.ReplaceUses(n.Out, out)
	name := n.Name
	onnxName := l.m.valueName[n.Out]
	g.Remove(n)
	g.Rename(nd, name)
	l.byName[onnxName] = out
	l.m.valueName[out] = onnxName
	l.count++
	return nd
}

// slice lowers a Slice of data with constant bounds and step 1, one
// OpSlice per axis.
func (l *lowering) slice(n *graph.Node, p *pb.NodeProto, x *graph.Value, rank int) error {
	get := func(k int) ([]int64, bool) {
		if k >= len(p.Input) || p.Input[k] == "" {
			return nil, true
		}
		s, _, ok := l.arg(p, k)
		if !ok || s == nil {
			return nil, false
		}
		return s.ints()
	}
	if len(p.Input) < 3 || rank == 0 {
		return nil // opset < 10: attributes; not exported by torch 1.13 at 11+
	}
	starts, ok1 := get(1)
	ends, ok2 := get(2)
	axes, ok3 := get(3)
	steps, ok4 := get(4)
	if !(ok1 && ok2 && ok3 && ok4) || len(starts) != len(ends) || len(starts) != 1 {
		return nil
	}
	for _, s := range steps {
		if s != 1 {
			return l.why(n, "step %d: only slices with step 1 are modelled", s)
		}
	}
	ax := int64(0)
	if len(axes) == 1 {
		ax = axes[0]
	}
	clamp := func(v int64) int { return int(min(max(v, -(1<<40)), 1<<40)) }
	nd := l.replace(n, graph.OpSlice, graph.Attr{Axis: int(ax), Layout: &graph.Layout{Start: clamp(starts[0]), End: clamp(ends[0])}}, nil, x)
	if ax < 0 {
		ax += int64(rank)
	}
	if c := l.dim(x, 1); ax == 1 && c.isConst() {
		lo, hi := sliceBounds64(starts[0], ends[0], int(c.c))
		nd.Out.Channels = hi - lo
	}
	return nil
}

// resize lowers Resize(x, roi, scales, sizes) as torch exports
// F.interpolate: with sizes that are x's batch and channels and another
// value's height and width (size=r.shape[-2:]), a Resize to that value's
// size; with constant spatial sizes (size=(h, w)), a Resize to that size;
// with constant scales of 1 for the batch and channels (scale_factor=s,
// which torch writes as Concat(Constant [1, 1], Constant [s, s])), a
// Resize by that factor. Sizes computed from x's own size
// (recompute_scale_factor=True) are evaluated like any shape: x's height
// and width times integers are a Resize by those factors; by a fraction
// the computation stays opaque (see eval), and so does the Resize.
func (l *lowering) resize(n *graph.Node, p *pb.NodeProto, a attrs, x *graph.Value) error {
	var attr graph.Attr
	mode := a.str("mode", "nearest")
	ct := a.str("coordinate_transformation_mode", "half_pixel")
	switch {
	case mode == "nearest" && ct == "asymmetric" && a.str("nearest_mode", "round_prefer_floor") == "floor":
		attr.Mode = "nearest"
	case mode == "linear" && (ct == "half_pixel" || ct == "pytorch_half_pixel"):
		attr.Mode = "bilinear"
	case mode == "linear" && ct == "align_corners":
		attr.Mode, attr.AlignCorners = "bilinear", true
	default:
		return l.why(n, "mode %s with coordinate_transformation_mode %s: only nearest (asymmetric, floor) and bilinear are modelled", mode, ct)
	}
	if ct == "pytorch_half_pixel" {
		// Same as half_pixel except for an output of size 1.
		return nil
	}
	if len(p.Input) < 4 || p.Input[3] == "" {
		return l.resizeByScales(n, p, attr, x)
	}
	s, _, ok := l.arg(p, 3)
	if !ok || s == nil {
		return l.why(n, "sizes computed by more than shape arithmetic (F.interpolate(scale_factor=f, recompute_scale_factor=True) with a non-integer f is not modelled)")
	}
	if len(s.v) != 4 {
		return nil
	}
	same := func(e *sx, axis int) bool {
		want := l.dim(x, axis)
		return e.op == want.op && e.c == want.c && e.v == want.v && e.axis == want.axis
	}
	h, w := s.v[2], s.v[3]
	if !same(s.v[0], 0) || !same(s.v[1], 1) {
		return l.why(n, "the sizes change the batch or the channels")
	}
	if h.isConst() && w.isConst() {
		if h.c <= 0 || w.c <= 0 || h.c > 1<<30 || w.c > 1<<30 {
			return l.why(n, "sizes %d x %d", h.c, w.c)
		}
		attr.Size = [2]int{int(h.c), int(w.c)}
		if nd := l.replace(n, graph.OpResize, attr, nil, x); nd.Out.Channels == 0 {
			nd.Out.Channels = x.Channels
		}
		return nil
	}
	if fh, fw := l.multiple(x, h, 2), l.multiple(x, w, 3); fh > 0 && fw > 0 {
		// x's own height and width times integers: recompute_scale_factor
		// =True by an integer factor, for which in/out is 1/scale.
		attr.Scale = [2]float64{float64(fh), float64(fw)}
		if nd := l.replace(n, graph.OpResize, attr, nil, x); nd.Out.Channels == 0 {
			nd.Out.Channels = x.Channels
		}
		return nil
	}
	if h.op != 'd' || w.op != 'd' || h.v != w.v {
		return l.why(n, "the sizes are neither constants, nor another tensor's height and width, nor the input's times integers")
	}
	r := graph.Ranks(l.g, l.inRank)[h.v]
	if r < 2 || h.axis != r-2 || w.axis != r-1 {
		return nil
	}
	l.replace(n, graph.OpResize, attr, nil, x, h.v)
	return nil
}

// multiple is k when e is dimension axis of x times a positive integer
// constant k (floor(H * 2.0) evaluated), 0 otherwise.
func (l *lowering) multiple(x *graph.Value, e *sx, axis int) int64 {
	isDim := func(e *sx) bool { return e.op == 'd' && e.v == x && e.axis == axis }
	switch {
	case e.op == '*' && isDim(e.a) && e.b.isConst() && e.b.c > 0:
		return e.b.c
	case e.op == '*' && isDim(e.b) && e.a.isConst() && e.a.c > 0:
		return e.a.c
	}
	return 0
}

// resizeByScales lowers a Resize by constant scales (1, 1, sh, sw). ONNX
// holds them as float32: each is read back as the shortest decimal that
// rounds to it (1.1, not 1.100000023841858), the double torch was given,
// since torch steps through the input by 1/scale in double before
// rounding to float.
func (l *lowering) resizeByScales(n *graph.Node, p *pb.NodeProto, attr graph.Attr, x *graph.Value) error {
	s, _, ok := l.arg(p, 2)
	if !ok {
		return l.why(n, "neither scales nor sizes")
	}
	if s == nil || s.f == nil {
		return l.why(n, "the scales are not constants")
	}
	if len(s.f) != 4 || s.f[0] != 1 || s.f[1] != 1 {
		return l.why(n, "scales %v: only (1, 1, h, w) resizing of (N, C, H, W) is modelled", s.f)
	}
	for d, f := range s.f[2:] {
		if !(f > 0 && f < 1e6) {
			return l.why(n, "scale %g", f)
		}
		attr.Scale[d], _ = strconv.ParseFloat(strconv.FormatFloat(float64(float32(f)), 'g', -1, 32), 64)
	}
	if nd := l.replace(n, graph.OpResize, attr, nil, x); nd.Out.Channels == 0 {
		nd.Out.Channels = x.Channels
	}
	return nil
}

// matmul lowers MatMul(x, Transpose(W)) with W a [out, in] parameter, as
// torch exports Linear(bias=False), to Linear reading W.
func (l *lowering) matmul(n *graph.Node, p *pb.NodeProto, x *graph.Value, rank int) error {
	if rank != 2 || len(p.Input) != 2 {
		return nil
	}
	if src, ok := l.m.params[p.Input[1]]; ok {
		return l.foldedMatMul(n, p, x, src)
	}
	tv := l.byName[p.Input[1]]
	if tv == nil || !IsOpaque(tv.Producer.Op) {
		return nil
	}
	tinfo := l.m.byIR[tv.Producer]
	if tinfo == nil || tinfo.proto.GetOpType() != "Transpose" || len(tinfo.proto.Input) != 1 {
		return nil
	}
	if perm := nodeAttrs(tinfo.proto).ints("perm"); len(perm) != 0 && (len(perm) != 2 || perm[0] != 1 || perm[1] != 0) {
		return nil
	}
	key := tinfo.proto.Input[0]
	src, ok := l.m.params[key]
	if !ok || len(src.td.shape) != 2 {
		return nil
	}
	if _, ok := l.m.Weights.byKey[key]; !ok {
		return nil
	}
	attr := graph.Attr{OutChannels: src.td.shape[0], InChannels: src.td.shape[1]}
	nd := l.replace(n, graph.OpLinear, attr, map[string]string{graph.RoleWeight: key}, x)
	nd.Out.Channels = attr.OutChannels
	if len(tv.Consumers) == 0 {
		l.dead[tv.Producer] = true
	}
	return nil
}

// foldPadIntoPool makes Pad(zeros, spatial, symmetric) + AveragePool one
// AvgPool with count_include_pad padding: torch's avg_pool2d(padding=p)
// exports that way, and keeps its unpadded input for backward.
func (l *lowering) foldPadIntoPool(pool *graph.Node) {
	pad := pool.Inputs[0].Producer
	if pad.Op != graph.OpPad || len(pad.Out.Consumers) != 1 || pad.Attr.Lay().PadValue != 0 || pool.Attr.Padding != [2]int{} {
		return
	}
	pp := pad.Attr.Lay().Pads
	if len(pp) != 8 || pp[0] != 0 || pp[1] != 0 || pp[4] != 0 || pp[5] != 0 || pp[2] != pp[6] || pp[3] != pp[7] {
		return
	}
	k := pool.Attr.KernelSize
	if 2*pp[2] > k[0] || 2*pp[3] > k[1] {
		return
	}
	pool.Attr.Padding = [2]int{pp[2], pp[3]}
	pool.Attr.CountIncludePad = true
	x := pad.Inputs[0]
	pool.Inputs[0] = x
	pad.Out.Consumers = nil
	x.Consumers = append(x.Consumers, pool)
	l.g.Remove(pad)
}

// fillChannels sets the channel count of a value the reader could not
// annotate because an input was opaque then.
func (l *lowering) fillChannels(n *graph.Node) {
	if n.Out.Channels != 0 || len(n.Inputs) == 0 || IsOpaque(n.Op) {
		return
	}
	switch n.Op {
	case graph.OpConcat:
		if n.Attr.Axis != 1 && n.Attr.Axis != -3 {
			return
		}
		c := 0
		for _, in := range n.Inputs {
			if in.Channels == 0 {
				return
			}
			c += in.Channels
		}
		n.Out.Channels = c
	case graph.OpReshape, graph.OpTranspose, graph.OpSlice, graph.OpFlatten, graph.OpLinear, graph.OpConv:
	default:
		n.Out.Channels = n.Inputs[0].Channels
	}
}

// shapeOf is v's symbolic shape: what lowering recorded, or its dimensions.
func (l *lowering) shapeOf(v *graph.Value, rank int) []*sx {
	if s, ok := l.shapes[v]; ok {
		return s
	}
	out := make([]*sx, rank)
	for i := range out {
		out[i] = l.dim(v, i)
	}
	return out
}

// factors splits a product into its constant and its other factors.
func factors(e *sx, coef *int64, rest *[]*sx) bool {
	switch {
	case e.isConst():
		*coef *= e.c
		return true
	case e.op == '*':
		return factors(e.a, coef, rest) && factors(e.b, coef, rest)
	case e.op == 'd':
		*rest = append(*rest, e)
		return true
	}
	return false
}

func sameSym(a, b *sx) bool {
	return a.op == b.op && a.c == b.c && a.v == b.v && a.axis == b.axis &&
		(a.a == nil) == (b.a == nil) && (a.a == nil || (sameSym(a.a, b.a) && sameSym(a.b, b.b)))
}

// resolveInfer replaces a Reshape's -1 by what it must be, when the
// factors of the input's element count and of the other entries cancel
// but for a constant: a channel shuffle's x.view(n, -1, h, w) has
// c channels.
func (l *lowering) resolveInfer(x *graph.Value, dims []*sx) []*sx {
	infer := -1
	for i, e := range dims {
		if e.isConst() && e.c == -1 {
			infer = i
		}
	}
	rank := graph.Ranks(l.g, l.inRank)[x]
	if infer < 0 || rank == 0 {
		return dims
	}
	inCoef, outCoef := int64(1), int64(1)
	var inRest, outRest []*sx
	for _, e := range l.shapeOf(x, rank) {
		if !factors(e, &inCoef, &inRest) {
			return dims
		}
	}
	for i, e := range dims {
		if i != infer && !factors(e, &outCoef, &outRest) {
			return dims
		}
	}
	for _, o := range outRest {
		found := false
		for k, in := range inRest {
			if sameSym(in, o) {
				inRest = append(inRest[:k], inRest[k+1:]...)
				found = true
				break
			}
		}
		if !found {
			return dims
		}
	}
	if len(inRest) != 0 || outCoef == 0 || inCoef%outCoef != 0 {
		return dims
	}
	out := append([]*sx(nil), dims...)
	out[infer] = sc(inCoef / outCoef)
	return out
}

// mean lowers x.mean((2, 3)) (ReduceMean over H and W, keepdims 0, as
// shufflenet and mnasnet end) to the reader's global average pool of the
// keepdims form, then a Reshape to (N, C).
func (l *lowering) mean(n *graph.Node, p *pb.NodeProto, a attrs, x *graph.Value, rank int) error {
	if rank != 4 || a.int("keepdims", 1) != 0 || !a.only("axes", "keepdims") {
		return nil
	}
	axes := a.ints("axes")
	if len(p.Input) > 1 {
		s, _, ok := l.arg(p, 1)
		if !ok || s == nil {
			return nil
		}
		c, isConst := s.ints()
		if !isConst {
			return nil
		}
		axes = c
	}
	if len(axes) != 2 || !((axes[0] == 2 && axes[1] == 3) || (axes[0] == -2 && axes[1] == -1)) {
		return nil
	}
	g := l.g
	pool := l.replace(n, graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, nil, x)
	pool.Out.Channels = x.Channels
	name := pool.Name
	g.Rename(pool, name+"_pool")
	consumers := append([]*graph.Node(nil), pool.Out.Consumers...)
	wasOut := g.Output == pool.Out
	keep := g.Output
	out := g.Add(name, graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{graph.RefDim(0, 0), graph.RefDim(0, 1)}}}, nil, pool.Out)
	g.Output = keep
	nd := out.Producer
	g.Nodes = g.Nodes[:len(g.Nodes)-1]
	for i, m := range g.Nodes {
		if m == pool {
			g.Nodes = append(g.Nodes[:i+1], append([]*graph.Node{nd}, g.Nodes[i+1:]...)...)
			break
		}
	}
	for _, c := range consumers {
		for k, in := range c.Inputs {
			if in == pool.Out {
				c.Inputs[k] = out
			}
		}
		out.Consumers = append(out.Consumers, c)
	}
	pool.Out.Consumers = []*graph.Node{nd}
	if wasOut {
		g.Output = out
	}
	for i := range g.Aux {
		if g.Aux[i].Value == pool.Out {
			g.Aux[i].Value = out
		}
	}
	out.Channels = x.Channels
	onnxName := l.m.valueName[pool.Out]
	l.byName[onnxName] = out
	l.m.valueName[out] = onnxName
	return nil
}

// foldedMatMul lowers MatMul(x, W') where W' is an initializer torch's
// constant folding made of Linear(bias=False)'s transposed weight, under a
// name of its own ("onnx::MatMul_25"): the module path is read off the
// node's scope name ("/fc1/MatMul": fc1), and the key fc1.weight is added
// to the model's weights with W' transposed back, so that the state dict's
// fc1.weight matches it.
func (l *lowering) foldedMatMul(n *graph.Node, p *pb.NodeProto, x *graph.Value, src *paramSrc) error {
	parts := strings.Split(strings.Trim(p.GetName(), "/"), "/")
	if len(src.td.shape) != 2 || len(parts) < 2 || parts[len(parts)-1] != "MatMul" || src.td.ext != nil {
		return nil
	}
	key := parts[len(parts)-2] + "." + graph.RoleWeight
	if _, taken := l.m.Weights.byKey[key]; taken || strings.HasSuffix(p.Input[1], "."+graph.RoleWeight) {
		return nil
	}
	v, err := src.td.values()
	if err != nil {
		return nil
	}
	in, out := src.td.shape[0], src.td.shape[1]
	f := make([]float32, len(v))
	for i := 0; i < in; i++ {
		for j := 0; j < out; j++ {
			f[j*in+i] = float32(v[i*out+j])
		}
	}
	dt := dtFloat
	td, err := inspectTensor(&pb.TensorProto{Name: &key, DataType: &dt, Dims: []int64{int64(out), int64(in)}, FloatData: f}, l.m.dir)
	if err != nil {
		return fmt.Errorf("transposing %s: %w", p.Input[1], err)
	}
	ps := &paramSrc{root: key, td: td, node: -1}
	l.m.params[key] = ps
	l.m.Weights.add(&param{key: key, value: key, src: ps})
	nd := l.replace(n, graph.OpLinear, graph.Attr{OutChannels: out, InChannels: in}, map[string]string{graph.RoleWeight: key}, x)
	nd.Out.Channels = out
	return nil
}

// split lowers Split (torch.split, x.chunk) into one Slice per output: the
// node's output 0 and the projection nodes of its further outputs.
func (l *lowering) split(n *graph.Node, p *pb.NodeProto, a attrs, x *graph.Value, rank int) error {
	if rank == 0 || !a.only("axis", "split", "num_outputs") {
		return nil
	}
	ax := int(a.int("axis", 0))
	if ax < 0 {
		ax += rank
	}
	size := l.dim(x, ax)
	if !size.isConst() && ax != 1 {
		return nil
	}
	sizes := a.ints("split")
	if len(p.Input) > 1 && p.Input[1] != "" {
		s, _, ok := l.arg(p, 1)
		if !ok || s == nil {
			return nil
		}
		c, isConst := s.ints()
		if !isConst {
			return nil
		}
		sizes = c
	}
	if sizes == nil {
		if !size.isConst() {
			return nil
		}
		k := int64(len(p.Output))
		per := (size.c + k - 1) / k
		for i := int64(0); i < k; i++ {
			sizes = append(sizes, min(per, size.c-i*per))
		}
	}
	if len(sizes) != len(p.Output) {
		return nil
	}
	// The projections of outputs 1.. read n's output: each becomes a Slice
	// of x first.
	start := make([]int, len(sizes)+1)
	for i, s := range sizes {
		start[i+1] = start[i] + int(s)
	}
	for _, c := range append([]*graph.Node(nil), n.Out.Consumers...) {
		sp := l.m.special[c]
		if c.Op != OpOutput || sp == nil || sp.kind != specialProjection {
			continue
		}
		k := -1
		for i, o := range p.Output {
			if o == sp.name {
				k = i
			}
		}
		if k <= 0 {
			return nil
		}
		nd := l.replace(c, graph.OpSlice, graph.Attr{Axis: ax, Layout: &graph.Layout{Start: start[k], End: start[k+1]}}, nil, x)
		if ax == 1 {
			nd.Out.Channels = int(sizes[k])
		}
	}
	nd := l.replace(n, graph.OpSlice, graph.Attr{Axis: ax, Layout: &graph.Layout{Start: 0, End: start[1]}}, nil, x)
	if ax == 1 {
		nd.Out.Channels = int(sizes[0])
	}
	return nil
}

// why records, for an opaque node lowering leaves as it is, the reason
// Opaque reports.
func (l *lowering) why(n *graph.Node, format string, args ...any) error {
	if info := l.m.byIR[n]; info != nil {
		info.why = fmt.Sprintf(format, args...)
	}
	return nil
}
