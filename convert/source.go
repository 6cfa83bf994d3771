package convert

import (
	"fmt"
	"sort"
	"time"

	"github.com/abnconvert/abnconvert/emit"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// Which inputs convert to which outputs (besides .onnx to .onnx, see
// onnx.go): every state-dict source converts to .pth or .safetensors.
//
//	input                         structure from          --output .pth        --output .safetensors
//	.pth state dict               recogniser or --graph   the same checkpoint  the state dict alone *
//	.pth whole pickled module     the module tree         its state dict       its state dict
//	.safetensors                  recogniser or --graph   a state dict         the same file
//
// * refused when the checkpoint holds anything besides the state dict
// (optimizer state, epoch, ...): safetensors holds tensors only, and a
// conversion never drops data silently. Convert to .pth to keep it.
//
// A .pth written from safetensors is a plain state dict (OrderedDict of
// tensors) that torch.load(weights_only=True) accepts; a .safetensors written
// from a .pth keeps every tensor's dtype, shape and values, laid out as the
// reference writer lays them out, with metadata {"format": "pt"} (a
// safetensors input keeps its own metadata).

func isSafetensors(path string) bool { return model.IsSafetensors(path) }

// checkOutput refuses, before any work, outputs that would lose data.
func checkOutput(s *model.Model, out string) error {
	if isONNX(out) {
		return fmt.Errorf("%s: writing ONNX needs an ONNX input; a state dict is written as .pth or .safetensors", out)
	}
	if isSafetensors(out) && s.Checkpoint != nil && s.Module == nil {
		if other := s.OtherEntries(); len(other) > 0 {
			return fmt.Errorf("%s: safetensors holds tensors only, and %s holds more than its state dict (%s); write a .pth to keep them, or save the state dict alone", out, s.Path, summarize(other, 6))
		}
	}
	if !isSafetensors(out) && s.Safetensors != nil {
		st := s.Safetensors
		for _, k := range st.Keys() {
			if st.DType(k).Torch() == "" {
				return fmt.Errorf("%s: tensor %q of %s is %s, which torch 1.13 has no dtype for; write a .safetensors instead", out, k, s.Path, st.DType(k))
			}
		}
	}
	return nil
}

// withCarried is a checkpoint's weights plus the state-dict tensors that
// are not the network's (pth.Checkpoint.Carried), for a writer that writes
// every tensor itself: a conversion never drops data silently.
type withCarried struct{ *pth.Checkpoint }

func (w withCarried) Keys() []string { return append(w.Checkpoint.Keys(), w.Checkpoint.Carried...) }

// runState converts a state dict that needs more than Run's .pth path: a
// safetensors input or output, a whole pickled module, or --graph.
func runState(opt Options, start time.Time) (*Result, error) {
	if isONNX(opt.Input) {
		if opt.Graph != "" {
			return nil, fmt.Errorf("%s: --graph gives the structure of a state dict; an ONNX input has its own", opt.Graph)
		}
		return nil, fmt.Errorf("%s: an ONNX input is written as ONNX; give an --output ending in .onnx", opt.Output)
	}
	if opt.Graph != "" || isSafetensors(opt.Input) || isSafetensors(opt.Output) {
		opt.progress("reading %s", opt.Input) // else Run said so already
	}
	s, err := model.Open(opt.Input)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	if err := refuseConverted(s); err != nil {
		return nil, err
	}
	if err := checkOutput(s, opt.Output); err != nil {
		return nil, err
	}
	g, match, err := s.Structure(opt.structure())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	if err := validateBN(g, s.Weights); err != nil {
		return nil, withPath(opt.Input, err)
	}
	opt.progress("%s: %s (%d nodes)", opt.Input, match.Arch, len(g.Nodes))
	prov, err := opt.structureSource(s)
	if err != nil {
		return nil, err
	}
	rep, err := rewrite.Run(g, s.Weights, rewriteOptions(opt))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	res := &Result{
		Input: opt.Input, Output: opt.Output, Module: opt.EmitModule,
		Format: s.Format, StatePath: s.StatePath(), Prefix: s.Prefix(),
		Arch: match.Arch, Family: match.Family, ExactArch: match.Exact, Notes: match.Notes,
		Options: reportOptions(opt),
		Report:  rep, BNEps: bnEps(g), Warnings: append(append([]string(nil), match.Warnings...), rep.Warnings...),
		Aliases: aliasGroups(s.Checkpoint, rep, isSafetensors(opt.Output)),
	}
	if s.Checkpoint != nil && s.Module == nil && !isSafetensors(opt.Output) {
		changed := map[string]bool{}
		for _, k := range rep.Changed {
			changed[k] = true
		}
		warn, err := s.Checkpoint.TransformOptimizer(rep.Flips, changed)
		if err != nil {
			return nil, fmt.Errorf("%s: optimizer state: %w", opt.Input, err)
		}
		res.Warnings = append(res.Warnings, warn...)
	}
	if s.Module != nil {
		res.Warnings = append(res.Warnings, fmt.Sprintf("%s is a whole pickled module; %s holds its state dict only (load it into the emitted module, or into %s)", opt.Input, opt.Output, s.Module.ShortClass()))
	}
	rec, err := prov.record(opt, g, match, rep)
	if err != nil {
		return nil, err
	}
	var module []byte
	if opt.EmitModule != "" {
		var counters []string
		if s.Checkpoint != nil {
			counters = s.Checkpoint.Carried
		}
		module, err = emit.Python(g, emit.Options{Header: header(opt, match), Counters: counters})
		if err != nil {
			return nil, fmt.Errorf("%s: emitting the Python module: %w", opt.EmitModule, err)
		}
	}
	opt.progress("writing %s", opt.Output)
	set := outputs(opt.Force, opt.Fsync, opt.Input, opt.Graph)
	defer set.Abort()
	if err := stage(s, set, opt.Output, rec); err != nil {
		return nil, err
	}
	if module != nil {
		if err := set.WriteFile(opt.EmitModule, module); err != nil {
			return nil, err
		}
	}
	res.Seconds = time.Since(start).Seconds()
	if err := stageReport(set, opt, res); err != nil {
		return nil, err
	}
	if err := set.Commit(); err != nil {
		return nil, err
	}
	opt.progress("done in %.2fs", res.Seconds)
	return res, nil
}

// inspectState is Inspect for the sources of runState: a safetensors file,
// a whole pickled module, or a state dict with --graph.
func inspectState(path string, size int64, opt Options) (*Inspection, error) {
	s, err := model.Open(path)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	ins := &Inspection{File: path, Size: size, Format: s.Format, StatePath: s.StatePath(), Prefix: s.Prefix(), DTypes: map[string]int{},
		Provenance: s.Provenance}
	if s.ProvenanceError != nil {
		ins.ProvenanceError = s.ProvenanceError.Error()
	}
	if s.Checkpoint != nil {
		ins.Globals = s.Checkpoint.Globals
		if s.Module == nil {
			ins.Entries = s.OtherEntries()
		}
	}
	if st := s.Safetensors; st != nil {
		ins.Globals = []string{}
		for k, v := range st.Metadata {
			if k == model.ProvenanceKey {
				continue // printed as the provenance record
			}
			ins.Entries = append(ins.Entries, fmt.Sprintf("metadata %s=%q", k, v))
		}
		sort.Strings(ins.Entries)
	}
	for _, k := range s.Weights.Keys() {
		shape, _ := s.Weights.Shape(k)
		dt := string(s.TorchDType(k))
		size := 0
		if st := s.Safetensors; st != nil {
			dt, size = string(st.DType(k)), st.DType(k).Size()
		} else {
			size = pth.DType(dt).Size()
		}
		ins.Tensors++
		ins.DTypes[dt]++
		ins.Bytes += int64(graph.Numel(shape) * size)
	}
	ins.Aliases = aliasGroups(s.Checkpoint, nil, false) // what a conversion would change, below
	g, match, err := s.Structure(opt.structure())
	if err != nil {
		ins.ArchError = err.Error()
		return ins, nil
	}
	ins.Arch, ins.Family, ins.ExactArch, ins.Notes = match.Arch, match.Family, match.Exact, append(append([]string(nil), match.Notes...), match.Warnings...)
	if err := refuseConverted(s); err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	if err := validateBN(g, s.Weights); err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	rep, err := rewrite.Run(g, s.Weights, rewriteOptions(opt))
	if err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	ins.Report = rep
	ins.Aliases = aliasGroups(s.Checkpoint, rep, false)
	return ins, nil
}
