package emit

import (
	"testing"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// TestErrorClasses: an op the emitter has no PyTorch for is "unsupported"
// (exit code 4); a broken attribute of a known op stays bad input.
func TestErrorClasses(t *testing.T) {
	for _, tc := range []struct {
		name   string
		breakG func(b *builder)
		want   failure.Kind
	}{
		{"unknown op", func(b *builder) { b.op("odd", "onnx.Sigmoid", graph.Attr{}, 4, b.g.Output) }, failure.Unsupported},
		{"bad attribute of a known op", func(b *builder) { b.op("drop", graph.OpDropout, graph.Attr{P: 1.5}, 4, b.g.Output) }, failure.BadInput},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := small()
			tc.breakG(b)
			_, err := Python(b.g, Options{})
			if got := failure.Of(err); got != tc.want {
				t.Errorf("%v: class %v, want %v", err, got, tc.want)
			}
		})
	}
}
