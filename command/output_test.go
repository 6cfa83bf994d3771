package command

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/abnconvert/abnconvert/output"
)

// The inputs of the output tests, one per writer kind.
var (
	onnxFixture        = filepath.Join("..", "onnx", "testdata", "tiny_cnn.onnx")
	opaqueFixture      = filepath.Join("..", "fixtures", "testdata", "acts", "softmax_net_op13.onnx") // has Softmax, which the runtime does not model
	safetensorsFixture = filepath.Join("..", "fixtures", "testdata", "formats4", "tiny_resnet_basic.safetensors")
)

// scene is the directories of a command whose outputs already exist from
// an earlier run: out/ (the checkpoint), mod/ (the module), rep/ (the
// report and plots), each holding a previous file that a failed or
// interrupted run must leave byte for byte as it was.
type scene struct {
	root, out, mod, rep string
	converted           string // a converted checkpoint, input of revert
}

func newScene(t *testing.T) *scene {
	t.Helper()
	root := t.TempDir()
	s := &scene{root: root, out: filepath.Join(root, "out"), mod: filepath.Join(root, "mod"), rep: filepath.Join(root, "rep")}
	for _, d := range []string{s.out, s.mod, s.rep} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{"out.pth", "out.safetensors", "out.onnx", "back.pth"} {
		s.previous(t, filepath.Join(s.out, p))
	}
	s.previous(t, filepath.Join(s.mod, "m.py"))
	for _, p := range []string{"r.json", "plot.svg"} {
		s.previous(t, filepath.Join(s.rep, p))
	}
	s.converted = filepath.Join(root, "converted.pth")
	if code, _, stderr := run("convert", "-i", resnetFixture, "-o", s.converted, "-q"); code != 0 {
		t.Fatalf("making revert's input: exit %d: %s", code, stderr)
	}
	return s
}

func (s *scene) previous(t *testing.T, path string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("previous "+filepath.Base(path)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// snapshot of every output directory.
func (s *scene) snapshot(t *testing.T) string {
	t.Helper()
	return "out: " + snapshot(t, s.out) + "\nmod: " + snapshot(t, s.mod) + "\nrep: " + snapshot(t, s.rep)
}

// readOnly makes dir read-only with its previous files in it: a tmpfs
// remounted read-only as root (who writes through permission bits),
// permission bits otherwise.
func readOnly(t *testing.T, dir string) {
	t.Helper()
	if os.Geteuid() != 0 {
		if err := os.Chmod(dir, 0o555); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Chmod(dir, 0o755) })
		return
	}
	keep := map[string][]byte{}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		keep[e.Name()], _ = os.ReadFile(filepath.Join(dir, e.Name()))
	}
	mountTmpfs(t, dir, "size=1m")
	for name, b := range keep {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("mount", "-o", "remount,ro", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot remount read-only: %v: %s", err, out)
	}
}

// writers are the commands of the output tests, one per writer kind, with
// the outputs each writes (relative to the scene).
func writers(s *scene) map[string][]string {
	out, mod, rep := s.out, s.mod, s.rep
	return map[string][]string{
		"pth": {"convert", "-i", resnetFixture, "-o", filepath.Join(out, "out.pth"),
			"--emit-module", filepath.Join(mod, "m.py"), "--report", filepath.Join(rep, "r.json")},
		"safetensors": {"convert", "-i", safetensorsFixture, "-o", filepath.Join(out, "out.safetensors"),
			"--emit-module", filepath.Join(mod, "m.py"), "--report", filepath.Join(rep, "r.json")},
		"pth to safetensors": {"convert", "-i", resnetFixture, "-o", filepath.Join(out, "out.safetensors"),
			"--emit-module", filepath.Join(mod, "m.py"), "--report", filepath.Join(rep, "r.json")},
		"onnx":   {"convert", "-i", onnxFixture, "-o", filepath.Join(out, "out.onnx"), "--report", filepath.Join(rep, "r.json")},
		"revert": {"revert", "-i", s.converted, "-o", filepath.Join(out, "back.pth")},
		"memory plot": {"memory", resnetFixture, "--size", "32", "--batch", "2",
			"--plot", filepath.Join(rep, "plot.svg")},
	}
}

// TestForceKeepsPreviousOutputs: a --force run in which one output fails
// (at any point: refused before writing, failing while written, or failing
// after the others are complete) exits 2 naming that output, and leaves
// every previous output byte for byte as it was and no temporary file;
// the same run without the failure replaces them all.
func TestForceKeepsPreviousOutputs(t *testing.T) {
	type failing struct {
		name  string
		setup func(t *testing.T, s *scene) // makes the failure
		fault string                       // or inject ENOSPC into the output with this base name
		names string                       // the output the error line names
	}
	moduleReadOnly := failing{"module into a read-only directory", func(t *testing.T, s *scene) { readOnly(t, s.mod) }, "", "mod/m.py"}
	reportReadOnly := failing{"report into a read-only directory", func(t *testing.T, s *scene) { readOnly(t, s.rep) }, "", "rep/r.json"}
	reportMissing := failing{"report into a missing directory", nil, "", "nodir/r.json"}
	reportFull := failing{"report fails while written (disk full)", nil, "r.json", "rep/r.json"}
	moduleFull := failing{"module fails while written (disk full)", nil, "m.py", "mod/m.py"}
	outReadOnly := func(name string) failing {
		return failing{"checkpoint into a read-only directory", func(t *testing.T, s *scene) { readOnly(t, s.out) }, "", "out/" + name}
	}
	cases := map[string][]failing{
		"pth":                {moduleReadOnly, reportReadOnly, reportMissing, reportFull, moduleFull, outReadOnly("out.pth"), {"checkpoint fails while written", nil, "out.pth", "out/out.pth"}},
		"safetensors":        {moduleReadOnly, reportReadOnly, reportFull, {"checkpoint fails while written", nil, "out.safetensors", "out/out.safetensors"}},
		"pth to safetensors": {moduleReadOnly, reportFull},
		"onnx":               {reportReadOnly, reportMissing, reportFull, outReadOnly("out.onnx"), {"checkpoint fails while written", nil, "out.onnx", "out/out.onnx"}},
		"revert":             {{"output fails while written", nil, "back.pth", "out/back.pth"}},
		"memory plot":        {{"plot fails while written", nil, "plot.svg", "rep/plot.svg"}, {"plot into a read-only directory", func(t *testing.T, s *scene) { readOnly(t, s.rep) }, "", "rep/plot.svg"}},
	}
	for kind, fails := range cases {
		for _, f := range fails {
			t.Run(kind+"/"+f.name, func(t *testing.T) {
				s := newScene(t)
				args := writers(s)[kind]
				if f.setup != nil {
					f.setup(t, s)
				}
				if f.names == "nodir/r.json" {
					for i := range args {
						if strings.HasSuffix(args[i], "r.json") {
							args[i] = filepath.Join(s.root, "nodir", "r.json")
						}
					}
				}
				before := s.snapshot(t)
				if f.fault != "" {
					defer output.InjectFault(f.fault, 10, syscall.ENOSPC)()
				}
				code, stdout, stderr := run(append(args, "--force", "--quiet")...)
				if code != ExitBadInput {
					t.Fatalf("exit %d, want %d; stderr %q", code, ExitBadInput, stderr)
				}
				if stdout != "" || strings.Count(stderr, "\n") != 1 || !strings.Contains(stderr, filepath.Join(s.root, f.names)+": ") {
					t.Errorf("stdout %q, stderr %q: want one error line naming %s", stdout, stderr, f.names)
				}
				t.Log(strings.TrimSpace(stderr))
				if after := s.snapshot(t); after != before {
					t.Errorf("outputs changed (a previous file lost or a temporary file left):\nbefore %s\nafter  %s", before, after)
				}
			})
		}
	}
	// The control: without a failure every previous output is replaced,
	// so the comparisons above can fail.
	for kind := range cases {
		t.Run(kind+"/no failure", func(t *testing.T) {
			s := newScene(t)
			args := writers(s)[kind]
			if code, _, stderr := run(append(args, "--force", "--quiet")...); code != 0 {
				t.Fatalf("exit %d: %s", code, stderr)
			}
			for i, a := range args {
				if i > 0 && strings.HasPrefix(args[i-1], "-") && args[i-1] != "-i" && strings.HasPrefix(a, s.root) && args[i-1] != "--size" {
					if b, _ := os.ReadFile(a); bytes.HasPrefix(b, []byte("previous ")) || len(b) == 0 {
						t.Errorf("%s %s: not replaced", args[i-1], a)
					}
				}
			}
			for _, d := range []string{s.out, s.mod, s.rep} {
				ents, _ := os.ReadDir(d)
				for _, e := range ents {
					if strings.Contains(e.Name(), ".tmp-") || strings.Contains(e.Name(), ".old-") {
						t.Errorf("left in %s: %s", d, e.Name())
					}
				}
			}
		})
	}
}

// TestInterruptedWriters sends SIGINT and SIGTERM to a command (this test
// binary re-run as abnconvert) whose write of one output is stalled
// midway, for every writer kind: the checkpoint of each format, the
// module, the report, revert's output and memory's plot. The command must
// die of the signal, leaving every previous output byte for byte as it
// was and no temporary file.
func TestInterruptedWriters(t *testing.T) {
	if stall := os.Getenv("ABNCONVERT_TEST_STALL_OUTPUT"); stall != "" {
		pattern, after, _ := strings.Cut(stall, "\n")
		n, _ := strconv.ParseInt(after, 10, 64)
		defer output.InjectFault(pattern, n, nil)() // stall, never fail
		args := strings.Split(os.Getenv("ABNCONVERT_ARGS"), "\n")
		os.Exit(Main(append([]string{"abnconvert"}, args...), os.Stdout, os.Stderr))
	}
	cases := []struct {
		kind, stall string
		dir         func(s *scene) string
		after       int64
	}{
		{"pth", "out.pth", func(s *scene) string { return s.out }, 100000},
		{"safetensors", "out.safetensors", func(s *scene) string { return s.out }, 100000},
		{"pth to safetensors", "out.safetensors", func(s *scene) string { return s.out }, 100000},
		{"onnx", "out.onnx", func(s *scene) string { return s.out }, 5000},
		{"pth", "m.py", func(s *scene) string { return s.mod }, 500},
		{"pth", "r.json", func(s *scene) string { return s.rep }, 500},
		{"onnx", "r.json", func(s *scene) string { return s.rep }, 500},
		{"revert", "back.pth", func(s *scene) string { return s.out }, 100000},
		{"memory plot", "plot.svg", func(s *scene) string { return s.rep }, 500},
	}
	for _, tc := range cases {
		for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
			t.Run(fmt.Sprintf("%s/%s/%v", tc.kind, tc.stall, sig), func(t *testing.T) {
				s := newScene(t)
				args := append(writers(s)[tc.kind], "--force", "--quiet")
				before := s.snapshot(t)
				cmd := exec.Command(os.Args[0], "-test.run=^TestInterruptedWriters$")
				cmd.Env = append(os.Environ(), "ABNCONVERT_TEST_STALL_OUTPUT="+tc.stall+"\n"+strconv.FormatInt(tc.after, 10),
					"ABNCONVERT_ARGS="+strings.Join(args, "\n"))
				var out bytes.Buffer
				cmd.Stdout, cmd.Stderr = &out, &out
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				dir := tc.dir(s)
				for deadline := time.Now().Add(30 * time.Second); !stalled(dir, tc.stall, tc.after); time.Sleep(2 * time.Millisecond) {
					if time.Now().After(deadline) {
						cmd.Process.Kill()
						cmd.Wait()
						t.Fatalf("the write of %s never stalled; child said:\n%s", tc.stall, out.String())
					}
				}
				cmd.Process.Signal(sig)
				cmd.Wait()
				if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != sig {
					t.Errorf("child ended with %v, want death by %v; it said:\n%s", cmd.ProcessState, sig, out.String())
				}
				if after := s.snapshot(t); after != before {
					t.Errorf("outputs changed (a previous file lost or a temporary file left):\nbefore %s\nafter  %s", before, after)
				}
			})
		}
	}
}

// stalled reports whether dir holds the temporary file of output name with
// at least n/2 bytes in it: the write is under way, and stops at n bytes
// written. Not n: bytes written over what the file holds count too (the
// chunked .pth copy writes some records again as their changes come out),
// and the file stood 100-1,500 bytes short of a 100,000-byte stall.
func stalled(dir, name string, n int64) bool {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "."+name+".tmp-") {
			if fi, err := e.Info(); err == nil && fi.Size() >= n/2 {
				return true
			}
		}
	}
	return false
}

// TestErrorClasses: every command maps an error's class to its exit code,
// with one line on stderr and no output left: a recovered panic (injected
// into a writer) is an internal error, 3; an op the runtime does not
// model is 4, unsupported.
func TestErrorClasses(t *testing.T) {
	dir := t.TempDir()
	converted := filepath.Join(dir, "cnn_abn.onnx")
	if code, _, stderr := run("convert", "-i", onnxFixture, "-o", converted, "-q"); code != 0 {
		t.Fatalf("convert: exit %d: %s", code, stderr)
	}
	cases := []struct {
		name  string
		args  []string
		panic string // inject a panic into the output with this base name
		code  int
		want  string
	}{
		{"panic in the ONNX writer (recovered there)", []string{"convert", "-i", onnxFixture, "-o", filepath.Join(dir, "out", "p.onnx")}, "p.onnx", ExitInternal, "p.onnx: writing ONNX: internal error (please report it): injected panic"},
		{"panic in the pth writer (recovered by Main)", []string{"convert", "-i", resnetFixture, "-o", filepath.Join(dir, "out", "p.pth"), "--emit-module", filepath.Join(dir, "out", "p.py")}, "p.pth", ExitInternal, "internal error (please report it): injected panic"},
		{"panic writing the report", []string{"convert", "-i", resnetFixture, "-o", filepath.Join(dir, "out", "p.pth"), "--report", filepath.Join(dir, "out", "p.json")}, "p.json", ExitInternal, "internal error"},
		{"verify: an op the runtime does not model", []string{"verify", "--original", opaqueFixture, "--converted", converted}, "", ExitUnsupported, "does not model these ops yet: Softmax x1"},
		{"memory: an op the runtime does not model", []string{"memory", opaqueFixture, "--size", "16", "--batch", "2"}, "", ExitUnsupported, `unsupported op "onnx.Softmax"`},
		{"convert --graph: an op the runtime does not model, refused with no output", []string{"convert", "-i", "../fixtures/testdata/acts/softmax_net.pth", "--graph", opaqueFixture, "-o", filepath.Join(dir, "out", "t.pth"), "--relu", "abn"}, "", ExitUnsupported, "does not support yet, so no module could be emitted and no conversion verified: Softmax x1"},
		{"bad input stays 2", []string{"verify", "--original", filepath.Join(dir, "none.onnx"), "--converted", converted}, "", ExitBadInput, "none.onnx"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			outDir := filepath.Join(dir, "out")
			os.RemoveAll(outDir)
			os.Mkdir(outDir, 0o755)
			if tc.panic != "" {
				defer output.InjectFault(tc.panic, 10, output.ErrPanic)()
			}
			code, stdout, stderr := run(append(tc.args, "--quiet")...)
			if code != tc.code {
				t.Fatalf("exit %d, want %d; stderr %q", code, tc.code, stderr)
			}
			if stdout != "" || strings.Count(stderr, "\n") != 1 || !strings.Contains(stderr, tc.want) {
				t.Errorf("stdout %q, stderr %q: want one line containing %q", stdout, stderr, tc.want)
			}
			if ents, _ := os.ReadDir(outDir); len(ents) != 0 {
				t.Errorf("left behind: %v", ents)
			}
		})
	}
	_, help, _ := run("--help")
	for _, want := range []string{"3  internal error", "4  the network uses an op abnconvert does not support yet"} {
		if !strings.Contains(help, want) {
			t.Errorf("--help does not document %q", want)
		}
	}
}

// TestFsync: --fsync syncs every output of every writer kind to disk
// before its rename, and without it nothing is synced (the ONNX writer
// used to sync always).
func TestFsync(t *testing.T) {
	outputs := map[string]int64{"pth": 3, "safetensors": 3, "pth to safetensors": 3, "onnx": 2, "revert": 1, "memory plot": 1}
	for kind, n := range outputs {
		for _, fsync := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/fsync=%v", kind, fsync), func(t *testing.T) {
				s := newScene(t)
				args := append(writers(s)[kind], "--force", "--quiet")
				if fsync {
					args = append(args, "--fsync")
				}
				before := output.Syncs()
				if code, _, stderr := run(args...); code != 0 {
					t.Fatalf("exit %d: %s", code, stderr)
				}
				want := map[bool]int64{false: 0, true: n}[fsync]
				if got := output.Syncs() - before; got != want {
					t.Errorf("%d files synced, want %d", got, want)
				}
			})
		}
	}
}
