package verify

import (
	"fmt"
	"sort"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
)

// overlay is a graph.Weights that reads through to a base store and keeps
// its own replacements in memory: the reference's adjusted tensors never
// reach the original file.
type overlay struct {
	base graph.Weights
	own  map[string][]float64
}

func newOverlay(base graph.Weights) *overlay {
	return &overlay{base: base, own: map[string][]float64{}}
}

func (o *overlay) Keys() []string                 { return o.base.Keys() }
func (o *overlay) Shape(key string) ([]int, bool) { return o.base.Shape(key) }
func (o *overlay) SetValues(k string, v []float64) error {
	s, ok := o.base.Shape(k)
	if !ok {
		return fmt.Errorf("no tensor %q", k)
	}
	if graph.Numel(s) != len(v) {
		return fmt.Errorf("tensor %q has %d elements, got %d values", k, graph.Numel(s), len(v))
	}
	o.own[k] = append([]float64(nil), v...)
	return nil
}

func (o *overlay) Values(key string) ([]float64, error) {
	if v, ok := o.own[key]; ok {
		return append([]float64(nil), v...), nil
	}
	return o.base.Values(key)
}

// applyApproximations turns the original graph g (over w) into the
// reference the converted network must equal exactly: every activation the
// ReLU policy approximated becomes leaky_relu(slope), and every channel with
// |gamma| < eps gets InPlace-ABN's smallest scale, eps, with the sign the
// conversion gave it. It returns how many sites and channels it changed.
func applyApproximations(g *graph.Graph, w *overlay, rep *rewrite.Report, slope float64) (sites, channels int, err error) {
	for _, s := range rep.Sites {
		if s.Outcome == rewrite.OutcomeApproximated && s.ActivationNode != "" {
			n := g.Node(s.ActivationNode)
			if n == nil {
				return 0, 0, fmt.Errorf("reference: %s: %w", s.ActivationNode, errNoNode)
			}
			n.Op = graph.OpLeakyReLU
			n.Attr.ActParam = s.OpActivationParam
			if n.Attr.ActParam == 0 {
				n.Attr.ActParam = slope
			}
			sites++
		}
		if len(s.TinyGammaChannels) == 0 {
			continue
		}
		bn := g.Node(s.Node)
		if bn == nil {
			return 0, 0, fmt.Errorf("reference: %s: %w", s.Node, errNoNode)
		}
		key := bn.Params[graph.RoleWeight]
		v, err := w.Values(key)
		if err != nil {
			return 0, 0, err
		}
		neg := map[int]bool{}
		for _, c := range s.FoldedChannels {
			neg[c] = true
		}
		for _, c := range s.FlippedChannels {
			neg[c] = true
		}
		eps := bn.Attr.Eps
		for _, c := range s.TinyGammaChannels {
			v[c] = eps
			if neg[c] {
				v[c] = -eps
			}
			channels++
		}
		if err := w.SetValues(key, v); err != nil {
			return 0, 0, err
		}
	}
	return sites, channels, nil
}

func sortStrings(s []string) { sort.Strings(s) }
