package output

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSignals runs a child (this test binary) that commits one set, then
// stalls writing a second; the test signals it. The child must die of the
// signal with the second set's temporary files removed, the first set's
// output in place and the previous file of the second untouched; a signal
// the child was started ignoring (SIGHUP under nohup) must change nothing.
func TestSignals(t *testing.T) {
	if dir := os.Getenv("OUTPUT_TEST_CHILD"); dir != "" {
		first := New(Options{})
		if err := first.WriteFile(filepath.Join(dir, "first"), []byte("committed")); err != nil {
			t.Fatal(err)
		}
		if err := first.Commit(); err != nil {
			t.Fatal(err)
		}
		InjectFault("b", 3, nil)
		s := New(Options{Force: true})
		if err := s.WriteFile(filepath.Join(dir, "a"), []byte("staged a")); err != nil {
			t.Fatal(err)
		}
		f, err := s.Create(filepath.Join(dir, "b"))
		if err != nil {
			t.Fatal(err)
		}
		f.Write([]byte("0123456789")) // stalls after 3 bytes
		t.Fatal("the stalled write returned")
	}
	nohup, _ := exec.LookPath("nohup")
	// A child inherits the signals this test was started ignoring (go test
	// run under nohup ignores SIGHUP): GNU env --default-signal gives the
	// cases that want a handled signal its default disposition back.
	var reset []string
	if exec.Command("env", "--default-signal=HUP", "true").Run() == nil {
		reset = []string{"env", "--default-signal=HUP,INT,TERM"}
	}
	for _, tc := range []struct {
		name    string
		sig     syscall.Signal
		ignored bool // started with the signal ignored (nohup)
	}{
		{"SIGINT", syscall.SIGINT, false},
		{"SIGTERM", syscall.SIGTERM, false},
		{"SIGHUP", syscall.SIGHUP, false},
		{"SIGHUP under nohup", syscall.SIGHUP, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.ignored && nohup == "" {
				t.Skip("no nohup here")
			}
			dir := t.TempDir()
			write(t, filepath.Join(dir, "b"), "previous b")
			child := []string{os.Args[0], "-test.run=^TestSignals$"}
			if tc.ignored {
				child = append([]string{nohup}, child...) // after env, which would undo it
			}
			args := append(slices.Clone(reset), child...)
			cmd := exec.Command(args[0], args[1:]...)
			cmd.Env = append(os.Environ(), "OUTPUT_TEST_CHILD="+dir)
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Process.Kill()
			stalledNow := func() bool {
				ents, _ := os.ReadDir(dir)
				for _, e := range ents {
					if fi, err := e.Info(); err == nil && strings.HasPrefix(e.Name(), ".b.tmp-") && fi.Size() == 3 {
						return true
					}
				}
				return false
			}
			for deadline := time.Now().Add(20 * time.Second); !stalledNow(); time.Sleep(2 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the child never stalled; it said:\n%s", out.String())
				}
			}
			staged := listing(t, dir)
			cmd.Process.Signal(tc.sig)
			sig := tc.sig
			if tc.ignored {
				time.Sleep(300 * time.Millisecond)
				if got := listing(t, dir); got != staged {
					t.Errorf("an ignored %v changed the outputs:\nbefore %s\nafter  %s", tc.sig, staged, got)
				}
				sig = syscall.SIGTERM
				cmd.Process.Signal(sig)
			}
			// Bounded: a child that ignores the signal would hang the
			// test until go test's own timeout, with nothing said.
			waited := make(chan struct{})
			go func() { cmd.Wait(); close(waited) }()
			select {
			case <-waited:
			case <-time.After(30 * time.Second):
				cmd.Process.Kill()
				<-waited
				t.Fatalf("the child outlived %v by 30 s; it said:\n%s", sig, out.String())
			}
			if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != sig {
				t.Errorf("child ended with %v, want death by %v; it said:\n%s", cmd.ProcessState, sig, out.String())
			}
			if got, want := listing(t, dir), `b="previous b" first="committed"`; got != want {
				t.Errorf("after the signal: %s, want %s", got, want)
			}
		})
	}
}
