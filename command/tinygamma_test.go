package command

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestTinyGammaCLI: --tiny-gamma through the command line. tiny_resnext's
// layer2.1.bn2 (BN + ReLU, in place under --relu leaky) has two channels
// with |gamma| < eps: by default the site is ABN, with its reason, the
// count and one warning; with approx it stays in place, approximated, and
// verify reports the training step's drift; a bad value is exit 2.
func TestTinyGammaCLI(t *testing.T) {
	in := fixturePath("tiny_resnext")
	dir := t.TempDir()
	type site struct {
		Node      string `json:"node"`
		Op        string `json:"op"`
		Outcome   string `json:"outcome"`
		Reason    string `json:"reason"`
		Tiny      []int  `json:"tiny_gamma_channels"`
		TinyExact []int  `json:"tiny_gamma_exact_channels"`
	}
	type report struct {
		Options struct {
			TinyGamma string `json:"tiny_gamma"`
		} `json:"options"`
		Report struct {
			Policy  string `json:"tiny_gamma_policy"`
			Summary struct {
				TinyGamma         int `json:"tiny_gamma"`
				TinyGammaFallback int `json:"tiny_gamma_fallback"`
				FallbackABN       int `json:"fallback_abn"`
			} `json:"summary"`
			Sites    []site   `json:"sites"`
			Warnings []string `json:"warnings"`
		} `json:"report"`
	}
	for _, tc := range []struct {
		args            []string // after the input and output
		policy, op      string
		outcome         string
		fellBack        int
		tiny, tinyExact []int
		table, notTable string
	}{
		{nil, "exact", "ABN", "fallback-abn", 1, nil, []int{0, 1}, "1 with tiny gamma (1 kept out of place for it)", "stored as weight 0"},
		{[]string{"--tiny-gamma", "exact"}, "exact", "ABN", "fallback-abn", 1, nil, []int{0, 1}, "tiny gamma exact", "stored as weight 0"},
		{[]string{"--tiny-gamma", "approx"}, "approx", "InPlaceABN", "approximated", 0, []int{0, 1}, nil, "stored as weight 0 (scale eps)", "kept out of place as ABN"},
	} {
		name := strings.Join(append([]string{"default"}, tc.args...), " ")
		out := filepath.Join(dir, tc.policy+".pth")
		rep := filepath.Join(dir, tc.policy+".json")
		// The root form, as the README shows it.
		code, stdout, stderr := run(append([]string{"-i", in, "-o", out, "--report", rep, "--force"}, tc.args...)...)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", name, code, stderr)
		}
		if !strings.Contains(stdout, tc.table) || strings.Contains(stdout, tc.notTable) {
			t.Errorf("%s: table wants %q, not %q:\n%s", name, tc.table, tc.notTable, stdout)
		}
		b, err := os.ReadFile(rep)
		if err != nil {
			t.Fatal(err)
		}
		var r report
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatal(err)
		}
		s := r.Report.Summary
		if r.Options.TinyGamma != tc.policy || r.Report.Policy != tc.policy || s.TinyGamma != 1 || s.TinyGammaFallback != tc.fellBack || s.FallbackABN != tc.fellBack {
			t.Errorf("%s: options %q, policy %q, summary %+v", name, r.Options.TinyGamma, r.Report.Policy, s)
		}
		warned := 0
		for _, w := range r.Report.Warnings {
			if strings.Contains(w, "--tiny-gamma approx keeps them in place") {
				warned++
			}
		}
		if warned != tc.fellBack {
			t.Errorf("%s: warnings %q", name, r.Report.Warnings)
		}
		for _, x := range r.Report.Sites {
			if x.Node != "layer2.1.bn2" {
				continue
			}
			if x.Op != tc.op || x.Outcome != tc.outcome || !slices.Equal(x.Tiny, tc.tiny) || !slices.Equal(x.TinyExact, tc.tinyExact) ||
				tc.fellBack > 0 && !strings.Contains(x.Reason, "channels [0 1] with |gamma| < eps=1e-05") {
				t.Errorf("%s: site %+v", name, x)
			}
		}
		// verify reads the policy from the record; its JSON carries the
		// training drift (the ReLU sites are leaky under either policy).
		code, stdout, stderr = run("verify", "--original", in, "--converted", out, "--size", "32", "--json", "-q")
		var v struct {
			Preserved bool   `json:"preserved"`
			FlagsFrom string `json:"flags_from"`
			Drift     *struct {
				TinyGamma int `json:"tiny_gamma_channels"`
				Train     *struct {
					Output struct {
						Rel float64 `json:"rel"`
					} `json:"output"`
					InputGradient struct {
						Rel float64 `json:"rel"`
					} `json:"input_gradient"`
					RunningStats *struct {
						Name string  `json:"name"`
						Rel  float64 `json:"rel"`
					} `json:"running_stats"`
				} `json:"train"`
			} `json:"drift"`
		}
		if err := json.Unmarshal([]byte(stdout), &v); err != nil || code != 0 || !v.Preserved || !strings.Contains(v.FlagsFrom, "--tiny-gamma "+tc.policy) {
			t.Fatalf("%s: verify exit %d (%v): %s%s", name, code, err, stdout, stderr)
		}
		if d := v.Drift; d == nil || d.TinyGamma != len(tc.tiny) || d.Train == nil || !(d.Train.Output.Rel > 0) || !(d.Train.InputGradient.Rel > 0) ||
			d.Train.RunningStats == nil || d.Train.RunningStats.Name == "" {
			t.Errorf("%s: verify drift %s", name, stdout)
		}
		code, stdout, _ = run("verify", "--original", in, "--converted", out, "--size", "32", "-q")
		if code != 0 || !strings.Contains(stdout, "training-step drift from the original: output rel") {
			t.Errorf("%s: verify text, exit %d:\n%s", name, code, stdout)
		}
		// The other policy contradicts the record.
		other := map[string]string{"exact": "approx", "approx": "exact"}[tc.policy]
		code, _, stderr = run("verify", "--original", in, "--converted", out, "--size", "32", "-q", "--tiny-gamma", other)
		if code != 2 || !strings.Contains(stderr, "--tiny-gamma "+other+" contradicts the provenance record") {
			t.Errorf("%s: verify --tiny-gamma %s: exit %d: %s", name, other, code, stderr)
		}
	}
	for _, args := range [][]string{
		{"convert", "-i", in, "-o", filepath.Join(dir, "bad.pth"), "--tiny-gamma", "maybe"},
		{"-i", in, "-o", filepath.Join(dir, "bad.pth"), "--tiny-gamma", "maybe"},
		{"verify", "--original", in, "--converted", filepath.Join(dir, "exact.pth"), "--tiny-gamma", "maybe"},
	} {
		code, _, stderr := run(args...)
		if code != 2 || !strings.Contains(stderr, `--tiny-gamma "maybe": want exact`) {
			t.Errorf("%v: exit %d: %s", args, code, stderr)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "bad.pth")); err == nil {
		t.Error("a refused conversion left its output")
	}
}
