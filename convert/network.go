package convert

import (
	"fmt"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx"
)

// Network is an input opened with its structure, from any source a
// conversion reads as a state dict: a .pth state dict, a whole pickled
// module, or a .safetensors file, with the structure recognised, taken from
// the module tree, or read from opt.Graph. verify and memory run it.
type Network struct {
	Graph   *graph.Graph
	Weights graph.Weights
	Match   *arch.Match
	Format  string
	src     *source // nil for ONNX
	path    string  // the ONNX file, re-read by Rebuild
}

// OpenNetwork opens path and builds its graph (opt.Arch and opt.Graph as
// for a conversion). Each call gives a fresh view of the weights: changes
// through SetValues stay in memory and in that view.
func OpenNetwork(path string, opt Options) (*Network, error) {
	if opt.Arch == "" {
		opt.Arch = "auto"
	}
	if isONNX(path) {
		m, err := onnx.Read(path)
		if err != nil {
			return nil, err
		}
		return &Network{Graph: m.Graph, Weights: m.Weights, Match: &arch.Match{Arch: m.Graph.Arch, Family: "onnx", Exact: true},
			Format: fmt.Sprintf("onnx (opset %d)", m.Opset), path: path}, nil
	}
	s, err := openSource(path)
	if err != nil {
		return nil, err
	}
	g, m, err := structure(s, opt)
	if err != nil {
		s.close()
		return nil, wrapPath(path, err)
	}
	return &Network{Graph: g, Weights: s.w, Match: m, Format: s.format, src: s}, nil
}

// OpenWeights opens the state dict of path, in any format OpenNetwork
// reads, without building a graph: a converted file's weights.
func OpenWeights(path string) (graph.Weights, func(), error) {
	s, err := openSource(path)
	if err != nil {
		return nil, nil, err
	}
	return s.w, s.close, nil
}

// Close releases the input file.
func (n *Network) Close() {
	if n.src != nil {
		n.src.close()
	}
}

// wrapPath prefixes an error with the file it concerns, once.
func wrapPath(path string, err error) error {
	if err == nil {
		return nil
	}
	if len(err.Error()) >= len(path) && err.Error()[:len(path)] == path {
		return err
	}
	return fmt.Errorf("%s: %w", path, err)
}

// Rebuild builds the network's graph again over the same weights: a fresh
// graph for passes that mark or rewrite it.
func (n *Network) Rebuild(opt Options) (*graph.Graph, *arch.Match, error) {
	if opt.Arch == "" {
		opt.Arch = "auto"
	}
	if n.src == nil {
		// ONNX: the file is the structure; its parameter keys are the
		// same on every read, so the graph indexes n.Weights too.
		m, err := onnx.Read(n.path)
		if err != nil {
			return nil, nil, err
		}
		// The graph is for running (memory measures it; nothing writes
		// it): torch's zero Pads before AveragePool go.
		m.DropZeroPads()
		return m.Graph, n.Match, nil
	}
	return structure(n.src, opt)
}
