package pth

import (
	"fmt"
	"hash/crc32"
	"io"

	"github.com/abnconvert/abnconvert/negate"
)

// Negating output channels is the one change a sign fold makes to a
// convolution's weights, and for a float dtype it is a flip of sign bits
// (package negate). So a negation is not decoded and held: it is recorded
// on the tensor and applied to the bytes while its record streams from the
// input to the output (copyNegated), the output's CRC computed on the way.
// Only a tensor that owns its whole storage, contiguously from offset 0,
// is treated so (its record is rewritten in place under the same key); any
// other takes the decoding path, which writes the same bytes.

func isFloat(d DType) bool {
	switch d {
	case Float32, Float64, Float16, BFloat16:
		return true
	}
	return false
}

func layoutOf(t *Tensor) (negate.Layout, bool) {
	return negate.FloatLayout(isFloat(t.DType()), t.DType().Size(), t.Shape)
}

// lazyNegatable reports whether t's negations can be applied to its record
// as it streams: a float tensor that alone views its storage, all of it,
// contiguously from offset 0.
func (c *Checkpoint) lazyNegatable(t *Tensor) bool {
	if _, ok := layoutOf(t); !ok || t.pending != nil {
		return false
	}
	if t.Offset != 0 || !t.Contiguous() || t.Numel() != t.Storage.Numel {
		return false
	}
	return c.storageUsers()[t.Storage] == 1
}

// storageUsers counts the tensors viewing each storage. A conversion
// changes values, never the tree's shape, so it is counted once.
func (c *Checkpoint) storageUsers() map[*Storage]int {
	if c.users == nil {
		c.users = make(map[*Storage]int, len(c.storages))
		walkTensors(c.Root, map[any]bool{}, func(t *Tensor) { c.users[t.Storage]++ })
	}
	return c.users
}

// NegateChannels negates slices ch of dim 0 of a state-dict tensor (a
// convolution's output channels; graph.ChannelNegater). It reports whether
// the values change: a set of all-zero channels is left as it is. A
// channel listed twice is negated once.
func (c *Checkpoint) NegateChannels(key string, channels []int) (bool, error) {
	t, ok := c.Tensor(key)
	if !ok {
		return false, fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	changed, err := c.negate(t, channels, true)
	if err != nil {
		return false, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	return changed, nil
}

// negateChannels negates channels of any tensor of the checkpoint (an
// optimizer buffer), always: a negated zero becomes -0 in the output, as it
// does when decoded and encoded again.
func (c *Checkpoint) negateChannels(t *Tensor, channels []int) error {
	_, err := c.negate(t, channels, false)
	return err
}

func (c *Checkpoint) negate(t *Tensor, channels []int, onlyIfNonzero bool) (bool, error) {
	if len(t.Shape) == 0 {
		return false, fmt.Errorf("a scalar has no channels to negate")
	}
	chans, bad, ok := negate.Set(channels, t.Shape[0])
	if !ok {
		return false, fmt.Errorf("channel %d out of range [0, %d)", bad, t.Shape[0])
	}
	if len(chans) == 0 {
		return false, nil
	}
	if !c.lazyNegatable(t) {
		return c.negateDecoded(t, chans, onlyIfNonzero)
	}
	if onlyIfNonzero {
		nz, err := c.anyNonzero(t, chans)
		if err != nil || !nz {
			return false, err
		}
	}
	t.negate = negate.Xor(t.negate, chans)
	c.lazyNegated = append(c.lazyNegated, t)
	return true, nil
}

// negateDecoded is the general path: decode, negate, keep the values for
// the writer to encode.
func (c *Checkpoint) negateDecoded(t *Tensor, chans []int, onlyIfNonzero bool) (bool, error) {
	v, err := c.TensorValues(t)
	if err != nil {
		return false, err
	}
	inner := len(v) / t.Shape[0]
	changed := false
	for _, ch := range chans {
		for i := ch * inner; i < (ch+1)*inner && !changed; i++ {
			changed = v[i] != 0
		}
	}
	if onlyIfNonzero && !changed {
		return false, nil
	}
	negate.Values(v, t.Shape[0], chans)
	return true, c.SetTensorValues(t, v)
}

// anyNonzero reports whether any element of the channels is nonzero,
// reading the channels' bytes a buffer at a time and stopping at the first
// nonzero element. It does not check the record's CRC: the copy does, and
// fails the conversion, before any output is in place.
func (c *Checkpoint) anyNonzero(t *Tensor, chans []int) (bool, error) {
	l, _ := layoutOf(t)
	buf := make([]byte, 0, 64<<10)
	for _, ch := range chans {
		end := int64(ch+1) * l.ChannelBytes
		for off := int64(ch) * l.ChannelBytes; off < end; {
			n := min(int64(cap(buf)), end-off)
			b, err := c.readRaw(t.Storage, off, buf[:n])
			if err != nil {
				return false, err
			}
			if l.AnyNonzero(b) {
				return true, nil
			}
			off += n
		}
	}
	return false, nil
}

// readRaw reads len(buf) bytes of a storage's record at start without
// checking the record's CRC (see anyNonzero).
func (c *Checkpoint) readRaw(st *Storage, start int64, buf []byte) ([]byte, error) {
	if start < 0 || start+int64(len(buf)) > st.rec.size {
		return nil, fmt.Errorf("reading %s: bytes [%d, %d) lie outside its %d bytes", st.rec.name, start, start+int64(len(buf)), st.rec.size)
	}
	if st.rec.zf != nil {
		return c.readRange(st, start, int64(len(buf)))
	}
	if _, err := c.f.ReadAt(buf, st.rec.offset+start); err != nil {
		return nil, fmt.Errorf("reading %s: %w", st.rec.name, err)
	}
	return buf, nil
}

// copyNegated copies st's record into the archive with t's negations
// applied, checking the input's CRC.
func (c *Checkpoint) copyNegated(z *zipWriter, name string, st *Storage, t *Tensor) error {
	rc, err := c.openRecord(st)
	if err != nil {
		return fmt.Errorf("%s: %s: %w", c.Path, st.rec.name, err)
	}
	defer rc.Close()
	l, _ := layoutOf(t)
	fr := &negate.Reader{R: rc, Layout: l, Chans: t.negate}
	out := func() uint32 { return fr.CRC ^ l.CRCDelta(t.negate, 0, st.rec.size) }
	if _, err := z.addSum(name, st.rec.size, fr, out); err != nil {
		return fmt.Errorf("%s: copying %s: %w", c.Path, st.rec.name, err)
	}
	if st.rec.hasCRC && fr.CRC != st.rec.crc {
		return fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, fr.CRC, st.rec.crc)
	}
	return nil
}

// StreamTensor writes a state-dict tensor's bytes, contiguous row-major,
// with pending negations applied, straight from its record, when the tensor
// is a whole record's only view (ok false otherwise: the caller encodes
// Values). The record's CRC is checked as it streams.
func (c *Checkpoint) StreamTensor(key string, w io.Writer) (ok bool, err error) {
	t, found := c.Tensor(key)
	if !found || t.pending != nil || t.Offset != 0 || !t.Contiguous() || t.Numel() != t.Storage.Numel || c.storageUsers()[t.Storage] != 1 {
		return false, nil
	}
	st := t.Storage
	rc, err := c.openRecord(st)
	if err != nil {
		return true, fmt.Errorf("%s: %s: %w", c.Path, st.rec.name, err)
	}
	defer rc.Close()
	var r io.Reader = io.LimitReader(rc, st.rec.size)
	var crc func() uint32
	if l, float := layoutOf(t); float {
		fr := &negate.Reader{R: r, Layout: l, Chans: t.negate}
		r, crc = fr, func() uint32 { return fr.CRC }
	} else {
		h := crc32.NewIEEE()
		r, crc = io.TeeReader(r, h), h.Sum32
	}
	n, err := io.Copy(w, r)
	if err != nil {
		return true, fmt.Errorf("%s: copying %s: %w", c.Path, st.rec.name, err)
	}
	if n != st.rec.size {
		return true, fmt.Errorf("%s: record %s ended after %d of %d bytes", c.Path, st.rec.name, n, st.rec.size)
	}
	if st.rec.hasCRC && crc() != st.rec.crc {
		return true, fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, crc(), st.rec.crc)
	}
	return true, nil
}
