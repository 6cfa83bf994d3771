package onnx

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
)

// decodeOnly hides Weights' graph.ChannelNegater: the rewrite then takes
// the decoding path every conversion took before sign folds streamed.
type decodeOnly struct{ graph.Weights }

// Sign folds applied as sign-bit flips of raw bytes write the same model as
// decoding, negating and encoding, in every output form; and a folded
// model is the same from run to run (the fold order once came from a map).
func TestNegationWritesSameBytes(t *testing.T) {
	files := []string{"tiny_cnn.onnx", "tiny_cnn_op9.onnx", "tiny_cnn_op17.onnx", "tiny_dense.onnx", "tiny_dense_ext.onnx"}
	forms := map[string]WriteOptions{"custom": {}, "standard": {StandardOps: true}, "fold": {FoldForInference: true}}
	for _, name := range files {
		for form, opt := range forms {
			t.Run(name+"/"+form, func(t *testing.T) {
				out := func(hide bool) []byte {
					m := mustRead(t, filepath.Join("testdata", name))
					var w graph.Weights = m.Weights
					if hide {
						w = decodeOnly{m.Weights}
					}
					convertWith(t, m, w)
					b, err := os.ReadFile(write(t, m, opt))
					if err != nil {
						t.Fatal(err)
					}
					return b
				}
				streamed := out(false)
				if again := out(false); !bytes.Equal(streamed, again) {
					t.Fatal("two conversions of the same model wrote different bytes")
				}
				if decoded := out(true); !bytes.Equal(streamed, decoded) {
					t.Fatalf("the streamed negation wrote %d bytes that differ from the decoding path's %d", len(streamed), len(decoded))
				}
			})
		}
	}
}

func convertWith(t *testing.T, m *Model, w graph.Weights) {
	t.Helper()
	rep, err := rewrite.Run(m.Graph, w, leaky)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Flips) == 0 {
		t.Fatal("no sign moved: the model no longer tests negation")
	}
}
