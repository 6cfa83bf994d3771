package convert

import (
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/rewrite"
)

// Inspection is what a checkpoint holds and what a conversion would do with
// it. Producing one writes nothing.
type Inspection struct {
	File      string         `json:"file"`
	Size      int64          `json:"size_bytes"`
	Format    string         `json:"format"`
	Globals   []string       `json:"globals"`
	StatePath []string       `json:"state_path"`
	Prefix    string         `json:"prefix,omitempty"`
	Entries   []string       `json:"other_entries,omitempty"`
	Tensors   int            `json:"tensors"`
	DTypes    map[string]int `json:"dtypes"`
	Bytes     int64          `json:"tensor_bytes"`
	Arch      string         `json:"arch,omitempty"`
	Family    string         `json:"family,omitempty"`
	ExactArch bool           `json:"arch_exact"`
	Notes     []string       `json:"arch_notes,omitempty"`
	// ArchError says why no architecture was recognised; the rest of the
	// inspection is still valid.
	ArchError string          `json:"arch_error,omitempty"`
	Report    *rewrite.Report `json:"report,omitempty"`
	// RewriteError says why the conversion would be refused.
	RewriteError string `json:"rewrite_error,omitempty"`
	// Aliases are the state dict's groups of keys sharing a storage, and
	// what a conversion would do with each (alias.go).
	Aliases []AliasGroup `json:"aliases,omitempty"`
	// Provenance is the record of the conversion that wrote the file, if
	// abnconvert did; ProvenanceError says why a record could not be read.
	Provenance      *model.Provenance `json:"provenance,omitempty"`
	ProvenanceError string            `json:"provenance_error,omitempty"`
}

// Inspect opens path, recognises it and dry-runs the rewrite with opt's
// policy. Only an unreadable or refused file is an error.
func Inspect(path string, opt Options) (*Inspection, error) {
	opt.defaults()
	if err := opt.validate(); err != nil {
		return nil, err
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, unwrapPathError(err))
	}
	if isONNX(path) {
		return inspectONNX(path, st.Size(), opt)
	}
	if opt.Graph != "" || isSafetensors(path) {
		return inspectState(path, st.Size(), opt) // source.go
	}
	m, err := model.Open(path)
	if err != nil {
		return nil, err
	}
	if m.Module != nil {
		m.Close()
		return inspectState(path, st.Size(), opt) // a whole pickled module
	}
	defer m.Close()
	ck := m.Checkpoint
	ins := &Inspection{
		File: path, Size: st.Size(), Format: string(ck.Format), Globals: ck.Globals,
		StatePath: ck.StatePath, Prefix: ck.Prefix, DTypes: map[string]int{},
		Provenance: m.Provenance,
	}
	if m.ProvenanceError != nil {
		ins.ProvenanceError = m.ProvenanceError.Error()
	}
	if d, ok := ck.Root.(*pth.Dict); ok && len(ck.StatePath) > 0 {
		for i := 0; i < d.Len(); i++ {
			k, _ := d.Entry(i)
			if s, ok := k.(string); !ok || s != ck.StatePath[0] {
				ins.Entries = append(ins.Entries, fmt.Sprint(k))
			}
		}
	}
	for _, k := range ck.Carried {
		ins.Entries = append(ins.Entries, k+" (AveragedModel's count, not a weight)")
	}
	for _, k := range ck.Keys() {
		t, ok := ck.Tensor(k)
		if !ok {
			continue
		}
		ins.Tensors++
		ins.DTypes[string(t.DType())]++
		ins.Bytes += int64(t.Numel() * t.DType().Size())
	}
	ins.Aliases = aliasGroups(ck, nil, false) // what a conversion would change, below
	g, match, err := arch.Recognize(ck, opt.Arch)
	if err != nil {
		ins.ArchError = err.Error()
		return ins, nil
	}
	ins.Arch, ins.Family, ins.ExactArch, ins.Notes = match.Arch, match.Family, match.Exact, append(append([]string(nil), match.Notes...), match.Warnings...)
	if err := refuseConverted(m); err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	if err := validateBN(g, ck); err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	rep, err := rewrite.Run(g, ck, rewriteOptions(opt))
	if err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	ins.Report = rep
	ins.Aliases = aliasGroups(ck, rep, false)
	return ins, nil
}

// WriteText prints the inspection for a person.
func (ins *Inspection) WriteText(w io.Writer) {
	onnxFile := ins.Family == "onnx"
	if onnxFile {
		fmt.Fprintf(w, "%s: %s model, %d bytes\n", ins.File, ins.Format, ins.Size)
		fmt.Fprintf(w, "parameters: %d tensors, %.1f MB", ins.Tensors, float64(ins.Bytes)/1e6)
	} else {
		fmt.Fprintf(w, "%s: %s checkpoint, %d bytes\n", ins.File, ins.Format, ins.Size)
		where := "top level"
		if len(ins.StatePath) > 0 {
			where = "under " + strings.Join(ins.StatePath, ".")
		}
		fmt.Fprintf(w, "state dict (%s): %d tensors, %.1f MB", where, ins.Tensors, float64(ins.Bytes)/1e6)
	}
	var dts []string
	for d, n := range ins.DTypes {
		dts = append(dts, fmt.Sprintf("%s %d", d, n))
	}
	sort.Strings(dts)
	fmt.Fprintf(w, " (%s)\n", strings.Join(dts, ", "))
	if ins.Prefix != "" {
		fmt.Fprintf(w, "key prefix: %q (kept on output)\n", ins.Prefix)
	}
	if len(ins.Entries) > 0 {
		fmt.Fprintf(w, "other entries (kept on output): %s\n", strings.Join(ins.Entries, ", "))
	}
	if !onnxFile {
		fmt.Fprintf(w, "globals: %s\n", strings.Join(ins.Globals, ", "))
	}
	writeAliases(w, ins.File, ins.Aliases)
	switch {
	case ins.Provenance != nil:
		ins.Provenance.WriteText(w)
	case ins.ProvenanceError != "":
		fmt.Fprintf(w, "provenance: %s\n", ins.ProvenanceError)
	}
	if ins.ArchError != "" {
		fmt.Fprintf(w, "architecture: not recognised: %s\n", ins.ArchError)
		return
	}
	fmt.Fprintf(w, "architecture: %s", ins.Arch)
	if !ins.ExactArch {
		fmt.Fprintf(w, " (family %s, non-standard configuration)", ins.Family)
	}
	fmt.Fprintln(w)
	for _, n := range ins.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
	if ins.RewriteError != "" {
		fmt.Fprintf(w, "conversion would be refused: %s\n", ins.RewriteError)
		return
	}
	fmt.Fprintln(w, "what a conversion would do:")
	ins.Report.WriteTable(w)
}

func inspectONNX(path string, size int64, opt Options) (*Inspection, error) {
	md, err := model.Open(path)
	if err != nil {
		return nil, err
	}
	m := md.ONNX
	ins := &Inspection{File: path, Size: size, Format: md.Format, DTypes: map[string]int{},
		Arch: m.Graph.Arch, Family: "onnx", ExactArch: true, Provenance: md.Provenance}
	if md.ProvenanceError != nil {
		ins.ProvenanceError = md.ProvenanceError.Error()
	}
	for _, k := range m.Weights.Keys() {
		ins.Tensors++
		if dt, ok := m.Weights.DataType(k); ok {
			ins.DTypes[dt]++
		}
		if s, ok := m.Weights.Shape(k); ok {
			ins.Bytes += int64(graph.Numel(s)) * 4
		}
	}
	if opaque := m.Opaque(); len(opaque) > 0 {
		ins.Notes = append(ins.Notes, fmt.Sprintf("%d node(s) the IR does not model are carried through: %s", len(opaque), summarize(opaque, 6)))
	}
	rep, err := rewrite.Run(m.Graph, m.Weights, rewriteOptions(opt))
	if err != nil {
		ins.RewriteError = err.Error()
		return ins, nil
	}
	ins.Report = rep
	return ins, nil
}
