package emit

import (
	"math"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// small is conv -> InPlaceABN -> conv, the base the error cases break.
func small() *builder {
	b := newBuilder("small", 3)
	x := b.conv("conv1", b.g.Input, 4, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABN, "bn1", x, graph.ActLeakyReLU, 0.01)
	b.conv("conv2", x, 4, 1, 1, 0, 1, false)
	return b
}

func TestErrors(t *testing.T) {
	tests := []struct {
		name   string
		breakG func(b *builder) *graph.Graph
		want   []string // substrings of the error
	}{
		{"relu in InPlaceABN", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Attr.Activation = graph.ActReLU
			return b.g
		}, []string{`"bn1"`, "relu"}},
		{"leaky slope 0 in InPlaceABN", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Attr.ActParam = 0
			return b.g
		}, []string{`"bn1"`, "inverted"}},
		{"elu alpha negative in InPlaceABN", func(b *builder) *graph.Graph {
			n := b.g.Node("bn1")
			n.Attr.Activation, n.Attr.ActParam = graph.ActELU, -1
			return b.g
		}, []string{`"bn1"`, "inverted"}},
		{"leaky slope negative in ABN", func(b *builder) *graph.Graph {
			// ABN's leaky_relu runs in place: torch refuses its backward.
			n := b.g.Node("bn1")
			n.Op, n.Attr.ActParam = graph.OpABN, -0.1
			return b.g
		}, []string{`"bn1"`, "negative_slope below 0", "identity ABN"}},
		{"elu alpha negative in ABN", func(b *builder) *graph.Graph {
			n := b.g.Node("bn1")
			n.Op, n.Attr.Activation, n.Attr.ActParam = graph.OpABN, graph.ActELU, -1
			return b.g
		}, []string{`"bn1"`, "alpha below 0"}},
		{"unknown activation", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Attr.Activation = "gelu"
			return b.g
		}, []string{`"bn1"`, `"gelu"`}},
		{"key without role suffix", func(b *builder) *graph.Graph {
			b.g.Node("conv1").Params[graph.RoleWeight] = "conv1.kernel"
			return b.g
		}, []string{`"conv1"`, `"conv1.kernel"`}},
		{"keys of two modules", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Params[graph.RoleBias] = "bn2.bias"
			return b.g
		}, []string{`"bn1"`, "different modules"}},
		{"unknown role", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Params["scale"] = "bn1.scale"
			return b.g
		}, []string{`"bn1"`, `"scale"`}},
		{"conv bias attribute without key", func(b *builder) *graph.Graph {
			b.g.Node("conv1").Attr.Bias = true
			return b.g
		}, []string{`"conv1"`, "bias"}},
		{"conv channels do not fit groups", func(b *builder) *graph.Graph {
			b.g.Node("conv1").Attr.Groups = 2
			return b.g
		}, []string{`"conv1"`, "groups"}},
		{"weight without bias", func(b *builder) *graph.Graph {
			delete(b.g.Node("bn1").Params, graph.RoleBias)
			return b.g
		}, []string{`"bn1"`, "together"}},
		{"zero eps", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Attr.Eps = 0
			return b.g
		}, []string{`"bn1"`, "eps"}},
		{"momentum above one", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Attr.Momentum = 2
			return b.g
		}, []string{`"bn1"`, "momentum"}},
		{"layer inside another layer", func(b *builder) *graph.Graph {
			n := b.g.Node("conv2")
			n.Params[graph.RoleWeight] = "bn1.inner.weight"
			return b.g
		}, []string{`"conv2"`, `"bn1.inner"`, `"bn1"`}},
		{"two nodes one module", func(b *builder) *graph.Graph {
			b.g.Node("conv2").Params[graph.RoleWeight] = "conv1.weight"
			return b.g
		}, []string{`"conv1"`, `"conv2"`}},
		{"segment shadows a Module attribute", func(b *builder) *graph.Graph {
			b.g.Node("conv2").Params[graph.RoleWeight] = "head.eval.weight"
			return b.g
		}, []string{`"conv2"`, `"eval"`}},
		{"empty segment", func(b *builder) *graph.Graph {
			b.g.Node("conv2").Params[graph.RoleWeight] = "head..weight"
			return b.g
		}, []string{`"conv2"`, "empty segment"}},
		{"sign on a conv", func(b *builder) *graph.Graph {
			n := b.g.Node("conv2")
			n.Sign = []int8{1, -1, 1, 1}
			return b.g
		}, []string{`"conv2"`, "sign vector"}},
		{"sign entry zero", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Sign = []int8{1, 0, -1, 1}
			return b.g
		}, []string{`"bn1"`, "entry 1"}},
		{"sign length (graph validation)", func(b *builder) *graph.Graph {
			b.g.Node("bn1").Sign = []int8{1, -1}
			return b.g
		}, []string{`"bn1"`, "sign vector"}},
		{"unsupported op", func(b *builder) *graph.Graph {
			b.op("odd", "Softmax", graph.Attr{}, 4, b.g.Output)
			return b.g
		}, []string{`"odd"`, "not supported"}},
		{"invalid UTF-8 name", func(b *builder) *graph.Graph {
			b.op("bad\xff", graph.OpReLU, graph.Attr{}, 4, b.g.Output)
			return b.g
		}, []string{"UTF-8"}},
		{"group value read before the group ends", func(b *builder) *graph.Graph {
			x := b.g.Node("bn1").Out
			b.mark("g", b.g.Node("conv1").Out, x)
			// conv2 reads bn1 (in the group) but conv3 is the group's last member,
			// and comes after conv2.
			c3 := b.conv("conv3", x, 4, 1, 1, 0, 1, false)
			b.mark("g", c3)
			return b.g
		}, []string{`"g"`, `"conv2"`, `"conv3"`}},
		{"bad pool geometry", func(b *builder) *graph.Graph {
			b.op("pool", graph.OpMaxPool, graph.Attr{}, 4, b.g.Output)
			return b.g
		}, []string{`"pool"`, "geometry"}},
		{"dropout probability", func(b *builder) *graph.Graph {
			b.op("drop", graph.OpDropout, graph.Attr{P: 1.5}, 4, b.g.Output)
			return b.g
		}, []string{`"drop"`, "1.5"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := tc.breakG(small())
			src, err := Python(g, Options{})
			if err == nil {
				t.Fatalf("no error; emitted:\n%s", src)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %s", err, w)
				}
			}
		})
	}
	if _, err := Python(nil, Options{}); err == nil {
		t.Error("nil graph: no error")
	}
	if _, err := Python(small().g, Options{}); err != nil {
		t.Errorf("the unbroken base graph fails: %v", err)
	}
}

func TestPyFloat(t *testing.T) {
	for _, c := range []struct {
		in   float64
		want string
	}{
		{1e-5, "1e-05"}, {0.1, "0.1"}, {1, "1.0"}, {0, "0.0"}, {-2.5, "-2.5"},
		{1e21, "1e+21"}, {0.001, "0.001"}, {1.0 / 3, "0.3333333333333333"},
		{math.NaN(), `float("nan")`}, {math.Inf(-1), `-float("inf")`},
	} {
		if got := pyFloat(c.in); got != c.want {
			t.Errorf("pyFloat(%v) = %s, want %s", c.in, got, c.want)
		}
	}
}

func TestSignMask(t *testing.T) {
	for _, c := range []struct {
		sign  []int8
		want  string
		flips int
	}{
		{[]int8{1, -1, 1, 1, -1}, "0x12", 2},
		{[]int8{1, 1, 1}, "0x0", 0},
		{[]int8{-1}, "0x1", 1},
	} {
		got, flips, err := signMask(c.sign)
		if err != nil || got != c.want || flips != c.flips {
			t.Errorf("signMask(%v) = %s, %d, %v; want %s, %d", c.sign, got, flips, err, c.want, c.flips)
		}
	}
	// A wide vector decodes back bit for bit.
	sign := make([]int8, 2048)
	for i := range sign {
		sign[i] = 1
		if i%7 == 3 || i == 2047 {
			sign[i] = -1
		}
	}
	mask, _, err := signMask(sign)
	if err != nil {
		t.Fatal(err)
	}
	var m big.Int
	if _, ok := m.SetString(strings.TrimPrefix(mask, "0x"), 16); !ok {
		t.Fatalf("mask %q does not parse", mask)
	}
	for i, s := range sign {
		if (m.Bit(i) == 1) != (s < 0) {
			t.Fatalf("channel %d: bit %d, sign %d", i, m.Bit(i), s)
		}
	}
}

func TestPrivate(t *testing.T) {
	b := residual()
	for _, c := range []struct {
		node string // the node whose input is judged
		want bool
	}{
		{"module.bn1", true},             // conv output, read once
		{"module.layer1.0.bn1", true},    // idem
		{"module.layer1.0.conv1", false}, // stem norm output: read twice, and saved
		{"module.layer2.0.bn1", false},   // relu output read twice
		{"module.layer2.1.bn1", false},   // add output read twice
		{"module.layer1.0.act", true},    // add output read once
		{"module.layer1.1.relu", true},   // add output read once
		{"module.layer1.0.conv2", false}, // InPlaceABN output: saved for backward
		{"module.layer1.1.conv1", false}, // leaky output read by two convs
		{"module.layer1.1.downsample.1", true},
	} {
		n := b.g.Node(c.node)
		if n == nil {
			t.Fatalf("no node %q", c.node)
		}
		if got := private(n.Inputs[0], b.g); got != c.want {
			t.Errorf("input of %s: private = %v, want %v", c.node, got, c.want)
		}
	}
	if private(b.g.Input, b.g) {
		t.Error("the graph input is the caller's tensor, never private")
	}
}

func TestAllPositiveSignEmitsNothing(t *testing.T) {
	b := small()
	b.g.Node("bn1").Sign = []int8{1, 1, 1, 1}
	src, err := Python(b.g, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(src), "input_sign") {
		t.Errorf("an all-positive sign vector produced a flip:\n%s", src)
	}
}

// TestSyntax compiles emitted sources whose names and header are full of
// quotes, backslashes, newlines and non-ASCII text: none of it may escape
// its string or comment. Needs only a Python interpreter.
func TestSyntax(t *testing.T) {
	if _, err := os.Stat(python); err != nil {
		t.Skipf("no %s", python)
	}
	b := oddNames()
	src, err := Python(b.g, Options{Header: "a \"\"\" b \\ c\n\"\"\"; import os\n\x01 \u00e9"})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "m.py")
	if err := os.WriteFile(path, src, 0o644); err != nil {
		t.Fatal(err)
	}
	check := `import ast, sys
tree = ast.parse(open(sys.argv[1], encoding="utf-8").read())
doc = ast.get_docstring(tree)
assert "import os" in doc, doc
imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
assert all(a.name != "os" for n in imports for a in n.names), "header text became code"
`
	if out, err := exec.Command(python, "-c", check, path).CombinedOutput(); err != nil {
		t.Fatalf("emitted source does not parse as intended: %v\n%s\n%s", err, out, src)
	}
}

// oddNames has module paths and node names with quotes, backslashes,
// newlines and non-ASCII characters.
func oddNames() *builder {
	b := newBuilder("odd \"names\"\\", 3)
	x := b.conv("mod\"ule.c\\onv", b.g.Input, 4, 3, 1, 1, 1, false)
	x = b.norm(graph.OpInPlaceABN, "mod\"ule.b\u00f1.0", x, graph.ActLeakyReLU, 0.01)
	x = b.op("add\nnewline", graph.OpAdd, graph.Attr{}, 4, x, x)
	b.op("relu'#", graph.OpReLU, graph.Attr{}, 4, x)
	return b
}
