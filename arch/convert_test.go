package arch_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/convert"
)

// TestConvertedInTorch converts each whole pickled fixture of
// fixtures/structure.py end to end (convert.Run, --relu abn,
// --emit-module), then real PyTorch loads the converted checkpoint into
// the emitted module strictly and compares it with the original pickled
// module in eval mode, at an input size other than the goldens', within
// 1e-4 (fixtures/structure.py check). The inplace_abn stand-in runs the
// InPlace-ABN layers.
func TestConvertedInTorch(t *testing.T) {
	const python = "/usr/bin/python3"
	if testing.Short() {
		t.Skip("runs PyTorch")
	}
	if err := exec.Command(python, "-c", "import torch, torchvision").Run(); err != nil {
		t.Skipf("%s cannot import torch: %v", python, err)
	}
	dir := t.TempDir()
	for _, name := range []string{"dilated_module", "fcn_module", "deeplab_module", "regnet_module", "mnasnet_module",
		"googlenet_module", "resnet_head_module", "vgg_head_module", "efficientnet_module", "lraspp_module"} {
		t.Run(name, func(t *testing.T) {
			in := filepath.Join("..", "fixtures", "testdata", "structure", name+".pth")
			out, mod := filepath.Join(dir, name+"_abn.pth"), filepath.Join(dir, name+"_abn.py")
			if _, err := convert.Run(convert.Options{Input: in, Output: out, EmitModule: mod, ReLU: "abn"}); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(mod)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(b), "InPlaceABN") && !strings.Contains(string(b), "ABN(") {
				t.Errorf("the emitted module has no ABN layer")
			}
			res, err := exec.Command(python, filepath.Join("..", "fixtures", "structure.py"), "check", in, out, mod).CombinedOutput()
			if err != nil {
				t.Fatalf("%v\n%s", err, res)
			}
			t.Logf("%s", strings.TrimSpace(string(res)))
		})
	}
}
