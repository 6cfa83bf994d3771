package model

import (
	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/pth"
)

// moduleGraph builds the graph of a whole pickled module: package arch
// rebuilds its forward from the module tree.
func moduleGraph(m *pth.Module, w graph.Weights, force string) (*graph.Graph, *arch.Match, error) {
	return arch.FromModule(m, w, force)
}
