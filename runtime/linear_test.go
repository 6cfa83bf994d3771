package runtime

import (
	"math"
	"testing"
)

// TestLinearRows checks the linear layer forward and backward against the
// definition in float64, at batches on both sides of linearRows (row by
// row and through the GEMM), with and without bias, on 1 and 3 threads,
// at sizes that leave vector tails and split unevenly.
func TestLinearRows(t *testing.T) {
	for _, threads := range []int{1, 3} {
		b := NewCPU(threads)
		for _, d := range [][3]int{{1, 1, 1}, {2, 37, 300}, {4, 513, 70}, {3, 9, 4000}, {5, 37, 300}, {8, 20, 17}} {
			n, out, in := d[0], d[1], d[2]
			for _, bias := range []bool{false, true} {
				x, w, dy := make([]float32, n*in), make([]float32, out*in), make([]float32, n*out)
				for i := range x {
					x[i] = float32(math.Sin(float64(i)*0.7)) * 2
				}
				for i := range w {
					w[i] = float32(math.Cos(float64(i)*1.3)) / 10
				}
				for i := range dy {
					dy[i] = float32(math.Sin(float64(i)*2.1 + 1))
				}
				bv := make([]float32, out)
				for i := range bv {
					bv[i] = float32(i%7) - 3
				}
				up := func(shape []int, v []float32) Tensor {
					tt, err := b.Alloc(shape, Float32)
					if err != nil {
						t.Fatal(err)
					}
					if v != nil {
						if err := b.Upload(tt, v); err != nil {
							t.Fatal(err)
						}
					}
					return tt
				}
				down := func(tt Tensor, size int) []float32 {
					v := make([]float32, size)
					if err := b.Download(tt, v); err != nil {
						t.Fatal(err)
					}
					return v
				}
				xt, wt, dyt := up([]int{n, in}, x), up([]int{out, in}, w), up([]int{n, out}, dy)
				var bt Tensor
				if bias {
					bt = up([]int{out}, bv)
				}
				// Outputs hold garbage first: every value must be written.
				junk := func(size int) []float32 {
					v := make([]float32, size)
					for i := range v {
						v[i] = 7
					}
					return v
				}
				yt, dxt, dwt := up([]int{n, out}, junk(n*out)), up([]int{n, in}, junk(n*in)), up([]int{out, in}, junk(out*in))
				if err := b.Linear(yt, xt, wt, bt); err != nil {
					t.Fatal(err)
				}
				if err := b.LinearBackward(dxt, dwt, nil, dyt, xt, wt); err != nil {
					t.Fatal(err)
				}
				y, dx, dw := down(yt, n*out), down(dxt, n*in), down(dwt, out*in)
				near := func(what string, got float32, want, scale float64) {
					t.Helper()
					if math.Abs(float64(got)-want) > 1e-5*scale+1e-6 {
						t.Fatalf("threads %d, %dx%d·%dx%dᵀ, bias %v: %s = %v, want %v", threads, n, in, out, in, bias, what, got, want)
					}
				}
				for i := 0; i < n; i++ {
					for o := 0; o < out; o++ {
						var s, a float64
						for k := 0; k < in; k++ {
							s += float64(x[i*in+k]) * float64(w[o*in+k])
							a += math.Abs(float64(x[i*in+k]) * float64(w[o*in+k]))
						}
						if bias {
							s += float64(bv[o])
						}
						near("y", y[i*out+o], s, a)
					}
					for k := 0; k < in; k++ {
						var s, a float64
						for o := 0; o < out; o++ {
							s += float64(dy[i*out+o]) * float64(w[o*in+k])
							a += math.Abs(float64(dy[i*out+o]) * float64(w[o*in+k]))
						}
						near("dx", dx[i*in+k], s, a)
					}
				}
				for o := 0; o < out; o++ {
					for k := 0; k < in; k++ {
						var s, a float64
						for i := 0; i < n; i++ {
							s += float64(dy[i*out+o]) * float64(x[i*in+k])
							a += math.Abs(float64(dy[i*out+o]) * float64(x[i*in+k]))
						}
						near("dw", dw[o*in+k], s, a)
					}
				}
			}
		}
	}
}
