package pth

import (
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"runtime/debug"
	"syscall"

	"github.com/abnconvert/abnconvert/negate"
)

// copyMapped copies a stored record into the archive from a memory map of
// the input, a window at a time: write(2) then copies page cache to page
// cache once, where read(2) into a buffer and write(2) out of it copy every
// byte twice. Everything but the writing runs on the other core, a chunk
// ahead: the map is not populated up front, so its pages are faulted in
// there, by the pass that checks the record's CRC (each byte is read once),
// and the same pass flips the sign bits of t's pending negations into a
// scratch copy of the chunks they touch. The output's CRC is combined from
// the same chunk CRCs, changed for the flipped chunks by the flips' own
// CRC (negate.CRCDelta), without reading the flipped copy. The windows are
// unmapped as the copy moves on, so resident memory stays at one window
// (and its scratch copy) whatever the file's size.
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
		if z.flip == nil {
			z.flip = make([]byte, window)
		}
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
		m, err := syscall.Mmap(int(c.f.Fd()), base, int(at-base+n), syscall.PROT_READ, syscall.MAP_SHARED)
		if err != nil {
			return fmt.Errorf("%s: mapping %s: %w", c.Path, st.rec.name, err)
		}
		data := m[at-base:]
		nchunks := int((n + chunk - 1) / chunk)
		sums := make([]uint32, nchunks)
		outSums := make([]uint32, nchunks)
		pieces := make([][][]byte, nchunks) // a flipped chunk's pieces
		ready := make(chan struct{}, nchunks)
		done := make(chan any, 1)
		go func() {
			debug.SetPanicOnFault(true) // per goroutine
			defer func() {
				done <- recover()
				close(ready)
			}()
			for k := range sums {
				lo, hi := int64(k)*chunk, min(int64(k+1)*chunk, n)
				b := data[lo:hi]
				sums[k] = crc32.ChecksumIEEE(b)
				if pos := off + lo; chans != nil && l.Touches(chans, pos, hi-lo) {
					pieces[k] = l.Segments(z.flip[lo:hi], b, chans, pos, nil)
					outSums[k] = sums[k] ^ l.CRCDelta(chans, pos, hi-lo)
				} else {
					outSums[k] = sums[k]
				}
				ready <- struct{}{}
			}
		}()
		for k := 0; k < nchunks && err == nil; k++ {
			if _, ok := <-ready; !ok {
				break // a fault in the map: re-raised below
			}
			var w int
			if pieces[k] == nil {
				w, err = z.w.Write(data[int64(k)*chunk : min(int64(k+1)*chunk, n)])
			} else {
				w, err = writePieces(z.w, pieces[k])
			}
			z.off += int64(w)
		}
		if r := <-done; r != nil {
			panic(r) // a fault in the map: recovered above as a read error
		}
		for k := range sums {
			ln := min(int64(k+1)*chunk, n) - int64(k)*chunk
			crcIn = crc32Combine(crcIn, sums[k], ln)
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

// writePieces writes bufs in order: in one vectored write where w takes
// one (the unflipped bytes straight from the map), else one by one.
func writePieces(w io.Writer, bufs [][]byte) (int, error) {
	if vw, ok := w.(vecWriter); ok {
		return vw.WriteVec(bufs)
	}
	total := 0
	for _, b := range bufs {
		n, err := w.Write(b)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
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
