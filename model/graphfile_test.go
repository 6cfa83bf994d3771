package model

import (
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestCumulativeMomentumExports: MomNet's BatchNorm2d(momentum=None)
// layers (a.1, b.1; num_batches_tracked 301 after 300 training steps and
// the export's forward) from real torch exports, in train mode (factor
// 1/301) and eval mode (factor 0), are read as momentum=None, and its
// momentum=0.05 layer (c.1) as 0.05; ParamNet's momentum=0.1 layers stay
// 0.1. fixtures/bnparams.py checks the emitted modules in torch.
func TestCumulativeMomentumExports(t *testing.T) {
	for _, export := range []string{"mom_net_train.onnx", "mom_net_eval.onnx"} {
		t.Run(export, func(t *testing.T) {
			n, err := OpenNetwork(testdata("bnparams", "mom_net.pth"), Options{Graph: testdata("bnparams", export)})
			if err != nil {
				t.Fatal(err)
			}
			defer n.Close()
			for name, none := range map[string]bool{"a.1": true, "b.1": true, "c.1": false} {
				a := n.Graph.Node(name).Attr
				if a.MomentumNone != none || !none && a.Momentum != 0.05 {
					t.Errorf("%s: momentum %g, none %v; want none %v", name, a.Momentum, a.MomentumNone, none)
				}
			}
			notes := strings.Join(n.Match.Notes, "\n")
			if !strings.Contains(notes, "2 BatchNorm layer(s) read as momentum=None") || !strings.Contains(notes, "a.1, b.1") || !strings.Contains(notes, "cannot be told apart") {
				t.Errorf("notes:\n%s", notes)
			}
		})
	}
	n, err := OpenNetwork(testdata("bnparams", "param_net.pth"), Options{Graph: testdata("bnparams", "param_net.onnx")})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	for _, nd := range n.Graph.Nodes {
		if nd.Op == graph.OpBatchNorm && (nd.Attr.MomentumNone || nd.Attr.Momentum != 0.1) {
			t.Errorf("%s: momentum %g, none %v; want 0.1", nd.Name, nd.Attr.Momentum, nd.Attr.MomentumNone)
		}
	}
	if notes := strings.Join(n.Match.Notes, "\n"); strings.Contains(notes, "momentum=None") {
		t.Errorf("a note on momentum=None for a network without one:\n%s", notes)
	}
}

// TestCumulativeMomentumRule: the factor against num_batches_tracked, case
// by case (the factors are what the ONNX reader gives for the float32
// torch writes: 1 - 1/2 and 1 - 1/4 are exact).
func TestCumulativeMomentumRule(t *testing.T) {
	cases := []struct {
		name     string
		momentum float64
		count    []float64 // nil: no num_batches_tracked
		mode     string
		none     bool
		err      string
	}{
		{"1/N: state dict saved after the export", 0.5, []float64{2}, "train", true, ""},
		{"1/(N+1): saved before", 0.25, []float64{3}, "train", true, ""},
		{"neither", 0.25, []float64{5}, "train", false, ""},
		{"1/(N-1) is not", 0.5, []float64{3}, "train", false, ""},
		{"no num_batches_tracked", 0.5, nil, "train", false, ""},
		{"0.1 is torch's default momentum", 0.1, []float64{10}, "train", false, ""},
		{"0.01 too", 0.01, []float64{99}, "train", false, ""},
		{"a train export's factor 0 is momentum 0", 0, []float64{7}, "train", false, ""},
		{"an eval export's factor 0 is momentum=None", 0, []float64{7}, "eval", true, ""},
		{"an eval export's 1/N is a momentum", 0.5, []float64{2}, "eval", false, ""},
		{"count 0", 0.5, []float64{0}, "train", false, ""},
		{"not a count", 0.5, []float64{2.5}, "train", false, "want one count"},
		{"two counts", 0.5, []float64{2, 2}, "train", false, "want one count"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := graph.New("t", 2)
			w := graph.NewMemWeights()
			params := map[string]string{}
			if tc.count != nil {
				params[graph.RoleNumBatches] = "bn.num_batches_tracked"
				w.Put("bn.num_batches_tracked", []int{len(tc.count)}, tc.count)
			}
			g.Add("bn", graph.OpBatchNorm, graph.Attr{Features: 2, Eps: 1e-5, Momentum: tc.momentum}, params, g.Input)
			note, err := cumulativeMomentum(g, w, tc.mode)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "bn.num_batches_tracked") {
					t.Fatalf("error %v, want one naming the key and %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			a := g.Node("bn").Attr
			if a.MomentumNone != tc.none || (note != "") != tc.none {
				t.Fatalf("momentum %g none %v, note %q; want none %v", a.Momentum, a.MomentumNone, note, tc.none)
			}
			if !tc.none && a.Momentum != tc.momentum {
				t.Fatalf("momentum changed to %g", a.Momentum)
			}
		})
	}
}
