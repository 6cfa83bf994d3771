package verify

import (
	"fmt"
	"math"
	"os"

	"google.golang.org/protobuf/encoding/protowire"
)

// The ONNX reader (package onnx) keeps nodes of the ai.abnconvert domain
// opaque: they are what a conversion writes, not what it reads. To run a
// converted model, verify needs their inputs and attributes, which it reads
// here straight from the protobuf wire format: the few fields of
// ModelProto, GraphProto, NodeProto and AttributeProto it needs, by their
// field numbers in onnx.proto, nothing else.

// protoNode is one NodeProto.
type protoNode struct {
	name, opType, domain string
	inputs               []string
	floats               map[string]float32
	ints                 map[string][]int64
	strs                 map[string]string
}

// protoModel is what verify reads of a model: its nodes by name (names
// given twice are left out of the map and counted), and the dimensions of
// the first graph input (-1 for a symbolic one).
type protoModel struct {
	nodes    map[string]*protoNode
	dupNames map[string]bool
	inputDim []int64
}

// ONNX field numbers.
const (
	modelGraph  = 7
	graphNode   = 1
	graphInput  = 11
	nodeInput   = 1
	nodeName    = 3
	nodeOpType  = 4
	nodeAttr    = 5
	nodeDomain  = 7
	attrName    = 1
	attrF       = 2
	attrI       = 3
	attrS       = 4
	attrInts    = 8
	valueType   = 2
	typeTensor  = 1
	tensorShape = 2
	shapeDim    = 1
	dimValue    = 1
)

func readProtoModel(path string) (*protoModel, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pm := &protoModel{nodes: map[string]*protoNode{}, dupNames: map[string]bool{}}
	err = fields(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if num != modelGraph || typ != protowire.BytesType {
			return nil
		}
		return fields(v, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
			switch {
			case num == graphNode && typ == protowire.BytesType:
				n, err := readNode(v)
				if err != nil {
					return err
				}
				if _, dup := pm.nodes[n.name]; dup || pm.dupNames[n.name] {
					delete(pm.nodes, n.name)
					pm.dupNames[n.name] = true
				} else {
					pm.nodes[n.name] = n
				}
			case num == graphInput && typ == protowire.BytesType && pm.inputDim == nil:
				dims, err := readInputDims(v)
				if err != nil {
					return err
				}
				pm.inputDim = dims
			}
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("%s: reading the protobuf: %w", path, err)
	}
	return pm, nil
}

// fields calls f for each top-level field of a message.
func fields(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var v []byte
		var x uint64
		switch typ {
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			x, n = protowire.ConsumeVarint(b)
		case protowire.Fixed32Type:
			var u uint32
			u, n = protowire.ConsumeFixed32(b)
			x = uint64(u)
		case protowire.Fixed64Type:
			x, n = protowire.ConsumeFixed64(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if err := f(num, typ, v, x); err != nil {
			return err
		}
	}
	return nil
}

func readNode(b []byte) (*protoNode, error) {
	n := &protoNode{floats: map[string]float32{}, ints: map[string][]int64{}, strs: map[string]string{}}
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case nodeInput:
			n.inputs = append(n.inputs, string(v))
		case nodeName:
			n.name = string(v)
		case nodeOpType:
			n.opType = string(v)
		case nodeDomain:
			n.domain = string(v)
		case nodeAttr:
			return readAttr(v, n)
		}
		return nil
	})
	return n, err
}

func readAttr(b []byte, n *protoNode) error {
	var name string
	var f *float32
	var s *string
	var ints []int64
	var i *int64
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		switch {
		case num == attrName && typ == protowire.BytesType:
			name = string(v)
		case num == attrF && typ == protowire.Fixed32Type:
			fv := math.Float32frombits(uint32(x))
			f = &fv
		case num == attrI && typ == protowire.VarintType:
			iv := int64(x)
			i = &iv
		case num == attrS && typ == protowire.BytesType:
			sv := string(v)
			s = &sv
		case num == attrInts && typ == protowire.VarintType:
			ints = append(ints, int64(x))
		case num == attrInts && typ == protowire.BytesType: // packed
			for len(v) > 0 {
				x, k := protowire.ConsumeVarint(v)
				if k < 0 {
					return protowire.ParseError(k)
				}
				ints = append(ints, int64(x))
				v = v[k:]
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	switch {
	case f != nil:
		n.floats[name] = *f
	case s != nil:
		n.strs[name] = *s
	case ints != nil:
		n.ints[name] = ints
	case i != nil:
		n.ints[name] = []int64{*i}
	}
	return nil
}

// readInputDims reads ValueInfoProto.type.tensor_type.shape.dim[*].dim_value.
func readInputDims(b []byte) ([]int64, error) {
	dims := []int64{}
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if num != valueType || typ != protowire.BytesType {
			return nil
		}
		return fields(v, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
			if num != typeTensor || typ != protowire.BytesType {
				return nil
			}
			return fields(v, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
				if num != tensorShape || typ != protowire.BytesType {
					return nil
				}
				return fields(v, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
					if num != shapeDim || typ != protowire.BytesType {
						return nil
					}
					d := int64(-1)
					err := fields(v, func(num protowire.Number, typ protowire.Type, _ []byte, x uint64) error {
						if num == dimValue && typ == protowire.VarintType {
							d = int64(x)
						}
						return nil
					})
					dims = append(dims, d)
					return err
				})
			})
		})
	})
	return dims, err
}
