package onnx

import "testing"

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
