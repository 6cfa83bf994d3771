package output

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
)

// listing describes a directory: every entry with its contents, so that a
// left temporary file or a changed previous file shows.
func listing(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		b, _ := os.ReadFile(filepath.Join(dir, e.Name()))
		out = append(out, fmt.Sprintf("%s=%q", e.Name(), b))
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

func stage(t *testing.T, s *Set, path, data string) {
	t.Helper()
	f, err := s.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte(data)); err != nil {
		t.Fatal(err)
	}
}

// TestCommit: nothing is visible until Commit, which replaces every
// output together, keeps a replaced file's permissions, and leaves no
// temporary file.
func TestCommit(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.pth"), filepath.Join(dir, "b.json")
	write(t, a, "old a")
	s := New(Options{Force: true})
	defer s.Abort()
	stage(t, s, a, "new a")
	stage(t, s, b, "new b")
	if got, _ := os.ReadFile(a); string(got) != "old a" {
		t.Errorf("a before Commit: %q, want the previous contents", got)
	}
	if _, err := os.Stat(b); err == nil {
		t.Error("b exists before Commit")
	}
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	if got, want := listing(t, dir), `a.pth="new a" b.json="new b"`; got != want {
		t.Errorf("after Commit: %s, want %s", got, want)
	}
	for path, mode := range map[string]os.FileMode{a: 0o600, b: 0o644} {
		if fi, _ := os.Stat(path); fi.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", path, fi.Mode().Perm(), mode)
		}
	}
	s.Abort() // a no-op now
	if got := listing(t, dir); !strings.Contains(got, "new a") {
		t.Errorf("Abort after Commit changed the outputs: %s", got)
	}
}

// TestAbort: every failure before Commit leaves the previous files as
// they were and no temporary file.
func TestAbort(t *testing.T) {
	dir := t.TempDir()
	a := filepath.Join(dir, "a.pth")
	write(t, a, "old a")
	before := listing(t, dir)
	s := New(Options{Force: true})
	stage(t, s, a, "new a")
	stage(t, s, filepath.Join(dir, "m.py"), "module")
	if _, err := s.Create(filepath.Join(dir, "missing", "r.json")); err == nil {
		t.Fatal("Create in a missing directory succeeded")
	}
	s.Abort()
	if got := listing(t, dir); got != before {
		t.Errorf("after Abort: %s, want %s", got, before)
	}
	if err := s.Commit(); err == nil {
		t.Error("Commit after Abort succeeded")
	}
}

// TestFailedRename: when a rename fails midway through Commit (here the
// second destination became a directory after it was staged), the output
// already renamed gets its previous contents back, a new one is removed,
// and no temporary or backup file is left.
func TestFailedRename(t *testing.T) {
	dir := t.TempDir()
	old, fresh, late := filepath.Join(dir, "1old"), filepath.Join(dir, "2new"), filepath.Join(dir, "3dir")
	write(t, old, "previous")
	s := New(Options{Force: true})
	stage(t, s, old, "replacement")
	stage(t, s, fresh, "fresh")
	stage(t, s, late, "late")
	if err := os.MkdirAll(filepath.Join(late, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	err := s.Commit()
	if err == nil || !strings.Contains(err.Error(), late) {
		t.Fatalf("Commit: %v, want an error naming %s", err, late)
	}
	if got, want := listing(t, dir), `1old="previous" 3dir=""`; got != want {
		t.Errorf("after the failed Commit: %s, want %s", got, want)
	}
}

// TestCreateRefuses: the destination checks, before any byte is written.
func TestCreateRefuses(t *testing.T) {
	dir := t.TempDir()
	in, existing := filepath.Join(dir, "in.pth"), filepath.Join(dir, "existing")
	write(t, in, "input")
	write(t, existing, "x")
	link := filepath.Join(dir, "hard")
	if err := os.Link(in, link); err != nil {
		t.Fatal(err)
	}
	sym := filepath.Join(dir, "sym")
	if err := os.Symlink(in, sym); err != nil {
		t.Fatal(err)
	}
	before := listing(t, dir)
	for _, tc := range []struct {
		name  string
		force bool
		path  string
		is    error
		want  string
	}{
		{"existing without force", false, existing, ErrExists, "use --force"},
		{"the input", true, in, ErrInput, "never overwrites its input"},
		{"a hard link to the input", true, link, ErrInput, "it is " + in},
		{"a symbolic link to the input", true, sym, ErrInput, "it is " + in},
		{"a directory", true, dir, nil, "not a regular file"},
		{"a missing directory", true, filepath.Join(dir, "no", "x"), nil, "no such file or directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := New(Options{Force: tc.force})
			defer s.Abort()
			s.Protect(in, filepath.Join(dir, "not there"))
			_, err := s.Create(tc.path)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), tc.path+": ") || (tc.is != nil && !errors.Is(err, tc.is)) {
				t.Errorf("Create(%s): %v, want an error naming it and containing %q", tc.path, err, tc.want)
			}
		})
	}
	s := New(Options{Force: true})
	defer s.Abort()
	stage(t, s, filepath.Join(dir, "twice"), "1")
	if _, err := s.Create(filepath.Join(dir, ".", "twice")); err == nil || !strings.Contains(err.Error(), "two outputs") {
		t.Errorf("the same output twice: %v", err)
	}
	s.Abort()
	if got := listing(t, dir); got != before {
		t.Errorf("directory changed: %s, want %s", got, before)
	}
}

// TestSync: files are synced exactly when Options.Sync asks.
func TestSync(t *testing.T) {
	for _, sync := range []bool{false, true} {
		before := Syncs()
		dir := t.TempDir()
		s := New(Options{Sync: sync})
		stage(t, s, filepath.Join(dir, "a"), "a")
		stage(t, s, filepath.Join(dir, "b"), "b")
		if err := s.Commit(); err != nil {
			t.Fatal(err)
		}
		if got, want := Syncs()-before, map[bool]int64{false: 0, true: 2}[sync]; got != want {
			t.Errorf("Sync %v: %d file syncs, want %d", sync, got, want)
		}
	}
}

// TestFault: an injected fault hits the outputs its pattern names only,
// and a failed write is reported, sticky, without the temporary's name.
func TestFault(t *testing.T) {
	dir := t.TempDir()
	defer InjectFault("*.json", 3, syscall.ENOSPC)()
	s := New(Options{})
	defer s.Abort()
	stage(t, s, filepath.Join(dir, "a.pth"), strings.Repeat("x", 1<<17)) // spills past the buffer
	f, err := s.Create(filepath.Join(dir, "r.json"))
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("0123456789"))
	err = s.Commit()
	if !errors.Is(err, syscall.ENOSPC) || err.Error() != filepath.Join(dir, "r.json")+": no space left on device" {
		t.Errorf("Commit: %v", err)
	}
	if got := listing(t, dir); got != "" {
		t.Errorf("left: %s", got)
	}
	if _, err := f.Write([]byte("x")); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("a write after the failure: %v, want the same error", err)
	}
}

// TestPanicFault: ErrPanic makes the write panic, for tests of the
// callers' recovery.
func TestPanicFault(t *testing.T) {
	defer InjectFault("", 0, ErrPanic)()
	s := New(Options{})
	defer s.Abort()
	f, err := s.Create(filepath.Join(t.TempDir(), "a"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if r := recover(); r != ErrPanic {
			t.Errorf("recovered %v, want ErrPanic", r)
		}
	}()
	f.Write(bytes.Repeat([]byte("x"), 1<<17))
	t.Error("no panic")
}

// TestWriteVec: buffers written with WriteVec land in order after what
// Write buffered, whatever their number (more than one writev takes) and
// sizes (empty ones too).
func TestWriteVec(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "v.bin")
	s := New(Options{})
	defer s.Abort()
	f, err := s.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	var want []byte
	if _, err := f.Write([]byte("head")); err != nil {
		t.Fatal(err)
	}
	want = append(want, "head"...)
	var bufs [][]byte
	for i := 0; i < 2500; i++ {
		b := make([]byte, i%7)
		for k := range b {
			b[k] = byte(i + k)
		}
		bufs = append(bufs, b)
		want = append(want, b...)
	}
	n, err := f.WriteVec(bufs)
	if err != nil || n != len(want)-4 {
		t.Fatalf("WriteVec: %d, %v; want %d", n, err, len(want)-4)
	}
	if _, err := f.Write([]byte("tail")); err != nil {
		t.Fatal(err)
	}
	want = append(want, "tail"...)
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("file holds %d bytes, want %d (first difference matters)", len(got), len(want))
	}
}

// TestEditInPlace: bytes appended, flushed, read back, overwritten at an
// offset (WriteAt) while appending goes on where it was; Rewind empties
// the file and appends from its first byte again.
func TestEditInPlace(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "e.bin")
	s := New(Options{})
	defer s.Abort()
	f, err := s.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("0123456789")); err != nil {
		t.Fatal(err)
	}
	if err := f.Flush(); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 3)
	if _, err := f.ReadAt(b, 2); err != nil || string(b) != "234" {
		t.Fatalf("ReadAt: %q, %v; want \"234\"", b, err)
	}
	if _, err := f.WriteAt([]byte("ab"), 4); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("xyz")); err != nil {
		t.Fatal(err)
	}
	if err := f.Flush(); err != nil {
		t.Fatal(err)
	}
	b = make([]byte, 13)
	if _, err := f.ReadAt(b, 0); err != nil || string(b) != "0123ab6789xyz" {
		t.Fatalf("after WriteAt and Write: %q, %v; want \"0123ab6789xyz\"", b, err)
	}
	if _, err := f.Write([]byte("unflushed")); err != nil {
		t.Fatal(err)
	}
	if err := f.Rewind(); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("new")); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(p); err != nil || string(got) != "new" {
		t.Fatalf("after Rewind: %q, %v; want \"new\"", got, err)
	}
}

// TestWriteVecAt: pieces written at an offset in one vectored write (more
// than the kernel takes in one call, and empty ones), over bytes appended
// and past them, leave appending where it was; under an injected fault
// the write fails after the bytes the fault allows.
func TestWriteVecAt(t *testing.T) {
	for _, fault := range []bool{false, true} {
		dir := t.TempDir()
		p := filepath.Join(dir, "v.bin")
		if fault {
			defer InjectFault("v.bin", 5000, syscall.ENOSPC)()
		}
		s := New(Options{})
		f, err := s.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write([]byte("0123456789")); err != nil {
			t.Fatal(err)
		}
		if err := f.Flush(); err != nil {
			t.Fatal(err)
		}
		var bufs [][]byte
		var want []byte
		for i := 0; i < 2500; i++ {
			b := make([]byte, i%5)
			for k := range b {
				b[k] = byte(i*7 + k)
			}
			bufs = append(bufs, b)
			want = append(want, b...)
		}
		n, err := f.WriteVecAt(bufs, 4)
		if fault {
			if err == nil || !errors.Is(err, syscall.ENOSPC) {
				t.Errorf("WriteVecAt under a fault: %d, %v; want ENOSPC", n, err)
			}
			s.Abort()
			continue
		}
		if err != nil || n != len(want) {
			t.Fatalf("WriteVecAt: %d, %v; want %d", n, err, len(want))
		}
		if _, err := f.Write([]byte("ab")); err != nil { // appending goes on at 10
			t.Fatal(err)
		}
		if err := s.Commit(); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		full := append([]byte("0123"), want...)
		copy(full[10:], "ab")
		if !bytes.Equal(got, full) {
			t.Fatalf("file holds %d bytes, want %d", len(got), len(full))
		}
	}
}
