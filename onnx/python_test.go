package onnx

import (
	"bytes"
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// Checks by the real onnx package (checker, loader) and an independent
// numpy evaluator (testdata/check.py), on the committed fixtures and on
// resnet18 and densenet121 exported by real torch at test time.

// converted is one fixture read, converted with the leaky policy and
// written in every mode.
type converted struct {
	name, orig, golden    string
	rt, custom, std, fold string
}

// convertAll reads path, writes it back unchanged, converts it and writes
// it in the three modes, into dir.
func convertAll(t *testing.T, name, path, golden, dir string) converted {
	t.Helper()
	c := converted{name: name, orig: path, golden: golden}
	m, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	c.rt = filepath.Join(dir, name+".rt.onnx")
	if err := m.Write(c.rt, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	convert(t, m)
	for _, w := range []struct {
		path *string
		opt  WriteOptions
		tag  string
	}{{&c.custom, WriteOptions{}, "custom"}, {&c.std, WriteOptions{StandardOps: true}, "std"}, {&c.fold, WriteOptions{FoldForInference: true}, "fold"}} {
		*w.path = filepath.Join(dir, name+"."+w.tag+".onnx")
		if err := m.Write(*w.path, w.opt); err != nil {
			t.Fatalf("%s %s: %v", name, w.tag, err)
		}
	}
	return c
}

// tasks lists the checks of one converted fixture.
func (c converted) tasks() []task {
	ts := []task{
		{"op": "roundtrip", "a": c.orig, "b": c.rt},
		{"op": "checker", "path": c.custom, "full": true},
		{"op": "checker", "path": c.std, "full": true},
		{"op": "checker", "path": c.fold, "full": true},
	}
	if c.golden == "" {
		return ts
	}
	return append(ts,
		task{"op": "eval", "path": c.orig, "golden": c.golden, "reference": "golden"},
		task{"op": "eval", "path": c.custom, "golden": c.golden, "reference": c.orig, "slope": 0.01},
		task{"op": "eval", "path": c.std, "golden": c.golden, "reference": c.orig, "slope": 0.01},
		task{"op": "eval", "path": c.fold, "golden": c.golden, "reference": c.orig, "slope": 0.01},
	)
}

// verify asserts on check.py's answers to c.tasks(). bytes says whether
// the round trip must be byte-identical (not when external data moved).
func (c converted) verify(t *testing.T, res []result, bytesEqual bool) {
	t.Helper()
	// Relative tolerances against the leaky reference: the standard-ops
	// file holds the original float32 values up to signs (|weight| + eps
	// gives gamma back; measured differences are float64 evaluation noise,
	// about 1e-9), the custom file float32(|gamma| - eps) (about 1e-7), the
	// folded file float32 products.
	tol := map[string]float64{c.orig: 1e-5, c.custom: 1e-6, c.std: 1e-7, c.fold: 1e-6}
	for _, r := range res {
		what := c.name + " " + r.Task["op"].(string) + " " + filepath.Base(str(r.Task["path"])+str(r.Task["b"]))
		if !r.OK {
			t.Errorf("%s: %s", what, r.Error)
			continue
		}
		switch r.Task["op"] {
		case "roundtrip":
			if !r.Graph || !r.Inits {
				t.Errorf("%s: graph equal %v, initializers equal %v %v", what, r.Graph, r.Inits, r.Mismatch)
			}
			if bytesEqual && !r.Bytes {
				t.Errorf("%s: not byte-identical", what)
			}
		case "eval":
			if r.Rel > tol[str(r.Task["path"])] {
				t.Errorf("%s: max abs diff %.3g (rel %.3g) against the reference", what, r.MaxAbs, r.Rel)
			}
			t.Logf("%s: max abs diff %.3g, rel %.3g", what, r.MaxAbs, r.Rel)
			if r.RefMax == 0 {
				t.Errorf("%s: zero reference output", what)
			}
		}
	}
}

func str(v any) string {
	s, _ := v.(string)
	return s
}

func TestPythonFixtures(t *testing.T) {
	t.Parallel()
	havePython(t, "onnx numpy")
	dir := t.TempDir()
	var all []converted
	var tasks []task
	for _, f := range []struct{ name, golden string }{
		{"tiny_cnn", "tiny_cnn"}, {"tiny_cnn_fresh", "tiny_cnn_fresh"}, {"tiny_dense", "tiny_dense"},
		{"tiny_dense_ext", "tiny_dense"}, {"tiny_cnn_train", ""}, {"tiny_cnn_op9", "tiny_cnn"}, {"tiny_cnn_op17", "tiny_cnn"},
	} {
		g := ""
		if f.golden != "" {
			g, _ = filepath.Abs(filepath.Join("testdata", f.golden+".golden.json"))
		}
		c := convertAll(t, f.name, filepath.Join("testdata", f.name+".onnx"), g, dir)
		all = append(all, c)
		tasks = append(tasks, c.tasks()...)
	}
	// The checker accepts ai.abnconvert nodes because the domain is
	// imported: without the import it must refuse them.
	undeclared := filepath.Join(dir, "undeclared.onnx")
	mp := loadProto(t, all[2].custom)
	var keep []*pb.OperatorSetIdProto
	for _, o := range mp.OpsetImport {
		if o.GetDomain() != Domain {
			keep = append(keep, o)
		}
	}
	mp.OpsetImport = keep
	b, err := proto.Marshal(mp)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(undeclared, b, 0o644); err != nil {
		t.Fatal(err)
	}
	tasks = append(tasks, task{"op": "checker", "path": undeclared})
	res := runChecks(t, tasks)
	if last := res[len(res)-1]; last.OK || !strings.Contains(last.Error, "No opset import for domain 'ai.abnconvert'") {
		t.Errorf("checker on undeclared custom domain: ok=%v %s", last.OK, last.Error)
	}
	res = res[:len(res)-1]
	i := 0
	for _, c := range all {
		n := len(c.tasks())
		c.verify(t, res[i:i+n], !strings.HasSuffix(c.name, "_ext"))
		i += n
	}
	// The leaky network really differs from the original (else the
	// comparisons above would prove nothing).
	for _, r := range res {
		if r.Task["op"] == "eval" && r.Task["reference"] != "golden" && strings.Contains(str(r.Task["path"]), "tiny_cnn.std") {
			g := readGolden(t, "testdata/tiny_cnn.golden.json")
			diff := 0.0
			for k, v := range r.Output {
				diff = math.Max(diff, math.Abs(v-g.Output[k]))
			}
			if diff < 1e-4 {
				t.Errorf("converted output equals the ReLU original (diff %g): ReLU was not replaced", diff)
			}
		}
	}
}

// TestPythonModels exports resnet18 (randomised BNs and freshly
// initialised, where torch deduplicates) and densenet121 with real torch
// (PRESERVE, and EVAL to be refused), then converts and checks them.
func TestPythonModels(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("exports resnet18 and densenet121 with torch")
	}
	havePython(t, "torch torchvision onnx numpy")
	dir := t.TempDir()
	if out, err := exec.Command(python, "testdata/gen.py", "big", dir).CombinedOutput(); err != nil {
		t.Fatalf("gen.py big: %v\n%s", err, out)
	}
	for _, f := range []string{"resnet18_eval", "densenet121_eval"} {
		if _, err := Read(filepath.Join(dir, f+".onnx")); !errors.Is(err, ErrEvalExport) {
			t.Errorf("%s: %v, want ErrEvalExport", f, err)
		}
	}
	var all []converted
	var tasks []task
	for _, f := range []struct{ name, golden string }{{"resnet18", "resnet18"}, {"resnet18_fresh", ""}, {"densenet121", "densenet121"}} {
		g := ""
		if f.golden != "" {
			g = filepath.Join(dir, f.golden+".golden.json")
		}
		path := filepath.Join(dir, f.name+".onnx")
		c := convertAll(t, f.name, path, g, dir)
		a, _ := os.ReadFile(path)
		b, _ := os.ReadFile(c.rt)
		if !bytes.Equal(a, b) {
			t.Errorf("%s: round trip not byte-identical", f.name)
		}
		all = append(all, c)
		tasks = append(tasks, c.tasks()...)
	}
	// The fresh resnet18 against the leaky version of itself, on resnet18's
	// golden input.
	fresh := all[1]
	fresh.golden = filepath.Join(dir, "resnet18.golden.json")
	tasks = append(tasks,
		task{"op": "eval", "path": fresh.custom, "golden": fresh.golden, "reference": fresh.orig, "slope": 0.01},
		task{"op": "eval", "path": fresh.std, "golden": fresh.golden, "reference": fresh.orig, "slope": 0.01})
	res := runChecks(t, tasks)
	i := 0
	for _, c := range all {
		n := len(c.tasks())
		c.verify(t, res[i:i+n], true)
		i += n
	}
	fresh.verify(t, res[i:], true)

	// Deduplication in the fresh export, and un-sharing on write.
	m := mustRead(t, fresh.orig)
	if len(m.Shared()) == 0 {
		t.Error("no deduplicated tensors in the fresh resnet18 export")
	}
	checkFreshABN(t, fresh.custom, 20)
}

// checkFreshABN checks that every ai.abnconvert node of a converted,
// freshly initialised network reads weight 1 - eps, bias 0, mean 0, var 1.
func checkFreshABN(t *testing.T, path string, want int) {
	t.Helper()
	o, err := ReadWith(path, ReadOptions{AllowEvalExport: true})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, node := range loadProto(t, path).Graph.Node {
		if node.GetDomain() != Domain {
			continue
		}
		n++
		eps := float64(nodeAttrs(node).float("epsilon", 0))
		for k, w := range []float64{1 - eps, 0, 0, 1} {
			v, err := o.Weights.Values(node.Input[k+1])
			if err != nil {
				t.Fatal(err)
			}
			for _, x := range v {
				if math.Abs(x-w) > 1e-7 {
					t.Fatalf("%s input %s: %g, want %g", node.GetName(), node.Input[k+1], x, w)
				}
			}
		}
	}
	if n != want {
		t.Errorf("%d ai.abnconvert nodes, want %d", n, want)
	}
}
