//go:build !cuda

package command

import (
	"path/filepath"
	"strings"
	"testing"
)

// A binary built without the cuda tag answers --device cuda with one line
// that says how to build with CUDA, and exit 2.
func TestDeviceCUDAWithoutTag(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_vgg.pth")
	for _, args := range [][]string{
		{"verify", "--original", fixture, "--converted", fixture, "--device", "cuda"},
		{"memory", fixture, "--device", "cuda"},
	} {
		code, _, stderr := run(args...)
		if code != 2 || !strings.Contains(stderr, "make cuda") || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
			t.Errorf("%v: exit %d, %q", args, code, stderr)
		}
	}
}
