package runtime

import (
	"math"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// auxNet is conv, BN, then a main head (ReLU in place, conv, global pool,
// linear) and an auxiliary head reading the BN output (conv, global pool).
// The ReLU would overwrite the BN output in place if nothing else read it:
// the auxiliary head reads it, and being an output must keep it too.
func auxNet(auxAt string) *hand {
	h := newHand(3)
	c := h.conv("c", h.g.Input, 3, 4, 3, 1)
	bn := h.norm("bn", graph.OpBatchNorm, c, 4, "", 0)
	r := h.g.Add("relu", graph.OpReLU, graph.Attr{}, nil, bn)
	m := h.conv("main.conv", r, 4, 4, 1, 0)
	p := h.g.Add("main.pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, nil, m)
	f := h.g.Add("main.flat", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, p)
	out := h.linear("main.fc", f, 4, 5)
	var aux *graph.Value
	switch auxAt {
	case "bn":
		aux = bn
	case "head":
		a := h.conv("aux.conv", bn, 4, 2, 1, 0)
		aux = h.g.Add("aux.pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, nil, a)
	}
	h.g.Output = out
	if aux != nil {
		h.g.SetAux("aux", aux, false)
	}
	return h
}

// TestAuxOutputs checks that an auxiliary output is downloaded as computed
// (never overwritten by an in-place reader), and that BackwardAll is the
// sum of the backward of each output alone: gradients are linear in the
// output gradients, so a seed dropped or applied twice shows.
func TestAuxOutputs(t *testing.T) {
	for _, at := range []string{"bn", "head"} {
		t.Run(at, func(t *testing.T) {
			h := auxNet(at)
			if err := h.g.Validate(); err != nil {
				t.Fatal(err)
			}
			x := NewHostTensor(2, 3, 4, 4)
			copy(x.Data, f32(h.vals(len(x.Data))))
			run := func(dm, da *HostTensor) ([]*HostTensor, *HostTensor, map[string][]float32) {
				t.Helper()
				e, err := New(h.g, h.w, NewCPU(1), Options{})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				if _, err := e.Forward(x, true); err != nil {
					t.Fatal(err)
				}
				outs := e.Outputs()
				dx, grads, err := e.BackwardAll([]*HostTensor{dm, da})
				if err != nil {
					t.Fatal(err)
				}
				return outs, dx, grads
			}
			outs, _, _ := run(&HostTensor{Shape: []int{2, 5}, Data: make([]float32, 10)}, nil)
			if len(outs) != 2 {
				t.Fatalf("%d outputs, want 2", len(outs))
			}
			if at == "bn" {
				neg := 0
				for _, v := range outs[1].Data {
					if v < 0 {
						neg++
					}
				}
				if neg == 0 {
					t.Errorf("the BN output has no negative value: the in-place ReLU overwrote it")
				}
			}
			dm := &HostTensor{Shape: outs[0].Shape, Data: f32(h.vals(len(outs[0].Data)))}
			da := &HostTensor{Shape: outs[1].Shape, Data: f32(h.vals(len(outs[1].Data)))}
			zero := &HostTensor{Shape: outs[0].Shape, Data: make([]float32, len(outs[0].Data))}
			_, dxBoth, gBoth := run(dm, da)
			_, dxMain, gMain := run(dm, nil)
			_, dxAux, gAux := run(zero, da)
			near := func(what string, got, a, b []float32) {
				t.Helper()
				worst, scale := 0.0, 0.0
				for i := range got {
					var av, bv float64
					if a != nil {
						av = float64(a[i])
					}
					if b != nil {
						bv = float64(b[i])
					}
					worst = math.Max(worst, math.Abs(float64(got[i])-av-bv))
					scale = math.Max(scale, math.Abs(float64(got[i])))
				}
				if scale == 0 || worst > 1e-5*scale {
					t.Errorf("%s: both seeds differ from the sum of each alone by %g (scale %g)", what, worst, scale)
				}
			}
			nonzero := 0
			for _, v := range dxAux.Data {
				if v != 0 {
					nonzero++
				}
			}
			if nonzero == 0 {
				t.Fatalf("the auxiliary output's gradient alone gives a zero input gradient: its seed was dropped")
			}
			near("input gradient", dxBoth.Data, dxMain.Data, dxAux.Data)
			for k, v := range gBoth {
				near(k, v, gMain[k], gAux[k])
			}
			if len(gAux["c.weight"]) == 0 || len(gMain["main.fc.weight"]) == 0 {
				t.Fatalf("missing parameter gradients: %v %v", len(gAux["c.weight"]), len(gMain["main.fc.weight"]))
			}
		})
	}
}

func TestBackwardAllErrors(t *testing.T) {
	h := auxNet("head")
	e, err := New(h.g, h.w, NewCPU(1), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	x := NewHostTensor(1, 3, 4, 4)
	if _, err := e.Forward(x, true); err != nil {
		t.Fatal(err)
	}
	dm := &HostTensor{Shape: []int{1, 5}, Data: make([]float32, 5)}
	bad := &HostTensor{Shape: []int{1, 3}, Data: make([]float32, 3)}
	for _, d := range [][]*HostTensor{nil, {nil}, {dm, bad}, {dm, nil, dm}} {
		if _, _, err := e.BackwardAll(d); err == nil {
			t.Errorf("BackwardAll(%d gradients) succeeded", len(d))
		}
	}
}
