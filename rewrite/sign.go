package rewrite

import (
	"fmt"

	"github.com/abnconvert/abnconvert/graph"
)

// A channel's sign can be moved through ops that commute with negation
// channel by channel: concatenation along channels (which only renumbers
// channels) and average pooling (linear). Max pooling does not commute with
// negation, and everything else either mixes channels or is not linear.

// concatAlongChannels reports whether a Concat joins along dimension 1, the
// only concatenation that maps channels to channels.
func concatAlongChannels(n *graph.Node) bool {
	return n.Op == graph.OpConcat && (n.Attr.Axis == 1 || n.Attr.Axis == -3)
}

// channels is v's channel count, from the graph's annotation or, failing
// that, from its producer.
func channels(v *graph.Value) int {
	for depth := 0; v != nil && depth < 1000; depth++ {
		if v.Channels != 0 {
			return v.Channels
		}
		p := v.Producer
		info, _ := p.Op.Info()
		switch info.Channels {
		case graph.ChannelsOut:
			return p.Attr.OutChannels
		case graph.ChannelsFeatures:
			return p.Attr.Features
		case graph.ChannelsSum:
			sum := 0
			for _, in := range p.Inputs {
				c := channels(in)
				if c == 0 {
					return 0
				}
				sum += c
			}
			return sum
		case graph.ChannelsOfInput:
			v = p.Inputs[0]
		default:
			return 0
		}
	}
	return 0
}

// signThrough says whether a sign fold may pass through op (the table's
// SignThrough: the average pools).
func signThrough(op graph.Op) bool {
	info, _ := op.Info()
	return info.SignThrough
}

// traceSource follows channel c of v back to the linear producer that
// computes it, if there is one.
func traceSource(v *graph.Value, c int) (*graph.Node, int, string) {
	for {
		p := v.Producer
		switch {
		case p.Op == graph.OpConv || p.Op == graph.OpLinear:
			return p, c, ""
		case concatAlongChannels(p):
			off, found := 0, false
			for _, in := range p.Inputs {
				n := channels(in)
				if n == 0 {
					return nil, 0, fmt.Sprintf("the channel count of %s, an input of %s, is unknown", in.Name, p.Name)
				}
				if c < off+n {
					v, c, found = in, c-off, true
					break
				}
				off += n
			}
			if !found {
				return nil, 0, fmt.Sprintf("channel %d is beyond the %d channels of %s", c, off, p.Name)
			}
		case signThrough(p.Op):
			v = p.Inputs[0]
		case p.Op == graph.OpMaxPool:
			return nil, 0, fmt.Sprintf("it comes from MaxPool2d %s, which is not sign-symmetric", p.Name)
		default:
			return nil, 0, fmt.Sprintf("it comes from %s %s, which has no weights to take the sign", p.Op, p.Name)
		}
	}
}

// hit is a site's channel that a producer's output channel reaches.
type hit struct {
	s *site
	c int
}

// foldReach follows output channel pc of producer p forward to every reader.
// Negating that channel is only invisible if every reader is a BN site,
// which takes the sign back through its gamma and running mean; it returns
// those sites' channels (valid until the next call), or why the fold is
// impossible (see foldBlocker).
func foldReach(st *State, r *reaches, p *graph.Node, pc int) ([]hit, func() string) {
	info := r.of(p.Out)
	if info.why != nil {
		return nil, func() string { return info.why(pc) }
	}
	hits := r.scratch[:0]
	for _, h := range info.hits {
		hits = append(hits, hit{h.s, pc + h.off})
	}
	r.scratch = hits
	return hits, nil
}

// reaches memoizes, per value, where its channels go: the sites that read
// channel c at channel c+off, in the order a depth-first walk meets them,
// or the first reason (in that order) that no channel of it can be
// negated unseen. Every channel of a value travels the same way, so a
// DenseNet, where one layer's output reaches every later layer of its
// block through the concatenations, is walked once per value rather than
// once per negative channel.
type reaches struct {
	st   *State
	memo map[*graph.Value]*reach
	// scratch holds foldReach's result, which is used up before the next
	// call: a DenseNet channel reaches dozens of sites, for each of
	// thousands of negative channels.
	scratch []hit
}

type reach struct {
	// hits has no repeats: a site reached along two paths at the same
	// channel is one hit (its gamma is negated once), the first met.
	hits []reachHit
	why  func(c int) string // nil when every reader is a site
}

type reachHit struct {
	s   *site
	off int
}

func newReaches(st *State) *reaches { return &reaches{st: st, memo: map[*graph.Value]*reach{}} }

func (r *reaches) of(v *graph.Value) *reach {
	if info, ok := r.memo[v]; ok {
		return info
	}
	info := r.walk(v)
	info.hits = uniqueHits(info.hits)
	r.memo[v] = info
	return info
}

// uniqueHits drops the repeats of hits, keeping the first of each.
func uniqueHits(hits []reachHit) []reachHit {
	seen := make(map[reachHit]bool, len(hits))
	out := hits[:0]
	for _, h := range hits {
		if !seen[h] {
			seen[h] = true
			out = append(out, h)
		}
	}
	return out
}

func (r *reaches) walk(v *graph.Value) *reach {
	info := &reach{}
	fail := func(why func(c int) string) *reach { return &reach{why: why} }
	if r.st.g.IsOutput(v) {
		return fail(func(c int) string { return fmt.Sprintf("channel %d of %s reaches the network output", c, v.Name) })
	}
	// follow adds what the consumer's output reaches, its channels at off
	// more than v's.
	follow := func(out *graph.Value, off int) bool {
		sub := r.of(out)
		if sub.why != nil {
			info = fail(func(c int) string { return sub.why(c + off) })
			return false
		}
		for _, h := range sub.hits {
			info.hits = append(info.hits, reachHit{h.s, h.off + off})
		}
		return true
	}
	for _, n := range uniqueNodes(v.Consumers) {
		switch {
		case r.st.byNode[n] != nil:
			info.hits = append(info.hits, reachHit{r.st.byNode[n], 0})
		case concatAlongChannels(n):
			off := 0
			for _, in := range n.Inputs {
				k := channels(in)
				if k == 0 {
					in, n := in, n
					return fail(func(int) string {
						return fmt.Sprintf("the channel count of %s, an input of %s, is unknown", in.Name, n.Name)
					})
				}
				if in == v && !follow(n.Out, off) {
					return info
				}
				off += k
			}
		case signThrough(n.Op):
			if !follow(n.Out, 0) {
				return info
			}
		default:
			n := n
			return fail(func(c int) string {
				return fmt.Sprintf("channel %d of %s is also read by %s %s, which would see it negated", c, v.Name, n.Op, n.Name)
			})
		}
	}
	return info
}

// foldBlocker is fold-signs' precondition for one producer channel: the
// producer must own its weights, every reader must be a site, and every
// in-place reader must have a negative (or zero) gamma there, because after
// the fold it sees |gamma| and nothing else. Why a fold is blocked is
// returned as a function that says it: the report keeps only the first
// reason per site, and a DenseNet's thousands of negative channels are
// mostly blocked, so formatting each was a large part of the pass.
func foldBlocker(st *State, r *reaches, p *graph.Node, pc int, f *folder) ([]hit, func() string) {
	pk := f.producer(st, p)
	if pk.keys[0] == "" {
		return nil, func() string { return fmt.Sprintf("%s %s has no weight parameter", p.Op, p.Name) }
	}
	// The reasons are made by functions of their own, so that the
	// closures capture these functions' parameters, allocated when a
	// reason is made, and not the loops' variables, which a closure
	// capturing them would allocate at every turn.
	for i, key := range pk.keys {
		if key == "" {
			continue
		}
		if pc >= pk.dims[i] {
			return nil, noChannel(p, key, pc)
		}
		if pk.users[i] > 1 {
			return nil, shared(p, key)
		}
	}
	hits, why := foldReach(st, r, p, pc)
	if why != nil {
		return nil, why
	}
	for _, h := range hits {
		gamma, err := f.site(st, h.s).gammaOf(st)
		if err != nil || h.c >= len(gamma) {
			// The graph's channel counts disagree with the parameters:
			// leave the channel alone rather than negate the wrong one.
			return nil, mapsOutside(p, pc, h)
		}
		if g := gamma[h.c]; h.s.inPlace() && g > 0 {
			return nil, positiveGamma(p, pc, h, g)
		}
	}
	return hits, nil
}

func noChannel(p *graph.Node, key string, pc int) func() string {
	return func() string {
		return fmt.Sprintf("%s %s: parameter %q has no output channel %d", p.Op, p.Name, key, pc)
	}
}

func shared(p *graph.Node, key string) func() string {
	return func() string { return fmt.Sprintf("%s %s shares parameter %q with another node", p.Op, p.Name, key) }
}

func mapsOutside(p *graph.Node, pc int, h hit) func() string {
	return func() string {
		return fmt.Sprintf("channel %d of %s maps to channel %d of %s, which it does not have", pc, p.Name, h.c, h.s.bn.Name)
	}
}

func positiveGamma(p *graph.Node, pc int, h hit, g float64) func() string {
	return func() string {
		return fmt.Sprintf("channel %d of %s also feeds channel %d of %s, whose gamma %.4g is positive", pc, p.Name, h.c, h.s.bn.Name, g)
	}
}

// folder is what fold-signs looks up once per producer and per site
// rather than once per negative channel: a trained network has thousands
// of them (resnext101_32x8d about 16,000), each of which cost a dozen
// lookups by parameter name (the hash of a long key each), most of the
// pass's 11 ms, on the path before a trained checkpoint's copy starts
// (the rewrite as a whole went from 22.8 ms to 14.7).
// What it holds stays valid for the pass: the vectors it hands out are
// the cache's, which only flush drops.
type folder struct {
	users  map[string]int // how many nodes use each parameter
	prods  map[*graph.Node]*producerKeys
	sites  map[*site]*siteVecs
	lastP  *graph.Node // the previous lookup, most often asked again
	lastPK *producerKeys
	lastS  *site
	lastSV *siteVecs
}

// foldRoles are the producer parameters a fold negates, in its order.
var foldRoles = [2]string{graph.RoleWeight, graph.RoleBias}

// siteRoles are the site vectors a fold negates, in its order.
var siteRoles = [2]string{graph.RoleWeight, graph.RoleRunningMean}

// producerKeys is a producer's parameters (foldRoles; "" where it has
// none), each one's dim 0 (0 for a missing or scalar tensor: no channel is
// below it) and users, and its queued negations, made on first need.
type producerKeys struct {
	keys  [2]string
	dims  [2]int
	users [2]int
	neg   [2]*sliceNegation
	// blocked is why each output channel cannot be folded, once found
	// (nil: not asked, or foldable), indexed by channel: a map keyed by
	// (producer, channel), hashed for each of densenet201 trained's
	// 2,000 negative channels, made the pass 0.3 ms slower (4.49 ms
	// against 4.20, median of 6 BenchmarkAnalysis runs alternated).
	blocked []func() string
}

func (pk *producerKeys) blockedAt(pc int) func() string {
	if pc < len(pk.blocked) {
		return pk.blocked[pc]
	}
	return nil
}

func (pk *producerKeys) setBlocked(pc int, why func() string) {
	if pc >= len(pk.blocked) {
		pk.blocked = append(pk.blocked, make([]func() string, pc+1-len(pk.blocked))...)
	}
	pk.blocked[pc] = why
}

// siteVecs is a site's gamma (with the error reading it) and the
// negations of its siteRoles vectors, made on first need.
type siteVecs struct {
	s        *site
	read     bool
	gamma    []float64
	gammaErr error
	neg      [2]*vecNegation
}

func newFolder(st *State) *folder {
	n := 0
	for _, nd := range st.g.Nodes {
		n += len(nd.Params)
	}
	// Sized once: grown from empty they were rehashed as they filled.
	f := &folder{users: make(map[string]int, n), prods: map[*graph.Node]*producerKeys{}, sites: make(map[*site]*siteVecs, len(st.sites))}
	for _, n := range st.g.Nodes {
		for _, k := range n.Params {
			f.users[k]++
		}
	}
	return f
}

func (f *folder) producer(st *State, p *graph.Node) *producerKeys {
	if p == f.lastP {
		return f.lastPK
	}
	pk := f.prods[p]
	if pk == nil {
		pk = &producerKeys{}
		for i, role := range foldRoles {
			key := p.Params[role]
			pk.keys[i] = key
			if key == "" {
				continue
			}
			if shape, ok := st.w.Shape(key); ok && len(shape) > 0 {
				pk.dims[i] = shape[0]
			}
			pk.users[i] = f.users[key]
		}
		f.prods[p] = pk
	}
	f.lastP, f.lastPK = p, pk
	return pk
}

func (f *folder) site(st *State, s *site) *siteVecs {
	if s == f.lastS {
		return f.lastSV
	}
	sv := f.sites[s]
	if sv == nil {
		sv = &siteVecs{s: s}
		f.sites[s] = sv
	}
	f.lastS, f.lastSV = s, sv
	return sv
}

// gammaOf is the site's cached gamma, read once (a failed read is tried
// no more: the cache keeps no failure, and reading again fails again).
func (sv *siteVecs) gammaOf(st *State) ([]float64, error) {
	if !sv.read {
		sv.gamma, sv.gammaErr = st.t.vec(sv.s.key(graph.RoleWeight))
		sv.read = true
	}
	return sv.gamma, sv.gammaErr
}

// foldSigns makes negative gammas of in-place sites positive by negating the
// producing channel: weight[pc, ...] and bias[pc] of the convolution, and
// gamma and running_mean at every site that reads the channel, so that
// (-x - (-mu)) / sigma * (-gamma) + beta is what the BN computed before.
func foldSigns(st *State) error {
	f := newFolder(st)
	reach := newReaches(st)
	for _, s := range st.sites {
		if !s.inPlace() {
			continue
		}
		gamma, err := f.site(st, s).gammaOf(st)
		if err != nil {
			return fmt.Errorf("node %s: %w", s.bn.Name, err)
		}
		// gamma is the cached vector: folds below update it as they go.
		for c := range gamma {
			if !(gamma[c] < 0) {
				continue
			}
			p, pc, why := traceSource(s.bn.Inputs[0], c)
			if p == nil {
				s.block(c, func() string { return why })
				continue
			}
			pk := f.producer(st, p)
			if why := pk.blockedAt(pc); why != nil {
				s.block(c, why)
				continue
			}
			hits, blocker := foldBlocker(st, reach, p, pc, f)
			if blocker != nil {
				pk.setBlocked(pc, blocker)
				s.block(c, blocker)
				continue
			}
			if err := fold(st, p, pc, hits, f); err != nil {
				return err
			}
		}
	}
	return nil
}

// fold is fold-signs' action.
func fold(st *State, p *graph.Node, pc int, hits []hit, f *folder) error {
	pk := f.producer(st, p)
	for i, key := range pk.keys {
		if key == "" {
			continue
		}
		if pk.neg[i] == nil {
			pk.neg[i] = st.t.sliceNegation(key)
		}
		if err := pk.neg[i].toggle(pc); err != nil {
			return fmt.Errorf("node %s: %w", p.Name, err)
		}
	}
	for _, h := range hits {
		sv := f.site(st, h.s)
		for i, role := range siteRoles {
			if sv.neg[i] == nil {
				n, err := st.t.vecNegation(h.s.key(role))
				if err != nil {
					return fmt.Errorf("node %s: %w", h.s.bn.Name, err)
				}
				sv.neg[i] = n
			}
			if err := sv.neg[i].negate(h.c); err != nil {
				return fmt.Errorf("node %s: %w", h.s.bn.Name, err)
			}
		}
		h.s.folded = append(h.s.folded, h.c)
		if !contains(h.s.into, p.Name) {
			h.s.into = append(h.s.into, p.Name)
		}
	}
	return nil
}

// block remembers why channel c could not be folded, for the report.
func (s *site) block(c int, why func() string) {
	if s.note == "" {
		s.note = fmt.Sprintf("channel %d not folded: %s", c, why())
	}
}

// flipSigns takes the negative channels folding left. InPlace-ABN overwrites
// its input anyway, so multiplying that input by a +1/-1 vector in place
// first costs no memory and keeps the layer exact, with gamma and
// running_mean negated on those channels. The input must be private to the
// site, which is the in-place precondition again; where it is not, the site
// falls back to ABN.
func flipSigns(st *State) error {
	for _, s := range st.sites {
		if !s.inPlace() {
			continue
		}
		gamma, err := st.t.vec(s.key(graph.RoleWeight))
		if err != nil {
			return fmt.Errorf("node %s: %w", s.bn.Name, err)
		}
		var neg []int
		for c, v := range gamma {
			if v < 0 {
				neg = append(neg, c)
			}
		}
		if len(neg) == 0 {
			continue
		}
		if why := inPlaceBlocker(st.g, s.bn); why != "" {
			s.fallBack(fmt.Sprintf("channels %v have negative gamma that could not be folded (%s), and the input cannot be flipped in place: %s", neg, s.note, why))
			continue
		}
		if err := flip(st, s, neg); err != nil {
			return err
		}
	}
	return nil
}

// flip is flip-signs' action: record the sign vector on the node and negate
// gamma and running_mean on the flipped channels.
func flip(st *State, s *site, neg []int) error {
	sign := s.bn.Sign
	if sign == nil {
		sign = make([]int8, s.bn.Attr.Features)
		for i := range sign {
			sign[i] = 1
		}
	}
	for _, c := range neg {
		sign[c] = -sign[c]
	}
	// neg comes from gamma's own indices, so only a running_mean shorter
	// than gamma can fail, at the first channel past its end either way.
	for _, role := range []string{graph.RoleWeight, graph.RoleRunningMean} {
		if err := st.t.negateVecAt(s.key(role), neg); err != nil {
			return fmt.Errorf("node %s: %w", s.bn.Name, err)
		}
	}
	s.bn.Sign = sign
	s.flipped = neg
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
