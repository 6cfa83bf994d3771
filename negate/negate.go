// Package negate negates output channels of stored float tensors without
// decoding them. Negating a float is flipping its sign bit, in every float
// format (float64, float32, float16, bfloat16), so a sign fold's change to
// a convolution's weights is a byte transform applied while the tensor
// streams from the input file to the output: no value is decoded or held.
package negate

import (
	"encoding/binary"
	"hash/crc32"
	"io"
	"slices"
	"sort"
	"sync/atomic"
)

// Layout is where a tensor's channels and sign bits lie in its bytes:
// contiguous, row-major, little-endian, dim 0 the channel.
type Layout struct {
	ChannelBytes int64 // bytes of one dim-0 slice
	ElemSize     int64
	SignByte     int64 // offset of the sign bit's byte within an element
}

// FloatLayout is the layout of a contiguous float tensor of elemSize-byte
// elements and shape, and false when negating is not a sign flip (an
// integer dtype) or there are no channels.
func FloatLayout(float bool, elemSize int, shape []int) (Layout, bool) {
	if !float || elemSize == 0 || len(shape) == 0 || shape[0] == 0 {
		return Layout{}, false
	}
	n := 1
	for _, d := range shape[1:] {
		n *= d
	}
	return Layout{ChannelBytes: int64(n) * int64(elemSize), ElemSize: int64(elemSize), SignByte: int64(elemSize - 1)}, true
}

// Xor is the symmetric difference of two sorted channel sets: a channel
// negated twice has its own sign again. The result is never nil.
func Xor(a, b []int) []int {
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

// Set returns channels sorted without repeats, and the first index outside
// [0, n) if any (ok false).
func Set(channels []int, n int) (set []int, bad int, ok bool) {
	for _, ch := range channels {
		if ch < 0 || ch >= n {
			return nil, ch, false
		}
	}
	if len(channels) == 0 {
		return nil, 0, true
	}
	// Sorted, then repeats dropped: a fold passes thousands of channels,
	// and a map of them was most of the cost.
	set = slices.Clone(channels)
	slices.Sort(set)
	return slices.Compact(set), 0, true
}

// AnyNonzero reports whether b, whole elements of l's layout, holds an
// element that is not zero of either sign (NaN counts as nonzero).
func (l Layout) AnyNonzero(b []byte) bool {
	for i := int64(0); i+l.ElemSize <= int64(len(b)); i += l.ElemSize {
		for k := int64(0); k < l.ElemSize; k++ {
			x := b[i+k]
			if k == l.SignByte {
				x &^= 0x80
			}
			if x != 0 {
				return true
			}
		}
	}
	return false
}

// Reader streams a tensor's bytes from R with the sign of every element of
// the listed channels flipped. CRC is the CRC-32 of the bytes as read
// (before the flip), for checking the input's own checksum.
type Reader struct {
	R      io.Reader
	Layout Layout
	Chans  []int // sorted
	CRC    uint32
	pos    int64
	next   int // first channel in Chans that may still lie ahead
}

func (s *Reader) Read(p []byte) (int, error) {
	n, err := s.R.Read(p)
	s.CRC = crc32.Update(s.CRC, crc32.IEEETable, p[:n])
	s.next = s.Layout.apply(s.Chans, s.next, s.pos, p[:n])
	s.pos += int64(n)
	return n, err
}

// Apply flips the sign bits that fall in b, the tensor's bytes from offset
// pos, of the elements of the channels chans (sorted).
func (l Layout) Apply(chans []int, pos int64, b []byte) {
	i := sort.Search(len(chans), func(i int) bool { return int64(chans[i]+1)*l.ChannelBytes > pos })
	l.apply(chans, i, pos, b)
}

// Touches reports whether any of the channels' bytes lie in [pos, pos+n).
func (l Layout) Touches(chans []int, pos, n int64) bool {
	i := sort.Search(len(chans), func(i int) bool { return int64(chans[i]+1)*l.ChannelBytes > pos })
	return i < len(chans) && int64(chans[i])*l.ChannelBytes < pos+n
}

// apply flips from chans[next] on and returns the first channel that may
// still extend past b, for a stream that calls it on consecutive buffers.
func (l Layout) apply(chans []int, next int, pos int64, b []byte) int {
	lo, hi := pos, pos+int64(len(b))
	for next < len(chans) {
		cs := int64(chans[next]) * l.ChannelBytes
		ce := cs + l.ChannelBytes
		if cs >= hi {
			break
		}
		a, e := max(cs, lo), min(ce, hi)
		l.xorRun(b[a-lo:e-lo], b[a-lo:e-lo], a-cs)
		if ce > hi {
			break
		}
		next++
	}
	return next
}

// runs calls fn for each run of consecutive listed channels (sorted) that
// overlaps [lo, hi), clipped to it: [a, e) and the offset of a within the
// run's first channel (element boundaries lie every ElemSize bytes from
// there, as every channel starts on one).
func (l Layout) runs(chans []int, lo, hi int64, fn func(a, e, phase int64)) {
	i := sort.Search(len(chans), func(i int) bool { return int64(chans[i]+1)*l.ChannelBytes > lo })
	for i < len(chans) {
		cs := int64(chans[i]) * l.ChannelBytes
		if cs >= hi {
			return
		}
		j := i
		for j+1 < len(chans) && chans[j+1] == chans[j]+1 && int64(chans[j+1])*l.ChannelBytes < hi {
			j++
		}
		a := max(cs, lo)
		fn(a, min(int64(chans[j]+1)*l.ChannelBytes, hi), a-cs)
		i = j + 1
	}
}

// Runs calls fn for each run of consecutive listed channels (sorted) that
// overlaps [lo, hi), clipped to it: the byte ranges [a, e) that Apply
// changes.
func (l Layout) Runs(chans []int, lo, hi int64, fn func(a, e int64)) {
	l.runs(chans, lo, hi, func(a, e, _ int64) { fn(a, e) })
}

// CopyApply is copy(dst, src) then Apply(chans, pos, dst), in one pass:
// src is the tensor's bytes from offset pos, dst as long.
func (l Layout) CopyApply(dst, src []byte, chans []int, pos int64) {
	lo, cur := pos, pos
	l.runs(chans, pos, pos+int64(len(src)), func(a, e, phase int64) {
		copy(dst[cur-lo:a-lo], src[cur-lo:a-lo])
		l.xorRun(dst[a-lo:e-lo], src[a-lo:e-lo], phase)
		cur = e
	})
	copy(dst[cur-lo:], src[cur-lo:])
}

// Segments is CopyApply without the copy: it writes the channels' runs of
// src, flipped, one after another into dst (Flipped(chans, pos, len(src))
// bytes) and returns, appended to vec, the pieces that make the flipped
// bytes in order: src where nothing flips, dst where it does. A vectored
// write of them writes what CopyApply's dst holds, and the unflipped bytes
// are never copied.
//
// Why dst holds the runs only: a copy's scratch is then as large as what
// flips (a tenth of a trained densenet201's conversion's bytes), not as
// what it copies. Sized by the pieces, the chunked copy's scratch was 8 MB
// of fresh heap on densenet201 trained, faulted in page by page.
func (l Layout) Segments(dst, src []byte, chans []int, pos int64, vec [][]byte) [][]byte {
	lo, hi, cur := pos, pos+int64(len(src)), pos
	var k int64 // dst's bytes so far
	l.runs(chans, lo, hi, func(a, e, phase int64) {
		if a > cur {
			vec = append(vec, src[cur-lo:a-lo])
		}
		d := dst[k : k+e-a : k+e-a]
		l.xorRun(d, src[a-lo:e-lo], phase)
		vec = append(vec, d)
		k += e - a
		cur = e
	})
	if hi > cur {
		vec = append(vec, src[cur-lo:])
	}
	return vec
}

// Flipped is how many bytes of [pos, pos+n) the channels' runs cover: the
// scratch Segments needs.
func (l Layout) Flipped(chans []int, pos, n int64) int64 {
	var k int64
	l.runs(chans, pos, pos+n, func(a, e, _ int64) { k += e - a })
	return k
}

// xorRun writes src to dst (the same length; they may be the same slice)
// with every sign bit flipped, src starting at byte phase of an element
// run. Eight bytes at a time where the element size divides 8 (every
// float), one word mask serving the whole run.
func (l Layout) xorRun(dst, src []byte, phase int64) {
	es := l.ElemSize
	k := 0
	if es > 0 && 8%es == 0 {
		var w uint64
		for b := int64(0); b < 8; b++ {
			if (phase+b)%es == l.SignByte {
				w |= 0x80 << (8 * b)
			}
		}
		// Four words a step, each step's slices cut to their length
		// first, so that the compiler checks bounds once a step rather
		// than at every word.
		dst := dst[:len(src)]
		for ; len(src)-k >= 32; k += 32 {
			s, d := src[k:k+32:k+32], dst[k:k+32:k+32]
			binary.LittleEndian.PutUint64(d[0:8], binary.LittleEndian.Uint64(s[0:8])^w)
			binary.LittleEndian.PutUint64(d[8:16], binary.LittleEndian.Uint64(s[8:16])^w)
			binary.LittleEndian.PutUint64(d[16:24], binary.LittleEndian.Uint64(s[16:24])^w)
			binary.LittleEndian.PutUint64(d[24:32], binary.LittleEndian.Uint64(s[24:32])^w)
		}
		for ; k+8 <= len(src); k += 8 {
			binary.LittleEndian.PutUint64(dst[k:], binary.LittleEndian.Uint64(src[k:])^w)
		}
	}
	for ; k < len(src); k++ {
		x := src[k]
		if (phase+int64(k))%es == l.SignByte {
			x ^= 0x80
		}
		dst[k] = x
	}
}

// Values negates decoded row-major values of the listed channels in place,
// for a reader of a tensor whose negation is still pending.
func Values(v []float64, n0 int, chans []int) {
	if n0 == 0 {
		return
	}
	inner := len(v) / n0
	for _, ch := range chans {
		for i := ch * inner; i < (ch+1)*inner; i++ {
			v[i] = -v[i]
		}
	}
}

// CRCDelta is what flipping the sign bits of the channels chans (sorted)
// does to the CRC-32 (IEEE) of the tensor's bytes [pos, pos+n):
//
//	crc32.ChecksumIEEE(flipped) == crc32.ChecksumIEEE(original) ^ l.CRCDelta(chans, pos, n)
//
// CRC-32 is affine over GF(2), so the change is the CRC, from a zero
// state, of the flip mask alone: 0x80 at every sign byte of the flipped
// channels, zero elsewhere. The mask is a few runs of one repeated element,
// whose CRC comes from doubling and shifts (multiplications by powers of x
// modulo the polynomial), so a copy that flips signs gets its output's CRC
// from its input's without reading the output: O(runs · log n), not O(n).
func (l Layout) CRCDelta(chans []int, pos, n int64) uint32 {
	var acc uint32
	cur := pos
	l.runs(chans, pos, pos+n, func(a, e, phase int64) {
		// The first sign byte at or after a.
		first := a + (l.ElemSize+l.SignByte-phase%l.ElemSize)%l.ElemSize
		if first >= e {
			return
		}
		m := (e-1-first)/l.ElemSize + 1 // sign bytes in [a, e)
		last := first + (m-1)*l.ElemSize
		// The run's mask from its first sign byte is the element (zeros,
		// then 0x80 at SignByte) repeated m times less its leading zeros,
		// which a zero state does not see, then e-last-1 zeros.
		acc = shift(acc, e-cur) ^ shift(l.repeated(m), e-last-1)
		cur = e
	})
	return shift(acc, pos+n-cur)
}

// repeated is the CRC from a zero state of a run's mask from its first
// sign byte: 0x80, then m-1 times (ElemSize-1 zeros, 0x80). Cached as
// xPow is: a checkpoint's runs have few lengths.
func (l Layout) repeated(m int64) uint32 {
	key := uint64(m)<<4 | uint64(l.ElemSize)
	cacheable := m > 0 && m < 1<<28 && l.ElemSize > 0 && l.ElemSize < 16
	var slot *atomic.Uint64
	if cacheable {
		slot = &repeatCache[key*0x9e3779b97f4a7c15>>(64-repeatCacheBits)]
		if e := slot.Load(); e>>32 == key {
			return uint32(e)
		}
	}
	unit := make([]byte, l.ElemSize)
	unit[l.ElemSize-1] = 0x80
	w1 := rawCRC(unit)
	// w is the CRC of k units, by doubling over the bits of m-1.
	var w uint32
	k := int64(0)
	for b := 62; b >= 0; b-- {
		if k > 0 {
			w = shift(w, k*l.ElemSize) ^ w
			k *= 2
		}
		if (m-1)>>b&1 != 0 {
			w = shift(w, l.ElemSize) ^ w1
			k++
		}
	}
	v := shift(rawCRC([]byte{0x80}), k*l.ElemSize) ^ w
	if cacheable {
		slot.Store(key<<32 | uint64(v))
	}
	return v
}

// repeatCache holds repeated's keys (m and ElemSize; 0: none) in the high
// half of each word and their CRCs in the low half.
var repeatCache [1 << repeatCacheBits]atomic.Uint64

const repeatCacheBits = 10

// Combine returns the CRC-32 (IEEE) of A followed by B from crcA, crcB
// and len(B), without reading either: CRC is affine over GF(2), and
// appending n bytes multiplies by x^(8n) modulo the polynomial (zlib's
// crc32_combine).
func Combine(crcA, crcB uint32, lenB int64) uint32 { return shift(crcA, lenB) ^ crcB }

// rawCRC is the CRC-32 (IEEE) register after b from a zero state, without
// the standard's initial and final inversions: linear in b.
func rawCRC(b []byte) uint32 { return ^crc32.Update(0xffffffff, crc32.IEEETable, b) }

// shift is the register after n zero bytes from state v: v times x^(8n)
// modulo the (reflected) polynomial, by the powers x^(2^k) (zlib's
// multmodp and x2nmodp).
func shift(v uint32, n int64) uint32 {
	if v == 0 || n <= 0 {
		return v
	}
	return multModP(xPow(n), v)
}

// xPow is x^(8n) modulo the polynomial, cached: a checkpoint's runs and
// gaps have few lengths (a grouped convolution's thin channels make tens
// of thousands of runs of one length). The cache is a table of atomic
// words, each a length and its power, without a lock: behind a mutex and
// a map, the lookup was most of what CRCDelta cost (about 70 ns a run).
// Two lengths that share a slot take turns; each is computed again.
func xPow(n int64) uint32 {
	if n <= 0 {
		return 1 << 31 // x^0 (shift asks for no shorter run)
	}
	if n >= 1<<32 {
		return powOf(n)
	}
	slot := &powCache[uint64(n)*0x9e3779b97f4a7c15>>(64-powCacheBits)]
	if e := slot.Load(); e>>32 == uint64(n) {
		return uint32(e)
	}
	p := powOf(n)
	slot.Store(uint64(n)<<32 | uint64(p))
	return p
}

// powOf is x^(8n) modulo the polynomial, from the powers x^(2^k).
func powOf(n int64) uint32 {
	p := uint32(1) << 31 // x^0
	for k, m := 3, n; m != 0; m, k = m>>1, k+1 {
		if m&1 != 0 {
			p = multModP(x2n[k&31], p)
		}
	}
	return p
}

// powCache holds xPow's lengths (below 2^32; 0: none) in the high half of
// each word and their powers in the low half.
var powCache [1 << powCacheBits]atomic.Uint64

const powCacheBits = 12

// x2n[k] is x^(2^k) modulo the polynomial; zlib indexes it modulo 32 (the
// powers repeat with that period; TestShiftComposes checks it past 2^32
// bytes).
var x2n = func() (t [32]uint32) {
	p := uint32(1) << 30 // x^1
	t[0] = p
	for k := 1; k < 32; k++ {
		p = multModP(p, p)
		t[k] = p
	}
	return t
}()

// multModP multiplies a and b modulo the CRC-32 polynomial, both in the
// reflected representation (bit 31 is x^0). Without branches: the bits of
// a product of two CRCs are coin flips, and zlib's loop, which branches
// on each, mispredicted half of them (180 ns a product here, 36 without,
// a benchmark on the bench VM, 2026-12-06).
func multModP(a, b uint32) uint32 {
	var p uint32
	for range 32 {
		p ^= b & -(a >> 31)
		a <<= 1
		b = b>>1 ^ (0xedb88320 & -(b & 1))
	}
	return p
}
