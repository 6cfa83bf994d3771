package pth

import "fmt"

// DecodeElements converts little-endian elements of dtype d into float64,
// exactly as Values does for a checkpoint tensor. Other formats that share
// torch's element types (safetensors) decode through it, so that every
// reader rounds and refuses the same way.
func DecodeElements(d DType, b []byte) ([]float64, error) {
	es := d.Size()
	if es == 0 || d == Complex64 || d == Complex128 {
		return nil, fmt.Errorf("dtype %s cannot be decoded to real numbers", d)
	}
	if len(b)%es != 0 {
		return nil, fmt.Errorf("%d bytes are not a whole number of %s elements", len(b), d)
	}
	out := make([]float64, len(b)/es)
	return out, decode(d, b, out)
}

// EncodeElements converts v into little-endian elements of dtype d: floats
// round to nearest, ties to even; integer and bool types refuse values they
// cannot hold exactly (see SetValues).
func EncodeElements(d DType, v []float64) ([]byte, error) {
	if d.Size() == 0 || d == Complex64 || d == Complex128 {
		return nil, fmt.Errorf("real numbers cannot be encoded as dtype %s", d)
	}
	return encode(d, v)
}
