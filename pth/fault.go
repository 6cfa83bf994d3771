package pth

import "github.com/abnconvert/abnconvert/output"

// InjectWriteFault makes every later Write fail with err once after bytes
// have reached its temporary file, as a full disk (syscall.ENOSPC) or a
// write cut short by the system (syscall.EIO, syscall.EINTR) would fail it;
// restore removes the fault. With a nil err the write stalls there instead.
// It is output.InjectFault for every staged file, kept for the tests that
// call it; production code never calls it.
func InjectWriteFault(after int64, err error) (restore func()) {
	return output.InjectFault("", after, err)
}
