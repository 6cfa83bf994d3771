package rewrite

import (
	"fmt"
	"math"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
)

// chooseOp picks each site's target op and activation. InPlace-ABN recovers
// its input from its output in the backward pass, so its activation must be
// invertible: leaky_relu with a positive slope, elu with a positive alpha, or
// identity; match-bn-act fuses no other leaky_relu or elu (a parameter of 0
// is read as a ReLU, a negative one stays out of place). ReLU follows the
// ReLU policy.
func chooseOp(st *State) error {
	inPlace := graph.OpInPlaceABN
	if st.opt.Sync {
		inPlace = graph.OpInPlaceABNSync
	}
	for _, s := range st.sites {
		s.op, s.actName, s.actParam = inPlace, s.srcAct, s.srcParam
		if s.srcAct != graph.ActReLU {
			continue
		}
		switch st.opt.ReLU {
		case ReLUError:
			what := s.act.Name
			if s.actNote != "" {
				what = s.actNote // names the node too
			}
			return fmt.Errorf("node %s: BatchNorm2d + ReLU (%s) has no exact in-place form (ReLU policy %q; use %q for leaky_relu(%g) or %q for an exact ABN)",
				s.bn.Name, what, ReLUError, ReLULeaky, st.opt.Slope, ReLUABN)
		case ReLUABN:
			s.op, s.actParam = graph.OpABN, 0
		default:
			s.actName, s.actParam = graph.ActLeakyReLU, st.opt.Slope
			s.approx = true
			s.reason = fmt.Sprintf("ReLU replaced by leaky_relu(%g) so that the layer can run in place: outputs change where the pre-activation is negative", st.opt.Slope)
		}
	}
	return nil
}

// inPlaceBlocker is the in-place precondition: InPlace-ABN overwrites its
// input, so nobody else may read that value, now or in the backward pass.
// It returns "" when the site may run in place.
func inPlaceBlocker(g *graph.Graph, bn *graph.Node) string {
	in := bn.Inputs[0]
	p := in.Producer
	if in == g.Input || p.Op == graph.OpInput {
		return "its input is the network input, which belongs to the caller"
	}
	if g.IsOutput(in) {
		return fmt.Sprintf("its input %s is also the network output", in.Name)
	}
	if readers := uniqueNodes(in.Consumers); len(readers) > 1 {
		var others []*graph.Node
		for _, r := range readers {
			if r != bn {
				others = append(others, r)
			}
		}
		return fmt.Sprintf("its input %s is also read by %s", in.Name, nodeNames(others))
	}
	if info, _ := p.Op.Info(); !info.Overwritable {
		return fmt.Sprintf("its input comes from %s %s, whose output may not be overwritten (it is kept for backward or is a view)", p.Op, p.Name)
	}
	return ""
}

// checkInPlace demotes in-place sites whose input may not be overwritten.
func checkInPlace(st *State) error {
	for _, s := range st.sites {
		if !s.inPlace() {
			continue
		}
		if why := inPlaceBlocker(st.g, s.bn); why != "" {
			s.fallBack("cannot run in place: " + why)
		}
	}
	return nil
}

// checkTinyGamma demotes to ABN the in-place sites with a channel whose
// |gamma| < eps, under --tiny-gamma exact. InPlace-ABN scales by
// |weight| + eps, never less than eps, so such a channel has no exact
// in-place form; the old answer, scale eps (reparametrise, under approx),
// moves eval outputs little but a training step much more (a smp Unet
// with 1% of its gammas at 1e-7: 0.12 of the input gradient). ABN uses
// the weight as stored, negative gammas included, so the site also needs
// no sign moved: this runs before fold-signs. It looks at |gamma| as read,
// which no earlier pass changes.
func checkTinyGamma(st *State) error {
	if st.opt.TinyGamma != TinyGammaExact {
		return nil
	}
	for _, s := range st.sites {
		if !s.inPlace() {
			continue
		}
		gamma, err := st.t.vec(s.key(graph.RoleWeight))
		if err != nil {
			return fmt.Errorf("node %s: %w", s.bn.Name, err)
		}
		var tiny []int
		for c, v := range gamma {
			if math.Abs(v) < s.eps {
				tiny = append(tiny, c)
			}
		}
		if len(tiny) == 0 {
			continue
		}
		s.fallBack(fmt.Sprintf("%s with |gamma| < eps=%g, which InPlace-ABN cannot represent (its scale is |weight| + eps): ABN keeps them exact, out of place (--tiny-gamma %s keeps the site in place with scale eps there, approximately)",
			channelList(tiny, len(gamma)), s.eps, TinyGammaApprox))
		s.tinyExact = tiny
	}
	return nil
}

// channelList names channels for a reason: all of them up to ten, else
// the first ten and the count (the report's channel lists hold them all).
func channelList(chans []int, of int) string {
	const most = 10
	if len(chans) == 1 {
		return fmt.Sprintf("channel %d", chans[0])
	}
	if len(chans) <= most {
		return fmt.Sprintf("channels %v", chans)
	}
	s := strings.Trim(fmt.Sprint(chans[:most]), "[]")
	return fmt.Sprintf("%d of %d channels ([%s ...])", len(chans), of, s)
}
