// Package runtime is a reference interpreter of abnconvert's IR: it runs a
// graph forward and backward, in eval and training mode, and measures the
// memory a training step keeps for its backward pass.
//
// The shape follows torch.fx's Interpreter: one walker (Executor) visits the
// nodes in order and hands every op to a Backend, whose interface is split by
// op family; liveness is computed once, up front, per input shape (see plan),
// so every backend allocates and frees the same tensors at the same points.
// Two backends come with the package: NewCPU computes in float32 on the CPU
// with all cores; NewShapes computes nothing and only tracks shapes and
// memory, so the figures of a full-size network come in seconds. A CUDA
// backend can satisfy the same interface: the executor only holds opaque
// Tensor handles and moves data through Upload and Download.
//
// What the runtime keeps for backward mirrors PyTorch 1.13's autograd for the
// original layers (so its saved_bytes figure compares with PyTorch's
// saved-tensor hooks), and the InPlace-ABN paper for the converted ones: an
// InPlace-ABN node overwrites its input with its output z and keeps only z,
// the batch variance and, as inplace_abn does, its one-element sample count
// (the emitted fused residual add keeps none); its backward inverts the
// activation to recover the normalised input. DenseNet layers marked by Node.Recompute keep neither
// their concatenation nor their ABN output: both live in two shared buffers
// and are rebuilt in the backward pass from the batch statistics saved in the
// forward pass, so running statistics are updated once.
//
// Two more memory techniques are policies of the executor, so that their
// figures are measured the same way: gradient checkpointing
// (Options.Checkpoint: segments keep only their inputs and are rerun in the
// backward pass, with the forward's batch statistics) and 16-bit
// activations (Options.Half: activations, their gradients and the weight
// copies convolutions compute with are stored in bfloat16 or float16, as
// torch.autocast keeps them). The executor counts the arithmetic it runs and
// reruns (Work), so that what a technique costs in recomputation is measured
// too.
package runtime

import (
	"errors"
	"fmt"
	"time"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// HostTensor is a float32 tensor in Go memory, row-major.
type HostTensor struct {
	Shape []int
	// Data has numel(Shape) elements; it is nil in results of a backend
	// that does not execute (NewShapes).
	Data []float32
}

// NewHostTensor returns a zero tensor of the given shape.
func NewHostTensor(shape ...int) *HostTensor {
	return &HostTensor{Shape: append([]int(nil), shape...), Data: make([]float32, numel(shape))}
}

// Options steer an Executor.
type Options struct {
	// Seed draws the dropout masks of training-mode forwards. The mask of
	// a node in the k-th training forward (k from 0) uses DropoutSeed(Seed,
	// node name, k); see DropoutKeep for the rule.
	Seed uint64
	// GradInEval makes eval-mode forwards keep what backward needs, so
	// that Backward can follow them (gradients through running
	// statistics). Training-mode forwards always keep it.
	GradInEval bool
	// NoRecompute ignores Node.Recompute marks: marked DenseNet layers then
	// keep their concatenation and ABN output like any other layer (for
	// comparing the two ways, and their memory).
	NoRecompute bool
	// Checkpoint selects gradient checkpointing: segments whose forward
	// keeps only its inputs and is rerun in the backward pass (see
	// Checkpointing; Segments lists what a policy chooses).
	Checkpoint Checkpointing
	// Half, when BFloat16 or Float16, keeps activations, their gradients
	// and the weight copies Conv2d and Linear compute with in that 16-bit
	// format, as torch.autocast does (CPU autocast uses bfloat16): what is
	// saved for backward is stored and counted in 16 bits. BN statistics,
	// parameters and their gradients stay float32, max-pool indices int64.
	// The CPU backend computes in float32 from the 16-bit values and rounds
	// what it writes. Float32 (the zero value) is off.
	Half DType
	// Trace, when set, is called after every node's forward ("forward"),
	// recomputation ("recompute", under Checkpoint) and backward
	// ("backward") step with its index, the node count and the time the
	// step took: for progress lines and per-layer timings.
	Trace func(phase string, index, total int, node *graph.Node, took time.Duration)
}

// DropoutSeed is the seed of a node's mask in the k-th training forward:
// seed + fnv1a64(node)*0x632BE59BD9B4E019 + k*0x85EBCA77C2B2AE63 (mod 2^64).
// It depends on the node's name, not its position, so that editing a graph
// elsewhere leaves a layer's masks alone.
func DropoutSeed(seed uint64, node string, k int) uint64 {
	h := uint64(0xCBF29CE484222325)
	for i := 0; i < len(node); i++ {
		h ^= uint64(node[i])
		h *= 0x100000001B3
	}
	return seed + h*0x632BE59BD9B4E019 + 0x85EBCA77C2B2AE63*uint64(k)
}

// Executor runs one graph with one set of parameters on one backend.
// Parameters and running statistics are uploaded once, by New; a training
// forward updates the running statistics on the backend (read them with
// RunningStats), never the graph.Weights. An Executor is not safe for
// concurrent use; the ops it calls use the backend's threads.
type Executor struct {
	g     *graph.Graph
	w     graph.Weights
	b     Backend
	opt   Options
	index map[*graph.Node]int

	params     map[string]Tensor
	paramBytes int64
	signs      []Tensor
	// batches is each BN node's num_batches_tracked, kept on the host: it
	// picks the momentum=None factor.
	batches []int64
	// trainSteps counts training forwards, for dropout seeds.
	trainSteps int

	plans map[string]*plan
	// segs are the checkpoint segments, by node index.
	segs     []segment
	segments []Segment
	run      *run
	mem      MemoryReport
	work     WorkReport
	// outs are the last forward's outputs: the main one, then the
	// auxiliary ones (graph.Graph.Aux).
	outs []*HostTensor
	// base is what the backend held when the last forward started
	// (parameters, and anything another executor holds on a shared
	// backend): the memory figures count from there.
	base int64
}

// run is the state of one forward pass that a backward pass may follow.
type run struct {
	p     *plan
	roots []Tensor // per storage: its allocation while live
	vals  []Tensor // per node: its output, a view into its storage
	grads []gref   // per node: the gradient of its output
	// pgrads holds the parameter gradients by state-dict key.
	pgrads map[string]Tensor
	// temps holds gradient temporaries between their allocation and
	// their folding in.
	temps map[Tensor]bool
	// recomputed marks the nodes whose recomputation has run: their
	// values and aux storages are the recomputation's from then on.
	recomputed []bool
	// step is the training forward's index, for dropout seeds (a
	// recomputation draws the same masks).
	step int
	done bool // backward ran
}

// at is the pass node i's values currently come from.
func (r *run) at(i int) *pass {
	if r.recomputed[i] {
		return &r.p.rec[i]
	}
	return &r.p.fwd[i]
}

// gbuf is a gradient allocation; several handles may share it (a Flatten's
// input gradient is its output gradient reshaped).
type gbuf struct {
	root Tensor
	refs int
}

type gref struct {
	buf *gbuf
	t   Tensor
}

// ErrNoForward is returned by Backward when no forward pass kept what it
// needs.
var ErrNoForward = errors.New("runtime: backward needs a training forward (or one with Options.GradInEval) first")

// New checks g against the parameters in w and uploads them to b.
func New(g *graph.Graph, w graph.Weights, b Backend, opt Options) (*Executor, error) {
	if g == nil || w == nil || b == nil {
		return nil, errors.New("runtime: nil graph, weights or backend")
	}
	if err := g.Validate(); err != nil {
		return nil, fmt.Errorf("runtime: %w", err)
	}
	if opt.Half != Float32 && !opt.Half.Is16() {
		return nil, fmt.Errorf("runtime: Options.Half is %v, want float32 (off), bfloat16 or float16", opt.Half)
	}
	e := &Executor{g: g, w: w, b: b, opt: opt, index: map[*graph.Node]int{}, params: map[string]Tensor{},
		signs: make([]Tensor, len(g.Nodes)), batches: make([]int64, len(g.Nodes)), plans: map[string]*plan{}}
	for i, nd := range g.Nodes {
		e.index[nd] = i
	}
	if opt.Checkpoint != NoCheckpointing {
		segs, err := Segments(g, opt.Checkpoint)
		if err != nil {
			return nil, err
		}
		e.segments = segs
		for _, s := range segs {
			e.segs = append(e.segs, segment{s.Start, s.End})
		}
	}
	for i, nd := range g.Nodes {
		if err := e.load(i, nd); err != nil {
			e.Close()
			return nil, err
		}
	}
	return e, nil
}

// load checks a node's parameters and uploads them.
func (e *Executor) load(i int, nd *graph.Node) error {
	a := normAttr(nd)
	want := map[string][]int{}
	switch nd.Op {
	case graph.OpConv:
		if a.OutChannels <= 0 || a.InChannels <= 0 || a.Groups <= 0 || a.InChannels%a.Groups != 0 {
			return fmt.Errorf("runtime: node %s: in_channels %d, out_channels %d, groups %d: out of range", nd.Name, a.InChannels, a.OutChannels, a.Groups)
		}
		want[graph.RoleWeight] = []int{a.OutChannels, a.InChannels / a.Groups, a.KernelSize[0], a.KernelSize[1]}
		want[graph.RoleBias] = []int{a.OutChannels}
	case graph.OpLinear:
		want[graph.RoleWeight] = []int{a.OutChannels, a.InChannels}
		want[graph.RoleBias] = []int{a.OutChannels}
	case graph.OpBatchNorm, graph.OpABN, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
		c := []int{a.Features}
		want[graph.RoleWeight], want[graph.RoleBias], want[graph.RoleRunningMean], want[graph.RoleRunningVar] = c, c, c, c
		for _, r := range []string{graph.RoleRunningMean, graph.RoleRunningVar} {
			if nd.Params[r] == "" {
				return fmt.Errorf("runtime: node %s: no %s (layers without running statistics are not supported)", nd.Name, r)
			}
		}
		if nd.Sign != nil {
			if len(nd.Sign) != a.Features {
				return fmt.Errorf("runtime: node %s: sign vector has %d entries for %d features", nd.Name, len(nd.Sign), a.Features)
			}
			t, err := e.upload(nd.Name+" sign", []int{a.Features}, func() ([]float32, error) {
				v := make([]float32, len(nd.Sign))
				for c, s := range nd.Sign {
					if s != 1 && s != -1 {
						return nil, fmt.Errorf("sign[%d] is %d, want +1 or -1", c, s)
					}
					v[c] = float32(s)
				}
				return v, nil
			})
			if err != nil {
				return fmt.Errorf("runtime: node %s: %w", nd.Name, err)
			}
			e.signs[i] = t
		}
		if k := nd.Params[graph.RoleNumBatches]; k != "" && e.b.Executes() {
			v, err := e.w.Values(k)
			if err != nil {
				return fmt.Errorf("runtime: node %s: %s: %w", nd.Name, k, err)
			}
			if len(v) != 1 {
				return fmt.Errorf("runtime: node %s: %s has %d values, want 1", nd.Name, k, len(v))
			}
			e.batches[i] = int64(v[0])
		}
	}
	for role, key := range nd.Params {
		if role == graph.RoleNumBatches {
			continue
		}
		shape, ok := want[role]
		if !ok {
			return fmt.Errorf("runtime: node %s (%s): unexpected parameter role %q (%s)", nd.Name, nd.Op, role, key)
		}
		got, ok := e.w.Shape(key)
		if !ok {
			return fmt.Errorf("runtime: node %s: parameter %s not in the weights", nd.Name, key)
		}
		if numel(got) != numel(shape) || (len(got) == len(shape) && !sameInts(got, shape)) {
			return fmt.Errorf("runtime: node %s: %s has shape %v, want %v", nd.Name, key, got, shape)
		}
		if _, done := e.params[key]; done {
			continue
		}
		t, err := e.upload(key, shape, func() ([]float32, error) {
			return graph.Float32Values(e.w, key)
		})
		if err != nil {
			return fmt.Errorf("runtime: node %s: %s: %w", nd.Name, key, err)
		}
		e.params[key] = t
	}
	if (nd.Op == graph.OpConv || nd.Op == graph.OpLinear) && nd.Params[graph.RoleWeight] == "" {
		return fmt.Errorf("runtime: node %s (%s) has no weight", nd.Name, nd.Op)
	}
	return nil
}

// upload allocates a parameter tensor and, when the backend executes, fills
// it from values.
func (e *Executor) upload(what string, shape []int, values func() ([]float32, error)) (Tensor, error) {
	if a, ok := e.b.(adopter); ok && e.b.Executes() {
		v, err := values()
		if err == nil && len(v) != numel(shape) {
			err = fmt.Errorf("%d values for shape %v", len(v), shape)
		}
		if err != nil {
			return nil, err
		}
		t, err := a.adopt(shape, v)
		if err == nil {
			e.paramBytes += int64(numel(shape)) * 4
		}
		return t, err
	}
	t, err := e.b.Alloc(shape, Float32)
	if err != nil {
		return nil, err
	}
	e.paramBytes += int64(numel(shape)) * 4
	if !e.b.Executes() {
		return t, nil
	}
	v, err := values()
	if err == nil && len(v) != numel(shape) {
		err = fmt.Errorf("%d values for shape %v", len(v), shape)
	}
	if err == nil {
		err = e.b.Upload(t, v)
	}
	if err != nil {
		e.b.Free(t)
		e.paramBytes -= int64(numel(shape)) * 4
		return nil, err
	}
	return t, nil
}

// Close frees every tensor the executor holds on the backend.
func (e *Executor) Close() error {
	e.release()
	var first error
	for k, t := range e.params {
		if err := e.b.Free(t); err != nil && first == nil {
			first = err
		}
		delete(e.params, k)
	}
	for i, t := range e.signs {
		if t != nil {
			if err := e.b.Free(t); err != nil && first == nil {
				first = err
			}
			e.signs[i] = nil
		}
	}
	e.paramBytes = 0
	return first
}

// param returns the tensor of a node's parameter role, nil when absent.
func (e *Executor) param(nd *graph.Node, role string) Tensor {
	if k, ok := nd.Params[role]; ok {
		return e.params[k]
	}
	return nil
}

func (e *Executor) planFor(shape []int, training bool) (*plan, error) {
	save := training || e.opt.GradInEval
	key := fmt.Sprint(shape, training, save)
	if p, ok := e.plans[key]; ok {
		return p, nil
	}
	p, err := makePlanWith(e.g, e.index, shape, planConfig{training: training, save: save, recompute: !e.opt.NoRecompute, segments: e.segs, half: e.opt.Half})
	if err != nil {
		return nil, err
	}
	e.plans[key] = p
	return p, nil
}

// release frees what a forward pass kept, if a backward pass did not.
func (e *Executor) release() {
	r := e.run
	if r == nil {
		return
	}
	for s, t := range r.roots {
		if t != nil {
			e.b.Free(t)
			r.roots[s] = nil
		}
	}
	for i := range r.grads {
		e.dropGrad(r, i)
	}
	for k, t := range r.pgrads {
		e.b.Free(t)
		delete(r.pgrads, k)
	}
	for t := range r.temps {
		e.b.Free(t)
		delete(r.temps, t)
	}
	e.run = nil
}

// Outputs returns the last forward's outputs: the one Forward returned,
// then the graph's auxiliary outputs in order (graph.Graph.Aux). In eval,
// the training-only ones are computed too: the model returns only the
// main one then, and the caller skips them.
func (e *Executor) Outputs() []*HostTensor { return append([]*HostTensor(nil), e.outs...) }

// Forward runs the graph on x in training or eval mode and returns its
// main output (Outputs has the auxiliary ones). A training forward updates the running statistics and keeps what
// Backward needs; so does an eval forward with Options.GradInEval.
func (e *Executor) Forward(x *HostTensor, training bool) (*HostTensor, error) {
	if x == nil {
		return nil, errors.New("runtime: nil input")
	}
	if e.b.Executes() && len(x.Data) != numel(x.Shape) {
		return nil, fmt.Errorf("runtime: input has %d values for shape %v", len(x.Data), x.Shape)
	}
	e.release()
	p, err := e.planFor(x.Shape, training)
	if err != nil {
		return nil, err
	}
	r := &run{p: p, roots: make([]Tensor, len(p.storages)), vals: make([]Tensor, p.n), grads: make([]gref, p.n),
		pgrads: map[string]Tensor{}, temps: map[Tensor]bool{}, recomputed: make([]bool, p.n), step: e.trainSteps}
	e.run = r
	e.b.ResetPeak()
	e.base = e.b.Stats().LiveBytes
	e.mem = MemoryReport{Backend: e.b.Name(), Training: training, InputShape: append([]int(nil), x.Shape...), ParamBytes: e.paramBytes}
	e.mem.Layers = make([]LayerMemory, p.n)
	e.work = WorkReport{}
	var out *HostTensor
	// The first n events are the forwards of nodes 0..n-1.
	for i, nd := range e.g.Nodes {
		start := time.Now()
		if err := e.allocStep(r, i); err != nil {
			return nil, e.fail(fmt.Errorf("runtime: node %s: %w", nd.Name, err))
		}
		if err := e.bind(r, i); err != nil {
			return nil, e.fail(fmt.Errorf("runtime: node %s: %w", nd.Name, err))
		}
		if err := e.forward(r, i, nd, x, false); err != nil {
			return nil, e.fail(fmt.Errorf("runtime: node %s (%s): %w", nd.Name, nd.Op, err))
		}
		e.work.ForwardFLOPs += p.flops[i].fwd
		if i == p.n-1 {
			e.outs = nil
			for k, v := range e.g.Outputs() {
				j := e.index[v.Producer]
				o := &HostTensor{Shape: append([]int(nil), p.shapes[j]...)}
				if e.b.Executes() {
					o.Data = make([]float32, numel(o.Shape))
					if err := e.b.Download(r.vals[j], o.Data); err != nil {
						return nil, e.fail(fmt.Errorf("runtime: reading output %s: %w", v.Name, err))
					}
				}
				e.outs = append(e.outs, o)
				if k == 0 {
					out = o
				}
			}
		}
		if err := e.freeStep(r, i); err != nil {
			return nil, e.fail(err)
		}
		e.mem.Layers[i] = LayerMemory{Node: nd.Name, Op: string(nd.Op), LiveBytes: e.b.Stats().LiveBytes - e.base}
		if e.opt.Trace != nil {
			e.opt.Trace("forward", i, p.n, nd, time.Since(start))
		}
	}
	if training {
		e.trainSteps++
	}
	st := e.b.Stats()
	e.mem.PeakBytes = st.PeakBytes - e.base
	if p.save {
		e.mem.SavedBytes = st.LiveBytes - e.base
		for _, si := range p.storages {
			switch {
			case si.first < p.n && si.last >= p.n && si.savedBy >= 0:
				e.mem.Layers[si.savedBy].SavedBytes += si.bytes()
			case si.kind == kindShared:
				// Charged to the first group, which allocates them.
				e.mem.Layers[si.owner].SavedBytes += si.bytes()
			}
		}
	} else {
		e.run = nil
	}
	return out, nil
}

// fail releases the run after an error, so that a later call starts clean.
func (e *Executor) fail(err error) error {
	e.release()
	return err
}

// allocStep allocates the storages the plan starts before step.
func (e *Executor) allocStep(r *run, step int) error {
	for _, s := range r.p.allocAt[step] {
		si := r.p.storages[s]
		t, err := e.b.Alloc(si.shape, si.dt)
		if err != nil {
			return fmt.Errorf("allocating the %s (%v): %w", si.what, si.shape, err)
		}
		r.roots[s] = t
	}
	return nil
}

// freeStep frees the storages whose last use is step.
func (e *Executor) freeStep(r *run, step int) error {
	for _, s := range r.p.freeAt[step] {
		if t := r.roots[s]; t != nil {
			if err := e.b.Free(t); err != nil {
				return fmt.Errorf("runtime: freeing the %s of node %s: %w", r.p.storages[s].what, e.g.Nodes[r.p.storages[s].owner].Name, err)
			}
			r.roots[s] = nil
		}
	}
	for i, v := range r.vals {
		if v != nil && r.roots[r.at(i).store] == nil {
			r.vals[i] = nil
		}
	}
	return nil
}

// bind sets node i's output handle: its storage in the current pass, viewed
// with its shape.
func (e *Executor) bind(r *run, i int) error {
	s := r.at(i).store
	root := r.roots[s]
	if root == nil {
		return fmt.Errorf("storage of the output is not live (plan bug)")
	}
	if sameInts(root.Shape(), r.p.shapes[i]) {
		r.vals[i] = root
		return nil
	}
	v, err := e.b.View(root, r.p.shapes[i])
	if err != nil {
		return err
	}
	r.vals[i] = v
	return nil
}

// in returns the handle of node nd's k-th input.
func (e *Executor) in(r *run, nd *graph.Node, k int) Tensor {
	return r.vals[e.index[nd.Inputs[k].Producer]]
}

func (e *Executor) aux(r *run, i, k int) Tensor { return r.roots[r.at(i).aux[k]] }

// weight returns the weight node i computes with: the parameter, or under
// Options.Half its 16-bit copy, which fill (in a forward or a
// recomputation) first writes from the parameter.
func (e *Executor) weight(r *run, i int, nd *graph.Node, fill bool) (Tensor, error) {
	w := e.param(nd, graph.RoleWeight)
	wc := r.at(i).wcopy
	if wc < 0 {
		return w, nil
	}
	t := r.roots[wc]
	if t == nil {
		return nil, fmt.Errorf("16-bit weight copy is not live (plan bug)")
	}
	if fill {
		if err := e.b.Copy(t, w); err != nil {
			return nil, fmt.Errorf("16-bit copy of %s: %w", nd.Params[graph.RoleWeight], err)
		}
	}
	return t, nil
}

func convParams(nd *graph.Node) ConvParams {
	a := normAttr(nd)
	return ConvParams{Stride: a.Stride, Padding: a.Padding, Dilation: a.Dilation, Groups: a.Groups}
}

func poolParams(nd *graph.Node) PoolParams {
	a := normAttr(nd)
	return PoolParams{Kernel: a.KernelSize, Stride: a.Stride, Padding: a.Padding, CeilMode: a.CeilMode, CountIncludePad: a.CountIncludePad}
}

func normParams(nd *graph.Node) NormParams {
	return NormParams{Eps: nd.Attr.Eps, AbsWeight: nd.Op == graph.OpInPlaceABN || nd.Op == graph.OpInPlaceABNSync, Act: actOf(nd)}
}

// forward runs node i through its op's kernel; recompute says it is the
// rerun of a checkpointed node, which must not update running statistics
// again.
func (e *Executor) forward(r *run, i int, nd *graph.Node, x *HostTensor, recompute bool) error {
	if isLayoutOp(nd, r.inShapes(e, nd)) {
		return e.layoutForward(r, i, nd)
	}
	if k, ok := kernels[nd.Op]; ok && k.forward != nil {
		return k.forward(e, r, i, nd, x, recompute)
	}
	// inferShapes accepted the op, so this is a bug, not the network's.
	return failure.Internalf("op %s planned but not executed by the forward pass", nd.Op)
}

// broadcasting is the backend's Broadcasting, or an error naming it.
func (e *Executor) broadcasting() (Broadcasting, error) {
	bb, ok := e.b.(Broadcasting)
	if !ok {
		return nil, fmt.Errorf("backend %s has no broadcasting elementwise ops (Mul, Sub, Div, Add of different shapes)", e.b.Name())
	}
	return bb, nil
}

// binaryOf says whether nd runs as a broadcasting binary op, and which:
// Mul, Sub and Div always, Add when its two inputs differ in shape (the
// same-shape Add of residual blocks stays a Sum).
func binaryOf(nd *graph.Node, p *plan, index map[*graph.Node]int) (BinaryOp, bool) {
	switch nd.Op {
	case graph.OpMul:
		return BinaryMul, true
	case graph.OpSub:
		return BinarySub, true
	case graph.OpDiv:
		return BinaryDiv, true
	case graph.OpAdd:
		if len(nd.Inputs) == 2 && !sameInts(p.shapes[index[nd.Inputs[0].Producer]], p.shapes[index[nd.Inputs[1].Producer]]) {
			return BinaryAdd, true
		}
	}
	return 0, false
}

func (e *Executor) inputs(r *run, nd *graph.Node) []Tensor {
	ts := make([]Tensor, len(nd.Inputs))
	for k := range nd.Inputs {
		ts[k] = e.in(r, nd, k)
	}
	return ts
}

// normalize runs a BN-family node: batch statistics and the running update
// in training mode (update is false when recomputing), then the transform.
func (e *Executor) normalize(r *run, i int, nd *graph.Node, y, x Tensor, update bool) error {
	b := e.b
	w, bias := e.param(nd, graph.RoleWeight), e.param(nd, graph.RoleBias)
	rm, rv := e.param(nd, graph.RoleRunningMean), e.param(nd, graph.RoleRunningVar)
	sign := e.signs[i]
	if !r.p.training {
		return b.Normalize(y, x, sign, rm, rv, w, bias, normParams(nd))
	}
	mean, variance := e.aux(r, i, 0), e.aux(r, i, 1)
	if update {
		if err := b.BatchStats(mean, variance, x, sign); err != nil {
			return err
		}
		e.batches[i]++
		factor := nd.Attr.Momentum
		if nd.Attr.MomentumNone {
			factor = 1 / float64(e.batches[i])
		}
		if fault.momentum != 0 && faulty(nd) {
			factor = fault.momentum
		}
		sh := x.Shape()
		// (N, C, H, W), or (N, C) after a Linear.
		count := numel(sh) / sh[1]
		if err := b.UpdateRunning(rm, rv, mean, variance, factor, count); err != nil {
			return err
		}
		if fault.runningVar != 0 && faulty(nd) && count > 1 {
			extra := factor * (fault.runningVar - 1) * float64(count) / float64(count-1)
			if err := e.scaleOnHost(rv, 1, variance, extra); err != nil {
				return err
			}
		}
	}
	return b.Normalize(y, x, sign, mean, variance, w, bias, normParams(nd))
}

// RunningStats downloads every BN-family node's running statistics and
// num_batches_tracked (as a one-element slice), keyed by state-dict key.
func (e *Executor) RunningStats() (map[string][]float32, error) {
	out := map[string][]float32{}
	if !e.b.Executes() {
		return out, nil
	}
	for i, nd := range e.g.Nodes {
		if !nd.Op.IsBNFamily() {
			continue
		}
		for _, role := range []string{graph.RoleRunningMean, graph.RoleRunningVar} {
			k := nd.Params[role]
			t := e.params[k]
			v := make([]float32, numel(t.Shape()))
			if err := e.b.Download(t, v); err != nil {
				return nil, fmt.Errorf("runtime: node %s: reading %s: %w", nd.Name, k, err)
			}
			out[k] = v
		}
		if k := nd.Params[graph.RoleNumBatches]; k != "" {
			out[k] = []float32{float32(e.batches[i])}
		}
	}
	return out, nil
}

// Memory reports the memory of the last Forward (and Backward, when one
// followed it).
func (e *Executor) Memory() MemoryReport {
	m := e.mem
	m.Layers = append([]LayerMemory(nil), e.mem.Layers...)
	return m
}

// Work reports the arithmetic of the last Forward (and Backward, when one
// followed it), recomputation apart.
func (e *Executor) Work() WorkReport { return e.work }

// Segments lists the checkpoint segments Options.Checkpoint chose (nil
// without checkpointing).
func (e *Executor) Segments() []Segment { return append([]Segment(nil), e.segments...) }
