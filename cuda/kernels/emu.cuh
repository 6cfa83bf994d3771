// Host emulation of the CUDA built-ins that the kernels use, for compiling
// kernels/*.cu with a C++ compiler (see ../emu.cc, built with the cudaemu
// tag). Each CUDA thread of a block runs as a fiber; __syncthreads and the
// warp shuffles are barriers between fibers, so the kernels run with their
// real block structure, one block after another, on one CPU thread.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace emu {
struct dim3 {
	unsigned x, y, z;
};
struct Thread {
	dim3 idx;
	int linear;
};
extern dim3 block_idx, block_dim, grid_dim;
extern Thread* current;
void syncthreads();
uint64_t shfl_down_bits(uint64_t bits, int delta);
}  // namespace emu

#define KERNEL extern "C"
#define DEV static inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx (emu::current->idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define __syncthreads() emu::syncthreads()

struct alignas(16) float4 {
	float x, y, z, w;
};

static inline float4 make_float4(float a, float b, float c, float d) {
	float4 v = {a, b, c, d};
	return v;
}

static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }

template <class T>
static inline T __shfl_down_sync(unsigned, T v, int delta) {
	static_assert(sizeof(T) <= 8, "shuffle of a value wider than 64 bits");
	uint64_t bits = 0;
	memcpy(&bits, &v, sizeof v);
	bits = emu::shfl_down_bits(bits, delta);
	T r;
	memcpy(&r, &bits, sizeof r);
	return r;
}

// One CPU thread runs every fiber, and fibers switch only at barriers:
// read-modify-write is atomic here.
static inline float atomicAdd(float* p, float v) {
	float old = *p;
	*p = old + v;
	return old;
}

// The round-to-nearest intrinsics the kernels use where a fused
// multiply-add would move a result off the CPU backend's: the host
// compiler contracts nothing for baseline x86-64.
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
