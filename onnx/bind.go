package onnx

import (
	"bytes"
	"fmt"
	"sort"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// bindParams decides where each parameter slot of each written node reads
// its data from (see Write's doc for the rules).
func (w *writer) bindParams() error {
	// Standard ops: the in-place ops' BN scale is |weight| + eps.
	if w.opt.StandardOps {
		for _, n := range w.g.Nodes {
			if !w.abnFromBN(n) || !inPlaceOp(n.Op) || w.fold[n] != nil {
				continue
			}
			v, err := w.m.Weights.Values(n.Params[graph.RoleWeight])
			if err != nil {
				return fmt.Errorf("node %s: %w", n.Name, err)
			}
			w.derived[slotRef{w.m.byIR[n].index, 1}] = w.gamma(n, v)
		}
	}
	// Group the written slots by the key they read; derived slots are each
	// their own group.
	type group struct {
		p     *param
		slots []slotRef
		data  []float64
		// raw holds the key's bytes with its sign flips applied when its
		// only change is a negation (NegateChannels): nothing decoded.
		raw []byte
		// external: a negation of a tensor held in external data, whose
		// bytes are made only when written (w.external).
		external bool
	}
	// newGroup groups a changed key's slots, with its new contents.
	newGroup := func(p *param, slots []slotRef) (*group, error) {
		if p.set == nil && len(p.negate) > 0 && p.src.td.ext != nil {
			return &group{p: p, external: true, slots: slots}, nil
		}
		if p.set == nil && p.negate != nil {
			raw, err := p.negatedRaw()
			if err != nil {
				return nil, fmt.Errorf("tensor %q: %w", p.key, err)
			}
			return &group{p: p, raw: raw, slots: slots}, nil
		}
		return &group{p: p, data: p.set, slots: slots}, nil
	}
	var groups []*group
	byKey := map[string]*group{}
	for _, n := range w.g.Nodes {
		info := w.m.byIR[n]
		if info == nil || info.ir != n || info.kind != kindModelled || w.fold[n] != nil {
			continue
		}
		roles := make([]string, 0, len(info.params))
		for role := range info.params {
			roles = append(roles, role)
		}
		sort.Strings(roles)
		for _, role := range roles {
			k := info.params[role]
			s := slotRef{info.index, k}
			p := w.m.Weights.byKey[n.Params[role]]
			if d, ok := w.derived[s]; ok {
				groups = append(groups, &group{p: p, slots: []slotRef{s}, data: d})
				continue
			}
			if p.value != info.proto.Input[k] {
				// The rewrite pointed the slot at another key: bind it to
				// that key's data through a new initializer.
				d, err := w.m.Weights.Values(p.key)
				if err != nil {
					return err
				}
				groups = append(groups, &group{p: p, slots: []slotRef{s}, data: d})
				continue
			}
			if !p.changed() {
				continue
			}
			g := byKey[p.key]
			if g == nil {
				var err error
				if g, err = newGroup(p, nil); err != nil {
					return err
				}
				byKey[p.key] = g
				groups = append(groups, g)
			}
			g.slots = append(g.slots, s)
		}
	}
	// Folded convolutions: their derived slots, the bias possibly new.
	// In node order: a map's order would change the names and the order of
	// new initializers from run to run.
	folded := make([]*graph.Node, 0, len(w.fold))
	for _, c := range w.fold {
		folded = append(folded, c)
	}
	sort.Slice(folded, func(i, j int) bool { return w.m.byIR[folded[i]].index < w.m.byIR[folded[j]].index })
	for _, c := range folded {
		ci := w.m.byIR[c]
		wp := w.m.Weights.byKey[c.Params[graph.RoleWeight]]
		groups = append(groups, &group{p: wp, slots: []slotRef{{ci.index, 1}}, data: w.derived[slotRef{ci.index, 1}]})
		if k := c.Params[graph.RoleBias]; k != "" {
			groups = append(groups, &group{p: w.m.Weights.byKey[k], slots: []slotRef{{ci.index, 2}}, data: w.derived[slotRef{ci.index, 2}]})
		} else {
			t, err := encodeTensor(&pb.TensorProto{DataType: wp.src.td.t.DataType, Dims: []int64{int64(c.Attr.OutChannels)}, RawData: []byte{}}, w.derived[slotRef{ci.index, 2}])
			if err != nil {
				return fmt.Errorf("node %s: bias: %w", c.Name, err)
			}
			t.Name = strp(w.fresh(ci.proto.GetName() + ".bias_folded"))
			w.newInits = append(w.newInits, t)
			w.repoint[slotRef{ci.index, 2}] = t.GetName()
		}
	}
	sort.SliceStable(groups, func(i, j int) bool { return groups[i].slots[0].node < groups[j].slots[0].node })
	readers := w.readers()
	// Keys no written node owns but whose values were set: rewritten where
	// they are.
	for _, key := range w.m.Weights.order {
		p := w.m.Weights.byKey[key]
		if !p.changed() || len(p.owners) > 0 || p.split {
			continue
		}
		g, err := newGroup(p, readers[p.value])
		if err != nil {
			return err
		}
		groups = append(groups, g)
	}
	for _, g := range groups {
		var enc *pb.TensorProto
		var err error
		same := false
		switch {
		case g.external:
			// A sign flip changes the bytes of every element it touches
			// (zeros become negative zeros): never the same.
			enc = shallowTensor(g.p.src.td.t)
			w.external[enc] = g.p
		case g.raw != nil:
			enc = rawTensor(g.p.src.td.t, g.raw)
		default:
			if enc, err = encodeTensor(g.p.src.td.t, g.data); err != nil {
				return fmt.Errorf("tensor %q: %w", g.p.key, err)
			}
		}
		if !g.external {
			orig, err := rawOf(g.p.src.td)
			if err != nil {
				return fmt.Errorf("tensor %q: %w", g.p.key, err)
			}
			same = bytes.Equal(orig, rawOfTensor(enc))
		}
		bound := true
		for _, s := range g.slots {
			if s.input >= 0 && w.m.infos[s.node].proto.Input[s.input] != g.p.value {
				bound = false
			}
		}
		if same && bound {
			continue
		}
		v := g.p.value
		exclusive := bound && !g.p.split && !w.outputs[v]
		if exclusive {
			for _, r := range readers[v] {
				if !containsSlot(g.slots, r) {
					exclusive = false
					break
				}
			}
		}
		enc.Name = strp(v)
		switch {
		case exclusive && g.p.src.node < 0:
			w.inPlace[v] = enc
		case exclusive:
			// Produced by an Identity or a Constant that only these slots
			// read: an initializer of the same name replaces that node.
			w.drop[g.p.src.node] = true
			w.newInits = append(w.newInits, enc)
		default:
			enc.Name = strp(w.fresh(v + "_abn"))
			w.newInits = append(w.newInits, enc)
			for _, s := range g.slots {
				w.repoint[s] = enc.GetName()
			}
		}
	}
	return nil
}

func containsSlot(list []slotRef, s slotRef) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// readers lists, for every value name, the node inputs that will read it
// in the output (subgraph references as input -1), given the nodes the
// writer drops so far: BNs folded away.
func (w *writer) readers() map[string][]slotRef {
	folded := map[int]bool{}
	for n := range w.fold {
		folded[w.m.byIR[n].index] = true
	}
	r := map[string][]slotRef{}
	for i, n := range w.m.proto.Graph.Node {
		if folded[i] {
			continue
		}
		for k, in := range n.Input {
			if in != "" {
				r[in] = append(r[in], slotRef{i, k})
			}
		}
		for _, ref := range outerRefs(n) {
			r[ref] = append(r[ref], slotRef{i, -1})
		}
	}
	return r
}

// rawOf is a tensor's elements as little-endian bytes, whatever field holds
// them.
func rawOf(td *tensorData) ([]byte, error) {
	if td.ext != nil || td.t.RawData != nil {
		return td.rawBytes()
	}
	v, err := td.values()
	if err != nil {
		return nil, err
	}
	return rawOfValues(td.t.GetDataType(), v), nil
}

func rawOfTensor(t *pb.TensorProto) []byte {
	if t.RawData != nil {
		return t.RawData
	}
	n, _ := storedCount(t, t.GetDataType())
	v, _ := (&tensorData{t: t, numel: n}).values()
	return rawOfValues(t.GetDataType(), v)
}

func rawOfValues(dt int32, v []float64) []byte {
	size := elemSize(dt)
	b := make([]byte, len(v)*size)
	for i, x := range v {
		encodeRaw(dt, b[i*size:], x)
	}
	return b
}

func uniqueNodes(list []*graph.Node) []*graph.Node {
	var out []*graph.Node
	seen := map[*graph.Node]bool{}
	for _, n := range list {
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out
}
