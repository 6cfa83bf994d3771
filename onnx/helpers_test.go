package onnx

import (
	"encoding/binary"
	"encoding/json"
	"flag"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

var update = flag.Bool("update", false, "regenerate testdata: the fixtures (gen.py tiny, with /usr/bin/python3) and the IR dumps")

const python = "/usr/bin/python3"

// mb builds small ONNX models by hand.
type mb struct{ m *pb.ModelProto }

func newModel(opset int64) *mb {
	return &mb{m: &pb.ModelProto{
		IrVersion:    i64p(7),
		ProducerName: strp("abnconvert-test"),
		OpsetImport:  []*pb.OperatorSetIdProto{{Domain: strp(""), Version: i64p(opset)}},
		Graph:        &pb.GraphProto{Name: strp("test")},
	}}
}

func tensorType(dims ...int64) *pb.TypeProto {
	d := make([]*pb.TensorShapeProto_Dimension, len(dims))
	for i, x := range dims {
		d[i] = &pb.TensorShapeProto_Dimension{Value: &pb.TensorShapeProto_Dimension_DimValue{DimValue: x}}
	}
	ft := dtFloat
	return &pb.TypeProto{Value: &pb.TypeProto_TensorType{TensorType: &pb.TypeProto_Tensor{ElemType: &ft, Shape: &pb.TensorShapeProto{Dim: d}}}}
}

func (b *mb) input(name string, dims ...int64) *mb {
	b.m.Graph.Input = append(b.m.Graph.Input, &pb.ValueInfoProto{Name: strp(name), Type: tensorType(dims...)})
	return b
}

func (b *mb) output(name string) *mb {
	b.m.Graph.Output = append(b.m.Graph.Output, &pb.ValueInfoProto{Name: strp(name)})
	return b
}

// init adds a float32 initializer stored in raw_data.
func (b *mb) init(name string, dims []int64, vals ...float64) *pb.TensorProto {
	dt := dtFloat
	t := &pb.TensorProto{Name: strp(name), Dims: dims, DataType: &dt, RawData: rawOfValues(dtFloat, vals)}
	b.m.Graph.Initializer = append(b.m.Graph.Initializer, t)
	return t
}

func (b *mb) node(op, name string, in, out []string, attrs ...*pb.AttributeProto) *pb.NodeProto {
	n := &pb.NodeProto{OpType: strp(op), Input: in, Output: out, Attribute: attrs}
	if name != "" {
		n.Name = strp(name)
	}
	b.m.Graph.Node = append(b.m.Graph.Node, n)
	return n
}

func (b *mb) bytes(t *testing.T) []byte {
	t.Helper()
	out, err := proto.Marshal(b.m)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// save writes the model as dir/name and returns the path.
func (b *mb) save(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b.bytes(t), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func aInt(name string, v int64) *pb.AttributeProto {
	return &pb.AttributeProto{Name: strp(name), Type: attrTypeP(pb.AttributeProto_INT), I: i64p(v)}
}
func aInts(name string, v ...int64) *pb.AttributeProto { return intsAttr(name, v) }
func aFloat(name string, v float32) *pb.AttributeProto { return floatAttr(name, v) }
func aStr(name, v string) *pb.AttributeProto           { return stringAttr(name, v) }

func seq(n int, f func(i int) float64) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = f(i)
	}
	return v
}

// bnParams adds the four BatchNormalization initializers prefix.weight,
// .bias, .running_mean, .running_var for c channels, gamma as given.
func (b *mb) bnParams(prefix string, gamma []float64) []string {
	c := int64(len(gamma))
	b.init(prefix+".weight", []int64{c}, gamma...)
	b.init(prefix+".bias", []int64{c}, seq(len(gamma), func(i int) float64 { return 0.1 * float64(i) })...)
	b.init(prefix+".running_mean", []int64{c}, seq(len(gamma), func(i int) float64 { return 0.05 * float64(i) })...)
	b.init(prefix+".running_var", []int64{c}, seq(len(gamma), func(i int) float64 { return 1 + 0.1*float64(i) })...)
	return []string{prefix + ".weight", prefix + ".bias", prefix + ".running_mean", prefix + ".running_var"}
}

// convBNRelu is x[1,2,5,5] -> Conv(3 out, 3x3, pad 1) -> BN -> Relu -> y.
func convBNRelu(gamma ...float64) *mb {
	if len(gamma) == 0 {
		gamma = []float64{0.5, 1.5, -0.75}
	}
	b := newModel(13).input("x", 1, 2, 5, 5).output("y")
	b.init("conv.weight", []int64{3, 2, 3, 3}, seq(54, func(i int) float64 { return math.Sin(float64(i)) })...)
	bn := b.bnParams("bn", gamma)
	b.node("Conv", "conv", []string{"x", "conv.weight"}, []string{"c"}, aInts("kernel_shape", 3, 3), aInts("pads", 1, 1, 1, 1))
	b.node("BatchNormalization", "bn", append([]string{"c"}, bn...), []string{"n"}, aFloat("epsilon", 1e-5), aFloat("momentum", 0.9))
	b.node("Relu", "relu", []string{"n"}, []string{"y"})
	return b
}

func readBytes(t *testing.T, b []byte, opt ReadOptions) (*Model, error) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "m.onnx")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return ReadWith(p, opt)
}

func mustRead(t *testing.T, path string) *Model {
	t.Helper()
	m, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func opCount(g *graph.Graph) map[graph.Op]int {
	c := map[graph.Op]int{}
	for _, n := range g.Nodes {
		c[n.Op]++
	}
	return c
}

// golden is what gen.py stores next to a fixture.
type golden struct {
	InputShape   []int     `json:"input_shape"`
	Input        []float64 `json:"input"`
	OutputShape  []int     `json:"output_shape"`
	Output       []float64 `json:"output"`
	Initializers map[string]struct {
		Dims     []int     `json:"dims"`
		DataType int32     `json:"data_type"`
		Sum      float64   `json:"sum"`
		SumSq    float64   `json:"sumsq"`
		First    []float64 `json:"first"`
	} `json:"initializers"`
}

func readGolden(t *testing.T, path string) *golden {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var g golden
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return &g
}

// pythonOK reports whether /usr/bin/python3 imports what the named checks
// need ("onnx numpy", or "torch torchvision onnx" to generate fixtures).
var pythonCache sync.Map

func havePython(t *testing.T, modules string) {
	t.Helper()
	v, ok := pythonCache.Load(modules)
	if !ok {
		err := exec.Command(python, "-c", "import "+strings.ReplaceAll(modules, " ", ", ")).Run()
		v = err == nil
		pythonCache.Store(modules, v)
	}
	if !v.(bool) {
		t.Skipf("%s cannot import %s", python, modules)
	}
}

// task is one check for testdata/check.py; result is its answer.
type task map[string]any

type result struct {
	OK       bool      `json:"ok"`
	Error    string    `json:"error"`
	Bytes    bool      `json:"bytes_equal"`
	Graph    bool      `json:"graph_equal"`
	Inits    bool      `json:"initializers_equal"`
	Mismatch []string  `json:"initializer_mismatch"`
	MaxAbs   float64   `json:"max_abs"`
	RefMax   float64   `json:"ref_max"`
	Rel      float64   `json:"rel"`
	Output   []float64 `json:"output"`
	Task     task      `json:"task"`
}

// runChecks runs check.py over tasks in one Python process.
func runChecks(t *testing.T, tasks []task) []result {
	t.Helper()
	havePython(t, "onnx numpy")
	dir := t.TempDir()
	spec := filepath.Join(dir, "tasks.json")
	b, _ := json.Marshal(tasks)
	if err := os.WriteFile(spec, b, 0o644); err != nil {
		t.Fatal(err)
	}
	script, _ := filepath.Abs("testdata/check.py")
	out, err := exec.Command(python, script, spec).Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		t.Fatalf("check.py: %v\n%s", err, msg)
	}
	var res []result
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("check.py output: %v\n%s", err, out)
	}
	if len(res) != len(tasks) {
		t.Fatalf("check.py answered %d tasks of %d", len(res), len(tasks))
	}
	return res
}

func f32bytes(v ...float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}
