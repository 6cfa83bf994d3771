package cuda

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// TestMain checks, after a full run, that the tests launched every kernel
// of the table at least once: a kernel no op reaches would be checked
// against the PTX but never against the CPU backend.
func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if code == 0 && flag.Lookup("test.run").Value.String() == "" && !testing.Short() {
		var missing []string
		for _, s := range kernelSpecs {
			if !launched.m[s.name] {
				missing = append(missing, s.name)
			}
		}
		if len(missing) > 0 {
			fmt.Fprintf(os.Stderr, "FAIL: no test launched %s\n", strings.Join(missing, ", "))
			code = 1
		}
	}
	os.Exit(code)
}

// fixtureNet is a bundled fixture's network, as read and, when converted,
// as rewritten by the conversion's defaults (InPlace-ABN with leaky ReLU,
// DenseNet layers marked for recomputation).
type fixtureNet struct {
	name string
	g    *graph.Graph
	w    graph.Weights
}

func loadWeights(t testing.TB, path string) *graph.MemWeights {
	t.Helper()
	ck, err := pth.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	w := graph.NewMemWeights()
	for _, k := range ck.Keys() {
		shape, _ := ck.Shape(k)
		v, err := ck.Values(k)
		if err != nil {
			t.Fatalf("%s: %s: %v", path, k, err)
		}
		w.Put(k, shape, v)
	}
	return w
}

// fixtureNets returns the original and converted network of every
// fixtures/testdata/tiny_*.pth, and of act_net (fixtures/acts.py: ReLU6,
// SiLU, a squeeze-and-excitation gate with Sigmoid and a broadcasting Mul,
// Hardswish, GELU, Hardsigmoid, a mean head) from its opset-13 export.
func fixtureNets(t testing.TB) []fixtureNet {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("..", "fixtures", "testdata", "tiny_*.pth"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no fixtures: %v", err)
	}
	var out []fixtureNet
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".pth")
		w := loadWeights(t, f)
		g, _, err := arch.Recognize(w, "auto")
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		out = append(out, fixtureNet{name: name, g: g, w: w})
		cw := loadWeights(t, f)
		cg, _, err := arch.Recognize(cw, "auto")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := rewrite.Run(cg, cw, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		out = append(out, fixtureNet{name: name + " converted", g: cg, w: cw})
	}
	act := filepath.Join("..", "fixtures", "testdata", "acts", "act_net_op13.onnx")
	for _, converted := range []bool{false, true} {
		m, err := onnx.Read(act)
		if err != nil {
			t.Fatal(err)
		}
		name := "act_net"
		if converted {
			name += " converted"
			if _, err := rewrite.Run(m.Graph, m.Weights, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}); err != nil {
				t.Fatalf("%s: %v", act, err)
			}
		}
		out = append(out, fixtureNet{name: name, g: m.Graph, w: m.Weights})
	}
	// The layout networks (fixtures/shape_nets.py: channel shuffle, an
	// inception block with a non-zero Pad and ceil_mode, a Linear+BatchNorm1d
	// head, a segmentation head resized to the input, a UNet and a chain
	// resized by scale factors and to a fixed size, MobileNetV3 inverted
	// residuals whose adds the conversion fuses into InPlace-ABN), their shape subgraphs
	// and layout ops lowered as --graph lowers them.
	for _, name := range []string{"shuffle", "inception", "head", "seg", "unet", "upseq", "invres"} {
		path := filepath.Join("..", "fixtures", "testdata", "shape", name+"_op13.onnx")
		for _, converted := range []bool{false, true} {
			m, err := onnx.Read(path)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := m.LowerLayout(); err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			if o := m.Opaque(); len(o) != 0 {
				t.Fatalf("%s: opaque after lowering: %v", path, o)
			}
			n := fixtureNet{name: name, g: m.Graph, w: m.Weights}
			if converted {
				n.name += " converted"
				if _, err := rewrite.Run(m.Graph, m.Weights, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}); err != nil {
					t.Fatalf("%s: %v", path, err)
				}
			}
			out = append(out, n)
		}
	}
	// StochasticDepth (fixtures/stochdepth.py: row mode on an MBConv
	// residual branch, as efficientnet has it, and batch mode), from its
	// train-mode export: the training step draws the noise on each backend
	// from the same seed, so the outputs agree only if the same samples
	// survive.
	sd := filepath.Join("..", "fixtures", "testdata", "stochdepth", "sd_op13.onnx")
	for _, converted := range []bool{false, true} {
		m, err := onnx.Read(sd)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.LowerLayout(); err != nil {
			t.Fatalf("%s: %v", sd, err)
		}
		if o := m.Opaque(); len(o) != 0 {
			t.Fatalf("%s: opaque after lowering: %v", sd, o)
		}
		n := fixtureNet{name: "sd", g: m.Graph, w: m.Weights}
		if converted {
			n.name += " converted"
			if _, err := rewrite.Run(m.Graph, m.Weights, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}); err != nil {
				t.Fatalf("%s: %v", sd, err)
			}
		}
		out = append(out, n)
	}
	return out
}

func randomInput(seed uint64, shape ...int) *runtime.HostTensor {
	r := rand.New(rand.NewPCG(seed, 3))
	x := runtime.NewHostTensor(shape...)
	for i := range x.Data {
		x.Data[i] = float32(r.NormFloat64())
	}
	return x
}

func gradFor(seed uint64, shape []int) *runtime.HostTensor {
	return randomInput(seed+1, shape...)
}

// step is one eval forward, one training forward and its backward, with
// the memory report after each.
type step struct {
	eval, train      runtime.MemoryReport
	stats            []runtime.AllocStats
	evalOut, out, dx *runtime.HostTensor
	grads            map[string][]float32
	running          map[string][]float32
}

func runStep(t testing.TB, n fixtureNet, b runtime.Backend, x *runtime.HostTensor) step {
	t.Helper()
	e, err := runtime.New(n.g, n.w, b, runtime.Options{Seed: 5})
	if err != nil {
		t.Fatalf("%s on %s: %v", n.name, b.Name(), err)
	}
	var s step
	if s.evalOut, err = e.Forward(x, false); err != nil {
		t.Fatalf("%s on %s: eval: %v", n.name, b.Name(), err)
	}
	s.eval = e.Memory()
	s.stats = append(s.stats, b.Stats())
	if s.out, err = e.Forward(x, true); err != nil {
		t.Fatalf("%s on %s: training forward: %v", n.name, b.Name(), err)
	}
	s.stats = append(s.stats, b.Stats())
	if s.dx, s.grads, err = e.Backward(gradFor(5, s.out.Shape)); err != nil {
		t.Fatalf("%s on %s: backward: %v", n.name, b.Name(), err)
	}
	s.train = e.Memory()
	s.stats = append(s.stats, b.Stats())
	if s.running, err = e.RunningStats(); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("%s on %s: close: %v", n.name, b.Name(), err)
	}
	s.stats = append(s.stats, b.Stats())
	return s
}

// TestNetworksMemoryMatchesCPU runs every fixture network, original and
// converted, through the runtime on the CUDA backend over the fake device:
// every launch is checked, and the memory report (saved bytes, peak, each
// layer's live bytes after forward and backward) and the allocator counts
// must equal the CPU backend's for the same step.
func TestNetworksMemoryMatchesCPU(t *testing.T) {
	x := randomInput(1, 2, 3, 32, 32)
	for _, n := range fixtureNets(t) {
		t.Run(n.name, func(t *testing.T) {
			want := runStep(t, n, runtime.NewCPU(2), x)
			b, dev := newFakeBackend(t)
			got := runStep(t, n, b, x)
			for _, r := range []*runtime.MemoryReport{&want.eval, &want.train, &got.eval, &got.train} {
				r.Backend = ""
			}
			if !reflect.DeepEqual(got.eval, want.eval) {
				t.Errorf("eval memory: cuda %+v, cpu %+v", summary(got.eval), summary(want.eval))
			}
			if !reflect.DeepEqual(got.train, want.train) {
				t.Errorf("training memory: cuda %+v, cpu %+v", summary(got.train), summary(want.train))
				for i := range got.train.Layers {
					if i < len(want.train.Layers) && got.train.Layers[i] != want.train.Layers[i] {
						t.Errorf("first difference at layer %d: cuda %+v, cpu %+v", i, got.train.Layers[i], want.train.Layers[i])
						break
					}
				}
			}
			if !reflect.DeepEqual(got.stats, want.stats) {
				t.Errorf("allocator counts: cuda %+v, cpu %+v", got.stats, want.stats)
			}
			if !reflect.DeepEqual(got.out.Shape, want.out.Shape) || len(got.grads) != len(want.grads) || len(got.running) != len(want.running) {
				t.Errorf("results differ in shape: output %v/%v, %d/%d gradients, %d/%d running statistics",
					got.out.Shape, want.out.Shape, len(got.grads), len(want.grads), len(got.running), len(want.running))
			}
			if len(dev.launches) == 0 {
				t.Error("no kernel launched")
			}
			if err := b.Close(); err != nil {
				t.Fatal(err)
			}
			if err := b.TrimCache(); err != nil {
				t.Fatal(err)
			}
			if dev.used != 0 {
				t.Errorf("%d bytes of device memory left after closing the executor and the backend", dev.used)
			}
		})
	}
}

func summary(r runtime.MemoryReport) string {
	return fmt.Sprintf("saved %d peak %d params %d, %d layers", r.SavedBytes, r.PeakBytes, r.ParamBytes, len(r.Layers))
}
