package pth

import (
	"hash/crc32"
	"math/rand/v2"
	"testing"
)

func TestCRC32Combine(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, n := range [][2]int{{0, 0}, {0, 5}, {7, 0}, {1, 1}, {100, 3}, {3, 1 << 20}, {1 << 16, 12345}} {
		a, b := make([]byte, n[0]), make([]byte, n[1])
		for i := range a {
			a[i] = byte(r.Uint32())
		}
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		want := crc32.ChecksumIEEE(append(append([]byte{}, a...), b...))
		if got := crc32Combine(crc32.ChecksumIEEE(a), crc32.ChecksumIEEE(b), int64(len(b))); got != want {
			t.Errorf("lengths %v: combined %08x, want %08x", n, got, want)
		}
	}
}

// The cached shift by a whole copy chunk agrees with the general one.
func TestCRC32CombineChunk(t *testing.T) {
	a := []byte("the first chunk")
	b := make([]byte, mapChunk)
	for i := range b {
		b[i] = byte(i * 7)
	}
	want := crc32.ChecksumIEEE(append(append([]byte{}, a...), b...))
	if got := crc32Combine(crc32.ChecksumIEEE(a), crc32.ChecksumIEEE(b), mapChunk); got != want {
		t.Errorf("combined %08x, want %08x", got, want)
	}
}
