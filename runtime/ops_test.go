package runtime

import (
	"reflect"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// opCase is one case of testdata/ops.json.gz.
type opCase struct {
	Name     string                `json:"name"`
	Op       string                `json:"op"`
	Attr     graph.Attr            `json:"attr"`
	Graph    string                `json:"graph"`
	Training bool                  `json:"training"`
	Sign     []int8                `json:"sign"`
	Input    tensorJSON            `json:"input"`
	Dout     []float64             `json:"dout"`
	Output   tensorJSON            `json:"output"`
	Dx       []float64             `json:"dx"`
	Params   map[string]tensorJSON `json:"params"`
	Grads    map[string][]float64  `json:"grads"`
	Running  map[string][]float64  `json:"running"`
	// SavedElems is what PyTorch's saved-tensor hooks saw the case keep
	// for backward, in elements (newer cases only).
	SavedElems *int64 `json:"saved_elems"`
	// SavedBytes is the same in bytes as the float32 runtime holds them
	// (integer tensors, max-pool's indices, at their own size), where the
	// case has it.
	SavedBytes *int64 `json:"saved_bytes"`
}

type opGolden struct {
	Torch string   `json:"torch"`
	Seed  uint64   `json:"seed"`
	Cases []opCase `json:"cases"`
}

// buildCase makes the case's graph (see fixtures/ops.py) and weights. The
// op node is "op"; its parameters are "op.<role>".
func buildCase(c opCase) (*graph.Graph, *graph.MemWeights) {
	w := graph.NewMemWeights()
	params := map[string]string{}
	for role, tj := range c.Params {
		key := role
		if !strings.Contains(role, ".") {
			key = "op." + role
			params[role] = key
		}
		w.Put(key, tj.Shape, tj.Values)
	}
	g := graph.New(c.Name, c.Input.Shape[1])
	x := g.Input
	var res *graph.Value
	switch c.Graph {
	case "conv", "residual", "then_conv", "then_pool", "then_add", "then_leaky":
		if c.Graph == "residual" {
			res = x
		}
		ch := c.Input.Shape[1]
		x = g.Add("pre", graph.OpConv, graph.Attr{KernelSize: [2]int{1, 1}, Stride: [2]int{1, 1}, Dilation: [2]int{1, 1},
			Groups: 1, InChannels: ch, OutChannels: ch}, map[string]string{graph.RoleWeight: "pre.weight"}, x)
	case "add", "concat":
		act := g.Add("act", graph.OpLeakyReLU, graph.Attr{ActParam: 0.3}, nil, x)
		if c.Graph == "add" {
			g.Add("op", graph.OpAdd, c.Attr, nil, x, act)
		} else {
			g.Add("op", graph.OpConcat, c.Attr, nil, x, act, x)
		}
		return g, w
	case "binary", "binary_rev", "binary_same":
		// A squeeze-and-excitation gate: x op sigmoid(mean over H, W),
		// the gate first for binary_rev; binary_same: x op leaky(x).
		var other *graph.Value
		if c.Graph == "binary_same" {
			other = g.Add("act", graph.OpLeakyReLU, graph.Attr{ActParam: 0.3}, nil, x)
		} else {
			pool := g.Add("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, nil, x)
			other = g.Add("gate", graph.OpSigmoid, graph.Attr{}, nil, pool)
		}
		if c.Graph == "binary_rev" {
			g.Add("op", graph.Op(c.Op), c.Attr, nil, other, x)
		} else {
			g.Add("op", graph.Op(c.Op), c.Attr, nil, x, other)
		}
		return g, w
	}
	if len(params) == 0 {
		params = nil
	}
	var y *graph.Value
	if res != nil {
		y = g.Add("op", graph.Op(c.Op), c.Attr, params, x, res)
	} else {
		y = g.Add("op", graph.Op(c.Op), c.Attr, params, x)
	}
	g.Node("op").Sign = c.Sign
	// What reads the op's output next (fixtures/ops.py saved_chains).
	switch c.Graph {
	case "then_conv":
		ch := c.Input.Shape[1]
		g.Add("post", graph.OpConv, graph.Attr{KernelSize: [2]int{1, 1}, Stride: [2]int{1, 1}, Dilation: [2]int{1, 1},
			Groups: 1, InChannels: ch, OutChannels: ch}, map[string]string{graph.RoleWeight: "post.weight"}, y)
	case "then_pool":
		g.Add("post", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}}, nil, y)
	case "then_add":
		g.Add("post", graph.OpAdd, graph.Attr{}, nil, y, x)
	case "then_leaky":
		g.Add("post", graph.OpLeakyReLU, graph.Attr{ActParam: 0.3}, nil, y)
	}
	return g, w
}

// TestOpsAgainstTorch runs every op case of ops.json.gz (made by real
// PyTorch autograd in float64) on the CPU backend: forward output, input
// gradient, parameter gradients and running statistics. It also runs each
// case on the shape-only backend, whose memory figures must equal the CPU
// backend's.
func TestOpsAgainstTorch(t *testing.T) {
	var gold opGolden
	readGolden(t, "ops.json.gz", &gold)
	if len(gold.Cases) < 50 {
		t.Fatalf("only %d cases in ops.json.gz", len(gold.Cases))
	}
	for _, c := range gold.Cases {
		t.Run(c.Name, func(t *testing.T) {
			g, w := buildCase(c)
			cpuMem := runCase(t, c, g, w, NewCPU(2), gold.Seed)
			shapeMem := runCase(t, c, g, w, NewShapes(), gold.Seed)
			switch {
			case c.SavedBytes != nil:
				if shapeMem.SavedBytes != *c.SavedBytes {
					t.Errorf("saved for backward: %d bytes, PyTorch keeps %d", shapeMem.SavedBytes, *c.SavedBytes)
				}
			case c.SavedElems != nil && shapeMem.SavedBytes != 4**c.SavedElems:
				t.Errorf("saved for backward: %d bytes, PyTorch keeps %d elements (%d bytes)", shapeMem.SavedBytes, *c.SavedElems, 4**c.SavedElems)
			}
			cpuMem.Backend, shapeMem.Backend = "", ""
			if !reflect.DeepEqual(cpuMem, shapeMem) {
				t.Errorf("memory differs between backends:\ncpu    %+v\nshapes %+v", cpuMem, shapeMem)
			}
		})
	}
	// TestOpTableKernels checks that every op of the table has a case.
}

func runCase(t *testing.T, c opCase, g *graph.Graph, w graph.Weights, b Backend, seed uint64) MemoryReport {
	t.Helper()
	e, err := New(g, w, b, Options{Seed: seed, GradInEval: true})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	out, err := e.Forward(&HostTensor{Shape: c.Input.Shape, Data: f32(c.Input.Values)}, c.Training)
	if err != nil {
		t.Fatal(err)
	}
	if !sameInts(out.Shape, c.Output.Shape) {
		t.Fatalf("%s: output shape %v, torch %v", b.Name(), out.Shape, c.Output.Shape)
	}
	dx, grads, err := e.Backward(&HostTensor{Shape: out.Shape, Data: f32(c.Dout)})
	if err != nil {
		t.Fatal(err)
	}
	mem := e.Memory()
	if !b.Executes() {
		return mem
	}
	const tol = 1e-4
	check(t, "output", out.Data, c.Output.Values, tol)
	check(t, "input gradient", dx.Data, c.Dx, tol)
	for role, want := range c.Grads {
		key := role
		if !strings.Contains(role, ".") {
			key = "op." + role
		}
		got, ok := grads[key]
		if !ok {
			t.Errorf("no gradient for %s", key)
			continue
		}
		check(t, "gradient of "+key, got, want, tol)
	}
	if len(grads) != len(c.Grads) {
		t.Errorf("%d parameter gradients, torch has %d", len(grads), len(c.Grads))
	}
	stats, err := e.RunningStats()
	if err != nil {
		t.Fatal(err)
	}
	for role, want := range c.Running {
		check(t, "running "+role, stats["op."+role], want, 1e-5)
	}
	if st := b.Stats(); st.LiveBytes != mem.ParamBytes {
		t.Errorf("after backward %d bytes live, want only the %d of parameters", st.LiveBytes, mem.ParamBytes)
	}
	return mem
}
