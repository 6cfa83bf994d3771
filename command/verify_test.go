package command

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/pth"
)

// TestVerifyExitCodes is the CI contract: 0 when a conversion preserved the
// outputs, 1 when it did not, 2 on bad input.
func TestVerifyExitCodes(t *testing.T) {
	orig := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	dir := t.TempDir()
	out := filepath.Join(dir, "out.pth")
	if code, _, stderr := run("-i", orig, "-o", out, "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	code, stdout, stderr := run("verify", "--original", orig, "--converted", out, "--size", "32", "--json", "-q")
	if code != 0 {
		t.Fatalf("verify of a good conversion: exit %d\n%s%s", code, stdout, stderr)
	}
	var res struct {
		Preserved bool `json:"preserved"`
		Checks    []struct {
			Name string `json:"name"`
		} `json:"checks"`
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || !res.Preserved || len(res.Checks) < 5 {
		t.Fatalf("--json: %v %+v\n%s", err, res, stdout)
	}
	// The original itself as the "converted" file: BN weights copied
	// without the |weight| + eps reparametrisation.
	code, stdout, _ = run("verify", "--original", orig, "--converted", orig, "--size", "32", "-q")
	if code != 1 || !strings.Contains(stdout, "NOT PRESERVED") {
		t.Fatalf("verify of a naive copy: exit %d\n%s", code, stdout)
	}
	code, _, stderr = run("verify", "--original", orig, "--converted", filepath.Join(dir, "missing.pth"))
	if code != 2 || !strings.Contains(stderr, "missing.pth") {
		t.Fatalf("missing file: exit %d, %q", code, stderr)
	}
}

// verifyJSON is the part of verify's --json these tests read.
type verifyJSON struct {
	Preserved bool     `json:"preserved"`
	Failed    []string `json:"failed"`
	Skipped   []string `json:"skipped"`
	Passed    int      `json:"passed"`
	Checks    []struct {
		Name    string  `json:"name"`
		Rel     float64 `json:"rel"`
		Limit   float64 `json:"limit"`
		Noise   float64 `json:"noise"`
		Pass    bool    `json:"pass"`
		Skipped bool    `json:"skipped"`
		Reason  string  `json:"reason"`
	} `json:"checks"`
	Drift *struct {
		Rounded int `json:"rounded_gamma_channels"`
	} `json:"drift"`
}

func verifyRun(t *testing.T, args ...string) (int, verifyJSON, string) {
	t.Helper()
	code, stdout, stderr := run(append([]string{"verify", "--size", "32", "--json", "-q"}, args...)...)
	var v verifyJSON
	if err := json.Unmarshal([]byte(stdout), &v); err != nil {
		t.Fatalf("verify %v: exit %d, %v\n%s%s", args, code, err, stdout, stderr)
	}
	return code, v, stdout
}

// restated writes src's state dict as a new .pth, keys renamed by rename
// and float32 tensors stored as dtype ("" keeps them).
func restated(t *testing.T, src string, rename func(string) string, dtype pth.DType) string {
	t.Helper()
	ck, err := pth.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := filepath.Join(t.TempDir(), "restated.pth")
	nc := pth.NewStateDict(out)
	for _, k := range ck.Keys() {
		shape, _ := ck.Shape(k)
		v, err := ck.Values(k)
		if err != nil {
			t.Fatal(err)
		}
		dt := pth.DType(ck.DType(k))
		if dt == pth.Float32 && dtype != "" {
			dt = dtype
		}
		if err := nc.AddTensor(rename(k), dt, shape, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Write(out, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}

func convertTo(t *testing.T, in string, args ...string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "abn.pth")
	if code, _, stderr := run(append([]string{"-i", in, "-o", out, "-q"}, args...)...); code != 0 {
		t.Fatalf("convert %s: exit %d: %s", in, code, stderr)
	}
	return out
}

// TestVerifySkipped: checks that cannot discriminate (VGG's conv biases,
// read only by a training-mode BN: true gradient zero) are shown as skipped
// with their reason, in --json and in the text, and not counted as passed.
func TestVerifySkipped(t *testing.T) {
	orig := filepath.Join("..", "fixtures", "testdata", "tiny_vgg.pth")
	conv := convertTo(t, orig)
	code, v, _ := verifyRun(t, "--original", orig, "--converted", conv)
	if code != 0 || !v.Preserved || len(v.Skipped) != 4 {
		t.Fatalf("exit %d, preserved %v, skipped %v", code, v.Preserved, v.Skipped)
	}
	judged := 0
	for _, c := range v.Checks {
		if c.Skipped {
			if c.Pass || !strings.HasSuffix(c.Name, ".bias") || !strings.Contains(c.Reason, "true value zero") {
				t.Errorf("skipped %+v", c)
			}
			continue
		}
		judged++
		if c.Limit >= 1 {
			t.Errorf("%s judged with limit %g", c.Name, c.Limit)
		}
	}
	if judged != v.Passed {
		t.Errorf("%d checks judged, %d passed", judged, v.Passed)
	}
	code, stdout, _ := run("verify", "--original", orig, "--converted", conv, "--size", "32", "-q")
	if !verdictOK(stdout) {
		t.Errorf("no passing verdict:\n%s", stdout)
	}
	for _, want := range []string{"skip gradient features.0.bias", "which subtracts each channel's batch mean", "0 failed, 4 skipped", "4 check(s) skipped"} {
		if code != 0 || !strings.Contains(stdout, want) {
			t.Errorf("exit %d, text lacks %q:\n%s", code, want, stdout)
		}
	}
}

// TestVerifyHalfPrecision: bfloat16 and float16 checkpoints verify under
// the default policy (|gamma| - eps rounds back to |gamma| there; the
// reference takes the scales the file holds, reported as drift).
func TestVerifyHalfPrecision(t *testing.T) {
	for _, dt := range []pth.DType{pth.BFloat16, pth.Float16} {
		orig := restated(t, filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth"), func(k string) string { return k }, dt)
		conv := convertTo(t, orig)
		code, v, out := verifyRun(t, "--original", orig, "--converted", conv)
		if code != 0 || !v.Preserved || v.Drift == nil || v.Drift.Rounded == 0 {
			t.Errorf("%s: exit %d, failed %v, drift %+v\n%s", dt, code, v.Failed, v.Drift, out)
		}
	}
}

// TestVerifyKeyNames: the same weights under `module.` keys and plain keys
// give the same verdict and figures at seeds 0 to 4.
func TestVerifyKeyNames(t *testing.T) {
	orig := filepath.Join("..", "fixtures", "testdata", "tiny_resnet_basic.pth")
	prefixed := restated(t, orig, func(k string) string { return "module." + k }, "")
	conv, convPrefixed := convertTo(t, orig), convertTo(t, prefixed)
	for seed := 0; seed < 5; seed++ {
		s := []string{"--seed", fmt.Sprint(seed)}
		ca, a, _ := verifyRun(t, append(s, "--original", orig, "--converted", conv)...)
		cb, b, _ := verifyRun(t, append(s, "--original", prefixed, "--converted", convPrefixed)...)
		if ca != 0 || cb != ca || len(a.Checks) != len(b.Checks) {
			t.Fatalf("seed %d: exit %d with plain keys, %d with module. keys", seed, ca, cb)
		}
		for i := range a.Checks {
			if a.Checks[i].Rel != b.Checks[i].Rel || a.Checks[i].Limit != b.Checks[i].Limit {
				t.Errorf("seed %d: %s %g/%g, %s %g/%g", seed, a.Checks[i].Name, a.Checks[i].Rel, a.Checks[i].Limit, b.Checks[i].Name, b.Checks[i].Rel, b.Checks[i].Limit)
			}
		}
	}
}

// verdictOK: the text ends in a passing verdict, exact (PRESERVED) or
// exact apart from declared approximations (CONVERTED AS SPECIFIED).
func verdictOK(stdout string) bool {
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	last := lines[len(lines)-1]
	return strings.HasPrefix(last, "PRESERVED") || strings.HasPrefix(last, "CONVERTED AS SPECIFIED")
}
