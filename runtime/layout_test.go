package runtime

import (
	"math"
	"reflect"
	"testing"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

type layoutCase struct {
	opCase
	SavedElems int64 `json:"saved_elems"`
}

// buildLayoutCase makes the graph of a case of layout_ops.json.gz (see
// fixtures/layout_ops.py).
func buildLayoutCase(c layoutCase) (*graph.Graph, *graph.MemWeights) {
	oc := c.opCase
	switch oc.Graph {
	case "single", "concat":
		return buildCase(oc)
	}
	w := graph.NewMemWeights()
	g := graph.New(oc.Name, oc.Input.Shape[1])
	x := g.Input
	switch oc.Graph {
	case "shuffle":
		// torchvision's channel_shuffle, with the sizes read from x.
		k := int64(oc.Attr.Groups)
		r1 := g.Add("r1", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{
			graph.RefDim(0, 0), graph.ConstDim(k), {Ref: 0, From: 1, To: 2, Div: k}, graph.RefDim(0, 2), graph.RefDim(0, 3)}}}, nil, x)
		t := g.Add("t", graph.OpTranspose, graph.Attr{Layout: &graph.Layout{Perm: []int{0, 2, 1, 3, 4}}}, nil, r1)
		g.Add("op", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{
			graph.RefDim(1, 0), graph.ConstDim(-1), graph.RefDim(1, 2), graph.RefDim(1, 3)}}}, nil, t, x)
	case "slice_conv":
		params := map[string]string{graph.RoleWeight: "op.weight"}
		pw := oc.Params[graph.RoleWeight]
		w.Put("op.weight", pw.Shape, pw.Values)
		s := g.Add("s", graph.OpSlice, graph.Attr{Axis: 1, Layout: &graph.Layout{Start: 1, End: 3}}, nil, x)
		g.Add("op", graph.OpConv, oc.Attr, params, s)
	case "flat":
		g.Add("op", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{
			{Ref: 0, From: 0, To: 2}, graph.ConstDim(-1)}}}, nil, x)
	case "resize_up", "resize_down":
		pre := g.Add("pre", graph.OpAvgPool, graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}, CountIncludePad: true}, nil, x)
		if oc.Graph == "resize_up" {
			g.Add("op", graph.OpResize, oc.Attr, nil, pre, x)
		} else {
			g.Add("op", graph.OpResize, oc.Attr, nil, x, pre)
		}
	}
	return g, w
}

// TestLayoutOpsAgainstTorch runs every case of layout_ops.json.gz (real
// PyTorch autograd in float64) on the CPU backend, and on the shape-only
// backend, whose memory figures must equal the CPU's, and whose saved
// bytes must equal what PyTorch's saved-tensor hooks saw.
func TestLayoutOpsAgainstTorch(t *testing.T) {
	var gold struct {
		Cases []layoutCase `json:"cases"`
	}
	readGolden(t, "layout_ops.json.gz", &gold)
	if len(gold.Cases) < 20 {
		t.Fatalf("only %d cases in layout_ops.json.gz", len(gold.Cases))
	}
	seen := map[string]bool{}
	for _, c := range gold.Cases {
		seen[c.Op] = true
		t.Run(c.Name, func(t *testing.T) {
			g, w := buildLayoutCase(c)
			if err := g.Validate(); err != nil {
				t.Fatal(err)
			}
			cpuMem := runCase(t, c.opCase, g, w, NewCPU(2), 42)
			shapeMem := runCase(t, c.opCase, g, w, NewShapes(), 42)
			cpuMem.Backend, shapeMem.Backend = "", ""
			if !reflect.DeepEqual(cpuMem, shapeMem) {
				t.Errorf("memory differs between backends:\ncpu    %+v\nshapes %+v", cpuMem, shapeMem)
			}
			if want := 4 * c.SavedElems; shapeMem.SavedBytes != want {
				t.Errorf("saved for backward: %d bytes, PyTorch keeps %d elements (%d bytes)", shapeMem.SavedBytes, c.SavedElems, want)
			}
		})
	}
	for _, op := range []graph.Op{graph.OpTranspose, graph.OpReshape, graph.OpPad, graph.OpSlice, graph.OpConcat, graph.OpResize, graph.OpBatchNorm} {
		if !seen[string(op)] {
			t.Errorf("no golden case for %s", op)
		}
	}
}

// TestReshapeFollowsInput checks that a computed shape is evaluated for the
// input at hand: the same channel-shuffle graph runs at two batch sizes and
// resolutions.
func TestReshapeFollowsInput(t *testing.T) {
	c := layoutCase{opCase: opCase{Name: "shuffle", Graph: "shuffle", Attr: graph.Attr{Groups: 2}, Input: tensorJSON{Shape: []int{1, 4, 2, 2}}}}
	g, w := buildLayoutCase(c)
	for _, shape := range [][]int{{1, 4, 2, 2}, {3, 4, 5, 7}} {
		e, err := New(g, w, NewCPU(1), Options{})
		if err != nil {
			t.Fatal(err)
		}
		x := NewHostTensor(shape...)
		for i := range x.Data {
			x.Data[i] = float32(i)
		}
		y, err := e.Forward(x, false)
		e.Close()
		if err != nil {
			t.Fatal(err)
		}
		if !sameInts(y.Shape, shape) {
			t.Fatalf("output %v for input %v", y.Shape, shape)
		}
		// Channel k of the output is channel (k%2)*2 + k/2 of the input.
		n, ch, hw := shape[0], shape[1], shape[2]*shape[3]
		for b := 0; b < n; b++ {
			for k := 0; k < ch; k++ {
				src := (k%2)*(ch/2) + k/2
				if got, want := y.Data[(b*ch+k)*hw], x.Data[(b*ch+src)*hw]; got != want {
					t.Fatalf("input %v: output channel %d starts with %g, want input channel %d's %g", shape, k, got, src, want)
				}
			}
		}
	}
}

// TestLayoutRefusals: shapes that cannot work are refused when planning,
// with the node named.
func TestLayoutRefusals(t *testing.T) {
	for _, tc := range []struct {
		name string
		op   graph.Op
		attr graph.Attr
	}{
		{"bad perm", graph.OpTranspose, graph.Attr{Layout: &graph.Layout{Perm: []int{0, 1, 1, 2}}}},
		{"short perm", graph.OpTranspose, graph.Attr{Layout: &graph.Layout{Perm: []int{0, 1}}}},
		{"negative pad", graph.OpPad, graph.Attr{Layout: &graph.Layout{Pads: []int{0, 0, -1, 0, 0, 0, 0, 0}}}},
		{"empty slice", graph.OpSlice, graph.Attr{Axis: 1, Layout: &graph.Layout{Start: 2, End: 2}}},
		{"bad view", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{graph.RefDim(0, 0), graph.ConstDim(5)}}}},
		{"bad mode", graph.OpResize, graph.Attr{Mode: "bicubic"}},
		{"scaled to nothing", graph.OpResize, graph.Attr{Mode: "nearest", Scale: [2]float64{0.2, 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := graph.New("r", 3)
			ins := []*graph.Value{g.Input}
			if tc.op == graph.OpResize && tc.attr.Scale == [2]float64{} {
				ins = append(ins, g.Input)
			}
			g.Add("op", tc.op, tc.attr, nil, ins...)
			e, err := New(g, graph.NewMemWeights(), NewShapes(), Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			_, err = e.Forward(&HostTensor{Shape: []int{2, 3, 4, 4}}, false)
			if err == nil {
				t.Fatal("accepted")
			}
			if failure.Of(err) == failure.Unsupported {
				t.Errorf("reported as an unsupported op: %v", err)
			}
		})
	}
}

// resizeRef resizes a golden case's input and scatters its upstream
// gradient back with resizeTaps, with the tap rule given (exactFwd,
// exactBwd: NearestIndex's exact), and returns the largest relative
// error of the output and of the input gradient against PyTorch's.
func resizeRef(c layoutCase, how Interp, exactFwd, exactBwd bool) (outErr, dxErr float64) {
	xs, ys := c.Input.Shape, c.Output.Shape
	planes, ih, iw, oh, ow := xs[0]*xs[1], xs[2], xs[3], ys[2], ys[3]
	y := make([]float64, len(c.Output.Values))
	dx := make([]float64, len(c.Input.Values))
	for pass, exact := range []bool{exactFwd, exactBwd} {
		h0, h1, hl := resizeTaps(0, ih, oh, how, exact)
		w0, w1, wl := resizeTaps(1, iw, ow, how, exact)
		for p := 0; p < planes; p++ {
			for i := 0; i < oh; i++ {
				for j := 0; j < ow; j++ {
					o := (p*oh+i)*ow + j
					taps := [4]int{h0[i]*iw + w0[j], h0[i]*iw + w1[j], h1[i]*iw + w0[j], h1[i]*iw + w1[j]}
					lh, lw := float64(hl[i]), float64(wl[j])
					wts := [4]float64{(1 - lh) * (1 - lw), (1 - lh) * lw, lh * (1 - lw), lh * lw}
					for k, t := range taps {
						if pass == 0 {
							y[o] += wts[k] * c.Input.Values[p*ih*iw+t]
						} else {
							dx[p*ih*iw+t] += wts[k] * c.Dout[o]
						}
					}
				}
			}
		}
	}
	return maxRel(y, c.Output.Values), maxRel(dx, c.Dx)
}

func maxRel(got, want []float64) float64 {
	scale, worst := 0.0, 0.0
	for _, w := range want {
		scale = max(scale, math.Abs(w))
	}
	for i := range want {
		worst = max(worst, math.Abs(got[i]-want[i])/max(scale, 1e-30))
	}
	return worst
}

// TestResizeGoldensDiscriminate checks that the scale-factor goldens can
// fail: the rule the runtime follows reproduces each, and each plausible
// wrong rule (stepping by in/out instead of 1/scale; nearest_idx's
// special cases in the forward of a many-channel tensor, or not in the
// backward) misses at least one.
func TestResizeGoldensDiscriminate(t *testing.T) {
	var gold struct {
		Cases []layoutCase `json:"cases"`
	}
	readGolden(t, "layout_ops.json.gz", &gold)
	type rule struct {
		name   string
		interp func(Interp) Interp
		exact  func(channels int) (fwd, bwd bool)
	}
	torchRule := func(ch int) (bool, bool) { return ch == 1, true }
	same := func(h Interp) Interp { return h }
	rules := []rule{
		{"torch 1.13", same, torchRule},
		{"in/out step", func(h Interp) Interp { h.Scale = [2]float64{}; return h }, torchRule},
		{"exact forward", same, func(int) (bool, bool) { return true, true }},
		{"inexact forward", same, func(int) (bool, bool) { return false, true }},
		{"inexact backward", same, func(ch int) (bool, bool) { return ch == 1, false }},
	}
	missed := map[string]int{}
	n := 0
	for _, c := range gold.Cases {
		if c.Op != string(graph.OpResize) || c.Graph != "single" || c.Attr.Scale == [2]float64{} {
			continue
		}
		n++
		for _, r := range rules {
			fwd, bwd := r.exact(c.Input.Shape[1])
			oe, de := resizeRef(c, r.interp(InterpOf(c.Attr)), fwd, bwd)
			if oe > 1e-5 || de > 1e-5 {
				missed[r.name]++
				if r.name == "torch 1.13" {
					t.Errorf("%s: output error %.2g, input gradient error %.2g", c.Name, oe, de)
				}
			}
		}
	}
	if n < 15 {
		t.Fatalf("only %d scale-factor resize cases", n)
	}
	for _, r := range rules[1:] {
		if missed[r.name] == 0 {
			t.Errorf("rule %q reproduces every scale-factor golden: they cannot tell it from torch's", r.name)
		}
	}
	t.Logf("%d cases; wrong rules missed: %v", n, missed)
}
