package runtime

// A depthwise convolution (groups == input channels == output channels,
// MobileNet's and EfficientNet's 3x3 and 5x5 layers) through the grouped
// GEMM path is one 1 x kh*kw by kh*kw x l product per channel and image,
// after an im2col that copies the plane kh*kw times: a product one row tall
// wastes the micro-kernel and the copy costs more than the arithmetic.
// These loops shift and add instead, channel by channel, in float32 like
// the GEMM, over the threads by channel so that no two threads write the
// same weight gradient.

var noDepthwise bool

func (g *convGeom) isDepthwise() bool { return !noDepthwise && g.g > 1 && g.cg == 1 && g.og == 1 }

// depthwiseTaps calls fn for every kernel tap (a, b) and output row oh
// whose input row ih lies inside the image, with the output columns
// [lo, hi) whose input column ow*sw+off lies inside too.
func (g *convGeom) depthwiseTaps(fn func(tap, oh, ih, lo, hi, off int)) {
	sh, sw := g.p.Stride[0], g.p.Stride[1]
	ph, pw := g.p.Padding[0], g.p.Padding[1]
	dh, dw := g.p.Dilation[0], g.p.Dilation[1]
	for a := 0; a < g.kh; a++ {
		for b := 0; b < g.kw; b++ {
			off := b*dw - pw
			lo, hi := validRange(g.ow, g.w, sw, off)
			if lo >= hi {
				continue
			}
			for oh := 0; oh < g.oh; oh++ {
				ih := oh*sh - ph + a*dh
				if ih < 0 || ih >= g.h {
					continue
				}
				fn(a*g.kw+b, oh, ih, lo, hi, off)
			}
		}
	}
}

// depthwiseForward writes y = conv(x, w) + bias for channels [c0, c1) of
// every image.
func (g *convGeom) depthwiseForward(y, x, w, bias []float32, c0, c1 int) {
	sw, hw := g.p.Stride[1], g.h*g.w
	for ch := c0; ch < c1; ch++ {
		wt := w[ch*g.kh*g.kw:][:g.kh*g.kw]
		for n := 0; n < g.n; n++ {
			dst := y[n*g.ysz+ch*g.l:][:g.l]
			src := x[n*g.xsz+ch*hw:][:hw]
			clear(dst)
			g.depthwiseTaps(func(tap, oh, ih, lo, hi, off int) {
				wv := wt[tap]
				drow, srow := dst[oh*g.ow:][:g.ow], src[ih*g.w:][:g.w]
				if sw == 1 {
					axpy(wv, srow[lo+off:hi+off], drow[lo:hi])
					return
				}
				for o := lo; o < hi; o++ {
					drow[o] += wv * srow[o*sw+off]
				}
			})
			if bias != nil {
				v := bias[ch]
				for j := range dst {
					dst[j] += v
				}
			}
		}
	}
}

// depthwiseBackward writes the input gradient dx (when not nil) and the
// weight gradient dw (when not nil) for channels [c0, c1). Each tap's
// weight gradient sums a row's products in float32 (as the GEMM does) and
// the rows and images in float64.
func (g *convGeom) depthwiseBackward(dx, dw, dy, x, w []float32, c0, c1 int) {
	sw, hw, taps := g.p.Stride[1], g.h*g.w, g.kh*g.kw
	acc := make([]float64, taps)
	for ch := c0; ch < c1; ch++ {
		wt := w[ch*taps:][:taps]
		clear(acc)
		for n := 0; n < g.n; n++ {
			gy := dy[n*g.ysz+ch*g.l:][:g.l]
			src := x[n*g.xsz+ch*hw:][:hw]
			var gx []float32
			if dx != nil {
				gx = dx[n*g.xsz+ch*hw:][:hw]
				clear(gx)
			}
			g.depthwiseTaps(func(tap, oh, ih, lo, hi, off int) {
				grow, srow := gy[oh*g.ow:][:g.ow], src[ih*g.w:][:g.w]
				if sw == 1 {
					gr := grow[lo:hi]
					if dw != nil {
						acc[tap] += float64(dot(gr, srow[lo+off:hi+off]))
					}
					if gx != nil {
						axpy(wt[tap], gr, gx[ih*g.w+lo+off:])
					}
					return
				}
				if dw != nil {
					var sum float32
					for o := lo; o < hi; o++ {
						sum += grow[o] * srow[o*sw+off]
					}
					acc[tap] += float64(sum)
				}
				if gx != nil {
					wv, drow := wt[tap], gx[ih*g.w:][:g.w]
					for o := lo; o < hi; o++ {
						drow[o*sw+off] += wv * grow[o]
					}
				}
			})
		}
		if dw != nil {
			for tap, v := range acc {
				dw[ch*taps+tap] = float32(v)
			}
		}
	}
}
