package runtime

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// A plan is everything the executor decides before running a graph on an
// input shape in a mode, in the manner of torch.fx's Interpreter with
// garbage_collect_values: the shape of every value, which storage every value
// lives in (in-place ops and views share their input's), what every node
// keeps for backward, and the last step at which each storage is used. The
// walker then only follows the plan, so every backend allocates and frees the
// same tensors at the same points and their memory figures compare.
//
// Steps: forward step i runs node i (node 0 is the input); backward step
// bstep(i) = 2N-1-i runs node i's backward, so the backward walks the nodes
// in reverse and the timeline is 0 .. 2N-1.
type plan struct {
	shape    []int
	training bool // BN family uses batch statistics and updates running ones
	save     bool // keep what backward needs (training, or Options.GradInEval)
	n        int  // node count

	shapes [][]int // output shape of each node
	store  []int   // storage of each node's output
	// inPlace marks nodes whose output overwrites their first input's
	// storage (activations, InPlace-ABN); view marks Flatten and eval
	// Dropout, whose output is their input reshaped.
	inPlace []bool
	view    []bool
	// saves lists, per node, the storages it keeps for backward: what its
	// backward reads. aux lists the extra storages a node allocates (batch
	// statistics, pooling indices, dropout masks), in the order the walker
	// expects them.
	saves [][]int
	aux   [][]int
	// group is the shared-buffer group of each node, nil when unmarked or
	// when recomputation is off.
	group    []*group
	groups   []*group
	storages []storageInfo
	// allocAt and freeAt list the storages allocated before, and freed
	// after, each step.
	allocAt [][]int
	freeAt  [][]int
}

type storageKind uint8

const (
	kindValue  storageKind = iota // a node's output
	kindAux                       // statistics, indices, masks
	kindShared                    // a DenseNet shared buffer
)

type storageInfo struct {
	shape []int
	dt    DType
	kind  storageKind
	owner int // node that allocates it
	what  string
	first int // step before which it is allocated
	last  int // step after which it is freed
	// savedBy is the first node (forward order) that keeps it for
	// backward, -1 if none: the per-layer breakdown charges it there.
	savedBy int
}

func (s storageInfo) bytes() int64 { return int64(numel(s.shape)) * s.dt.Size() }

// group is one DenseNet shared-buffer group: Concat → ABN-family → 1x1 conv.
// Neither the concatenation nor the ABN output is kept; both live in shared
// buffers and are recomputed in the backward pass with the batch statistics
// the forward pass saved, so running statistics are updated once.
type group struct {
	name           string
	cat, abn, conv int // node indices
	// mean and variance are the ABN's saved batch statistics (aux
	// storages).
	mean, variance int
}

func (p *plan) bstep(i int) int { return 2*p.n - 1 - i }

// newStorage adds a storage allocated before step first.
func (p *plan) newStorage(shape []int, dt DType, kind storageKind, owner int, what string, first int) int {
	p.storages = append(p.storages, storageInfo{shape: shape, dt: dt, kind: kind, owner: owner, what: what, first: first, last: first, savedBy: -1})
	return len(p.storages) - 1
}

// use extends storage s's life to step.
func (p *plan) use(s, step int) {
	if step > p.storages[s].last {
		p.storages[s].last = step
	}
}

// keep records that node i keeps storage s for its backward.
func (p *plan) keep(i, s int) {
	p.saves[i] = append(p.saves[i], s)
	p.use(s, p.bstep(i))
	if p.storages[s].savedBy < 0 {
		p.storages[s].savedBy = i
	}
}

// keepAt records that node i keeps s for a backward that runs at step.
func (p *plan) keepAt(i, s, step int) {
	p.saves[i] = append(p.saves[i], s)
	p.use(s, step)
	if p.storages[s].savedBy < 0 {
		p.storages[s].savedBy = i
	}
}

// makePlan plans g for an input of shape in. index maps nodes to their
// position.
func makePlan(g *graph.Graph, index map[*graph.Node]int, in []int, training, save, recompute bool) (*plan, error) {
	n := len(g.Nodes)
	p := &plan{
		shape: append([]int(nil), in...), training: training, save: save, n: n,
		shapes: make([][]int, n), store: make([]int, n), inPlace: make([]bool, n), view: make([]bool, n),
		saves: make([][]int, n), aux: make([][]int, n), group: make([]*group, n),
	}
	if err := p.inferShapes(g, index); err != nil {
		return nil, err
	}
	if save && recompute {
		if err := p.findGroups(g, index); err != nil {
			return nil, err
		}
	}
	// lastRead is the last forward step reading a value; mayOverwrite
	// uses it to decide whether a node may overwrite its input.
	lastRead := func(v *graph.Value) int {
		last := -1
		for _, c := range v.Consumers {
			if j := index[c]; j > last {
				last = j
			}
		}
		return last
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
		catBuf = p.newStorage([]int{catN}, Float32, kindShared, first, "shared concatenation buffer", first)
		abnBuf = p.newStorage([]int{abnN}, Float32, kindShared, first, "shared ABN output buffer", first)
	}

	for i, nd := range g.Nodes {
		sh := p.shapes[i]
		gr := p.group[i]
		switch {
		case nd.Op == graph.OpInput:
			p.store[i] = p.newStorage(sh, Float32, kindValue, i, "input", i)
		case gr != nil && i == gr.cat:
			p.store[i] = catBuf
		case gr != nil && i == gr.abn:
			p.store[i] = abnBuf
		case nd.Op == graph.OpFlatten || (nd.Op == graph.OpDropout && !training):
			p.view[i] = true
			p.store[i] = p.store[index[nd.Inputs[0].Producer]]
		case p.mayOverwrite(g, index, nd, i, lastRead):
			p.inPlace[i] = true
			p.store[i] = p.store[index[nd.Inputs[0].Producer]]
		default:
			p.store[i] = p.newStorage(sh, Float32, kindValue, i, "output", i)
		}
		// Forward reads.
		for _, in := range nd.Inputs {
			p.use(p.store[index[in.Producer]], i)
		}
		p.use(p.store[i], i)
		p.planAux(nd, i, index)
		if save {
			p.planSaves(g, nd, i, index)
		}
	}
	// The output is downloaded at the end of the forward pass.
	p.use(p.store[index[g.Output.Producer]], n-1)
	for _, gr := range p.groups {
		p.use(catBuf, p.bstep(gr.conv))
		p.use(abnBuf, p.bstep(gr.conv))
	}
	p.allocAt = make([][]int, 2*n)
	p.freeAt = make([][]int, 2*n)
	for s, st := range p.storages {
		p.allocAt[st.first] = append(p.allocAt[st.first], s)
		p.freeAt[st.last] = append(p.freeAt[st.last], s)
	}
	return p, nil
}

// mayOverwrite decides whether nd writes its output over its input, as
// torchvision's inplace=True activations and InPlace-ABN do. That is only
// safe when nothing reads the input's storage afterwards: the input is not
// the graph's input or output, every reader of every value living in that
// storage has run by now and nd is the only reader at this step, and no
// earlier node keeps the storage for its backward (PyTorch would refuse such
// an in-place op at backward time).
func (p *plan) mayOverwrite(g *graph.Graph, index map[*graph.Node]int, nd *graph.Node, i int, lastRead func(*graph.Value) int) bool {
	switch nd.Op {
	case graph.OpReLU, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
	case graph.OpLeakyReLU, graph.OpELU:
		// The backward of an in-place activation only has the result; it
		// must tell the two branches apart from it, which needs a positive
		// slope or alpha.
		if !(nd.Attr.ActParam > 0) {
			return false
		}
	default:
		return false
	}
	in := nd.Inputs[0]
	if in == g.Input || in == g.Output {
		return false
	}
	s := p.store[index[in.Producer]]
	if p.storages[s].kind != kindValue {
		return false
	}
	for j, other := range g.Nodes[:i] {
		if p.store[j] != s {
			continue
		}
		if other.Out == g.Output {
			return false
		}
		for _, c := range other.Out.Consumers {
			k := index[c]
			if k > i || (k == i && c != nd) {
				return false
			}
		}
		if lastRead(other.Out) > i {
			return false
		}
	}
	for j := 0; j < i; j++ {
		for _, k := range p.saves[j] {
			if k == s {
				return false
			}
		}
	}
	return true
}

// planAux adds the statistics, indices and masks node i allocates.
func (p *plan) planAux(nd *graph.Node, i int, index map[*graph.Node]int) {
	add := func(shape []int, dt DType, what string) int {
		s := p.newStorage(shape, dt, kindAux, i, what, i)
		p.aux[i] = append(p.aux[i], s)
		return s
	}
	switch {
	case nd.Op.IsBNFamily() && p.training:
		c := p.shapes[i][1]
		add([]int{c}, Float32, "batch mean")
		add([]int{c}, Float32, "batch variance")
	case nd.Op == graph.OpMaxPool && p.save:
		add(p.shapes[i], Int64, "argmax indices")
	case nd.Op == graph.OpDropout && p.training:
		add(p.shapes[i], Float32, "dropout mask")
	}
}

// planSaves records what node i keeps for backward. It mirrors what PyTorch
// 1.13's autograd saves for the same op (checked with saved-tensor hooks), so
// that the figure for an original network compares with PyTorch's, and what
// the InPlace-ABN paper and the memory-efficient DenseNet report keep for the
// converted layers.
func (p *plan) planSaves(g *graph.Graph, nd *graph.Node, i int, index map[*graph.Node]int) {
	in := func(k int) int { return p.store[index[nd.Inputs[k].Producer]] }
	out := p.store[i]
	if gr := p.group[i]; gr != nil {
		at := p.bstep(gr.conv)
		switch i {
		case gr.cat:
			// The concatenation is rebuilt from its inputs.
			for k := range nd.Inputs {
				p.keepAt(i, in(k), at)
			}
		case gr.abn:
			// Batch statistics to recompute the output; nothing else.
			for _, s := range p.aux[i] {
				p.keepAt(i, s, at)
			}
		}
		return
	}
	switch nd.Op {
	case graph.OpConv, graph.OpLinear, graph.OpAvgPool, graph.OpAdaptiveAvgPool:
		// Average pools keep their input too: PyTorch's backward kernels
		// take it (for its shape), so its autograd saves it.
		p.keep(i, in(0))
	case graph.OpBatchNorm:
		p.keep(i, in(0))
		for _, s := range p.aux[i] {
			p.keep(i, s)
		}
	case graph.OpABN:
		// inplace_abn's ABN is batch_norm followed by an in-place
		// activation: the input and statistics for the former, the
		// result for the latter.
		p.keep(i, in(0))
		for _, s := range p.aux[i] {
			p.keep(i, s)
		}
		if actOf(nd).Kind != ActIdentity {
			p.keep(i, out)
		}
	case graph.OpInPlaceABN, graph.OpInPlaceABNSync:
		// The output z and the variance; the mean is not needed.
		p.keep(i, out)
		if p.training {
			p.keep(i, p.aux[i][1])
		}
	case graph.OpReLU:
		p.keep(i, out)
	case graph.OpLeakyReLU, graph.OpELU:
		if p.inPlace[i] {
			p.keep(i, out)
		} else {
			p.keep(i, in(0))
		}
	case graph.OpMaxPool:
		p.keep(i, in(0))
		p.keep(i, p.aux[i][0])
	case graph.OpDropout:
		if p.training {
			p.keep(i, p.aux[i][0])
		}
	}
}

// findGroups collects the DenseNet groups marked by Node.Recompute and checks
// that each has the shape the shared buffers rely on.
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
		if len(idx) != 3 {
			return bad(fmt.Sprintf("has %d nodes, want Concat, an ABN-family node and a 1x1 Conv2d", len(idx)))
		}
		cat, abn, conv := g.Nodes[idx[0]], g.Nodes[idx[1]], g.Nodes[idx[2]]
		switch {
		case cat.Op != graph.OpConcat:
			return bad(fmt.Sprintf("first node %s is %s, want Concat", cat.Name, cat.Op))
		case !abn.Op.IsBNFamily():
			return bad(fmt.Sprintf("second node %s is %s, want an ABN-family node", abn.Name, abn.Op))
		case conv.Op != graph.OpConv:
			return bad(fmt.Sprintf("third node %s is %s, want Conv2d", conv.Name, conv.Op))
		case abn.Inputs[0] != cat.Out || conv.Inputs[0] != abn.Out:
			return bad("its nodes do not read one another in a chain")
		case !onlyReader(cat.Out, abn) || !onlyReader(abn.Out, conv):
			return bad(fmt.Sprintf("%s or %s has readers outside the group", cat.Name, abn.Name))
		case cat.Out == g.Output || abn.Out == g.Output:
			return bad("a recomputed value is the graph output")
		}
		gr := &group{name: name, cat: idx[0], abn: idx[1], conv: idx[2]}
		for _, i := range idx {
			p.group[i] = gr
		}
		p.groups = append(p.groups, gr)
	}
	return nil
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
	switch nd.Op {
	case graph.OpInput:
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
	case graph.OpConv:
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
	case graph.OpBatchNorm, graph.OpABN, graph.OpInPlaceABN, graph.OpInPlaceABNSync:
		if err := need4(); err != nil {
			return nil, err
		}
		x := ins[0]
		if a.Features != 0 && x[1] != a.Features {
			return nil, fmt.Errorf("input has %d channels, the layer has %d features", x[1], a.Features)
		}
		if training && x[0]*x[2]*x[3] < 2 {
			return nil, fmt.Errorf("expected more than 1 value per channel when training, got input size %v", x)
		}
		if nd.Op == graph.OpInPlaceABN || nd.Op == graph.OpInPlaceABNSync {
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
	case graph.OpReLU, graph.OpLeakyReLU, graph.OpELU, graph.OpDropout:
		return append([]int(nil), ins[0]...), nil
	case graph.OpAdd:
		for _, s := range ins[1:] {
			if !sameInts(s, ins[0]) {
				return nil, fmt.Errorf("adds shapes %v and %v", ins[0], s)
			}
		}
		return append([]int(nil), ins[0]...), nil
	case graph.OpConcat:
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
	case graph.OpMaxPool, graph.OpAvgPool:
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
	case graph.OpAdaptiveAvgPool:
		if err := need4(); err != nil {
			return nil, err
		}
		x := ins[0]
		if a.OutputSize[0] < 1 || a.OutputSize[1] < 1 {
			return nil, fmt.Errorf("output size %v must be positive", a.OutputSize)
		}
		return []int{x[0], x[1], a.OutputSize[0], a.OutputSize[1]}, nil
	case graph.OpFlatten:
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
	case graph.OpLinear:
		x := ins[0]
		if len(x) != 2 {
			return nil, fmt.Errorf("input has shape %v, want (N, features)", x)
		}
		if a.InChannels != 0 && x[1] != a.InChannels {
			return nil, fmt.Errorf("input has %d features, the layer wants %d", x[1], a.InChannels)
		}
		return []int{x[0], a.OutChannels}, nil
	}
	return nil, fmt.Errorf("unsupported op %q", nd.Op)
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
