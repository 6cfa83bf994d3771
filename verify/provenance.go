package verify

import (
	"fmt"
	"strings"

	"github.com/abnconvert/abnconvert/model"
)

// The converted network is rebuilt from the conversion's flags. A file
// abnconvert wrote says which they were (its provenance record, package
// model), so none needs repeating: a flag given anyway must agree with the
// record, or verify refuses, naming both values (a contradicting flag means
// the caller believes the file is something it is not). A file without a
// record (an older abnconvert's output, or another tool's) is verified
// with the flags given, defaults for the rest, and the result says so and
// which flags to give.

// given reports which conversion flags the caller set: an empty or zero
// field is a flag not given (Sync can only be given as true).
type given struct{ relu, slope, tiny, sync, arch, graph bool }

func (o *Options) given() given {
	return given{relu: o.ReLU != "", slope: o.Slope != 0, tiny: o.TinyGamma != "", sync: o.Sync,
		arch: o.Arch != "" && o.Arch != "auto", graph: o.Graph != ""}
}

// settle fills the conversion's flags from the converted file's record,
// refusing contradictions; conv is the opened converted file. It returns
// where the flags came from, for the result, and warnings.
func (o *Options) settle(conv *model.Model) (from string, warnings []string, err error) {
	if conv.ProvenanceError != nil {
		return "", nil, conv.ProvenanceError
	}
	g := o.given()
	p := conv.Provenance
	if p == nil {
		o.defaults()
		return "command line", []string{noRecord(o)}, nil
	}
	contradiction := func(flag, gave, rec string) error {
		return fmt.Errorf("%s %s contradicts the provenance record of %s: the conversion used %s %s (drop the flag: verify reads it from the file)", flag, gave, o.Converted, flag, rec)
	}
	switch {
	case g.relu && o.ReLU != p.ReLU:
		return "", nil, contradiction("--relu", o.ReLU, p.ReLU)
	case g.slope && o.Slope != p.Slope:
		return "", nil, contradiction("--slope", fmt.Sprint(o.Slope), fmt.Sprint(p.Slope))
	case g.tiny && o.TinyGamma != p.TinyGammaPolicy():
		rec := p.TinyGammaPolicy()
		if p.TinyGamma == "" {
			rec += " (the record is older than the flag: abnconvert approximated then)"
		}
		return "", nil, contradiction("--tiny-gamma", o.TinyGamma, rec)
	case g.sync && !p.Sync:
		return "", nil, fmt.Errorf("--sync contradicts the provenance record of %s: the conversion did not use --sync (drop the flag: verify reads it from the file)", o.Converted)
	case g.arch && o.Arch != p.Arch && o.Arch != p.Recognised:
		return "", nil, contradiction("--arch", o.Arch, p.Arch+" (taken as "+p.Recognised+")")
	}
	o.ReLU, o.Slope, o.Sync = p.ReLU, p.Slope, p.Sync
	// A record from before --tiny-gamma: every conversion approximated.
	o.TinyGamma = p.TinyGammaPolicy()
	if !g.arch {
		o.Arch = p.Arch
	}
	switch {
	case p.Structure.Source == model.SourceGraph && !g.graph:
		return "", nil, fmt.Errorf("%s: the conversion took its structure from --graph %s (sha256 %s), which the file does not hold; give it with --graph", o.Converted, p.Structure.File, p.Structure.SHA256)
	case p.Structure.Source == model.SourceGraph:
		d, err := model.FileSHA256(o.Graph)
		if err != nil {
			return "", nil, err
		}
		if d != p.Structure.SHA256 {
			return "", nil, fmt.Errorf("--graph %s (sha256 %s) contradicts the provenance record of %s: the conversion took its structure from %s (sha256 %s)", o.Graph, d, o.Converted, p.Structure.File, p.Structure.SHA256)
		}
	case g.graph:
		return "", nil, fmt.Errorf("--graph %s contradicts the provenance record of %s: the conversion took its structure from the %s, not from --graph (drop the flag)", o.Graph, o.Converted, p.Structure.Source)
	}
	if p.Input.SHA256 != "" {
		if same, d, err := p.Input.Matches(o.Original); err == nil && !same {
			warnings = append(warnings, fmt.Sprintf("%s was converted from %s (sha256 %s), and %s has sha256 %s: not the file converted; verified anyway", o.Converted, p.Input.File, p.Input.SHA256, o.Original, d))
		}
	}
	o.defaults()
	return fmt.Sprintf("provenance record (abnconvert %s: %s)", p.Version, p.Flags()), warnings, nil
}

// noRecord is the note for a converted file without a record.
func noRecord(o *Options) string {
	used := []string{"--relu " + o.ReLU, fmt.Sprintf("--slope %g", o.Slope), "--tiny-gamma " + o.TinyGamma}
	if o.Sync {
		used = append(used, "--sync")
	}
	if o.Arch != "auto" {
		used = append(used, "--arch "+o.Arch)
	}
	if o.Graph != "" {
		used = append(used, "--graph "+o.Graph)
	}
	return fmt.Sprintf("%s has no provenance record (written by an abnconvert older than the record, or by another tool): the converted network was rebuilt from %s; "+
		"if the conversion used other flags, give them: --relu (leaky, abn, error), --slope, --tiny-gamma (exact, approx; abnconvert before the flag approximated), --sync, --arch, --graph", o.Converted, strings.Join(used, " "))
}
