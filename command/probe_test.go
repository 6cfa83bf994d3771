package command

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func probeFixture(name string) string {
	return filepath.Join("..", "fixtures", "testdata", "probe", name)
}

// TestProbeExitCodes: --probe on verify, convert --verify and the root
// form. The CIFAR ResNet's state dict (the stock one's keys and shapes)
// with a probe from the real model exits 1 naming the probe check and
// --graph; with --graph it exits 0; a bad probe exits 2 before anything is
// written; without a probe the verdict says it is conditional.
func TestProbeExitCodes(t *testing.T) {
	dir := t.TempDir()
	cifar, stock := probeFixture("cifar.pth"), probeFixture("stock.pth")
	cifarProbe := probeFixture("cifar.probe.pth")
	out := filepath.Join(dir, "cifar_abn.pth")

	// convert --verify --probe, structure assumed: written, then exit 1.
	code, stdout, stderr := run("convert", "-i", cifar, "-o", out, "--relu", "abn", "--verify", "--probe", cifarProbe)
	if code != ExitMismatch || !strings.Contains(stdout, "FAIL probe: eval output") ||
		!strings.Contains(stdout, "NOT PRESERVED") || !strings.Contains(stdout, "convert with --graph") {
		t.Fatalf("convert --verify --probe of the CIFAR state dict: exit %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, stderr = run("verify", "--original", cifar, "--converted", out, "--probe", cifarProbe, "--json", "-q")
	var res struct {
		Preserved   bool     `json:"preserved"`
		Failed      []string `json:"failed"`
		Structure   string   `json:"structure"`
		Conditional bool     `json:"conditional"`
		Probe       *struct {
			Pass   bool   `json:"pass"`
			Cause  string `json:"cause"`
			Checks []struct {
				Name string `json:"name"`
				Pass bool   `json:"pass"`
			} `json:"checks"`
		} `json:"probe"`
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || code != ExitMismatch || res.Preserved || res.Probe == nil ||
		res.Probe.Pass || res.Structure != "assumed" || !strings.Contains(res.Probe.Cause, "--graph") {
		t.Fatalf("verify --probe --json: exit %d, %v, %+v\n%s", code, err, res, stderr)
	}

	// The root form with --graph: the structure read, the probe passes.
	code, stdout, stderr = run("-i", cifar, "-o", out, "-f", "--relu", "abn", "--graph", probeFixture("cifar.onnx"), "--probe", cifarProbe, "-q")
	if code != 0 {
		t.Fatalf("--graph --probe (root form, --probe implies --verify): exit %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, stderr = run("verify", "--original", cifar, "--converted", out, "--graph", probeFixture("cifar.onnx"), "--probe", cifarProbe, "-q")
	if code != 0 || !strings.Contains(stdout, "ok   probe: eval output") || !strings.Contains(stdout, "what PyTorch computed on your model") {
		t.Fatalf("verify --graph --probe: exit %d\n%s%s", code, stdout, stderr)
	}

	// No probe, structure assumed: exit 0, the verdict conditional.
	sout := filepath.Join(dir, "stock_abn.pth")
	code, stdout, stderr = run("-i", stock, "-o", sout, "--relu", "abn", "--verify", "--json", "-q")
	var conv struct {
		Verify struct {
			Conditional bool   `json:"conditional"`
			Structure   string `json:"structure"`
			Assumption  string `json:"assumption"`
		} `json:"verify"`
	}
	if err := json.Unmarshal([]byte(stdout), &conv); err != nil || code != 0 || !conv.Verify.Conditional || conv.Verify.Structure != "assumed" ||
		!strings.Contains(conv.Verify.Assumption, "keys and shapes") {
		t.Fatalf("--verify without a probe: exit %d, %v, %+v\n%s", code, err, conv, stderr)
	}
	code, stdout, _ = run("verify", "--original", stock, "--converted", sout, "-q")
	if code != 0 || !strings.Contains(stdout, "PRESERVED, assuming the structure recognised from the state dict's keys and shapes") {
		t.Fatalf("verify without a probe: exit %d\n%s", code, stdout)
	}

	// A bad probe: exit 2 naming it; convert writes nothing.
	none := filepath.Join(dir, "none.pth")
	code, _, stderr = run("-i", stock, "-o", none, "--probe", stock, "-q")
	if code != ExitBadInput || !strings.Contains(stderr, stock) || !strings.Contains(stderr, "abnexport.py") {
		t.Fatalf("a state dict as the probe: exit %d, %q", code, stderr)
	}
	if _, err := os.Stat(none); !os.IsNotExist(err) {
		t.Fatalf("%s written although the probe was refused", none)
	}
	code, _, stderr = run("verify", "--original", stock, "--converted", sout, "--probe", filepath.Join(dir, "missing.probe.pth"))
	if code != ExitBadInput || !strings.Contains(stderr, "missing.probe.pth") {
		t.Fatalf("missing probe: exit %d, %q", code, stderr)
	}
}
