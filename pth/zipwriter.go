package pth

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"slices"
)

// zipWriter writes an archive the way torch's own writer lays it out:
// records stored (uncompressed), each record's data aligned to 64 bytes by
// padding inside an extra field of the local header (id 0x4246, "FB"), CRC
// and sizes in a data descriptor so that data can be streamed, fixed
// timestamps, zip64 records only where sizes or offsets need them.
// archive/zip cannot choose where data lands, hence this writer.
type zipWriter struct {
	w       io.Writer
	off     int64
	entries []zipEntry
	// force64 makes every entry and the end record use zip64 fields; tests
	// use it to exercise those paths without writing 4 GiB.
	force64 bool
	buf     []byte
	// pipe holds pipeCopy's buffers, made on first need and kept: made
	// for each record, they were 3 MiB of garbage per large record (900
	// MB of them on wide_resnet101_2 copied without maps), each page a
	// fault, and the heap soon past the collector's limit.
	pipe [][]byte
	// batchBufs are the group buffers of the last batcher, for the next
	// (batcher.close).
	batchBufs [][]byte
	// queue, when non-nil, holds what write was given since the last
	// flush, counted into off as if written (copyBatch).
	queue [][]byte
}

type zipEntry struct {
	name   string
	off    int64 // of the local header
	data   int64 // of the data
	size   int64
	crc    uint32
	zip64  bool // sizes in zip64 form (local extra, 8-byte descriptor)
	offset bool // header offset in the zip64 extra of the central directory
}

const (
	zipAlign   = 64
	max32      = 0xffffffff
	dosDate    = 0x0021 // 1980-01-01: fixed, so identical input gives identical bytes
	dosTime    = 0
	flagDesc   = 0x0008 // CRC and sizes follow the data
	flagUTF8   = 0x0800
	copyBufLen = 1 << 20
)

func newZipWriter(w io.Writer) *zipWriter {
	return &zipWriter{w: w}
}

// copyBuf is z.buf, made on first need: a conversion of a torch-written
// checkpoint copies through the batcher, the pipe and the placed writers,
// and writes what it holds in memory directly (addBytes), so it never
// needs it. Fresh heap can cost about 0.4 ms a MB on the VM measured (a
// page fault per huge page, whose memory the host may have to back
// again): densenet201 trained, 8 MB more heap, +3.3 ms in the median of
// 25 rounds; in the VM's other state, where fresh pages are cheap (and
// `cp` fast), 1.15 MB less made no difference (bench/alternate.md).
func (z *zipWriter) copyBuf() []byte {
	if z.buf == nil {
		z.buf = make([]byte, copyBufLen)
	}
	return z.buf
}

// pipeBuffers is z.pipe, made on first need.
func (z *zipWriter) pipeBuffers() [][]byte {
	if z.pipe == nil {
		z.pipe = make([][]byte, pipeBuffers)
		for i := range z.pipe {
			z.pipe[i] = make([]byte, copyBufLen)
		}
	}
	return z.pipe
}

func (z *zipWriter) write(b []byte) error {
	if z.queue != nil {
		z.queue = append(z.queue, b)
		z.off += int64(len(b))
		return nil
	}
	n, err := z.w.Write(b)
	z.off += int64(n)
	return err
}

// flush writes the queue, in one vectored write where the writer takes
// one, and empties it.
func (z *zipWriter) flush() error {
	q := z.queue
	z.queue = q[:0]
	if vw, ok := z.w.(vecWriter); ok {
		_, err := vw.WriteVec(q)
		return err
	}
	for _, b := range q {
		if _, err := z.w.Write(b); err != nil {
			return err
		}
	}
	return nil
}

// add writes one record of exactly size bytes read from src, through a
// fixed buffer, and returns the CRC-32 of what it wrote.
func (z *zipWriter) add(name string, size int64, src io.Reader) (uint32, error) {
	return z.addSum(name, size, src, nil)
}

// addSum is add where sum, when not nil, gives the CRC-32 of what was
// written once the copy has ended (a negated record's comes from its
// input's, which the reader computes anyway, and the flips': no second
// pass over the bytes).
func (z *zipWriter) addSum(name string, size int64, src io.Reader, sum func() uint32) (uint32, error) {
	e, err := z.begin(name, size)
	if err != nil {
		return 0, err
	}
	var n int64
	var crc uint32
	switch {
	case size > copyBufLen:
		n, crc, err = pipeCopy(z.w, src, size, z.pipeBuffers(), sum == nil)
	case sum != nil:
		n, err = io.CopyBuffer(onlyWriter{z.w}, io.LimitReader(src, size), z.copyBuf())
	default:
		h := crc32.NewIEEE()
		n, err = io.CopyBuffer(onlyWriter{io.MultiWriter(z.w, h)}, io.LimitReader(src, size), z.copyBuf())
		crc = h.Sum32()
	}
	if sum != nil && err == nil {
		crc = sum()
	}
	z.off += n
	if err != nil {
		return 0, fmt.Errorf("writing %s: %w", name, err)
	}
	if n != size {
		return 0, fmt.Errorf("writing %s: source ended after %d of %d bytes", name, n, size)
	}
	return crc, z.finish(e, crc)
}

// addBytes writes one record whose contents b are in memory, with no
// buffer between: what add would copy through one.
func (z *zipWriter) addBytes(name string, b []byte) error {
	e, err := z.begin(name, int64(len(b)))
	if err != nil {
		return err
	}
	if err := z.write(b); err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return z.finish(e, crc32.ChecksumIEEE(b))
}

// addStream writes one record of exactly size bytes that write produces.
func (z *zipWriter) addStream(name string, size int64, write func(io.Writer) error) error {
	e, err := z.begin(name, size)
	if err != nil {
		return err
	}
	h := crc32.NewIEEE()
	cw := &countingWriter{w: onlyWriter{io.MultiWriter(z.w, h)}}
	err = write(cw)
	z.off += cw.n
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	if cw.n != size {
		return fmt.Errorf("writing %s: %d bytes written where the tensor has %d", name, cw.n, size)
	}
	return z.finish(e, h.Sum32())
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// begin writes a record's local header; the caller writes exactly size
// bytes of data through z.w (counting them into z.off), then calls finish
// with their CRC-32.
func (z *zipWriter) begin(name string, size int64) (zipEntry, error) {
	e, h := z.header(nil, name, size, z.off)
	if err := z.write(h); err != nil {
		return e, err
	}
	if z.off%zipAlign != 0 {
		return e, fmt.Errorf("zip writer: record %s misaligned at %d", name, z.off)
	}
	e.data = z.off
	return e, nil
}

// header appends to h the local header of a record of size bytes named
// name whose header starts at off, and returns its entry (data set, crc
// not) and h.
func (z *zipWriter) header(h []byte, name string, size, off int64) (zipEntry, []byte) {
	e, pad := z.entry(name, size, off)
	le := binary.LittleEndian
	version := uint16(20)
	if e.zip64 {
		version = 45
	}
	// One allocation where h has no room, not one per append.
	h = slices.Grow(h, int(e.data-off))
	h = le.AppendUint32(h, 0x04034b50)
	h = le.AppendUint16(h, version)
	h = le.AppendUint16(h, flagDesc|flagUTF8)
	h = le.AppendUint16(h, 0) // stored
	h = le.AppendUint16(h, dosTime)
	h = le.AppendUint16(h, dosDate)
	h = le.AppendUint32(h, 0) // CRC: in the descriptor
	if e.zip64 {
		h = le.AppendUint32(h, max32)
		h = le.AppendUint32(h, max32)
	} else {
		h = le.AppendUint32(h, 0)
		h = le.AppendUint32(h, 0)
	}
	h = le.AppendUint16(h, uint16(len(name)))
	h = le.AppendUint16(h, uint16(int(e.data-off)-30-len(name)))
	h = append(h, name...)
	// The extra field: zip64's (sizes zero here: the data descriptor
	// carries them), then the alignment field and its padding.
	if e.zip64 {
		h = le.AppendUint16(h, 0x0001)
		h = le.AppendUint16(h, 16)
		h = le.AppendUint64(h, 0)
		h = le.AppendUint64(h, 0)
	}
	h = le.AppendUint16(h, 0x4246)
	h = le.AppendUint16(h, uint16(pad))
	for i := 0; i < pad; i++ {
		h = append(h, 'Z')
	}
	return e, h
}

// entry is the entry of the local header header writes (data set, crc
// not), and the padding of its extra field's alignment field, measured
// without building it (recordEnd, on every record of the plan).
func (z *zipWriter) entry(name string, size, off int64) (zipEntry, int) {
	e := zipEntry{name: name, off: off, size: size, zip64: z.force64 || size >= max32}
	e.offset = z.force64 || e.off >= max32
	extra := 0
	if e.zip64 {
		extra = 20
	}
	pad := int(headerPad(name, e.off, extra))
	e.data = off + 30 + int64(len(name)) + int64(extra+4+pad)
	return e, pad
}

// headerPad is the padding of the local header of record name at off,
// whose extra field holds extra bytes before the alignment field, that
// aligns its data to zipAlign.
func headerPad(name string, off int64, extra int) int64 {
	base := off + 30 + int64(len(name)) + int64(extra) + 4
	return (zipAlign - base%zipAlign) % zipAlign
}

// recordEnd is where a record of size bytes named name whose local header
// starts at off ends, data descriptor included: where begin, size bytes
// and finish would leave z.off (the same header and descriptor, built and
// measured).
func (z *zipWriter) recordEnd(name string, size, off int64) int64 {
	e, _ := z.entry(name, size, off)
	return e.data + size + e.descriptorLen()
}

// seek makes the writer go on at off, a record's first byte: the writer
// leaves a range to be written later and comes back to it (writeBody's
// records left until the signs settle). Its writer must be an
// output.File.
func (z *zipWriter) seek(off int64) error {
	if off == z.off {
		return nil
	}
	f, ok := z.w.(interface{ MoveTo(int64) error })
	if !ok || len(z.queue) > 0 {
		return fmt.Errorf("zip writer: cannot move from %d to %d", z.off, off)
	}
	if err := f.MoveTo(off); err != nil {
		return err
	}
	z.off = off
	return nil
}

// finish writes a record's data descriptor.
func (z *zipWriter) finish(e zipEntry, crc uint32) error {
	e.crc = crc
	if err := z.write(e.descriptor(nil)); err != nil {
		return err
	}
	z.entries = append(z.entries, e)
	return nil
}

// descriptor appends the entry's data descriptor to d; it follows the
// data, and its CRC at byte 4.
func (e zipEntry) descriptor(d []byte) []byte {
	le := binary.LittleEndian
	d = slices.Grow(d, int(e.descriptorLen()))
	d = le.AppendUint32(d, 0x08074b50)
	d = le.AppendUint32(d, e.crc)
	if e.zip64 {
		d = le.AppendUint64(d, uint64(e.size))
		d = le.AppendUint64(d, uint64(e.size))
	} else {
		d = le.AppendUint32(d, uint32(e.size))
		d = le.AppendUint32(d, uint32(e.size))
	}
	return d
}

// descriptorLen is the length of the data descriptor descriptor writes.
func (e zipEntry) descriptorLen() int64 {
	if e.zip64 {
		return 24
	}
	return 16
}

// onlyWriter hides io.ReaderFrom so that io.CopyBuffer really goes through
// the fixed buffer.
type onlyWriter struct{ io.Writer }

// close writes the central directory and the end records.
func (z *zipWriter) close() error {
	le := binary.LittleEndian
	cdStart := z.off
	// The whole directory in one buffer, one write: an entry at a time,
	// each grown from nothing, it was 4,000 allocations on densenet201.
	n := 0
	for _, e := range z.entries {
		n += 46 + len(e.name) + 28
	}
	h := make([]byte, 0, n)
	for _, e := range z.entries {
		h = le.AppendUint32(h, 0x02014b50)
		version := uint16(20)
		if e.zip64 || e.offset {
			version = 45
		}
		h = le.AppendUint16(h, version) // made by: MS-DOS, spec version
		h = le.AppendUint16(h, version)
		h = le.AppendUint16(h, flagDesc|flagUTF8)
		h = le.AppendUint16(h, 0)
		h = le.AppendUint16(h, dosTime)
		h = le.AppendUint16(h, dosDate)
		h = le.AppendUint32(h, e.crc)
		if e.zip64 {
			h = le.AppendUint32(h, max32)
			h = le.AppendUint32(h, max32)
		} else {
			h = le.AppendUint32(h, uint32(e.size))
			h = le.AppendUint32(h, uint32(e.size))
		}
		// The zip64 extra field: sizes (zip64), then the offset.
		fields := 0
		if e.zip64 {
			fields += 16
		}
		if e.offset {
			fields += 8
		}
		extra := 0
		if fields > 0 {
			extra = 4 + fields
		}
		h = le.AppendUint16(h, uint16(len(e.name)))
		h = le.AppendUint16(h, uint16(extra))
		h = le.AppendUint16(h, 0) // comment
		h = le.AppendUint16(h, 0) // disk
		h = le.AppendUint16(h, 0) // internal attributes
		h = le.AppendUint32(h, 0) // external attributes
		if e.offset {
			h = le.AppendUint32(h, max32)
		} else {
			h = le.AppendUint32(h, uint32(e.off))
		}
		h = append(h, e.name...)
		if fields > 0 {
			h = le.AppendUint16(h, 0x0001)
			h = le.AppendUint16(h, uint16(fields))
			if e.zip64 {
				h = le.AppendUint64(h, uint64(e.size))
				h = le.AppendUint64(h, uint64(e.size))
			}
			if e.offset {
				h = le.AppendUint64(h, uint64(e.off))
			}
		}
	}
	if err := z.write(h); err != nil {
		return err
	}
	cdEnd := z.off
	count := len(z.entries)
	need64 := z.force64 || count >= 0xffff || cdStart >= max32 || cdEnd-cdStart >= max32
	var t []byte
	if need64 {
		rec := z.off
		t = le.AppendUint32(t, 0x06064b50)
		t = le.AppendUint64(t, 44)
		t = le.AppendUint16(t, 45)
		t = le.AppendUint16(t, 45)
		t = le.AppendUint32(t, 0)
		t = le.AppendUint32(t, 0)
		t = le.AppendUint64(t, uint64(count))
		t = le.AppendUint64(t, uint64(count))
		t = le.AppendUint64(t, uint64(cdEnd-cdStart))
		t = le.AppendUint64(t, uint64(cdStart))
		t = le.AppendUint32(t, 0x07064b50)
		t = le.AppendUint32(t, 0)
		t = le.AppendUint64(t, uint64(rec))
		t = le.AppendUint32(t, 1)
	}
	clamp16 := func(n int) uint16 {
		if need64 || n >= 0xffff {
			return 0xffff
		}
		return uint16(n)
	}
	clamp32 := func(n int64) uint32 {
		if need64 || n >= max32 {
			return max32
		}
		return uint32(n)
	}
	t = le.AppendUint32(t, 0x06054b50)
	t = le.AppendUint16(t, 0)
	t = le.AppendUint16(t, 0)
	t = le.AppendUint16(t, clamp16(count))
	t = le.AppendUint16(t, clamp16(count))
	t = le.AppendUint32(t, clamp32(cdEnd-cdStart))
	t = le.AppendUint32(t, clamp32(cdStart))
	t = le.AppendUint16(t, 0)
	return z.write(t)
}
