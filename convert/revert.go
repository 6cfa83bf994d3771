package convert

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// Revert turns an InPlace-ABN checkpoint back into plain BatchNorm, for
// export and deployment anywhere (ONNX, TensorRT, plain PyTorch).
//
// InPlace-ABN scales by |weight| + eps, never by the weight as stored, so
// the plain-BN gamma of an InPlace-ABN layer is |weight| + eps, computed in
// the tensor's own precision as the layer computes it (abs(weight) + eps in
// float32 for a float32 weight): the reverted BN then computes exactly what
// the layer computed. ABN layers use their weight as stored and keep it.
//
// Which layers are which, and what else the conversion did, comes from this
// tool's conversion report (--report of convert) when given: its sites say
// which nodes became InPlaceABN(Sync) and which ABN, its bn_eps each layer's
// eps, and its flips every channel whose sign the conversion moved into a
// producing convolution or onto the layer's input: those negations are
// undone (the optimizer's first moments with them), and the gamma of each
// moved channel gets its sign back. Converting then reverting thus gives
// back the original checkpoint, up to float32 rounding of |gamma| - eps + eps,
// except channels with |gamma| < eps, which the conversion stored at scale
// eps and which revert to scale eps.
//
// Without a report (a checkpoint from inplace_abn's own training scripts),
// every BN-family layer (a module path with weight, bias, running_mean and
// running_var, all 1-d of one length) is taken as InPlace-ABN with eps
// RevertOptions.Eps, as inplace_abn's model zoo trains them.
//
// The state dict keys are the same for BN and the ABN family, "module."
// prefixes and nesting included, so the reverted checkpoint keeps every key
// and every other entry. The activation is not in a state dict: the result
// lists, per layer, the one the InPlace-ABN network ran, which the deployed
// BN network must apply (leaky_relu where the conversion replaced a ReLU).

// RevertOptions are revert's inputs, one per command-line flag.
type RevertOptions struct {
	Input, Output string
	// Report is the conversion's report JSON (convert --report), optional.
	Report string
	// Eps is the eps of layers the report does not give one for (all of
	// them without a report); 0 means 1e-5, inplace_abn's default.
	Eps      float64
	Force    bool
	Fsync    bool
	Progress io.Writer
}

// RevertResult says what revert did; it is also the JSON the CLI prints.
type RevertResult struct {
	Input  string `json:"input"`
	Output string `json:"output"`
	Format string `json:"format"`
	// From says where the layer list came from.
	From     string           `json:"from"`
	Layers   []RevertedLayer  `json:"layers"`
	Unflip   map[string][]int `json:"unflipped,omitempty"`
	Warnings []string         `json:"warnings"`
	Seconds  float64          `json:"seconds"`
}

// RevertedLayer is one BN-family layer.
type RevertedLayer struct {
	Module string `json:"module"`
	// Op is what the layer was: InPlaceABN, InPlaceABNSync or ABN.
	Op  string  `json:"op"`
	Eps float64 `json:"eps"`
	// Activation is what the InPlace-ABN network applied after the layer,
	// which the BN network must apply too ("" when unknown: no report).
	Activation string `json:"activation,omitempty"`
	// Note says what deploying it needs to know.
	Note string `json:"note,omitempty"`
	// Negated are the channels whose gamma got its sign back.
	Negated []int `json:"negated_channels,omitempty"`
	// TinyGamma are channels the conversion stored at scale eps.
	TinyGamma []int `json:"tiny_gamma_channels,omitempty"`
}

func (o *RevertOptions) progress(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// Revert performs a revert; like a conversion it writes all or nothing and
// never modifies its input.
func Revert(opt RevertOptions) (*RevertResult, error) {
	start := time.Now()
	if opt.Eps == 0 {
		opt.Eps = 1e-5
	}
	if !(opt.Eps > 0) || math.IsInf(opt.Eps, 0) {
		return nil, fmt.Errorf("--eps %g: must be positive", opt.Eps)
	}
	if opt.Input == "" || opt.Output == "" {
		return nil, fmt.Errorf("both --input and --output are required")
	}
	if isONNX(opt.Input) || isONNX(opt.Output) {
		return nil, fmt.Errorf("%s: revert reads and writes .pth or .safetensors checkpoints; an ONNX model written with --onnx-ops standard already uses plain BatchNormalization", opt.Input)
	}
	if err := checkPaths(Options{Input: opt.Input, Output: opt.Output, Force: opt.Force}); err != nil {
		return nil, err
	}
	defer collectLate()() // gc.go
	var conv *Result
	if opt.Report != "" {
		b, err := os.ReadFile(opt.Report)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", opt.Report, unwrapPathError(err))
		}
		conv = &Result{}
		if err := json.Unmarshal(b, conv); err != nil || conv.Report == nil {
			if err == nil {
				err = fmt.Errorf("no \"report\" object")
			}
			return nil, fmt.Errorf("%s: not a conversion report of abnconvert (convert --report): %v", opt.Report, err)
		}
	}
	opt.progress("reading %s", opt.Input)
	s, err := model.Open(opt.Input)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	if err := checkOutput(s, opt.Output); err != nil {
		return nil, err
	}
	res := &RevertResult{Input: opt.Input, Output: opt.Output, Format: s.Format, Warnings: []string{}}
	var plan []revertSite
	if conv == nil && s.ProvenanceError != nil {
		return nil, fmt.Errorf("%w; give the conversion's --report", s.ProvenanceError)
	}
	if conv == nil && s.Provenance != nil {
		// The record the conversion wrote into the file says all a
		// report would.
		conv = reportOf(s.Provenance)
		res.From = fmt.Sprintf("the provenance record of %s (abnconvert %s, %s)", opt.Input, s.Provenance.Version, s.Provenance.Flags())
		plan, err = planFromReport(conv, s.Weights, opt.Eps, res)
	} else if conv != nil {
		res.From = "conversion report " + opt.Report
		plan, err = planFromReport(conv, s.Weights, opt.Eps, res)
	} else {
		res.From = fmt.Sprintf("every BN-family layer taken as InPlace-ABN with eps %g (no conversion report given)", opt.Eps)
		plan, err = planAll(s.Weights, opt.Eps)
		res.Warnings = append(res.Warnings, "without the conversion's --report every BN-family layer is taken as InPlace-ABN: a plain BatchNorm or ABN layer in this checkpoint would be changed wrongly")
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	flips := map[string][]int{}
	if conv != nil {
		flips = conv.Report.Flips
	}
	changed, err := applyRevert(s, plan, flips)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	for _, p := range plan {
		res.Layers = append(res.Layers, p.layer)
	}
	if len(flips) > 0 {
		res.Unflip = flips
	}
	if s.Checkpoint != nil && s.Module == nil && !isSafetensors(opt.Output) {
		warn, err := s.Checkpoint.TransformOptimizer(flips, changed)
		if err != nil {
			return nil, fmt.Errorf("%s: optimizer state: %w", opt.Input, err)
		}
		res.Warnings = append(res.Warnings, warn...)
	}
	opt.progress("writing %s", opt.Output)
	// The output is plain BatchNorm again: no provenance record (a record
	// the input held is dropped), so that nothing takes it for a
	// conversion's output.
	set := outputs(opt.Force, opt.Fsync, opt.Input, opt.Report)
	defer set.Abort()
	if err := stage(s, set, opt.Output, nil); err != nil {
		return nil, err
	}
	if err := set.Commit(); err != nil {
		return nil, err
	}
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// revertSite is one layer to revert.
type revertSite struct {
	layer   RevertedLayer
	weight  string
	inPlace bool
}

func planFromReport(conv *Result, w graph.Weights, defEps float64, res *RevertResult) ([]revertSite, error) {
	var missing []string
	var plan []revertSite
	noEps := 0
	for _, st := range conv.Report.Sites {
		eps, ok := conv.BNEps[st.Node]
		if !ok {
			eps = defEps
			noEps++
		}
		l := RevertedLayer{Module: st.Node, Op: string(st.Op), Eps: eps, TinyGamma: st.TinyGammaChannels}
		l.Activation = st.OpActivation
		if st.OpActivation == graph.ActLeakyReLU || st.OpActivation == graph.ActELU {
			l.Activation = fmt.Sprintf("%s(%g)", st.OpActivation, st.OpActivationParam)
		}
		if st.Outcome == rewrite.OutcomeApproximated && st.Activation != st.OpActivation {
			l.Note = fmt.Sprintf("the original network had %s here; the conversion made it %s, so deploy BN + %s to compute what the InPlace-ABN network computed (BN + %s only matches the original up to that approximation)",
				st.Activation, l.Activation, l.Activation, st.Activation)
		}
		if len(st.TinyGammaChannels) > 0 {
			tiny := fmt.Sprintf("channels %v had |gamma| < eps in the original and revert to scale eps", st.TinyGammaChannels)
			if l.Note != "" {
				l.Note += "; " + tiny
			} else {
				l.Note = tiny
			}
		}
		key := st.Node + "." + graph.RoleWeight
		if _, ok := w.Shape(key); !ok {
			missing = append(missing, key)
			continue
		}
		plan = append(plan, revertSite{layer: l, weight: key, inPlace: st.Op == graph.OpInPlaceABN || st.Op == graph.OpInPlaceABNSync})
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("the report's layers are not in this checkpoint (%d missing: %s); give the report of the conversion that wrote it", len(missing), summarize(missing, 6))
	}
	for k := range conv.Report.Flips {
		if _, ok := w.Shape(k); !ok {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return nil, fmt.Errorf("the report's sign flips name tensors not in this checkpoint: %s", summarize(missing, 6))
	}
	if noEps > 0 {
		res.Warnings = append(res.Warnings, fmt.Sprintf("the report gives no eps for %d layer(s) (written by an older abnconvert): eps %g assumed", noEps, defEps))
	}
	return plan, nil
}

// planAll finds every BN-family layer of a state dict by its keys.
func planAll(w graph.Weights, eps float64) ([]revertSite, error) {
	var plan []revertSite
	for _, k := range w.Keys() {
		mp, ok := strings.CutSuffix(k, "."+graph.RoleWeight)
		if !ok {
			continue
		}
		ws, _ := w.Shape(k)
		if len(ws) != 1 {
			continue
		}
		bn := true
		for _, role := range []string{graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
			s, ok := w.Shape(mp + "." + role)
			bn = bn && ok && len(s) == 1 && s[0] == ws[0]
		}
		if !bn {
			continue
		}
		plan = append(plan, revertSite{layer: RevertedLayer{Module: mp, Op: string(graph.OpInPlaceABN) + " (assumed)", Eps: eps}, weight: k, inPlace: true})
	}
	if len(plan) == 0 {
		return nil, fmt.Errorf("no BN-family layer (weight, bias, running_mean, running_var) in the state dict")
	}
	return plan, nil
}

// applyRevert undoes the sign flips, then sets each InPlace-ABN layer's
// gamma to |weight| + eps with the sign the conversion moved away.
func applyRevert(s *model.Model, plan []revertSite, flips map[string][]int) (map[string]bool, error) {
	changed := map[string]bool{}
	inPlaceWeight := map[string]bool{}
	for _, p := range plan {
		if p.inPlace {
			inPlaceWeight[p.weight] = true
		}
	}
	keys := make([]string, 0, len(flips))
	for k := range flips {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if inPlaceWeight[k] {
			continue // its sign is set below, from the same list
		}
		if err := negateChannels(s.Weights, k, flips[k]); err != nil {
			return nil, err
		}
		changed[k] = true
	}
	for i, p := range plan {
		if !p.inPlace {
			continue
		}
		v, err := s.Weights.Values(p.weight)
		if err != nil {
			return nil, err
		}
		neg := map[int]bool{}
		for _, c := range flips[p.weight] {
			neg[c] = true
		}
		f32 := s.TorchDType(p.weight) == pth.Float32
		for c, x := range v {
			var g float64
			if f32 {
				// As the layer computes it: abs(weight) + eps in float32.
				g = float64(float32(math.Abs(x)) + float32(p.layer.Eps))
			} else {
				g = math.Abs(x) + p.layer.Eps
			}
			if neg[c] {
				g = -g
				plan[i].layer.Negated = append(plan[i].layer.Negated, c)
			}
			v[c] = g
		}
		if err := s.Weights.SetValues(p.weight, v); err != nil {
			return nil, err
		}
		changed[p.weight] = true
	}
	return changed, nil
}

// negateChannels negates the given slices along dim 0 of a tensor.
func negateChannels(w graph.Weights, key string, chans []int) error {
	shape, ok := w.Shape(key)
	if !ok || len(shape) == 0 || shape[0] == 0 {
		return fmt.Errorf("%s: cannot negate channels of a missing, scalar or empty tensor", key)
	}
	for _, c := range chans {
		if c < 0 || c >= shape[0] {
			return fmt.Errorf("%s: channel %d out of range (%d channels)", key, c, shape[0])
		}
	}
	if n, ok := w.(graph.ChannelNegater); ok {
		// Sign bits flipped as the tensor is written, nothing decoded. An
		// all-zero selection is left to the decoding path below, which
		// writes -0 there as revert always has.
		if changed, err := n.NegateChannels(key, chans); err != nil || changed {
			return err
		}
	}
	v, err := w.Values(key)
	if err != nil {
		return err
	}
	per := len(v) / shape[0]
	for _, c := range chans {
		if c < 0 || c >= shape[0] {
			return fmt.Errorf("%s: channel %d out of range (%d channels)", key, c, shape[0])
		}
		for j := c * per; j < (c+1)*per; j++ {
			v[j] = -v[j]
		}
	}
	return w.SetValues(key, v)
}

// WriteTable prints a revert's summary for a person.
func (r *RevertResult) WriteTable(w io.Writer) {
	bw := bufio.NewWriter(w) // (a line per layer; Report.WriteTable's reason)
	defer bw.Flush()
	w = bw
	fmt.Fprintf(w, "%s: %s checkpoint; layers from %s\n", r.Input, r.Format, r.From)
	flipped := 0
	for _, c := range r.Unflip {
		flipped += len(c)
	}
	if flipped > 0 {
		fmt.Fprintf(w, "undid %d sign flip(s) in %d tensor(s)\n", flipped, len(r.Unflip))
	}
	for _, l := range r.Layers {
		act := l.Activation
		if act == "" {
			act = "(activation not recorded)"
		}
		fmt.Fprintf(w, "  %-40s %-22s eps %-8g -> BatchNorm2d + %s", l.Module, l.Op, l.Eps, act)
		if len(l.Negated) > 0 {
			fmt.Fprintf(w, ", %d negative gamma(s) restored", len(l.Negated))
		}
		fmt.Fprintln(w)
		if l.Note != "" {
			fmt.Fprintf(w, "      note: %s\n", l.Note)
		}
	}
	for _, wn := range r.Warnings {
		fmt.Fprintf(w, "warning: %s\n", wn)
	}
	fmt.Fprintf(w, "wrote %s in %.2fs\n", r.Output, r.Seconds)
}

// bnEps lists every BN-family node's eps, for the conversion report.
func bnEps(g *graph.Graph) map[string]float64 {
	out := map[string]float64{}
	for _, n := range g.Nodes {
		if n.Op.IsBNFamily() {
			out[n.Name] = n.Attr.Eps
		}
	}
	return out
}
