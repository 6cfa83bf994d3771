package output

import (
	"errors"
	"io"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// ErrPanic, given to InjectFault as its err, makes the write panic instead
// of failing, as a bug in a writer would: tests use it to check that a
// panic anywhere in writing ends as an internal error (exit code 3) with
// every temporary file removed.
var ErrPanic = errors.New("injected panic")

// injected is the fault InjectFault set, nil when none.
var injected atomic.Pointer[fault]

type fault struct {
	pattern string
	after   int64
	err     error
}

// InjectFault makes every file staged later whose destination's base name
// matches pattern (filepath.Match; "" matches every file) fail once after
// bytes have reached its temporary file, as a full disk (syscall.ENOSPC)
// or a write cut short by the system (syscall.EIO, syscall.EINTR) would
// fail it; restore removes the fault. With a nil err the write stalls
// there instead, as on a disk that stops answering, for tests that
// interrupt a write in progress. It exists so that tests of every writer,
// in process or in a child process, can make any output fail midway;
// production code never calls it. It is not safe to use from tests
// running in parallel.
func InjectFault(pattern string, after int64, err error) (restore func()) {
	injected.Store(&fault{pattern: pattern, after: after, err: err})
	return func() { injected.Store(nil) }
}

// withFault wraps a staged file's writes with the injected fault if one
// applies to its destination, else returns nil.
func withFault(dest string, w io.Writer) io.Writer {
	f := injected.Load()
	if f == nil {
		return nil
	}
	if f.pattern != "" {
		if ok, _ := filepath.Match(f.pattern, filepath.Base(dest)); !ok {
			return nil
		}
	}
	return &faultWriter{w: w, left: f.after, err: f.err}
}

// faultWriter passes bytes through until left is spent, then fails:
// appended (Write) and positioned (writeAt, from several goroutines at
// once) bytes alike.
type faultWriter struct {
	w    io.Writer
	mu   sync.Mutex
	left int64
	err  error
}

func (f *faultWriter) Write(p []byte) (int, error) {
	return f.write(p, func(b []byte) (int, error) { return f.w.Write(b) })
}

// writeAt is w.WriteAt(p, off) under the fault.
func (f *faultWriter) writeAt(w io.WriterAt, p []byte, off int64) (int, error) {
	return f.write(p, func(b []byte) (int, error) { return w.WriteAt(b, off) })
}

func (f *faultWriter) write(p []byte, write func([]byte) (int, error)) (int, error) {
	f.mu.Lock()
	if int64(len(p)) <= f.left {
		f.left -= int64(len(p))
		f.mu.Unlock()
		return write(p)
	}
	m := f.left
	f.left = 0
	f.mu.Unlock()
	n, err := write(p[:m])
	if err != nil {
		return n, err
	}
	switch f.err {
	case nil:
		for {
			time.Sleep(time.Hour) // a sleeping goroutine, not a deadlock
		}
	case ErrPanic:
		panic(ErrPanic)
	}
	return n, f.err
}
