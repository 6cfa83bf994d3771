//go:build !linux

package output

import "os"

// pwritev writes bufs to f at off, in order, one WriteAt each: only Linux
// has the vectored call here.
func pwritev(f *os.File, bufs [][]byte, off int64) (int, error) {
	total := 0
	for _, b := range bufs {
		n, err := f.WriteAt(b, off+int64(total))
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}
