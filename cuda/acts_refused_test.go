package cuda

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/runtime"
)

// TestKernelActRefusesByName: the activations with no CUDA kernel yet are
// refused as unsupported (exit 4), by name, not run as identity; the ones
// with a kernel pass.
func TestKernelActRefusesByName(t *testing.T) {
	for _, c := range []struct {
		act  runtime.Act
		name string
	}{
		{runtime.Act{Kind: runtime.ActTanh}, "tanh"},
		{runtime.Act{Kind: runtime.ActSELU}, "selu"},
		{runtime.Act{Kind: runtime.ActCELU, Param: 0.5}, "celu(0.5)"},
		{runtime.Act{Kind: runtime.ActSoftplus, Param: 1, Param2: 20}, "softplus(1, 20)"},
		{runtime.Act{Kind: runtime.ActMish}, "mish"},
	} {
		err := kernelAct(c.act)
		if err == nil || failure.Of(err) != failure.Unsupported || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s: %v (kind %v), want unsupported naming it", c.name, err, failure.Of(err))
		}
	}
	for k := runtime.ActIdentity; k <= runtime.ActGELU; k++ {
		if err := kernelAct(runtime.Act{Kind: k}); err != nil {
			t.Errorf("kind %d has a kernel, refused: %v", k, err)
		}
	}
}
