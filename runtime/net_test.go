package runtime

import (
	"math"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// netGolden is testdata/net_NAME.json.gz.
type netGolden struct {
	Model   string            `json:"model"`
	Seed    uint64            `json:"seed"`
	Weights map[string][3]any `json:"weights"` // key -> [shape, sum, sum of |v|]
	Input   tensorJSON        `json:"input"`
	Eval    []float64         `json:"eval_output"`
	Leaky   []float64         `json:"eval_output_leaky"`
	Shape   []int             `json:"output_shape"`
	Train   netStep           `json:"train"`
	TrainLk *netStep          `json:"train_leaky"`
}

type netStep struct {
	Output  []float64            `json:"output"`
	Dout    []float64            `json:"dout"`
	Dx      []float64            `json:"dx"`
	Grads   map[string][]float64 `json:"grads"`
	Running map[string][]float64 `json:"running"`
	// F32Error is PyTorch's own float32 error on the same step (float32
	// against float64, in mismatch's measure).
	F32Error struct {
		Output  float64            `json:"output"`
		Dx      float64            `json:"dx"`
		Grads   map[string]float64 `json:"grads"`
		Running map[string]float64 `json:"running"`
	} `json:"f32_error"`
}

// f32Factor is how much worse than float32 PyTorch the runtime may be on a
// training step: the step is judged against the reference's own float32
// error, and never held to less than the base tolerance.
const f32Factor = 4

func stepTol(base, torchErr float64) float64 { return math.Max(base, f32Factor*torchErr) }

// loadNet reads the golden and the committed fixture checkpoint it was made
// from (through the pth reader), checks that they agree, and returns the
// weights as an in-memory store.
func loadNet(t *testing.T, name string) (*netGolden, *graph.MemWeights) {
	t.Helper()
	var gold netGolden
	readGolden(t, "net_"+name+".json.gz", &gold)
	ck, err := pth.Open(filepath.Join("..", "fixtures", "testdata", name+".pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	w := graph.NewMemWeights()
	for _, k := range ck.Keys() {
		shape, _ := ck.Shape(k)
		v, err := ck.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		w.Put(k, shape, v)
		fp, ok := gold.Weights[k]
		if !ok {
			t.Fatalf("%s: %s not in the golden; regenerate with fixtures/ops.py", name, k)
		}
		sum, abs := 0.0, 0.0
		for _, x := range v {
			sum += x
			abs += math.Abs(x)
		}
		if math.Abs(sum-fp[1].(float64)) > 1e-6*(1+abs) || math.Abs(abs-fp[2].(float64)) > 1e-6*(1+abs) {
			t.Fatalf("%s: %s differs from the weights the golden was made from; regenerate with fixtures/ops.py", name, k)
		}
	}
	if len(gold.Weights) != len(ck.Keys()) {
		t.Fatalf("%s: golden has %d tensors, the checkpoint %d", name, len(gold.Weights), len(ck.Keys()))
	}
	return &gold, w
}

func copyWeights(w *graph.MemWeights) *graph.MemWeights {
	out := graph.NewMemWeights()
	for _, k := range w.Keys() {
		s, _ := w.Shape(k)
		v, _ := w.Values(k)
		out.Put(k, s, v)
	}
	return out
}

// TestNetworksAgainstTorch runs the tiny torchvision networks end to end:
// the eval output, then one training step (output, input gradient, every
// parameter gradient, running statistics and num_batches_tracked), against
// real PyTorch.
func TestNetworksAgainstTorch(t *testing.T) {
	for _, name := range []string{"tiny_densenet", "tiny_resnext", "tiny_vgg"} {
		t.Run(name, func(t *testing.T) {
			gold, w := loadNet(t, name)
			g, _, err := arch.Recognize(w, "auto")
			if err != nil {
				t.Fatal(err)
			}
			e, err := New(g, w, NewCPU(2), Options{Seed: gold.Seed})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			x := &HostTensor{Shape: gold.Input.Shape, Data: f32(gold.Input.Values)}
			out, err := e.Forward(x, false)
			if err != nil {
				t.Fatal(err)
			}
			if !sameInts(out.Shape, gold.Shape) {
				t.Fatalf("output shape %v, torch %v", out.Shape, gold.Shape)
			}
			check(t, "eval output", out.Data, gold.Eval, 1e-4)
			if _, _, err := e.Backward(NewHostTensor(out.Shape...)); err != ErrNoForward {
				t.Errorf("backward after an eval forward without GradInEval: %v, want ErrNoForward", err)
			}
			checkStep(t, e, x, &gold.Train, nil, 1e-4)
		})
	}
}

// checkStep runs one training step and compares it with step. mapGrad, when
// not nil, maps a reference gradient to the expected one (for converted
// networks).
func checkStep(t *testing.T, e *Executor, x *HostTensor, step *netStep, mapping *signMap, tol float64) (out *HostTensor, dx *HostTensor, grads map[string][]float32, stats map[string][]float32) {
	t.Helper()
	out, err := e.Forward(x, true)
	if err != nil {
		t.Fatal(err)
	}
	check(t, "training output", out.Data, step.Output, stepTol(tol, step.F32Error.Output))
	dx, grads, err = e.Backward(&HostTensor{Shape: out.Shape, Data: f32(step.Dout)})
	if err != nil {
		t.Fatal(err)
	}
	check(t, "input gradient", dx.Data, step.Dx, stepTol(tol, step.F32Error.Dx))
	for k, want := range step.Grads {
		if mapping != nil {
			want = mapping.apply(k, want)
		}
		check(t, "gradient of "+k, grads[k], want, stepTol(tol, step.F32Error.Grads[k]))
	}
	if len(step.Grads) > 0 && len(grads) != len(step.Grads) {
		t.Errorf("%d parameter gradients, torch has %d", len(grads), len(step.Grads))
	}
	stats, err = e.RunningStats()
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range step.Running {
		if mapping != nil {
			want = mapping.apply(k, want)
		}
		check(t, "buffer "+k, stats[k], want, stepTol(tol, step.F32Error.Running[k]))
	}
	return out, dx, grads, stats
}

// signMap relates the converted network's parameters to the original's:
// per key and leading-dimension index, +1 when unchanged, -1 when the
// conversion negated that slice (a sign folded into a convolution's output
// channel, or a running mean flipped with its channel), and for InPlace-ABN
// weights sign(gamma) (0 for |gamma| < eps, stored as weight 0), since
// d/dw of |w| + eps is sign(w) and the channel was flipped when gamma < 0.
type signMap struct {
	factor map[string][]float64
}

func newSignMap(t *testing.T, g *graph.Graph, orig, conv *graph.MemWeights) *signMap {
	m := &signMap{factor: map[string][]float64{}}
	inplace := map[string]bool{}
	for _, n := range g.Nodes {
		if n.Op == graph.OpInPlaceABN || n.Op == graph.OpInPlaceABNSync {
			inplace[n.Params[graph.RoleWeight]] = true
		}
	}
	for _, k := range orig.Keys() {
		shape, _ := orig.Shape(k)
		a, _ := orig.Values(k)
		b, _ := conv.Values(k)
		if len(shape) == 0 {
			continue
		}
		rows := shape[0]
		per := len(a) / rows
		f := make([]float64, rows)
		for r := 0; r < rows; r++ {
			if inplace[k] {
				f[r] = math.Copysign(1, a[r])
				if b[r] == 0 {
					f[r] = 0
				}
				continue
			}
			same, neg := true, true
			for j := r * per; j < (r+1)*per; j++ {
				same = same && a[j] == b[j]
				neg = neg && a[j] == -b[j]
			}
			switch {
			case same:
				f[r] = 1
			case neg:
				f[r] = -1
			default:
				t.Fatalf("%s[%d] changed by the conversion in a way the test does not model", k, r)
			}
		}
		m.factor[k] = f
	}
	return m
}

func (m *signMap) apply(key string, v []float64) []float64 {
	f, ok := m.factor[key]
	if !ok {
		return v
	}
	out := make([]float64, len(v))
	per := len(v) / len(f)
	for i := range v {
		out[i] = v[i] * f[i/per]
	}
	return out
}

// TestConvertedNetworks converts the tiny DenseNet and ResNeXt with the
// rewrite package (InPlace-ABN, leaky ReLU 0.01, DenseNet shared buffers)
// and runs them against PyTorch's leaky-ReLU reference of the original
// network: eval output, one training step (gradients mapped through the
// conversion's sign folding and |w| + eps), running statistics. The
// converted network differs from the reference only on the channels whose
// |gamma| < eps, which the fixtures include on purpose; hence a looser
// tolerance than the op tests.
//
// It also runs the same step without the DenseNet recomputation: outputs,
// gradients and running statistics must agree, which shows that the
// recomputation uses the forward's batch statistics and updates the running
// ones once.
func TestConvertedNetworks(t *testing.T) {
	for _, name := range []string{"tiny_densenet", "tiny_resnext"} {
		t.Run(name, func(t *testing.T) {
			gold, orig := loadNet(t, name)
			w := copyWeights(orig)
			g, _, err := arch.Recognize(w, "auto")
			if err != nil {
				t.Fatal(err)
			}
			// --tiny-gamma approx: every BN + ReLU site leaky, as the
			// golden reference is (exact would keep the tiny-gamma
			// site's ReLU, as ABN).
			rep, err := rewrite.Run(g, w, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01, TinyGamma: rewrite.TinyGammaApprox})
			if err != nil {
				t.Fatal(err)
			}
			ops := map[graph.Op]int{}
			marked := 0
			for _, n := range g.Nodes {
				ops[n.Op]++
				if n.Recompute != "" {
					marked++
				}
			}
			if ops[graph.OpInPlaceABN] == 0 || ops[graph.OpBatchNorm] != 0 {
				t.Fatalf("conversion left %v", ops)
			}
			if name == "tiny_densenet" && marked == 0 {
				t.Fatalf("no dense layer marked for recomputation: %+v", rep.Summary)
			}
			mapping := newSignMap(t, g, orig, w)
			x := &HostTensor{Shape: gold.Input.Shape, Data: f32(gold.Input.Values)}
			const tol = 2e-3

			run := func(opt Options) (*HostTensor, *HostTensor, map[string][]float32, map[string][]float32, MemoryReport) {
				e, err := New(g, w, NewCPU(2), opt)
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				out, err := e.Forward(x, false)
				if err != nil {
					t.Fatal(err)
				}
				check(t, "eval output", out.Data, gold.Leaky, tol)
				out, dx, grads, stats := checkStep(t, e, x, gold.TrainLk, mapping, tol)
				return out, dx, grads, stats, e.Memory()
			}
			out1, dx1, g1, s1, m1 := run(Options{Seed: gold.Seed})
			out2, dx2, g2, s2, m2 := run(Options{Seed: gold.Seed, NoRecompute: true})
			check(t, "output with and without recomputation", out1.Data, f64(out2.Data), 1e-6)
			check(t, "input gradient with and without recomputation", dx1.Data, f64(dx2.Data), 1e-5)
			for k := range g2 {
				check(t, "gradient of "+k+" with and without recomputation", g1[k], f64(g2[k]), 1e-5)
			}
			if !reflect.DeepEqual(s1, s2) {
				t.Errorf("running statistics differ with and without recomputation")
			}
			// At this size the two shared buffers weigh about what they
			// save; TestMemoryCalibration checks the saving at full size.
			t.Logf("%s: saved %d bytes with shared buffers, %d without; %d sites, %d dense groups", name, m1.SavedBytes, m2.SavedBytes, rep.Summary.Sites, marked/3)
		})
	}
}

func f64(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// TestRecomputeInEvalMode runs the converted tiny DenseNet's backward after
// an eval-mode forward (Options.GradInEval): the shared buffers are then
// refilled with the running statistics, and the gradients must equal those
// of the same graph without recomputation.
func TestRecomputeInEvalMode(t *testing.T) {
	gold, w := loadNet(t, "tiny_densenet")
	g, _, err := arch.Recognize(w, "auto")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rewrite.Run(g, w, rewrite.Options{}); err != nil {
		t.Fatal(err)
	}
	x := &HostTensor{Shape: gold.Input.Shape, Data: f32(gold.Input.Values)}
	var dxs [][]float32
	var grads []map[string][]float32
	for _, noRecompute := range []bool{false, true} {
		e, err := New(g, w, NewCPU(2), Options{GradInEval: true, NoRecompute: noRecompute})
		if err != nil {
			t.Fatal(err)
		}
		out, err := e.Forward(x, false)
		if err != nil {
			t.Fatal(err)
		}
		dOut := NewHostTensor(out.Shape...)
		for i := range dOut.Data {
			dOut.Data[i] = float32(i%7) - 3
		}
		dx, gr, err := e.Backward(dOut)
		if err != nil {
			t.Fatal(err)
		}
		dxs, grads = append(dxs, dx.Data), append(grads, gr)
		e.Close()
	}
	check(t, "input gradient", dxs[0], f64(dxs[1]), 1e-5)
	for k, v := range grads[1] {
		check(t, "gradient of "+k, grads[0][k], f64(v), 1e-5)
	}
}
