package command

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/safetensors"
)

// TestTrainingCheckpoints: checkpoints as training tools write them, made
// by real torch 1.13 and 2.6 (fixtures/ckpts.py: AveragedModel EMA with
// n_averaged, torch.compile's _orig_mod., Lightning's {"state_dict":
// {"model.": ...}, optimizer, loops, ...}, protocol 4 and 5 pickles, zip
// and legacy), through the CLI: convert, inspect --security of the output,
// verify, revert with the report. The output and the reverted file keep
// the input's layout: the same keys in the same order under the same
// path, every entry besides the state dict, n_averaged unchanged; the
// reverted tensors are the original's (but for the |gamma| < eps channels
// the report names, which come back as +-eps); both load with
// torch.load(weights_only=True) in torch 1.13 and 2.6 (inspect --security
// exit 0), even when the input does not (protocol 4, floats).
func TestTrainingCheckpoints(t *testing.T) {
	golden := readCkptsGolden(t)
	if len(golden) != 7 {
		t.Fatalf("%d fixtures in ckpts.json, want 7", len(golden))
	}
	for name, g := range golden {
		t.Run(name, func(t *testing.T) {
			in := filepath.Join(ckptsDir, name)
			dir := t.TempDir()
			out, rep, back := filepath.Join(dir, "abn.pth"), filepath.Join(dir, "report.json"), filepath.Join(dir, "bn.pth")
			if code, _, stderr := run("convert", "-i", in, "-o", out, "--report", rep, "-q"); code != 0 {
				t.Fatalf("convert: exit %d: %s", code, stderr)
			}
			// Accepted by both, but for what the data itself holds: torch
			// 1.13 has no opcode for a Python float (Lightning's lr), so
			// it refuses any file that keeps one.
			_, stdout, _ := run("inspect", "--security", "--json", out)
			var sec Security
			if err := json.Unmarshal([]byte(stdout), &sec); err != nil || len(sec.Torch) != 2 {
				t.Fatalf("inspect --security --json of the output: %v\n%s", err, stdout)
			}
			for _, v := range sec.Torch {
				if !v.Accepted && (v.Torch != "1.13" || v.Opcode != "BINFLOAT") {
					t.Errorf("output refused by torch %s: %s", v.Torch, v.Reason)
				}
			}
			if code, stdout, stderr := run("verify", "--original", in, "--converted", out, "-q"); code != 0 || !verdictOK(stdout) {
				t.Errorf("verify: exit %d: %s\n%s", code, stderr, stdout)
			}
			if code, _, stderr := run("revert", "-i", out, "-o", back, "--report", rep, "-q"); code != 0 {
				t.Fatalf("revert: exit %d: %s", code, stderr)
			}
			tiny := tinyGammas(t, rep)
			orig := openCkpt(t, in)
			for _, f := range []string{out, back} {
				got := openCkpt(t, f)
				if err := sameLayout(g.StatePath, g.Prefix, g.Keys, g.Entries, orig, got); err != nil {
					t.Errorf("%s: %v", filepath.Base(f), err)
				}
				for k, raw := range g.Extra {
					var want struct {
						Tensor int64 `json:"tensor"`
					}
					json.Unmarshal(raw, &want)
					v, err := got.Values(k)
					if err != nil || len(v) != 1 || int64(v[0]) != want.Tensor || got.DType(k) != "int64" {
						t.Errorf("%s: %s = %v (%s, %v), want %d as torch wrote it", filepath.Base(f), k, v, got.DType(k), err, want.Tensor)
					}
				}
			}
			got := openCkpt(t, back)
			for _, k := range orig.Keys() {
				a, b := ckptValues(t, orig, k), ckptValues(t, got, k)
				for i := range a {
					if tiny[k][i] {
						continue
					}
					if a[i] != b[i] {
						t.Fatalf("reverted %s[%d] = %g, the original has %g", k, i, b[i], a[i])
					}
				}
			}
		})
	}
}

// TestAveragedModelSafetensors: an EMA checkpoint converted to
// safetensors keeps n_averaged too (safetensors holds tensors only, and
// n_averaged is one); inspect names it apart from the 74 weights.
func TestAveragedModelSafetensors(t *testing.T) {
	out := filepath.Join(t.TempDir(), "ema_abn.safetensors")
	if code, _, stderr := run("convert", "-i", filepath.Join(ckptsDir, "ema_resnet.pth"), "-o", out, "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	f, err := safetensors.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	v, err := f.Values("n_averaged")
	if shape, _ := f.Shape("n_averaged"); err != nil || len(v) != 1 || v[0] != 2 || len(shape) != 0 || f.DType("n_averaged") != "I64" {
		t.Errorf("n_averaged: %v %v %s %v; want 2, I64, shape []", v, shape, f.DType("n_averaged"), err)
	}
	if len(f.Keys()) != 75 {
		t.Errorf("%d tensors, want the input's 75", len(f.Keys()))
	}
	code, stdout, _ := run("inspect", filepath.Join(ckptsDir, "ema_resnet.pth"))
	if code != 0 || !strings.Contains(stdout, "other entries (kept on output): n_averaged (AveragedModel's count, not a weight)") ||
		!strings.Contains(stdout, "74 tensors") {
		t.Errorf("inspect: exit %d:\n%s", code, stdout)
	}
}

func openCkpt(t *testing.T, path string) *pth.Checkpoint {
	t.Helper()
	ck, err := pth.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	return ck
}

func ckptValues(t *testing.T, ck *pth.Checkpoint, key string) []float64 {
	t.Helper()
	v, err := ck.Values(key)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// tinyGammas reads the channels a conversion report names as |gamma| <
// eps, by state-dict key.
func tinyGammas(t *testing.T, report string) map[string]map[int]bool {
	t.Helper()
	b, err := os.ReadFile(report)
	if err != nil {
		t.Fatal(err)
	}
	var r struct {
		Report struct {
			Sites []struct {
				Node string `json:"node"`
				Tiny []int  `json:"tiny_gamma_channels"`
			} `json:"sites"`
		} `json:"report"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	out := map[string]map[int]bool{}
	for _, s := range r.Report.Sites {
		for _, ch := range s.Tiny {
			if out[s.Node+".weight"] == nil {
				out[s.Node+".weight"] = map[int]bool{}
			}
			out[s.Node+".weight"][ch] = true
		}
	}
	return out
}

// sameLayout compares a written checkpoint with torch's golden and its
// input: state-dict path, key prefix, every state-dict key in torch's
// order, and the entries beside the state dict.
func sameLayout(path []string, prefix string, keys, entries []string, orig, got *pth.Checkpoint) error {
	if strings.Join(got.StatePath, ".") != strings.Join(path, ".") || got.Prefix != prefix {
		return fmt.Errorf("state dict at %q prefix %q, want %q and %q", got.StatePath, got.Prefix, path, prefix)
	}
	var all []string
	sd := got.StateDict()
	for i := 0; i < sd.Len(); i++ {
		k, _ := sd.Entry(i)
		all = append(all, fmt.Sprint(k))
	}
	if strings.Join(all, ",") != strings.Join(keys, ",") {
		return fmt.Errorf("state dict keys %v, torch wrote %v", all, keys)
	}
	if len(entries) > 0 {
		root, ok := got.Root.(*pth.Dict)
		if !ok {
			return fmt.Errorf("root is not a dict")
		}
		var have []string
		for i := 0; i < root.Len(); i++ {
			k, _ := root.Entry(i)
			if s := fmt.Sprint(k); s != path[0] {
				have = append(have, s)
			}
		}
		if strings.Join(have, ",") != strings.Join(entries, ",") {
			return fmt.Errorf("entries %v beside the state dict, torch wrote %v", have, entries)
		}
	}
	if len(got.Keys()) != len(orig.Keys()) || strings.Join(got.Carried, ",") != strings.Join(orig.Carried, ",") {
		return fmt.Errorf("%d weights, carried %v; the input has %d, %v", len(got.Keys()), got.Carried, len(orig.Keys()), orig.Carried)
	}
	return nil
}
