package model

import (
	"archive/zip"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// Every output of a conversion carries a provenance record: how it was
// made, so that verify, revert and inspect need no flag the conversion
// took. It lies where the file's loaders ignore it:
//
//	.pth          a zip record <archive>/abnconvert.json (pth.ProvenanceRecord),
//	              which torch.load never reads: its pickle references only
//	              data/<key> records
//	.safetensors  the header's __metadata__ entry "abnconvert.provenance"
//	              (a string, as safetensors requires)
//	.onnx         the model's metadata_props entry "abnconvert.provenance"
//
// The record is JSON, the same in all three, and deterministic: no time,
// no absolute path, map keys sorted, so that two conversions of one input
// with one set of flags stay byte-identical.
const (
	// ProvenanceKey is the safetensors metadata and ONNX metadata_props
	// key of the record.
	ProvenanceKey = "abnconvert.provenance"
	// ProvenanceSchema is the version of the record's layout.
	ProvenanceSchema = 1
)

// Structure sources: where a conversion took the network's structure from.
const (
	SourceRecogniser = "recogniser" // the state dict's keys and shapes
	SourceGraph      = "graph"      // an ONNX export given with --graph
	SourceModule     = "module"     // the module tree of a whole pickled module
	SourceONNX       = "onnx"       // the ONNX model converted
)

// Provenance is the record. Its flags are the values the conversion ran
// with (defaults included), not only those given on its command line.
type Provenance struct {
	Tool    string `json:"tool"` // "abnconvert"
	Version string `json:"version"`
	Schema  int    `json:"schema"`
	// Input is the file converted: its base name and SHA-256.
	Input FileDigest `json:"input"`
	// Structure is where the network's structure came from.
	Structure StructureSource `json:"structure"`
	// Arch is the --arch given ("auto" or a name); Recognised what the
	// structure was taken as ("resnet50", "custom (structure from x.onnx)").
	Arch       string  `json:"arch"`
	Recognised string  `json:"recognised"`
	ReLU       string  `json:"relu"`
	Slope      float64 `json:"slope"`
	Sync       bool    `json:"sync"`
	// TinyGamma is --tiny-gamma: exact or approx. A record without it was
	// written before the flag existed, when every conversion approximated:
	// TinyGammaPolicy says so.
	TinyGamma string `json:"tiny_gamma,omitempty"`
	// ONNXOps is the ONNX output form (custom, standard, fold); "" for
	// checkpoints.
	ONNXOps string `json:"onnx_ops,omitempty"`
	// BNEps is every BN-family node's eps: revert needs it to undo
	// weight = |gamma| - eps.
	BNEps map[string]float64 `json:"bn_eps"`
	// Flips lists, per tensor, every channel whose sign the conversion
	// negated (folded into a producer, or flipped on a layer's input).
	Flips map[string][]int `json:"flips"`
	// Sites is every converted BatchNorm.
	Sites []Site `json:"sites"`
}

// FileDigest names a file by its base name and content.
type FileDigest struct {
	File   string `json:"file"`
	SHA256 string `json:"sha256"`
	// Method is how SHA256 was taken: "" for the file's bytes, or
	// DigestZipRecords.
	Method string `json:"method,omitempty"`
}

// DigestZipRecords is the SHA-256 of a zip archive's list of records: each
// record's name, size and CRC-32 as its central directory records them, in
// order. It identifies a .pth checkpoint as well as its bytes do against
// accidental change (the CRCs cover every byte, and a conversion checks
// them as it copies), without reading 500 MB twice: hashing the whole file
// cost twice the time of the conversion itself.
const DigestZipRecords = "zip-records"

// DigestInput digests a conversion's input: a zip checkpoint by its record
// list, anything else by its bytes.
func DigestInput(path string) (FileDigest, error) {
	base := filepath.Base(path)
	if d, ok := zipRecordsSHA256(path); ok {
		return FileDigest{File: base, SHA256: d, Method: DigestZipRecords}, nil
	}
	d, err := FileSHA256(path)
	if err != nil {
		return FileDigest{}, err
	}
	return FileDigest{File: base, SHA256: d}, nil
}

// Matches digests path the way d was taken and compares; the digest it
// computed is returned for messages.
func (d FileDigest) Matches(path string) (bool, string, error) {
	var got string
	switch d.Method {
	case DigestZipRecords:
		z, ok := zipRecordsSHA256(path)
		if !ok {
			return false, "(not a zip archive)", nil
		}
		got = z
	case "":
		s, err := FileSHA256(path)
		if err != nil {
			return false, "", err
		}
		got = s
	default:
		return false, "", fmt.Errorf("digest method %q is not one this abnconvert knows", d.Method)
	}
	return got == d.SHA256, got, nil
}

func zipRecordsSHA256(path string) (string, bool) {
	r, err := zip.OpenReader(path)
	if err != nil {
		return "", false
	}
	defer r.Close()
	return pth.ZipRecordsSHA256(r.File), true
}

// DigestInput is DigestInput(m.Path), from the zip directory the
// checkpoint was opened with where it has one, rather than reading it
// again (densenet201: 1,209 records, about 1 ms).
func (m *Model) DigestInput() (FileDigest, error) {
	if m.Checkpoint != nil {
		if d, ok := m.Checkpoint.RecordsSHA256(); ok {
			return FileDigest{File: filepath.Base(m.Path), SHA256: d, Method: DigestZipRecords}, nil
		}
	}
	return DigestInput(m.Path)
}

// StructureSource says where the structure came from and digests it: the
// --graph file's bytes, the input's bytes for a whole module or an ONNX
// model, and the state dict's layout (its keys and shapes, what the
// recogniser reads) for a recognised checkpoint.
type StructureSource struct {
	Source string `json:"source"`
	File   string `json:"file,omitempty"`
	SHA256 string `json:"sha256"`
}

// Site is one converted BatchNorm, as the rewrite report gives it.
type Site struct {
	Node string `json:"node"`
	// Op is InPlaceABN, InPlaceABNSync or ABN.
	Op string `json:"op"`
	// Activation is what followed the BN in the original network;
	// OpActivation and OpActivationParam what the layer runs.
	Activation        string   `json:"activation"`
	ActivationNode    string   `json:"activation_node,omitempty"`
	OpActivation      string   `json:"op_activation"`
	OpActivationParam float64  `json:"op_activation_param,omitempty"`
	Outcome           string   `json:"outcome"`
	FoldedChannels    []int    `json:"folded_channels,omitempty"`
	FoldedInto        []string `json:"folded_into,omitempty"`
	FlippedChannels   []int    `json:"flipped_channels,omitempty"`
	TinyGammaChannels []int    `json:"tiny_gamma_channels,omitempty"`
	// TinyGammaExactChannels made the site fall back to ABN (--tiny-gamma
	// exact): they are held as stored.
	TinyGammaExactChannels []int `json:"tiny_gamma_exact_channels,omitempty"`
}

// TinyGammaApprox is the tiny-gamma policy of a record that names none:
// abnconvert approximated |gamma| < eps (scale eps) before --tiny-gamma.
const TinyGammaApprox = "approx"

// TinyGammaPolicy is the record's --tiny-gamma, TinyGammaApprox for a
// record from before the flag.
func (p *Provenance) TinyGammaPolicy() string {
	if p.TinyGamma == "" {
		return TinyGammaApprox
	}
	return p.TinyGamma
}

// DecodeProvenance parses a record; it refuses one that is not this tool's.
func DecodeProvenance(b []byte) (*Provenance, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	var p Provenance
	if err := d.Decode(&p); err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	if p.Tool != "abnconvert" {
		return nil, fmt.Errorf("written by %q, not abnconvert", p.Tool)
	}
	if p.Schema < 1 || p.Schema > ProvenanceSchema {
		return nil, fmt.Errorf("schema %d, this abnconvert reads 1 to %d (a newer abnconvert wrote it)", p.Schema, ProvenanceSchema)
	}
	return &p, nil
}

// readProvenance finds the record in the opened file. A record that does
// not parse is kept as ProvenanceError: converting such a file needs no
// record, but verify and revert refuse it.
func (m *Model) readProvenance() {
	var raw []byte
	switch {
	case m.Checkpoint != nil:
		raw = m.Checkpoint.Provenance
	case m.Safetensors != nil:
		if s, ok := m.Safetensors.Metadata[ProvenanceKey]; ok {
			raw = []byte(s)
		}
	case m.ONNX != nil:
		if s, ok := m.ONNX.Metadata(ProvenanceKey); ok {
			raw = []byte(s)
		}
	}
	if raw == nil {
		return
	}
	p, err := DecodeProvenance(raw)
	if err != nil {
		m.ProvenanceError = fmt.Errorf("%s: its provenance record is unreadable: %w", m.Path, err)
		return
	}
	m.Provenance = p
}

// FileSHA256 is the hex SHA-256 of a file's bytes.
func FileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// LayoutSHA256 digests what the recogniser reads of a state dict: each
// key with its shape, in order.
func LayoutSHA256(w graph.Weights) string {
	// Each line as fmt.Sprintf("%s %v\n", key, shape) writes it, built
	// with strconv: fmt was most of the digest's 0.7 ms on densenet201.
	h := sha256.New()
	var b []byte
	for _, k := range w.Keys() {
		s, _ := w.Shape(k)
		b = append(append(b[:0], k...), " ["...)
		for i, d := range s {
			if i > 0 {
				b = append(b, ' ')
			}
			b = strconv.AppendInt(b, int64(d), 10)
		}
		h.Write(append(b, "]\n"...))
	}
	return hex.EncodeToString(h.Sum(nil))
}

// StructureSource digests where Structure(opt) takes the structure from.
func (m *Model) StructureSource(opt Options) (StructureSource, error) {
	var src StructureSource
	var file string
	switch {
	case m.ONNX != nil:
		src.Source, file = SourceONNX, m.Path
	case opt.Graph != "":
		src.Source, file = SourceGraph, opt.Graph
	case m.Module != nil:
		src.Source, file = SourceModule, m.Path
	default:
		src.Source = SourceRecogniser
		src.SHA256 = LayoutSHA256(m.Weights)
		return src, nil
	}
	d, err := FileSHA256(file)
	if err != nil {
		return src, err
	}
	src.File, src.SHA256 = baseName(file), d
	return src, nil
}

func baseName(p string) string {
	if i := strings.LastIndexAny(p, `/\`); i >= 0 {
		return p[i+1:]
	}
	return p
}

// Flags is the record's flags as a command line, for messages.
func (p *Provenance) Flags() string {
	s := fmt.Sprintf("--relu %s --slope %g --tiny-gamma %s", p.ReLU, p.Slope, p.TinyGammaPolicy())
	if p.Sync {
		s += " --sync"
	}
	if p.Arch != "" && p.Arch != "auto" {
		s += " --arch " + p.Arch
	}
	if p.Structure.Source == SourceGraph {
		s += " --graph " + p.Structure.File
	}
	if p.ONNXOps != "" {
		s += " --onnx-ops " + p.ONNXOps
	}
	return s
}

// WriteText prints the record for a person (inspect).
func (p *Provenance) WriteText(w io.Writer) {
	fmt.Fprintf(w, "provenance: converted by abnconvert %s from %s (sha256 %s)\n", p.Version, p.Input.File, short(p.Input.SHA256))
	fmt.Fprintf(w, "  flags: %s\n", p.Flags())
	st := p.Structure.Source
	if p.Structure.File != "" {
		st += " " + p.Structure.File
	}
	fmt.Fprintf(w, "  structure: %s (sha256 %s), taken as %s\n", st, short(p.Structure.SHA256), p.Recognised)
	counts := map[string]int{}
	for _, s := range p.Sites {
		counts[s.Op]++
	}
	var ops []string
	for op, n := range counts {
		ops = append(ops, fmt.Sprintf("%d %s", n, op))
	}
	sort.Strings(ops)
	flips := 0
	for _, c := range p.Flips {
		flips += len(c)
	}
	fmt.Fprintf(w, "  %d site(s): %s; %d BN eps; %d sign flip(s) in %d tensor(s)\n", len(p.Sites), strings.Join(ops, ", "), len(p.BNEps), flips, len(p.Flips))
}

func short(d string) string {
	if len(d) > 16 {
		return d[:16] + "..."
	}
	return d
}
