package cuda

import (
	"fmt"
	"math/bits"
)

// fastDiv divides by an invariant divisor with a multiply-high, an add and
// a shift, as the kernels' fdiv does: the memory-bound kernels divide every
// element's flat index by a plane size, and a hardware 32-bit division
// would cost several times the load it serves. This Go copy of the formula
// lets the tests check the magic numbers exhaustively at the edges.
type fastDiv struct {
	d, m, s uint32
}

// maxDividend bounds the dividends fdiv is exact for: (t + n) must not
// overflow 32 bits, and t <= n.
const maxDividend = 1<<31 - 1

// newFastDiv computes the multiplier and shift for 1 <= d <= 2^31
// (Granlund and Montgomery, in the round-up form PyTorch's IntDivider
// uses): s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1.
func newFastDiv(d int) (fastDiv, error) {
	if d < 1 || d > 1<<31 {
		return fastDiv{}, fmt.Errorf("cuda: divisor %d out of range [1, 2^31]", d)
	}
	s := uint32(bits.Len32(uint32(d - 1)))
	m := (uint64(1)<<32)*((uint64(1)<<s)-uint64(d))/uint64(d) + 1
	return fastDiv{d: uint32(d), m: uint32(m), s: s}, nil
}

// div is n / d for n <= maxDividend, computed as the kernels do.
func (f fastDiv) div(n uint32) uint32 {
	t := uint32((uint64(n) * uint64(f.m)) >> 32)
	return (t + n) >> f.s
}
