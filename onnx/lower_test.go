package onnx

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestDropZeroPads: torch's zero Pad goes, the AveragePool then reads the
// Pad's input, and the lowered model refuses to be written; a Pad that
// pads is kept, and the model can still be written.
func TestDropZeroPads(t *testing.T) {
	pad := graph.Op(OpaquePrefix + "Pad")
	tests := []struct {
		name    string
		nonZero bool // set one pad of the first Pad's initializer to 1
		dropped int
	}{
		{name: "zero pads", dropped: 1},
		{name: "a Pad that pads", nonZero: true, dropped: 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := mustRead(t, "testdata/tiny_dense.onnx")
			before := opCount(m.Graph)[pad]
			if before != 1 {
				t.Fatalf("%d Pads in the fixture, want 1", before)
			}
			if tc.nonZero {
				for _, n := range m.Graph.Nodes {
					if n.Op != pad {
						continue
					}
					key := m.byIR[n].proto.GetInput()[1]
					v, err := m.Weights.Values(key)
					if err != nil {
						t.Fatal(err)
					}
					v[len(v)-1] = 1
					if err := m.Weights.SetValues(key, v); err != nil {
						t.Fatal(err)
					}
					break
				}
			}
			if got := m.DropZeroPads(); got != tc.dropped {
				t.Fatalf("dropped %d, want %d", got, tc.dropped)
			}
			if got := opCount(m.Graph)[pad]; got != before-tc.dropped {
				t.Fatalf("%d Pads left, want %d", got, before-tc.dropped)
			}
			if err := m.Graph.Validate(); err != nil {
				t.Fatal(err)
			}
			for _, n := range m.Graph.Nodes {
				if n.Op == graph.OpAvgPool && n.Inputs[0].Producer.Op != graph.OpConv && !tc.nonZero {
					t.Errorf("%s reads %s, want the transition's Conv", n.Name, n.Inputs[0].Producer.Op)
				}
			}
			err := m.Write(filepath.Join(t.TempDir(), "out.onnx"), WriteOptions{})
			if tc.dropped > 0 && (err == nil || !strings.Contains(err.Error(), "lowered for running")) {
				t.Errorf("Write after dropping: %v", err)
			}
			if tc.dropped == 0 && err != nil {
				t.Errorf("Write with nothing dropped: %v", err)
			}
		})
	}
}
