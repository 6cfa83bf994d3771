package runtime

import "github.com/abnconvert/abnconvert/graph"

// MarkSharedBuffers marks, for the memory-efficient DenseNet of Pleiss et al.
// 2017 on a graph that still has plain BN + activation layers, every chain
// Concat → BatchNorm2d → activation → Conv2d whose links are each the only
// reader of the one before (a DenseNet layer's bottleneck) as one
// shared-buffer group, named after the Concat (Node.Recompute). It returns
// the number of groups marked. Chains already marked are left alone. The
// rewrite package marks converted graphs (Concat → ABN → Conv2d) itself.
func MarkSharedBuffers(g *graph.Graph) int {
	marked := 0
	for _, cat := range g.Nodes {
		if cat.Op != graph.OpConcat || cat.Recompute != "" || g.IsOutput(cat.Out) {
			continue
		}
		bn := soleReader(g, cat)
		if bn == nil || bn.Op != graph.OpBatchNorm || bn.Recompute != "" {
			continue
		}
		act := soleReader(g, bn)
		if act == nil || act.Recompute != "" {
			continue
		}
		// The activation runs in place on the shared buffer.
		if !act.Op.IsActivation() || !inPlaceRule(act.Op).Allows(act.Attr) {
			continue
		}
		conv := soleReader(g, act)
		if conv == nil || conv.Op != graph.OpConv || conv.Recompute != "" {
			continue
		}
		name := cat.Name
		for _, n := range []*graph.Node{cat, bn, act, conv} {
			n.Recompute = name
		}
		marked++
	}
	return marked
}

// soleReader is the only node reading n's output, nil when there are
// several or none, or when n's output is the graph output.
func soleReader(g *graph.Graph, n *graph.Node) *graph.Node {
	if len(n.Out.Consumers) != 1 || g.IsOutput(n.Out) {
		return nil
	}
	return n.Out.Consumers[0]
}
