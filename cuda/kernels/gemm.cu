// Single-precision matrix product for convolutions and linear layers:
// C = op(A)·op(B), or C += op(A)·op(B) with acc, on row-major matrices,
// batched over blockIdx.z (A, B and C advance by sa, sb and sc floats per
// batch entry; a stride of 0 shares the matrix). op(A) is M×K: A[i*lda + p],
// or A[p*lda + i] with ta. op(B) is K×N: B[p*ldb + j], or B[j*ldb + p] with
// tb.
//
// A 64×64 tile of C per block of 256 threads, 4×4 values per thread, k in
// steps of 16 through shared memory. Written here rather than taken from
// cuBLAS so that the binary needs only the driver (libcuda), which is what a
// machine with a GPU is sure to have.
#include "common.cuh"

#define TM 64
#define TN 64
#define TK 16

KERNEL void sgemm(float* C, const float* A, const float* B, int M, int N, int K, int lda, int ldb, int ldc, i64 sa,
	i64 sb, i64 sc, int ta, int tb, int acc) {
	__shared__ __align__(16) float As[TK][TM];
	__shared__ __align__(16) float Bs[TK][TN];
	A += sa * blockIdx.z;
	B += sb * blockIdx.z;
	C += sc * blockIdx.z;
	int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
	int m0 = blockIdx.y * TM, n0 = blockIdx.x * TN;
	float r[4][4];
	for (int i = 0; i < 4; i++)
		for (int j = 0; j < 4; j++) r[i][j] = 0.f;
	for (int k0 = 0; k0 < K; k0 += TK) {
		// Each thread loads 4 of the 1024 values of each tile; the
		// index order follows the stored layout, so that neighbouring
		// threads read neighbouring addresses.
		for (int q = 0; q < 4; q++) {
			int e = tid + q * 256;
			int row, kk;
			if (ta) {
				kk = e / TM;
				row = e % TM;
			} else {
				row = e / TK;
				kk = e % TK;
			}
			int gi = m0 + row, gp = k0 + kk;
			float v = 0.f;
			if (gi < M && gp < K) v = ta ? A[(i64)gp * lda + gi] : A[(i64)gi * lda + gp];
			As[kk][row] = v;
			int col;
			if (tb) {
				col = e / TK;
				kk = e % TK;
			} else {
				kk = e / TN;
				col = e % TN;
			}
			int gj = n0 + col;
			gp = k0 + kk;
			v = 0.f;
			if (gj < N && gp < K) v = tb ? B[(i64)gj * ldb + gp] : B[(i64)gp * ldb + gj];
			Bs[kk][col] = v;
		}
		__syncthreads();
		for (int kk = 0; kk < TK; kk++) {
			float4 a = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
			float4 b = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
			float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
			for (int i = 0; i < 4; i++)
				for (int j = 0; j < 4; j++) r[i][j] += av[i] * bv[j];
		}
		__syncthreads();
	}
	for (int i = 0; i < 4; i++) {
		int gi = m0 + ty * 4 + i;
		if (gi >= M) continue;
		for (int j = 0; j < 4; j++) {
			int gj = n0 + tx * 4 + j;
			if (gj >= N) continue;
			float* p = C + (i64)gi * ldc + gj;
			*p = acc ? *p + r[i][j] : r[i][j];
		}
	}
}
