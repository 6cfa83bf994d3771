package runtime_test

// Faults that only a training step shows, put into the runtime's ABN-family
// layers (the converted side only: the reference runs BatchNorm2d), must
// make `abnconvert verify` exit 1; the same fixtures verify without them
// (verify's TestPreserved, at seeds 0 to 4). These tests live here because
// only the runtime's own test binary can set the fault (export_test.go).

import (
	"bytes"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/command"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/runtime"
)

type verdict struct {
	Preserved bool     `json:"preserved"`
	Failed    []string `json:"failed"`
	Checks    []struct {
		Name    string  `json:"name"`
		Rel     float64 `json:"rel"`
		Limit   float64 `json:"limit"`
		Pass    bool    `json:"pass"`
		Skipped bool    `json:"skipped"`
	} `json:"checks"`
}

func cli(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := command.Main(append([]string{"abnconvert"}, args...), &out, &errb)
	return code, out.String() + errb.String()
}

func convertFixture(t *testing.T, orig, relu string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "abn.pth")
	if code, msg := cli(t, "-i", orig, "-o", out, "--relu", relu, "-q"); code != 0 {
		t.Fatalf("convert %s: exit %d: %s", orig, code, msg)
	}
	return out
}

// verifyCLI runs `abnconvert verify --json` and decodes the result.
func verifyCLI(t *testing.T, orig, conv, relu string, seed int) (int, verdict) {
	t.Helper()
	code, out := cli(t, "verify", "--original", orig, "--converted", conv, "--relu", relu,
		"--size", "32", "--seed", fmt.Sprint(seed), "--json", "-q")
	var v verdict
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("verify: exit %d, %v:\n%s", code, err, out)
	}
	return code, v
}

// worst is the failed check furthest over its limit, for the log.
func worst(v verdict) string {
	best, ratio := "", 0.0
	for _, c := range v.Checks {
		if !c.Pass && !c.Skipped && c.Limit > 0 && c.Rel/c.Limit > ratio {
			best, ratio = fmt.Sprintf("%s rel %.2e limit %.2e (x%.0f)", c.Name, c.Rel, c.Limit, c.Rel/c.Limit), c.Rel/c.Limit
		}
	}
	return best
}

var faults = []struct {
	name  string
	fault runtime.Fault
	// inPlaceOnly: the fault is in InPlace-ABN's backward, which --relu abn
	// uses only at identity sites (VGG and DenseNet then have none).
	inPlaceOnly bool
	want        string // a prefix of the checks that must fail
}{
	{"InPlace-ABN weight gradient x1.01", runtime.Fault{ABNWeightGrad: 1.01}, true, "gradient "},
	{"running variance update off by 1%", runtime.Fault{RunningVar: 1.01}, false, "running "},
	{"momentum 0.101 instead of 0.1", runtime.Fault{Momentum: 0.101}, false, "running "},
	{"momentum 0.9 (Keras' convention)", runtime.Fault{Momentum: 0.9}, false, "running "},
}

// TestVerifyCatchesTrainingFaults: every fault, on every fixture and policy
// it applies to, through the command line: exit 1 with a training check
// failed, while the eval outputs (before the training step) still pass.
func TestVerifyCatchesTrainingFaults(t *testing.T) {
	type job struct{ name, relu string }
	var jobs []job
	for _, n := range []string{"tiny_resnet_basic", "tiny_resnext", "tiny_densenet", "tiny_vgg", "tiny_resnet_nested"} {
		for _, relu := range []string{"leaky", "abn"} {
			jobs = append(jobs, job{n, relu})
		}
	}
	conv := map[job]string{}
	for _, j := range jobs {
		conv[j] = convertFixture(t, filepath.Join("..", "fixtures", "testdata", j.name+".pth"), j.relu)
	}
	for _, f := range faults {
		t.Run(f.name, func(t *testing.T) {
			for _, j := range jobs {
				if f.inPlaceOnly && j.relu == "abn" && (j.name == "tiny_vgg" || j.name == "tiny_densenet") {
					continue
				}
				orig := filepath.Join("..", "fixtures", "testdata", j.name+".pth")
				restore := runtime.SetFault(f.fault)
				code, v := verifyCLI(t, orig, conv[j], j.relu, 0)
				restore()
				if code != 1 || v.Preserved {
					t.Errorf("%s --relu %s: exit %d, preserved %v", j.name, j.relu, code, v.Preserved)
					continue
				}
				found := false
				for _, name := range v.Failed {
					if name == "eval output" {
						t.Errorf("%s --relu %s: a training-only fault failed the eval output", j.name, j.relu)
					}
					found = found || strings.HasPrefix(name, f.want)
				}
				if !found {
					t.Errorf("%s --relu %s: failed %v, none %q", j.name, j.relu, v.Failed, f.want)
				}
				t.Logf("%s --relu %s: %d failed, worst %s", j.name, j.relu, len(v.Failed), worst(v))
			}
		})
	}
}

// TestFaultsAtEverySeed: the faults are caught at seeds 0 to 4 (tiny_resnext,
// --relu leaky), and on a bfloat16 checkpoint of it (seed 0), whose limits
// are float32's (verify models what half precision does to BN scales).
func TestFaultsAtEverySeed(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: seed 0 only, in TestVerifyCatchesTrainingFaults")
	}
	orig := filepath.Join("..", "fixtures", "testdata", "tiny_resnext.pth")
	bf16 := toBFloat16(t, orig)
	for _, in := range []string{orig, bf16} {
		conv := convertFixture(t, in, "leaky")
		if code, v := verifyCLI(t, in, conv, "leaky", 0); code != 0 {
			t.Fatalf("%s without a fault: exit %d, failed %v", in, code, v.Failed)
		}
		last := 4
		if in == bf16 {
			last = 0
		}
		for _, f := range faults {
			for seed := 0; seed <= last; seed++ {
				restore := runtime.SetFault(f.fault)
				code, v := verifyCLI(t, in, conv, "leaky", seed)
				restore()
				if code != 1 {
					t.Errorf("%s, %s, seed %d: exit %d", filepath.Base(in), f.name, seed, code)
				} else if seed == 0 {
					t.Logf("%s, %s: %d failed, worst %s", filepath.Base(in), f.name, len(v.Failed), worst(v))
				}
			}
		}
	}
}

// toBFloat16 writes a copy of a fixture with every float32 tensor stored as
// bfloat16.
func toBFloat16(t *testing.T, src string) string {
	t.Helper()
	ck, err := pth.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := filepath.Join(t.TempDir(), "bf16.pth")
	nc := pth.NewStateDict(out)
	for _, k := range ck.Keys() {
		shape, _ := ck.Shape(k)
		v, err := ck.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		dt := pth.DType(ck.DType(k))
		if dt == pth.Float32 {
			dt = pth.BFloat16
		}
		if err := nc.AddTensor(k, dt, shape, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Write(out, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}
