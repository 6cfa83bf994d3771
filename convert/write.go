package convert

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/output"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/safetensors"
)

// outputs starts the output set of a conversion or a revert: every file
// the command writes is staged in it and renamed into place together by
// Commit, so that a later output failing (a module into a read-only
// directory, a report into a missing one) leaves every previous file as it
// was. The command's input files are protected.
func outputs(force, fsync bool, inputs ...string) *output.Set {
	set := output.New(output.Options{Force: force, Sync: fsync})
	for _, in := range inputs {
		if in != "" {
			set.Protect(in)
		}
	}
	return set
}

// stage writes the (converted) state dict into set at out, in out's
// format.
func (s *source) stage(set *output.Set, out string) error {
	if isSafetensors(out) {
		if s.st != nil {
			return s.st.Stage(set, out)
		}
		var w graph.Weights = s.w
		if s.ck != nil && len(s.ck.Carried) > 0 {
			w = withCarried{s.ck}
		}
		ts, err := safetensors.FromWeights(w, func(k string) safetensors.DType { return safetensors.FromTorch(s.torchDType(k)) })
		if err != nil {
			return fmt.Errorf("%s: %w", out, err)
		}
		return safetensors.StageTensors(set, out, ts, map[string]string{"format": "pt"})
	}
	if s.ck != nil {
		return s.ck.Stage(set, out)
	}
	nc := pth.NewStateDict(out)
	for _, k := range s.w.Keys() {
		shape, _ := s.w.Shape(k)
		if s.st != nil && s.st.DType(k).Size() == s.torchDType(k).Size() {
			// The bytes stream from the safetensors file (both formats store
			// tensors row-major, little-endian) with the conversion's sign
			// flips applied on the way: nothing is held.
			key := k
			if err := nc.AddStreamedTensor(k, s.torchDType(k), shape, func(w io.Writer) error { return s.st.WriteTensor(key, w) }); err != nil {
				return err
			}
			continue
		}
		v, err := s.w.Values(k)
		if err != nil {
			return err
		}
		if err := nc.AddTensor(k, s.torchDType(k), shape, v); err != nil {
			return err
		}
	}
	return nc.Stage(set, out)
}

// stageReport stages the JSON report, when one was asked for.
func stageReport(set *output.Set, opt Options, res *Result) error {
	if opt.ReportPath == "" {
		return nil
	}
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return fmt.Errorf("%s: %w", opt.ReportPath, err)
	}
	return set.WriteFile(opt.ReportPath, append(b, '\n'))
}
