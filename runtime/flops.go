package runtime

import "github.com/abnconvert/abnconvert/graph"

// WorkReport counts the arithmetic of the last training step, op by op as
// the executor ran it, with per-op counts taken from the graph:
//
//   - Conv2d and Linear: 2 FLOPs per multiply-add (N·Cout·Hout·Wout·Cin/groups·kh·kw,
//     or N·in·out), plus one per output element for a bias; their backward
//     twice that (input and weight gradients), plus the bias gradient.
//   - Every other op counts its output's element count, forward and backward
//     alike: BN family, activations, Add, Concat, pools, Dropout. A fused
//     activation (ABN, InPlace-ABN) counts its elements again, so that fusing
//     changes no totals and rows compare. Flatten and the input count 0.
//
// These are not a cycle-accurate model: elementwise ops are memory-bound,
// so their share of the time exceeds their share of FLOPs. They say how
// much arithmetic a memory technique repeats, against the same yardstick
// for every technique.
type WorkReport struct {
	// ForwardFLOPs and BackwardFLOPs are the training step's own work.
	ForwardFLOPs  int64 `json:"forward_flops"`
	BackwardFLOPs int64 `json:"backward_flops"`
	// RecomputeFLOPs is the work done again to save memory: checkpoint
	// segments' forwards rerun in the backward pass, DenseNet shared
	// buffers refilled (Concat and BN), and InPlace-ABN's inversion of its
	// output (one pass over its elements) in its backward.
	RecomputeFLOPs int64 `json:"recompute_flops"`
}

// Extra is the recomputed work as a fraction of the step's forward and
// backward work.
func (w WorkReport) Extra() float64 {
	if t := w.ForwardFLOPs + w.BackwardFLOPs; t > 0 {
		return float64(w.RecomputeFLOPs) / float64(t)
	}
	return 0
}

type nodeFlops struct{ fwd, bwd int64 }

// flopsOf counts one node's forward and backward work (see WorkReport).
func flopsOf(nd *graph.Node, ins [][]int, out []int, training bool) nodeFlops {
	elems := int64(numel(out))
	a := normAttr(nd)
	switch nd.Op {
	case graph.OpInput, graph.OpFlatten:
		return nodeFlops{}
	case graph.OpConv:
		if len(ins) != 1 || len(ins[0]) != 4 || len(out) != 4 {
			return nodeFlops{}
		}
		macs := elems * int64(ins[0][1]/max(a.Groups, 1)) * int64(a.KernelSize[0]*a.KernelSize[1])
		f := nodeFlops{fwd: 2 * macs, bwd: 4 * macs}
		if a.Bias {
			f.fwd += elems
			f.bwd += elems
		}
		return f
	case graph.OpLinear:
		if len(ins) != 1 || len(ins[0]) != 2 {
			return nodeFlops{}
		}
		macs := elems * int64(ins[0][1])
		f := nodeFlops{fwd: 2 * macs, bwd: 4 * macs}
		if a.Bias {
			f.fwd += elems
			f.bwd += elems
		}
		return f
	case graph.OpABN, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
		// The residual's addition, and its subtraction to recover the
		// normalised output in backward.
		if actOf(nd).Kind != ActIdentity || nd.Residual() != nil {
			return nodeFlops{fwd: 2 * elems, bwd: 2 * elems}
		}
	case graph.OpDropout:
		if !training {
			return nodeFlops{}
		}
	case graph.OpStochasticDepth:
		if !stochasticDepthActive(nd, training) {
			return nodeFlops{}
		}
	}
	return nodeFlops{fwd: elems, bwd: elems}
}
