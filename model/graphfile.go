package model

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/onnx"
)

// graphFromONNX takes a network's structure from its ONNX export and its
// parameters from the state dict w: --graph model.onnx, for architectures no
// recogniser knows. The export must keep BatchNormalization nodes
// (training=torch.onnx.TrainingMode.PRESERVE; onnx.Read refuses an
// eval-mode export and says how to re-export), and torch names initializers
// after the parameters they export ("layer1.0.bn1.weight"), which is what
// ties each node to its module: onnx.ModulePath. Every parameter the graph
// reads must be in the state dict with the same shape, and every tensor of
// the state dict must be read by the graph (num_batches_tracked aside,
// which ONNX does not carry); the error lists each tensor that is missing,
// extra or wrongly shaped.
//
// The IR keeps the ONNX reader's graph, with node names and parameter keys
// turned into module paths and state-dict keys, so that the rewrite report,
// the emitted module and the written checkpoint all speak the state dict's
// names. Ops the IR does not model stay opaque: the conversion still runs
// around them, but the Python module cannot be emitted.
func graphFromONNX(path string, w graph.Weights) (*graph.Graph, *arch.Match, error) {
	m, err := onnx.Read(path)
	if err != nil {
		return nil, nil, err
	}
	if err := m.NoBatchNorm(); err != nil {
		var nobn *onnx.NoBatchNormError
		if errors.As(err, &nobn) && len(nobn.Frozen) == 0 {
			// Constant folding computed the frozen layers' scale and
			// shift into constants: the state dict still names them.
			nobn.Frozen = frozenInState(w)
		}
		return nil, nil, err
	}
	// Shape subgraphs and layout ops become IR ops whose shapes follow the
	// input (nothing writes this model back).
	if _, err := m.LowerLayout(); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	// An export without dynamic axes runs only at its own batch size: a
	// warning with the recipe (the shapes lowering evaluated show it).
	fixed := m.FixedShapeWarning()
	g := m.Graph
	stateKeys := w.Keys()
	inState := map[string]bool{}
	for _, k := range stateKeys {
		inState[k] = true
	}
	prefix := statePrefix(g, inState, stateKeys)

	var unnamed, missing, shapes []string
	var unnamedNodes []unnamedNode
	used := map[string]bool{}
	newParams := map[*graph.Node]map[string]string{}
	modPath := map[*graph.Node]string{}
	for _, n := range g.Nodes {
		if len(n.Params) == 0 {
			continue
		}
		mp := onnx.ModulePath(n)
		if mp == "" {
			var keys []string
			for _, k := range n.Params {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			name, _, _ := m.Source(n)
			unnamed = append(unnamed, fmt.Sprintf("%s (%s) reads %s", name, n.Op, strings.Join(keys, ", ")))
			unnamedNodes = append(unnamedNodes, unnamedNode{name: name, node: n, keys: keys})
			continue
		}
		mp = prefix + mp
		modPath[n] = mp
		params := map[string]string{}
		for role, ok := range n.Params {
			key := mp + "." + role
			params[role] = key
			if !inState[key] {
				missing = append(missing, key)
				continue
			}
			used[key] = true
			want, _ := m.Weights.Shape(ok)
			got, _ := w.Shape(key)
			if graph.Numel(want) != graph.Numel(got) || !sameDims(want, got) {
				shapes = append(shapes, fmt.Sprintf("%s %v (graph: %v)", key, got, want))
			}
		}
		if n.Op.IsBNFamily() {
			if k := mp + "." + graph.RoleNumBatches; inState[k] {
				params[graph.RoleNumBatches] = k
				used[k] = true
			}
		}
		newParams[n] = params
	}
	var extra []string
	for _, k := range stateKeys {
		if !used[k] {
			extra = append(extra, k)
		}
	}
	// A tensor of the state dict that the graph does read, but through ops
	// that tie it to no modelled layer, is not "not in the graph": name
	// the ops (exit 4, the input is valid), FrozenBatchNorm2d apart.
	shared, affine, affineMods, unnamed := classifyUnnamed(unnamedNodes, unnamed)
	extra = slices.DeleteFunc(extra, func(k string) bool {
		// An affine=False BN's statistics are its node's, refused above.
		i := strings.LastIndex(k, ".")
		return i > 0 && affineMods[k[:i]]
	})
	frozen, readBy, extra := readButUnbound(m, extra, prefix, inState)
	if len(unnamed)+len(missing)+len(shapes)+len(extra) == 0 && len(frozen)+len(readBy)+len(shared)+len(affine) > 0 {
		var parts []string
		if len(shared) > 0 {
			parts = append(parts, fmt.Sprintf("module(s) called more than once, which abnconvert does not support yet (one BatchNorm's running statistics updated by two calls cannot become one InPlace-ABN layer per call): %s; give each call its own module", strings.Join(shared, "; ")))
		}
		if len(affine) > 0 {
			parts = append(parts, fmt.Sprintf("BatchNorm2d(affine=False), which abnconvert does not support yet (no weight or bias in the state dict: the export holds constants instead): %s", strings.Join(affine, "; ")))
		}
		if len(frozen) > 0 {
			parts = append(parts, fmt.Sprintf("%d FrozenBatchNorm2d layer(s) (frozen: nothing to convert): %s; the other BatchNorms could be converted, but the arithmetic torch exports the frozen layers as is not modelled yet%s", len(frozen), summarize(frozen, 6), opaqueOps(m, frozen, prefix)))
		}
		if len(readBy) > 0 {
			parts = append(parts, fmt.Sprintf("tensors of %d module(s) of the state dict are read by ops abnconvert does not model, so no layer ties them to the state dict: %s", len(readBy), strings.Join(readBy, "; ")))
		}
		return nil, nil, failure.Unsupportedf("%s: %s", path, strings.Join(parts, "; "))
	}
	for _, r := range readBy {
		extra = append(extra, r)
	}
	for _, f := range frozen {
		extra = append(extra, f+" (FrozenBatchNorm2d: frozen, nothing to convert)")
	}
	unnamed = append(append(unnamed, shared...), affine...)
	if len(unnamed)+len(missing)+len(shapes)+len(extra) > 0 {
		sort.Strings(missing)
		sort.Strings(shapes)
		var parts []string
		if len(missing) > 0 {
			parts = append(parts, fmt.Sprintf("%d tensor(s) the graph reads are missing from the state dict: %s", len(missing), summarize(missing, 8)))
		}
		if len(extra) > 0 {
			hint := ""
			for _, k := range extra {
				if strings.HasPrefix(k, "aux1.") || strings.HasPrefix(k, "aux2.") || strings.HasPrefix(k, "AuxLogits.") {
					// GoogLeNet and Inception3 run their auxiliary
					// classifiers in training only: an eval export
					// has none.
					hint = " (auxiliary classifiers: an eval-mode export of GoogLeNet or Inception3 leaves them out; convert the whole pickled module or the state dict without --graph, which keep them as training-only outputs)"
					break
				}
			}
			parts = append(parts, fmt.Sprintf("%d tensor(s) of the state dict are not in the graph: %s%s", len(extra), summarize(extra, 8), hint))
		}
		if len(shapes) > 0 {
			parts = append(parts, fmt.Sprintf("%d tensor(s) have another shape in the state dict: %s", len(shapes), summarize(shapes, 8)))
		}
		if len(unnamed) > 0 {
			parts = append(parts, fmt.Sprintf("%d node(s) read parameters not named after a module%s: %s", len(unnamed), constantFoldingHint(unnamed), summarize(unnamed, 4)))
		}
		return nil, nil, fmt.Errorf("the state dict does not match the graph of %s: %s", path, strings.Join(parts, "; "))
	}
	if dup := calledTwice(modPath); dup != "" {
		// Two nodes of one module (a conv or a Linear called twice) would
		// take one name: refused by name, not as a broken name index.
		return nil, nil, failure.Unsupportedf("%s: module(s) called more than once, which abnconvert does not support yet: %s; give each call its own module", path, dup)
	}
	renameForState(g, m, modPath)
	for n, p := range newParams {
		n.Params = p
	}
	if err := g.Validate(); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	g.Arch = fmt.Sprintf("custom (structure from %s)", filepath.Base(path))
	match := &arch.Match{Arch: g.Arch, Family: "graph", Prefix: prefix, Exact: true,
		Notes: []string{fmt.Sprintf("structure from %s (opset %d), parameters matched by name", path, m.Opset)}}
	note, err := cumulativeMomentum(g, w, m.ExportMode())
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	if note != "" {
		match.Notes = append(match.Notes, note)
	}
	if opaque := m.Opaque(); len(opaque) > 0 {
		// A state dict converted along a graph the runtime cannot run could
		// be neither emitted as a module nor verified: say so, every op at
		// once, rather than write a checkpoint nothing can check.
		return nil, nil, failure.Unsupportedf("%s: the network uses ops abnconvert does not support yet, so no module could be emitted and no conversion verified: %s", path, strings.Join(opaque, "; "))
	}
	if fixed != "" {
		match.Warnings = append(match.Warnings, fixed)
		dims, _ := m.FixedShape()
		for _, d := range dims {
			match.FixedInput = append(match.FixedInput, int(d))
		}
		g.FixedInput = match.FixedInput
	}
	if m.ExportMode() == "eval" {
		match.Warnings = append(match.Warnings, fmt.Sprintf("%s was exported in eval mode, which drops every Dropout and StochasticDepth layer: the emitted module trains without any the network had; to keep them, export with model.train() and training=torch.onnx.TrainingMode.PRESERVE (torch 1.x exports StochasticDepth's noise only with torch 2's bernoulli symbolic registered, see the README; torch 1.13 cannot export Dropout2d/Dropout3d in train mode: put those layers alone in eval mode for the export, as the README and python/abnexport.py do; or give the whole pickled module, torch.save(model))", path))
	}
	return g, match, nil
}

// cumulativeMomentum marks the BatchNorm nodes that are
// BatchNorm2d(momentum=None), a cumulative average, and says so in one
// note for the network. An export does not carry momentum=None: torch
// writes the factor of the export's own forward as a constant, 1/N with N
// the num_batches_tracked that forward reached (train mode; the state dict
// holds N when saved after the export, as the README's recipe does, N - 1
// when saved before), or 0 in eval mode. Read as a momentum, 1/1001 would
// make the running statistics drift from the network's. A node is marked
// where the export's factor is 1/N or 1/(N+1) for the state dict's
// num_batches_tracked N, or 0 in an eval export, except a power of ten
// (0.1, torch's default, 0.01, ...), which is read as the momentum people
// write. Nodes without a num_batches_tracked keep the factor as momentum.
func cumulativeMomentum(g *graph.Graph, w graph.Weights, mode string) (string, error) {
	var marked []string
	for _, n := range g.Nodes {
		key, ok := n.Params[graph.RoleNumBatches]
		if n.Op != graph.OpBatchNorm || !ok || n.Attr.MomentumNone {
			continue
		}
		v, err := w.Values(key)
		if err != nil {
			return "", fmt.Errorf("node %s: %w", n.Name, err)
		}
		if len(v) != 1 || v[0] < 0 || v[0] != math.Trunc(v[0]) {
			return "", fmt.Errorf("node %s: %s holds %v, want one count (a BatchNorm's num_batches_tracked)", n.Name, key, v)
		}
		count := int64(v[0])
		f := n.Attr.Momentum
		cumulative := false
		switch {
		case mode == "eval":
			// torch's eval forward takes factor 0 for momentum=None and
			// the momentum itself otherwise.
			cumulative = f == 0
		case powerOfTen(f):
		default:
			cumulative = onnx.CumulativeFactor(f, count) || onnx.CumulativeFactor(f, count+1)
		}
		if cumulative {
			n.Attr.Momentum, n.Attr.MomentumNone = 0, true
			marked = append(marked, n.Name)
		}
	}
	if len(marked) == 0 {
		return "", nil
	}
	rule := "whose export factor is 1/N or 1/(N+1) for the state dict's num_batches_tracked N (torch writes the factor of the export's own forward, not momentum=None)"
	if mode == "eval" {
		rule = "whose export factor is 0 (an eval-mode export writes 0 for momentum=None, and the momentum itself otherwise)"
	}
	return fmt.Sprintf("%d BatchNorm layer(s) read as momentum=None, a cumulative moving average, %s: %s; a real momentum equal to that factor cannot be told apart in an export: compare the running statistics after a training step with the real model's, or convert the whole pickled module (torch.save(model)), which carries momentum itself",
		len(marked), rule, summarize(marked, 6)), nil
}

// powerOfTen reports a momentum of 0.1, 0.01, ...: torch's default and
// the values people write, read as a momentum even where it equals 1/N.
func powerOfTen(f float64) bool {
	if !(f > 0) {
		return false
	}
	// The shortest decimal: "0.1", "0.01", "0.001", "1e-04", ...
	return strconv.FormatFloat(f, 'g', -1, 64) == strconv.FormatFloat(math.Pow(10, math.Round(math.Log10(f))), 'g', -1, 64)
}

// statePrefix is the key prefix the state dict adds to the graph's
// parameter names ("module." from DataParallel), "" when none: the prefix
// under which the first parameter of the graph is found.
func statePrefix(g *graph.Graph, inState map[string]bool, keys []string) string {
	for _, n := range g.Nodes {
		mp := onnx.ModulePath(n)
		if mp == "" {
			continue
		}
		for role := range n.Params {
			key := mp + "." + role
			if inState[key] {
				return ""
			}
			for _, k := range keys {
				if p, ok := strings.CutSuffix(k, key); ok && strings.HasSuffix(p, ".") {
					return p
				}
			}
			return ""
		}
	}
	return ""
}

// renameForState names each parameter node after its module path and
// every other node after its ONNX scope ("/act/LeakyRelu" -> "act"), made
// unique, so that reports and the emitted module speak module paths.
func renameForState(g *graph.Graph, m *onnx.Model, modPath map[*graph.Node]string) {
	taken := map[string]bool{"input": true}
	for _, p := range modPath {
		taken[p] = true
	}
	final := map[*graph.Node]string{}
	for _, n := range g.Nodes {
		if n.Op == graph.OpInput {
			continue
		}
		if p, ok := modPath[n]; ok {
			final[n] = p
			continue
		}
		base := scopeName(n, m)
		name := base
		for i := 2; taken[name]; i++ {
			name = fmt.Sprintf("%s_%d", base, i)
		}
		taken[name] = true
		final[n] = name
	}
	// Through temporary names, so that no rename meets a name still held.
	i := 0
	for _, n := range g.Nodes {
		if _, ok := final[n]; ok {
			g.Rename(n, fmt.Sprintf("\x00%d", i))
			i++
		}
	}
	for _, n := range g.Nodes {
		if name, ok := final[n]; ok {
			g.Rename(n, name)
		}
	}
}

func scopeName(n *graph.Node, m *onnx.Model) string {
	name, opType, ok := m.Source(n)
	if !ok || name == "" {
		return strings.ToLower(string(n.Op))
	}
	parts := strings.Split(strings.Trim(name, "/"), "/")
	if len(parts) >= 2 {
		return parts[len(parts)-2]
	}
	if opType != "" {
		return strings.ToLower(opType)
	}
	return parts[0]
}

func sameDims(a, b []int) bool {
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

// unnamedNode is a node whose parameters are not named after one module.
type unnamedNode struct {
	name string
	node *graph.Node
	keys []string
}

// classifyUnnamed tells the causes of parameters not named after a
// module apart: a BatchNorm called twice (the reader keys its second
// call's parameters "bn.weight@/bn_1/BatchNormalization.weight"), a
// BatchNorm2d(affine=False) (weight and bias are constants of the export,
// its statistics are named), and the rest (as msgs has them), which
// constant folding renamed or which are the export's own constants.
func classifyUnnamed(nodes []unnamedNode, msgs []string) (shared, affine []string, affineMods map[string]bool, rest []string) {
	affineMods = map[string]bool{}
	for i, u := range nodes {
		var values, named, other []string
		for _, k := range u.keys {
			if v, _, ok := onnx.SplitKey(k); ok {
				values = append(values, v)
			} else if strings.HasPrefix(k, "/") || strings.HasPrefix(k, "onnx::") {
				other = append(other, k)
			} else {
				named = append(named, k)
			}
		}
		switch {
		case len(values) > 0 && len(other) == 0:
			mod := values[0]
			if j := strings.LastIndex(mod, "."); j > 0 {
				mod = mod[:j]
			}
			shared = append(shared, fmt.Sprintf("%s (%s again at node %s, reading %s)", mod, u.node.Op, u.name, strings.Join(values, ", ")))
		case u.node.Op.IsBNFamily() && len(named) > 0 && len(other) > 0 && allRunning(named):
			mod := named[0][:strings.LastIndex(named[0], ".")]
			affine = append(affine, fmt.Sprintf("%s (node %s: weight and bias are the constants %s)", mod, u.name, strings.Join(other, ", ")))
			affineMods[mod] = true
		default:
			rest = append(rest, msgs[i])
		}
	}
	return shared, affine, affineMods, rest
}

func allRunning(keys []string) bool {
	for _, k := range keys {
		if !strings.HasSuffix(k, "."+graph.RoleRunningMean) && !strings.HasSuffix(k, "."+graph.RoleRunningVar) {
			return false
		}
	}
	return true
}

// constantFoldingHint is the next step for parameters not named after a
// module: only where torch's constant folding renamed them (onnx::*) is
// do_constant_folding=False the answer.
func constantFoldingHint(unnamed []string) string {
	for _, u := range unnamed {
		if strings.Contains(u, "onnx::") {
			return " (torch's constant folding renamed them: export with do_constant_folding=False so that torch keeps parameter names)"
		}
	}
	return " (torch names an initializer after the parameter it exports; these are the export's own constants or values computed from parameters)"
}

// readButUnbound sorts the state dict's keys that no modelled layer reads:
// FrozenBatchNorm2d layers (a module whose weight, bias, running_mean and
// running_var the graph reads as arithmetic, with no num_batches_tracked),
// keys read by ops the IR does not model (by module, with their readers
// and the unsupported ops of the readers' scope), and the
// rest, which the graph does not read at all.
func readButUnbound(m *onnx.Model, extra []string, prefix string, inState map[string]bool) (frozen, readBy, rest []string) {
	isFrozen := map[string]bool{}
	for _, mod := range m.FrozenBN() {
		if !inState[prefix+mod+"."+graph.RoleNumBatches] {
			isFrozen[prefix+mod] = true
		}
	}
	seenFrozen := map[string]bool{}
	// Grouped by module: GroupNorm's weight and bias are one cause.
	type readGroup struct {
		keys, readers []string
		seen          map[string]bool
		scope         string // a reader's node name, for its scope
	}
	byMod := map[string]*readGroup{}
	var mods []string
	for _, k := range extra {
		mod := k
		if i := strings.LastIndex(k, "."); i > 0 {
			mod = k[:i]
		}
		if isFrozen[mod] {
			if !seenFrozen[mod] {
				seenFrozen[mod] = true
				frozen = append(frozen, mod)
			}
			continue
		}
		init, ok := strings.CutPrefix(k, prefix)
		if !ok {
			rest = append(rest, k)
			continue
		}
		readers := m.Readers(init)
		if len(readers) == 0 {
			rest = append(rest, k)
			continue
		}
		r, ok := byMod[mod]
		if !ok {
			r = &readGroup{seen: map[string]bool{}}
			byMod[mod] = r
			mods = append(mods, mod)
		}
		r.keys = append(r.keys, k)
		for _, rd := range readers {
			if name := fmt.Sprintf("%s (%s)", rd.Op, rd.Node); !r.seen[name] {
				r.seen[name] = true
				r.readers = append(r.readers, name)
			}
		}
		if r.scope == "" {
			r.scope = readers[0].Node
		}
	}
	for _, mod := range mods {
		r := byMod[mod]
		verb := "is"
		if len(r.keys) > 1 {
			verb = "are"
		}
		msg := fmt.Sprintf("%s %s read by %s", strings.Join(r.keys, ", "), verb, summarize(r.readers, 4))
		if ops := m.OpaqueInScope(r.scope, false); len(ops) > 0 {
			msg += ", beside unsupported ops: " + strings.Join(ops, ", ")
		}
		readBy = append(readBy, msg)
	}
	return frozen, readBy, rest
}

// opaqueOps names the unsupported ops of the first frozen layer, for the
// message.
func opaqueOps(m *onnx.Model, frozen []string, prefix string) string {
	if len(frozen) == 0 {
		return ""
	}
	readers := m.Readers(strings.TrimPrefix(frozen[0], prefix) + "." + graph.RoleRunningVar)
	if len(readers) == 0 {
		return ""
	}
	if ops := m.OpaqueInScope(readers[0].Node, true); len(ops) > 0 {
		return " (" + strings.Join(ops, ", ") + ")"
	}
	return ""
}

// calledTwice names the modules two nodes of the graph take their
// parameters from (a module called twice), "" when none.
func calledTwice(modPath map[*graph.Node]string) string {
	by := map[string][]string{}
	for n, p := range modPath {
		by[p] = append(by[p], n.Name)
	}
	var out []string
	for p, nodes := range by {
		if len(nodes) > 1 {
			sort.Strings(nodes)
			out = append(out, fmt.Sprintf("%s (nodes %s)", p, strings.Join(nodes, ", ")))
		}
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

// frozenInState lists the modules of a state dict that hold running
// statistics without num_batches_tracked: FrozenBatchNorm2d's buffers.
func frozenInState(w graph.Weights) []string {
	in := map[string]bool{}
	for _, k := range w.Keys() {
		in[k] = true
	}
	var out []string
	for _, k := range w.Keys() {
		mod, ok := strings.CutSuffix(k, "."+graph.RoleRunningVar)
		if ok && !in[mod+"."+graph.RoleNumBatches] && in[mod+"."+graph.RoleWeight] {
			out = append(out, mod)
		}
	}
	sort.Strings(out)
	return out
}
