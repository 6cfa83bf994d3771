// Batch normalisation and InPlace-ABN, written for memory bandwidth.
//
// Tensors are NCHW; a channel's values are n_img planes of hw floats, one
// plane every c*hw floats. Each phase reads its tensors once:
//
//   forward   bn_stats (reads x) -> bn_stats_final -> [bn_update_running]
//             -> bn_coeffs -> bn_apply (reads x, writes y, in place or not)
//   backward  bn_bwd_reduce (reads x or z, and dy) -> bn_bwd_final
//             -> bn_bwd_apply (reads them again, writes dx, which may be dy)
//
// The reductions split each channel over blockIdx.x (splits blocks per
// channel, each a contiguous range of the channel's units) and
// blockIdx.y = channel; each block writes two double partial sums, which
// the *_final kernels (one thread per channel) add up. A unit is a float4
// when hw % 4 == 0 (vec), else a float. The per-channel scalars go to the
// apply kernels as one float4 per channel, so every apply unit does one
// extra (cached) load.
#include "common.cuh"

// chan_unit is the tensor index of unit u of channel ch, where (m, s)
// divide by hw4, the units per plane.
DEV i64 chan_unit(unsigned u, int ch, int c, int hw4, unsigned m, unsigned s) {
	unsigned img = fdiv(u, m, s);
	return ((i64)img * c + ch) * hw4 + (u - img * (unsigned)hw4);
}

// The range of units split sp of a channel of `units` covers.
DEV void split_range(unsigned units, int sp, int splits, unsigned* lo, unsigned* hi) {
	*lo = (unsigned)((u64)units * sp / splits);
	*hi = (unsigned)((u64)units * (sp + 1) / splits);
}

// Per-channel sums of (x - k) and (x - k)^2, k being the channel's first
// value: shifting by a value of the data keeps E[x^2] - E[x]^2 from
// cancelling when the mean is large against the spread.
KERNEL void bn_stats(double* part, const float* x, int n_img, int c, int hw, int vec, unsigned m, unsigned s,
	int splits) {
	int ch = blockIdx.y, sp = blockIdx.x;
	int hw4 = vec ? hw >> 2 : hw;
	unsigned lo, hi;
	split_range((unsigned)n_img * (unsigned)hw4, sp, splits, &lo, &hi);
	float k = x[(i64)ch * hw];
	double s1 = 0, s2 = 0;
	// Two units per thread and round, both loads issued before either is
	// used: more bytes in flight per thread.
	for (unsigned u = lo + threadIdx.x; u < hi; u += 2 * blockDim.x) {
		unsigned u2 = u + blockDim.x;
		bool two = u2 < hi;
		i64 at = chan_unit(u, ch, c, hw4, m, s), at2 = two ? chan_unit(u2, ch, c, hw4, m, s) : at;
		if (vec) {
			float4 v = ld4(x, at), w = ld4(x, at2);
			if (!two) w = make_float4(k, k, k, k);
			float d0 = v.x - k, d1 = v.y - k, d2 = v.z - k, d3 = v.w - k;
			float e0 = w.x - k, e1 = w.y - k, e2 = w.z - k, e3 = w.w - k;
			s1 += (double)(((d0 + d1) + (d2 + d3)) + ((e0 + e1) + (e2 + e3)));
			s2 += (double)(((d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)) + ((e0 * e0 + e1 * e1) + (e2 * e2 + e3 * e3)));
		} else {
			float d = x[at] - k, e = two ? x[at2] - k : 0.f;
			s1 += (double)d + e;
			s2 += (double)d * d + (double)e * e;
		}
	}
	block_sum2(&s1, &s2);
	if (threadIdx.x == 0) {
		part[((i64)ch * splits + sp) * 2] = s1;
		part[((i64)ch * splits + sp) * 2 + 1] = s2;
	}
}

// Mean (of sign*x) and biased variance per channel from bn_stats' partials;
// count is n_img*hw.
KERNEL void bn_stats_final(float* mean, float* var, const double* part, const float* x, const float* sign, int c,
	int hw, int splits, double count) {
	GRID_LOOP(ch, c) {
		double s1 = 0, s2 = 0;
		for (int sp = 0; sp < splits; sp++) {
			s1 += part[(ch * splits + sp) * 2];
			s2 += part[(ch * splits + sp) * 2 + 1];
		}
		double d = s1 / count, v = s2 / count - d * d;
		double mu = (double)x[ch * hw] + d;
		if (sign) mu *= sign[ch];
		mean[ch] = (float)mu;
		var[ch] = (float)(v > 0 ? v : 0);
	}
}

// running = (1-factor)*running + factor*batch, the variance unbiased.
KERNEL void bn_update_running(float* rm, float* rv, const float* mean, const float* var, int c, double factor,
	double unbias) {
	GRID_LOOP(ch, c) {
		rm[ch] = (float)((1 - factor) * (double)rm[ch] + factor * (double)mean[ch]);
		rv[ch] = (float)((1 - factor) * (double)rv[ch] + factor * (double)var[ch] * unbias);
	}
}

DEV double gamma_of(const float* w, int ch, double eps, int absw) {
	if (!w) return absw ? 1 + eps : 1;
	return absw ? fabs((double)w[ch]) + eps : (double)w[ch];
}

// The forward transform's coefficients: y = act((x - k.y) * k.x + k.z),
// which is gamma*(sign*x - mean)/sqrt(var + eps) + beta written around the
// mean, so that a large mean does not cost float32 precision.
KERNEL void bn_coeffs(float* coef, const float* sign, const float* mean, const float* var, const float* w,
	const float* b, int c, double eps, int absw) {
	GRID_LOOP(ch, c) {
		double sg = sign ? (double)sign[ch] : 1;
		double scale = gamma_of(w, ch, eps, absw) / sqrt((double)var[ch] + eps);
		st4(coef, ch, make_float4((float)(scale * sg), (float)(sg * mean[ch]), b ? b[ch] : 0.f, 0.f));
	}
}

// unit_coef is the coefficients of the channel of unit i; (mh, sh) divide
// by the units per plane and (mc, sc) by c.
DEV float4 unit_coef(const float* coef, i64 i, int c, unsigned mh, unsigned sh, unsigned mc, unsigned sc) {
	unsigned plane = fdiv((unsigned)i, mh, sh);
	unsigned ch = plane - fdiv(plane, mc, sc) * (unsigned)c;
	return ld4(coef, ch);
}

DEV float4 apply4(float4 v, float4 k, int kind, float a) {
	v.x = act((v.x - k.y) * k.x + k.z, kind, a);
	v.y = act((v.y - k.y) * k.x + k.z, kind, a);
	v.z = act((v.z - k.y) * k.x + k.z, kind, a);
	v.w = act((v.w - k.y) * k.x + k.z, kind, a);
	return v;
}

// y = act((x - k.y) * k.x + k.z) over n units (fewer than 2^31). y may be
// x. Each thread takes two units a grid apart per round, loading both
// before storing either.
KERNEL void bn_apply(float* y, const float* x, const float* coef, i64 n, int c, unsigned mh, unsigned sh,
	unsigned mc, unsigned sc, int vec, int kind, float a) {
	i64 grid = (i64)gridDim.x * blockDim.x;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 2 * grid) {
		i64 j = i + grid;
		bool two = j < n;
		float4 k = unit_coef(coef, i, c, mh, sh, mc, sc);
		float4 k2 = two ? unit_coef(coef, j, c, mh, sh, mc, sc) : k;
		if (vec) {
			float4 v = ld4(x, i), w = two ? ld4(x, j) : v;
			st4(y, i, apply4(v, k, kind, a));
			if (two) st4(y, j, apply4(w, k2, kind, a));
		} else {
			float v = x[i], w = two ? x[j] : v;
			y[i] = act((v - k.y) * k.x + k.z, kind, a);
			if (two) y[j] = act((w - k2.y) * k2.x + k2.z, kind, a);
		}
	}
}

// One element of the backward reduction: from the saved tensor u and the
// gradient g, the gradient gg of the affine output and u's distance d from
// the channel's centre. Mode 0 (from the input): u = x, the centre is the
// mean of sign*x. Mode 1 (InPlace-ABN, from the output): u = z, inverted
// through the activation; the centre is beta.
DEV void bwd_elem(float u, float g, float sg, float ctr, int mode, int kind, float a, float* gg, float* d) {
	if (mode == 0) {
		*gg = g;
		*d = sg * u - ctr;
		return;
	}
	float y;
	invert(u, g, kind, a, &y, gg);
	*d = y - ctr;
}

// The sums of gg and gg*d over one float4 unit.
DEV void bwd_sums4(float4 u, float4 g, float sg, float ctr, int mode, int kind, float a, float* t1, float* t2) {
	float g0, g1, g2, g3, d0, d1, d2, d3;
	bwd_elem(u.x, g.x, sg, ctr, mode, kind, a, &g0, &d0);
	bwd_elem(u.y, g.y, sg, ctr, mode, kind, a, &g1, &d1);
	bwd_elem(u.z, g.z, sg, ctr, mode, kind, a, &g2, &d2);
	bwd_elem(u.w, g.w, sg, ctr, mode, kind, a, &g3, &d3);
	*t1 = (g0 + g1) + (g2 + g3);
	*t2 = (g0 * d0 + g1 * d1) + (g2 * d2 + g3 * d3);
}

// Per-channel sums of gg and gg*d (see bwd_elem).
KERNEL void bn_bwd_reduce(double* part, const float* u, const float* g, const float* sign, const float* center,
	int n_img, int c, int hw, int vec, unsigned m, unsigned s, int splits, int mode, int kind, float a) {
	int ch = blockIdx.y, sp = blockIdx.x;
	int hw4 = vec ? hw >> 2 : hw;
	unsigned lo, hi;
	split_range((unsigned)n_img * (unsigned)hw4, sp, splits, &lo, &hi);
	float sg = sign ? sign[ch] : 1.f, ctr = center ? center[ch] : 0.f;
	double s1 = 0, s2 = 0;
	// Two units per thread and round, as in bn_stats.
	for (unsigned q = lo + threadIdx.x; q < hi; q += 2 * blockDim.x) {
		unsigned q2 = q + blockDim.x;
		bool two = q2 < hi;
		i64 at = chan_unit(q, ch, c, hw4, m, s), at2 = two ? chan_unit(q2, ch, c, hw4, m, s) : at;
		if (vec) {
			float4 uv = ld4(u, at), gv = ld4(g, at);
			float4 uw = ld4(u, at2), gw = ld4(g, at2);
			float a1, a2, b1, b2;
			bwd_sums4(uv, gv, sg, ctr, mode, kind, a, &a1, &a2);
			bwd_sums4(uw, gw, sg, ctr, mode, kind, a, &b1, &b2);
			if (two) {
				a1 += b1;
				a2 += b2;
			}
			s1 += a1;
			s2 += a2;
		} else {
			float g0, d0, g1 = 0.f, d1 = 0.f;
			float uu = u[at], gu = g[at], uw = u[at2], gw = g[at2];
			bwd_elem(uu, gu, sg, ctr, mode, kind, a, &g0, &d0);
			if (two) bwd_elem(uw, gw, sg, ctr, mode, kind, a, &g1, &d1);
			s1 += (double)g0 + g1;
			s2 += (double)g0 * d0 + (double)g1 * d1;
		}
	}
	block_sum2(&s1, &s2);
	if (threadIdx.x == 0) {
		part[((i64)ch * splits + sp) * 2] = s1;
		part[((i64)ch * splits + sp) * 2 + 1] = s2;
	}
}

// From the reduction's partials: dbias = sum(gg), dweight = sum(gg*xhat)
// (times sign(weight) for InPlace-ABN's |weight| + eps), and the apply
// coefficients. With xhat = d/sigma (mode 0, sigma = sqrt(var + eps)) or
// d/gamma (mode 1), and scale = gamma*sign/sigma:
//
//   dx = scale*(gg - mean(gg) - xhat*mean(gg*xhat))      training
//   dx = scale*gg                                         eval
//
// written as dx = k.x*gg + k.y*(u - k.w) + k.z, u being x (mode 0, sign
// folded into k.y and k.w) or the inverted y (mode 1). count is n_img*hw.
KERNEL void bn_bwd_final(float* coef, float* dw, float* db, const double* part, const float* sign,
	const float* center, const float* var, const float* w, int c, int splits, double count, double eps, int absw,
	int mode, int training) {
	GRID_LOOP(ch, c) {
		double s1 = 0, s2 = 0;
		for (int sp = 0; sp < splits; sp++) {
			s1 += part[(ch * splits + sp) * 2];
			s2 += part[(ch * splits + sp) * 2 + 1];
		}
		double sg = sign ? (double)sign[ch] : 1, ctr = center ? (double)center[ch] : 0;
		double gamma = gamma_of(w, ch, eps, absw);
		double invstd = 1 / sqrt((double)var[ch] + eps);
		double sumx = mode == 0 ? s2 * invstd : s2 / gamma;
		if (db) db[ch] = (float)s1;
		if (dw) {
			double f = 1;
			if (absw && w) f = w[ch] > 0 ? 1 : (w[ch] < 0 ? -1 : 0);
			dw[ch] = (float)(sumx * f);
		}
		double scale = gamma * invstd * sg;
		double mdy = training ? s1 / count : 0, mx = training ? sumx / count : 0;
		double k1 = mode == 0 ? -scale * mx * invstd : -scale * mx / gamma;
		if (mode == 0)
			st4(coef, ch, make_float4((float)scale, (float)(k1 * sg), (float)(-scale * mdy), (float)(sg * ctr)));
		else
			st4(coef, ch, make_float4((float)scale, (float)k1, (float)(-scale * mdy), (float)ctr));
	}
}

DEV float bwd_apply1(float u, float g, float4 k, int mode, int kind, float a) {
	if (mode == 1) {
		float y, dy;
		invert(u, g, kind, a, &y, &dy);
		u = y;
		g = dy;
	}
	return k.x * g + k.y * (u - k.w) + k.z;
}

DEV float4 bwd_apply4(float4 u, float4 g, float4 k, int mode, int kind, float a) {
	return make_float4(bwd_apply1(u.x, g.x, k, mode, kind, a), bwd_apply1(u.y, g.y, k, mode, kind, a),
		bwd_apply1(u.z, g.z, k, mode, kind, a), bwd_apply1(u.w, g.w, k, mode, kind, a));
}

// dx = k.x*gg + k.y*(u - k.w) + k.z over n units (see bn_bwd_final); dx
// may be g. Two units a grid apart per thread and round, as in bn_apply.
KERNEL void bn_bwd_apply(float* dx, const float* u, const float* g, const float* coef, i64 n, int c, unsigned mh,
	unsigned sh, unsigned mc, unsigned sc, int vec, int mode, int kind, float a) {
	i64 grid = (i64)gridDim.x * blockDim.x;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 2 * grid) {
		i64 j = i + grid;
		bool two = j < n;
		float4 k = unit_coef(coef, i, c, mh, sh, mc, sc);
		float4 k2 = two ? unit_coef(coef, j, c, mh, sh, mc, sc) : k;
		if (vec) {
			float4 uv = ld4(u, i), gv = ld4(g, i);
			float4 uw = two ? ld4(u, j) : uv, gw = two ? ld4(g, j) : gv;
			st4(dx, i, bwd_apply4(uv, gv, k, mode, kind, a));
			if (two) st4(dx, j, bwd_apply4(uw, gw, k2, mode, kind, a));
		} else {
			float uv = u[i], gv = g[i];
			float uw = two ? u[j] : uv, gw = two ? g[j] : gv;
			dx[i] = bwd_apply1(uv, gv, k, mode, kind, a);
			if (two) dx[j] = bwd_apply1(uw, gw, k2, mode, kind, a);
		}
	}
}
