//go:build cuda || cudaemu

package cuda

import (
	"errors"
	"math"
	"sort"
	"testing"

	"github.com/abnconvert/abnconvert/runtime"
	"github.com/abnconvert/abnconvert/verify"
)

// Comparisons of the CUDA backend with the CPU backend, shared by the
// emulator's tests (cudaemu) and the GPU's (cuda).

// rel is the largest absolute difference of got from want, relative to
// want's largest magnitude (absolute when want is all zeros).
func rel(got, want []float32) (float64, int) { return relFloor(got, want, 0) }

// relFloor is rel with the scale at least floor: a gradient that is zero
// up to rounding (a bias before a batch norm) is compared against the
// scale of the network's other gradients, not against its own noise.
func relFloor(got, want []float32, floor float64) (float64, int) {
	var d, scale float64
	at := -1
	for i := range want {
		a, b := float64(got[i]), float64(want[i])
		if math.IsNaN(a) != math.IsNaN(b) {
			return math.Inf(1), i
		}
		if math.IsNaN(b) {
			continue
		}
		if e := math.Abs(a - b); e > d {
			d, at = e, i
		}
		scale = math.Max(scale, math.Abs(b))
	}
	scale = math.Max(scale, floor)
	if scale == 0 {
		return d, at
	}
	return d / scale, at
}

func download(t testing.TB, b runtime.Backend, x runtime.Tensor) []float32 {
	t.Helper()
	v := make([]float32, numel(x.Shape()))
	if err := b.Download(x, v); err != nil {
		t.Fatal(err)
	}
	return v
}

// compareOps runs every op case on the CPU backend and on a CUDA backend
// from newB, and compares every tensor the case made, inputs included (a
// kernel writing outside its output shows up as a changed input).
func compareOps(t *testing.T, newB func(testing.TB) *Backend) {
	worst := map[string]float64{}
	for _, c := range opCases {
		t.Run(c.name, func(t *testing.T) {
			cm := newMk(t, runtime.NewCPU(1))
			if err := c.run(cm); errors.Is(err, errNoLayout) {
				t.Skipf("cpu: %v", err)
			} else if err != nil {
				t.Fatalf("cpu: %v", err)
			}
			em := newMk(t, newB(t))
			if err := c.run(em); err != nil {
				t.Fatalf("cuda: %v", err)
			}
			if len(cm.made) != len(em.made) {
				t.Fatalf("%d tensors on the CPU, %d on the CUDA backend", len(cm.made), len(em.made))
			}
			for k := range cm.made {
				want, got := download(t, cm.b, cm.made[k]), download(t, em.b, em.made[k])
				r, at := rel(got, want)
				worst[c.name] = math.Max(worst[c.name], r)
				if r > 2e-5 {
					t.Errorf("tensor %d %v: relative difference %.3g at %d (cuda %g, cpu %g)", k, cm.made[k].Shape(), r, at, got[at], want[at])
				}
			}
		})
	}
	names := make([]string, 0, len(worst))
	for k := range worst {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		t.Logf("%-45s %.2e", k, worst[k])
	}
}

// compareNetworks runs every fixture network, original and converted,
// through one eval forward and one training step on the CPU backend and on
// a CUDA backend from newB. The
// training tolerance is verify's floor (5e-3): the converted fixtures have
// channels with |gamma| < eps on purpose, and InPlace-ABN's backward
// divides by gamma, which magnifies float32 rounding there.
func compareNetworks(t *testing.T, newB func(testing.TB) *Backend, x *runtime.HostTensor) map[string]map[string]float64 {
	return compareNets(t, fixtureNets(t), 2, 0, newB, x)
}

// noiseFactor is how many times its float32 noise a gradient may differ
// when compareNets measures noise (verify's --train-factor).
const noiseFactor = 25

// compareNets is compareNetworks over the networks given, the CPU backend
// with the threads given. With draws > 0 each gradient's limit is
// noiseFactor times its float32 noise, as verify judges (verify/noise.go),
// where that is above 5e-3: the largest difference among the CPU run and
// draws CPU runs of verify's perturbed copies (input and weights moved by a
// rounding, then convolution weights by sqrt(fan-in) roundings, as far as
// another backend's sums move them), more copies (up to
// verify.MaxNoiseDraws) before a gradient fails. On a full-size network a
// rounding can flip a ReLU mask or a max-pool's choice, and that moves the
// gradients upstream by a few percent (resnet50 at batch 8, 224x224:
// input-gradient noise 2e-2), so the two backends' sums, taken in
// different orders, differ by that much too. A gradient whose limit
// reaches 1 cannot tell a right result from a wrong one and is counted as
// skipped. Outputs and running statistics keep their
// fixed limits. The worst difference over its limit is recorded per group
// as group+"_of_limit".
func compareNets(t *testing.T, nets []fixtureNet, threads, draws int, newB func(testing.TB) *Backend, x *runtime.HostTensor) map[string]map[string]float64 {
	worst := map[string]map[string]float64{}
	for _, n := range nets {
		t.Run(n.name, func(t *testing.T) {
			want := runStep(t, n, runtime.NewCPU(threads), x)
			var moved []step
			draw := func() {
				pw, px := verify.RoundingMoved(n.g, n.w, x, 7, uint64(len(moved)))
				moved = append(moved, runStep(t, fixtureNet{name: n.name + " (moved)", g: n.g, w: pw}, runtime.NewCPU(threads), px))
			}
			for len(moved) < draws {
				draw()
			}
			b := newB(t)
			got := runStep(t, n, b, x)
			gradScale := 0.0
			for _, w := range want.grads {
				for _, v := range w {
					gradScale = math.Max(gradScale, math.Abs(float64(v)))
				}
			}
			w := map[string]float64{}
			worst[n.name] = w
			// noise is the largest difference among the CPU run and the
			// moved ones of one result (pick).
			noise := func(pick func(step) []float32, floor float64) float64 {
				runs := append([]step{want}, moved...)
				var e float64
				for i := range runs {
					for j := i + 1; j < len(runs); j++ {
						r, _ := relFloor(pick(runs[i]), pick(runs[j]), floor)
						e = math.Max(e, r)
					}
				}
				return e
			}
			// check compares one result; group names the row of the
			// summary it counts in.
			check := func(group, what string, g, ref []float32, tol, floor float64) {
				t.Helper()
				if len(g) != len(ref) {
					t.Errorf("%s: %d values, cpu %d", what, len(g), len(ref))
					w[group] = math.Inf(1)
					return
				}
				if tol >= 1 {
					w["skipped"]++
					t.Logf("%s: skipped, its limit %.3g (its float32 noise times %d) would pass a zero result", what, tol, noiseFactor)
					return
				}
				r, at := relFloor(g, ref, floor)
				w[group] = math.Max(w[group], r)
				w[group+"_of_limit"] = math.Max(w[group+"_of_limit"], r/tol)
				if r > tol {
					t.Errorf("%s: relative difference %.3g at %d (cuda %g, cpu %g), limit %.3g", what, r, at, g[at], ref[at], tol)
				}
			}
			// gradTol is a gradient's limit: with draws, against more noise
			// copies while got is over it.
			gradTol := func(got []float32, pick func(step) []float32, floor float64) float64 {
				if draws == 0 {
					return 5e-3
				}
				tol := math.Max(5e-3, noiseFactor*noise(pick, floor))
				for len(got) == len(pick(want)) && len(moved) < verify.MaxNoiseDraws {
					if r, _ := relFloor(got, pick(want), floor); r <= tol {
						break
					}
					draw()
					tol = math.Max(5e-3, noiseFactor*noise(pick, floor))
				}
				return tol
			}
			check("eval_output", "eval output", got.evalOut.Data, want.evalOut.Data, 1e-4, 0)
			check("train_output", "training output", got.out.Data, want.out.Data, 1e-4, 0)
			check("input_gradient", "input gradient", got.dx.Data, want.dx.Data,
				gradTol(got.dx.Data, func(s step) []float32 { return s.dx.Data }, 0), 0)
			for k, ref := range want.grads {
				floor := 1e-3 * gradScale
				check("parameter_gradients", "gradient "+k, got.grads[k], ref,
					gradTol(got.grads[k], func(s step) []float32 { return s.grads[k] }, floor), floor)
			}
			if draws > 0 {
				w["noise_draws"] = float64(len(moved))
			}
			for k, ref := range want.running {
				check("running_statistics", "running "+k, got.running[k], ref, 1e-4, 0)
			}
			t.Logf("%s: %s; worst relative differences %v", n.name, summary(got.train), w)
		})
	}
	return worst
}
