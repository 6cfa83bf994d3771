package runtime

import (
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
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := graph.New("r", 3)
			ins := []*graph.Value{g.Input}
			if tc.op == graph.OpResize {
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
