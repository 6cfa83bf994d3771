package pth

import (
	"slices"
	"sort"
)

// A state dict may hold one storage under several keys: tied weights
// saved with state_dict(keep_vars=True) or sd["b"] = sd["a"] (one tensor
// object, pickled once and referenced again), tied weights saved with
// state_dict() (one detached tensor per key over one storage), or views of
// one storage at overlapping bytes. torch.load gives them back sharing
// their storage, and load_state_dict copies each key into its own module.
//
// A conversion changes keys one at a time. So that a change made through
// one key never reaches another, each key is given a tensor object of its
// own when the state dict is found (separate), which then views a storage
// that another tensor views too: such a tensor is negated by decoding
// (lazyNegatable needs a sole user), and the writer's plan gives a changed
// one a record of its own, leaving the others the input's record. An alias
// that the conversion does not change is written as it was read: the
// pickler writes a copy placed where its twin is as a reference to the
// twin, as the input did.

// Alias is a group of state-dict keys whose tensors view overlapping bytes
// of one storage record, directly or through another key of the group.
type Alias struct {
	// Keys are the group's keys in file order.
	Keys []string `json:"keys"`
	// Storage is the storage record's key (archive/data/<Storage>).
	Storage string `json:"storage"`
	// SameObject: every key holds the one tensor object (one pickled
	// tensor referenced again), rather than views of its storage.
	SameObject bool `json:"same_object"`
}

// Aliases lists the state dict's alias groups (Carried keys included), in
// the file order of their first keys; nil when there are none. Two views
// overlap where the element ranges their offsets, shapes and strides
// reach overlap (an interleaved pair, a tensor's even and odd columns,
// counts too: what it claims is that the keys may share bytes).
func (c *Checkpoint) Aliases() []Alias {
	if c.state == nil {
		return nil
	}
	// Most checkpoints have no storage under two tensors: the count the
	// conversion made already (negating in place needs it) says so
	// without a map per storage.
	users, shared := c.storageUsers(), false
	for _, v := range c.state.vals {
		if t, ok := v.(*Tensor); ok && users[t.Storage] > 1 {
			shared = true
			break
		}
	}
	if !shared {
		return nil
	}
	type view struct {
		key    string
		t      *Tensor
		lo, hi int
		order  int
	}
	byStorage := map[*Storage][]view{}
	var stores []*Storage
	for i, k := range c.state.keys {
		s, ok := k.(string)
		t, isT := c.state.vals[i].(*Tensor)
		if !ok || !isT || t.Storage == nil {
			continue
		}
		lo, hi := t.span()
		if hi <= lo { // no element: nothing shared
			continue
		}
		if byStorage[t.Storage] == nil {
			stores = append(stores, t.Storage)
		}
		byStorage[t.Storage] = append(byStorage[t.Storage], view{s, t, lo, hi, i})
	}
	type group struct {
		a     Alias
		first int // the file position of its first key
	}
	var groups []group
	for _, st := range stores {
		vs := byStorage[st]
		if len(vs) < 2 {
			continue
		}
		// Overlapping ranges chain into groups: sorted by start, a view
		// joins the group under way while it starts before the group's end.
		sort.SliceStable(vs, func(i, j int) bool { return vs[i].lo < vs[j].lo })
		for i := 0; i < len(vs); {
			j, end := i+1, vs[i].hi
			for j < len(vs) && vs[j].lo < end {
				end = max(end, vs[j].hi)
				j++
			}
			if j-i >= 2 {
				g := slices.Clone(vs[i:j])
				sort.Slice(g, func(a, b int) bool { return g[a].order < g[b].order })
				a := Alias{Storage: st.Key, SameObject: true}
				for _, v := range g {
					a.Keys = append(a.Keys, v.key)
					a.SameObject = a.SameObject && v.t.object() == g[0].t.object()
				}
				groups = append(groups, group{a, g[0].order})
			}
			i = j
		}
	}
	sort.Slice(groups, func(i, j int) bool { return groups[i].first < groups[j].first })
	var out []Alias
	for _, g := range groups {
		out = append(out, g.a)
	}
	return out
}

// object is the tensor object t was read as: its twin where separate made
// t, else t.
func (t *Tensor) object() *Tensor {
	if t.twin != nil {
		return t.twin
	}
	return t
}

// separate gives each key of the state dict d that holds a tensor object
// already held under an earlier key a shallow copy of its own (same
// storage, offset, shape and strides), whose twin is that object; done as
// the state dict is found, before a copy of the records starts beside the
// conversion (Prewrite) and its pickler walks the tree.
func separate(d *Dict) {
	// Marked and unmarked again rather than kept in a map: every
	// checkpoint is searched, and a tensor under two keys is rare.
	for i, v := range d.vals {
		t, ok := v.(*Tensor)
		if !ok {
			continue
		}
		if !t.keyed {
			t.keyed = true
			continue
		}
		cp := *t
		cp.Shape, cp.Stride = slices.Clone(t.Shape), slices.Clone(t.Stride)
		cp.twin, cp.keyed = t, false
		d.vals[i] = &cp
	}
	for _, v := range d.vals {
		if t, ok := v.(*Tensor); ok {
			t.keyed = false
		}
	}
}
