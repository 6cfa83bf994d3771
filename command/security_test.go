package command

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// ckptsGolden is fixtures/testdata/ckpts/ckpts.json (fixtures/ckpts.py):
// checkpoints written by torch 1.13 and torch 2.6, with what each torch's
// torch.load(weights_only=True) said of them when loaded.
type ckptsGolden map[string]struct {
	WrittenBy   string                     `json:"written_by_torch"`
	StatePath   []string                   `json:"state_path"`
	Prefix      string                     `json:"prefix"`
	Keys        []string                   `json:"keys"`
	Extra       map[string]json.RawMessage `json:"extra"`
	Entries     []string                   `json:"entries"`
	WeightsOnly map[string]struct {
		Accepted bool   `json:"accepted"`
		Opcode   int    `json:"opcode"`
		Global   string `json:"global"`
	} `json:"weights_only"`
}

var ckptsDir = filepath.Join("..", "fixtures", "testdata", "ckpts")

func readCkptsGolden(t *testing.T) ckptsGolden {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ckptsDir, "ckpts.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g ckptsGolden
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	return g
}

// opcodeNumbers maps the pickletools names inspect --security gives to
// the numbers torch's "Unsupported operand N" gives.
var opcodeNumbers = map[string]int{"FRAME": 0x95, "BINFLOAT": 'G', "SHORT_BINUNICODE": 0x8c, "MEMOIZE": 0x94, "STACK_GLOBAL": 0x93}

// TestSecurityAgainstTorch: inspect --security --json gives, for torch
// 1.13 and 2.6 separately, the verdict each real torch gave when it loaded
// the file with weights_only=True (the golden), first reason included, and
// exits 0 only when both accept. fixtures/weights_only.py check does the
// same over a wider set, live.
func TestSecurityAgainstTorch(t *testing.T) {
	for name, g := range readCkptsGolden(t) {
		t.Run(name, func(t *testing.T) {
			code, stdout, stderr := run("inspect", "--security", "--json", filepath.Join(ckptsDir, name))
			var sec Security
			if err := json.Unmarshal([]byte(stdout), &sec); err != nil {
				t.Fatalf("exit %d, %v: %s%s", code, err, stdout, stderr)
			}
			all := true
			if len(sec.Torch) != len(g.WeightsOnly) {
				t.Fatalf("%d verdicts, want %d (%+v)", len(sec.Torch), len(g.WeightsOnly), sec.Torch)
			}
			for _, v := range sec.Torch {
				want, ok := g.WeightsOnly[v.Torch]
				if !ok {
					t.Fatalf("verdict for torch %s, which the golden does not hold", v.Torch)
				}
				all = all && want.Accepted
				if v.Accepted != want.Accepted {
					t.Errorf("torch %s: accepted %v, torch said %v", v.Torch, v.Accepted, want.Accepted)
				}
				if want.Opcode != 0 && opcodeNumbers[v.Opcode] != want.Opcode {
					t.Errorf("torch %s: refused for opcode %q, torch for operand %d", v.Torch, v.Opcode, want.Opcode)
				}
				if want.Global != "" && v.Global != want.Global {
					t.Errorf("torch %s: refused for global %q, torch for %q", v.Torch, v.Global, want.Global)
				}
			}
			wantCode := 0
			if !all {
				wantCode = ExitBadInput
				if strings.Count(stderr, "\n") != 1 || !strings.Contains(stderr, "refuses it in torch") {
					t.Errorf("stderr %q: want one line saying which torch refuses it", stderr)
				}
			}
			if code != wantCode || sec.Safe != all || !sec.Pickle {
				t.Errorf("exit %d, safe %v, pickle %v; want exit %d, safe %v", code, sec.Safe, sec.Pickle, wantCode, all)
			}
		})
	}
}

// TestSecurityText: the verdict for a person names each torch release and
// the reason, and does not call a protocol-4 file unsafe code: torch 2.6
// refuses it for its form (FRAME), though every global is allowlisted.
func TestSecurityText(t *testing.T) {
	code, stdout, _ := run("inspect", "--security", filepath.Join(ckptsDir, "proto4_densenet26.pth"))
	for _, want := range []string{
		"pickle protocol 4",
		"torch 1.13 weights_only: REFUSED: opcode FRAME (Unsupported operand 149), at offset 2 of",
		"torch 2.6  weights_only: REFUSED: opcode FRAME (Unsupported operand 149)",
		"the refusal is of how the pickle is written, not of code it would run (pickle protocol 4;",
	} {
		if !strings.Contains(stdout, want) {
			t.Errorf("no %q in:\n%s", want, stdout)
		}
	}
	if code != ExitBadInput || strings.Contains(stdout, "NOT safe") {
		t.Errorf("exit %d; want 2 and no 'NOT safe':\n%s", code, stdout)
	}
	code, stdout, _ = run("inspect", "--security", filepath.Join(ckptsDir, "lightning_vgg.pth"))
	if code != ExitBadInput || !strings.Contains(stdout, "torch 1.13 weights_only: REFUSED: opcode BINFLOAT") || !strings.Contains(stdout, "torch 2.6  weights_only: accepted") {
		t.Errorf("lightning: exit %d:\n%s", code, stdout)
	}
}

// TestSecuritySafetensors: a safetensors file has no pickle; inspect
// --security says so, lists its tensors with dtype and shape, and exits 0,
// whatever the file is named.
func TestSecuritySafetensors(t *testing.T) {
	src := filepath.Join("..", "fixtures", "testdata", "formats4", "tiny_resnet_basic.safetensors")
	renamed := filepath.Join(t.TempDir(), "weights.bin")
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(renamed, b, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, file := range []string{src, renamed} {
		code, stdout, stderr := run("inspect", "--security", file)
		if code != 0 || stderr != "" || !strings.Contains(stdout, "86 tensors, no pickle") ||
			!hasFields(stdout, "F32 [8 3 7 7] conv1.weight") || !hasFields(stdout, "I64 [] bn1.num_batches_tracked") {
			t.Errorf("%s: exit %d, stderr %q:\n%s", file, code, stderr, stdout)
		}
		code, stdout, _ = run("inspect", "--security", "--json", file)
		var sec Security
		if err := json.Unmarshal([]byte(stdout), &sec); err != nil || code != 0 {
			t.Fatalf("--json: exit %d, %v", code, err)
		}
		if sec.Pickle || sec.Format != "safetensors" || len(sec.Torch) != 0 || len(sec.Tensors) != 86 ||
			sec.Tensors[0].Name == "" || sec.Metadata["format"] != "pt" {
			t.Errorf("--json: %+v", sec)
		}
	}
}

// hasFields reports whether a line of text has the space-separated fields
// of want, whatever the padding.
func hasFields(text, want string) bool {
	for _, line := range strings.Split(text, "\n") {
		if strings.Join(strings.Fields(line), " ") == want {
			return true
		}
	}
	return false
}
