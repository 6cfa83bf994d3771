//go:build !linux

package output

import "os"

// renameNoReplace renames without replacing: a hard link, which never
// replaces, and the removal of the temporary name.
func renameNoReplace(tmp, path string) error {
	if err := os.Link(tmp, path); err != nil {
		return err
	}
	os.Remove(tmp)
	return nil
}

// processExists is true: without a way to ask, no leftover is removed.
func processExists(pid int) bool { return true }

func tryLockFile(f *os.File) bool { return false }
