package rewrite

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// Tests on real data: small torchvision networks (testdata/gen_fx.py) traced
// by torch.fx, with their weights and float64 outputs computed by PyTorch.

type fxNode struct {
	Name   string         `json:"name"`
	Module string         `json:"module"`
	Op     string         `json:"op"`
	Inputs []string       `json:"inputs"`
	Attr   map[string]any `json:"attr"`
	Shape  []int          `json:"shape"`
}

type fxFixture struct {
	Name    string   `json:"name"`
	Nodes   []fxNode `json:"nodes"`
	Output  string   `json:"output"`
	Tensors []struct {
		Key    string `json:"key"`
		Shape  []int  `json:"shape"`
		Offset int    `json:"offset"`
		Numel  int    `json:"numel"`
	} `json:"tensors"`
	Input struct {
		Shape  []int     `json:"shape"`
		Values []float64 `json:"values"`
	} `json:"input"`
	EvalOutput  []float64 `json:"eval_output"`
	LeakyOutput []float64 `json:"leaky_output"`
	LeakySites  int       `json:"leaky_sites"`
}

var fxFixtures = []string{"tiny_densenet", "tiny_resnext"}

func loadFx(t *testing.T, name string) (*fxFixture, *graph.Graph, *graph.MemWeights) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", name+".fx.json"))
	if err != nil {
		t.Fatal(err)
	}
	var fx fxFixture
	if err := json.Unmarshal(data, &fx); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	blob, err := os.ReadFile(filepath.Join("testdata", name+".weights.bin"))
	if err != nil {
		t.Fatal(err)
	}
	w := graph.NewMemWeights()
	for _, tt := range fx.Tensors {
		if (tt.Offset+tt.Numel)*4 > len(blob) {
			t.Fatalf("%s: %q beyond the weights file", name, tt.Key)
		}
		v := make([]float64, tt.Numel)
		for i := range v {
			v[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(blob[(tt.Offset+i)*4:])))
		}
		w.Put(tt.Key, tt.Shape, v)
	}
	g, err := buildFx(&fx, w)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return &fx, g, w
}

// buildFx turns the trace into a graph the way the recogniser would: nodes
// that own parameters are named by module path, the rest by trace name.
func buildFx(fx *fxFixture, w graph.Weights) (*graph.Graph, error) {
	var g *graph.Graph
	vals := map[string]*graph.Value{}
	pair := func(a map[string]any, k string) [2]int {
		l, _ := a[k].([]any)
		if len(l) != 2 {
			return [2]int{}
		}
		return [2]int{int(l[0].(float64)), int(l[1].(float64))}
	}
	num := func(a map[string]any, k string) float64 { f, _ := a[k].(float64); return f }
	flag := func(a map[string]any, k string) bool { b, _ := a[k].(bool); return b }
	for _, n := range fx.Nodes {
		if n.Op == "Input" {
			g = graph.New(fx.Name, n.Shape[1])
			vals[n.Name] = g.Input
			continue
		}
		a := n.Attr
		attr := graph.Attr{
			KernelSize: pair(a, "kernel_size"), Stride: pair(a, "stride"), Padding: pair(a, "padding"),
			Dilation: pair(a, "dilation"), Groups: int(num(a, "groups")), CeilMode: flag(a, "ceil_mode"),
			CountIncludePad: flag(a, "count_include_pad"), InChannels: int(num(a, "in_channels")),
			OutChannels: int(num(a, "out_channels")), Features: int(num(a, "features")), Bias: flag(a, "bias"),
			Eps: num(a, "eps"), Momentum: num(a, "momentum"), ActParam: num(a, "activation_param"),
			Axis: int(num(a, "axis")), OutputSize: pair(a, "output_size"), StartDim: int(num(a, "start_dim")), P: num(a, "p"),
		}
		name, params := n.Name, map[string]string(nil)
		switch n.Op {
		case "Conv2d", "BatchNorm2d", "Linear":
			name, params = n.Module, map[string]string{}
			for _, role := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar, graph.RoleNumBatches} {
				if _, ok := w.Shape(n.Module + "." + role); ok {
					params[role] = n.Module + "." + role
				}
			}
		}
		if g.Node(name) != nil {
			return nil, fmt.Errorf("duplicate node %q", name)
		}
		var ins []*graph.Value
		for _, in := range n.Inputs {
			v, ok := vals[in]
			if !ok {
				return nil, fmt.Errorf("%s reads unknown %s", n.Name, in)
			}
			ins = append(ins, v)
		}
		v := g.Add(name, graph.Op(n.Op), attr, params, ins...)
		if len(n.Shape) > 1 {
			v.Channels = n.Shape[1]
		}
		vals[n.Name] = v
	}
	g.Output = vals[fx.Output]
	return g, g.Validate()
}

func fxInput(fx *fxFixture) *tensor {
	return &tensor{shape: fx.Input.Shape, data: append([]float64(nil), fx.Input.Values...)}
}

func compareTo(t *testing.T, what string, got *tensor, want []float64) {
	t.Helper()
	if len(got.data) != len(want) {
		t.Fatalf("%s: %d outputs, PyTorch has %d", what, len(got.data), len(want))
	}
	d := maxAbsDiff(got, &tensor{data: want})
	if d > exact {
		t.Fatalf("%s: differs from PyTorch by %g", what, d)
	}
}

// TestFxEvaluatorMatchesPyTorch checks the test evaluator itself against
// PyTorch's float64 outputs of the source networks, so that the numeric
// checks below are checks against PyTorch.
func TestFxEvaluatorMatchesPyTorch(t *testing.T) {
	for _, name := range fxFixtures {
		t.Run(name, func(t *testing.T) {
			fx, g, w := loadFx(t, name)
			got, err := evaluate(g, w, fxInput(fx))
			if err != nil {
				t.Fatal(err)
			}
			compareTo(t, "source network", got, fx.EvalOutput)
		})
	}
}

func TestFxConversion(t *testing.T) {
	for _, name := range fxFixtures {
		for _, tc := range []struct{ policy, tiny string }{
			{ReLUABN, TinyGammaExact}, {ReLULeaky, TinyGammaExact}, {ReLUABN, TinyGammaApprox}, {ReLULeaky, TinyGammaApprox},
		} {
			policy := tc.policy
			t.Run(name+"/"+policy+"/tiny-"+tc.tiny, func(t *testing.T) {
				fx, g, w := loadFx(t, name)
				orig, shapes := snapshot(t, w), shapesOf(w)
				rep, err := Run(g, w, Options{ReLU: policy, TinyGamma: tc.tiny})
				if err != nil {
					t.Fatal(err)
				}
				checkBookkeeping(t, orig, shapes, w, rep)
				got, err := evaluate(g, w, fxInput(fx))
				if err != nil {
					t.Fatal(err)
				}
				s := rep.Summary
				// The reference: the source network, with ReLU after BN
				// replaced by leaky_relu(0.01) under the leaky policy. It
				// must reproduce PyTorch's outputs (eval_output or
				// leaky_output)...
				pytorch := fx.EvalOutput
				if policy == ReLULeaky {
					pytorch = fx.LeakyOutput
				}
				compareTo(t, "reference", fxReference(t, name, policy == ReLULeaky, nil), pytorch)
				// ...and, with the gammas below eps set to the +-eps that
				// InPlace-ABN can represent (--tiny-gamma approx) and the
				// sites that fell back for them left exact, the converted
				// network must reproduce it.
				compareTo(t, "converted", got, fxReference(t, name, policy == ReLULeaky, rep).data)
				switch {
				case s.TinyGamma == 0, tc.tiny == TinyGammaExact && policy == ReLUABN:
					// Nothing approximated: PyTorch's own outputs.
					compareTo(t, "converted", got, pytorch)
				case tc.tiny == TinyGammaApprox:
					if d := maxAbsDiff(got, &tensor{data: pytorch}); d > 1e-3 {
						t.Errorf("tiny gammas moved the outputs by %g", d)
					}
				}
				fellBack := 0
				for _, x := range rep.Sites {
					switch {
					case len(x.TinyGammaExactChannels) > 0:
						fellBack++
						if x.Outcome != OutcomeFallbackABN || x.Op != graph.OpABN || tc.tiny != TinyGammaExact || len(x.TinyGammaChannels) > 0 {
							t.Errorf("site %+v", x)
						}
					case len(x.TinyGammaChannels) > 0 && tc.tiny != TinyGammaApprox:
						t.Errorf("site %s approximated tiny gammas under --tiny-gamma %s", x.Node, tc.tiny)
					}
				}
				// Both fixtures have one in-place site with tiny gammas
				// (under the leaky policy, where their ReLU sites are in
				// place).
				wantBack := 0
				if tc.tiny == TinyGammaExact && s.TinyGamma > 0 {
					wantBack = s.TinyGamma
				}
				approxSites := fx.LeakySites
				if tc.tiny == TinyGammaExact {
					approxSites -= s.TinyGammaFallback // their exact ReLU back
				}
				if s.FallbackABN != wantBack || s.TinyGammaFallback != fellBack || fellBack != wantBack || (policy == ReLUABN) != (s.Approximated == 0) ||
					policy == ReLULeaky && s.Approximated != approxSites || policy == ReLULeaky && s.TinyGamma == 0 {
					t.Errorf("summary %+v, %d BN+ReLU sites", s, fx.LeakySites)
				}
				for _, n := range g.Nodes {
					if n.Op == graph.OpBatchNorm || n.Op == graph.OpReLU && n.Inputs[0].Producer.Op.IsBNFamily() {
						t.Errorf("%s %s left behind", n.Op, n.Name)
					}
				}
				if strings.Contains(name, "densenet") {
					// torchvision DenseNet with block_config (2, 3): five
					// dense layers plus one transition have the shape.
					flipped := 0
					for _, x := range rep.Sites {
						if len(x.FlippedChannels) > 0 {
							flipped++
						}
					}
					if s.DenseLayersMarked != 6 || policy == ReLULeaky && flipped == 0 {
						t.Errorf("summary %+v, dense layers %v", s, rep.DenseLayers)
					}
				} else if s.DenseLayersMarked != 0 {
					t.Errorf("a ResNeXt has no dense layers: %v", rep.DenseLayers)
				}
				if policy == ReLULeaky && tc.tiny == TinyGammaExact {
					golden(t, name, rep)
				}
			})
		}
	}
}

// fxReference evaluates the source network of a fixture, with BN-following
// ReLUs made leaky_relu(0.01) if leaky, and, given a report, with each tiny
// gamma replaced by the effective gamma the conversion gave it: eps with the
// source gamma's sign (a zero gamma is not negative, so it gets +eps).
func fxReference(t *testing.T, name string, leaky bool, rep *Report) *tensor {
	t.Helper()
	fx, g, w := loadFx(t, name)
	if leaky {
		// Given a report, only the sites it approximated: one that fell
		// back to ABN has its exact ReLU back.
		approx := map[string]bool{}
		if rep != nil {
			for _, s := range rep.Sites {
				if s.Outcome == OutcomeApproximated {
					approx[s.ActivationNode] = true
				}
			}
		}
		for _, n := range g.Nodes {
			if n.Op == graph.OpReLU && n.Inputs[0].Producer.Op == graph.OpBatchNorm && (rep == nil || approx[n.Name]) {
				n.Op, n.Attr.ActParam = graph.OpLeakyReLU, 0.01
			}
		}
	}
	if rep != nil {
		for _, s := range rep.Sites {
			if len(s.TinyGammaChannels) == 0 {
				continue
			}
			n := g.Node(s.Node)
			key := n.Params[graph.RoleWeight]
			gamma, _ := w.Values(key)
			for _, c := range s.TinyGammaChannels {
				gamma[c] = n.Attr.Eps
				if slices.Contains(s.NegativeChannels, c) {
					gamma[c] = -n.Attr.Eps
				}
			}
			if err := w.SetValues(key, gamma); err != nil {
				t.Fatal(err)
			}
		}
	}
	out, err := evaluate(g, w, fxInput(fx))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// golden compares the report, as JSON and as a table, with testdata; -update
// rewrites them.
func golden(t *testing.T, name string, rep *Report) {
	t.Helper()
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	for _, f := range []struct {
		file string
		data []byte
	}{
		{name + ".report.golden.json", append(js, '\n')},
		{name + ".table.golden", table.Bytes()},
	} {
		path := filepath.Join("testdata", f.file)
		if *update {
			if err := os.WriteFile(path, f.data, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%v (run go test -update to create it)", err)
		}
		if !bytes.Equal(want, f.data) {
			t.Errorf("%s differs from the golden file (go test -update to accept):\n%s", path, f.data)
		}
	}
}
