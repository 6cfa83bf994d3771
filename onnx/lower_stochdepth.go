package onnx

import (
	"math"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// randomOps are ONNX's random ops: a node of one left opaque says why.
var randomOps = map[string]bool{
	"RandomUniformLike": true, "RandomUniform": true, "RandomNormalLike": true, "RandomNormal": true,
	"Bernoulli": true, "Multinomial": true,
}

// stochasticDepth recognises torchvision.ops.stochastic_depth as a
// train-mode PRESERVE export traces it (torch 2.x's own symbolic for
// bernoulli_, and torch 1.13 with that symbolic registered, see
// fixtures/stochdepth.py), ending in the Mul n:
//
//	noise = ConstantOfShape(size, 0) or a constant of that shape
//	noise = Cast(Less(RandomUniformLike(noise, low 0, high 1), s), float)
//	noise = Div(noise, s)              (absent when s is 0: p = 1)
//	y     = Mul(x, noise)
//
// where s = 1 - p, and size is (x.shape[0], 1, ..., 1) in row mode, all
// ones in batch mode, with x's rank (an export without a dynamic batch
// axis writes row mode at batch 1 as batch mode: the same graph, frozen at
// that batch like the export's other shapes). It becomes one OpStochasticDepth(x),
// and the noise nodes leave the graph. It reports whether n matched; a
// RandomUniformLike that does not fit stays opaque, and the runtime and
// emitter refuse it by name (a random op abnconvert cannot reproduce).
func (l *lowering) stochasticDepth(n *graph.Node, p *pb.NodeProto) bool {
	if p.GetOpType() != "Mul" || len(p.Input) != 2 || len(p.Attribute) != 0 || len(n.Inputs) != 2 {
		return false
	}
	for k := 0; k < 2; k++ {
		x := l.byName[p.Input[k]]
		if x == nil || l.sym[x] != nil {
			continue
		}
		if attr, chain, ok := l.noise(p.Input[1-k], x); ok {
			l.replace(n, graph.OpStochasticDepth, attr, nil, x)
			for _, c := range chain {
				l.dead[c] = true
			}
			return true
		}
	}
	return false
}

// noise matches the noise value named name for x; it returns the node's
// attributes and the IR nodes that compute the noise.
func (l *lowering) noise(name string, x *graph.Value) (graph.Attr, []*graph.Node, bool) {
	var chain []*graph.Node
	// step is the one ONNX node producing value, read by nothing else (in
	// the IR, where it stands as an opaque node).
	step := func(value, op string) *pb.NodeProto {
		info := l.m.producer[value]
		v := l.byName[value]
		if info == nil || info.ir == nil || v == nil || v.Producer != info.ir || info.proto.GetOpType() != op ||
			len(info.proto.Output) != 1 || len(v.Consumers) != 1 || l.g.IsOutput(v) {
			return nil
		}
		if d := info.proto.GetDomain(); d != "" && d != "ai.onnx" {
			return nil
		}
		chain = append(chain, info.ir)
		return info.proto
	}
	fail := func() (graph.Attr, []*graph.Node, bool) { return graph.Attr{}, nil, false }

	var div, cast *pb.NodeProto
	if div = step(name, "Div"); div != nil {
		if len(div.Input) != 2 || len(div.Attribute) != 0 {
			return fail()
		}
		name = div.Input[0]
	}
	if cast = step(name, "Cast"); cast == nil || len(cast.Input) != 1 || nodeAttrs(cast).int("to", 0) != int64(pb.TensorProto_FLOAT) {
		return fail()
	}
	less := step(cast.Input[0], "Less")
	if less == nil || len(less.Input) != 2 {
		return fail()
	}
	s, ok := l.scalar(less.Input[1])
	if !ok || !(s >= 0 && s <= 1) {
		return fail()
	}
	if div != nil {
		// torchvision divides by the same survival rate it drew with.
		if d, ok := l.scalar(div.Input[1]); !ok || d != s || s == 0 {
			return fail()
		}
	} else if s != 0 {
		return fail()
	}
	rnd := step(less.Input[0], "RandomUniformLike")
	if rnd == nil || len(rnd.Input) != 1 {
		return fail()
	}
	ra := nodeAttrs(rnd)
	if !ra.only("low", "high", "dtype", "seed") || ra.float("low", 0) != 0 || ra.float("high", 1) != 1 ||
		ra.int("dtype", int64(pb.TensorProto_FLOAT)) != int64(pb.TensorProto_FLOAT) {
		return fail()
	}
	rank := graph.Ranks(l.g, l.inRank)[x]
	mode, ok := l.noiseShape(rnd.Input[0], x, rank, step)
	if !ok {
		return fail()
	}
	return graph.Attr{P: oneMinus32(float32(s)), Mode: mode}, chain, true
}

// noiseShape reads the shape of the tensor RandomUniformLike draws like:
// (x.shape[0], 1, ..., 1) is row mode, all ones batch mode, both of x's
// rank. The tensor is a constant (torch folds a constant shape) or a
// ConstantOfShape of a shape computed from x.
func (l *lowering) noiseShape(name string, x *graph.Value, rank int, step func(string, string) *pb.NodeProto) (string, bool) {
	if rank == 0 {
		return "", false
	}
	ones := func(shape []int) bool {
		for _, d := range shape {
			if d != 1 {
				return false
			}
		}
		return len(shape) == rank
	}
	if src, ok := l.m.params[name]; ok {
		return graph.StochasticBatch, ones(src.td.shape)
	}
	v := l.byName[name]
	if v == nil {
		return "", false
	}
	if t := l.sym[v]; t != nil {
		// A ConstantOfShape of a constant shape, evaluated.
		return graph.StochasticBatch, ones(t.shape)
	}
	cs := step(name, "ConstantOfShape")
	if cs == nil || len(cs.Input) != 1 {
		return "", false
	}
	sv := l.byName[cs.Input[0]]
	if sv == nil || l.sym[sv] == nil {
		return "", false
	}
	dims := l.sym[sv].v
	if len(dims) != rank {
		return "", false
	}
	for _, e := range dims[1:] {
		if !e.isConst() || e.c != 1 {
			return "", false
		}
	}
	switch e := dims[0]; {
	case e.op == 'd' && e.axis == 0 && (e.v == x || l.m.valueName[e.v] == l.m.valueName[x]):
		return "", true
	case e.isConst() && e.c == 1:
		return graph.StochasticBatch, true
	}
	return "", false
}

// scalar is the value of a one-element constant input.
func (l *lowering) scalar(name string) (float64, bool) {
	src, ok := l.m.params[name]
	if !ok || src.td.numel != 1 || src.td.ext != nil {
		return 0, false
	}
	v, err := src.td.values()
	if err != nil || len(v) != 1 || math.IsNaN(v[0]) {
		return 0, false
	}
	return v[0], true
}
