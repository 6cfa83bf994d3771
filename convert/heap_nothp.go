//go:build !(linux && (amd64 || arm64))

package convert

// hugeHeap does nothing but on 64-bit Linux (see heap_thp.go).
func hugeHeap(n int) (lo, hi uintptr) { return 0, 0 }
