package emit

import (
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/abnconvert/abnconvert/failure"
	"github.com/abnconvert/abnconvert/graph"
)

// layer is a node that owns a PyTorch module: its place in the module tree
// and the constructor call that builds it.
type layer struct {
	node *graph.Node
	path string
	ctor string
	// sign is the hex mask of the node's negated input channels, "" when none.
	sign  string
	flips int
}

// step is one statement of forward: a single node, or a recompute group run
// as one function.
type step struct {
	group string
	nodes []*graph.Node
	// ins are the values the step reads from outside itself, in first-read
	// order: the group function's parameters.
	ins []*graph.Value
	// outs are the values of the step that later steps read (or that the
	// graph returns), in production order.
	outs []*graph.Value
}

// program is everything the renderer needs, computed and checked up front so
// that rendering cannot fail half way.
type program struct {
	g       *graph.Graph
	opt     Options
	layers  []*layer
	byNode  map[*graph.Node]*layer
	steps   []*step
	vars    map[*graph.Value]string
	dels    [][]*graph.Value // dels[i]: values dead after step i
	inPlace int              // InPlaceABN(Sync) layers
	// residuals counts the InPlaceABN layers that add a residual
	// (graph.Node.Residual): computed by _inplace_abn_add.
	residuals int
	signed    int // layers with a sign flip
	groups    int // recompute groups
}

// rolesFor is the roles a parameter-owning op may carry (the op table's
// Params); anything else would put a key in the checkpoint that the module
// does not have.
func rolesFor(op graph.Op) []string {
	info, _ := op.Info()
	return info.Params.Roles()
}

// ownsModule says whether op is a module of the emitted network: one that
// owns parameters.
func ownsModule(op graph.Op) bool {
	info, _ := op.Info()
	return info.Params != graph.ParamsNone
}

func isInPlace(op graph.Op) bool { return op == graph.OpInPlaceABN || op == graph.OpInPlaceABNSync }

// moduleAttrs are attribute names of torch.nn.Module: add_module refuses a
// child of that name, so a module path segment spelled so cannot be built.
var moduleAttrs = map[string]bool{}

func init() {
	for _, s := range strings.Fields(`T_destination add_module apply bfloat16 buffers children
		compile cpu cuda double dump_patches eval extra_repr float forward get_buffer
		get_extra_state get_parameter get_submodule half ipu load_state_dict modules mtia
		named_buffers named_children named_modules named_parameters parameters
		register_backward_hook register_buffer register_forward_hook register_forward_pre_hook
		register_full_backward_hook register_full_backward_pre_hook register_load_state_dict_post_hook
		register_load_state_dict_pre_hook register_module register_parameter
		register_state_dict_post_hook register_state_dict_pre_hook requires_grad_
		set_extra_state set_submodule share_memory state_dict to to_empty train training type xpu
		zero_grad call_super_init`) {
		moduleAttrs[s] = true
	}
}

func plan(g *graph.Graph, opt Options) (*program, error) {
	p := &program{g: g, opt: opt, byNode: map[*graph.Node]*layer{}, vars: map[*graph.Value]string{}}
	if err := p.planLayers(); err != nil {
		return nil, err
	}
	if err := p.planSteps(); err != nil {
		return nil, err
	}
	p.planNames()
	return p, nil
}

func (p *program) planLayers() error {
	paths := map[string]*graph.Node{}
	for i, n := range p.g.Nodes {
		if !utf8.ValidString(n.Name) {
			return fmt.Errorf("node %q: name is not valid UTF-8", n.Name)
		}
		if n.Op == graph.OpInput {
			continue
		}
		if i == 0 || n.Op == "" {
			return fmt.Errorf("node %q: unexpected op %q", n.Name, n.Op)
		}
		if !ownsModule(n.Op) {
			if len(n.Params) != 0 {
				return fmt.Errorf("node %q (%s): has parameters but the op takes none", n.Name, n.Op)
			}
			if n.Sign != nil {
				return fmt.Errorf("node %q (%s): a sign vector belongs on a BN-family node", n.Name, n.Op)
			}
			if err := checkParamless(n); err != nil {
				return fmt.Errorf("node %q (%s): %w", n.Name, n.Op, err)
			}
			continue
		}
		l, err := newLayer(n)
		if err != nil {
			return fmt.Errorf("node %q (%s): %w", n.Name, n.Op, err)
		}
		if prev, dup := paths[l.path]; dup {
			return fmt.Errorf("nodes %q and %q both own module %q", prev.Name, n.Name, l.path)
		}
		paths[l.path] = n
		p.layers = append(p.layers, l)
		p.byNode[n] = l
		if isInPlace(n.Op) {
			p.inPlace++
		}
		if n.Residual() != nil {
			p.residuals++
		}
		if l.sign != "" {
			p.signed++
		}
	}
	// A module path cannot be both a layer and a container of another layer.
	for path, n := range paths {
		for i := strings.IndexByte(path, '.'); i >= 0; i = nextDot(path, i) {
			if m, clash := paths[path[:i]]; clash {
				return fmt.Errorf("node %q owns module %q, inside node %q's module %q", n.Name, path, m.Name, path[:i])
			}
		}
	}
	return nil
}

func nextDot(s string, i int) int {
	j := strings.IndexByte(s[i+1:], '.')
	if j < 0 {
		return -1
	}
	return i + 1 + j
}

// modulePath is the state-dict prefix shared by all of a node's keys.
func modulePath(n *graph.Node) (string, error) {
	allowed := map[string]bool{}
	for _, r := range rolesFor(n.Op) {
		allowed[r] = true
	}
	roles := make([]string, 0, len(n.Params))
	for r := range n.Params {
		roles = append(roles, r)
	}
	sort.Strings(roles)
	path := ""
	for _, r := range roles {
		key := n.Params[r]
		if !allowed[r] {
			return "", fmt.Errorf("parameter role %q (key %q) does not exist on this module", r, key)
		}
		suffix := "." + r
		if !strings.HasSuffix(key, suffix) || len(key) == len(suffix) {
			return "", fmt.Errorf("key %q does not end in %q after a module path", key, suffix)
		}
		prefix := strings.TrimSuffix(key, suffix)
		if path != "" && prefix != path {
			return "", fmt.Errorf("keys %q and %q name different modules", n.Params[roles[0]], key)
		}
		path = prefix
	}
	if path == "" {
		// A parameterless norm (affine=False, no running statistics) still
		// needs a place in the tree: its node name.
		path = n.Name
	}
	if !utf8.ValidString(path) {
		return "", fmt.Errorf("module path %q is not valid UTF-8", path)
	}
	for _, seg := range strings.Split(path, ".") {
		if seg == "" {
			return "", fmt.Errorf("module path %q has an empty segment", path)
		}
		if moduleAttrs[seg] || strings.HasPrefix(seg, "__") {
			return "", fmt.Errorf("module path %q: segment %q is an attribute of torch.nn.Module and cannot name a child", path, seg)
		}
	}
	return path, nil
}

func newLayer(n *graph.Node) (*layer, error) {
	path, err := modulePath(n)
	if err != nil {
		return nil, err
	}
	l := &layer{node: n, path: path}
	a := n.Attr
	_, hasBias := n.Params[graph.RoleBias]
	switch {
	case n.Op == graph.OpConv:
		if _, ok := n.Params[graph.RoleWeight]; !ok {
			return nil, fmt.Errorf("no weight key")
		}
		if hasBias != a.Bias {
			return nil, fmt.Errorf("attribute bias=%v but bias key present=%v", a.Bias, hasBias)
		}
		groups := orOne(a.Groups)
		if a.InChannels <= 0 || a.OutChannels <= 0 || a.InChannels%groups != 0 || a.OutChannels%groups != 0 {
			return nil, fmt.Errorf("channels %d->%d do not fit %d groups", a.InChannels, a.OutChannels, groups)
		}
		if a.KernelSize[0] <= 0 || a.KernelSize[1] <= 0 || a.Padding[0] < 0 || a.Padding[1] < 0 ||
			a.Stride[0] < 0 || a.Stride[1] < 0 || a.Dilation[0] < 0 || a.Dilation[1] < 0 {
			return nil, fmt.Errorf("bad geometry k%v s%v p%v d%v", a.KernelSize, a.Stride, a.Padding, a.Dilation)
		}
		// Zero stride or dilation means "not set": PyTorch's default is 1.
		l.ctor = fmt.Sprintf("torch.nn.Conv2d(%d, %d, kernel_size=%s, stride=%s, padding=%s, dilation=%s, groups=%d, bias=%s)",
			a.InChannels, a.OutChannels, pyPair(a.KernelSize), pyPair(pairOrOne(a.Stride)), pyPair(a.Padding),
			pyPair(pairOrOne(a.Dilation)), groups, pyBool(hasBias))
	case n.Op == graph.OpLinear:
		if _, ok := n.Params[graph.RoleWeight]; !ok {
			return nil, fmt.Errorf("no weight key")
		}
		if hasBias != a.Bias {
			return nil, fmt.Errorf("attribute bias=%v but bias key present=%v", a.Bias, hasBias)
		}
		if a.InChannels <= 0 || a.OutChannels <= 0 {
			return nil, fmt.Errorf("bad features %d->%d", a.InChannels, a.OutChannels)
		}
		l.ctor = fmt.Sprintf("torch.nn.Linear(%d, %d, bias=%s)", a.InChannels, a.OutChannels, pyBool(hasBias))
	default: // BN family
		ctor, err := normCtor(n)
		if err != nil {
			return nil, err
		}
		l.ctor = ctor
		if n.Sign != nil {
			if len(n.Sign) != a.Features {
				return nil, fmt.Errorf("sign vector has %d entries for %d features", len(n.Sign), a.Features)
			}
			mask, flips, err := signMask(n.Sign)
			if err != nil {
				return nil, err
			}
			// An all-positive vector is a no-op: emit nothing for it.
			if flips > 0 {
				l.sign, l.flips = mask, flips
			}
		}
	}
	return l, nil
}

func normCtor(n *graph.Node) (string, error) {
	a := n.Attr
	has := func(r string) bool { _, ok := n.Params[r]; return ok }
	affine := has(graph.RoleWeight)
	if affine != has(graph.RoleBias) {
		return "", fmt.Errorf("weight and bias keys must come together")
	}
	track := has(graph.RoleRunningMean)
	if track != has(graph.RoleRunningVar) {
		return "", fmt.Errorf("running_mean and running_var keys must come together")
	}
	if !track && has(graph.RoleNumBatches) {
		return "", fmt.Errorf("num_batches_tracked without running statistics")
	}
	if a.Features <= 0 {
		return "", fmt.Errorf("features %d", a.Features)
	}
	// Zero eps is what a builder that forgot to set it leaves behind; no
	// trained network uses it.
	if !(a.Eps > 0) {
		return "", fmt.Errorf("eps %g must be positive", a.Eps)
	}
	momentum := "None"
	if !a.MomentumNone {
		if !(a.Momentum >= 0 && a.Momentum <= 1) {
			return "", fmt.Errorf("momentum %g outside [0, 1]", a.Momentum)
		}
		momentum = pyFloat(a.Momentum)
	}
	args := fmt.Sprintf("%d, eps=%s, momentum=%s", a.Features, pyFloat(a.Eps), momentum)
	if !affine {
		args += ", affine=False"
	}
	if !track {
		args += ", track_running_stats=False"
	}
	if n.Op == graph.OpBatchNorm {
		return bnClass(n) + "(" + args + ")", nil
	}
	if err := checkActivation(n); err != nil {
		return "", err
	}
	return fmt.Sprintf("inplace_abn.%s(%s, activation=%s, activation_param=%s)",
		n.Op, args, pyStr(a.Activation), pyFloat(a.ActParam)), nil
}

// checkActivation refuses at conversion time what would fail only later, at
// forward or backward time: relu in an in-place layer (not invertible), and
// a leaky slope or ELU alpha that its backward pass would divide by, or
// that torch's in-place backward refuses (a negative one).
func checkActivation(n *graph.Node) error {
	a := n.Attr
	switch a.Activation {
	case graph.ActReLU, graph.ActIdentity:
	case graph.ActLeakyReLU, graph.ActELU:
		// The backward pass tells the negative side by the sign of the
		// output and divides by the parameter: it must be positive.
		if isInPlace(n.Op) && !(a.ActParam > 0) {
			return fmt.Errorf("%s(%g) cannot be inverted in the backward pass", a.Activation, a.ActParam)
		}
		// inplace_abn's ABN runs its activation in place too (1.1.0:
		// F.leaky_relu(x, slope, inplace=True)), and torch refuses that
		// backward for a negative parameter. The rewrite keeps such an
		// activation out of place after an identity BN.
		if !(a.ActParam >= 0) {
			return fmt.Errorf("%s(%g): %s applies its activation in place, and torch has no in-place backward for %s below 0 (keep the activation as its own node after an identity %s)",
				a.Activation, a.ActParam, n.Op, paramName(a.Activation), n.Op)
		}
	default:
		return fmt.Errorf("unknown activation %q", a.Activation)
	}
	if a.Activation == graph.ActReLU && isInPlace(n.Op) {
		return fmt.Errorf("activation relu is not invertible, %s refuses it (use ABN, or leaky_relu)", n.Op)
	}
	return nil
}

func checkParamless(n *graph.Node) error {
	a := n.Attr
	info, _ := n.Op.Info()
	switch n.Op {
	case graph.OpLeakyReLU, graph.OpELU, graph.OpAdd, graph.OpConcat, graph.OpFlatten:
	case graph.OpHardtanh, graph.OpHardsigmoid, graph.OpCELU, graph.OpSoftplus:
		// The runtime refuses the same attributes with the same words.
		return info.Check(a)
	case graph.OpMaxPool, graph.OpAvgPool:
		if a.KernelSize[0] <= 0 || a.KernelSize[1] <= 0 || a.Padding[0] < 0 || a.Padding[1] < 0 ||
			a.Stride[0] < 0 || a.Stride[1] < 0 || a.Dilation[0] < 0 || a.Dilation[1] < 0 {
			return fmt.Errorf("bad geometry k%v s%v p%v d%v", a.KernelSize, a.Stride, a.Padding, a.Dilation)
		}
		if n.Op == graph.OpAvgPool && (a.Dilation[0] > 1 || a.Dilation[1] > 1) {
			return fmt.Errorf("average pooling has no dilation")
		}
	case graph.OpAdaptiveAvgPool:
		if a.OutputSize[0] <= 0 || a.OutputSize[1] <= 0 {
			return fmt.Errorf("bad output size %v", a.OutputSize)
		}
	case graph.OpDropout, graph.OpStochasticDepth:
		if !(a.P >= 0 && a.P <= 1) {
			return fmt.Errorf("%s probability %g outside [0, 1]", n.Op, a.P)
		}
		if n.Op == graph.OpStochasticDepth && a.Mode != "" && a.Mode != graph.StochasticBatch {
			return fmt.Errorf("StochasticDepth mode %q: want row or batch", a.Mode)
		}
	case graph.OpResize:
		if a.Mode != "nearest" && a.Mode != "bilinear" {
			return fmt.Errorf("resize mode %q: want nearest or bilinear", a.Mode)
		}
		if a.Mode == "nearest" && a.AlignCorners {
			return fmt.Errorf("nearest resizing has no align_corners")
		}
	default:
		switch {
		case info.Python != "":
			// Written from the table's expression: no attributes.
		case isLayout(n.Op):
			return checkLayout(n)
		default:
			return failure.Unsupportedf("op %s not supported by the Python emitter", n.Op)
		}
	}
	return nil
}

func orOne(v int) int {
	if v == 0 {
		return 1
	}
	return v
}

func pairOrOne(p [2]int) [2]int { return [2]int{orOne(p[0]), orOne(p[1])} }

// planSteps orders forward's statements. A recompute group becomes one step,
// placed at its last member: by then every value it reads exists. Its values
// must not be read by any node before that point, or the step would be late.
func (p *program) planSteps() error {
	index := map[*graph.Node]int{}
	members := map[string][]*graph.Node{}
	last := map[string]int{}
	for i, n := range p.g.Nodes {
		index[n] = i
		if n.Recompute != "" && !p.opt.NoRecompute {
			if n.Op == graph.OpInput {
				return fmt.Errorf("recompute group %q: the graph input cannot be part of it", n.Recompute)
			}
			members[n.Recompute] = append(members[n.Recompute], n)
			last[n.Recompute] = i
		}
	}
	for i, n := range p.g.Nodes {
		switch {
		case n.Op == graph.OpInput:
		case n.Recompute == "" || p.opt.NoRecompute:
			p.steps = append(p.steps, &step{nodes: []*graph.Node{n}, ins: dedup(n.Inputs), outs: []*graph.Value{n.Out}})
		case last[n.Recompute] == i:
			s, err := p.groupStep(n.Recompute, members[n.Recompute], index, i)
			if err != nil {
				return fmt.Errorf("recompute group %q: %w", n.Recompute, err)
			}
			p.steps = append(p.steps, s)
			p.groups++
		}
	}
	return nil
}

func (p *program) groupStep(name string, nodes []*graph.Node, index map[*graph.Node]int, at int) (*step, error) {
	s := &step{group: name, nodes: nodes}
	inside := map[*graph.Node]bool{}
	for _, n := range nodes {
		inside[n] = true
	}
	seen := map[*graph.Value]bool{}
	for _, n := range nodes {
		for _, v := range n.Inputs {
			if !inside[v.Producer] && !seen[v] {
				seen[v] = true
				s.ins = append(s.ins, v)
			}
		}
	}
	for _, n := range nodes {
		leaves := p.g.IsOutput(n.Out)
		for _, c := range n.Out.Consumers {
			if inside[c] {
				continue
			}
			if index[c] < at {
				return nil, fmt.Errorf("node %q reads %q before the group's last member %q", c.Name, n.Name, p.g.Nodes[at].Name)
			}
			leaves = true
		}
		if leaves {
			s.outs = append(s.outs, n.Out)
		}
	}
	if len(s.outs) == 0 {
		return nil, fmt.Errorf("no value of the group is used")
	}
	if len(s.ins) == 0 {
		return nil, fmt.Errorf("the group reads nothing from outside it")
	}
	return s, nil
}

func dedup(vs []*graph.Value) []*graph.Value {
	var out []*graph.Value
	seen := map[*graph.Value]bool{}
	for _, v := range vs {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}

// planNames numbers every value in production order and computes, for each
// step, the values it is the last reader of: forward deletes them there, so
// that a value lives in Python no longer than in the graph (autograd keeps
// what it saved regardless).
func (p *program) planNames() {
	p.vars[p.g.Input] = "x"
	k := 0
	for _, n := range p.g.Nodes {
		if n.Op != graph.OpInput {
			k++
			p.vars[n.Out] = fmt.Sprintf("x%d", k)
		}
	}
	lastUse := map[*graph.Value]int{}
	for i, s := range p.steps {
		for _, v := range s.ins {
			lastUse[v] = i
		}
		for _, v := range s.outs {
			if _, read := lastUse[v]; !read {
				lastUse[v] = i // never read: dead right after it is made
			}
		}
	}
	p.dels = make([][]*graph.Value, len(p.steps))
	for _, v := range append([]*graph.Value{p.g.Input}, p.values()...) {
		i, ok := lastUse[v]
		if ok && !p.g.IsOutput(v) {
			p.dels[i] = append(p.dels[i], v)
		}
	}
}

// values lists every node output in production order.
func (p *program) values() []*graph.Value {
	var vs []*graph.Value
	for _, n := range p.g.Nodes {
		if n.Op != graph.OpInput {
			vs = append(vs, n.Out)
		}
	}
	return vs
}

// private reports whether an in-place operation may overwrite v: v must be
// read by one node only, and its producer must not need it in its own
// backward pass or share its storage with another value (the op table's
// saves rule and View): torch.relu and torch.sigmoid keep their result for
// backward, and so do the in-place layers and ABN's in-place activation;
// flatten, reshape, slice and dropout (in eval) may return a view of their
// input.
func private(v *graph.Value, g *graph.Graph) bool {
	if v == g.Input || len(v.Consumers) != 1 {
		return false
	}
	n := v.Producer
	info, _ := n.Op.Info()
	switch {
	case info.View, info.Saves == graph.SaveOutput, info.Saves == graph.SaveInPlaceABN:
		return false
	case info.Saves == graph.SaveABN:
		return n.Attr.Activation == graph.ActIdentity
	}
	return true
}

// paramName is what PyTorch calls the parameter of activation act.
func paramName(act string) string {
	if act == graph.ActELU {
		return "alpha"
	}
	return "negative_slope"
}
