package verify

import (
	"fmt"
	"math"
	"sort"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/half"
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

// Float32Values is Values rounded to float32, without a float64 copy of
// the tensors the overlay does not own.
func (o *overlay) Float32Values(key string) ([]float32, error) {
	if v, ok := o.own[key]; ok {
		return graph.Round32(v), nil
	}
	return graph.Float32Values(o.base, key)
}

// applyApproximations turns the original graph g (over w) into the
// reference the converted network must equal exactly: every activation the
// ReLU policy approximated becomes leaky_relu(slope), and every channel with
// |gamma| < eps gets InPlace-ABN's smallest scale, eps, with the sign the
// conversion gave it. It returns how many sites and channels it changed.
func applyApproximations(g *graph.Graph, w *overlay, rep *rewrite.Report, slope float64) (sites, channels int, err error) {
	for _, s := range rep.Sites {
		// Approximated for its activation (ReLU -> leaky_relu), not only
		// for tiny gammas (below).
		if s.Outcome == rewrite.OutcomeApproximated && s.ActivationNode != "" && s.Activation != s.OpActivation {
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

// applyStorageRounding gives the reference the BN scales the converted
// file can hold. At an InPlace-ABN site the conversion stores
// |gamma| - eps; in bfloat16 or float16 that rounds (back to |gamma| itself
// for every |gamma| above about eps/u: eps is less than half a unit there),
// so the layer's scale |weight| + eps is round(|gamma| - eps) + eps, off
// |gamma| by up to min(eps, u*|gamma|): as good as the format allows. The
// reference takes that scale (sign kept), computed from the original's
// gamma with the writers' rounding, so the comparison stays at float32
// precision (a wrong weight still fails) and the rounding's effect is
// drift, reported against the original. The storage is read from the
// values: a tensor whose every value, in the original and in the
// converted file, is a bfloat16 (or float16) one (the converted
// |gamma| - eps of a float32 checkpoint practically never all are). It
// returns how many channels it moved.
func applyStorageRounding(g *graph.Graph, w *overlay, rep *rewrite.Report, conv graph.Weights) (channels int, err error) {
	for _, s := range rep.Sites {
		if s.Op != graph.OpInPlaceABN && s.Op != graph.OpInPlaceABNSync {
			continue
		}
		bn := g.Node(s.Node)
		if bn == nil {
			return 0, fmt.Errorf("reference: %s: %w", s.Node, errNoNode)
		}
		key := bn.Params[graph.RoleWeight]
		if key == "" {
			continue
		}
		gamma, err := w.base.Values(key)
		if err != nil {
			return 0, err
		}
		stored, err := conv.Values(key)
		if err != nil {
			return 0, err
		}
		var round func(float64) float64
		switch {
		case holds(gamma, bf16) && holds(stored, bf16):
			round = bf16
		case holds(gamma, f16) && holds(stored, f16):
			round = f16
		default:
			continue
		}
		v, err := w.Values(key) // tiny-gamma channels already at ±eps
		if err != nil {
			return 0, err
		}
		tiny := map[int]bool{}
		for _, c := range s.TinyGammaChannels {
			tiny[c] = true
		}
		eps, moved := bn.Attr.Eps, 0
		for c, x := range gamma {
			if tiny[c] || c >= len(v) {
				continue
			}
			scale := round(math.Abs(x)-eps) + eps
			if x < 0 {
				scale = -scale
			}
			if scale != x {
				v[c] = scale
				moved++
			}
		}
		if moved > 0 {
			if err := w.SetValues(key, v); err != nil {
				return 0, err
			}
			channels += moved
		}
	}
	return channels, nil
}

func bf16(v float64) float64 { return half.BFloat16ToFloat(half.BFloat16(v)) }
func f16(v float64) float64  { return half.Float16ToFloat(half.Float16(v)) }

// holds reports whether every value of v is exactly one of round's format.
func holds(v []float64, round func(float64) float64) bool {
	for _, x := range v {
		if round(x) != x {
			return false
		}
	}
	return true
}
