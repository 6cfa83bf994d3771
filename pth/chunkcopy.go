package pth

import (
	"errors"
	"fmt"
	"hash/crc32"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/abnconvert/abnconvert/negate"
)

// vecAtWriter writes several pieces of one range of a file in one call
// (output.File).
type vecAtWriter interface {
	WriteVecAt(bufs [][]byte, off int64) (int, error)
}

// chunkLen is the range of the output writeChunked writes at a time: its
// writes start and end on multiples of it, which is what lets ext4
// (Linux 6.x, large folios) make the file's page cache of folios as large
// as the range. Written front to back in 1 MiB pieces, 81 MB cost the
// kernel about half the CPU of the same bytes written record by record at
// their 64-byte aligned offsets (8.5 ms against 16.5, a test program on
// the bench VM, 2026-12-06).
var chunkLen int64 = 1 << 20

// chunkWindow is how much of the input's map writeChunked populates at a
// time (MADV_POPULATE_READ: its page-table entries set in one call rather
// than a fault at a time), and the least it releases (MADV_DONTNEED) at
// once, so that resident memory stays at a few windows whatever the
// file's size. Both on huge-page boundaries of the file, where the map's
// huge-page entries are made and dropped whole.
const chunkWindow = 2 << 20

// chunksInFlight is how many chunks writeChunked prepares ahead of the one
// it writes.
const chunksInFlight = 2

// chunkable reports whether writeChunked can write every storage of plan
// through z: input records stored uncompressed, or contents held in
// memory, into an output that takes positioned vectored writes.
func (c *Checkpoint) chunkable(z *zipWriter, plan *writePlan) bool {
	if !chunkCopy || c.f == nil || len(plan.storages) == 0 {
		return false
	}
	if _, ok := z.w.(vecAtWriter); !ok {
		return false
	}
	if _, ok := z.w.(interface{ MoveTo(int64) error }); !ok {
		return false
	}
	for _, s := range plan.storages {
		if s.stream != nil || (s.data == nil && (s.src == nil || s.src.rec.zf != nil)) {
			return false
		}
	}
	return true
}

// chunkCopy selects writeChunked where chunkable; tests turn it off to
// compare with the other copies.
var chunkCopy = true

// chunkSource is where writeChunked takes the input's bytes from:
// chunkAuto chooses (slowMap), the tests force one or the other.
type chunkSource int

const (
	chunkAuto chunkSource = iota
	chunkFromMap
	chunkFromReads
)

var chunkSourceFor = chunkAuto

// chunkedFrom, when set (tests), is told where each chunked copy takes
// the input's bytes from: a map, or reads.
var chunkedFrom func(mapped bool)

// chunkMapSlow is the time above which populating the first window of the
// input's map makes writeChunked read the file instead. Reading a window
// (2 MB) into a buffer copies it in about 0.15 ms here; populating one
// whose page cache is in huge folios sets a few entries (4-5 µs), one of
// small folios 512 (90-175 µs on the bench VM, where a file read back
// with cat(1) has its first 30 MB in small folios, the rest in huge ones,
// 2026-12-06), which still saves the buffer and the copy into it; on a VM
// whose page-table changes are calls to the hypervisor (11-15 µs a fault,
// measured 2026-12-02) it would take about 6 ms.
var chunkMapSlow = time.Millisecond

// outChunk is one chunk of writeChunked's output: its pieces, in order,
// from at, and the memory they point into (besides the map and the
// plan's new contents), reused once it is written.
type outChunk struct {
	at     int64
	pieces [][]byte
	arena  []byte // headers and descriptors
	flips  []byte // bytes of negated channels, flipped
	data   []byte // bytes read from the input (chunkFromReads)
	inPos  int64  // the input offset after its last mapped byte
	ends   []*chunkEnd
	err    error
}

// chunkEnd is a record whose last byte lies in a chunk (or an earlier
// one): once the chunk is written, the record is in the file.
type chunkEnd struct {
	s     *outStorage
	entry int // its entry's index in z.entries
	e     zipEntry
	crcIn uint32 // its input bytes' CRC (checked)
	final bool   // written with the contents the plan or late gave it
}

// hold returns n bytes of the chunk's arena (a new one where this has no
// room: the pieces still point into it).
func (ch *outChunk) hold(n int) []byte {
	if len(ch.arena)+n > cap(ch.arena) {
		ch.arena = make([]byte, 0, max(n, 16<<10))
	}
	ch.arena = ch.arena[:len(ch.arena)+n]
	return ch.arena[len(ch.arena)-n:]
}

// room returns n bytes of *b, grown to chunkLen on first need.
func room(b *[]byte, n int64) []byte {
	if int64(len(*b))+n > int64(cap(*b)) {
		*b = make([]byte, 0, max(n, chunkLen))
	}
	*b = (*b)[:int64(len(*b))+n]
	return (*b)[int64(len(*b))-n:]
}

// writeChunked writes the records of every storage of plan, in order,
// from z.off on: the bytes writeRecords writes, but a chunk of the output
// at a time rather than a record at a time, each chunk (chunkLen bytes,
// on multiples of it) in one pwritev of its pieces: the records' headers
// and descriptors from memory, their bytes straight from a map of the
// input (or read into the chunk where maps cost more: chunkMapSlow), the
// negated channels from a flipped copy, new contents published meanwhile
// from memory. The input's CRCs are checked on the way. A goroutine
// prepares the chunks (CRCs, flips, reads) ahead of the writes.
//
// Why: read into a buffer and written out of it record by record, a
// record's bytes are copied twice, and the output's page cache is made
// of small folios. On densenet201's 79 MB of records, three goroutines
// reading, checking and writing record by record used 27-32 ms of CPU;
// chunks from a map 15-17, chunks read 19-22 (a test program, 2026-12-06).
//
// Negations and new contents published while it runs (late) are taken
// as a record's first byte is reached; Finish edits the records written
// before theirs were known.
func (c *Checkpoint) writeChunked(z *zipWriter, plan *writePlan, late *lateFlips, stop <-chan struct{}) error {
	w := z.w.(vecAtWriter)
	// The records' ends are checked against the file before it is
	// mapped: a map reads zeros, not an error, past the end of a file
	// within its last page.
	fi, err := c.f.Stat()
	if err != nil {
		return fmt.Errorf("%s: %w", c.Path, err)
	}
	var mapLen int64
	firstIn := int64(-1)
	for _, s := range plan.storages {
		if s.data == nil {
			end := s.src.rec.offset + s.src.rec.size
			if fi.Size() < end {
				return fmt.Errorf("%s: %s ends at byte %d, past the end of the file (%d bytes): the file is truncated or changed while read", c.Path, s.src.rec.name, end, fi.Size())
			}
			mapLen = max(mapLen, end)
			if firstIn < 0 {
				firstIn = s.src.rec.offset
			}
		}
	}
	var m []byte
	if mapLen > 0 && chunkSourceFor != chunkFromReads {
		if m, err = syscall.Mmap(int(c.f.Fd()), 0, int(mapLen), syscall.PROT_READ, syscall.MAP_SHARED); err != nil {
			m = nil // read it instead
		} else if chunkSourceFor == chunkAuto && slowMap(m, firstIn) {
			syscall.Munmap(m)
			m = nil
		}
	}
	if m != nil {
		defer syscall.Munmap(m)
	}
	if chunkedFrom != nil {
		chunkedFrom(m != nil)
	}

	start := z.off
	full := make(chan *outChunk, chunksInFlight)
	free := make(chan *outChunk, chunksInFlight+1)
	for range chunksInFlight + 1 {
		free <- &outChunk{}
	}
	quit := make(chan struct{})
	var end int64
	go func() {
		defer close(full)
		end = c.prepareChunks(z, plan, m, start, late, full, free, quit, stop)
	}()
	var werr error
	ow := overwriter{c: c, z: z, w: w, m: m, late: late, crcs: map[int]uint32{}}
	for ch := range full {
		if werr == nil {
			werr = ch.err
		}
		if werr == nil {
			var n int
			n, werr = w.WriteVecAt(ch.pieces, ch.at)
			if werr == nil && int64(n) != chunkBytes(ch.pieces) {
				werr = fmt.Errorf("wrote %d bytes of %d", n, chunkBytes(ch.pieces))
			}
			if werr == nil {
				werr = ow.written(ch.ends)
			}
			if werr != nil {
				close(quit) // the preparer stops; what it sent is drained
			}
		}
		// Release the map behind the copy. (The records come in the
		// input's order; where one does not, its pages are only mapped
		// again: a released range of a file's map reads the file again.)
		if lo := ch.inPos &^ (2<<20 - 1); m != nil && lo >= ow.zapped+chunkWindow {
			syscall.Madvise(m[ow.zapped:lo], syscall.MADV_DONTNEED)
			ow.zapped = lo
		}
		clear(ch.pieces)
		clear(ch.ends)
		ch.pieces, ch.arena, ch.flips, ch.data, ch.ends, ch.err = ch.pieces[:0], ch.arena[:0], ch.flips[:0], ch.data[:0], ch.ends[:0], nil
		free <- ch
	}
	if werr != nil {
		return werr
	}
	if late != nil && late.allWritten != nil {
		close(late.allWritten)
	}
	// Ended before the signs settled (PrewriteLater): the negations are
	// written over here as soon as they are out, beside the conversion's
	// last passes, rather than edited by Finish after them, one read and
	// one write a run of channels (densenet201 trained: 10-15 ms where
	// its copy ended first).
	if late != nil && late.settled != nil && len(ow.waiting) > 0 {
		select {
		case <-late.settled:
		case <-stop:
			return errStopped
		}
		if err := ow.written(nil); err != nil { // what is out by now
			return err
		}
	}
	for i, crc := range ow.crcs {
		z.entries[i].crc = crc
	}
	return z.seek(end) // appending goes on after the records
}

func chunkBytes(pieces [][]byte) int64 {
	var n int64
	for _, p := range pieces {
		n += int64(len(p))
	}
	return n
}

// slowMap populates the map's first window of records (from the input
// offset first) and reports whether that took longer than chunkMapSlow.
func slowMap(m []byte, first int64) bool {
	lo := max(first, 0) &^ (2<<20 - 1)
	hi := min(lo+chunkWindow, int64(len(m)))
	const madvPopulateRead = 22
	t := time.Now()
	if syscall.Madvise(m[lo:hi], madvPopulateRead) != nil {
		return false // no MADV_POPULATE_READ (before Linux 5.14): faults as read
	}
	return time.Since(t) > chunkMapSlow
}

// errChunkQuit ends prepareChunks when the writer has failed.
var errChunkQuit = errors.New("chunked copy stopped")

// prepareChunks is writeChunked's goroutine: it lays the records out from
// the output offset start, makes each chunk's pieces (from the map m, or
// read from the file where m is nil) and sends the chunks on full, taking
// their memory from free. It returns where the records end and their
// entries appended to z's. A failure is sent as a chunk's err.
func (c *Checkpoint) prepareChunks(z *zipWriter, plan *writePlan, m []byte, start int64, late *lateFlips, full, free chan *outChunk, quit, stop <-chan struct{}) (end int64) {
	var ch *outChunk
	pos := start
	var inPos, populated int64
	fail := func(err error) {
		if ch == nil {
			ch = &outChunk{}
		}
		ch.err = err
		select {
		case full <- ch:
		case <-quit:
		}
	}
	// A file truncated under the map faults on access: that is the input
	// changing while it is read, an error, not a crash.
	debug.SetPanicOnFault(true) // this goroutine's own
	defer func() {
		if r := recover(); r != nil {
			fail(fmt.Errorf("%s: reading it: the file changed or ended while it was read (%v)", c.Path, r))
		}
	}()
	next := func() error {
		select {
		case ch = <-free:
		case <-quit:
			return errChunkQuit
		}
		ch.at = pos
		return nil
	}
	send := func() error {
		ch.inPos = inPos
		select {
		case full <- ch:
		case <-quit:
			return errChunkQuit
		}
		ch = nil
		return next()
	}
	// put adds n bytes of the output at pos to the chunk, cut into the
	// parts [lo, hi) that lie in one chunk each (cut makes their pieces),
	// sending the chunk each time pos reaches a multiple of chunkLen.
	put := func(n int64, cut func(lo, hi int64) error) error {
		for lo := int64(0); lo < n; {
			hi := min(n, lo+chunkLen-pos%chunkLen)
			if err := cut(lo, hi); err != nil {
				return err
			}
			pos += hi - lo
			lo = hi
			if pos%chunkLen == 0 {
				if err := send(); err != nil {
					return err
				}
			}
		}
		return nil
	}
	// putBytes puts b, which stays as it is until the chunks are written
	// (the plan's new contents); putCopy puts a copy of b, made in the
	// arena of each chunk it lies in (a header, a descriptor: a chunk's
	// arena is reused once it is written, and a header may lie across two).
	putBytes := func(b []byte) error {
		return put(int64(len(b)), func(lo, hi int64) error {
			ch.pieces = append(ch.pieces, b[lo:hi])
			return nil
		})
	}
	putCopy := func(b []byte) error {
		return put(int64(len(b)), func(lo, hi int64) error {
			a := ch.hold(int(hi - lo))
			copy(a, b[lo:hi])
			ch.pieces = append(ch.pieces, a)
			return nil
		})
	}
	if err := next(); err != nil {
		return 0
	}
	for _, s := range plan.storages {
		select {
		case <-stop:
			fail(errStopped)
			return 0
		default:
		}
		if late != nil {
			if err := late.wrote(z, stop); err != nil {
				fail(err)
				return 0
			}
		}
		end, err := c.chunkRecord(z, s, m, &pos, &inPos, &populated, late, &ch, put, putBytes, putCopy)
		if err != nil {
			if err != errChunkQuit {
				fail(err)
			}
			return 0
		}
		// In z's entries as each is prepared (the writer changes only
		// CRCs, at the end): late.wrote counts them (the tests'
		// holdCopyAt).
		end.entry = len(z.entries)
		z.entries = append(z.entries, end.e)
		// With the chunk it ends in, or with the next (its last bytes
		// sent already): written once that one is.
		ch.ends = append(ch.ends, end)
	}
	if len(ch.pieces) > 0 || len(ch.ends) > 0 {
		ch.inPos = inPos
		select {
		case full <- ch:
		case <-quit:
		}
	}
	return pos
}

// chunkRecord puts one storage's record, header to descriptor, into the
// chunks (prepareChunks), and returns it as written (its entry, its
// input's CRC, whether later changes may still concern it).
func (c *Checkpoint) chunkRecord(z *zipWriter, s *outStorage, m []byte, pos, inPos, populated *int64, late *lateFlips, ch **outChunk,
	put func(int64, func(lo, hi int64) error) error, putBytes, putCopy func([]byte) error) (*chunkEnd, error) {
	end := &chunkEnd{s: s, final: true}
	name := "archive/data/" + s.key
	size := s.length()
	var buf [256]byte // a header's or descriptor's bytes, copied into the chunks
	e, h := z.header(buf[:0], name, size, *pos)
	if err := putCopy(h); err != nil {
		return nil, err
	}
	e.data = *pos
	if s.data != nil {
		if err := putBytes(s.data); err != nil {
			return nil, err
		}
		e.crc = crc32.ChecksumIEEE(s.data)
	} else {
		st := s.src
		t := s.negated
		if t == nil && late != nil {
			t = late.take(st)
		}
		var nd []byte // new contents published meanwhile: written instead
		if late != nil {
			nd = late.takeData(st)
		}
		var l negate.Layout
		if t != nil {
			l, _ = layoutOf(t)
		}
		var crc uint32
		err := put(size, func(lo, hi int64) error {
			cur := *ch
			var b []byte
			if m != nil {
				if end := st.rec.offset + hi; end > *populated {
					// The next window's entries in one call.
					wlo := max(*populated, (st.rec.offset+lo)&^(2<<20-1))
					whi := min(max(end, wlo+chunkWindow), int64(len(m)))
					const madvPopulateRead = 22
					syscall.Madvise(m[wlo:whi], madvPopulateRead)
					*populated = whi
				}
				b = m[st.rec.offset+lo : st.rec.offset+hi]
				*inPos = st.rec.offset + hi
			} else {
				b = room(&cur.data, hi-lo)
				if _, err := c.f.ReadAt(b, st.rec.offset+lo); err != nil {
					return fmt.Errorf("%s: reading %s: %w", c.Path, st.rec.name, err)
				}
			}
			crc = crc32.Update(crc, crc32.IEEETable, b)
			switch {
			case nd != nil:
				cur.pieces = append(cur.pieces, nd[lo:hi])
			case t != nil && l.Touches(t.negate, lo, hi-lo):
				if m != nil {
					cur.pieces = l.Segments(room(&cur.flips, hi-lo), b, t.negate, lo, cur.pieces)
				} else {
					l.Apply(t.negate, lo, b)
					cur.pieces = append(cur.pieces, b)
				}
			default:
				cur.pieces = append(cur.pieces, b)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		if st.rec.hasCRC && crc != st.rec.crc {
			return nil, fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, crc, st.rec.crc)
		}
		switch {
		case nd != nil:
			e.crc = crc32.ChecksumIEEE(nd)
		case t != nil:
			e.crc = crc ^ l.CRCDelta(t.negate, 0, size)
		default:
			e.crc = crc
		}
		end.crcIn, end.final = crc, nd != nil || t != nil
	}
	if err := putCopy(e.descriptor(buf[:0])); err != nil {
		return nil, err
	}
	end.e = e
	return end, nil
}

// overwriteGap is the most bytes between two flipped runs of a record that
// the overwriter writes again in one write rather than two: a write costs
// a few microseconds, about what copying 16-32 KB into the page cache
// does.
const overwriteGap = 16 << 10

// overwriter writes again, whole, the records writeChunked wrote before
// the changes published meanwhile (late: negations once the signs settle,
// new contents at Finish) were known, from the input's bytes, as soon as
// both the record is in the file and its changes are out: a record
// written over costs about half as much as written fresh (the page cache
// it lands in is there, in large folios: 44 MB in 5.3-5.6 ms against
// 10-11.4, a test program on the bench VM, 2026-12-06), and nothing is
// read back. It marks them taken (late), so that Finish edits only what
// was published after.
type overwriter struct {
	z       *zipWriter // its headers, as the copy wrote them
	c       *Checkpoint
	w       vecAtWriter
	m       []byte
	late    *lateFlips
	waiting []*chunkEnd // written before their changes, if any, were out
	flips   *map[*Storage]*Tensor
	data    *map[*Storage][]byte
	crcs    map[int]uint32 // entry index -> its CRC once written over
	buf     []byte
	pieces  [][]byte
	group   []newContents // neighbours to write again in one write
	// zapped is where the copy has released m up to; lo, hi the input
	// range written over since the last release, mapped again.
	zapped, lo, hi int64
}

// written takes the records just written (ends), and writes over every
// waiting record whose changes are now out.
func (o *overwriter) written(ends []*chunkEnd) error {
	if o.late == nil {
		return nil
	}
	fl, dm := o.late.flips.Load(), o.late.data.Load()
	scan := ends
	if fl != o.flips || dm != o.data {
		// New changes out: every record waiting may have some.
		o.flips, o.data = fl, dm
		for _, d := range ends {
			if !d.final {
				o.waiting = append(o.waiting, d)
			}
		}
		scan, o.waiting = o.waiting, nil
	}
	for _, d := range scan {
		if d.final {
			continue
		}
		var nd []byte
		var t *Tensor
		if dm != nil {
			nd = (*dm)[d.s.src]
		}
		if fl != nil && nd == nil {
			t = (*fl)[d.s.src]
		}
		if nd == nil && t == nil {
			o.waiting = append(o.waiting, d)
			continue
		}
		if nd != nil {
			// New contents (a BN's vectors, one record after the
			// other): neighbours in one write.
			if n := len(o.group); n > 0 {
				last := o.group[n-1].d.e
				if last.data+last.size+last.descriptorLen() != d.e.off || d.e.data+d.e.size-o.group[0].d.e.data > chunkLen {
					if err := o.writeGroup(); err != nil {
						return err
					}
				}
			}
			o.group = append(o.group, newContents{d, nd})
			continue
		}
		if err := o.writeGroup(); err != nil {
			return err
		}
		if err := o.overwrite(d, t); err != nil {
			return err
		}
		o.release(false)
	}
	if err := o.writeGroup(); err != nil {
		return err
	}
	o.release(true)
	return nil
}

// newContents is a record the overwriter writes again with new contents.
type newContents struct {
	d  *chunkEnd
	nd []byte
}

// writeGroup writes the records of o.group, neighbours in the output, again
// with their new contents, in one write: each one's bytes and descriptor,
// and the local headers between them (as the copy wrote them: the same
// names, sizes and offsets).
func (o *overwriter) writeGroup() error {
	if len(o.group) == 0 {
		return nil
	}
	o.pieces = o.pieces[:0]
	for i, g := range o.group {
		e := g.d.e
		if i > 0 {
			_, h := o.z.header(nil, e.name, e.size, e.off)
			o.pieces = append(o.pieces, h)
		}
		e.crc = crc32.ChecksumIEEE(g.nd)
		o.pieces = append(o.pieces, g.nd, e.descriptor(nil))
		o.crcs[g.d.entry] = e.crc
	}
	if _, err := o.w.WriteVecAt(o.pieces, o.group[0].d.e.data); err != nil {
		return fmt.Errorf("writing %s: %w", o.group[0].d.e.name, err)
	}
	o.late.mu.Lock()
	if o.late.takenData == nil {
		o.late.takenData = map[*Storage][]byte{}
	}
	for _, g := range o.group {
		o.late.takenData[g.d.s.src] = g.nd
	}
	o.late.overwritten += len(o.group)
	o.late.mu.Unlock()
	clear(o.group)
	o.group = o.group[:0]
	return nil
}

// release releases what the copy had released and the overwrites mapped
// again, on huge-page boundaries, once it spans a window (all, at the end
// of a scan): the records written over since the signs settled can be
// most of the file (resnext101_32x8d trained), which the map otherwise
// held.
func (o *overwriter) release(all bool) {
	if o.m == nil || o.hi <= o.lo || (!all && o.hi-o.lo < chunkWindow) {
		return
	}
	lo, hi := o.lo&^(2<<20-1), o.hi&^(2<<20-1)
	if all {
		hi = (o.hi + 2<<20 - 1) &^ (2<<20 - 1)
	}
	if hi = min(hi, o.zapped); hi > lo {
		syscall.Madvise(o.m[lo:hi], syscall.MADV_DONTNEED)
	}
	if all {
		o.lo, o.hi = 0, 0
	} else {
		o.lo = max(o.lo, hi)
	}
}

// overwrite writes d's record again with the negations of t, or the new
// contents nd, and its descriptor, and notes them taken.
func (o *overwriter) overwrite(d *chunkEnd, t *Tensor) error {
	st, e := d.s.src, d.e
	size := e.size
	l, _ := layoutOf(t)
	e.crc = d.crcIn ^ l.CRCDelta(t.negate, 0, size)
	// The flipped runs only, those less than overwriteGap apart in
	// one write (the bytes between as the copy wrote them), each
	// write at most chunkLen; the descriptor's CRC with the last
	// one where it is that close to the end, else on its own.
	var spans [][2]int64
	l.Runs(t.negate, 0, size, func(a, b int64) {
		if n := len(spans); n > 0 && a-spans[n-1][1] < overwriteGap && b-spans[n-1][0] <= chunkLen {
			spans[n-1][1] = b
			return
		}
		for ; b-a > chunkLen; a += chunkLen {
			spans = append(spans, [2]int64{a, a + chunkLen})
		}
		spans = append(spans, [2]int64{a, b})
	})
	desc := e.descriptor(nil)
	if n := len(spans); n == 0 || size-spans[n-1][1] >= overwriteGap || size-spans[n-1][0] > chunkLen {
		spans = append(spans, [2]int64{size, size})
	} else {
		spans[n-1][1] = size
	}
	if o.buf == nil {
		o.buf = make([]byte, chunkLen)
	}
	for k, sp := range spans {
		lo, hi := sp[0], sp[1]
		o.pieces = o.pieces[:0]
		if o.m != nil {
			src := o.m[st.rec.offset+lo : st.rec.offset+hi]
			if o.hi == 0 {
				o.lo = st.rec.offset + lo
			}
			o.lo, o.hi = min(o.lo, st.rec.offset+lo), max(o.hi, st.rec.offset+hi)
			o.pieces = l.Segments(o.buf[:hi-lo], src, t.negate, lo, o.pieces)
		} else if hi > lo {
			b := o.buf[:hi-lo]
			if _, err := o.c.f.ReadAt(b, st.rec.offset+lo); err != nil {
				return fmt.Errorf("%s: reading %s: %w", o.c.Path, st.rec.name, err)
			}
			l.Apply(t.negate, lo, b)
			o.pieces = append(o.pieces, b)
		}
		if k == len(spans)-1 {
			o.pieces = append(o.pieces, desc)
		}
		if _, err := o.w.WriteVecAt(o.pieces, e.data+lo); err != nil {
			return fmt.Errorf("writing %s: %w", e.name, err)
		}
	}
	o.late.mu.Lock()
	o.late.overwritten++
	o.late.taken[st] = t
	o.late.mu.Unlock()
	o.crcs[d.entry] = e.crc
	return nil
}
