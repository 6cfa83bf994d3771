package onnx

import "github.com/abnconvert/abnconvert/graph"

// DropZeroPads removes from the IR every Pad of zeros in constant mode, the
// identity torch exports before each AveragePool with count_include_pad
// (DenseNet's transitions), so that the runtime can run the graph; it
// returns how many it removed. It is for running only: a model whose Pads
// were dropped refuses to be written, since its file still has them.
func (m *Model) DropZeroPads() int {
	dropped := 0
	for _, n := range append([]*graph.Node(nil), m.Graph.Nodes...) {
		info := m.byIR[n]
		if info == nil || n.Op != graph.Op(OpaquePrefix+"Pad") || len(n.Inputs) != 1 {
			continue
		}
		p := info.proto
		in := p.GetInput()
		if len(in) < 2 || in[1] == "" || (len(in) > 2 && in[2] != "") {
			continue // no pads, or a fill value: not obviously the identity
		}
		constant := true
		for _, a := range p.GetAttribute() {
			if a.GetName() == "mode" && string(a.GetS()) != "constant" {
				constant = false
			}
		}
		if !constant {
			continue
		}
		pads, err := m.Weights.Values(in[1])
		if err != nil {
			continue
		}
		zero := true
		for _, v := range pads {
			zero = zero && v == 0
		}
		if !zero {
			continue
		}
		m.Graph.ReplaceUses(n.Out, n.Inputs[0])
		m.Graph.Remove(n)
		dropped++
	}
	if dropped > 0 {
		m.lowered = true
	}
	return dropped
}
