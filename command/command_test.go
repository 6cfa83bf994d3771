package command

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func run(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := Main(append([]string{"abnconvert"}, args...), &out, &errb)
	return code, out.String(), errb.String()
}

func TestExitCodes(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_resnet_basic.pth")
	dir := t.TempDir()
	cases := []struct {
		name    string
		args    []string
		code    int
		stderr  string // substring of the one error line
		noFiles bool
	}{
		{"help", []string{"--help"}, 0, "", true},
		{"no arguments shows help", nil, 0, "", true},
		{"unknown flag", []string{"--nope"}, 2, "flag provided but not defined", true},
		{"missing output", []string{"--input", fixture}, 2, "--output are required", true},
		{"missing input file", []string{"-i", filepath.Join(dir, "x.pth"), "-o", filepath.Join(dir, "y.pth")}, 2, "x.pth: no such file", true},
		{"bad policy", []string{"-i", fixture, "-o", filepath.Join(dir, "y.pth"), "--relu", "gelu"}, 2, "--relu", true},
		{"refused relu", []string{"convert", "-i", fixture, "-o", filepath.Join(dir, "y.pth"), "--relu", "error"}, 2, "relu", true},
		{"inspect without file", []string{"inspect"}, 2, "inspect takes one", true},
		{"checkpoint named .py", []string{"-i", fixture, "-o", filepath.Join(dir, "model_abn.py")}, 2, "the Python module is --emit-module", true},
		{"stray argument", []string{"-i", fixture, "-o", filepath.Join(dir, "y.pth"), "extra"}, 2, "unexpected argument", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := run(c.args...)
			if code != c.code {
				t.Fatalf("exit %d, want %d; stderr %q", code, c.code, stderr)
			}
			if c.code == 0 && !strings.Contains(stdout, "abnconvert") {
				t.Errorf("help not shown: %q", stdout)
			}
			if c.stderr != "" {
				if !strings.Contains(stderr, c.stderr) {
					t.Errorf("stderr %q lacks %q", stderr, c.stderr)
				}
				// Progress lines may come first; the error is one line, last.
				lines := strings.Split(strings.TrimSpace(stderr), "\n")
				if last := lines[len(lines)-1]; !strings.HasPrefix(last, "abnconvert: ") || !strings.Contains(last, c.stderr) {
					t.Errorf("last stderr line %q is not the error", last)
				}
				if n := strings.Count(stderr, "abnconvert: "); n != 1 {
					t.Errorf("%d error lines, want one: %q", n, stderr)
				}
			}
			if c.noFiles {
				if e, _ := os.ReadDir(dir); len(e) != 0 {
					t.Errorf("files left behind: %v", e)
				}
			}
		})
	}
}

func TestConvertAndInspect(t *testing.T) {
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_densenet.pth")
	dir := t.TempDir()
	out := filepath.Join(dir, "out.pth")
	code, stdout, stderr := run("-i", fixture, "-o", out, "--emit-module", filepath.Join(dir, "m.py"))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{"densenet", "WARNING", "wrote"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("table lacks %q:\n%s", want, stdout)
		}
	}
	if !strings.Contains(stderr, "reading") {
		t.Errorf("no progress on stderr: %q", stderr)
	}
	// The same conversion again is refused (output exists) ...
	if code, _, stderr := run("convert", "-i", fixture, "-o", out); code != 2 || !strings.Contains(stderr, "already exists") {
		t.Errorf("second run: exit %d, %q", code, stderr)
	}
	// ... and with --force and --json gives machine-readable output.
	code, stdout, stderr = run("convert", "-i", fixture, "-o", out, "--force", "--json", "--quiet")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res map[string]any
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("--json output is not JSON: %v\n%s", err, stdout)
	}
	if stderr != "" {
		t.Errorf("--quiet still wrote %q", stderr)
	}
	code, stdout, _ = run("inspect", "--json", fixture)
	if code != 0 || !strings.Contains(stdout, `"family": "densenet"`) {
		t.Errorf("inspect: exit %d\n%s", code, stdout)
	}
}
