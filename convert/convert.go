// Package convert is the conversion job: read a checkpoint, recognise its
// architecture, run the rewrite pipeline, carry the optimizer state along,
// and write the converted checkpoint, its Python module and its report,
// all or nothing (one output set, package output: write.go).
package convert

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/emit"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// Options are the conversion's inputs, one field per command-line flag.
type Options struct {
	Input      string
	Output     string
	EmitModule string // optional Python module path
	ReportPath string // optional JSON report path
	Arch       string // "auto" or a name
	ReLU       string // leaky, abn, error
	Slope      float64
	// TinyGamma is the policy for in-place sites with |gamma| < eps: exact
	// (ABN there; the default) or approx (scale eps, in place).
	TinyGamma string
	Sync      bool
	Force     bool
	Fsync     bool   // flush outputs to disk before renaming them into place
	ONNXOps   string // ONNX output: custom (default), standard, fold
	Graph     string // optional ONNX export giving a state dict's structure (--graph)
	DumpAfter string
	Dump      io.Writer
	Progress  io.Writer // nil: silent
	Command   string    // the command line, recorded in the emitted module
	Version   string    // the tool's version, for the provenance record ("dev" when empty)
	// Table says the caller prints the result's table (WriteTable): a
	// checkpoint's is laid out while the output is finished.
	Table bool
}

// Result is what a conversion did; it is also the JSON the CLI prints.
type Result struct {
	Input  string `json:"input"`
	Output string `json:"output"`
	Module string `json:"module,omitempty"`
	// Data is the ONNX output's own external data file (the changed
	// tensors of an external-data model), written beside it.
	Data      string          `json:"data,omitempty"`
	Format    string          `json:"format"`
	StatePath []string        `json:"state_path"`
	Prefix    string          `json:"prefix,omitempty"`
	Arch      string          `json:"arch"`
	Family    string          `json:"family"`
	ExactArch bool            `json:"arch_exact"`
	Notes     []string        `json:"arch_notes,omitempty"`
	Options   ReportOptions   `json:"options"`
	Report    *rewrite.Report `json:"report"`
	// BNEps is each BN-family node's eps, which revert needs to undo
	// weight = |gamma| - eps exactly (see revert.go).
	BNEps map[string]float64 `json:"bn_eps,omitempty"`
	// Aliases are the input's groups of keys sharing a storage, and what
	// the conversion did with each (alias.go).
	Aliases  []AliasGroup `json:"aliases,omitempty"`
	Warnings []string     `json:"warnings"`
	Seconds  float64      `json:"seconds"`

	// body is the table but its last line, laid out ahead (Options.Table);
	// nil: WriteTable lays it out.
	body *tableBody
}

type tableBody struct {
	done chan struct{}
	b    bytes.Buffer
}

// layOutTable lays the table out (but its last line, which gives the time
// taken) on a goroutine: on densenet201 trained that was 0.5 ms once the
// output was written, with one core idle, where the copy's last records
// are still being written beside it now. Nothing it reads changes after.
func (r *Result) layOutTable() {
	t := &tableBody{done: make(chan struct{})}
	r.body = t
	go func() {
		defer close(t.done)
		r.writeBody(&t.b)
	}()
}

// ReportOptions records the flags that shaped the result.
type ReportOptions struct {
	ReLU      string  `json:"relu"`
	Slope     float64 `json:"slope"`
	TinyGamma string  `json:"tiny_gamma"`
	Sync      bool    `json:"sync"`
}

func reportOptions(opt Options) ReportOptions {
	return ReportOptions{ReLU: opt.ReLU, Slope: opt.Slope, TinyGamma: opt.TinyGamma, Sync: opt.Sync}
}

func (o *Options) defaults() {
	if o.Arch == "" {
		o.Arch = "auto"
	}
	if o.ReLU == "" {
		o.ReLU = "leaky"
	}
	if o.Slope == 0 {
		o.Slope = 0.01
	}
	if o.TinyGamma == "" {
		o.TinyGamma = rewrite.TinyGammaExact
	}
}

func (o *Options) validate() error {
	switch o.ReLU {
	case "leaky", "abn", "error":
	default:
		return fmt.Errorf("--relu %q: want leaky, abn or error", o.ReLU)
	}
	switch o.TinyGamma {
	case rewrite.TinyGammaExact, rewrite.TinyGammaApprox:
	default:
		return fmt.Errorf("--tiny-gamma %q: want %s (ABN where |gamma| < eps: exact) or %s (in place, scale eps there: approximate)", o.TinyGamma, rewrite.TinyGammaExact, rewrite.TinyGammaApprox)
	}
	if !(o.Slope > 0 && o.Slope < 1) {
		return fmt.Errorf("--slope %g: InPlace-ABN inverts leaky_relu, so the slope must be in (0, 1)", o.Slope)
	}
	return nil
}

func (o *Options) progress(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// Run performs a conversion. Every error names the file it concerns; on
// error no output file is left behind and the input is never modified.
func Run(opt Options) (*Result, error) {
	start := time.Now()
	opt.defaults()
	if err := opt.validate(); err != nil {
		return nil, err
	}
	if err := checkPaths(opt); err != nil {
		return nil, err
	}
	defer collectLate()() // gc.go
	// The recognisers' patterns compile on the other core, idle while
	// the input is read.
	go arch.Warm()
	if opt.Graph != "" || isSafetensors(opt.Input) || isSafetensors(opt.Output) {
		return runState(opt, start) // source.go
	}
	if isONNX(opt.Input) {
		return runONNX(opt, start)
	}
	if isONNX(opt.Output) {
		return nil, fmt.Errorf("%s: writing ONNX needs an ONNX input (a .pth is written as .pth)", opt.Output)
	}
	opt.progress("reading %s", opt.Input)
	m, err := model.Open(opt.Input)
	if err != nil {
		return nil, err
	}
	if m.Module != nil {
		m.Close()
		return runState(opt, start) // a whole pickled module: source.go
	}
	defer m.Close()
	if err := refuseConverted(m); err != nil {
		return nil, err
	}
	ck := m.Checkpoint

	// The output is written while the conversion decides what it changes
	// (pth.PrewriteLater), from here on: the records it may negate once
	// the signs are settled, the rest at once (copyWhen). A refused
	// conversion still leaves nothing behind, since the set renames
	// nothing into place before Commit and Abort removes what was written.
	set := outputs(opt.Force, opt.Fsync, opt.Input)
	defer set.Abort()
	pw, err := ck.PrewriteLater(set, opt.Output, copyWhen(ck))
	if err != nil {
		return nil, err
	}
	defer pw.Stop() // before Abort removes the file

	g, match, err := arch.Recognize(ck, opt.Arch)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	if err := validateBN(g, ck); err != nil {
		return nil, withPath(opt.Input, err)
	}
	opt.progress("recognised %s (%d nodes)", match.Arch, len(g.Nodes))
	prov, err := opt.structureSource(m)
	if err != nil {
		return nil, err
	}

	ropt := rewriteOptions(opt)
	ropt.SignsSettled = func() error { pw.Settle(); return nil }
	rep, err := rewrite.Run(g, ck, ropt)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	res := &Result{
		Input: opt.Input, Output: opt.Output, Module: opt.EmitModule,
		Format: string(ck.Format), StatePath: ck.StatePath, Prefix: ck.Prefix,
		Arch: match.Arch, Family: match.Family, ExactArch: match.Exact, Notes: match.Notes,
		Options: reportOptions(opt),
		Report:  rep, BNEps: bnEps(g), Aliases: aliasGroups(ck, rep, false),
	}
	res.Warnings = append(res.Warnings, rep.Warnings...)

	changed := map[string]bool{}
	for _, k := range rep.Changed {
		changed[k] = true
	}
	warn, err := ck.TransformOptimizer(rep.Flips, changed)
	if err != nil {
		return nil, fmt.Errorf("%s: optimizer state: %w", opt.Input, err)
	}
	res.Warnings = append(res.Warnings, warn...)
	if ck.Provenance, err = prov.record(opt, g, match, rep); err != nil {
		return nil, err
	}

	var module []byte
	if opt.EmitModule != "" {
		module, err = emit.Python(g, emit.Options{Header: header(opt, match), Counters: ck.Carried})
		if err != nil {
			return nil, fmt.Errorf("%s: emitting the Python module: %w", opt.EmitModule, err)
		}
	}

	opt.progress("writing %s", opt.Output)
	if opt.Table {
		res.layOutTable()
	}
	if err := pw.Finish(); err != nil {
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

// copyWhen tells the copy when to write each record (tests replace it).
// A trained checkpoint's BN weights have negative entries, whose signs the
// conversion folds into the channels of the producing convolutions, and a
// producer's record copied before its negations are known is read back
// and written over afterwards, which costs more than the copy's head
// start (resnext101_32x8d trained: 62 ms of edits against a 100 ms copy).
// A producer has as many output channels (dim 0) as the BN it feeds: the
// records of tensors of two or more dimensions whose first is the channel
// count of a BN weight with a negative entry wait until the signs are
// settled; the rest, on densenet201 trained its 32-channel convolutions
// and its classifier, a third of its bytes, are copied while the
// conversion reads (3 ms sooner in the median of 50 runs than a copy
// started once the signs settled). It guesses only the order: the output
// is the same bytes whatever it says. (A site that falls back to ABN for
// |gamma| < eps, check-tiny-gamma, moves no sign, so its producer may wait
// for nothing: a cost in time only, and a rare one; TestCopyWhen's write
// paths compare byte-identical on the tiny-gamma fixtures too.)
var copyWhen = func(ck *pth.Checkpoint) func(key string, shape []int) pth.When {
	// The BN weights are read at the first question, which PrewriteLater
	// asks once the copy has started making the pickle on the other core.
	var neg map[int]bool
	return func(_ string, shape []int) pth.When {
		if neg == nil {
			neg = negativeBN(ck)
		}
		if len(shape) >= 2 && neg[shape[0]] {
			return pth.Settled
		}
		return pth.Now
	}
}

// negativeBN is the channel counts of the checkpoint's BatchNorm weights
// (a ".weight" beside a ".running_var") that have a negative entry. It
// reads the vectors validation and the rewrite read next (kept in memory
// once read), only those shaped as BN vectors (before anything checked
// the shapes).
func negativeBN(ck *pth.Checkpoint) map[int]bool {
	var buf []float64
	neg := map[int]bool{}
	for _, key := range ck.Keys() {
		base, ok := strings.CutSuffix(key, ".weight")
		if !ok {
			continue
		}
		w, _ := ck.Shape(key)
		v, ok := ck.Shape(base + ".running_var")
		if !ok || len(v) != 1 || len(w) != 1 || w[0] != v[0] || w[0] > maxBNChannels || neg[w[0]] {
			continue
		}
		var err error
		if buf, err = ck.AppendValues(buf[:0], key); err != nil {
			continue // validation reports it
		}
		for _, x := range buf {
			if x < 0 {
				neg[w[0]] = true
				break
			}
		}
	}
	return neg
}

// maxBNChannels bounds the vectors negativeBN reads.
const maxBNChannels = 1 << 16

func rewriteOptions(opt Options) rewrite.Options {
	return rewrite.Options{
		ReLU: opt.ReLU, Slope: opt.Slope, TinyGamma: opt.TinyGamma, Sync: opt.Sync,
		DumpAfter: opt.DumpAfter, Dump: opt.Dump,
	}
}

func header(opt Options, m *arch.Match) string {
	cmd := opt.Command
	if cmd == "" {
		cmd = fmt.Sprintf("abnconvert --input %s --output %s --relu %s --slope %g", filepath.Base(opt.Input), filepath.Base(opt.Output), opt.ReLU, opt.Slope)
	}
	return fmt.Sprintf("Architecture: %s. Command: %s", m.Arch, cmd)
}

// checkPaths refuses, before any work, outputs that would overwrite the
// input or each other, and existing outputs without --force.
func checkPaths(opt Options) error {
	st, err := os.Stat(opt.Input)
	if err != nil {
		return fmt.Errorf("%s: %w", opt.Input, unwrapPathError(err))
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s: not a regular file", opt.Input)
	}
	switch strings.ToLower(filepath.Ext(opt.Output)) {
	case ".py", ".json", ".txt", ".svg", ".png":
		// A checkpoint written under such a name is a silent mistake
		// (a zip in a .py); the likely intent has its own flag.
		return fmt.Errorf("%s: --output is the converted checkpoint (.pth, .pt, .safetensors, or .onnx for an ONNX input); the Python module is --emit-module, the JSON report --report", opt.Output)
	}
	outs := []struct{ flag, path string }{{"--output", opt.Output}, {"--emit-module", opt.EmitModule}, {"--report", opt.ReportPath}}
	seen := map[string]string{}
	for _, o := range outs {
		if o.path == "" {
			continue
		}
		abs, err := filepath.Abs(o.path)
		if err != nil {
			return fmt.Errorf("%s: %w", o.path, err)
		}
		if prev, dup := seen[abs]; dup {
			return fmt.Errorf("%s: given to both %s and %s", o.path, prev, o.flag)
		}
		seen[abs] = o.flag
		if ost, err := os.Stat(o.path); err == nil {
			if os.SameFile(st, ost) {
				return fmt.Errorf("%s: %s is the input file; abnconvert never overwrites its input", o.path, o.flag)
			}
			if ost.IsDir() {
				return fmt.Errorf("%s: %s is a directory", o.path, o.flag)
			}
			if !opt.Force {
				return fmt.Errorf("%s: already exists (use --force to overwrite)", o.path)
			}
		}
		dir := filepath.Dir(abs)
		if dst, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%s: directory %s does not exist", o.path, dir)
		} else if err != nil {
			// ENAMETOOLONG (a path past PATH_MAX), EACCES, ELOOP:
			// the system's own words say what is wrong.
			return fmt.Errorf("%s: %s: directory %s: %w", o.path, o.flag, dir, unwrapPathError(err))
		} else if !dst.IsDir() {
			return fmt.Errorf("%s: %s is not a directory", o.path, dir)
		}
	}
	return nil
}

func unwrapPathError(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// WriteTable prints the human summary of a conversion.
func (r *Result) WriteTable(w io.Writer) {
	bw := bufio.NewWriter(w) // (one write for the table; Report.WriteTable's reason)
	defer bw.Flush()
	w = bw
	if r.body != nil {
		<-r.body.done
		w.Write(r.body.b.Bytes())
	} else {
		r.writeBody(w)
	}
	fmt.Fprintf(w, "wrote %s", r.Output)
	if r.Data != "" {
		fmt.Fprintf(w, " (its external data: %s)", r.Data)
	}
	if r.Module != "" {
		fmt.Fprintf(w, " and %s", r.Module)
	}
	fmt.Fprintf(w, " in %.2fs\n", r.Seconds)
}

// writeBody is the table but its last line.
func (r *Result) writeBody(w io.Writer) {
	fmt.Fprintf(w, "%s: %s checkpoint", r.Input, r.Format)
	if len(r.StatePath) > 0 {
		fmt.Fprintf(w, ", state dict under %q", strings.Join(r.StatePath, "."))
	}
	if r.Prefix != "" {
		fmt.Fprintf(w, ", key prefix %q", r.Prefix)
	}
	fmt.Fprintf(w, "\narchitecture: %s", r.Arch)
	if !r.ExactArch {
		fmt.Fprintf(w, " (family %s, non-standard configuration)", r.Family)
	}
	fmt.Fprintln(w)
	for _, n := range r.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
	r.Report.WriteTable(w) // prints the rewrite's own warnings
	writeAliases(w, r.Input, r.Aliases)
	inReport := map[string]bool{}
	for _, wn := range r.Report.Warnings {
		inReport[wn] = true
	}
	var warns []string
	for _, wn := range r.Warnings {
		if !inReport[wn] {
			warns = append(warns, wn)
		}
	}
	sort.Strings(warns)
	for _, wn := range dedupe(warns) {
		fmt.Fprintf(w, "warning: %s\n", wn)
	}
}

func dedupe(s []string) []string {
	var out []string
	for i, x := range s {
		if i == 0 || x != s[i-1] {
			out = append(out, x)
		}
	}
	return out
}
