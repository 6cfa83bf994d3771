// Shared definitions of abnconvert's CUDA kernels.
//
// The kernels are compiled twice: by nvcc into the PTX that the backend
// loads (make ptx), and by a host C++ compiler against emu.cuh, which runs
// every CUDA thread of a block as a fiber on the CPU, so that the default
// CPU-only machines can check the kernels' arithmetic against the Go CPU
// backend (go test -tags cudaemu ./cuda/). Kernels therefore use only what
// emu.cuh emulates: the index registers, __syncthreads, __shfl_down_sync,
// atomicAdd, __umulhi and the math functions used here. A warp shuffle
// must be reached by all 32 lanes of its warp, and blocks are whole warps.
#pragma once

#ifdef __CUDACC__
#define KERNEL extern "C" __global__
#define DEV static __device__ __forceinline__
#else
#include "emu.cuh"
#endif

typedef long long i64;
typedef unsigned long long u64;

// Activation kinds; the values are runtime.ActKind's.
#define ACT_IDENTITY 0
#define ACT_RELU 1
#define ACT_LEAKY 2
#define ACT_ELU 3
// The activations InPlace-ABN cannot invert: elementwise kernels only.
#define ACT_HARDTANH 4
#define ACT_SIGMOID 5
#define ACT_SILU 6
#define ACT_HARDSIGMOID 7
#define ACT_HARDSWISH 8
#define ACT_GELU 9

// Binary ops; the values are runtime.BinaryOp's.
#define BIN_ADD 0
#define BIN_SUB 1
#define BIN_MUL 2
#define BIN_DIV 3

// Threads per block of every kernel but the GEMM: a multiple of the warp.
#define BLOCK 256

// fdiv is division by an invariant divisor d through a magic multiplier m
// and shift s (Granlund and Montgomery; the host computes m and s, see
// fastdiv.go): exact for every n < 2^31 and d <= 2^31. Memory-bound kernels
// divide each element's flat index by the plane size, and a hardware
// division would cost more than the load it serves.
DEV unsigned fdiv(unsigned n, unsigned m, unsigned s) {
	unsigned t = __umulhi(n, m);
	return (t + n) >> s;
}

#define GRID_LOOP(i, n) \
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// The elements past the last whole float4 unit: fewer than 4, so only the
// first threads of block 0 see them.
#define TAIL_LOOP(i, n) for (i64 i = ((n) & ~3LL) + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += 4)

DEV float4 ld4(const float* p, i64 i) { return reinterpret_cast<const float4*>(p)[i]; }
DEV void st4(float* p, i64 i, float4 v) { reinterpret_cast<float4*>(p)[i] = v; }

DEV i64 lmin(i64 a, i64 b) { return a < b ? a : b; }
DEV int imin(int a, int b) { return a < b ? a : b; }
DEV int imax(int a, int b) { return a > b ? a : b; }

// act applies an activation with the CPU backend's conventions: ReLU keeps
// NaN, leaky ReLU scales every value whose sign bit is set (so -0 stays -0).
DEV float act(float v, int kind, float a) {
	switch (kind) {
	case ACT_RELU:
		return v != v ? v : (v > 0.f ? v : 0.f);
	case ACT_LEAKY:
		return signbit(v) ? v * a : v;
	case ACT_ELU:
		return v > 0.f ? v : a * expm1f(v);
	}
	return v;
}

// act_grad is g times the activation's derivative, from its input x or,
// when from_out, its output (for in-place activations). Zero counts as not
// positive, as in PyTorch.
DEV float act_grad(float g, float s, int kind, float a, int from_out) {
	switch (kind) {
	case ACT_RELU:
		return s > 0.f ? g : 0.f;
	case ACT_LEAKY:
		return s > 0.f ? g : g * a;
	case ACT_ELU:
		if (s > 0.f) return g;
		return from_out ? g * (s + a) : g * (a * expf(s));
	}
	return g;
}

// invert undoes an InPlace-ABN activation: from its output z and the
// output's gradient dz, the pre-activation y and its gradient dy.
DEV void invert(float z, float dz, int kind, float a, float* y, float* dy) {
	if (z >= 0.f || kind == ACT_IDENTITY) {
		*y = z;
		*dy = dz;
		return;
	}
	if (kind == ACT_LEAKY) {
		*y = z / a;
		*dy = dz * a;
		return;
	}
	// ELU
	*y = log1pf(z / a);
	*dy = dz * (z + a);
}

// Block-wide sums of doubles: warp shuffles, then one value per warp
// through shared memory. Every thread of the block must call them; thread 0
// gets the result.
DEV double warp_sum(double v) {
	for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
	return v;
}

DEV void block_sum2(double* a, double* b) {
	__shared__ double sa[BLOCK / 32], sb[BLOCK / 32];
	double x = warp_sum(*a), y = warp_sum(*b);
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	if (lane == 0) {
		sa[warp] = x;
		sb[warp] = y;
	}
	__syncthreads();
	if (warp == 0) {
		x = lane < BLOCK / 32 ? sa[lane] : 0.0;
		y = lane < BLOCK / 32 ? sb[lane] : 0.0;
		x = warp_sum(x);
		y = warp_sum(y);
	}
	*a = x;
	*b = y;
	__syncthreads();
}
