package emit

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// cases are the hand-built graphs every test runs over.
var cases = []struct {
	name  string
	build func() *builder
	opt   Options
	// For the execution test: the hand-written reference in
	// testdata/check_model.py, the case to compare with (the same graph
	// emitted without recomputation), the recomputed norms whose running
	// statistics must be updated once, and the channel count of the
	// concatenation that recomputation must not keep.
	ref, twin      string
	norms          []string
	concatChannels int
	// torchvision names a torchvision model whose forward, gradients and
	// running statistics the emitted module must reproduce exactly with
	// that model's own state dict; such cases are too big for golden files.
	torchvision string
	inputSize   int
}{
	{name: "conv_bn_act", build: convBNAct, ref: "conv_bn_act"},
	{name: "residual", build: residual, opt: Options{Header: "abnconvert test\nflags: --sign-flip"}, ref: "residual"},
	{name: "densenet", build: denseNet, ref: "densenet", twin: "densenet_inline",
		norms: []string{"features.denseblock1.denselayer1.norm.1", "features.denseblock1.denselayer2.norm.1"}, concatChannels: 13},
	{name: "densenet_inline", build: denseNet, opt: Options{NoRecompute: true}, ref: "densenet"},
	{name: "abn_linear", build: abnLinear, ref: "abn_linear"},
	{name: "odd_names", build: oddNames},
	{name: "activations", build: activations, ref: "activations"},
	{name: "inverted_residual", build: invertedResidual, ref: "inverted_residual"},
	{name: "tv_resnet18", build: tvResNet18, torchvision: "resnet18", inputSize: 64},
	{name: "tv_densenet121", build: tvDenseNet121(true), torchvision: "densenet121", inputSize: 32,
		norms: []string{"features.denseblock1.denselayer1.norm1", "features.denseblock3.denselayer24.norm1"}},
}

func TestGolden(t *testing.T) {
	for _, c := range cases {
		if c.torchvision != "" {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			b := c.build()
			if err := b.g.Validate(); err != nil {
				t.Fatalf("test graph is invalid: %v", err)
			}
			got, err := Python(b.g, c.opt)
			if err != nil {
				t.Fatal(err)
			}
			again, err := Python(c.build().g, c.opt)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, again) {
				t.Fatal("two runs over the same graph differ")
			}
			path := filepath.Join("testdata", c.name+".py.golden")
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("%s differs from the emitted source (go test -update refreshes it); first difference:\n%s", path, firstDiff(want, got))
			}
		})
	}
}

func firstDiff(want, got []byte) string {
	wl, gl := strings.Split(string(want), "\n"), strings.Split(string(got), "\n")
	for i := 0; i < len(wl) || i < len(gl); i++ {
		var w, g string
		if i < len(wl) {
			w = wl[i]
		}
		if i < len(gl) {
			g = gl[i]
		}
		if w != g {
			return fmt.Sprintf("line %d:\n- %s\n+ %s", i+1, w, g)
		}
	}
	return "(none)"
}

func BenchmarkPythonDenseNet121(b *testing.B) {
	g := tvDenseNet121(true)().g
	for i := 0; i < b.N; i++ {
		if _, err := Python(g, Options{}); err != nil {
			b.Fatal(err)
		}
	}
}
