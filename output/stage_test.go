package output

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// TestCommitNoReplace: without Force, a file that appears at the
// destination after Create checked it (another program, another run) is
// never replaced: Commit fails with ErrExists naming it, the file keeps
// its contents, and no temporary file is left. With Force it is replaced,
// as before.
func TestCommitNoReplace(t *testing.T) {
	for _, force := range []bool{false, true} {
		dir := t.TempDir()
		out := filepath.Join(dir, "model_abn.pth")
		s := New(Options{Force: force})
		stage(t, s, out, "ours")
		write(t, out, "theirs") // appears mid-run
		err := s.Commit()
		got, _ := os.ReadFile(out)
		if force {
			if err != nil || string(got) != "ours" {
				t.Fatalf("force: err %v, file %q; want it replaced", err, got)
			}
		} else {
			if !errors.Is(err, ErrExists) || !strings.Contains(err.Error(), out) {
				t.Fatalf("no force: err %v; want ErrExists naming %s", err, out)
			}
			if string(got) != "theirs" {
				t.Fatalf("no force: the file that appeared was changed to %q", got)
			}
		}
		if l := listing(t, dir); strings.Count(l, "=") != 1 {
			t.Fatalf("force %v: left %s", force, l)
		}
	}
}

// TestConcurrentCommits: two runs staging one new output at once, without
// Force, 20 rounds: exactly one commits, the other fails with ErrExists,
// and the file holds the winner's bytes in full.
func TestConcurrentCommits(t *testing.T) {
	for round := 0; round < 20; round++ {
		dir := t.TempDir()
		out := filepath.Join(dir, "out.pth")
		var wg sync.WaitGroup
		errs := make([]error, 2)
		start := make(chan struct{})
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s := New(Options{})
				defer s.Abort()
				f, err := s.Create(out)
				if err != nil {
					errs[i] = err
					return
				}
				f.Write([]byte(strings.Repeat(strconv.Itoa(i), 4096)))
				<-start
				errs[i] = s.Commit()
			}()
		}
		close(start)
		wg.Wait()
		ok := 0
		winner := -1
		for i, err := range errs {
			switch {
			case err == nil:
				ok++
				winner = i
			case !errors.Is(err, ErrExists):
				t.Fatalf("round %d: run %d: %v; want success or ErrExists", round, i, err)
			}
		}
		if ok != 1 {
			t.Fatalf("round %d: %d runs committed (errors %v); want exactly 1", round, ok, errs)
		}
		got, _ := os.ReadFile(out)
		if string(got) != strings.Repeat(strconv.Itoa(winner), 4096) {
			t.Fatalf("round %d: the file is not run %d's bytes", round, winner)
		}
		if l := listing(t, dir); strings.Count(l, "=") != 1 {
			t.Fatalf("round %d: left %d entries", round, strings.Count(l, "="))
		}
	}
}

// TestLongName: an output name the file system accepts (up to NAME_MAX)
// gets a temporary name that fits too.
func TestLongName(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []int{200, 240, 250, 255} {
		name := strings.Repeat("m", n-4) + ".pth"
		if n == 255 {
			name = strings.Repeat("é", 125) + "m.pth" // 255 bytes, multi-byte runes at the cut
		}
		if len(name) != n {
			t.Fatalf("built a %d-byte name for %d", len(name), n)
		}
		out := filepath.Join(dir, name)
		s := New(Options{})
		stage(t, s, out, "x")
		if err := s.Commit(); err != nil {
			t.Fatalf("%d-byte name: %v", n, err)
		}
		if got, err := os.ReadFile(out); err != nil || string(got) != "x" {
			t.Fatalf("%d-byte name: read %q, %v", n, got, err)
		}
	}
	if tn := tempName(strings.Repeat("é", 127)+"m", 4194304, ^uint32(0)); len(tn) > nameMax || !strings.HasSuffix(tn, tempSuffix(4194304, ^uint32(0))) {
		t.Fatalf("tempName of a 255-byte base: %d bytes %q", len(tn), tn)
	}
}

// deadPID is the PID of a process that has ended.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skipf("cannot run a child process: %v", err)
	}
	return cmd.Process.Pid
}

// TestRemoveStale: the next run in a directory removes the temporary
// files of runs that died (their PID gone, their lock free), and leaves
// those of live runs (a live PID, or a held lock: a writer in another PID
// namespace), files of other names, and its own.
func TestRemoveStale(t *testing.T) {
	dir := t.TempDir()
	dead := deadPID(t)
	stale := filepath.Join(dir, ".model_abn.pth.tmp-"+strconv.Itoa(dead)+"-1abc")
	live := filepath.Join(dir, ".model_abn.pth.tmp-"+strconv.Itoa(os.Getppid())+"-2abc")
	locked := filepath.Join(dir, ".other.pth.tmp-"+strconv.Itoa(dead)+"-3abc")
	userFile := filepath.Join(dir, ".notes.tmp-"+strconv.Itoa(dead))
	for _, p := range []string{stale, live, locked, userFile} {
		write(t, p, "partial")
	}
	holder, err := os.Open(locked)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	if !tryLockFile(holder) {
		t.Skip("this file system has no flock: removeStale leaves every file (by design)")
	}
	s := New(Options{})
	defer s.Abort()
	stage(t, s, filepath.Join(dir, "model_abn.pth"), "new")
	for _, p := range []string{live, locked, userFile} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s was removed: %v", filepath.Base(p), err)
		}
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("the dead run's %s is still there", filepath.Base(stale))
	}
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	holder.Close() // its writer "dies": the next run takes the file
	s2 := New(Options{Force: true})
	defer s2.Abort()
	stage(t, s2, filepath.Join(dir, "model_abn.pth"), "newer")
	if _, err := os.Stat(locked); !os.IsNotExist(err) {
		t.Errorf("%s, unlocked with a dead PID, is still there", filepath.Base(locked))
	}
}
