package emit

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestResidualAdd runs testdata/check_residual.py on the emitted
// inverted-residual module: _inplace_abn_add against inplace_abn's own
// layer followed by an out-of-place add and against plain PyTorch (every
// InPlaceABN configuration, training and eval, 4-D and 2-D), gradcheck,
// the whole emitted model in float64 and float32, and the saved tensors.
func TestResidualAdd(t *testing.T) {
	needTorch(t)
	b := invertedResidual()
	src, err := Python(b.g, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Count(string(src), "= _inplace_abn_add(mods["); got != 3 {
		t.Fatalf("%d calls of _inplace_abn_add in forward, want 3 (one per residual norm)", got)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "inverted_residual.py")
	if err := os.WriteFile(path, src, 0o644); err != nil {
		t.Fatal(err)
	}
	keys := map[string][]int{}
	for _, k := range b.g.ParamKeys() {
		shape, _ := b.w.Shape(k)
		keys[k] = append([]int{}, shape...)
	}
	// Blocks 1 and 3 feed a layer that saves the sum (a convolution, a
	// Linear); block 2's sum goes to an Add, which saves nothing, so fusing
	// it saves no tensor there.
	spec, err := json.Marshal(map[string]any{"module": path, "keys": keys, "input": []int{4, 3, 6, 6}, "saving_sites": 2})
	if err != nil {
		t.Fatal(err)
	}
	list := filepath.Join(dir, "spec.json")
	if err := os.WriteFile(list, spec, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := standinPython(t, filepath.Join("testdata", "check_residual.py"), list).CombinedOutput()
	if err != nil {
		t.Fatalf("check_residual.py: %v\n%s", err, out)
	}
	for _, want := range []string{"ok modules", "ok gradcheck", "ok model", "ok saved"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("check_residual.py did not report %q:\n%s", want, out)
		}
	}
	t.Logf("%s", out)
}
