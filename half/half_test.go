package half

import (
	"math"
	"testing"
)

func TestRoundTrip(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		x := Float16ToFloat(uint16(h))
		if math.IsNaN(x) {
			if !math.IsNaN(Float16ToFloat(Float16(x))) {
				t.Fatalf("NaN %#04x does not stay NaN", h)
			}
			continue
		}
		if got := Float16(x); got != uint16(h) {
			t.Fatalf("float16 %#04x: decoded %g, encoded back %#04x", h, x, got)
		}
		b := BFloat16ToFloat(uint16(h))
		if !math.IsNaN(b) && BFloat16(b) != uint16(h) {
			t.Fatalf("bfloat16 %#04x: decoded %g, encoded back %#04x", h, b, BFloat16(b))
		}
	}
}

func TestRounding(t *testing.T) {
	cases := []struct {
		x        float64
		f16, b16 uint16
	}{
		{1, 0x3c00, 0x3f80},
		{-2, 0xc000, 0xc000},
		{1 + 1.0/2048, 0x3c00, 0x3f80},       // float16 tie: to even
		{1 + 3.0/2048, 0x3c02, 0x3f80},       // float16 tie: up to even
		{65520, 0x7c00, 0x4780},              // float16 overflows to infinity
		{math.Ldexp(1, -25), 0x0000, 0x3300}, // half the smallest float16 subnormal: to even (zero)
		{math.Ldexp(3, -26), 0x0001, 0x3340}, // past half: up
		{math.Inf(-1), 0xfc00, 0xff80},
	}
	for _, c := range cases {
		if got := Float16(c.x); got != c.f16 {
			t.Errorf("Float16(%g) = %#04x, want %#04x", c.x, got, c.f16)
		}
		if got := BFloat16(c.x); got != c.b16 {
			t.Errorf("BFloat16(%g) = %#04x, want %#04x", c.x, got, c.b16)
		}
	}
}
