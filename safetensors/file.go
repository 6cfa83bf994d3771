// Package safetensors reads and writes the safetensors format
// (huggingface/safetensors): an 8-byte little-endian header length, a JSON
// header naming every tensor's dtype, shape and byte range, optional
// "__metadata__" strings, then the raw little-endian tensor bytes.
//
// Open reads only the header and checks it as the reference reader does
// (header length within bounds, every byte range inside the data and
// exactly the size its shape and dtype need, ranges contiguous and covering
// the data), and refuses duplicate names, which a JSON map would silently
// merge. Tensor bytes stay in the file until Values asks for them. A *File
// implements graph.Weights; Write writes it back, unchanged tensors copied
// byte for byte, changed ones re-encoded in their own dtype, laid out as
// the reference writer lays a file out (WriteTensors).
//
// The format holds a flat map of tensors and string metadata only: no
// nesting, no optimizer state, no aliasing between tensors.
package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"unicode/utf8"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/negate"
	"github.com/abnconvert/abnconvert/output"
)

// MaxHeader is the largest header the reference implementation reads
// (100 MB); a longer one is refused before anything is allocated for it.
const MaxHeader = 100_000_000

// maxElems bounds a tensor's element count, so that size arithmetic cannot
// overflow.
const maxElems = 1 << 56

// ErrMalformed wraps every error about a file that does not follow the
// format.
var ErrMalformed = errors.New("malformed safetensors file")

// File is an opened safetensors file. Close releases it.
type File struct {
	Path string
	// Metadata is the header's "__metadata__" map; nil when absent.
	Metadata map[string]string
	// HeaderLen is the JSON header's length in bytes, padding included.
	HeaderLen int64

	f       *os.File
	stat    os.FileInfo
	order   []string // by byte offset
	entries map[string]*entry
}

type entry struct {
	name       string
	dtype      DType
	shape      []int
	begin, end int64 // relative to the start of the data
	pending    []float64
	// negate lists the dim-0 slices whose sign bits are flipped as the
	// tensor is written (NegateChannels); non-nil marks it changed.
	negate []int
}

var _ graph.Weights = (*File)(nil)

// Open reads a file's header. Nothing is decoded until Values asks for it.
func Open(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	sf := &File{Path: path, f: f, stat: st, entries: map[string]*entry{}}
	if err := sf.readHeader(); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return sf, nil
}

// Close releases the file; values not yet decoded are lost.
func (f *File) Close() error { return f.f.Close() }

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

func (f *File) readHeader() error {
	size := f.stat.Size()
	if !f.stat.Mode().IsRegular() {
		return errors.New("not a regular file")
	}
	var lenBuf [8]byte
	if _, err := f.f.ReadAt(lenBuf[:], 0); err != nil {
		return malformed("%d bytes, shorter than the 8-byte header length", size)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > MaxHeader {
		return malformed("header length %d is more than the %d bytes the format allows", n, MaxHeader)
	}
	if int64(n) > size-8 {
		return malformed("header length %d runs past the end of the %d-byte file", n, size)
	}
	hdr := make([]byte, n)
	if _, err := f.f.ReadAt(hdr, 8); err != nil {
		return fmt.Errorf("reading the header: %w", err)
	}
	f.HeaderLen = int64(n)
	if !utf8.Valid(hdr) {
		return malformed("the header is not valid UTF-8")
	}
	if len(hdr) == 0 || hdr[0] != '{' {
		return malformed("the header does not start with '{'")
	}
	if err := f.parse(hdr); err != nil {
		return err
	}
	return f.validate(size - 8 - int64(n))
}

// rawInfo is one tensor's header entry as written.
type rawInfo struct {
	DType       *string   `json:"dtype"`
	Shape       *[]int64  `json:"shape"`
	DataOffsets *[]uint64 `json:"data_offsets"`
}

// parse walks the header object key by key, so that a name given twice is
// seen (a map would keep one of the two silently).
func (f *File) parse(hdr []byte) error {
	dec := json.NewDecoder(bytes.NewReader(hdr))
	dec.UseNumber()
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return malformed("the header is not a JSON object")
	}
	seen := map[string]bool{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return malformed("header: %v", err)
		}
		name, ok := t.(string)
		if !ok {
			return malformed("header: key %v is not a string", t)
		}
		if seen[name] {
			return malformed("header: %q is given twice", name)
		}
		seen[name] = true
		if name == "__metadata__" {
			var md map[string]string
			if err := dec.Decode(&md); err != nil {
				return malformed("header: __metadata__ must map strings to strings: %v", err)
			}
			if md == nil {
				md = map[string]string{}
			}
			f.Metadata = md
			continue
		}
		var ri rawInfo
		if err := dec.Decode(&ri); err != nil {
			return malformed("header: tensor %q: %v", name, err)
		}
		e, err := newEntry(name, ri)
		if err != nil {
			return malformed("header: tensor %q: %v", name, err)
		}
		f.entries[name] = e
		f.order = append(f.order, name)
	}
	if _, err := dec.Token(); err != nil {
		return malformed("header: %v", err)
	}
	// Only the writer's space padding may follow the object.
	for _, c := range hdr[dec.InputOffset():] {
		if c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			return malformed("header: data after the JSON object")
		}
	}
	return nil
}

func newEntry(name string, ri rawInfo) (*entry, error) {
	if ri.DType == nil || ri.Shape == nil || ri.DataOffsets == nil {
		return nil, errors.New("needs dtype, shape and data_offsets")
	}
	d := DType(*ri.DType)
	if d.Size() == 0 {
		return nil, fmt.Errorf("unknown dtype %q", *ri.DType)
	}
	if len(*ri.DataOffsets) != 2 {
		return nil, fmt.Errorf("data_offsets has %d numbers, want 2", len(*ri.DataOffsets))
	}
	e := &entry{name: name, dtype: d}
	n := int64(1)
	for _, s := range *ri.Shape {
		if s < 0 {
			return nil, fmt.Errorf("shape %v has a negative dimension", *ri.Shape)
		}
		if s > 0 && n > maxElems/s {
			return nil, fmt.Errorf("shape %v is too large", *ri.Shape)
		}
		n *= s
		e.shape = append(e.shape, int(s))
	}
	b, en := (*ri.DataOffsets)[0], (*ri.DataOffsets)[1]
	if b > 1<<62 || en > 1<<62 {
		return nil, fmt.Errorf("data_offsets [%d, %d] out of range", b, en)
	}
	e.begin, e.end = int64(b), int64(en)
	if e.end < e.begin {
		return nil, fmt.Errorf("data_offsets [%d, %d] end before they begin", b, en)
	}
	if want := n * int64(d.Size()); e.end-e.begin != want {
		return nil, fmt.Errorf("data_offsets [%d, %d] hold %d bytes; shape %v of %s needs %d", b, en, e.end-e.begin, e.shape, d, want)
	}
	return e, nil
}

// validate checks, as the reference reader does, that the byte ranges
// follow each other without gap or overlap from 0 to the end of the file.
func (f *File) validate(dataLen int64) error {
	sort.SliceStable(f.order, func(i, j int) bool {
		a, b := f.entries[f.order[i]], f.entries[f.order[j]]
		if a.begin != b.begin {
			return a.begin < b.begin
		}
		return a.end < b.end
	})
	at := int64(0)
	for _, name := range f.order {
		e := f.entries[name]
		if e.begin != at {
			if e.begin < at {
				return malformed("tensor %q: bytes [%d, %d) overlap the tensor before it, which ends at %d", name, e.begin, e.end, at)
			}
			return malformed("tensor %q: bytes [%d, %d) leave a gap after %d", name, e.begin, e.end, at)
		}
		at = e.end
	}
	if at != dataLen {
		return malformed("the tensors cover %d bytes of data, the file holds %d after the header", at, dataLen)
	}
	return nil
}

// Keys lists the tensor names in the order of their bytes in the file.
func (f *File) Keys() []string { return append([]string(nil), f.order...) }

// Shape reports a tensor's shape.
func (f *File) Shape(key string) ([]int, bool) {
	e, ok := f.entries[key]
	if !ok {
		return nil, false
	}
	return append([]int{}, e.shape...), true
}

// DType reports a tensor's element type, "" for an unknown name.
func (f *File) DType(key string) DType {
	if e, ok := f.entries[key]; ok {
		return e.dtype
	}
	return ""
}

// Raw returns a tensor's bytes as stored in the file (before SetValues).
func (f *File) Raw(key string) ([]byte, error) {
	e, ok := f.entries[key]
	if !ok {
		return nil, fmt.Errorf("%s: no tensor %q", f.Path, key)
	}
	b := make([]byte, e.end-e.begin)
	if _, err := f.f.ReadAt(b, 8+f.HeaderLen+e.begin); err != nil {
		return nil, fmt.Errorf("%s: tensor %q: reading %d bytes: %w", f.Path, key, len(b), err)
	}
	return b, nil
}

// Values decodes a tensor into float64, row-major; after SetValues it
// returns the new values.
func (f *File) Values(key string) ([]float64, error) {
	e, ok := f.entries[key]
	if !ok {
		return nil, fmt.Errorf("%s: no tensor %q", f.Path, key)
	}
	if e.pending != nil {
		return append([]float64(nil), e.pending...), nil
	}
	b, err := f.Raw(key)
	if err != nil {
		return nil, err
	}
	v, err := decode(e.dtype, b)
	if err != nil {
		return nil, fmt.Errorf("%s: tensor %q: %w", f.Path, key, err)
	}
	if e.negate != nil {
		negate.Values(v, e.shape[0], e.negate)
	}
	return v, nil
}

func (e *entry) layout() (negate.Layout, bool) {
	switch e.dtype {
	case F16, BF16, F32, F64:
		return negate.FloatLayout(true, e.dtype.Size(), e.shape)
	}
	return negate.Layout{}, false
}

// NegateChannels negates slices of dim 0 of a tensor (graph.ChannelNegater)
// by flipping sign bits as the tensor is written: nothing is decoded but
// the bytes needed to see whether the channels are all zero (then nothing
// changes, and it reports false).
func (f *File) NegateChannels(key string, channels []int) (bool, error) {
	e, ok := f.entries[key]
	if !ok {
		return false, fmt.Errorf("%s: no tensor %q", f.Path, key)
	}
	if len(e.shape) == 0 {
		return false, fmt.Errorf("%s: tensor %q: a scalar has no channels to negate", f.Path, key)
	}
	chans, bad, ok := negate.Set(channels, e.shape[0])
	if !ok {
		return false, fmt.Errorf("%s: tensor %q: channel %d out of range [0, %d)", f.Path, key, bad, e.shape[0])
	}
	if len(chans) == 0 {
		return false, nil
	}
	l, lazy := e.layout()
	if !lazy || e.pending != nil {
		v, err := f.Values(key)
		if err != nil {
			return false, err
		}
		inner := len(v) / e.shape[0]
		nz := false
		for _, ch := range chans {
			for i := ch * inner; i < (ch+1)*inner && !nz; i++ {
				nz = v[i] != 0
			}
		}
		if !nz {
			return false, nil
		}
		negate.Values(v, e.shape[0], chans)
		return true, f.SetValues(key, v)
	}
	buf := make([]byte, 64<<10)
	nz := false
	for _, ch := range chans {
		end := int64(ch+1) * l.ChannelBytes
		for off := int64(ch) * l.ChannelBytes; off < end && !nz; {
			n := min(int64(len(buf)), end-off)
			if _, err := f.f.ReadAt(buf[:n], 8+f.HeaderLen+e.begin+off); err != nil {
				return false, fmt.Errorf("%s: tensor %q: %w", f.Path, key, err)
			}
			nz = l.AnyNonzero(buf[:n])
			off += n
		}
	}
	if !nz {
		return false, nil
	}
	e.negate = negate.Xor(e.negate, chans)
	return true, nil
}

// SetValues replaces a tensor's values; Write re-encodes them in the
// tensor's own dtype. Values the dtype cannot hold are refused now, so that
// Write cannot fail on them.
func (f *File) SetValues(key string, v []float64) error {
	e, ok := f.entries[key]
	if !ok {
		return fmt.Errorf("%s: no tensor %q", f.Path, key)
	}
	if n := graph.Numel(e.shape); n != len(v) {
		return fmt.Errorf("%s: tensor %q has %d elements, got %d values", f.Path, key, n, len(v))
	}
	if _, err := encode(e.dtype, v); err != nil {
		return fmt.Errorf("%s: tensor %q: %w", f.Path, key, err)
	}
	e.pending = append([]float64(nil), v...)
	e.negate = nil
	return nil
}

// Changed lists the tensors SetValues replaced, in file order.
func (f *File) Changed() []string {
	var out []string
	for _, k := range f.order {
		if e := f.entries[k]; e.pending != nil || e.negate != nil {
			out = append(out, k)
		}
	}
	return out
}

// Tensors describes every tensor for WriteTensors: unchanged ones stream
// their bytes from this file, changed ones are re-encoded.
func (f *File) Tensors() []Tensor {
	out := make([]Tensor, 0, len(f.order))
	for _, k := range f.order {
		e := f.entries[k]
		key := k
		out = append(out, Tensor{Name: k, DType: e.dtype, Shape: append([]int{}, e.shape...), Write: func(w io.Writer) error { return f.WriteTensor(key, w) }})
	}
	return out
}

// WriteTensor writes a tensor's bytes as the format stores them (row-major,
// little-endian): from the file, with pending sign flips applied as they
// stream, or encoded from the values SetValues gave.
func (f *File) WriteTensor(key string, w io.Writer) error {
	e, ok := f.entries[key]
	if !ok {
		return fmt.Errorf("%s: no tensor %q", f.Path, key)
	}
	if e.pending != nil {
		b, err := encode(e.dtype, e.pending)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	var r io.Reader = io.NewSectionReader(f.f, 8+f.HeaderLen+e.begin, e.end-e.begin)
	if e.negate != nil {
		l, _ := e.layout()
		r = &negate.Reader{R: r, Layout: l, Chans: e.negate}
	}
	_, err := io.Copy(w, r)
	return err
}

// Write writes the file with every SetValues change to path (see
// WriteTensors), keeping the metadata, as a one-file output set. It
// refuses to overwrite the input.
func (f *File) Write(path string, opt WriteOptions) error {
	set := output.New(output.Options{Force: opt.Force, Sync: opt.Sync})
	defer set.Abort()
	if err := f.Stage(set, path); err != nil {
		return err
	}
	return set.Commit()
}

// Stage writes the file with every SetValues change (see Write) into a new
// output of set at path; it is renamed into place when the set commits.
func (f *File) Stage(set *output.Set, path string) error {
	set.Protect(f.Path)
	return StageTensors(set, path, f.Tensors(), f.Metadata)
}
