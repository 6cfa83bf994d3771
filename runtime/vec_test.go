package runtime

import (
	"math"
	"testing"
)

// TestVectorLoops checks the vector loops (AVX2 where the CPU has it)
// against the scalar formulas on random values of every magnitude, the
// special values, and lengths that leave every remainder.
func TestVectorLoops(t *testing.T) {
	state := uint64(3)
	next := func() float32 {
		state = state*6364136223846793005 + 1442695040888963407
		// Random sign, exponent and mantissa: magnitudes 2^-40 .. 2^23.
		u := uint32(state >> 32)
		mag := math.Ldexp(1+float64(u&0xffff)/65536, int(u>>16&63)-40)
		if u>>31 != 0 {
			mag = -mag
		}
		return float32(mag)
	}
	special := []float32{0, float32(math.Copysign(0, -1)), 1, -1, 20, -20, 87, -87, 88.7, -88.7, 103, -103, 104, -104, 707, -707, 709, -709, 800, -800,
		math.MaxFloat32, -math.MaxFloat32, float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()), 1e-45, -1e-45}
	same := func(a, b float32) bool { return a == b || (a != a && b != b) }
	for _, n := range []int{0, 1, 3, 4, 7, 8, 9, 15, 16, 17, 33, 1000} {
		s := make([]float32, n)
		g := make([]float32, n)
		for i := range s {
			s[i], g[i] = next(), next()
			if i%2 == 0 {
				// Where σ is neither 0 nor 1: |x| up to 16.
				s[i] = float32(math.Mod(float64(s[i]), 16))
			}
			if i < len(special) && n == 1000 {
				s[i] = special[i]
			}
		}
		y, want := make([]float32, n), make([]float32, n)
		silu(y, s)
		siluScalar(want, s)
		dx, wantDx := make([]float32, n), make([]float32, n)
		siluGrad(dx, g, s)
		siluGradScalar(wantDx, g, s)
		differ := 0
		for i := range s {
			if !same(y[i], want[i]) || !same(dx[i], wantDx[i]) {
				differ++
			}
			// One float32 rounding apart at most: the vector exp is
			// within 1e-14 of math.Exp.
			if !same(y[i], want[i]) && math.Abs(float64(y[i]-want[i])) > ulp32(want[i]) {
				t.Errorf("n=%d silu(%g) = %g, want %g", n, s[i], y[i], want[i])
			}
			if !same(dx[i], wantDx[i]) && math.Abs(float64(dx[i]-wantDx[i])) > ulp32(wantDx[i]) {
				t.Errorf("n=%d silu'(%g)*%g = %g, want %g", n, s[i], g[i], dx[i], wantDx[i])
			}
		}
		// A result within 1e-14 of the scalar one rounds to the same
		// float32 but for one value in millions; an error of 1e-8 (a
		// wrong polynomial coefficient) changes a fifth of them.
		if differ > n/100 {
			t.Errorf("n=%d: %d results differ from the scalar loop's", n, differ)
		}
		a := next()
		ya, wa := append([]float32(nil), g...), append([]float32(nil), g...)
		axpy(a, s, ya)
		for i, v := range s {
			wa[i] += a * v
		}
		d, wd := dot(s, g), float32(0)
		for i, v := range s {
			wd += v * g[i]
		}
		var mag float64
		for i, v := range s {
			mag += math.Abs(float64(v) * float64(g[i]))
			// A fused multiply-add rounds once, the scalar twice.
			if !same(ya[i], wa[i]) && math.Abs(float64(ya[i]-wa[i])) > 2*ulp32(wa[i])+ulp32(a*v) {
				t.Errorf("n=%d axpy[%d] = %g, want %g", n, i, ya[i], wa[i])
			}
		}
		if lim := float64(n+1) * mag * 6e-8; math.Abs(float64(d-wd)) > lim && !same(d, wd) {
			t.Errorf("n=%d dot = %g, want %g (limit %g)", n, d, wd, lim)
		}
	}
}

func ulp32(v float32) float64 {
	v = float32(math.Abs(float64(v)))
	return float64(math.Nextafter32(v, float32(math.Inf(1))) - v)
}
