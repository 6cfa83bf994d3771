package arch

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/emit"
	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/runtime"
)

// Fixtures of fixtures/structure.py (real torch 1.13, torchvision 0.14).
func structureFixture(name string) string {
	return filepath.Join("..", "fixtures", "testdata", "structure", name)
}

type structureGolden struct {
	Keys            []string  `json:"keys"`
	InputShape      []int     `json:"input_shape"`
	Input           []float32 `json:"input"`
	Output          []float32 `json:"output"`
	UndilatedOutput []float32 `json:"undilated_output"`
}

func readStructureGolden(t *testing.T, name string) *structureGolden {
	t.Helper()
	b, err := os.ReadFile(structureFixture(name + ".golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g structureGolden
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	return &g
}

func openModule(t *testing.T, name string) (*pth.Checkpoint, *pth.Module) {
	t.Helper()
	ck, m, err := pth.OpenModule(structureFixture(name + ".pth"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	return ck, m
}

// eval runs g over w in the runtime, eval mode.
func eval(t *testing.T, g *graph.Graph, w graph.Weights, shape []int, x []float32) []float32 {
	t.Helper()
	ex, err := runtime.New(g, w, runtime.NewCPU(0), runtime.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ex.Close()
	in := runtime.NewHostTensor(shape...)
	copy(in.Data, x)
	y, err := ex.Forward(in, false)
	if err != nil {
		t.Fatal(err)
	}
	return y.Data
}

// relErr is the largest absolute difference over the largest magnitude.
func relErr(got, want []float32) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	d, s := 0.0, 0.0
	for i := range want {
		d = math.Max(d, math.Abs(float64(got[i])-float64(want[i])))
		s = math.Max(s, math.Abs(float64(want[i])))
	}
	return d / s
}

func hasNote(m *Match, sub string) bool {
	for _, n := range m.Notes {
		if strings.Contains(n, sub) {
			return true
		}
	}
	return false
}

// TestDilatedModule: a ResNet built with replace_stride_with_dilation =
// [False, True, True] and pickled whole is rebuilt with every convolution's
// stride, padding and dilation (torch's golden within 1e-4); its state
// dict alone gives the undilated network torchvision's defaults describe,
// and says so.
func TestDilatedModule(t *testing.T) {
	gold := readStructureGolden(t, "dilated_module")
	if e := relErr(gold.UndilatedOutput, gold.Output); e < 1e-3 {
		t.Fatalf("the fixture does not tell the structures apart: undilated output within %.2e", e)
	}
	ck, m := openModule(t, "dilated_module")
	g, match, err := FromModule(m, ck, "auto")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		node                      string
		stride, padding, dilation int
	}{
		{"layer2.0.conv2", 2, 1, 1},
		{"layer2.0.downsample.0", 2, 0, 1},
		{"layer3.0.conv2", 1, 1, 1}, // the first dilated block keeps the previous dilation
		{"layer3.0.downsample.0", 1, 0, 1},
		{"layer3.1.conv2", 1, 2, 2},
		{"layer4.0.conv2", 1, 2, 2},
		{"layer4.0.downsample.0", 1, 0, 1},
		{"layer4.1.conv2", 1, 4, 4},
	} {
		n := g.Node(c.node)
		if n == nil {
			t.Fatalf("no node %s", c.node)
		}
		a := n.Attr
		if a.Stride != [2]int{c.stride, c.stride} || a.Padding != [2]int{c.padding, c.padding} || a.Dilation != [2]int{c.dilation, c.dilation} {
			t.Errorf("%s: stride %v padding %v dilation %v, want %d %d %d", c.node, a.Stride, a.Padding, a.Dilation, c.stride, c.padding, c.dilation)
		}
	}
	if e := relErr(eval(t, g, ck, gold.InputShape, gold.Input), gold.Output); e > 1e-4 {
		t.Errorf("whole module: eval output rel %.2e against torch", e)
	}
	if hasNote(match, assumedPrefix) || !hasNote(match, "3 dilated convolutions") {
		t.Errorf("whole module notes: %q", match.Notes)
	}

	sg, sm, err := Recognize(ck, "auto")
	if err != nil {
		t.Fatal(err)
	}
	if e := relErr(eval(t, sg, ck, gold.InputShape, gold.Input), gold.UndilatedOutput); e > 1e-4 {
		t.Errorf("state dict: eval output rel %.2e against the undilated network", e)
	}
	if !hasNote(sm, assumedPrefix+" from torchvision's constructor defaults") || !hasNote(sm, "no dilation") ||
		!hasNote(sm, "--graph") || !hasNote(sm, "whole pickled module") {
		t.Errorf("state dict notes do not state the assumed structure: %q", sm.Notes)
	}
}

// TestSegmentationModules: FCN and DeepLabV3 pickled whole are read with
// their backbone's dilation and the ASPP rates of their modules; their
// state dicts alone are recognised too, with torchvision's constructor
// dilation, and give the same graph save for the ASPP rates a state dict
// cannot hold.
func TestSegmentationModules(t *testing.T) {
	for _, c := range []struct {
		name   string
		arch   string
		rates  []int // ASPP rates of the module
		resize int
	}{
		{"fcn_module", "fcn (backbone resnet (Bottleneck [1 1 2 2], width 4, replace_stride_with_dilation [False, True, True], groups 2, width_per_group 32), 3 classes)", nil, 1},
		{"deeplab_module", "deeplabv3 (backbone resnet (Bottleneck [1 1 2 2], width 4, replace_stride_with_dilation [False, True, True], groups 2, width_per_group 32), 3 classes)", []int{2, 3, 5}, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			ck, m := openModule(t, c.name)
			g, match, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if match.Family != FamilySegmentation || match.Arch != c.arch {
				t.Errorf("family %s, arch %q", match.Family, match.Arch)
			}
			if n := countOps(g)[graph.OpResize]; n != c.resize {
				t.Errorf("%d Resize nodes, want %d", n, c.resize)
			}
			if out := g.Output.Producer; out.Op != graph.OpResize || out.Inputs[1] != g.Input || out.Attr.Mode != "bilinear" || out.Attr.AlignCorners {
				t.Errorf("output %s", out.Name)
			}
			if d := g.Node("backbone.layer4.1.conv2").Attr.Dilation; d != [2]int{4, 4} {
				t.Errorf("backbone.layer4.1.conv2 dilation %v", d)
			}
			for i, r := range c.rates {
				n := g.Node("classifier.0.convs." + string(rune('1'+i)) + ".0")
				if n.Attr.Dilation != [2]int{r, r} || n.Attr.Padding != [2]int{r, r} {
					t.Errorf("%s: dilation %v padding %v, want %d", n.Name, n.Attr.Dilation, n.Attr.Padding, r)
				}
			}
			checkCoverage(t, g, ck)

			sg, sm, err := Recognize(ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if sm.Family != FamilySegmentation || !hasNote(sm, "replace_stride_with_dilation=[False, True, True]") {
				t.Errorf("state dict: family %s, notes %q", sm.Family, sm.Notes)
			}
			want := strings.Split(g.String(), "\n")[1:]
			got := strings.Split(sg.String(), "\n")[1:]
			if len(got) != len(want) {
				t.Fatalf("state dict graph has %d lines, module graph %d", len(got), len(want))
			}
			differ := 0
			for i := range got {
				if got[i] != want[i] {
					differ++
					if !strings.HasPrefix(got[i], "classifier.0.convs.") || !strings.Contains(got[i], "d[12 12]") && !strings.Contains(got[i], "d[24 24]") && !strings.Contains(got[i], "d[36 36]") {
						t.Errorf("state dict graph differs:\n%s\nmodule:\n%s", got[i], want[i])
					}
				}
			}
			if differ != len(c.rates) {
				t.Errorf("%d lines differ, want %d (the ASPP rates)", differ, len(c.rates))
			}
		})
	}
}

// TestModulesInTorch runs the modules emitted from the rebuilt graphs with
// real PyTorch, with the original state dicts loaded strictly, against the
// original pickled modules at another input size (fixtures/structure.py
// check): the segmentation models' Resize is not in abnconvert's runtime,
// so torch is their oracle.
func TestModulesInTorch(t *testing.T) {
	const python = "/usr/bin/python3"
	if testing.Short() {
		t.Skip("runs PyTorch")
	}
	if err := exec.Command(python, "-c", "import torch, torchvision").Run(); err != nil {
		t.Skipf("%s cannot import torch: %v", python, err)
	}
	// The emitted module imports inplace_abn; fixtures/standin stands in.
	standin, err := filepath.Abs(filepath.Join("..", "fixtures", "standin"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, name := range []string{"dilated_module", "fcn_module", "deeplab_module", "regnet_module", "mnasnet_module", "googlenet_module", "resnet_head_module", "vgg_head_module",
		"efficientnet_module", "lraspp_module"} {
		t.Run(name, func(t *testing.T) {
			ck, m := openModule(t, name)
			g, _, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			src, err := emit.Python(g, emit.Options{})
			if err != nil {
				t.Fatal(err)
			}
			mod := filepath.Join(dir, name+".py")
			if err := os.WriteFile(mod, src, 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(python, filepath.Join("..", "fixtures", "structure.py"), "check", structureFixture(name+".pth"), "-", mod)
			cmd.Env = append(os.Environ(), "PYTHONPATH="+standin)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			t.Logf("%s", strings.TrimSpace(string(out)))
		})
	}
}

// TestModuleRefusals: module trees the builders must refuse, each with the
// module path, the attribute and the class of the error: an attribute
// value abnconvert does not model is unsupported (exit 4), never ignored.
func TestModuleRefusals(t *testing.T) {
	i := func(v int64) pth.Value { return v }
	pair := func(a, b int64) pth.Value { return &pth.Tuple{Items: []pth.Value{a, b}} }
	conv := func(attrs map[string]pth.Value) *pth.Module {
		a := map[string]pth.Value{"in_channels": i(3), "out_channels": i(4), "groups": i(1), "padding_mode": "zeros",
			"transposed": false, "output_padding": pair(0, 0), "kernel_size": pair(3, 3), "stride": pair(1, 1), "dilation": pair(1, 1), "padding": pair(1, 1)}
		for k, v := range attrs {
			a[k] = v
		}
		return &pth.Module{Class: "torch.nn.modules.conv.Conv2d", Attrs: a, Params: []pth.NamedTensor{{Name: "weight", Tensor: &pth.Tensor{}}}}
	}
	mod := func(class string, attrs map[string]pth.Value) *pth.Module {
		return &pth.Module{Class: class, Attrs: attrs}
	}
	bn := func(attrs map[string]pth.Value) *pth.Module {
		a := map[string]pth.Value{"num_features": i(4), "eps": 1e-5, "momentum": 0.1, "affine": true, "track_running_stats": true}
		for k, v := range attrs {
			a[k] = v
		}
		m := mod("torch.nn.modules.batchnorm.BatchNorm2d", a)
		for _, r := range []string{"weight", "bias", "running_mean", "running_var"} {
			m.Params = append(m.Params, pth.NamedTensor{Name: r, Tensor: &pth.Tensor{}})
		}
		return m
	}
	pool := func(attrs map[string]pth.Value) *pth.Module {
		a := map[string]pth.Value{"kernel_size": i(2), "stride": i(2), "padding": i(0), "dilation": i(1), "ceil_mode": false, "return_indices": false}
		for k, v := range attrs {
			a[k] = v
		}
		return mod("torch.nn.modules.pooling.MaxPool2d", a)
	}
	up := func(attrs map[string]pth.Value) *pth.Module {
		a := map[string]pth.Value{"name": "Upsample", "size": nil, "scale_factor": 2.0, "mode": "bilinear", "align_corners": false, "recompute_scale_factor": nil}
		for k, v := range attrs {
			a[k] = v
		}
		return mod("torch.nn.modules.upsampling.Upsample", a)
	}
	seq := func(children ...*pth.Module) *pth.Module {
		m := &pth.Module{Class: classSequential}
		for k, c := range children {
			m.Children = append(m.Children, pth.Child{Name: string(rune('0' + k)), Module: c})
		}
		return m
	}
	// resnet returns the dilated fixture's tree with one module changed.
	resnet := func(path string, change func(m *pth.Module)) func(t *testing.T) (*pth.Module, graph.Weights) {
		return func(t *testing.T) (*pth.Module, graph.Weights) {
			ck, root := openModule(t, "dilated_module")
			m := root
			for _, seg := range strings.Split(path, ".") {
				found := false
				for _, c := range m.Children {
					if c.Name == seg {
						m, found = c.Module, true
						break
					}
				}
				if !found {
					t.Fatalf("no module %s", path)
				}
			}
			change(m)
			return root, ck
		}
	}
	// hand gives a hand-built tree the tensors its attributes imply, so
	// that each case fails for its own reason.
	hand := func(m *pth.Module) func(t *testing.T) (*pth.Module, graph.Weights) {
		return func(*testing.T) (*pth.Module, graph.Weights) {
			w := graph.NewMemWeights()
			var walk func(m *pth.Module, path string)
			walk = func(m *pth.Module, path string) {
				for _, p := range m.Params {
					var shape []int
					if m.ShortClass() == "Conv2d" {
						o, _ := integer(m.Attr("out_channels"))
						in, _ := integer(m.Attr("in_channels"))
						g, _ := integer(m.Attr("groups"))
						k, _ := pairAttr(m, "kernel_size")
						shape = []int{o, in / max(g, 1), k[0], k[1]}
					} else {
						f, _ := integer(m.Attr("num_features"))
						shape = []int{f}
					}
					w.Put(path+"."+p.Name, shape, make([]float64, graph.Numel(shape)))
				}
				for _, c := range m.Children {
					walk(c.Module, join(path, c.Name))
				}
			}
			walk(m, "")
			return m, w
		}
	}
	unsupported, bad := failure.Unsupported, failure.BadInput
	cases := []struct {
		name string
		tree func(t *testing.T) (*pth.Module, graph.Weights)
		want string
		kind failure.Kind
	}{
		{"custom root", hand(mod("__main__.Net", nil)), "abnconvert rebuilds the forward of nn.Sequential chains", unsupported},
		{"starts with relu", hand(seq(mod("torch.nn.modules.activation.ReLU", map[string]pth.Value{"inplace": false}))), "must start with a Conv2d", bad},
		{"reflect padding", hand(seq(conv(map[string]pth.Value{"padding_mode": "reflect"}))), `0 (Conv2d): padding_mode "reflect"`, unsupported},
		{"same padding, even kernel", hand(seq(conv(map[string]pth.Value{"padding": "same", "kernel_size": pair(2, 2)}))), "pads asymmetrically", unsupported},
		{"transposed", hand(seq(conv(map[string]pth.Value{"transposed": true}))), "transposed=True", unsupported},
		{"unknown conv attribute", hand(seq(conv(map[string]pth.Value{"weight_standardise": true}))), "0 (Conv2d): attribute weight_standardise = True is not one abnconvert understands", unsupported},
		{"opaque attribute", hand(seq(&pth.Module{Class: "torch.nn.modules.conv.Conv2d", Attrs: conv(nil).Attrs, Opaque: []string{"_forward_hooks", "scale_fn"}})), "attribute scale_fn (not plain data)", unsupported},
		{"stride missing", hand(seq(conv(map[string]pth.Value{"stride": nil}))), "stride is None, not an int or a pair of ints", bad},
		{"flatten all", hand(seq(conv(nil), mod("torch.nn.modules.flatten.Flatten", map[string]pth.Value{"start_dim": i(0), "end_dim": i(-1)}))), "only Flatten(start_dim=1", unsupported},
		{"bn features", hand(seq(conv(nil), bn(map[string]pth.Value{"num_features": i(5)}))), "num_features 5, but 4 channels reach it", bad},
		{"bn not affine", hand(seq(conv(nil), bn(map[string]pth.Value{"affine": false}))), "1 (BatchNorm2d): affine=False", unsupported},
		{"bn no running stats", hand(seq(conv(nil), bn(map[string]pth.Value{"track_running_stats": false}))), "track_running_stats=False", unsupported},
		{"torchvision block", hand(seq(conv(nil), &pth.Module{Class: "torchvision.models.densenet._DenseLayer", Children: []pth.Child{{Name: "conv1", Module: conv(nil)}}})), "is not a chain layer", unsupported},
		{"block without its layers", hand(seq(conv(nil), &pth.Module{Class: "torchvision.models.resnet.BasicBlock", Children: []pth.Child{{Name: "conv1", Module: conv(nil)}}})), "1.conv1 (Conv2d): in_channels 3, but 4 channels reach it", bad},
		{"max pool indices", hand(seq(conv(nil), pool(map[string]pth.Value{"return_indices": true}))), "return_indices", unsupported},
		{"max pool dilation", hand(seq(conv(nil), pool(map[string]pth.Value{"dilation": i(2)}))), "1 (MaxPool2d): dilation [2 2]: dilated max pooling is not modelled", unsupported},
		{"avg pool divisor", hand(seq(conv(nil), mod("torch.nn.modules.pooling.AvgPool2d", map[string]pth.Value{"kernel_size": i(2), "stride": nil, "padding": i(0), "ceil_mode": false, "count_include_pad": true, "divisor_override": i(3)}))), "divisor_override 3", unsupported},
		{"pool kernel", hand(seq(conv(nil), mod("torch.nn.modules.pooling.AvgPool2d", map[string]pth.Value{"kernel_size": "x"}))), "kernel_size is 'x'", bad},
		{"relu inplace", hand(seq(conv(nil), mod("torch.nn.modules.activation.ReLU", map[string]pth.Value{"inplace": i(1)}))), "inplace is 1, not a bool", bad},
		{"dropout p", hand(seq(conv(nil), mod("torch.nn.modules.dropout.Dropout", map[string]pth.Value{"p": 1.5, "inplace": false}))), "p is 1.5, not a probability", bad},
		{"upsample bicubic", hand(seq(conv(nil), up(map[string]pth.Value{"mode": "bicubic"}))), "1 (Upsample): mode 'bicubic': only nearest and bilinear", unsupported},
		{"upsample trilinear", hand(seq(conv(nil), up(map[string]pth.Value{"mode": "trilinear"}))), "mode 'trilinear'", unsupported},
		{"upsample recompute 1.5", hand(seq(conv(nil), up(map[string]pth.Value{"scale_factor": 1.5, "recompute_scale_factor": true}))),
			"recompute_scale_factor=True with scale_factor 1.5", unsupported},
		{"upsample size and scale", hand(seq(conv(nil), up(map[string]pth.Value{"size": pair(4, 4)}))), "wants exactly one", bad},
		{"upsample neither", hand(seq(conv(nil), up(map[string]pth.Value{"scale_factor": nil}))), "wants exactly one", bad},
		{"upsample nearest aligned", hand(seq(conv(nil), up(map[string]pth.Value{"mode": "nearest", "align_corners": true}))), "align_corners True with mode 'nearest'", bad},
		{"upsample negative", hand(seq(conv(nil), up(map[string]pth.Value{"scale_factor": -2.0}))), "scale_factor is -2, not a positive number", bad},
		{"upsample empty tuple", hand(seq(conv(nil), up(map[string]pth.Value{"scale_factor": &pth.Tuple{}}))), "scale_factor is (), not a positive number", bad},
		{"upsample three factors", hand(seq(conv(nil), up(map[string]pth.Value{"scale_factor": &pth.Tuple{Items: []pth.Value{2.0, 2.0, 2.0}}}))), "scale_factor is (2, 2, 2)", bad},
		{"upsample recompute with size", hand(seq(conv(nil), up(map[string]pth.Value{"scale_factor": nil, "size": i(8), "recompute_scale_factor": true}))), "with a size", bad},
		{"stochastic depth mode", hand(seq(conv(nil), mod("torchvision.ops.stochastic_depth.StochasticDepth", map[string]pth.Value{"p": 0.2, "mode": "column"}))), "mode 'column': want row or batch", unsupported},
		{"gelu tanh", hand(seq(conv(nil), mod("torch.nn.modules.activation.GELU", map[string]pth.Value{"approximate": "tanh"}))), "approximate 'tanh': only the exact GELU is modelled", unsupported},
		{"softsign", hand(seq(conv(nil), mod("torch.nn.modules.activation.Softsign", nil))), "Softsign is not a layer abnconvert's IR models yet", unsupported},
		{"softplus beta 0", hand(seq(conv(nil), mod("torch.nn.modules.activation.Softplus", map[string]pth.Value{"beta": int64(0), "threshold": 20.0}))), "1 (Softplus): beta 0, threshold 20: want finite numbers, beta nonzero", bad},
		{"celu alpha 0", hand(seq(conv(nil), mod("torch.nn.modules.activation.CELU", map[string]pth.Value{"alpha": 0.0, "inplace": false}))), "1 (CELU): alpha is 0", bad},
		{"selu unknown attribute", hand(seq(conv(nil), mod("torch.nn.modules.activation.SELU", map[string]pth.Value{"inplace": false, "alpha": 2.0}))), "attribute alpha = 2", unsupported},
		{"resnet reflect padding", resnet("layer3.1.conv2", func(m *pth.Module) { m.Attrs["padding_mode"] = "reflect" }), `layer3.1.conv2 (Conv2d): padding_mode "reflect"`, unsupported},
		{"resnet unknown bn attribute", resnet("layer4.1.bn2", func(m *pth.Module) { m.Attrs["frozen"] = true }), "layer4.1.bn2 (BatchNorm2d): attribute frozen = True", unsupported},
		{"resnet replaced activation", resnet("layer1.0.relu", func(m *pth.Module) {
			m.Class = "torch.nn.modules.activation.Softsign"
		}), "layer1.0.relu (Softsign): torch.nn.modules.activation.Softsign is not a layer", unsupported},
		{"resnet block attribute", resnet("layer2.0", func(m *pth.Module) { m.Attrs["drop_path"] = 0.1 }), "layer2.0 (Bottleneck): attribute drop_path = 0.1", unsupported},
		{"resnet extra module", resnet("layer2.0", func(m *pth.Module) {
			m.Children = append(m.Children, pth.Child{Name: "se", Module: mod("torch.nn.modules.activation.Sigmoid", nil)})
		}), "layer2.0.se (torch.nn.modules.activation.Sigmoid): not a module torchvision's forward uses", unsupported},
		{"weight disagrees with attributes", func(t *testing.T) (*pth.Module, graph.Weights) {
			m := seq(conv(nil))
			w := graph.NewMemWeights()
			w.Put("0.weight", []int{4, 3, 5, 5}, make([]float64, 300))
			return m, w
		}, "0 (Conv2d): 0.weight has shape [4 3 5 5], but the module's attributes give [4 3 3 3]", bad},
		{"resnet conv geometry", resnet("layer1.0.conv2", func(m *pth.Module) { m.Attrs["kernel_size"] = pair(5, 5) }), "kernel_size [5 5], groups 2, but its weight gives", bad},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m, w := c.tree(t)
			_, _, err := FromModule(m, w, "auto")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
			if k := failure.Of(err); k != c.kind {
				t.Errorf("class %v, want %v", k, c.kind)
			}
		})
	}
	// Both of torchvision's StochasticDepth modes are read.
	for mode, want := range map[string]string{"row": "", "batch": graph.StochasticBatch} {
		m, w := hand(seq(conv(nil), mod("torchvision.ops.stochastic_depth.StochasticDepth", map[string]pth.Value{"p": 0.2, "mode": mode})))(t)
		g, _, err := FromModule(m, w, "auto")
		if err != nil {
			t.Fatalf("StochasticDepth mode %s: %v", mode, err)
		}
		found := false
		for _, n := range g.Nodes {
			if n.Op == graph.OpStochasticDepth {
				found = true
				if n.Attr.P != 0.2 || n.Attr.Mode != want {
					t.Errorf("StochasticDepth mode %s: p %g, mode %q, want 0.2 and %q", mode, n.Attr.P, n.Attr.Mode, want)
				}
			}
		}
		if !found {
			t.Errorf("StochasticDepth mode %s: no node", mode)
		}
	}
}

// TestModuleActivationSwap: a torchvision ResNet whose ReLU module was
// replaced by a LeakyReLU is followed (the forward calls the module), and
// so is one whose max pool became an average pool (ResNet's forward over
// the tree).
func TestModuleActivationSwap(t *testing.T) {
	ck, root := openModule(t, "dilated_module")
	for _, c := range root.Children {
		if c.Name == "relu" {
			c.Module.Class = "torch.nn.modules.activation.LeakyReLU"
			c.Module.Attrs["negative_slope"] = 0.2
		}
	}
	g, _, err := FromModule(root, ck, "auto")
	if err != nil {
		t.Fatal(err)
	}
	if n := g.Node("relu"); n.Op != graph.OpLeakyReLU || n.Attr.ActParam != 0.2 {
		t.Errorf("stem activation %s(%g)", n.Op, n.Attr.ActParam)
	}
	for _, c := range root.Children {
		if c.Name == "maxpool" {
			c.Module.Class = "torch.nn.modules.pooling.AvgPool2d"
			c.Module.Attrs = map[string]pth.Value{"kernel_size": int64(3), "stride": int64(2), "padding": int64(1), "ceil_mode": false, "count_include_pad": false, "divisor_override": nil}
		}
	}
	if g, _, err = FromModule(root, ck, "auto"); err != nil {
		t.Fatal(err)
	}
	if n := g.Node("maxpool"); n.Op != graph.OpAvgPool || n.Attr.CountIncludePad || n.Attr.Stride != [2]int{2, 2} {
		t.Errorf("stem pool %s %+v", n.Op, n.Attr)
	}
	if n := g.Node("relu"); n.Op != graph.OpLeakyReLU {
		t.Errorf("stem activation %s", n.Op)
	}
}

// TestTorchvisionModules: torchvision 0.14's four segmentation models,
// pickled whole at full size by real torch, are read as data through the
// allowlist (nothing executed). The ResNet-based ones are rebuilt, named
// and dilated as their constructors build them; the MobileNetV3-based ones
// are refused as unsupported, naming what is missing. With aux_loss the
// second head is an auxiliary output. The other BatchNorm
// classifiers are read as data too, and refused as unsupported by name.
func TestTorchvisionModules(t *testing.T) {
	const python = "/usr/bin/python3"
	if testing.Short() {
		t.Skip("runs PyTorch and writes 400 MB")
	}
	if err := exec.Command(python, "-c", "import torchvision").Run(); err != nil {
		t.Skipf("%s cannot import torchvision: %v", python, err)
	}
	dir := t.TempDir()
	script := `import sys, torch
from torchvision.models import segmentation as S
for name in sys.argv[2:]:
    aux = name.endswith("_aux")
    make = getattr(S, name[:-4] if aux else name)
    torch.save(make(weights=None, weights_backbone=None, aux_loss=aux), sys.argv[1] + "/" + name + ".pth")
`
	names := []string{"fcn_resnet50", "deeplabv3_resnet50", "lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "deeplabv3_resnet50_aux",
		"deeplabv3_mobilenet_v3_large_aux"}
	if out, err := exec.Command(python, append([]string{"-c", script, dir}, names...)...).CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// The other BatchNorm classifiers, smallest of each family.
	// want: "" when rebuilt, else the start of the error.
	classifiers := map[string]string{"mobilenet_v2": "", "mobilenet_v3_small": "",
		"efficientnet_b0": "", "efficientnet_v2_s": "",
		"regnet_y_400mf": "", "regnet_x_400mf": "",
		"shufflenet_v2_x0_5": "", "mnasnet0_5": "",
		"googlenet": "", "inception_v3": ""}
	script = `import sys, torch, torchvision
for name in sys.argv[2:]:
    kw = {"init_weights": False} if name in ("googlenet", "inception_v3") else {}
    torch.save(getattr(torchvision.models, name)(weights=None, **kw), sys.argv[1] + "/" + name + ".pth")
`
	var cl []string
	for n := range classifiers {
		cl = append(cl, n)
	}
	if out, err := exec.Command(python, append([]string{"-c", script, dir}, cl...)...).CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for name, want := range classifiers {
		t.Run(name, func(t *testing.T) {
			ck, m, err := pth.OpenModule(filepath.Join(dir, name+".pth"))
			if err != nil {
				t.Fatalf("not read as data: %v", err)
			}
			defer ck.Close()
			g, _, err := FromModule(m, ck, "auto")
			if want == "" {
				if err != nil {
					t.Fatal(err)
				}
				checkCoverage(t, g, ck)
				// googlenet() and inception_v3() build their auxiliary
				// classifiers by default: outputs in training only, and
				// the state dict alone gives the same graph.
				wantAux := map[string]int{"googlenet": 2, "inception_v3": 1}[name]
				if len(g.Aux) != wantAux {
					t.Fatalf("%d auxiliary outputs, want %d", len(g.Aux), wantAux)
				}
				for _, a := range g.Aux {
					if !a.TrainOnly || a.Value.Channels != 1000 {
						t.Errorf("aux %s: training only %v, %d classes", a.Name, a.TrainOnly, a.Value.Channels)
					}
				}
				if wantAux > 0 {
					sg, _, err := Recognize(ck, "auto")
					if err != nil {
						t.Fatal(err)
					}
					if a, b := strings.SplitN(sg.String(), "\n", 2)[1], strings.SplitN(g.String(), "\n", 2)[1]; a != b {
						t.Errorf("the state dict's graph differs from the module's")
					}
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), want) || failure.Of(err) != failure.Unsupported {
				t.Fatalf("error %v (%v), want %q", err, failure.Of(err), want)
			}
		})
	}
	// The MobileNetV3 segmentation models: rebuilt from the tree, the
	// dilation of the last blocks read from it (TestFullSizeTreeStateDicts
	// compares them with their state dicts' graphs).
	for _, name := range []string{"lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large_aux"} {
		t.Run(name, func(t *testing.T) {
			ck, m, err := pth.OpenModule(filepath.Join(dir, name+".pth"))
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			g, _, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if d := g.Node("backbone.15.block.1.0").Attr.Dilation; d != [2]int{2, 2} {
				t.Errorf("backbone.15.block.1.0 dilation %v", d)
			}
			checkCoverage(t, g, ck)
			if !strings.HasSuffix(name, "_aux") {
				return
			}
			// FCNHead(40, 21) on features[4], resized to the input; the
			// state dict alone gives the same graph.
			if len(g.Aux) != 1 || g.Aux[0].Name != "aux" || g.Aux[0].TrainOnly || g.Aux[0].Value.Channels != 21 {
				t.Fatalf("aux %+v", g.Aux)
			}
			if in := g.Node("aux_classifier.0").Inputs[0]; !strings.HasPrefix(in.Producer.Name, "backbone.4.") {
				t.Errorf("aux_classifier.0 reads %s, want features[4]'s output", in.Producer.Name)
			}
			sg, _, err := Recognize(ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if a, b := strings.SplitN(sg.String(), "\n", 2)[1], strings.SplitN(g.String(), "\n", 2)[1]; a != b {
				t.Errorf("the state dict's graph differs from the module's")
			}
		})
	}
	for _, c := range []struct {
		name, want string // want: the error, "" for none
		arch       string
		aux        int
	}{
		{"fcn_resnet50", "", "fcn_resnet50", 0},
		{"deeplabv3_resnet50", "", "deeplabv3_resnet50", 0},
		{"deeplabv3_resnet50_aux", "", "deeplabv3_resnet50 (aux_loss=True)", 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			ck, m, err := pth.OpenModule(filepath.Join(dir, c.name+".pth"))
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			g, match, err := FromModule(m, ck, "auto")
			if c.want != "" {
				if err == nil || !strings.Contains(err.Error(), c.want) || failure.Of(err) != failure.Unsupported {
					t.Fatalf("error %v (%v), want unsupported, %q", err, failure.Of(err), c.want)
				}
				t.Logf("%v", err)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if match.Arch != c.arch || !match.Exact {
				t.Errorf("arch %q exact %v", match.Arch, match.Exact)
			}
			if len(g.Aux) != c.aux {
				t.Fatalf("%d auxiliary outputs, want %d", len(g.Aux), c.aux)
			}
			if c.aux > 0 {
				// FCNHead(1024, 21) on layer3's output, resized to the input.
				a := g.Aux[0]
				if a.Name != "aux" || a.TrainOnly || a.Value.Producer.Op != graph.OpResize || a.Value.Channels != 21 {
					t.Errorf("aux %+v: %s with %d channels", a, a.Value.Producer.Op, a.Value.Channels)
				}
				if in := g.Node("aux_classifier.0").Inputs[0]; in.Producer.Name != "backbone.layer3.5.relu:3" && !strings.HasPrefix(in.Producer.Name, "backbone.layer3.5") {
					t.Errorf("aux_classifier.0 reads %s, want layer3's output", in.Producer.Name)
				}
			}
			if d := g.Node("backbone.layer4.2.conv2").Attr.Dilation; d != [2]int{4, 4} {
				t.Errorf("backbone.layer4.2.conv2 dilation %v", d)
			}
			checkCoverage(t, g, ck)
			// The state dict alone: the same graph (torchvision's rates).
			sg, _, err := Recognize(ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if a, b := strings.SplitN(sg.String(), "\n", 2)[1], strings.SplitN(g.String(), "\n", 2)[1]; a != b {
				t.Errorf("the state dict's graph differs from the module's")
			}
		})
	}
}

// TestTreeModules: RegNet, MNASNet and GoogLeNet, whose state dicts are not
// recognised, are rebuilt from their pickled module trees alone and
// compute what torch computed (golden within 1e-4).
func TestTreeModules(t *testing.T) {
	for _, c := range []struct{ name, arch string }{
		{"regnet_module", "regnet ("},
		{"mnasnet_module", "mnasnet ("},
		{"googlenet_module", "googlenet ("},
		{"resnet_head_module", "resnet ("},
		{"vgg_head_module", "vgg ("},
		{"efficientnet_module", "efficientnet ("},
		{"lraspp_module", "lraspp ("},
	} {
		t.Run(c.name, func(t *testing.T) {
			gold := readStructureGolden(t, c.name)
			ck, m := openModule(t, c.name)
			g, match, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(match.Arch, c.arch) {
				t.Errorf("arch %q", match.Arch)
			}
			checkCoverage(t, g, ck)
			if e := relErr(eval(t, g, ck, gold.InputShape, gold.Input), gold.Output); e > 1e-4 {
				t.Errorf("eval output rel %.2e against torch", e)
			}
		})
	}
}

// TestTreeFallbacks: each family's forward rebuilt over the module tree
// alone gives, for its whole-module fixture, the very graph the recogniser
// plus the modules' attributes give.
func TestTreeFallbacks(t *testing.T) {
	for _, c := range []struct {
		path string
		tree treeRoot
	}{
		{structureFixture("dilated_module.pth"), resnetTree},
		{filepath.Join("..", "fixtures", "testdata", "formats4", "resnet_module.pth"), resnetTree},
		{filepath.Join("..", "fixtures", "testdata", "formats4", "densenet_module.pth"), densenetTree},
		{filepath.Join("..", "fixtures", "testdata", "formats4", "vgg_module.pth"), vggTree},
	} {
		t.Run(filepath.Base(c.path), func(t *testing.T) {
			ck, m, err := pth.OpenModule(c.path)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			g, _, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			tg, _, err := fromTree(m, ck, c.tree)
			if err != nil {
				t.Fatal(err)
			}
			a, b := strings.SplitN(tg.String(), "\n", 2)[1], strings.SplitN(g.String(), "\n", 2)[1]
			if a != b {
				t.Errorf("tree graph:\n%s\nrecognised graph:\n%s", a, b)
			}
		})
	}
}

// TestFullSizeTrees: torchvision's inception_v3 (aux_logits=False),
// mobilenet_v2, mobilenet_v3_small, regnet_y_400mf, efficientnet_b0 and
// shufflenet_v2_x1_0 at full size
// (trained-like BN), pickled whole by real torch, are rebuilt from their
// module trees and compute what torch computes (1e-4).
func TestFullSizeTrees(t *testing.T) {
	const python = "/usr/bin/python3"
	if testing.Short() {
		t.Skip("runs PyTorch")
	}
	if err := exec.Command(python, "-c", "import torchvision").Run(); err != nil {
		t.Skipf("%s cannot import torchvision: %v", python, err)
	}
	dir := t.TempDir()
	script := `import json, sys, torch, torchvision
sys.path.insert(0, sys.argv[2])
from formats4 import randomise, seeded_input
M = torchvision.models
for name, make in (("inception_v3", lambda: M.inception_v3(weights=None, aux_logits=False, init_weights=False)),
                   ("mobilenet_v2", M.mobilenet_v2), ("mobilenet_v3_small", M.mobilenet_v3_small), ("regnet_y_400mf", M.regnet_y_400mf),
                   ("efficientnet_b0", M.efficientnet_b0), ("shufflenet_v2_x1_0", M.shufflenet_v2_x1_0)):
    torch.manual_seed(0)
    m = randomise(make(), 1)
    torch.save(m, sys.argv[1] + "/" + name + ".pth")
    x = seeded_input((1, 3, 96, 80))
    with torch.no_grad():
        y = m(x)
    json.dump({"input_shape": list(x.shape), "input": x.flatten().tolist(), "output": y.flatten().tolist()}, open(sys.argv[1] + "/" + name + ".golden.json", "w"))
`
	fixtures, err := filepath.Abs(filepath.Join("..", "fixtures"))
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(python, "-c", script, dir, fixtures).CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, name := range []string{"inception_v3", "mobilenet_v2", "mobilenet_v3_small", "regnet_y_400mf", "efficientnet_b0", "shufflenet_v2_x1_0"} {
		t.Run(name, func(t *testing.T) {
			ck, m, err := pth.OpenModule(filepath.Join(dir, name+".pth"))
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			g, match, err := FromModule(m, ck, "auto")
			if err != nil {
				t.Fatal(err)
			}
			checkCoverage(t, g, ck)
			b, err := os.ReadFile(filepath.Join(dir, name+".golden.json"))
			if err != nil {
				t.Fatal(err)
			}
			var gold structureGolden
			if err := json.Unmarshal(b, &gold); err != nil {
				t.Fatal(err)
			}
			if e := relErr(eval(t, g, ck, gold.InputShape, gold.Input), gold.Output); e > 1e-4 {
				t.Errorf("%s: eval output rel %.2e against torch", match.Arch, e)
			}
		})
	}
}

// TestUpsampleModules: nn.Upsample and its two subclasses in a chain
// become one-input Resizes with torch's attributes: the scale factor as
// given (one number or a pair), a fixed size, align_corners None as False,
// recompute_scale_factor=True accepted for an integer factor.
func TestUpsampleModules(t *testing.T) {
	up := func(class string, attrs map[string]pth.Value) pth.Child {
		a := map[string]pth.Value{"name": class, "size": nil, "scale_factor": nil, "mode": "nearest", "align_corners": nil, "recompute_scale_factor": nil}
		for k, v := range attrs {
			a[k] = v
		}
		return pth.Child{Module: &pth.Module{Class: "torch.nn.modules.upsampling." + class, Attrs: a}}
	}
	pair := func(a, b pth.Value) pth.Value { return &pth.Tuple{Items: []pth.Value{a, b}} }
	conv := &pth.Module{Class: "torch.nn.modules.conv.Conv2d", Attrs: map[string]pth.Value{"in_channels": int64(3), "out_channels": int64(4),
		"groups": int64(1), "padding_mode": "zeros", "transposed": false, "output_padding": pair(int64(0), int64(0)), "kernel_size": pair(int64(1), int64(1)),
		"stride": pair(int64(1), int64(1)), "dilation": pair(int64(1), int64(1)), "padding": pair(int64(0), int64(0))},
		Params: []pth.NamedTensor{{Name: "weight", Tensor: &pth.Tensor{}}}}
	children := []pth.Child{{Module: conv},
		up("Upsample", map[string]pth.Value{"scale_factor": 2.0}),
		up("UpsamplingBilinear2d", map[string]pth.Value{"scale_factor": pair(1.5, 0.5), "mode": "bilinear", "align_corners": true}),
		up("Upsample", map[string]pth.Value{"size": pair(int64(5), int64(7)), "mode": "bilinear"}),
		up("UpsamplingNearest2d", map[string]pth.Value{"size": int64(9)}),
		up("Upsample", map[string]pth.Value{"scale_factor": 3.0, "recompute_scale_factor": true}),
	}
	root := &pth.Module{Class: classSequential}
	for k, c := range children {
		c.Name = fmt.Sprint(k)
		root.Children = append(root.Children, c)
	}
	w := graph.NewMemWeights()
	w.Put("0.weight", []int{4, 3, 1, 1}, make([]float64, 12))
	g, _, err := FromModule(root, w, "auto")
	if err != nil {
		t.Fatal(err)
	}
	want := []graph.Attr{
		{Mode: "nearest", Scale: [2]float64{2, 2}},
		{Mode: "bilinear", AlignCorners: true, Scale: [2]float64{1.5, 0.5}},
		{Mode: "bilinear", Size: [2]int{5, 7}},
		{Mode: "nearest", Size: [2]int{9, 9}},
		{Mode: "nearest", Scale: [2]float64{3, 3}},
	}
	for k, a := range want {
		n := g.Node(fmt.Sprint(k + 1))
		if n == nil || n.Op != graph.OpResize || len(n.Inputs) != 1 || n.Attr != a || n.Out.Channels != 4 {
			t.Errorf("node %d: %+v, want a one-input Resize with %+v and 4 channels\n%s", k+1, n, a, g)
		}
	}
}
