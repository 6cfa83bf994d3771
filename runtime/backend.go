package runtime

import "fmt"

// DType is the element type of a device tensor.
type DType uint8

const (
	// Float32 holds activations, gradients, parameters and dropout masks.
	Float32 DType = iota
	// Int64 holds max-pool argmax indices. PyTorch saves them as int64, so
	// the runtime does too: the memory figures then compare byte for byte.
	Int64
	// BFloat16 and Float16 hold activations, their gradients and weight
	// copies under Options.Half: 16-bit storage, as under torch.autocast.
	// A computing backend may compute in float32 from them; values written
	// to them are rounded to nearest, ties to even.
	BFloat16
	Float16
)

// Size is the byte size of one element.
func (d DType) Size() int64 {
	switch d {
	case Int64:
		return 8
	case BFloat16, Float16:
		return 2
	}
	return 4
}

// Is16 reports whether d is one of the 16-bit float formats.
func (d DType) Is16() bool { return d == BFloat16 || d == Float16 }

func (d DType) String() string {
	switch d {
	case Int64:
		return "int64"
	case BFloat16:
		return "bfloat16"
	case Float16:
		return "float16"
	}
	return "float32"
}

// Tensor is an opaque handle to a backend's tensor: its data lives wherever
// the backend keeps it (Go memory, device memory, nowhere). The executor only
// ever passes handles back to the backend that made them; it reads or writes
// data through Upload and Download alone.
type Tensor interface {
	Shape() []int
	DType() DType
}

// Backend runs the ops. It is split by op family so that a backend (the CPU
// one here, a CUDA one later) implements each family with the library or
// kernels that suit it. Every output tensor is allocated by the executor
// through Alloc before the op is called; ops never allocate tensors the
// executor can see (scratch space is the backend's own business).
//
// Unless an op says otherwise, outputs must not alias inputs.
type Backend interface {
	// Name identifies the backend in reports ("cpu", "shapes").
	Name() string
	// Executes reports whether ops compute values. A backend that only
	// tracks shapes and memory returns false: the executor then neither
	// reads parameter values nor transfers data.
	Executes() bool

	Allocator
	Transfer
	Elementwise
	Convolution
	Dense
	Normalization
	Pooling
}

// Allocator hands out device memory. Every tensor the executor holds comes
// from Alloc (or is a View of one), and Stats counts the bytes of live
// allocations: that count is the runtime's memory measurement.
type Allocator interface {
	// Alloc returns a tensor of the given shape; contents are undefined.
	Alloc(shape []int, dt DType) (Tensor, error)
	// View returns a handle on the first numel(shape) elements of t's
	// storage with a new shape. It allocates nothing; the view must not be
	// used after its storage is freed, and must not be freed itself.
	View(t Tensor, shape []int) (Tensor, error)
	// Free releases an allocation made by Alloc.
	Free(t Tensor) error
	// Stats reports the bytes allocated and not yet freed, and the peak of
	// that figure since the last ResetPeak.
	Stats() AllocStats
	// ResetPeak sets the peak to the current live bytes.
	ResetPeak()
}

// AllocStats is an allocator's count.
type AllocStats struct {
	LiveBytes int64 `json:"live_bytes"`
	PeakBytes int64 `json:"peak_bytes"`
	// Allocs counts calls to Alloc since the backend was made.
	Allocs int `json:"allocs"`
}

// DeviceMemory is implemented by backends on a device whose driver keeps
// its own count (cuda): it lets a measurement cross-check the allocator's
// figures, which are the runtime's, against the driver's.
type DeviceMemory interface {
	// DeviceMemory reads the figures after the queued work has run.
	DeviceMemory() (DeviceFigures, error)
	// TrimCache gives the allocator's cached free blocks back to the
	// driver and restarts PeakReservedBytes, so that the next figures are
	// one measurement's own.
	TrimCache() error
}

// DeviceFigures are a device's memory figures at one moment.
type DeviceFigures struct {
	// LiveBytes is the backend's own count (Stats().LiveBytes).
	LiveBytes int64 `json:"live_bytes"`
	// ReservedBytes is what the backend's allocator holds from the
	// driver: live blocks (rounded), scratch buffers and cached free
	// blocks.
	ReservedBytes int64 `json:"reserved_bytes"`
	// PeakReservedBytes is the most ReservedBytes has been since the last
	// TrimCache.
	PeakReservedBytes int64 `json:"peak_reserved_bytes"`
	// DriverUsedBytes is the driver's used memory (total minus free) above
	// what it was when the device was opened.
	DriverUsedBytes int64 `json:"driver_used_bytes"`
	// TotalBytes is the device's memory.
	TotalBytes int64 `json:"total_bytes"`
}

// Transfer moves data between the host and the backend.
type Transfer interface {
	// Upload writes src (row-major, len = numel) into dst, converting to
	// dst's type.
	Upload(dst Tensor, src []float32) error
	// Download reads src into dst (len = numel).
	Download(src Tensor, dst []float32) error
}

// Elementwise holds ops that treat tensors as flat arrays or as channel
// slices.
type Elementwise interface {
	// Copy copies src into dst (same numel).
	Copy(dst, src Tensor) error
	// Sum writes the elementwise sum of srcs (same shape) into dst.
	Sum(dst Tensor, srcs ...Tensor) error
	// Accumulate adds src into dst (same numel).
	Accumulate(dst, src Tensor) error
	// Activation writes act(src) into dst; dst may be src (in place).
	Activation(dst, src Tensor, act Act) error
	// ActivationBackward writes the input gradient into dx from the output
	// gradient dy and a saved tensor: the op's output when fromOutput (for
	// in-place activations, which keep only their result), else its input.
	// dx may be dy.
	ActivationBackward(dx, dy, saved Tensor, act Act, fromOutput bool) error
	// DropoutMask fills mask with 1/(1-p) for kept elements and 0 for
	// dropped ones, drawn from seed (see DropoutKeep for the rule).
	DropoutMask(mask Tensor, p float64, seed uint64) error
	// Mul writes the elementwise product a*b into dst; dst may be a or b.
	Mul(dst, a, b Tensor) error
	// Concat writes srcs one after another along dimension 1 into dst.
	Concat(dst Tensor, srcs ...Tensor) error
	// Split is Concat's adjoint: it copies consecutive dimension-1 slices
	// of src into dsts.
	Split(src Tensor, dsts ...Tensor) error
}

// Convolution holds 2-d convolution over NCHW tensors; weights are
// [out, in/groups, kh, kw].
type Convolution interface {
	// Conv2d writes conv(x, w) + b into y; b may be nil.
	Conv2d(y, x, w, b Tensor, p ConvParams) error
	// Conv2dBackward computes the gradients of the input (dx), the weight
	// (dw) and the bias (db) from the output gradient dy; each of the three
	// may be nil when not wanted. dw and db are overwritten, not
	// accumulated.
	Conv2dBackward(dx, dw, db, dy, x, w Tensor, p ConvParams) error
}

// Dense holds the fully connected layer over [N, in] tensors with weights
// [out, in].
type Dense interface {
	// Linear writes x·wᵀ + b into y; b may be nil.
	Linear(y, x, w, b Tensor) error
	// LinearBackward computes dx, dw, db from dy (each may be nil).
	LinearBackward(dx, dw, db, dy, x, w Tensor) error
}

// Normalization holds batch normalisation and the ABN family over NCHW
// tensors, per channel. sign, when not nil, is a [C] tensor of ±1 that
// multiplies the input before anything else (Node.Sign): the ops behave as
// if applied to sign*x, without writing it.
type Normalization interface {
	// BatchStats writes the per-channel mean and biased variance of sign*x
	// over N, H and W into mean and variance ([C] each).
	BatchStats(mean, variance, x, sign Tensor) error
	// UpdateRunning folds batch statistics into running ones as PyTorch
	// does: running = (1-factor)*running + factor*batch, with the variance
	// unbiased by count/(count-1).
	UpdateRunning(runMean, runVar, mean, variance Tensor, factor float64, count int) error
	// Normalize writes act(gamma*(sign*x - mean)/sqrt(variance + eps) + beta)
	// into y, where gamma is weight, or |weight| + eps when p.AbsWeight. y
	// may be x (in place). weight and bias may be nil (1 and 0).
	Normalize(y, x, sign, mean, variance, weight, bias Tensor, p NormParams) error
	// NormalizeBackward computes, from the saved input x, the gradients of
	// an identity-activation Normalize: dx (of x, sign applied), dweight and
	// dbias. training says whether mean and variance were batch statistics
	// (their gradient then flows into dx). dx may be dy. Any output may be
	// nil.
	NormalizeBackward(dx, dweight, dbias, dy, x, sign, mean, variance, weight Tensor, p NormParams, training bool) error
	// NormalizeBackwardFromOutput is InPlace-ABN's backward: from the saved
	// output z alone it inverts the activation, recovers
	// xhat = (y - beta)/gamma and computes dx, dweight and dbias as
	// NormalizeBackward does. dx may be dz; any output may be nil.
	NormalizeBackwardFromOutput(dx, dweight, dbias, dz, z, sign, variance, weight, bias Tensor, p NormParams, training bool) error
}

// Pooling holds the 2-d pools over NCHW tensors.
type Pooling interface {
	// MaxPool writes the window maxima into y and, when idx is not nil,
	// the flat h*W+w position of each maximum in its input plane into idx
	// (Int64, y's shape), as PyTorch does.
	MaxPool(y, idx, x Tensor, p PoolParams) error
	// MaxPoolBackward writes into dx the output gradients routed to the
	// saved argmax positions (dx is overwritten).
	MaxPoolBackward(dx, dy, idx Tensor) error
	AvgPool(y, x Tensor, p PoolParams) error
	AvgPoolBackward(dx, dy Tensor, p PoolParams) error
	// AdaptiveAvgPool pools x into y's spatial size with PyTorch's windows:
	// start = floor(i*in/out), end = ceil((i+1)*in/out).
	AdaptiveAvgPool(y, x Tensor) error
	AdaptiveAvgPoolBackward(dx, dy Tensor) error
}

// BinaryOp is an elementwise binary op.
type BinaryOp uint8

const (
	BinaryAdd BinaryOp = iota
	BinarySub
	BinaryMul
	BinaryDiv
)

func (op BinaryOp) String() string {
	return [...]string{"add", "sub", "mul", "div"}[op]
}

// Broadcasting holds elementwise binary ops whose operands have different
// shapes, with NumPy's (and PyTorch's) rule: shapes aligned on their last
// dimension, each dimension equal or 1 in one of them. It is optional: a
// backend without it cannot run graphs with Mul, Sub, Div or a
// broadcasting Add, and the executor says so.
type Broadcasting interface {
	// Binary writes a op b into dst, whose shape is the broadcast shape.
	Binary(dst, a, b Tensor, op BinaryOp) error
	// BinaryBackward writes into da and db the gradients of a and b from
	// dy, summed over the dimensions each was broadcast along (both are
	// overwritten). a and b are the operands, needed for Mul and Div
	// only: nil for Add and Sub, which keep nothing for backward.
	BinaryBackward(da, db, dy, a, b Tensor, op BinaryOp) error
}

// BroadcastShape is the shape of a op b under NumPy's rule.
func BroadcastShape(a, b []int) ([]int, error) {
	n := max(len(a), len(b))
	out := make([]int, n)
	for i := 0; i < n; i++ {
		da, db := 1, 1
		if k := len(a) - n + i; k >= 0 {
			da = a[k]
		}
		if k := len(b) - n + i; k >= 0 {
			db = b[k]
		}
		switch {
		case da == db, db == 1:
			out[i] = da
		case da == 1:
			out[i] = db
		default:
			return nil, fmt.Errorf("shapes %v and %v do not broadcast", a, b)
		}
	}
	return out, nil
}

// ConvParams are a convolution's hyper-parameters.
type ConvParams struct {
	Stride, Padding, Dilation [2]int
	Groups                    int
}

// PoolParams are a max or average pool's hyper-parameters.
type PoolParams struct {
	Kernel, Stride, Padding [2]int
	CeilMode                bool
	// CountIncludePad: whether padding counts in an average's divisor.
	CountIncludePad bool
}

// ActKind is an activation function.
type ActKind uint8

const (
	ActIdentity ActKind = iota
	ActReLU
	ActLeakyReLU
	ActELU
	// The activations InPlace-ABN cannot invert. A backend that does not
	// implement one must refuse it, not compute another.
	ActHardtanh    // clamp to [Param, Param2]
	ActSigmoid     // its backward works from the output
	ActSiLU        // x * sigmoid(x)
	ActHardsigmoid // max(0, min(1, Param*x + Param2))
	ActHardswish   // x * relu6(x + 3) / 6
	ActGELU        // x * (1 + erf(x / sqrt 2)) / 2
	ActTanh        // its backward works from the output
	ActSELU        // torch's fixed alpha and scale
	ActCELU        // alpha Param
	ActSoftplus    // beta Param, threshold Param2
	ActMish        // x * tanh(softplus(x))
)

// Act is an activation and its parameters (leaky slope, ELU alpha,
// Hardtanh's bounds, Hardsigmoid's alpha and beta).
type Act struct {
	Kind   ActKind
	Param  float64
	Param2 float64
}

func (a Act) String() string {
	switch a.Kind {
	case ActReLU:
		return "relu"
	case ActLeakyReLU:
		return fmt.Sprintf("leaky_relu(%g)", a.Param)
	case ActELU:
		return fmt.Sprintf("elu(%g)", a.Param)
	case ActHardtanh:
		return fmt.Sprintf("hardtanh(%g, %g)", a.Param, a.Param2)
	case ActSigmoid:
		return "sigmoid"
	case ActSiLU:
		return "silu"
	case ActHardsigmoid:
		return fmt.Sprintf("hardsigmoid(%g, %g)", a.Param, a.Param2)
	case ActHardswish:
		return "hardswish"
	case ActGELU:
		return "gelu"
	case ActTanh:
		return "tanh"
	case ActSELU:
		return "selu"
	case ActCELU:
		return fmt.Sprintf("celu(%g)", a.Param)
	case ActSoftplus:
		return fmt.Sprintf("softplus(%g, %g)", a.Param, a.Param2)
	case ActMish:
		return "mish"
	}
	return "identity"
}

// NormParams are a normalisation's hyper-parameters.
type NormParams struct {
	Eps float64
	// AbsWeight selects InPlace-ABN's scale |weight| + eps instead of weight.
	AbsWeight bool
	// Act is applied after the affine transform.
	Act Act
}

// ConvOutSize is the output extent of a convolution along one axis.
func ConvOutSize(in, k, stride, pad, dil int) int {
	return (in+2*pad-dil*(k-1)-1)/stride + 1
}

// PoolOutSize is the output extent of a max or average pool along one axis,
// with PyTorch's ceil_mode rule: the last window must start inside the input
// or the left padding.
func PoolOutSize(in, k, stride, pad int, ceil bool) int {
	num := in + 2*pad - k
	out := num/stride + 1
	if ceil {
		out = (num+stride-1)/stride + 1
		if (out-1)*stride >= in+pad {
			out--
		}
	}
	return out
}

// AdaptiveWindow is PyTorch's adaptive pooling window for output index i.
func AdaptiveWindow(i, in, out int) (start, end int) {
	start = i * in / out
	end = ((i+1)*in + out - 1) / out
	return start, end
}

// DropoutKeep is the dropout rule every backend implements, so that masks
// are reproducible across backends: element i (flat index) of a mask drawn
// with seed is kept when splitmix64(seed + i*golden)'s top 53 bits, as a
// fraction of 2^53, are >= p.
func DropoutKeep(seed uint64, i int, p float64) bool {
	z := seed + uint64(i)*0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	z ^= z >> 31
	u := float64(z>>11) / (1 << 53)
	return u >= p
}

// numel is the element count of a shape.
func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
