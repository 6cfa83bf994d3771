package convert

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/output"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// decodeOnly hides a store's graph.ChannelNegater, so that the rewrite
// takes the path every conversion took before sign folds streamed: decode,
// negate, encode.
type decodeOnly struct{ graph.Weights }

// The conversion writes the same bytes whether sign folds stream as
// sign-bit flips or go through decoded values, on every fixture (trained-like
// BN: negative gammas, optimizer state) and policy.
func TestStreamedSignFoldsWriteSameBytes(t *testing.T) {
	files, _ := filepath.Glob("../fixtures/testdata/*.pth")
	if len(files) < 5 {
		t.Fatalf("found %d fixtures", len(files))
	}
	withFlips := 0
	defer func() {
		if withFlips < 5 {
			t.Errorf("only %d conversions moved a sign: the fixtures no longer test the streamed path", withFlips)
		}
	}()
	for _, f := range files {
		for _, relu := range []string{"leaky", "abn"} {
			t.Run(filepath.Base(f)+"/"+relu, func(t *testing.T) {
				write := func(hide bool) ([]byte, int) {
					ck, err := pth.Open(f)
					if err != nil {
						t.Fatal(err)
					}
					defer ck.Close()
					g, _, err := arch.Recognize(ck, "auto")
					if err != nil {
						t.Fatal(err)
					}
					var w graph.Weights = ck
					if hide {
						w = decodeOnly{ck}
					}
					rep, err := rewrite.Run(g, w, rewrite.Options{ReLU: relu, Slope: 0.01})
					if err != nil {
						t.Fatal(err)
					}
					changed := map[string]bool{}
					for _, k := range rep.Changed {
						changed[k] = true
					}
					if _, err := ck.TransformOptimizer(rep.Flips, changed); err != nil {
						t.Fatal(err)
					}
					var b bytes.Buffer
					if _, err := ck.WriteTo(&b); err != nil {
						t.Fatal(err)
					}
					return b.Bytes(), len(rep.Flips)
				}
				streamed, flips := write(false)
				decoded, _ := write(true)
				withFlips += min(flips, 1)
				if !bytes.Equal(streamed, decoded) {
					os.WriteFile(filepath.Join(t.TempDir(), "streamed.pth"), streamed, 0o644)
					t.Fatalf("streamed sign folds wrote %d bytes differing from the decoding path's %d", len(streamed), len(decoded))
				}
			})
		}
	}
}

// A .safetensors input written as .pth streams its tensors (sign flips
// applied on the way) and writes the bytes that encoding every tensor's
// decoded values writes.
func TestSafetensorsToPthStreamsSameBytes(t *testing.T) {
	in := "../fixtures/testdata/formats4/tiny_resnet_basic.safetensors"
	dir := t.TempDir()
	for _, relu := range []string{"leaky", "abn"} {
		s, err := model.Open(in)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		g, _, err := arch.Recognize(s.Weights, "auto")
		if err != nil {
			t.Fatal(err)
		}
		rep, err := rewrite.Run(g, s.Weights, rewrite.Options{ReLU: relu, Slope: 0.01})
		if err != nil {
			t.Fatal(err)
		}
		if len(rep.Flips) == 0 {
			t.Fatal("no sign moved: the fixture no longer tests the streamed flips")
		}
		streamed := filepath.Join(dir, relu+".streamed.pth")
		set := output.New(output.Options{})
		defer set.Abort()
		if err := stage(s, set, streamed, nil); err != nil {
			t.Fatal(err)
		}
		if err := set.Commit(); err != nil {
			t.Fatal(err)
		}
		ref := pth.NewStateDict(streamed)
		for _, k := range s.Weights.Keys() {
			shape, _ := s.Weights.Shape(k)
			v, err := s.Weights.Values(k)
			if err != nil {
				t.Fatal(err)
			}
			if err := ref.AddTensor(k, s.TorchDType(k), shape, v); err != nil {
				t.Fatal(err)
			}
		}
		var want bytes.Buffer
		if _, err := ref.WriteTo(&want); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(streamed)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want.Bytes()) {
			t.Errorf("--relu %s: the streamed .pth (%d bytes) differs from the encoded one (%d)", relu, len(got), want.Len())
		}
	}
}
