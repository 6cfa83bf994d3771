// Max, average and adaptive average pools over planes of NCHW tensors, one
// thread per output (forward) or per input (backward, gather form, except
// max-pool backward, which only has the saved argmax and scatters with
// atomics into a zeroed gradient).
#include "common.cuh"

// y and idx (may be null) per output; the first maximum wins and NaN
// propagates, as in PyTorch and the CPU backend.
KERNEL void maxpool(float* y, i64* idx, const float* x, i64 total, int h, int w, int oh, int ow, int kh, int kw,
	int sh, int sw, int ph, int pw) {
	GRID_LOOP(o, total) {
		i64 pl = o / ((i64)oh * ow);
		int r = (int)(o - pl * oh * ow), i = r / ow, j = r % ow;
		int h0 = i * sh - ph, w0 = j * sw - pw;
		int h1 = imin(h0 + kh, h), w1 = imin(w0 + kw, w);
		h0 = imax(h0, 0);
		w0 = imax(w0, 0);
		const float* src = x + pl * h * w;
		float best = -INFINITY;
		int at = h0 * w + w0;
		for (int a = h0; a < h1; a++)
			for (int b = w0; b < w1; b++) {
				float v = src[a * w + b];
				if (v > best || v != v) {
					best = v;
					at = a * w + b;
				}
			}
		y[o] = best;
		if (idx) idx[o] = at;
	}
}

// dx (zeroed by the host) += dy at the saved positions.
KERNEL void maxpool_bwd(float* dx, const float* dy, const i64* idx, i64 total, int hw, int ohw) {
	GRID_LOOP(o, total) {
		i64 k = idx[o];
		if (k >= 0 && k < hw) atomicAdd(dx + (o / ohw) * hw + k, dy[o]);
	}
}

// PyTorch's average-pool window along one axis: the clipped range [lo, hi)
// and the divisor's extent.
DEV void avg_window(int i, int in, int k, int stride, int pad, int include_pad, int* lo, int* hi, int* size) {
	int l = i * stride - pad;
	int e = imin(l + k, in + pad);
	*size = e - l;
	l = imax(l, 0);
	e = imin(e, in);
	if (!include_pad) *size = e - l;
	*lo = l;
	*hi = e;
}

KERNEL void avgpool(float* y, const float* x, i64 total, int h, int w, int oh, int ow, int kh, int kw, int sh, int sw,
	int ph, int pw, int include_pad) {
	GRID_LOOP(o, total) {
		i64 pl = o / ((i64)oh * ow);
		int r = (int)(o - pl * oh * ow), i = r / ow, j = r % ow;
		int h0, h1, hs, w0, w1, ws;
		avg_window(i, h, kh, sh, ph, include_pad, &h0, &h1, &hs);
		avg_window(j, w, kw, sw, pw, include_pad, &w0, &w1, &ws);
		if (h0 >= h1 || w0 >= w1) {
			y[o] = 0.f;
			continue;
		}
		const float* src = x + pl * h * w;
		float sum = 0.f;
		for (int a = h0; a < h1; a++)
			for (int b = w0; b < w1; b++) sum += src[a * w + b];
		y[o] = sum / (float)(hs * ws);
	}
}

// The outputs whose window may hold input position p along one axis:
// those i with i*stride - pad <= p < i*stride - pad + k.
DEV void avg_candidates(int p, int k, int stride, int pad, int out, int* lo, int* hi) {
	int t = p + pad - k + 1;
	*lo = t <= 0 ? 0 : (t + stride - 1) / stride;
	*hi = imin((p + pad) / stride, out - 1);
}

KERNEL void avgpool_bwd(float* dx, const float* dy, i64 total, int h, int w, int oh, int ow, int kh, int kw, int sh,
	int sw, int ph, int pw, int include_pad) {
	GRID_LOOP(q, total) {
		i64 pl = q / ((i64)h * w);
		int r = (int)(q - pl * h * w), y0 = r / w, x0 = r % w;
		int ilo, ihi, jlo, jhi;
		avg_candidates(y0, kh, sh, ph, oh, &ilo, &ihi);
		avg_candidates(x0, kw, sw, pw, ow, &jlo, &jhi);
		const float* g = dy + pl * oh * ow;
		float sum = 0.f;
		for (int i = ilo; i <= ihi; i++) {
			int h0, h1, hs;
			avg_window(i, h, kh, sh, ph, include_pad, &h0, &h1, &hs);
			if (y0 < h0 || y0 >= h1) continue;
			for (int j = jlo; j <= jhi; j++) {
				int w0, w1, ws;
				avg_window(j, w, kw, sw, pw, include_pad, &w0, &w1, &ws);
				if (x0 < w0 || x0 >= w1) continue;
				sum += g[i * ow + j] / (float)(hs * ws);
			}
		}
		dx[q] = sum;
	}
}

// Adaptive windows: start = floor(i*in/out), end = ceil((i+1)*in/out).
DEV int ad_start(int i, int in, int out) { return (int)((i64)i * in / out); }
DEV int ad_end(int i, int in, int out) { return (int)(((i64)(i + 1) * in + out - 1) / out); }

KERNEL void adaptive_pool(float* y, const float* x, i64 total, int h, int w, int oh, int ow) {
	GRID_LOOP(o, total) {
		i64 pl = o / ((i64)oh * ow);
		int r = (int)(o - pl * oh * ow), i = r / ow, j = r % ow;
		int h0 = ad_start(i, h, oh), h1 = ad_end(i, h, oh), w0 = ad_start(j, w, ow), w1 = ad_end(j, w, ow);
		const float* src = x + pl * h * w;
		float sum = 0.f;
		for (int a = h0; a < h1; a++)
			for (int b = w0; b < w1; b++) sum += src[a * w + b];
		y[o] = sum / (float)((h1 - h0) * (w1 - w0));
	}
}

// The outputs whose adaptive window holds position p: from floor(p*out/in)
// to ceil((p+1)*out/in) - 1, each checked.
KERNEL void adaptive_pool_bwd(float* dx, const float* dy, i64 total, int h, int w, int oh, int ow) {
	GRID_LOOP(q, total) {
		i64 pl = q / ((i64)h * w);
		int r = (int)(q - pl * h * w), y0 = r / w, x0 = r % w;
		int ilo = (int)((i64)y0 * oh / h), ihi = imin((int)(((i64)(y0 + 1) * oh + h - 1) / h) - 1, oh - 1);
		int jlo = (int)((i64)x0 * ow / w), jhi = imin((int)(((i64)(x0 + 1) * ow + w - 1) / w) - 1, ow - 1);
		const float* g = dy + pl * oh * ow;
		float sum = 0.f;
		for (int i = ilo; i <= ihi; i++) {
			int h0 = ad_start(i, h, oh), h1 = ad_end(i, h, oh);
			if (y0 < h0 || y0 >= h1) continue;
			for (int j = jlo; j <= jhi; j++) {
				int w0 = ad_start(j, w, ow), w1 = ad_end(j, w, ow);
				if (x0 < w0 || x0 >= w1) continue;
				sum += g[i * ow + j] / (float)((h1 - h0) * (w1 - w0));
			}
		}
		dx[q] = sum;
	}
}
