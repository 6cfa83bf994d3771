package arch

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestEveryName builds each supported configuration's state dict from the
// generator (itself checked against real torchvision in
// TestGeneratorMatchesTorchvision) and checks detection and node counts.
// The counts are written out by hand from the architectures, not computed.
func TestEveryName(t *testing.T) {
	tests := []struct {
		name                                   string
		conv, bn, relu, add, concat, pool, lin int
	}{
		// ResNet convs = BNs: stem + 2 or 3 per block + downsamples
		// (3 for BasicBlock nets, 4 for Bottleneck nets).
		{"resnet18", 20, 20, 17, 8, 0, 1, 1},
		{"resnet34", 36, 36, 33, 16, 0, 1, 1},
		{"resnet50", 53, 53, 49, 16, 0, 1, 1},
		{"resnet101", 104, 104, 100, 33, 0, 1, 1},
		{"resnet152", 155, 155, 151, 50, 0, 1, 1},
		{"resnext50_32x4d", 53, 53, 49, 16, 0, 1, 1},
		{"resnext101_32x8d", 104, 104, 100, 33, 0, 1, 1},
		{"resnext101_64x4d", 104, 104, 100, 33, 0, 1, 1},
		{"wide_resnet50_2", 53, 53, 49, 16, 0, 1, 1},
		{"wide_resnet101_2", 104, 104, 100, 33, 0, 1, 1},
		// densenet121: 58 dense layers, 120 convs + classifier = 121 layers.
		{"densenet121", 120, 121, 121, 0, 62, 1, 1},
		{"densenet161", 160, 161, 161, 0, 82, 1, 1},
		{"densenet169", 168, 169, 169, 0, 86, 1, 1},
		{"densenet201", 200, 201, 201, 0, 102, 1, 1},
		{"vgg11_bn", 8, 8, 10, 0, 0, 5, 3},
		{"vgg13_bn", 10, 10, 12, 0, 0, 5, 3},
		{"vgg16_bn", 13, 13, 15, 0, 0, 5, 3},
		{"vgg19_bn", 16, 16, 18, 0, 0, 5, 3},
	}
	if len(tests) != len(Names()) {
		t.Fatalf("table has %d names, Names() %d", len(tests), len(Names()))
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := weightsOf(named(t, tc.name, 1000), "")
			g, m, err := Recognize(w, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if m.Arch != tc.name || !m.Exact || g.Arch != tc.name || m.Prefix != "" {
				t.Fatalf("match %+v, graph arch %q", m, g.Arch)
			}
			checkCoverage(t, g, w)
			ops := countOps(g)
			got := [7]int{ops[graph.OpConv], ops[graph.OpBatchNorm], ops[graph.OpReLU], ops[graph.OpAdd], ops[graph.OpConcat],
				ops[graph.OpMaxPool], ops[graph.OpLinear]}
			want := [7]int{tc.conv, tc.bn, tc.relu, tc.add, tc.concat, tc.pool, tc.lin}
			if got != want {
				t.Errorf("conv, bn, relu, add, concat, maxpool, linear = %v, want %v", got, want)
			}
			if g.Output.Channels != 1000 {
				t.Errorf("output channels %d", g.Output.Channels)
			}
			// Forcing the right name gives the same graph.
			g2, m2, err := Recognize(w, tc.name)
			if err != nil {
				t.Fatal(err)
			}
			if m2.Arch != tc.name || g2.String() != g.String() {
				t.Errorf("forced: %+v", m2)
			}
		})
	}
}

// TestResNetAttrs checks the hyper-parameters torchvision sets but the state
// dict does not hold, and the residual wiring.
func TestResNetAttrs(t *testing.T) {
	g, _, err := Recognize(weightsOf(named(t, "resnext50_32x4d", 1000), ""), "")
	if err != nil {
		t.Fatal(err)
	}
	type want struct {
		op                  graph.Op
		k, s, p, groups, in int
		out                 int
		inputs              []string
	}
	cases := map[string]want{
		"conv1":                 {graph.OpConv, 7, 2, 3, 1, 3, 64, []string{"input"}},
		"maxpool":               {graph.OpMaxPool, 3, 2, 1, 0, 0, 64, []string{"relu"}},
		"layer1.0.conv2":        {graph.OpConv, 3, 1, 1, 32, 128, 128, []string{"layer1.0.relu"}},
		"layer2.0.conv1":        {graph.OpConv, 1, 1, 0, 1, 256, 256, []string{"layer1.2.relu:3"}},
		"layer2.0.conv2":        {graph.OpConv, 3, 2, 1, 32, 256, 256, []string{"layer2.0.relu"}},
		"layer2.0.downsample.0": {graph.OpConv, 1, 2, 0, 1, 256, 512, []string{"layer1.2.relu:3"}},
		"layer2.0.add":          {graph.OpAdd, 0, 0, 0, 0, 0, 512, []string{"layer2.0.bn3", "layer2.0.downsample.1"}},
		"layer2.1.add":          {graph.OpAdd, 0, 0, 0, 0, 0, 512, []string{"layer2.1.bn3", "layer2.0.relu:3"}},
		"layer4.2.conv2":        {graph.OpConv, 3, 1, 1, 32, 1024, 1024, []string{"layer4.2.relu"}},
		"avgpool":               {graph.OpAdaptiveAvgPool, 0, 0, 0, 0, 0, 2048, []string{"layer4.2.relu:3"}},
		"flatten":               {graph.OpFlatten, 0, 0, 0, 0, 0, 2048, []string{"avgpool"}},
		"fc":                    {graph.OpLinear, 0, 0, 0, 0, 2048, 1000, []string{"flatten"}},
	}
	for name, w := range cases {
		n := g.Node(name)
		if n == nil {
			t.Errorf("no node %s", name)
			continue
		}
		var ins []string
		for _, v := range n.Inputs {
			ins = append(ins, v.Name)
		}
		a := n.Attr
		if n.Op != w.op || a.KernelSize[0] != w.k || a.Stride[0] != w.s || a.Padding[0] != w.p || a.Groups != w.groups ||
			a.InChannels != w.in || n.Out.Channels != w.out || fmt.Sprint(ins) != fmt.Sprint(w.inputs) {
			t.Errorf("%s: %s %+v ch=%d inputs %v, want %+v", name, n.Op, a, n.Out.Channels, ins, w)
		}
		if n.Op == graph.OpConv && (a.Dilation != [2]int{1, 1} || a.Bias || a.OutChannels != w.out) {
			t.Errorf("%s: %+v", name, a)
		}
	}
	bn := g.Node("layer3.5.bn2")
	if bn.Attr.Eps != 1e-5 || bn.Attr.Momentum != 0.1 || bn.Attr.Features != 512 || len(bn.Params) != 5 {
		t.Errorf("bn: %+v %v", bn.Attr, bn.Params)
	}
	if g.Node("avgpool").Attr.OutputSize != [2]int{1, 1} || g.Node("flatten").Attr.StartDim != 1 || !g.Node("fc").Attr.Bias {
		t.Error("head attributes")
	}
	if g.Node("layer1.0.downsample.0") == nil || g.Node("layer1.1.downsample.0") != nil {
		t.Error("layer1 downsample placement")
	}
}

func TestDenseNetAttrs(t *testing.T) {
	g, _, err := Recognize(weightsOf(named(t, "densenet121", 1000), ""), "")
	if err != nil {
		t.Fatal(err)
	}
	first := g.Node("features.denseblock1.denselayer1.cat")
	if first == nil || first.Op != graph.OpConcat || len(first.Inputs) != 1 || first.Inputs[0].Name != "features.pool0" || first.Attr.Axis != 1 {
		t.Fatalf("first dense layer concat: %+v", first)
	}
	third := g.Node("features.denseblock1.denselayer3.cat")
	var ins []string
	for _, v := range third.Inputs {
		ins = append(ins, v.Name)
	}
	if fmt.Sprint(ins) != "[features.pool0 features.denseblock1.denselayer1.conv2 features.denseblock1.denselayer2.conv2]" || third.Out.Channels != 64+2*32 {
		t.Errorf("layer3 concat inputs %v ch %d", ins, third.Out.Channels)
	}
	blockCat := g.Node("features.denseblock1.cat")
	if len(blockCat.Inputs) != 7 || blockCat.Out.Channels != 256 || blockCat.Out.Consumers[0].Name != "features.transition1.norm" {
		t.Errorf("block concat: %d inputs, %d channels", len(blockCat.Inputs), blockCat.Out.Channels)
	}
	pool := g.Node("features.transition1.pool")
	if pool.Op != graph.OpAvgPool || pool.Attr.KernelSize != [2]int{2, 2} || pool.Attr.Stride != [2]int{2, 2} || !pool.Attr.CountIncludePad || pool.Out.Channels != 128 {
		t.Errorf("transition pool: %+v", pool.Attr)
	}
	c2 := g.Node("features.denseblock4.denselayer16.conv2")
	if c2.Attr.InChannels != 128 || c2.Attr.OutChannels != 32 || c2.Attr.Padding != [2]int{1, 1} {
		t.Errorf("conv2: %+v", c2.Attr)
	}
	relu5 := g.Node("features.relu5")
	if relu5 == nil || relu5.Inputs[0].Name != "features.norm5" || relu5.Out.Channels != 1024 {
		t.Fatalf("relu5: %+v", relu5)
	}
	if g.Node("features.denseblock4.cat").Out.Consumers[0].Name != "features.norm5" || g.Node("classifier").Attr.InChannels != 1024 {
		t.Error("tail wiring")
	}
}

func TestVGGAttrs(t *testing.T) {
	g, m, err := Recognize(weightsOf(named(t, "vgg11_bn", 10), ""), "")
	if err != nil {
		t.Fatal(err)
	}
	if m.Arch != "vgg11_bn" || !strings.Contains(strings.Join(m.Notes, "|"), "num_classes 10") {
		t.Errorf("match %+v", m)
	}
	// vgg11 cfg A: 64 M 128 M 256 256 M 512 512 M 512 512 M.
	for _, name := range []string{"features.3", "features.7", "features.14", "features.21", "features.28"} {
		n := g.Node(name)
		if n == nil || n.Op != graph.OpMaxPool || n.Attr.KernelSize != [2]int{2, 2} || n.Attr.Stride != [2]int{2, 2} {
			t.Errorf("%s: %+v", name, n)
		}
	}
	if n := g.Node("features.25"); n.Op != graph.OpConv || n.Attr.Padding != [2]int{1, 1} || !n.Attr.Bias || n.Attr.InChannels != 512 {
		t.Errorf("features.25: %+v", n.Attr)
	}
	if n := g.Node("features.27"); n.Op != graph.OpReLU {
		t.Errorf("features.27 is %s", n.Op)
	}
	if n := g.Node("avgpool"); n.Attr.OutputSize != [2]int{7, 7} {
		t.Errorf("avgpool %+v", n.Attr)
	}
	if n := g.Node("flatten"); n.Out.Channels != 512*49 {
		t.Errorf("flatten channels %d", n.Out.Channels)
	}
	var seq []string
	for _, n := range g.Nodes[len(g.Nodes)-7:] {
		seq = append(seq, fmt.Sprintf("%s:%s", n.Name, n.Op))
	}
	want := "[classifier.0:Linear classifier.1:ReLU classifier.2:Dropout classifier.3:Linear classifier.4:ReLU classifier.5:Dropout classifier.6:Linear]"
	if fmt.Sprint(seq) != want {
		t.Errorf("classifier %v", seq)
	}
	if g.Node("classifier.5").Attr.P != 0.5 || g.Output.Channels != 10 {
		t.Error("dropout p or num_classes")
	}
}

// TestTinyVariants: torchvision key names, other widths and depths.
func TestTinyVariants(t *testing.T) {
	tests := []struct {
		desc string
		ts   []tensor
		want string
	}{
		{"basic width 8", resnetConfig{false, [4]int{1, 1, 1, 1}, 8, 1, 64}.tensors(10), "resnet (BasicBlock [1 1 1 1], width 8)"},
		{"bottleneck width 4", resnetConfig{true, [4]int{1, 2, 1, 1}, 4, 1, 64}.tensors(3), "resnet (Bottleneck [1 2 1 1], width 4)"},
		{"resnext-like", resnetConfig{true, [4]int{2, 1, 1, 1}, 8, 2, 32}.tensors(3), "resnet (Bottleneck [2 1 1 1], width 8, groups 2, width_per_group 32)"},
		{"wide-like", resnetConfig{true, [4]int{1, 1, 1, 1}, 8, 1, 128}.tensors(3), "resnet (Bottleneck [1 1 1 1], width 8, width_per_group 128)"},
		{"resnet18 depth other classes", resnetConfig{false, [4]int{1, 1, 1, 1}, 64, 1, 64}.tensors(1000), "resnet (BasicBlock [1 1 1 1], width 64)"},
		{"densenet tiny", densenetConfig{4, []int{2, 2}, 8, 2}.tensors(10), "densenet (growth 4, bn_size 2, blocks [2 2], init 8)"},
		{"densenet 3 blocks", densenetConfig{6, []int{1, 3, 2}, 16, 4}.tensors(10), "densenet (growth 6, bn_size 4, blocks [1 3 2], init 16)"},
		{"vgg tiny", vggConfig{[]int{8, vggPool, 16, 16, vggPool}, [2]int{32, 24}}.tensors(5), "vgg_bn (cfg [8 M 16 16 M], classifier 32 24)"},
		{"vgg16 features small head", vggConfig{vggD, [2]int{512, 512}}.tensors(10), "vgg_bn (vgg16_bn features, classifier 512 512)"},
		{"vgg leading pool", vggConfig{[]int{vggPool, 8, vggPool}, [2]int{4, 4}}.tensors(2), "vgg_bn (cfg [M 8 M], classifier 4 4)"},
	}
	for _, tc := range tests {
		t.Run(tc.desc, func(t *testing.T) {
			w := weightsOf(tc.ts, "")
			g, m, err := Recognize(w, "")
			if err != nil {
				t.Fatal(err)
			}
			if m.Arch != tc.want || m.Exact || g.Arch != tc.want {
				t.Errorf("got %q exact=%v, want %q", m.Arch, m.Exact, tc.want)
			}
			checkCoverage(t, g, w)
		})
	}
}

// TestResNeXtGroups: groups come from conv2's weight shape.
func TestResNeXtGroups(t *testing.T) {
	g, m, err := Recognize(weightsOf(resnetConfig{true, [4]int{1, 1, 1, 1}, 8, 4, 16}.tensors(3), ""), "")
	if err != nil {
		t.Fatal(err)
	}
	if n := g.Node("layer3.0.conv2"); n.Attr.Groups != 4 || n.Attr.InChannels != 32 || n.Attr.Stride != [2]int{2, 2} {
		t.Errorf("layer3.0.conv2 %+v (%s)", n.Attr, m.Arch)
	}
}

func TestPrefix(t *testing.T) {
	for _, ts := range [][]tensor{
		named(t, "resnet18", 1000),
		densenetConfig{4, []int{2, 2}, 8, 2}.tensors(10),
		named(t, "vgg11_bn", 1000),
	} {
		w := weightsOf(ts, "module.")
		g, m, err := Recognize(w, "auto")
		if err != nil {
			t.Fatal(err)
		}
		if m.Prefix != "module." || !strings.Contains(m.Notes[0], `"module."`) {
			t.Errorf("match %+v", m)
		}
		for _, n := range g.Nodes[1:] {
			if !strings.HasPrefix(n.Name, "module.") {
				t.Errorf("node %s lacks the prefix", n.Name)
			}
		}
		checkCoverage(t, g, w)
		plain, _, err := Recognize(weightsOf(ts, ""), "auto")
		if err != nil {
			t.Fatal(err)
		}
		if strings.ReplaceAll(g.String(), "module.", "") != plain.String() {
			t.Errorf("prefixed graph differs from the plain one beyond names")
		}
	}
	// A deeper, unusual prefix, and forcing a name through it.
	w := weightsOf(named(t, "resnet50", 1000), "model.backbone.")
	g, m, err := Recognize(w, "resnet50")
	if err != nil {
		t.Fatal(err)
	}
	if m.Prefix != "model.backbone." || g.Node("model.backbone.layer4.2.relu:3") == nil {
		t.Errorf("match %+v", m)
	}
}

func TestLegacyDenseNet(t *testing.T) {
	ts := legacyKeys(densenetConfig{4, []int{2, 2}, 8, 2}.tensors(10))
	w := weightsOf(ts, "module.")
	g, m, err := Recognize(w, "auto")
	if err != nil {
		t.Fatal(err)
	}
	if m.Arch != "densenet (growth 4, bn_size 2, blocks [2 2], init 8)" {
		t.Errorf("arch %q", m.Arch)
	}
	checkCoverage(t, g, w)
	n := g.Node("module.features.denseblock2.denselayer1.norm.1")
	if n == nil || n.Params[graph.RoleRunningVar] != "module.features.denseblock2.denselayer1.norm.1.running_var" {
		t.Fatalf("legacy norm node: %+v", n)
	}
	if _, ok := n.Params[graph.RoleNumBatches]; ok {
		t.Error("num_batches_tracked invented")
	}
	for _, name := range []string{"relu.1", "conv.1", "norm.2", "relu.2", "conv.2"} {
		if g.Node("module.features.denseblock2.denselayer1."+name) == nil {
			t.Errorf("no node %s", name)
		}
	}
	notes := strings.Join(m.Notes, "|")
	if !strings.Contains(notes, "4 dense layers use the legacy key names") || !strings.Contains(notes, "num_batches_tracked") {
		t.Errorf("notes %q", notes)
	}
	// A legacy densenet121 is still densenet121, automatically and forced.
	legacy121 := weightsOf(legacyKeys(named(t, "densenet121", 1000)), "")
	for _, force := range []string{"", "densenet121"} {
		if _, m, err := Recognize(legacy121, force); err != nil || m.Arch != "densenet121" || !m.Exact {
			t.Errorf("force %q: %v %+v", force, err, m)
		}
	}
}

// TestErrors: unknown layouts and forced mismatches, with what the message
// must name.
func TestErrors(t *testing.T) {
	r18 := named(t, "resnet18", 1000)
	r50 := named(t, "resnet50", 1000)
	d121 := named(t, "densenet121", 1000)
	random := []tensor{{"encoder.embed.weight", []int{10, 4}}, {"decoder.out.bias", []int{4}}}
	tests := []struct {
		desc  string
		ts    []tensor
		force string
		is    error
		want  []string
	}{
		{"truncated resnet", edit(r18, `^(layer4|fc)\.`, nil), "", ErrUnrecognised,
			[]string{"closest family resnet (matched 90 of 90 keys)", "missing layer4.0.conv1.weight"}},
		{"random dict", random, "", ErrUnrecognised,
			[]string{"no key looks like a supported family", "encoder.embed.weight"}},
		{"densenet without norm5", edit(d121, `^features\.norm5\.`, nil), "", ErrUnrecognised,
			[]string{"closest family densenet (matched 722 of 722 keys)", "missing features.norm5.weight"}},
		{"wrong in_channels", edit(r18, "", map[string][]int{"layer2.0.conv1.weight": {128, 32, 3, 3}}), "", ErrUnrecognised,
			[]string{"not a torchvision ResNet: layer2.0.conv1.weight has shape [128 32 3 3], expected in_channels 64"}},
		{"wrong kernel", edit(r18, "", map[string][]int{"conv1.weight": {64, 3, 3, 3}}), "", ErrUnrecognised,
			[]string{"conv1.weight has shape [64 3 3 3], expected a 7x7 kernel"}},
		{"bn width", edit(r18, "", map[string][]int{"layer1.1.bn2.running_var": {32}}), "", ErrUnrecognised,
			[]string{"layer1.1.bn2.running_var has shape [32], expected [64]"}},
		{"missing running stats", edit(r18, `^layer3\.1\.bn1\.running_(mean|var)$`, nil), "", ErrUnrecognised,
			[]string{"lacks 2 keys: layer3.1.bn1.running_mean; layer3.1.bn1.running_var"}},
		{"extra keys", edit(r18, "", nil, tensor{"fc2.weight", []int{3, 3}}, tensor{"aux.bias", []int{3}}), "", ErrUnrecognised,
			[]string{"2 keys are not part of the ResNet layout: fc2.weight; aux.bias"}},
		{"missing downsample", edit(r18, `^layer3\.0\.downsample`, nil), "", ErrUnrecognised,
			[]string{"missing layer3.0.downsample.0.weight"}},
		{"mixed blocks", edit(r18, "", nil, tensor{"layer2.1.conv3.weight", []int{128, 128, 1, 1}}), "", ErrUnrecognised,
			[]string{"layer2.1 does not match the BasicBlock of layer1.0"}},
		{"plain vgg", vggConfig{[]int{8, vggPool}, [2]int{4, 4}}.tensors(2)[:2], "", ErrUnrecognised,
			[]string{"plain VGG without batch norm is not supported"}},
		{"vgg skipped conv", edit(named(t, "vgg16_bn", 1000), `^features\.(3|4)\.`, nil), "", ErrUnrecognised,
			[]string{"expected a Conv2d at features.3, or a MaxPool2d there and a Conv2d at features.4; found no parameters until features.7"}},
		{"densenet bad growth", edit(d121, "", map[string][]int{"features.denseblock1.denselayer2.norm1.weight": {95}}), "", ErrUnrecognised,
			[]string{"features.denseblock1.denselayer2.norm1.weight has shape [95], expected [96]"}},
		{"forced deeper", r50, "resnet101", ErrMismatch,
			[]string{"not resnet101", "missing layer3.6.conv1.weight (resnet101 has shape [256 1024 1 1])"}},
		{"forced wider", named(t, "wide_resnet50_2", 1000), "resnet50", ErrMismatch,
			[]string{"layer1.0.conv1.weight has shape [128 64 1 1], resnet50 has [64 64 1 1]", "and "}},
		{"forced other family", r18, "densenet121", ErrMismatch,
			[]string{"missing features.conv0.weight", "disagreements"}},
		{"forced groups", named(t, "resnext50_32x4d", 1000), "resnext101_32x8d", ErrMismatch,
			[]string{"layer1.0.conv1.weight has shape [128 64 1 1], resnext101_32x8d has [256 64 1 1]"}},
		{"forced with extra", edit(r18, "", nil, tensor{"module.fc.weight", []int{3, 3}}), "resnet18", ErrMismatch,
			[]string{"unexpected module.fc.weight"}},
		{"unknown name", r18, "resnet19", nil, []string{`unknown architecture "resnet19"`, "resnet18, resnet34"}},
	}
	for _, tc := range tests {
		t.Run(tc.desc, func(t *testing.T) {
			g, m, err := Recognize(weightsOf(tc.ts, ""), tc.force)
			if err == nil {
				t.Fatalf("no error; got %+v (%d nodes)", m, len(g.Nodes))
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("error %v is not %v", err, tc.is)
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q\n does not contain %q", err, s)
				}
			}
		})
	}
}

func TestEmpty(t *testing.T) {
	if _, _, err := Recognize(graph.NewMemWeights(), ""); !errors.Is(err, ErrUnrecognised) {
		t.Errorf("empty: %v", err)
	}
}

func TestNames(t *testing.T) {
	names := Names()
	if len(names) != 18 || names[0] != "resnet18" || names[17] != "vgg19_bn" {
		t.Errorf("Names() = %v", names)
	}
}

// TestMutations damages tiny state dicts one key at a time (dropped, or given
// a degenerate shape): Recognize must never panic, and whatever it accepts
// must be a valid graph that consumes every key.
func TestMutations(t *testing.T) {
	bases := map[string][]tensor{
		"resnet":   resnetConfig{true, [4]int{1, 2, 1, 1}, 4, 2, 32}.tensors(3),
		"densenet": densenetConfig{4, []int{2, 2}, 8, 2}.tensors(3),
		"vgg":      vggConfig{[]int{8, vggPool, 16, vggPool}, [2]int{8, 8}}.tensors(3),
	}
	shapes := [][]int{nil, {0}, {1}, {2, 2}, {1, 1, 1, 1}, {4, 0, 7, 7}, {-3, 3, 3, 3}, {8, 3, 7, 7}}
	for name, ts := range bases {
		accepted, refused := 0, 0
		try := func(what string, ts []tensor) {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("%s %s: panic %v", name, what, r)
				}
			}()
			w := weightsOf(ts, "")
			g, _, err := Recognize(w, "")
			if err != nil {
				refused++
				return
			}
			accepted++
			checkCoverage(t, g, w)
		}
		for i, victim := range ts {
			try("drop "+victim.key, append(append([]tensor{}, ts[:i]...), ts[i+1:]...))
			for _, s := range shapes {
				try(fmt.Sprintf("%s=%v", victim.key, s), edit(ts, "", map[string][]int{victim.key: s}))
			}
		}
		// Dropping a num_batches_tracked is harmless; almost all else is not.
		if refused < len(ts)*len(shapes) {
			t.Errorf("%s: only %d of the damaged dicts refused (%d accepted)", name, refused, accepted)
		}
	}
}
