package onnx

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
	"github.com/abnconvert/abnconvert/runtime"
)

// shapeDir holds fixtures/shape_nets.py's networks: a channel shuffle, an
// inception-like block, a Linear(bias=False)+BatchNorm1d head and a
// segmentation head resized to the input, exported by torch 1.13 with
// training=PRESERVE and dynamic axes at opsets 11, 13 and 17.
const shapeDir = "../fixtures/testdata/shape"

// TestLowerLayoutExports lowers torch's exports: no opaque node is left,
// the layout ops expected are there, the graph runs at a batch size and
// resolution other than the export's and reproduces PyTorch's eval and
// training-mode outputs there, and the shape-only backend keeps for
// backward what PyTorch's saved-tensor hooks count.
func TestLowerLayoutExports(t *testing.T) {
	for _, tc := range []struct {
		name string
		want map[graph.Op]int
		// dropout: the training forward draws a mask torch does not.
		dropout bool
		// files are the exports read, the opsets' by default.
		files []string
		// noSaved: an eval-mode export without the Dropout the training
		// figure counts.
		noSaved bool
	}{
		{name: "shuffle", want: map[graph.Op]int{graph.OpSlice: 2, graph.OpReshape: 2, graph.OpTranspose: 1, graph.OpConcat: 1}},
		{name: "inception", want: map[graph.Op]int{graph.OpPad: 1, graph.OpMaxPool: 1, graph.OpAvgPool: 1, graph.OpConcat: 2, graph.OpSlice: 2}},
		{name: "head", want: map[graph.Op]int{graph.OpLinear: 2, graph.OpBatchNorm: 2, graph.OpDropout: 1, graph.OpReshape: 2}, dropout: true},
		{name: "seg", want: map[graph.Op]int{graph.OpResize: 2, graph.OpAdd: 1}},
		// nn.Upsample(scale_factor=2) and F.interpolate(scale_factor=2):
		// Resize with scales Concat(Constant [1, 1], Constant [2, 2]).
		{name: "unet", want: map[graph.Op]int{graph.OpResize: 2, graph.OpConcat: 2}},
		// By 2 nearest, by 2 bilinear with align_corners, to (12, 10):
		// sizes Concat(Slice(Shape(x), 0, 2), Constant [12, 10]).
		{name: "upseq", want: map[graph.Op]int{graph.OpResize: 3}},
		// Constant folding made Linear(bias=False)'s weight an initializer
		// "onnx::MatMul_25" of shape [in, out].
		{name: "head", want: map[graph.Op]int{graph.OpLinear: 2, graph.OpBatchNorm: 2}, files: []string{"head_op13f.onnx"}, noSaved: true},
	} {
		var gold actsGolden
		b, err := os.ReadFile(filepath.Join(shapeDir, tc.name+".json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, &gold); err != nil {
			t.Fatal(err)
		}
		files := tc.files
		if files == nil {
			for _, opset := range []int{11, 13, 17} {
				files = append(files, fmt.Sprintf("%s_op%d.onnx", tc.name, opset))
			}
		}
		for _, file := range files {
			t.Run(strings.TrimSuffix(file, ".onnx"), func(t *testing.T) {
				m := mustRead(t, filepath.Join(shapeDir, file))
				n, err := m.LowerLayout()
				if err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					t.Error("nothing lowered")
				}
				if o := m.Opaque(); len(o) != 0 {
					t.Errorf("Opaque lists lowered ops: %v", o)
				}
				for _, nd := range m.Graph.Nodes {
					if IsOpaque(nd.Op) {
						t.Errorf("opaque node left: %s (%s)", nd.Name, nd.Op)
					}
				}
				got := opCount(m.Graph)
				for op, k := range tc.want {
					if got[op] != k {
						t.Errorf("%d %s nodes, want %d\n%s", got[op], op, k, m.Graph)
					}
				}
				if err := m.Write(filepath.Join(t.TempDir(), "out.onnx"), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "lowered") {
					t.Errorf("writing a lowered model: %v, want a refusal", err)
				}
				x := &runtime.HostTensor{Shape: gold.Input, Data: f32s(gold.InputValues)}
				for _, training := range []bool{false, true} {
					if training && tc.dropout {
						continue
					}
					e, err := runtime.New(m.Graph, m.Weights, runtime.NewCPU(2), runtime.Options{})
					if err != nil {
						t.Fatal(err)
					}
					y, err := e.Forward(x, training)
					e.Close()
					if err != nil {
						t.Fatal(err)
					}
					ref := gold.EvalOutput
					if training {
						ref = gold.TrainOutput
					}
					if fmt.Sprint(y.Shape) != fmt.Sprint(gold.OutputShape) {
						t.Fatalf("output %v, torch %v", y.Shape, gold.OutputShape)
					}
					if e := maxRel(y.Data, ref); e > 1e-4 {
						t.Errorf("training=%v: output differs from PyTorch's by %.2e", training, e)
					}
				}
				e, err := runtime.New(m.Graph, m.Weights, runtime.NewShapes(), runtime.Options{})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				if _, err := e.Forward(&runtime.HostTensor{Shape: gold.Input}, true); err != nil {
					t.Fatal(err)
				}
				if got := e.Memory().SavedBytes; got != gold.SavedBytes && !tc.noSaved {
					t.Errorf("saved for backward %d bytes, PyTorch %d", got, gold.SavedBytes)
				}
			})
		}
	}
}

func maxRel(got []float32, want []float64) float64 {
	if len(got) != len(want) {
		return 1e9
	}
	var num, den float64
	for i, w := range want {
		num = max(num, math.Abs(float64(got[i])-w))
		den = max(den, math.Abs(w))
	}
	if den == 0 {
		return num
	}
	return num / den
}

// TestLowerLayoutSymbols checks the symbolic evaluation on its own: integer
// division floors, products of adjacent dimensions merge, and what cannot
// be expressed stays unlowered.
func TestLowerLayoutSymbols(t *testing.T) {
	v := &graph.Value{Name: "x"}
	d := func(axis int) *sx { return &sx{op: 'd', v: v, axis: axis} }
	must := func(e *sx, err error) *sx {
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	q := must(arith('/', sc(-7), sc(2)))
	if q.c != -4 {
		t.Errorf("-7 // 2 = %d, want -4", q.c)
	}
	for _, tc := range []struct {
		name string
		e    *sx
		want string
		ok   bool
	}{
		{"dim", d(2), "in0.shape[2]", true},
		{"half", must(arith('/', d(1), sc(2))), "in0.shape[1] // 2", true},
		{"hw", must(arith('*', d(2), d(3))), "in0.shape[2:4].numel()", true},
		{"scaled", must(arith('*', sc(3), d(0))), "in0.shape[0] * 3", true},
		{"const", must(arith('-', sc(8), sc(3))), "5", true},
		{"sum", must(arith('+', d(2), sc(1))), "", false},
		{"apart", must(arith('*', d(1), d(3))), "", false},
	} {
		refs := []*graph.Value{v}
		dim, ok := toDim(tc.e, &refs)
		if ok != tc.ok {
			t.Errorf("%s: ok %v, want %v", tc.name, ok, tc.ok)
			continue
		}
		if ok {
			if s := dim.String(func(k int) string { return fmt.Sprintf("in%d", k) }); s != tc.want {
				t.Errorf("%s: %s, want %s", tc.name, s, tc.want)
			}
		}
	}
}

// TestLowerLayoutCases: hand-built graphs, x -> Conv -> BN -> Relu "r" ->
// the node under test -> y, each lowered or left opaque (and then still
// listed by Opaque, so that --graph refuses it by name).
func TestLowerLayoutCases(t *testing.T) {
	i64 := func(name string, v ...int64) func(b *mb) string {
		return func(b *mb) string {
			dt := dtInt64
			b.m.Graph.Initializer = append(b.m.Graph.Initializer, &pb.TensorProto{Name: strp(name), Dims: []int64{int64(len(v))}, DataType: &dt, Int64Data: v})
			return name
		}
	}
	f32 := func(name string, v ...float64) func(b *mb) string {
		return func(b *mb) string {
			b.init(name, []int64{int64(len(v))}, v...)
			return name
		}
	}
	noInput := func(*mb) string { return "" }
	for _, tc := range []struct {
		name  string
		op    string
		extra []func(b *mb) string // further inputs
		attrs []*pb.AttributeProto
		want  graph.Op // "" when it must stay opaque
		why   string   // then: what Opaque says
	}{
		{"transpose", "Transpose", nil, []*pb.AttributeProto{aInts("perm", 0, 2, 3, 1)}, graph.OpTranspose, ""},
		{"pad", "Pad", []func(b *mb) string{i64("pads", 0, 0, 1, 0, 0, 0, 0, 2)}, nil, graph.OpPad, ""},
		{"pad reflect", "Pad", []func(b *mb) string{i64("pads", 0, 0, 1, 0, 0, 0, 0, 2)}, []*pb.AttributeProto{aStr("mode", "reflect")}, "", "only constant padding"},
		{"slice", "Slice", []func(b *mb) string{i64("s", 1), i64("e", 3), i64("a", 1)}, nil, graph.OpSlice, ""},
		{"slice step 2", "Slice", []func(b *mb) string{i64("s", 0), i64("e", 3), i64("a", 1), i64("st", 2)}, nil, "", "step 2"},
		{"unsqueeze", "Unsqueeze", []func(b *mb) string{i64("axes", -1)}, nil, graph.OpReshape, ""},
		{"squeeze without axes", "Squeeze", nil, nil, "", "without axes"},
		{"reshape constant", "Reshape", []func(b *mb) string{i64("shape", 1, 3, -1)}, nil, graph.OpReshape, ""},
		{"mean", "ReduceMean", nil, []*pb.AttributeProto{aInts("axes", 2, 3), aInt("keepdims", 0)}, graph.OpReshape, ""},
		{"mean over C", "ReduceMean", nil, []*pb.AttributeProto{aInts("axes", 1), aInt("keepdims", 0)}, "", "keepdims 0"},
		{"resize by scales", "Resize", []func(b *mb) string{noInput, f32("scales", 1, 1, 1.5, 0.5)},
			[]*pb.AttributeProto{aStr("mode", "nearest"), aStr("coordinate_transformation_mode", "asymmetric"), aStr("nearest_mode", "floor")}, graph.OpResize, ""},
		{"resize bilinear by scales", "Resize", []func(b *mb) string{noInput, f32("scales", 1, 1, 2, 2)},
			[]*pb.AttributeProto{aStr("mode", "linear"), aStr("coordinate_transformation_mode", "align_corners")}, graph.OpResize, ""},
		{"resize by scales on channels", "Resize", []func(b *mb) string{noInput, f32("scales", 1, 2, 2, 2)},
			[]*pb.AttributeProto{aStr("mode", "nearest"), aStr("coordinate_transformation_mode", "asymmetric"), aStr("nearest_mode", "floor")}, "", "only (1, 1, h, w)"},
		{"resize cubic", "Resize", []func(b *mb) string{noInput, f32("scales", 1, 1, 2, 2)},
			[]*pb.AttributeProto{aStr("mode", "cubic")}, "", "only nearest (asymmetric, floor) and bilinear"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := convBNRelu()
			b.m.Graph.Node[len(b.m.Graph.Node)-1].Output = []string{"r"}
			in := []string{"r"}
			for _, f := range tc.extra {
				in = append(in, f(b))
			}
			b.node(tc.op, "under_test", in, []string{"y"}, tc.attrs...)
			m, err := readBytes(t, b.bytes(t), ReadOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := m.LowerLayout(); err != nil {
				t.Fatal(err)
			}
			out := m.Graph.Output.Producer
			opaque := m.Opaque()
			if tc.want == "" {
				if !IsOpaque(out.Op) || len(opaque) != 1 || !strings.HasPrefix(opaque[0], tc.op) || !strings.Contains(opaque[0], tc.why) {
					t.Errorf("lowered to %s (opaque: %v), want it left opaque", out.Op, opaque)
				}
				return
			}
			if out.Op != tc.want || len(opaque) != 0 {
				t.Errorf("output node %s (opaque: %v), want %s", out.Op, opaque, tc.want)
			}
			e, err := runtime.New(m.Graph, m.Weights, runtime.NewShapes(), runtime.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if _, err := e.Forward(&runtime.HostTensor{Shape: []int{1, 2, 5, 5}}, false); err != nil {
				t.Errorf("running the lowered graph: %v", err)
			}
		})
	}
}

// TestResizeScalesRead: a Resize by scales becomes a one-input Resize with
// the factors torch was given (float32 1.1 read back as 1.1), and the
// shape-only backend gives floor(in * scale).
func TestResizeScalesRead(t *testing.T) {
	b := convBNRelu()
	b.m.Graph.Node[len(b.m.Graph.Node)-1].Output = []string{"r"}
	b.init("scales", []int64{4}, 1, 1, float64(float32(1.1)), 0.5)
	b.node("Resize", "up", []string{"r", "", "scales"}, []string{"y"}, aStr("mode", "linear"), aStr("coordinate_transformation_mode", "half_pixel"))
	m, err := readBytes(t, b.bytes(t), ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.LowerLayout(); err != nil {
		t.Fatal(err)
	}
	out := m.Graph.Output.Producer
	if want := (graph.Attr{Mode: "bilinear", Scale: [2]float64{1.1, 0.5}}); out.Op != graph.OpResize || len(out.Inputs) != 1 || out.Attr != want || out.Out.Channels != 3 {
		t.Fatalf("lowered to %s %+v (%d inputs, %d channels), want a one-input Resize %+v", out.Op, out.Attr, len(out.Inputs), out.Out.Channels, want)
	}
	e, err := runtime.New(m.Graph, m.Weights, runtime.NewShapes(), runtime.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	y, err := e.Forward(&runtime.HostTensor{Shape: []int{2, 2, 10, 7}}, false)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(y.Shape) != "[2 3 11 3]" {
		t.Errorf("output %v, want [2 3 11 3]", y.Shape)
	}
}

// TestResizeRecomputedFraction: F.interpolate(scale_factor=1.5,
// recompute_scale_factor=True) exports sizes computed as floor(H * 1.5):
// the shape computation must not read 1.5 as the integer 1 (which made it
// a Resize to the input's own size): it stays opaque, refused by name.
// By an integer factor it is a Resize by that factor.
func TestResizeRecomputedFraction(t *testing.T) {
	for _, scale := range []float64{1.5, 1, 2} {
		b := convBNRelu()
		b.m.Graph.Node[len(b.m.Graph.Node)-1].Output = []string{"r"}
		i64 := func(name string, v ...int64) string {
			dt := dtInt64
			b.m.Graph.Initializer = append(b.m.Graph.Initializer, &pb.TensorProto{Name: strp(name), Dims: []int64{int64(len(v))}, DataType: &dt, Int64Data: v})
			return name
		}
		b.init("factor", []int64{2}, scale, scale)
		b.node("Shape", "shape", []string{"r"}, []string{"s"})
		b.node("Slice", "nc", []string{"s", i64("z", 0), i64("two", 2)}, []string{"nc"})
		b.node("Slice", "hw", []string{"s", "two", i64("four", 4)}, []string{"hw"})
		b.node("Cast", "hwf", []string{"hw"}, []string{"hwf"}, aInt("to", 1))
		b.node("Mul", "mul", []string{"hwf", "factor"}, []string{"m"})
		b.node("Floor", "floor", []string{"m"}, []string{"fl"})
		b.node("Cast", "hwi", []string{"fl"}, []string{"hwi"}, aInt("to", 7))
		b.node("Concat", "sizes", []string{"nc", "hwi"}, []string{"sizes"}, aInt("axis", 0))
		b.node("Resize", "up", []string{"r", "", "", "sizes"}, []string{"y"}, aStr("mode", "nearest"),
			aStr("coordinate_transformation_mode", "asymmetric"), aStr("nearest_mode", "floor"))
		m, err := readBytes(t, b.bytes(t), ReadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.LowerLayout(); err != nil {
			t.Fatal(err)
		}
		out := m.Graph.Output.Producer
		switch scale {
		case 1:
			// By 1: a Resize to r's own size, as before.
			if out.Op != graph.OpResize || len(out.Inputs) != 2 {
				t.Errorf("by 1: lowered to %s with %d inputs, want a Resize to r's size", out.Op, len(out.Inputs))
			}
			continue
		case 2:
			if want := (graph.Attr{Mode: "nearest", Scale: [2]float64{2, 2}}); out.Op != graph.OpResize || len(out.Inputs) != 1 || out.Attr != want {
				t.Errorf("by 2: lowered to %s %+v with %d inputs, want a one-input Resize %+v", out.Op, out.Attr, len(out.Inputs), want)
			}
			continue
		}
		if o := fmt.Sprint(m.Opaque()); !IsOpaque(out.Op) || !strings.Contains(o, "Resize x1 (sizes computed by more than shape arithmetic (F.interpolate(scale_factor=f, recompute_scale_factor=True)") {
			t.Errorf("by %g: lowered to %s %+v (opaque: %s), want it left opaque, and why", scale, out.Op, out.Attr, o)
		}
	}
}
