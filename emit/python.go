// Package emit writes the Python side of a conversion: a self-contained
// module whose Model class builds the converted network, loads the converted
// checkpoint with strict key matching, and computes the graph in forward.
//
// The generated forward honours the two contracts that make the conversion
// pay off in training memory: nothing is applied in place to the output of an
// InPlaceABN layer (autograd saved it), and DenseNet layers marked for
// recomputation keep neither their concatenation nor their normalised output
// for the backward pass, without counting a batch twice in the running
// statistics.
package emit

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// Options tune the generated module.
type Options struct {
	// Header is free text from the caller (tool version, flags), placed in
	// the module docstring.
	Header string
	// NoRecompute emits the nodes of recompute groups one by one, as if
	// they were not marked: the same function, without the memory saving.
	NoRecompute bool
	// Counters are the checkpoint's 0-dim integer tensors that belong to
	// no layer (an AveragedModel's "n_averaged"): Model registers each as
	// a buffer, so that the converted checkpoint loads with strict=True.
	Counters []string
}

// Python returns the source of a Python module defining class Model, a
// torch.nn.Module with a no-argument constructor that computes g. The keys of
// Model().state_dict() are g's parameter keys, with one exception: a norm
// that has running statistics always has num_batches_tracked too, so a node
// without that key gets one more (torch fills it with 0 when it loads a
// checkpoint whose metadata gives no version, or version 1, for that module).
// The output depends on g and opt only.
func Python(g *graph.Graph, opt Options) ([]byte, error) {
	if g == nil {
		return nil, errors.New("emit: no graph")
	}
	if err := g.Validate(); err != nil {
		return nil, fmt.Errorf("emit: %w", err)
	}
	p, err := plan(g, opt)
	if err != nil {
		return nil, fmt.Errorf("emit %s: %w", g.Arch, err)
	}
	var b bytes.Buffer
	p.writeDoc(&b)
	p.writeHelpers(&b)
	p.writeInit(&b)
	if err := p.writeForward(&b); err != nil {
		return nil, fmt.Errorf("emit %s: %w", g.Arch, err)
	}
	return b.Bytes(), nil
}

func (p *program) writeDoc(b *bytes.Buffer) {
	arch := p.g.Arch
	if arch == "" {
		arch = "network"
	}
	fmt.Fprintf(b, "\"\"\"%s, converted to InPlace-ABN by abnconvert.\n\n", docText(arch))
	b.WriteString("Generated file: regenerate it with abnconvert instead of editing it.\n")
	if h := strings.TrimSpace(p.opt.Header); h != "" {
		fmt.Fprintf(b, "\n%s\n", docText(h))
	}
	b.WriteString(`
Load the converted checkpoint (needs PyTorch and the inplace_abn package,
mapillary's v1.1.0 API, importable):

    import torch
    m = Model()
    m.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
`)
	if p.inPlace > 0 {
		fmt.Fprintf(b, `
In place: the InPlaceABN layers (%d here) overwrite their input with their
output and keep only that output for the backward pass. Never apply an
in-place operation (relu_, add_, +=) to such an output: autograd raises at
backward time. Residual additions and the activations after them are out of
place here for that reason`, p.inPlace)
		if p.residuals == 0 {
			b.WriteString(".\n")
		} else {
			fmt.Fprintf(b, `, except where an InPlaceABN(identity) layer
ends a residual block (%d here): _inplace_abn_add then adds the residual
inside the layer's own autograd step, writing the sum over the layer's input,
and keeps only the sum (which the next layer keeps anyway) and the residual
(which the block's first layer keeps anyway); its backward recovers the
layer's output as sum - residual. Adding the residual in place after the
layer would overwrite what the layer saved; out of place, both the layer's
output and the sum would be kept.
`, p.residuals)
		}
	}
	if p.signed > 0 {
		fmt.Fprintf(b, `
Sign flips: the layers with an input_sign buffer (%d here, not part of the
state dict) negate some of their input channels just before normalising. That
represents a negative BatchNorm scale exactly, which |weight| + eps cannot;
the running_mean entries of those channels are stored negated to match.
`, p.signed)
	}
	if p.groups > 0 {
		fmt.Fprintf(b, `
Recomputation: the DenseNet layers marked so (%d here) keep neither their
concatenated input nor their normalised output for the backward pass
(shared-buffer recomputation).
In training they run under torch.utils.checkpoint (reentrant) and are
recomputed during backward, without updating the running statistics a second
time. Reentrant checkpointing supports loss.backward(), not torch.autograd.grad.
`, p.groups)
	}
	b.WriteString("\"\"\"\n\n")
}

func (p *program) writeHelpers(b *bytes.Buffer) {
	b.WriteString("import torch\nimport torch.nn.functional as F\n")
	if p.uses(graph.OpStochasticDepth) {
		b.WriteString("import torchvision\n")
	}
	if p.groups > 0 {
		b.WriteString("from torch.utils.checkpoint import checkpoint\n")
	}
	if p.trainOnlyAux() {
		b.WriteString("import collections\n")
	}
	b.WriteString("\nimport inplace_abn\n")
	if p.trainOnlyAux() {
		// torchvision's GoogLeNetOutputs and InceptionOutputs are
		// namedtuples too: the fields are read by name or position alike.
		fmt.Fprintf(b, "\n_Outputs = collections.namedtuple(\"Outputs\", [%s])\n", strings.Join(p.outputFields(), ", "))
	}
	b.WriteString(`

def _place(root, path, module):
    """Attach module at its state-dict path, making plain containers on the way."""
    parent = root
    names = path.split(".")
    for name in names[:-1]:
        child = parent._modules.get(name)
        if child is None:
            child = torch.nn.Module()
            parent.add_module(name, child)
        parent = child
    parent.add_module(names[-1], module)
    return module
`)
	if p.signed > 0 {
		b.WriteString(`

def _sign_vector(channels, mask):
    """The +1/-1 multiplier of a layer's input channels, shaped [1, C, 1, 1].

    Bit c of the hexadecimal mask is set when channel c is negated.
    """
    bits = int(mask, 16)
    signs = [-1.0 if (bits >> c) & 1 else 1.0 for c in range(channels)]
    return torch.tensor(signs).view(1, channels, 1, 1)
`)
	}
	if p.residuals > 0 {
		b.WriteString(inPlaceABNAdd)
	}
	if p.groups > 0 {
		b.WriteString(`

def _recompute(training, body, norms, *features):
    """Run one shared-buffer group: body(*features), typically concatenation,
    norm and 1x1 convolution.

    In training with autograd on, the group runs under checkpoint: the first
    call runs without grad, so neither the concatenation nor the norm output is
    kept, and backward calls body again to rebuild them. That second call sees
    the same batch and must not count it again in the running statistics, so
    it updates scratch copies, swapped in for the call and swapped out after.
    Copying the old values back in place instead would break BatchNorm2d,
    whose backward keeps its running statistics and checks they are intact.
    In eval, without grad, or when no feature needs a gradient (reentrant
    checkpoint would then drop the gradients of the group's own parameters),
    body simply runs.
    """
    if not (training and torch.is_grad_enabled() and any(f.requires_grad for f in features)):
        return body(*features)

    def run(*xs):
        if not torch.is_grad_enabled():
            return body(*xs)
        kept = [(n.running_mean, n.running_var, n.num_batches_tracked) for n in norms]
        for n, stats in zip(norms, kept):
            n.running_mean, n.running_var, n.num_batches_tracked = (
                None if t is None else t.clone() for t in stats)
        try:
            return body(*xs)
        finally:
            for n, stats in zip(norms, kept):
                n.running_mean, n.running_var, n.num_batches_tracked = stats

    return checkpoint(run, *features, use_reentrant=True)
`)
	}
}

func (p *program) writeInit(b *bytes.Buffer) {
	fmt.Fprintf(b, "\n\nclass Model(torch.nn.Module):\n")
	fmt.Fprintf(b, "    \"\"\"%s with InPlace-ABN; parameters and buffers named as in the converted checkpoint.\"\"\"\n\n", docText(orDefault(p.g.Arch, "The network")))
	b.WriteString("    def __init__(self):\n        super().__init__()\n")
	if len(p.layers) == 0 {
		b.WriteString("        pass\n")
	}
	for _, k := range p.opt.Counters {
		fmt.Fprintf(b, "        self.register_buffer(%s, torch.tensor(0, dtype=torch.long))  # carried from the checkpoint, no layer's\n", pyStr(k))
	}
	for _, l := range p.layers {
		call := fmt.Sprintf("_place(self, %s, %s)", pyStr(l.path), l.ctor)
		if l.sign == "" {
			fmt.Fprintf(b, "        %s\n", call)
			continue
		}
		fmt.Fprintf(b, "        %s.register_buffer(\n            \"input_sign\", _sign_vector(%d, %s), persistent=False)  # negated channels: %d\n",
			call, len(l.node.Sign), pyStr(l.sign), l.flips)
	}
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

func (p *program) writeForward(b *bytes.Buffer) error {
	b.WriteString("\n    def forward(self, x):\n")
	b.WriteString("        # Looked up on every call so that copies and replicas of the model use their own modules.\n")
	b.WriteString("        mods = dict(self.named_modules())\n")
	group := 0
	for i, s := range p.steps {
		if s.group == "" {
			line, err := p.nodeLine(s.nodes[0])
			if err != nil {
				return err
			}
			fmt.Fprintf(b, "        %s\n", line)
		} else {
			group++
			if err := p.writeGroup(b, s, group); err != nil {
				return err
			}
		}
		if d := p.dels[i]; len(d) > 0 {
			fmt.Fprintf(b, "        del %s\n", p.names(d))
		}
	}
	p.writeReturn(b)
	return nil
}

// writeReturn returns what the original model returns: the output alone;
// with auxiliary outputs, a dict of them all (torchvision's segmentation
// models, an ONNX graph with several outputs); with training-only ones
// (GoogLeNet, Inception3), a namedtuple of them all in training and the
// main output alone in eval.
func (p *program) writeReturn(b *bytes.Buffer) {
	main := p.vars[p.g.Output]
	if len(p.g.Aux) == 0 {
		fmt.Fprintf(b, "        return %s\n", main)
		return
	}
	vars := []string{main}
	for _, a := range p.g.Aux {
		vars = append(vars, p.vars[a.Value])
	}
	if p.trainOnlyAux() {
		fmt.Fprintf(b, "        if self.training:\n            return _Outputs(%s)\n        return %s\n", strings.Join(vars, ", "), main)
		return
	}
	items := []string{fmt.Sprintf("%s: %s", pyStr(orDefault(p.g.OutputName, "out")), main)}
	for i, a := range p.g.Aux {
		items = append(items, fmt.Sprintf("%s: %s", pyStr(a.Name), vars[i+1]))
	}
	fmt.Fprintf(b, "        return {%s}\n", strings.Join(items, ", "))
}

// trainOnlyAux says the model returns its auxiliary outputs in training
// only (all of them are then; Validate-level mixing is not produced by
// any builder).
func (p *program) trainOnlyAux() bool {
	return len(p.g.Aux) > 0 && p.g.Aux[0].TrainOnly
}

// outputFields are the namedtuple's fields for training-only auxiliary
// outputs: the main output's name, then theirs.
func (p *program) outputFields() []string {
	f := []string{pyStr(orDefault(p.g.OutputName, "logits"))}
	for _, a := range p.g.Aux {
		f = append(f, pyStr(a.Name))
	}
	return f
}

func (p *program) writeGroup(b *bytes.Buffer, s *step, k int) error {
	fn := fmt.Sprintf("group%d", k)
	fmt.Fprintf(b, "\n        def %s(%s):  # %s: recomputed in backward\n", fn, p.names(s.ins), commentText(s.group))
	var norms []string
	for _, n := range s.nodes {
		line, err := p.nodeLine(n)
		if err != nil {
			return err
		}
		fmt.Fprintf(b, "            %s\n", line)
		if n.Op.IsBNFamily() {
			norms = append(norms, fmt.Sprintf("mods[%s]", pyStr(p.byNode[n].path)))
		}
	}
	fmt.Fprintf(b, "            return %s\n", p.names(s.outs))
	fmt.Fprintf(b, "        %s = _recompute(self.training, %s, [%s], %s)\n\n",
		p.names(s.outs), fn, strings.Join(norms, ", "), p.names(s.ins))
	return nil
}

func (p *program) names(vs []*graph.Value) string {
	var out []string
	for _, v := range vs {
		out = append(out, p.vars[v])
	}
	return strings.Join(out, ", ")
}

// nodeLine is the one statement computing n, with a comment naming it.
func (p *program) nodeLine(n *graph.Node) (string, error) {
	a := n.Attr
	in := func(i int) string { return p.vars[n.Inputs[i]] }
	var expr, note string
	switch n.Op {
	case graph.OpConv, graph.OpLinear:
		expr = fmt.Sprintf("mods[%s](%s)", pyStr(p.byNode[n].path), in(0))
	case graph.OpBatchNorm, graph.OpABN, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
		l := p.byNode[n]
		mod := fmt.Sprintf("mods[%s]", pyStr(l.path))
		arg := in(0)
		own := private(n.Inputs[0], p.g)
		switch {
		case l.sign != "" && own:
			// The input is this layer's alone: flip it where it lies.
			arg = fmt.Sprintf("%s.mul_(%s.input_sign)", arg, mod)
			note = fmt.Sprintf(", negating %d input channels first", l.flips)
		case l.sign != "":
			arg = fmt.Sprintf("%s * %s.input_sign", arg, mod)
			note = fmt.Sprintf(", negating %d input channels first, into a new tensor (input shared)", l.flips)
		case isInPlace(n.Op) && !own:
			arg += ".clone()"
			note = ", on a copy (input shared)"
		}
		if isInPlace(n.Op) {
			note = ", in place" + note
		}
		if n.Op != graph.OpBatchNorm {
			note = " " + activationText(a) + note
		}
		expr = fmt.Sprintf("%s(%s)", mod, arg)
		if r := n.Residual(); r != nil {
			expr = fmt.Sprintf("_inplace_abn_add(%s, %s, %s)", mod, arg, p.vars[r])
			note += ", plus the residual " + p.vars[r] + " (only the sum is kept)"
		}
	case graph.OpLeakyReLU:
		expr = fmt.Sprintf("F.leaky_relu(%s, %s)", in(0), pyFloat(a.ActParam))
	case graph.OpELU:
		expr = fmt.Sprintf("F.elu(%s, %s)", in(0), pyFloat(a.ActParam))
	case graph.OpHardtanh:
		if a.ActParam == 0 && a.ActParam2 == 6 {
			expr = fmt.Sprintf("F.relu6(%s)", in(0))
		} else {
			expr = fmt.Sprintf("F.hardtanh(%s, %s, %s)", in(0), pyFloat(a.ActParam), pyFloat(a.ActParam2))
		}
	case graph.OpHardsigmoid:
		if a.ActParam == 1.0/6 && a.ActParam2 == 0.5 {
			expr = fmt.Sprintf("F.hardsigmoid(%s)", in(0))
		} else {
			// ONNX's HardSigmoid with other alpha and beta.
			expr = fmt.Sprintf("torch.clamp(%s * %s + %s, 0.0, 1.0)", in(0), pyFloat(a.ActParam), pyFloat(a.ActParam2))
		}
	case graph.OpCELU:
		expr = fmt.Sprintf("F.celu(%s, %s)", in(0), pyFloat(a.ActParam))
	case graph.OpSoftplus:
		expr = fmt.Sprintf("F.softplus(%s, %s, %s)", in(0), pyFloat(a.ActParam), pyFloat(a.ActParam2))
	case graph.OpAdd:
		expr = strings.Join(p.operands(n), " + ")
	case graph.OpConcat:
		expr = fmt.Sprintf("torch.cat([%s], %d)", strings.Join(p.operands(n), ", "), a.Axis)
	case graph.OpMaxPool:
		// A zero stride means "not set": PyTorch's default is the kernel size.
		expr = fmt.Sprintf("F.max_pool2d(%s, %s, stride=%s, padding=%s, dilation=%s, ceil_mode=%s)",
			in(0), pyPair(a.KernelSize), pyPair(poolStride(a)), pyPair(a.Padding), pyPair(pairOrOne(a.Dilation)), pyBool(a.CeilMode))
	case graph.OpAvgPool:
		expr = fmt.Sprintf("F.avg_pool2d(%s, %s, stride=%s, padding=%s, ceil_mode=%s, count_include_pad=%s)",
			in(0), pyPair(a.KernelSize), pyPair(poolStride(a)), pyPair(a.Padding), pyBool(a.CeilMode), pyBool(a.CountIncludePad))
	case graph.OpAdaptiveAvgPool:
		expr = fmt.Sprintf("F.adaptive_avg_pool2d(%s, %s)", in(0), pyPair(a.OutputSize))
	case graph.OpFlatten:
		expr = fmt.Sprintf("torch.flatten(%s, %d)", in(0), a.StartDim)
	case graph.OpDropout:
		expr = fmt.Sprintf("F.dropout(%s, %s, training=self.training)", in(0), pyFloat(a.P))
	case graph.OpStochasticDepth:
		// torchvision's own function: the same noise as the original
		// draws from the same generator state.
		mode := "row"
		if a.Mode == graph.StochasticBatch {
			mode = a.Mode
		}
		expr = fmt.Sprintf("torchvision.ops.stochastic_depth(%s, %s, %s, self.training)", in(0), pyFloat(a.P), pyStr(mode))
	case graph.OpResize:
		align := ""
		if a.Mode != "nearest" {
			align = ", align_corners=" + pyBool(a.AlignCorners)
		}
		switch {
		case len(n.Inputs) == 2:
			// To the second input's size at run time, as torchvision's
			// segmentation models do: any input size works.
			expr = fmt.Sprintf("F.interpolate(%s, size=%s.shape[-2:], mode=%s%s)", in(0), in(1), pyStr(a.Mode), align)
		case a.Size != [2]int{}:
			expr = fmt.Sprintf("F.interpolate(%s, size=%s, mode=%s%s)", in(0), pyPair(a.Size), pyStr(a.Mode), align)
		default:
			// nn.Upsample(scale_factor=...)'s call, recompute_scale_factor
			// left None: torch steps through the input by 1/scale.
			expr = fmt.Sprintf("F.interpolate(%s, scale_factor=%s, mode=%s%s)", in(0), pyScale(a.Scale), pyStr(a.Mode), align)
		}
	default:
		if info, _ := n.Op.Info(); info.Python != "" {
			// The table's expression (graph.OpInfo.Python) of the
			// inputs in order: the ops without attributes.
			ins := make([]any, len(n.Inputs))
			for k := range ins {
				ins[k] = in(k)
			}
			expr = fmt.Sprintf(info.Python, ins...)
			break
		}
		var ok bool
		if expr, ok = p.layoutExpr(n); !ok {
			return "", failure.Unsupportedf("node %q: op %q not supported by the Python emitter", n.Name, n.Op)
		}
	}
	return fmt.Sprintf("%s = %s  # %s: %s%s", p.vars[n.Out], expr, commentText(n.Name), n.Op, note), nil
}

func (p *program) operands(n *graph.Node) []string {
	var out []string
	for _, v := range n.Inputs {
		out = append(out, p.vars[v])
	}
	return out
}

func poolStride(a graph.Attr) [2]int {
	s := a.Stride
	for i := range s {
		if s[i] == 0 {
			s[i] = a.KernelSize[i]
		}
	}
	return s
}

func activationText(a graph.Attr) string {
	if a.Activation == graph.ActLeakyReLU || a.Activation == graph.ActELU {
		return fmt.Sprintf("%s(%s)", a.Activation, pyFloat(a.ActParam))
	}
	return a.Activation
}

// uses reports whether the graph has a node of op.
func (p *program) uses(op graph.Op) bool {
	for _, n := range p.g.Nodes {
		if n.Op == op {
			return true
		}
	}
	return false
}
