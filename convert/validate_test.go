package convert

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// bnGraph is input -> conv -> bn with a 4-channel BN whose parameters are
// the given values; every other parameter is sane.
func bnGraph(weight, bias, mean, variance []float64) (*graph.Graph, *graph.MemWeights) {
	g := graph.New("test", 3)
	x := g.Add("conv", graph.OpConv, graph.Attr{InChannels: 3, OutChannels: 4}, map[string]string{graph.RoleWeight: "conv.weight"}, g.Input)
	params := map[string]string{}
	w := graph.NewMemWeights()
	w.Put("conv.weight", []int{4, 3, 1, 1}, make([]float64, 12))
	for role, v := range map[string][]float64{graph.RoleWeight: weight, graph.RoleBias: bias, graph.RoleRunningMean: mean, graph.RoleRunningVar: variance} {
		if v != nil {
			params[role] = "m.bn." + role
			w.Put("m.bn."+role, []int{len(v)}, v)
		}
	}
	g.Add("m.bn", graph.OpBatchNorm, graph.Attr{Features: 4, Eps: 1e-5}, params, x)
	return g, w
}

func TestValidateBN(t *testing.T) {
	ok := []float64{1, -2, 0.5, 0}
	nan, inf := math.NaN(), math.Inf(-1)
	cases := []struct {
		name                  string
		weight, bias, mean, v []float64
		want                  string // "" for valid
	}{
		{"sane", ok, ok, ok, []float64{1, 0, 2, 1e-12}, ""},
		{"zero and negative-zero variance", ok, ok, ok, []float64{0, math.Copysign(0, -1), 1, 1}, ""},
		{"no running statistics", ok, ok, nil, nil, ""},
		{"negative variance", ok, ok, ok, []float64{1, 1, 1, -0.5}, "m.bn.running_var[3] = -0.5: a variance cannot be negative"},
		{"tiny negative variance", ok, ok, ok, []float64{-1e-30, 1, 1, 1}, "m.bn.running_var[0] = -1e-30: a variance"},
		{"NaN weight", []float64{1, 1, nan, 1}, ok, ok, ok, "m.bn.weight[2] = NaN: BN parameters must be finite"},
		{"-Inf bias", ok, []float64{inf, 1, 1, 1}, ok, ok, "m.bn.bias[0] = -Inf"},
		{"+Inf mean", ok, ok, []float64{1, math.Inf(1), 1, 1}, ok, "m.bn.running_mean[1] = +Inf"},
		{"NaN variance", ok, ok, ok, []float64{1, 1, 1, nan}, "m.bn.running_var[3] = NaN"},
		{"float64 value printed in full", ok, ok, ok, []float64{1, -0.1, 1, 1}, "m.bn.running_var[1] = -0.1:"},
		{"largest finite values", []float64{math.MaxFloat64, -math.MaxFloat64, math.SmallestNonzeroFloat64, 1}, ok, ok, []float64{math.MaxFloat64, 1, 1, 1}, ""},
		{"-Inf variance", ok, ok, ok, []float64{1, 1, inf, 1}, "m.bn.running_var[2] = -Inf: BN parameters must be finite"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g, w := bnGraph(c.weight, c.bias, c.mean, c.v)
			err := validateBN(g, w)
			if c.want == "" {
				if err != nil {
					t.Fatalf("valid parameters refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
		})
	}
}

// TestValidateRealCheckpoints: every committed fixture passes, so the
// check refuses nothing torch trained.
func TestValidateRealCheckpoints(t *testing.T) {
	for _, name := range append(fixtures, "tiny_resnet_nested") {
		ins, err := Inspect(fixture(name), Options{})
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(ins.RewriteError, "BN parameters") || strings.Contains(ins.RewriteError, "variance") {
			t.Errorf("%s: %s", name, ins.RewriteError)
		}
	}
}

// TestValidateInRun: Run refuses a checkpoint with a negative running
// variance, naming the file, the key and the element, and writes nothing;
// Inspect reports the same problem as the reason a conversion is refused.
func TestValidateInRun(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "in.pth")
	ck, err := pth.Open(fixture("tiny_vgg"))
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	var key string
	for _, k := range ck.Keys() {
		if strings.HasSuffix(k, "running_var") {
			key = k
			break
		}
	}
	v, err := ck.Values(key)
	if err != nil {
		t.Fatal(err)
	}
	v[1] = -2
	if err := ck.SetValues(key, v); err != nil {
		t.Fatal(err)
	}
	if err := ck.Write(in, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	want := in + ": " + key + "[1] = -2: a variance cannot be negative"
	_, err = Run(Options{Input: in, Output: filepath.Join(dir, "out.pth")})
	if err == nil || err.Error() != want {
		t.Fatalf("Run: %v\nwant %s", err, want)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("files left: %v", ents)
	}
	ins, err := Inspect(in, Options{})
	if err != nil || !strings.Contains(ins.RewriteError, key+"[1] = -2") {
		t.Errorf("Inspect: %v, rewrite error %q", err, ins.RewriteError)
	}
}

func TestWithPath(t *testing.T) {
	base := errors.New("boom")
	if got := withPath("a.pth", base).Error(); got != "a.pth: boom" {
		t.Errorf("%q", got)
	}
	if got := withPath("a.pth", withPath("a.pth", base)).Error(); got != "a.pth: boom" {
		t.Errorf("prefixed twice: %q", got)
	}
	if !errors.Is(withPath("a.pth", base), base) {
		t.Error("withPath drops the wrapped error")
	}
}
