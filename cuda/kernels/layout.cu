// The layout ops (runtime.Layout): a strided copy for Transpose (Permute),
// Pad, Slice and Concat along any axis (CopyBox, forward and backward), and
// Resize, nearest and bilinear, with torch's source positions.
#include "strided.cuh"

// y[o] = x[i] (or += with add) for each of n elements of a box, o and i
// its offsets in y and x by the strides so and sa; y and x are the boxes'
// first elements.
KERNEL void lay_copy(float* y, const float* x, i64 n, int add,
	unsigned d1, unsigned m1, unsigned s1, unsigned d2, unsigned m2, unsigned s2, unsigned d3,
	unsigned m3, unsigned s3, i64 so0, i64 so1, i64 so2, i64 so3, i64 sa0, i64 sa1, i64 sa2, i64 sa3, i64 sb0, i64 sb1,
	i64 sb2, i64 sb3) {
	const bgeo g = BGEO;
	GRID_LOOP(v, n) {
		i64 o, i, unused;
		bsplit(g, (unsigned)v, &o, &i, &unused);
		if (add)
			y[o] += x[i];
		else
			y[o] = x[i];
	}
}

// rtap is runtime's resizeTaps for output position o of out along an axis
// of in: the two source positions and the second's weight. step is the
// host's runtime.Interp.Step (1/scale for a scale factor, in/out, or
// (in-1)/(out-1) with align corners); exact takes nearest_idx's special
// cases (runtime.NearestIndex). The products and sums are rounded one by
// one (no fused multiply-add), as the CPU backend rounds them, so that a
// position on an integer stays there.
DEV void rtap(int o, int in, int out, float step, int bilinear, int align, int exact, int* i0, int* i1, float* l1) {
	if (!bilinear) {
		int s;
		if (exact && out == in)
			s = o;
		else if (exact && out == 2 * in)
			s = o >> 1;
		else
			s = (int)floorf(__fmul_rn((float)o, step));
		*i0 = *i1 = imin(s, in - 1);
		*l1 = 0.f;
		return;
	}
	float src = 0.f;
	if (align) {
		src = __fmul_rn(step, (float)o);
	} else {
		src = __fadd_rn(__fmul_rn(step, __fadd_rn((float)o, 0.5f)), -0.5f);
		src = src > 0.f ? src : 0.f;
	}
	int a = imin((int)src, in - 1);
	*i0 = a;
	*i1 = a < in - 1 ? a + 1 : a;
	*l1 = src - (float)a;
}

// y (planes of oh x ow) interpolated from x (planes of ih x iw); n is y's
// element count, (wm, ws) divide by ow and (hm, hs) by oh; sh and sw are
// the steps along the height and the width.
KERNEL void lay_resize(float* y, const float* x, i64 n, int ih, int iw, int oh, int ow, unsigned wm, unsigned ws,
	unsigned hm, unsigned hs, int bilinear, int align, float sh, float sw, int exact) {
	GRID_LOOP(v, n) {
		unsigned q = fdiv((unsigned)v, wm, ws), j = (unsigned)v - q * ow;
		unsigned p = fdiv(q, hm, hs), i = q - p * oh;
		int a, b, u, w;
		float lh, lw;
		rtap(i, ih, oh, sh, bilinear, align, exact, &a, &b, &lh);
		rtap(j, iw, ow, sw, bilinear, align, exact, &u, &w, &lw);
		const float* xp = x + (i64)p * ih * iw;
		y[v] = (1.f - lh) * ((1.f - lw) * xp[a * iw + u] + lw * xp[a * iw + w]) +
			lh * ((1.f - lw) * xp[b * iw + u] + lw * xp[b * iw + w]);
	}
}

// Resize's adjoint: each of dy's n elements adds its four weighted taps
// into dx, which the host zeroed. Taps of one output element can coincide
// (nearest, or an edge), so every add is atomic.
KERNEL void lay_resize_bwd(float* dx, const float* dy, i64 n, int ih, int iw, int oh, int ow, unsigned wm,
	unsigned ws, unsigned hm, unsigned hs, int bilinear, int align, float sh, float sw, int exact) {
	GRID_LOOP(v, n) {
		unsigned q = fdiv((unsigned)v, wm, ws), j = (unsigned)v - q * ow;
		unsigned p = fdiv(q, hm, hs), i = q - p * oh;
		int a, b, u, w;
		float lh, lw;
		rtap(i, ih, oh, sh, bilinear, align, exact, &a, &b, &lh);
		rtap(j, iw, ow, sw, bilinear, align, exact, &u, &w, &lw);
		float* xp = dx + (i64)p * ih * iw;
		float g = dy[v];
		atomicAdd(xp + a * iw + u, (1.f - lh) * (1.f - lw) * g);
		atomicAdd(xp + a * iw + w, (1.f - lh) * lw * g);
		atomicAdd(xp + b * iw + u, lh * (1.f - lw) * g);
		atomicAdd(xp + b * iw + w, lh * lw * g);
	}
}
