package pth

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/half"
)

// TestRoundingMatchesTorch compares float16 and bfloat16 encoding with
// torch's own conversion of the same float32 values (random magnitudes,
// overflow, subnormals, ties), from testdata/rounding.json.
func TestRoundingMatchesTorch(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("testdata", "rounding.json"))
	if err != nil {
		t.Fatal(err)
	}
	var r struct {
		Inputs   []float64 `json:"inputs"`
		Float16  []uint16  `json:"float16"`
		BFloat16 []uint16  `json:"bfloat16"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	for i, x := range r.Inputs {
		if got := half.Float16(x); got != r.Float16[i] {
			t.Errorf("float16(%g) = %#04x, torch %#04x", x, got, r.Float16[i])
		}
		if got := half.BFloat16(x); got != r.BFloat16[i] {
			t.Errorf("bfloat16(%g) = %#04x, torch %#04x", x, got, r.BFloat16[i])
		}
		if h := half.Float16ToFloat(r.Float16[i]); !math.IsInf(h, 0) && math.Abs(h-x) > math.Abs(x)/1024+6e-8 {
			t.Errorf("half.Float16ToFloat(%#04x) = %g, far from %g", r.Float16[i], h, x)
		}
	}
}

// TestRoundingCases pins the rules on hand-computed cases, including ones
// where rounding through float32 first would round twice and differ.
func TestRoundingCases(t *testing.T) {
	cases := []struct {
		x        float64
		f16, b16 uint16
	}{
		{1, 0x3c00, 0x3f80},
		{-2, 0xc000, 0xc000},
		{1 + 1.0/2048, 0x3c00, 0x3f80},               // tie, stays even
		{1 + 3.0/2048, 0x3c02, 0x3f80},               // tie, rounds up to even
		{1 + 1.0/2048 + 1.0/(1<<40), 0x3c01, 0x3f80}, // just above the tie: a float32 detour would land on the tie
		{1 + 1.0/256 + 1.0/(1<<30), 0x3c04, 0x3f81},  // same for bfloat16
		{65504, 0x7bff, 0x4780},                      // bfloat16: 0x477fe000 rounds up
		{65520, 0x7c00, 0x4780},                      // overflows float16
		{math.Ldexp(1, -24), 0x0001, 0x3380},         // smallest float16 subnormal
		{math.Ldexp(1, -25), 0x0000, 0x3300},         // tie with zero: even
		{math.Ldexp(3, -26), 0x0001, 0x3340},
		{math.Inf(-1), 0xfc00, 0xff80},
		{0, 0, 0},
		{math.Copysign(0, -1), 0x8000, 0x8000},
		{1e-320, 0, 0},
	}
	for _, c := range cases {
		if got := half.Float16(c.x); got != c.f16 {
			t.Errorf("float16(%g) = %#04x, want %#04x", c.x, got, c.f16)
		}
		if got := half.BFloat16(c.x); got != c.b16 {
			t.Errorf("bfloat16(%g) = %#04x, want %#04x", c.x, got, c.b16)
		}
	}
	if !math.IsNaN(half.Float16ToFloat(half.Float16(math.NaN()))) {
		t.Errorf("NaN does not survive float16")
	}
}

// TestEncodeRefuses: integer and bool dtypes take only values they hold
// exactly.
func TestEncodeRefuses(t *testing.T) {
	cases := []struct {
		d DType
		v float64
	}{
		{Int64, 0.5}, {Int64, 1 << 63}, {Int32, 1 << 31}, {Int16, -40000}, {Int8, 128},
		{Uint8, -1}, {Uint8, 256}, {Bool, 2}, {Bool, 0.5}, {Complex64, 1},
	}
	for _, c := range cases {
		if _, err := encode(c.d, []float64{c.v}); err == nil {
			t.Errorf("encode(%s, %v) succeeded", c.d, c.v)
		}
	}
	b, err := encode(Int64, []float64{-(1 << 40), 7})
	if err != nil {
		t.Fatal(err)
	}
	out := make([]float64, 2)
	if decode(Int64, b, out); out[0] != -(1<<40) || out[1] != 7 {
		t.Errorf("int64 round trip: %v", out)
	}
	c := openFixture(t, "dtypes")
	if err := c.SetValues("u8", []float64{1, 2, 300}); err == nil || !strings.Contains(err.Error(), "u8") {
		t.Errorf("SetValues out of uint8 range: %v", err)
	}
	if err := c.SetValues("f32", []float64{1}); err == nil {
		t.Errorf("SetValues with the wrong length succeeded")
	}
}

// SetValues keeps its own copy, reused when set again: neither the slice
// given nor one Values returned is the store's, so no caller changes what
// is written, and setting again changes no slice a caller holds.
func TestSetValuesOwnsItsCopy(t *testing.T) {
	c := openFixture(t, "dtypes")
	first := []float64{1, 2, 3}
	if n, _ := c.Shape("i32"); len(n) != 1 || n[0] != 3 {
		t.Fatalf("fixture's i32 has shape %v, the test wants [3]", n)
	}
	if err := c.SetValues("i32", first); err != nil {
		t.Fatal(err)
	}
	first[0] = 100 // the caller's slice, changed after
	got, err := c.Values("i32")
	if err != nil {
		t.Fatal(err)
	}
	if got[0] != 1 {
		t.Fatalf("Values = %v after the caller changed its slice, want [1 2 3]", got)
	}
	if err := c.SetValues("i32", []float64{4, 5, 6}); err != nil {
		t.Fatal(err)
	}
	if got[0] != 1 || got[1] != 2 || got[2] != 3 {
		t.Errorf("a slice Values returned changed to %v when the values were set again", got)
	}
	again, _ := c.Values("i32")
	if again[0] != 4 || again[2] != 6 {
		t.Errorf("Values = %v after the second SetValues, want [4 5 6]", again)
	}
}

// BenchmarkEncode encodes a BN vector's worth of float32 values, as a
// conversion's plan does for every rewritten vector.
func BenchmarkEncode(b *testing.B) {
	v := make([]float64, 1024)
	for i := range v {
		v[i] = float64(i) * 0.37
	}
	b.SetBytes(int64(len(v)) * 4)
	for b.Loop() {
		if _, err := encode(Float32, v); err != nil {
			b.Fatal(err)
		}
	}
}
