package convert

import (
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/emit"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/safetensors"
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

func isSafetensors(path string) bool {
	return strings.EqualFold(filepath.Ext(path), ".safetensors")
}

// source is a state dict opened for conversion, whatever its format.
type source struct {
	path   string
	format string
	w      graph.Weights
	ck     *pth.Checkpoint   // a .pth: state dict, or a whole module's
	st     *safetensors.File // a .safetensors file
	module *pth.Module       // the module tree of a whole pickled module
}

// openSource opens a .safetensors file, a .pth state dict, or a whole
// pickled module (which pth.Open refuses; the refusal's globals say which).
func openSource(path string) (*source, error) {
	if isSafetensors(path) {
		f, err := safetensors.Open(path)
		if err != nil {
			return nil, err
		}
		return &source{path: path, format: "safetensors", w: f, st: f}, nil
	}
	ck, err := pth.Open(path)
	var re *pth.RefusedError
	if errors.As(err, &re) && pth.LooksLikeModule(re.Globals) {
		ck, m, err := pth.OpenModule(path)
		if err != nil {
			return nil, err
		}
		return &source{path: path, format: fmt.Sprintf("%s (whole pickled module %s)", ck.Format, m.Class), w: ck, ck: ck, module: m}, nil
	}
	if err != nil {
		return nil, err
	}
	if ck.StateDict() == nil {
		ck.Close()
		return nil, fmt.Errorf("%s: no state dict found in the checkpoint", path)
	}
	return &source{path: path, format: string(ck.Format), w: ck, ck: ck}, nil
}

func (s *source) close() {
	if s.ck != nil {
		s.ck.Close()
	}
	if s.st != nil {
		s.st.Close()
	}
}

func (s *source) statePath() []string {
	if s.ck != nil && s.ck.StatePath != nil {
		return s.ck.StatePath
	}
	return []string{}
}

func (s *source) prefix() string {
	if s.ck != nil {
		return s.ck.Prefix
	}
	return pth.CommonPrefix(s.w.Keys())
}

// torchDType is a tensor's torch element type.
func (s *source) torchDType(key string) pth.DType {
	if s.st != nil {
		return s.st.DType(key).Torch()
	}
	return pth.DType(s.ck.DType(key))
}

// checkOutput refuses, before any work, outputs that would lose data.
func (s *source) checkOutput(out string) error {
	if isONNX(out) {
		return fmt.Errorf("%s: writing ONNX needs an ONNX input; a state dict is written as .pth or .safetensors", out)
	}
	if isSafetensors(out) && s.ck != nil && s.module == nil {
		if other := otherEntries(s.ck); len(other) > 0 {
			return fmt.Errorf("%s: safetensors holds tensors only, and %s holds more than its state dict (%s); write a .pth to keep them, or save the state dict alone", out, s.path, summarize(other, 6))
		}
	}
	if !isSafetensors(out) && s.st != nil {
		for _, k := range s.st.Keys() {
			if s.st.DType(k).Torch() == "" {
				return fmt.Errorf("%s: tensor %q of %s is %s, which torch 1.13 has no dtype for; write a .safetensors instead", out, k, s.path, s.st.DType(k))
			}
		}
	}
	return nil
}

// otherEntries lists what a checkpoint holds besides its state dict's
// tensors: entries of the dicts the state dict is nested in, and non-tensor
// entries of the state dict itself.
func otherEntries(ck *pth.Checkpoint) []string {
	var out []string
	d, _ := ck.Root.(*pth.Dict)
	for i, name := range ck.StatePath {
		if d == nil {
			break
		}
		var next *pth.Dict
		for j := 0; j < d.Len(); j++ {
			k, v := d.Entry(j)
			if s, ok := k.(string); ok && s == name {
				next, _ = v.(*pth.Dict)
				continue
			}
			out = append(out, strings.Join(append(append([]string{}, ck.StatePath[:i]...), fmt.Sprint(k)), "."))
		}
		d = next
	}
	if sd := ck.StateDict(); sd != nil {
		for j := 0; j < sd.Len(); j++ {
			k, v := sd.Entry(j)
			if _, ok := v.(*pth.Tensor); !ok {
				out = append(out, fmt.Sprint(k))
			}
		}
	}
	return out
}

// structure builds the graph: from the --graph ONNX file, from a whole
// module's tree, or by recognising the state dict's layout.
func structure(s *source, opt Options) (*graph.Graph, *arch.Match, error) {
	switch {
	case opt.Graph != "":
		return graphFromONNX(opt.Graph, s.w)
	case s.module != nil:
		return moduleGraph(s.module, s.w, opt.Arch)
	}
	return arch.Recognize(s.w, opt.Arch)
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
	s, err := openSource(opt.Input)
	if err != nil {
		return nil, err
	}
	defer s.close()
	if err := s.checkOutput(opt.Output); err != nil {
		return nil, err
	}
	g, match, err := structure(s, opt)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	if err := validateBN(g, s.w); err != nil {
		return nil, withPath(opt.Input, err)
	}
	opt.progress("%s: %s (%d nodes)", opt.Input, match.Arch, len(g.Nodes))
	rep, err := rewrite.Run(g, s.w, rewriteOptions(opt))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	res := &Result{
		Input: opt.Input, Output: opt.Output, Module: opt.EmitModule,
		Format: s.format, StatePath: s.statePath(), Prefix: s.prefix(),
		Arch: match.Arch, Family: match.Family, ExactArch: match.Exact, Notes: match.Notes,
		Options: ReportOptions{ReLU: opt.ReLU, Slope: opt.Slope, Sync: opt.Sync},
		Report:  rep, BNEps: bnEps(g), Warnings: append([]string(nil), rep.Warnings...),
	}
	if s.ck != nil && s.module == nil && !isSafetensors(opt.Output) {
		changed := map[string]bool{}
		for _, k := range rep.Changed {
			changed[k] = true
		}
		warn, err := s.ck.TransformOptimizer(rep.Flips, changed)
		if err != nil {
			return nil, fmt.Errorf("%s: optimizer state: %w", opt.Input, err)
		}
		res.Warnings = append(res.Warnings, warn...)
	}
	if s.module != nil {
		res.Warnings = append(res.Warnings, fmt.Sprintf("%s is a whole pickled module; %s holds its state dict only (load it into the emitted module, or into %s)", opt.Input, opt.Output, s.module.ShortClass()))
	}
	var module []byte
	if opt.EmitModule != "" {
		module, err = emit.Python(g, emit.Options{Header: header(opt, match)})
		if err != nil {
			return nil, fmt.Errorf("%s: emitting the Python module: %w", opt.EmitModule, err)
		}
	}
	opt.progress("writing %s", opt.Output)
	set := outputs(opt.Force, opt.Fsync, opt.Input, opt.Graph)
	defer set.Abort()
	if err := s.stage(set, opt.Output); err != nil {
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
	s, err := openSource(path)
	if err != nil {
		return nil, err
	}
	defer s.close()
	ins := &Inspection{File: path, Size: size, Format: s.format, StatePath: s.statePath(), Prefix: s.prefix(), DTypes: map[string]int{}}
	if s.ck != nil {
		ins.Globals = s.ck.Globals
		if s.module == nil {
			ins.Entries = otherEntries(s.ck)
		}
	}
	if s.st != nil {
		ins.Globals = []string{}
		for k, v := range s.st.Metadata {
			ins.Entries = append(ins.Entries, fmt.Sprintf("metadata %s=%q", k, v))
		}
		sort.Strings(ins.Entries)
	}
	for _, k := range s.w.Keys() {
		shape, _ := s.w.Shape(k)
		dt := string(s.torchDType(k))
		size := 0
		if s.st != nil {
			dt, size = string(s.st.DType(k)), s.st.DType(k).Size()
		} else {
			size = pth.DType(dt).Size()
		}
		ins.Tensors++
		ins.DTypes[dt]++
		ins.Bytes += int64(graph.Numel(shape) * size)
	}
	g, match, err := structure(s, opt)
	if err != nil {
		ins.ArchError = err.Error()
		return ins, nil
	}
	ins.Arch, ins.Family, ins.ExactArch, ins.Notes = match.Arch, match.Family, match.Exact, match.Notes
	if err := validateBN(g, s.w); err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	rep, err := rewrite.Run(g, s.w, rewriteOptions(opt))
	if err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	ins.Report = rep
	return ins, nil
}
