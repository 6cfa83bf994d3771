package pth

import (
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	"github.com/abnconvert/abnconvert/negate"
)

// copyMapped copies a stored record into the archive from a memory map of
// the input, a window at a time: write(2) then copies page cache to page
// cache once, where read(2) into a buffer and write(2) out of it copy every
// byte twice. Everything but the writing runs on the other core, ahead of
// it (mapper): mapping, populating the map, checking the record's CRC (each
// byte is read once) and flipping the sign bits of the record's pending
// negations into a scratch copy of the chunks they touch. The output's CRC
// is combined from the same chunk CRCs, changed for the flipped chunks by
// the flips' own CRC (negate.CRCDelta), without reading the flipped copy.
// Windows are unmapped as the copy moves on, so resident memory stays at
// two windows (and their scratch copies) whatever the file's size.
func (c *Checkpoint) copyMapped(z *zipWriter, name string, st *Storage, mp *mapper) (err error) {
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
	var crcIn, crcOut uint32
	for done := int64(0); done < st.rec.size; {
		w, ok := <-mp.windows
		if !ok || w.st != st {
			return fmt.Errorf("%s: copying %s: the map windows are out of step with the records", c.Path, st.rec.name)
		}
		if w.err != nil {
			return w.err
		}
		if w.fault != nil {
			syscall.Munmap(w.m)
			panic(w.fault) // a fault in the map: recovered above as a read error
		}
		for k := range w.sums {
			lo, hi := int64(k)*mapChunk, min(int64(k+1)*mapChunk, int64(len(w.data)))
			var n int
			if w.pieces[k] == nil {
				n, err = z.w.Write(w.data[lo:hi])
			} else {
				n, err = writePieces(z.w, w.pieces[k])
			}
			z.off += int64(n)
			if err != nil {
				break
			}
			crcIn = crc32Combine(crcIn, w.sums[k], hi-lo)
			crcOut = crc32Combine(crcOut, w.outSums[k], hi-lo)
		}
		done += int64(len(w.data))
		// The mapper unmaps it, off this core: an unmap (a TLB flush on
		// every core) took the writer 6 ms of resnext101_32x8d's 356 MB.
		mp.free <- spent{flip: w.flip, m: w.m}
		if err != nil {
			return fmt.Errorf("writing %s: %w", name, err)
		}
	}
	if st.rec.hasCRC && crcIn != st.rec.crc {
		return fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, crcIn, st.rec.crc)
	}
	return z.finish(e, crcOut)
}

// mapWindow is one window of a record copyMapped copies, made ready by the
// mapper: data (in the map m) cut in chunks of mapChunk bytes, each with
// the CRC of its bytes and of its output (flipped where t negates
// channels, pieces then being the chunk's bytes to write, unflipped ones
// from the map and flipped ones from flip). The writer unmaps m and hands
// flip back to the mapper.
type mapWindow struct {
	st            *Storage
	m, data, flip []byte
	sums, outSums []uint32
	pieces        [][][]byte
	fault         any // a fault in the map while reading it
	err           error
}

// mapWindowSize is the size of copyMapped's windows (the tests lower it to
// copy their small fixtures' records in several).
var mapWindowSize int64 = 4 << 20

// mappedRecord is a record copyMapped copies, with the tensor whose
// negations it applies (nil: none).
type mappedRecord struct {
	st *Storage
	t  *Tensor
}

// mapper makes the windows of every record copyMapped copies ready, in the
// order they are written, on a goroutine of its own: at most two at a
// time, the one written and the next, which may be the next record's, so
// that the writer never waits for a record's first window.
type mapper struct {
	windows <-chan *mapWindow
	free    chan spent // written windows back: scratch copies for flips (made on first need), maps to unmap
	stop    chan struct{}
}

// spent is a window the writer is done with.
type spent struct{ flip, m []byte }

func (c *Checkpoint) startMapper(recs []mappedRecord, late *lateFlips) *mapper {
	const inFlight = 2
	out := make(chan *mapWindow)
	mp := &mapper{windows: out, free: make(chan spent, inFlight), stop: make(chan struct{})}
	for i := 0; i < inFlight; i++ {
		mp.free <- spent{}
	}
	page := int64(os.Getpagesize())
	go func() {
		defer close(out)
		for _, r := range recs {
			var l negate.Layout
			var chans []int
			t := r.t
			if t == nil && late != nil {
				t = late.take(r.st)
			}
			if t != nil {
				l, _ = layoutOf(t)
				chans = t.negate
			}
			size := r.st.rec.size
			for off := int64(0); off < size; off += mapWindowSize {
				var flip []byte
				select {
				case <-mp.stop: // first: a scratch copy may be free too
					return
				default:
				}
				select {
				case sp := <-mp.free:
					if sp.m != nil {
						syscall.Munmap(sp.m) // (a map of ours, whole: no error to expect)
					}
					flip = sp.flip
				case <-mp.stop:
					return
				}
				if flip == nil && chans != nil {
					flip = make([]byte, mapWindowSize)
				}
				n := min(mapWindowSize, size-off)
				at := r.st.rec.offset + off
				base := at &^ (page - 1)
				w := &mapWindow{st: r.st, flip: flip}
				m, err := syscall.Mmap(int(c.f.Fd()), base, int(at-base+n), syscall.PROT_READ, syscall.MAP_SHARED)
				if err != nil {
					w.err = fmt.Errorf("%s: mapping %s: %w", c.Path, r.st.rec.name, err)
				} else {
					w.m, w.data = m, m[at-base:]
					w.fault = prepareWindow(w, l, chans, off)
				}
				select {
				case out <- w:
				case <-mp.stop:
					if w.m != nil {
						syscall.Munmap(w.m)
					}
					return
				}
				if w.err != nil || w.fault != nil {
					return
				}
			}
		}
	}()
	return mp
}

// close stops the mapper and unmaps the windows it made that were not
// written, and those written that it did not unmap.
func (mp *mapper) close() {
	close(mp.stop)
	for w := range mp.windows {
		if w.m != nil {
			syscall.Munmap(w.m)
		}
	}
	// The last windows written, which the mapper, done, did not take.
	for {
		select {
		case sp := <-mp.free:
			if sp.m != nil {
				syscall.Munmap(sp.m)
			}
		default:
			return
		}
	}
}

// prepareWindow populates w's map in one call (where the kernel has
// MADV_POPULATE_READ; otherwise the pages fault in as they are read), then
// computes its chunks' CRCs and flips. It returns a fault in the map.
func prepareWindow(w *mapWindow, l negate.Layout, chans []int, off int64) (fault any) {
	debug.SetPanicOnFault(true) // per goroutine
	defer func() { fault = recover() }()
	syscall.Madvise(w.m, madvPopulateRead)
	n := int64(len(w.data))
	nchunks := int((n + mapChunk - 1) / mapChunk)
	w.sums = make([]uint32, nchunks)
	w.outSums = make([]uint32, nchunks)
	w.pieces = make([][][]byte, nchunks)
	for k := range w.sums {
		lo, hi := int64(k)*mapChunk, min(int64(k+1)*mapChunk, n)
		b := w.data[lo:hi]
		w.sums[k] = crc32.ChecksumIEEE(b)
		w.outSums[k] = w.sums[k]
		if pos := off + lo; chans != nil && l.Touches(chans, pos, hi-lo) {
			w.pieces[k] = l.Segments(w.flip[lo:hi], b, chans, pos, nil)
			w.outSums[k] ^= l.CRCDelta(chans, pos, hi-lo)
		}
	}
	return nil
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
// compressed), to be copied from a map, and maps are what this machine
// copies faster (chooseMaps).
func (c *Checkpoint) mappable(st *Storage) bool {
	return mapCopy && st.rec.zf == nil && st.rec.size >= mapMin && !c.maps.reads
}

// mapChoice is a checkpoint's choice of copy for its large records, made
// once by chooseMaps.
type mapChoice struct {
	once  sync.Once
	reads bool // read them through buffers (pipeCopy), not maps
}

// mapProbe makes chooseMaps measure; tests turn it off to choose the
// copy themselves (mapCopy).
var mapProbe = true

// chooseMaps decides, before the first large record is copied, whether
// the large records are copied from maps of the input or read through the
// writer's buffers. A map saves the copy into a buffer, but each page of
// it costs a page-table entry set and cleared, which on some VMs is a
// call into the hypervisor: on one measured 2026-12-02 (an AMD EPYC guest
// with a paravirtualised MMU, where a page fault costs 11 µs), copying
// wide_resnet101_2 from maps took 419 ms median and 660 ms CPU, through
// buffers 195 ms and 271 ms (`cp`: 102 ms). Where page tables are cheap
// the map wins by the copy it saves. So both are timed on a record
// itself, a map window's bytes each (mapsFaster), best of three, and maps
// are kept only where they take less than three quarters of the read's
// time: the probe maps alone, while the copy unmaps with its other
// threads running, and on the VM above it timed maps (1 MiB then) at
// 1.4-3.5 times the read where the whole copy took 2.1 times as long.
// The output is the same bytes either way. The read buffer is the
// writer's first pipe buffer, which the reads then use.
func (c *Checkpoint) chooseMaps(z *zipWriter, plan *writePlan) {
	if !mapCopy || !mapProbe {
		return
	}
	c.maps.once.Do(func() {
		// The probe reads and maps its window three times each (2-3 ms
		// on the VM of 2026-12-05), as much as maps save on 7 windows
		// there: below mapProbeMin the large records are read. Probed:
		// the first record a whole window long, else the longest.
		var probe *Storage
		var mappable int64
		for _, s := range plan.storages {
			if s.data == nil && s.stream == nil && s.src != nil && s.src.rec.zf == nil && s.src.rec.size >= max(mapMin, copyBufLen) {
				mappable += s.src.rec.size
				if probe == nil || probe.rec.size < min(s.src.rec.size, mapWindowSize) {
					probe = s.src
				}
			}
		}
		switch {
		case probe == nil:
		case mappable < mapProbeMin:
			c.maps.reads = true
		default:
			c.maps.reads = !c.mapsFaster(z, probe)
		}
	})
}

// mapProbeMin is the least the large records of a checkpoint must hold
// for chooseMaps to probe (16 windows): a DenseNet's few large records
// (14 MB of densenet201's 81) are read.
var mapProbeMin int64 = 64 << 20

// mapsFaster times a map of st's record as the copy makes one (a window
// of up to mapWindowSize bytes, populated, then unmapped) against reading
// the same bytes as the copy reads them (copyBufLen at a time), best of
// three each, and reports whether the map took less than three quarters
// of the read's time.
//
// The same bytes each way: a map's cost is mostly per call (the mmap,
// the populate's walk, the unmap's TLB flush), a read's per byte, so a
// probe of 1 MiB each (as before 2026-12-05) charged the map four times
// its share. On this project's VM that day a 1 MiB map took 84-138 µs
// against 135-178 for reading it (reads chosen), a 4 MiB window 169-289
// µs against 448-603 for four reads (maps chosen). Copied from maps,
// resnext101_32x8d init's median went from 210 to 197 ms,
// wide_resnet101_2 trained's from 305 to 289, the 2 GB one's (init)
// from 1,091 to 967, with 5-21% less CPU (bench/alternate.md). On the VM
// of the paravirtualised MMU above, where a page's entry cost
// microseconds, a window costs that per page, four times a 1 MiB map,
// and reads should still be chosen (not measured again: that VM's MMU is
// no longer seen).
func (c *Checkpoint) mapsFaster(z *zipWriter, st *Storage) bool {
	buf := z.pipeBuffers()[0][:copyBufLen]
	page := int64(os.Getpagesize())
	size := min(mapWindowSize, st.rec.size)
	base := st.rec.offset &^ (page - 1)
	n := int(st.rec.offset - base + size)
	readAll := func() error {
		for off := int64(0); off < size; off += copyBufLen {
			if _, err := c.f.ReadAt(buf[:min(copyBufLen, size-off)], st.rec.offset+off); err != nil {
				return err
			}
		}
		return nil
	}
	if err := readAll(); err != nil { // (the buffer's own pages fault in here)
		return true // the copy meets the error again
	}
	read, mapped := time.Duration(1<<62), time.Duration(1<<62)
	for range 3 {
		t0 := time.Now()
		if err := readAll(); err != nil {
			return true
		}
		read = min(read, time.Since(t0))
		t0 = time.Now()
		m, err := syscall.Mmap(int(c.f.Fd()), base, n, syscall.PROT_READ, syscall.MAP_SHARED)
		if err != nil {
			return false
		}
		if syscall.Madvise(m, madvPopulateRead) != nil {
			// No MADV_POPULATE_READ (before Linux 5.14): the copy's maps
			// then fault their pages in as they are read, a cost this
			// probe would have to touch the map to see; keep the maps,
			// as before the probe.
			syscall.Munmap(m)
			return true
		}
		syscall.Munmap(m)
		mapped = min(mapped, time.Since(t0))
	}
	return 4*mapped < 3*read
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
