package emit

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestStochasticDepthEmitted: a StochasticDepth node becomes torchvision's
// own function in its mode (row or batch) with the module's training flag (so the
// emitted module draws the noise the original draws), torchvision is
// imported only then, and a probability outside [0, 1] is refused.
func TestStochasticDepthEmitted(t *testing.T) {
	build := func(p float64, mode ...string) *graph.Graph {
		b := newBuilder("sd", 3)
		x := b.conv("conv1", b.g.Input, 4, 1, 1, 0, 1, false)
		s := b.op("sd", graph.OpStochasticDepth, graph.Attr{P: p, Mode: strings.Join(mode, "")}, 4, x)
		b.op("add", graph.OpAdd, graph.Attr{}, 4, s, x)
		return b.g
	}
	src, err := Python(build(0.125), Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"import torchvision\n", `torchvision.ops.stochastic_depth(`, `0.125, "row", self.training)`} {
		if !strings.Contains(string(src), want) {
			t.Errorf("emitted module lacks %q:\n%s", want, src)
		}
	}
	plain, err := Python(convBNAct().g, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(plain), "import torchvision") {
		t.Error("torchvision imported by a module that does not use it")
	}
	if _, err := Python(build(1.5), Options{}); err == nil || !strings.Contains(err.Error(), "StochasticDepth probability 1.5") {
		t.Errorf("p 1.5: %v", err)
	}
	batch, err := Python(build(0.25, graph.StochasticBatch), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(batch), `0.25, "batch", self.training)`) {
		t.Errorf("batch mode not emitted as such:\n%s", batch)
	}
	if _, err := Python(build(0.25, "column"), Options{}); err == nil || !strings.Contains(err.Error(), `mode "column"`) {
		t.Errorf("mode column: %v", err)
	}
}
