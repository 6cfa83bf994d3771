// Package outputtest holds checks shared by the tests of the packages that
// write through package output.
package outputtest

import (
	"syscall"
	"testing"
)

// NoBlocksPastEnd fails t when the file at path holds more blocks than its
// size needs: blocks reserved past its end (output.File.Reserve asked for
// too much) stay allocated after it is renamed into place.
func NoBlocksPastEnd(t testing.TB, path string) {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	bs := int64(st.Blksize)
	if need := (st.Size + bs - 1) / bs * bs; st.Blocks*512 > need {
		t.Errorf("%s: %d bytes in %d blocks of 512 bytes, where %d bytes of blocks hold it", path, st.Size, st.Blocks, need)
	}
}
