package safetensors

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/abnconvert/abnconvert/pth"
)

// DType is an element type, spelled as the format spells it ("F32").
type DType string

// The element types of the reference implementation, in its enum order,
// which is increasing alignment: the writer lays tensors out in decreasing
// order of it, so that every tensor starts aligned to its element size.
const (
	BOOL   DType = "BOOL"
	U8     DType = "U8"
	I8     DType = "I8"
	F8E5M2 DType = "F8_E5M2"
	F8E4M3 DType = "F8_E4M3"
	I16    DType = "I16"
	U16    DType = "U16"
	F16    DType = "F16"
	BF16   DType = "BF16"
	I32    DType = "I32"
	U32    DType = "U32"
	F32    DType = "F32"
	F64    DType = "F64"
	I64    DType = "I64"
	U64    DType = "U64"
)

var order = []DType{BOOL, U8, I8, F8E5M2, F8E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64}

// rank is the dtype's position in the reference enum, -1 when unknown.
func (d DType) rank() int {
	for i, o := range order {
		if o == d {
			return i
		}
	}
	return -1
}

// Size is the element size in bytes, 0 for an unknown dtype.
func (d DType) Size() int {
	switch d {
	case BOOL, U8, I8, F8E5M2, F8E4M3:
		return 1
	case I16, U16, F16, BF16:
		return 2
	case I32, U32, F32:
		return 4
	case F64, I64, U64:
		return 8
	}
	return 0
}

// torchTypes maps the element types torch also has to torch's names.
var torchTypes = map[DType]pth.DType{
	BOOL: pth.Bool, U8: pth.Uint8, I8: pth.Int8, I16: pth.Int16, F16: pth.Float16,
	BF16: pth.BFloat16, I32: pth.Int32, F32: pth.Float32, F64: pth.Float64, I64: pth.Int64,
}

// Torch is the torch element type of d ("float32"), "" when torch 1.13 has
// none (the unsigned types wider than a byte, the float8 types).
func (d DType) Torch() pth.DType { return torchTypes[d] }

// FromTorch is the element type for a torch dtype, "" when the format has
// none (complex types).
func FromTorch(t pth.DType) DType {
	for d, tt := range torchTypes {
		if tt == t {
			return d
		}
	}
	return ""
}

// decode converts little-endian elements into float64. The types torch
// shares go through torch's own codec (package pth); the unsigned types go
// here; float8 is carried as bytes but never decoded.
func decode(d DType, b []byte) ([]float64, error) {
	if t := d.Torch(); t != "" {
		return pth.DecodeElements(t, b)
	}
	es := d.Size()
	switch d {
	case U16, U32, U64:
	default:
		return nil, fmt.Errorf("dtype %s cannot be decoded to real numbers", d)
	}
	if len(b)%es != 0 {
		return nil, fmt.Errorf("%d bytes are not a whole number of %s elements", len(b), d)
	}
	out := make([]float64, len(b)/es)
	le := binary.LittleEndian
	for i := range out {
		switch d {
		case U16:
			out[i] = float64(le.Uint16(b[2*i:]))
		case U32:
			out[i] = float64(le.Uint32(b[4*i:]))
		case U64:
			out[i] = float64(le.Uint64(b[8*i:]))
		}
	}
	return out, nil
}

// encode converts v to little-endian elements, refusing values an integer
// type cannot hold exactly.
func encode(d DType, v []float64) ([]byte, error) {
	if t := d.Torch(); t != "" {
		return pth.EncodeElements(t, v)
	}
	var hi float64
	switch d {
	case U16:
		hi = math.MaxUint16
	case U32:
		hi = math.MaxUint32
	case U64:
		hi = 1 << 64
	default:
		return nil, fmt.Errorf("real numbers cannot be encoded as dtype %s", d)
	}
	es := d.Size()
	b := make([]byte, len(v)*es)
	le := binary.LittleEndian
	for i, x := range v {
		if x != math.Trunc(x) || x < 0 || x > hi || (d == U64 && x >= hi) {
			return nil, fmt.Errorf("element %d: value %v does not fit dtype %s", i, x, d)
		}
		switch d {
		case U16:
			le.PutUint16(b[2*i:], uint16(x))
		case U32:
			le.PutUint32(b[4*i:], uint32(x))
		case U64:
			le.PutUint64(b[8*i:], uint64(x))
		}
	}
	return b, nil
}
