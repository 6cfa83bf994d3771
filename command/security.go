package command

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/safetensors"
)

// Security is the report of inspect --security: for a pickle checkpoint,
// every global its pickles reference and, for each torch release whose
// weights_only unpickler is known (pth.Releases: 1.13 and 2.6), whether
// torch.load(weights_only=True) accepts the file and the first thing it
// would refuse; for a safetensors file, that there is no pickle, and its
// tensors.
//
// Exit codes: 0 when every release accepts the file (or it has no pickle
// at all: safetensors), 2 when any release refuses it (one line on stderr
// says which and why) or when the file cannot be read.
type Security struct {
	File string `json:"file"`
	// Format is "zip", "legacy" or "safetensors".
	Format string `json:"format"`
	// Pickle is false for a safetensors file: nothing in it can run code.
	Pickle bool `json:"pickle"`
	// Protocol is the main pickle's protocol (torch.save writes 2 unless
	// given pickle_protocol=).
	Protocol int              `json:"pickle_protocol,omitempty"`
	Globals  []SecurityGlobal `json:"globals"`
	// Torch holds one verdict per torch release, oldest first.
	Torch []pth.Verdict `json:"torch,omitempty"`
	// Tensors and Metadata describe a safetensors file.
	Tensors  []SecurityTensor  `json:"tensors,omitempty"`
	Metadata map[string]string `json:"metadata,omitempty"`
	// Safe is true when torch.load(weights_only=True) of every release in
	// Torch accepts the file (false for safetensors, which torch.load
	// cannot read at all).
	Safe    bool   `json:"safe_with_weights_only"`
	Verdict string `json:"verdict"`
	// Stopped says where the file stops being a checkpoint (a bare
	// pickle named .pth, a truncated legacy file); the verdicts cover the
	// pickles before it, which torch.load reads, and runs, first.
	Stopped string `json:"stopped,omitempty"`
}

// SecurityGlobal is one global and the allowlists' answer for it.
type SecurityGlobal struct {
	Name string `json:"name"`
	// Allowed is true when every release's allowlist holds it; AllowedBy
	// names the releases whose allowlist does.
	Allowed   bool     `json:"allowed"`
	AllowedBy []string `json:"allowed_by"`
}

// SecurityTensor is one tensor of a safetensors file.
type SecurityTensor struct {
	Name  string `json:"name"`
	DType string `json:"dtype"`
	Shape []int  `json:"shape"`
}

// securityAction runs inspect --security. Nothing is decoded or executed:
// the pickles are only walked, so it works on files that Open refuses.
func securityAction(c *cli.Context, path string) error {
	var (
		sec *Security
		err error
	)
	if looksSafetensors(path) {
		sec, err = safetensorsSecurity(path)
	} else {
		sec, err = pickleSecurity(path)
	}
	if err != nil {
		return err
	}
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		if err := enc.Encode(sec); err != nil {
			return err
		}
	} else {
		sec.WriteText(c.App.Writer)
	}
	if sec.Pickle && !sec.Safe {
		return cli.Exit(fmt.Sprintf("%s: %s", path, sec.refusals()), ExitBadInput)
	}
	return nil
}

// looksSafetensors: the extension, or the layout (an 8-byte little-endian
// header length, then the JSON header's '{'), which neither a zip nor a
// legacy pickle checkpoint has.
func looksSafetensors(path string) bool {
	if strings.EqualFold(filepath.Ext(path), ".safetensors") {
		return true
	}
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	var head [9]byte
	if _, err := io.ReadFull(f, head[:]); err != nil {
		return false
	}
	st, err := f.Stat()
	return err == nil && head[8] == '{' && binary.LittleEndian.Uint64(head[:8]) < uint64(st.Size())
}

func safetensorsSecurity(path string) (*Security, error) {
	f, err := safetensors.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sec := &Security{File: path, Format: "safetensors", Globals: []SecurityGlobal{}, Metadata: f.Metadata, Tensors: []SecurityTensor{}}
	for _, k := range f.Keys() {
		shape, _ := f.Shape(k)
		sec.Tensors = append(sec.Tensors, SecurityTensor{Name: k, DType: string(f.DType(k)), Shape: shape})
	}
	sec.Verdict = "no pickle: a safetensors file holds a JSON header and raw tensor bytes, so loading it runs no code " +
		"(torch.load cannot read it; safetensors.torch.load_file can)"
	return sec, nil
}

func pickleSecurity(path string) (*Security, error) {
	a, err := pth.AuditFile(path)
	if err != nil {
		return nil, err
	}
	sec := &Security{File: path, Format: string(a.Format), Pickle: true, Protocol: a.Protocol, Globals: []SecurityGlobal{}, Safe: true, Stopped: a.Stopped}
	for _, r := range pth.Releases() {
		v := r.Verdict(a)
		sec.Torch = append(sec.Torch, v)
		sec.Safe = sec.Safe && v.Accepted
	}
	var unsafe []string
	for _, g := range a.Globals {
		sg := SecurityGlobal{Name: g, AllowedBy: []string{}}
		for _, r := range pth.Releases() {
			if r.Allows(g) {
				sg.AllowedBy = append(sg.AllowedBy, r.Torch)
			}
		}
		sg.Allowed = len(sg.AllowedBy) == len(pth.Releases())
		if len(sg.AllowedBy) == 0 {
			unsafe = append(unsafe, g)
		}
		sec.Globals = append(sec.Globals, sg)
	}
	switch {
	case sec.Safe:
		sec.Verdict = fmt.Sprintf("safe to load with torch.load(weights_only=True) in torch %s: every opcode and global it uses is on their allowlists", releaseNames())
	case len(unsafe) > 0:
		sec.Verdict = fmt.Sprintf("NOT safe: %s; a plain torch.load would import and call %s while loading", sec.refusals(), strings.Join(unsafe, ", "))
		if a.Stopped != "" {
			sec.Verdict += fmt.Sprintf(" (before it fails: %s)", a.Stopped)
		}
	case a.Stopped != "" && sec.refusedOnlyWhereStopped():
		sec.Verdict = fmt.Sprintf("not a loadable checkpoint (%s); nothing in the pickles before that point would run code: torch %s's weights_only unpickler accepts them", a.Stopped, releaseNames())
	default:
		// Only compatibility: every global is one some release allows.
		sec.Verdict = sec.refusals() + "; every global it references is on a torch allowlist: the refusal is of how the pickle is written, not of code it would run"
		if sec.Protocol >= 4 {
			sec.Verdict += fmt.Sprintf(" (pickle protocol %d; torch.save's default, 2, and abnconvert's outputs load in both)", sec.Protocol)
		}
	}
	return sec, nil
}

// refusedOnlyWhereStopped: every release's refusal is the file's end as
// a checkpoint, not an opcode or a global before it.
func (s *Security) refusedOnlyWhereStopped() bool {
	for _, v := range s.Torch {
		if !v.Accepted && (v.Opcode != "" || v.Global != "") {
			return false
		}
	}
	return true
}

// refusals says which releases refuse the file and why, and which accept.
func (s *Security) refusals() string {
	var no, yes []string
	for _, v := range s.Torch {
		if v.Accepted {
			yes = append(yes, v.Torch)
		} else {
			no = append(no, fmt.Sprintf("torch %s (%s)", v.Torch, v.Reason))
		}
	}
	out := "torch.load(weights_only=True) refuses it in " + strings.Join(no, " and ")
	if len(yes) > 0 {
		out += "; torch " + strings.Join(yes, " and ") + " accepts it"
	}
	return out
}

func releaseNames() string {
	var names []string
	for _, r := range pth.Releases() {
		names = append(names, r.Torch)
	}
	return strings.Join(names, " and ")
}

// WriteText prints the report for a person: one global a line, one line
// per torch release, then the verdict.
func (s *Security) WriteText(w io.Writer) {
	if !s.Pickle {
		fmt.Fprintf(w, "%s: safetensors, %d tensors, no pickle (nothing was executed)\n", s.File, len(s.Tensors))
		for _, t := range s.Tensors {
			fmt.Fprintf(w, "  %-5s %-16s %s\n", t.DType, fmt.Sprint(t.Shape), t.Name)
		}
		fmt.Fprintf(w, "verdict: %s\n", s.Verdict)
		return
	}
	kind := s.Format + " checkpoint"
	if s.Format == string(pth.FormatBarePickle) {
		kind = "a bare pickle, not a checkpoint (torch.load reads it as a legacy one's first pickle)"
	}
	fmt.Fprintf(w, "%s: %s, pickle protocol %d, %d globals referenced (nothing was executed)\n", s.File, kind, s.Protocol, len(s.Globals))
	if s.Stopped != "" {
		fmt.Fprintf(w, "  not a whole checkpoint: %s\n", s.Stopped)
	}
	for _, g := range s.Globals {
		mark := "allowed"
		switch {
		case len(g.AllowedBy) == 0:
			mark = "REFUSED"
		case !g.Allowed:
			mark = "only " + strings.Join(g.AllowedBy, ",")
		}
		fmt.Fprintf(w, "  %-8s %s\n", mark, g.Name)
	}
	for _, v := range s.Torch {
		if v.Accepted {
			fmt.Fprintf(w, "torch %-4s weights_only: accepted\n", v.Torch)
		} else {
			fmt.Fprintf(w, "torch %-4s weights_only: REFUSED: %s, at offset %d of %s\n", v.Torch, v.Reason, v.Offset, v.Part)
		}
	}
	fmt.Fprintf(w, "verdict: %s\n", s.Verdict)
}
