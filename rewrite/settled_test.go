package rewrite

import (
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// negationRecorder is weights that negate stored channels themselves
// (graph.ChannelNegater, as a checkpoint does), recording whether any
// negation came after SignsSettled.
type negationRecorder struct {
	*graph.MemWeights
	settled, late, calls int
	// setsAfter counts the values written after SignsSettled: the
	// vectors fold-signs changed are written after it, not waited for.
	setsAfter int
}

func (w *negationRecorder) SetValues(key string, v []float64) error {
	if w.settled > 0 {
		w.setsAfter++
	}
	return w.MemWeights.SetValues(key, v)
}

func (w *negationRecorder) NegateChannels(key string, channels []int) (bool, error) {
	w.calls++
	if w.settled > 0 {
		w.late++
	}
	v, err := w.Values(key)
	if err != nil {
		return false, err
	}
	shape, _ := w.Shape(key)
	stride := len(v) / shape[0]
	changed := false
	for _, c := range channels {
		for j := c * stride; j < (c+1)*stride; j++ {
			changed = changed || v[j] != 0
			v[j] = -v[j]
		}
	}
	return changed, w.SetValues(key, v)
}

// TestSignsSettled: SignsSettled is called once, no stored channel is
// negated after it and the vectors fold-signs changed are written after
// it, on networks whose negative gammas are folded into plain producers,
// into a DenseNet's concatenations and flipped on private inputs; and the
// conversion is the one made without the hook.
func TestSignsSettled(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build func() *net
	}{
		{"conv-bn-leaky", func() *net { return convBNAct(graph.OpLeakyReLU, 0.2) }},
		{"conv-bn-relu", func() *net { return convBNAct(graph.OpReLU, 0) }},
		{"densenet121", func() *net { return densenet121(3) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.build()
			w := &negationRecorder{MemWeights: b.w}
			foldSets := 0 // the values fold-signs wrote after the hook
			_, err := run(b.g, w, Options{SignsSettled: func() error { w.settled++; return nil }}, func(p Pass, _ *State) error {
				if p.Name == signsSettledAfter {
					foldSets = w.setsAfter
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if w.settled != 1 || w.late != 0 || w.calls == 0 {
				t.Fatalf("SignsSettled called %d times; %d of %d negations after it (want 1, 0 of some)", w.settled, w.late, w.calls)
			}
			if foldSets == 0 {
				t.Fatalf("fold-signs wrote no vector after SignsSettled: the hook waited for them")
			}
			ref := tc.build()
			if _, err := Run(ref.g, &negationRecorder{MemWeights: ref.w}, Options{}); err != nil {
				t.Fatal(err)
			}
			if got, want := b.g.String(), ref.g.String(); got != want {
				t.Fatalf("graph with the hook differs:\n%s\nwithout:\n%s", got, want)
			}
			for _, k := range ref.w.Keys() {
				a, _ := b.w.Values(k)
				r, _ := ref.w.Values(k)
				for i := range r {
					if a[i] != r[i] {
						t.Fatalf("%s[%d] = %g with the hook, %g without", k, i, a[i], r[i])
					}
				}
			}
		})
	}
}
