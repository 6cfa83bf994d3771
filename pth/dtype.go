package pth

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/abnconvert/abnconvert/half"
)

// DType is a tensor element type, spelled as torch spells it without the
// "torch." prefix.
type DType string

const (
	Float32    DType = "float32"
	Float64    DType = "float64"
	Float16    DType = "float16"
	BFloat16   DType = "bfloat16"
	Int64      DType = "int64"
	Int32      DType = "int32"
	Int16      DType = "int16"
	Int8       DType = "int8"
	Uint8      DType = "uint8"
	Bool       DType = "bool"
	Complex64  DType = "complex64"
	Complex128 DType = "complex128"
)

// storageDTypes maps torch's legacy storage class names, which every
// persistent id in data.pkl names, to the element type they hold.
var storageDTypes = map[string]DType{
	"FloatStorage":         Float32,
	"DoubleStorage":        Float64,
	"HalfStorage":          Float16,
	"BFloat16Storage":      BFloat16,
	"LongStorage":          Int64,
	"IntStorage":           Int32,
	"ShortStorage":         Int16,
	"CharStorage":          Int8,
	"ByteStorage":          Uint8,
	"BoolStorage":          Bool,
	"ComplexFloatStorage":  Complex64,
	"ComplexDoubleStorage": Complex128,
}

// Size is the element size in bytes, 0 for an unknown dtype.
func (d DType) Size() int {
	switch d {
	case Float64, Int64, Complex64:
		return 8
	case Float32, Int32:
		return 4
	case Float16, BFloat16, Int16:
		return 2
	case Int8, Uint8, Bool:
		return 1
	case Complex128:
		return 16
	}
	return 0
}

// storageClass is the legacy storage class torch names for d, used for
// storages this package creates.
func (d DType) storageClass() string {
	for name, dt := range storageDTypes {
		if dt == d {
			return name
		}
	}
	return ""
}

// decode converts little-endian elements of dtype d in b into out
// (len(out) == len(b)/d.Size()).
func decode(d DType, b []byte, out []float64) error {
	le := binary.LittleEndian
	switch d {
	case Float32:
		for i := range out {
			out[i] = float64(math.Float32frombits(le.Uint32(b[4*i:])))
		}
	case Float64:
		for i := range out {
			out[i] = math.Float64frombits(le.Uint64(b[8*i:]))
		}
	case Float16:
		for i := range out {
			out[i] = half.Float16ToFloat(le.Uint16(b[2*i:]))
		}
	case BFloat16:
		for i := range out {
			out[i] = float64(math.Float32frombits(uint32(le.Uint16(b[2*i:])) << 16))
		}
	case Int64:
		for i := range out {
			out[i] = float64(int64(le.Uint64(b[8*i:])))
		}
	case Int32:
		for i := range out {
			out[i] = float64(int32(le.Uint32(b[4*i:])))
		}
	case Int16:
		for i := range out {
			out[i] = float64(int16(le.Uint16(b[2*i:])))
		}
	case Int8:
		for i := range out {
			out[i] = float64(int8(b[i]))
		}
	case Uint8:
		for i := range out {
			out[i] = float64(b[i])
		}
	case Bool:
		for i := range out {
			if b[i] != 0 {
				out[i] = 1
			} else {
				out[i] = 0
			}
		}
	default:
		return fmt.Errorf("cannot decode dtype %s into real numbers", d)
	}
	return nil
}

// encode converts v into little-endian elements of dtype d. Floating types
// round to nearest, ties to even; integer types and bool refuse values they
// cannot hold exactly, because silently truncating a counter or a mask would
// corrupt the checkpoint.
func encode(d DType, v []float64) ([]byte, error) {
	le := binary.LittleEndian
	b := make([]byte, len(v)*d.Size())
	if len(v) == 0 {
		return b, nil // whatever the dtype, as an element loop would
	}
	// A loop per dtype, as decode has, rather than a switch per element:
	// every rewritten BN vector of a checkpoint is encoded on a
	// conversion's path (Finish's plan).
	switch d {
	case Float32:
		for i, x := range v {
			le.PutUint32(b[4*i:], math.Float32bits(float32(x)))
		}
	case Float64:
		for i, x := range v {
			le.PutUint64(b[8*i:], math.Float64bits(x))
		}
	case Float16:
		for i, x := range v {
			le.PutUint16(b[2*i:], half.Float16(x))
		}
	case BFloat16:
		for i, x := range v {
			le.PutUint16(b[2*i:], half.BFloat16(x))
		}
	case Int64, Int32, Int16, Int8, Uint8, Bool:
		for i, x := range v {
			n, err := integral(d, x)
			if err != nil {
				return nil, fmt.Errorf("element %d: %w", i, err)
			}
			switch d {
			case Int64:
				le.PutUint64(b[8*i:], uint64(n))
			case Int32:
				le.PutUint32(b[4*i:], uint32(n))
			case Int16:
				le.PutUint16(b[2*i:], uint16(n))
			default:
				b[i] = byte(n)
			}
		}
	default:
		return nil, fmt.Errorf("cannot encode real numbers as dtype %s", d)
	}
	return b, nil
}

func integral(d DType, x float64) (int64, error) {
	lo, hi := math.Inf(-1), math.Inf(1)
	switch d {
	case Int64:
		lo, hi = -9223372036854775808, 9223372036854775807
	case Int32:
		lo, hi = math.MinInt32, math.MaxInt32
	case Int16:
		lo, hi = math.MinInt16, math.MaxInt16
	case Int8:
		lo, hi = math.MinInt8, math.MaxInt8
	case Uint8:
		lo, hi = 0, math.MaxUint8
	case Bool:
		lo, hi = 0, 1
	}
	// hi for int64 rounds up to 2^63 as a float64, which does not fit.
	if x != math.Trunc(x) || x < lo || x > hi || (d == Int64 && x >= 9223372036854775807) {
		return 0, fmt.Errorf("value %v does not fit dtype %s", x, d)
	}
	return int64(x), nil
}
