package convert

import (
	"fmt"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/rewrite"
)

// Every output carries the conversion's provenance record (package model):
// the flags that shaped the network, where its structure came from, each
// BN's eps and every sign the conversion moved. verify rebuilds the
// converted network from it and revert undoes the conversion from it, with
// no flag repeated and no report kept beside the file.

// refuseConverted refuses a state dict that is already a conversion's
// output: its BN weights hold |gamma| - eps, which a second conversion
// would take for gammas and reparametrise again. (An ONNX output converts
// again soundly: standard ops hold BatchNormalization with gamma
// |weight| + eps, custom ops no BatchNormalization at all.)
func refuseConverted(m *model.Model) error {
	if p := m.Provenance; p != nil && m.ONNX == nil {
		return fmt.Errorf("%s: already converted (its provenance record says abnconvert %s wrote it from %s with %s); convert the original, or revert this file first", m.Path, p.Version, p.Input.File, p.Flags())
	}
	return nil
}

// structure is the conversion's structure options.
func (o Options) structure() model.Options { return model.Options{Arch: o.Arch, Graph: o.Graph} }

// origin is the part of the record known before the rewrite.
type origin struct {
	input     model.FileDigest
	structure model.StructureSource
}

// structureSource digests the input and the structure source of m.
func (o Options) structureSource(m *model.Model) (*origin, error) {
	d, err := m.DigestInput()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", o.Input, unwrapPathError(err))
	}
	d.File = baseName(o.Input)
	st, err := m.StructureSource(o.structure())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", o.Graph, unwrapPathError(err))
	}
	return &origin{input: d, structure: st}, nil
}

// record is the encoded provenance record of a finished rewrite of g.
func (p *origin) record(opt Options, g *graph.Graph, match *arch.Match, rep *rewrite.Report) ([]byte, error) {
	return provenanceOf(opt, p, g, match, rep).Encode()
}

func provenanceOf(opt Options, p *origin, g *graph.Graph, match *arch.Match, rep *rewrite.Report) *model.Provenance {
	version := opt.Version
	if version == "" {
		version = "dev"
	}
	pr := &model.Provenance{
		Tool: "abnconvert", Version: version, Schema: model.ProvenanceSchema,
		Input: p.input, Structure: p.structure,
		Arch: opt.Arch, Recognised: match.Arch,
		ReLU: opt.ReLU, Slope: opt.Slope, Sync: opt.Sync, TinyGamma: opt.TinyGamma,
		BNEps: bnEps(g), Flips: rep.Flips, Sites: []model.Site{},
	}
	if isONNX(opt.Output) {
		pr.ONNXOps = opt.ONNXOps
	}
	if pr.Flips == nil {
		pr.Flips = map[string][]int{}
	}
	for _, s := range rep.Sites {
		pr.Sites = append(pr.Sites, model.Site{
			Node: s.Node, Op: string(s.Op), Activation: s.Activation, ActivationNode: s.ActivationNode,
			OpActivation: s.OpActivation, OpActivationParam: s.OpActivationParam, Outcome: string(s.Outcome),
			FoldedChannels: s.FoldedChannels, FoldedInto: s.FoldedInto, FlippedChannels: s.FlippedChannels,
			TinyGammaChannels: s.TinyGammaChannels, TinyGammaExactChannels: s.TinyGammaExactChannels,
		})
	}
	return pr
}

// reportOf is the conversion report a provenance record holds: its sites,
// sign flips and eps, in the form revert and verify read a --report in.
func reportOf(p *model.Provenance) *Result {
	rep := &rewrite.Report{Arch: p.Recognised, ReLUPolicy: p.ReLU, Slope: p.Slope, TinyGammaPolicy: p.TinyGammaPolicy(), Sync: p.Sync, Flips: p.Flips}
	for _, s := range p.Sites {
		rep.Sites = append(rep.Sites, rewrite.Site{
			Node: s.Node, Op: graph.Op(s.Op), Activation: s.Activation, ActivationNode: s.ActivationNode,
			OpActivation: s.OpActivation, OpActivationParam: s.OpActivationParam, Outcome: rewrite.Outcome(s.Outcome),
			FoldedChannels: s.FoldedChannels, FoldedInto: s.FoldedInto, FlippedChannels: s.FlippedChannels,
			TinyGammaChannels: s.TinyGammaChannels, TinyGammaExactChannels: s.TinyGammaExactChannels,
		})
	}
	return &Result{Arch: p.Recognised, Options: ReportOptions{ReLU: p.ReLU, Slope: p.Slope, TinyGamma: p.TinyGammaPolicy(), Sync: p.Sync}, Report: rep, BNEps: p.BNEps}
}

func baseName(p string) string {
	for i := len(p) - 1; i >= 0; i-- {
		if p[i] == '/' || p[i] == '\\' {
			return p[i+1:]
		}
	}
	return p
}
