// Elementwise kernels: activations, sums, products, dropout masks, and the
// channel-slice copies of Concat and Split. Each is a grid-stride loop over
// float4 units (every tensor starts at the start of a device allocation, so
// it is 16-byte aligned), with the last n % 4 elements done one by one.
#include "common.cuh"

// y = act(x); y may be x.
KERNEL void ew_act(float* y, const float* x, i64 n, int kind, float a) {
	GRID_LOOP(i, n >> 2) {
		float4 v = ld4(x, i);
		v.x = act(v.x, kind, a);
		v.y = act(v.y, kind, a);
		v.z = act(v.z, kind, a);
		v.w = act(v.w, kind, a);
		st4(y, i, v);
	}
	TAIL_LOOP(i, n) y[i] = act(x[i], kind, a);
}

// dx = dy * act'(s), s the activation's input or (from_out) output; dx may
// be dy.
KERNEL void ew_act_bwd(float* dx, const float* dy, const float* s, i64 n, int kind, float a, int from_out) {
	GRID_LOOP(i, n >> 2) {
		float4 g = ld4(dy, i), v = ld4(s, i);
		g.x = act_grad(g.x, v.x, kind, a, from_out);
		g.y = act_grad(g.y, v.y, kind, a, from_out);
		g.z = act_grad(g.z, v.z, kind, a, from_out);
		g.w = act_grad(g.w, v.w, kind, a, from_out);
		st4(dx, i, g);
	}
	TAIL_LOOP(i, n) dx[i] = act_grad(dy[i], s[i], kind, a, from_out);
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
