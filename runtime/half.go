package runtime

import "github.com/abnconvert/abnconvert/half"

// The 16-bit formats activations can be kept in (Options.Half) use the
// repository's one codec (package half): encoding rounds to nearest, ties to
// even, as PyTorch's .to(torch.bfloat16) and .half() do; decoding is exact.

// encode16 writes src rounded to dt (BFloat16 or Float16) into dst.
func encode16(dt DType, dst []uint16, src []float32) {
	dst = dst[:len(src)]
	if dt == BFloat16 {
		for k, v := range src {
			dst[k] = half.BFloat16(float64(v))
		}
		return
	}
	for k, v := range src {
		dst[k] = half.Float16(float64(v))
	}
}

// decode16 writes the float32 values of src (in format dt) into dst.
func decode16(dt DType, dst []float32, src []uint16) {
	dst = dst[:len(src)]
	if dt == BFloat16 {
		for k, v := range src {
			dst[k] = float32(half.BFloat16ToFloat(v))
		}
		return
	}
	for k, v := range src {
		dst[k] = float32(half.Float16ToFloat(v))
	}
}

// Round16 returns v rounded to the 16-bit format dt (v itself for any other
// type): what keeping v in that format loses.
func Round16(dt DType, v float32) float32 {
	var h [1]uint16
	var f [1]float32
	switch dt {
	case BFloat16, Float16:
		encode16(dt, h[:], []float32{v})
		decode16(dt, f[:], h[:])
		return f[0]
	}
	return v
}
