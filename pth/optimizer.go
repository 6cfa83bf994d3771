package pth

import (
	"fmt"
	"sort"
	"strings"
)

// Optimizer buffers by how a conversion affects them.
var (
	// firstMoments are running averages of the gradient: they change sign
	// with the parameter.
	firstMoments = map[string]bool{"momentum_buffer": true, "exp_avg": true}
	// unaffected holds second moments (averages of the squared gradient,
	// blind to sign) and step counters.
	unaffected = map[string]bool{"exp_avg_sq": true, "max_exp_avg_sq": true, "square_avg": true, "step": true}
)

// isBuffer tells the state-dict entries that are not parameters, so that
// the optimizer's parameter numbering can be matched to state-dict keys.
func isBuffer(key string) bool {
	for _, s := range []string{"running_mean", "running_var", "num_batches_tracked"} {
		if key == s || strings.HasSuffix(key, "."+s) {
			return true
		}
	}
	return false
}

// TransformOptimizer keeps the optimizer state stored in the checkpoint
// (any dict with "state" and "param_groups") valid for the converted
// parameters.
//
// The rule. Optimizer parameter ids number the parameters of param_groups
// in order; they are matched, in that order, to the state-dict entries that
// are parameters (not running_mean, running_var or num_batches_tracked).
// When the counts differ, or a buffer's shape differs from its parameter's,
// the mapping cannot be trusted and the optimizer's whole state is dropped,
// with a warning. Otherwise, for each parameter that the conversion changed
// (a key of flips, or of changed):
//   - first moments (momentum_buffer, exp_avg) are negated along dim 0 at
//     the indices flips[key] lists: the conversion negated those channels,
//     which negates their gradients, and a first moment is a running
//     average of gradients. Channels not in flips keep theirs: for a BN
//     weight rewritten as |gamma| - eps the gradient of the other channels
//     is unchanged;
//   - second moments (exp_avg_sq, max_exp_avg_sq, square_avg) and step are
//     left alone: squares do not see the sign;
//   - any other buffer (Adagrad's sum, RMSprop's grad_avg...) has no known
//     rule, so that parameter's state is dropped, with a warning, and the
//     optimizer restarts it from zero.
//
// Parameters the conversion left alone keep their state untouched.
func (c *Checkpoint) TransformOptimizer(flips map[string][]int, changed map[string]bool) (warnings []string, err error) {
	var params []string
	for _, k := range c.keys {
		if !isBuffer(k) {
			params = append(params, k)
		}
	}
	touched := map[string]bool{}
	for k := range flips {
		touched[k] = true
	}
	for k, v := range changed {
		if v {
			touched[k] = true
		}
	}
	for _, opt := range findOptimizers(c.Root, nil, map[*Dict]bool{}) {
		w, err := c.transformOne(opt.d, opt.path, params, touched, flips)
		warnings = append(warnings, w...)
		if err != nil {
			return warnings, err
		}
	}
	return warnings, nil
}

type foundOptimizer struct {
	d    *Dict
	path string
}

func findOptimizers(v Value, path []string, seen map[*Dict]bool) []foundOptimizer {
	d, ok := v.(*Dict)
	if !ok || seen[d] {
		return nil
	}
	seen[d] = true
	if isOptimizer(d) {
		return []foundOptimizer{{d, strings.Join(path, ".")}}
	}
	var out []foundOptimizer
	for i, k := range d.keys {
		out = append(out, findOptimizers(d.vals[i], append(append([]string{}, path...), keyString(k)), seen)...)
	}
	return out
}

func (c *Checkpoint) transformOne(opt *Dict, where string, params []string, touched map[string]bool, flips map[string][]int) ([]string, error) {
	if where == "" {
		where = "(top level)"
	}
	stateV, _ := opt.Get("state")
	groupsV, _ := opt.Get("param_groups")
	state, ok1 := stateV.(*Dict)
	groups, ok2 := groupsV.(*List)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("%s: optimizer %s: state or param_groups has an unexpected type", c.Path, where)
	}
	// Optimizer id -> position in the concatenated param_groups lists.
	pos := map[int64]int{}
	n := 0
	for _, g := range groups.Items {
		gd, ok := g.(*Dict)
		if !ok {
			return nil, fmt.Errorf("%s: optimizer %s: a param group is a %s, not a dict", c.Path, where, typeName(g))
		}
		pv, _ := gd.Get("params")
		pl, ok := pv.(*List)
		if !ok {
			return nil, fmt.Errorf("%s: optimizer %s: a param group has no params list", c.Path, where)
		}
		for _, id := range pl.Items {
			i, ok := id.(int64)
			if !ok {
				return nil, fmt.Errorf("%s: optimizer %s: parameter id %v is not an int", c.Path, where, id)
			}
			pos[i] = n
			n++
		}
	}
	drop := func(why string) []string {
		count := state.Len()
		opt.Set("state", NewDict(state.Ordered))
		return []string{fmt.Sprintf("optimizer %s: %s; dropped its state for all %d parameters", where, why, count)}
	}
	if n != len(params) {
		return drop(fmt.Sprintf("it has %d parameters, the state dict %d", n, len(params))), nil
	}
	// Check every buffer's shape before changing anything.
	type entry struct {
		id  Value
		key string
		buf *Dict
	}
	var entries []entry
	for i, id := range state.keys {
		idn, ok := id.(int64)
		p, ok2 := pos[idn]
		if !ok || !ok2 {
			return drop(fmt.Sprintf("state entry %v is not a parameter id of its param_groups", id)), nil
		}
		key := params[p]
		buf, ok := state.vals[i].(*Dict)
		if !ok {
			return drop(fmt.Sprintf("state of %s is a %s, not a dict", key, typeName(state.vals[i]))), nil
		}
		t, _ := c.Tensor(key)
		for j, name := range buf.keys {
			bt, ok := buf.vals[j].(*Tensor)
			if !ok || name == "step" {
				continue
			}
			if !sameShape(bt.Shape, t.Shape) {
				return drop(fmt.Sprintf("buffer %v of parameter %d has shape %v, but %s has shape %v", name, idn, bt.Shape, key, t.Shape)), nil
			}
		}
		entries = append(entries, entry{id, key, buf})
	}
	var warnings []string
	for _, e := range entries {
		if !touched[e.key] {
			continue
		}
		var other []string
		for _, name := range e.buf.keys {
			s, _ := name.(string)
			if !firstMoments[s] && !unaffected[s] {
				other = append(other, keyString(name))
			}
		}
		if len(other) > 0 {
			sort.Strings(other)
			state.Delete(e.id)
			warnings = append(warnings, fmt.Sprintf("optimizer %s: dropped the state of %s: no rule for its buffers %s", where, e.key, strings.Join(other, ", ")))
			continue
		}
		if len(flips[e.key]) == 0 {
			continue
		}
		for j, name := range e.buf.keys {
			bt, ok := e.buf.vals[j].(*Tensor)
			s, _ := name.(string)
			if !ok || !firstMoments[s] {
				continue // a None momentum buffer has nothing to flip
			}
			if err := c.negateChannels(bt, flips[e.key]); err != nil {
				return warnings, fmt.Errorf("%s: optimizer %s: %s of %s: %w", c.Path, where, name, e.key, err)
			}
		}
	}
	return warnings, nil
}

func sameShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
