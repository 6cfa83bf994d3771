package runtime

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"sync"

	"github.com/abnconvert/abnconvert/graph"
)

// Checkpointing selects how gradient checkpointing cuts a graph into
// segments. Within a segment the forward pass keeps nothing for backward
// (but the batch statistics of BN layers, a few bytes per channel, which
// the recomputation reuses so that running statistics are updated once);
// the segment's inputs are kept instead, and the backward pass reruns the
// segment's forward from them just before it needs what the segment would
// have kept.
type Checkpointing string

const (
	// NoCheckpointing keeps everything, as an ordinary training step does.
	NoCheckpointing Checkpointing = ""
	// CheckpointBlocks makes one segment per block of the network, read
	// from the module paths of its nodes: a residual block (layerN.M), a
	// dense layer (denseblockN.denselayerM) or a transition (transitionN)
	// of a DenseNet. A network with none of these (VGG) is cut into its
	// convolution stages: the nodes up to and including each max pool.
	// Nodes outside every block (stem, head) are not checkpointed.
	CheckpointBlocks Checkpointing = "blocks"
	// CheckpointSqrt is the sqrt(n) schedule of Chen et al. 2016 ("Training
	// deep nets with sublinear memory cost"): the n nodes after the input
	// are cut into ceil(sqrt(n)) segments of about equal length, each cut
	// at the candidate split point nearest its target. As in the paper,
	// candidates are the nodes whose output is the only value that crosses
	// the cut (so every segment has a single input, as
	// torch.utils.checkpoint_sequential needs), except a node whose output
	// the next node overwrites in place.
	CheckpointSqrt Checkpointing = "sqrt"
)

// ParseCheckpointing reads "", "none", "blocks" or "sqrt".
func ParseCheckpointing(s string) (Checkpointing, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "none":
		return NoCheckpointing, nil
	case "blocks":
		return CheckpointBlocks, nil
	case "sqrt":
		return CheckpointSqrt, nil
	}
	return "", fmt.Errorf("checkpointing %q: want none, blocks or sqrt", s)
}

// Segment is one checkpoint segment: the nodes Start..End (indices into
// graph.Nodes, inclusive), named First..Last.
type Segment struct {
	Start int    `json:"start"`
	End   int    `json:"end"`
	First string `json:"first"`
	Last  string `json:"last"`
	// Inputs names the values the segment reads from before it: what the
	// forward pass keeps in its stead.
	Inputs []string `json:"inputs"`
}

// ErrNoBlocks is returned by Segments when a graph has no blocks to
// checkpoint.
var ErrNoBlocks = errors.New("no blocks to checkpoint")

// blockPattern finds the block a node belongs to in its module path:
// torchvision's residual blocks (layerN.M, also in segmentation backbones),
// dense layers and transitions, EfficientNet's blocks (features.N.M: stage
// N, block M) and MobileNet's (features.N), MNASNet's stacks (layers.N.M),
// RegNet's (trunk_output.blockN.blockN-M), ShuffleNet's (stageN.M), and
// GoogLeNet's and Inception's modules (inception3a, Mixed_5b). Compiled
// on first need, not at start: it was most of this package's init, which
// every run of the command pays (about 0.1 ms), a conversion included.
var blockPattern = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`(?:^|\.)(?:layer\d+\.\d+|denseblock\d+\.denselayer\d+|transition\d+|features\.\d+\.\d+\.block|features\.\d+\.(?:conv|block)|layers\.\d+\.\d+|trunk_output\.block\d+\.block\d+-\d+|stage\d+\.\d+|inception\d[a-z]|Mixed_\d[a-z])(?:[.:]|$)`)
})

// blockOf returns the module path of the block node name lies in, "" when
// none.
func blockOf(name string) string {
	loc := blockPattern().FindStringIndex(name)
	if loc == nil {
		return ""
	}
	return strings.TrimRight(name[:loc[1]], ".:")
}

// Segments lists the checkpoint segments policy c makes of g; nil for
// NoCheckpointing.
func Segments(g *graph.Graph, c Checkpointing) ([]Segment, error) {
	if g == nil || len(g.Nodes) < 2 {
		return nil, errors.New("runtime: checkpointing needs a graph with nodes")
	}
	var ranges [][2]int
	switch c {
	case NoCheckpointing:
		return nil, nil
	case CheckpointBlocks:
		ranges = blockRanges(g)
		if len(ranges) == 0 {
			return nil, fmt.Errorf("runtime: %s: %w (no residual blocks, dense layers, transitions or max pools)", g.Arch, ErrNoBlocks)
		}
	case CheckpointSqrt:
		ranges = sqrtRanges(g)
	default:
		return nil, fmt.Errorf("runtime: unknown checkpointing %q", c)
	}
	ranges = keepGroups(g, ranges)
	index := map[*graph.Node]int{}
	for i, n := range g.Nodes {
		index[n] = i
	}
	out := make([]Segment, len(ranges))
	for k, r := range ranges {
		s := Segment{Start: r[0], End: r[1], First: g.Nodes[r[0]].Name, Last: g.Nodes[r[1]].Name}
		seen := map[*graph.Value]bool{}
		for i := r[0]; i <= r[1]; i++ {
			for _, in := range g.Nodes[i].Inputs {
				if index[in.Producer] < r[0] && !seen[in] {
					seen[in] = true
					s.Inputs = append(s.Inputs, in.Name)
				}
			}
		}
		out[k] = s
	}
	return out, nil
}

func blockRanges(g *graph.Graph) [][2]int {
	var out [][2]int
	cur := ""
	for i := 1; i < len(g.Nodes); i++ {
		b := blockOf(g.Nodes[i].Name)
		switch {
		case b == "":
		case b == cur && len(out) > 0 && out[len(out)-1][1] == i-1:
			out[len(out)-1][1] = i
		default:
			out = append(out, [2]int{i, i})
		}
		cur = b
	}
	if len(out) > 0 {
		return out
	}
	// No module paths to go by: convolution stages, up to each max pool.
	start := 1
	for i := 1; i < len(g.Nodes); i++ {
		if g.Nodes[i].Op == graph.OpMaxPool {
			out = append(out, [2]int{start, i})
			start = i + 1
		}
	}
	return out
}

func sqrtRanges(g *graph.Graph) [][2]int {
	n := len(g.Nodes) - 1
	index := map[*graph.Node]int{}
	for i, nd := range g.Nodes {
		index[nd] = i
	}
	// lastUse of a node's output: its last reader, past the end for the
	// graph output.
	lastUse := make([]int, len(g.Nodes))
	for i, nd := range g.Nodes {
		lastUse[i] = i
		for _, c := range nd.Out.Consumers {
			lastUse[i] = max(lastUse[i], index[c])
		}
		if g.IsOutput(nd.Out) {
			lastUse[i] = len(g.Nodes)
		}
	}
	// A cut after node c is a candidate when no earlier value is still
	// read after c, and no reader of c's output would overwrite it.
	var cands []int
	reach := lastUse[0]
	for c := 1; c < n; c++ {
		if reach <= c && lastUse[c] > c && !overwrittenInPlace(g.Nodes[c]) {
			cands = append(cands, c)
		}
		reach = max(reach, lastUse[c])
	}
	k := int(math.Ceil(math.Sqrt(float64(n))))
	var out [][2]int
	prev := 0
	for j := 1; j < k && len(cands) > 0; j++ {
		target := float64(j*n) / float64(k)
		best := cands[0]
		for _, c := range cands[1:] {
			if math.Abs(float64(c)-target) < math.Abs(float64(best)-target) {
				best = c
			}
		}
		// Where candidates are sparse, several targets share the nearest
		// one: it makes one cut.
		if best > prev {
			out = append(out, [2]int{prev + 1, best})
			prev = best
		}
	}
	return append(out, [2]int{prev + 1, n})
}

// overwrittenInPlace reports whether a reader of nd's output may run in
// place on it: such a reader cannot start a segment, since the segment's
// input must survive until the recomputation.
func overwrittenInPlace(nd *graph.Node) bool {
	for _, c := range nd.Out.Consumers {
		if inPlaceRule(c.Op).Allows(c.Attr) {
			return true
		}
	}
	return false
}

// keepGroups widens and merges segments so that no DenseNet shared-buffer
// group (nodes marked with one Node.Recompute name, such as a block's last
// Concat with the next transition's BN and conv) is cut by a segment
// boundary: the group's backward rebuilds its buffers from its inputs, which
// must all come from one pass.
func keepGroups(g *graph.Graph, ranges [][2]int) [][2]int {
	span := map[string][2]int{}
	var names []string
	for i, n := range g.Nodes {
		if n.Recompute == "" {
			continue
		}
		s, ok := span[n.Recompute]
		if !ok {
			names = append(names, n.Recompute)
			s = [2]int{i, i}
		}
		s[1] = i
		span[n.Recompute] = s
	}
	for changed := true; changed; {
		changed = false
		for _, name := range names {
			s := span[name]
			for k := range ranges {
				r := &ranges[k]
				if r[0] > s[1] || r[1] < s[0] || (r[0] <= s[0] && r[1] >= s[1]) {
					continue
				}
				r[0], r[1] = min(r[0], s[0]), max(r[1], s[1])
				changed = true
			}
		}
		// Merge segments that now overlap or touch a widened one.
		var merged [][2]int
		for _, r := range ranges {
			if n := len(merged); n > 0 && r[0] <= merged[n-1][1] {
				merged[n-1][1] = max(merged[n-1][1], r[1])
				changed = true
				continue
			}
			merged = append(merged, r)
		}
		ranges = merged
	}
	return ranges
}
