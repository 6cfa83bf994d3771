package command

import (
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/pth"
)

// The provenance record through the command line, where users meet it:
// verify needs no flag the conversion took and refuses one that
// contradicts the file, says which flags to give for a file without a
// record, revert is exact from the record alone, inspect prints it, and
// torch loads a .pth that holds it.

func fixturePath(name string) string { return filepath.Join("..", "fixtures", "testdata", name+".pth") }

// TestVerifyWithoutFlags: a --relu abn conversion verified with no flags
// passes (before the record it failed on every gradient).
func TestVerifyWithoutFlags(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "abn.pth")
	if code, _, stderr := run("convert", "-i", fixturePath("tiny_resnext"), "-o", out, "--relu", "abn", "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	code, stdout, stderr := run("verify", "--original", fixturePath("tiny_resnext"), "--converted", out, "--size", "32", "-q")
	if code != 0 {
		t.Fatalf("verify with no flags: exit %d\n%s%s", code, stdout, stderr)
	}
	if !strings.Contains(stdout, "conversion flags from the provenance record") || !strings.Contains(stdout, "--relu abn") {
		t.Errorf("verify does not say where the flags came from:\n%s", stdout)
	}
	// A flag that contradicts the record: exit 2, both values named.
	code, stdout, stderr = run("verify", "--original", fixturePath("tiny_resnext"), "--converted", out, "--relu", "leaky", "--size", "32", "-q")
	if code != 2 || !strings.Contains(stderr, "--relu leaky") || !strings.Contains(stderr, "--relu abn") || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
		t.Errorf("contradicting --relu: exit %d, stderr %q, stdout %q", code, stderr, stdout)
	}
	code, _, stderr = run("verify", "--original", fixturePath("tiny_resnext"), "--converted", out, "--slope", "0.3", "--size", "32", "-q")
	if code != 2 || !strings.Contains(stderr, "--slope 0.3") || !strings.Contains(stderr, "--slope 0.01") {
		t.Errorf("contradicting --slope: exit %d, stderr %q", code, stderr)
	}
	// The same flag as the record: fine.
	if code, stdout, stderr := run("verify", "--original", fixturePath("tiny_resnext"), "--converted", out, "--relu", "abn", "--size", "32", "-q"); code != 0 {
		t.Errorf("agreeing --relu: exit %d\n%s%s", code, stdout, stderr)
	}
	// --verify after a conversion reads the record it just wrote.
	out2 := filepath.Join(dir, "abn2.pth")
	if code, stdout, stderr := run("convert", "-i", fixturePath("tiny_densenet"), "-o", out2, "--relu", "abn", "--verify", "-q"); code != 0 {
		t.Errorf("convert --verify: exit %d\n%s%s", code, stdout, stderr)
	}
}

// TestVerifyNoRecord: a converted file without a record (as an older
// abnconvert wrote it) is verified from the flags given, and the output
// says which flags to give; with the right ones it passes.
func TestVerifyNoRecord(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "abn.pth")
	if code, _, stderr := run("convert", "-i", fixturePath("tiny_resnext"), "-o", out, "--relu", "abn", "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	ck, err := pth.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Provenance == nil {
		t.Fatal("the conversion wrote no provenance record")
	}
	ck.Provenance = nil
	bare := filepath.Join(dir, "bare.pth")
	if err := ck.Write(bare, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	ck.Close()
	code, stdout, _ := run("verify", "--original", fixturePath("tiny_resnext"), "--converted", bare, "--size", "32", "-q")
	if code != 1 {
		t.Errorf("no record, default flags on a --relu abn conversion: exit %d, want 1", code)
	}
	for _, want := range []string{"has no provenance record", "rebuilt from --relu leaky --slope 0.01", "give them: --relu"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("the output does not say %q:\n%s", want, stdout)
		}
	}
	if code, stdout, stderr := run("verify", "--original", fixturePath("tiny_resnext"), "--converted", bare, "--relu", "abn", "--size", "32", "-q"); code != 0 {
		t.Errorf("no record, the conversion's flags given: exit %d\n%s%s", code, stdout, stderr)
	}
}

// TestRevertFromRecord: every fixture, under both policies, converted and
// reverted without --report, comes back tensor for tensor, bit-exact,
// except the channels with |gamma| < eps the record lists (scale eps, with
// their sign); DenseNet included, whose flips only the record and the
// emitted module hold. Written as .pth and as .safetensors.
func TestRevertFromRecord(t *testing.T) {
	names := []string{"tiny_resnet_basic", "tiny_resnext", "tiny_densenet", "tiny_vgg", "tiny_resnet_nested"}
	got, _ := filepath.Glob(filepath.Join("..", "fixtures", "testdata", "*.pth"))
	if len(got) != len(names) {
		t.Fatalf("fixtures %v: update the list", got)
	}
	for _, name := range names {
		for _, relu := range []string{"leaky", "abn"} {
			for _, ext := range []string{".pth", ".safetensors"} {
				if ext == ".safetensors" && name == "tiny_resnet_nested" {
					continue // it holds an optimizer state: safetensors cannot
				}
				t.Run(name+"/"+relu+ext, func(t *testing.T) {
					dir := t.TempDir()
					conv, back := filepath.Join(dir, "abn"+ext), filepath.Join(dir, "bn"+ext)
					if code, _, stderr := run("convert", "-i", fixturePath(name), "-o", conv, "--relu", relu, "-q"); code != 0 {
						t.Fatalf("convert: exit %d: %s", code, stderr)
					}
					code, stdout, stderr := run("revert", "-i", conv, "-o", back, "--json")
					if code != 0 {
						t.Fatalf("revert: exit %d: %s", code, stderr)
					}
					var rr struct {
						From     string   `json:"from"`
						Warnings []string `json:"warnings"`
					}
					if err := json.Unmarshal([]byte(stdout), &rr); err != nil {
						t.Fatal(err)
					}
					if !strings.Contains(rr.From, "provenance record") || len(rr.Warnings) != 0 {
						t.Errorf("layers from %q, warnings %q", rr.From, rr.Warnings)
					}
					cm, err := model.Open(conv)
					if err != nil {
						t.Fatal(err)
					}
					rec := cm.Provenance
					cm.Close()
					if rec == nil {
						t.Fatal("no record in the converted file")
					}
					tiny := map[string]map[int]bool{}
					for _, s := range rec.Sites {
						for _, ch := range s.TinyGammaChannels {
							k := s.Node + "." + graph.RoleWeight
							if tiny[k] == nil {
								tiny[k] = map[int]bool{}
							}
							tiny[k][ch] = true
						}
					}
					om, err := model.Open(fixturePath(name))
					if err != nil {
						t.Fatal(err)
					}
					defer om.Close()
					bm, err := model.Open(back)
					if err != nil {
						t.Fatal(err)
					}
					defer bm.Close()
					if bm.Provenance != nil {
						t.Error("the reverted file still carries a provenance record")
					}
					exact := 0
					for _, k := range om.Weights.Keys() {
						a, err := om.Weights.Values(k)
						if err != nil {
							t.Fatal(err)
						}
						b, err := bm.Weights.Values(k)
						if err != nil {
							t.Fatalf("%s: %v", k, err)
						}
						for i := range a {
							if tiny[k][i] {
								eps := rec.BNEps[strings.TrimSuffix(k, "."+graph.RoleWeight)]
								if math.Abs(b[i]) != float64(float32(eps)) || (a[i] < 0) != (b[i] < 0) && a[i] != 0 {
									t.Errorf("%s[%d]: tiny gamma %g reverted to %g, want +-eps with its sign", k, i, a[i], b[i])
								}
								continue
							}
							if math.Float64bits(a[i]) != math.Float64bits(b[i]) {
								t.Fatalf("%s[%d] = %g, the original has %g", k, i, b[i], a[i])
							}
							exact++
						}
					}
					if exact == 0 {
						t.Fatal("nothing compared")
					}
				})
			}
		}
	}
}

// TestInspectRecord: inspect prints the record of a converted file, and
// its JSON carries it; an original has none.
func TestInspectRecord(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "abn.safetensors")
	if code, _, stderr := run("convert", "-i", fixturePath("tiny_densenet"), "-o", out, "--relu", "abn", "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	code, stdout, stderr := run("inspect", out)
	if code != 0 {
		t.Fatalf("inspect: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"provenance: converted by abnconvert dev from tiny_densenet.pth", "--relu abn --slope 0.01", "structure: recogniser", "conversion would be refused: " + out + ": already converted"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("inspect does not print %q:\n%s", want, stdout)
		}
	}
	if strings.Contains(stdout, "metadata "+model.ProvenanceKey) {
		t.Error("the record is listed again as plain metadata")
	}
	code, stdout, _ = run("inspect", "--json", out)
	var ins struct {
		Provenance *model.Provenance `json:"provenance"`
	}
	if code != 0 || json.Unmarshal([]byte(stdout), &ins) != nil || ins.Provenance == nil || ins.Provenance.ReLU != "abn" || len(ins.Provenance.Sites) != 13 || len(ins.Provenance.BNEps) != 13 {
		t.Errorf("inspect --json: exit %d, provenance %+v", code, ins.Provenance)
	}
	if _, stdout, _ := run("inspect", fixturePath("tiny_densenet")); strings.Contains(stdout, "provenance:") {
		t.Errorf("an original with a record:\n%s", stdout)
	}
}

// TestTorchLoadsRecord: torch loads a converted .pth, record and all, with
// weights_only=True, with the default torch.load and with mmap=True (torch
// 2.x), to exactly what it loads from the same file without the record
// (fixtures/provenance.py): with torch 1.13 and, where the chroot is
// built, torch 2.6. A plain state dict, and a checkpoint nested with an
// optimizer state and an epoch (which torch 1.13's weights_only refuses
// for its floats, with the record or without).
func TestTorchLoadsRecord(t *testing.T) {
	repo, _ := filepath.Abs("..")
	script := filepath.Join(repo, "fixtures", "provenance.py")
	torch113 := exec.Command("/usr/bin/python3", "-c", "import torch").Run() == nil
	torch26 := false
	if root, err := exec.Command("bash", filepath.Join(repo, ".ci", "torch26.sh")).Output(); err == nil {
		_, err := os.Stat(filepath.Join(strings.TrimSpace(string(root)), ".abnconvert-stamp"))
		torch26 = err == nil
	}
	if !torch113 && !torch26 {
		t.Skip("no torch: /usr/bin/python3 lacks it and the torch 2.6 chroot is not built")
	}
	for _, name := range []string{"tiny_resnext", "tiny_resnet_nested"} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			with, without := filepath.Join(dir, "abn.pth"), filepath.Join(dir, "bare.pth")
			if code, _, stderr := run("convert", "-i", fixturePath(name), "-o", with, "-q"); code != 0 {
				t.Fatalf("convert: exit %d: %s", code, stderr)
			}
			ck, err := pth.Open(with)
			if err != nil {
				t.Fatal(err)
			}
			if ck.Provenance == nil {
				t.Fatal("no record written")
			}
			ck.Provenance = nil
			if err := ck.Write(without, pth.WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			ck.Close()
			check := func(what string, cmd *exec.Cmd, modes ...string) {
				b, err := cmd.CombinedOutput()
				if err != nil {
					t.Errorf("%s: %v\n%s", what, err, b)
				}
				t.Logf("%s", b)
				if name != "tiny_resnext" {
					return
				}
				for _, m := range modes {
					if !strings.Contains(string(b), m+": ") || !strings.Contains(string(b), "tensors equal") {
						t.Errorf("%s: no %q load compared", what, m)
					}
				}
			}
			if torch113 {
				check("torch 1.13", exec.Command("/usr/bin/python3", script, with, without), "weights_only=True", "default torch.load")
			}
			if torch26 {
				cmd := exec.Command("bash", filepath.Join(repo, ".ci", "torch26.sh"), "--run", "python3", script, with, without)
				cmd.Dir = repo
				check("torch 2.6", cmd, "weights_only=True", "default torch.load", "mmap=True, weights_only=True")
				st := filepath.Join(dir, "abn.safetensors")
				if code, _, stderr := run("convert", "-i", fixturePath(name), "-o", st, "-q"); name == "tiny_resnext" && code == 0 {
					cmd := exec.Command("bash", filepath.Join(repo, ".ci", "torch26.sh"), "--run", "python3", script, "--safetensors", st)
					cmd.Dir = repo
					if b, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(b), "record of 20 sites") {
						t.Errorf("safetensors: %v\n%s", err, b)
					} else {
						t.Logf("%s", b)
					}
				} else if name == "tiny_resnext" {
					t.Errorf("convert to safetensors: exit %d: %s", code, stderr)
				}
			}
		})
	}
}

// TestVerifyFormatsWithoutFlags: every kind of input, converted with
// non-default flags, verifies with no flags; a --graph conversion needs
// its graph again (the file does not hold it), and another graph file is
// refused with both digests.
func TestVerifyFormatsWithoutFlags(t *testing.T) {
	f4 := func(name string) string { return filepath.Join("..", "fixtures", "testdata", "formats4", name) }
	dir := t.TempDir()
	cases := []struct {
		name, in, out string
		convert       []string // extra convert flags
		verify        []string // flags verify still needs
	}{
		{"safetensors out", fixturePath("tiny_densenet"), "d.safetensors", []string{"--relu", "abn"}, nil},
		{"safetensors in", f4("tiny_resnet_basic.safetensors"), "r.pth", []string{"--relu", "leaky", "--slope", "0.2"}, nil},
		{"whole module", f4("resnet_module.pth"), "m.pth", []string{"--relu", "abn"}, nil},
		{"--graph", f4("custom.pth"), "c.pth", []string{"--graph", f4("custom.onnx"), "--slope", "0.05"}, []string{"--graph", f4("custom.onnx")}},
		{"ONNX, custom ops", filepath.Join("..", "onnx", "testdata", "tiny_dense.onnx"), "o.onnx", []string{"--relu", "abn"}, nil},
		{"ONNX, standard ops", filepath.Join("..", "onnx", "testdata", "tiny_dense.onnx"), "s.onnx", []string{"--relu", "abn", "--onnx-ops", "standard"}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(dir, c.out)
			args := append([]string{"convert", "-i", c.in, "-o", out, "-q"}, c.convert...)
			if code, _, stderr := run(args...); code != 0 {
				t.Fatalf("convert: exit %d: %s", code, stderr)
			}
			m, err := model.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			rec := m.Provenance
			m.Close()
			if rec == nil {
				t.Fatal("no provenance record in the output")
			}
			args = append([]string{"verify", "--original", c.in, "--converted", out, "--size", "32", "-q"}, c.verify...)
			code, stdout, stderr := run(args...)
			if code != 0 {
				t.Fatalf("verify: exit %d\n%s%s", code, stdout, stderr)
			}
			if !strings.Contains(stdout, "from the provenance record") {
				t.Errorf("verify:\n%s", stdout)
			}
			if c.verify == nil {
				return
			}
			code, _, stderr = run("verify", "--original", c.in, "--converted", out, "--size", "32", "-q")
			if code != 2 || !strings.Contains(stderr, "give it with --graph") || !strings.Contains(stderr, "custom.onnx") {
				t.Errorf("--graph conversion verified without it: exit %d, %q", code, stderr)
			}
			other := filepath.Join(dir, "other.onnx")
			b, _ := os.ReadFile(f4("custom.onnx"))
			os.WriteFile(other, append(b, 0), 0o644) // another file: a digest that differs
			code, _, stderr = run("verify", "--original", c.in, "--converted", out, "--graph", other, "--size", "32", "-q")
			if code != 2 || !strings.Contains(stderr, "contradicts") || !strings.Contains(stderr, rec.Structure.SHA256) {
				t.Errorf("another --graph: exit %d, %q", code, stderr)
			}
		})
	}
}

// TestConvertedTwice: a conversion's output is refused as an input (its
// BN weights are |gamma| - eps already); its revert converts again.
func TestConvertedTwice(t *testing.T) {
	dir := t.TempDir()
	for _, ext := range []string{".pth", ".safetensors"} {
		out := filepath.Join(dir, "abn"+ext)
		if code, _, stderr := run("convert", "-i", fixturePath("tiny_resnext"), "-o", out, "-q"); code != 0 {
			t.Fatalf("convert: exit %d: %s", code, stderr)
		}
		again := filepath.Join(dir, "again"+ext)
		code, _, stderr := run("convert", "-i", out, "-o", again, "-q")
		if code != 2 || !strings.Contains(stderr, "already converted") || !strings.Contains(stderr, "tiny_resnext.pth") {
			t.Errorf("%s converted twice: exit %d, %q", ext, code, stderr)
		}
		if _, err := os.Stat(again); err == nil {
			t.Error("an output was written")
		}
		back := filepath.Join(dir, "back"+ext)
		if code, _, stderr := run("revert", "-i", out, "-o", back, "-q"); code != 0 {
			t.Fatalf("revert: exit %d: %s", code, stderr)
		}
		if code, _, stderr := run("convert", "-i", back, "-o", again, "-q"); code != 0 {
			t.Errorf("converting the reverted file: exit %d: %s", code, stderr)
		}
	}
}

// TestUnreadableRecord: a record that does not parse stops verify and
// revert (exit 2, naming the file), and does not stop a conversion of the
// file, whose output carries a fresh record.
func TestUnreadableRecord(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "abn.pth")
	if code, _, stderr := run("convert", "-i", fixturePath("tiny_vgg"), "-o", out, "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	ck, err := pth.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	ck.Provenance = []byte(`{"tool": "abnconvert", "schema": 99}`)
	bad := filepath.Join(dir, "bad.pth")
	if err := ck.Write(bad, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	ck.Close()
	code, _, stderr := run("verify", "--original", fixturePath("tiny_vgg"), "--converted", bad, "-q")
	if code != 2 || !strings.Contains(stderr, "bad.pth: its provenance record is unreadable: schema 99") {
		t.Errorf("verify: exit %d, %q", code, stderr)
	}
	code, _, stderr = run("revert", "-i", bad, "-o", filepath.Join(dir, "r.pth"), "-q")
	if code != 2 || !strings.Contains(stderr, "unreadable") || !strings.Contains(stderr, "--report") {
		t.Errorf("revert: exit %d, %q", code, stderr)
	}
	again := filepath.Join(dir, "again.pth")
	if code, _, stderr := run("convert", "-i", bad, "-o", again, "-q", "--relu", "abn"); code != 0 {
		t.Fatalf("converting a file with a bad record: exit %d: %s", code, stderr)
	}
	m, err := model.Open(again)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Provenance == nil || m.Provenance.ReLU != "abn" || m.Provenance.Input.File != "bad.pth" {
		t.Errorf("record of the reconversion: %+v", m.Provenance)
	}
}

// TestRecordDeterministic: the record holds no time and no path, so two
// conversions of one input into differently named outputs, in different
// directories, are byte-identical in every output format.
func TestRecordDeterministic(t *testing.T) {
	for _, c := range []struct{ in, ext string }{
		{fixturePath("tiny_densenet"), ".pth"},
		{fixturePath("tiny_densenet"), ".safetensors"},
		{filepath.Join("..", "onnx", "testdata", "tiny_dense.onnx"), ".onnx"},
	} {
		var outs [][]byte
		for i := 0; i < 2; i++ {
			out := filepath.Join(t.TempDir(), "out"+string(rune('a'+i))+c.ext)
			if code, _, stderr := run("convert", "-i", c.in, "-o", out, "-q"); code != 0 {
				t.Fatalf("convert: exit %d: %s", code, stderr)
			}
			b, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			outs = append(outs, b)
		}
		if string(outs[0]) != string(outs[1]) {
			t.Errorf("%s: two conversions differ", c.ext)
		}
		if !strings.Contains(string(outs[0]), `"tool":"abnconvert"`) && !strings.Contains(string(outs[0]), `\"tool\":\"abnconvert\"`) {
			t.Errorf("%s: no record in the bytes", c.ext)
		}
	}
}

// TestVerifyOtherOriginal: verify warns when the original given is not the
// file the record says was converted (digested by its zip records, as
// hashing the whole checkpoint would double a conversion's time), and not
// when it is, or holds the very same records.
func TestVerifyOtherOriginal(t *testing.T) {
	dir := t.TempDir()
	in := fixturePath("tiny_resnet_basic")
	out := filepath.Join(dir, "abn.pth")
	if code, _, stderr := run("convert", "-i", in, "-o", out, "--relu", "abn", "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	// The same records under another name: the same checkpoint.
	same := filepath.Join(dir, "copy.pth")
	b, err := os.ReadFile(in)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(same, b, 0o644); err != nil {
		t.Fatal(err)
	}
	// One running mean moved: another checkpoint.
	ck, err := pth.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	v, err := ck.Values("bn1.running_mean")
	if err != nil {
		t.Fatal(err)
	}
	v[0] += 0.5
	if err := ck.SetValues("bn1.running_mean", v); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(dir, "other.pth")
	if err := ck.Write(other, pth.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	ck.Close()
	for _, tc := range []struct {
		original string
		warn     bool
	}{{in, false}, {same, false}, {other, true}} {
		_, stdout, stderr := run("verify", "--original", tc.original, "--converted", out, "--size", "32", "-q")
		if got := strings.Contains(stdout+stderr, "not the file converted"); got != tc.warn {
			t.Errorf("verify --original %s: warned %v, want %v\n%s%s", filepath.Base(tc.original), got, tc.warn, stdout, stderr)
		}
	}
}

// TestEvalExportWarning: a state dict converted along an eval-mode export
// is warned that the export lost its Dropout layers, and told how to keep
// them.
func TestEvalExportWarning(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := run("convert", "-i", "../fixtures/testdata/acts/act_net.pth", "--graph", "../fixtures/testdata/acts/act_net_op13.onnx",
		"-o", filepath.Join(dir, "a.pth"), "--relu", "abn", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res struct{ Warnings []string }
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, w := range res.Warnings {
		found = found || (strings.Contains(w, "exported in eval mode") && strings.Contains(w, "model.train()") && strings.Contains(w, "PRESERVE"))
	}
	if !found {
		t.Errorf("no eval-export warning in %q", res.Warnings)
	}
}
