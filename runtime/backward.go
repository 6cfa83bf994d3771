package runtime

import (
	"fmt"
	"time"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// Backward runs the backward pass of the last forward from dOut, the
// gradient of the graph's output. It returns the gradient of the graph's
// input and the gradients of every weight and bias, keyed by state-dict key.
//
// Gradient buffers follow one rule, the same on every backend: a value's
// gradient is allocated when its first contribution arrives and freed once
// its producer's backward has run; elementwise backwards (activations, the
// BN family, dropout, flatten, add) write their input gradient over their
// output gradient instead of allocating, since that is dead afterwards.
func (e *Executor) Backward(dOut *HostTensor) (*HostTensor, map[string][]float32, error) {
	if dOut == nil {
		return nil, nil, fmt.Errorf("runtime: no output gradient")
	}
	return e.BackwardAll([]*HostTensor{dOut})
}

// BackwardAll is Backward from the gradients of several outputs, in the
// order of Outputs: the main output's first, then the auxiliary ones', as
// a loss that adds the auxiliary heads' terms gives them. A missing or nil
// auxiliary gradient is zero: that head then gets no gradient, as in
// PyTorch when the loss leaves it out.
func (e *Executor) BackwardAll(dOuts []*HostTensor) (*HostTensor, map[string][]float32, error) {
	r := e.run
	if r == nil || !r.p.save || r.done {
		return nil, nil, ErrNoForward
	}
	p := r.p
	outs := e.g.Outputs()
	if len(dOuts) == 0 || dOuts[0] == nil {
		return nil, nil, fmt.Errorf("runtime: no gradient for the main output")
	}
	if len(dOuts) > len(outs) {
		return nil, nil, fmt.Errorf("runtime: %d output gradients for %d outputs", len(dOuts), len(outs))
	}
	for k, dOut := range dOuts {
		if dOut == nil {
			continue
		}
		oi := e.index[outs[k].Producer]
		if !sameInts(dOut.Shape, p.shapes[oi]) {
			return nil, nil, fmt.Errorf("runtime: gradient of output %s has shape %v, the output %v", outs[k].Name, dOut.Shape, p.shapes[oi])
		}
		if e.b.Executes() && len(dOut.Data) != numel(dOut.Shape) {
			return nil, nil, fmt.Errorf("runtime: gradient of output %s has %d values for shape %v", outs[k].Name, len(dOut.Data), dOut.Shape)
		}
	}
	for k, dOut := range dOuts {
		if dOut == nil {
			continue
		}
		oi := e.index[outs[k].Producer]
		g, err := e.allocGrad(r, p.shapes[oi])
		if err != nil {
			return nil, nil, e.fail(fmt.Errorf("runtime: output gradient: %w", err))
		}
		r.grads[oi] = g
		if e.b.Executes() {
			if err := e.b.Upload(g.t, dOut.Data); err != nil {
				return nil, nil, e.fail(fmt.Errorf("runtime: output gradient: %w", err))
			}
		}
	}
	for ev := p.n; ev < len(p.events); ev++ {
		i := p.events[ev].node
		nd := e.g.Nodes[i]
		start := time.Now()
		if err := e.allocStep(r, ev); err != nil {
			return nil, nil, e.fail(fmt.Errorf("runtime: node %s: %w", nd.Name, err))
		}
		if p.events[ev].kind == evRecompute {
			r.recomputed[i] = true
			if err := e.bind(r, i); err != nil {
				return nil, nil, e.fail(fmt.Errorf("runtime: recomputing node %s: %w", nd.Name, err))
			}
			if err := e.forward(r, i, nd, nil, true); err != nil {
				return nil, nil, e.fail(fmt.Errorf("runtime: recomputing node %s (%s): %w", nd.Name, nd.Op, err))
			}
			e.work.RecomputeFLOPs += p.flops[i].fwd
			if err := e.freeStep(r, ev); err != nil {
				return nil, nil, e.fail(err)
			}
			if e.opt.Trace != nil {
				e.opt.Trace("recompute", i, p.n, nd, time.Since(start))
			}
			continue
		}
		if r.grads[i].buf != nil && i > 0 {
			if err := e.backward(r, i, nd); err != nil {
				return nil, nil, e.fail(fmt.Errorf("runtime: backward of node %s (%s): %w", nd.Name, nd.Op, err))
			}
			e.dropGrad(r, i)
			e.work.BackwardFLOPs += p.flops[i].bwd
		}
		if err := e.freeStep(r, ev); err != nil {
			return nil, nil, e.fail(err)
		}
		e.mem.Layers[i].BackwardLiveBytes = e.b.Stats().LiveBytes - e.base
		if e.opt.Trace != nil {
			e.opt.Trace("backward", i, p.n, nd, time.Since(start))
		}
	}

	dx := &HostTensor{Shape: append([]int(nil), p.shapes[0]...)}
	grads := map[string][]float32{}
	if e.b.Executes() {
		dx.Data = make([]float32, numel(dx.Shape))
		if r.grads[0].buf != nil {
			if err := e.b.Download(r.grads[0].t, dx.Data); err != nil {
				return nil, nil, e.fail(fmt.Errorf("runtime: reading the input gradient: %w", err))
			}
		}
	}
	for k, t := range r.pgrads {
		var v []float32
		if e.b.Executes() {
			v = make([]float32, numel(t.Shape()))
			if err := e.b.Download(t, v); err != nil {
				return nil, nil, e.fail(fmt.Errorf("runtime: reading the gradient of %s: %w", k, err))
			}
		}
		grads[k] = v
	}
	e.mem.PeakBytes = e.b.Stats().PeakBytes - e.base
	r.done = true
	e.release()
	return dx, grads, nil
}

// allocGrad allocates the gradient buffer of a value, in the type of
// activations.
func (e *Executor) allocGrad(r *run, shape []int) (gref, error) {
	t, err := e.b.Alloc(shape, r.p.act)
	if err != nil {
		return gref{}, err
	}
	return gref{buf: &gbuf{root: t, refs: 1}, t: t}, nil
}

// dropGrad releases node i's output gradient.
func (e *Executor) dropGrad(r *run, i int) {
	g := r.grads[i]
	if g.buf == nil {
		return
	}
	r.grads[i] = gref{}
	g.buf.refs--
	if g.buf.refs == 0 {
		e.b.Free(g.buf.root)
	}
}

// target is where an op writes a gradient, and what to do afterwards:
// adopt it as the gradient, or add it into the gradient already there.
type target struct {
	dst    Tensor
	shared bool // dst is the output gradient's own buffer
	finish func() error
}

func noFinish() error { return nil }

// inputTarget prepares the gradient of nd's k-th input. With reuse (the
// output gradient, for ops that may overwrite it), the op writes there.
func (e *Executor) inputTarget(r *run, nd *graph.Node, k int, reuse *gref) (target, error) {
	j := e.index[nd.Inputs[k].Producer]
	shape := r.p.shapes[j]
	have := r.grads[j].buf != nil
	if reuse != nil && reuse.buf != nil {
		dst := reuse.t
		if !sameInts(dst.Shape(), shape) {
			v, err := e.b.View(reuse.buf.root, shape)
			if err != nil {
				return target{}, err
			}
			dst = v
		}
		if !have {
			buf := reuse.buf
			return target{dst: dst, shared: true, finish: func() error {
				buf.refs++
				r.grads[j] = gref{buf: buf, t: dst}
				return nil
			}}, nil
		}
		return target{dst: dst, shared: true, finish: func() error { return e.b.Accumulate(r.grads[j].t, dst) }}, nil
	}
	if !have {
		g, err := e.allocGrad(r, shape)
		if err != nil {
			return target{}, err
		}
		// Adopted at once, so that an error on the way frees it too.
		r.grads[j] = g
		return target{dst: g.t, finish: noFinish}, nil
	}
	return e.tempTarget(r, shape, r.p.act, func(tmp Tensor) error { return e.b.Accumulate(r.grads[j].t, tmp) })
}

// tempTarget allocates a temporary that finish folds in with add and frees.
// The run tracks it until then, so that an error in between frees it too.
func (e *Executor) tempTarget(r *run, shape []int, dt DType, add func(Tensor) error) (target, error) {
	tmp, err := e.b.Alloc(shape, dt)
	if err != nil {
		return target{}, err
	}
	r.temps[tmp] = true
	return target{dst: tmp, finish: func() error {
		err := add(tmp)
		delete(r.temps, tmp)
		if ferr := e.b.Free(tmp); err == nil {
			err = ferr
		}
		return err
	}}, nil
}

// paramTarget prepares the gradient of a node's parameter; dst is nil when
// the node has no such parameter.
// layerTargets returns the gradient targets of a layer's input (reusing
// reuse's buffer when inputTarget may), weight and bias.
func (e *Executor) layerTargets(r *run, nd *graph.Node, reuse *gref) (tx, tw, tb target, err error) {
	if tx, err = e.inputTarget(r, nd, 0, reuse); err != nil {
		return
	}
	if tw, err = e.paramTarget(r, nd, graph.RoleWeight); err != nil {
		return
	}
	tb, err = e.paramTarget(r, nd, graph.RoleBias)
	return
}

func (e *Executor) paramTarget(r *run, nd *graph.Node, role string) (target, error) {
	key := nd.Params[role]
	if key == "" {
		return target{finish: noFinish}, nil
	}
	shape := e.params[key].Shape()
	t, ok := r.pgrads[key]
	if !ok {
		t, err := e.b.Alloc(shape, Float32)
		if err != nil {
			return target{}, err
		}
		r.pgrads[key] = t
		return target{dst: t, finish: noFinish}, nil
	}
	return e.tempTarget(r, shape, Float32, func(tmp Tensor) error { return e.b.Accumulate(t, tmp) })
}

func finishAll(ts ...target) error {
	for _, t := range ts {
		if err := t.finish(); err != nil {
			return err
		}
	}
	return nil
}

// backward runs node i's backward.
func (e *Executor) backward(r *run, i int, nd *graph.Node) error {
	p := r.p
	dy := r.grads[i]
	if gr := p.group[i]; gr != nil {
		if i == gr.conv {
			return e.groupBackward(r, gr)
		}
		return nil
	}
	if isLayoutOp(nd, r.inShapes(e, nd)) {
		return e.layoutBackward(r, i, nd, dy.t)
	}
	restore, err := e.rematerialize(r, i, nd)
	defer restore()
	if err != nil {
		return err
	}
	if k, ok := kernels[nd.Op]; ok && k.backward != nil {
		return k.backward(e, r, i, nd, &dy)
	}
	// inferShapes accepted the op, so this is a bug, not the network's.
	return failure.Internalf("op %s planned but not differentiated by the backward pass", nd.Op)
}

// binaryBackward runs a broadcasting binary op's backward: both input
// gradients at once, from the operands Mul and Div kept.
func (e *Executor) binaryBackward(r *run, nd *graph.Node, dy Tensor, op BinaryOp) error {
	bb, err := e.broadcasting()
	if err != nil {
		return err
	}
	ta, err := e.inputTarget(r, nd, 0, nil)
	if err != nil {
		return err
	}
	// Adopt (or fold in) the first gradient before asking for the second:
	// x * x reads one value twice.
	tb, err := e.inputTarget(r, nd, 1, nil)
	if err != nil {
		return err
	}
	var a, b Tensor
	if op == BinaryMul || op == BinaryDiv {
		a, b = e.in(r, nd, 0), e.in(r, nd, 1)
	}
	if err := bb.BinaryBackward(ta.dst, tb.dst, dy, a, b, op); err != nil {
		return err
	}
	return finishAll(ta, tb)
}

// normBackward runs a BN-family node's backward from its saved tensors: the
// input x for BatchNorm and ABN (and ABN's output y for its activation), the
// output z alone for InPlace-ABN.
func (e *Executor) normBackward(r *run, i int, nd *graph.Node, dy *gref, x, y Tensor) error {
	b := e.b
	if nd.Residual() != nil {
		// The residual's gradient is dy, taken before dy becomes x's.
		j := e.index[nd.Inputs[1].Producer]
		if r.grads[j].buf != nil {
			if err := b.Accumulate(r.grads[j].t, dy.t); err != nil {
				return err
			}
		} else {
			t, err := e.inputTarget(r, nd, 1, nil)
			if err != nil {
				return err
			}
			if err := b.Copy(t.dst, dy.t); err != nil {
				return err
			}
			if err := t.finish(); err != nil {
				return err
			}
		}
	}
	tx, tw, tb, err := e.layerTargets(r, nd, dy)
	if err != nil {
		return err
	}
	w, bias := e.param(nd, graph.RoleWeight), e.param(nd, graph.RoleBias)
	mean, variance := e.param(nd, graph.RoleRunningMean), e.param(nd, graph.RoleRunningVar)
	if r.p.training {
		mean, variance = e.aux(r, i, 0), e.aux(r, i, 1)
	}
	np := normParams(nd)
	if res := nd.Residual(); res != nil {
		// y holds the sum z = IABN(x) + residual; nothing reads it after
		// this node's backward (the graph outputs are never fused), so
		// the normalised output is recovered where it lies.
		bb, err := e.broadcasting()
		if err != nil {
			return err
		}
		if err := bb.Binary(y, y, e.in(r, nd, 1), BinarySub); err != nil {
			return err
		}
		e.work.RecomputeFLOPs += int64(numel(r.p.shapes[i]))
	}
	if nd.Op == graph.OpInPlaceABN || nd.Op == graph.OpInPlaceABNSync {
		// Inverting the activation and recovering xhat from z is work
		// the plain layer does not do: one pass over the elements.
		e.work.RecomputeFLOPs += int64(numel(r.p.shapes[i]))
		err = b.NormalizeBackwardFromOutput(tx.dst, tw.dst, tb.dst, dy.t, y, e.signs[i], variance, w, bias, np, r.p.training)
		if err == nil && fault.abnWeightGrad != 0 {
			err = e.scaleOnHost(tw.dst, fault.abnWeightGrad, nil, 0)
		}
	} else {
		if np.Act.Kind != ActIdentity {
			// The activation ran in place on the normalised output,
			// which is what y holds.
			if err := b.ActivationBackward(dy.t, dy.t, y, np.Act, true); err != nil {
				return err
			}
			np.Act = Act{}
		}
		err = b.NormalizeBackward(tx.dst, tw.dst, tb.dst, dy.t, x, e.signs[i], mean, variance, w, np, r.p.training)
	}
	if err != nil {
		return err
	}
	return finishAll(tx, tw, tb)
}

// concatBackward splits dy into the inputs' gradients.
func (e *Executor) concatBackward(r *run, nd *graph.Node, dy Tensor) error {
	ts := make([]target, len(nd.Inputs))
	dsts := make([]Tensor, len(nd.Inputs))
	for k := range nd.Inputs {
		t, err := e.inputTarget(r, nd, k, nil)
		if err != nil {
			return err
		}
		ts[k], dsts[k] = t, t.dst
	}
	if err := e.b.Split(dy, dsts...); err != nil {
		return err
	}
	return finishAll(ts...)
}

// groupBackward runs a DenseNet group's whole backward at its convolution's
// step: it rebuilds the concatenation and the normalised (and activated)
// output in the shared buffers, with the batch statistics the forward pass
// saved (no running update), then runs the convolution's, the activation's,
// the normalisation's and the concatenation's backward. None of these has
// readers outside the group, so their gradients are complete by then.
func (e *Executor) groupBackward(r *run, gr *group) error {
	b, p := e.b, r.p
	catN, abnN, convN := e.g.Nodes[gr.cat], e.g.Nodes[gr.abn], e.g.Nodes[gr.conv]
	catV, abnV := r.vals[gr.cat], r.vals[gr.abn]
	if err := b.Concat(catV, e.inputs(r, catN)...); err != nil {
		return fmt.Errorf("recomputing %s: %w", catN.Name, err)
	}
	if err := e.normalize(r, gr.abn, abnN, abnV, catV, false); err != nil {
		return fmt.Errorf("recomputing %s: %w", abnN.Name, err)
	}
	e.work.RecomputeFLOPs += p.flops[gr.cat].fwd + p.flops[gr.abn].fwd
	var actN *graph.Node
	if gr.act >= 0 {
		actN = e.g.Nodes[gr.act]
		if err := b.Activation(abnV, abnV, actOf(actN)); err != nil {
			return fmt.Errorf("recomputing %s: %w", actN.Name, err)
		}
		e.work.RecomputeFLOPs += p.flops[gr.act].fwd
	}
	dy := r.grads[gr.conv]
	tx, err := e.inputTarget(r, convN, 0, nil)
	if err != nil {
		return err
	}
	tw, err := e.paramTarget(r, convN, graph.RoleWeight)
	if err != nil {
		return err
	}
	tb, err := e.paramTarget(r, convN, graph.RoleBias)
	if err != nil {
		return err
	}
	w, err := e.weight(r, gr.conv, convN, false)
	if err != nil {
		return err
	}
	if err := b.Conv2dBackward(tx.dst, tw.dst, tb.dst, dy.t, abnV, w, convParams(convN)); err != nil {
		return err
	}
	if err := finishAll(tx, tw, tb); err != nil {
		return err
	}
	if actN != nil {
		// The activation ran in place: its backward works from its
		// output, and writes the BN output's gradient over its own.
		da := r.grads[gr.act]
		t, err := e.inputTarget(r, actN, 0, &da)
		if err != nil {
			return err
		}
		if err := b.ActivationBackward(t.dst, da.t, abnV, actOf(actN), true); err != nil {
			return fmt.Errorf("node %s: %w", actN.Name, err)
		}
		if err := t.finish(); err != nil {
			return err
		}
		e.dropGrad(r, gr.act)
		e.work.BackwardFLOPs += p.flops[gr.act].bwd
	}
	dz := r.grads[gr.abn]
	if err := e.normBackward(r, gr.abn, abnN, &dz, catV, abnV); err != nil {
		return fmt.Errorf("node %s: %w", abnN.Name, err)
	}
	e.dropGrad(r, gr.abn)
	if err := e.concatBackward(r, catN, r.grads[gr.cat].t); err != nil {
		return fmt.Errorf("node %s: %w", catN.Name, err)
	}
	e.dropGrad(r, gr.cat)
	e.work.BackwardFLOPs += p.flops[gr.abn].bwd + p.flops[gr.cat].bwd
	return nil
}
