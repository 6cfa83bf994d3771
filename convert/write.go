package convert

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
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
// format, with the provenance record rec (nil: none, as revert writes; a
// record the input held is dropped then).
func stage(s *model.Model, set *output.Set, out string, rec []byte) error {
	if isSafetensors(out) {
		if st := s.Safetensors; st != nil {
			meta := map[string]string{}
			for k, v := range st.Metadata {
				meta[k] = v
			}
			delete(meta, model.ProvenanceKey)
			if rec != nil {
				meta[model.ProvenanceKey] = string(rec)
			}
			st.Metadata = meta
			return st.Stage(set, out)
		}
		var w graph.Weights = s.Weights
		if ck := s.Checkpoint; ck != nil && len(ck.Carried) > 0 {
			w = withCarried{ck}
		}
		ts, err := safetensors.FromWeights(w, func(k string) safetensors.DType { return safetensors.FromTorch(s.TorchDType(k)) })
		if err != nil {
			return fmt.Errorf("%s: %w", out, err)
		}
		meta := map[string]string{"format": "pt"}
		if rec != nil {
			meta[model.ProvenanceKey] = string(rec)
		}
		return safetensors.StageTensors(set, out, ts, meta)
	}
	if ck := s.Checkpoint; ck != nil {
		ck.Provenance = rec
		return ck.Stage(set, out)
	}
	nc := pth.NewStateDict(out)
	st := s.Safetensors
	for _, k := range s.Weights.Keys() {
		shape, _ := s.Weights.Shape(k)
		if st != nil && st.DType(k).Size() == s.TorchDType(k).Size() {
			// The bytes stream from the safetensors file (both formats store
			// tensors row-major, little-endian) with the conversion's sign
			// flips applied on the way: nothing is held.
			key := k
			if err := nc.AddStreamedTensor(k, s.TorchDType(k), shape, func(w io.Writer) error { return st.WriteTensor(key, w) }); err != nil {
				return err
			}
			continue
		}
		v, err := s.Weights.Values(k)
		if err != nil {
			return err
		}
		if err := nc.AddTensor(k, s.TorchDType(k), shape, v); err != nil {
			return err
		}
	}
	nc.Provenance = rec
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
