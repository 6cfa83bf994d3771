package command

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMemory: the JSON contract of `memory`, every input format, the
// comparison table, the plot file.
func TestMemory(t *testing.T) {
	f4 := filepath.Join("..", "fixtures", "testdata", "formats4")
	inputs := [][]string{
		{filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")},
		{filepath.Join(f4, "tiny_resnet_basic.safetensors")},
		{filepath.Join(f4, "resnet_module.pth")},
		{filepath.Join(f4, "custom.pth"), "--graph", filepath.Join(f4, "custom.onnx")},
		{filepath.Join(f4, "custom.onnx")},
		// torch's zero Pads before the transitions' AveragePool are
		// dropped for running; the dense layers get shared buffers.
		{filepath.Join("..", "onnx", "testdata", "tiny_dense.onnx")},
	}
	for _, in := range inputs {
		args := append([]string{"memory", "--batch", "4", "--size", "32", "--json", "-q"}, in...)
		code, stdout, stderr := run(args...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", in, code, stderr)
		}
		var r struct {
			Original  struct{ SavedBytes, PeakBytes int64 } `json:"original"`
			Converted struct{ SavedBytes, PeakBytes int64 } `json:"converted"`
		}
		if err := json.Unmarshal([]byte(stdout), &r); err != nil {
			t.Fatalf("%v: %v\n%s", in, err, stdout)
		}
		if !strings.Contains(stdout, `"saved_bytes"`) || !strings.Contains(stdout, `"peak_bytes"`) {
			t.Fatalf("%v: JSON lacks saved_bytes/peak_bytes:\n%s", in, stdout)
		}
		if strings.HasSuffix(in[0], "tiny_dense.onnx") && !strings.Contains(stdout, "shared DenseNet buffers") {
			t.Errorf("%v: no shared-buffer row:\n%s", in, stdout)
		}
	}
	dir := t.TempDir()
	plot := filepath.Join(dir, "cmp.svg")
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	code, stdout, stderr := run("memory", fixture, "--compare", "--no-drift", "--batch", "4", "--size", "32", "--plot", plot, "-q")
	if code != 0 {
		t.Fatalf("--compare: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"checkpointing", "bfloat16", "shared DenseNet buffers", "InPlace-ABN"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("--compare table lacks %q:\n%s", want, stdout)
		}
	}
	if b, err := os.ReadFile(plot); err != nil || !strings.Contains(string(b), "<svg") {
		t.Errorf("plot: %v", err)
	}
	if code, _, stderr := run("memory", fixture, "--budget", "lots"); code != 2 || !strings.Contains(stderr, "--budget") {
		t.Errorf("bad budget: exit %d, %q", code, stderr)
	}
}
