package safetensors

import (
	"encoding/binary"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/output"
)

// WriteOptions steer WriteTensors.
type WriteOptions struct {
	// Force allows replacing an existing file.
	Force bool
	// Sync flushes the file to disk before renaming it into place.
	Sync bool
}

// Tensor is one tensor to write.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	// Write writes exactly the tensor's little-endian, row-major bytes;
	// it is called once, in file order.
	Write func(w io.Writer) error
}

// Layout sorts tensors as the reference writer does: by dtype, largest
// alignment first, then by name (bytewise), so that each tensor's bytes
// start aligned to its element size. It returns the header (padded with
// spaces to a multiple of 8 bytes, as the reference pads it) and the
// tensors in file order.
func Layout(tensors []Tensor, metadata map[string]string) ([]byte, []Tensor, error) {
	ts := append([]Tensor(nil), tensors...)
	seen := map[string]bool{}
	for _, t := range ts {
		if t.DType.Size() == 0 {
			return nil, nil, fmt.Errorf("tensor %q: unknown dtype %q", t.Name, t.DType)
		}
		if t.Name == "__metadata__" {
			return nil, nil, fmt.Errorf("tensor %q: the name is reserved for metadata", t.Name)
		}
		if !utf8.ValidString(t.Name) {
			return nil, nil, fmt.Errorf("tensor %q: the name is not valid UTF-8", t.Name)
		}
		if seen[t.Name] {
			return nil, nil, fmt.Errorf("tensor %q is given twice", t.Name)
		}
		seen[t.Name] = true
	}
	sort.SliceStable(ts, func(i, j int) bool {
		ri, rj := ts[i].DType.rank(), ts[j].DType.rank()
		if ri != rj {
			return ri > rj
		}
		return ts[i].Name < ts[j].Name
	})
	var b strings.Builder
	b.WriteByte('{')
	first := true
	if metadata != nil {
		keys := make([]string, 0, len(metadata))
		for k := range metadata {
			keys = append(keys, k)
		}
		// The reference keeps metadata in a hash map, whose order is
		// arbitrary; sorted keys make the output deterministic.
		sort.Strings(keys)
		b.WriteString(`"__metadata__":{`)
		for i, k := range keys {
			if !utf8.ValidString(k) || !utf8.ValidString(metadata[k]) {
				return nil, nil, fmt.Errorf("metadata %q: not valid UTF-8", k)
			}
			if i > 0 {
				b.WriteByte(',')
			}
			jsonString(&b, k)
			b.WriteByte(':')
			jsonString(&b, metadata[k])
		}
		b.WriteByte('}')
		first = false
	}
	off := int64(0)
	for _, t := range ts {
		n := int64(1)
		for _, d := range t.Shape {
			if d < 0 || (d > 0 && n > maxElems/int64(d)) {
				return nil, nil, fmt.Errorf("tensor %q: shape %v out of range", t.Name, t.Shape)
			}
			n *= int64(d)
		}
		size := n * int64(t.DType.Size())
		if !first {
			b.WriteByte(',')
		}
		first = false
		jsonString(&b, t.Name)
		b.WriteString(`:{"dtype":`)
		jsonString(&b, string(t.DType))
		b.WriteString(`,"shape":[`)
		for i, d := range t.Shape {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(strconv.Itoa(d))
		}
		fmt.Fprintf(&b, `],"data_offsets":[%d,%d]}`, off, off+size)
		off += size
	}
	b.WriteByte('}')
	for b.Len()%8 != 0 {
		b.WriteByte(' ')
	}
	if b.Len() > MaxHeader {
		return nil, nil, fmt.Errorf("the header would take %d bytes, more than the %d the format allows", b.Len(), MaxHeader)
	}
	return []byte(b.String()), ts, nil
}

// jsonString writes s as a JSON string escaped as serde_json (the
// reference's encoder) escapes it: quote, backslash and control characters
// only, control characters without a short form as \u00xx in lowercase hex.
func jsonString(b *strings.Builder, s string) {
	const hex = "0123456789abcdef"
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			if c < 0x20 {
				b.WriteString(`\u00`)
				b.WriteByte(hex[c>>4])
				b.WriteByte(hex[c&0xf])
			} else {
				b.WriteByte(c)
			}
		}
	}
	b.WriteByte('"')
}

// WriteTensors writes a safetensors file laid out as the reference writer
// lays it out (see Layout) as a one-file output set (package output):
// through a temporary file in the same directory renamed into place, so
// that a failed or interrupted write leaves nothing behind.
func WriteTensors(path string, tensors []Tensor, metadata map[string]string, opt WriteOptions) error {
	set := output.New(output.Options{Force: opt.Force, Sync: opt.Sync})
	defer set.Abort()
	if err := StageTensors(set, path, tensors, metadata); err != nil {
		return err
	}
	return set.Commit()
}

// StageTensors writes a safetensors file (see WriteTensors) into a new
// output of set at path, streaming each tensor to its temporary file; it is
// renamed into place when the set commits.
func StageTensors(set *output.Set, path string, tensors []Tensor, metadata map[string]string) error {
	hdr, ordered, err := Layout(tensors, metadata)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	f, err := set.Create(path)
	if err != nil {
		return err
	}
	// The file's size is known: its blocks are allocated at once
	// (output.File.Reserve).
	size := int64(8 + len(hdr))
	for _, t := range ordered {
		size += int64(graph.Numel(t.Shape) * t.DType.Size())
	}
	f.Reserve(size)
	if err := Encode(f, hdr, ordered); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// Encode writes a header and tensors as Layout returned them to w.
func Encode(w io.Writer, header []byte, ordered []Tensor) error {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(header)))
	if _, err := w.Write(n[:]); err != nil {
		return err
	}
	if _, err := w.Write(header); err != nil {
		return err
	}
	for _, t := range ordered {
		want := int64(graph.Numel(t.Shape) * t.DType.Size())
		cw := &countWriter{w: w}
		if err := t.Write(cw); err != nil {
			return fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		if cw.n != want {
			return fmt.Errorf("tensor %q: wrote %d bytes, its shape %v of %s needs %d", t.Name, cw.n, t.Shape, t.DType, want)
		}
	}
	return nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// Streamer is a Weights that can write a tensor's bytes as stored, with
// its pending sign flips, without decoding it (a .pth checkpoint); done is
// false when it cannot for that tensor.
type Streamer interface {
	StreamTensor(key string, w io.Writer) (done bool, err error)
}

// FromWeights describes every tensor of a state dict for WriteTensors, in
// the dtypes dtype names (a torch state dict's own), encoding the values
// Values returns. It refuses dtypes the format has no type for.
func FromWeights(w graph.Weights, dtype func(key string) DType) ([]Tensor, error) {
	var out []Tensor
	for _, k := range w.Keys() {
		shape, ok := w.Shape(k)
		if !ok {
			return nil, fmt.Errorf("tensor %q: no shape", k)
		}
		d := dtype(k)
		if d.Size() == 0 {
			return nil, fmt.Errorf("tensor %q: its dtype has no safetensors equivalent", k)
		}
		key := k
		out = append(out, Tensor{Name: k, DType: d, Shape: shape, Write: func(wr io.Writer) error {
			if s, ok := w.(Streamer); ok {
				if done, err := s.StreamTensor(key, wr); done || err != nil {
					return err
				}
			}
			v, err := w.Values(key)
			if err != nil {
				return err
			}
			b, err := encode(d, v)
			if err != nil {
				return err
			}
			_, err = wr.Write(b)
			return err
		}})
	}
	return out, nil
}
