package rewrite

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// A channel's sign can be moved through ops that commute with negation
// channel by channel: concatenation along channels (which only renumbers
// channels) and average pooling (linear). Max pooling does not commute with
// negation, and everything else either mixes channels or is not linear.

// concatAlongChannels reports whether a Concat joins along dimension 1, the
// only concatenation that maps channels to channels.
func concatAlongChannels(n *graph.Node) bool {
	return n.Op == graph.OpConcat && (n.Attr.Axis == 1 || n.Attr.Axis == -3)
}

// channels is v's channel count, from the graph's annotation or, failing
// that, from its producer.
func channels(v *graph.Value) int {
	for depth := 0; v != nil && depth < 1000; depth++ {
		if v.Channels != 0 {
			return v.Channels
		}
		p := v.Producer
		switch p.Op {
		case graph.OpConv, graph.OpLinear:
			return p.Attr.OutChannels
		case graph.OpBatchNorm, graph.OpABN, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
			return p.Attr.Features
		case graph.OpConcat:
			sum := 0
			for _, in := range p.Inputs {
				c := channels(in)
				if c == 0 {
					return 0
				}
				sum += c
			}
			return sum
		case graph.OpReLU, graph.OpLeakyReLU, graph.OpELU, graph.OpMaxPool, graph.OpAvgPool,
			graph.OpAdaptiveAvgPool, graph.OpDropout, graph.OpStochasticDepth, graph.OpAdd:
			v = p.Inputs[0]
		case graph.OpHardtanh, graph.OpSigmoid, graph.OpSiLU, graph.OpHardsigmoid, graph.OpHardswish, graph.OpGELU:
			// Elementwise: the channels of their input.
			v = p.Inputs[0]
		default:
			return 0
		}
	}
	return 0
}

// traceSource follows channel c of v back to the linear producer that
// computes it, if there is one.
func traceSource(v *graph.Value, c int) (*graph.Node, int, string) {
	for {
		p := v.Producer
		switch {
		case p.Op == graph.OpConv || p.Op == graph.OpLinear:
			return p, c, ""
		case concatAlongChannels(p):
			off, found := 0, false
			for _, in := range p.Inputs {
				n := channels(in)
				if n == 0 {
					return nil, 0, fmt.Sprintf("the channel count of %s, an input of %s, is unknown", in.Name, p.Name)
				}
				if c < off+n {
					v, c, found = in, c-off, true
					break
				}
				off += n
			}
			if !found {
				return nil, 0, fmt.Sprintf("channel %d is beyond the %d channels of %s", c, off, p.Name)
			}
		case p.Op == graph.OpAvgPool || p.Op == graph.OpAdaptiveAvgPool:
			v = p.Inputs[0]
		case p.Op == graph.OpMaxPool:
			return nil, 0, fmt.Sprintf("it comes from MaxPool2d %s, which is not sign-symmetric", p.Name)
		default:
			return nil, 0, fmt.Sprintf("it comes from %s %s, which has no weights to take the sign", p.Op, p.Name)
		}
	}
}

// hit is a site's channel that a producer's output channel reaches.
type hit struct {
	s *site
	c int
}

// foldReach follows output channel pc of producer p forward to every reader.
// Negating that channel is only invisible if every reader is a BN site,
// which takes the sign back through its gamma and running mean; it returns
// those sites' channels, or why the fold is impossible.
func foldReach(st *State, p *graph.Node, pc int) ([]hit, string) {
	type vc struct {
		v *graph.Value
		c int
	}
	var hits []hit
	seen := map[vc]bool{}
	var walk func(v *graph.Value, c int) string
	walk = func(v *graph.Value, c int) string {
		if seen[vc{v, c}] {
			return ""
		}
		seen[vc{v, c}] = true
		if v == st.g.Output {
			return fmt.Sprintf("channel %d of %s reaches the network output", c, v.Name)
		}
		for _, r := range uniqueNodes(v.Consumers) {
			switch {
			case st.byNode[r] != nil:
				hits = append(hits, hit{st.byNode[r], c})
			case concatAlongChannels(r):
				off := 0
				for _, in := range r.Inputs {
					n := channels(in)
					if n == 0 {
						return fmt.Sprintf("the channel count of %s, an input of %s, is unknown", in.Name, r.Name)
					}
					if in == v {
						if why := walk(r.Out, off+c); why != "" {
							return why
						}
					}
					off += n
				}
			case r.Op == graph.OpAvgPool || r.Op == graph.OpAdaptiveAvgPool:
				if why := walk(r.Out, c); why != "" {
					return why
				}
			default:
				return fmt.Sprintf("channel %d of %s is also read by %s %s, which would see it negated", c, v.Name, r.Op, r.Name)
			}
		}
		return ""
	}
	if why := walk(p.Out, pc); why != "" {
		return nil, why
	}
	return hits, ""
}

// foldBlocker is fold-signs' precondition for one producer channel: the
// producer must own its weights, every reader must be a site, and every
// in-place reader must have a negative (or zero) gamma there, because after
// the fold it sees |gamma| and nothing else.
func foldBlocker(st *State, p *graph.Node, pc int, keyUsers map[string]int) ([]hit, string) {
	wkey := p.Params[graph.RoleWeight]
	if wkey == "" {
		return nil, fmt.Sprintf("%s %s has no weight parameter", p.Op, p.Name)
	}
	for _, role := range []string{graph.RoleWeight, graph.RoleBias} {
		key := p.Params[role]
		if key == "" {
			continue
		}
		shape, ok := st.w.Shape(key)
		if !ok || len(shape) == 0 || pc >= shape[0] {
			return nil, fmt.Sprintf("%s %s: parameter %q has no output channel %d", p.Op, p.Name, key, pc)
		}
		if keyUsers[key] > 1 {
			return nil, fmt.Sprintf("%s %s shares parameter %q with another node", p.Op, p.Name, key)
		}
	}
	hits, why := foldReach(st, p, pc)
	if why != "" {
		return nil, why
	}
	for _, h := range hits {
		gamma, err := st.t.vec(h.s.key(graph.RoleWeight))
		if err != nil || h.c >= len(gamma) {
			// The graph's channel counts disagree with the parameters:
			// leave the channel alone rather than negate the wrong one.
			return nil, fmt.Sprintf("channel %d of %s maps to channel %d of %s, which it does not have", pc, p.Name, h.c, h.s.bn.Name)
		}
		if h.s.inPlace() && gamma[h.c] > 0 {
			return nil, fmt.Sprintf("channel %d of %s also feeds channel %d of %s, whose gamma %.4g is positive", pc, p.Name, h.c, h.s.bn.Name, gamma[h.c])
		}
	}
	return hits, ""
}

// foldSigns makes negative gammas of in-place sites positive by negating the
// producing channel: weight[pc, ...] and bias[pc] of the convolution, and
// gamma and running_mean at every site that reads the channel, so that
// (-x - (-mu)) / sigma * (-gamma) + beta is what the BN computed before.
func foldSigns(st *State) error {
	keyUsers := map[string]int{}
	for _, n := range st.g.Nodes {
		for _, k := range n.Params {
			keyUsers[k]++
		}
	}
	type src struct {
		p  *graph.Node
		pc int
	}
	blocked := map[src]string{}
	for _, s := range st.sites {
		if !s.inPlace() {
			continue
		}
		gamma, err := st.t.vec(s.key(graph.RoleWeight))
		if err != nil {
			return fmt.Errorf("node %s: %w", s.bn.Name, err)
		}
		// gamma is the cached vector: folds below update it as they go.
		for c := range gamma {
			if !(gamma[c] < 0) {
				continue
			}
			p, pc, why := traceSource(s.bn.Inputs[0], c)
			if p == nil {
				s.block(c, why)
				continue
			}
			if why, done := blocked[src{p, pc}]; done {
				s.block(c, why)
				continue
			}
			hits, why := foldBlocker(st, p, pc, keyUsers)
			if why != "" {
				blocked[src{p, pc}] = why
				s.block(c, why)
				continue
			}
			if err := fold(st, p, pc, hits); err != nil {
				return err
			}
		}
	}
	return nil
}

// fold is fold-signs' action.
func fold(st *State, p *graph.Node, pc int, hits []hit) error {
	for _, role := range []string{graph.RoleWeight, graph.RoleBias} {
		if key := p.Params[role]; key != "" {
			st.t.negateSlice(key, pc)
		}
	}
	for _, h := range hits {
		for _, role := range []string{graph.RoleWeight, graph.RoleRunningMean} {
			if err := st.t.negateVec(h.s.key(role), h.c); err != nil {
				return fmt.Errorf("node %s: %w", h.s.bn.Name, err)
			}
		}
		h.s.folded = append(h.s.folded, h.c)
		if !contains(h.s.into, p.Name) {
			h.s.into = append(h.s.into, p.Name)
		}
	}
	return nil
}

// block remembers why channel c could not be folded, for the report.
func (s *site) block(c int, why string) {
	if s.note == "" {
		s.note = fmt.Sprintf("channel %d not folded: %s", c, why)
	}
}

// flipSigns takes the negative channels folding left. InPlace-ABN overwrites
// its input anyway, so multiplying that input by a +1/-1 vector in place
// first costs no memory and keeps the layer exact, with gamma and
// running_mean negated on those channels. The input must be private to the
// site, which is the in-place precondition again; where it is not, the site
// falls back to ABN.
func flipSigns(st *State) error {
	for _, s := range st.sites {
		if !s.inPlace() {
			continue
		}
		gamma, err := st.t.vec(s.key(graph.RoleWeight))
		if err != nil {
			return fmt.Errorf("node %s: %w", s.bn.Name, err)
		}
		var neg []int
		for c, v := range gamma {
			if v < 0 {
				neg = append(neg, c)
			}
		}
		if len(neg) == 0 {
			continue
		}
		if why := inPlaceBlocker(st.g, s.bn); why != "" {
			s.fallBack(fmt.Sprintf("channels %v have negative gamma that could not be folded (%s), and the input cannot be flipped in place: %s", neg, s.note, why))
			continue
		}
		if err := flip(st, s, neg); err != nil {
			return err
		}
	}
	return nil
}

// flip is flip-signs' action: record the sign vector on the node and negate
// gamma and running_mean on the flipped channels.
func flip(st *State, s *site, neg []int) error {
	sign := s.bn.Sign
	if sign == nil {
		sign = make([]int8, s.bn.Attr.Features)
		for i := range sign {
			sign[i] = 1
		}
	}
	for _, c := range neg {
		sign[c] = -sign[c]
		for _, role := range []string{graph.RoleWeight, graph.RoleRunningMean} {
			if err := st.t.negateVec(s.key(role), c); err != nil {
				return fmt.Errorf("node %s: %w", s.bn.Name, err)
			}
		}
	}
	s.bn.Sign = sign
	s.flipped = neg
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
