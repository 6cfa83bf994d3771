package runtime

import (
	"testing"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// TestErrorClasses: an op the runtime does not model is "unsupported"
// (exit code 4), whatever command meets it (verify, memory); an input the
// network cannot take stays bad input.
func TestErrorClasses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build func(h *hand)
		input []int
		want  failure.Kind
	}{
		{"unknown op", func(h *hand) { h.g.Add("gate", graph.Op("onnx.Sigmoid"), graph.Attr{}, nil, h.g.Input) }, []int{2, 4, 3, 3}, failure.Unsupported},
		{"channel mismatch", func(h *hand) { h.conv("c1", h.g.Input, 4, 4, 3, 1) }, []int{1, 3, 5, 5}, failure.BadInput},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHand(tc.input[1])
			tc.build(h)
			e, err := New(h.g, h.w, NewCPU(1), Options{})
			if err == nil {
				_, err = e.Forward(NewHostTensor(tc.input...), true)
				e.Close()
			}
			if err == nil || failure.Of(err) != tc.want {
				t.Errorf("%v: class %v, want %v", err, failure.Of(err), tc.want)
			}
		})
	}
}
