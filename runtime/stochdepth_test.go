package runtime

import (
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// stochasticDepthNet is conv -> StochasticDepth(p) -> add with the conv's
// output, an EfficientNet residual in small.
func stochasticDepthNet(p float64) *hand {
	h := newHand(3)
	c := h.conv("c1", h.g.Input, 3, 4, 1, 0)
	s := h.g.Add("sd", graph.OpStochasticDepth, graph.Attr{P: p}, nil, c)
	h.g.Add("add", graph.OpAdd, graph.Attr{}, nil, s, c)
	return h
}

// TestStochasticDepth: in training each sample's branch is zeroed or
// scaled by 1/(1-p) as a whole, by the Dropout rule over the sample index
// (reproducible, a new draw every step), and the gradient is dy times the
// same noise; in eval, and at p = 0, the identity.
func TestStochasticDepth(t *testing.T) {
	const n, p = 400, 0.2
	h := stochasticDepthNet(p)
	x := NewHostTensor(n, 3, 2, 2)
	for i := range x.Data {
		x.Data[i] = float32(i%7) - 3
	}
	// The conv's output, per sample, from an eval pass (the identity).
	e, err := New(h.g, h.w, NewCPU(2), Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ev, err := e.Forward(x, false)
	if err != nil {
		t.Fatal(err)
	}
	conv := make([]float32, len(ev.Data))
	for i, v := range ev.Data {
		conv[i] = v / 2
	}
	tr, err := e.Forward(x, true)
	if err != nil {
		t.Fatal(err)
	}
	per := len(conv) / n
	kept := 0
	for s := 0; s < n; s++ {
		keep := DropoutKeep(DropoutSeed(1, "sd", 0), s, p)
		scale := float32(0)
		if keep {
			scale = float32(1 / (1 - p))
			kept++
		}
		for k := s * per; k < (s+1)*per; k++ {
			if want := conv[k]*scale + conv[k]; math.Abs(float64(tr.Data[k]-want)) > 1e-5*(1+math.Abs(float64(want))) {
				t.Fatalf("sample %d element %d: %g, want %g (kept %v)", s, k, tr.Data[k], want, keep)
			}
		}
	}
	if frac := float64(kept) / n; math.Abs(frac-0.8) > 0.06 {
		t.Errorf("kept %.3f of the samples, want about 0.8", frac)
	}
	// The backward of the training pass: the input gradient of the SD
	// node reaches the conv as dy*noise + dy.
	dy := NewHostTensor(tr.Shape...)
	for i := range dy.Data {
		dy.Data[i] = 1
	}
	if _, grads, err := e.Backward(dy); err != nil {
		t.Fatal(err)
	} else if len(grads["c1.weight"]) != 12 {
		t.Errorf("conv weight gradient has %d values", len(grads["c1.weight"]))
	}
	again, err := e.Forward(x, true)
	if err != nil {
		t.Fatal(err)
	}
	if reflect.DeepEqual(again.Data, tr.Data) {
		t.Error("the next step drew the same noise")
	}

	// At p = 0 training is the identity too.
	z := stochasticDepthNet(0)
	ez, err := New(z.g, z.w, NewCPU(1), Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer ez.Close()
	out, err := ez.Forward(x, true)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(out.Data, ev.Data) {
		t.Error("p = 0 in training is not the identity")
	}
}

// TestStochasticDepthGradient checks the backward against a numerical
// derivative of the training forward (the noise is fixed by the seed and
// step, so each pass draws the same noise only when the step is reset:
// the executor is rebuilt for each evaluation).
func TestStochasticDepthGradient(t *testing.T) {
	h := newHand(3)
	c := h.conv("c1", h.g.Input, 3, 2, 1, 0)
	h.g.Add("sd", graph.OpStochasticDepth, graph.Attr{P: 0.5}, nil, c)
	x := NewHostTensor(6, 3, 1, 1)
	for i := range x.Data {
		x.Data[i] = float32(i%5) - 2
	}
	loss := func(w []float64) (float64, []float32) {
		ww := graph.NewMemWeights()
		ww.Put("c1.weight", []int{2, 3, 1, 1}, w)
		e, err := New(h.g, ww, NewCPU(1), Options{Seed: 3})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		y, err := e.Forward(x, true)
		if err != nil {
			t.Fatal(err)
		}
		s := 0.0
		dy := NewHostTensor(y.Shape...)
		for i, v := range y.Data {
			s += float64(v) * float64(i+1)
			dy.Data[i] = float32(i + 1)
		}
		_, grads, err := e.Backward(dy)
		if err != nil {
			t.Fatal(err)
		}
		return s, grads["c1.weight"]
	}
	w0, _ := h.w.Values("c1.weight")
	_, g := loss(w0)
	for k := range w0 {
		w := append([]float64(nil), w0...)
		const d = 1e-2
		w[k] += d
		up, _ := loss(w)
		w[k] -= 2 * d
		down, _ := loss(w)
		num := (up - down) / (2 * d)
		if math.Abs(num-float64(g[k])) > 1e-3*(1+math.Abs(num)) {
			t.Errorf("weight %d: gradient %g, numerical %g", k, g[k], num)
		}
	}
}

// TestStochasticDepthSaved: PyTorch 1.13 keeps only the noise for
// torchvision's stochastic_depth (saved-tensor hooks on
// stochastic_depth(x * 2, 0.2, "row", True) for x of shape (8, 16, 7, 7):
// one tensor of shape (8, 1, 1, 1), 32 bytes); the runtime's accounting
// gives the node that, and nothing in eval.
func TestStochasticDepthSaved(t *testing.T) {
	h := stochasticDepthNet(0.2)
	x := NewHostTensor(8, 3, 7, 7)
	for _, training := range []bool{true, false} {
		e, err := New(h.g, h.w, NewCPU(1), Options{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Forward(x, training); err != nil {
			t.Fatal(err)
		}
		want := int64(0)
		if training {
			want = 8 * 4
		}
		for _, l := range e.Memory().Layers {
			if l.Node == "sd" && l.SavedBytes != want {
				t.Errorf("training %v: sd saves %d bytes, want %d", training, l.SavedBytes, want)
			}
		}
		e.Close()
	}
}

// TestStochasticDepthBatch: in batch mode one draw (index 0 of the Dropout
// rule) zeroes or scales every sample alike, the noise saved is one
// element, and a mode the IR does not define is refused when planning.
func TestStochasticDepthBatch(t *testing.T) {
	const p = 0.5
	h := newHand(3)
	c := h.conv("c1", h.g.Input, 3, 4, 1, 0)
	h.g.Add("sd", graph.OpStochasticDepth, graph.Attr{P: p, Mode: graph.StochasticBatch}, nil, c)
	x := NewHostTensor(8, 3, 2, 2)
	for i := range x.Data {
		x.Data[i] = float32(i%7) - 3
	}
	e, err := New(h.g, h.w, NewCPU(1), Options{Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ev, err := e.Forward(x, false)
	if err != nil {
		t.Fatal(err)
	}
	kept := 0
	for step := 0; step < 16; step++ {
		tr, err := e.Forward(x, true)
		if err != nil {
			t.Fatal(err)
		}
		scale := float32(0)
		if DropoutKeep(DropoutSeed(2, "sd", step), 0, p) {
			scale = 1 / (1 - p)
			kept++
		}
		for k, v := range tr.Data {
			if want := ev.Data[k] * scale; math.Abs(float64(v-want)) > 1e-5*(1+math.Abs(float64(want))) {
				t.Fatalf("step %d element %d: %g, want %g", step, k, v, want)
			}
		}
		for _, l := range e.Memory().Layers {
			if l.Node == "sd" && l.SavedBytes != 4 {
				t.Errorf("step %d: sd saves %d bytes, want 4 (one draw)", step, l.SavedBytes)
			}
		}
	}
	if kept == 0 || kept == 16 {
		t.Errorf("kept the batch %d times in 16 steps at p = 0.5", kept)
	}

	bad := newHand(3)
	bc := bad.conv("c1", bad.g.Input, 3, 4, 1, 0)
	bad.g.Add("sd", graph.OpStochasticDepth, graph.Attr{P: p, Mode: "column"}, nil, bc)
	if eb, err := New(bad.g, bad.w, NewCPU(1), Options{}); err == nil {
		_, err = eb.Forward(x, true)
		eb.Close()
		if err == nil || !strings.Contains(err.Error(), `mode "column"`) {
			t.Errorf("mode column: %v", err)
		}
	} else if !strings.Contains(err.Error(), `mode "column"`) {
		t.Errorf("mode column: %v", err)
	}
}
