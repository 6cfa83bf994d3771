package runtime

import (
	"github.com/abnconvert/abnconvert/graph"
)

// StochasticDepth (torchvision.ops.stochastic_depth) drops a whole
// residual branch per sample in row mode, for the whole batch in batch
// mode: in training it multiplies its input by noise of shape (N, 1, ...,
// 1), or (1, ..., 1) in batch mode, each entry 0 with probability p and
// 1/(1-p) otherwise, drawn like Dropout's mask (DropoutSeed of the node's
// name and the step) so that runs are reproducible; PyTorch keeps that
// noise, and only it, for the backward (the product's other operand needs
// no gradient). In eval, and at p = 0 where torchvision returns its input,
// it is the identity, a view of its input.

// stochasticDepthActive says whether nd draws noise: in training with p > 0.
func stochasticDepthActive(nd *graph.Node, training bool) bool {
	return training && nd.Attr.P > 0
}

// stochasticDepthNoise is nd's noise shape for an input of shape x: the
// batch dimension (row mode) or 1 (batch mode), ones elsewhere.
func stochasticDepthNoise(nd *graph.Node, x []int) []int {
	out := make([]int, len(x))
	for i := range out {
		out[i] = 1
	}
	if len(x) > 0 && nd.Attr.Mode != graph.StochasticBatch {
		out[0] = x[0]
	}
	return out
}

func (e *Executor) stochasticDepth(r *run, i int, nd *graph.Node, y Tensor) error {
	if !stochasticDepthActive(nd, r.p.training) {
		return nil
	}
	noise := e.aux(r, i, 0)
	if err := e.b.DropoutMask(noise, nd.Attr.P, DropoutSeed(e.opt.Seed, nd.Name, r.step)); err != nil {
		return err
	}
	bb, err := e.broadcasting()
	if err != nil {
		return err
	}
	return bb.Binary(y, e.in(r, nd, 0), noise, BinaryMul)
}

// stochasticDepthBackward: dx = dy * noise, written over dy where the
// gradient buffer can be reused; the identity passes dy on.
func (e *Executor) stochasticDepthBackward(r *run, i int, nd *graph.Node, p *plan, dy gref) error {
	tx, err := e.inputTarget(r, nd, 0, &dy)
	if err != nil {
		return err
	}
	if stochasticDepthActive(nd, p.training) {
		bb, err := e.broadcasting()
		if err != nil {
			return err
		}
		err = bb.Binary(tx.dst, dy.t, e.aux(r, i, 0), BinaryMul)
		if err != nil {
			return err
		}
	} else if !tx.shared {
		if err := e.b.Copy(tx.dst, dy.t); err != nil {
			return err
		}
	}
	return tx.finish()
}
