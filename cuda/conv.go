package cuda

import (
	"fmt"

	"github.com/abnconvert/abnconvert/runtime"
)

// colBudget bounds the im2col scratch buffer: the images of a batch are
// unfolded and multiplied in chunks of at most this many bytes (and at
// least one image).
const colBudget = 64 << 20

// gemmCall is one (batched) matrix product; see kernels/gemm.cu.
type gemmCall struct {
	c, a, b       uint64
	m, n, k       int
	lda, ldb, ldc int
	sa, sb, sc    int64 // batch strides in floats
	ta, tb, acc   bool
	batch         int
}

// gemm launches g, in runs of at most maxGridYZ batch entries.
func (b *Backend) gemm(g gemmCall) error {
	if g.m == 0 || g.n == 0 || g.batch == 0 {
		return nil
	}
	for z := 0; z < g.batch; z += maxGridYZ {
		nb := min(g.batch-z, maxGridYZ)
		d, err := gemmDims(g.m, g.n, nb)
		if err != nil {
			return err
		}
		off := func(p uint64, s int64) uint64 { return p + uint64(int64(z)*s*4) }
		if err := b.launch(kSgemm, d, ptr(off(g.c, g.sc)), ptr(off(g.a, g.sa)), ptr(off(g.b, g.sb)),
			i32(g.m), i32(g.n), i32(g.k), i32(g.lda), i32(g.ldb), i32(g.ldc), i64(g.sa), i64(g.sb), i64(g.sc),
			boolArg(g.ta), boolArg(g.tb), boolArg(g.acc)); err != nil {
			return err
		}
	}
	return nil
}

// convGeom is a convolution's sizes, checked as the CPU backend checks
// them.
type convGeom struct {
	n, c, h, w int // input
	o, kh, kw  int // weight: o outputs, c/g inputs each
	oh, ow     int // output
	g, cg, og  int // groups and channels per group
	k, l       int // GEMM depth (cg*kh*kw) and output plane size
	direct     bool
	p          runtime.ConvParams
}

func convGeometry(x, w, y []int, p runtime.ConvParams) (convGeom, error) {
	if len(x) != 4 || len(w) != 4 || len(y) != 4 {
		return convGeom{}, fmt.Errorf("cuda: conv2d shapes %v, %v, %v: want 4 dimensions", x, w, y)
	}
	g := convGeom{n: x[0], c: x[1], h: x[2], w: x[3], o: w[0], kh: w[2], kw: w[3], oh: y[2], ow: y[3], g: p.Groups, p: p}
	for _, s := range [][2]int{p.Stride, p.Dilation} {
		if s[0] < 1 || s[1] < 1 {
			return convGeom{}, fmt.Errorf("cuda: conv2d stride %v, dilation %v: want positive", p.Stride, p.Dilation)
		}
	}
	if p.Padding[0] < 0 || p.Padding[1] < 0 {
		return convGeom{}, fmt.Errorf("cuda: conv2d padding %v: want non-negative", p.Padding)
	}
	if g.g < 1 || g.c%g.g != 0 || g.o%g.g != 0 || w[1] != g.c/g.g || y[0] != g.n || y[1] != g.o ||
		y[2] != runtime.ConvOutSize(g.h, g.kh, p.Stride[0], p.Padding[0], p.Dilation[0]) ||
		y[3] != runtime.ConvOutSize(g.w, g.kw, p.Stride[1], p.Padding[1], p.Dilation[1]) {
		return convGeom{}, fmt.Errorf("cuda: conv2d input %v, weight %v, output %v, %+v do not fit", x, w, y, p)
	}
	g.cg, g.og = g.c/g.g, g.o/g.g
	g.k, g.l = g.cg*g.kh*g.kw, g.oh*g.ow
	g.direct = g.kh == 1 && g.kw == 1 && p.Stride == [2]int{1, 1} && p.Padding == [2]int{0, 0}
	return g, nil
}

// runs splits the batch into chunks whose scratch (im2col columns, the
// per-image weight-gradient products) fits colBudget and whose kernels'
// index ranges (col2im runs over the input) fit one launch.
func (g *convGeom) runs() ([][2]int, error) {
	per := int64(g.og) * int64(g.k)
	if !g.direct {
		per = max(per, int64(g.k)*int64(g.l), int64(g.cg)*int64(g.h)*int64(g.w))
	}
	limit := int64(colBudget / 4)
	if per > limit {
		// One image alone exceeds the budget: images one at a time, as
		// long as one fits the kernels' index range.
		limit = min(per, maxUnits)
	}
	return chunks(g.n, per, limit)
}

// unfold runs im2col for images [n0, n1) of group grp into the column
// scratch and returns its address; a direct (1x1) convolution reads the
// input itself, whose address comes back with its batch stride.
func (b *Backend) unfold(g *convGeom, x *tensor, grp, n0, n1 int) (col uint64, stride int64, err error) {
	hw := int64(g.h) * int64(g.w)
	src := x.at((int64(n0)*int64(g.c) + int64(grp*g.cg)) * hw)
	if g.direct {
		return src, int64(g.c) * hw, nil
	}
	per := int64(g.k) * int64(g.l)
	col, err = b.getScratch(scrCol, int64(n1-n0)*per*4)
	if err != nil {
		return 0, 0, err
	}
	total := int64(n1-n0) * per
	p := g.p
	err = b.launch(kIm2col, loopDims(total, b.sms), ptr(col), ptr(src), i32(n1-n0), i64(int64(g.c)*hw), i32(g.cg),
		i32(g.h), i32(g.w), i32(g.kh), i32(g.kw), i32(g.oh), i32(g.ow), i32(p.Stride[0]), i32(p.Stride[1]),
		i32(p.Padding[0]), i32(p.Padding[1]), i32(p.Dilation[0]), i32(p.Dilation[1]))
	return col, per, err
}

func (b *Backend) Conv2d(y, x, w, bias runtime.Tensor, p runtime.ConvParams) error {
	t, err := b.floats(y, x, w, bias)
	if err != nil {
		return err
	}
	if t[0] == nil || t[1] == nil || t[2] == nil {
		return fmt.Errorf("cuda: conv2d of a nil tensor")
	}
	g, err := convGeometry(t[1].shape, t[2].shape, t[0].shape, p)
	if err != nil {
		return err
	}
	yt, xt, wt, bt := t[0], t[1], t[2], t[3]
	if bt != nil && bt.numel() != int64(g.o) {
		return fmt.Errorf("cuda: conv2d bias of %d for %d channels", bt.numel(), g.o)
	}
	if yt.numel() == 0 {
		return nil
	}
	runs, err := g.runs()
	if err != nil {
		return fmt.Errorf("cuda: conv2d input %v: %w", xt.shape, err)
	}
	l := int64(g.l)
	for grp := 0; grp < g.g; grp++ {
		for _, r := range runs {
			col, stride, err := b.unfold(&g, xt, grp, r[0], r[1])
			if err != nil {
				return err
			}
			// Y_n[og, l] = W_g[og, k] · col_n[k, l] for every image n.
			if err := b.gemm(gemmCall{
				c: yt.at((int64(r[0])*int64(g.o) + int64(grp*g.og)) * l), a: wt.at(int64(grp * g.og * g.k)), b: col,
				m: g.og, n: g.l, k: g.k, lda: g.k, ldb: g.l, ldc: g.l,
				sa: 0, sb: stride, sc: int64(g.o) * l, batch: r[1] - r[0],
			}); err != nil {
				return err
			}
		}
	}
	if bt != nil {
		n := yt.numel()
		return b.launch(kBiasAdd, loopDims(n, b.sms), tp(yt), tp(bt), i64(n), i32(g.o), i32(g.l))
	}
	return nil
}

func (b *Backend) Conv2dBackward(dx, dw, db, dy, x, w runtime.Tensor, p runtime.ConvParams) error {
	t, err := b.floats(dx, dw, db, dy, x, w)
	if err != nil {
		return err
	}
	dxt, dwt, dbt, dyt, xt, wt := t[0], t[1], t[2], t[3], t[4], t[5]
	if dyt == nil || xt == nil || wt == nil {
		return fmt.Errorf("cuda: conv2d backward of a nil tensor")
	}
	g, err := convGeometry(xt.shape, wt.shape, dyt.shape, p)
	if err != nil {
		return err
	}
	if (dxt != nil && dxt.numel() != xt.numel()) || (dwt != nil && dwt.numel() != wt.numel()) || (dbt != nil && dbt.numel() != int64(g.o)) {
		return fmt.Errorf("cuda: conv2d backward: gradient shapes do not fit input %v, weight %v", xt.shape, wt.shape)
	}
	if dbt != nil {
		if err := b.chanSum(dbt, dyt, g.n, g.o, g.l); err != nil {
			return err
		}
	}
	if dwt == nil && dxt == nil {
		return nil
	}
	runs, err := g.runs()
	if err != nil {
		return fmt.Errorf("cuda: conv2d backward input %v: %w", xt.shape, err)
	}
	l, hw := int64(g.l), int64(g.h)*int64(g.w)
	wg := int64(g.og) * int64(g.k)
	if dwt != nil && (g.n == 0 || g.l == 0) {
		if err := b.dev.memset32(dwt.ptr, 0, dwt.numel()); err != nil {
			return err
		}
	}
	for grp := 0; grp < g.g; grp++ {
		for ri, r := range runs {
			nb := r[1] - r[0]
			gy := dyt.at((int64(r[0])*int64(g.o) + int64(grp*g.og)) * l)
			if dwt != nil && g.l > 0 {
				col, stride, err := b.unfold(&g, xt, grp, r[0], r[1])
				if err != nil {
					return err
				}
				// P_n[og, k] = dY_n[og, l] · col_n[k, l]ᵀ per image,
				// then the images summed into dW_g.
				part, err := b.getScratch(scrGemm, int64(nb)*wg*4)
				if err != nil {
					return err
				}
				if err := b.gemm(gemmCall{
					c: part, a: gy, b: col, m: g.og, n: g.k, k: g.l, lda: g.l, ldb: g.l, ldc: g.k,
					sa: int64(g.o) * l, sb: stride, sc: wg, tb: true, batch: nb,
				}); err != nil {
					return err
				}
				if err := b.launch(kBatchSum, loopDims(wg, b.sms), ptr(dwt.at(int64(grp)*wg)), ptr(part), i64(wg), i32(nb), boolArg(ri > 0)); err != nil {
					return err
				}
			}
			if dxt == nil {
				continue
			}
			// dcol_n[k, l] = W_g[og, k]ᵀ · dY_n[og, l], folded back into
			// dX (a direct convolution writes dX itself).
			dst := dxt.at((int64(r[0])*int64(g.c) + int64(grp*g.cg)) * hw)
			if g.direct {
				if err := b.gemm(gemmCall{
					c: dst, a: wt.at(int64(grp) * wg), b: gy, m: g.k, n: g.l, k: g.og, lda: g.k, ldb: g.l, ldc: g.l,
					sb: int64(g.o) * l, sc: int64(g.c) * hw, ta: true, batch: nb,
				}); err != nil {
					return err
				}
				continue
			}
			per := int64(g.k) * l
			col, err := b.getScratch(scrCol, int64(nb)*per*4)
			if err != nil {
				return err
			}
			if err := b.gemm(gemmCall{
				c: col, a: wt.at(int64(grp) * wg), b: gy, m: g.k, n: g.l, k: g.og, lda: g.k, ldb: g.l, ldc: g.l,
				sb: int64(g.o) * l, sc: per, ta: true, batch: nb,
			}); err != nil {
				return err
			}
			total := int64(nb) * int64(g.cg) * hw
			if total == 0 {
				continue
			}
			if err := b.launch(kCol2im, loopDims(total, b.sms), ptr(dst), ptr(col), i32(nb), i64(int64(g.c)*hw), i32(g.cg),
				i32(g.h), i32(g.w), i32(g.kh), i32(g.kw), i32(g.oh), i32(g.ow), i32(p.Stride[0]), i32(p.Stride[1]),
				i32(p.Padding[0]), i32(p.Padding[1]), i32(p.Dilation[0]), i32(p.Dilation[1])); err != nil {
				return err
			}
		}
	}
	return nil
}

// chanSum writes the per-channel sums of y ([n, c, hw]) into out.
func (b *Backend) chanSum(out, y *tensor, n, c, hw int) error {
	if c == 0 {
		return nil
	}
	if c > maxGridX {
		return fmt.Errorf("cuda: %d channels", c)
	}
	return b.launch(kChanSum, blocks1(c), tp(out), tp(y), i32(n), i32(c), i32(hw))
}

func linearDims(x, w, y []int) (n, in, out int, err error) {
	if len(x) != 2 || len(w) != 2 || len(y) != 2 || x[1] != w[1] || y[1] != w[0] || y[0] != x[0] {
		return 0, 0, 0, fmt.Errorf("cuda: linear input %v, weight %v, output %v do not fit", x, w, y)
	}
	return x[0], x[1], w[0], nil
}

func (b *Backend) Linear(y, x, w, bias runtime.Tensor) error {
	t, err := b.floats(y, x, w, bias)
	if err != nil {
		return err
	}
	if t[0] == nil || t[1] == nil || t[2] == nil {
		return fmt.Errorf("cuda: linear of a nil tensor")
	}
	n, in, out, err := linearDims(t[1].shape, t[2].shape, t[0].shape)
	if err != nil {
		return err
	}
	if t[3] != nil && t[3].numel() != int64(out) {
		return fmt.Errorf("cuda: linear bias of %d for %d features", t[3].numel(), out)
	}
	// Y[n, out] = X[n, in] · W[out, in]ᵀ.
	if err := b.gemm(gemmCall{c: t[0].ptr, a: t[1].ptr, b: t[2].ptr, m: n, n: out, k: in, lda: in, ldb: in, ldc: out, tb: true, batch: 1}); err != nil {
		return err
	}
	if t[3] != nil && n*out > 0 {
		total := int64(n) * int64(out)
		return b.launch(kBiasAdd, loopDims(total, b.sms), tp(t[0]), tp(t[3]), i64(total), i32(out), i32(1))
	}
	return nil
}

func (b *Backend) LinearBackward(dx, dw, db, dy, x, w runtime.Tensor) error {
	t, err := b.floats(dx, dw, db, dy, x, w)
	if err != nil {
		return err
	}
	dxt, dwt, dbt, dyt, xt, wt := t[0], t[1], t[2], t[3], t[4], t[5]
	if dyt == nil || xt == nil || wt == nil {
		return fmt.Errorf("cuda: linear backward of a nil tensor")
	}
	n, in, out, err := linearDims(xt.shape, wt.shape, dyt.shape)
	if err != nil {
		return err
	}
	if (dxt != nil && dxt.numel() != xt.numel()) || (dwt != nil && dwt.numel() != wt.numel()) || (dbt != nil && dbt.numel() != int64(out)) {
		return fmt.Errorf("cuda: linear backward: gradient shapes do not fit input %v, weight %v", xt.shape, wt.shape)
	}
	if dxt != nil {
		// dX[n, in] = dY[n, out] · W[out, in].
		if err := b.gemm(gemmCall{c: dxt.ptr, a: dyt.ptr, b: wt.ptr, m: n, n: in, k: out, lda: out, ldb: in, ldc: in, batch: 1}); err != nil {
			return err
		}
	}
	if dwt != nil {
		// dW[out, in] = dY[n, out]ᵀ · X[n, in].
		if err := b.gemm(gemmCall{c: dwt.ptr, a: dyt.ptr, b: xt.ptr, m: out, n: in, k: n, lda: out, ldb: in, ldc: in, ta: true, batch: 1}); err != nil {
			return err
		}
	}
	if dbt != nil {
		return b.chanSum(dbt, dyt, n, out, 1)
	}
	return nil
}
