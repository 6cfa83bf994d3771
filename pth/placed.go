package pth

import (
	"fmt"
	"hash/crc32"
	"runtime"
	"sync"
	"unsafe"
)

// placedWriter is an output written at offsets, from several goroutines
// at once, beside appending elsewhere in it (output.File).
type placedWriter interface {
	WriteAt(p []byte, off int64) (int, error)
}

// placeable reports whether copyPlaced can copy a storage's record: an
// input record stored uncompressed and not copied from a map (chooseMaps:
// the maps have a copy of their own).
func (c *Checkpoint) placeable(s *outStorage) bool {
	return s.data == nil && s.stream == nil && s.src != nil && s.src.rec.zf == nil && !c.mappable(s.src)
}

// copyPlaced copies the input records of the storages of plan at the
// indices idx (placeable ones) into their places, offs[i] for storage i,
// on a goroutine per core, each reading a record (up to placedPiece at a
// time) into its buffer behind the record's local header, checking its
// CRC, applying its negations (late's too) and writing header, bytes and
// data descriptor with one positioned write a piece. It returns their
// entries, in any order. It runs beside the copy of the other records
// through z, whose bytes lie elsewhere in the file (z's buffer never holds
// any of theirs), and uses z only to lay out the headers.
//
// It copies the records left until the signs settle (writeBody): there
// the copy had been one reader ahead of one writer, which read and wrote
// densenet201's 57 MB of them in 18-23 ms with the writer waiting 10-14
// ms for its reads, where two goroutines each reading, checking and
// writing their own records moved 46 MB in 10 ms (pread, CRC, pwrite of
// 512 KiB records, blocks reserved; one goroutine 17 ms) on the same VM.
func (c *Checkpoint) copyPlaced(z *zipWriter, w placedWriter, plan *writePlan, idx []int, offs []int64, late *lateFlips, stop <-chan struct{}) ([]zipEntry, error) {
	var entries []zipEntry
	jobs := make(chan int)
	var (
		mu       sync.Mutex
		firstErr error
		wg       sync.WaitGroup
	)
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
	}
	// One more than the cores: the writes to a file are made one at a
	// time (output.File waits for another's write parked), so that two
	// goroutines on two cores left one idle whenever both had a piece
	// to write; a third reads and checks meanwhile (median of the
	// round's difference: densenet201 trained -0.7 ms, resnext101_32x8d
	// trained -11.4, wide_resnet101_2 trained -3.2, the 2 GB one -17.7).
	workers := min(runtime.GOMAXPROCS(0)+1, placedWorkers, len(idx))
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf []byte
			for i := range jobs {
				e, b, err := c.copyOnePlaced(z, w, plan.storages[i], offs[i], buf, late)
				buf = b
				if err != nil {
					fail(err)
					for range jobs { // drain: the feeder stops on the error
					}
					return
				}
				mu.Lock()
				entries = append(entries, e)
				mu.Unlock()
			}
		}()
	}
feed:
	for _, i := range idx {
		mu.Lock()
		failed := firstErr != nil
		mu.Unlock()
		if failed {
			break
		}
		select {
		case jobs <- i:
		case <-stop:
			fail(errStopped)
			break feed
		}
	}
	close(jobs)
	wg.Wait()
	return entries, firstErr
}

// placedWorkers bounds copyPlaced's goroutines.
const placedWorkers = 4

// placedPiece is the most bytes of a record copyPlaced reads and writes at
// once; tests lower it to copy their small records in several pieces.
var placedPiece int64 = copyBufLen

// copyOnePlaced is copyPlaced's copy of one record (s.src) whose local
// header lies at off, through buf (grown as needed, returned for the next
// record). Errors name the input and its record, or the output's write.
func (c *Checkpoint) copyOnePlaced(z *zipWriter, w placedWriter, s *outStorage, off int64, buf []byte, late *lateFlips) (zipEntry, []byte, error) {
	st := s.src
	size := st.rec.size
	name := "archive/data/" + s.key
	e, h := z.header(buf[:0], name, size, off)
	t := s.negated
	if t == nil && late != nil {
		t = late.take(st)
	}
	var nd []byte // new contents published meanwhile: written instead
	if late != nil {
		nd = late.takeData(st)
	}
	const descMax = 24
	var crc uint32
	at := off
	for pos := int64(0); ; {
		n := min(placedPiece, size-pos)
		head := len(h)
		if need := head + int(n) + descMax + copyAlign; cap(buf) < need {
			buf = make([]byte, 0, max(need, int(placedPiece)+head+descMax+copyAlign))
		}
		h = alignedAfter(buf, h)
		b := h[:head+int(n)]
		d := b[head:]
		if _, err := c.f.ReadAt(d, st.rec.offset+pos); err != nil {
			return e, buf[:0], fmt.Errorf("%s: reading %s: %w", c.Path, st.rec.name, err)
		}
		crc = crc32.Update(crc, crc32.IEEETable, d)
		switch {
		case nd != nil:
			copy(d, nd[pos:pos+n])
		case t != nil:
			l, _ := layoutOf(t)
			l.Apply(t.negate, pos, d)
		}
		pos += n
		if pos == size {
			if st.rec.hasCRC && crc != st.rec.crc {
				return e, buf[:0], fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, crc, st.rec.crc)
			}
			switch {
			case nd != nil:
				e.crc = crc32.ChecksumIEEE(nd)
			case t != nil:
				l, _ := layoutOf(t)
				e.crc = crc ^ l.CRCDelta(t.negate, 0, size)
			default:
				e.crc = crc
			}
			b = e.descriptor(b)
		}
		if _, err := w.WriteAt(b, at); err != nil {
			return e, buf[:0], fmt.Errorf("writing %s: %w", name, err)
		}
		at += int64(len(b))
		if pos == size {
			return e, buf[:0], nil
		}
		h = h[:0]
	}
}

// copyAlign is the alignment copyOnePlaced gives a record's bytes in its
// buffer: that of the records in the file (torch aligns them to 64 bytes),
// so that the kernel's copies into the buffer (pread) and out of it (the
// write) move whole cache lines at both ends. Behind a header of any
// length they did not, and copying densenet201 so read and wrote 10-20%
// slower (1 MiB pieces, one thread, 2026-12-06).
const copyAlign = 64

// alignedAfter copies h (a local header, possibly empty) into buf, which
// has copyAlign bytes to spare, where the bytes that follow it start on a
// copyAlign boundary, and returns the copy. h may lie in buf.
func alignedAfter(buf, h []byte) []byte {
	base := buf[:cap(buf)]
	end := uintptr(unsafe.Pointer(unsafe.SliceData(base))) + uintptr(len(h))
	k := int((copyAlign - end%copyAlign) % copyAlign)
	copy(base[k:], h)
	return base[k : k+len(h)]
}
