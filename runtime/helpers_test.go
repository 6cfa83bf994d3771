package runtime

import (
	"compress/gzip"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The goldens are made by real PyTorch: -update reruns fixtures/ops.py
// (with /usr/bin/python3, or $PYTHON) before the tests.
var update = flag.Bool("update", false, "regenerate testdata/*.json.gz with fixtures/ops.py (needs PyTorch)")

func TestMain(m *testing.M) {
	flag.Parse()
	if *update {
		py := os.Getenv("PYTHON")
		if py == "" {
			py = "/usr/bin/python3"
		}
		cmd := exec.Command(py, filepath.Join("..", "fixtures", "ops.py"))
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "fixtures/ops.py:", err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

// readGolden decodes a gzipped JSON file of testdata (written by
// fixtures/ops.py).
func readGolden(t testing.TB, name string, v any) {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatalf("%v (run /usr/bin/python3 fixtures/ops.py to make it)", err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.NewDecoder(z).Decode(v); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}

type tensorJSON struct {
	Shape  []int     `json:"shape"`
	Values []float64 `json:"values"`
}

func f32(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// mismatch compares float32 results with float64 references: element i
// passes when |got-want| <= tol*(|want| + 0.1*max|want|), a relative
// tolerance that does not blow up near zero. It describes the worst
// element, or returns "" when all pass.
func mismatch(got []float32, want []float64, tol float64) string {
	if len(got) != len(want) {
		return fmt.Sprintf("%d values, want %d", len(got), len(want))
	}
	scale := 0.0
	for _, w := range want {
		scale = math.Max(scale, math.Abs(w))
	}
	worst, at := 0.0, -1
	for i, w := range want {
		g := float64(got[i])
		r := math.Abs(g-w) / (math.Abs(w) + 0.1*scale + 1e-12)
		if math.IsNaN(g) {
			r = math.Inf(1)
		}
		if r > worst {
			worst, at = r, i
		}
	}
	if worst <= tol {
		return ""
	}
	return fmt.Sprintf("element %d is %g, want %g (relative error %.3g > %g; max |want| %g)", at, got[at], want[at], worst, tol, scale)
}

func check(t *testing.T, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	if m := mismatch(got, want, tol); m != "" {
		t.Errorf("%s: %s", what, m)
	}
}
