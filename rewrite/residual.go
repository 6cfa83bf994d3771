package rewrite

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// addResidual fuses a residual addition into the InPlaceABN(identity) that
// ends the block: y = IABN(x); z = y + r becomes one node computing z over
// x. Unfused, the block keeps y (InPlace-ABN inverts from its output) and
// the next layer keeps z: two tensors. Fused, it keeps z alone and recovers
// y = z - r in backward, from the residual r that the block's first layer
// keeps anyway. That is the form that reaches the saving the note measured
// with the real library on MobileNetV3 (whose own `result += input` gets it
// only by overwriting what InPlace-ABN saved, which fails at backward).
//
// A site is fused only where that saves a tensor: r and z must each be read
// by a node that keeps its input for backward. InPlaceABNSync sites are left
// alone (the fused form has no cross-process statistics).
func addResidual(st *State) error {
	index := make(map[*graph.Node]int, len(st.g.Nodes))
	for i, n := range st.g.Nodes {
		index[n] = i
	}
	for _, s := range st.sites {
		add, r, why := residualAdd(st.g, s, index)
		if add == nil {
			s.residualWhy = why
			continue
		}
		n := s.bn
		st.g.ReplaceUses(add.Out, n.Out)
		st.g.Remove(add)
		n.Inputs = append(n.Inputs, r)
		r.Consumers = append(r.Consumers, n)
		s.residual, s.residualAdd = r.Name, add.Name
	}
	return nil
}

// residualAdd is add-residual's precondition for site s: the Add it fuses
// and the residual, or why there is none.
func residualAdd(g *graph.Graph, s *site, index map[*graph.Node]int) (add *graph.Node, r *graph.Value, why string) {
	n := s.bn
	switch {
	case n.Op != graph.OpInPlaceABN || s.actName != graph.ActIdentity:
		return nil, nil, ""
	case n.Recompute != "":
		return nil, nil, "recomputed with its dense layer"
	case g.IsOutput(n.Out):
		return nil, nil, "its output is a network output"
	}
	readers := uniqueNodes(n.Out.Consumers)
	if len(readers) != 1 || readers[0].Op != graph.OpAdd || len(readers[0].Inputs) != 2 || len(n.Out.Consumers) != 1 {
		return nil, nil, ""
	}
	add = readers[0]
	r = add.Inputs[0]
	if r == n.Out {
		r = add.Inputs[1]
	}
	switch {
	case r == n.Out:
		return nil, nil, "adds its output to itself"
	case g.IsOutput(add.Out):
		return nil, nil, fmt.Sprintf("the sum %s is a network output", add.Name)
	case !keptByAnother(add.Out, nil):
		return nil, nil, fmt.Sprintf("no reader keeps the sum %s for backward: fusing it would save nothing", add.Name)
	case r.Producer == nil || index[r.Producer] > index[n]:
		// The fused node would read r before it is computed.
		return nil, nil, fmt.Sprintf("the residual %s is computed after it", r.Name)
	case r.Channels != 0 && n.Out.Channels != 0 && r.Channels != n.Out.Channels:
		return nil, nil, fmt.Sprintf("the residual %s has %d channels, it %d (a broadcast)", r.Name, r.Channels, n.Out.Channels)
	case !keptByAnother(r, add):
		return nil, nil, fmt.Sprintf("no other reader keeps the residual %s for backward: fusing %s would save nothing", r.Name, add.Name)
	}
	return add, r, ""
}

// keptByAnother says whether a reader of v other than except keeps v for its
// backward pass in PyTorch's autograd whatever the policy (a convolution or
// linear layer its input, a pooling or a non-invertible activation too),
// so that keeping it once more costs nothing.
func keptByAnother(v *graph.Value, except *graph.Node) bool {
	for _, c := range v.Consumers {
		if c == except {
			continue
		}
		if info, _ := c.Op.Info(); info.Saves.KeepsInput() {
			return true
		}
	}
	return false
}
