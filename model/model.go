// Package model opens every input abnconvert reads, whatever its format:
// a .pth state dict (zip or legacy, nested, prefixed), a whole pickled
// module (torch.save(model)), a .safetensors file, or an ONNX model; and it
// builds the network's structure from the state dict's layout (the
// recogniser), from a module tree, from an ONNX export given with --graph,
// or from the ONNX model itself. It also reads the provenance record a
// conversion wrote into the file (provenance.go).
//
// convert, verify, memory, revert and inspect all open their inputs here,
// so that every command reads every format the same way, with the same
// error messages. Nothing here writes.
package model

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx"
	"github.com/abnconvert/abnconvert/pth"
	"github.com/abnconvert/abnconvert/safetensors"
)

// IsONNX tells the formats apart by extension: .onnx is ONNX, anything
// else is read as a PyTorch checkpoint or safetensors.
func IsONNX(path string) bool { return strings.EqualFold(filepath.Ext(path), ".onnx") }

// IsSafetensors says whether path names a .safetensors file.
func IsSafetensors(path string) bool {
	return strings.EqualFold(filepath.Ext(path), ".safetensors")
}

// Model is an opened input: its weights, the format details a writer or a
// report needs, and the provenance record, if the file holds one. Exactly
// one of Checkpoint, Safetensors and ONNX is set.
type Model struct {
	Path string
	// Format describes the file for people: "zip", "legacy",
	// "safetensors", "zip (whole pickled module ...)", "onnx (opset N)".
	Format string
	// Weights is the state dict (for ONNX: the initializers by parameter).
	// Changes through SetValues stay in memory.
	Weights graph.Weights

	Checkpoint  *pth.Checkpoint   // a .pth: its state dict, or a whole module's
	Module      *pth.Module       // the module tree of a whole pickled module
	Safetensors *safetensors.File // a .safetensors file
	ONNX        *onnx.Model       // an ONNX model, with its own graph

	// Provenance is the record a conversion by abnconvert wrote into the
	// file; nil when the file has none (an original, an older abnconvert's
	// output, or another tool's file).
	Provenance *Provenance
	// ProvenanceError says why a record the file holds could not be read.
	ProvenanceError error
}

// Options say how the structure is built.
type Options struct {
	// Arch is "auto" (or "") to recognise the architecture, or a name.
	Arch string
	// Graph is an ONNX export giving a state dict's structure (--graph).
	Graph string
}

// Open opens path: a .safetensors file, an ONNX model, a .pth state dict,
// or a whole pickled module (which pth.Open refuses; the refusal's globals
// say which). Each call gives a fresh view of the weights.
func Open(path string) (*Model, error) {
	if IsONNX(path) {
		return OpenONNX(path, onnx.ReadOptions{})
	}
	md, err := openState(path)
	if err != nil {
		return nil, err
	}
	md.readProvenance()
	return md, nil
}

// OpenONNX opens an ONNX model with the reader's options (verify reads a
// converted model folded for inference, which a conversion refuses).
func OpenONNX(path string, ro onnx.ReadOptions) (*Model, error) {
	m, err := onnx.ReadWith(path, ro)
	if err != nil {
		return nil, err
	}
	md := &Model{Path: path, Format: fmt.Sprintf("onnx (opset %d)", m.Opset), Weights: m.Weights, ONNX: m}
	md.readProvenance()
	return md, nil
}

func openState(path string) (*Model, error) {
	if IsSafetensors(path) {
		f, err := safetensors.Open(path)
		if err != nil {
			return nil, err
		}
		return &Model{Path: path, Format: "safetensors", Weights: f, Safetensors: f}, nil
	}
	ck, err := pth.Open(path)
	var re *pth.RefusedError
	if errors.As(err, &re) && pth.LooksLikeModule(re.Globals) {
		ck, m, err := pth.OpenModule(path)
		if err != nil {
			return nil, err
		}
		return &Model{Path: path, Format: fmt.Sprintf("%s (whole pickled module %s)", ck.Format, m.Class), Weights: ck, Checkpoint: ck, Module: m}, nil
	}
	if err != nil {
		return nil, err
	}
	if ck.StateDict() == nil {
		ck.Close()
		return nil, fmt.Errorf("%s: no state dict found in the checkpoint", path)
	}
	return &Model{Path: path, Format: string(ck.Format), Weights: ck, Checkpoint: ck}, nil
}

// Close releases the input file.
func (m *Model) Close() {
	if m.Checkpoint != nil {
		m.Checkpoint.Close()
	}
	if m.Safetensors != nil {
		m.Safetensors.Close()
	}
}

// StatePath is the chain of keys from the checkpoint's root to its state
// dict (empty for a top-level state dict, safetensors and ONNX).
func (m *Model) StatePath() []string {
	if m.Checkpoint != nil && m.Checkpoint.StatePath != nil {
		return m.Checkpoint.StatePath
	}
	return []string{}
}

// Prefix is the key prefix common to the state dict's keys ("module.").
func (m *Model) Prefix() string {
	if m.Checkpoint != nil {
		return m.Checkpoint.Prefix
	}
	return pth.CommonPrefix(m.Weights.Keys())
}

// TorchDType is a tensor's torch element type ("" for ONNX, and for a
// safetensors dtype torch 1.13 lacks).
func (m *Model) TorchDType(key string) pth.DType {
	switch {
	case m.Safetensors != nil:
		return m.Safetensors.DType(key).Torch()
	case m.Checkpoint != nil:
		return pth.DType(m.Checkpoint.DType(key))
	}
	return ""
}

// OtherEntries lists what a checkpoint holds besides its state dict's
// tensors: entries of the dicts the state dict is nested in, and non-tensor
// entries of the state dict itself (nil for other formats).
func (m *Model) OtherEntries() []string {
	if m.Checkpoint == nil {
		return nil
	}
	ck := m.Checkpoint
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

// Structure builds the graph: from the --graph ONNX file, from a whole
// module's tree, by recognising the state dict's layout, or, for an ONNX
// model, the model's own graph (the same graph on every call: read the
// file again for another).
func (m *Model) Structure(opt Options) (*graph.Graph, *arch.Match, error) {
	if opt.Arch == "" {
		opt.Arch = "auto"
	}
	switch {
	case m.ONNX != nil:
		return m.ONNX.Graph, &arch.Match{Arch: m.ONNX.Graph.Arch, Family: "onnx", Exact: true}, nil
	case opt.Graph != "":
		return graphFromONNX(opt.Graph, m.Weights)
	case m.Module != nil:
		return moduleGraph(m.Module, m.Weights, opt.Arch)
	}
	return arch.Recognize(m.Weights, opt.Arch)
}

// Network is an input opened with its structure: what verify and memory
// run.
type Network struct {
	*Model
	Graph *graph.Graph
	Match *arch.Match
}

// OpenNetwork opens path and builds its graph (opt as for Structure). Each
// call gives a fresh view of the weights: changes through SetValues stay in
// memory and in that view.
func OpenNetwork(path string, opt Options) (*Network, error) {
	m, err := Open(path)
	if err != nil {
		return nil, err
	}
	g, match, err := m.Structure(opt)
	if err != nil {
		m.Close()
		return nil, wrapPath(path, err)
	}
	return &Network{Model: m, Graph: g, Match: match}, nil
}

// Rebuild builds the network's graph again over the same weights: a fresh
// graph for passes that mark or rewrite it.
func (n *Network) Rebuild(opt Options) (*graph.Graph, *arch.Match, error) {
	if n.ONNX == nil {
		return n.Structure(opt)
	}
	// ONNX: the file is the structure; its parameter keys are the same on
	// every read, so the graph indexes n.Weights too.
	m, err := onnx.Read(n.Path)
	if err != nil {
		return nil, nil, err
	}
	// The graph is for running (memory measures it; nothing writes it):
	// torch's zero Pads before AveragePool go.
	m.DropZeroPads()
	if _, err := m.LowerLayout(); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", n.Path, err)
	}
	return m.Graph, n.Match, nil
}

// wrapPath prefixes an error with the file it concerns, once.
func wrapPath(path string, err error) error {
	if err == nil {
		return nil
	}
	if strings.HasPrefix(err.Error(), path) {
		return err
	}
	return fmt.Errorf("%s: %w", path, err)
}

func summarize(s []string, n int) string {
	if len(s) <= n {
		return strings.Join(s, ", ")
	}
	return strings.Join(s[:n], ", ") + fmt.Sprintf(" and %d more", len(s)-n)
}
