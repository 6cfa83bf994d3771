package onnx

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/half"
	"github.com/abnconvert/abnconvert/onnx/internal/pb"
)

// ONNX TensorProto data types this package decodes (TensorProto.DataType).
const (
	dtFloat    = int32(pb.TensorProto_FLOAT)
	dtUint8    = int32(pb.TensorProto_UINT8)
	dtInt8     = int32(pb.TensorProto_INT8)
	dtUint16   = int32(pb.TensorProto_UINT16)
	dtInt16    = int32(pb.TensorProto_INT16)
	dtInt32    = int32(pb.TensorProto_INT32)
	dtInt64    = int32(pb.TensorProto_INT64)
	dtBool     = int32(pb.TensorProto_BOOL)
	dtFloat16  = int32(pb.TensorProto_FLOAT16)
	dtDouble   = int32(pb.TensorProto_DOUBLE)
	dtUint32   = int32(pb.TensorProto_UINT32)
	dtUint64   = int32(pb.TensorProto_UINT64)
	dtBfloat16 = int32(pb.TensorProto_BFLOAT16)
)

// elemSize is the raw_data width of a decodable data type, 0 for the others
// (strings, complex numbers, types newer than this package).
func elemSize(dt int32) int {
	switch dt {
	case dtUint8, dtInt8, dtBool:
		return 1
	case dtUint16, dtInt16, dtFloat16, dtBfloat16:
		return 2
	case dtFloat, dtInt32, dtUint32:
		return 4
	case dtInt64, dtDouble, dtUint64:
		return 8
	}
	return 0
}

func dtypeName(dt int32) string {
	if s, ok := pb.TensorProto_DataType_name[dt]; ok {
		return s
	}
	return "data type " + strconv.Itoa(int(dt))
}

// maxElems bounds a tensor's declared element count: dims come from the
// file, and their product must not overflow or ask for absurd memory before
// it is checked against the bytes that are really there.
const maxElems = 1 << 40

// tensorShape converts dims to ints, refusing negative dimensions and
// element counts that overflow.
func tensorShape(dims []int64) ([]int, int, error) {
	shape := make([]int, len(dims))
	n := int64(1)
	for i, d := range dims {
		if d < 0 {
			return nil, 0, fmt.Errorf("negative dimension %d in %v", d, dims)
		}
		if d != 0 && n > maxElems/d {
			return nil, 0, fmt.Errorf("dimensions %v declare more than 2^40 elements", dims)
		}
		n *= d
		shape[i] = int(d)
	}
	return shape, int(n), nil
}

// external is where a tensor's bytes live outside the model file.
type external struct {
	path   string // resolved, inside the model's directory
	loc    string // as written in the file
	offset int64
	length int64
}

// tensorData describes how one TensorProto holds its elements, checked
// against what the file really contains. Nothing is decoded until values is
// called.
type tensorData struct {
	t     *pb.TensorProto
	shape []int
	numel int
	ext   *external
}

// inspectTensor checks a tensor's declared size against the bytes present
// (in raw_data, a typed field or an external file) without decoding it. dir
// is the model's directory, against which external locations resolve.
func inspectTensor(t *pb.TensorProto, dir string) (*tensorData, error) {
	shape, numel, err := tensorShape(t.GetDims())
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	td := &tensorData{t: t, shape: shape, numel: numel}
	dt := t.GetDataType()
	size := elemSize(dt)
	if t.GetDataLocation() == pb.TensorProto_EXTERNAL {
		if size == 0 {
			return nil, fmt.Errorf("%w: external data of type %s", ErrUnsupported, dtypeName(dt))
		}
		ext, err := resolveExternal(t, dir, int64(numel)*int64(size))
		if err != nil {
			return nil, err
		}
		td.ext = ext
		return td, nil
	}
	if size == 0 {
		// Not decodable (strings, complex): carried through untouched; Values
		// says why if asked.
		return td, nil
	}
	have, field := storedCount(t, dt)
	if field == "raw_data" {
		if len(t.RawData) != numel*size {
			return nil, fmt.Errorf("%w: raw_data holds %d bytes, dims %v of %s need %d", ErrMalformed, len(t.RawData), t.GetDims(), dtypeName(dt), numel*size)
		}
		return td, nil
	}
	if have != numel {
		return nil, fmt.Errorf("%w: %s holds %d values, dims %v need %d", ErrMalformed, field, have, t.GetDims(), numel)
	}
	return td, nil
}

// storedCount reports which field holds a tensor's values and how many it
// has. A tensor with no elements may have no field at all.
func storedCount(t *pb.TensorProto, dt int32) (int, string) {
	if t.RawData != nil {
		return len(t.RawData), "raw_data"
	}
	switch dt {
	case dtFloat:
		return len(t.FloatData), "float_data"
	case dtDouble:
		return len(t.DoubleData), "double_data"
	case dtInt64:
		return len(t.Int64Data), "int64_data"
	case dtUint32, dtUint64:
		return len(t.Uint64Data), "uint64_data"
	default:
		return len(t.Int32Data), "int32_data"
	}
}

// resolveExternal validates an external-data reference: a relative location
// that stays inside the model's directory (symbolic links included), and an
// offset and length that fit the file and match the tensor's size.
func resolveExternal(t *pb.TensorProto, dir string, want int64) (*external, error) {
	ext := &external{offset: 0, length: -1}
	for _, kv := range t.ExternalData {
		switch kv.GetKey() {
		case "location":
			ext.loc = kv.GetValue()
		case "offset", "length":
			v, err := strconv.ParseInt(kv.GetValue(), 10, 64)
			if err != nil || v < 0 {
				return nil, fmt.Errorf("%w: external data %s %q is not a non-negative integer", ErrMalformed, kv.GetKey(), kv.GetValue())
			}
			if kv.GetKey() == "offset" {
				ext.offset = v
			} else {
				ext.length = v
			}
		}
	}
	if ext.loc == "" {
		return nil, fmt.Errorf("%w: external data without a location", ErrMalformed)
	}
	loc := filepath.FromSlash(ext.loc)
	if filepath.IsAbs(loc) || strings.HasPrefix(ext.loc, "/") || filepath.VolumeName(loc) != "" {
		return nil, fmt.Errorf("%w: external data location %q is absolute; it must be relative to the model's directory", ErrMalformed, ext.loc)
	}
	clean := filepath.Clean(loc)
	if clean == ".." || strings.HasPrefix(clean, ".."+string(filepath.Separator)) {
		return nil, fmt.Errorf("%w: external data location %q leaves the model's directory", ErrMalformed, ext.loc)
	}
	path := filepath.Join(dir, clean)
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return nil, fmt.Errorf("%w: external data %q: %v", ErrMalformed, ext.loc, err)
	}
	realDir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: model directory %q: %v", ErrMalformed, dir, err)
	}
	if rel, err := filepath.Rel(realDir, real); err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return nil, fmt.Errorf("%w: external data location %q resolves to %s, outside the model's directory", ErrMalformed, ext.loc, real)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return nil, fmt.Errorf("%w: external data %q: %v", ErrMalformed, ext.loc, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: external data %q is not a regular file", ErrMalformed, ext.loc)
	}
	if ext.offset > fi.Size() {
		return nil, fmt.Errorf("%w: external data %q: offset %d beyond the file's %d bytes", ErrMalformed, ext.loc, ext.offset, fi.Size())
	}
	if ext.length < 0 {
		ext.length = fi.Size() - ext.offset
	}
	if ext.length > fi.Size()-ext.offset {
		return nil, fmt.Errorf("%w: external data %q: %d bytes at offset %d run past the file's %d bytes", ErrMalformed, ext.loc, ext.length, ext.offset, fi.Size())
	}
	if ext.length != want {
		return nil, fmt.Errorf("%w: external data %q holds %d bytes, dims %v of %s need %d", ErrMalformed, ext.loc, ext.length, t.GetDims(), dtypeName(t.GetDataType()), want)
	}
	ext.path = real
	return ext, nil
}

// rawBytes returns the little-endian element bytes of a raw_data or
// external tensor, reading the external file if needed.
func (td *tensorData) rawBytes() ([]byte, error) {
	if td.ext == nil {
		return td.t.RawData, nil
	}
	f, err := os.Open(td.ext.path)
	if err != nil {
		return nil, fmt.Errorf("external data %q: %w", td.ext.loc, err)
	}
	defer f.Close()
	b := make([]byte, td.ext.length)
	if _, err := f.ReadAt(b, td.ext.offset); err != nil && !(err == io.EOF && td.ext.length == 0) {
		return nil, fmt.Errorf("external data %q: %w", td.ext.loc, err)
	}
	return b, nil
}

// values decodes every element into float64, row-major.
func (td *tensorData) values() ([]float64, error) {
	t := td.t
	dt := t.GetDataType()
	size := elemSize(dt)
	if size == 0 {
		return nil, fmt.Errorf("%w: cannot decode tensor of type %s", ErrUnsupported, dtypeName(dt))
	}
	out := make([]float64, td.numel)
	if td.ext != nil || t.RawData != nil {
		b, err := td.rawBytes()
		if err != nil {
			return nil, err
		}
		if len(b) != td.numel*size {
			return nil, fmt.Errorf("%w: %d bytes for %d elements of %s", ErrMalformed, len(b), td.numel, dtypeName(dt))
		}
		for i := range out {
			out[i] = decodeRaw(dt, b[i*size:])
		}
		return out, nil
	}
	switch dt {
	case dtFloat:
		for i, v := range t.FloatData[:td.numel] {
			out[i] = float64(v)
		}
	case dtDouble:
		copy(out, t.DoubleData)
	case dtInt64:
		for i, v := range t.Int64Data[:td.numel] {
			out[i] = float64(v)
		}
	case dtUint32, dtUint64:
		for i, v := range t.Uint64Data[:td.numel] {
			out[i] = float64(v)
		}
	case dtFloat16:
		for i, v := range t.Int32Data[:td.numel] {
			out[i] = half.Float16ToFloat(uint16(v))
		}
	case dtBfloat16:
		for i, v := range t.Int32Data[:td.numel] {
			out[i] = float64(math.Float32frombits(uint32(uint16(v)) << 16))
		}
	case dtUint8:
		for i, v := range t.Int32Data[:td.numel] {
			out[i] = float64(uint8(v))
		}
	case dtInt8:
		for i, v := range t.Int32Data[:td.numel] {
			out[i] = float64(int8(v))
		}
	case dtUint16:
		for i, v := range t.Int32Data[:td.numel] {
			out[i] = float64(uint16(v))
		}
	case dtInt16:
		for i, v := range t.Int32Data[:td.numel] {
			out[i] = float64(int16(v))
		}
	case dtInt32, dtBool:
		for i, v := range t.Int32Data[:td.numel] {
			out[i] = float64(v)
		}
	}
	return out, nil
}

func decodeRaw(dt int32, b []byte) float64 {
	le := binary.LittleEndian
	switch dt {
	case dtFloat:
		return float64(math.Float32frombits(le.Uint32(b)))
	case dtDouble:
		return math.Float64frombits(le.Uint64(b))
	case dtInt64:
		return float64(int64(le.Uint64(b)))
	case dtUint64:
		return float64(le.Uint64(b))
	case dtInt32:
		return float64(int32(le.Uint32(b)))
	case dtUint32:
		return float64(le.Uint32(b))
	case dtFloat16:
		return half.Float16ToFloat(le.Uint16(b))
	case dtBfloat16:
		return float64(math.Float32frombits(uint32(le.Uint16(b)) << 16))
	case dtInt16:
		return float64(int16(le.Uint16(b)))
	case dtUint16:
		return float64(le.Uint16(b))
	case dtInt8:
		return float64(int8(b[0]))
	case dtUint8:
		return float64(b[0])
	case dtBool:
		if b[0] != 0 {
			return 1
		}
		return 0
	}
	return math.NaN()
}

// encodeTensor returns a copy of t holding v instead of its elements, in
// the same data type and the same kind of field (raw_data for raw or
// external tensors, else the typed field t used). Name, dims, doc string
// and unknown fields are kept.
// rawTensor is t holding raw (its elements as little-endian bytes) in
// raw_data, as encodeTensor writes a raw or external tensor.
func rawTensor(t *pb.TensorProto, raw []byte) *pb.TensorProto {
	out := shallowTensor(t)
	out.RawData, out.FloatData, out.DoubleData, out.Int32Data, out.Int64Data, out.Uint64Data = raw, nil, nil, nil, nil, nil
	out.ExternalData, out.DataLocation = nil, nil
	return out
}

func encodeTensor(t *pb.TensorProto, v []float64) (*pb.TensorProto, error) {
	dt := t.GetDataType()
	size := elemSize(dt)
	if size == 0 {
		return nil, fmt.Errorf("%w: cannot encode tensor of type %s", ErrUnsupported, dtypeName(dt))
	}
	for _, x := range v {
		if !representable(dt, x) {
			return nil, fmt.Errorf("value %g does not fit %s", x, dtypeName(dt))
		}
	}
	out := shallowTensor(t)
	out.RawData, out.FloatData, out.DoubleData, out.Int32Data, out.Int64Data, out.Uint64Data = nil, nil, nil, nil, nil, nil
	out.ExternalData, out.DataLocation = nil, nil
	raw := t.RawData != nil || t.GetDataLocation() == pb.TensorProto_EXTERNAL
	if raw {
		b := make([]byte, len(v)*size)
		for i, x := range v {
			encodeRaw(dt, b[i*size:], x)
		}
		out.RawData = b
		return out, nil
	}
	switch dt {
	case dtFloat:
		out.FloatData = make([]float32, len(v))
		for i, x := range v {
			out.FloatData[i] = float32(x)
		}
	case dtDouble:
		out.DoubleData = append([]float64(nil), v...)
	case dtInt64:
		out.Int64Data = make([]int64, len(v))
		for i, x := range v {
			out.Int64Data[i] = int64(math.RoundToEven(x))
		}
	case dtUint32, dtUint64:
		out.Uint64Data = make([]uint64, len(v))
		for i, x := range v {
			out.Uint64Data[i] = uint64(math.RoundToEven(x))
		}
	default:
		out.Int32Data = make([]int32, len(v))
		b := make([]byte, 8)
		for i, x := range v {
			encodeRaw(dt, b, x)
			switch size {
			case 1:
				out.Int32Data[i] = int32(b[0])
				if dt == dtInt8 {
					out.Int32Data[i] = int32(int8(b[0]))
				}
			case 2:
				out.Int32Data[i] = int32(binary.LittleEndian.Uint16(b))
				if dt == dtInt16 {
					out.Int32Data[i] = int32(int16(binary.LittleEndian.Uint16(b)))
				}
			case 4:
				out.Int32Data[i] = int32(binary.LittleEndian.Uint32(b))
			}
		}
	}
	return out, nil
}

// representable reports whether x fits dt: an integer tensor must not wrap
// around silently; float types take anything, as a cast would (overflow
// gives an infinity).
func representable(dt int32, x float64) bool {
	if math.IsNaN(x) {
		return dt == dtFloat || dt == dtDouble || dt == dtFloat16 || dt == dtBfloat16
	}
	lo, hi := 0.0, 0.0
	switch dt {
	case dtFloat, dtDouble, dtFloat16, dtBfloat16:
		return true
	case dtBool:
		return x == 0 || x == 1
	case dtUint8:
		hi = math.MaxUint8
	case dtInt8:
		lo, hi = math.MinInt8, math.MaxInt8
	case dtUint16:
		hi = math.MaxUint16
	case dtInt16:
		lo, hi = math.MinInt16, math.MaxInt16
	case dtInt32:
		lo, hi = math.MinInt32, math.MaxInt32
	case dtUint32:
		hi = math.MaxUint32
	case dtInt64:
		lo, hi = math.MinInt64, 1<<63-1024
	case dtUint64:
		hi = 1<<64 - 2048
	}
	return x >= lo && x <= hi
}

func encodeRaw(dt int32, b []byte, x float64) {
	le := binary.LittleEndian
	switch dt {
	case dtFloat:
		le.PutUint32(b, math.Float32bits(float32(x)))
	case dtDouble:
		le.PutUint64(b, math.Float64bits(x))
	case dtInt64:
		le.PutUint64(b, uint64(int64(math.RoundToEven(x))))
	case dtUint64:
		le.PutUint64(b, uint64(math.RoundToEven(x)))
	case dtInt32:
		le.PutUint32(b, uint32(int32(math.RoundToEven(x))))
	case dtUint32:
		le.PutUint32(b, uint32(math.RoundToEven(x)))
	case dtFloat16:
		le.PutUint16(b, half.Float16(x))
	case dtBfloat16:
		le.PutUint16(b, half.BFloat16(x))
	case dtInt16:
		le.PutUint16(b, uint16(int16(math.RoundToEven(x))))
	case dtUint16:
		le.PutUint16(b, uint16(math.RoundToEven(x)))
	case dtInt8:
		b[0] = byte(int8(math.RoundToEven(x)))
	case dtUint8:
		b[0] = byte(math.RoundToEven(x))
	case dtBool:
		b[0] = 0
		if x != 0 {
			b[0] = 1
		}
	}
}
