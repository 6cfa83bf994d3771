package arch

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

// TestGeneratorMatchesTorchvision checks the configuration table and key
// generator, which the other tests and the forced-name diff rely on, against
// the state dicts real torchvision writes: same keys, same order, same shapes.
func TestGeneratorMatchesTorchvision(t *testing.T) {
	real := loadTorchvision(t)
	for _, name := range Names() {
		want, ok := real[name]
		if !ok {
			t.Errorf("%s missing from testdata/torchvision_keys.json.gz", name)
			continue
		}
		got := named(t, name, 1000)
		if len(got) != len(want) {
			t.Errorf("%s: %d tensors generated, torchvision has %d", name, len(got), len(want))
			continue
		}
		for i := range got {
			if got[i].key != want[i].key || !sameShape(got[i].shape, want[i].shape) {
				t.Errorf("%s entry %d: generated %s %v, torchvision %s %v", name, i, got[i].key, got[i].shape, want[i].key, want[i].shape)
				break
			}
		}
	}
}

// TestTorchvisionKeys recognises the real key lists: each supported model
// exactly, and the non-standard networks built with torchvision's classes by
// their description.
func TestTorchvisionKeys(t *testing.T) {
	custom := map[string]string{
		"custom_resnet_basic_1111_c10":        "resnet (BasicBlock [1 1 1 1], width 64)",
		"custom_resnet_bottleneck_1211_g2w16": "resnet (Bottleneck [1 2 1 1], width 64, groups 2, width_per_group 16)",
		"custom_densenet_k4_bn2_22_i8_c10":    "densenet (growth 4, bn_size 2, blocks [2 2], init 8)",
		"custom_densenet121_legacy":           "densenet121",
		"custom_vgg_bn_8M16M_h32_24_c5":       "vgg_bn (cfg [8 M 16 M], classifier 32 24)",
	}
	for name, ts := range loadTorchvision(t) {
		t.Run(name, func(t *testing.T) {
			w := weightsOf(ts, "")
			g, m, err := Recognize(w, "auto")
			if strings.HasPrefix(name, "invalid_") {
				if !errors.Is(err, ErrUnrecognised) || !strings.Contains(err.Error(), "classifier.0.weight has shape [4096 25088], expected in_features 784") {
					t.Errorf("want the classifier refused, got %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want, isCustom := custom[name]
			if !isCustom {
				want = name
			}
			_, exact := lookup(want)
			if m.Arch != want || m.Exact != exact {
				t.Errorf("got %q exact=%v, want %q", m.Arch, m.Exact, want)
			}
			checkCoverage(t, g, w)
		})
	}
}

// TestGolden compares graph dumps with testdata/*.golden; go test -update
// rewrites them.
func TestGolden(t *testing.T) {
	tests := []struct {
		file string
		ts   []tensor
	}{
		{"resnet18.golden", named(t, "resnet18", 1000)},
		{"densenet_tiny.golden", densenetConfig{4, []int{2, 2}, 8, 2}.tensors(10)},
	}
	for _, tc := range tests {
		g, _, err := Recognize(weightsOf(tc.ts, ""), "")
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join("testdata", tc.file)
		if *update {
			if err := os.WriteFile(path, []byte(g.String()), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%v (run go test -update to create it)", err)
		}
		if got := g.String(); got != string(want) {
			t.Errorf("%s differs from the graph built now:\n%s", path, got)
		}
	}
}
