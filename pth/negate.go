package pth

import (
	"fmt"
	"hash/crc32"
	"io"
	"sort"
)

// Negating output channels is the one change a sign fold makes to a
// convolution's weights, and for every float dtype it is a change of sign
// bits only: element i of channel c is negated by flipping the top bit of its
// bytes. So a negation is not decoded and held; it is recorded on the tensor
// and applied to the bytes while its record streams from the input to the
// output (copyNegated), with the output's CRC computed on the way. Only a
// tensor that owns its whole storage, contiguously from offset 0, can be
// treated so (its record is rewritten in place under the same key); any
// other takes the decoding path, which gives the same bytes.

// signBit reports the byte offset, within an element of size es, of the byte
// holding a float dtype's sign bit (little-endian: the last one), and false
// for a dtype whose negation is not a sign flip.
func signBitByte(d DType) (int, bool) {
	switch d {
	case Float32, Float64, Float16, BFloat16:
		return d.Size() - 1, true
	}
	return 0, false
}

// lazyNegatable reports whether t's negations can be applied to its record
// as it streams: the storage is t's alone, t covers it from offset 0
// contiguously, and the dtype's negation is a sign flip.
func (c *Checkpoint) lazyNegatable(t *Tensor) bool {
	if _, ok := signBitByte(t.DType()); !ok || t.pending != nil || len(t.Shape) == 0 || t.Shape[0] == 0 {
		return false
	}
	if t.Offset != 0 || !t.Contiguous() || t.Numel() != t.Storage.Numel {
		return false
	}
	return c.storageUsers()[t.Storage] == 1
}

// storageUsers counts the tensors viewing each storage. The tree does not
// change shape during a conversion (values do), so it is counted once.
func (c *Checkpoint) storageUsers() map[*Storage]int {
	if c.users == nil {
		c.users = map[*Storage]int{}
		walkTensors(c.Root, map[any]bool{}, func(t *Tensor) { c.users[t.Storage]++ })
	}
	return c.users
}

// NegateChannels negates slices ch of dim 0 of a state-dict tensor (the
// output channels of a convolution). It reports whether the values change:
// a negated zero is still zero, and a set of all-zero channels is left as it
// is. Listing a channel twice negates it once.
func (c *Checkpoint) NegateChannels(key string, channels []int) (bool, error) {
	t, ok := c.Tensor(key)
	if !ok {
		return false, fmt.Errorf("%s: no tensor %q in the state dict", c.Path, key)
	}
	chans, err := channelSet(t, channels)
	if err != nil {
		return false, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	if len(chans) == 0 {
		return false, nil
	}
	if !c.lazyNegatable(t) {
		changed, err := c.negateDecoded(t, chans, true)
		if err != nil {
			return false, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
		}
		return changed, nil
	}
	nz, err := c.anyNonzero(t, chans)
	if err != nil {
		return false, fmt.Errorf("%s: tensor %q: %w", c.Path, key, err)
	}
	if !nz {
		return false, nil
	}
	t.negate = xorChannels(t.negate, chans)
	return true, nil
}

// negateChannels negates channels of any tensor of the checkpoint (an
// optimizer buffer), always: a negated zero becomes -0 in the output, as it
// does when decoded and encoded again.
func (c *Checkpoint) negateChannels(t *Tensor, channels []int) error {
	chans, err := channelSet(t, channels)
	if err != nil {
		return err
	}
	if len(chans) == 0 {
		return nil
	}
	if !c.lazyNegatable(t) {
		_, err := c.negateDecoded(t, chans, false)
		return err
	}
	t.negate = xorChannels(t.negate, chans)
	if len(t.negate) == 0 {
		// Flipped back: the bytes are the input's again, but the record was
		// marked changed, which the decoding path would also report.
		t.negate = []int{}
	}
	return nil
}

// channelSet checks channel indices against dim 0 and returns them sorted,
// without repeats.
func channelSet(t *Tensor, channels []int) ([]int, error) {
	if len(t.Shape) == 0 {
		return nil, fmt.Errorf("a scalar has no channels to negate")
	}
	seen := map[int]bool{}
	var out []int
	for _, ch := range channels {
		if ch < 0 || ch >= t.Shape[0] {
			return nil, fmt.Errorf("channel %d out of range [0, %d)", ch, t.Shape[0])
		}
		if !seen[ch] {
			seen[ch] = true
			out = append(out, ch)
		}
	}
	sort.Ints(out)
	return out, nil
}

// xorChannels is the symmetric difference of two sorted channel sets: a
// channel negated twice is back to its own sign.
func xorChannels(a, b []int) []int {
	out := []int{}
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && a[i] < b[j]):
			out = append(out, a[i])
			i++
		case i == len(a) || b[j] < a[i]:
			out = append(out, b[j])
			j++
		default:
			i++
			j++
		}
	}
	return out
}

// negateDecoded is the general path: decode, negate, keep the values for
// the writer to encode. With onlyIfNonzero an all-zero selection is left
// alone and reported unchanged.
func (c *Checkpoint) negateDecoded(t *Tensor, chans []int, onlyIfNonzero bool) (bool, error) {
	v, err := c.TensorValues(t)
	if err != nil {
		return false, err
	}
	inner := len(v) / t.Shape[0]
	changed := false
	for _, ch := range chans {
		for i := ch * inner; i < (ch+1)*inner; i++ {
			if v[i] != 0 {
				changed = true
			}
			v[i] = -v[i]
		}
	}
	if onlyIfNonzero && !changed {
		return false, nil
	}
	return changed, c.SetTensorValues(t, v)
}

// channelBytes is the byte length of one dim-0 slice of t.
func channelBytes(t *Tensor) int64 {
	return int64(t.Numel()/t.Shape[0]) * int64(t.DType().Size())
}

// anyNonzero reports whether any element of the channels is not zero
// (either sign); NaN counts as nonzero. It reads the channels' bytes only,
// a buffer at a time, and stops at the first nonzero element: the record's
// CRC is checked when the record is copied, before any output is in place.
func (c *Checkpoint) anyNonzero(t *Tensor, chans []int) (bool, error) {
	es := t.DType().Size()
	sb, _ := signBitByte(t.DType())
	cb := channelBytes(t)
	buf := make([]byte, 0, 64<<10)
	for _, ch := range chans {
		for off := int64(ch) * cb; off < int64(ch+1)*cb; {
			n := min(int64(cap(buf)), int64(ch+1)*cb-off)
			b, err := c.readRaw(t.Storage, off, buf[:n])
			if err != nil {
				return false, err
			}
			for i := 0; i+es <= len(b); i += es {
				for k := 0; k < es; k++ {
					x := b[i+k]
					if k == sb {
						x &^= 0x80
					}
					if x != 0 {
						return true, nil
					}
				}
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

// negateInPlace applies negations to decoded values (Values of a tensor
// whose negation is still pending).
func negateInPlace(t *Tensor, v []float64) {
	inner := len(v) / t.Shape[0]
	for _, ch := range t.negate {
		for i := ch * inner; i < (ch+1)*inner; i++ {
			v[i] = -v[i]
		}
	}
}

// signFlipReader streams a record, flipping the sign bit of every element
// in the listed channels, and keeps the CRC-32 of the bytes as read, which
// copyNegated checks against the input archive's.
type signFlipReader struct {
	r       io.Reader
	pos     int64
	chanLen int64
	es      int64
	sb      int64
	chans   []int // sorted
	next    int   // first channel in chans that may still lie ahead
	crc     uint32
}

func (s *signFlipReader) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	b := p[:n]
	s.crc = crc32.Update(s.crc, crc32.IEEETable, b)
	lo, hi := s.pos, s.pos+int64(n)
	for s.next < len(s.chans) {
		cs := int64(s.chans[s.next]) * s.chanLen
		ce := cs + s.chanLen
		if cs >= hi {
			break
		}
		a, e := max(cs, lo), min(ce, hi)
		// The first sign byte at or after a within this channel.
		first := cs + ((a-cs+s.es-1-s.sb)/s.es)*s.es + s.sb
		for i := first; i < e; i += s.es {
			b[i-lo] ^= 0x80
		}
		if ce > hi {
			break
		}
		s.next++
	}
	s.pos = hi
	return n, err
}

// copyNegated copies st's record into the archive with t's negations
// applied, checking the input's CRC.
func (c *Checkpoint) copyNegated(z *zipWriter, name string, st *Storage, t *Tensor) error {
	rc, err := c.openRecord(st)
	if err != nil {
		return fmt.Errorf("%s: %s: %w", c.Path, st.rec.name, err)
	}
	defer rc.Close()
	sb, _ := signBitByte(t.DType())
	fr := &signFlipReader{r: rc, chanLen: channelBytes(t), es: int64(t.DType().Size()), sb: int64(sb), chans: t.negate}
	if _, err := z.add(name, st.rec.size, fr); err != nil {
		return fmt.Errorf("%s: copying %s: %w", c.Path, st.rec.name, err)
	}
	if st.rec.hasCRC && fr.crc != st.rec.crc {
		return fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, fr.crc, st.rec.crc)
	}
	return nil
}
