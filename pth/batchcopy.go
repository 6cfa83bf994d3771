package pth

import (
	"fmt"
	"hash/crc32"
	"sync"
)

// copyBatch copies a run of small records into the archive: stored input
// records (each under mapMin) and new contents. A DenseNet has hundreds of
// them (BN vectors, thin convolutions), holding most of its bytes, and
// copying them one by one costs several system calls and a CRC pass each
// on the critical path. So they are read in groups of up to batchBuf
// bytes, neighbours in the file in one pread, by the batcher, which also
// checks each input record's CRC and applies its negations in place ahead
// of this goroutine, which writes each group's headers, data and
// descriptors in one vectored write. An input record's output CRC comes
// from its recorded one (a flip's change is negate.CRCDelta): the output
// is what writing record by record writes.
//
// late, when not nil, is told after each group (lateFlips.wrote), so that
// the tests' hold can stop the copy inside a run.
func (c *Checkpoint) copyBatch(z *zipWriter, run []batchRecord, bt *batcher, late *lateFlips, stop <-chan struct{}) error {
	z.queue = make([][]byte, 0, 64)
	defer func() { z.queue = nil }()
	for n := 0; n < len(run); {
		g, ok := <-bt.full
		if !ok || &g.recs[0] != &run[n] {
			return fmt.Errorf("%s: copying %s: the batch groups are out of step with the records", c.Path, run[n].name)
		}
		if g.err != nil {
			return g.err
		}
		for i, r := range g.recs {
			e, err := z.begin(r.name, int64(len(g.data[i])))
			if err != nil {
				return err
			}
			z.write(g.data[i])
			if err := z.finish(e, g.crcs[i]); err != nil {
				return err
			}
		}
		if err := z.flush(); err != nil {
			return fmt.Errorf("writing %s to %s: %w", g.recs[0].name, g.recs[len(g.recs)-1].name, err)
		}
		n += len(g.recs)
		bt.free <- g.buf
		if late != nil && n < len(run) {
			if err := late.wrote(z, stop); err != nil {
				return err
			}
		}
	}
	return nil
}

// batcher reads the groups of every copyBatch run, in writing order,
// ahead of the writer: up to batchInFlight groups at a time (the one
// written and those after it, which may be the next runs'), each read on a
// goroutine of its own, so that once the conversion's core is free the
// reading, CRC checks included, runs on both cores beside the writing.
// A single reader was the copy's bottleneck: on densenet201 it took 30 ms
// of a copy whose writes took 26, and the writer waited 15 ms for it.
type batcher struct {
	full chan batchGroup
	free chan []byte // group buffers, made on first need
	stop chan struct{}
	wg   sync.WaitGroup // the dispatcher and its readers
}

// batchGroup is a group of a run read by the batcher: each record's bytes
// (flipped; in buf for input records) and output CRC.
type batchGroup struct {
	recs []batchRecord
	data [][]byte
	crcs []uint32
	buf  []byte
	err  error
}

// batchInFlight is the number of group buffers: the one the writer writes
// and the ones read meanwhile.
const batchInFlight = 3

// startBatcher starts reading the groups of runs, up to inFlight (at most
// batchInFlight) at a time, into the buffers bufs and new ones.
func (c *Checkpoint) startBatcher(runs [][]batchRecord, late *lateFlips, bufs [][]byte, inFlight int) *batcher {
	// full never blocks: there are only batchInFlight buffers.
	bt := &batcher{full: make(chan batchGroup, batchInFlight), free: make(chan []byte, batchInFlight), stop: make(chan struct{})}
	for i := 0; i < min(inFlight, batchInFlight); i++ {
		var b []byte
		if i < len(bufs) {
			b = bufs[i]
		}
		bt.free <- b
	}
	// pending holds each group's result channel in writing order; no
	// more than batchInFlight are out at once (one per buffer).
	pending := make(chan chan batchGroup, batchInFlight)
	bt.wg.Add(1)
	go func() { // the dispatcher
		defer bt.wg.Done()
		defer close(pending)
		n := 0
		for _, run := range runs {
			for _, g := range splitBatch(run, batchBuf) {
				n++
				var buf []byte
				select {
				case <-bt.stop: // first: a buffer may be free too
					return
				default:
				}
				select {
				case buf = <-bt.free:
				case <-bt.stop:
					return
				}
				if buf == nil {
					buf = make([]byte, batchBuf)
				}
				res := make(chan batchGroup, 1)
				pending <- res
				bt.wg.Add(1)
				go func(n int) {
					defer bt.wg.Done()
					if batchReadHook != nil {
						batchReadHook(n)
					}
					f := batchGroup{recs: g, buf: buf}
					f.data, f.crcs, f.err = c.readBatch(g, buf, late)
					res <- f
				}(n)
			}
		}
	}()
	go func() { // hands the groups over in writing order
		defer close(bt.full)
		for res := range pending {
			f := <-res
			bt.full <- f
			if f.err != nil {
				return
			}
		}
	}()
	return bt
}

// batchReadHook, when set (tests), is called by each group's reader, with
// the group's number (from 1, in writing order), before it reads.
var batchReadHook func(group int)

// close stops the batcher and waits for it, so that no read is left
// running once the copy returns, and returns the group buffers it made,
// for the next batcher of the same write: a copy in phases
// (PrewriteLater) starts one per phase, and the conversion collects no
// garbage on the way (convert/gc.go), so that new buffers were new pages
// to fault in and clear.
func (bt *batcher) close() [][]byte {
	close(bt.stop)
	var bufs [][]byte
	for g := range bt.full {
		if g.buf != nil {
			bufs = append(bufs, g.buf)
		}
	}
	bt.wg.Wait()
	for {
		select {
		case b := <-bt.free:
			if b != nil {
				bufs = append(bufs, b)
			}
		default:
			return bufs
		}
	}
}

// batchRecord is one record of a copyBatch run, written as name: data, or
// when data is nil st's record with t's negations applied (t nil: none).
type batchRecord struct {
	name string
	data []byte
	st   *Storage
	t    *Tensor
}

// input reports whether the record is copied from the input.
func (r batchRecord) input() bool { return r.data == nil }

// batchable reports whether a storage's record is copied by copyBatch: a
// stored record with a recorded CRC, too small to be mapped.
func (c *Checkpoint) batchable(st *Storage) bool {
	return batchCopy && st.rec.zf == nil && st.rec.hasCRC && st.rec.size < batchBuf && !c.mappable(st)
}

// batchBuf is the size of one of copyBatch's buffers, the most bytes it
// reads in one group (the tests lower it to split their small fixtures
// into several groups). It is mapMin, so that every stored record under
// mapMin is batched: larger buffers cost more than the system calls they
// save, since each page of a fresh buffer faults on its first read (on
// densenet201 trained, 4 MiB buffers: median CPU 142 ms, 1 MiB: 115 ms,
// 15 runs each, alternated).
var batchBuf int64 = 1 << 20

// batchGap is the most bytes between two records that one read spans (a
// zip header and its padding) rather than reading them apart.
const batchGap = 4 << 10

// batchCopy selects copyBatch for small stored records; tests turn it off
// to compare with the record-by-record copy.
var batchCopy = true

// splitBatch cuts recs into groups of at most max bytes read from the
// input, spans between neighbours included, and the padding before each
// read after a group's first (readBatch).
func splitBatch(recs []batchRecord, max int64) [][]batchRecord {
	var groups [][]batchRecord
	start, used := 0, int64(0)
	var prev *record // the group's last input record
	for i, r := range recs {
		if !r.input() {
			continue
		}
		need := r.st.rec.size
		if prev != nil {
			if gap := r.st.rec.offset - (prev.offset + prev.size); gap >= 0 && gap <= batchGap {
				need += gap
			} else {
				// A read of its own, which readBatch starts on a
				// copyAlign boundary of the buffer: room for the padding.
				need += copyAlign - 1
			}
		}
		if prev != nil && used+need > max {
			groups = append(groups, recs[start:i])
			start, used, need = i, 0, r.st.rec.size
		}
		used += need
		prev = &r.st.rec
	}
	if start < len(recs) {
		groups = append(groups, recs[start:])
	}
	return groups
}

// readBatch reads a group of splitBatch into buf, checks each input
// record's CRC and applies its negations (late's too), or takes late's new
// contents for it. It returns each record's bytes (in buf for input
// records) and output CRC.
func (c *Checkpoint) readBatch(g []batchRecord, buf []byte, late *lateFlips) ([][]byte, []uint32, error) {
	data := make([][]byte, len(g))
	crcs := make([]uint32, len(g))
	used := int64(0)
	for i := 0; i < len(g); {
		if !g[i].input() {
			data[i], crcs[i] = g[i].data, crc32.ChecksumIEEE(g[i].data)
			i++
			continue
		}
		// One read for the input records from i whose bytes follow each
		// other in the file up to small gaps (the same rule as
		// splitBatch's).
		lo := g[i].st.rec.offset
		hi := lo + g[i].st.rec.size
		j := i + 1
		for ; j < len(g); j++ {
			if !g[j].input() {
				continue
			}
			r := g[j].st.rec
			if r.offset < hi || r.offset-hi > batchGap {
				break
			}
			hi = r.offset + r.size
		}
		// Each read's bytes start on a copyAlign boundary of the buffer
		// (see copyAlign: the input's records are so aligned in the file,
		// and their copies in the output too); splitBatch left room for
		// the padding.
		used = (used + copyAlign - 1) &^ (copyAlign - 1)
		if used+hi-lo > int64(len(buf)) {
			return nil, nil, fmt.Errorf("%s: reading %s: a group of %d bytes from %d does not fit its buffer of %d", c.Path, g[i].st.rec.name, hi-lo, used, len(buf))
		}
		b := buf[used : used+hi-lo]
		if _, err := c.f.ReadAt(b, lo); err != nil {
			return nil, nil, fmt.Errorf("%s: reading %s: %w", c.Path, g[i].st.rec.name, err)
		}
		for k := i; k < j; k++ {
			if !g[k].input() {
				data[k], crcs[k] = g[k].data, crc32.ChecksumIEEE(g[k].data)
				continue
			}
			r := g[k].st.rec
			d := b[r.offset-lo : r.offset-lo+r.size]
			crc := crc32.ChecksumIEEE(d)
			if crc != r.crc {
				return nil, nil, fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, r.name, crc, r.crc)
			}
			if late != nil {
				// New contents published meanwhile (Finish checked that
				// they have the record's size) are written instead; the
				// input's bytes were still checked above.
				if nd := late.takeData(g[k].st); nd != nil {
					data[k], crcs[k] = nd, crc32.ChecksumIEEE(nd)
					continue
				}
			}
			t := g[k].t
			if t == nil && late != nil {
				t = late.take(g[k].st)
			}
			if t != nil {
				l, _ := layoutOf(t)
				l.Apply(t.negate, 0, d)
				crc ^= l.CRCDelta(t.negate, 0, r.size)
			}
			data[k], crcs[k] = d, crc
		}
		used += hi - lo
		i = j
	}
	return data, crcs, nil
}
