package emit

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// python is the interpreter that sees Debian's PyTorch; an earlier python3
// on PATH may lack it.
const python = "/usr/bin/python3"

// TestExecute runs every emitted module with real PyTorch and the
// inplace_abn stand-in: see testdata/check_model.py for what it checks.
// needTorch skips a test that runs PyTorch under -short or where python
// cannot import torch.
func needTorch(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("runs PyTorch")
	}
	if err := exec.Command(python, "-c", "import torch").Run(); err != nil {
		t.Skipf("%s cannot import torch: %v", python, err)
	}
}

// standinPython is python with args, the inplace_abn stand-in importable
// and no __pycache__ left in the source tree by importing it.
func standinPython(t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	standin, err := filepath.Abs(filepath.Join("..", "fixtures", "standin"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(python, args...)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+standin, "PYTHONDONTWRITEBYTECODE=1")
	return cmd
}

func TestExecute(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	type spec struct {
		Name           string            `json:"name"`
		Module         string            `json:"module"`
		Input          []int             `json:"input"`
		Keys           map[string][]int  `json:"keys"`
		Signs          map[string][]int8 `json:"signs"`
		Reference      string            `json:"reference,omitempty"`
		Twin           *spec             `json:"twin,omitempty"`
		Norms          []string          `json:"norms,omitempty"`
		ConcatChannels int               `json:"concat_channels,omitempty"`
		Torchvision    string            `json:"torchvision,omitempty"`
	}
	specs := map[string]*spec{}
	var order []*spec
	for _, c := range cases {
		b := c.build()
		src, err := Python(b.g, c.opt)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		path := filepath.Join(dir, c.name+".py")
		if err := os.WriteFile(path, src, 0o644); err != nil {
			t.Fatal(err)
		}
		size, batch := 8, 4
		if c.inputSize != 0 {
			size, batch = c.inputSize, 2
		}
		s := &spec{Name: c.name, Module: path, Input: []int{batch, b.g.Input.Channels, size, size},
			Keys: map[string][]int{}, Signs: b.signs, Reference: c.ref, Norms: c.norms,
			ConcatChannels: c.concatChannels, Torchvision: c.torchvision}
		for _, k := range b.g.ParamKeys() {
			shape, ok := b.w.Shape(k)
			if !ok {
				t.Fatalf("%s: no shape for %q", c.name, k)
			}
			s.Keys[k] = append([]int{}, shape...)
		}
		specs[c.name] = s
		order = append(order, s)
	}
	for _, c := range cases {
		if c.twin != "" {
			specs[c.name].Twin = specs[c.twin]
		}
	}
	js, err := json.MarshalIndent(order, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	list := filepath.Join(dir, "cases.json")
	if err := os.WriteFile(list, js, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := standinPython(t, filepath.Join("testdata", "check_model.py"), list).CombinedOutput()
	if err != nil {
		t.Fatalf("check_model.py: %v\n%s", err, out)
	}
	for _, c := range cases {
		if !strings.Contains(string(out), "ok "+c.name+"\n") {
			t.Errorf("check_model.py did not report case %s:\n%s", c.name, out)
		}
	}
	t.Logf("%s", out)
}
