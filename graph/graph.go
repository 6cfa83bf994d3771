// Package graph holds abnconvert's intermediate representation: a dataflow
// graph of convolutional-network operations whose parameters live in a
// separate weight store, addressed by state-dict key.
//
// Every format reader builds a Graph; every rewrite pass transforms one; the
// emitters and the runtime read one. Nodes are kept in topological order, and
// every node has exactly one output value, which is all the operations of the
// supported families need.
package graph

import (
	"fmt"
	"math"
	"sort"
	"strings"
)

// Op names an operation. The strings are stable: they appear in reports and
// JSON output.
type Op string

const (
	OpInput     Op = "Input"
	OpConv      Op = "Conv2d"
	OpBatchNorm Op = "BatchNorm2d"
	OpReLU      Op = "ReLU"
	OpLeakyReLU Op = "LeakyReLU"
	OpELU       Op = "ELU"
	// OpInPlaceABN may have a second input, a residual: the node then
	// computes InPlaceABN(x) + residual, written over x, as the end of a
	// residual block whose last BatchNorm has no activation (MobileNet's
	// inverted residuals). It saves only that sum, which the next layer
	// saves anyway, and its backward recovers the normalised output as
	// sum - residual; the residual is saved by the block's first layer.
	// That form needs Attr.Activation identity and a residual of x's
	// shape (see Node.Residual).
	OpInPlaceABN      Op = "InPlaceABN"
	OpInPlaceABNSync  Op = "InPlaceABNSync"
	OpABN             Op = "ABN"
	OpAdd             Op = "Add"
	OpConcat          Op = "Concat"
	OpMaxPool         Op = "MaxPool2d"
	OpAvgPool         Op = "AvgPool2d"
	OpAdaptiveAvgPool Op = "AdaptiveAvgPool2d"
	OpFlatten         Op = "Flatten"
	OpLinear          Op = "Linear"
	OpDropout         Op = "Dropout"

	// Activations InPlace-ABN cannot invert (the shapes of MobileNet,
	// EfficientNet and RegNetY): each is elementwise and keeps, for its
	// backward, what PyTorch 1.13's autograd keeps (see runtime).
	// Hardtanh clamps to [ActParam, ActParam2] (ReLU6 is Hardtanh(0, 6),
	// ONNX's Clip); Hardsigmoid is max(0, min(1, ActParam*x + ActParam2)),
	// ONNX's HardSigmoid (torch's is alpha 1/6, beta 0.5); Hardswish is
	// torch's x * relu6(x + 3) / 6; GELU is the exact (erf) form.
	OpHardtanh    Op = "Hardtanh"
	OpSigmoid     Op = "Sigmoid"
	OpSiLU        Op = "SiLU"
	OpHardsigmoid Op = "Hardsigmoid"
	OpHardswish   Op = "Hardswish"
	OpGELU        Op = "GELU"
	// Tanh, SELU (torch's fixed alpha and scale), CELU(alpha: ActParam),
	// Softplus(beta: ActParam, threshold: ActParam2: x where beta*x >
	// threshold, else log(1 + exp(beta*x)) / beta) and Mish (x *
	// tanh(softplus(x))), as PyTorch 1.13 computes them.
	OpTanh     Op = "Tanh"
	OpSELU     Op = "SELU"
	OpCELU     Op = "CELU"
	OpSoftplus Op = "Softplus"
	OpMish     Op = "Mish"

	// Binary elementwise ops with NumPy broadcasting (a squeeze-and-
	// excitation gate multiplies (N, C, H, W) by (N, C, 1, 1)). Add also
	// broadcasts when it has two inputs.
	OpMul Op = "Mul"
	OpSub Op = "Sub"
	OpDiv Op = "Div"
	// OpResize interpolates its first input (N, C, H, W). With two inputs
	// it resizes to the spatial size of the second (the shape is read,
	// the values are not): torchvision's segmentation models call
	// F.interpolate(x, size=input.shape[-2:]). With one input it resizes
	// by Attr.Scale (nn.Upsample(scale_factor=2), a UNet's decoder) or to
	// the fixed Attr.Size (nn.Upsample(size=(h, w))), exactly one of the
	// two set. Attr.Mode is "nearest" or "bilinear", with
	// Attr.AlignCorners.
	OpResize Op = "Resize"
	// OpStochasticDepth is torchvision's StochasticDepth(p, mode): in
	// training each sample (row of dimension 0) is zeroed with
	// probability Attr.P and the others scaled by 1/(1-P); with Attr.Mode
	// StochasticBatch, the whole batch is, by one draw. Attr.Mode is ""
	// for torchvision's "row" (what MBConv uses), so that graphs read
	// before batch mode existed compare equal. In eval, and when P is 0,
	// the identity.
	OpStochasticDepth Op = "StochasticDepth"
)

// StochasticBatch is OpStochasticDepth's Attr.Mode for torchvision's
// mode="batch"; row mode is "".
const StochasticBatch = "batch"

// Activation names of the ABN family, spelled as the inplace_abn package
// spells them.
const (
	ActReLU      = "relu"
	ActLeakyReLU = "leaky_relu"
	ActELU       = "elu"
	ActIdentity  = "identity"
)

// Parameter roles: the suffix of a state-dict key after the owning module's
// path.
const (
	RoleWeight      = "weight"
	RoleBias        = "bias"
	RoleRunningMean = "running_mean"
	RoleRunningVar  = "running_var"
	RoleNumBatches  = "num_batches_tracked"
)

// Attr carries the attributes of every op kind. Only the fields meaningful to
// a node's Op are set; the zero value of the rest is ignored.
type Attr struct {
	// Conv2d, pools.
	KernelSize [2]int `json:"kernel_size,omitempty"`
	Stride     [2]int `json:"stride,omitempty"`
	Padding    [2]int `json:"padding,omitempty"`
	Dilation   [2]int `json:"dilation,omitempty"`
	Groups     int    `json:"groups,omitempty"`
	CeilMode   bool   `json:"ceil_mode,omitempty"`
	// AvgPool2d: whether zero padding counts in the divisor (PyTorch's default
	// is true).
	CountIncludePad bool `json:"count_include_pad,omitempty"`

	// Conv2d, Linear: channel counts; BN family: Features.
	InChannels  int  `json:"in_channels,omitempty"`
	OutChannels int  `json:"out_channels,omitempty"`
	Features    int  `json:"features,omitempty"`
	Bias        bool `json:"bias,omitempty"`

	// BN family.
	Eps      float64 `json:"eps,omitempty"`
	Momentum float64 `json:"momentum,omitempty"`
	// MomentumNone means a cumulative moving average (PyTorch momentum=None).
	MomentumNone bool `json:"momentum_none,omitempty"`

	// ABN family: Activation is one of the Act* names; ActParam is the
	// leaky-ReLU slope or the ELU alpha. LeakyReLU/ELU nodes use ActParam too.
	Activation string  `json:"activation,omitempty"`
	ActParam   float64 `json:"activation_param,omitempty"`
	// ActParam2 is Hardtanh's upper bound and Hardsigmoid's offset (beta);
	// ActParam is then the lower bound, or the slope (alpha).
	ActParam2 float64 `json:"activation_param2,omitempty"`

	// Concat.
	Axis int `json:"axis,omitempty"`
	// AdaptiveAvgPool2d.
	OutputSize [2]int `json:"output_size,omitempty"`
	// Flatten.
	StartDim int `json:"start_dim,omitempty"`
	// Dropout.
	P float64 `json:"p,omitempty"`
	// Resize; StochasticDepth ("" for row, StochasticBatch).
	Mode         string `json:"mode,omitempty"`
	AlignCorners bool   `json:"align_corners,omitempty"`
	// Resize with one input: Scale is the scale factor per spatial axis
	// (height, width) as torch was given it (recompute_scale_factor=None:
	// the output is floor(in * Scale), and torch reads source positions
	// through 1/Scale, not in/out, which differ for a non-integer
	// factor); Size is a fixed output size (height, width).
	Scale [2]float64 `json:"scale_factor,omitempty"`
	Size  [2]int     `json:"size,omitempty"`
	// Reshape, Transpose, Pad, Slice (graph/layout.go); a pointer so that
	// Attr stays comparable. Read it with Lay.
	Layout *Layout `json:"layout,omitempty"`
}

// Node is one operation.
type Node struct {
	// Name is unique in the graph. For a node that owns parameters it is the
	// module path of those parameters in the state dict, prefix included
	// ("module.layer1.0.bn1"); other nodes get a descriptive synthetic name
	// ("layer1.0.add").
	Name   string
	Op     Op
	Inputs []*Value
	Out    *Value
	Attr   Attr
	// Params maps a role (RoleWeight, ...) to the state-dict key that holds
	// it. Empty for parameterless ops.
	Params map[string]string

	// Sign, for a BN-family node, is the per-channel sign flip (+1/-1)
	// applied in place to the node's input before normalising; nil when no
	// channel is flipped. It lets InPlace-ABN represent a negative gamma
	// whose sign could not be folded into a linear producer.
	Sign []int8
	// Recompute names the DenseNet shared-buffer group this node belongs to
	// (the dense layer's module path); empty when not marked. Marked nodes
	// keep neither their output nor the concatenation they read for the
	// backward pass: both are recomputed.
	Recompute string
}

// Residual is the residual an InPlaceABN node adds to its normalised
// output (its second input), or nil.
func (n *Node) Residual() *Value {
	if n.Op == OpInPlaceABN && len(n.Inputs) == 2 {
		return n.Inputs[1]
	}
	return nil
}

// Value is the output of one node.
type Value struct {
	Name      string
	Producer  *Node
	Consumers []*Node
	// Channels is the size of dimension 1 (the channel or feature dimension),
	// 0 when unknown.
	Channels int
}

// Graph is a network: its nodes in topological order, one input, one main
// output and any auxiliary outputs.
type Graph struct {
	// Arch names the recognised architecture ("resnet50"), or describes the
	// source of the structure.
	Arch   string
	Nodes  []*Node
	Input  *Value
	Output *Value
	// Aux lists the auxiliary outputs: the heads torchvision's segmentation
	// models (aux_loss=True), GoogLeNet and Inception3 (aux_logits=True)
	// return beside the main output, which training adds to the loss.
	Aux []Aux
	// OutputName is the main output's name where the model returns it
	// beside auxiliary ones: "out" (a segmentation model's dict),
	// "logits" (GoogLeNet's namedtuple), an ONNX graph output's name.
	OutputName string
	// FixedInput is the input shape an ONNX export made without dynamic
	// axes was traced at: torch wrote the shapes it computed from it as
	// constants, so the network runs at that shape only. nil otherwise.
	FixedInput []int
	byName     map[string]*Node
	counter    int
}

// Aux is an auxiliary output.
type Aux struct {
	// Name is the output's name in the model: the segmentation models'
	// dict key ("aux"), the namedtuple field ("aux_logits1"), or the ONNX
	// graph output's name.
	Name  string
	Value *Value
	// TrainOnly marks a head the model computes in training only
	// (GoogLeNet's and Inception3's): in eval the model returns the main
	// output alone.
	TrainOnly bool
}

// IsOutput reports whether v is the main output or an auxiliary one: a
// value the caller reads, which no pass may overwrite or fold away.
func (g *Graph) IsOutput(v *Value) bool {
	if v == nil {
		return false
	}
	if v == g.Output {
		return true
	}
	for _, a := range g.Aux {
		if a.Value == v {
			return true
		}
	}
	return false
}

// Outputs returns the main output, then the auxiliary ones in order.
func (g *Graph) Outputs() []*Value {
	out := []*Value{g.Output}
	for _, a := range g.Aux {
		out = append(out, a.Value)
	}
	return out
}

// SetAux adds an auxiliary output. Add moves the main output to each new
// node, so builders add the auxiliary heads and then set Output back.
func (g *Graph) SetAux(name string, v *Value, trainOnly bool) {
	g.Aux = append(g.Aux, Aux{Name: name, Value: v, TrainOnly: trainOnly})
}

// New returns a graph with an input value of the given channel count.
func New(arch string, inChannels int) *Graph {
	g := &Graph{Arch: arch, byName: map[string]*Node{}}
	n := &Node{Name: "input", Op: OpInput}
	n.Out = &Value{Name: "input", Producer: n, Channels: inChannels}
	g.Nodes = append(g.Nodes, n)
	g.byName[n.Name] = n
	g.Input = n.Out
	return g
}

// Add appends a node computing op over inputs and returns its output value.
// The name must be unique; Add panics on a duplicate because that is a bug in
// the builder, not bad input.
func (g *Graph) Add(name string, op Op, attr Attr, params map[string]string, inputs ...*Value) *Value {
	if _, dup := g.byName[name]; dup {
		panic(fmt.Sprintf("graph: duplicate node name %q", name))
	}
	n := &Node{Name: name, Op: op, Inputs: inputs, Attr: attr, Params: params}
	n.Out = &Value{Name: name, Producer: n}
	for _, in := range inputs {
		in.Consumers = append(in.Consumers, n)
	}
	g.Nodes = append(g.Nodes, n)
	g.byName[name] = n
	g.Output = n.Out
	return n.Out
}

// Node returns the node with the given name, or nil.
func (g *Graph) Node(name string) *Node { return g.byName[name] }

// Remove deletes n from the graph. Its output must have no consumers left.
func (g *Graph) Remove(n *Node) {
	if len(n.Out.Consumers) != 0 {
		panic(fmt.Sprintf("graph: removing %s, whose output is still used", n.Name))
	}
	for _, in := range n.Inputs {
		in.Consumers = removeNode(in.Consumers, n)
	}
	for i, m := range g.Nodes {
		if m == n {
			g.Nodes = append(g.Nodes[:i], g.Nodes[i+1:]...)
			break
		}
	}
	delete(g.byName, n.Name)
	if g.Output == n.Out {
		g.Output = nil
	}
	for i := range g.Aux {
		if g.Aux[i].Value == n.Out {
			g.Aux[i].Value = nil
		}
	}
}

// ReplaceUses makes every consumer of old read new instead, and moves the
// graph output if it was old.
func (g *Graph) ReplaceUses(old, new *Value) {
	for _, c := range old.Consumers {
		for i, in := range c.Inputs {
			if in == old {
				c.Inputs[i] = new
			}
		}
		new.Consumers = append(new.Consumers, c)
	}
	old.Consumers = nil
	if g.Output == old {
		g.Output = new
	}
	for i := range g.Aux {
		if g.Aux[i].Value == old {
			g.Aux[i].Value = new
		}
	}
}

// Rename changes a node's name, keeping the index in step.
func (g *Graph) Rename(n *Node, name string) {
	delete(g.byName, n.Name)
	n.Name = name
	n.Out.Name = name
	g.byName[name] = n
}

func removeNode(list []*Node, n *Node) []*Node {
	out := list[:0]
	for _, m := range list {
		if m != n {
			out = append(out, m)
		}
	}
	return out
}

// ParamKeys returns every state-dict key the graph references, sorted.
func (g *Graph) ParamKeys() []string {
	var keys []string
	for _, n := range g.Nodes {
		for _, k := range n.Params {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	return keys
}

// Validate checks the graph's invariants: unique names, topological order,
// producer and consumer links that agree with each other, and arities that
// fit each op. Passes run it after they finish, and tests run it after every
// pass, so that a pass that breaks the graph fails where it broke it.
func (g *Graph) Validate() error {
	// Sized up front: the rewrite validates after every pass.
	seen := make(map[*Value]bool, len(g.Nodes))
	names := make(map[string]bool, len(g.Nodes))
	// inGraph is the nodes by identity: a node is in the graph when its
	// name is a node's and the index maps that name to it, which the loop
	// below checks of every node, and a pointer hashes faster than a name.
	inGraph := make(map[*Node]bool, len(g.Nodes))
	for i, n := range g.Nodes {
		if names[n.Name] {
			return fmt.Errorf("graph: duplicate node name %q", n.Name)
		}
		names[n.Name] = true
		inGraph[n] = true
		if g.byName[n.Name] != n {
			return fmt.Errorf("graph: node %q missing from the name index", n.Name)
		}
		if n.Out == nil || n.Out.Producer != n {
			return fmt.Errorf("graph: node %q: output not linked back to it", n.Name)
		}
		if (n.Op == OpInput) != (i == 0) {
			return fmt.Errorf("graph: node %q: the input node must come first, and only once", n.Name)
		}
		if n.Op == OpInPlaceABN {
			switch {
			case len(n.Inputs) != 1 && len(n.Inputs) != 2:
				return fmt.Errorf("graph: node %q (%s) has %d inputs, want 1, or 2 (with a residual)", n.Name, n.Op, len(n.Inputs))
			case len(n.Inputs) == 2 && n.Attr.Activation != ActIdentity:
				return fmt.Errorf("graph: node %q (%s) adds a residual after activation %q: only identity can be recovered from the sum", n.Name, n.Op, n.Attr.Activation)
			case len(n.Inputs) == 2 && n.Inputs[0] == n.Inputs[1]:
				return fmt.Errorf("graph: node %q (%s) adds its own input as the residual", n.Name, n.Op)
			}
		}
		if n.Op == OpResize {
			if err := n.Attr.checkResize(len(n.Inputs)); err != nil {
				return fmt.Errorf("graph: node %q (%s): %w", n.Name, n.Op, err)
			}
		}
		// After the two checks above, whose messages say more than the
		// table's bounds. An op with no row is the readers' to refuse.
		if info, ok := n.Op.Info(); ok {
			if err := info.checkArity(len(n.Inputs)); err != nil {
				return fmt.Errorf("graph: node %q (%s) %w", n.Name, n.Op, err)
			}
		}
		for _, in := range n.Inputs {
			if !seen[in] {
				return fmt.Errorf("graph: node %q reads %q before it is computed", n.Name, in.Name)
			}
			if !containsNode(in.Consumers, n) {
				return fmt.Errorf("graph: node %q reads %q but is not among its consumers", n.Name, in.Name)
			}
		}
		if len(n.Sign) != 0 && len(n.Sign) != n.Attr.Features {
			return fmt.Errorf("graph: node %q: sign vector has %d entries for %d features", n.Name, len(n.Sign), n.Attr.Features)
		}
		seen[n.Out] = true
	}
	for _, n := range g.Nodes {
		for _, c := range n.Out.Consumers {
			if !inGraph[c] {
				return fmt.Errorf("graph: %q is consumed by %q, which is not in the graph", n.Name, c.Name)
			}
			if !containsValue(c.Inputs, n.Out) {
				return fmt.Errorf("graph: %q lists consumer %q, which does not read it", n.Name, c.Name)
			}
		}
	}
	if g.Output == nil || !seen[g.Output] {
		return fmt.Errorf("graph: no output")
	}
	names = map[string]bool{}
	for _, a := range g.Aux {
		switch {
		case a.Value == nil || !seen[a.Value]:
			return fmt.Errorf("graph: auxiliary output %q is not computed by the graph", a.Name)
		case a.Name == "" || names[a.Name]:
			return fmt.Errorf("graph: auxiliary output name %q is empty or repeated", a.Name)
		case a.Value == g.Output:
			return fmt.Errorf("graph: auxiliary output %q is the main output", a.Name)
		}
		names[a.Name] = true
	}
	return nil
}

// checkResize checks a Resize's inputs against its attributes: two
// inputs (to the second's size) and neither Scale nor Size, or one input
// and exactly one of them, every entry positive.
func (a Attr) checkResize(inputs int) error {
	scaled, sized := a.Scale != [2]float64{}, a.Size != [2]int{}
	switch {
	case inputs == 2 && (scaled || sized):
		return fmt.Errorf("resizes to its second input's size and has a scale factor %v or size %v too", a.Scale, a.Size)
	case inputs == 2:
		return nil
	case inputs != 1:
		return fmt.Errorf("has %d inputs, want 1 (with a scale factor or size) or 2 (to the second's size)", inputs)
	case scaled == sized:
		return fmt.Errorf("one input, and %s", map[bool]string{true: "both a scale factor and a size", false: "neither a scale factor nor a size"}[scaled])
	case scaled && !(a.Scale[0] > 0 && a.Scale[1] > 0 && a.Scale[0] < 1e6 && a.Scale[1] < 1e6):
		return fmt.Errorf("scale factor %v: want positive and finite", a.Scale)
	case sized && (a.Size[0] <= 0 || a.Size[1] <= 0):
		return fmt.Errorf("size %v: want positive", a.Size)
	}
	return nil
}

// ResizeShape is the (N, C, H, W) a Resize gives for input x (and, with
// two inputs, the shape ref of the second): for a scale factor
// floor(in * scale), as torch computes it in double precision.
func (a Attr) ResizeShape(x, ref []int) ([]int, error) {
	if len(x) != 4 {
		return nil, fmt.Errorf("resizes %v: want (N, C, H, W)", x)
	}
	switch {
	case ref != nil:
		if len(ref) < 2 {
			return nil, fmt.Errorf("resizes %v to the size of %v: want a spatial size", x, ref)
		}
		return []int{x[0], x[1], ref[len(ref)-2], ref[len(ref)-1]}, nil
	case a.Size != [2]int{}:
		return []int{x[0], x[1], a.Size[0], a.Size[1]}, nil
	}
	out := []int{x[0], x[1], 0, 0}
	for d := range 2 {
		out[2+d] = int(math.Floor(float64(x[2+d]) * a.Scale[d]))
		if out[2+d] < 1 {
			return nil, fmt.Errorf("resizes %v by %v: an empty output", x, a.Scale)
		}
	}
	return out, nil
}

// IsActivation reports whether op is an elementwise activation of one
// input, the ones InPlace-ABN can fuse (ReLU, LeakyReLU, ELU) or not.
func (op Op) IsActivation() bool {
	info, _ := op.Info()
	return info.Activation
}

// IsBinary reports whether op is a broadcasting binary elementwise op.
func (op Op) IsBinary() bool {
	info, _ := op.Info()
	return info.Shape == ShapeBroadcast
}

func containsNode(list []*Node, n *Node) bool {
	for _, m := range list {
		if m == n {
			return true
		}
	}
	return false
}

func containsValue(list []*Value, v *Value) bool {
	for _, m := range list {
		if m == v {
			return true
		}
	}
	return false
}

// IsBNFamily reports whether op normalises with batch statistics.
func (op Op) IsBNFamily() bool {
	info, _ := op.Info()
	return info.Shape == ShapeNorm
}

// String renders the graph one node a line, for dumps and golden tests.
func (g *Graph) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "graph %s\n", g.Arch)
	for _, n := range g.Nodes {
		var ins []string
		for _, in := range n.Inputs {
			ins = append(ins, in.Name)
		}
		fmt.Fprintf(&b, "%s = %s(%s)", n.Name, n.Op, strings.Join(ins, ", "))
		if s := n.Attr.summary(n.Op); s != "" {
			fmt.Fprintf(&b, " [%s]", s)
		}
		if n.Recompute != "" {
			fmt.Fprintf(&b, " recompute=%s", n.Recompute)
		}
		if n.Sign != nil {
			neg := 0
			for _, s := range n.Sign {
				if s < 0 {
					neg++
				}
			}
			fmt.Fprintf(&b, " signflip=%d", neg)
		}
		if n.Out.Channels != 0 {
			fmt.Fprintf(&b, " ch=%d", n.Out.Channels)
		}
		b.WriteByte('\n')
	}
	if g.Output != nil {
		fmt.Fprintf(&b, "output %s\n", g.Output.Name)
	}
	for _, a := range g.Aux {
		if a.Value != nil {
			train := ""
			if a.TrainOnly {
				train = " (training only)"
			}
			fmt.Fprintf(&b, "aux %s %s%s\n", a.Name, a.Value.Name, train)
		}
	}
	return b.String()
}

func (a Attr) summary(op Op) string {
	switch op {
	case OpConv:
		return fmt.Sprintf("%d->%d k%v s%v p%v d%v g%d bias=%v", a.InChannels, a.OutChannels, a.KernelSize, a.Stride, a.Padding, a.Dilation, a.Groups, a.Bias)
	case OpLinear:
		return fmt.Sprintf("%d->%d bias=%v", a.InChannels, a.OutChannels, a.Bias)
	case OpBatchNorm:
		return fmt.Sprintf("%d eps=%g momentum=%g", a.Features, a.Eps, a.Momentum)
	case OpABN, OpInPlaceABN, OpInPlaceABNSync:
		return fmt.Sprintf("%d eps=%g momentum=%g %s(%g)", a.Features, a.Eps, a.Momentum, a.Activation, a.ActParam)
	case OpLeakyReLU, OpELU:
		return fmt.Sprintf("%g", a.ActParam)
	case OpHardtanh, OpHardsigmoid, OpSoftplus:
		return fmt.Sprintf("%g, %g", a.ActParam, a.ActParam2)
	case OpCELU:
		return fmt.Sprintf("%g", a.ActParam)
	case OpMaxPool, OpAvgPool:
		return fmt.Sprintf("k%v s%v p%v ceil=%v", a.KernelSize, a.Stride, a.Padding, a.CeilMode)
	case OpAdaptiveAvgPool:
		return fmt.Sprintf("%v", a.OutputSize)
	case OpConcat:
		return fmt.Sprintf("axis=%d", a.Axis)
	case OpFlatten:
		return fmt.Sprintf("start_dim=%d", a.StartDim)
	case OpResize:
		switch {
		case a.Scale != [2]float64{}:
			return fmt.Sprintf("%s align_corners=%v scale=%v", a.Mode, a.AlignCorners, a.Scale)
		case a.Size != [2]int{}:
			return fmt.Sprintf("%s align_corners=%v size=%v", a.Mode, a.AlignCorners, a.Size)
		}
		return fmt.Sprintf("%s align_corners=%v", a.Mode, a.AlignCorners)
	case OpStochasticDepth:
		if a.Mode == StochasticBatch {
			return fmt.Sprintf("p=%g batch", a.P)
		}
		return fmt.Sprintf("p=%g row", a.P)
	}
	return a.layoutSummary(op)
}
