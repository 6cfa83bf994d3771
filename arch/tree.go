package arch

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// Networks rebuilt from the module tree alone: their state dicts are not
// recognised, but a whole pickled instance is walked module by module, each
// torchvision block class with the forward torchvision 0.14 gives it, each
// torch.nn layer read as in an nn.Sequential chain.

// treeRoot is the forward of a model class around its children.
type treeRoot struct {
	title string
	attrs []string
	build func(b *chainBuilder, m *pth.Module) error
}

var treeRoots = map[string]treeRoot{
	"torchvision.models.mnasnet.MNASNet":         {title: "mnasnet", attrs: []string{"alpha", "num_classes"}, build: mnasnetForward},
	"torchvision.models.regnet.RegNet":           {title: "regnet", build: regnetForward},
	"torchvision.models.mobilenetv2.MobileNetV2": {title: "mobilenet_v2", attrs: []string{"last_channel"}, build: mobilenetV2Forward},
	"torchvision.models.mobilenetv3.MobileNetV3": {title: "mobilenet_v3", build: mobilenetV3Forward},
	// EfficientNet's forward is MobileNetV3's: features, avgpool,
	// flatten, classifier.
	"torchvision.models.efficientnet.EfficientNet": {title: "efficientnet", build: mobilenetV3Forward},
	"torchvision.models.shufflenetv2.ShuffleNetV2": {title: "shufflenet_v2", build: shufflenetForward},
	"torchvision.models.inception.Inception3": {title: "inception_v3", attrs: []string{"aux_logits", "transform_input", "AuxLogits"},
		build: inception3Forward},
	"torchvision.models.googlenet.GoogLeNet": {title: "googlenet", attrs: []string{"aux_logits", "transform_input", "aux1", "aux2"},
		build: googlenetForward},
}

// blocks are the torchvision block classes a tree may hold, anywhere.
var blocks map[string]func(b *chainBuilder, m *pth.Module, path string) error

// notModelled names block classes whose computation the IR lacks.
var notModelled = map[string]string{}

func init() {
	seq := func(known ...string) func(b *chainBuilder, m *pth.Module, path string) error {
		return func(b *chainBuilder, m *pth.Module, path string) error { return b.chain(m, path+".", known...) }
	}
	blocks = map[string]func(b *chainBuilder, m *pth.Module, path string) error{
		// nn.Sequential subclasses: their children in order.
		"torchvision.ops.misc.Conv2dNormActivation":        seq("out_channels"),
		"torchvision.models.regnet.SimpleStemIN":           seq("out_channels"),
		"torchvision.models.regnet.BottleneckTransform":    seq(),
		"torchvision.models.regnet.AnyStage":               seq(),
		"torchvision.models.mnasnet._InvertedResidual":     mnasnetBlock,
		"torchvision.models.regnet.ResBottleneckBlock":     regnetBlock,
		"torchvision.models.resnet.BasicBlock":             resnetTreeBlock,
		"torchvision.models.resnet.Bottleneck":             resnetTreeBlock,
		"torchvision.models.googlenet.BasicConv2d":         basicConv,
		"torchvision.models.densenet._DenseBlock":          denseBlock,
		"torchvision.models.inception.BasicConv2d":         basicConv,
		"torchvision.models.mobilenetv2.InvertedResidual":  invertedResidual,
		"torchvision.models.mobilenetv3.InvertedResidual":  invertedResidual,
		"torchvision.ops.misc.SqueezeExcitation":           squeezeExcitation,
		"torchvision.models.inception.InceptionA":          inceptionV3Block,
		"torchvision.models.inception.InceptionB":          inceptionV3Block,
		"torchvision.models.inception.InceptionC":          inceptionV3Block,
		"torchvision.models.inception.InceptionD":          inceptionV3Block,
		"torchvision.models.inception.InceptionE":          inceptionV3Block,
		"torchvision.models.densenet._Transition":          seq(),
		"torchvision.models.googlenet.Inception":           inceptionBlock,
		"torchvision.models.efficientnet.MBConv":           mbConv,
		"torchvision.models.efficientnet.FusedMBConv":      mbConv,
		"torchvision.models.shufflenetv2.InvertedResidual": shuffleBlock,
	}
	registerSegmentationTrees()
}

// fromTree builds a graph from a module tree whose every module the
// builder visits.
func fromTree(m *pth.Module, w graph.Weights, root treeRoot) (*graph.Graph, *Match, error) {
	b := &chainBuilder{w: w, used: map[string]bool{}}
	if err := checkAttrs(m, root.attrs...); err != nil {
		return nil, nil, fmt.Errorf("whole pickled %s: %w", m.ShortClass(), err)
	}
	if err := root.build(b, m); err != nil {
		return nil, nil, fmt.Errorf("whole pickled %s: %w", m.ShortClass(), err)
	}
	var extra []string
	for _, k := range w.Keys() {
		if !b.used[k] {
			extra = append(extra, k)
		}
	}
	if len(extra) > 0 {
		return nil, nil, fmt.Errorf("whole pickled %s: the state dict holds tensors no module of the forward uses: %s", m.ShortClass(), firstFew(extra, 6))
	}
	if err := b.g.Validate(); err != nil {
		return nil, nil, failure.Internalf("whole pickled %s: built graph is invalid: %w", m.ShortClass(), err)
	}
	match := &Match{Arch: fmt.Sprintf("%s (%d layers)", root.title, b.layers), Family: root.title,
		Notes: []string{fmt.Sprintf("structure from the pickled %s instance: its forward rebuilt module by module, every layer's attributes read from its modules", m.Class)}}
	b.g.Arch = match.Arch
	return b.g, match, nil
}

// children returns m's children by name and refuses any but names
// (optional ones may be absent, or None).
func children(m *pth.Module, names ...string) (map[string]*pth.Module, error) {
	out := map[string]*pth.Module{}
	for _, c := range m.Children {
		if !contains(names, c.Name) {
			return nil, failure.Unsupportedf("child %q is not one torchvision's %s has (%v); a modified network needs --graph", c.Name, m.ShortClass(), names)
		}
		out[c.Name] = c.Module
	}
	return out, nil
}

func join(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

// run applies child name of m, which must exist.
func (b *chainBuilder) run(m *pth.Module, kids map[string]*pth.Module, path, name string) error {
	c := kids[name]
	if c == nil {
		return fmt.Errorf("%s has no child %q", m.ShortClass(), name)
	}
	p := join(path, name)
	if err := b.layer(c, p); err != nil {
		return fmt.Errorf("%s (%s): %w", p, c.ShortClass(), err)
	}
	return nil
}

// globalPool adds adaptive average pooling to 1x1 and a flatten, which
// x.mean([2, 3]) and avgpool + torch.flatten(x, 1) both are.
func (b *chainBuilder) globalPool(pool string, module bool) {
	c := b.cur.Channels
	if !module {
		b.cur = b.g.Add(pool, graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, nil, b.cur)
		b.cur.Channels = c
	}
	b.cur = b.g.Add("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, b.cur)
	b.cur.Channels = c
}

// mnasnetForward: layers, x.mean([2, 3]), classifier.
func mnasnetForward(b *chainBuilder, m *pth.Module) error {
	kids, err := children(m, "layers", "classifier")
	if err != nil {
		return err
	}
	if err := b.run(m, kids, "", "layers"); err != nil {
		return err
	}
	b.globalPool("mean", false)
	return b.run(m, kids, "", "classifier")
}

// mnasnetBlock: layers(x), plus x when apply_residual.
func mnasnetBlock(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m, "apply_residual"); err != nil {
		return err
	}
	res, ok := m.Attr("apply_residual").(bool)
	if !ok {
		return fmt.Errorf("apply_residual is %s, not a bool", describe(m.Attr("apply_residual")))
	}
	kids, err := children(m, "layers")
	if err != nil {
		return err
	}
	x := b.cur
	if err := b.run(m, kids, path, "layers"); err != nil {
		return err
	}
	if res {
		return b.residual(path, "apply_residual", x)
	}
	return nil
}

// regnetForward: stem, trunk_output, avgpool, flatten, fc.
func regnetForward(b *chainBuilder, m *pth.Module) error {
	kids, err := children(m, "stem", "trunk_output", "avgpool", "fc")
	if err != nil {
		return err
	}
	for _, name := range []string{"stem", "trunk_output", "avgpool"} {
		if err := b.run(m, kids, "", name); err != nil {
			return err
		}
	}
	if b.cur.Producer.Op != graph.OpAdaptiveAvgPool || b.cur.Producer.Attr.OutputSize != [2]int{1, 1} {
		return failure.Unsupportedf("avgpool is not AdaptiveAvgPool2d((1, 1))")
	}
	b.globalPool("avgpool", true)
	return b.run(m, kids, "", "fc")
}

// regnetBlock: activation(proj(x) + f(x)), or activation(x + f(x)) when
// proj is None.
func regnetBlock(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m, "proj"); err != nil {
		return err
	}
	if v, ok := m.Attrs["proj"]; ok && v != nil {
		return fmt.Errorf("proj is %s", describe(v))
	}
	kids, err := children(m, "proj", "f", "activation")
	if err != nil {
		return err
	}
	x := b.cur
	short := x
	if kids["proj"] != nil {
		if err := b.run(m, kids, path, "proj"); err != nil {
			return err
		}
		short = b.cur
		b.cur = x
	}
	if err := b.run(m, kids, path, "f"); err != nil {
		return err
	}
	if short.Channels != b.cur.Channels {
		return fmt.Errorf("the shortcut has %d channels, f %d", short.Channels, b.cur.Channels)
	}
	c := b.cur.Channels
	b.cur = b.g.Add(path+".add", graph.OpAdd, graph.Attr{}, nil, short, b.cur)
	b.cur.Channels = c
	return b.run(m, kids, path, "activation")
}

// googlenetForward is GoogLeNet's eval and training forward without
// auxiliary classifiers (aux_logits=False) and without transform_input.
func googlenetForward(b *chainBuilder, m *pth.Module) error {
	if tr, ok := m.Attr("transform_input").(bool); !ok || tr {
		return failure.Unsupportedf("transform_input %s: the per-channel input affine is not modelled; save the model with transform_input=False and normalise the input yourself",
			describe(m.Attr("transform_input")))
	}
	order := []string{"conv1", "maxpool1", "conv2", "conv3", "maxpool2", "inception3a", "inception3b", "maxpool3",
		"inception4a", "inception4b", "inception4c", "inception4d", "inception4e", "maxpool4", "inception5a", "inception5b", "avgpool", "dropout", "fc"}
	kids, err := children(m, append(order, "aux1", "aux2")...)
	if err != nil {
		return err
	}
	aux, ok := m.Attr("aux_logits").(bool)
	if !ok || aux != (kids["aux1"] != nil) || aux != (kids["aux2"] != nil) {
		return failure.Unsupportedf("aux_logits %s with aux1 %s and aux2 %s: torchvision's GoogLeNet has both auxiliary classifiers with aux_logits=True and neither with False",
			describe(m.Attr("aux_logits")), present(kids["aux1"]), present(kids["aux2"]))
	}
	// In training, GoogLeNet returns (logits, aux_logits2, aux_logits1)
	// from aux1 on inception4a's output and aux2 on inception4d's (see
	// below for which is which); in eval the logits alone.
	var heads [2]*graph.Value
	for _, name := range order {
		if err := b.run(m, kids, "", name); err != nil {
			return err
		}
		if k := map[string]int{"inception4a": 1, "inception4d": 2}[name]; aux && k > 0 {
			x := b.cur
			if err := googlenetAux(b, kids[fmt.Sprintf("aux%d", k)], fmt.Sprintf("aux%d", k)); err != nil {
				return err
			}
			heads[k-1], b.cur = b.cur, x
		}
		if name == "avgpool" {
			if b.cur.Producer.Attr.OutputSize != [2]int{1, 1} {
				return failure.Unsupportedf("avgpool is not AdaptiveAvgPool2d((1, 1))")
			}
			b.globalPool("avgpool", true)
		}
	}
	if aux {
		// What torchvision 0.14 returns, not what its names say: _forward
		// returns (x, aux2, aux1), forward unpacks it as x, aux1, aux2, so
		// GoogLeNetOutputs' aux_logits2 field holds aux1's logits and
		// aux_logits1 aux2's. A training loop reads them by position or
		// name; both must find what the original gives.
		b.g.Output = b.cur
		b.g.OutputName = "logits"
		b.g.SetAux("aux_logits2", heads[0], true)
		b.g.SetAux("aux_logits1", heads[1], true)
	}
	return nil
}

func present(m *pth.Module) string {
	if m == nil {
		return "absent"
	}
	return "present"
}

// googlenetAux is GoogLeNet's InceptionAux: F.adaptive_avg_pool2d(x, (4,
// 4)), conv (a BasicConv2d), flatten, F.relu(fc1) in place, dropout, fc2.
func googlenetAux(b *chainBuilder, m *pth.Module, path string) error {
	if m.Class != "torchvision.models.googlenet.InceptionAux" {
		return failure.Unsupportedf("%s is a %s, not torchvision's googlenet.InceptionAux", path, m.ShortClass())
	}
	if err := checkAttrs(m); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	kids, err := children(m, "conv", "fc1", "fc2", "dropout")
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	c := b.cur.Channels
	b.cur = b.g.Add(path+".pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{4, 4}}, nil, b.cur)
	b.cur.Channels = c
	if err := b.run(m, kids, path, "conv"); err != nil {
		return err
	}
	c = b.cur.Channels * 16
	b.cur = b.g.Add(path+".flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, b.cur)
	b.cur.Channels = c
	if err := b.run(m, kids, path, "fc1"); err != nil {
		return err
	}
	c = b.cur.Channels
	b.cur = b.g.Add(path+".relu", graph.OpReLU, graph.Attr{}, nil, b.cur)
	b.cur.Channels = c
	for _, name := range []string{"dropout", "fc2"} {
		if err := b.run(m, kids, path, name); err != nil {
			return err
		}
	}
	return nil
}

// basicConv is GoogLeNet's BasicConv2d: conv, bn, then F.relu.
func basicConv(b *chainBuilder, m *pth.Module, path string) error {
	// stddev: Inception3 sets it on AuxLogits.conv1 for init_weights
	// only; the forward never reads it.
	if err := checkAttrs(m, "stddev"); err != nil {
		return err
	}
	kids, err := children(m, "conv", "bn")
	if err != nil {
		return err
	}
	for _, name := range []string{"conv", "bn"} {
		if err := b.run(m, kids, path, name); err != nil {
			return err
		}
	}
	c := b.cur.Channels
	b.cur = b.g.Add(path+".relu", graph.OpReLU, graph.Attr{}, nil, b.cur)
	b.cur.Channels = c
	return nil
}

// inceptionBlock is GoogLeNet's Inception: four branches over the same
// input, concatenated in order.
func inceptionBlock(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m); err != nil {
		return err
	}
	names := []string{"branch1", "branch2", "branch3", "branch4"}
	kids, err := children(m, names...)
	if err != nil {
		return err
	}
	x := b.cur
	var outs []*graph.Value
	sum := 0
	for _, name := range names {
		b.cur = x
		if err := b.run(m, kids, path, name); err != nil {
			return err
		}
		outs = append(outs, b.cur)
		sum += b.cur.Channels
	}
	b.cur = b.g.Add(path+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, outs...)
	b.cur.Channels = sum
	return nil
}

// resnetTree is the ResNet forward over whatever modules the tree holds:
// for a torchvision ResNet whose state dict the recogniser does not take
// (a replaced head such as fc = nn.Sequential(nn.Dropout(p),
// nn.Linear(...)), a replaced activation), every child is run as a layer.
var resnetTree = treeRoot{title: "resnet", attrs: []string{"inplanes", "dilation", "groups", "base_width"}, build: resnetTreeForward}

func resnetTreeForward(b *chainBuilder, m *pth.Module) error {
	order := []string{"conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"}
	kids, err := children(m, order...)
	if err != nil {
		return err
	}
	for _, name := range order {
		if err := b.run(m, kids, "", name); err != nil {
			return err
		}
		if name == "avgpool" {
			if b.cur.Producer.Op != graph.OpAdaptiveAvgPool || b.cur.Producer.Attr.OutputSize != [2]int{1, 1} {
				return failure.Unsupportedf("avgpool is not AdaptiveAvgPool2d((1, 1))")
			}
			b.globalPool("avgpool", true)
		}
	}
	return nil
}

// resnetTreeBlock is BasicBlock's and Bottleneck's forward: the main
// branch, the downsample branch (or the input), their sum, the shared relu
// module once more. Its second and third uses are nodes relu:2, relu:3,
// as the state-dict builder names them.
func resnetTreeBlock(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m, "stride", "downsample"); err != nil {
		return err
	}
	if err := noDownsampleAttr(m); err != nil {
		return err
	}
	main := []string{"conv1", "bn1", "relu", "conv2", "bn2"}
	if m.ShortClass() == "Bottleneck" {
		main = []string{"conv1", "bn1", "relu", "conv2", "bn2", "relu:2", "conv3", "bn3"}
	}
	kids, err := children(m, append(main, "downsample")...)
	if err != nil {
		return err
	}
	x := b.cur
	for _, name := range main {
		mod, use, _ := strings.Cut(name, ":")
		if use == "" {
			if err := b.run(m, kids, path, mod); err != nil {
				return err
			}
			continue
		}
		if err := b.layer(kids[mod], path+"."+name); err != nil {
			return fmt.Errorf("%s.%s (%s): %w", path, name, kids[mod].ShortClass(), err)
		}
	}
	y := b.cur
	short := x
	if kids["downsample"] != nil {
		b.cur = x
		if err := b.run(m, kids, path, "downsample"); err != nil {
			return err
		}
		short = b.cur
	}
	if short.Channels != y.Channels {
		return fmt.Errorf("the shortcut has %d channels, the main branch %d", short.Channels, y.Channels)
	}
	b.cur = b.g.Add(path+".add", graph.OpAdd, graph.Attr{}, nil, y, short)
	b.cur.Channels = y.Channels
	last := "relu:3"
	if m.ShortClass() == "BasicBlock" {
		last = "relu:2"
	}
	if err := b.layer(kids["relu"], path+"."+last); err != nil {
		return fmt.Errorf("%s.%s (%s): %w", path, last, kids["relu"].ShortClass(), err)
	}
	return nil
}

// vggTree is VGG's forward over the tree: features, avgpool, flatten,
// classifier.
var vggTree = treeRoot{title: "vgg", build: vggTreeForward}

func vggTreeForward(b *chainBuilder, m *pth.Module) error {
	order := []string{"features", "avgpool", "classifier"}
	kids, err := children(m, order...)
	if err != nil {
		return err
	}
	for _, name := range order {
		if err := b.run(m, kids, "", name); err != nil {
			return err
		}
		if name == "avgpool" {
			p := b.cur.Producer
			if p.Op != graph.OpAdaptiveAvgPool {
				return failure.Unsupportedf("avgpool is a %s, not AdaptiveAvgPool2d", p.Op)
			}
			c := b.cur.Channels * p.Attr.OutputSize[0] * p.Attr.OutputSize[1]
			b.cur = b.g.Add("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, b.cur)
			b.cur.Channels = c
		}
	}
	return nil
}

// densenetTree is DenseNet's forward over the tree: features, then F.relu,
// adaptive average pooling to 1x1, flatten (functional: nodes
// features.relu5, avgpool, flatten, as the state-dict builder names them),
// classifier.
var densenetTree = treeRoot{title: "densenet", build: densenetTreeForward}

func densenetTreeForward(b *chainBuilder, m *pth.Module) error {
	kids, err := children(m, "features", "classifier")
	if err != nil {
		return err
	}
	if err := b.run(m, kids, "", "features"); err != nil {
		return err
	}
	c := b.cur.Channels
	b.cur = b.g.Add("features.relu5", graph.OpReLU, graph.Attr{}, nil, b.cur)
	b.cur.Channels = c
	b.globalPool("avgpool", false)
	return b.run(m, kids, "", "classifier")
}

// denseBlock is _DenseBlock's forward: each layer reads the concatenation
// of the block's input and every earlier layer's output; the block returns
// the concatenation of all of them.
func denseBlock(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m); err != nil {
		return err
	}
	features := []*graph.Value{b.cur}
	for _, c := range m.Children {
		p := join(path, c.Name)
		if c.Module.Class != "torchvision.models.densenet._DenseLayer" {
			return failure.Unsupportedf("%s (%s): a _DenseBlock holds _DenseLayer modules only", p, c.Module.ShortClass())
		}
		if err := denseLayerTree(b, c.Module, p, features); err != nil {
			return fmt.Errorf("%s (_DenseLayer): %w", p, err)
		}
		features = append(features, b.cur)
	}
	b.cur = b.g.Add(path+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, features...)
	b.cur.Channels = sumChannels(features)
	return nil
}

// denseLayerTree is _DenseLayer's forward over features.
func denseLayerTree(b *chainBuilder, m *pth.Module, path string, features []*graph.Value) error {
	if err := checkAttrs(m, "drop_rate", "memory_efficient"); err != nil {
		return err
	}
	if err := denseLayerCheck(m); err != nil {
		return err
	}
	order := []string{"norm1", "relu1", "conv1", "norm2", "relu2", "conv2"}
	kids, err := children(m, order...)
	if err != nil {
		return err
	}
	b.cur = b.g.Add(path+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, features...)
	b.cur.Channels = sumChannels(features)
	for _, name := range order {
		if err := b.run(m, kids, path, name); err != nil {
			return err
		}
	}
	return nil
}

// inception3Forward is Inception3's forward without the auxiliary
// classifier (aux_logits=False) and without transform_input: the stem,
// the Mixed blocks, avgpool, dropout, flatten, fc.
func inception3Forward(b *chainBuilder, m *pth.Module) error {
	if tr, ok := m.Attr("transform_input").(bool); !ok || tr {
		return failure.Unsupportedf("transform_input %s: the per-channel input affine is not modelled; save the model with transform_input=False and normalise the input yourself",
			describe(m.Attr("transform_input")))
	}
	order := []string{"Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "maxpool1", "Conv2d_3b_1x1", "Conv2d_4a_3x3", "maxpool2",
		"Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d", "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c",
		"avgpool", "dropout", "fc"}
	kids, err := children(m, append(order, "AuxLogits")...)
	if err != nil {
		return err
	}
	aux, ok := m.Attr("aux_logits").(bool)
	if !ok || aux != (kids["AuxLogits"] != nil) {
		return failure.Unsupportedf("aux_logits %s with AuxLogits %s: torchvision's Inception3 has the auxiliary classifier with aux_logits=True and not with False",
			describe(m.Attr("aux_logits")), present(kids["AuxLogits"]))
	}
	var head *graph.Value
	for _, name := range order {
		if name == "Mixed_7a" && aux {
			// In training, InceptionOutputs(logits, aux_logits): AuxLogits
			// on Mixed_6e's output; in eval the logits alone.
			x := b.cur
			if err := inception3Aux(b, kids["AuxLogits"], "AuxLogits"); err != nil {
				return err
			}
			head, b.cur = b.cur, x
		}
		if name == "fc" {
			// torch.flatten(x, 1) after the dropout.
			c := b.cur.Channels
			b.cur = b.g.Add("flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, b.cur)
			b.cur.Channels = c
		}
		if err := b.run(m, kids, "", name); err != nil {
			return err
		}
		if name == "avgpool" && b.cur.Producer.Attr.OutputSize != [2]int{1, 1} {
			return failure.Unsupportedf("avgpool is not AdaptiveAvgPool2d((1, 1))")
		}
	}
	if aux {
		b.g.Output = b.cur
		b.g.OutputName = "logits"
		b.g.SetAux("aux_logits", head, true)
	}
	return nil
}

// inception3Aux is Inception3's InceptionAux: F.avg_pool2d(x, 5,
// stride=3), conv0 and conv1 (BasicConv2d), F.adaptive_avg_pool2d(x, (1,
// 1)), flatten, fc. Its input must be at least 17x17 (Mixed_6e's size at
// 299x299) for conv1's 5x5 kernel.
func inception3Aux(b *chainBuilder, m *pth.Module, path string) error {
	if m.Class != "torchvision.models.inception.InceptionAux" {
		return failure.Unsupportedf("%s is a %s, not torchvision's inception.InceptionAux", path, m.ShortClass())
	}
	if err := checkAttrs(m); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	kids, err := children(m, "conv0", "conv1", "fc")
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	c := b.cur.Channels
	b.cur = b.g.Add(path+".avg_pool", graph.OpAvgPool, graph.Attr{KernelSize: [2]int{5, 5}, Stride: [2]int{3, 3}, CountIncludePad: true}, nil, b.cur)
	b.cur.Channels = c
	for _, name := range []string{"conv0", "conv1"} {
		if err := b.run(m, kids, path, name); err != nil {
			return err
		}
	}
	c = b.cur.Channels
	b.cur = b.g.Add(path+".pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, nil, b.cur)
	b.cur.Channels = c
	b.cur = b.g.Add(path+".flatten", graph.OpFlatten, graph.Attr{StartDim: 1}, nil, b.cur)
	b.cur.Channels = c
	return b.run(m, kids, path, "fc")
}

// An Inception-v3 branch step: a child module, a functional pool
// (F.avg_pool2d(x, 3, stride=1, padding=1) or F.max_pool2d(x, 3,
// stride=2)), or two children applied to the same tensor and concatenated
// (InceptionE's 1x3 and 3x1 pair).
type v3step struct {
	mod  string
	pool byte // 'a' or 'm'
	pair [2]string
}

func mods(names ...string) []v3step {
	out := make([]v3step, len(names))
	for i, n := range names {
		out[i] = v3step{mod: n}
	}
	return out
}

var (
	avgPool3 = v3step{pool: 'a'}
	maxPool3 = v3step{pool: 'm'}
)

// inceptionV3Branches lists each block's branches in the order its forward
// concatenates them.
var inceptionV3Branches = map[string][][]v3step{
	"InceptionA": {mods("branch1x1"), mods("branch5x5_1", "branch5x5_2"), mods("branch3x3dbl_1", "branch3x3dbl_2", "branch3x3dbl_3"),
		{avgPool3, {mod: "branch_pool"}}},
	"InceptionB": {mods("branch3x3"), mods("branch3x3dbl_1", "branch3x3dbl_2", "branch3x3dbl_3"), {maxPool3}},
	"InceptionC": {mods("branch1x1"), mods("branch7x7_1", "branch7x7_2", "branch7x7_3"),
		mods("branch7x7dbl_1", "branch7x7dbl_2", "branch7x7dbl_3", "branch7x7dbl_4", "branch7x7dbl_5"), {avgPool3, {mod: "branch_pool"}}},
	"InceptionD": {mods("branch3x3_1", "branch3x3_2"), mods("branch7x7x3_1", "branch7x7x3_2", "branch7x7x3_3", "branch7x7x3_4"), {maxPool3}},
	"InceptionE": {mods("branch1x1"), {{mod: "branch3x3_1"}, {pair: [2]string{"branch3x3_2a", "branch3x3_2b"}}},
		{{mod: "branch3x3dbl_1"}, {mod: "branch3x3dbl_2"}, {pair: [2]string{"branch3x3dbl_3a", "branch3x3dbl_3b"}}}, {avgPool3, {mod: "branch_pool"}}},
}

func inceptionV3Block(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m); err != nil {
		return err
	}
	branches := inceptionV3Branches[m.ShortClass()]
	var names []string
	for _, br := range branches {
		for _, st := range br {
			switch {
			case st.mod != "":
				names = append(names, st.mod)
			case st.pair[0] != "":
				names = append(names, st.pair[0], st.pair[1])
			}
		}
	}
	kids, err := children(m, names...)
	if err != nil {
		return err
	}
	if len(kids) != len(names) {
		return failure.Unsupportedf("has %d of the %d children torchvision's %s has", len(kids), len(names), m.ShortClass())
	}
	x := b.cur
	var outs []*graph.Value
	sum := 0
	for _, br := range branches {
		b.cur = x
		for _, st := range br {
			c := b.cur.Channels
			switch {
			case st.pool == 'a':
				b.cur = b.g.Add(path+".avg_pool", graph.OpAvgPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, CountIncludePad: true}, nil, b.cur)
				b.cur.Channels = c
			case st.pool == 'm':
				b.cur = b.g.Add(path+".max_pool", graph.OpMaxPool, graph.Attr{KernelSize: [2]int{3, 3}, Stride: [2]int{2, 2}, Dilation: [2]int{1, 1}}, nil, b.cur)
				b.cur.Channels = c
			case st.pair[0] != "":
				in := b.cur
				var pair []*graph.Value
				for _, n := range st.pair {
					b.cur = in
					if err := b.run(m, kids, path, n); err != nil {
						return err
					}
					pair = append(pair, b.cur)
				}
				b.cur = b.g.Add(path+"."+st.pair[0]+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, pair...)
				b.cur.Channels = sumChannels(pair)
			default:
				if err := b.run(m, kids, path, st.mod); err != nil {
					return err
				}
			}
		}
		outs = append(outs, b.cur)
		sum += b.cur.Channels
	}
	b.cur = b.g.Add(path+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, outs...)
	b.cur.Channels = sum
	return nil
}

// mobilenetV2Forward: features, adaptive average pooling to 1x1 (F.
// adaptive_avg_pool2d), flatten, classifier.
func mobilenetV2Forward(b *chainBuilder, m *pth.Module) error {
	kids, err := children(m, "features", "classifier")
	if err != nil {
		return err
	}
	if err := b.run(m, kids, "", "features"); err != nil {
		return err
	}
	b.globalPool("avgpool", false)
	return b.run(m, kids, "", "classifier")
}

// mobilenetV3Forward: features, avgpool, flatten, classifier.
func mobilenetV3Forward(b *chainBuilder, m *pth.Module) error {
	kids, err := children(m, "features", "avgpool", "classifier")
	if err != nil {
		return err
	}
	for _, name := range []string{"features", "avgpool"} {
		if err := b.run(m, kids, "", name); err != nil {
			return err
		}
	}
	if b.cur.Producer.Attr.OutputSize != [2]int{1, 1} {
		return failure.Unsupportedf("avgpool is not AdaptiveAvgPool2d(1)")
	}
	b.globalPool("avgpool", true)
	return b.run(m, kids, "", "classifier")
}

// invertedResidual is MobileNetV2's and V3's block: conv (V2) or block
// (V3), plus the input when use_res_connect.
func invertedResidual(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m, "stride", "use_res_connect", "out_channels"); err != nil {
		return err
	}
	res, ok := m.Attr("use_res_connect").(bool)
	if !ok {
		return fmt.Errorf("use_res_connect is %s, not a bool", describe(m.Attr("use_res_connect")))
	}
	body := "conv"
	if strings.Contains(m.Class, "mobilenetv3") {
		body = "block"
	}
	kids, err := children(m, body)
	if err != nil {
		return err
	}
	x := b.cur
	if err := b.run(m, kids, path, body); err != nil {
		return err
	}
	if res {
		return b.residual(path, "use_res_connect", x)
	}
	return nil
}

// squeezeExcitation is torchvision's SqueezeExcitation: scale =
// scale_activation(fc2(activation(fc1(avgpool(x))))), then scale * x.
func squeezeExcitation(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m); err != nil {
		return err
	}
	order := []string{"avgpool", "fc1", "activation", "fc2", "scale_activation"}
	kids, err := children(m, order...)
	if err != nil {
		return err
	}
	x := b.cur
	for _, name := range order {
		if err := b.run(m, kids, path, name); err != nil {
			return err
		}
	}
	if b.cur.Channels != x.Channels {
		return fmt.Errorf("the gate has %d channels, its input %d", b.cur.Channels, x.Channels)
	}
	c := x.Channels
	b.cur = b.g.Add(path+".mul", graph.OpMul, graph.Attr{}, nil, b.cur, x)
	b.cur.Channels = c
	return nil
}

// mbConv is EfficientNet's MBConv and FusedMBConv: block(x), and when
// use_res_connect, stochastic_depth of it plus x. The StochasticDepth
// module is used only then.
func mbConv(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m, "use_res_connect", "out_channels"); err != nil {
		return err
	}
	res, ok := m.Attr("use_res_connect").(bool)
	if !ok {
		return fmt.Errorf("use_res_connect is %s, not a bool", describe(m.Attr("use_res_connect")))
	}
	kids, err := children(m, "block", "stochastic_depth")
	if err != nil {
		return err
	}
	x := b.cur
	if err := b.run(m, kids, path, "block"); err != nil {
		return err
	}
	if !res {
		// Unused by the forward: still an attribute-checked module.
		if sd := kids["stochastic_depth"]; sd != nil {
			if _, _, err := readLayer(sd); err != nil {
				return fmt.Errorf("%s.stochastic_depth: %w", path, err)
			}
		}
		return nil
	}
	if b.cur.Channels != x.Channels {
		return fmt.Errorf("use_res_connect with %d channels in and %d out", x.Channels, b.cur.Channels)
	}
	if err := b.run(m, kids, path, "stochastic_depth"); err != nil {
		return err
	}
	return b.residual(path, "use_res_connect", x)
}

// residual adds a block's input x to its output, as the block's forward
// does when its flag (apply_residual, use_res_connect) is set.
func (b *chainBuilder) residual(path, flag string, x *graph.Value) error {
	if b.cur.Channels != x.Channels {
		return fmt.Errorf("%s with %d channels in and %d out", flag, x.Channels, b.cur.Channels)
	}
	c := b.cur.Channels
	b.cur = b.g.Add(path+".add", graph.OpAdd, graph.Attr{}, nil, b.cur, x)
	b.cur.Channels = c
	return nil
}

// shufflenetForward is ShuffleNetV2's forward: conv1, maxpool, the three
// stages, conv5, x.mean([2, 3]), fc.
func shufflenetForward(b *chainBuilder, m *pth.Module) error {
	order := []string{"conv1", "maxpool", "stage2", "stage3", "stage4", "conv5"}
	kids, err := children(m, append(order, "fc")...)
	if err != nil {
		return err
	}
	for _, name := range order {
		if err := b.run(m, kids, "", name); err != nil {
			return err
		}
	}
	b.globalPool("mean", false)
	return b.run(m, kids, "", "fc")
}

// shuffleBlock is ShuffleNetV2's InvertedResidual: at stride 1 the input's
// channels are split in two halves (x.chunk(2, dim=1)), the first kept and
// the second through branch2; at stride 2 both branches read the whole
// input; the two are concatenated and the channels shuffled in two groups.
func shuffleBlock(b *chainBuilder, m *pth.Module, path string) error {
	if err := checkAttrs(m, "stride"); err != nil {
		return err
	}
	stride, ok := integer(m.Attr("stride"))
	if !ok || stride < 1 || stride > 3 {
		return fmt.Errorf("stride is %s", describe(m.Attr("stride")))
	}
	kids, err := children(m, "branch1", "branch2")
	if err != nil {
		return err
	}
	x := b.cur
	var left, right *graph.Value
	if stride == 1 {
		if br := kids["branch1"]; br != nil && len(br.Children) > 0 {
			return failure.Unsupportedf("branch1 has layers at stride 1, which torchvision's forward does not use")
		}
		c := x.Channels
		if c%2 != 0 {
			return fmt.Errorf("stride 1 with %d input channels: x.chunk(2) needs an even count", c)
		}
		half := func(name string, start, end int) *graph.Value {
			v := b.g.Add(path+"."+name, graph.OpSlice, graph.Attr{Axis: 1, Layout: &graph.Layout{Start: start, End: end}}, nil, x)
			v.Channels = end - start
			return v
		}
		left = half("chunk0", 0, c/2)
		b.cur = half("chunk1", c/2, c)
	} else {
		if kids["branch1"] == nil || len(kids["branch1"].Children) == 0 {
			return fmt.Errorf("stride %d without branch1", stride)
		}
		if err := b.run(m, kids, path, "branch1"); err != nil {
			return err
		}
		left = b.cur
		b.cur = x
	}
	if err := b.run(m, kids, path, "branch2"); err != nil {
		return err
	}
	right = b.cur
	c := left.Channels + right.Channels
	if c%2 != 0 {
		return fmt.Errorf("%d channels cannot be shuffled in two groups", c)
	}
	cat := b.g.Add(path+".cat", graph.OpConcat, graph.Attr{Axis: 1}, nil, left, right)
	cat.Channels = c
	// channel_shuffle(out, 2): view(b, 2, c // 2, h, w), transpose(1, 2),
	// view(b, -1, h, w).
	v := b.g.Add(path+".shuffle.view", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{
		graph.RefDim(0, 0), graph.ConstDim(2), graph.ConstDim(int64(c / 2)), graph.RefDim(0, 2), graph.RefDim(0, 3)}}}, nil, cat)
	v.Channels = 2
	v = b.g.Add(path+".shuffle.transpose", graph.OpTranspose, graph.Attr{Layout: &graph.Layout{Perm: []int{0, 2, 1, 3, 4}}}, nil, v)
	v.Channels = c / 2
	v = b.g.Add(path+".shuffle.flatten", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{
		graph.RefDim(0, 0), graph.ConstDim(-1), graph.RefDim(0, 3), graph.RefDim(0, 4)}}}, nil, v)
	v.Channels = c
	b.cur = v
	return nil
}
