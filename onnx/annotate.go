// After the nodes are built: parameter keys and channel counts.

package onnx

import (
	"github.com/abnconvert/abnconvert/graph"
)

// keys gives every modelled node's parameter slots their keys (see
// Weights): a slot reads its value's key, except that BN-family slots never
// share one.
func (b *builder) keys() {
	for _, info := range b.m.infos {
		if info.kind != kindModelled {
			continue
		}
		exclusive := info.op == graph.OpBatchNorm
		for _, role := range []string{graph.RoleWeight, graph.RoleBias, graph.RoleRunningMean, graph.RoleRunningVar} {
			k, ok := info.params[role]
			if !ok {
				continue
			}
			value := info.proto.Input[k]
			s := slot{info: info, input: k, role: role}
			p := b.w.byKey[value]
			first, claimed := b.claims[value]
			switch {
			case !claimed:
				b.claims[value] = p
				p.owners = append(p.owners, s)
				p.exclusive = exclusive
			case !exclusive && !first.exclusive:
				p.owners = append(p.owners, s)
			default:
				key := value + "@" + info.ir.Name + "." + role
				p = &param{key: key, value: value, src: p.src, owners: []slot{s}, split: true}
				b.w.add(p)
			}
			info.ir.Params[role] = p.key
		}
	}
}

// channelsOf is dimension 1 of a value's declared shape, 0 when unknown.
func (b *builder) channelsOf(name string) int {
	t := b.types[name]
	if t == nil {
		return 0
	}
	tt := t.GetTensorType()
	if tt == nil || tt.Shape == nil || len(tt.Shape.Dim) < 2 {
		return 0
	}
	return int(tt.Shape.Dim[1].GetDimValue())
}

// channelPreserving are opaque ops whose output has the channel count of
// their first input (elementwise ops; Pad only when it pads no channels,
// checked below).
var channelPreserving = map[string]bool{
	"Sigmoid": true, "Tanh": true, "HardSigmoid": true, "HardSwish": true, "Clip": true,
	"Neg": true, "Abs": true, "Exp": true, "Log": true, "Sqrt": true, "Softplus": true,
	"Softsign": true, "PRelu": true, "Selu": true, "Celu": true, "Gelu": true, "Erf": true,
	"Identity": true, "Mul": true, "Sub": true, "Div": true, "Pow": true, "Max": true, "Min": true,
	"Sum": true, "Mean": true, "Mish": true, "ThresholdedRelu": true, "Cast": true,
}

// channels annotates every IR value with its channel count where it is
// known: from the op (Conv, BN, Concat, ...), from the declared shapes
// (value_info), or through opaque elementwise ops. The rewrite passes need
// them to follow a channel through a Concat.
func (b *builder) channels() {
	for _, n := range b.g.Nodes {
		if n.Out.Channels != 0 {
			continue
		}
		c := 0
		switch n.Op {
		case graph.OpConv, graph.OpLinear:
			c = n.Attr.OutChannels
		case graph.OpBatchNorm:
			c = n.Attr.Features
		case graph.OpConcat:
			if n.Attr.Axis == 1 || n.Attr.Axis == -3 {
				for _, in := range n.Inputs {
					if in.Channels == 0 {
						c = 0
						break
					}
					c += in.Channels
				}
			}
		case graph.OpReLU, graph.OpLeakyReLU, graph.OpELU, graph.OpMaxPool, graph.OpAvgPool,
			graph.OpAdaptiveAvgPool, graph.OpDropout:
			c = n.Inputs[0].Channels
		case graph.OpAdd:
			for _, in := range n.Inputs {
				if in.Channels != 0 {
					c = in.Channels
					break
				}
			}
		default:
			if info := b.m.byIR[n]; info != nil && len(n.Inputs) > 0 && b.preservesChannels(info) {
				c = n.Inputs[0].Channels
			}
		}
		if c == 0 {
			c = b.channelsOf(b.m.valueName[n.Out])
		}
		n.Out.Channels = c
	}
}

func (b *builder) preservesChannels(info *nodeInfo) bool {
	n := info.proto
	if d := n.GetDomain(); d != "" && d != "ai.onnx" {
		return false
	}
	if len(info.data) == 0 || info.data[0] != 0 {
		return false
	}
	if n.GetOpType() != "Pad" {
		return channelPreserving[n.GetOpType()]
	}
	// Pad: pads are [x1_begin, x2_begin, ..., x1_end, ...], an attribute
	// before opset 11 and input 1 since; dimension 1 must get none.
	var pads []float64
	if p := nodeAttrs(n).ints("pads"); p != nil {
		for _, x := range p {
			pads = append(pads, float64(x))
		}
	} else if p, ok := b.param(n, 1); ok {
		v, err := p.td.values()
		if err != nil {
			return false
		}
		pads = v
	}
	if len(pads) < 4 || len(pads)%2 != 0 {
		return false
	}
	if len(n.Input) > 3 && n.Input[3] != "" {
		return false // axes given: pads index other dimensions
	}
	return pads[1] == 0 && pads[len(pads)/2+1] == 0
}
