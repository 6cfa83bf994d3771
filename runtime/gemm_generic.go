//go:build !amd64 || purego

package runtime

func bestKernel() microKernel { return genericKernel }

// KernelName names the GEMM micro-kernel in use.
func KernelName() string { return "generic 4x4" }
