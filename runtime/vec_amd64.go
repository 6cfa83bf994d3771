//go:build amd64 && !purego

package runtime

import "unsafe"

//go:noescape
func axpyAVX(n int, a float32, x, y *float32)

//go:noescape
func dotAVX(n int, x, y *float32) float32

//go:noescape
func siluAVX(n int, x, y *float32)

//go:noescape
func siluGradAVX(n int, x, gy, d *float32)

var vecAVX = hasAVX2FMA()

// silu writes d = x·σ(x) for x in s (len(d) >= len(s)), computed in
// float64 and rounded once, as activateSmooth does. The vector loop is the
// same formula four lanes at a time; scalar code spent 12 ns an element,
// most of an efficientnet training step.
func silu(d, s []float32) {
	d = d[:len(s)]
	n := 0
	if vecAVX && len(s) >= 4 {
		n = len(s) &^ 3
		siluAVX(n, unsafe.SliceData(s), unsafe.SliceData(d))
	}
	siluScalar(d[n:], s[n:])
}

// siluGrad writes d = g·σ(x)·(1 + x·(1 − σ(x))) for x in s (d may be g).
func siluGrad(d, g, s []float32) {
	d, g = d[:len(s)], g[:len(s)]
	n := 0
	if vecAVX && len(s) >= 4 {
		n = len(s) &^ 3
		siluGradAVX(n, unsafe.SliceData(s), unsafe.SliceData(g), unsafe.SliceData(d))
	}
	siluGradScalar(d[n:], g[n:], s[n:])
}

// axpy adds a*x to y (len(y) >= len(x)). With AVX2 and FMA each product is
// fused with its sum (one rounding, as in the GEMM kernel).
func axpy(a float32, x, y []float32) {
	y = y[:len(x)]
	n := 0
	if vecAVX && len(x) >= 8 {
		n = len(x) &^ 7
		axpyAVX(n, a, unsafe.SliceData(x), unsafe.SliceData(y))
	}
	for i := n; i < len(x); i++ {
		y[i] += a * x[i]
	}
}

// dot is the sum of x[i]*y[i] (len(y) >= len(x)), in float32.
func dot(x, y []float32) float32 {
	y = y[:len(x)]
	n := 0
	var s float32
	if vecAVX && len(x) >= 8 {
		n = len(x) &^ 7
		s = dotAVX(n, unsafe.SliceData(x), unsafe.SliceData(y))
	}
	for i := n; i < len(x); i++ {
		s += x[i] * y[i]
	}
	return s
}
