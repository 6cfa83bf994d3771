//go:build linux

package output

import (
	"os"
	"syscall"
	"unsafe"
)

// pwritev writes bufs to f at off, in order, with pwritev(2): several
// pieces of one range of the file (package pth's chunked copy: headers, and
// record bytes straight from a map of the input) in one call, which the
// file system takes as one write of their total length. It resumes after
// short writes and EINTR.
func pwritev(f *os.File, bufs [][]byte, off int64) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	total := 0
	iov := make([]syscall.Iovec, 0, min(len(bufs), maxIovec))
	for len(bufs) > 0 {
		iov = iov[:0]
		for _, b := range bufs {
			if len(iov) == maxIovec {
				break
			}
			if len(b) > 0 {
				v := syscall.Iovec{Base: &b[0]}
				v.SetLen(len(b))
				iov = append(iov, v)
			}
		}
		if len(iov) == 0 {
			break
		}
		var n uintptr
		var errno syscall.Errno
		at := off + int64(total)
		if err := rc.Write(func(fd uintptr) bool {
			// The offset in two words, low then high, as the kernel's
			// pwritev takes it on every architecture.
			n, _, errno = syscall.Syscall6(syscall.SYS_PWRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)), uintptr(at), uintptr(uint64(at)>>32), 0)
			return errno != syscall.EAGAIN
		}); err != nil {
			return total, err
		}
		if errno == syscall.EINTR {
			continue
		}
		if errno != 0 {
			return total, &os.PathError{Op: "pwritev", Path: f.Name(), Err: errno}
		}
		if n == 0 {
			return total, &os.PathError{Op: "pwritev", Path: f.Name(), Err: syscall.EIO}
		}
		total += int(n)
		// Drop what was written, whole buffers then part of one.
		left := int(n)
		for len(bufs) > 0 && left >= len(bufs[0]) {
			left -= len(bufs[0])
			bufs = bufs[1:]
		}
		if left > 0 {
			bufs = append([][]byte{bufs[0][left:]}, bufs[1:]...)
		}
	}
	return total, nil
}
