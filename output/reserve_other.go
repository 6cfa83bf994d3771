//go:build !linux

package output

// Reserve does nothing but on Linux (see reserve_linux.go).
func (f *File) Reserve(n int64) {}
