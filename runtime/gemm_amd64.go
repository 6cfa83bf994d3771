//go:build amd64 && !purego

package runtime

// The amd64 build uses an assembly micro-kernel (gemm_amd64.s) when the CPU
// has AVX2 and FMA and the OS saves the YMM registers. Measured on the
// project's 2-core EPYC against the alternatives (one core, a 256×196×2304
// product): the plain-Go 4×4 kernel about 3 GFLOP/s, a simd/archsimd
// (GOEXPERIMENT=simd) 4×16 kernel about 25-35 (the compiler's FMA form
// needs a register move per multiply-add and spills larger tiles), this
// kernel about 40-60, gonum's Sgemm about 6.

//go:noescape
func kernel6x16asm(kc int, a, b, c *float32, ldc int, add bool)

func cpuid(leaf, sub uint32) (eax, ebx, ecx, edx uint32)

func xgetbv() (eax, edx uint32)

var asmKernel = microKernel{mr: 6, nr: 16, fn: kernel6x16}

func kernel6x16(kc int, a, b, c []float32, ldc int, add bool) {
	// The assembly trusts its pointers: check every bound once here.
	_ = a[kc*6-1]
	_ = b[kc*16-1]
	_ = c[5*ldc+15]
	kernel6x16asm(kc, &a[0], &b[0], &c[0], ldc, add)
}

// hasAVX2FMA reports whether the CPU has AVX2 and FMA and the OS has
// enabled the YMM state.
func hasAVX2FMA() bool {
	max, _, _, _ := cpuid(0, 0)
	if max < 7 {
		return false
	}
	_, _, ecx1, _ := cpuid(1, 0)
	const fma, osxsave, avx = 1 << 12, 1 << 27, 1 << 28
	if ecx1&fma == 0 || ecx1&osxsave == 0 || ecx1&avx == 0 {
		return false
	}
	if lo, _ := xgetbv(); lo&6 != 6 {
		return false
	}
	_, ebx7, _, _ := cpuid(7, 0)
	return ebx7&(1<<5) != 0
}

func bestKernel() microKernel {
	if hasAVX2FMA() {
		return asmKernel
	}
	return genericKernel
}

// KernelName names the GEMM micro-kernel in use.
func KernelName() string {
	if gemmKernel.mr == asmKernel.mr {
		return "avx2-fma asm 6x16"
	}
	return "generic 4x4"
}
