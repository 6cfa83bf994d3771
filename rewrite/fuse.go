package rewrite

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
)

// reparametrise stores weight = |gamma| - eps at in-place sites, so that the
// layer's |weight| + eps is |gamma| again. Gammas smaller than eps cannot be
// represented: under --tiny-gamma exact check-tiny-gamma has made their
// sites ABN; under approx they get weight 0 (scale eps), a warning, and
// the site is approximated. ABN sites keep the weight as stored.
func reparametrise(st *State) error {
	for _, s := range st.sites {
		if !s.inPlace() {
			continue
		}
		key := s.key(graph.RoleWeight)
		gamma, err := st.t.vec(key)
		if err != nil {
			return fmt.Errorf("node %s: %w", s.bn.Name, err)
		}
		for c, v := range gamma {
			if v < 0 {
				// fold-signs and flip-signs leave no negative gamma at an
				// in-place site; one here is a bug in those passes.
				return fmt.Errorf("node %s: channel %d of %q still has negative gamma %g", s.bn.Name, c, key, v)
			}
			if v < s.eps {
				s.tiny = append(s.tiny, c)
				if e := s.eps - v; e > s.tinyErr {
					s.tinyErr = e
				}
				gamma[c] = 0
				continue
			}
			gamma[c] = v - s.eps
		}
		if len(s.tiny) > 0 {
			st.warn = append(st.warn, fmt.Sprintf("%s: %d channel(s) %v with |gamma| < eps=%g stored as weight 0 (scale eps), approximated (--tiny-gamma %s): scale off by up to %.3g",
				s.bn.Name, len(s.tiny), s.tiny, s.eps, TinyGammaApprox, s.tinyErr))
			tiny := fmt.Sprintf("%s with |gamma| < eps=%g given scale eps (--tiny-gamma %s): outputs change, a training step more", channelList(s.tiny, len(gamma)), s.eps, TinyGammaApprox)
			if s.reason != "" {
				tiny = s.reason + "; " + tiny
			}
			s.reason = tiny
		}
	}
	return nil
}

// fuse turns each BN node into its site's ABN-family node (same name, same
// parameters) and removes the activation node, whose readers now read the
// fused node.
func fuse(st *State) error {
	for _, s := range st.sites {
		n := s.bn
		a := n.Attr
		n.Op = s.op
		n.Attr = graph.Attr{
			Features: a.Features, Eps: a.Eps, Momentum: a.Momentum, MomentumNone: a.MomentumNone,
			Activation: s.actName, ActParam: s.actParam,
		}
		if s.act != nil {
			st.g.ReplaceUses(s.act.Out, n.Out)
			st.g.Remove(s.act)
		}
	}
	return nil
}

// denseGroup is mark-dense's precondition: a Concat read only by an
// ABN-family node that is read only by a 1x1 convolution, the shape of a
// DenseNet layer (and transition) whose concatenation and normalised output
// can live in shared buffers and be recomputed for backward.
func denseGroup(g *graph.Graph, cat *graph.Node) (abn, conv *graph.Node, why string) {
	if g.IsOutput(cat.Out) {
		return nil, nil, "its output is the network output"
	}
	readers := uniqueNodes(cat.Out.Consumers)
	if len(readers) != 1 {
		return nil, nil, fmt.Sprintf("its output is read by %d nodes", len(readers))
	}
	abn = readers[0]
	if !abn.Op.IsBNFamily() || abn.Op == graph.OpBatchNorm {
		return nil, nil, fmt.Sprintf("read by %s %s, not an ABN-family node", abn.Op, abn.Name)
	}
	if g.IsOutput(abn.Out) {
		return nil, nil, fmt.Sprintf("%s is the network output", abn.Name)
	}
	readers = uniqueNodes(abn.Out.Consumers)
	if len(readers) != 1 {
		return nil, nil, fmt.Sprintf("%s is read by %d nodes", abn.Name, len(readers))
	}
	conv = readers[0]
	if conv.Op != graph.OpConv || conv.Attr.KernelSize != [2]int{1, 1} {
		return nil, nil, fmt.Sprintf("%s is read by %s %s, not a 1x1 convolution", abn.Name, conv.Op, conv.Name)
	}
	return abn, conv, ""
}

// markDense sets Recompute on each dense group's three nodes, naming the
// group after the layer's module path (the ABN's name minus its last
// component).
func markDense(st *State) error {
	for _, n := range st.g.Nodes {
		if n.Op != graph.OpConcat {
			continue
		}
		abn, conv, why := denseGroup(st.g, n)
		if why != "" {
			continue
		}
		group := abn.Name
		if i := strings.LastIndexByte(group, '.'); i > 0 {
			group = group[:i]
		}
		n.Recompute, abn.Recompute, conv.Recompute = group, group, group
		st.dense = append(st.dense, group)
	}
	return nil
}
