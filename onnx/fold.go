package onnx

import (
	"fmt"
	"math"

	"github.com/abnconvert/abnconvert/graph"
)

// folds picks, under FoldForInference, the BN-family nodes that fold into
// the Conv before them: a Conv read by that node alone.
func (w *writer) folds() error {
	if !w.opt.FoldForInference {
		return nil
	}
	for _, n := range w.g.Nodes {
		if !n.Op.IsBNFamily() {
			continue
		}
		info := w.m.byIR[n]
		if info == nil || info.ir != n || info.op != graph.OpBatchNorm {
			continue
		}
		c := n.Inputs[0].Producer
		ci := w.m.byIR[c]
		if c.Op != graph.OpConv || ci == nil || ci.ir != c || ci.op != graph.OpConv || w.g.IsOutput(c.Out) {
			continue
		}
		if readers := uniqueNodes(c.Out.Consumers); len(readers) != 1 || readers[0] != n || len(c.Out.Consumers) != 1 {
			continue
		}
		if w.outputs[w.name[c.Out]] {
			continue
		}
		wkey := c.Params[graph.RoleWeight]
		if !floatType(w.m.Weights.byKey[wkey].src.td.t.GetDataType()) {
			continue
		}
		scale, shift, err := w.affine(n)
		if err != nil {
			return err
		}
		W, err := w.m.Weights.Values(wkey)
		if err != nil {
			return fmt.Errorf("node %s: %w", c.Name, err)
		}
		co := c.Attr.OutChannels
		if co != len(scale) || len(W)%co != 0 {
			return fmt.Errorf("node %s: %d output channels, %d BN features in %s", c.Name, co, len(scale), n.Name)
		}
		per := len(W) / co
		for o := 0; o < co; o++ {
			for j := o * per; j < (o+1)*per; j++ {
				W[j] *= scale[o]
			}
		}
		bias := make([]float64, co)
		if k := c.Params[graph.RoleBias]; k != "" {
			if bias, err = w.m.Weights.Values(k); err != nil {
				return fmt.Errorf("node %s: %w", c.Name, err)
			}
		}
		for o := range bias {
			bias[o] = bias[o]*scale[o] + shift[o]
		}
		w.derived[slotRef{ci.index, 1}] = W
		w.derived[slotRef{ci.index, 2}] = bias
		w.fold[n] = c
	}
	return nil
}

func floatType(dt int32) bool {
	return dt == dtFloat || dt == dtDouble || dt == dtFloat16 || dt == dtBfloat16
}

// affine is what an ABN-family node does to its input, before the
// activation, in inference: y = x*scale + shift per channel, with the sign
// flip and the |weight| + eps of the in-place ops included.
func (w *writer) affine(n *graph.Node) (scale, shift []float64, err error) {
	vals := map[string][]float64{}
	for _, role := range bnRoles {
		v, err := w.m.Weights.Values(n.Params[role])
		if err != nil {
			return nil, nil, fmt.Errorf("node %s: %w", n.Name, err)
		}
		vals[role] = v
	}
	eps := float64(float32(n.Attr.Eps)) // what an ONNX runtime uses
	gamma := w.gamma(n, vals[graph.RoleWeight])
	c := len(gamma)
	scale, shift = make([]float64, c), make([]float64, c)
	for i := 0; i < c; i++ {
		inv := gamma[i] / math.Sqrt(vals[graph.RoleRunningVar][i]+eps)
		s := 1.0
		if n.Sign != nil {
			s = float64(n.Sign[i])
		}
		scale[i] = s * inv
		shift[i] = vals[graph.RoleBias][i] - vals[graph.RoleRunningMean][i]*inv
	}
	return scale, shift, nil
}

// gamma is the scale a plain BatchNormalization needs to compute what n
// computes: |weight| + eps for the in-place ops, the weight for ABN.
func (w *writer) gamma(n *graph.Node, weight []float64) []float64 {
	if !inPlaceOp(n.Op) {
		return weight
	}
	g := make([]float64, len(weight))
	for i, v := range weight {
		g[i] = math.Abs(v) + n.Attr.Eps
	}
	return g
}
