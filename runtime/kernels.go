package runtime

import (
	"github.com/abnconvert/abnconvert/graph"
)

// kernel is an op's forward and backward in the executor. forward runs
// node i (x is the network's input, recompute says it is the rerun of a
// checkpointed node, which must not update running statistics again);
// backward runs its backward from the output gradient dy, which it may
// hand on to an input (inputTarget's reuse). A nil backward means the op
// has none (the input).
type kernel struct {
	forward  func(e *Executor, r *run, i int, nd *graph.Node, x *HostTensor, recompute bool) error
	backward func(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error
}

// kernels holds the kernels of every op of graph's op table (read only;
// TestOpTableKernels checks that none is missing). The layout ops, and a
// Concat that is not along the channels of 4-D tensors, run through
// layoutForward and layoutBackward before this table is consulted
// (isLayoutOp). The activations share one pair, parameterised by actOf.
var kernels = map[graph.Op]kernel{
	graph.OpInput:           {forward: inputForward},
	graph.OpConv:            {forward: layerForward, backward: layerBackward},
	graph.OpLinear:          {forward: layerForward, backward: layerBackward},
	graph.OpBatchNorm:       {forward: normForward, backward: normBackwardKernel},
	graph.OpABN:             {forward: normForward, backward: normBackwardKernel},
	graph.OpInPlaceABN:      {forward: normForward, backward: normBackwardKernel},
	graph.OpInPlaceABNSync:  {forward: normForward, backward: normBackwardKernel},
	graph.OpReLU:            {forward: activationForward, backward: activationBackward},
	graph.OpLeakyReLU:       {forward: activationForward, backward: activationBackward},
	graph.OpELU:             {forward: activationForward, backward: activationBackward},
	graph.OpHardtanh:        {forward: activationForward, backward: activationBackward},
	graph.OpSigmoid:         {forward: activationForward, backward: activationBackward},
	graph.OpSiLU:            {forward: activationForward, backward: activationBackward},
	graph.OpHardsigmoid:     {forward: activationForward, backward: activationBackward},
	graph.OpHardswish:       {forward: activationForward, backward: activationBackward},
	graph.OpGELU:            {forward: activationForward, backward: activationBackward},
	graph.OpTanh:            {forward: activationForward, backward: activationBackward},
	graph.OpSELU:            {forward: activationForward, backward: activationBackward},
	graph.OpCELU:            {forward: activationForward, backward: activationBackward},
	graph.OpSoftplus:        {forward: activationForward, backward: activationBackward},
	graph.OpMish:            {forward: activationForward, backward: activationBackward},
	graph.OpAdd:             {forward: sumForward, backward: sumBackward},
	graph.OpMul:             {forward: sumForward, backward: sumBackward},
	graph.OpSub:             {forward: sumForward, backward: sumBackward},
	graph.OpDiv:             {forward: sumForward, backward: sumBackward},
	graph.OpConcat:          {forward: concatForward, backward: concatBackwardKernel},
	graph.OpMaxPool:         {forward: maxPoolForward, backward: poolBackward},
	graph.OpAvgPool:         {forward: avgPoolForward, backward: poolBackward},
	graph.OpAdaptiveAvgPool: {forward: adaptivePoolForward, backward: poolBackward},
	graph.OpFlatten:         {forward: viewForward, backward: passBackward},
	graph.OpReshape:         {forward: viewForward, backward: passBackward},
	graph.OpDropout:         {forward: dropoutForward, backward: passBackward},
	graph.OpStochasticDepth: {forward: stochasticDepthForward, backward: stochasticDepthBackwardKernel},
	graph.OpTranspose:       {forward: layoutForwardKernel, backward: layoutBackwardKernel},
	graph.OpPad:             {forward: layoutForwardKernel, backward: layoutBackwardKernel},
	graph.OpSlice:           {forward: layoutForwardKernel, backward: layoutBackwardKernel},
	graph.OpResize:          {forward: layoutForwardKernel, backward: layoutBackwardKernel},
}

func inputForward(e *Executor, r *run, i int, nd *graph.Node, x *HostTensor, _ bool) error {
	if e.b.Executes() {
		return e.b.Upload(r.vals[i], x.Data)
	}
	return nil
}

func layerForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	b, y := e.b, r.vals[i]
	w, err := e.weight(r, i, nd, true)
	if err != nil {
		return err
	}
	if nd.Op == graph.OpConv {
		return b.Conv2d(y, e.in(r, nd, 0), w, e.param(nd, graph.RoleBias), convParams(nd))
	}
	return b.Linear(y, e.in(r, nd, 0), w, e.param(nd, graph.RoleBias))
}

func layerBackward(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	tx, tw, tb, err := e.layerTargets(r, nd, nil)
	if err != nil {
		return err
	}
	x := e.in(r, nd, 0)
	w, err := e.weight(r, i, nd, false)
	if err != nil {
		return err
	}
	if nd.Op == graph.OpConv {
		err = e.b.Conv2dBackward(tx.dst, tw.dst, tb.dst, dy.t, x, w, convParams(nd))
	} else {
		err = e.b.LinearBackward(tx.dst, tw.dst, tb.dst, dy.t, x, w)
	}
	if err != nil {
		return err
	}
	return finishAll(tx, tw, tb)
}

func normForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, recompute bool) error {
	y := r.vals[i]
	if err := e.normalize(r, i, nd, y, e.in(r, nd, 0), !recompute); err != nil {
		return err
	}
	if nd.Residual() != nil {
		return e.b.Sum(y, y, e.in(r, nd, 1))
	}
	return nil
}

func normBackwardKernel(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	return e.normBackward(r, i, nd, dy, e.in(r, nd, 0), r.vals[i])
}

// activationForward runs the table's activations: one kernel with actOf's
// kind and parameters.
func activationForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	return e.b.Activation(r.vals[i], e.in(r, nd, 0), actOf(nd))
}

// activationBackward works from the output where the op keeps it (ReLU,
// Sigmoid: graph.SaveOutput) or ran in place, else from the input.
func activationBackward(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	info, _ := nd.Op.Info()
	fromOut := r.at(i).inPlace || info.Saves == graph.SaveOutput
	saved := e.in(r, nd, 0)
	if fromOut {
		saved = r.vals[i]
	}
	tx, err := e.inputTarget(r, nd, 0, dy)
	if err != nil {
		return err
	}
	if err := e.b.ActivationBackward(tx.dst, dy.t, saved, actOf(nd), fromOut); err != nil {
		return err
	}
	return tx.finish()
}

// sumForward runs Add, Mul, Sub and Div: a broadcasting binary op, or
// (Add of inputs of one shape) a Sum.
func sumForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	y := r.vals[i]
	if op, ok := binaryOf(nd, r.p, e.index); ok {
		bb, err := e.broadcasting()
		if err != nil {
			return err
		}
		return bb.Binary(y, e.in(r, nd, 0), e.in(r, nd, 1), op)
	}
	return e.b.Sum(y, e.inputs(r, nd)...)
}

func sumBackward(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	if op, ok := binaryOf(nd, r.p, e.index); ok {
		return e.binaryBackward(r, nd, dy.t, op)
	}
	for k := range nd.Inputs {
		var reuse *gref
		if k == len(nd.Inputs)-1 {
			reuse = dy
		}
		t, err := e.inputTarget(r, nd, k, reuse)
		if err != nil {
			return err
		}
		if !t.shared {
			if err := e.b.Copy(t.dst, dy.t); err != nil {
				return err
			}
		}
		if err := t.finish(); err != nil {
			return err
		}
	}
	return nil
}

func concatForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	return e.b.Concat(r.vals[i], e.inputs(r, nd)...)
}

func concatBackwardKernel(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	return e.concatBackward(r, nd, dy.t)
}

func maxPoolForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	var idx Tensor
	if r.p.save {
		idx = e.aux(r, i, 0)
	}
	return e.b.MaxPool(r.vals[i], idx, e.in(r, nd, 0), poolParams(nd))
}

func avgPoolForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	return e.b.AvgPool(r.vals[i], e.in(r, nd, 0), poolParams(nd))
}

func adaptivePoolForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	return e.b.AdaptiveAvgPool(r.vals[i], e.in(r, nd, 0))
}

func poolBackward(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	tx, err := e.inputTarget(r, nd, 0, nil)
	if err != nil {
		return err
	}
	switch nd.Op {
	case graph.OpMaxPool:
		err = e.b.MaxPoolBackward(tx.dst, dy.t, e.aux(r, i, 0))
	case graph.OpAvgPool:
		err = e.b.AvgPoolBackward(tx.dst, dy.t, poolParams(nd))
	default:
		err = e.b.AdaptiveAvgPoolBackward(tx.dst, dy.t)
	}
	if err != nil {
		return err
	}
	return tx.finish()
}

// viewForward: Flatten and Reshape share their input's storage (the plan
// made their output a view of it), so there is nothing to compute.
func viewForward(*Executor, *run, int, *graph.Node, *HostTensor, bool) error { return nil }

func dropoutForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	if !r.p.training {
		return nil
	}
	mask := e.aux(r, i, 0)
	if err := e.b.DropoutMask(mask, nd.Attr.P, DropoutSeed(e.opt.Seed, nd.Name, r.step)); err != nil {
		return err
	}
	return e.b.Mul(r.vals[i], e.in(r, nd, 0), mask)
}

// passBackward hands the gradient on to the input: unchanged for Flatten,
// Reshape and dropout in eval, times the mask for dropout in training.
func passBackward(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	tx, err := e.inputTarget(r, nd, 0, dy)
	if err != nil {
		return err
	}
	if nd.Op == graph.OpDropout && r.p.training {
		err = e.b.Mul(tx.dst, dy.t, e.aux(r, i, 0))
	} else if !tx.shared {
		err = e.b.Copy(tx.dst, dy.t)
	}
	if err != nil {
		return err
	}
	return tx.finish()
}

func stochasticDepthForward(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	return e.stochasticDepth(r, i, nd, r.vals[i])
}

func stochasticDepthBackwardKernel(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	return e.stochasticDepthBackward(r, i, nd, r.p, *dy)
}

func layoutForwardKernel(e *Executor, r *run, i int, nd *graph.Node, _ *HostTensor, _ bool) error {
	return e.layoutForward(r, i, nd)
}

func layoutBackwardKernel(e *Executor, r *run, i int, nd *graph.Node, dy *gref) error {
	return e.layoutBackward(r, i, nd, dy.t)
}
