package verify

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/runtime"
)

// The probe: ground truth from outside abnconvert. verify compares the
// conversion with abnconvert's own rebuild of the original; when the
// rebuild is wrong (a structure assumed from keys and shapes that the
// user's model does not have, a BN momentum an export froze), both sides
// share the mistake and the comparison passes. python/abnexport.py records
// what real PyTorch computed on the user's model object; verify runs the
// rebuild of the original on the probe's input first and compares.

// ProbeVersion is the probe format this abnconvert reads
// (python/abnexport.py's FORMAT_VERSION).
const ProbeVersion = 1

// Probe limits. Both sides are float32 implementations of the same network
// with different summation orders: on the fixtures and resnet50 they agree
// to 1e-6..1e-5 of the largest magnitude in eval and in the training
// forward (resnet50 with trained-like BN at 2x3x64x64: 4e-5, 6e-5), while a wrong structure moves the outputs by 1e-1 and a wrong
// momentum the running statistics by 1e-2 or more; 1e-3 leaves a factor of
// 100 either way. The input gradient is looser: a ReLU mask or max-pool
// argmax at a value next to zero may fall the other way in the other
// implementation and move every gradient upstream by a step (1-4% on
// resnet50 at batch 2, 64x64: see verify's noise; its probe measured 1.0e-2),
// while a wrong structure gives a gradient off by its own size (1.3 to 3.5
// measured).
const (
	probeEvalLimit  = 1e-3 // eval outputs, before and after the step: max |diff| / max |probe|
	probeTrainLimit = 1e-3 // training outputs, running statistics: relative L2
	probeGradLimit  = 1e-1 // input gradient: relative L2
)

// Probe is what python/abnexport.py recorded from the user's model.
type Probe struct {
	Path string
	// Input is the seeded input every check runs on.
	Input *runtime.HostTensor
	// Eval and After are the eval-mode outputs before and after the
	// training step; Train the training step's outputs and GradOut their
	// gradients g (the loss is sum over outputs of sum(output * g)).
	Eval, Train, GradOut, After []*runtime.HostTensor
	InputGrad                   *runtime.HostTensor
	// Stats holds every BN buffer after the step, by state-dict key.
	Stats map[string][]float32
	// RandomEval counts the Dropout and StochasticDepth layers the probe's
	// training step ran in eval mode (their masks cannot be reproduced).
	RandomEval int
}

// ProbeResult is the comparison of the rebuild of the original with the
// probe.
type ProbeResult struct {
	File  string `json:"file"`
	Input []int  `json:"input_shape"`
	// RandomLayersEval: Dropout and StochasticDepth layers run in eval mode
	// during both training steps, the probe's and the rebuild's.
	RandomLayersEval int      `json:"random_layers_eval"`
	Checks           []Check  `json:"checks"`
	Pass             bool     `json:"pass"`
	Failed           []string `json:"failed,omitempty"`
	// Cause names the likely cause of a failure and the next step.
	Cause string `json:"cause,omitempty"`
}

// ReadProbe reads and validates a probe file. Every error names the file.
func ReadProbe(path string) (*Probe, error) {
	m, err := model.Open(path)
	if err != nil {
		return nil, fmt.Errorf("probe %w", err)
	}
	defer m.Close()
	if m.ONNX != nil || m.Module != nil {
		return nil, fmt.Errorf("probe %s: not a probe (an ONNX model or a whole module): record one with python/abnexport.py", path)
	}
	p, err := readProbe(path, m.Weights)
	if err != nil {
		return nil, fmt.Errorf("probe %s: %w", path, err)
	}
	return p, nil
}

var errNotProbe = errors.New("not an abnconvert probe")

func readProbe(path string, w graph.Weights) (*Probe, error) {
	p := &Probe{Path: path, Stats: map[string][]float32{}}
	tensor := func(k string) (*runtime.HostTensor, error) {
		shape, ok := w.Shape(k)
		if !ok {
			return nil, fmt.Errorf("no entry %q: record the probe again with python/abnexport.py", k)
		}
		v, err := graph.Float32Values(w, k)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
		return &runtime.HostTensor{Shape: append([]int(nil), shape...), Data: v}, nil
	}
	ver, err := tensor("abnconvert_probe")
	if err != nil {
		return nil, fmt.Errorf("%w (no \"abnconvert_probe\" entry): record one with python/abnexport.py", errNotProbe)
	}
	if len(ver.Data) != 1 || int(ver.Data[0]) != ProbeVersion {
		return nil, fmt.Errorf("probe format version %v; this abnconvert reads version %d: record it again with this abnconvert's python/abnexport.py", ver.Data, ProbeVersion)
	}
	if p.Input, err = tensor("input"); err != nil {
		return nil, err
	}
	if len(p.Input.Shape) < 2 {
		return nil, fmt.Errorf("input has shape %v: a batch of at least (N, C) is needed", p.Input.Shape)
	}
	if p.InputGrad, err = tensor("train.input_grad"); err != nil {
		return nil, err
	}
	if fmt.Sprint(p.InputGrad.Shape) != fmt.Sprint(p.Input.Shape) {
		return nil, fmt.Errorf("train.input_grad has shape %v, the input %v", p.InputGrad.Shape, p.Input.Shape)
	}
	if r, err := tensor("random_layers_eval"); err == nil && len(r.Data) == 1 {
		p.RandomEval = int(r.Data[0])
	}

	// Every other entry: a numbered output, or a BN buffer; anything else
	// is refused rather than ignored (a probe of another format).
	outs := map[string]map[int]*runtime.HostTensor{"eval.output": {}, "train.output": {}, "train.grad_output": {}, "after.output": {}}
	known := map[string]bool{"abnconvert_probe": true, "input": true, "train.input_grad": true, "random_layers_eval": true, "seed": true}
	for _, k := range w.Keys() {
		switch {
		case known[k]:
			continue
		case strings.HasPrefix(k, "train.stats."):
			t, err := tensor(k)
			if err != nil {
				return nil, err
			}
			p.Stats[strings.TrimPrefix(k, "train.stats.")] = t.Data
			continue
		}
		i := strings.LastIndexByte(k, '.')
		group, ok := outs[k[:max(i, 0)]]
		n, err := strconv.Atoi(k[i+1:])
		if i < 0 || !ok || err != nil || n < 0 {
			return nil, fmt.Errorf("unexpected entry %q: not a probe python/abnexport.py (format %d) writes", k, ProbeVersion)
		}
		if group[n], err = tensor(k); err != nil {
			return nil, err
		}
	}
	list := func(name string) ([]*runtime.HostTensor, error) {
		g := outs[name]
		l := make([]*runtime.HostTensor, len(g))
		for k := range l {
			if l[k] = g[k]; l[k] == nil {
				return nil, fmt.Errorf("no entry %q (the probe holds %d %s entries): record the probe again with python/abnexport.py", fmt.Sprintf("%s.%d", name, k), len(g), name)
			}
		}
		if len(l) == 0 {
			return nil, fmt.Errorf("no entry %q: record the probe again with python/abnexport.py", name+".0")
		}
		return l, nil
	}
	for _, f := range []struct {
		name string
		to   *[]*runtime.HostTensor
	}{{"eval.output", &p.Eval}, {"train.output", &p.Train}, {"train.grad_output", &p.GradOut}, {"after.output", &p.After}} {
		if *f.to, err = list(f.name); err != nil {
			return nil, err
		}
	}
	if len(p.GradOut) != len(p.Train) {
		return nil, fmt.Errorf("%d training outputs but %d output gradients", len(p.Train), len(p.GradOut))
	}
	for k := range p.Train {
		if fmt.Sprint(p.Train[k].Shape) != fmt.Sprint(p.GradOut[k].Shape) {
			return nil, fmt.Errorf("train.output.%d has shape %v, its gradient %v", k, p.Train[k].Shape, p.GradOut[k].Shape)
		}
	}
	if len(p.After) != len(p.Eval) {
		return nil, fmt.Errorf("%d eval outputs but %d after the step", len(p.Eval), len(p.After))
	}
	if len(p.Stats) == 0 {
		return nil, errors.New("no train.stats entries: the model has no BatchNorm with running statistics, or the probe was not written by python/abnexport.py")
	}
	return p, nil
}

// quietRandom makes g's random layers deterministic for the probe's
// training step, as abnexport.py did in PyTorch (eval mode there): Dropout
// with p = 0 keeps every element at scale 1/(1-0), StochasticDepth with
// p = 0 is inactive (the runtime's own rules); g is the probe's own
// rebuild, so nothing else sees the change. It returns how many it changed.
func quietRandom(g *graph.Graph) int {
	n := 0
	for _, nd := range g.Nodes {
		if nd.Op == graph.OpDropout || nd.Op == graph.OpStochasticDepth {
			nd.Attr.P = 0
			n++
		}
	}
	return n
}

// runProbe runs the rebuild of the original (g over w) on the probe's input
// as the probe was recorded, and compares: eval outputs, training outputs,
// input gradient, running statistics, eval after the step. An error means
// the probe cannot be run through the network at all (another model's).
func runProbe(p *Probe, g *graph.Graph, w graph.Weights, newBackend func() (runtime.Backend, error), opt Options) (*ProbeResult, error) {
	res := &ProbeResult{File: p.Path, Input: p.Input.Shape, RandomLayersEval: p.RandomEval}
	quietRandom(g)
	n, err := newNetwork(newBackend, opt.Seed, g, w, "original (probe)", opt.Progress)
	if err != nil {
		return nil, err
	}
	defer n.ex.Close()
	bad := func(err error) error {
		return fmt.Errorf("probe %s: the probe's input %v does not run through the original's network (%w): was it recorded from another model?", p.Path, p.Input.Shape, err)
	}
	evalOuts := func() ([]*runtime.HostTensor, error) {
		if _, err := n.ex.Forward(p.Input, false); err != nil {
			return nil, bad(err)
		}
		outs := n.ex.Outputs()
		l := outs[:1]
		for k, a := range g.Aux {
			if !a.TrainOnly {
				l = append(l, outs[k+1])
			}
		}
		return l, nil
	}
	outputs := func(name string, got, want []*runtime.HostTensor, cmp func(string, []float32, []float32) Check) {
		if len(got) != len(want) {
			res.add(Check{Name: name, Metric: "max", Note: fmt.Sprintf("the rebuild returns %d outputs, the probe %d", len(got), len(want))})
			return
		}
		for k := range want {
			nm := name
			if len(want) > 1 {
				nm = fmt.Sprintf("%s %d", name, k)
			}
			if fmt.Sprint(got[k].Shape) != fmt.Sprint(want[k].Shape) {
				res.add(Check{Name: nm, Metric: "max", Note: fmt.Sprintf("shape %v, the probe's %v", got[k].Shape, want[k].Shape)})
				continue
			}
			res.add(cmp(nm, got[k].Data, want[k].Data))
		}
	}
	evalCmp := func(nm string, got, want []float32) Check { return compare(nm, got, want, nil, probeEvalLimit) }
	trainCmp := func(nm string, got, want []float32) Check { return compareL2(nm, got, want, nil, probeTrainLimit) }

	opt.progress("the original network on the probe's input %v (%s): eval, one training step, eval again", p.Input.Shape, p.Path)
	ys, err := evalOuts()
	if err != nil {
		return nil, err
	}
	outputs("eval output", ys, p.Eval, evalCmp)

	if _, err := n.ex.Forward(p.Input, true); err != nil {
		return nil, bad(err)
	}
	ts := n.ex.Outputs()
	outputs("train output", ts, p.Train, trainCmp)
	same := len(ts) == len(p.Train)
	for k := range ts {
		same = same && fmt.Sprint(ts[k].Shape) == fmt.Sprint(p.Train[k].Shape)
	}
	if same {
		dx, _, err := n.ex.BackwardAll(p.GradOut)
		if err != nil {
			return nil, fmt.Errorf("probe %s: original network, backward: %w", p.Path, err)
		}
		res.add(compareL2("input gradient", dx.Data, p.InputGrad.Data, nil, probeGradLimit))
	} else {
		res.add(Check{Name: "input gradient", Metric: "l2", Note: "not computed: the training outputs differ in number or shape"})
	}
	stats, err := n.ex.RunningStats()
	if err != nil {
		return nil, err
	}
	keys := make([]string, 0, len(p.Stats))
	for k := range p.Stats {
		keys = append(keys, k)
	}
	for k := range stats {
		if _, ok := p.Stats[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		got, inRebuild := stats[k]
		want, inProbe := p.Stats[k]
		name := "running " + k
		switch {
		case !inRebuild && strings.HasSuffix(k, graph.RoleNumBatches):
			// An ONNX graph carries no num_batches_tracked (the export
			// drops its update): nothing to compare with.
			res.add(Check{Name: name, Pass: true}.skip("the rebuild of the original has no num_batches_tracked (an ONNX graph does not carry it)"))
		case !inRebuild:
			res.add(Check{Name: name, Note: "in the probe, not in the rebuild of the original"})
		case !inProbe:
			res.add(Check{Name: name, Note: "in the rebuild of the original, not in the probe"})
		case strings.HasSuffix(k, graph.RoleNumBatches):
			ok := len(got) == 1 && len(want) == 1 && got[0] == want[0]
			res.add(Check{Name: name, Pass: ok, Note: fmt.Sprintf("%v vs the probe's %v", got, want)})
		default:
			res.add(trainCmp(name, got, want))
		}
	}
	after, err := evalOuts()
	if err != nil {
		return nil, err
	}
	outputs("eval output after training step", after, p.After, evalCmp)
	res.Pass = len(res.Failed) == 0
	return res, nil
}

func (r *ProbeResult) add(c Check) {
	if c.Metric == "" {
		c.Metric = "l2"
	}
	r.Checks = append(r.Checks, c)
	if !c.Pass && !c.Skipped {
		r.Failed = append(r.Failed, c.Name)
	}
}

// Structure sources, for Result.Structure.
const (
	StructureAssumed = "assumed" // recognised from the state dict's keys and shapes
	StructureRead    = "read"    // read from --graph, an ONNX input or a whole pickled module
)

// structureOf says whether the structure of the original was assumed from
// its keys and shapes, and the assumption in words.
func structureOf(m *model.Model, opt Options, arch string) (string, string) {
	if m.ONNX != nil || opt.Graph != "" || m.Module != nil {
		return StructureRead, ""
	}
	return StructureAssumed, fmt.Sprintf("the structure recognised from the state dict's keys and shapes (%s)", arch)
}

// againstProbe fills in where the structure came from and, with a probe,
// compares a fresh rebuild of the original (rebuild) with it; a failed
// probe check fails the verdict. Called once res is made, before the
// conversion is compared with the rebuild.
func (opt Options) againstProbe(res *Result, structure, assumption string, rebuild func() (*graph.Graph, graph.Weights, func(), error), newBackend func() (runtime.Backend, error)) error {
	res.Structure, res.Assumption = structure, assumption
	if opt.Probe == "" {
		res.Conditional = structure == StructureAssumed
		return nil
	}
	p, err := ReadProbe(opt.Probe)
	if err != nil {
		return err
	}
	g, w, done, err := rebuild()
	if err != nil {
		return err
	}
	defer done()
	pr, err := runProbe(p, g, w, newBackend, opt)
	if err != nil {
		return err
	}
	if !pr.Pass {
		pr.Cause = probeCause(pr, res, opt)
	}
	res.Probe = pr
	for _, c := range pr.Checks {
		c.Name = "probe: " + c.Name
		res.count(c)
	}
	return nil
}

// probeCause names the likely cause of a failed probe and the next step.
func probeCause(pr *ProbeResult, res *Result, opt Options) string {
	onlyStats := true
	for _, f := range pr.Failed {
		onlyStats = onlyStats && strings.HasPrefix(f, "running ")
	}
	head := fmt.Sprintf("abnconvert's rebuild of the original differs from what PyTorch computed on your model (%s): ", pr.File)
	prefix := strings.TrimSuffix(strings.TrimSuffix(pr.File, ".probe.pth"), ".pth")
	other := fmt.Sprintf("; or the probe was recorded from other weights than %s (abnexport.py writes both from one model)", opt.Original)
	switch {
	case res.Structure == StructureAssumed:
		return head + fmt.Sprintf("%s does not match: convert with --graph %s.onnx from abnexport.py (or from the whole pickled module), and verify with the same --graph", res.Assumption, prefix) + other
	case onlyStats:
		return head + "the outputs agree but the running statistics move differently after one step: a BN momentum the rebuild does not have (momentum=None, which an ONNX export freezes into a constant, is the known case: convert the whole pickled module instead)" + other
	case opt.Graph != "":
		return head + fmt.Sprintf("the network rebuilt from --graph %s computes differently: check that the export comes from the same model as the probe, else abnconvert reads a layer of it wrongly: report the failing checks", opt.Graph) + other
	}
	return head + "abnconvert reads a layer of it wrongly: report the failing checks" + other
}
