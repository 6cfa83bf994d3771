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
	return vectored(f, "pwritev", bufs, func(fd uintptr, iov []syscall.Iovec, done int) (uintptr, syscall.Errno) {
		at := off + int64(done)
		// The offset in two words, low then high, as the kernel's
		// pwritev takes it on every architecture.
		n, _, errno := syscall.Syscall6(syscall.SYS_PWRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)), uintptr(at), uintptr(uint64(at)>>32), 0)
		return n, errno
	})
}
