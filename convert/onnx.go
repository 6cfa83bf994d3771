package convert

import (
	"fmt"
	"strings"
	"time"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/onnx"
	"github.com/abnconvert/abnconvert/rewrite"
)

// isONNX tells the formats apart by extension: .onnx is ONNX, anything
// else is read as a PyTorch checkpoint.
func isONNX(path string) bool { return model.IsONNX(path) }

// runONNX converts an ONNX graph: the structure comes from the file, so no
// recogniser is needed, and the output is ONNX again (see onnx.Write).
func runONNX(opt Options, start time.Time) (*Result, error) {
	if !isONNX(opt.Output) {
		return nil, fmt.Errorf("%s: an ONNX input is written as ONNX; give an --output ending in .onnx", opt.Output)
	}
	if opt.EmitModule != "" {
		return nil, fmt.Errorf("%s: --emit-module needs a PyTorch checkpoint (module paths and a state dict); an ONNX input is converted to ONNX", opt.EmitModule)
	}
	opt.progress("reading %s", opt.Input)
	md, err := model.Open(opt.Input)
	if err != nil {
		return nil, err
	}
	m := md.ONNX
	if err := m.NoBatchNorm(); err != nil {
		// A copy with nothing changed would read as a conversion.
		return nil, err
	}
	opt.progress("read %d nodes (opset %d)", len(m.Graph.Nodes), m.Opset)
	prov, err := opt.structureSource(md)
	if err != nil {
		return nil, err
	}
	rep, err := rewrite.Run(m.Graph, m.Weights, rewriteOptions(opt))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opt.Input, err)
	}
	res := &Result{
		Input: opt.Input, Output: opt.Output, Format: "onnx", StatePath: []string{},
		Arch: m.Graph.Arch, Family: "onnx", ExactArch: true,
		Options: reportOptions(opt),
		Report:  rep, Warnings: append([]string(nil), rep.Warnings...),
	}
	if w := m.FixedShapeWarning(); w != "" {
		res.Warnings = append(res.Warnings, w)
	}
	if opaque := m.Opaque(); len(opaque) > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d node(s) the IR does not model were carried through unchanged: %s", len(opaque), summarize(opaque, 6)))
	}
	opt.progress("writing %s", opt.Output)
	var wo onnx.WriteOptions
	switch opt.ONNXOps {
	case "", "custom":
	case "standard":
		wo.StandardOps = true
	case "fold":
		wo.FoldForInference = true
	default:
		return nil, fmt.Errorf("--onnx-ops %q: want custom, standard or fold", opt.ONNXOps)
	}
	if opt.ONNXOps == "" {
		opt.ONNXOps = "custom"
	}
	rec, err := prov.record(opt, m.Graph, &arch.Match{Arch: m.Graph.Arch}, rep)
	if err != nil {
		return nil, err
	}
	wo.Metadata = map[string]string{model.ProvenanceKey: string(rec)}
	set := outputs(opt.Force, opt.Fsync, opt.Input)
	defer set.Abort()
	if err := m.Stage(set, opt.Output, wo); err != nil {
		return nil, err
	}
	if data := opt.Output + ".data"; set.Staged(data) {
		// The tensors the conversion changed, of a model whose weights are
		// external data: they ship with the model.
		res.Data = data
	}
	res.Seconds = time.Since(start).Seconds()
	if err := stageReport(set, opt, res); err != nil {
		return nil, err
	}
	if err := set.Commit(); err != nil {
		return nil, err
	}
	return res, nil
}

func summarize(s []string, n int) string {
	if len(s) <= n {
		return strings.Join(s, ", ")
	}
	return strings.Join(s[:n], ", ") + fmt.Sprintf(" and %d more", len(s)-n)
}
