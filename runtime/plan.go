package runtime

import (
	"fmt"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// A plan is everything the executor decides before running a graph on an
// input shape in a mode, in the manner of torch.fx's Interpreter with
// garbage_collect_values: the shape of every value, which storage every value
// lives in (in-place ops and views share their input's), what every node
// keeps for backward, and the last event at which each storage is used. The
// walker then only follows the plan, so every backend allocates and frees the
// same tensors at the same points and their memory figures compare.
//
// Events: the forward of node i is event i (node 0 is the input); then the
// backward walks the nodes in reverse, one event per node. Under gradient
// checkpointing, the backward of a segment's last node is preceded by one
// recompute event per node of the segment, which reruns its forward from the
// segment's inputs (kept since the forward pass) and keeps, this time, what
// the segment's backward needs.
type plan struct {
	shape    []int
	training bool // BN family uses batch statistics and updates running ones
	save     bool // keep what backward needs (training, or Options.GradInEval)
	n        int  // node count
	// act is the type of activations and their gradients: Float32, or the
	// 16-bit format of Options.Half.
	act DType

	shapes [][]int // output shape of each node
	// fwd says where each node's forward pass puts things; rec, for the
	// nodes of checkpoint segments, where their recomputation does.
	fwd, rec []pass
	// group is the shared-buffer group of each node, nil when unmarked or
	// when recomputation is off.
	group  []*group
	groups []*group
	// seg is the checkpoint segment of each node, -1 outside any.
	seg      []int
	segs     []segment
	storages []storageInfo
	// kept marks storages something keeps for a backward or a recompute:
	// no in-place op may overwrite them.
	kept []bool

	events []event
	// fpos, rpos and bpos are the events of each node's forward,
	// recomputation (-1 when not recomputed) and backward.
	fpos, rpos, bpos []int
	// allocAt and freeAt list the storages allocated before, and freed
	// after, each event.
	allocAt [][]int
	freeAt  [][]int
	flops   []nodeFlops
	// remat lists, per node, the inputs that are Slice outputs it keeps
	// as the sliced tensor (see savedInput); its backward slices them
	// again.
	remat map[int][]int
}

// pass is where one execution of a node (its forward, or its recomputation)
// puts things.
type pass struct {
	store int // storage of the output
	// inPlace: the output overwrites the first input's storage
	// (activations, InPlace-ABN); view: Flatten and eval Dropout, whose
	// output is their input reshaped.
	inPlace, view bool
	// aux lists the extra storages the node allocates (batch statistics,
	// pooling indices, dropout masks), in the order the walker expects.
	aux []int
	// wcopy is the 16-bit copy of a Conv2d's or Linear's weight under
	// Options.Half (autocast keeps such a copy for backward), -1 otherwise.
	wcopy int
}

type eventKind uint8

const (
	evForward eventKind = iota
	evRecompute
	evBackward
)

type event struct {
	kind eventKind
	node int
}

// segment is a checkpoint segment: nodes first..last.
type segment struct{ first, last int }

type storageKind uint8

const (
	kindValue  storageKind = iota // a node's output
	kindAux                       // statistics, indices, masks, weight copies
	kindShared                    // a DenseNet shared buffer
)

type storageInfo struct {
	shape []int
	dt    DType
	kind  storageKind
	owner int // node that allocates it
	what  string
	first int // event before which it is allocated
	last  int // event after which it is freed
	// savedBy is the first node (forward order) that keeps it for
	// backward, -1 if none: the per-layer breakdown charges it there.
	savedBy int
}

func (s storageInfo) bytes() int64 { return int64(numel(s.shape)) * s.dt.Size() }

// group is one DenseNet shared-buffer group: Concat → BN-family node (→
// activation) → 1x1 conv. Neither the concatenation nor the normalised (and
// activated) output is kept; both live in shared buffers and are recomputed
// in the backward pass with the batch statistics the forward pass saved, so
// running statistics are updated once. The activation, when the group has
// one (plain BN + ReLU, as in the memory-efficient DenseNet report), runs in
// place on the BN output's buffer.
type group struct {
	name           string
	cat, abn, conv int // node indices
	act            int // activation node, -1 when fused into the ABN
}

// planConfig is what a plan depends on besides the graph and input shape.
type planConfig struct {
	training, save bool
	// recompute honours Node.Recompute marks (DenseNet shared buffers).
	recompute bool
	// segments are the checkpoint segments (used when save).
	segments []segment
	// half, when 16-bit, is the type activations are kept in.
	half DType
}

// newStorage adds a storage allocated before event first.
func (p *plan) newStorage(shape []int, dt DType, kind storageKind, owner int, what string, first int) int {
	p.storages = append(p.storages, storageInfo{shape: shape, dt: dt, kind: kind, owner: owner, what: what, first: first, last: first, savedBy: -1})
	p.kept = append(p.kept, false)
	return len(p.storages) - 1
}

// use extends storage s's life to event ev.
func (p *plan) use(s, ev int) {
	if ev > p.storages[s].last {
		p.storages[s].last = ev
	}
}

// keep records that node i keeps storage s for its backward.
func (p *plan) keep(i, s int) { p.keepAt(i, s, p.bpos[i]) }

// keepAt records that node i keeps s for a backward or recompute at event
// ev.
func (p *plan) keepAt(i, s, ev int) {
	p.use(s, ev)
	p.kept[s] = true
	if p.storages[s].savedBy < 0 {
		p.storages[s].savedBy = i
	}
}

// makePlan plans g for an input of shape in, without checkpointing or 16-bit
// activations. index maps nodes to their position.
func makePlan(g *graph.Graph, index map[*graph.Node]int, in []int, training, save, recompute bool) (*plan, error) {
	return makePlanWith(g, index, in, planConfig{training: training, save: save, recompute: recompute})
}

func makePlanWith(g *graph.Graph, index map[*graph.Node]int, in []int, cfg planConfig) (*plan, error) {
	n := len(g.Nodes)
	p := &plan{
		shape: append([]int(nil), in...), training: cfg.training, save: cfg.save, n: n, act: Float32,
		shapes: make([][]int, n), fwd: make([]pass, n), rec: make([]pass, n), group: make([]*group, n), seg: make([]int, n),
	}
	if cfg.half.Is16() {
		p.act = cfg.half
	}
	for i := range p.seg {
		p.seg[i] = -1
		p.fwd[i].wcopy, p.rec[i].wcopy = -1, -1
	}
	if err := p.inferShapes(g, index); err != nil {
		return nil, err
	}
	if cfg.save && cfg.recompute {
		if err := p.findGroups(g, index); err != nil {
			return nil, err
		}
	}
	if cfg.save {
		if err := p.setSegments(g, cfg.segments); err != nil {
			return nil, err
		}
	}
	p.timeline()
	p.flops = make([]nodeFlops, n)
	for i, nd := range g.Nodes {
		var ins [][]int
		for _, v := range nd.Inputs {
			ins = append(ins, p.shapes[index[v.Producer]])
		}
		p.flops[i] = flopsOf(nd, ins, p.shapes[i], p.training)
	}

	var catBuf, abnBuf int = -1, -1
	if len(p.groups) > 0 {
		catN, abnN := 0, 0
		first := n
		for _, gr := range p.groups {
			catN = max(catN, numel(p.shapes[gr.cat]))
			abnN = max(abnN, numel(p.shapes[gr.abn]))
			first = min(first, gr.cat)
		}
		catBuf = p.newStorage([]int{catN}, p.act, kindShared, first, "shared concatenation buffer", p.fpos[first])
		abnBuf = p.newStorage([]int{abnN}, p.act, kindShared, first, "shared ABN output buffer", p.fpos[first])
	}
	// output picks a node's storage in a pass: a shared buffer, a view or
	// in-place result of its input, or a new one.
	output := func(nd *graph.Node, i, k int, pp *pass, sto func(int) int, ev int, what string) {
		gr := p.group[i]
		switch {
		case nd.Op == graph.OpInput:
			pp.store = p.newStorage(p.shapes[i], p.act, kindValue, i, "input", ev)
		case gr != nil && i == gr.cat:
			pp.store = catBuf
		case gr != nil && (i == gr.abn || i == gr.act):
			pp.store = abnBuf
			pp.inPlace = i == gr.act
		case nd.Op == graph.OpFlatten || nd.Op == graph.OpReshape || (nd.Op == graph.OpDropout && !p.training) ||
			(nd.Op == graph.OpStochasticDepth && !stochasticDepthActive(nd, p.training)):
			pp.view = true
			pp.store = sto(index[nd.Inputs[0].Producer])
		case p.mayOverwrite(g, index, nd, i, k, sto):
			pp.inPlace = true
			pp.store = sto(index[nd.Inputs[0].Producer])
		default:
			pp.store = p.newStorage(p.shapes[i], p.act, kindValue, i, what, ev)
		}
		for _, in := range nd.Inputs {
			p.use(sto(index[in.Producer]), ev)
		}
		p.use(pp.store, ev)
	}

	fsto := func(j int) int { return p.fwd[j].store }
	for i, nd := range g.Nodes {
		k := p.seg[i]
		if k >= 0 && p.segs[k].first == i {
			// The segment's inputs stay until its recomputation.
			for _, s := range p.segmentInputs(g, index, k) {
				p.keepAt(i, s, p.rpos[i])
			}
		}
		pp := &p.fwd[i]
		output(nd, i, -1, pp, fsto, p.fpos[i], "output")
		p.planAux(nd, i, pp, p.fpos[i], nil)
		p.planWeightCopy(nd, i, pp, p.fpos[i])
		switch {
		case !cfg.save:
		case k >= 0:
			// Checkpointed: nothing is kept but the batch statistics,
			// which the recomputation and the backward reuse (running
			// statistics are updated once).
			if nd.Op.IsBNFamily() && p.training {
				for _, s := range pp.aux {
					p.keep(i, s)
				}
			}
		default:
			p.planSaves(g, nd, i, pp, fsto, index)
		}
	}
	// The outputs are downloaded at the end of the forward pass.
	for _, v := range g.Outputs() {
		p.use(fsto(index[v.Producer]), n-1)
	}

	for k, sg := range p.segs {
		rsto := func(j int) int {
			if p.seg[j] == k {
				return p.rec[j].store
			}
			return p.fwd[j].store
		}
		for i := sg.first; i <= sg.last; i++ {
			nd, pp, ev := g.Nodes[i], &p.rec[i], p.rpos[i]
			output(nd, i, k, pp, rsto, ev, "recomputed output")
			p.planAux(nd, i, pp, ev, &p.fwd[i])
			p.planWeightCopy(nd, i, pp, ev)
			p.planSaves(g, nd, i, pp, rsto, index)
		}
	}
	for _, gr := range p.groups {
		p.use(catBuf, p.bpos[gr.conv])
		p.use(abnBuf, p.bpos[gr.conv])
	}
	p.allocAt = make([][]int, len(p.events))
	p.freeAt = make([][]int, len(p.events))
	for s, st := range p.storages {
		p.allocAt[st.first] = append(p.allocAt[st.first], s)
		p.freeAt[st.last] = append(p.freeAt[st.last], s)
	}
	return p, nil
}

// timeline lays out the events: every forward, then the backwards in reverse
// order, each segment's recomputation just before its last node's backward.
func (p *plan) timeline() {
	n := p.n
	p.fpos, p.rpos, p.bpos = make([]int, n), make([]int, n), make([]int, n)
	for i := 0; i < n; i++ {
		p.fpos[i], p.rpos[i] = len(p.events), -1
		p.events = append(p.events, event{evForward, i})
	}
	for i := n - 1; i >= 0; i-- {
		if k := p.seg[i]; k >= 0 && p.segs[k].last == i {
			for j := p.segs[k].first; j <= i; j++ {
				p.rpos[j] = len(p.events)
				p.events = append(p.events, event{evRecompute, j})
			}
		}
		p.bpos[i] = len(p.events)
		p.events = append(p.events, event{evBackward, i})
	}
}

// setSegments checks the checkpoint segments and assigns nodes to them.
func (p *plan) setSegments(g *graph.Graph, segs []segment) error {
	prev := 0
	for k, s := range segs {
		if s.first <= prev || s.last < s.first || s.last >= p.n {
			return fmt.Errorf("runtime: checkpoint segment %d (nodes %d..%d): out of order or out of range (%d nodes)", k, s.first, s.last, p.n)
		}
		for i := s.first; i <= s.last; i++ {
			p.seg[i] = k
		}
		prev = s.last
	}
	p.segs = segs
	for _, gr := range p.groups {
		k := p.seg[gr.cat]
		for _, i := range []int{gr.abn, gr.act, gr.conv} {
			if i >= 0 && p.seg[i] != k {
				return fmt.Errorf("runtime: recompute group %q straddles a checkpoint segment boundary at %s", gr.name, g.Nodes[i].Name)
			}
		}
	}
	return nil
}

// segmentInputs lists the forward storages segment k reads from outside.
func (p *plan) segmentInputs(g *graph.Graph, index map[*graph.Node]int, k int) []int {
	sg := p.segs[k]
	var out []int
	seen := map[int]bool{}
	for i := sg.first; i <= sg.last; i++ {
		for _, in := range g.Nodes[i].Inputs {
			j := index[in.Producer]
			if j >= sg.first {
				continue
			}
			if s := p.fwd[j].store; !seen[s] {
				seen[s] = true
				out = append(out, s)
			}
		}
	}
	return out
}

// mayOverwrite decides whether nd writes its output over its input, as
// torchvision's inplace=True activations and InPlace-ABN do. That is only
// safe when nothing reads the input's storage afterwards: the input is not
// the graph's input or output, every reader of every value living in that
// storage has run by now and nd is the only reader at this step, and nothing
// keeps the storage for a backward or a recompute (PyTorch would refuse
// such an in-place op at backward time). In the recomputation of segment k
// (k >= 0), values from outside the segment are never overwritten, and
// readers after the segment do not count: they read the forward's copy.
func (p *plan) mayOverwrite(g *graph.Graph, index map[*graph.Node]int, nd *graph.Node, i, k int, sto func(int) int) bool {
	// The row says which ops may (graph.InPlaceRule: ReLU and the
	// InPlace-ABN layers; LeakyReLU and ELU run out of place, as their
	// modules do by default).
	if info, _ := nd.Op.Info(); !info.InPlace.Allows(nd.Attr) {
		return false
	}
	in := nd.Inputs[0]
	if in == g.Input || g.IsOutput(in) {
		return false
	}
	j0 := index[in.Producer]
	lo, hi := 0, p.n-1
	if k >= 0 {
		if p.seg[j0] != k {
			return false
		}
		lo, hi = p.segs[k].first, p.segs[k].last
	}
	s := sto(j0)
	if p.storages[s].kind != kindValue || p.kept[s] {
		return false
	}
	for j := lo; j < i; j++ {
		if sto(j) != s {
			continue
		}
		other := g.Nodes[j]
		if g.IsOutput(other.Out) {
			return false
		}
		for _, c := range other.Out.Consumers {
			r := index[c]
			if r > hi {
				continue
			}
			if r > i || (r == i && c != nd) {
				return false
			}
		}
	}
	return true
}

// planAux adds the statistics, indices and masks node i allocates at event
// ev. A recomputation (reuse is the forward's pass) reuses the forward's
// batch statistics instead of computing new ones.
func (p *plan) planAux(nd *graph.Node, i int, pp *pass, ev int, reuse *pass) {
	add := func(shape []int, dt DType, what string) {
		s := p.newStorage(shape, dt, kindAux, i, what, ev)
		pp.aux = append(pp.aux, s)
	}
	switch {
	case nd.Op.IsBNFamily() && p.training:
		if reuse != nil {
			pp.aux = reuse.aux
			for _, s := range pp.aux {
				p.use(s, ev)
			}
			return
		}
		// Statistics stay float32 under Options.Half, as under autocast.
		c := p.shapes[i][1]
		add([]int{c}, Float32, "batch mean")
		add([]int{c}, Float32, "batch variance")
		if info, _ := nd.Op.Info(); info.Saves == graph.SaveInPlaceABN && nd.Residual() == nil {
			// inplace_abn's InPlaceABN counts the samples per channel
			// in a one-element int64 tensor and keeps it for its
			// backward (8 bytes PyTorch's hooks see per layer); the
			// emitted module's fused residual add (_inplace_abn_add)
			// has no such tensor.
			add([]int{1}, Int64, "sample count")
		}
	case nd.Op == graph.OpMaxPool && p.save:
		add(p.shapes[i], Int64, "argmax indices")
	case nd.Op == graph.OpDropout && p.training:
		add(p.shapes[i], p.act, "dropout mask")
	case nd.Op == graph.OpStochasticDepth && stochasticDepthActive(nd, p.training):
		add(stochasticDepthNoise(nd, p.shapes[i]), p.act, "stochastic depth noise")
	}
}

// planWeightCopy adds, under Options.Half, the 16-bit copy of a Conv2d's or
// Linear's weight that the node computes with.
func (p *plan) planWeightCopy(nd *graph.Node, i int, pp *pass, ev int) {
	if !p.act.Is16() || (nd.Op != graph.OpConv && nd.Op != graph.OpLinear) {
		return
	}
	a := normAttr(nd)
	shape := []int{a.OutChannels, a.InChannels}
	if nd.Op == graph.OpConv {
		shape = []int{a.OutChannels, a.InChannels / a.Groups, a.KernelSize[0], a.KernelSize[1]}
	}
	pp.wcopy = p.newStorage(shape, p.act, kindAux, i, "16-bit weight copy", ev)
}

// planSaves records what node i keeps for backward, in the pass pp whose
// storages sto gives. It mirrors what PyTorch 1.13's autograd saves for the
// same op (checked with saved-tensor hooks), so that the figure for an
// original network compares with PyTorch's, and what the InPlace-ABN paper
// and the memory-efficient DenseNet report keep for the converted layers.
func (p *plan) planSaves(g *graph.Graph, nd *graph.Node, i int, pp *pass, sto func(int) int, index map[*graph.Node]int) {
	in := func(k int) int { return p.savedInput(nd, i, k, sto, index) }
	out := pp.store
	if gr := p.group[i]; gr != nil {
		at := p.bpos[gr.conv]
		switch i {
		case gr.cat:
			// The concatenation is rebuilt from its inputs.
			for k := range nd.Inputs {
				p.keepAt(i, in(k), at)
			}
		case gr.abn:
			// Batch statistics to recompute the output; nothing else.
			for _, s := range pp.aux {
				p.keepAt(i, s, at)
			}
		case gr.conv:
			if pp.wcopy >= 0 {
				p.keep(i, pp.wcopy)
			}
		}
		return
	}
	info, _ := nd.Op.Info()
	switch info.Saves {
	case graph.SaveInput:
		// Convolution and linear layers keep their 16-bit weight copy
		// too (no other op has one).
		p.keep(i, in(0))
		if pp.wcopy >= 0 {
			p.keep(i, pp.wcopy)
		}
	case graph.SaveNorm:
		p.keep(i, in(0))
		for _, s := range pp.aux {
			p.keep(i, s)
		}
	case graph.SaveABN:
		// inplace_abn's ABN is batch_norm followed by an in-place
		// activation: the input and statistics for the former, the
		// result for the latter.
		p.keep(i, in(0))
		for _, s := range pp.aux {
			p.keep(i, s)
		}
		if actOf(nd).Kind != ActIdentity {
			p.keep(i, out)
		}
	case graph.SaveInPlaceABN:
		// The output z, the variance and the sample count; the mean is
		// not needed. With a residual, z is the sum, and the residual
		// too (no sample count: see planAux), to recover the
		// normalised output from it (the block's first layer keeps that
		// tensor already, so it costs nothing more).
		p.keep(i, out)
		if p.training {
			p.keep(i, pp.aux[1])
			if len(pp.aux) > 2 {
				p.keep(i, pp.aux[2]) // the sample count
			}
		}
		if nd.Residual() != nil {
			p.keep(i, in(1))
		}
	case graph.SaveOutput:
		p.keep(i, out)
	case graph.SaveOperands:
		// Both operands (every value of a graph requires grad).
		p.keep(i, in(0))
		p.keep(i, in(1))
	case graph.SaveInputIndices:
		p.keep(i, in(0))
		p.keep(i, pp.aux[0])
	case graph.SaveAux:
		// planAux made the draw only where the op uses one (a dropout
		// mask in training, stochastic depth's noise when active).
		for _, s := range pp.aux {
			p.keep(i, s)
		}
	}
}

// findGroups collects the DenseNet groups marked by Node.Recompute and checks
// that each has the shape the shared buffers rely on: Concat, a BN-family
// node, optionally an activation, a Conv2d, each the only reader of the one
// before.
func (p *plan) findGroups(g *graph.Graph, index map[*graph.Node]int) error {
	byName := map[string][]int{}
	var order []string
	for i, nd := range g.Nodes {
		if nd.Recompute == "" {
			continue
		}
		if _, ok := byName[nd.Recompute]; !ok {
			order = append(order, nd.Recompute)
		}
		byName[nd.Recompute] = append(byName[nd.Recompute], i)
	}
	for _, name := range order {
		idx := byName[name]
		bad := func(why string) error {
			return fmt.Errorf("runtime: recompute group %q (node %s): %s", name, g.Nodes[idx[0]].Name, why)
		}
		if len(idx) != 3 && len(idx) != 4 {
			return bad(fmt.Sprintf("has %d nodes, want Concat, a BN-family node, an optional activation and a 1x1 Conv2d", len(idx)))
		}
		chain := make([]*graph.Node, len(idx))
		for k, i := range idx {
			chain[k] = g.Nodes[i]
		}
		cat, abn, conv := chain[0], chain[1], chain[len(chain)-1]
		gr := &group{name: name, cat: idx[0], abn: idx[1], act: -1, conv: idx[len(idx)-1]}
		switch {
		case cat.Op != graph.OpConcat:
			return bad(fmt.Sprintf("first node %s is %s, want Concat", cat.Name, cat.Op))
		case !abn.Op.IsBNFamily():
			return bad(fmt.Sprintf("second node %s is %s, want a BN-family node", abn.Name, abn.Op))
		case abn.Residual() != nil:
			return bad(fmt.Sprintf("%s adds a residual: its sum cannot live in the shared buffer", abn.Name))
		case conv.Op != graph.OpConv:
			return bad(fmt.Sprintf("last node %s is %s, want Conv2d", conv.Name, conv.Op))
		}
		if len(chain) == 4 {
			act := chain[2]
			switch {
			case abn.Op == graph.OpInPlaceABN || abn.Op == graph.OpInPlaceABNSync:
				return bad(fmt.Sprintf("%s is in place and takes no separate activation", abn.Name))
			case act.Op.IsActivation() && inPlaceRule(act.Op).Allows(act.Attr):
			default:
				// The activation runs in place on the shared buffer, so
				// its backward must work from its output.
				return bad(fmt.Sprintf("third node %s is %s, want an activation that can run in place", act.Name, act.Op))
			}
			gr.act = idx[2]
		}
		for k := 1; k < len(chain); k++ {
			if chain[k].Inputs[0] != chain[k-1].Out {
				return bad("its nodes do not read one another in a chain")
			}
			if !onlyReader(chain[k-1].Out, chain[k]) {
				return bad(fmt.Sprintf("%s has readers outside the group", chain[k-1].Name))
			}
			if g.IsOutput(chain[k-1].Out) {
				return bad("a recomputed value is the graph output")
			}
		}
		for _, i := range idx {
			p.group[i] = gr
		}
		p.groups = append(p.groups, gr)
	}
	return nil
}

// inPlaceRule is op's row's in-place rule.
func inPlaceRule(op graph.Op) graph.InPlaceRule {
	info, _ := op.Info()
	return info.InPlace
}

func onlyReader(v *graph.Value, n *graph.Node) bool {
	for _, c := range v.Consumers {
		if c != n {
			return false
		}
	}
	return len(v.Consumers) > 0
}

// inferShapes computes every node's output shape from the input shape, and
// checks every op's input against its attributes and parameters.
func (p *plan) inferShapes(g *graph.Graph, index map[*graph.Node]int) error {
	for i, nd := range g.Nodes {
		var ins [][]int
		for _, in := range nd.Inputs {
			ins = append(ins, p.shapes[index[in.Producer]])
		}
		sh, err := outShape(nd, p.shape, ins, p.training)
		if err != nil {
			return fmt.Errorf("runtime: node %s (%s): %w", nd.Name, nd.Op, err)
		}
		p.shapes[i] = sh
	}
	return nil
}

func outShape(nd *graph.Node, input []int, ins [][]int, training bool) ([]int, error) {
	need4 := func() error {
		if len(ins[0]) != 4 {
			return fmt.Errorf("input has shape %v, want 4 dimensions (N, C, H, W)", ins[0])
		}
		return nil
	}
	a := normAttr(nd)
	info, _ := nd.Op.Info()
	if info.Check != nil {
		if err := info.Check(a); err != nil {
			return nil, err
		}
	}
	switch info.Shape {
	case graph.ShapeInput:
		if len(input) < 2 {
			return nil, fmt.Errorf("input shape %v: want at least (N, C)", input)
		}
		for _, d := range input {
			if d <= 0 {
				return nil, fmt.Errorf("input shape %v has a non-positive dimension", input)
			}
		}
		if c := nd.Out.Channels; c != 0 && input[1] != c {
			return nil, fmt.Errorf("input has %d channels, the graph wants %d", input[1], c)
		}
		return append([]int(nil), input...), nil
	case graph.ShapeConv:
		if err := need4(); err != nil {
			return nil, err
		}
		x := ins[0]
		if a.InChannels != 0 && x[1] != a.InChannels {
			return nil, fmt.Errorf("input has %d channels, the convolution wants %d", x[1], a.InChannels)
		}
		if a.Groups < 1 || x[1]%a.Groups != 0 || a.OutChannels%a.Groups != 0 {
			return nil, fmt.Errorf("groups %d do not divide %d input and %d output channels", a.Groups, x[1], a.OutChannels)
		}
		for d := 0; d < 2; d++ {
			if a.KernelSize[d] < 1 || a.Stride[d] < 1 || a.Dilation[d] < 1 || a.Padding[d] < 0 {
				return nil, fmt.Errorf("kernel %v, stride %v, padding %v, dilation %v: out of range", a.KernelSize, a.Stride, a.Padding, a.Dilation)
			}
		}
		h := ConvOutSize(x[2], a.KernelSize[0], a.Stride[0], a.Padding[0], a.Dilation[0])
		w := ConvOutSize(x[3], a.KernelSize[1], a.Stride[1], a.Padding[1], a.Dilation[1])
		if h < 1 || w < 1 {
			return nil, fmt.Errorf("input %v is too small for kernel %v dilation %v padding %v", x, a.KernelSize, a.Dilation, a.Padding)
		}
		return []int{x[0], a.OutChannels, h, w}, nil
	case graph.ShapeNorm:
		// (N, C, H, W), or (N, C) after a Linear (BatchNorm1d).
		if len(ins[0]) != 2 {
			if err := need4(); err != nil {
				return nil, err
			}
		}
		x := ins[0]
		if a.Features != 0 && x[1] != a.Features {
			return nil, fmt.Errorf("input has %d channels, the layer has %d features", x[1], a.Features)
		}
		if nd.Residual() != nil && !sameInts(ins[1], x) {
			// Added in place: no broadcasting.
			return nil, fmt.Errorf("adds residual %s of shape %v to its output of shape %v", nd.Inputs[1].Name, ins[1], x)
		}
		if training && numel(x)/x[1] < 2 {
			return nil, fmt.Errorf("expected more than 1 value per channel when training, got input size %v", x)
		}
		if info.Saves == graph.SaveInPlaceABN {
			// The backward recovers the input from the output, so the
			// activation must be invertible.
			switch act := actOf(nd); {
			case act.Kind == ActReLU:
				return nil, fmt.Errorf("activation relu is not invertible: InPlace-ABN refuses it (use ABN, or leaky_relu)")
			case act.Kind != ActIdentity && !(act.Param > 0):
				return nil, fmt.Errorf("activation %s is not invertible: InPlace-ABN needs a positive parameter", act)
			}
		}
		return append([]int(nil), x...), nil
	case graph.ShapeSame:
		// The row's Check has validated the attributes.
		return append([]int(nil), ins[0]...), nil
	case graph.ShapeBroadcast:
		return BroadcastShape(ins[0], ins[1])
	case graph.ShapeSum:
		if len(ins) == 2 && !sameInts(ins[0], ins[1]) {
			return BroadcastShape(ins[0], ins[1])
		}
		for _, s := range ins[1:] {
			if !sameInts(s, ins[0]) {
				return nil, fmt.Errorf("adds shapes %v and %v", ins[0], s)
			}
		}
		return append([]int(nil), ins[0]...), nil
	case graph.ShapeConcat:
		if isLayoutOp(nd, ins) {
			break
		}
		if a.Axis != 1 && a.Axis != -3 {
			return nil, fmt.Errorf("concatenation along axis %d: only channels (1) are supported", a.Axis)
		}
		out := append([]int(nil), ins[0]...)
		if len(out) != 4 {
			return nil, fmt.Errorf("input has shape %v, want 4 dimensions", out)
		}
		for _, s := range ins[1:] {
			if len(s) != 4 || s[0] != out[0] || s[2] != out[2] || s[3] != out[3] {
				return nil, fmt.Errorf("concatenates shapes %v and %v", ins[0], s)
			}
			out[1] += s[1]
		}
		return out, nil
	case graph.ShapePool:
		if err := need4(); err != nil {
			return nil, err
		}
		x := ins[0]
		out := []int{x[0], x[1], 0, 0}
		for d := 0; d < 2; d++ {
			k, s, pd := a.KernelSize[d], a.Stride[d], a.Padding[d]
			if k < 1 || s < 1 || pd < 0 || 2*pd > k {
				return nil, fmt.Errorf("kernel %v stride %v padding %v: out of range (padding at most half the kernel)", a.KernelSize, a.Stride, a.Padding)
			}
			out[2+d] = PoolOutSize(x[2+d], k, s, pd, a.CeilMode)
			if out[2+d] < 1 {
				return nil, fmt.Errorf("input %v is too small for kernel %v", x, a.KernelSize)
			}
		}
		return out, nil
	case graph.ShapeAdaptivePool:
		if err := need4(); err != nil {
			return nil, err
		}
		x := ins[0]
		if a.OutputSize[0] < 1 || a.OutputSize[1] < 1 {
			return nil, fmt.Errorf("output size %v must be positive", a.OutputSize)
		}
		return []int{x[0], x[1], a.OutputSize[0], a.OutputSize[1]}, nil
	case graph.ShapeFlatten:
		x := ins[0]
		sd := a.StartDim
		if sd < 0 {
			sd += len(x)
		}
		if sd < 0 || sd >= len(x) {
			return nil, fmt.Errorf("start_dim %d out of range for shape %v", a.StartDim, x)
		}
		out := append([]int(nil), x[:sd]...)
		return append(out, numel(x[sd:])), nil
	case graph.ShapeLinear:
		x := ins[0]
		if len(x) != 2 {
			return nil, fmt.Errorf("input has shape %v, want (N, features)", x)
		}
		if a.InChannels != 0 && x[1] != a.InChannels {
			return nil, fmt.Errorf("input has %d features, the layer wants %d", x[1], a.InChannels)
		}
		return []int{x[0], a.OutChannels}, nil
	}
	if out, ok, err := layoutShape(nd, ins); ok {
		return out, err
	}
	// The one place the runtime meets an op it does not model: every run
	// plans first, so verify and memory refuse such a network here.
	return nil, failure.Unsupportedf("unsupported op %q", nd.Op)
}

func sameInts(a, b []int) bool {
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

// actOf is the activation a node applies.
func actOf(nd *graph.Node) Act {
	a := nd.Attr
	switch nd.Op {
	case graph.OpReLU:
		return Act{Kind: ActReLU}
	case graph.OpLeakyReLU:
		return Act{Kind: ActLeakyReLU, Param: a.ActParam}
	case graph.OpELU:
		return Act{Kind: ActELU, Param: a.ActParam}
	case graph.OpHardtanh:
		return Act{Kind: ActHardtanh, Param: a.ActParam, Param2: a.ActParam2}
	case graph.OpSigmoid:
		return Act{Kind: ActSigmoid}
	case graph.OpSiLU:
		return Act{Kind: ActSiLU}
	case graph.OpHardsigmoid:
		return Act{Kind: ActHardsigmoid, Param: a.ActParam, Param2: a.ActParam2}
	case graph.OpHardswish:
		return Act{Kind: ActHardswish}
	case graph.OpGELU:
		return Act{Kind: ActGELU}
	case graph.OpTanh:
		return Act{Kind: ActTanh}
	case graph.OpSELU:
		return Act{Kind: ActSELU}
	case graph.OpCELU:
		return Act{Kind: ActCELU, Param: a.ActParam}
	case graph.OpSoftplus:
		return Act{Kind: ActSoftplus, Param: a.ActParam, Param2: a.ActParam2}
	case graph.OpMish:
		return Act{Kind: ActMish}
	case graph.OpABN, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
		switch a.Activation {
		case graph.ActReLU:
			return Act{Kind: ActReLU}
		case graph.ActLeakyReLU:
			return Act{Kind: ActLeakyReLU, Param: a.ActParam}
		case graph.ActELU:
			return Act{Kind: ActELU, Param: a.ActParam}
		}
	}
	return Act{Kind: ActIdentity}
}

// normAttr returns a node's attributes with PyTorch's defaults in place of
// zero values a hand-built graph may leave: dilation 1, groups 1, a pool's
// stride equal to its kernel, and the channel counts of Conv2d and Linear
// read from their inputs by the caller when zero.
func normAttr(nd *graph.Node) graph.Attr {
	a := nd.Attr
	switch nd.Op {
	case graph.OpConv:
		for d := 0; d < 2; d++ {
			if a.Dilation[d] == 0 {
				a.Dilation[d] = 1
			}
			if a.Stride[d] == 0 {
				a.Stride[d] = 1
			}
		}
		if a.Groups == 0 {
			a.Groups = 1
		}
	case graph.OpMaxPool, graph.OpAvgPool:
		for d := 0; d < 2; d++ {
			if a.Stride[d] == 0 {
				a.Stride[d] = a.KernelSize[d]
			}
		}
	}
	return a
}
