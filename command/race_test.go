package command

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// TestConcurrentRunsNoForce: two conversions onto one new output path at
// once, without --force, 20 rounds: exactly one writes it (exit 0), the
// other exits 2 naming it, and the output is a whole checkpoint (equal to
// what a single run writes), with no temporary file left beside it. The
// runs are processes (this test binary run again as abnconvert), as two
// users' runs are: urfave/cli keeps global flag state, so two in one
// process would race in the flag parser, not in the output's commit.
func TestConcurrentRunsNoForce(t *testing.T) {
	if args := os.Getenv("ABNCONVERT_RACE_ARGS"); args != "" {
		os.Exit(Main(append([]string{"abnconvert"}, strings.Split(args, "\n")...), os.Stdout, os.Stderr))
	}
	fixture := filepath.Join("..", "fixtures", "testdata", "tiny_resnet_basic.pth")
	dir := t.TempDir()
	want := filepath.Join(dir, "alone.pth")
	if code, _, stderr := run("convert", "-i", fixture, "-o", want, "-q"); code != 0 {
		t.Fatalf("single run: exit %d: %s", code, stderr)
	}
	wantBytes, _ := os.ReadFile(want)
	for round := 0; round < 20; round++ {
		rdir := filepath.Join(dir, "r"+string(rune('a'+round)))
		os.Mkdir(rdir, 0o755)
		out := filepath.Join(rdir, "out.pth")
		var wg sync.WaitGroup
		codes := make([]int, 2)
		stderrs := make([]string, 2)
		for i := range codes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cmd := exec.Command(os.Args[0], "-test.run=^TestConcurrentRunsNoForce$")
				cmd.Env = append(os.Environ(), "ABNCONVERT_RACE_ARGS="+strings.Join([]string{"convert", "-i", fixture, "-o", out, "-q"}, "\n"))
				var errb bytes.Buffer
				cmd.Stderr = &errb
				err := cmd.Run()
				codes[i], stderrs[i] = cmd.ProcessState.ExitCode(), errb.String()
				if err != nil && codes[i] < 0 {
					stderrs[i] = err.Error()
				}
			}()
		}
		wg.Wait()
		ok := 0
		for i, c := range codes {
			switch {
			case c == 0:
				ok++
			case c == 2 && strings.Contains(stderrs[i], "out.pth") && strings.Contains(stderrs[i], "exists"):
			default:
				t.Fatalf("round %d: run %d exit %d: %s", round, i, c, stderrs[i])
			}
		}
		if ok != 1 {
			t.Fatalf("round %d: %d runs exited 0; want exactly 1 (stderr %q)", round, ok, stderrs)
		}
		got, _ := os.ReadFile(out)
		if string(got) != string(wantBytes) {
			t.Fatalf("round %d: the output differs from a single run's", round)
		}
		ents, _ := os.ReadDir(rdir)
		if len(ents) != 1 {
			t.Fatalf("round %d: %d entries left in the directory", round, len(ents))
		}
	}
}
