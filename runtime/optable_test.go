package runtime

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestOpTableKernels checks that the runtime can run every op of graph's
// table: each row has kernels (and an activation its Act kind), and a case against PyTorch autograd (forward, backward
// and the saved-tensor bytes) in ops.json.gz or layout_ops.json.gz, or a
// test of its own named here, so that an op added to the table without
// kernels, or without a golden case, fails here.
func TestOpTableKernels(t *testing.T) {
	var ops, layout struct {
		Cases []opCase `json:"cases"`
	}
	readGolden(t, "ops.json.gz", &ops)
	readGolden(t, "layout_ops.json.gz", &layout)
	covered := map[graph.Op]string{
		graph.OpInput:           "every case",
		graph.OpStochasticDepth: "TestStochasticDepth* (torchvision's draw)",
	}
	for _, c := range append(ops.Cases, layout.Cases...) {
		covered[graph.Op(c.Op)] = c.Name
	}
	for _, r := range graph.Ops() {
		if covered[r.Op] == "" {
			t.Errorf("op %s has a row in graph's table but no case against PyTorch autograd (add one to fixtures/ops.py)", r.Op)
		}
		k, ok := kernels[r.Op]
		switch {
		case !ok || k.forward == nil:
			t.Errorf("op %s has a row in graph's table but no forward kernel (runtime/kernels.go)", r.Op)
		case k.backward == nil && r.Op != graph.OpInput:
			t.Errorf("op %s has no backward kernel (runtime/kernels.go)", r.Op)
		}
		// An activation without its Act kind would run as the identity.
		if r.Activation {
			if act := actOf(&graph.Node{Op: r.Op}); act.Kind == ActIdentity {
				t.Errorf("activation %s has no Act kind in actOf: it would run as the identity", r.Op)
			}
		}
	}
	for op := range kernels {
		if _, ok := op.Info(); !ok {
			t.Errorf("kernels for %s, which has no row in graph's table", op)
		}
	}
}

// TestOpTableShapes checks that outShape has a case for every shape rule
// of the table: a one-node graph of each op is planned, and only the op's
// own attribute checks may refuse it, never "unsupported op".
func TestOpTableShapes(t *testing.T) {
	for _, r := range graph.Ops() {
		if r.Op == graph.OpInput {
			continue
		}
		n := r.MinInputs
		nd := &graph.Node{Name: "n", Op: r.Op, Inputs: make([]*graph.Value, n)}
		ins := make([][]int, n)
		for k := range ins {
			ins[k] = []int{2, 3, 4, 4}
		}
		_, err := outShape(nd, []int{2, 3, 4, 4}, ins, false)
		if err != nil && strings.Contains(err.Error(), "unsupported op") {
			t.Errorf("%s (shape rule %d): %v", r.Op, r.Shape, err)
		}
	}
}

// TestOpTableSaves checks that every row's saved-for-backward rule has been
// measured against PyTorch's saved-tensor hooks: a case of ops.json.gz with
// the figure (TestOpsAgainstTorch compares it with the runtime's), any case
// of layout_ops.json.gz (all carry it), or a test of its own named here;
// and every activation's before each kind of reader (a convolution, a
// max-pool, an Add, another activation).
func TestOpTableSaves(t *testing.T) {
	var ops struct {
		Cases []opCase `json:"cases"`
	}
	var layout struct {
		Cases []layoutCase `json:"cases"`
	}
	readGolden(t, "ops.json.gz", &ops)
	readGolden(t, "layout_ops.json.gz", &layout)
	measured := map[graph.Op]string{
		graph.OpInput: "the input is the caller's",
		// ops.py's reference for the BN family is batch_norm and an
		// activation, which keep other tensors than the library's layers.
		graph.OpABN:             "TestSavedBytes",
		graph.OpInPlaceABN:      "TestSavedBytes",
		graph.OpInPlaceABNSync:  "InPlaceABN's rule (TestSavedBytes)",
		graph.OpStochasticDepth: "TestStochasticDepthSaved",
	}
	// chains lists, per activation, the readers of its output it was
	// measured before (fixtures/ops.py saved_chains): whether the pair
	// keeps one storage or two depends on both rules.
	chains := map[graph.Op]map[string]bool{}
	for _, c := range ops.Cases {
		if c.SavedElems != nil || c.SavedBytes != nil {
			measured[graph.Op(c.Op)] = c.Name
			if strings.HasPrefix(c.Graph, "then_") {
				if chains[graph.Op(c.Op)] == nil {
					chains[graph.Op(c.Op)] = map[string]bool{}
				}
				chains[graph.Op(c.Op)][c.Graph] = true
			}
		}
	}
	for _, c := range layout.Cases {
		measured[graph.Op(c.Op)] = c.Name
	}
	for _, r := range graph.Ops() {
		if measured[r.Op] == "" {
			t.Errorf("op %s: its saves rule (%d) has no case measured by PyTorch's saved-tensor hooks (fixtures/ops.py saved())", r.Op, r.Saves)
		}
		if !r.Activation {
			continue
		}
		for _, then := range []string{"then_conv", "then_pool", "then_add", "then_leaky"} {
			if !chains[r.Op][then] {
				t.Errorf("activation %s: no %s case measured by PyTorch's saved-tensor hooks (fixtures/ops.py saved_chains())", r.Op, then)
			}
		}
	}
}
