// Elementwise kernels: activations, sums, products, dropout masks, and the
// channel-slice copies of Concat and Split. Each is a grid-stride loop over
// float4 units (every tensor starts at the start of a device allocation, so
// it is 16-byte aligned), with the last n % 4 elements done one by one.
#include "common.cuh"

// The activations InPlace-ABN cannot invert, with the CPU backend's
// formulas and branch conventions (runtime/cpu_act.go) in float32, as
// PyTorch's CUDA kernels compute them: a and b are Hardtanh's bounds or
// Hardsigmoid's alpha and beta.
DEV float sigmoid(float x) {
	if (x >= 0.f) return 1.f / (1.f + expf(-x));
	float e = expf(x);
	return e / (1.f + e);
}

// Phi(x), the normal distribution's CDF, through erfc: 1 + erf(x/sqrt 2)
// cancels for negative x, erfc does not.
DEV float norm_cdf(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }

DEV float act_smooth(float x, int kind, float a, float b) {
	switch (kind) {
	case ACT_HARDTANH:
		// NaN passes, as PyTorch's clamp keeps it.
		return x < a ? a : (x > b ? b : x);
	case ACT_SIGMOID:
		return sigmoid(x);
	case ACT_SILU:
		return x * sigmoid(x);
	case ACT_HARDSIGMOID: {
		if (x != x) return x;
		float t = a * x + b;
		return t > 0.f ? (t < 1.f ? t : 1.f) : 0.f;
	}
	case ACT_HARDSWISH: {
		// A NaN stays NaN through both comparisons.
		float r = x + 3.f;
		r = r < 0.f ? 0.f : (r > 6.f ? 6.f : r);
		return x * r / 6.f;
	}
	case ACT_GELU:
		return x * norm_cdf(x);
	}
	return x;
}

// act_smooth_grad is g times the derivative at s: the input, or Sigmoid's
// output (the one it keeps). The gradient passes strictly inside
// Hardtanh's and Hardsigmoid's linear parts, as in PyTorch.
DEV float act_smooth_grad(float g, float s, int kind, float a, float b) {
	switch (kind) {
	case ACT_HARDTANH:
		return s > a && s < b ? g : 0.f;
	case ACT_SIGMOID:
		return g * s * (1.f - s);
	case ACT_SILU: {
		float sg = sigmoid(s);
		return g * sg * (1.f + s * (1.f - sg));
	}
	case ACT_HARDSIGMOID: {
		float t = a * s + b;
		return t > 0.f && t < 1.f ? g * a : 0.f;
	}
	case ACT_HARDSWISH:
		if (s < -3.f) return 0.f;
		return s <= 3.f ? g * (s / 3.f + 0.5f) : g;
	case ACT_GELU:
		return g * (norm_cdf(s) + s * expf(-0.5f * s * s) * 0.398942280401432678f);
	}
	return g;
}

DEV float act_any(float v, int kind, float a, float b) { return kind > ACT_ELU ? act_smooth(v, kind, a, b) : act(v, kind, a); }

// from_out applies to ELU alone (the CPU backend's convention): the smooth
// activations read s as what they keep.
DEV float act_any_grad(float g, float s, int kind, float a, float b, int from_out) {
	return kind > ACT_ELU ? act_smooth_grad(g, s, kind, a, b) : act_grad(g, s, kind, a, from_out);
}

// y = act(x); y may be x.
KERNEL void ew_act(float* y, const float* x, i64 n, int kind, float a, float b) {
	GRID_LOOP(i, n >> 2) {
		float4 v = ld4(x, i);
		v.x = act_any(v.x, kind, a, b);
		v.y = act_any(v.y, kind, a, b);
		v.z = act_any(v.z, kind, a, b);
		v.w = act_any(v.w, kind, a, b);
		st4(y, i, v);
	}
	TAIL_LOOP(i, n) y[i] = act_any(x[i], kind, a, b);
}

// dx = dy * act'(s), s the activation's input or (from_out) output; dx may
// be dy.
KERNEL void ew_act_bwd(float* dx, const float* dy, const float* s, i64 n, int kind, float a, float b, int from_out) {
	GRID_LOOP(i, n >> 2) {
		float4 g = ld4(dy, i), v = ld4(s, i);
		g.x = act_any_grad(g.x, v.x, kind, a, b, from_out);
		g.y = act_any_grad(g.y, v.y, kind, a, b, from_out);
		g.z = act_any_grad(g.z, v.z, kind, a, b, from_out);
		g.w = act_any_grad(g.w, v.w, kind, a, b, from_out);
		st4(dx, i, g);
	}
	TAIL_LOOP(i, n) dx[i] = act_any_grad(dy[i], s[i], kind, a, b, from_out);
}

// y = a + b.
KERNEL void ew_add(float* y, const float* a, const float* b, i64 n) {
	GRID_LOOP(i, n >> 2) {
		float4 u = ld4(a, i), v = ld4(b, i);
		st4(y, i, make_float4(u.x + v.x, u.y + v.y, u.z + v.z, u.w + v.w));
	}
	TAIL_LOOP(i, n) y[i] = a[i] + b[i];
}

// y += x.
KERNEL void ew_acc(float* y, const float* x, i64 n) {
	GRID_LOOP(i, n >> 2) {
		float4 u = ld4(y, i), v = ld4(x, i);
		st4(y, i, make_float4(u.x + v.x, u.y + v.y, u.z + v.z, u.w + v.w));
	}
	TAIL_LOOP(i, n) y[i] += x[i];
}

// y = a * b; y may be a or b.
KERNEL void ew_mul(float* y, const float* a, const float* b, i64 n) {
	GRID_LOOP(i, n >> 2) {
		float4 u = ld4(a, i), v = ld4(b, i);
		st4(y, i, make_float4(u.x * v.x, u.y * v.y, u.z * v.z, u.w * v.w));
	}
	TAIL_LOOP(i, n) y[i] = a[i] * b[i];
}

// The dropout mask: element i is kept (scale) when splitmix64(seed +
// i*golden)'s top 53 bits, as a fraction of 2^53, are >= p; else 0. This is
// runtime.DropoutKeep, bit for bit, so every backend draws the same mask.
KERNEL void ew_dropout(float* m, i64 n, u64 seed, double p, float scale) {
	GRID_LOOP(i, n) {
		u64 z = seed + (u64)i * 0x9E3779B97F4A7C15ULL;
		z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
		z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
		z ^= z >> 31;
		double u = (double)(z >> 11) / 9007199254740992.0;
		m[i] = u >= p ? scale : 0.f;
	}
}

// Concat (join) and Split: per image, a part's block of part_len units sits
// at offset units into the whole's block of whole_len units. n is the
// part's unit count (images * part_len); (pm, ps) divide by part_len. With
// vec, a unit is a float4 (every length and the offset are then multiples
// of 4 floats); else a float.
KERNEL void ew_slices(float* whole, float* part, i64 n, i64 part_len, i64 whole_len, i64 offset, unsigned pm,
	unsigned ps, int vec, int join) {
	GRID_LOOP(i, n) {
		i64 img = fdiv((unsigned)i, pm, ps);
		i64 w = img * whole_len + offset + (i - img * part_len);
		if (vec) {
			if (join)
				st4(whole, w, ld4(part, i));
			else
				st4(part, i, ld4(whole, w));
		} else {
			if (join)
				whole[w] = part[i];
			else
				part[i] = whole[w];
		}
	}
}
