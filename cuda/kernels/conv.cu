// The convolution's helpers around the GEMM (gemm.cu): im2col and its
// adjoint col2im over a chunk of images of one group, bias broadcast,
// per-channel sums (bias gradients) and the sum of per-image partial
// products (weight gradients).
#include "common.cuh"

// col[img][k][l] for nb images: k = (ci*kh + a)*kw + b over the cg input
// channels of the group and the kernel window, l = oy*ow + ox over the
// output plane. x points at the group's first channel of the first image;
// images are x_img floats apart. Positions outside the input read 0. The
// chunk has fewer than 2^31 values (the host sizes it).
KERNEL void im2col(float* col, const float* x, int nb, i64 x_img, int cg, int h, int w, int kh, int kw, int oh,
	int ow, int sh, int sw, int ph, int pw, int dh, int dw) {
	unsigned l_n = (unsigned)oh * ow, k_n = (unsigned)cg * kh * kw;
	i64 total = (i64)nb * k_n * l_n;
	GRID_LOOP(i, total) {
		unsigned idx = (unsigned)i;
		unsigned l = idx % l_n, rest = idx / l_n;
		unsigned k = rest % k_n, img = rest / k_n;
		int b = k % kw, a = (k / kw) % kh, ci = k / (kw * kh);
		int oy = l / ow, ox = l % ow;
		int iy = oy * sh - ph + a * dh, ix = ox * sw - pw + b * dw;
		float v = 0.f;
		if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = x[img * x_img + ((i64)ci * h + iy) * w + ix];
		col[i] = v;
	}
}

// col2im writes each input position of the chunk (overwriting it) with the
// sum of the col entries that im2col copied from it: the gather form of the
// adjoint, so no two threads write one place.
KERNEL void col2im(float* x, const float* col, int nb, i64 x_img, int cg, int h, int w, int kh, int kw, int oh,
	int ow, int sh, int sw, int ph, int pw, int dh, int dw) {
	unsigned plane = (unsigned)h * w, per_img = (unsigned)cg * plane;
	unsigned l_n = (unsigned)oh * ow, k_n = (unsigned)cg * kh * kw;
	i64 total = (i64)nb * per_img;
	GRID_LOOP(i, total) {
		unsigned idx = (unsigned)i;
		unsigned img = idx / per_img, r = idx % per_img;
		int ci = r / plane, iy = (r % plane) / w, ix = r % w;
		float sum = 0.f;
		for (int a = 0; a < kh; a++) {
			int ty = iy + ph - a * dh;
			if (ty < 0 || ty % sh != 0) continue;
			int oy = ty / sh;
			if (oy >= oh) continue;
			for (int b = 0; b < kw; b++) {
				int tx = ix + pw - b * dw;
				if (tx < 0 || tx % sw != 0) continue;
				int ox = tx / sw;
				if (ox >= ow) continue;
				unsigned k = ((unsigned)ci * kh + a) * kw + b;
				sum += col[((i64)img * k_n + k) * l_n + (unsigned)oy * ow + ox];
			}
		}
		x[img * x_img + r] = sum;
	}
}

// y[n][ch][j] += bias[ch] over n values, c channels of hw values.
KERNEL void bias_add(float* y, const float* bias, i64 n, int c, int hw) {
	GRID_LOOP(i, n) y[i] += bias[(i / hw) % c];
}

// out[ch] = sum over images and positions of y[img][ch][j]: one block per
// channel, summed in double.
KERNEL void chan_sum(float* out, const float* y, int n_img, int c, int hw) {
	int ch = blockIdx.x;
	double s = 0, unused = 0;
	i64 units = (i64)n_img * hw;
	for (i64 u = threadIdx.x; u < units; u += blockDim.x) {
		i64 img = u / hw;
		s += y[(img * c + ch) * hw + (u - img * hw)];
	}
	block_sum2(&s, &unused);
	if (threadIdx.x == 0) out[ch] = (float)s;
}

// out[i] = (acc ? out[i] : 0) + sum over b < nb of parts[b*n + i].
KERNEL void batch_sum(float* out, const float* parts, i64 n, int nb, int acc) {
	GRID_LOOP(i, n) {
		float s = acc ? out[i] : 0.f;
		for (int b = 0; b < nb; b++) s += parts[(i64)b * n + i];
		out[i] = s;
	}
}
