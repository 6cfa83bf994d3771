package verify

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/convert"
	"github.com/abnconvert/abnconvert/onnx"
	"github.com/abnconvert/abnconvert/runtime"
)

var onnxFixtures = map[string]string{
	"custom":     filepath.Join("..", "fixtures", "testdata", "formats4", "custom.onnx"),
	"tiny_dense": filepath.Join("..", "onnx", "testdata", "tiny_dense.onnx"),
	"tiny_cnn":   filepath.Join("..", "onnx", "testdata", "tiny_cnn.onnx"),
}

func convertONNX(t *testing.T, in, ops, relu string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), ops+"_"+relu+".onnx")
	if _, err := convert.Run(convert.Options{Input: in, Output: out, ONNXOps: ops, ReLU: relu}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestONNXPreserved: a custom network (LeakyReLU, ELU) and a DenseNet
// (recompute groups, zero Pads before AveragePool), written with the custom
// domain, with standard ops, and folded for inference, under both ReLU
// policies, all verify.
func TestONNXPreserved(t *testing.T) {
	for _, name := range []string{"custom", "tiny_dense"} {
		for _, ops := range []string{"custom", "standard", "fold"} {
			for _, relu := range []string{"leaky", "abn"} {
				t.Run(name+"/"+ops+"/"+relu, func(t *testing.T) {
					in := onnxFixtures[name]
					res, err := Run(Options{Original: in, Converted: convertONNX(t, in, ops, relu), ReLU: relu})
					if err != nil {
						t.Fatal(err)
					}
					if !res.Preserved {
						t.Fatalf("not preserved: %v\n%+v", res.Failed, res.Checks)
					}
					want := 4
					if ops == "fold" {
						want = 2 // eval output, and the training step's skip note
					}
					if len(res.Checks) != want {
						t.Errorf("%d checks: %+v", len(res.Checks), res.Checks)
					}
					if last := res.Checks[len(res.Checks)-1]; ops == "fold" &&
						(!last.Skipped || last.Pass || !strings.Contains(last.Reason, "folded for inference") || len(res.Skipped) != 1 || res.Passed != 1) {
						t.Errorf("the folded model's training step is not recorded as skipped: %+v, skipped %v, %d passed", last, res.Skipped, res.Passed)
					}
					if name == "tiny_dense" && relu == "leaky" && (res.Drift == nil || res.Drift.Sites == 0) {
						t.Error("no drift reported for the approximated ReLU sites")
					}
					// The training step's drift: outputs and input gradient
					// (the files name their running statistics apart); none
					// for a model folded for inference, which has no step.
					if d := res.Drift; d != nil {
						tr := d.Train
						if ops == "fold" && tr != nil || ops != "fold" && (tr == nil || !(tr.Output.Rel > 0) || !(tr.InputGradient.Rel > 0) || tr.RunningStats != nil) {
							t.Errorf("training drift %+v", tr)
						}
					}
				})
			}
		}
	}
}

// TestONNXCaught: conversions that do not compute what was promised fail.
func TestONNXCaught(t *testing.T) {
	// Converted exactly (ABN relu) but verified as if ReLU had become
	// leaky_relu: the provenance record says otherwise, and verify
	// refuses, naming both values.
	in := onnxFixtures["tiny_dense"]
	_, err := Run(Options{Original: in, Converted: convertONNX(t, in, "custom", "abn"), ReLU: "leaky", Slope: 0.2})
	if err == nil || !strings.Contains(err.Error(), "--relu leaky") || !strings.Contains(err.Error(), "--relu abn") {
		t.Errorf("a flag contradicting the record: %v", err)
	}
	// One stored InPlace-ABN weight perturbed in the file.
	in = onnxFixtures["custom"]
	out := convertONNX(t, in, "custom", "leaky")
	m, err := onnx.ReadWith(out, onnx.ReadOptions{AllowEvalExport: true})
	if err != nil {
		t.Fatal(err)
	}
	w, err := m.Weights.Values("bn_a.weight")
	if err != nil {
		t.Fatal(err)
	}
	var pat []byte
	for _, v := range w[:4] {
		pat = binary.LittleEndian.AppendUint32(pat, math.Float32bits(float32(v)))
	}
	b, _ := os.ReadFile(out)
	at := bytes.Index(b, pat)
	if at < 0 || bytes.Index(b[at+1:], pat) >= 0 {
		t.Fatal("bn_a.weight's bytes are not found exactly once in the file")
	}
	binary.LittleEndian.PutUint32(b[at:], math.Float32bits(float32(w[0]*1.5)))
	bad := filepath.Join(t.TempDir(), "bad.onnx")
	os.WriteFile(bad, b, 0o644)
	res, err := Run(Options{Original: in, Converted: bad})
	if err != nil {
		t.Fatal(err)
	}
	if res.Preserved || len(res.Failed) == 0 || res.Failed[0] != "eval output" {
		t.Errorf("a perturbed weight verified: %+v", res)
	}
}

// TestONNXRefused: models with ops the runtime does not model are refused
// by name; an ONNX file is only verified against an ONNX file.
func TestONNXRefused(t *testing.T) {
	// Softmax: an op the runtime does not model (tiny_cnn's Sigmoid and Mul
	// it now runs).
	opaque := filepath.Join("..", "fixtures", "testdata", "acts", "softmax_net_op13.onnx")
	_, err := Run(Options{Original: opaque, Converted: convertONNX(t, opaque, "custom", "leaky")})
	if err == nil || !strings.Contains(err.Error(), "Softmax x1") || !strings.Contains(err.Error(), "softmax_net_op13.onnx") {
		t.Errorf("opaque ops: %v", err)
	}
	in := onnxFixtures["tiny_cnn"]
	out := convertONNX(t, in, "custom", "leaky")
	_, err = Run(Options{Original: in, Converted: fixture("tiny_vgg")})
	if err == nil || !strings.Contains(err.Error(), "give both as .onnx") {
		t.Errorf("ONNX against .pth: %v", err)
	}
	_, err = Run(Options{Original: filepath.Join("..", "onnx", "testdata", "tiny_cnn_eval.onnx"), Converted: out})
	if err == nil || !strings.Contains(err.Error(), "PRESERVE") {
		t.Errorf("eval export as the original: %v", err)
	}
}

// TestONNXLoweringAgainstTorch: the original tiny DenseNet, its zero Pads
// lowered away, computes in the runtime what torch computed (golden).
func TestONNXLoweringAgainstTorch(t *testing.T) {
	var gold struct {
		InputShape []int     `json:"input_shape"`
		Input      []float32 `json:"input"`
		Output     []float32 `json:"output"`
	}
	b, err := os.ReadFile(filepath.Join("..", "onnx", "testdata", "tiny_dense.golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &gold); err != nil {
		t.Fatal(err)
	}
	md, err := readRunnable(onnxFixtures["tiny_dense"], false)
	if err != nil {
		t.Fatal(err)
	}
	m := md.ONNX
	ex, err := runtime.New(m.Graph, m.Weights, runtime.NewCPU(0), runtime.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ex.Close()
	x := runtime.NewHostTensor(gold.InputShape...)
	copy(x.Data, gold.Input)
	y, err := ex.Forward(x, false)
	if err != nil {
		t.Fatal(err)
	}
	if c := compare("torch", y.Data, gold.Output, nil, 1e-4); !c.Pass {
		t.Errorf("runtime against torch: rel %.2e", c.Rel)
	}
}

// TestProtoAttributes: the wire-format reader finds what the writer put on
// a custom node (DOMAIN.md).
func TestProtoAttributes(t *testing.T) {
	out := convertONNX(t, onnxFixtures["tiny_dense"], "custom", "leaky")
	pm, err := readProtoModel(out)
	if err != nil {
		t.Fatal(err)
	}
	n := pm.nodes["/features/denseblock1/denselayer1/norm1/BatchNormalization"]
	if n == nil {
		t.Fatalf("node not found among %d", len(pm.nodes))
	}
	if n.domain != onnx.Domain || n.opType != "InPlaceABN" || len(n.inputs) != 5 || n.strs["activation"] != "leaky_relu" ||
		decimal(n.floats["activation_param"]) != 0.01 || decimal(n.floats["momentum"]) != 0.1 || n.strs["recompute_group"] == "" {
		t.Errorf("node %+v", n)
	}
	if len(pm.inputDim) != 4 || pm.inputDim[1] != 3 {
		t.Errorf("input dims %v", pm.inputDim)
	}
}

// TestOtherFormats: verify reads every state-dict source a conversion
// reads (safetensors, whole pickled modules, --graph), proves good
// conversions of them and catches a naive one.
func TestOtherFormats(t *testing.T) {
	f4 := filepath.Join("..", "fixtures", "testdata", "formats4")
	cases := []struct {
		name, in, out, graph string
	}{
		{"safetensors", filepath.Join(f4, "tiny_resnet_basic.safetensors"), "out.safetensors", ""},
		{"safetensors to pth", filepath.Join(f4, "tiny_resnet_basic.safetensors"), "out.pth", ""},
		{"torchvision module", filepath.Join(f4, "resnet_module.pth"), "out.pth", ""},
		{"Sequential module", filepath.Join(f4, "seq_module.pth"), "out.pth", ""},
		{"--graph", filepath.Join(f4, "custom.pth"), "out.pth", filepath.Join(f4, "custom.onnx")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), c.out)
			if _, err := convert.Run(convert.Options{Input: c.in, Output: out, Graph: c.graph}); err != nil {
				t.Fatal(err)
			}
			res, err := Run(Options{Original: c.in, Converted: out, Graph: c.graph, Size: 32})
			if err != nil {
				t.Fatal(err)
			}
			if !res.Preserved {
				t.Fatalf("not preserved: %v", res.Failed)
			}
			// The original as its own "conversion": weights not reparametrised.
			if c.out == "out.pth" && c.name != "Sequential module" {
				return
			}
			naive, err := Run(Options{Original: c.in, Converted: c.in, Graph: c.graph, Size: 32})
			if err != nil {
				t.Fatal(err)
			}
			if naive.Preserved {
				t.Fatal("a naive copy verified")
			}
		})
	}
}
