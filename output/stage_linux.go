//go:build linux

package output

import (
	"errors"
	"os"
	"syscall"
	"unsafe"
)

// renameNoReplace renames without replacing an existing destination:
// renameat2(RENAME_NOREPLACE) where the kernel and file system have it
// (Linux 3.15; ext4, xfs, btrfs, tmpfs), else a hard link (which never
// replaces either) and the removal of the temporary name, else (a file
// system without hard links) the destination's name taken first with
// O_EXCL, so that nobody else can take it, then replaced by the rename.
// Each way fails with an error matching fs.ErrExist when the destination
// exists.
func renameNoReplace(tmp, path string) error {
	if sysRenameat2 != 0 {
		err := renameat2(tmp, path, renameNoReplaceFlag)
		if err == nil || !fallBackFrom(err) {
			return wrapRename(tmp, path, err)
		}
	}
	err := os.Link(tmp, path)
	if err == nil {
		os.Remove(tmp)
		return nil
	}
	if errors.Is(err, os.ErrExist) || !fallBackFrom(err) {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	f.Close()
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// fallBackFrom says whether err means "this way is not available here"
// rather than a failure of the rename itself.
func fallBackFrom(err error) bool {
	return errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOSYS) ||
		errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EOPNOTSUPP)
}

const renameNoReplaceFlag = 1 // RENAME_NOREPLACE, linux/fs.h

func renameat2(from, to string, flags uint) error {
	p1, err := syscall.BytePtrFromString(from)
	if err != nil {
		return err
	}
	p2, err := syscall.BytePtrFromString(to)
	if err != nil {
		return err
	}
	const atFDCWD = -100
	fd := atFDCWD
	_, _, e := syscall.Syscall6(sysRenameat2, uintptr(fd), uintptr(unsafe.Pointer(p1)), uintptr(fd), uintptr(unsafe.Pointer(p2)), uintptr(flags), 0)
	if e != 0 {
		return e
	}
	return nil
}

func wrapRename(from, to string, err error) error {
	if err == nil {
		return nil
	}
	return &os.LinkError{Op: "renameat2", Old: from, New: to, Err: err}
}

// processExists says whether a process of that PID exists (kill(pid, 0)
// answers ESRCH only when none does; EPERM means one exists that is not
// ours to signal).
func processExists(pid int) bool {
	if pid <= 0 {
		return true
	}
	return !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// tryLockFile takes the file's advisory lock (flock(2), held by the open
// file, released when it is closed or the process dies) without waiting:
// true when nobody else holds it. A file system without locks answers
// false, so that removeStale leaves such files alone.
func tryLockFile(f *os.File) bool {
	return syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil
}
