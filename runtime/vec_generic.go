//go:build !amd64 || purego

package runtime

// axpy adds a*x to y (len(y) >= len(x)).
func axpy(a float32, x, y []float32) {
	y = y[:len(x)]
	for i, v := range x {
		y[i] += a * v
	}
}

// dot is the sum of x[i]*y[i] (len(y) >= len(x)), in float32.
func dot(x, y []float32) float32 {
	y = y[:len(x)]
	var s float32
	for i, v := range x {
		s += v * y[i]
	}
	return s
}

func silu(d, s []float32) { siluScalar(d, s) }

func siluGrad(d, g, s []float32) { siluGradScalar(d, g, s) }
