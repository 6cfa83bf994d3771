package output

import (
	"os"
	"syscall"
	"unsafe"
)

// maxIovec is Linux's IOV_MAX: the most buffers one writev takes.
const maxIovec = 1024

// writev writes bufs to f in order with writev(2), resuming after short
// writes and EINTR.
func writev(f *os.File, bufs [][]byte) (int, error) {
	return vectored(f, "writev", bufs, func(fd uintptr, iov []syscall.Iovec, _ int) (uintptr, syscall.Errno) {
		n, _, errno := syscall.Syscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
		return n, errno
	})
}

// vectored writes bufs to f in order by calls of call (a vectored write
// system call given at most maxIovec buffers and the bytes written so
// far), resuming after short writes and EINTR; op names the call in
// errors.
func vectored(f *os.File, op string, bufs [][]byte, call func(fd uintptr, iov []syscall.Iovec, done int) (uintptr, syscall.Errno)) (int, error) {
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
		if err := rc.Write(func(fd uintptr) bool {
			n, errno = call(fd, iov, total)
			return errno != syscall.EAGAIN
		}); err != nil {
			return total, err
		}
		if errno == syscall.EINTR {
			continue
		}
		if errno != 0 {
			return total, &os.PathError{Op: op, Path: f.Name(), Err: errno}
		}
		if n == 0 {
			return total, &os.PathError{Op: op, Path: f.Name(), Err: syscall.EIO}
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
