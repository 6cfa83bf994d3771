package cuda

import (
	"math/rand/v2"
	"testing"
)

// TestFastDiv checks the kernels' division formula against exact division
// for divisors at the edges (1, powers of two and their neighbours, the
// plane sizes of common networks, the largest allowed) and dividends at
// the edges of each divisor's multiples and of the allowed range.
func TestFastDiv(t *testing.T) {
	divisors := []int{1, 2, 3, 4, 5, 6, 7, 9, 12, 49, 196, 784, 3136, 12544, 50176, 65535, 65536, 65537,
		1<<20 - 1, 1 << 20, 1<<20 + 1, 1<<30 - 1, 1 << 30, 1<<30 + 1, 1<<31 - 1, 1 << 31}
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 200; i++ {
		divisors = append(divisors, 1+r.IntN(1<<31))
	}
	for _, d := range divisors {
		f, err := newFastDiv(d)
		if err != nil {
			t.Fatalf("d=%d: %v", d, err)
		}
		ns := []uint32{0, 1, maxDividend, maxDividend - 1}
		for _, k := range []uint64{1, 2, 3, 1000, uint64(maxDividend) / uint64(d)} {
			m := k * uint64(d)
			for _, n := range []uint64{m - 1, m, m + 1} {
				if n <= maxDividend {
					ns = append(ns, uint32(n))
				}
			}
		}
		for i := 0; i < 1000; i++ {
			ns = append(ns, uint32(r.IntN(maxDividend+1)))
		}
		for _, n := range ns {
			if got, want := f.div(n), n/uint32(d); got != want {
				t.Fatalf("%d / %d: fdiv gives %d, want %d (m=%d s=%d)", n, d, got, want, f.m, f.s)
			}
		}
	}
}

func TestFastDivExhaustiveSmall(t *testing.T) {
	for d := 1; d <= 300; d++ {
		f, err := newFastDiv(d)
		if err != nil {
			t.Fatal(err)
		}
		for n := uint32(0); n < 1<<16; n++ {
			if f.div(n) != n/uint32(d) {
				t.Fatalf("%d / %d: %d", n, d, f.div(n))
			}
		}
	}
}

func TestFastDivRange(t *testing.T) {
	for _, d := range []int{0, -1, 1<<31 + 1} {
		if _, err := newFastDiv(d); err == nil {
			t.Errorf("newFastDiv(%d) accepted", d)
		}
	}
}
