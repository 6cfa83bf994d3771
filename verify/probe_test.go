package verify

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/convert"
	"github.com/abnconvert/abnconvert/pth"
)

// The probe fixtures of fixtures/probe.py: a tiny torchvision ResNet
// (stock) and its CIFAR variant (conv1 stride 1, no max-pool: the same
// keys and shapes), each with a probe abnexport.py recorded in real torch.
func probeFile(name string) string { return filepath.Join("..", "fixtures", "testdata", "probe", name) }

// probeConverted converts the probe fixture name.pth (with --graph when
// graph is set) with --relu abn.
func probeConverted(t *testing.T, name, graph string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), name+"_abn.pth")
	if _, err := convert.Run(convert.Options{Input: probeFile(name + ".pth"), Output: out, ReLU: "abn", Graph: graph}); err != nil {
		t.Fatal(err)
	}
	return out
}

// editProbe writes a copy of the probe src with each entry passed through
// edit (a "" key drops it) and the entries of add appended.
func editProbe(t *testing.T, src string, edit func(k string, shape []int, v []float64) (string, []int, []float64), add map[string][]float64) string {
	t.Helper()
	ck, err := pth.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := filepath.Join(t.TempDir(), "edited.probe.pth")
	nc := pth.NewStateDict(out)
	for _, k := range ck.Keys() {
		shape, _ := ck.Shape(k)
		v, err := ck.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		nk, ns, nv := edit(k, shape, v)
		if nk == "" {
			continue
		}
		if err := nc.AddTensor(nk, pth.DType(ck.DType(k)), ns, nv); err != nil {
			t.Fatal(err)
		}
	}
	for k, v := range add {
		if err := nc.AddTensor(k, pth.Float32, []int{len(v)}, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Write(out, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}

func keep(k string, s []int, v []float64) (string, []int, []float64) { return k, s, v }

func drop(key string) func(string, []int, []float64) (string, []int, []float64) {
	return func(k string, s []int, v []float64) (string, []int, []float64) {
		if k == key {
			return "", nil, nil
		}
		return k, s, v
	}
}

func TestReadProbe(t *testing.T) {
	p, err := ReadProbe(probeFile("stock.probe.pth"))
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Eval) != 1 || len(p.Train) != 1 || len(p.After) != 1 || len(p.GradOut) != 1 ||
		p.Input.Shape[1] != 3 || len(p.Stats) == 0 || p.RandomEval != 0 {
		t.Fatalf("probe read as %d eval, %d train, %d after outputs, input %v, %d stats, %d random layers",
			len(p.Eval), len(p.Train), len(p.After), p.Input.Shape, len(p.Stats), p.RandomEval)
	}
	if d, err := ReadProbe(probeFile("drop.probe.pth")); err != nil || d.RandomEval != 1 {
		t.Fatalf("drop.probe.pth: %v, %d random layers in eval, want 1", err, d.RandomEval)
	}
}

// A file that is not a probe, or a probe with wrong keys or shapes, is
// refused by name, with what to do.
func TestReadProbeRefused(t *testing.T) {
	src := probeFile("stock.probe.pth")
	cases := []struct {
		name string
		file string
		want string
	}{
		{"a state dict", probeFile("stock.pth"), "not an abnconvert probe"},
		{"no marker", editProbe(t, src, drop("abnconvert_probe"), nil), "not an abnconvert probe"},
		{"other version", editProbe(t, src, func(k string, s []int, v []float64) (string, []int, []float64) {
			if k == "abnconvert_probe" {
				v = []float64{2}
			}
			return k, s, v
		}, nil), "format version [2]"},
		{"no input gradient", editProbe(t, src, drop("train.input_grad"), nil), `no entry "train.input_grad"`},
		{"no eval output", editProbe(t, src, drop("eval.output.0"), nil), `no entry "eval.output.0"`},
		{"a gap in the outputs", editProbe(t, src, keep, map[string][]float64{"after.output.2": {1}}), `no entry "after.output.1"`},
		{"unknown entry", editProbe(t, src, keep, map[string][]float64{"logits": {1}}), `unexpected entry "logits"`},
		{"gradient of another shape", editProbe(t, src, func(k string, s []int, v []float64) (string, []int, []float64) {
			if k == "train.grad_output.0" {
				return k, []int{len(v)}, v
			}
			return k, s, v
		}, nil), "train.output.0 has shape [2 5], its gradient [10]"},
		{"no statistics", editProbe(t, src, func(k string, s []int, v []float64) (string, []int, []float64) {
			if strings.HasPrefix(k, "train.stats.") {
				return "", nil, nil
			}
			return k, s, v
		}, nil), "no train.stats entries"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ReadProbe(c.file)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), c.file) {
				t.Fatalf("error %v, want one naming %s and saying %q", err, c.file, c.want)
			}
		})
	}
}

// A probe whose input the original cannot run (one channel for a
// three-channel network) is bad input naming the probe, not a verdict.
func TestProbeWrongInput(t *testing.T) {
	conv := probeConverted(t, "stock", "")
	bad := editProbe(t, probeFile("stock.probe.pth"), func(k string, s []int, v []float64) (string, []int, []float64) {
		if k == "input" || k == "train.input_grad" {
			return k, []int{s[0], 1, s[2], s[3]}, v[:len(v)/3]
		}
		return k, s, v
	}, nil)
	_, err := Run(Options{Original: probeFile("stock.pth"), Converted: conv, Probe: bad})
	if err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "does not run through the original's network") {
		t.Fatalf("error %v, want one naming %s and the input", err, bad)
	}
}

func TestProbeVerdicts(t *testing.T) {
	if testing.Short() {
		t.Skip("converts and verifies four times")
	}
	stock := probeConverted(t, "stock", "")
	cifar := probeConverted(t, "cifar", "")
	graph := probeFile("cifar.onnx")
	cifarGraph := probeConverted(t, "cifar", graph)
	cifarProbe := probeFile("cifar.probe.pth")
	// The export itself as the input: abnexport.py gave its initializers
	// the state before the export's trace.
	onnxOut := filepath.Join(t.TempDir(), "cifar_abn.onnx")
	if _, err := convert.Run(convert.Options{Input: graph, Output: onnxOut, ReLU: "abn"}); err != nil {
		t.Fatal(err)
	}
	// A probe whose one running variance moved by 1%: the outputs agree,
	// the statistics' check alone fails.
	moved := editProbe(t, cifarProbe, func(k string, s []int, v []float64) (string, []int, []float64) {
		if k == "train.stats.layer1.0.bn1.running_var" {
			for i := range v {
				v[i] *= 1.01
			}
		}
		return k, s, v
	}, nil)
	cases := []struct {
		name        string
		opt         Options
		preserved   bool
		structure   string
		conditional bool
		failed      string // a failed check the verdict must name
		cause       string // in the cause
	}{
		{"stock, its probe", Options{Original: probeFile("stock.pth"), Converted: stock, Probe: probeFile("stock.probe.pth")}, true, StructureAssumed, false, "", ""},
		{"stock, no probe", Options{Original: probeFile("stock.pth"), Converted: stock}, true, StructureAssumed, true, "", ""},
		{"cifar state dict, its probe", Options{Original: probeFile("cifar.pth"), Converted: cifar, Probe: cifarProbe}, false, StructureAssumed, false,
			"probe: eval output", "does not match: convert with --graph " + strings.TrimSuffix(cifarProbe, ".probe.pth") + ".onnx"},
		{"cifar --graph, its probe", Options{Original: probeFile("cifar.pth"), Converted: cifarGraph, Graph: graph, Probe: cifarProbe}, true, StructureRead, false, "", ""},
		{"cifar --graph, no probe", Options{Original: probeFile("cifar.pth"), Converted: cifarGraph, Graph: graph}, true, StructureRead, false, "", ""},
		{"cifar.onnx as the input, its probe", Options{Original: graph, Converted: onnxOut, Probe: cifarProbe}, true, StructureRead, false, "", ""},
		{"cifar --graph, a statistic moved", Options{Original: probeFile("cifar.pth"), Converted: cifarGraph, Graph: graph, Probe: moved}, false, StructureRead, false,
			"probe: running layer1.0.bn1.running_var", "BN momentum"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res, err := Run(c.opt)
			if err != nil {
				t.Fatal(err)
			}
			if res.Preserved != c.preserved || res.Structure != c.structure || res.Conditional != c.conditional {
				t.Fatalf("preserved %v, structure %q, conditional %v; want %v, %q, %v (failed %v)",
					res.Preserved, res.Structure, res.Conditional, c.preserved, c.structure, c.conditional, res.Failed)
			}
			if (res.Probe != nil) != (c.opt.Probe != "") {
				t.Fatalf("probe result %v with --probe %q", res.Probe, c.opt.Probe)
			}
			counted := res.Checks
			if res.Probe != nil {
				counted = append(append([]Check(nil), counted...), res.Probe.Checks...)
			}
			passed, failed, skipped := 0, 0, 0
			for _, c := range counted {
				switch {
				case c.Skipped:
					skipped++
				case c.Pass:
					passed++
				default:
					failed++
				}
			}
			if passed != res.Passed || failed != len(res.Failed) || skipped != len(res.Skipped) {
				t.Fatalf("counted %d passed, %d failed, %d skipped; the result says %d, %v, %v", passed, failed, skipped, res.Passed, res.Failed, res.Skipped)
			}
			if c.failed != "" && !strings.Contains(strings.Join(res.Failed, "\n"), c.failed) {
				t.Fatalf("failed %v, want %q among them", res.Failed, c.failed)
			}
			if c.preserved && res.Probe != nil && (!res.Probe.Pass || len(res.Probe.Checks) < 5) {
				t.Fatalf("probe %+v", res.Probe)
			}
			if c.cause != "" && (res.Probe == nil || !strings.Contains(res.Probe.Cause, c.cause)) {
				t.Fatalf("cause %q, want one saying %q", res.Probe.Cause, c.cause)
			}
			if c.failed == "probe: running layer1.0.bn1.running_var" {
				for _, f := range res.Failed {
					if strings.HasPrefix(f, "probe: ") && f != c.failed {
						t.Fatalf("%s failed too: only the moved statistic should", f)
					}
				}
			}
		})
	}
}
