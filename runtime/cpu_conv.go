package runtime

import (
	"fmt"
	"sync"
)

// sgemmPar is sgemm with the columns of C split over up to par goroutines.
func sgemmPar(par int, ta, tb bool, m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	splitColumns(par, m, n, k, tb, ldb, func(j0, j1, boff int) {
		sgemm(ta, tb, m, j1-j0, k, a, lda, b[boff:], ldb, c[j0:], ldc, acc)
	})
}

// sgemmParPacked is sgemmPar with op(A) packed by packAll.
func sgemmParPacked(par int, pa *packedA, tb bool, n int, b []float32, ldb int, c []float32, ldc int, acc bool) {
	splitColumns(par, pa.m, n, pa.k, tb, ldb, func(j0, j1, boff int) {
		sgemmPacked(pa, tb, j1-j0, b[boff:], ldb, c[j0:], ldc, acc)
	})
}

// splitColumns calls run for column ranges [j0, j1) of an m×n×k product,
// in parallel when it is worth it; boff is where B's part starts.
func splitColumns(par, m, n, k int, tb bool, ldb int, run func(j0, j1, boff int)) {
	// Columns in multiples of 16, so that every part keeps whole
	// micro-tiles; small products are not worth a goroutine.
	parts := min(par, n/64)
	if parts <= 1 || m*n*k < 1<<18 {
		run(0, n, 0)
		return
	}
	var wg sync.WaitGroup
	for t := 0; t < parts; t++ {
		j0, j1 := n*t/parts/16*16, n*(t+1)/parts/16*16
		if t == parts-1 {
			j1 = n
		}
		if j0 >= j1 {
			continue
		}
		boff := j0
		if tb {
			boff = j0 * ldb
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			run(j0, j1, boff)
		}()
	}
	wg.Wait()
}

// convGeom is a convolution's sizes.
type convGeom struct {
	n, c, h, w     int // input
	o, kh, kw      int // weight (o outputs, c/g inputs each)
	oh, ow         int // output
	g, cg, og      int // groups and channels per group
	k, l           int // GEMM depth (cg*kh*kw) and output plane size
	direct         bool
	p              ConvParams
	xsz, ysz, wgsz int // per-image input and output sizes, per-group weights
}

func convGeometry(x, w, y []int, p ConvParams) (convGeom, error) {
	if len(x) != 4 || len(w) != 4 || len(y) != 4 {
		return convGeom{}, fmt.Errorf("cpu: conv2d shapes %v, %v, %v: want 4 dimensions", x, w, y)
	}
	g := convGeom{n: x[0], c: x[1], h: x[2], w: x[3], o: w[0], kh: w[2], kw: w[3], oh: y[2], ow: y[3], g: p.Groups, p: p}
	if g.g < 1 || g.c%g.g != 0 || g.o%g.g != 0 || w[1] != g.c/g.g || y[0] != g.n || y[1] != g.o ||
		y[2] != ConvOutSize(g.h, g.kh, p.Stride[0], p.Padding[0], p.Dilation[0]) ||
		y[3] != ConvOutSize(g.w, g.kw, p.Stride[1], p.Padding[1], p.Dilation[1]) {
		return convGeom{}, fmt.Errorf("cpu: conv2d input %v, weight %v, output %v, %+v do not fit", x, w, y, p)
	}
	g.cg, g.og = g.c/g.g, g.o/g.g
	g.k, g.l = g.cg*g.kh*g.kw, g.oh*g.ow
	g.direct = g.kh == 1 && g.kw == 1 && p.Stride == [2]int{1, 1} && p.Padding == [2]int{0, 0}
	g.xsz, g.ysz, g.wgsz = g.c*g.h*g.w, g.o*g.l, g.og*g.k
	return g, nil
}

// im2col unfolds one group of one image (cg planes of h×w) into col, k rows
// of l columns.
func (g *convGeom) im2col(src, col []float32) {
	sh, sw := g.p.Stride[0], g.p.Stride[1]
	ph, pw := g.p.Padding[0], g.p.Padding[1]
	dh, dw := g.p.Dilation[0], g.p.Dilation[1]
	for c := 0; c < g.cg; c++ {
		plane := src[c*g.h*g.w : (c+1)*g.h*g.w]
		for a := 0; a < g.kh; a++ {
			for b := 0; b < g.kw; b++ {
				row := col[((c*g.kh+a)*g.kw+b)*g.l:][:g.l]
				// The output columns whose input column lies inside
				// the image: iw = ow*sw - pw + b*dw in [0, w).
				lo, hi := validRange(g.ow, g.w, sw, b*dw-pw)
				for oh := 0; oh < g.oh; oh++ {
					ih := oh*sh - ph + a*dh
					dst := row[oh*g.ow : (oh+1)*g.ow]
					if ih < 0 || ih >= g.h {
						clear(dst)
						continue
					}
					srow := plane[ih*g.w : (ih+1)*g.w]
					clear(dst[:lo])
					clear(dst[hi:])
					off := b*dw - pw
					if sw == 1 {
						// lo == hi when this kernel column misses the
						// image for every output column (a kernel wider
						// than the padded input): lo+off may then be
						// negative.
						if lo < hi {
							copy(dst[lo:hi], srow[lo+off:hi+off])
						}
						continue
					}
					for ow := lo; ow < hi; ow++ {
						dst[ow] = srow[ow*sw+off]
					}
				}
			}
		}
	}
}

// col2im adds col (k rows of l columns) back into one group of one image.
func (g *convGeom) col2im(col, dst []float32) {
	sh, sw := g.p.Stride[0], g.p.Stride[1]
	ph, pw := g.p.Padding[0], g.p.Padding[1]
	dh, dw := g.p.Dilation[0], g.p.Dilation[1]
	for c := 0; c < g.cg; c++ {
		plane := dst[c*g.h*g.w : (c+1)*g.h*g.w]
		for a := 0; a < g.kh; a++ {
			for b := 0; b < g.kw; b++ {
				row := col[((c*g.kh+a)*g.kw+b)*g.l:][:g.l]
				lo, hi := validRange(g.ow, g.w, sw, b*dw-pw)
				off := b*dw - pw
				for oh := 0; oh < g.oh; oh++ {
					ih := oh*sh - ph + a*dh
					if ih < 0 || ih >= g.h {
						continue
					}
					src := row[oh*g.ow : (oh+1)*g.ow]
					drow := plane[ih*g.w : (ih+1)*g.w]
					if sw == 1 {
						if lo < hi {
							d := drow[lo+off : hi+off]
							for j, v := range src[lo:hi] {
								d[j] += v
							}
						}
						continue
					}
					for ow := lo; ow < hi; ow++ {
						drow[ow*sw+off] += src[ow]
					}
				}
			}
		}
	}
}

// validRange returns the output indices o in [lo, hi) for which
// o*stride + off lies in [0, in).
func validRange(out, in, stride, off int) (lo, hi int) {
	lo = 0
	if off < 0 {
		lo = (-off + stride - 1) / stride
	}
	hi = 0
	if in-off > 0 {
		hi = (in - off + stride - 1) / stride
	}
	lo, hi = min(lo, out), min(hi, out)
	if hi < lo {
		hi = lo
	}
	return lo, hi
}

// packGroups packs op(A) of every group's weights (m×k, row stride lda in
// w, transposed when ta) for the products of a convolution, its blocks
// spread over the backend's threads, into one pooled buffer that release
// gives back. On small feature maps (late stages, small test inputs) the
// packing costs as much as the products, and was done on one thread into a
// fresh allocation on every call.
func (c *cpu) packGroups(ta bool, wd []float32, g *convGeom, lda, m, k int) (packs []*packedA, release func()) {
	packs = make([]*packedA, g.g)
	total := 0
	for grp := range packs {
		packs[grp] = newPackedA(m, k)
		total += packs[grp].size()
	}
	buf := getBuf(total)
	at := 0
	for _, p := range packs {
		p.data = (*buf)[at : at+p.size()]
		at += p.size()
	}
	per := packs[0].blocks()
	c.parallel(g.g*per, g.g*m*k, func(lo, hi int) {
		for u := lo; u < hi; {
			grp, b := u/per, u%per
			end := min(hi-grp*per, per)
			packs[grp].pack(ta, wd[grp*g.wgsz:], lda, b, end)
			u = grp*per + end
		}
	})
	return packs, func() { packPool.Put(buf) }
}

// tasks runs fn for each (image, group) pair, over the backend's threads
// when there are enough pairs; otherwise serially, and fn should then use
// the threads inside (its par argument).
func (c *cpu) tasks(g *convGeom, fn func(worker, n, grp, par int)) {
	total := g.n * g.g
	if total < c.threads {
		for t := 0; t < total; t++ {
			fn(0, t/g.g, t%g.g, c.threads)
		}
		return
	}
	var wg sync.WaitGroup
	for wk := 0; wk < c.threads; wk++ {
		lo, hi := total*wk/c.threads, total*(wk+1)/c.threads
		wg.Add(1)
		go func() {
			defer wg.Done()
			for t := lo; t < hi; t++ {
				fn(wk, t/g.g, t%g.g, 1)
			}
		}()
	}
	wg.Wait()
}

func (c *cpu) Conv2d(y, x, w, b Tensor, p ConvParams) error {
	f, done, err := c.floats(y, x, w, b)
	defer done()
	if err != nil {
		return err
	}
	g, err := convGeometry(x.Shape(), w.Shape(), y.Shape(), p)
	if err != nil {
		return err
	}
	yd, xd, wd, bd := f[0], f[1], f[2], f[3]
	if bd != nil && len(bd) != g.o {
		return fmt.Errorf("cpu: conv2d bias of %d for %d channels", len(bd), g.o)
	}
	if g.isDepthwise() {
		c.parallel(g.c, len(yd)*g.kh*g.kw, func(lo, hi int) { g.depthwiseForward(yd, xd, wd, bd, lo, hi) })
		return nil
	}
	// The weights are packed once and shared by every image.
	packs, release := c.packGroups(false, wd, &g, g.k, g.og, g.k)
	defer release()
	cols := make([]*[]float32, c.threads)
	c.tasks(&g, func(wk, n, grp, par int) {
		src := xd[n*g.xsz+grp*g.cg*g.h*g.w:]
		col := src
		if !g.direct {
			if cols[wk] == nil {
				cols[wk] = getBuf(g.k * g.l)
			}
			col = *cols[wk]
			g.im2col(src, col)
		}
		out := yd[n*g.ysz+grp*g.og*g.l:]
		sgemmParPacked(par, packs[grp], false, g.l, col, g.l, out, g.l, false)
		if bd != nil {
			for o := 0; o < g.og; o++ {
				v := bd[grp*g.og+o]
				row := out[o*g.l : (o+1)*g.l]
				for j := range row {
					row[j] += v
				}
			}
		}
	})
	for _, b := range cols {
		if b != nil {
			packPool.Put(b)
		}
	}
	return nil
}

func (c *cpu) Conv2dBackward(dx, dw, db, dy, x, w Tensor, p ConvParams) error {
	f, done, err := c.floats(dx, dw, db, dy, x, w)
	defer done()
	if err != nil {
		return err
	}
	g, err := convGeometry(x.Shape(), w.Shape(), dy.Shape(), p)
	if err != nil {
		return err
	}
	dxd, dwd, dbd, dyd, xd, wd := f[0], f[1], f[2], f[3], f[4], f[5]
	if (dxd != nil && len(dxd) != len(xd)) || (dwd != nil && len(dwd) != len(wd)) || (dbd != nil && len(dbd) != g.o) {
		return fmt.Errorf("cpu: conv2d backward: gradient shapes do not fit input %v, weight %v", x.Shape(), w.Shape())
	}
	if dbd != nil {
		c.parallel(g.o, len(dyd), func(lo, hi int) {
			for o := lo; o < hi; o++ {
				var s float64
				for n := 0; n < g.n; n++ {
					for _, v := range dyd[n*g.ysz+o*g.l : n*g.ysz+(o+1)*g.l] {
						s += float64(v)
					}
				}
				dbd[o] = float32(s)
			}
		})
	}
	if dwd == nil && dxd == nil {
		return nil
	}
	if g.isDepthwise() {
		c.parallel(g.c, len(dyd)*g.kh*g.kw, func(lo, hi int) { g.depthwiseBackward(dxd, dwd, dyd, xd, wd, lo, hi) })
		return nil
	}
	// Each worker sums its images' weight gradients into its own buffer;
	// the buffers are added at the end. partial[wk][grp] says whether
	// worker wk's buffer holds group grp yet.
	partial := make([][]bool, c.threads)
	parts := make([]*[]float32, c.threads)
	cols := make([]*[]float32, c.threads)
	var packs []*packedA
	if dxd != nil {
		// op(A) = W_gᵀ, packed once for every image.
		var release func()
		packs, release = c.packGroups(true, wd, &g, g.k, g.k, g.og)
		defer release()
	}
	c.tasks(&g, func(wk, n, grp, par int) {
		src := xd[n*g.xsz+grp*g.cg*g.h*g.w:]
		gy := dyd[n*g.ysz+grp*g.og*g.l:]
		if cols[wk] == nil && !g.direct {
			cols[wk] = getBuf(g.k * g.l)
		}
		if dwd != nil {
			if partial[wk] == nil {
				partial[wk] = make([]bool, g.g)
				parts[wk] = getBuf(len(wd))
			}
			col := src
			if !g.direct {
				col = *cols[wk]
				g.im2col(src, col)
			}
			// A worker's first image of a group overwrites its buffer,
			// later ones add to it.
			sgemmPar(par, false, true, g.og, g.k, g.l, gy, g.l, col, g.l, (*parts[wk])[grp*g.wgsz:], g.k, partial[wk][grp])
			partial[wk][grp] = true
		}
		if dxd != nil {
			dst := dxd[n*g.xsz+grp*g.cg*g.h*g.w:]
			if g.direct {
				sgemmParPacked(par, packs[grp], false, g.l, gy, g.l, dst, g.l, false)
				return
			}
			dcol := *cols[wk]
			sgemmParPacked(par, packs[grp], false, g.l, gy, g.l, dcol, g.l, false)
			clear(dst[:g.cg*g.h*g.w])
			g.col2im(dcol, dst)
		}
	})
	for _, b := range cols {
		if b != nil {
			packPool.Put(b)
		}
	}
	if dwd != nil {
		clear(dwd)
		for wk, done := range partial {
			for grp, ok := range done {
				if !ok {
					continue
				}
				d, p := dwd[grp*g.wgsz:(grp+1)*g.wgsz], (*parts[wk])[grp*g.wgsz:(grp+1)*g.wgsz]
				for j, v := range p {
					d[j] += v
				}
			}
			if parts[wk] != nil {
				packPool.Put(parts[wk])
			}
		}
	}
	return nil
}

func (c *cpu) Linear(y, x, w, b Tensor) error {
	f, done, err := c.floats(y, x, w, b)
	defer done()
	if err != nil {
		return err
	}
	n, in, out, err := linearDims(x.Shape(), w.Shape(), y.Shape())
	if err != nil {
		return err
	}
	yd, xd, wd, bd := f[0], f[1], f[2], f[3]
	if n <= linearRows {
		// Each output a dot product of an input row and a weight row,
		// the weight row read once for the whole batch.
		c.parallel(out, n*out*in, func(lo, hi int) {
			for o := lo; o < hi; o++ {
				wr := wd[o*in : (o+1)*in]
				for i := 0; i < n; i++ {
					yd[i*out+o] = dot(xd[i*in:(i+1)*in], wr)
				}
			}
		})
	} else {
		sgemmPar(c.threads, false, true, n, out, in, xd, in, wd, in, yd, out, false)
	}
	if bd != nil {
		if len(bd) != out {
			return fmt.Errorf("cpu: linear bias of %d for %d features", len(bd), out)
		}
		for i := 0; i < n; i++ {
			row := yd[i*out : (i+1)*out]
			for j := range row {
				row[j] += bd[j]
			}
		}
	}
	return nil
}

func (c *cpu) LinearBackward(dx, dw, db, dy, x, w Tensor) error {
	f, done, err := c.floats(dx, dw, db, dy, x, w)
	defer done()
	if err != nil {
		return err
	}
	n, in, out, err := linearDims(x.Shape(), w.Shape(), dy.Shape())
	if err != nil {
		return err
	}
	dxd, dwd, dbd, dyd, xd, wd := f[0], f[1], f[2], f[3], f[4], f[5]
	if dxd != nil && n <= linearRows {
		// Each input gradient row a sum of weight rows scaled by the
		// output gradient, every thread over its own columns.
		clear(dxd[:n*in])
		c.parallel(in, n*out*in, func(lo, hi int) {
			for o := 0; o < out; o++ {
				wr := wd[o*in+lo : o*in+hi]
				for i := 0; i < n; i++ {
					axpy(dyd[i*out+o], wr, dxd[i*in+lo:i*in+hi])
				}
			}
		})
	} else if dxd != nil {
		sgemmPar(c.threads, false, false, n, in, out, dyd, out, wd, in, dxd, in, false)
	}
	if dwd != nil {
		sgemmPar(c.threads, true, false, out, in, n, dyd, out, xd, in, dwd, in, false)
	}
	if dbd != nil {
		for j := 0; j < out; j++ {
			var s float64
			for i := 0; i < n; i++ {
				s += float64(dyd[i*out+j])
			}
			dbd[j] = float32(s)
		}
	}
	return nil
}

// linearRows is the largest batch a linear layer computes row by row
// instead of through the GEMM, which packs the whole weight matrix on every
// call: for a batch of a few rows that costs as much as the product, and
// for vgg16_bn's first classifier layer (102M weights) it was a quarter of
// a verify at batch 2.
const linearRows = 4

func linearDims(x, w, y []int) (n, in, out int, err error) {
	if len(x) != 2 || len(w) != 2 || len(y) != 2 || x[1] != w[1] || y[1] != w[0] || y[0] != x[0] {
		return 0, 0, 0, fmt.Errorf("cpu: linear input %v, weight %v, output %v do not fit", x, w, y)
	}
	return x[0], x[1], w[0], nil
}
