package runtime

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
)

// hand builds small graphs with deterministic parameters.
type hand struct {
	g *graph.Graph
	w *graph.MemWeights
	k int
}

func newHand(c int) *hand { return &hand{g: graph.New("hand", c), w: graph.NewMemWeights()} }

// vals returns n deterministic values in [-1, 1).
func (h *hand) vals(n int) []float64 {
	v := make([]float64, n)
	for i := range v {
		h.k++
		v[i] = math.Mod(float64(h.k)*0.6180339887, 2) - 1
	}
	return v
}

func (h *hand) conv(name string, x *graph.Value, in, out, k, pad int) *graph.Value {
	key := name + ".weight"
	h.w.Put(key, []int{out, in, k, k}, h.vals(out*in*k*k))
	return h.g.Add(name, graph.OpConv, graph.Attr{KernelSize: [2]int{k, k}, Stride: [2]int{1, 1}, Padding: [2]int{pad, pad},
		Dilation: [2]int{1, 1}, Groups: 1, InChannels: in, OutChannels: out}, map[string]string{graph.RoleWeight: key}, x)
}

func (h *hand) norm(name string, op graph.Op, x *graph.Value, c int, act string, param float64) *graph.Value {
	params := map[string]string{}
	for _, r := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
		key := name + "." + r
		v := h.vals(c)
		if r == graph.RoleRunningVar || r == graph.RoleWeight {
			for i := range v {
				v[i] = 0.5 + math.Abs(v[i])
			}
		}
		h.w.Put(key, []int{c}, v)
		params[r] = key
	}
	return h.g.Add(name, op, graph.Attr{Features: c, Eps: 1e-5, Momentum: 0.1, Activation: act, ActParam: param}, params, x)
}

func (h *hand) linear(name string, x *graph.Value, in, out int) *graph.Value {
	key := name + ".weight"
	h.w.Put(key, []int{out, in}, h.vals(out*in))
	return h.g.Add(name, graph.OpLinear, graph.Attr{InChannels: in, OutChannels: out}, map[string]string{graph.RoleWeight: key}, x)
}

// TestSavedBytes checks what small graphs keep for backward against sums
// worked out by hand from what PyTorch saves per op. Batch 2, 4 channels,
// 5x5: one activation is 800 bytes.
func TestSavedBytes(t *testing.T) {
	const act = 2 * 4 * 5 * 5 * 4
	// count is InPlaceABN's one-element int64 sample count, which
	// inplace_abn keeps for its backward.
	const count = 8
	tests := []struct {
		name  string
		build func(h *hand)
		input []int
		want  int64
	}{
		{"conv bn relu conv: input, conv output, statistics, relu result", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			x = h.norm("bn", graph.OpBatchNorm, x, 4, "", 0)
			x = h.g.Add("relu", graph.OpReLU, graph.Attr{}, nil, x)
			h.conv("c2", x, 4, 4, 3, 1)
		}, []int{2, 4, 5, 5}, act + act + 2*16 + act},
		{"inplace-abn keeps z, shared with the next conv's input, the variance and the sample count", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			x = h.norm("abn", graph.OpInPlaceABN, x, 4, graph.ActLeakyReLU, 0.01)
			h.conv("c2", x, 4, 4, 3, 1)
		}, []int{2, 4, 5, 5}, act + act + 16 + count},
		{"abn keeps its input, statistics and output", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			x = h.norm("abn", graph.OpABN, x, 4, graph.ActReLU, 0)
			h.conv("c2", x, 4, 4, 3, 1)
		}, []int{2, 4, 5, 5}, act + act + 2*16 + act},
		{"a negative-slope leaky relu kept after inplace-abn keeps z too, and writes a new tensor", func(h *hand) {
			// rewrite's kept activation: out of place (torch has no
			// in-place backward for a negative slope), keeping its
			// input, the z InPlace-ABN keeps; the next conv keeps its
			// fresh output.
			x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			x = h.norm("abn", graph.OpInPlaceABN, x, 4, graph.ActIdentity, 0)
			x = h.g.Add("act", graph.OpLeakyReLU, graph.Attr{ActParam: -0.1}, nil, x)
			h.conv("c2", x, 4, 4, 3, 1)
		}, []int{2, 4, 5, 5}, act + act + 16 + count + act},
		{"a negative-alpha elu likewise", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			x = h.norm("abn", graph.OpInPlaceABN, x, 4, graph.ActIdentity, 0)
			x = h.g.Add("act", graph.OpELU, graph.Attr{ActParam: -0.5}, nil, x)
			h.conv("c2", x, 4, 4, 3, 1)
		}, []int{2, 4, 5, 5}, act + act + 16 + count + act},
		{"inplace-abn on a shared input works on a copy", func(h *hand) {
			c := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			x := h.norm("abn", graph.OpInPlaceABN, c, 4, graph.ActIdentity, 0)
			h.g.Add("add", graph.OpAdd, graph.Attr{}, nil, x, c)
		}, []int{2, 4, 5, 5}, act + act + 16 + count},
		{"max pool keeps its input and int64 indices", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			h.g.Add("pool", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}}, nil, x)
		}, []int{2, 4, 5, 5}, act + act + 2*4*2*2*8},
		{"flatten is a view of what the linear layer keeps", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
			x = h.g.Add("flat", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, x)
			h.linear("fc", x, 100, 3)
		}, []int{2, 4, 5, 5}, act + act},
		{"dropout keeps a float mask", func(h *hand) {
			x := h.linear("l1", h.g.Input, 10, 10)
			x = h.g.Add("drop", graph.OpDropout, graph.Attr{P: 0.5}, nil, x)
			h.linear("l2", x, 10, 3)
		}, []int{2, 10}, 80 + 80 + 80},
		{"add and concat keep nothing", func(h *hand) {
			a := h.conv("c1", h.g.Input, 4, 4, 1, 0)
			s := h.g.Add("add", graph.OpAdd, graph.Attr{}, nil, a, h.g.Input)
			h.g.Add("cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, s, a)
		}, []int{2, 4, 5, 5}, act},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHand(tc.input[1])
			tc.build(h)
			var reports []MemoryReport
			for _, b := range []Backend{NewCPU(2), NewShapes()} {
				e, err := New(h.g, h.w, b, Options{})
				if err != nil {
					t.Fatal(err)
				}
				x := NewHostTensor(tc.input...)
				copy(x.Data, f32(h.vals(len(x.Data))))
				out, err := e.Forward(x, true)
				if err != nil {
					t.Fatal(err)
				}
				if m := e.Memory(); m.SavedBytes != tc.want {
					t.Errorf("%s: saved %d bytes, want %d; layers %+v", b.Name(), m.SavedBytes, tc.want, m.Layers)
				}
				dOut := NewHostTensor(out.Shape...)
				copy(dOut.Data, f32(h.vals(len(dOut.Data))))
				if _, _, err := e.Backward(dOut); err != nil {
					t.Fatal(err)
				}
				m := e.Memory()
				m.Backend = ""
				reports = append(reports, m)
				if st := b.Stats(); st.LiveBytes != m.ParamBytes {
					t.Errorf("%s: %d bytes live after backward, parameters are %d", b.Name(), st.LiveBytes, m.ParamBytes)
				}
				e.Close()
				if st := b.Stats(); st.LiveBytes != 0 {
					t.Errorf("%s: %d bytes live after Close", b.Name(), st.LiveBytes)
				}
			}
			if !reflect.DeepEqual(reports[0], reports[1]) {
				t.Errorf("backends disagree:\ncpu    %+v\nshapes %+v", reports[0], reports[1])
			}
		})
	}
}

// TestInPlaceOnlyWhenSafe runs graphs whose activations may or may not
// overwrite their input, and checks the values against sums worked out in
// Go: an in-place op on an input another node still reads would change them.
func TestInPlaceOnlyWhenSafe(t *testing.T) {
	h := newHand(3)
	c := h.conv("c", h.g.Input, 3, 3, 1, 0)
	r := h.g.Add("relu", graph.OpReLU, graph.Attr{}, nil, c)
	l := h.g.Add("leaky", graph.OpLeakyReLU, graph.Attr{ActParam: 0.5}, nil, c)
	a := h.g.Add("add", graph.OpAdd, graph.Attr{}, nil, r, l, c)
	h.g.Add("relu2", graph.OpReLU, graph.Attr{}, nil, a)
	cw, _ := h.w.Values("c.weight")
	for _, training := range []bool{false, true} {
		e, err := New(h.g, h.w, NewCPU(1), Options{})
		if err != nil {
			t.Fatal(err)
		}
		x := NewHostTensor(1, 3, 2, 2)
		copy(x.Data, f32(h.vals(12)))
		out, err := e.Forward(x, training)
		if err != nil {
			t.Fatal(err)
		}
		for o := 0; o < 3; o++ {
			for p := 0; p < 4; p++ {
				v := 0.0
				for i := 0; i < 3; i++ {
					v += cw[o*3+i] * float64(x.Data[i*4+p])
				}
				leaky := v
				if v < 0 {
					leaky = 0.5 * v
				}
				want := math.Max(math.Max(v, 0)+leaky+v, 0)
				if got := float64(out.Data[o*4+p]); math.Abs(got-want) > 1e-5 {
					t.Errorf("training=%v: output[%d,%d] = %g, want %g", training, o, p, got, want)
				}
			}
		}
		e.Close()
	}
	// relu2 reads a private value: in place. relu and leaky share c.
	p, err := makePlan(h.g, indexOf(h.g), []int{1, 3, 2, 2}, true, true, true)
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range h.g.Nodes {
		want := n.Name == "relu2"
		if p.fwd[i].inPlace != want {
			t.Errorf("%s: in place %v, want %v", n.Name, p.fwd[i].inPlace, want)
		}
	}
}

func indexOf(g *graph.Graph) map[*graph.Node]int {
	m := map[*graph.Node]int{}
	for i, n := range g.Nodes {
		m[n] = i
	}
	return m
}

// TestErrorsNameTheNode checks that bad graphs and inputs fail with errors
// that say where.
func TestErrorsNameTheNode(t *testing.T) {
	tests := []struct {
		name    string
		build   func(h *hand)
		input   []int
		train   bool
		wantErr string
	}{
		{"channel mismatch", func(h *hand) { h.conv("c1", h.g.Input, 4, 4, 3, 1) }, []int{1, 3, 5, 5}, false, "input has 3 channels"},
		{"one value per channel in training", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 1, 0)
			h.norm("bn", graph.OpBatchNorm, x, 4, "", 0)
		}, []int{1, 4, 1, 1}, true, "node bn (BatchNorm2d): expected more than 1 value per channel when training"},
		{"inplace-abn with relu", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 1, 0)
			h.norm("abn", graph.OpInPlaceABN, x, 4, graph.ActReLU, 0)
		}, []int{2, 4, 3, 3}, true, "node abn (InPlaceABN): activation relu is not invertible"},
		{"unsupported op", func(h *hand) {
			h.g.Add("mystery", graph.Op("Softmax"), graph.Attr{}, nil, h.g.Input)
		}, []int{2, 4, 3, 3}, false, `node mystery (Softmax): unsupported op "Softmax"`},
		{"kernel larger than input", func(h *hand) { h.conv("c1", h.g.Input, 4, 4, 5, 0) }, []int{1, 4, 3, 3}, false, "node c1 (Conv2d): input [1 4 3 3] is too small"},
		{"linear on 4-d", func(h *hand) { h.linear("fc", h.g.Input, 4, 2) }, []int{1, 4, 3, 3}, false, "node fc (Linear): input has shape [1 4 3 3]"},
		{"concat of different sizes", func(h *hand) {
			p := h.g.Add("pool", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{2, 2}}, nil, h.g.Input)
			h.g.Add("cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, h.g.Input, p)
		}, []int{1, 4, 4, 4}, false, "node cat (Concat): concatenates shapes [1 4 4 4] and [1 4 2 2]"},
		{"broken recompute group", func(h *hand) {
			x := h.conv("c1", h.g.Input, 4, 4, 1, 0)
			x = h.norm("abn", graph.OpInPlaceABN, x, 4, graph.ActLeakyReLU, 0.01)
			h.g.Node("abn").Recompute = "layer"
			h.g.Node("c1").Recompute = "layer"
		}, []int{2, 4, 3, 3}, true, `recompute group "layer" (node c1): has 2 nodes`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHand(tc.input[1])
			tc.build(h)
			e, err := New(h.g, h.w, NewCPU(1), Options{})
			if err == nil {
				_, err = e.Forward(NewHostTensor(tc.input...), tc.train)
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("got %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestBadCalls(t *testing.T) {
	h := newHand(4)
	x := h.conv("c1", h.g.Input, 4, 4, 1, 0)
	h.norm("bn", graph.OpBatchNorm, x, 4, "", 0)
	e, err := New(h.g, h.w, NewCPU(1), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, _, err := e.Backward(NewHostTensor(2, 4, 3, 3)); !errors.Is(err, ErrNoForward) {
		t.Errorf("backward before forward: %v", err)
	}
	if _, err := e.Forward(&HostTensor{Shape: []int{2, 4, 3, 3}, Data: make([]float32, 5)}, true); err == nil || !strings.Contains(err.Error(), "5 values") {
		t.Errorf("short input: %v", err)
	}
	out, err := e.Forward(NewHostTensor(2, 4, 3, 3), true)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Backward(NewHostTensor(2, 4, 3, 4)); err == nil || !strings.Contains(err.Error(), "has shape [2 4 3 4], the output [2 4 3 3]") {
		t.Errorf("wrong gradient shape: %v", err)
	}
	if _, _, err := e.Backward(NewHostTensor(out.Shape...)); err != nil {
		t.Errorf("backward: %v", err)
	}
	if _, _, err := e.Backward(NewHostTensor(out.Shape...)); !errors.Is(err, ErrNoForward) {
		t.Errorf("second backward: %v", err)
	}

	// A parameter missing from the weights, and one of the wrong shape.
	w := graph.NewMemWeights()
	if _, err := New(h.g, w, NewCPU(1), Options{}); err == nil || !strings.Contains(err.Error(), "node c1: parameter c1.weight not in the weights") {
		t.Errorf("missing parameter: %v", err)
	}
	w.Put("c1.weight", []int{4, 4, 3, 3}, make([]float64, 144))
	if _, err := New(h.g, w, NewCPU(1), Options{}); err == nil || !strings.Contains(err.Error(), "c1.weight has shape [4 4 3 3], want [4 4 1 1]") {
		t.Errorf("wrong shape: %v", err)
	}
}

// TestDropout checks the mask rule: reproducible, about 1-p kept, scaled by
// 1/(1-p), a new mask every training step, identity in eval mode.
func TestDropout(t *testing.T) {
	h := newHand(1000)
	h.g.Add("drop", graph.OpDropout, graph.Attr{P: 0.3}, nil, h.g.Input)
	x := NewHostTensor(4, 1000)
	for i := range x.Data {
		x.Data[i] = 1
	}
	run := func(seed uint64, steps int) []float32 {
		e, err := New(h.g, h.w, NewCPU(2), Options{Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		var out *HostTensor
		for i := 0; i < steps; i++ {
			if out, err = e.Forward(x, true); err != nil {
				t.Fatal(err)
			}
		}
		return out.Data
	}
	a, b, c, d := run(1, 1), run(1, 1), run(2, 1), run(1, 2)
	if !reflect.DeepEqual(a, b) {
		t.Error("same seed, different masks")
	}
	if reflect.DeepEqual(a, c) || reflect.DeepEqual(a, d) {
		t.Error("another seed or step gave the same mask")
	}
	kept := 0
	for i, v := range a {
		switch {
		case v == 0:
		case math.Abs(float64(v)-1/0.7) < 1e-6:
			kept++
		default:
			t.Fatalf("element %d is %g, want 0 or 1/0.7", i, v)
		}
		if want := DropoutKeep(DropoutSeed(1, "drop", 0), i, 0.3); want != (v != 0) {
			t.Fatalf("element %d disagrees with DropoutKeep", i)
		}
	}
	if frac := float64(kept) / float64(len(a)); math.Abs(frac-0.7) > 0.03 {
		t.Errorf("kept %.3f, want about 0.7", frac)
	}
	e, _ := New(h.g, h.w, NewCPU(1), Options{})
	out, _ := e.Forward(x, false)
	if !reflect.DeepEqual(out.Data, x.Data) {
		t.Error("eval-mode dropout is not the identity")
	}
}

// TestBackendsAgreeOnNetworks runs the tiny fixture networks, original and
// converted (with and without shared buffers), in training mode on both
// backends: every memory figure must be the same.
func TestBackendsAgreeOnNetworks(t *testing.T) {
	for _, name := range []string{"tiny_densenet", "tiny_resnext", "tiny_vgg"} {
		for _, converted := range []bool{false, true} {
			_, w := loadNet(t, name)
			g, _, err := arch.Recognize(w, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if converted {
				if _, err := rewrite.Run(g, w, rewrite.Options{}); err != nil {
					t.Fatal(err)
				}
			}
			for _, opt := range []Options{{}, {NoRecompute: true}} {
				var reps []MemoryReport
				for _, b := range []Backend{NewCPU(2), NewShapes()} {
					e, err := New(g, w, b, opt)
					if err != nil {
						t.Fatal(err)
					}
					x := NewHostTensor(2, 3, 32, 32)
					out, err := e.Forward(x, true)
					if err != nil {
						t.Fatal(err)
					}
					if _, _, err := e.Backward(NewHostTensor(out.Shape...)); err != nil {
						t.Fatal(err)
					}
					m := e.Memory()
					m.Backend = ""
					reps = append(reps, m)
					e.Close()
				}
				if !reflect.DeepEqual(reps[0], reps[1]) {
					t.Errorf("%s converted=%v %+v: backends disagree: cpu saved %d peak %d, shapes saved %d peak %d",
						name, converted, opt, reps[0].SavedBytes, reps[0].PeakBytes, reps[1].SavedBytes, reps[1].PeakBytes)
				}
			}
		}
	}
}

// failing is a shape-only backend whose convolution backward fails, to
// check that an error in the middle of a pass frees what the pass held.
type failing struct {
	Backend
}

var errInjected = errors.New("injected failure")

func (failing) Conv2dBackward(dx, dw, db, dy, x, w Tensor, p ConvParams) error { return errInjected }

func TestErrorFreesEverything(t *testing.T) {
	g, w := recognise(t, "densenet121")
	b := failing{NewShapes()}
	e, err := New(g, w, b, Options{})
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Forward(&HostTensor{Shape: []int{2, 3, 64, 64}}, true)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Backward(&HostTensor{Shape: out.Shape}); !errors.Is(err, errInjected) || !strings.Contains(err.Error(), "backward of node features.denseblock4.denselayer16.conv2") {
		t.Errorf("got %v, want the injected failure at the last convolution", err)
	}
	if live, params := b.Stats().LiveBytes, e.Memory().ParamBytes; live != params {
		t.Errorf("%d bytes live after the failed backward, parameters hold %d", live, params)
	}
	if _, _, err := e.Backward(&HostTensor{Shape: out.Shape}); !errors.Is(err, ErrNoForward) {
		t.Errorf("backward after a failed one: %v", err)
	}
}

// TestSharedBackend runs two executors on one backend, as verify does with
// the original and the converted network: each reports what it reports on a
// backend of its own.
func TestSharedBackend(t *testing.T) {
	g1, w1 := recognise(t, "resnet50")
	g2, w2 := recognise(t, "resnet50")
	convert(t, g2, w2)
	alone := []MemoryReport{measure(t, g1, w1, 2, 64, Options{}), measure(t, g2, w2, 2, 64, Options{})}
	b := NewShapes()
	var es []*Executor
	for _, gw := range []struct {
		g *graph.Graph
		w graph.Weights
	}{{g1, w1}, {g2, w2}} {
		e, err := New(gw.g, gw.w, b, Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		es = append(es, e)
	}
	for i, e := range es {
		out, err := e.Forward(&HostTensor{Shape: []int{2, 3, 64, 64}}, true)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := e.Backward(&HostTensor{Shape: out.Shape}); err != nil {
			t.Fatal(err)
		}
		if got := e.Memory(); !reflect.DeepEqual(got, alone[i]) {
			t.Errorf("executor %d: saved %d peak %d on a shared backend, %d and %d alone", i, got.SavedBytes, got.PeakBytes, alone[i].SavedBytes, alone[i].PeakBytes)
		}
	}
}

// TestConvKernelWiderThanInput: a 5x5 convolution with padding 2 over a
// 1x1 or 1x2 input (MNASNet's depthwise 5x5 layers at a small resolution)
// has kernel columns that miss the image for every output column; forward
// and backward must skip them (they once sliced out of range), and compute
// what the direct sum gives.
func TestConvKernelWiderThanInput(t *testing.T) {
	for _, wd := range []int{1, 2} {
		h := newHand(2)
		h.conv("conv", h.g.Input, 2, 3, 5, 2)
		w, _ := h.w.Values("conv.weight")
		x := NewHostTensor(1, 2, 1, wd)
		for i := range x.Data {
			x.Data[i] = float32(i) - 0.5
		}
		e, err := New(h.g, h.w, NewCPU(1), Options{GradInEval: true})
		if err != nil {
			t.Fatal(err)
		}
		out, err := e.Forward(x, false)
		if err != nil {
			t.Fatal(err)
		}
		// y[o][j] = sum over c, input column i of w[o][c][2][i-j+2] x[c][i].
		at := func(o, c, kh, kw int) float64 { return w[((o*2+c)*5+kh)*5+kw] }
		for o := 0; o < 3; o++ {
			for j := 0; j < wd; j++ {
				want := 0.0
				for c := 0; c < 2; c++ {
					for i := 0; i < wd; i++ {
						want += at(o, c, 2, i-j+2) * float64(x.Data[c*wd+i])
					}
				}
				if got := float64(out.Data[o*wd+j]); math.Abs(got-want) > 1e-5 {
					t.Errorf("width %d: y[%d][%d] = %g, want %g", wd, o, j, got, want)
				}
			}
		}
		dy := NewHostTensor(1, 3, 1, wd)
		for i := range dy.Data {
			dy.Data[i] = 1
		}
		dx, _, err := e.Backward(dy)
		if err != nil {
			t.Fatal(err)
		}
		for c := 0; c < 2; c++ {
			for i := 0; i < wd; i++ {
				want := 0.0
				for o := 0; o < 3; o++ {
					for j := 0; j < wd; j++ {
						want += at(o, c, 2, i-j+2)
					}
				}
				if got := float64(dx.Data[c*wd+i]); math.Abs(got-want) > 1e-5 {
					t.Errorf("width %d: dx[%d][%d] = %g, want %g", wd, c, i, got, want)
				}
			}
		}
		e.Close()
	}
}
