package runtime

import "sync"

// GEMM: C = op(A)·op(B), or C += op(A)·op(B), on row-major float32
// matrices, blocked in the manner of Goto and van de Geijn: op(B) is packed
// in kc×nc blocks and op(A) in mc×kc blocks into panels of nr columns and mr
// rows, and a register-blocked micro-kernel multiplies one mr×kc panel by one
// kc×nr panel. Packing absorbs the transposes, so the three products a
// convolution and its backward need (NN, NT, TN) share one code path. The
// micro-kernel is assembly on amd64 CPUs with AVX2 and FMA (gemm_amd64.s),
// plain Go elsewhere and with the purego build tag.

// microKernel multiplies a packed mr×kc A panel by a packed kc×nr B panel and
// stores the product into c (row stride ldc), or adds it there when add.
type microKernel struct {
	mr, nr int
	fn     func(kc int, a, b, c []float32, ldc int, add bool)
}

const (
	gemmKC = 256
	gemmMC = 96 // a multiple of every kernel's mr
	gemmNC = 3072
)

// gemmKernel is the micro-kernel in use, chosen once for the CPU.
var gemmKernel = bestKernel()

var packPool = sync.Pool{New: func() any { return new([]float32) }}

func getBuf(n int) *[]float32 {
	p := packPool.Get().(*[]float32)
	if cap(*p) < n {
		*p = make([]float32, n)
	}
	*p = (*p)[:n]
	return p
}

// sgemm computes C (m×n, row stride ldc) = op(A)·op(B), or adds it into C
// when acc. op(A) is m×k: A is m×k with row stride lda, or k×m when ta. op(B)
// is k×n: B is k×n with row stride ldb, or n×k when tb.
func sgemm(ta, tb bool, m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	if m == 0 || n == 0 {
		return
	}
	mr := gemmKernel.mr
	abuf := getBuf(gemmKC * ((min(m, gemmMC) + mr - 1) / mr * mr))
	defer packPool.Put(abuf)
	getA := func(ic, pc, mc, kc int) []float32 {
		ap := *abuf
		packA(ta, a, lda, ic, pc, mc, kc, mr, ap)
		return ap
	}
	gemmCore(m, n, k, getA, tb, b, ldb, c, ldc, acc)
}

// packedA is op(A) packed once, block by block, for products that reuse it
// (a convolution's weights, for every image of a batch).
type packedA struct {
	m, k, mr int
	data     []float32
	// off[pc/gemmKC][ic/gemmMC] is where a block's panels start.
	off [][]int
}

func packAll(ta bool, a []float32, lda, m, k int) *packedA {
	p := newPackedA(m, k)
	p.data = make([]float32, p.size())
	p.pack(ta, a, lda, 0, p.blocks())
	return p
}

// newPackedA lays out a packed m×k op(A): where each mc×kc block's panels
// start in data, which the caller provides (p.size() values).
func newPackedA(m, k int) *packedA {
	mr := gemmKernel.mr
	p := &packedA{m: m, k: k, mr: mr}
	size := 0
	for pc := 0; pc < k; pc += gemmKC {
		var row []int
		for ic := 0; ic < m; ic += gemmMC {
			row = append(row, size)
			size += min(gemmKC, k-pc) * ((min(gemmMC, m-ic) + mr - 1) / mr * mr)
		}
		p.off = append(p.off, row)
	}
	p.off = append(p.off, []int{size}) // the end, for size()
	return p
}

// size is the number of values p.data holds.
func (p *packedA) size() int { return p.off[len(p.off)-1][0] }

// blocks is the number of mc×kc blocks, numbered k-block-major.
func (p *packedA) blocks() int { return (len(p.off) - 1) * ((p.m + gemmMC - 1) / gemmMC) }

// pack packs blocks [lo, hi) of op(A) into p.data; every value of a block's
// panels is written (padding included), so data may come from a pool.
// Blocks are independent: several goroutines may pack disjoint ranges.
func (p *packedA) pack(ta bool, a []float32, lda, lo, hi int) {
	per := (p.m + gemmMC - 1) / gemmMC
	for b := lo; b < hi; b++ {
		pc, ic := b/per*gemmKC, b%per*gemmMC
		packA(ta, a, lda, ic, pc, min(gemmMC, p.m-ic), min(gemmKC, p.k-pc), p.mr, p.data[p.off[pc/gemmKC][ic/gemmMC]:])
	}
}

// sgemmPacked is sgemm with op(A) packed by packAll.
func sgemmPacked(pa *packedA, tb bool, n int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	if pa.m == 0 || n == 0 {
		return
	}
	getA := func(ic, pc, mc, kc int) []float32 { return pa.data[pa.off[pc/gemmKC][ic/gemmMC]:] }
	gemmCore(pa.m, n, pa.k, getA, tb, b, ldb, c, ldc, acc)
}

// gemmCore runs the blocked loops; getA returns the packed panels of one
// mc×kc block of op(A).
func gemmCore(m, n, k int, getA func(ic, pc, mc, kc int) []float32, tb bool, b []float32, ldb int, c []float32, ldc int, acc bool) {
	if k == 0 {
		if !acc {
			for i := 0; i < m; i++ {
				clear(c[i*ldc : i*ldc+n])
			}
		}
		return
	}
	kern := gemmKernel
	mr, nr := kern.mr, kern.nr
	bbuf := getBuf(gemmKC * ((min(n, gemmNC) + nr - 1) / nr * nr))
	defer packPool.Put(bbuf)
	var tileBuf [64]float32
	tile := tileBuf[:]
	if mr*nr > len(tile) {
		tile = make([]float32, mr*nr)
	}
	for jc := 0; jc < n; jc += gemmNC {
		nc := min(gemmNC, n-jc)
		for pc := 0; pc < k; pc += gemmKC {
			kc := min(gemmKC, k-pc)
			// The first block of k overwrites C unless accumulating:
			// no clearing pass.
			add := acc || pc > 0
			bp := *bbuf
			packB(tb, b, ldb, pc, jc, kc, nc, nr, bp)
			for ic := 0; ic < m; ic += gemmMC {
				mc := min(gemmMC, m-ic)
				ap := getA(ic, pc, mc, kc)
				for jr := 0; jr < nc; jr += nr {
					cols := min(nr, nc-jr)
					bpan := bp[jr*kc : jr*kc+kc*nr]
					for ir := 0; ir < mc; ir += mr {
						rows := min(mr, mc-ir)
						apan := ap[ir*kc : ir*kc+kc*mr]
						ci := (ic+ir)*ldc + jc + jr
						if rows == mr && cols == nr {
							kern.fn(kc, apan, bpan, c[ci:], ldc, add)
							continue
						}
						t := tile[:mr*nr]
						kern.fn(kc, apan, bpan, t, nr, false)
						for i := 0; i < rows; i++ {
							row := c[ci+i*ldc : ci+i*ldc+cols]
							tr := t[i*nr : i*nr+cols]
							if !add {
								copy(row, tr)
								continue
							}
							for j := range row {
								row[j] += tr[j]
							}
						}
					}
				}
			}
		}
	}
}

// packA copies op(A)[i0:i0+mc, p0:p0+kc] into panels of mr rows, each laid
// out p-major (mr values per p), zero-padding the last panel.
func packA(ta bool, a []float32, lda, i0, p0, mc, kc, mr int, dst []float32) {
	for ir := 0; ir < mc; ir += mr {
		rows := min(mr, mc-ir)
		pan := dst[ir*kc : ir*kc+kc*mr]
		if ta {
			// A is k×m: row p of A holds column p of op(A).
			for p := 0; p < kc; p++ {
				src := a[(p0+p)*lda+i0+ir:]
				d := pan[p*mr : p*mr+mr]
				copy(d[:rows], src[:rows])
				clear(d[rows:])
			}
			continue
		}
		if rows == 6 && mr == 6 {
			// The AVX2 kernel's panels: six rows read side by side and
			// written in order, without the bounds checks of the
			// general loop (a convolution packs its whole weight tensor
			// on every call: 14% of a resnet50 verify).
			o := (i0+ir)*lda + p0
			r0, r1, r2 := a[o:o+kc], a[o+lda:o+lda+kc], a[o+2*lda:o+2*lda+kc]
			r3, r4, r5 := a[o+3*lda:o+3*lda+kc], a[o+4*lda:o+4*lda+kc], a[o+5*lda:o+5*lda+kc]
			pan = pan[:6*kc]
			for p := range kc {
				d := pan[p*6 : p*6+6 : p*6+6]
				d[0], d[1], d[2], d[3], d[4], d[5] = r0[p], r1[p], r2[p], r3[p], r4[p], r5[p]
			}
			continue
		}
		for i := 0; i < rows; i++ {
			src := a[(i0+ir+i)*lda+p0 : (i0+ir+i)*lda+p0+kc]
			for p, v := range src {
				pan[p*mr+i] = v
			}
		}
		for i := rows; i < mr; i++ {
			for p := 0; p < kc; p++ {
				pan[p*mr+i] = 0
			}
		}
	}
}

// packB copies op(B)[p0:p0+kc, j0:j0+nc] into panels of nr columns, each
// laid out p-major (nr values per p), zero-padding the last panel.
func packB(tb bool, b []float32, ldb, p0, j0, kc, nc, nr int, dst []float32) {
	for jr := 0; jr < nc; jr += nr {
		cols := min(nr, nc-jr)
		pan := dst[jr*kc : jr*kc+kc*nr]
		if !tb {
			for p := 0; p < kc; p++ {
				src := b[(p0+p)*ldb+j0+jr:]
				d := pan[p*nr : p*nr+nr]
				copy(d[:cols], src[:cols])
				clear(d[cols:])
			}
			continue
		}
		// B is n×k: row j of B holds column j of op(B).
		for j := 0; j < cols; j++ {
			src := b[(j0+jr+j)*ldb+p0 : (j0+jr+j)*ldb+p0+kc]
			for p, v := range src {
				pan[p*nr+j] = v
			}
		}
		for j := cols; j < nr; j++ {
			for p := 0; p < kc; p++ {
				pan[p*nr+j] = 0
			}
		}
	}
}

// genericKernel is the plain-Go micro-kernel: 4×4, sixteen accumulators
// that fit the x86-64 floating-point registers.
var genericKernel = microKernel{mr: 4, nr: 4, fn: kernel4x4}

func kernel4x4(kc int, a, b, c []float32, ldc int, add bool) {
	var c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 float32
	a = a[:kc*4]
	b = b[:kc*4]
	for p := 0; p < kc; p++ {
		ap := a[p*4 : p*4+4 : p*4+4]
		bp := b[p*4 : p*4+4 : p*4+4]
		a0, a1, a2, a3 := ap[0], ap[1], ap[2], ap[3]
		b0, b1, b2, b3 := bp[0], bp[1], bp[2], bp[3]
		c00 += a0 * b0
		c01 += a0 * b1
		c02 += a0 * b2
		c03 += a0 * b3
		c10 += a1 * b0
		c11 += a1 * b1
		c12 += a1 * b2
		c13 += a1 * b3
		c20 += a2 * b0
		c21 += a2 * b1
		c22 += a2 * b2
		c23 += a2 * b3
		c30 += a3 * b0
		c31 += a3 * b1
		c32 += a3 * b2
		c33 += a3 * b3
	}
	store4(c[0:4:4], c00, c01, c02, c03, add)
	store4(c[ldc:ldc+4:ldc+4], c10, c11, c12, c13, add)
	store4(c[2*ldc:2*ldc+4:2*ldc+4], c20, c21, c22, c23, add)
	store4(c[3*ldc:3*ldc+4:3*ldc+4], c30, c31, c32, c33, add)
}

func store4(r []float32, a, b, c, d float32, add bool) {
	if add {
		a, b, c, d = a+r[0], b+r[1], c+r[2], d+r[3]
	}
	r[0], r[1], r[2], r[3] = a, b, c, d
}
