package emit

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestOpTableEmission checks that the Python emitter has an emission for
// every row of graph's op table: a module (the ops with parameters), the
// row's Python expression, or a case of its own. A one-node graph of each
// op, with zero attributes, may be refused for its attributes, never as an
// unsupported op; where it is accepted, the line written names the op.
func TestOpTableEmission(t *testing.T) {
	for _, r := range graph.Ops() {
		if r.Op == graph.OpInput || ownsModule(r.Op) {
			continue
		}
		g := graph.New("optable", 3)
		ins := make([]*graph.Value, r.MinInputs)
		for k := range ins {
			ins[k] = g.Input
		}
		g.Add("n", r.Op, graph.Attr{}, nil, ins...)
		err := checkParamless(g.Node("n"))
		if err != nil {
			if strings.Contains(err.Error(), "not supported") {
				t.Errorf("%s: %v", r.Op, err)
			}
			continue
		}
		src, err := Python(g, Options{})
		if err != nil {
			t.Errorf("%s: %v", r.Op, err)
			continue
		}
		if !strings.Contains(string(src), "# n: "+string(r.Op)) {
			t.Errorf("%s: no line computes the node:\n%s", r.Op, src)
		}
		if r.Python != "" && !strings.Contains(string(src), strings.SplitN(r.Python, "%s", 2)[0]) {
			t.Errorf("%s: the table's expression %q is not what was written:\n%s", r.Op, r.Python, src)
		}
	}
}
