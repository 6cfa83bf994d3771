package arch

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/pth"
)

// TestTreeStateDictKeys recognises the real full-size state-dict key and
// shape lists of every MobileNetV2/V3, MNASNet, RegNet, GoogLeNet and
// Inception3 configuration of torchvision 0.14 by name, every key used,
// with and without a DataParallel prefix, and with the assumption stated.
func TestTreeStateDictKeys(t *testing.T) {
	for name, ts := range loadKeyFile(t, "torchvision_tree_keys.json.gz") {
		t.Run(name, func(t *testing.T) {
			for _, prefix := range []string{"", "module."} {
				w := weightsOf(ts, prefix)
				g, m, err := Recognize(w, "auto")
				if err != nil {
					t.Fatal(err)
				}
				if m.Arch != name || !m.Exact || m.Prefix != prefix {
					t.Errorf("got %q exact=%v prefix %q, want %q", m.Arch, m.Exact, m.Prefix, name)
				}
				checkCoverage(t, g, w)
				if !strings.Contains(strings.Join(m.Notes, "\n"), assumedPrefix+" from torchvision 0.14's") {
					t.Errorf("no assumption note: %q", m.Notes)
				}
				if _, _, err := Recognize(w, name); err != nil {
					t.Errorf("forced %s: %v", name, err)
				}
			}
		})
	}
}

// TestTreeStateDictRefusals: a truncated auxiliary classifier, or a
// truncated or renamed layout, names what is missing; a forced wrong name
// is a mismatch.
func TestTreeStateDictRefusals(t *testing.T) {
	keys := loadKeyFile(t, "torchvision_tree_keys.json.gz")
	cases := []struct {
		name string
		ts   []tensor
		want string
		kind failure.Kind
	}{
		{"googlenet aux truncated", append(append([]tensor{}, keys["googlenet"]...), tensor{"aux1.conv.conv.weight", []int{128, 512, 1, 1}}),
			"the googlenet layout lacks 13 keys: aux1.conv.bn.weight", failure.BadInput},
		{"inception aux truncated", append(append([]tensor{}, keys["inception_v3"]...), tensor{"AuxLogits.conv0.conv.weight", []int{128, 768, 1, 1}}),
			"the inception_v3 layout lacks 10 keys: AuxLogits.conv0.bn.weight", failure.BadInput},
		{"deeplabv3 mobilenet aux truncated", append(append([]tensor{}, keys["deeplabv3_mobilenet_v3_large"]...), tensor{"aux_classifier.0.weight", []int{10, 40, 3, 3}}),
			"aux_classifier.1.weight", failure.BadInput},
		{"mobilenet_v2 missing", edit(keys["mobilenet_v2"], `^features\.5\.conv\.1\.0\.weight$`, nil), "lacks 1 keys: features.5.conv.1.0.weight", failure.BadInput},
		{"mobilenet_v2 short", edit(keys["mobilenet_v2"], `^features\.18\.`, nil), "features has 18 modules", failure.BadInput},
		{"mobilenet_v3 blocks", edit(keys["mobilenet_v3_small"], `^features\.12\.`, nil), "features has 10 blocks", failure.BadInput},
		{"regnet extra", append(append([]tensor{}, keys["regnet_x_400mf"]...), tensor{"head.weight", []int{3, 3}}), "no module of the forward uses: head.weight", failure.BadInput},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := Recognize(weightsOf(c.ts, ""), "auto")
			if !errors.Is(err, ErrUnrecognised) || !strings.Contains(err.Error(), c.want) || failure.Of(err) != c.kind {
				t.Errorf("got %v (%v), want ErrUnrecognised (%v) with %q", err, failure.Of(err), c.kind, c.want)
			}
		})
	}
	if _, _, err := Recognize(weightsOf(keys["regnet_y_400mf"], ""), "regnet_x_400mf"); !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "but regnet_y_400mf") {
		t.Errorf("forced wrong name: %v", err)
	}
	if _, _, err := Recognize(weightsOf(keys["regnet_y_400mf"], ""), "mobilenet_v2"); !errors.Is(err, ErrMismatch) {
		t.Errorf("forced other family: %v", err)
	}
}

// sameGraph compares two graphs' dumps, their first (arch) line aside.
func sameGraph(t *testing.T, what string, a, b string) {
	t.Helper()
	a, b = strings.SplitN(a, "\n", 2)[1], strings.SplitN(b, "\n", 2)[1]
	if a != b {
		al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
		for i := range al {
			if i >= len(bl) || al[i] != bl[i] {
				other := "(end)"
				if i < len(bl) {
					other = bl[i]
				}
				t.Errorf("%s: the state dict's graph differs from the module's at line %d:\n  state dict: %s\n  module:     %s", what, i+1, al[i], other)
				return
			}
		}
		t.Errorf("%s: the module's graph is longer", what)
	}
}

// TestTreeStateDictsAsModules: the state dict of each reduced-width
// whole-module fixture made by real torch (RegNet, MNASNet, GoogLeNet,
// LRASPP over a dilated MobileNetV3) gives the very graph its pickled
// module gives, every attribute equal. The tiny EfficientNet's state dict
// is refused: its variant, which fixes BN eps and dropout, is not one of
// torchvision's.
func TestTreeStateDictsAsModules(t *testing.T) {
	for _, name := range []string{"regnet_module", "mnasnet_module", "googlenet_module", "lraspp_module"} {
		t.Run(name, func(t *testing.T) {
			ck, m := openModule(t, name)
			mg, _, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			g, _, err := Recognize(ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			sameGraph(t, name, g.String(), mg.String())
		})
	}
	ck, _ := openModule(t, "efficientnet_module")
	if _, _, err := Recognize(ck, "auto"); !errors.Is(err, ErrUnrecognised) || !strings.Contains(err.Error(), "convert the whole pickled module") {
		t.Errorf("tiny EfficientNet state dict: %v", err)
	}
}

// TestFullSizeTreeStateDicts: torchvision's full-size classifiers and
// MobileNetV3 segmentation models pickled whole by real torch: the graph from the state dict alone equals the graph
// from the module tree, every stride, padding, activation, eps and momentum
// included.
func TestFullSizeTreeStateDicts(t *testing.T) {
	const python = "/usr/bin/python3"
	if testing.Short() {
		t.Skip("runs PyTorch")
	}
	if err := exec.Command(python, "-c", "import torchvision").Run(); err != nil {
		t.Skipf("%s cannot import torchvision: %v", python, err)
	}
	names := []string{"mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "mnasnet0_5", "mnasnet1_3", "regnet_x_400mf", "regnet_y_800mf",
		"googlenet", "inception_v3", "shufflenet_v2_x0_5", "efficientnet_b0", "efficientnet_v2_s", "lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large"}
	dir := t.TempDir()
	script := `import sys, torch, torchvision
for f in ("kaiming_normal_", "kaiming_uniform_", "normal_", "uniform_", "zeros_", "ones_", "constant_", "trunc_normal_"):
    setattr(torch.nn.init, f, lambda t, *a, **k: t)
M = torchvision.models
for name in sys.argv[2:]:
    kw = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") else {}
    if "_mobilenet_v3_" in name:
        make, kw = getattr(M.segmentation, name), {"weights_backbone": None, "aux_loss": False}
    else:
        make = getattr(M, name)
    torch.save(make(**kw), sys.argv[1] + "/" + name + ".pth")
`
	if out, err := exec.Command(python, append([]string{"-c", script, dir}, names...)...).CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			ck, m, err := pth.OpenModule(filepath.Join(dir, name+".pth"))
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			mg, _, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			g, match, err := Recognize(ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if match.Arch != name {
				t.Errorf("recognised as %q", match.Arch)
			}
			sameGraph(t, name, g.String(), mg.String())
		})
	}
}
