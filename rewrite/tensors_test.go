package rewrite

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// appendingWeights is a store with AppendValues, as pth.Checkpoint has:
// the cache then compares with the store's values at flush rather than
// with a copy of its own.
type appendingWeights struct{ *graph.MemWeights }

func (w appendingWeights) AppendValues(dst []float64, key string) ([]float64, error) {
	v, err := w.Values(key)
	return append(dst, v...), err
}

// The vector cache outlives a pass only as what the store holds: a changed
// vector is written and stays cached as written, and a vector whose only
// change is a negated zero (no change to the store) is read again. Both
// ways of telling a change apart are run: a copy taken on reading, and
// the store's values decoded again at flush.
func TestTensorsCacheAcrossPasses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		store func(*graph.MemWeights) graph.Weights
		app   bool
	}{
		{"copy", func(w *graph.MemWeights) graph.Weights { return w }, false},
		{"store", func(w *graph.MemWeights) graph.Weights { return appendingWeights{w} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := graph.NewMemWeights()
			w.Put("a", []int{2}, []float64{0, 1})
			w.Put("b", []int{2}, []float64{2, 3})
			ts := newTensors(tc.store(w))
			if (ts.app != nil) != tc.app {
				t.Fatalf("the cache compares with the store: %v, want %v", ts.app != nil, tc.app)
			}
			testCacheAcrossPasses(t, w, ts)
		})
	}
}

func testCacheAcrossPasses(t *testing.T, w *graph.MemWeights, ts *tensors) {
	if err := ts.negateVec("a", 0); err != nil { // 0 -> -0: no change
		t.Fatal(err)
	}
	if err := ts.negateVec("b", 1); err != nil {
		t.Fatal(err)
	}
	if err := ts.flush(); err != nil {
		t.Fatal(err)
	}
	if ts.changed["a"] || !ts.changed["b"] {
		t.Fatalf("changed = %v, want b alone", ts.changed)
	}
	for key, want := range map[string][]float64{"a": {0, 1}, "b": {2, -3}} {
		stored, err := w.Values(key)
		if err != nil {
			t.Fatal(err)
		}
		cached, err := ts.vec(key)
		if err != nil {
			t.Fatal(err)
		}
		for i := range want {
			if math.Float64bits(stored[i]) != math.Float64bits(want[i]) || math.Float64bits(cached[i]) != math.Float64bits(want[i]) {
				t.Errorf("%s[%d]: stored %v, cached %v after flush, want %v (bit for bit)", key, i, stored[i], cached[i], want[i])
			}
		}
	}
	// The next pass changes b again from what was written, and it is
	// written again.
	if err := ts.negateVec("b", 0); err != nil {
		t.Fatal(err)
	}
	if err := ts.flush(); err != nil {
		t.Fatal(err)
	}
	if v, _ := w.Values("b"); v[0] != -2 || v[1] != -3 {
		t.Errorf("b = %v after the second pass, want [-2 -3]", v)
	}
	// A pass that changes b and changes it back writes nothing.
	for i := 0; i < 2; i++ {
		if err := ts.negateVec("b", 1); err != nil {
			t.Fatal(err)
		}
	}
	delete(ts.changed, "b")
	if err := ts.flush(); err != nil {
		t.Fatal(err)
	}
	if ts.changed["b"] {
		t.Errorf("b written again by a pass that left it as it was")
	}
}

// TestAppendTrue: appendTrue gives the indices a loop over every entry
// gives, for lengths around its eight-entry words and densities from none
// to all.
func TestAppendTrue(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for n := 0; n <= 70; n++ {
		for _, p := range []float64{0, 0.02, 0.11, 0.5, 0.9, 1} {
			b := make([]bool, n)
			for i := range b {
				b[i] = r.Float64() < p
			}
			var want []int
			for i, on := range b {
				if on {
					want = append(want, i)
				}
			}
			got := appendTrue([]int{-1}, b)
			if got[0] != -1 || !slices.Equal(got[1:], want) {
				t.Fatalf("n %d, density %g: appendTrue gives %v after the -1 it was given, want %v", n, p, got, want)
			}
		}
	}
}
