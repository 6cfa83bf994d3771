package runtime

import (
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// residualNet is two inverted-residual ends, conv -> InPlaceABN(identity)
// -> + the block input, the second block's input being the first's sum,
// then a conv. fused builds the adds into the InPlaceABN nodes (what
// rewrite's add-residual makes); otherwise they are Add nodes.
func residualNet(fused bool) *hand {
	h := newHand(3)
	x := h.conv("stem", h.g.Input, 3, 4, 3, 1)
	for _, b := range []string{"b1", "b2"} {
		y := h.norm(b+".bn", graph.OpInPlaceABN, h.conv(b+".conv", x, 4, 4, 1, 0), 4, graph.ActIdentity, 0)
		if fused {
			n := h.g.Node(b + ".bn")
			n.Inputs = append(n.Inputs, x)
			x.Consumers = append(x.Consumers, n)
			x = y
		} else {
			x = h.g.Add(b+".add", graph.OpAdd, graph.Attr{}, nil, y, x)
		}
	}
	h.g.Output = h.conv("head", x, 4, 2, 1, 0)
	return h
}

// TestResidualInPlaceABN checks the fused residual form against the Add it
// replaces: the same outputs, gradients and running statistics, and one
// activation fewer kept for backward per block (the normalised output,
// recovered from the sum).
func TestResidualInPlaceABN(t *testing.T) {
	type result struct {
		out, dx *HostTensor
		grads   map[string][]float32
		running map[string][]float32
		mem     MemoryReport
	}
	run := func(fused, training bool, b Backend, half DType) result {
		t.Helper()
		h := residualNet(fused)
		if err := h.g.Validate(); err != nil {
			t.Fatal(err)
		}
		x := NewHostTensor(2, 3, 5, 5)
		copy(x.Data, f32(h.vals(len(x.Data))))
		e, err := New(h.g, h.w, b, Options{GradInEval: true, Half: half})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		out, err := e.Forward(x, training)
		if err != nil {
			t.Fatal(err)
		}
		dOut := NewHostTensor(out.Shape...)
		for k := range dOut.Data {
			dOut.Data[k] = float32(math.Sin(float64(k)))
		}
		mem := e.Memory()
		dx, grads, err := e.Backward(dOut)
		if err != nil {
			t.Fatal(err)
		}
		running, err := e.RunningStats()
		if err != nil {
			t.Fatal(err)
		}
		return result{out, dx, grads, running, mem}
	}
	near := func(what string, got, want []float32) {
		t.Helper()
		if len(got) != len(want) {
			t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
		}
		for k := range got {
			if d := math.Abs(float64(got[k] - want[k])); d > 1e-5*(1+math.Abs(float64(want[k]))) {
				t.Fatalf("%s: element %d is %g, the unfused form's %g", what, k, got[k], want[k])
			}
		}
	}
	for _, training := range []bool{false, true} {
		f, u := run(true, training, NewCPU(2), Float32), run(false, training, NewCPU(2), Float32)
		near("output", f.out.Data, u.out.Data)
		near("input gradient", f.dx.Data, u.dx.Data)
		if len(f.grads) != len(u.grads) {
			t.Fatalf("%d parameter gradients, the unfused form %d", len(f.grads), len(u.grads))
		}
		for k, g := range u.grads {
			near("gradient of "+k, f.grads[k], g)
		}
		for k, v := range u.running {
			near(k, f.running[k], v)
		}
		if !training {
			continue
		}
		// Each block's normalised output, 2x4x5x5 float32, and its
		// InPlaceABN's 8-byte sample count, which the emitted fused add
		// (_inplace_abn_add) does not keep.
		if d, want := u.mem.SavedBytes-f.mem.SavedBytes, int64(2*(2*4*5*5*4+8)); d != want {
			t.Errorf("saved for backward: %d bytes fused, %d unfused: %d fewer, want two activations and two sample counts (%d)", f.mem.SavedBytes, u.mem.SavedBytes, d, want)
		}
		s := run(true, training, NewShapes(), Float32)
		s.mem.Backend, f.mem.Backend = "", ""
		if !reflect.DeepEqual(s.mem, f.mem) {
			t.Errorf("memory differs between backends:\ncpu    %+v\nshapes %+v", f.mem, s.mem)
		}
		// In 16 bits the sum is rounded before the normalised output is
		// recovered from it: the step stays near the unfused one.
		for _, dt := range []DType{BFloat16, Float16} {
			fh, uh := run(true, true, NewCPU(2), dt), run(false, true, NewCPU(2), dt)
			out, dx := relDiff(fh.out.Data, uh.out.Data), relDiff(fh.dx.Data, uh.dx.Data)
			t.Logf("%v: fused against unfused: output %.2e, input gradient %.2e", dt, out, dx)
			if math.IsNaN(out+dx) || out > 0.05 || dx > 0.1 {
				t.Errorf("%v: fused and unfused steps differ by %g (output), %g (input gradient)", dt, out, dx)
			}
		}
	}
}

// TestResidualShape refuses a residual that would broadcast: the sum is
// written over the input.
func TestResidualShape(t *testing.T) {
	h := newHand(3)
	x := h.conv("stem", h.g.Input, 3, 2, 3, 1)
	y := h.norm("bn", graph.OpInPlaceABN, h.conv("conv", x, 2, 4, 1, 0), 4, graph.ActIdentity, 0)
	n := h.g.Node("bn")
	n.Inputs = append(n.Inputs, x)
	x.Consumers = append(x.Consumers, n)
	h.g.Output = y
	e, err := New(h.g, h.w, NewCPU(1), Options{})
	if err == nil {
		_, err = e.Forward(NewHostTensor(1, 3, 4, 4), false)
		e.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "residual stem of shape [1 2 4 4]") {
		t.Fatalf("error %v, want one naming the residual and its shape", err)
	}
}
