package pth

import (
	"fmt"
	"hash/crc32"
)

// copyBatch copies a run of small records into the archive: stored input
// records (each under mapMin) and new contents. A DenseNet has hundreds of
// them (BN vectors, thin convolutions), holding most of its bytes, and
// copying them one by one costs several system calls and a CRC pass each
// on the critical path. So they are read in groups of up to batchBuf
// bytes, neighbours in the file in one pread, by a goroutine that also
// checks each input record's CRC and applies its negations in place, a
// group ahead of this goroutine, which writes each group's headers, data
// and descriptors in one vectored write. An input record's output CRC
// comes from its recorded one (a flip's change is negate.CRCDelta): the
// output is what writing record by record writes. bufs are the group
// buffers, made on first use and kept for the next run.
func (c *Checkpoint) copyBatch(z *zipWriter, recs []batchRecord, bufs *[][]byte) error {
	groups := splitBatch(recs, batchBuf)
	type filled struct {
		recs []batchRecord
		data [][]byte // each record's bytes, flipped
		crcs []uint32 // each record's output CRC
		buf  []byte
		err  error
	}
	const buffers = 2
	if *bufs == nil {
		for i := 0; i < buffers; i++ {
			*bufs = append(*bufs, make([]byte, batchBuf))
		}
	}
	free := make(chan []byte, buffers)
	for _, b := range *bufs {
		free <- b
	}
	full := make(chan filled, buffers)
	stop := make(chan struct{})
	go func() {
		defer close(full)
		for _, g := range groups {
			var buf []byte
			select {
			case buf = <-free:
			case <-stop:
				return
			}
			f := filled{recs: g, buf: buf}
			f.data, f.crcs, f.err = c.readBatch(g, buf)
			full <- f
			if f.err != nil {
				return
			}
		}
	}()
	defer func() {
		close(stop)
		for range full { // let the reader finish before its buffers go
		}
	}()
	z.queue = make([][]byte, 0, 64)
	defer func() { z.queue = nil }()
	for f := range full {
		if f.err != nil {
			return f.err
		}
		for i, r := range f.recs {
			e, err := z.begin(r.name, int64(len(f.data[i])))
			if err != nil {
				return err
			}
			z.write(f.data[i])
			if err := z.finish(e, f.crcs[i]); err != nil {
				return err
			}
		}
		if err := z.flush(); err != nil {
			return fmt.Errorf("writing %s to %s: %w", f.recs[0].name, f.recs[len(f.recs)-1].name, err)
		}
		free <- f.buf
	}
	return nil
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
// into several groups).
var batchBuf int64 = 4 << 20

// batchGap is the most bytes between two records that one read spans (a
// zip header and its padding) rather than reading them apart.
const batchGap = 4 << 10

// batchCopy selects copyBatch for small stored records; tests turn it off
// to compare with the record-by-record copy.
var batchCopy = true

// splitBatch cuts recs into groups of at most max bytes read from the
// input, spans between neighbours included.
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
// record's CRC and applies its negations. It returns each record's bytes
// (in buf for input records) and output CRC.
func (c *Checkpoint) readBatch(g []batchRecord, buf []byte) ([][]byte, []uint32, error) {
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
			if t := g[k].t; t != nil {
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
