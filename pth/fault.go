package pth

import (
	"io"
	"sync/atomic"
	"time"
)

// writeFault is the fault InjectWriteFault set, nil when none.
var writeFault atomic.Pointer[fault]

type fault struct {
	after int64
	err   error
}

// InjectWriteFault makes every later Write fail with err once after bytes
// have reached its temporary file, as a full disk (syscall.ENOSPC) or a
// write cut short by the system (syscall.EIO, syscall.EINTR) would fail it;
// restore removes the fault. It exists so that callers can test, in
// process, that a write failing midway leaves no output and no temporary
// file behind. With a nil err the write stalls there instead, as on a
// disk that stops answering, for tests that interrupt a write in progress.
// Production code never calls it. It is not safe to use from tests running
// in parallel.
func InjectWriteFault(after int64, err error) (restore func()) {
	writeFault.Store(&fault{after: after, err: err})
	return func() { writeFault.Store(nil) }
}

// withFault wraps a Write's destination with the injected fault, if any.
func withFault(w io.Writer) io.Writer {
	f := writeFault.Load()
	if f == nil {
		return w
	}
	return &faultWriter{w: w, left: f.after, err: f.err}
}

// faultWriter passes bytes through until left is spent, then fails.
type faultWriter struct {
	w    io.Writer
	left int64
	err  error
}

func (f *faultWriter) Write(p []byte) (int, error) {
	if int64(len(p)) <= f.left {
		n, err := f.w.Write(p)
		f.left -= int64(n)
		return n, err
	}
	n, err := f.w.Write(p[:f.left])
	f.left -= int64(n)
	if err != nil {
		return n, err
	}
	if f.err == nil {
		for {
			time.Sleep(time.Hour) // a sleeping goroutine, not a deadlock
		}
	}
	return n, f.err
}
