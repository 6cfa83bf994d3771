package graph

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// declaredOps parses the package's sources for the constants of type Op,
// so that a constant added without a row fails TestOpTable.
func declaredOps(t *testing.T) []Op {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var ops []Op
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				if id, ok := vs.Type.(*ast.Ident); !ok || id.Name != "Op" {
					continue
				}
				for _, v := range vs.Values {
					lit, ok := v.(*ast.BasicLit)
					if !ok {
						t.Fatalf("%s: an Op constant that is not a string literal", fset.Position(v.Pos()))
					}
					s, err := strconv.Unquote(lit.Value)
					if err != nil {
						t.Fatal(err)
					}
					ops = append(ops, Op(s))
				}
			}
		}
	}
	if len(ops) < 30 {
		t.Fatalf("found %d Op constants: the parse missed them", len(ops))
	}
	return ops
}

// TestOpTable checks that every Op constant has exactly one row and that
// the rows agree with themselves, so that a new op cannot be half-declared.
func TestOpTable(t *testing.T) {
	declared := map[Op]bool{}
	for _, op := range declaredOps(t) {
		declared[op] = true
		if _, ok := op.Info(); !ok {
			t.Errorf("op %s has no row in opTable (graph/ops.go)", op)
		}
	}
	onnx := map[string]Op{}
	for _, r := range Ops() {
		if !declared[r.Op] {
			t.Errorf("row %s: no Op constant declares it", r.Op)
		}
		if r.Shape == ShapeNone {
			t.Errorf("row %s: no shape rule", r.Op)
		}
		if r.MaxInputs != Variadic && r.MaxInputs < r.MinInputs {
			t.Errorf("row %s: inputs %d to %d", r.Op, r.MinInputs, r.MaxInputs)
		}
		if (r.Op == OpInput) != (r.MaxInputs == 0) {
			t.Errorf("row %s: only the input has no inputs", r.Op)
		}
		if r.Activation && (r.Shape != ShapeSame || r.MinInputs != 1 || r.MaxInputs != 1 || r.Channels != ChannelsOfInput) {
			t.Errorf("row %s: an activation is elementwise of one input", r.Op)
		}
		if r.ABNAct != "" && !r.Activation {
			t.Errorf("row %s: fuses into ABN as %s but is not an activation", r.Op, r.ABNAct)
		}
		if r.Overwritable && (r.View || r.Saves == SaveOutput || r.Saves == SaveInPlaceABN) {
			t.Errorf("row %s: overwritable, but its output is a view or kept for its backward", r.Op)
		}
		if r.InPlace != InPlaceNever && r.Saves != SaveOutput && r.Saves != SaveInPlaceABN {
			t.Errorf("row %s: runs in place, so its backward can only have its output (saves rule %d)", r.Op, r.Saves)
		}
		if (r.Shape == ShapeNorm) != (r.Params == ParamsNorm) {
			t.Errorf("row %s: the BN family, and only it, owns normalisation parameters", r.Op)
		}
		if r.SignThrough && r.Channels != ChannelsOfInput {
			t.Errorf("row %s: a sign passes through it, so its channels must be its input's", r.Op)
		}
		if r.Python != "" && (r.MaxInputs == Variadic || strings.Count(r.Python, "%s") != r.MaxInputs || strings.Count(r.Python, "%") != r.MaxInputs) {
			t.Errorf("row %s: Python format %q must take its %d inputs as %%s, nothing else", r.Op, r.Python, r.MaxInputs)
		}
		if r.ONNX != "" {
			if prev, dup := onnx[r.ONNX]; dup {
				t.Errorf("rows %s and %s both read ONNX %s", prev, r.Op, r.ONNX)
			}
			onnx[r.ONNX] = r.Op
			if got, ok := ONNXOp(r.ONNX); !ok || got != r.Op {
				t.Errorf("ONNXOp(%q) = %s, %v; want %s", r.ONNX, got, ok, r.Op)
			}
		}
	}
	if info, ok := Op("NoSuchOp").Info(); ok || info.Shape != ShapeNone {
		t.Errorf("an unknown op has row %+v", info)
	}
	if _, ok := ONNXOp("NoSuchOp"); ok {
		t.Error("ONNXOp found an unknown type")
	}
}

// TestOpTableArity checks Validate against the table's bounds: one input
// too few and one too many are refused, for every op with a bound.
func TestOpTableArity(t *testing.T) {
	for _, r := range Ops() {
		if r.Op == OpInput || r.Op == OpInPlaceABN || r.Op == OpResize {
			continue // the input is first and once; the other two have checks of their own (TestValidate)
		}
		for _, n := range []int{r.MinInputs - 1, r.MaxInputs + 1} {
			if n < 0 || r.MaxInputs == Variadic && n > r.MinInputs {
				continue
			}
			g := New("arity", 3)
			ins := make([]*Value, n)
			for k := range ins {
				ins[k] = g.Input
			}
			g.Add("n", r.Op, Attr{}, nil, ins...)
			if err := g.Validate(); err == nil || !strings.Contains(err.Error(), "inputs") {
				t.Errorf("%s with %d inputs: Validate = %v, want an arity error", r.Op, n, err)
			}
		}
	}
}
