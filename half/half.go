// Package half converts between float64 and the two 16-bit floating-point
// formats that checkpoints hold: IEEE 754 binary16 (float16) and bfloat16.
// Encoding rounds straight from float64, to nearest with ties to even, as
// torch does; the pth, onnx and safetensors codecs share it.
package half

import "math"

// Float16 rounds x to the nearest IEEE binary16 value.
func Float16(x float64) uint16 { return round(x, 5, 10) }

// BFloat16 rounds x to the nearest bfloat16 value.
func BFloat16(x float64) uint16 { return round(x, 8, 7) }

// BFloat16ToFloat decodes a bfloat16 value exactly (it is the top half of a
// float32).
func BFloat16ToFloat(h uint16) float64 { return float64(math.Float32frombits(uint32(h) << 16)) }

// Float16ToFloat decodes an IEEE 754 binary16 value exactly.
func Float16ToFloat(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	exp := int(h>>10) & 0x1f
	mant := float64(h & 0x3ff)
	switch exp {
	case 0:
		return sign * math.Ldexp(mant, -24)
	case 0x1f:
		if mant != 0 {
			return math.NaN()
		}
		return sign * math.Inf(1)
	}
	return sign * math.Ldexp(1024+mant, exp-25)
}

// round rounds x directly from float64 to a binary format with expBits
// exponent bits and mantBits stored mantissa bits (binary16: 5, 10;
// bfloat16: 8, 7), to nearest with ties to even, overflowing to infinity and
// keeping subnormals. Rounding straight from float64, rather than through
// float32, avoids double rounding.
func round(x float64, expBits, mantBits uint) uint16 {
	bits := math.Float64bits(x)
	sign := uint16(bits>>63) << (expBits + mantBits)
	expAll := uint16(1)<<expBits - 1
	if math.IsNaN(x) {
		return sign | expAll<<mantBits | 1<<(mantBits-1)
	}
	if math.IsInf(x, 0) {
		return sign | expAll<<mantBits
	}
	e64 := int((bits >> 52) & 0x7ff)
	if e64 == 0 {
		// Zero or a float64 subnormal: far below the smallest subnormal of
		// either target format.
		return sign
	}
	bias := 1<<(expBits-1) - 1
	e := e64 - 1023
	m := bits&(1<<52-1) | 1<<52 // 53-bit significand, value m * 2^(e-52)
	shift := 52 - int(mantBits)
	normal := e >= 1-bias
	if !normal {
		shift += 1 - bias - e
	}
	if shift > 54 {
		return sign
	}
	q := m >> uint(shift)
	rem := m & (1<<uint(shift) - 1)
	half := uint64(1) << uint(shift-1)
	if rem > half || (rem == half && q&1 == 1) {
		q++
	}
	if !normal {
		// q == 2^mantBits carries into the smallest normal, whose bit
		// pattern is exactly q.
		return sign | uint16(q)
	}
	if q == 1<<(mantBits+1) {
		q >>= 1
		e++
	}
	if e > bias {
		return sign | expAll<<mantBits
	}
	return sign | uint16(e+bias)<<mantBits | uint16(q-1<<mantBits)
}
