package onnx

import (
	"math/rand"
	"os"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// one builds x[1,4,6,6] -> (the node under test, named "n", output "y").
func one(op string, extraIn []string, attrs ...*pb.AttributeProto) *mb {
	b := newModel(13).input("x", 1, 4, 6, 6).output("y")
	b.node(op, "n", append([]string{"x"}, extraIn...), []string{"y"}, attrs...)
	return b
}

func withInit(b *mb, name string, dims []int64, v ...float64) *mb {
	b.init(name, dims, v...)
	return b
}

func withInt64(b *mb, name string, v ...int64) *mb {
	dt := dtInt64
	b.m.Graph.Initializer = append(b.m.Graph.Initializer, &pb.TensorProto{Name: strp(name), DataType: &dt, Dims: []int64{int64(len(v))}, Int64Data: v})
	return b
}

func convModel(attrs ...*pb.AttributeProto) *mb {
	return withInit(one("Conv", []string{"w"}, attrs...), "w", []int64{6, 2, 3, 3}, seq(108, func(i int) float64 { return float64(i) })...)
}

// TestOpMapping: which ONNX nodes the IR models, with which attributes,
// and which it carries as opaque nodes.
func TestOpMapping(t *testing.T) {
	bn := func(extraOut bool, attrs ...*pb.AttributeProto) *mb {
		b := newModel(15).input("x", 1, 4, 6, 6).output("y")
		ps := b.bnParams("bn", []float64{1, 2, 3, 4})
		out := []string{"y"}
		if extraOut {
			out = append(out, "rm", "rv")
			b.output("rm")
		}
		b.node("BatchNormalization", "n", append([]string{"x"}, ps...), out, attrs...)
		return b
	}
	cases := []struct {
		name string
		b    *mb
		op   graph.Op
		attr graph.Attr
	}{
		{"conv grouped strided dilated", convModel(aInt("group", 2), aInts("strides", 2, 1), aInts("dilations", 1, 2), aInts("pads", 1, 2, 1, 2)),
			graph.OpConv, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 1}, Padding: [2]int{1, 2}, Dilation: [2]int{1, 2}, Groups: 2, InChannels: 4, OutChannels: 6}},
		{"conv asymmetric pads", convModel(aInt("group", 2), aInts("pads", 0, 0, 1, 1)), "onnx.Conv", graph.Attr{}},
		{"conv SAME_UPPER", convModel(aInt("group", 2), aStr("auto_pad", "SAME_UPPER")), "onnx.Conv", graph.Attr{}},
		{"conv 1-D weight", withInit(one("Conv", []string{"w"}), "w", []int64{6, 4, 3}, seq(72, func(int) float64 { return 1 })...), "onnx.Conv", graph.Attr{}},
		{"conv computed weight", one("Conv", []string{"x"}), "onnx.Conv", graph.Attr{}},
		{"bn", bn(false, aFloat("epsilon", 1e-3), aFloat("momentum", 0.9)), graph.OpBatchNorm, graph.Attr{Features: 4, Eps: 1e-3, Momentum: 0.1}},
		{"bn defaults", bn(false), graph.OpBatchNorm, graph.Attr{Features: 4, Eps: 1e-5, Momentum: 0.1}},
		{"bn momentum 0.99", bn(false, aFloat("momentum", 0.99)), graph.OpBatchNorm, graph.Attr{Features: 4, Eps: 1e-5, Momentum: 0.01}},
		{"bn training, running stats used", bn(true, aInt("training_mode", 1)), "onnx.BatchNormalization", graph.Attr{}},
		{"relu", one("Relu", nil), graph.OpReLU, graph.Attr{}},
		{"leaky default", one("LeakyRelu", nil), graph.OpLeakyReLU, graph.Attr{ActParam: 0.01}},
		{"leaky 0.2", one("LeakyRelu", nil, aFloat("alpha", 0.2)), graph.OpLeakyReLU, graph.Attr{ActParam: 0.2}},
		{"elu default", one("Elu", nil), graph.OpELU, graph.Attr{ActParam: 1}},
		{"add two values", one("Add", []string{"x"}), graph.OpAdd, graph.Attr{}},
		{"add a constant", withInit(one("Add", []string{"k"}), "k", []int64{1}, 1), "onnx.Add", graph.Attr{}},
		{"concat", one("Concat", []string{"x"}, aInt("axis", 1)), graph.OpConcat, graph.Attr{Axis: 1}},
		{"maxpool", one("MaxPool", nil, aInts("kernel_shape", 3, 3), aInts("strides", 2, 2), aInts("pads", 1, 1, 1, 1), aInt("ceil_mode", 1)),
			graph.OpMaxPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 1}, CeilMode: true}},
		{"maxpool storage order", one("MaxPool", nil, aInts("kernel_shape", 3, 3), aInt("storage_order", 1)), "onnx.MaxPool", graph.Attr{}},
		{"maxpool 1-D", one("MaxPool", nil, aInts("kernel_shape", 3)), "onnx.MaxPool", graph.Attr{}},
		{"avgpool", one("AveragePool", nil, aInts("kernel_shape", 2, 2), aInts("strides", 2, 2), aInt("count_include_pad", 1)),
			graph.OpAvgPool, graph.Attr{KernelSize: [2]int{2, 2}, Stride: [2]int{2, 2}, CountIncludePad: true}},
		{"avgpool asymmetric", one("AveragePool", nil, aInts("kernel_shape", 2, 2), aInts("pads", 1, 0, 0, 0)), "onnx.AveragePool", graph.Attr{}},
		{"global average pool", one("GlobalAveragePool", nil), graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}},
		{"flatten", one("Flatten", nil), graph.OpFlatten, graph.Attr{StartDim: 1}},
		{"flatten axis 2", one("Flatten", nil, aInt("axis", 2)), "onnx.Flatten", graph.Attr{}},
		{"reshape [0,-1]", withInt64(one("Reshape", []string{"s"}), "s", 0, -1), graph.OpFlatten, graph.Attr{StartDim: 1}},
		{"reshape [1,-1]", withInt64(one("Reshape", []string{"s"}), "s", 1, -1), "onnx.Reshape", graph.Attr{}},
		{"gemm linear", withInit(withInit(one("Gemm", []string{"w", "bias"}, aInt("transB", 1)), "w", []int64{3, 4}, seq(12, func(int) float64 { return 1 })...), "bias", []int64{3}, 1, 2, 3),
			graph.OpLinear, graph.Attr{InChannels: 4, OutChannels: 3, Bias: true}},
		{"gemm transB 0", withInit(one("Gemm", []string{"w"}), "w", []int64{4, 3}, seq(12, func(int) float64 { return 1 })...), "onnx.Gemm", graph.Attr{}},
		{"matmul", withInit(one("MatMul", []string{"w"}), "w", []int64{6, 3}, seq(18, func(int) float64 { return 1 })...), "onnx.MatMul", graph.Attr{}},
		{"dropout ratio attribute", func() *mb {
			b := one("Dropout", nil, aFloat("ratio", 0.3))
			b.m.OpsetImport[0].Version = i64p(11)
			return b
		}(),
			graph.OpDropout, graph.Attr{P: 0.3}},
		{"dropout ratio input", withInit(one("Dropout", []string{"r"}), "r", nil, 0.25), graph.OpDropout, graph.Attr{P: 0.25}},
		{"dropout mask used", func() *mb {
			b := one("Dropout", nil)
			b.m.Graph.Node[0].Output = []string{"y", "mask"}
			b.output("mask")
			return b
		}(), "onnx.Dropout", graph.Attr{}},
		{"sigmoid", one("Sigmoid", nil), graph.OpSigmoid, graph.Attr{}},
		{"hardsigmoid default", one("HardSigmoid", nil), graph.OpHardsigmoid, graph.Attr{ActParam: 0.2, ActParam2: 0.5}},
		{"hardsigmoid torch", one("HardSigmoid", nil, aFloat("alpha", 1.0/6)), graph.OpHardsigmoid, graph.Attr{ActParam: 1.0 / 6, ActParam2: 0.5}},
		{"hardswish", one("HardSwish", nil), graph.OpHardswish, graph.Attr{}},
		{"tanh", one("Tanh", nil), graph.OpTanh, graph.Attr{}},
		{"mish (opset 18's)", one("Mish", nil), graph.OpMish, graph.Attr{}},
		{"selu default", one("Selu", nil), graph.OpSELU, graph.Attr{}},
		{"selu torch's constants", one("Selu", nil, aFloat("alpha", 1.6732632423543772), aFloat("gamma", 1.0507009873554805)), graph.OpSELU, graph.Attr{}},
		{"selu other alpha", one("Selu", nil, aFloat("alpha", 1.5)), "onnx.Selu", graph.Attr{}},
		{"celu default", one("Celu", nil), graph.OpCELU, graph.Attr{ActParam: 1}},
		{"celu alpha", one("Celu", nil, aFloat("alpha", 0.7)), graph.OpCELU, graph.Attr{ActParam: 0.7}},
		{"celu alpha 0", one("Celu", nil, aFloat("alpha", 0)), "onnx.Celu", graph.Attr{}},
		{"softplus", one("Softplus", nil), graph.OpSoftplus, graph.Attr{ActParam: 1, ActParam2: 20}},
		{"clip inputs (relu6)", withInit(withInit(one("Clip", []string{"lo", "hi"}), "lo", nil, 0), "hi", nil, 6), graph.OpHardtanh, graph.Attr{ActParam: 0, ActParam2: 6}},
		{"clip attributes", one("Clip", nil, aFloat("min", -0.5), aFloat("max", 0.25)), graph.OpHardtanh, graph.Attr{ActParam: -0.5, ActParam2: 0.25}},
		{"clip without max", withInit(one("Clip", []string{"lo"}), "lo", nil, 0), "onnx.Clip", graph.Attr{}},
		{"clip computed bound", one("Clip", []string{"x", "x"}), "onnx.Clip", graph.Attr{}},
		{"clip empty", withInit(withInit(one("Clip", []string{"lo", "hi"}), "lo", nil, 1), "hi", nil, 0), "onnx.Clip", graph.Attr{}},
		{"mul two values", one("Mul", []string{"x"}), graph.OpMul, graph.Attr{}},
		{"mul a constant", withInit(one("Mul", []string{"k"}), "k", []int64{1}, 2), "onnx.Mul", graph.Attr{}},
		{"sub two values", one("Sub", []string{"x"}), graph.OpSub, graph.Attr{}},
		{"div two values", one("Div", []string{"x"}), graph.OpDiv, graph.Attr{}},
		{"reduce mean H W", one("ReduceMean", nil, aInts("axes", 2, 3)), graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}},
		{"reduce mean -2 -1 keepdims", one("ReduceMean", nil, aInts("axes", -2, -1), aInt("keepdims", 1)), graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}},
		{"reduce mean axes input", withInt64(one("ReduceMean", []string{"ax"}), "ax", 2, 3), graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}},
		{"reduce mean no keepdims", one("ReduceMean", nil, aInts("axes", 2, 3), aInt("keepdims", 0)), "onnx.ReduceMean", graph.Attr{}},
		{"reduce mean channels", one("ReduceMean", nil, aInts("axes", 1)), "onnx.ReduceMean", graph.Attr{}},
		{"reduce mean all", one("ReduceMean", nil), "onnx.ReduceMean", graph.Attr{}},
		{"identity of a value", one("Identity", nil), "onnx.Identity", graph.Attr{}},
		{"custom domain", func() *mb {
			b := one("Relu", nil)
			b.m.Graph.Node[0].Domain = strp("com.example")
			b.m.OpsetImport = append(b.m.OpsetImport, &pb.OperatorSetIdProto{Domain: strp("com.example"), Version: i64p(1)})
			return b
		}(), "onnx.com.example.Relu", graph.Attr{}},
		{"unknown attribute", one("Relu", nil, aInt("mystery", 1)), "onnx.Relu", graph.Attr{}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m, err := readBytes(t, c.b.bytes(t), ReadOptions{})
			if err != nil {
				t.Fatal(err)
			}
			n := m.Graph.Node("n")
			if n == nil {
				t.Fatalf("no node n:\n%s", m.Graph)
			}
			if n.Op != c.op {
				t.Fatalf("op %s, want %s", n.Op, c.op)
			}
			if IsOpaque(n.Op) {
				if why := m.Opaque(); len(why) != 1 {
					t.Errorf("Opaque() = %v", why)
				}
				return
			}
			if n.Attr != c.attr {
				t.Errorf("attr %+v, want %+v", n.Attr, c.attr)
			}
		})
	}
}

// TestBoundaries: graph inputs and outputs beyond the first, and further
// outputs of an opaque node, become IR nodes, so the passes see every
// reader; a subgraph's reads from the main graph are inputs of its node.
func TestBoundaries(t *testing.T) {
	b := newModel(13).input("x", 1, 2, 4, 4).input("x2", 1, 2, 4, 4).output("y").output("aux").output("s1")
	bn := b.bnParams("bn", []float64{1, 1})
	b.node("BatchNormalization", "bn", append([]string{"x"}, bn...), []string{"n"})
	b.node("Relu", "relu", []string{"n"}, []string{"r"})
	b.node("Split", "split", []string{"r"}, []string{"s0", "s1"}, aInt("axis", 1))
	b.node("Add", "add", []string{"s0", "x2"}, []string{"aux"})
	then := &pb.GraphProto{Name: strp("then"), Output: []*pb.ValueInfoProto{{Name: strp("t")}},
		Node: []*pb.NodeProto{{OpType: strp("Identity"), Input: []string{"n"}, Output: []string{"t"}}}}
	els := &pb.GraphProto{Name: strp("else"), Output: []*pb.ValueInfoProto{{Name: strp("e")}},
		Node: []*pb.NodeProto{{OpType: strp("Identity"), Input: []string{"aux"}, Output: []string{"e"}}}}
	dt := dtBool
	b.m.Graph.Initializer = append(b.m.Graph.Initializer, &pb.TensorProto{Name: strp("cond"), DataType: &dt, RawData: []byte{1}})
	b.node("If", "if", []string{"cond"}, []string{"y"},
		&pb.AttributeProto{Name: strp("then_branch"), Type: attrTypeP(pb.AttributeProto_GRAPH), G: then},
		&pb.AttributeProto{Name: strp("else_branch"), Type: attrTypeP(pb.AttributeProto_GRAPH), G: els})
	m, err := readBytes(t, b.bytes(t), ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	g := m.Graph
	want := map[string]graph.Op{"input:x2": OpGraphInput, "output:aux": OpGraphOutput, "output:s1": OpGraphOutput, "split:1": OpOutput, "split": "onnx.Split", "if": "onnx.If"}
	for name, op := range want {
		if n := g.Node(name); n == nil || n.Op != op {
			t.Errorf("node %s: %v, want op %s\n%s", name, n, op, g)
		}
	}
	ifn := g.Node("if")
	if len(ifn.Inputs) != 2 || ifn.Inputs[0] != g.Node("bn").Out || ifn.Inputs[1] != g.Node("add").Out {
		t.Errorf("If reads %v, want the BN and the Add (through its subgraphs)", ifn.Inputs)
	}
	if g.Output != ifn.Out {
		t.Errorf("output %s", g.Output.Name)
	}
	// The BN's output is read by the Relu and by the If's subgraph: the
	// rewrite must see both readers.
	if n := len(g.Node("bn").Out.Consumers); n != 2 {
		t.Errorf("BN has %d readers, want 2", n)
	}
}

// TestNoPanics reads thousands of corrupted versions of a real model:
// each must be refused or read, never crash, and never hit the
// internal-error recovery (which would be a bug).
func TestNoPanics(t *testing.T) {
	t.Parallel()
	good, err := os.ReadFile("testdata/tiny_dense.onnx")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	rng := rand.New(rand.NewSource(1))
	try := func(b []byte) {
		p := dir + "/m.onnx"
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		m, err := Read(p)
		if err != nil && strings.Contains(err.Error(), "internal error") {
			t.Fatalf("reader bug on corrupted input: %v", err)
		}
		if err == nil {
			if err := m.Graph.Validate(); err != nil {
				t.Fatalf("read an invalid graph: %v", err)
			}
		}
	}
	for i := 0; i < 300; i++ {
		try(good[:rng.Intn(len(good))])
	}
	for i := 0; i < 1500; i++ {
		b := append([]byte(nil), good...)
		for k := 0; k < 1+rng.Intn(4); k++ {
			b[rng.Intn(len(b))] = byte(rng.Intn(256))
		}
		try(b)
	}
}

func FuzzRead(f *testing.F) {
	for _, p := range []string{"testdata/tiny_cnn.onnx", "testdata/tiny_cnn_fresh.onnx"} {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parse(dir+"/fuzz.onnx", b, ReadOptions{AllowEvalExport: true})
		if err == nil && m.Graph.Validate() != nil {
			t.Fatal("invalid graph")
		}
	})
}
