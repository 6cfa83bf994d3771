package rewrite

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
)

// site is one BatchNorm2d being converted, with what the passes decided.
type site struct {
	bn  *graph.Node
	act *graph.Node // the activation fused into the site; nil for identity
	// kept is the activation after the BN that cannot be fused for its
	// parameter and stays as its own node (negativeParam).
	kept *graph.Node

	// The activation as found in the source network.
	srcAct   string
	srcParam float64
	// match explains why no activation was fused (identity sites).
	match string

	// The target, as chosen and then possibly demoted to ABN.
	op       graph.Op
	actName  string
	actParam float64
	approx   bool   // the activation changed (ReLU -> leaky_relu)
	forced   bool   // fell back to ABN because in place was impossible
	reason   string // why forced or approximated
	note     string // extra words, e.g. why channels were flipped, not folded
	actNote  string // how the source activation was read (slope 0 is a ReLU, a negative one kept apart)

	eps      float64
	negative []int // channels with gamma < 0 in the source
	folded   []int // channels whose sign was folded into a producer
	into     []string
	flipped  []int // channels flipped in place (Node.Sign)
	tiny     []int // channels with |gamma| < eps given scale eps (--tiny-gamma approx)
	tinyErr  float64
	// tinyExact: channels with |gamma| < eps that made the site fall back
	// to ABN (--tiny-gamma exact), which keeps them as stored.
	tinyExact []int

	// add-residual: the residual added in place and the Add fused away,
	// or why an identity InPlaceABN read by an Add was not fused.
	residual, residualAdd, residualWhy string
}

func (s *site) inPlace() bool { return s.op == graph.OpInPlaceABN || s.op == graph.OpInPlaceABNSync }

func (s *site) key(role string) string { return s.bn.Params[role] }

// fallBack demotes a site to ABN. ABN runs every activation, ReLU included,
// so a ReLU site that had been approximated by leaky_relu gets its exact ReLU
// back.
func (s *site) fallBack(reason string) {
	s.op = graph.OpABN
	s.actName, s.actParam = s.srcAct, s.srcParam
	s.approx = false
	s.forced = true
	s.reason = reason
}

// fusableActivation is match-bn-act's precondition: the BN's output must go
// to exactly one node, an activation, and nowhere else (not even the
// network output), or fusing would change what the other readers see.
func fusableActivation(g *graph.Graph, bn *graph.Node) (*graph.Node, string) {
	out := bn.Out
	if g.IsOutput(out) {
		return nil, "its output is the network output"
	}
	readers := uniqueNodes(out.Consumers)
	switch {
	case len(readers) == 0:
		return nil, "its output is not read"
	case len(readers) > 1:
		return nil, fmt.Sprintf("its output is read by %d nodes (%s)", len(readers), nodeNames(readers))
	}
	r := readers[0]
	info, _ := r.Op.Info()
	switch {
	case info.ABNAct != "":
		if len(out.Consumers) != 1 {
			return nil, fmt.Sprintf("%s reads its output twice", r.Name)
		}
		if negativeParam(r) {
			// InPlace-ABN cannot invert it, and ABN is no way out: the
			// real library's ABN applies its activation in place, and
			// torch refuses an in-place leaky_relu or elu backward with a
			// negative parameter ("In-place leakyReLu backward
			// calculation is triggered with a negative slope which is
			// not supported"). Out of place, after an identity BN, it is
			// exact.
			return nil, fmt.Sprintf("followed by %s %s with %s %g, which InPlace-ABN cannot invert and ABN cannot run (ABN applies its activation in place, and torch has no in-place backward for %s below 0): the BN takes the identity activation and %s stays after it, out of place, keeping the tensor an in-place BN keeps (exact; one tensor fewer kept for backward)",
				r.Op, r.Name, actParamName(r.Op), r.Attr.ActParam, actParamName(r.Op), r.Op)
		}
		return r, ""
	case info.Activation && info.Saves == graph.SaveOutput:
		// Not invertible (Sigmoid), and it keeps its own output: the in-place BN
		// saves nothing here, and costs nothing.
		return nil, fmt.Sprintf("followed by %s %s, which InPlace-ABN cannot invert: the BN takes the identity activation and %s stays after it, out of place (exact; %s keeps its own output, so the site keeps as many tensors as before)", r.Op, r.Name, r.Op, r.Op)
	}
	if r.Op.IsActivation() {
		// Not invertible, and it keeps its input (as PyTorch's autograd
		// does): in place, the BN keeps that same tensor, one fewer.
		return nil, fmt.Sprintf("followed by %s %s, which InPlace-ABN cannot invert: the BN takes the identity activation and %s stays after it, out of place, keeping the tensor an in-place BN keeps (exact; one tensor fewer kept for backward)", r.Op, r.Name, r.Op)
	}
	return nil, fmt.Sprintf("followed by %s %s, not an activation", r.Op, r.Name)
}

// matchBNAct records one site per BatchNorm2d, in graph order, with the
// activation it feeds, and checks the BN's parameters are usable.
func matchBNAct(st *State) error {
	for _, n := range st.g.Nodes {
		if n.Op != graph.OpBatchNorm {
			continue
		}
		if err := checkBNParams(st, n); err != nil {
			return err
		}
		s := &site{bn: n, eps: n.Attr.Eps, srcAct: graph.ActIdentity}
		act, why := fusableActivation(st.g, n)
		if act == nil {
			s.match = why
			if r := uniqueNodes(n.Out.Consumers); len(r) == 1 && negativeParam(r[0]) && !st.g.IsOutput(n.Out) {
				// Said in the table's reason column too: the source's
				// activation runs apart from the converted BN.
				s.kept, s.actNote = r[0], why
			}
		} else {
			s.act = act
			s.srcAct = abnAct(act.Op)
			if s.srcAct != graph.ActReLU {
				s.srcParam = act.Attr.ActParam
			}
			if s.srcAct != graph.ActReLU && s.srcParam == 0 {
				// max(0, x), in value and in gradient (PyTorch's
				// backward gives 0 at x = 0 for all three): a ReLU,
				// which InPlace-ABN cannot invert either, so the ReLU
				// policy decides, as for nn.ReLU.
				s.actNote = fmt.Sprintf("%s %s with %s 0 is a ReLU: it follows the ReLU policy", act.Op, act.Name, actParamName(act.Op))
				s.srcAct, s.srcParam = graph.ActReLU, 0
			}
		}
		gamma, err := st.t.vec(s.key(graph.RoleWeight))
		if err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
		for c, v := range gamma {
			if v < 0 {
				s.negative = append(s.negative, c)
			}
		}
		st.sites = append(st.sites, s)
		st.byNode[n] = s
	}
	return nil
}

// checkBNParams insists on an affine BN with running statistics: the
// converted layers need all four vectors, each with one entry per channel.
func checkBNParams(st *State, n *graph.Node) error {
	if n.Attr.Eps < 0 {
		return fmt.Errorf("node %s: negative eps %g", n.Name, n.Attr.Eps)
	}
	features := n.Attr.Features
	for _, role := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
		key, ok := n.Params[role]
		if !ok || key == "" {
			return fmt.Errorf("node %s: no %s parameter (BatchNorm2d without affine parameters or running statistics is not supported)", n.Name, role)
		}
		shape, ok := st.w.Shape(key)
		if !ok {
			return fmt.Errorf("node %s: parameter %q not in the checkpoint", n.Name, key)
		}
		if len(shape) != 1 {
			return fmt.Errorf("node %s: parameter %q has shape %v, want one dimension", n.Name, key, shape)
		}
		if features == 0 {
			features = shape[0]
		}
		if shape[0] != features {
			return fmt.Errorf("node %s: parameter %q has %d entries for %d features", n.Name, key, shape[0], features)
		}
	}
	// Validate checks sign vectors against Features, so it must be right.
	n.Attr.Features = features
	if n.Out.Channels == 0 {
		n.Out.Channels = features
	}
	return nil
}

// negativeParam reports a LeakyReLU or ELU whose parameter is negative (or
// NaN): one that neither InPlace-ABN nor ABN can take.
func negativeParam(r *graph.Node) bool {
	a := abnAct(r.Op)
	return (a == graph.ActLeakyReLU || a == graph.ActELU) && !(r.Attr.ActParam >= 0)
}

// abnAct is the ABN-family activation op fuses as (graph.OpInfo.ABNAct),
// "" when none.
func abnAct(op graph.Op) string {
	info, _ := op.Info()
	return info.ABNAct
}

// actParamName is what PyTorch calls a LeakyReLU's or an ELU's parameter.
func actParamName(op graph.Op) string {
	if op == graph.OpELU {
		return "alpha"
	}
	return "negative_slope"
}

func uniqueNodes(list []*graph.Node) []*graph.Node {
	var out []*graph.Node
	for _, n := range list {
		dup := false
		for _, m := range out {
			if m == n {
				dup = true
				break
			}
		}
		if !dup {
			out = append(out, n)
		}
	}
	return out
}

func nodeNames(list []*graph.Node) string {
	names := make([]string, len(list))
	for i, n := range list {
		names[i] = n.Name
	}
	return strings.Join(names, ", ")
}
