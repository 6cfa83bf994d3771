//go:build linux

package output

import (
	"bytes"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestReserve: Reserve allocates the blocks of a staged file's first n
// bytes and leaves its size alone; the writes then fill them as they
// would have, and Commit puts the same bytes in place. Where this file
// system has no fallocate (the call itself refused), it is skipped.
func TestReserve(t *testing.T) {
	dir := t.TempDir()
	probe, err := os.Create(filepath.Join(dir, "probe"))
	if err != nil {
		t.Fatal(err)
	}
	err = syscall.Fallocate(int(probe.Fd()), 0x1, 0, 1<<20)
	probe.Close()
	if err != nil {
		t.Skipf("fallocate(FALLOC_FL_KEEP_SIZE) refused in %s: %v", dir, err)
	}

	path := filepath.Join(dir, "out.pth")
	s := New(Options{})
	defer s.Abort()
	f, err := s.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	const n = 1 << 20
	f.Reserve(n)
	var st syscall.Stat_t
	if err := syscall.Stat(f.tmp, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != 0 || st.Blocks*512 < n {
		t.Fatalf("after Reserve(%d): size %d, %d bytes of blocks; want size 0 and at least %d bytes of blocks", n, st.Size, st.Blocks*512, n)
	}
	data := bytes.Repeat([]byte("abnconvert"), n/10+1)[:n]
	if _, err := f.WriteVec([][]byte{data[:n/2], data[n/2:]}); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Errorf("%s: %d bytes, not the %d written", path, len(got), len(data))
	}
}
