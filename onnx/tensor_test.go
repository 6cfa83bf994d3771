package onnx

import (
	"errors"
	"math"
	"testing"

	"github.com/abnconvert/abnconvert/half"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

func TestFloat16Rounding(t *testing.T) {
	cases := []struct {
		in   float64
		bits uint16
	}{
		{0, 0x0000},
		{math.Copysign(0, -1), 0x8000},
		{1, 0x3c00},
		{-2, 0xc000},
		{65504, 0x7bff},                  // largest half
		{65519, 0x7bff},                  // rounds down
		{65520, 0x7c00},                  // halfway to 2^16: ties to even, which is infinity
		{math.Inf(1), 0x7c00},            //
		{math.Ldexp(1, -24), 0x0001},     // smallest subnormal
		{math.Ldexp(1, -25), 0x0000},     // halfway to it: ties to even (0)
		{math.Ldexp(3, -26), 0x0001},     // 0.75 of it rounds up
		{math.Ldexp(1, -14), 0x0400},     // smallest normal
		{math.Ldexp(1023, -24), 0x03ff},  // largest subnormal
		{math.Ldexp(2047, -25), 0x0400},  // rounds up from subnormal into normal
		{0.1, 0x2e66},                    // 0.0999755859375
		{1 + math.Ldexp(1, -11), 0x3c00}, // tie between 1 and 1+2^-10: even is 1
		{1 + math.Ldexp(3, -11), 0x3c02}, // tie between 1+2^-10 and 1+2^-9: even is the latter
		{1 + math.Ldexp(1, -11) + 1e-9, 0x3c01},
	}
	for _, c := range cases {
		if got := half.Float16(c.in); got != c.bits {
			t.Errorf("float16(%g) = %#04x, want %#04x", c.in, got, c.bits)
		}
	}
	// Every finite half survives decode then encode.
	for h := 0; h < 1<<16; h++ {
		if (h>>10)&0x1f == 0x1f {
			continue
		}
		if got := half.Float16(half.Float16ToFloat(uint16(h))); got != uint16(h) {
			t.Fatalf("half %#04x: decoded %g, re-encoded %#04x", h, half.Float16ToFloat(uint16(h)), got)
		}
	}
	if !math.IsNaN(half.Float16ToFloat(half.Float16(math.NaN()))) {
		t.Error("NaN did not survive")
	}
}

func TestBfloat16Rounding(t *testing.T) {
	cases := []struct {
		in   float64
		bits uint16
	}{
		{1, 0x3f80},
		{-1, 0xbf80},
		{3.140625, 0x4049},
		{1 + math.Ldexp(1, -8), 0x3f80}, // tie: even
		{1 + math.Ldexp(3, -8), 0x3f82},
		{math.MaxFloat32, 0x7f80}, // rounds up into infinity
		{math.Ldexp(1, -133), 0x0001},
	}
	for _, c := range cases {
		if got := half.BFloat16(c.in); got != c.bits {
			t.Errorf("bfloat16(%g) = %#04x, want %#04x", c.in, got, c.bits)
		}
	}
	// bfloat16 is the top half of a float32: agree with it where float32
	// rounding cannot interfere (values exactly representable in float32).
	for _, f := range []float32{0.15625, -7.5, 1e-30, 3e38} {
		want := uint16(math.Float32bits(f) >> 16)
		if math.Float32bits(f)&0xffff == 0 && half.BFloat16(float64(f)) != want {
			t.Errorf("bfloat16(%g) = %#04x, want %#04x", f, half.BFloat16(float64(f)), want)
		}
	}
}

func dtp(dt int32) *int32 { return &dt }

// TestTensorCodec decodes each data type from raw_data and from its typed
// field, re-encodes changed values and checks that the data type and the
// kind of field are kept.
func TestTensorCodec(t *testing.T) {
	vals := []float64{1, -2, 0.5, 3}
	cases := []struct {
		name string
		t    *pb.TensorProto
		want []float64
	}{
		{"float raw", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{4}, RawData: f32bytes(1, -2, 0.5, 3)}, vals},
		{"float typed", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{2, 2}, FloatData: []float32{1, -2, 0.5, 3}}, vals},
		{"double raw", &pb.TensorProto{DataType: dtp(dtDouble), Dims: []int64{4}, RawData: rawOfValues(dtDouble, vals)}, vals},
		{"double typed", &pb.TensorProto{DataType: dtp(dtDouble), Dims: []int64{4}, DoubleData: vals}, vals},
		{"float16 raw", &pb.TensorProto{DataType: dtp(dtFloat16), Dims: []int64{4}, RawData: []byte{0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38, 0x00, 0x42}}, vals},
		{"float16 typed", &pb.TensorProto{DataType: dtp(dtFloat16), Dims: []int64{4}, Int32Data: []int32{0x3c00, 0xc000, 0x3800, 0x4200}}, vals},
		{"bfloat16 raw", &pb.TensorProto{DataType: dtp(dtBfloat16), Dims: []int64{4}, RawData: []byte{0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f, 0x40, 0x40}}, vals},
		{"bfloat16 typed", &pb.TensorProto{DataType: dtp(dtBfloat16), Dims: []int64{4}, Int32Data: []int32{0x3f80, 0xc000, 0x3f00, 0x4040}}, vals},
		{"int64 raw", &pb.TensorProto{DataType: dtp(dtInt64), Dims: []int64{3}, RawData: rawOfValues(dtInt64, []float64{7, -1, 1 << 40})}, []float64{7, -1, 1 << 40}},
		{"int64 typed", &pb.TensorProto{DataType: dtp(dtInt64), Dims: []int64{3}, Int64Data: []int64{7, -1, 1 << 40}}, []float64{7, -1, 1 << 40}},
		{"int32 typed", &pb.TensorProto{DataType: dtp(dtInt32), Dims: []int64{2}, Int32Data: []int32{-5, 9}}, []float64{-5, 9}},
		{"int8 typed", &pb.TensorProto{DataType: dtp(dtInt8), Dims: []int64{2}, Int32Data: []int32{-100, 127}}, []float64{-100, 127}},
		{"uint8 raw", &pb.TensorProto{DataType: dtp(dtUint8), Dims: []int64{2}, RawData: []byte{0, 255}}, []float64{0, 255}},
		{"bool raw", &pb.TensorProto{DataType: dtp(dtBool), Dims: []int64{2}, RawData: []byte{1, 0}}, []float64{1, 0}},
		{"scalar", &pb.TensorProto{DataType: dtp(dtFloat), RawData: f32bytes(2.5)}, []float64{2.5}},
		{"empty", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{0, 3}}, []float64{}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			td, err := inspectTensor(c.t, t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			got, err := td.values()
			if err != nil {
				t.Fatal(err)
			}
			if !equalFloats(got, c.want) {
				t.Fatalf("decoded %v, want %v", got, c.want)
			}
			// Negate, encode, decode: same type, same field kind.
			neg := make([]float64, len(got))
			for i, v := range got {
				neg[i] = -v
				if c.t.GetDataType() == dtUint8 || c.t.GetDataType() == dtBool {
					neg[i] = v // unsigned: keep in range
				}
			}
			enc, err := encodeTensor(c.t, neg)
			if err != nil {
				t.Fatal(err)
			}
			if enc.GetDataType() != c.t.GetDataType() || (enc.RawData != nil) != (c.t.RawData != nil) {
				t.Fatalf("re-encoded as type %d raw=%v, was type %d raw=%v", enc.GetDataType(), enc.RawData != nil, c.t.GetDataType(), c.t.RawData != nil)
			}
			td2, err := inspectTensor(enc, t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			back, err := td2.values()
			if err != nil {
				t.Fatal(err)
			}
			if !equalFloats(back, neg) {
				t.Fatalf("round trip gave %v, want %v", back, neg)
			}
		})
	}
}

func equalFloats(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestTensorSizeChecks(t *testing.T) {
	cases := []struct {
		name string
		t    *pb.TensorProto
		want error
	}{
		{"raw too short", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{4}, RawData: f32bytes(1, 2, 3)}, ErrMalformed},
		{"raw too long", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{2}, RawData: f32bytes(1, 2, 3)}, ErrMalformed},
		{"typed too short", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{4}, FloatData: []float32{1}}, ErrMalformed},
		{"negative dim", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{-1}, RawData: f32bytes()}, ErrMalformed},
		{"overflowing dims", &pb.TensorProto{DataType: dtp(dtFloat), Dims: []int64{1 << 30, 1 << 30, 1 << 30}, RawData: f32bytes(1)}, ErrMalformed},
		{"huge dims, no data", &pb.TensorProto{DataType: dtp(dtDouble), Dims: []int64{1 << 39}}, ErrMalformed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := inspectTensor(c.t, t.TempDir())
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
		})
	}
	// A string tensor is carried, not decoded.
	td, err := inspectTensor(&pb.TensorProto{DataType: dtp(int32(pb.TensorProto_STRING)), Dims: []int64{1}, StringData: [][]byte{[]byte("a")}}, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := td.values(); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("decoding a string tensor: %v", err)
	}
	// Integers must not wrap around when written.
	if _, err := encodeTensor(&pb.TensorProto{DataType: dtp(dtInt8), Dims: []int64{1}, Int32Data: []int32{1}}, []float64{200}); err == nil {
		t.Fatal("200 encoded into int8")
	}
}
