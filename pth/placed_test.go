package pth

import (
	"bytes"
	"testing"
	"unsafe"
)

// TestAlignedAfter: whatever the header's length and wherever the buffer
// starts, the header is kept whole and the bytes after it start on a
// copyAlign boundary, inside the buffer's capacity, also when the header
// already lies at the buffer's start (as z.header leaves it).
func TestAlignedAfter(t *testing.T) {
	backing := make([]byte, 4096+copyAlign)
	for _, skew := range []int{0, 1, 13, copyAlign - 1, copyAlign} {
		for _, n := range []int{0, 1, 30, 63, 64, 65, 100, 127, 300} {
			for _, inBuf := range []bool{false, true} {
				buf := backing[skew : skew+n+copyAlign : skew+n+copyAlign]
				want := make([]byte, n)
				for i := range want {
					want[i] = byte(i*7 + 1)
				}
				h := want
				if inBuf {
					h = append(buf[:0], want...)
				}
				got := alignedAfter(buf, h)
				if !bytes.Equal(got, want) {
					t.Fatalf("skew %d, header %d, in buffer %v: header changed", skew, n, inBuf)
				}
				end := uintptr(unsafe.Pointer(unsafe.SliceData(got))) + uintptr(n)
				if end%copyAlign != 0 {
					t.Errorf("skew %d, header %d, in buffer %v: data at %d mod %d", skew, n, inBuf, end%copyAlign, copyAlign)
				}
				if cap(got) < n {
					t.Errorf("skew %d, header %d: capacity %d", skew, n, cap(got))
				}
			}
		}
	}
}
