package verify

import (
	"math"
	"math/rand/v2"
	goruntime "runtime"
	"slices"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestNextFloat32 checks the bit arithmetic against math.Nextafter32 on
// the special values and on random bit patterns, both directions.
func TestNextFloat32(t *testing.T) {
	inf := float32(math.Inf(1))
	xs := []float32{0, float32(math.Copysign(0, -1)), 1, -1, inf, -inf, float32(math.NaN()),
		math.MaxFloat32, -math.MaxFloat32, math.SmallestNonzeroFloat32, -math.SmallestNonzeroFloat32}
	r := rand.New(rand.NewPCG(1, 2))
	for range 100000 {
		xs = append(xs, math.Float32frombits(r.Uint32()))
	}
	for _, x := range xs {
		for _, up := range []bool{true, false} {
			dir := inf
			if !up {
				dir = -inf
			}
			got, want := nextFloat32(x, up), math.Nextafter32(x, dir)
			if math.Float32bits(got) != math.Float32bits(want) && !(got != got && want != want) {
				t.Fatalf("nextFloat32(%v (%#08x), up %v) = %v (%#08x), want %v (%#08x)", x, math.Float32bits(x), up, got, math.Float32bits(got), want, math.Float32bits(want))
			}
		}
	}
}

// TestPerturbedWeights checks the noise copies' weights: every element
// moved to a neighbouring float32 (or, with a fan-in, by at most sqrt(fan)
// roundings and never left in place), both directions drawn about equally,
// other draws and other tensors moved otherwise, and the same values
// whatever the number of threads (chunks have their own streams).
func TestPerturbedWeights(t *testing.T) {
	w := graph.NewMemWeights()
	big := make([]float64, 3*perturbChunk+123) // several chunks, over the parallel threshold
	for i := range big {
		big[i] = float64(float32(math.Sin(float64(i)) * 3))
	}
	w.Put("big", []int{len(big)}, big)
	w.Put("small", []int{5}, []float64{0, -1, 2.5, 1e-30, -7})
	w.Put("count", []int{1}, []float64{1<<24 + 1}) // not in order: a num_batches_tracked
	order := map[string]uint64{"big": 0, "small": 1}
	values := func(pw perturbedWeights, key string) []float64 {
		t.Helper()
		v, err := pw.Values(key)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	pw := perturbedWeights{Weights: w, order: order, seed: 3, draw: 0}
	for _, key := range []string{"big", "small"} {
		orig, _ := w.Values(key)
		got := values(pw, key)
		up := 0
		for i, y := range got {
			x := float32(orig[i])
			if float32(y) != math.Nextafter32(x, float32(math.Inf(1))) && float32(y) != math.Nextafter32(x, float32(math.Inf(-1))) {
				t.Fatalf("%s[%d]: %v moved to %v, not a neighbouring float32", key, i, x, y)
			}
			if float32(y) > x {
				up++
			}
		}
		if key == "big" && (up < len(got)*45/100 || up > len(got)*55/100) {
			t.Errorf("%s: %d of %d moved up, want about half", key, up, len(got))
		}
	}
	if c := values(pw, "count"); c[0] != 1<<24+1 {
		t.Errorf("a key outside the graph's parameters: %v, want %v as it is", c[0], 1<<24+1)
	}
	first := values(pw, "big")
	prev := goruntime.GOMAXPROCS(1)
	one := values(pw, "big")
	goruntime.GOMAXPROCS(3)
	three := values(pw, "big")
	goruntime.GOMAXPROCS(prev)
	if !slices.Equal(first, one) || !slices.Equal(first, three) {
		t.Error("the moved values depend on GOMAXPROCS")
	}
	other := values(perturbedWeights{Weights: w, order: order, seed: 3, draw: 1}, "big")
	same := 0
	for i := range other {
		if other[i] == first[i] {
			same++
		}
	}
	if same > len(first)*55/100 || same < len(first)*45/100 {
		t.Errorf("draws 0 and 1 agree on %d of %d elements, want about half", same, len(first))
	}
	// Chunks draw independently: the second chunk does not repeat the first.
	orig, _ := w.Values("big")
	dir := func(i int) bool { return first[i] > orig[i] }
	rep := 0
	for i := range perturbChunk {
		if dir(i) == dir(i+perturbChunk) {
			rep++
		}
	}
	if rep > perturbChunk*55/100 {
		t.Errorf("chunk 1 moves %d of %d elements the way chunk 0 does", rep, perturbChunk)
	}
	// With a fan-in: within sqrt(fan) roundings and the rounding to float32
	// (or one ulp, two roundings, where that left it in place).
	fan := perturbedWeights{Weights: w, order: order, seed: 3, draw: 2, fan: map[string]float64{"big": 64}}
	for i, y := range values(fan, "big") {
		x := orig[i]
		if y == x || math.Abs(y-x) > (8+2)*math.Abs(x)*roundoff+math.SmallestNonzeroFloat32 {
			t.Fatalf("big[%d]: %v moved to %v with fan-in 64", i, x, y)
		}
	}
}
