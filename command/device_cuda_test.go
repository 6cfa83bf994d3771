//go:build cuda

package command

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/cuda"
	"github.com/abnconvert/abnconvert/memory"
)

// TestDeviceCUDA drives the CLI's --device cuda end to end: verify and
// memory on a GPU (or, without one, the emulated driver of make
// gpu-emulated, found through LD_LIBRARY_PATH). It skips where the driver
// cannot open a device.
func TestDeviceCUDA(t *testing.T) {
	b, err := cuda.Open()
	if err != nil {
		t.Skipf("no GPU: %v", err)
	}
	b.Close()
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	out := filepath.Join(t.TempDir(), "abn.pth")
	if code, _, stderr := run("convert", "-i", fixture, "-o", out, "--quiet"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}

	t.Run("verify", func(t *testing.T) {
		code, stdout, stderr := run("verify", "--original", fixture, "--converted", out, "--device", "cuda", "--quiet", "--json")
		if code != 0 {
			t.Fatalf("exit %d: %s%s", code, stdout, stderr)
		}
		var r struct {
			Preserved bool   `json:"preserved"`
			Device    string `json:"device"`
		}
		if err := json.Unmarshal([]byte(stdout), &r); err != nil {
			t.Fatalf("%v: %s", err, stdout)
		}
		if !r.Preserved || r.Device != "cuda" {
			t.Fatalf("preserved %v on %q: %s", r.Preserved, r.Device, stdout)
		}
	})

	t.Run("memory", func(t *testing.T) {
		var res [2]memory.Result
		for i, dev := range []string{"cpu", "cuda"} {
			code, stdout, stderr := run("memory", fixture, "--batch", "2", "--size", "32", "--device", dev, "--quiet", "--json")
			if code != 0 {
				t.Fatalf("--device %s: exit %d: %s", dev, code, stderr)
			}
			if err := json.Unmarshal([]byte(stdout), &res[i]); err != nil {
				t.Fatalf("--device %s: %v", dev, err)
			}
		}
		cpu, gpu := res[0], res[1]
		if gpu.Backend != "cuda" {
			t.Errorf("backend %q, want cuda", gpu.Backend)
		}
		// The CUDA allocator's count is the runtime's figure: equal to
		// the shape-only measurement, byte for byte.
		for i := range cpu.Techniques {
			if cpu.Techniques[i] != gpu.Techniques[i] {
				t.Errorf("%s: cpu %+v, cuda %+v", cpu.Techniques[i].Name, cpu.Techniques[i], gpu.Techniques[i])
			}
		}
		for _, f := range []memory.Figures{gpu.Original, gpu.Converted} {
			if f.Device == nil || !f.Device.Consistent || f.Device.LiveBytes < f.SavedBytes+f.ParamBytes {
				t.Errorf("device check %+v (saved %d, parameters %d)", f.Device, f.SavedBytes, f.ParamBytes)
			}
		}
		code, stdout, _ := run("memory", fixture, "--batch", "2", "--size", "32", "--device", "cuda", "--quiet")
		if code != 0 || !strings.Contains(stdout, "device, converted: after the forward") || !strings.Contains(stdout, "consistent") {
			t.Errorf("exit %d:\n%s", code, stdout)
		}
	})

	t.Run("compare refused", func(t *testing.T) {
		code, _, stderr := run("memory", fixture, "--compare", "--device", "cuda")
		if code != 2 || !strings.Contains(stderr, "--compare --device cuda") {
			t.Errorf("exit %d: %q", code, stderr)
		}
	})
}
