package runtime

import (
	"math"
	"testing"
)

// TestGEMM checks sgemm against the definition on integer-valued matrices
// (exact in float32), for every transpose, sizes that leave partial
// micro-tiles and cross the blocking sizes, and both overwrite and
// accumulate; and sgemmPar's column split and the pre-packed path the same
// way.
func TestGEMM(t *testing.T) {
	defer func(k microKernel) { gemmKernel = k }(gemmKernel)
	for _, k := range []microKernel{genericKernel, bestKernel()} {
		gemmKernel = k
		testGEMM(t)
	}
}

func testGEMM(t *testing.T) {
	sizes := [][3]int{{1, 1, 1}, {7, 9, 13}, {5, 17, 300}, {100, 70, 9}, {13, 33, 600}, {97, 200, 3}, {20, 300, 50}}
	for _, d := range sizes {
		m, n, k := d[0], d[1], d[2]
		for _, ta := range []bool{false, true} {
			for _, tb := range []bool{false, true} {
				for _, acc := range []bool{false, true} {
					a, b := make([]float32, m*k), make([]float32, k*n)
					for i := range a {
						a[i] = float32((i*7)%11) - 5
					}
					for i := range b {
						b[i] = float32((i*3)%13) - 6
					}
					lda, ldb, ldc := k, n, n+3
					if ta {
						lda = m
					}
					if tb {
						ldb = k
					}
					for _, run := range []struct {
						par    int
						packed bool
					}{{1, false}, {3, false}, {1, true}, {3, true}} {
						par := run.par
						c := make([]float32, m*ldc)
						for i := range c {
							c[i] = 2
						}
						if run.packed {
							sgemmParPacked(par, packAll(ta, a, lda, m, k), tb, n, b, ldb, c, ldc, acc)
						} else {
							sgemmPar(par, ta, tb, m, n, k, a, lda, b, ldb, c, ldc, acc)
						}
						for i := 0; i < m; i++ {
							for j := 0; j < ldc; j++ {
								want := float32(2)
								if j < n {
									var s float32
									for p := 0; p < k; p++ {
										av, bv := a[i*k+p], b[p*n+j]
										if ta {
											av = a[p*m+i]
										}
										if tb {
											bv = b[j*k+p]
										}
										s += av * bv
									}
									want = s
									if acc {
										want += 2
									}
								}
								if c[i*ldc+j] != want {
									t.Fatalf("kernel %dx%d: %dx%dx%d ta=%v tb=%v acc=%v %+v: c[%d,%d] = %g, want %g", gemmKernel.mr, gemmKernel.nr, m, n, k, ta, tb, acc, run, i, j, c[i*ldc+j], want)
								}
							}
						}
					}
				}
			}
		}
	}
	t.Logf("micro-kernel: %s", KernelName())
}

// TestPackedABlocks checks that packing a packedA block by block, in any
// order, into a buffer holding garbage (a pooled one) gives packAll's data:
// every value of every panel, padding included, is written (packGroups
// relies on both), for both kernels' panel heights and both transposes.
func TestPackedABlocks(t *testing.T) {
	defer func(k microKernel) { gemmKernel = k }(gemmKernel)
	for _, kern := range []microKernel{genericKernel, bestKernel()} {
		gemmKernel = kern
		for _, d := range [][2]int{{1, 1}, {6, 7}, {13, 300}, {97, 513}, {200, 40}, {0, 5}, {5, 0}} {
			m, k := d[0], d[1]
			for _, ta := range []bool{false, true} {
				a := make([]float32, m*k)
				for i := range a {
					a[i] = float32(i%97) + 0.5
				}
				lda := k
				if ta {
					lda = m
				}
				want := packAll(ta, a, lda, m, k)
				p := newPackedA(m, k)
				p.data = make([]float32, p.size())
				for i := range p.data {
					p.data[i] = float32(math.NaN())
				}
				for b := p.blocks() - 1; b >= 0; b-- {
					p.pack(ta, a, lda, b, b+1)
				}
				if len(p.data) != len(want.data) {
					t.Fatalf("mr %d, %dx%d, ta %v: %d values, want %d", kern.mr, m, k, ta, len(p.data), len(want.data))
				}
				for i := range p.data {
					if p.data[i] != want.data[i] {
						t.Fatalf("mr %d, %dx%d, ta %v: value %d is %v, want %v", kern.mr, m, k, ta, i, p.data[i], want.data[i])
					}
				}
			}
		}
	}
}
