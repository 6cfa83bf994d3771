package onnx

import (
	"math/big"
	"strconv"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// shallow returns a new message of m's type whose fields (unknown fields
// included) are m's: messages and lists are shared, not copied. The writer
// uses it to build an output model around the input's untouched parts
// without copying tensor bytes; it assigns fresh slices to every field it
// changes and never mutates a shared one.
func shallow[M proto.Message](m M) M {
	src := m.ProtoReflect()
	dst := src.New()
	src.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		dst.Set(fd, v)
		return true
	})
	dst.SetUnknown(src.GetUnknown())
	return dst.Interface().(M)
}

func shallowTensor(t *pb.TensorProto) *pb.TensorProto { return shallow(t) }

// attribute lookup over a node's attributes.
type attrs map[string]*pb.AttributeProto

func nodeAttrs(n *pb.NodeProto) attrs {
	a := attrs{}
	for _, at := range n.Attribute {
		a[at.GetName()] = at
	}
	return a
}

func (a attrs) int(name string, def int64) int64 {
	if at, ok := a[name]; ok && at.I != nil {
		return at.GetI()
	}
	return def
}

func (a attrs) ints(name string) []int64 {
	if at, ok := a[name]; ok {
		return at.Ints
	}
	return nil
}

func (a attrs) float(name string, def float32) float32 {
	if at, ok := a[name]; ok && at.F != nil {
		return at.GetF()
	}
	return def
}

func (a attrs) str(name, def string) string {
	if at, ok := a[name]; ok && at.S != nil {
		return string(at.S)
	}
	return def
}

// only reports whether every attribute present is one of names: a modelled
// op with an attribute this package does not understand is carried as an
// opaque node instead of being modelled wrongly.
func (a attrs) only(names ...string) bool {
	for k := range a {
		found := false
		for _, n := range names {
			if k == n {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// decimal32 is the shortest decimal that rounds to f as a float32: ONNX
// stores attributes such as epsilon as float32, and the IR wants the value
// the user wrote (1e-5, not 9.999999747378752e-06).
func decimal32(f float32) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(float64(f), 'g', -1, 32), 64)
	return v
}

// oneMinus32 is 1 - f computed on f's shortest decimal, exactly, so that
// ONNX's BatchNormalization momentum 0.9 (the old value's weight) becomes
// PyTorch's 0.1, not 0.10000002384185791.
func oneMinus32(f float32) float64 {
	r, ok := new(big.Rat).SetString(strconv.FormatFloat(float64(f), 'g', -1, 32))
	if !ok {
		return 1 - float64(f)
	}
	v, _ := new(big.Rat).Sub(big.NewRat(1, 1), r).Float64()
	return v
}

func strp(s string) *string { return &s }
func i64p(v int64) *int64   { return &v }
func f32p(v float32) *float32 {
	return &v
}

func attrTypeP(t pb.AttributeProto_AttributeType) *pb.AttributeProto_AttributeType { return &t }

func floatAttr(name string, v float32) *pb.AttributeProto {
	return &pb.AttributeProto{Name: strp(name), Type: attrTypeP(pb.AttributeProto_FLOAT), F: f32p(v)}
}

func intsAttr(name string, v []int64) *pb.AttributeProto {
	return &pb.AttributeProto{Name: strp(name), Type: attrTypeP(pb.AttributeProto_INTS), Ints: v}
}

func stringAttr(name, v string) *pb.AttributeProto {
	return &pb.AttributeProto{Name: strp(name), Type: attrTypeP(pb.AttributeProto_STRING), S: []byte(v)}
}
