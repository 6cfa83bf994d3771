package graph

import (
	"fmt"
	"math"
)

// The op table: one row per Op saying what every consumer of the IR needs
// to know about it, in the manner of Go's cmd/compile/internal/ssa op
// tables. The validator, the runtime (shapes, saved tensors, in-place
// execution, kernel dispatch), memory (through the runtime's saves), the
// rewrite (which producers an in-place layer may overwrite, which ops a
// sign flip or a channel count passes through) and the emitters (Python
// expressions, ONNX op types) read their families from here rather than
// listing ops in switch statements of their own; what is particular to one
// op (a convolution's geometry, a pool's window) stays in code that the
// row's rule reaches.
//
// Adding an op:
//
//  1. Declare the Op constant (graph.go or layout.go) with a comment
//     saying what it computes and which Attr fields it reads.
//  2. Add its row to opTable below: arity, shape rule, saved-for-backward
//     rule (what PyTorch 1.13's autograd keeps, checked with saved-tensor
//     hooks), whether an in-place layer may overwrite its output, whether
//     it runs in place, whether a sign flip or the channel count passes
//     through it, and its emission where that is data (Python, ONNX).
//     A rule that does not exist yet is a new constant here and a case in
//     each consumer's switch over rules: the consumers' tests fail until
//     every one has it.
//  3. Give it kernels in package runtime: an entry in runtime/kernels.go
//     (an elementwise activation takes the shared activation pair, its Act
//     kind in runtime's actOf and the CPU kernels of cpu_act.go; the CUDA
//     backend's in package cuda), and cases against PyTorch autograd,
//     with the saved-tensor figure of PyTorch's hooks, in fixtures/ops.py
//     (appended last, so that earlier cases keep their draws).
//  4. Give it an emission, a Python format here or a case in
//     emit/python.go, and its readers: an ONNX type here or a case in
//     onnx/mapping.go, a torch.nn class in arch/module.go (and the class
//     in pth/module.go's allowlist).
//  5. Run the completeness checks: graph's TestOpTable (every Op constant
//     has a row, and the row agrees with itself), runtime's
//     TestOpTableKernels, TestOpTableShapes and TestOpTableSaves, emit's
//     TestOpTableEmission and onnx's TestOpTableONNX, which fail for a row
//     a consumer cannot handle.

// ShapeRule says how an op's output shape follows from its inputs. The
// runtime computes it (runtime.outShape), with the op-specific arithmetic
// (a convolution's geometry) in code the rule selects.
type ShapeRule uint8

const (
	// ShapeNone: no rule (an Op with no row).
	ShapeNone ShapeRule = iota
	// ShapeInput: the network's input, the shape the caller gives.
	ShapeInput
	// ShapeSame: input 0's shape (elementwise ops of one input).
	ShapeSame
	// ShapeNorm: the BN family: (N, C) or (N, C, H, W), C the features,
	// the input's shape.
	ShapeNorm
	// ShapeConv: a 2-D convolution's (N, Cout, H', W').
	ShapeConv
	// ShapeLinear: (N, in features) to (N, out features).
	ShapeLinear
	// ShapeBroadcast: NumPy broadcasting of two inputs.
	ShapeBroadcast
	// ShapeSum: Add: the common shape of its inputs, or the broadcast of
	// two that differ.
	ShapeSum
	// ShapeConcat: concatenation along Attr.Axis.
	ShapeConcat
	// ShapePool: a pooling window's (N, C, H', W').
	ShapePool
	// ShapeAdaptivePool: (N, C) and Attr.OutputSize.
	ShapeAdaptivePool
	// ShapeFlatten: dimensions from Attr.StartDim on collapsed into one.
	ShapeFlatten
	// ShapeLayout: the layout ops and Resize, whose shapes the runtime's
	// layout code computes op by op.
	ShapeLayout
)

// Rank is the rank an op's output has whatever its input's, 0 when it
// follows the input's (what the ONNX writer assumes of a value whose type
// the model does not declare).
func (r ShapeRule) Rank() int {
	switch r {
	case ShapeInput, ShapeConv, ShapePool, ShapeAdaptivePool:
		return 4
	case ShapeFlatten, ShapeLinear:
		return 2
	}
	return 0
}

// SaveRule says what an op keeps for its backward pass in PyTorch 1.13's
// autograd (checked with saved-tensor hooks), which the runtime keeps too,
// so that memory's figure for a network compares with PyTorch's.
type SaveRule uint8

const (
	// SaveNothing: the backward needs no tensor (Add, Concat, Flatten,
	// the layout ops).
	SaveNothing SaveRule = iota
	// SaveInput: input 0 (convolution and linear, also their 16-bit
	// weight copy; average pools, for its shape; the activations whose
	// derivative is a function of the input, LeakyReLU and ELU out of
	// place among them).
	SaveInput
	// SaveOutput: the output (ReLU, Sigmoid: the derivative is a
	// function of the result).
	SaveOutput
	// SaveOperands: both inputs (Mul, Div).
	SaveOperands
	// SaveInputIndices: the input and the argmax indices (MaxPool).
	SaveInputIndices
	// SaveAux: the op's random draw, when it made one (a dropout mask in
	// training, stochastic depth's noise when active).
	SaveAux
	// SaveNorm: the input and the batch statistics (BatchNorm).
	SaveNorm
	// SaveABN: the input and statistics, and the output unless the
	// activation is identity (inplace_abn's ABN: batch_norm, then an
	// in-place activation).
	SaveABN
	// SaveInPlaceABN: the output and the batch variance, and the
	// residual where one is added.
	SaveInPlaceABN
)

// KeepsInput says whether the rule keeps input 0 whatever the op's
// attributes and however it ran, so that one more reader keeping it costs
// nothing.
func (r SaveRule) KeepsInput() bool {
	switch r {
	case SaveInput, SaveOperands, SaveInputIndices, SaveNorm, SaveABN:
		return true
	}
	return false
}

// InPlaceRule says whether an op writes its output over its input, as
// torchvision's inplace=True activations and InPlace-ABN do, where nothing
// else needs the input.
type InPlaceRule uint8

const (
	// InPlaceNever: the output is a new tensor.
	InPlaceNever InPlaceRule = iota
	// InPlaceAlways: the op may always run in place.
	InPlaceAlways
)

// Allows says whether rule lets a node with attributes a run in place.
// No rule reads the attributes now; the parameter stays for one that
// would.
func (r InPlaceRule) Allows(a Attr) bool {
	return r == InPlaceAlways
}

// ChannelRule says where an op's output channel count (dimension 1) comes
// from.
type ChannelRule uint8

const (
	// ChannelsUnknown: the op does not say (the layout ops, Flatten).
	ChannelsUnknown ChannelRule = iota
	// ChannelsOfInput: input 0's.
	ChannelsOfInput
	// ChannelsOut: Attr.OutChannels (convolution, linear).
	ChannelsOut
	// ChannelsFeatures: Attr.Features (the BN family).
	ChannelsFeatures
	// ChannelsSum: the sum of the inputs' (Concat).
	ChannelsSum
)

// ParamRule says which parameters (state-dict roles) an op owns.
type ParamRule uint8

const (
	// ParamsNone: no parameters.
	ParamsNone ParamRule = iota
	// ParamsLayer: weight and bias (convolution, linear): a module of
	// the emitted network.
	ParamsLayer
	// ParamsNorm: weight, bias, running_mean, running_var and
	// num_batches_tracked (the BN family): a module too.
	ParamsNorm
)

// Roles lists the roles the rule allows, a new slice each call.
func (r ParamRule) Roles() []string {
	switch r {
	case ParamsLayer:
		return []string{RoleWeight, RoleBias}
	case ParamsNorm:
		return []string{RoleWeight, RoleBias, RoleRunningMean, RoleRunningVar, RoleNumBatches}
	}
	return nil
}

// Variadic is OpInfo.MaxInputs for an op with no upper bound.
const Variadic = -1

// OpInfo is one row of the op table.
type OpInfo struct {
	Op Op
	// MinInputs and MaxInputs bound the number of inputs (MaxInputs
	// Variadic: no bound). Validate checks them.
	MinInputs, MaxInputs int
	// Shape is the output shape rule.
	Shape ShapeRule
	// Params is which parameters the op owns: an op with any is a module
	// in the emitted network.
	Params ParamRule
	// Check, when set, validates the attributes the shape rule does not
	// (Hardtanh's bounds); the runtime and the Python emitter both call
	// it, so the two refuse the same nodes with the same words.
	Check func(Attr) error
	// Saves is what the backward keeps.
	Saves SaveRule
	// Activation marks an elementwise activation of one input, which the
	// runtime runs through its Activation kernels (see IsActivation).
	Activation bool
	// ABNAct is the ABN-family activation the op becomes when fused into
	// a preceding BatchNorm ("relu", "leaky_relu", "elu"), "" when
	// InPlace-ABN cannot take it.
	ABNAct string
	// InPlace says whether the op runs in place where its input is free.
	InPlace InPlaceRule
	// View marks an op whose output may share its input's storage (a
	// torch view, or dropout's identity in eval): nothing may write over
	// it in place.
	View bool
	// Overwritable marks producers whose output an in-place layer may
	// overwrite: the op does not keep its own output for its backward
	// pass and returns a fresh tensor, not a view of another.
	Overwritable bool
	// Channels is where the output channel count comes from.
	Channels ChannelRule
	// SignThrough marks a channelwise linear op: negating an input
	// channel negates the same output channel and nothing else, so a sign
	// fold may pass through it (average pools).
	SignThrough bool
	// Python, when set, is the op's Python expression: a fmt format
	// taking the emitted variables of its inputs in order. Ops with
	// attributes, or with more than one spelling, are written by package
	// emit.
	Python string
	// ONNX, when set, is the ONNX op type read as this op when it carries
	// no attributes (Relu, Sigmoid, Mul, ...).
	ONNX string
}

// opTable is the table, one row per Op. It is read only: Info returns
// copies of its rows.
var opTable = [...]OpInfo{
	{Op: OpInput, Shape: ShapeInput},
	{Op: OpConv, MinInputs: 1, MaxInputs: 1, Shape: ShapeConv, Params: ParamsLayer, Saves: SaveInput, Overwritable: true, Channels: ChannelsOut},
	{Op: OpLinear, MinInputs: 1, MaxInputs: 1, Shape: ShapeLinear, Params: ParamsLayer, Saves: SaveInput, Overwritable: true, Channels: ChannelsOut},
	{Op: OpBatchNorm, MinInputs: 1, MaxInputs: 1, Shape: ShapeNorm, Params: ParamsNorm, Saves: SaveNorm, Channels: ChannelsFeatures},
	{Op: OpABN, MinInputs: 1, MaxInputs: 1, Shape: ShapeNorm, Params: ParamsNorm, Saves: SaveABN, Channels: ChannelsFeatures},
	// The second input is the residual (see OpInPlaceABN).
	{Op: OpInPlaceABN, MinInputs: 1, MaxInputs: 2, Shape: ShapeNorm, Params: ParamsNorm, Saves: SaveInPlaceABN, InPlace: InPlaceAlways, Channels: ChannelsFeatures},
	{Op: OpInPlaceABNSync, MinInputs: 1, MaxInputs: 1, Shape: ShapeNorm, Params: ParamsNorm, Saves: SaveInPlaceABN, InPlace: InPlaceAlways, Channels: ChannelsFeatures},

	{Op: OpReLU, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveOutput, Activation: true, ABNAct: ActReLU, InPlace: InPlaceAlways, Channels: ChannelsOfInput,
		Python: "torch.relu(%s)", ONNX: "Relu"},
	// LeakyReLU and ELU run out of place, as nn.LeakyReLU and nn.ELU do by
	// default and as the emitted module writes them (F.leaky_relu, F.elu),
	// so they keep their input: a graph cannot tell an inplace=True
	// module, and running them in place where the input is free made
	// memory's figure miss that input wherever the next layer keeps the
	// output (a convolution, a max-pool): 5.21 MB against PyTorch's
	// 6.26 MB on a LeakyReLU/ELU chain.
	{Op: OpLeakyReLU, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveInput, Activation: true, ABNAct: ActLeakyReLU, Overwritable: true, Channels: ChannelsOfInput},
	{Op: OpELU, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveInput, Activation: true, ABNAct: ActELU, Overwritable: true, Channels: ChannelsOfInput},
	// The activations InPlace-ABN cannot invert keep their input (their
	// in-place forms, torchvision's inplace=True ReLU6, SiLU, Hardswish,
	// keep a copy of it: the same bytes), except Sigmoid, which keeps its
	// output.
	{Op: OpHardtanh, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Check: checkHardtanh, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput},
	{Op: OpSigmoid, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveOutput, Activation: true, Channels: ChannelsOfInput,
		Python: "torch.sigmoid(%s)", ONNX: "Sigmoid"},
	{Op: OpSiLU, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput,
		Python: "F.silu(%s)"},
	{Op: OpHardsigmoid, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Check: checkHardsigmoid, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput},
	{Op: OpHardswish, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput,
		Python: "F.hardswish(%s)", ONNX: "HardSwish"},
	{Op: OpGELU, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput,
		Python: "F.gelu(%s)"},
	// Tanh keeps its output (tanh_backward); SELU and CELU run through
	// elu, which keeps its input out of place, as do Softplus and Mish.
	{Op: OpTanh, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveOutput, Activation: true, Channels: ChannelsOfInput,
		Python: "torch.tanh(%s)", ONNX: "Tanh"},
	{Op: OpSELU, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput,
		Python: "F.selu(%s)"},
	{Op: OpCELU, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Check: checkCELU, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput},
	{Op: OpSoftplus, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Check: checkSoftplus, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput},
	{Op: OpMish, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveInput, Activation: true, Overwritable: true, Channels: ChannelsOfInput,
		Python: "F.mish(%s)", ONNX: "Mish"},

	{Op: OpAdd, MinInputs: 1, MaxInputs: Variadic, Shape: ShapeSum, Overwritable: true, Channels: ChannelsOfInput},
	{Op: OpMul, MinInputs: 2, MaxInputs: 2, Shape: ShapeBroadcast, Saves: SaveOperands, Overwritable: true,
		Python: "%s * %s", ONNX: "Mul"},
	{Op: OpSub, MinInputs: 2, MaxInputs: 2, Shape: ShapeBroadcast, Overwritable: true,
		Python: "%s - %s", ONNX: "Sub"},
	{Op: OpDiv, MinInputs: 2, MaxInputs: 2, Shape: ShapeBroadcast, Saves: SaveOperands, Overwritable: true,
		Python: "%s / %s", ONNX: "Div"},
	{Op: OpConcat, MinInputs: 1, MaxInputs: Variadic, Shape: ShapeConcat, Overwritable: true, Channels: ChannelsSum},

	{Op: OpMaxPool, MinInputs: 1, MaxInputs: 1, Shape: ShapePool, Saves: SaveInputIndices, Overwritable: true, Channels: ChannelsOfInput},
	// Average pools keep their input too: PyTorch's backward kernels take
	// it (for its shape), so its autograd saves it.
	{Op: OpAvgPool, MinInputs: 1, MaxInputs: 1, Shape: ShapePool, Saves: SaveInput, Overwritable: true, Channels: ChannelsOfInput, SignThrough: true},
	{Op: OpAdaptiveAvgPool, MinInputs: 1, MaxInputs: 1, Shape: ShapeAdaptivePool, Saves: SaveInput, Overwritable: true, Channels: ChannelsOfInput, SignThrough: true},
	{Op: OpFlatten, MinInputs: 1, MaxInputs: 1, Shape: ShapeFlatten, View: true},
	{Op: OpDropout, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Saves: SaveAux, View: true, Channels: ChannelsOfInput},
	{Op: OpStochasticDepth, MinInputs: 1, MaxInputs: 1, Shape: ShapeSame, Check: checkStochasticDepth, Saves: SaveAux, Channels: ChannelsOfInput},
	{Op: OpResize, MinInputs: 1, MaxInputs: 2, Shape: ShapeLayout},

	// The layout ops (layout.go). Reshape's further inputs are read for
	// their shape alone.
	{Op: OpReshape, MinInputs: 1, MaxInputs: Variadic, Shape: ShapeLayout, View: true},
	{Op: OpTranspose, MinInputs: 1, MaxInputs: 1, Shape: ShapeLayout},
	{Op: OpPad, MinInputs: 1, MaxInputs: 1, Shape: ShapeLayout},
	{Op: OpSlice, MinInputs: 1, MaxInputs: 1, Shape: ShapeLayout, View: true},
}

// opIndex finds a row by op; built once, read only.
var opIndex = func() map[Op]int {
	m := make(map[Op]int, len(opTable))
	for i, r := range opTable {
		if _, dup := m[r.Op]; dup {
			panic(fmt.Sprintf("graph: op %s has two rows", r.Op))
		}
		m[r.Op] = i
	}
	return m
}()

// Info returns op's row, and false for an op with no row (one a reader
// made up, or a misspelt JSON graph): its zero row has ShapeNone.
func (op Op) Info() (OpInfo, bool) {
	i, ok := opIndex[op]
	if !ok {
		return OpInfo{Op: op}, false
	}
	return opTable[i], true
}

// Ops returns every row, in table order.
func Ops() []OpInfo { return append([]OpInfo(nil), opTable[:]...) }

// ONNXOp returns the op whose row reads ONNX op type t, if one does.
func ONNXOp(t string) (Op, bool) {
	for _, r := range opTable {
		if r.ONNX != "" && r.ONNX == t {
			return r.Op, true
		}
	}
	return "", false
}

// checkArity checks n inputs against the row's bounds.
func (r OpInfo) checkArity(n int) error {
	switch {
	case r.MinInputs == r.MaxInputs && n != r.MinInputs:
		return fmt.Errorf("has %d inputs, want %d", n, r.MinInputs)
	case n < r.MinInputs && r.MinInputs == 1:
		return fmt.Errorf("has no inputs")
	case n < r.MinInputs:
		return fmt.Errorf("has %d inputs, want at least %d", n, r.MinInputs)
	case r.MaxInputs != Variadic && n > r.MaxInputs:
		return fmt.Errorf("has %d inputs, want at most %d", n, r.MaxInputs)
	}
	return nil
}

func checkHardtanh(a Attr) error {
	if !(a.ActParam <= a.ActParam2) {
		return fmt.Errorf("bounds [%g, %g] are empty", a.ActParam, a.ActParam2)
	}
	return nil
}

func checkHardsigmoid(a Attr) error {
	if math.IsNaN(a.ActParam) || math.IsNaN(a.ActParam2) || math.IsInf(a.ActParam, 0) || math.IsInf(a.ActParam2, 0) {
		return fmt.Errorf("alpha %g, beta %g: not finite", a.ActParam, a.ActParam2)
	}
	return nil
}

// checkCELU refuses alpha 0, which torch.celu refuses too (it divides by
// alpha), and a non-finite one.
func checkCELU(a Attr) error {
	if a.ActParam == 0 || math.IsNaN(a.ActParam) || math.IsInf(a.ActParam, 0) {
		return fmt.Errorf("alpha %g: want a finite, nonzero alpha", a.ActParam)
	}
	return nil
}

// checkSoftplus refuses beta 0 (softplus divides by beta) and non-finite
// parameters.
func checkSoftplus(a Attr) error {
	if a.ActParam == 0 || math.IsNaN(a.ActParam) || math.IsInf(a.ActParam, 0) || math.IsNaN(a.ActParam2) {
		return fmt.Errorf("beta %g, threshold %g: want a finite, nonzero beta", a.ActParam, a.ActParam2)
	}
	return nil
}

func checkStochasticDepth(a Attr) error {
	if a.Mode != "" && a.Mode != StochasticBatch {
		return fmt.Errorf("mode %q: want row (\"\") or %s", a.Mode, StochasticBatch)
	}
	if !(a.P >= 0 && a.P <= 1) {
		return fmt.Errorf("p %g is not a probability", a.P)
	}
	return nil
}
