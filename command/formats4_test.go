package command

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestFormatDoors: the command line for issue 4's doors: --graph (convert
// and inspect), safetensors, a whole pickled module, revert, and verify of
// ONNX, with their exit codes.
func TestFormatDoors(t *testing.T) {
	f4 := filepath.Join("..", "fixtures", "testdata", "formats4")
	dir := t.TempDir()
	out := filepath.Join(dir, "custom_abn.safetensors")
	rep := filepath.Join(dir, "report.json")
	code, _, stderr := run("convert", "-i", filepath.Join(f4, "custom.pth"), "--graph", filepath.Join(f4, "custom.onnx"),
		"-o", out, "--report", rep, "--emit-module", filepath.Join(dir, "custom_abn.py"), "-q")
	if code != 0 {
		t.Fatalf("convert --graph: exit %d: %s", code, stderr)
	}
	back := filepath.Join(dir, "custom_bn.pth")
	code, stdout, stderr := run("revert", "-i", out, "-o", back, "--report", rep, "--json")
	if code != 0 {
		t.Fatalf("revert: exit %d: %s", code, stderr)
	}
	var res struct {
		Layers []struct {
			Module     string  `json:"module"`
			Op         string  `json:"op"`
			Eps        float64 `json:"eps"`
			Activation string  `json:"activation"`
		} `json:"layers"`
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || len(res.Layers) != 4 {
		t.Fatalf("revert --json: %v\n%s", err, stdout)
	}
	if l := res.Layers[3]; l.Module != "bn_d" || l.Eps != 1e-3 || l.Activation != "elu(1)" {
		t.Errorf("layer %+v: want bn_d, eps 0.001 from the report, elu(1)", l)
	}
	if _, err := os.Stat(back); err != nil {
		t.Fatal(err)
	}

	code, stdout, _ = run("inspect", "--graph", filepath.Join(f4, "custom.onnx"), filepath.Join(f4, "custom.pth"))
	if code != 0 || !strings.Contains(stdout, "custom (structure from custom.onnx)") {
		t.Errorf("inspect --graph: exit %d\n%s", code, stdout)
	}
	code, stdout, _ = run("inspect", filepath.Join(f4, "resnet_module.pth"))
	if code != 0 || !strings.Contains(stdout, "whole pickled module torchvision.models.resnet.ResNet") {
		t.Errorf("inspect of a module: exit %d\n%s", code, stdout)
	}

	onnxOut := filepath.Join(dir, "custom_abn.onnx")
	if code, _, stderr := run("convert", "-i", filepath.Join(f4, "custom.onnx"), "-o", onnxOut, "-q"); code != 0 {
		t.Fatalf("convert onnx: exit %d: %s", code, stderr)
	}
	code, stdout, _ = run("verify", "--original", filepath.Join(f4, "custom.onnx"), "--converted", onnxOut, "-q")
	if code != 0 || !strings.Contains(stdout, "PRESERVED") {
		t.Errorf("verify onnx: exit %d\n%s", code, stdout)
	}

	cases := []struct {
		name   string
		args   []string
		stderr string
		code   int // 0: ExitBadInput
	}{
		{"revert without output", []string{"revert", "-i", out}, "--output are required", 0},
		{"revert stray argument", []string{"revert", "-i", out, "-o", filepath.Join(dir, "x.pth"), "extra"}, "unexpected argument", 0},
		{"revert existing output", []string{"revert", "-i", out, "-o", back}, "already exists", 0},
		{"custom module", []string{"convert", "-i", filepath.Join(f4, "custom_module.pth"), "-o", filepath.Join(dir, "m.pth"), "-q"}, "--graph model.onnx", 0},
		{"graph mismatch", []string{"convert", "-i", filepath.Join("..", "fixtures", "testdata", "tiny_vgg.pth"), "--graph", filepath.Join(f4, "custom.onnx"), "-o", filepath.Join(dir, "g.pth"), "-q"}, "missing from the state dict", 0},
		{"verify opaque ops", []string{"verify", "--original", filepath.Join("..", "fixtures", "testdata", "acts", "softmax_net_op13.onnx"), "--converted", onnxOut}, "Softmax", ExitUnsupported},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want := c.code
			if want == 0 {
				want = ExitBadInput
			}
			code, _, stderr := run(c.args...)
			if code != want || !strings.Contains(stderr, c.stderr) || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
				t.Errorf("exit %d, stderr %q; want %d and one line with %q", code, stderr, want, c.stderr)
			}
		})
	}
}
