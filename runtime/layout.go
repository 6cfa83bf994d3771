package runtime

import (
	"fmt"
	"math"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// Layout holds the ops that move elements without arithmetic over tensors
// of any rank, and resizing: Transpose, Pad, Slice, Concat along any axis
// and Resize (graph/layout.go). It is a separate interface so that a
// backend without these kernels (cuda, today) still satisfies Backend: the
// executor refuses such a network, as unsupported, before running it.
type Layout interface {
	// Permute writes src with its dimensions permuted into dst: dst
	// dimension i is src dimension perm[i].
	Permute(dst, src Tensor, perm []int) error
	// Fill sets every element of dst to v.
	Fill(dst Tensor, v float32) error
	// CopyBox copies the box of the given size at srcOff in src to dstOff
	// in dst (same rank); add accumulates instead of overwriting.
	CopyBox(dst, src Tensor, dstOff, srcOff, size []int, add bool) error
	// Resize interpolates src (N, C, H, W) to dst's spatial size as
	// torch's F.interpolate does (nearest, or bilinear with or without
	// align_corners), reading source positions as how says.
	Resize(dst, src Tensor, how Interp) error
	// ResizeBackward is Resize's adjoint: dx (overwritten) from dy.
	ResizeBackward(dx, dy Tensor, how Interp) error
}

// Interp says how Resize maps output positions to input positions.
type Interp struct {
	Bilinear, AlignCorners bool
	// Scale is the scale factor per spatial axis (height, width) torch was
	// given, zero when it was given an output size (or another tensor's):
	// torch then steps through the input by 1/Scale rather than in/out,
	// which differ when in * Scale is not an integer.
	Scale [2]float64
}

// InterpOf is the Interp of a Resize node's attributes.
func InterpOf(a graph.Attr) Interp {
	return Interp{Bilinear: a.Mode == "bilinear", AlignCorners: a.AlignCorners, Scale: a.Scale}
}

// Step is the distance in the input between two output positions along
// axis (0 height, 1 width) when resizing in to out, as torch's upsample
// kernels compute it in float (aten/src/ATen/native/UpSample.h,
// area_pixel_compute_scale and compute_scales_value): (in-1)/(out-1) with
// align_corners, else float(1/scale) when a scale factor was given, else
// in/out. Backends share it so that they read the same positions.
func (h Interp) Step(axis, in, out int) float32 {
	if h.Bilinear && h.AlignCorners {
		if out > 1 {
			return float32(in-1) / float32(out-1)
		}
		return 0
	}
	if s := h.Scale[axis]; s > 0 {
		return float32(1.0 / s)
	}
	return float32(in) / float32(out)
}

// NearestIndex is the input position output position o reads when
// resizing in to out with the nearest mode: floor(o * step), clamped.
// With exact, it is torch 1.13's nearest_idx, which copies when out equals
// in and halves when out is twice in, whatever the scale factor: torch's
// backward always uses it, its forward only in the channels-last kernel
// (which a contiguous tensor of one channel takes); the forward of other
// tensors (TensorIterator's HelperInterpNearest) does not. The two differ
// when a scale factor other than 1 or 2 gives such a size (2.1 for an
// input of 5: torch's forward reads row 0 three times, its backward sends
// the gradient of output row 2 to input row 1). Torch 2.6 takes them in
// every forward: there, and only in such cases, its results differ from
// 1.13's and the runtime's.
func NearestIndex(o, in, out int, step float32, exact bool) int {
	switch {
	case exact && out == in:
		return o
	case exact && out == 2*in:
		return o >> 1
	}
	return min(int(math.Floor(float64(float32(o)*step))), in-1)
}

// isLayoutOp reports whether the executor runs nd through layoutForward:
// the layout ops, and a Concat that is not along the channels of 4-D
// tensors (which Elementwise.Concat covers).
func isLayoutOp(nd *graph.Node, ins [][]int) bool {
	switch nd.Op {
	case graph.OpTranspose, graph.OpPad, graph.OpSlice, graph.OpResize:
		return true
	case graph.OpConcat:
		return len(ins) > 0 && !(len(ins[0]) == 4 && normAxis(nd.Attr.Axis, 4) == 1)
	}
	return false
}

func normAxis(ax, rank int) int {
	if ax < 0 {
		return ax + rank
	}
	return ax
}

// layoutShape is outShape for the layout ops and Reshape; ok is false for
// any other op.
func layoutShape(nd *graph.Node, ins [][]int) (out []int, ok bool, err error) {
	a, l := nd.Attr, nd.Attr.Lay()
	x := ins[0]
	switch nd.Op {
	case graph.OpReshape:
		out, err = reshapeShape(l.Shape, ins)
		return out, true, err
	case graph.OpTranspose:
		if len(l.Perm) != len(x) {
			return nil, true, fmt.Errorf("perm %v for a %d-dimensional input", l.Perm, len(x))
		}
		seen := make([]bool, len(x))
		out = make([]int, len(x))
		for i, p := range l.Perm {
			if p < 0 || p >= len(x) || seen[p] {
				return nil, true, fmt.Errorf("perm %v is not a permutation", l.Perm)
			}
			seen[p] = true
			out[i] = x[p]
		}
		return out, true, nil
	case graph.OpPad:
		if len(l.Pads) != 2*len(x) {
			return nil, true, fmt.Errorf("pads %v for a %d-dimensional input", l.Pads, len(x))
		}
		out = make([]int, len(x))
		for d := range x {
			if l.Pads[d] < 0 || l.Pads[len(x)+d] < 0 {
				return nil, true, fmt.Errorf("negative pads %v (cropping) are not supported", l.Pads)
			}
			out[d] = x[d] + l.Pads[d] + l.Pads[len(x)+d]
		}
		return out, true, nil
	case graph.OpSlice:
		ax := normAxis(a.Axis, len(x))
		if ax < 0 || ax >= len(x) {
			return nil, true, fmt.Errorf("axis %d of a %d-dimensional input", a.Axis, len(x))
		}
		lo, hi := sliceBounds(l.Start, l.End, x[ax])
		if hi <= lo {
			return nil, true, fmt.Errorf("slice %d:%d of a dimension of %d is empty", l.Start, l.End, x[ax])
		}
		out = append([]int(nil), x...)
		out[ax] = hi - lo
		return out, true, nil
	case graph.OpResize:
		if a.Mode != "nearest" && a.Mode != "bilinear" {
			return nil, true, fmt.Errorf("resize mode %q: want nearest or bilinear", a.Mode)
		}
		var ref []int
		if len(ins) > 1 {
			ref = ins[1]
		}
		out, err = a.ResizeShape(x, ref)
		return out, true, err
	case graph.OpConcat:
		ax := normAxis(a.Axis, len(x))
		if ax < 0 || ax >= len(x) {
			return nil, true, fmt.Errorf("axis %d of a %d-dimensional input", a.Axis, len(x))
		}
		out = append([]int(nil), x...)
		for _, s := range ins[1:] {
			if len(s) != len(x) {
				return nil, true, fmt.Errorf("concatenates shapes %v and %v", x, s)
			}
			for d := range s {
				if d != ax && s[d] != x[d] {
					return nil, true, fmt.Errorf("concatenates shapes %v and %v along axis %d", x, s, ax)
				}
			}
			out[ax] += s[ax]
		}
		return out, true, nil
	}
	return nil, false, nil
}

// sliceBounds clamps a Python slice start:end to a dimension of n.
func sliceBounds(start, end, n int) (lo, hi int) {
	clamp := func(v int) int {
		if v < 0 {
			v += n
		}
		return min(max(v, 0), n)
	}
	return clamp(start), clamp(end)
}

// reshapeShape evaluates a Reshape's computed shape against its inputs.
func reshapeShape(dims []graph.Dim, ins [][]int) ([]int, error) {
	if len(dims) == 0 {
		return nil, fmt.Errorf("no target shape")
	}
	out := make([]int, len(dims))
	infer, known := -1, 1
	for i, d := range dims {
		v, err := d.Eval(ins)
		if err != nil {
			return nil, err
		}
		switch {
		case v == -1 && infer < 0:
			infer = i
		case v < 1:
			return nil, fmt.Errorf("target shape entry %d is %d", i, v)
		default:
			known *= v
		}
		out[i] = v
	}
	n := numel(ins[0])
	if infer >= 0 {
		if known == 0 || n%known != 0 {
			return nil, fmt.Errorf("cannot view %v as %v", ins[0], out)
		}
		out[infer] = n / known
	}
	if numel(out) != n {
		return nil, fmt.Errorf("cannot view %v (%d elements) as %v", ins[0], n, out)
	}
	return out, nil
}

func (e *Executor) layout() (Layout, error) {
	l, ok := e.b.(Layout)
	if !ok {
		return nil, failure.Unsupportedf("the %s backend has no layout kernels (Transpose, Pad, Slice, Concat along any axis, Resize)", e.b.Name())
	}
	return l, nil
}

// layoutForward runs a layout op.
func (e *Executor) layoutForward(r *run, i int, nd *graph.Node) error {
	l, err := e.layout()
	if err != nil {
		return err
	}
	y, x := r.vals[i], e.in(r, nd, 0)
	a, la := nd.Attr, nd.Attr.Lay()
	switch nd.Op {
	case graph.OpTranspose:
		return l.Permute(y, x, la.Perm)
	case graph.OpPad:
		if err := l.Fill(y, float32(la.PadValue)); err != nil {
			return err
		}
		return l.CopyBox(y, x, la.Pads[:len(x.Shape())], zeros(len(x.Shape())), x.Shape(), false)
	case graph.OpSlice:
		return l.CopyBox(y, x, zeros(len(y.Shape())), sliceOffset(nd, x.Shape()), y.Shape(), false)
	case graph.OpResize:
		return l.Resize(y, x, InterpOf(a))
	case graph.OpConcat:
		ax := normAxis(a.Axis, len(y.Shape()))
		off := zeros(len(y.Shape()))
		for k := range nd.Inputs {
			src := e.in(r, nd, k)
			if err := l.CopyBox(y, src, off, zeros(len(off)), src.Shape(), false); err != nil {
				return err
			}
			off[ax] += src.Shape()[ax]
		}
		return nil
	}
	return failure.Internalf("op %s is not a layout op", nd.Op)
}

// layoutBackward runs a layout op's backward; Resize's second input and
// Reshape's shape inputs get no gradient (only their shape is read).
func (e *Executor) layoutBackward(r *run, i int, nd *graph.Node, dy Tensor) error {
	l, err := e.layout()
	if err != nil {
		return err
	}
	a, la := nd.Attr, nd.Attr.Lay()
	if nd.Op == graph.OpConcat {
		ax := normAxis(a.Axis, len(dy.Shape()))
		off := zeros(len(dy.Shape()))
		for k := range nd.Inputs {
			t, err := e.inputTarget(r, nd, k, nil)
			if err != nil {
				return err
			}
			sh := t.dst.Shape()
			if err := l.CopyBox(t.dst, dy, zeros(len(off)), off, sh, false); err != nil {
				return err
			}
			off[ax] += sh[ax]
			if err := t.finish(); err != nil {
				return err
			}
		}
		return nil
	}
	tx, err := e.inputTarget(r, nd, 0, nil)
	if err != nil {
		return err
	}
	dx := tx.dst
	switch nd.Op {
	case graph.OpTranspose:
		inv := make([]int, len(la.Perm))
		for k, p := range la.Perm {
			inv[p] = k
		}
		err = l.Permute(dx, dy, inv)
	case graph.OpPad:
		err = l.CopyBox(dx, dy, zeros(len(dx.Shape())), la.Pads[:len(dx.Shape())], dx.Shape(), false)
	case graph.OpSlice:
		if err = l.Fill(dx, 0); err == nil {
			err = l.CopyBox(dx, dy, sliceOffset(nd, dx.Shape()), zeros(len(dx.Shape())), dy.Shape(), false)
		}
	case graph.OpResize:
		err = l.ResizeBackward(dx, dy, InterpOf(a))
	default:
		return failure.Internalf("op %s is not a layout op", nd.Op)
	}
	if err != nil {
		return err
	}
	return tx.finish()
}

func zeros(n int) []int { return make([]int, n) }

func sliceOffset(nd *graph.Node, in []int) []int {
	off := zeros(len(in))
	ax := normAxis(nd.Attr.Axis, len(in))
	off[ax], _ = sliceBounds(nd.Attr.Lay().Start, nd.Attr.Lay().End, in[ax])
	return off
}

// The shape-only backend checks shapes and computes nothing.

func (s *shapes) Permute(dst, src Tensor, perm []int) error {
	if err := live(src); err != nil {
		return err
	}
	if len(perm) != len(src.Shape()) || numel(dst.Shape()) != numel(src.Shape()) {
		return fmt.Errorf("permute: %v by %v into %v", src.Shape(), perm, dst.Shape())
	}
	return live(dst)
}

func (s *shapes) Fill(dst Tensor, v float32) error { return live(dst) }

func (s *shapes) CopyBox(dst, src Tensor, dstOff, srcOff, size []int, add bool) error {
	if err := live(src); err != nil {
		return err
	}
	if err := live(dst); err != nil {
		return err
	}
	return checkBox(dst.Shape(), src.Shape(), dstOff, srcOff, size)
}

func (s *shapes) Resize(dst, src Tensor, how Interp) error {
	return checkResize(dst, src)
}

func (s *shapes) ResizeBackward(dx, dy Tensor, how Interp) error {
	return checkResize(dy, dx)
}

func checkResize(dst, src Tensor) error {
	if err := live(src); err != nil {
		return err
	}
	if err := live(dst); err != nil {
		return err
	}
	d, s := dst.Shape(), src.Shape()
	if len(d) != 4 || len(s) != 4 || d[0] != s[0] || d[1] != s[1] {
		return fmt.Errorf("resize: %v to %v", s, d)
	}
	return nil
}

func checkBox(dst, src, dstOff, srcOff, size []int) error {
	if len(dst) != len(src) || len(dstOff) != len(dst) || len(srcOff) != len(dst) || len(size) != len(dst) {
		return fmt.Errorf("copy box: ranks of %v, %v, %v, %v, %v differ", dst, src, dstOff, srcOff, size)
	}
	for d := range dst {
		if dstOff[d] < 0 || srcOff[d] < 0 || size[d] < 0 || dstOff[d]+size[d] > dst[d] || srcOff[d]+size[d] > src[d] {
			return fmt.Errorf("copy box of %v from %v at %v to %v at %v: out of range", size, src, srcOff, dst, dstOff)
		}
	}
	return nil
}

// inShapes are the planned shapes of nd's inputs.
func (r *run) inShapes(e *Executor, nd *graph.Node) [][]int {
	ins := make([][]int, len(nd.Inputs))
	for k, in := range nd.Inputs {
		ins[k] = r.p.shapes[e.index[in.Producer]]
	}
	return ins
}

// savedInput is the storage node i keeps when it keeps its input k. A
// Slice's output is a copy here, where torch's x[:, a:b] and x.chunk are
// views that keep the whole tensor they slice: so a node keeping a Slice
// output keeps the sliced tensor instead, as PyTorch's saved-tensor
// figure counts it, and its backward slices it again (rematerialize).
func (p *plan) savedInput(nd *graph.Node, i, k int, sto func(int) int, index map[*graph.Node]int) int {
	src := nd.Inputs[k].Producer
	if src.Op != graph.OpSlice || src.Inputs[0].Producer.Op == graph.OpSlice {
		return sto(index[src])
	}
	if p.remat == nil {
		p.remat = map[int][]int{}
	}
	for _, kk := range p.remat[i] {
		if kk == k {
			return sto(index[src.Inputs[0].Producer])
		}
	}
	p.remat[i] = append(p.remat[i], k)
	return sto(index[src.Inputs[0].Producer])
}

// rematerialize slices again, into temporaries, the Slice outputs node nd
// kept as the tensors they slice; restore frees them.
func (e *Executor) rematerialize(r *run, i int, nd *graph.Node) (restore func(), err error) {
	var temps []int
	restore = func() {
		for _, j := range temps {
			e.b.Free(r.vals[j])
			r.vals[j] = nil
		}
	}
	for _, k := range r.p.remat[i] {
		j := e.index[nd.Inputs[k].Producer]
		if r.vals[j] != nil {
			continue // still live
		}
		l, err := e.layout()
		if err != nil {
			return restore, err
		}
		sl := e.g.Nodes[j]
		src := e.in(r, sl, 0)
		if src == nil {
			return restore, failure.Internalf("the tensor %s slices is not live (plan bug)", sl.Name)
		}
		t, err := e.b.Alloc(r.p.shapes[j], r.p.act)
		if err != nil {
			return restore, err
		}
		r.vals[j] = t
		temps = append(temps, j)
		if err := l.CopyBox(t, src, zeros(len(t.Shape())), sliceOffset(sl, src.Shape()), t.Shape(), false); err != nil {
			return restore, err
		}
	}
	return restore, nil
}
