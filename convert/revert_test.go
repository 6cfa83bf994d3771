package convert

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/safetensors"
)

// TestRevertRoundTrip: converting then reverting with the report gives the
// original checkpoint back, value for value, except the channels with
// |gamma| < eps (which come back at scale eps, with their sign); and the
// original network over the reverted weights computes the original's eval
// outputs within 1e-5 relative (its tiny-gamma channels at +-eps, as
// conversion stores them).
func TestRevertRoundTrip(t *testing.T) {
	for _, c := range []struct{ name, relu, ext string }{
		{"tiny_resnet_basic", "leaky", ".pth"}, {"tiny_resnext", "abn", ".pth"},
		{"tiny_densenet", "leaky", ".safetensors"}, {"tiny_vgg", "abn", ".pth"},
	} {
		t.Run(c.name+"/"+c.relu, func(t *testing.T) {
			dir := t.TempDir()
			conv, rep, back := filepath.Join(dir, "abn"+c.ext), filepath.Join(dir, "r.json"), filepath.Join(dir, "bn"+c.ext)
			res, err := Run(Options{Input: fixture(c.name), Output: conv, ReportPath: rep, ReLU: c.relu})
			if err != nil {
				t.Fatal(err)
			}
			rr, err := Revert(RevertOptions{Input: conv, Output: back, Report: rep})
			if err != nil {
				t.Fatal(err)
			}
			if len(rr.Layers) != res.Report.Summary.Sites {
				t.Errorf("%d layers reverted, %d sites converted", len(rr.Layers), res.Report.Summary.Sites)
			}
			orig := open(t, fixture(c.name))
			defer orig.Close()
			got, done := openAny(t, back)
			defer done()
			tiny := map[string]map[int]bool{}
			for _, s := range res.Report.Sites {
				for _, ch := range s.TinyGammaChannels {
					if tiny[s.Node+".weight"] == nil {
						tiny[s.Node+".weight"] = map[int]bool{}
					}
					tiny[s.Node+".weight"][ch] = true
				}
			}
			for _, k := range orig.Keys() {
				a, b := values(t, orig, k), values(t, got, k)
				for i := range a {
					if tiny[k][i] {
						if math.Abs(b[i]) != float64(float32(1e-5)) || (a[i] < 0) != (b[i] < 0) && a[i] != 0 {
							t.Errorf("%s[%d]: tiny gamma %g reverted to %g, want +-eps with its sign", k, i, a[i], b[i])
						}
						continue
					}
					if a[i] != b[i] {
						t.Fatalf("%s[%d] = %g, the original has %g", k, i, b[i], a[i])
					}
				}
			}
			// Outputs: the original network over the reverted weights.
			g, _, err := arch.Recognize(got, "auto")
			if err != nil {
				t.Fatal(err)
			}
			gRef, _, err := arch.Recognize(orig, "auto")
			if err != nil {
				t.Fatal(err)
			}
			ref := newCopy(t, orig)
			for k, chans := range tiny {
				v := values(t, ref, k)
				for ch := range chans {
					v[ch] = math.Copysign(1e-5, v[ch])
					if v[ch] == 0 {
						v[ch] = 1e-5
					}
				}
				ref.SetValues(k, v)
			}
			x := randomInput(2, 3, 32, 32)
			y := evalOutput(t, g, got, []int{2, 3, 32, 32}, x)
			yRef := evalOutput(t, gRef, ref, []int{2, 3, 32, 32}, x)
			if e := relErr(y, yRef); e > 1e-5 {
				t.Errorf("reverted eval output rel %.2e, want <= 1e-5", e)
			}
		})
	}
}

func randomInput(shape ...int) []float32 {
	r := rand.New(rand.NewPCG(1, 2))
	x := make([]float32, graph.Numel(shape))
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	return x
}

// TestRevertOptimizer: a training checkpoint's optimizer state comes back
// too: the first moments of the channels whose sign moved are negated back.
func TestRevertOptimizer(t *testing.T) {
	dir := t.TempDir()
	conv, rep, back := filepath.Join(dir, "a.pth"), filepath.Join(dir, "r.json"), filepath.Join(dir, "b.pth")
	if _, err := Run(Options{Input: fixture("tiny_resnet_nested"), Output: conv, ReportPath: rep}); err != nil {
		t.Fatal(err)
	}
	if _, err := Revert(RevertOptions{Input: conv, Output: back, Report: rep}); err != nil {
		t.Fatal(err)
	}
	orig, got := open(t, fixture("tiny_resnet_nested")), open(t, back)
	defer orig.Close()
	defer got.Close()
	if strings.Join(got.StatePath, ".") != strings.Join(orig.StatePath, ".") || got.Prefix != orig.Prefix {
		t.Errorf("state dict under %v prefix %q, want %v %q", got.StatePath, got.Prefix, orig.StatePath, orig.Prefix)
	}
	// Every tensor of the whole tree, optimizer buffers included.
	a, b := treeTensors(orig.Root, ""), treeTensors(got.Root, "")
	if len(a) != len(b) || len(a) < 100 {
		t.Fatalf("%d tensors in the tree, the original has %d", len(b), len(a))
	}
	for path, ta := range a {
		tb, ok := b[path]
		if !ok {
			t.Fatalf("%s missing", path)
		}
		va, _ := orig.TensorValues(ta)
		vb, _ := got.TensorValues(tb)
		for i := range va {
			if math.Abs(va[i]-vb[i]) > 1e-6*math.Max(1, math.Abs(va[i])) {
				t.Fatalf("%s[%d] = %g, the original has %g", path, i, vb[i], va[i])
			}
		}
	}
}

func treeTensors(v pth.Value, path string) map[string]*pth.Tensor {
	out := map[string]*pth.Tensor{}
	switch v := v.(type) {
	case *pth.Tensor:
		out[path] = v
	case *pth.Dict:
		for i := 0; i < v.Len(); i++ {
			k, x := v.Entry(i)
			for p, t := range treeTensors(x, path+"/"+keyText(k)) {
				out[p] = t
			}
		}
	case *pth.List:
		for i, x := range v.Items {
			for p, t := range treeTensors(x, path+"/"+keyText(int64(i))) {
				out[p] = t
			}
		}
	}
	return out
}

func keyText(k pth.Value) string {
	b, _ := json.Marshal(k)
	return string(b)
}

// TestRevertZoo: a checkpoint as inplace_abn's training scripts save it
// ({"state_dict": ..., "epoch": ...}, "module." keys, stored weights of both
// signs, one below eps in magnitude) reverts, without a report, to
// gamma = |weight| + eps exactly as torch computes it (abn_zoo.json), and
// keeps every other tensor and entry.
func TestRevertZoo(t *testing.T) {
	var gold struct {
		Eps   float64              `json:"eps"`
		Gamma map[string][]float64 `json:"gamma"`
	}
	b, err := os.ReadFile(f4("abn_zoo.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &gold); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "bn.pth")
	res, err := Revert(RevertOptions{Input: f4("abn_zoo.pth"), Output: out, Eps: gold.Eps})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Layers) != 6 || len(res.Warnings) == 0 {
		t.Errorf("%d layers, warnings %v", len(res.Layers), res.Warnings)
	}
	orig, got := open(t, f4("abn_zoo.pth")), open(t, out)
	defer orig.Close()
	defer got.Close()
	if got.Prefix != "module." || strings.Join(got.StatePath, ".") != "state_dict" {
		t.Errorf("prefix %q, state path %v", got.Prefix, got.StatePath)
	}
	if d, ok := got.Root.(*pth.Dict); !ok || d.Len() != 3 {
		t.Errorf("root %v: epoch and arch entries lost", got.Root)
	}
	negatives := 0
	for _, k := range orig.Keys() {
		a, v := values(t, orig, k), values(t, got, k)
		want, isGamma := gold.Gamma[k]
		if !isGamma {
			if !equalF(a, v) {
				t.Errorf("%s changed", k)
			}
			continue
		}
		for i := range want {
			if float32(v[i]) != float32(want[i]) {
				t.Errorf("%s[%d] = %v, torch's abs(w) + eps is %v (w = %v)", k, i, float32(v[i]), float32(want[i]), a[i])
			}
			if a[i] < 0 {
				negatives++
			}
		}
	}
	if negatives < 6 {
		t.Errorf("the fixture has only %d negative weights", negatives)
	}
}

// TestRevertTable: hand-built InPlace-ABN checkpoints (safetensors), reverted
// without a report: negative stored weights, a zero, float64 weights, and
// layers that are not BN-family (left alone).
func TestRevertTable(t *testing.T) {
	cases := []struct {
		name   string
		dtype  safetensors.DType
		weight []float64
		eps    float64
		want   []float64
	}{
		{"negative", safetensors.F32, []float64{-0.5, 0.25, -2}, 1e-5, []float64{float64(float32(0.5) + float32(1e-5)), float64(float32(0.25) + float32(1e-5)), float64(float32(2) + float32(1e-5))}},
		{"zero and tiny", safetensors.F32, []float64{0, -1e-6}, 1e-3, []float64{float64(float32(1e-3)), float64(float32(float32(1e-6)) + float32(1e-3))}},
		{"float64", safetensors.F64, []float64{-0.1, 0.3}, 1e-5, []float64{0.1 + 1e-5, 0.3 + 1e-5}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			n := len(c.weight)
			ones := make([]float64, n)
			for i := range ones {
				ones[i] = 1
			}
			ts := []safetensors.Tensor{
				{Name: "net.bn.weight", DType: c.dtype, Shape: []int{n}, Write: encoder(t, c.dtype, c.weight)},
				{Name: "net.bn.bias", DType: c.dtype, Shape: []int{n}, Write: encoder(t, c.dtype, ones)},
				{Name: "net.bn.running_mean", DType: c.dtype, Shape: []int{n}, Write: encoder(t, c.dtype, ones)},
				{Name: "net.bn.running_var", DType: c.dtype, Shape: []int{n}, Write: encoder(t, c.dtype, ones)},
				{Name: "net.fc.weight", DType: c.dtype, Shape: []int{n}, Write: encoder(t, c.dtype, c.weight)},
				{Name: "net.fc.bias", DType: c.dtype, Shape: []int{n}, Write: encoder(t, c.dtype, ones)},
			}
			in, out := filepath.Join(dir, "in.safetensors"), filepath.Join(dir, "out.safetensors")
			if err := safetensors.WriteTensors(in, ts, nil, safetensors.WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := Revert(RevertOptions{Input: in, Output: out, Eps: c.eps}); err != nil {
				t.Fatal(err)
			}
			f, err := safetensors.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if got := values(t, f, "net.bn.weight"); !equalF(got, c.want) {
				t.Errorf("gamma %v, want %v", got, c.want)
			}
			if got := values(t, f, "net.fc.weight"); !equalF(got, roundTo(c.dtype, c.weight)) {
				t.Errorf("a Linear weight changed: %v", got)
			}
			if f.DType("net.bn.weight") != c.dtype {
				t.Errorf("dtype %s", f.DType("net.bn.weight"))
			}
		})
	}
}

func roundTo(d safetensors.DType, v []float64) []float64 {
	out := append([]float64(nil), v...)
	if d == safetensors.F32 {
		for i := range out {
			out[i] = float64(float32(out[i]))
		}
	}
	return out
}

// TestRevertRefusals: bad reports and inputs are refused before anything
// is written.
func TestRevertRefusals(t *testing.T) {
	dir := t.TempDir()
	conv, rep := filepath.Join(dir, "a.pth"), filepath.Join(dir, "r.json")
	if _, err := Run(Options{Input: fixture("tiny_vgg"), Output: conv, ReportPath: rep}); err != nil {
		t.Fatal(err)
	}
	notReport := filepath.Join(dir, "x.json")
	os.WriteFile(notReport, []byte(`{"sites": []}`), 0o644)
	cases := []struct {
		name string
		opt  RevertOptions
		want string
	}{
		{"report of another checkpoint", RevertOptions{Input: fixture("tiny_densenet"), Report: rep}, "the report's layers are not in this checkpoint"},
		{"not a report", RevertOptions{Input: conv, Report: notReport}, "not a conversion report"},
		{"missing report", RevertOptions{Input: conv, Report: filepath.Join(dir, "none.json")}, "none.json"},
		{"no BN", RevertOptions{Input: f4("dtypes.safetensors")}, "no BN-family layer"},
		{"bad eps", RevertOptions{Input: conv, Eps: -1}, "--eps -1"},
		{"onnx", RevertOptions{Input: f4("custom.onnx")}, "revert reads and writes .pth or .safetensors"},
		{"same file", RevertOptions{Input: conv, Output: conv}, "never overwrites its input"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.opt.Output == "" {
				c.opt.Output = filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_")+".pth")
			}
			_, err := Revert(c.opt)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
			if c.opt.Output != conv {
				if _, err := os.Stat(c.opt.Output); err == nil {
					t.Error("output written")
				}
			}
		})
	}
}
