package pth

import (
	"fmt"
	"hash/crc32"
	"os"
	"runtime/debug"
	"syscall"

	"github.com/abnconvert/abnconvert/negate"
)

// copyMapped copies a stored record into the archive from a memory map of
// the input, a window at a time: write(2) then copies page cache to page
// cache once, where read(2) into a buffer and write(2) out of it copy every
// byte twice. The record's CRC is checked on the way (each byte is read
// once: the output's CRC is combined from the same chunk CRCs, changed for
// the chunks the sign flips of t's pending negations touch by the flips'
// own CRC, without reading the flipped copy the flips are applied in). The windows are unmapped as the copy moves
// on, so resident memory stays at one window whatever the file's size.
func (c *Checkpoint) copyMapped(z *zipWriter, name string, st *Storage, t *Tensor) (err error) {
	const (
		window = 8 << 20
		chunk  = mapChunk
	)
	var l negate.Layout
	var chans []int
	if t != nil {
		l, _ = layoutOf(t)
		chans = t.negate
	}
	e, err := z.begin(name, st.rec.size)
	if err != nil {
		return err
	}
	// A file truncated under the map faults on access: that is the input
	// changing while it is read, an error, not a crash.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s: reading %s: the file changed or ended while it was read (%v)", c.Path, st.rec.name, r)
		}
	}()
	// A map reads zeros, not an error, past the end of a file within its
	// last page: a record the file no longer holds whole is refused first.
	if fi, err := c.f.Stat(); err != nil {
		return fmt.Errorf("%s: %w", c.Path, err)
	} else if end := st.rec.offset + st.rec.size; fi.Size() < end {
		return fmt.Errorf("%s: %s ends at byte %d, past the end of the file (%d bytes): the file is truncated or changed while read", c.Path, st.rec.name, end, fi.Size())
	}
	page := int64(os.Getpagesize())
	var crcIn, crcOut uint32
	size := st.rec.size
	for off := int64(0); off < size; off += window {
		n := min(window, size-off)
		at := st.rec.offset + off
		base := at &^ (page - 1)
		m, err := syscall.Mmap(int(c.f.Fd()), base, int(at-base+n), syscall.PROT_READ, syscall.MAP_SHARED|syscall.MAP_POPULATE)
		if err != nil {
			return fmt.Errorf("%s: mapping %s: %w", c.Path, st.rec.name, err)
		}
		data := m[at-base:]
		// The input's CRC is computed on the other core while this one
		// writes: per chunk, combined in order once both are done.
		nchunks := int((n + chunk - 1) / chunk)
		sums := make([]uint32, nchunks)
		done := make(chan any, 1)
		go func() {
			debug.SetPanicOnFault(true) // per goroutine
			defer func() { done <- recover() }()
			for k := range sums {
				sums[k] = crc32.ChecksumIEEE(data[int64(k)*chunk : min(int64(k+1)*chunk, n)])
			}
		}()
		outSums := make([]uint32, nchunks)
		flipped := make([]bool, nchunks)
		for k := 0; k < nchunks && err == nil; k++ {
			b := data[int64(k)*chunk : min(int64(k+1)*chunk, n)]
			pos := off + int64(k)*chunk
			out := b
			if chans != nil && l.Touches(chans, pos, int64(len(b))) {
				out = z.buf[:len(b)]
				// The flipped chunk's CRC is the input chunk's changed
				// by the flip mask's (negate.CRCDelta): no pass over
				// the output.
				outSums[k], flipped[k] = l.CRCDelta(chans, pos, int64(len(b))), true
			}
			var w int
			if vw, ok := z.w.(vecWriter); ok && flipped[k] {
				// The unflipped bytes go from the map, the flipped
				// ones from the scratch copy, in one writev.
				z.vec = l.Segments(z.buf[:len(b)], b, chans, pos, z.vec[:0])
				w, err = vw.WriteVec(z.vec)
			} else {
				if flipped[k] {
					l.CopyApply(out, b, chans, pos)
				}
				w, err = z.w.Write(out)
			}
			z.off += int64(w)
		}
		if r := <-done; r != nil {
			panic(r) // a fault in the map: recovered above as a read error
		}
		for k, sum := range sums {
			ln := min(int64(k+1)*chunk, n) - int64(k)*chunk
			crcIn = crc32Combine(crcIn, sum, ln)
			if flipped[k] {
				outSums[k] ^= sum
			} else {
				outSums[k] = sum
			}
			crcOut = crc32Combine(crcOut, outSums[k], ln)
		}
		if uerr := syscall.Munmap(m); err == nil && uerr != nil {
			err = uerr
		}
		if err != nil {
			return fmt.Errorf("writing %s: %w", name, err)
		}
	}
	if st.rec.hasCRC && crcIn != st.rec.crc {
		return fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, crcIn, st.rec.crc)
	}
	return z.finish(e, crcOut)
}

// vecWriter is a writer that takes several buffers in one call
// (output.File).
type vecWriter interface {
	WriteVec(bufs [][]byte) (int, error)
}

// mapChunk is the unit copyMapped writes and checksums.
const mapChunk = 1 << 20

// mappable reports whether a record's bytes lie stored in the file (not
// compressed), to be copied from a map.
func (c *Checkpoint) mappable(st *Storage) bool {
	return mapCopy && st.rec.zf == nil && st.rec.size >= mapMin
}

// mapMin is the smallest record copyMapped copies: a map costs two system
// calls and, on unmapping, a TLB shootdown on every core, which for the
// hundreds of small records of a DenseNet (BN vectors, thin convolutions)
// cost more than reading them through the copy buffer. The tests lower it
// to map their small fixtures.
var mapMin int64 = 1 << 20

// mapCopy selects copyMapped for stored records; tests turn it off to
// compare with the buffered copy.
var mapCopy = true
