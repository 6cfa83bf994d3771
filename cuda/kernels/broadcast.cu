// Broadcasting binary ops (Add, Sub, Mul, Div of operands of different
// shapes: squeeze-and-excitation's x * gate) and their backward.
//
// The host collapses the broadcast to at most four dimensions (dropping
// those of size 1, merging neighbours that every operand walks alike) and
// passes them as d0..d3, d0 implied by the element count; each flat index
// v over those dimensions is split by fdiv into four indices, whose dot
// products with the strides so, sa and sb (zero along a broadcast
// dimension) are the offsets into the result and the two operands. The
// backward sum of an operand's gradient runs over the same decomposition
// with the dimensions permuted, the operand's own first: v = j * r + k, j
// the gradient's element and k one of the r result elements it sums.
#include "strided.cuh"

// The forward in float32, as the CPU backend computes it (one rounding).
DEV float bop(int op, float x, float y) {
	switch (op) {
	case BIN_SUB:
		return x - y;
	case BIN_MUL:
		return x * y;
	case BIN_DIV:
		return x / y;
	}
	return x + y;
}

// One term of an operand's gradient (which: 0 for a, 1 for b), in double
// as the CPU backend sums them. a and b are read for Mul and Div only: Add
// and Sub keep no operands, and the host passes null for them.
DEV double bterm(int op, int which, float g, const float* a, const float* b, i64 ia, i64 ib) {
	double G = g;
	switch (op) {
	case BIN_SUB:
		return which ? -G : G;
	case BIN_MUL:
		return which ? G * (double)a[ia] : G * (double)b[ib];
	case BIN_DIV: {
		double q = G / (double)b[ib];
		return which ? -q * (double)a[ia] / (double)b[ib] : q;
	}
	}
	return G;
}

// y = a op b over n result elements; y may be a or b where its shape is
// theirs.
KERNEL void bc_binary(float* y, const float* a, const float* b, i64 n, int op,
	unsigned d1, unsigned m1, unsigned s1, unsigned d2, unsigned m2, unsigned s2, unsigned d3,
	unsigned m3, unsigned s3, i64 so0, i64 so1, i64 so2, i64 so3, i64 sa0, i64 sa1, i64 sa2, i64 sa3, i64 sb0, i64 sb1,
	i64 sb2, i64 sb3) {
	const bgeo g = BGEO;
	GRID_LOOP(v, n) {
		i64 o, ia, ib;
		bsplit(g, (unsigned)v, &o, &ia, &ib);
		y[o] = bop(op, a[ia], b[ib]);
	}
}

// The gradients of the operands that were not broadcast (da and db of the
// result's shape; null for a broadcast one, which bc_binary_sum writes):
// one term each per result element.
KERNEL void bc_binary_bwd(float* da, float* db, const float* dy, const float* a, const float* b, i64 n, int op,
	unsigned d1, unsigned m1, unsigned s1, unsigned d2, unsigned m2, unsigned s2, unsigned d3,
	unsigned m3, unsigned s3, i64 so0, i64 so1, i64 so2, i64 so3, i64 sa0, i64 sa1, i64 sa2, i64 sa3, i64 sb0, i64 sb1,
	i64 sb2, i64 sb3) {
	const bgeo g = BGEO;
	GRID_LOOP(v, n) {
		i64 o, ia, ib;
		bsplit(g, (unsigned)v, &o, &ia, &ib);
		float gy = dy[o];
		double ta = da ? bterm(op, 0, gy, a, b, ia, ib) : 0.0;
		double tb = db ? bterm(op, 1, gy, a, b, ia, ib) : 0.0;
		if (da) da[ia] = (float)ta;
		if (db) db[ib] = (float)tb;
	}
}

// The gradient of a broadcast operand (which: 0 for a, 1 for b): dx[j] is
// the sum of r terms, one block per j, summed in double. The geometry is
// permuted so that v = j * r + k.
KERNEL void bc_binary_sum(float* dx, const float* dy, const float* a, const float* b, i64 m, i64 r, int op, int which,
	unsigned d1, unsigned m1, unsigned s1, unsigned d2, unsigned m2, unsigned s2, unsigned d3,
	unsigned m3, unsigned s3, i64 so0, i64 so1, i64 so2, i64 so3, i64 sa0, i64 sa1, i64 sa2, i64 sa3, i64 sb0, i64 sb1,
	i64 sb2, i64 sb3) {
	const bgeo g = BGEO;
	for (i64 j = blockIdx.x; j < m; j += gridDim.x) {
		double s = 0.0, unused = 0.0;
		for (i64 k = threadIdx.x; k < r; k += blockDim.x) {
			i64 o, ia, ib;
			bsplit(g, (unsigned)(j * r + k), &o, &ia, &ib);
			s += bterm(op, which, dy[o], a, b, ia, ib);
		}
		block_sum2(&s, &unused);
		if (threadIdx.x == 0) dx[j] = (float)s;
	}
}
