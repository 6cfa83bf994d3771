package command

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestVerdictSaysWhatWasPreserved: a default conversion (--relu leaky)
// changes outputs by design, and its verdict says so in the verdict's line
// (how many sites, which activation, how far eval and a training step
// moved), in the text and in --json (exact false, approximations,
// verdict); an exact one (--relu abn) says none of that. Both exit 0.
func TestVerdictSaysWhatWasPreserved(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	dir := t.TempDir()
	for _, c := range []struct {
		relu  string
		exact bool
	}{{"leaky", false}, {"abn", true}} {
		out := filepath.Join(dir, c.relu+".pth")
		code, stdout, stderr := run("-i", fixture, "-o", out, "--relu", c.relu, "--verify")
		if code != 0 {
			t.Fatalf("--relu %s: exit %d: %s", c.relu, code, stderr)
		}
		lines := strings.Split(strings.TrimSpace(stdout), "\n")
		last := lines[len(lines)-1]
		approx := strings.Contains(last, "outputs changed on purpose by the declared approximations")
		head := "PRESERVED"
		if !c.exact {
			head = "CONVERTED AS SPECIFIED" // the first words say the outputs changed (issue 42)
		}
		if !strings.HasPrefix(last, head) || approx == c.exact {
			t.Errorf("--relu %s: verdict %q", c.relu, last)
		}
		if !c.exact && !regexp.MustCompile(`\(12 ReLU site\(s\) now leaky_relu\(0\.01\) .*eval outputs move by max abs [0-9.e-]+ .*a training step's outputs by rel`).MatchString(last) {
			t.Errorf("--relu leaky: the verdict does not say what moved and how far: %q", last)
		}
		code, stdout, stderr = run("verify", "--original", fixture, "--converted", out, "--json", "-q")
		if code != 0 {
			t.Fatalf("verify --relu %s: exit %d: %s", c.relu, code, stderr)
		}
		var res struct {
			Exact          *bool  `json:"exact"`
			Approximations string `json:"approximations"`
			Verdict        string `json:"verdict"`
			Drift          *struct {
				Top1 *float64 `json:"top1_agreement"`
			} `json:"drift"`
		}
		if err := json.Unmarshal([]byte(stdout), &res); err != nil {
			t.Fatal(err)
		}
		if res.Exact == nil || *res.Exact != c.exact || (res.Approximations == "") != c.exact || res.Verdict != last {
			t.Errorf("--relu %s: JSON exact %v, approximations %q, verdict %q (text %q)", c.relu, res.Exact, res.Approximations, res.Verdict, last)
		}
		if !c.exact && (res.Drift == nil || res.Drift.Top1 == nil) {
			t.Errorf("--relu leaky: no top-1 agreement for a classifier's 2-D output: %s", stdout)
		}
	}
}

// TestInspectSummaryAgreesWithTable: the summary counts sites by outcome
// (one a site) and, on a line of its own, the channels the table's NEG,
// FOLDED, FLIPPED and TINY columns count: their totals are the columns'
// sums (a DenseNet under --relu leaky read "0 sign-folded, 0 sign-flipped"
// above non-zero FOLDED and FLIPPED columns).
func TestInspectSummaryAgreesWithTable(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	code, stdout, stderr := run("inspect", fixture)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	m := regexp.MustCompile(`channels \(the table's NEG, FOLDED, FLIPPED, TINY columns\), whatever the site's outcome: (\d+) negative, (\d+) sign-folded in (\d+) sites, (\d+) sign-flipped in (\d+) sites, (\d+) with tiny gamma`).FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("no channel summary:\n%s", stdout)
	}
	want := make([]int, 6)
	for i := range want {
		want[i], _ = strconv.Atoi(m[i+1])
	}
	// Sum the table's columns: NODE ACTIVATION OP OUTCOME NEG FOLDED FLIPPED TINY ...
	got := make([]int, 6)
	rows := 0
	inTable := false
	for _, line := range strings.Split(stdout, "\n") {
		cols := regexp.MustCompile(`\s{2,}`).Split(strings.TrimSpace(line), -1)
		if len(cols) > 0 && cols[0] == "NODE" {
			inTable = true
			continue
		}
		if !inTable || len(cols) < 8 {
			inTable = inTable && line != ""
			continue
		}
		rows++
		n := func(s string) int { v, _ := strconv.Atoi(s); return v } // "-" is 0
		got[0] += n(cols[4])
		got[1] += n(cols[5])
		got[3] += n(cols[6])
		got[5] += n(cols[7])
		if n(cols[5]) > 0 {
			got[2]++
		}
		if n(cols[6]) > 0 {
			got[4]++
		}
	}
	if rows != 13 {
		t.Fatalf("read %d table rows, want 13:\n%s", rows, stdout)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("summary %v, table's columns %v", want, got)
			break
		}
	}
	if got[1] == 0 || got[3] == 0 {
		t.Errorf("the fixture no longer folds and flips channels (folded %d, flipped %d): the test checks nothing", got[1], got[3])
	}
}

// TestGraphMessages: a --graph conversion refused names the cause and the
// next step, with the exit code of its class and nothing written, on the
// committed exports of fixtures/messages.py (real torch 1.13): a tensor
// the graph reads through ops the IR does not model is not "not in the
// graph" (exit 4, the op and node); a module called twice and a
// BatchNorm2d(affine=False) are named as such, not as parameters "not
// named after a module (export with do_constant_folding=False)", which
// the export did use, or as a broken name index; FrozenBatchNorm2d is
// "frozen: nothing to convert", not an eval-mode export; a network
// without BatchNorm is "nothing to convert" (exit 2). A state dict alone
// that no family matches names the three ways to give its structure.
func TestGraphMessages(t *testing.T) {
	dir := filepath.Join("..", "fixtures", "testdata", "messages")
	out := t.TempDir()
	cases := []struct {
		name string
		code int
		want []string
	}{
		{"shared_bn", 4, []string{"called more than once", "bn (BatchNorm2d again at node /bn_1/BatchNormalization", "give each call its own module"}},
		{"shared_conv", 4, []string{"called more than once", "conv (nodes ", "give each call its own module"}},
		{"no_affine", 4, []string{"BatchNorm2d(affine=False)", "bn (node /bn/BatchNormalization: weight and bias are the constants"}},
		{"frozen", 2, []string{"nothing to convert: no BatchNorm", "FrozenBatchNorm2d (frozen: nothing to convert", ": bn, bn2."}},
		{"frozen_mix", 4, []string{"2 FrozenBatchNorm2d layer(s) (frozen: nothing to convert): frozen.bn, frozen.bn2", "Sqrt x1"}},
		{"gn_beside", 4, []string{"read by ops abnconvert does not model", "gn.weight, gn.bias are read by Mul (/gn/Mul), Add (/gn/Add), beside unsupported ops: InstanceNormalization x1 (first /gn/InstanceNormalization"}},
		{"convnext_like", 2, []string{"nothing to convert: no BatchNorm", "not an eval-mode export"}},
		{"gn_net", 2, []string{"nothing to convert: no BatchNorm", "InstanceNormalization x1, GroupNorm"}},
		{"nf_like", 2, []string{"nothing to convert: no BatchNorm"}},
		{"vit_like", 2, []string{"nothing to convert: no BatchNorm"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := filepath.Join(out, c.name+".pth")
			code, _, stderr := run("convert", "-i", filepath.Join(dir, c.name+".pth"), "--graph", filepath.Join(dir, c.name+".onnx"),
				"-o", o, "--emit-module", filepath.Join(out, c.name+".py"), "-q")
			lines := strings.Split(strings.TrimSpace(stderr), "\n")
			last := lines[len(lines)-1]
			if code != c.code {
				t.Errorf("exit %d, want %d: %s", code, c.code, last)
			}
			for _, w := range c.want {
				if !strings.Contains(last, w) {
					t.Errorf("the error does not say %q:\n%s", w, last)
				}
			}
			for _, bad := range []string{"missing from the name index", "looks like an eval-mode export", "do_constant_folding=False so that", "are not in the graph"} {
				if strings.Contains(last, bad) {
					t.Errorf("the error still says %q:\n%s", bad, last)
				}
			}
			if _, err := os.Stat(o); err == nil {
				t.Errorf("%s written", o)
			}
		})
	}
	// An ONNX input without BatchNorm is not copied as if converted.
	o := filepath.Join(out, "nf.onnx")
	if code, _, stderr := run("convert", "-i", filepath.Join(dir, "nf_like.onnx"), "-o", o, "-q"); code != 2 || !strings.Contains(stderr, "nothing to convert") {
		t.Errorf("ONNX input without BN: exit %d: %s", code, stderr)
	}
	code, _, stderr := run("convert", "-i", filepath.Join(dir, "shared_bn.pth"), "-o", filepath.Join(out, "sd.pth"), "-q")
	for _, w := range []string{"unrecognised layout", "(1) --graph net.onnx", "dynamic_axes=", "(2) the whole pickled module", "torch.save(model)", "(3) python3 python/abnexport.py", "--probe net.probe.pth"} {
		if code != 2 || !strings.Contains(stderr, w) {
			t.Errorf("state dict of no family: exit %d, the error does not say %q: %s", code, w, stderr)
		}
	}
}

// TestFixedShapeWarning: an export made without dynamic axes, whose
// reshapes torch wrote with the export's batch size, converts with a
// warning naming the input's fixed shape, the reshapes and the
// dynamic-axes recipe, in the text and in --json, and an emitted module
// whose constant reshapes raise an error naming the export's input shape;
// the README's export (dynamic axes) gets none of it.
func TestFixedShapeWarning(t *testing.T) {
	dir := filepath.Join("..", "fixtures", "testdata", "messages")
	out := t.TempDir()
	code, stdout, stderr := run("convert", "-i", filepath.Join(dir, "fixed.pth"), "--graph", filepath.Join(dir, "fixed.onnx"),
		"-o", filepath.Join(out, "f.pth"), "--relu", "abn", "--json", "--emit-module", filepath.Join(out, "f.py"))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res struct {
		Warnings []string `json:"warnings"`
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, w := range res.Warnings {
		if strings.Contains(w, "exported without dynamic axes: its input is fixed at [2, 3, 8, 8]") &&
			strings.Contains(w, "to [2, 2, 4, 8, 8]") && strings.Contains(w, `dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}}`) {
			found = true
		}
	}
	if !found {
		t.Errorf("no fixed-shape warning: %q", res.Warnings)
	}
	// The emitted module's constant reshapes check the batch size and the
	// element count, and say why they fail (fixtures/messages.py runs it).
	py, err := os.ReadFile(filepath.Join(out, "f.py"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(py), `.shape[0] == 2 and `); n != 2 || !strings.Contains(string(py), "without dynamic axes, at input shape (2, 3, 8, 8)") {
		t.Errorf("%d guarded reshapes, want 2:\n%s", n, py)
	}
	// verify runs such an export at its own shape: told so at another
	// (not a reshape error deep in the runtime), at it when none is given.
	orig, conv, graphFile := filepath.Join(dir, "fixed.pth"), filepath.Join(out, "f.pth"), filepath.Join(dir, "fixed.onnx")
	code, _, stderr = run("verify", "--original", orig, "--converted", conv, "--graph", graphFile, "--size", "16", "-q")
	if code != 2 || !strings.Contains(stderr, "exported without dynamic axes and runs only at its input shape [2 3 8 8], not [2 3 16 16]: verify with --batch 2 --size 8") {
		t.Errorf("verify at another shape: exit %d: %s", code, stderr)
	}
	if code, stdout, stderr = run("verify", "--original", orig, "--converted", conv, "--graph", graphFile, "--batch", "2", "--size", "8", "-q"); code != 0 {
		t.Errorf("verify at the export's shape: exit %d: %s%s", code, stdout, stderr)
	}
	if code, stdout, stderr = run("-i", orig, "--graph", graphFile, "-o", filepath.Join(out, "f2.pth"), "--relu", "abn", "--verify", "-q"); code != 0 {
		t.Errorf("convert --verify: exit %d: %s%s", code, stdout, stderr)
	}
	code, stdout, stderr = run("convert", "-i", filepath.Join(dir, "dropout2d.pth"), "--graph", filepath.Join(dir, "dropout2d.onnx"),
		"-o", filepath.Join(out, "d.pth"), "--relu", "abn", "--emit-module", filepath.Join(out, "d.py"))
	py, _ = os.ReadFile(filepath.Join(out, "d.py"))
	if code != 0 || strings.Contains(stdout+stderr+string(py), "without dynamic axes") {
		t.Errorf("an export with dynamic axes: exit %d, %s", code, stdout+stderr)
	}
}

// TestSegmentationAgreement: a segmentation network's 4-D output gets a
// per-pixel agreement (argmax over its channels), not a top-1 over the
// flattened map, which read 0% at cosine 1.000000; in --json
// pixel_agreement, and no top1_agreement.
func TestSegmentationAgreement(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "structure", "fcn_module.pth")
	out := filepath.Join(t.TempDir(), "fcn.pth")
	code, stdout, stderr := run("-i", fixture, "-o", out, "--verify")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	m := regexp.MustCompile(`drift from the original .*cosine ([0-9.]+), per-pixel agreement ([0-9.]+)% \(argmax over channels\)`).FindStringSubmatch(stdout)
	if m == nil || strings.Contains(stdout, "top-1 agreement") {
		t.Fatalf("no per-pixel agreement on the drift line:\n%s", stdout)
	}
	if cos, _ := strconv.ParseFloat(m[1], 64); cos > 0.9999 && m[2] != "100.00" {
		t.Errorf("cosine %s with per-pixel agreement %s%%", m[1], m[2])
	}
	code, stdout, stderr = run("verify", "--original", fixture, "--converted", out, "--json", "-q")
	if code != 0 {
		t.Fatalf("verify: exit %d: %s", code, stderr)
	}
	var res struct {
		Drift struct {
			Top1  *float64 `json:"top1_agreement"`
			Pixel *float64 `json:"pixel_agreement"`
		} `json:"drift"`
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatal(err)
	}
	if res.Drift.Top1 != nil || res.Drift.Pixel == nil || *res.Drift.Pixel != 1 {
		t.Errorf("JSON drift: top1 %v, pixel %v; want none and 1", res.Drift.Top1, res.Drift.Pixel)
	}
}
