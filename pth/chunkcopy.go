package pth

import (
	"errors"
	"fmt"
	"hash/crc32"
	"runtime/debug"
	"sync/atomic"
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

// outChunk is a batch of writeChunked's writes: pieces, written op by op,
// each op's pieces in one pwritev at its offset, and the memory they point
// into (besides the map and the plan's new contents), reused once they
// are written. A chunk of the copy is one op, a chunkLen range of the
// output; the writes over records written before their changes came out
// are ops of chunks of their own.
type outChunk struct {
	at     int64 // the output offset of the copy's next piece
	pieces [][]byte
	ops    []chunkOp
	arena  []byte // headers and descriptors
	flips  []byte // bytes of negated channels, flipped
	data   []byte // bytes read from the input (chunkFromReads)
	inPos  int64  // the input offset after its last mapped byte
	// remapLo and remapHi bound the input's pages that writes over records
	// mapped again (chunker.patchFlips), released once written.
	remapLo, remapHi int64
	last             bool // every record is written once this chunk is
	err              error
}

// chunkOp is one write of an outChunk: pieces[from:end] (from: the
// previous op's end) at at.
type chunkOp struct {
	at  int64
	end int
}

// chunkEnd is a record the copy has laid out in its chunks, as it was
// written there.
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

// room returns n bytes of *b, which grows (a new array: the pieces still
// point into the old one) by doubling, from least bytes to chunkLen. The
// flipped channels of a chunk are a tenth of it or less (densenet201
// trained), and a fresh MB of heap costs a few hundred microseconds of
// page faults on the bench VM; the bytes read fill the chunk.
func room(b *[]byte, n, least int64) []byte {
	if int64(len(*b))+n > int64(cap(*b)) {
		*b = make([]byte, 0, max(n, min(2*int64(cap(*b)), chunkLen), least))
	}
	*b = (*b)[:int64(len(*b))+n]
	return (*b)[int64(len(*b))-n:]
}

// scratch is how many bytes of flipped or read copies the chunk holds.
func (ch *outChunk) scratch() int64 { return int64(len(ch.flips) + len(ch.data)) }

// reset empties the chunk for its next use, keeping its memory.
func (ch *outChunk) reset() {
	clear(ch.pieces)
	ch.pieces, ch.ops, ch.arena, ch.flips, ch.data = ch.pieces[:0], ch.ops[:0], ch.arena[:0], ch.flips[:0], ch.data[:0]
	ch.inPos, ch.remapLo, ch.remapHi, ch.last, ch.err = 0, 0, 0, false, nil
}

// writeChunked writes the records of every storage of plan, in order,
// from z.off on: the bytes writeRecords writes, but a chunk of the output
// at a time rather than a record at a time, each chunk (chunkLen bytes,
// on multiples of it) in one pwritev of its pieces: the records' headers
// and descriptors from memory, their bytes straight from a map of the
// input (or read into the chunk where maps cost more: chunkMapSlow), the
// negated channels from a flipped copy, new contents published meanwhile
// from memory. The input's CRCs are checked on the way. A goroutine
// prepares the chunks (CRCs, flips, reads) ahead of the writes, which
// this one makes.
//
// Why: read into a buffer and written out of it record by record, a
// record's bytes are copied twice, and the output's page cache is made
// of small folios. On densenet201's 79 MB of records, three goroutines
// reading, checking and writing record by record used 27-32 ms of CPU;
// chunks from a map 15-17, chunks read 19-22 (a test program, 2026-12-06).
//
// Negations and new contents published while it runs (late) are taken
// as a record's first byte is reached, and the records written before
// are written over as soon as their changes are out (chunker.patch):
// where the copy ends before the signs settle (PrewriteLater), it waits
// for them. Finish edits what comes out after it ended.
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

	full := make(chan *outChunk, chunksInFlight)
	free := make(chan *outChunk, chunksInFlight+1)
	for range chunksInFlight + 1 {
		free <- &outChunk{}
	}
	quit := make(chan struct{})
	k := &chunker{c: c, z: z, m: m, late: late, full: full, free: free, quit: quit, stop: stop, pos: z.off}
	go func() {
		defer close(full)
		k.run(plan)
	}()
	var werr error
	for ch := range full {
		if werr == nil {
			werr = ch.err
		}
		if werr == nil {
			from := 0
			for _, op := range ch.ops {
				pieces := ch.pieces[from:op.end]
				from = op.end
				n, err := w.WriteVecAt(pieces, op.at)
				if err == nil && int64(n) != chunkBytes(pieces) {
					err = fmt.Errorf("wrote %d bytes of %d", n, chunkBytes(pieces))
				}
				if err != nil {
					werr = err
					close(quit) // the chunker stops; what it sent is drained
					break
				}
			}
		}
		// Release the map behind the copy. (The records come in the
		// input's order; where one does not, its pages are only mapped
		// again: a released range of a file's map reads the file again.)
		if lo := ch.inPos &^ (chunkRelease - 1); m != nil && lo >= k.zapped.Load()+chunkRelease {
			syscall.Madvise(m[k.zapped.Load():lo], syscall.MADV_DONTNEED)
			k.zapped.Store(lo)
		}
		// What writes over records mapped again behind that release is
		// released again (what lies past it goes with it later). Another
		// chunk's write over records there faults it in once more.
		if hi := min(ch.remapHi, k.zapped.Load()); m != nil && hi > ch.remapLo {
			syscall.Madvise(m[ch.remapLo:hi], syscall.MADV_DONTNEED)
		}
		if ch.last && werr == nil && late != nil && late.allWritten != nil {
			close(late.allWritten)
		}
		ch.reset()
		select {
		case free <- ch:
		default: // one fail made: the chunker has ended
		}
	}
	if werr != nil {
		return werr
	}
	return z.seek(k.end) // appending goes on after the records
}

// chunkRelease is the least writeChunked releases of the input's map at
// once (MADV_DONTNEED), on multiples of it (of huge pages, which are then
// dropped whole): each release flushes the other cores' TLBs.
const chunkRelease = 4 << 20

func chunkBytes(pieces [][]byte) int64 {
	var n int64
	for _, p := range pieces {
		n += int64(len(p))
	}
	return n
}

// slowMap populates the map's first window of records (from the input
// offset first) and reports whether that took longer than chunkMapSlow,
// and so did the next one: one window in five or ten takes 1.9-2.9 ms
// now and then on the bench VM where the rest take 0.2, a spike two
// windows in a row do not meet, and that would have the whole file read.
func slowMap(m []byte, first int64) bool {
	lo := max(first, 0) &^ (2<<20 - 1)
	slow := false
	for range 2 {
		hi := min(lo+chunkWindow, int64(len(m)))
		if hi <= lo {
			break // a file of one window: its verdict
		}
		t := time.Now()
		if syscall.Madvise(m[lo:hi], madvPopulateRead) != nil {
			return false // no MADV_POPULATE_READ (before Linux 5.14): faults as read
		}
		if time.Since(t) <= chunkMapSlow {
			return false
		}
		slow, lo = true, hi
	}
	return slow
}

// madvPopulateRead is MADV_POPULATE_READ (Linux 5.14), which package
// syscall lacks.
const madvPopulateRead = 22

// pageSize is the system's page size, on which madvise's ranges start.
var pageSize = syscall.Getpagesize()

// errChunkQuit ends the chunker when the writer has failed.
var errChunkQuit = errors.New("chunked copy stopped")

// chunker is writeChunked's goroutine: it lays the records out from the
// output offset pos, makes each chunk's pieces (from the map m, or read
// from the file where m is nil) and sends the chunks on full, taking
// their memory from free; and it makes the writes over the records laid
// out before their changes came out (patch). A failure is sent as a
// chunk's err.
type chunker struct {
	c          *Checkpoint
	z          *zipWriter
	m          []byte
	late       *lateFlips
	full       chan<- *outChunk
	free       <-chan *outChunk
	quit, stop <-chan struct{}
	zapped     atomic.Int64 // the writer has released m below this input offset

	ch               *outChunk
	pos              int64 // the output offset after the pieces so far
	inPos, populated int64 // input offsets: after the last mapped byte, the populated map
	end              int64 // where the records end, once laid out

	waiting []*chunkEnd // laid out before their changes, if any, were out
	flips   *map[*Storage]*Tensor
	data    *map[*Storage][]byte
	hbuf    []byte // a header's or descriptor's bytes, copied into the chunks
}

func (k *chunker) run(plan *writePlan) {
	// A file truncated under the map faults on access: that is the input
	// changing while it is read, an error, not a crash.
	debug.SetPanicOnFault(true) // this goroutine's own
	defer func() {
		if r := recover(); r != nil {
			k.fail(fmt.Errorf("%s: reading it: the file changed or ended while it was read (%v)", k.c.Path, r))
		}
	}()
	if err := k.next(); err != nil {
		return
	}
	for _, s := range plan.storages {
		select {
		case <-k.stop:
			k.fail(errStopped)
			return
		default:
		}
		if k.late != nil {
			if err := k.late.wrote(k.z, k.stop); err != nil {
				k.fail(err)
				return
			}
		}
		if err := k.patch(); err != nil {
			k.fail(err)
			return
		}
		if err := k.record(s); err != nil {
			k.fail(err)
			return
		}
	}
	k.end = k.pos
	k.ch.last = true
	if err := k.send(); err != nil {
		return
	}
	// Laid out before the signs settled (PrewriteLater): the negations
	// are written over as soon as they are out, beside the conversion's
	// last passes, rather than edited by Finish after them, one read and
	// one write a run of channels (densenet201 trained: 10-15 ms where
	// its copy ended first).
	if k.late != nil && k.late.settled != nil && len(k.waiting) > 0 {
		select {
		case <-k.late.settled:
		case <-k.stop:
			k.fail(errStopped)
			return
		case <-k.quit:
			return
		}
		if err := k.next(); err != nil {
			return
		}
		if err := k.patch(); err != nil {
			k.fail(err)
			return
		}
		k.send()
	}
}

// fail sends err to the writer, with the chunk in hand.
func (k *chunker) fail(err error) {
	if err == errChunkQuit {
		return
	}
	if k.ch == nil {
		k.ch = &outChunk{}
	}
	k.ch.err = err
	select {
	case k.full <- k.ch:
	case <-k.quit:
	}
	k.ch = nil
}

// next takes a chunk to fill from pos on.
func (k *chunker) next() error {
	select {
	case k.ch = <-k.free:
	case <-k.quit:
		return errChunkQuit
	}
	k.ch.at = k.pos
	return nil
}

// send hands the chunk to the writer, the copy's pieces since the chunk's
// last op as one more op.
func (k *chunker) send() error {
	ch := k.ch
	if n := len(ch.ops); len(ch.pieces) > 0 && (n == 0 || ch.ops[n-1].end < len(ch.pieces)) {
		ch.ops = append(ch.ops, chunkOp{at: ch.at, end: len(ch.pieces)})
	}
	ch.inPos = k.inPos
	k.ch = nil
	select {
	case k.full <- ch:
		return nil
	case <-k.quit:
		return errChunkQuit
	}
}

// put adds n bytes of the output at pos to the chunk, cut into the parts
// [lo, hi) that lie in one chunk each (cut makes their pieces), sending
// the chunk each time pos reaches a multiple of chunkLen.
func (k *chunker) put(n int64, cut func(lo, hi int64) error) error {
	for lo := int64(0); lo < n; {
		hi := min(n, lo+chunkLen-k.pos%chunkLen)
		if err := cut(lo, hi); err != nil {
			return err
		}
		k.pos += hi - lo
		lo = hi
		if k.pos%chunkLen == 0 {
			if err := k.send(); err != nil {
				return err
			}
			if err := k.next(); err != nil {
				return err
			}
		}
	}
	return nil
}

// putBytes puts b, which stays as it is until the chunks are written (the
// plan's new contents); putCopy puts a copy of b, made in the arena of
// each chunk it lies in (a header, a descriptor: a chunk's arena is
// reused once it is written, and a header may lie across two).
func (k *chunker) putBytes(b []byte) error {
	return k.put(int64(len(b)), func(lo, hi int64) error {
		k.ch.pieces = append(k.ch.pieces, b[lo:hi])
		return nil
	})
}

func (k *chunker) putCopy(b []byte) error {
	return k.put(int64(len(b)), func(lo, hi int64) error {
		a := k.ch.hold(int(hi - lo))
		copy(a, b[lo:hi])
		k.ch.pieces = append(k.ch.pieces, a)
		return nil
	})
}

// record lays out one storage's record, header to descriptor, and notes
// it in z's entries (the tests' holdCopyAt counts them there) and, where
// changes may still come out for it, as waiting.
func (k *chunker) record(s *outStorage) error {
	z, m := k.z, k.m
	name := "archive/data/" + s.key
	size := s.length()
	e, h := z.header(k.hbuf[:0], name, size, k.pos)
	k.hbuf = h
	if err := k.putCopy(h); err != nil {
		return err
	}
	e.data = k.pos
	end := &chunkEnd{s: s, final: true}
	if s.data != nil {
		if err := k.putBytes(s.data); err != nil {
			return err
		}
		e.crc = crc32.ChecksumIEEE(s.data)
	} else {
		st := s.src
		t := s.negated
		if t == nil && k.late != nil {
			t = k.late.take(st)
		}
		var nd []byte // new contents published meanwhile: written instead
		if k.late != nil {
			nd = k.late.takeData(st)
		}
		var l negate.Layout
		if t != nil {
			l, _ = layoutOf(t)
		}
		var crc uint32
		err := k.put(size, func(lo, hi int64) error {
			ch := k.ch
			var b []byte
			if m != nil {
				if end := st.rec.offset + hi; end > k.populated {
					// The next window's entries in one call.
					wlo := max(k.populated, (st.rec.offset+lo)&^(2<<20-1))
					whi := min(max(end, wlo+chunkWindow), int64(len(m)))
					syscall.Madvise(m[wlo:whi], madvPopulateRead)
					k.populated = whi
				}
				b = m[st.rec.offset+lo : st.rec.offset+hi]
				k.inPos = st.rec.offset + hi
			} else {
				b = room(&ch.data, hi-lo, chunkLen)
				if _, err := k.c.f.ReadAt(b, st.rec.offset+lo); err != nil {
					return fmt.Errorf("%s: reading %s: %w", k.c.Path, st.rec.name, err)
				}
			}
			crc = crc32.Update(crc, crc32.IEEETable, b)
			switch {
			case nd != nil:
				ch.pieces = append(ch.pieces, nd[lo:hi])
			case t != nil && l.Touches(t.negate, lo, hi-lo):
				if m != nil {
					ch.pieces = l.Segments(room(&ch.flips, l.Flipped(t.negate, lo, hi-lo), 64<<10), b, t.negate, lo, ch.pieces)
				} else {
					l.Apply(t.negate, lo, b)
					ch.pieces = append(ch.pieces, b)
				}
			default:
				ch.pieces = append(ch.pieces, b)
			}
			return nil
		})
		if err != nil {
			return err
		}
		if st.rec.hasCRC && crc != st.rec.crc {
			return fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", k.c.Path, st.rec.name, crc, st.rec.crc)
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
	if err := k.putCopy(e.descriptor(k.hbuf[:0])); err != nil {
		return err
	}
	end.e, end.entry = e, len(z.entries)
	z.entries = append(z.entries, e)
	if !end.final && k.late != nil {
		k.waiting = append(k.waiting, end)
	}
	return nil
}

// patchScratch is about the most flipped or read bytes a chunk of writes
// over records holds (one run may take it past): such chunks are many and
// small, and each of the chunks in flight keeps its scratch for its next
// use, so this bounds what they hold at once.
const patchScratch = 256 << 10

// overwriteGap is the most bytes between two flipped runs of a record that
// patch writes again in one write rather than two: a write costs a few
// microseconds, about what copying 16-32 KB into the page cache does.
const overwriteGap = 16 << 10

// patch writes over, once their changes are out (late: negations once the
// signs settle, new contents at Finish), the records laid out before:
// the flipped runs of channels from the input's bytes (its map, populated
// again where the writer has released it; read where there is no map),
// new contents from memory (a BN's
// vectors, neighbours, in one write with the headers between), and their
// descriptors. Those writes go to the writer after every chunk laid out
// so far, so that they land over the records as first written. It notes them
// taken (late), so that Finish edits only what comes out after, and sets
// their entries' CRCs.
//
// Why: a record written over costs about half as much as written fresh
// (its page cache is there, in large folios: 44 MB in 5.3-5.6 ms against
// 10-11.4, a test program on the bench VM, 2026-12-06), and nothing is
// read back; and the writer only writes.
func (k *chunker) patch() error {
	if k.late == nil || len(k.waiting) == 0 {
		return nil
	}
	fl, dm := k.late.flips.Load(), k.late.data.Load()
	if fl == k.flips && dm == k.data {
		return nil
	}
	k.flips, k.data = fl, dm
	changes := func(d *chunkEnd) (nd []byte, t *Tensor) {
		if dm != nil {
			nd = (*dm)[d.s.src]
		}
		if fl != nil && nd == nil {
			t = (*fl)[d.s.src]
		}
		return nd, t
	}
	var todo []*chunkEnd
	keep := k.waiting[:0]
	for _, d := range k.waiting {
		if nd, t := changes(d); nd == nil && t == nil {
			keep = append(keep, d)
		} else {
			todo = append(todo, d)
		}
	}
	clear(k.waiting[len(keep):])
	k.waiting = keep
	if len(todo) == 0 {
		return nil
	}
	// The copy's pieces so far go first, and it goes on in a chunk of
	// its own (the rest of this chunkLen range).
	if len(k.ch.pieces) > 0 {
		if err := k.send(); err != nil {
			return err
		}
		if err := k.next(); err != nil {
			return err
		}
	}
	pc := k.ch // the patches' chunk
	k.ch = nil
	// newChunk sends the patches' chunk and takes another.
	newChunk := func() error {
		k.ch = pc
		if err := k.send(); err != nil {
			return err
		}
		if err := k.next(); err != nil {
			return err
		}
		pc, k.ch = k.ch, nil
		return nil
	}
	var group []*chunkEnd // new contents, neighbours, written together
	var groupData [][]byte
	writeGroup := func() error {
		if len(group) == 0 {
			return nil
		}
		for i, d := range group {
			e := d.e
			if i > 0 {
				h0, _ := k.z.entry(e.name, e.size, e.off)
				_, h := k.z.header(pc.hold(int(h0.data - e.off))[:0], e.name, e.size, e.off)
				pc.pieces = append(pc.pieces, h)
			}
			e.crc = crc32.ChecksumIEEE(groupData[i])
			pc.pieces = append(pc.pieces, groupData[i], e.descriptor(pc.hold(int(e.descriptorLen()))[:0]))
			k.z.entries[d.entry].crc = e.crc
		}
		pc.ops = append(pc.ops, chunkOp{at: group[0].e.data, end: len(pc.pieces)})
		k.late.mu.Lock()
		if k.late.takenData == nil {
			k.late.takenData = map[*Storage][]byte{}
		}
		for i, d := range group {
			k.late.takenData[d.s.src] = groupData[i]
		}
		k.late.overwritten += len(group)
		k.late.mu.Unlock()
		group, groupData = group[:0], groupData[:0]
		return nil
	}
	for _, d := range todo {
		nd, t := changes(d)
		switch {
		case nd != nil:
			if n := len(group); n > 0 {
				last := group[n-1].e
				if last.data+last.size+last.descriptorLen() != d.e.off || d.e.data+d.e.size-group[0].e.data > chunkLen {
					if err := writeGroup(); err != nil {
						return err
					}
				}
			}
			group, groupData = append(group, d), append(groupData, nd)
		default:
			if err := writeGroup(); err != nil {
				return err
			}
			if err := k.patchFlips(&pc, d, t, newChunk); err != nil {
				return err
			}
		}
		if len(pc.ops) >= 64 || pc.scratch() >= patchScratch {
			if err := writeGroup(); err != nil {
				return err
			}
			if err := newChunk(); err != nil {
				return err
			}
		}
	}
	if err := writeGroup(); err != nil {
		return err
	}
	// The patches go, and the copy goes on from where it was.
	k.ch = pc
	if len(pc.ops) > 0 {
		if err := k.send(); err != nil {
			return err
		}
		return k.next()
	}
	return nil
}

// patchFlips adds to *pc the writes of d's flipped runs of channels (t's),
// those less than overwriteGap apart together, and of its descriptor, and
// notes d taken; newChunk sends *pc and takes another where its scratch
// is spent.
func (k *chunker) patchFlips(pc **outChunk, d *chunkEnd, t *Tensor, newChunk func() error) error {
	st, e := d.s.src, d.e
	size := e.size
	l, _ := layoutOf(t)
	e.crc = d.crcIn ^ l.CRCDelta(t.negate, 0, size)
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
	// The descriptor's CRC with the last run where it is that close to
	// the end, else on its own.
	if n := len(spans); n == 0 || size-spans[n-1][1] >= overwriteGap || size-spans[n-1][0] > chunkLen {
		spans = append(spans, [2]int64{size, size})
	} else {
		spans[n-1][1] = size
	}
	released := k.zapped.Load()
	for i, sp := range spans {
		lo, hi := sp[0], sp[1]
		need := hi - lo
		if k.m != nil {
			need = l.Flipped(t.negate, lo, hi-lo)
		}
		if s := (*pc).scratch(); s > 0 && s+need > patchScratch {
			if err := newChunk(); err != nil {
				return err
			}
		}
		ch := *pc
		if k.m != nil && hi > lo {
			if a := st.rec.offset + lo; a < released+2*chunkRelease {
				// Where the writer has released the map, or may by
				// the time this is written, the run's pages are
				// mapped again in one call (faulted in, they would
				// come a few at a time) and released once written
				// (remapLo, remapHi), rather than read into a
				// buffer: the buffers were 3 MB of fresh heap on
				// densenet201 trained, a MB a chunk in flight.
				pa := a &^ int64(pageSize-1)
				pb := min((st.rec.offset+hi+int64(pageSize)-1)&^int64(pageSize-1), int64(len(k.m)))
				syscall.Madvise(k.m[pa:pb], madvPopulateRead)
				if ch.remapHi == 0 {
					ch.remapLo = pa
				}
				ch.remapLo, ch.remapHi = min(ch.remapLo, pa), max(ch.remapHi, pb)
			}
			src := k.m[st.rec.offset+lo : st.rec.offset+hi]
			ch.pieces = l.Segments(room(&ch.flips, need, patchScratch), src, t.negate, lo, ch.pieces)
		} else if hi > lo {
			// Read where there is no map.
			b := room(&ch.data, hi-lo, chunkLen)
			if _, err := k.c.f.ReadAt(b, st.rec.offset+lo); err != nil {
				return fmt.Errorf("%s: reading %s: %w", k.c.Path, st.rec.name, err)
			}
			l.Apply(t.negate, lo, b)
			ch.pieces = append(ch.pieces, b)
		}
		if i == len(spans)-1 {
			ch.pieces = append(ch.pieces, e.descriptor(ch.hold(int(e.descriptorLen()))[:0]))
		}
		ch.ops = append(ch.ops, chunkOp{at: e.data + lo, end: len(ch.pieces)})
	}
	k.z.entries[d.entry].crc = e.crc
	k.late.mu.Lock()
	k.late.overwritten++
	k.late.taken[st] = t
	k.late.mu.Unlock()
	return nil
}
