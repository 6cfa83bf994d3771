package command

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
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
