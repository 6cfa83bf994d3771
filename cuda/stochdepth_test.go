package cuda

import (
	"github.com/abnconvert/abnconvert/runtime"
)

// The runtime runs StochasticDepth on any backend as a DropoutMask over
// the noise, (N, 1, ..., 1) in row mode and (1, ..., 1) in batch mode,
// then a broadcasting product, forward and backward (dx = dy * noise):
// these cases are those calls as the executor makes them, so that the
// emulator checks that the device's noise keeps exactly the samples the
// CPU backend's keeps.
func init() {
	for _, c := range []struct {
		name  string
		noise []int
	}{
		{"stochastic depth row", []int{64, 1, 1, 1}},
		{"stochastic depth batch", []int{1, 1, 1, 1}},
	} {
		x := []int{64, 8, 3, 3}
		opCases = append(opCases,
			opCase{c.name, func(m *mk) error {
				noise := m.f(c.noise...)
				if err := m.b.DropoutMask(noise, 0.2, runtime.DropoutSeed(5, "sd", 3)); err != nil {
					return err
				}
				return m.bc().Binary(m.f(x...), m.f(x...), noise, runtime.BinaryMul)
			}, "ew_dropout bc_binary"},
			opCase{c.name + " backward", func(m *mk) error {
				noise := m.f(c.noise...)
				if err := m.b.DropoutMask(noise, 0.5, runtime.DropoutSeed(5, "sd", 4)); err != nil {
					return err
				}
				dy := m.f(x...)
				// Over dy, as the executor writes it where the gradient
				// buffer can be reused.
				return m.bc().Binary(dy, dy, noise, runtime.BinaryMul)
			}, "ew_dropout bc_binary"},
		)
	}
}
