package cuda

import (
	"embed"
	"fmt"
	"path"
	"sort"
	"strings"
)

// The PTX of kernels/*.cu, made by `make ptx` (nvcc -arch=compute_70
// -ptx): PTX for a low virtual architecture, which the driver compiles for
// whatever GPU it finds (an H200 is compute capability 9.0).
//
//go:embed kernels/*.ptx
var ptxFiles embed.FS

// kernelID names a kernel the backend launches: an index into kernelSpecs.
type kernelID int

const (
	kAct kernelID = iota
	kActBwd
	kAdd
	kAcc
	kMul
	kDropout
	kSlices
	kBNStats
	kBNStatsFinal
	kBNUpdateRunning
	kBNCoeffs
	kBNApply
	kBNBwdReduce
	kBNBwdFinal
	kBNBwdApply
	kIm2col
	kCol2im
	kBiasAdd
	kChanSum
	kBatchSum
	kSgemm
	kMaxPool
	kMaxPoolBwd
	kAvgPool
	kAvgPoolBwd
	kAdaptivePool
	kAdaptivePoolBwd
	kBinary
	kBinaryBwd
	kBinarySum
	kLayCopy
	kResize
	kResizeBwd
	numKernels
)

// kernelSpec is a kernel's name, the PTX module (kernels/<module>.ptx) that
// defines it, and its parameters, one letter each: p a device pointer, l a
// 64-bit integer, i a 32-bit integer, f a float, d a double. The launcher
// refuses arguments of other kinds, and the tests check the letters
// against the PTX declarations, so a kernel signature edited on one side
// only fails before it reaches a GPU.
type kernelSpec struct {
	name, module, params string
}

var kernelSpecs = [numKernels]kernelSpec{
	kAct:             {"ew_act", "elementwise", "ppliff"},
	kActBwd:          {"ew_act_bwd", "elementwise", "pppliffi"},
	kAdd:             {"ew_add", "elementwise", "pppl"},
	kAcc:             {"ew_acc", "elementwise", "ppl"},
	kMul:             {"ew_mul", "elementwise", "pppl"},
	kDropout:         {"ew_dropout", "elementwise", "plldf"},
	kSlices:          {"ew_slices", "elementwise", "pplllliiii"},
	kBNStats:         {"bn_stats", "norm", "ppiiiiiii"},
	kBNStatsFinal:    {"bn_stats_final", "norm", "pppppiiid"},
	kBNUpdateRunning: {"bn_update_running", "norm", "ppppidd"},
	kBNCoeffs:        {"bn_coeffs", "norm", "ppppppidi"},
	kBNApply:         {"bn_apply", "norm", "pppliiiiiiif"},
	kBNBwdReduce:     {"bn_bwd_reduce", "norm", "pppppiiiiiiiiif"},
	kBNBwdFinal:      {"bn_bwd_final", "norm", "ppppppppiiddiii"},
	kBNBwdApply:      {"bn_bwd_apply", "norm", "ppppliiiiiiiif"},
	kIm2col:          {"im2col", "conv", "ppiliiiiiiiiiiiii"},
	kCol2im:          {"col2im", "conv", "ppiliiiiiiiiiiiii"},
	kBiasAdd:         {"bias_add", "conv", "pplii"},
	kChanSum:         {"chan_sum", "conv", "ppiii"},
	kBatchSum:        {"batch_sum", "conv", "pplii"},
	kSgemm:           {"sgemm", "gemm", "pppiiiiiillliii"},
	kMaxPool:         {"maxpool", "pool", "pppliiiiiiiiii"},
	kMaxPoolBwd:      {"maxpool_bwd", "pool", "ppplii"},
	kAvgPool:         {"avgpool", "pool", "ppliiiiiiiiiii"},
	kAvgPoolBwd:      {"avgpool_bwd", "pool", "ppliiiiiiiiiii"},
	kAdaptivePool:    {"adaptive_pool", "pool", "ppliiii"},
	kAdaptivePoolBwd: {"adaptive_pool_bwd", "pool", "ppliiii"},
	kBinary:          {"bc_binary", "broadcast", "pppli" + bgeoParams},
	kBinaryBwd:       {"bc_binary_bwd", "broadcast", "pppppli" + bgeoParams},
	kBinarySum:       {"bc_binary_sum", "broadcast", "ppppllii" + bgeoParams},
	kLayCopy:         {"lay_copy", "layout", "ppli" + bgeoParams},
	kResize:          {"lay_resize", "layout", "ppliiiiiiiiiiffi"},
	kResizeBwd:       {"lay_resize_bwd", "layout", "ppliiiiiiiiiiffi"},
}

func (k kernelID) String() string {
	if k < 0 || k >= numKernels {
		return fmt.Sprintf("kernel(%d)", int(k))
	}
	return kernelSpecs[k].name
}

// ptxSources returns the embedded PTX by module name.
func ptxSources() (map[string]string, error) {
	ents, err := ptxFiles.ReadDir("kernels")
	if err != nil {
		return nil, fmt.Errorf("cuda: embedded PTX: %w", err)
	}
	out := map[string]string{}
	for _, e := range ents {
		b, err := ptxFiles.ReadFile(path.Join("kernels", e.Name()))
		if err != nil {
			return nil, fmt.Errorf("cuda: embedded PTX %s: %w", e.Name(), err)
		}
		out[strings.TrimSuffix(e.Name(), ".ptx")] = string(b)
	}
	return out, nil
}

// modules lists the PTX modules the kernels live in, sorted.
func modules() []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range kernelSpecs {
		if !seen[s.module] {
			seen[s.module] = true
			out = append(out, s.module)
		}
	}
	sort.Strings(out)
	return out
}

// ptxTypeFits says whether a PTX parameter type takes an argument of kind
// c (a kernelSpec letter).
func ptxTypeFits(c byte, typ string) bool {
	switch c {
	case 'p', 'l':
		return typ == ".u64" || typ == ".s64" || typ == ".b64"
	case 'i':
		return typ == ".u32" || typ == ".s32" || typ == ".b32"
	case 'f':
		return typ == ".f32"
	case 'd':
		return typ == ".f64"
	}
	return false
}
