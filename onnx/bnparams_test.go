package onnx

import (
	"math"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// TestCumulativeFactor: the momentum attributes torch 1.13 wrote for a
// BatchNorm2d(momentum=None) at num_batches_tracked n (the float32 of
// 1 - 1/n, as read by the exporter's Python float), read as the reader
// reads them, match n and not its neighbours.
func TestCumulativeFactor(t *testing.T) {
	cases := []struct {
		attr float32 // the file's momentum attribute
		n    int64
	}{
		{0.9966777563095093, 301}, // mom_net_train.onnx (fixtures/bnparams.py)
		{0.9990010261535645, 1001},
		{0.5, 2},
		{0, 1},
	}
	for _, tc := range cases {
		m := oneMinus32(tc.attr)
		if !CumulativeFactor(m, tc.n) {
			t.Errorf("attribute %v: factor %g is not 1/%d", tc.attr, m, tc.n)
		}
		for _, other := range []int64{tc.n - 1, tc.n + 1} {
			if CumulativeFactor(m, other) {
				t.Errorf("attribute %v: factor %g taken for 1/%d too", tc.attr, m, other)
			}
		}
	}
	if CumulativeFactor(0.5, 0) || CumulativeFactor(0.5, -2) {
		t.Error("a count below 1 has no factor")
	}
}

// TestKeptActivationWritten: a LeakyRelu with a negative slope after a BN
// stays in the written model, unchanged, reading the converted node's
// output (identity InPlaceABN in the custom domain, BatchNormalization in
// standard ops).
func TestKeptActivationWritten(t *testing.T) {
	for _, opt := range []WriteOptions{{}, {StandardOps: true}} {
		b := newModel(13).input("x", 1, 2, 5, 5).output("y")
		b.init("conv.weight", []int64{3, 2, 3, 3}, seq(54, func(i int) float64 { return math.Sin(float64(i)) })...)
		bn := b.bnParams("bn", []float64{0.5, 1.5, -0.75})
		b.node("Conv", "conv", []string{"x", "conv.weight"}, []string{"c"}, aInts("kernel_shape", 3, 3), aInts("pads", 1, 1, 1, 1))
		b.node("BatchNormalization", "bn", append([]string{"c"}, bn...), []string{"n"}, aFloat("epsilon", 1e-5), aFloat("momentum", 0.9))
		b.node("LeakyRelu", "act", []string{"n"}, []string{"y"}, aFloat("alpha", -0.1))
		m, err := readBytes(t, b.bytes(t), ReadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		rep := convert(t, m)
		if s := rep.Sites[0]; s.Op != graph.OpInPlaceABN || s.OpActivation != graph.ActIdentity || s.KeptActivation == "" {
			t.Fatalf("site %+v", s)
		}
		out := loadProto(t, write(t, m, opt))
		var norm, act *pb.NodeProto
		for _, n := range out.Graph.Node {
			switch n.GetName() {
			case "bn":
				norm = n
			case "act":
				act = n
			}
		}
		if norm == nil || act == nil || act.GetOpType() != "LeakyRelu" || nodeAttrs(act).float("alpha", 0) != -0.1 ||
			len(act.Input) != 1 || act.Input[0] != norm.Output[0] || act.Output[0] != "y" {
			t.Fatalf("standard ops %v: bn %v, act %v", opt.StandardOps, norm, act)
		}
		want, wantAct := "InPlaceABN", "identity"
		if opt.StandardOps {
			want, wantAct = "BatchNormalization", ""
		}
		if norm.GetOpType() != want || string(nodeAttrs(norm)["activation"].GetS()) != wantAct {
			t.Fatalf("standard ops %v: bn written as %v", opt.StandardOps, norm)
		}
	}
}
