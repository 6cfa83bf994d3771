package pth

import (
	"archive/zip"
	"bufio"
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/big"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// Format is the on-disk layout of a checkpoint.
type Format string

const (
	// FormatZip is torch.save's format since torch 1.6.
	FormatZip Format = "zip"
	// FormatLegacy is torch.save(..., _use_new_zipfile_serialization=False):
	// consecutive pickles followed by raw storages.
	FormatLegacy Format = "legacy"
	// FormatBarePickle is a pickle that is no checkpoint (pickle.dump
	// under a .pth name), which torch.load reads as the legacy format's
	// first pickle; only the security audit reports it.
	FormatBarePickle Format = "bare pickle"
)

// maxPickle bounds data.pkl; real ones are kilobytes to a few megabytes.
const maxPickle = 1 << 30

// legacyMagic is the magic number legacy checkpoints start with.
var legacyMagic, _ = new(big.Int).SetString("1950A86A20F9469CFC6C", 16)

// zipOpener is the part of *zip.File used to stream a compressed record.
type zipOpener interface {
	Open() (io.ReadCloser, error)
}

// Checkpoint is an opened PyTorch checkpoint: its object tree, with tensor
// bytes left in the file until asked for. It implements graph.Weights over
// the state dict it holds. Close releases the file.
type Checkpoint struct {
	Path   string
	Format Format
	// Root is the whole object tree torch.save was given.
	Root Value
	// Globals lists every global the pickle references, in order of first
	// appearance.
	Globals []string
	// StatePath is the chain of string keys from Root to the state dict
	// (empty when Root is the state dict, nil when none was found).
	StatePath []string
	// Prefix is a key prefix common to every state-dict key ("module."),
	// informational only: keys keep it.
	Prefix string
	// Carried lists the state-dict tensors that are not weights of the
	// network (an AveragedModel's "n_averaged"): not in Keys, so that the
	// structure is recognised from the weights alone, and written back
	// unchanged (Tensor, Shape and Values still read them).
	Carried []string
	// Provenance is the ProvenanceRecord of a zip checkpoint abnconvert
	// wrote (nil when there is none). Write writes it back when set: a
	// converter sets its own record, revert clears it.
	Provenance []byte

	f     *os.File
	stat  os.FileInfo
	state *Dict
	keys  []string
	// storages indexes every storage the pickle references, by key.
	storages map[string]*Storage
	// users counts the tensors viewing each storage (storageUsers).
	users map[*Storage]int
	// lazyNegated are the tensors negated in place (negate, without
	// decoding), in order, repeats and all: what Prewrite.Settle hands
	// the copy.
	lazyNegated []*Tensor
	// ahead is readWhole's read-ahead over small stored records.
	ahead readAheadState
	// maps is the copy's choice between maps and reads (mapProbe).
	maps mapChoice
	// recordsSHA256 is ZipRecordsSHA256 of the zip directory read (zip
	// checkpoints only).
	recordsSHA256 string
}

// Open reads a checkpoint's structure. It executes nothing: globals outside
// the allowlist of torch.load(weights_only=True) make it fail with a
// *RefusedError before anything is decoded.
func Open(path string) (*Checkpoint, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	c := &Checkpoint{Path: path, f: f, stat: st, storages: map[string]*Storage{}}
	if err := c.load(); err != nil {
		f.Close()
		var re *RefusedError
		if errors.As(err, &re) {
			return nil, err
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Close releases the input file; values not yet decoded are lost.
func (c *Checkpoint) Close() error { return c.f.Close() }

// Scan lists every global a checkpoint's pickles reference, without
// decoding them, for a security view. It returns the list even when Open
// would refuse the file; err reports a file that cannot be walked.
func Scan(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	c := &Checkpoint{Path: path, f: f, stat: st}
	globals, err := c.scanOnly()
	if err != nil {
		return globals, fmt.Errorf("%s: %w", path, err)
	}
	return globals, nil
}

func (c *Checkpoint) detect() (Format, error) {
	head := make([]byte, 4)
	if _, err := c.f.ReadAt(head, 0); err != nil {
		return "", errNotPickle
	}
	switch {
	case bytes.Equal(head, []byte("PK\x03\x04")):
		return FormatZip, nil
	case head[0] == opProto:
		return FormatLegacy, nil
	}
	tar := make([]byte, 5)
	if _, err := c.f.ReadAt(tar, 257); err == nil && string(tar) == "ustar" {
		return "", errors.New("the tar-based checkpoint format of torch < 0.4 is not supported")
	}
	if what := otherFormat(c.f); what != "" {
		return "", fmt.Errorf("%w: it looks like %s", errNotPickle, what)
	}
	return "", errNotPickle
}

// otherFormat names the format of a file that is no checkpoint but looks
// like one abnconvert reads under another name (a renamed file is a
// common mistake), with the next step; "" when it looks like neither.
func otherFormat(r io.ReaderAt) string {
	head := make([]byte, 9)
	n, _ := r.ReadAt(head, 0)
	head = head[:n]
	// ONNX: a ModelProto whose first field is ir_version (tag 0x08, a
	// small varint) followed by another field's tag, as every exporter
	// writes it.
	if len(head) >= 3 && head[0] == 0x08 && head[1] >= 3 && head[1] <= 20 && head[2]&7 == 2 {
		return "an ONNX model: give it a .onnx name (abnconvert reads ONNX by its extension)"
	}
	// safetensors: an 8-byte little-endian header length, then '{'.
	if len(head) == 9 && head[8] == '{' && binary.LittleEndian.Uint64(head) < 100<<20 {
		return "a safetensors file: give it a .safetensors name"
	}
	return ""
}

func (c *Checkpoint) scanOnly() ([]string, error) {
	format, err := c.detect()
	if err != nil {
		return nil, err
	}
	if format == FormatZip {
		a, err := c.openZip()
		if err != nil {
			return nil, err
		}
		res, err := a.readPickle(nil)
		return res.globals, err
	}
	_, _, globals, err := c.legacyPickles()
	var re *RefusedError
	var dup *dupKeyError
	if errors.As(err, &re) || errors.As(err, &dup) {
		return globals, nil // refusing is Open's business; the list is complete
	}
	return globals, err
}

func (c *Checkpoint) load() error {
	format, err := c.detect()
	if err != nil {
		return err
	}
	c.Format = format
	if format == FormatZip {
		err = c.loadZip()
	} else {
		err = c.loadLegacy()
	}
	if err != nil {
		return err
	}
	c.findState()
	return nil
}

// archive is an opened zip checkpoint.
type archive struct {
	z      *zip.Reader
	prefix string // top-level folder, with its slash ("archive/")
	byName map[string]*zip.File
	// offsets holds each record's data offset, which checkRecords finds
	// (a read of the record's local header) and the storage resolver
	// needs again.
	offsets map[*zip.File]int64
}

// record looks a record up by its name below the top-level folder.
func (a *archive) record(name string) *zip.File { return a.byName[a.prefix+name] }

// dataOffset is zf.DataOffset, found once.
func (a *archive) dataOffset(zf *zip.File) (int64, error) {
	if off, ok := a.offsets[zf]; ok {
		return off, nil
	}
	return zf.DataOffset()
}

// openZip opens the archive and finds its top-level folder, the one that
// holds data.pkl.
func (c *Checkpoint) openZip() (*archive, error) {
	hr := &headerReader{f: c.f, size: c.stat.Size()}
	z, err := zip.NewReader(hr, c.stat.Size())
	if err != nil {
		return nil, fmt.Errorf("reading zip archive: %w", err)
	}
	offsets, err := checkRecords(z, c.stat.Size(), hr)
	if err != nil {
		return nil, err
	}
	a := &archive{z: z, byName: make(map[string]*zip.File, len(z.File)), offsets: offsets}
	for _, zf := range z.File {
		if _, dup := a.byName[zf.Name]; dup {
			return nil, fmt.Errorf("archive holds two records named %s", zf.Name)
		}
		a.byName[zf.Name] = zf
		dir, base, ok := strings.Cut(zf.Name, "/")
		if ok && base == "data.pkl" {
			if a.prefix != "" {
				return nil, fmt.Errorf("archive has two data.pkl records (%sdata.pkl, %s)", a.prefix, zf.Name)
			}
			a.prefix = dir + "/"
		}
	}
	if a.prefix == "" {
		return nil, errors.New("archive has no <folder>/data.pkl record: not a torch.save file")
	}
	return a, nil
}

// headerReader is the file as archive/zip reads it. archive/zip reads each
// record's 30-byte local header with a pread of its own (DataOffset), and a
// checkpoint's records are mostly BN vectors of a few KB, laid out one
// after the other: that was a thousand system calls to open densenet201.
// While checkRecords walks the records it sets ahead, the bytes the next
// headers are expected to span, and a short read outside the window reads
// that much into it, so that the headers of a run of small records come
// from one pread. The bytes are the file's either way; a read the window
// does not cover whole goes to the file. checkRecords clears the window
// before the archive is used, so that later reads, which may run in
// parallel, go straight to the file and share nothing.
type headerReader struct {
	f      *os.File
	size   int64
	ahead  int
	win    []byte
	winOff int64
}

// maxHeaderRead is the longest read headerReader serves from its window:
// archive/zip's local-header read (30 bytes), with room to spare.
const maxHeaderRead = 64

func (r *headerReader) ReadAt(p []byte, off int64) (int, error) {
	if off >= r.winOff && off-r.winOff <= int64(len(r.win)) && int64(len(p)) <= int64(len(r.win))-(off-r.winOff) {
		return copy(p, r.win[off-r.winOff:]), nil
	}
	if len(p) <= maxHeaderRead && r.ahead > len(p) && off >= 0 && off < r.size {
		n := int(min(int64(r.ahead), r.size-off))
		if cap(r.win) < n {
			r.win = make([]byte, n, max(n, 64<<10))
		}
		got, _ := r.f.ReadAt(r.win[:n], off)
		r.win, r.winOff = r.win[:got], off
		if got >= len(p) {
			return copy(p, r.win), nil
		}
	}
	return r.f.ReadAt(p, off)
}

// readAhead is how many bytes from zf's local header on the headers of the
// records that follow it are expected to span: up to 64 KB of consecutive
// small records (their headers, names, padding and data). A large record's
// header is read alone (0), since the next one lies past its data. Any
// estimate is safe: it only decides how many reads find their bytes in
// the window.
func readAhead(files []*zip.File) int {
	const small, most = 16 << 10, 64 << 10
	n := 0
	for i, zf := range files {
		if zf.CompressedSize64 > small || i == 64 {
			break
		}
		// 30-byte header, name, up to 64 bytes of alignment padding in the
		// extra field, the data, a 24-byte data descriptor.
		n += 30 + len(zf.Name) + 64 + int(zf.CompressedSize64) + 24
		if n >= most {
			return most
		}
	}
	return n
}
func (a *archive) readPickle(ahead *pickleAhead) (scanned, error) {
	zf := a.record("data.pkl")
	if zf.UncompressedSize64 > maxPickle {
		return scanned{}, fmt.Errorf("%s is %d bytes, more than %d", zf.Name, zf.UncompressedSize64, maxPickle)
	}
	if ahead.matches(a, zf) {
		return ahead.res, nil
	}
	rc, err := zf.Open()
	if err != nil {
		return scanned{}, fmt.Errorf("%s: %w", zf.Name, err)
	}
	defer rc.Close()
	res, err := scanPickle(bufio.NewReader(rc), int64(zf.UncompressedSize64))
	if err != nil {
		return res, fmt.Errorf("%s: %w", zf.Name, err)
	}
	// Read to the end of the record: archive/zip checks the CRC only there.
	if _, err := io.Copy(io.Discard, rc); err != nil {
		return res, fmt.Errorf("%s: %w", zf.Name, recordError(err))
	}
	return res, nil
}

// ZipRecordsSHA256 is the SHA-256, in hex, of the list of a zip archive's
// records as its central directory gives them, in order: each record's
// name, size and CRC-32, one line each as fmt.Sprintf("%d:%s %d %08x\n",
// len(name), name, size, crc) writes it (model.DigestZipRecords).
func ZipRecordsSHA256(files []*zip.File) string {
	h := sha256.New()
	var b []byte
	for _, f := range files {
		b = strconv.AppendInt(b[:0], int64(len(f.Name)), 10)
		b = append(append(append(b, ':'), f.Name...), ' ')
		b = strconv.AppendUint(b, f.UncompressedSize64, 10)
		b = append(b, ' ')
		// %08x: at least 8 hex digits, zero-padded.
		x := strconv.FormatUint(uint64(f.CRC32), 16)
		for range 8 - len(x) {
			b = append(b, '0')
		}
		h.Write(append(append(b, x...), '\n'))
	}
	return hex.EncodeToString(h.Sum(nil))
}

// RecordsSHA256 is ZipRecordsSHA256 of the archive the checkpoint was
// opened from, taken while it was opened; false for other formats.
func (c *Checkpoint) RecordsSHA256() (string, bool) {
	return c.recordsSHA256, c.recordsSHA256 != ""
}

// pickleAhead is data.pkl as scanned from the file's first record before
// the zip directory was read (Checkpoint.pickleAhead), with where it was
// found.
type pickleAhead struct {
	f       io.ReaderAt
	name    string // the local header's
	dataOff int64
	res     scanned
}

// pickleAhead scans the pickle of the file's first record, if that is a
// stored <folder>/data.pkl, as torch writes it: up to its STOP, since the
// local header of a record torch writes gives no size. It returns nil
// where there is no such record or the scan fails: readPickle then reads
// the pickle as the directory says (and meets the error again there).
//
// Why: on densenet201 (1,209 records) reading and checking the directory
// and scanning the pickle take about 2 ms each, one after the other on
// the path before the copy can start, while the other core is idle.
func (c *Checkpoint) pickleAhead() *pickleAhead {
	const headerLen = 30
	var h [headerLen]byte
	if _, err := c.f.ReadAt(h[:], 0); err != nil {
		return nil
	}
	le := binary.LittleEndian
	if le.Uint32(h[0:]) != 0x04034b50 || le.Uint16(h[8:]) != uint16(zip.Store) {
		return nil
	}
	n, e := int64(le.Uint16(h[26:])), int64(le.Uint16(h[28:]))
	name := make([]byte, n)
	if _, err := c.f.ReadAt(name, headerLen); err != nil {
		return nil
	}
	if dir, base, ok := strings.Cut(string(name), "/"); !ok || dir == "" || base != "data.pkl" {
		return nil
	}
	off := headerLen + n + e
	limit := min(c.stat.Size()-off, maxPickle)
	if limit <= 0 {
		return nil
	}
	// The scan sizes its buffer and memo by limit (up to readChunk
	// each): the whole file's 81 MB on densenet201, whose pickle is 202
	// KB, made them 2 MB of fresh heap, about a millisecond of page
	// faults on the VM measured. The directory's size, where it gives
	// one, bounds them; a wrong one only fails the scan (nil: read as
	// the directory says).
	if size, ok := c.pickleSize(string(name)); ok && size <= limit {
		// Read whole, in one call, and scanned in memory, up to
		// readWholeMax: a larger size only claims memory where the scan
		// as it reads allocates as the bytes arrive, up to the STOP,
		// which may come much sooner. Where the read fails (a file
		// shorter than its directory says), scanned as it reads, as
		// before, to meet the same error.
		limit = size
		if size <= readWholeMax {
			b := make([]byte, size)
			if _, rerr := c.f.ReadAt(b, off); rerr == nil {
				res, err := scanPickleBytes(b)
				if err != nil {
					return nil
				}
				return &pickleAhead{f: c.f, name: string(name), dataOff: off, res: res}
			}
		}
	}
	res, err := scanPickle(bufio.NewReader(io.NewSectionReader(c.f, off, limit)), limit)
	if err != nil {
		return nil
	}
	return &pickleAhead{f: c.f, name: string(name), dataOff: off, res: res}
}

// readWholeMax bounds the pickle pickleAhead reads whole before scanning
// it: real ones are kilobytes to a few megabytes (densenet201: 202 KB). A
// variable for the tests, which set it to 0 to scan as it reads.
var readWholeMax int64 = 16 << 20

// pickleSize is the size the zip directory's first entry gives its
// record, where that entry is the file's first record, name (as torch
// writes them): read from the end of central directory record (or its
// zip64 locator and record) and that entry's header, a few small reads,
// while the directory itself (1,209 entries on densenet201) is read on
// another core. Only a hint for pickleAhead: false where anything is
// unusual (a comment after the directory, a zip64 size), and the
// directory's own reading checks what is kept (matches).
func (c *Checkpoint) pickleSize(name string) (int64, bool) {
	le := binary.LittleEndian
	size := c.stat.Size()
	const eocdLen, locLen, z64Len, cdLen = 22, 20, 56, 46
	if size < eocdLen {
		return 0, false
	}
	var eocd [eocdLen]byte
	if _, err := c.f.ReadAt(eocd[:], size-eocdLen); err != nil || le.Uint32(eocd[0:]) != 0x06054b50 {
		return 0, false
	}
	cd := int64(le.Uint32(eocd[16:]))
	if cd == 0xffffffff && size >= eocdLen+locLen {
		var loc [locLen]byte
		if _, err := c.f.ReadAt(loc[:], size-eocdLen-locLen); err != nil || le.Uint32(loc[0:]) != 0x07064b50 {
			return 0, false
		}
		at := int64(le.Uint64(loc[8:]))
		var z64 [z64Len]byte
		if at < 0 || at > size-z64Len {
			return 0, false
		}
		if _, err := c.f.ReadAt(z64[:], at); err != nil || le.Uint32(z64[0:]) != 0x06064b50 {
			return 0, false
		}
		cd = int64(le.Uint64(z64[48:]))
	}
	if cd < 0 || cd > size-cdLen-int64(len(name)) {
		return 0, false
	}
	h := make([]byte, cdLen+len(name))
	if _, err := c.f.ReadAt(h, cd); err != nil || le.Uint32(h[0:]) != 0x02014b50 {
		return 0, false
	}
	if int(le.Uint16(h[28:])) != len(name) || string(h[cdLen:]) != name || le.Uint32(h[42:]) != 0 {
		return 0, false // not the file's first record
	}
	n := int64(le.Uint32(h[24:]))
	if n == 0xffffffff || n != int64(le.Uint32(h[20:])) {
		return 0, false
	}
	return n, true
}

// scanAhead turns the pickle's scan ahead of the directory on; the tests
// turn it off to compare.
var scanAhead = true

// matches reports whether p is what readPickle would scan from zf: the
// same record, stored, at the same offset, exactly its bytes up to the
// STOP (a record with more after it is read again), their CRC-32 the one
// the directory gives (and the data descriptor, where it has one, as
// archive/zip checks it), and no FRAME said to run past its end (the
// only check of scanPickle that its limit, the record's size there,
// could fail where the scan ahead, limited by the file, did not).
func (p *pickleAhead) matches(a *archive, zf *zip.File) bool {
	if p == nil || zf.Name != p.name || zf.Method != zip.Store || a.offsets[zf] != p.dataOff {
		return false
	}
	size := int64(zf.UncompressedSize64)
	if int64(len(p.res.data)) != size || zf.CompressedSize64 != zf.UncompressedSize64 || p.res.frameReach > size {
		return false
	}
	if crc32.ChecksumIEEE(p.res.data) != zf.CRC32 {
		return false
	}
	if zf.Flags&0x8 != 0 {
		// archive/zip's readDataDescriptor: an optional signature, then
		// the CRC-32, which must be the directory's, and two sizes (12
		// bytes it reads in all, 16 with the signature).
		var d [16]byte
		n, _ := p.f.ReadAt(d[:], p.dataOff+size)
		b := d[:n]
		if len(b) >= 4 && binary.LittleEndian.Uint32(b) == 0x08074b50 {
			b = b[4:]
		}
		if len(b) < 12 || binary.LittleEndian.Uint32(b) != zf.CRC32 {
			return false
		}
	}
	return true
}

// recordError explains archive/zip's terse errors about a record's bytes.
func recordError(err error) error {
	switch {
	case errors.Is(err, zip.ErrChecksum):
		return fmt.Errorf("record is corrupt (CRC-32 mismatch): %w", err)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("record is shorter than the archive declares: %w", err)
	}
	return err
}

// maxDeflateRatio is the largest expansion deflate can achieve (258-byte
// matches coded in two bits, about 1032:1); a record declaring more is
// lying about its size.
const maxDeflateRatio = 1032

// checkRecords refuses records whose declared sizes the file cannot back,
// before anything is allocated for them: a stored record must lie inside
// the file, and a compressed one cannot expand beyond what deflate allows.
// It returns each record's data offset, reading the local headers through
// hr's window, which it clears when done.
func checkRecords(z *zip.Reader, fileSize int64, hr *headerReader) (map[*zip.File]int64, error) {
	defer func() { hr.ahead, hr.win = 0, nil }()
	offsets := make(map[*zip.File]int64, len(z.File))
	for i, zf := range z.File {
		hr.ahead = readAhead(z.File[i:])
		off, err := zf.DataOffset()
		if err != nil {
			return nil, fmt.Errorf("record %s: %w", zf.Name, err)
		}
		csize, usize := zf.CompressedSize64, zf.UncompressedSize64
		if off < 0 || off > fileSize || csize > uint64(fileSize-off) {
			return nil, fmt.Errorf("record %s declares %d bytes at offset %d, past the end of the %d-byte file", zf.Name, csize, off, fileSize)
		}
		switch zf.Method {
		case zip.Store:
			if csize != usize {
				return nil, fmt.Errorf("record %s is stored but declares %d bytes compressed and %d uncompressed", zf.Name, csize, usize)
			}
		default:
			if usize/maxDeflateRatio > csize {
				return nil, fmt.Errorf("record %s declares %d bytes uncompressed from %d compressed, more than compression can expand (a zip bomb or a corrupt header)", zf.Name, usize, csize)
			}
		}
		offsets[zf] = off
	}
	return offsets, nil
}

func (c *Checkpoint) loadZip() error {
	// The zip directory is read and checked on another core while this
	// one scans the pickle from the file's first record, where torch
	// writes it; the scan is kept only if the directory agrees (readPickle).
	type opened struct {
		a   *archive
		err error
	}
	dir := make(chan opened, 1)
	go func() {
		a, err := c.openZip()
		if err == nil {
			c.recordsSHA256 = ZipRecordsSHA256(a.z.File)
			c.ahead.preDone = make(chan struct{})
		}
		dir <- opened{a, err}
		if err == nil {
			c.prefetchSmall(a)
		}
	}()
	var ahead *pickleAhead
	if scanAhead {
		ahead = c.pickleAhead()
	}
	d := <-dir
	a, err := d.a, d.err
	if err != nil {
		return err
	}
	if len(c.storages) == 0 {
		// A storage per record at most: sized once, not grown through a
		// thousand inserts.
		c.storages = make(map[string]*Storage, len(a.z.File))
	}
	prefix := a.prefix
	if a.record("version") == nil {
		return fmt.Errorf("archive has no %sversion record", prefix)
	}
	if bo := a.record("byteorder"); bo != nil {
		b, err := readSmall(bo)
		if err != nil {
			return err
		}
		if s := strings.TrimSpace(string(b)); s != "little" {
			return fmt.Errorf("storages are %q-endian; only little-endian checkpoints are supported", s)
		}
	}
	if zf := a.record(ProvenanceRecord); zf != nil {
		if zf.UncompressedSize64 > maxProvenance {
			return fmt.Errorf("record %s is %d bytes, more than %d", zf.Name, zf.UncompressedSize64, maxProvenance)
		}
		b, err := readAll(zf)
		if err != nil {
			return err
		}
		c.Provenance = b
	}
	res, err := a.readPickle(ahead)
	c.Globals = res.globals
	if err != nil {
		return err
	}
	if bad := refused(res.globals); len(bad) > 0 {
		return &RefusedError{File: c.Path, Part: "data.pkl", Refused: bad, Globals: res.globals}
	}
	if res.dupKey != nil {
		return fmt.Errorf("%sdata.pkl: %w", prefix, res.dupKey)
	}
	data := res.data
	u := unpickler{storages: c.storages, resolve: c.zipStorage(a), memo: res.memo}
	root, err := u.load(data)
	if err != nil {
		return fmt.Errorf("%sdata.pkl: %w", prefix, err)
	}
	c.Root = root
	return nil
}

func (st *Storage) checkSize() error {
	es := int64(st.DType.Size())
	// Compare by division: numel comes from the file and numel×size can
	// overflow.
	if es == 0 || int64(st.Numel) > st.rec.size/es {
		return fmt.Errorf("storage %q (%s) holds %d bytes, fewer than %d elements of %s need", st.Key, st.rec.name, st.rec.size, st.Numel, st.DType)
	}
	return nil
}

// ProvenanceRecord is the zip record, below the archive's folder, that
// holds abnconvert's provenance record (package model). torch.load reads
// only the records its pickle references (data/<key>) and a few it knows
// by name (version, byteorder, .data/...), so it ignores this one.
const ProvenanceRecord = "abnconvert.json"

// maxProvenance bounds the provenance record: a few hundred bytes per BN.
const maxProvenance = 64 << 20

// readAll reads a whole record whose declared size was checked.
func readAll(zf *zip.File) ([]byte, error) {
	rc, err := zf.Open()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", zf.Name, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, int64(zf.UncompressedSize64)+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", zf.Name, recordError(err))
	}
	return b, nil
}

func readSmall(zf *zip.File) ([]byte, error) {
	rc, err := zf.Open()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", zf.Name, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, 1<<10))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", zf.Name, err)
	}
	return b, nil
}

// legacyPickles walks the five pickles of a legacy file: magic number,
// protocol version, system info, the object itself, and the list of storage
// keys. It returns the main and key-list pickles, every global referenced,
// and where the raw storages start.
func (c *Checkpoint) legacyPickles() (pickles [2][]byte, storagesAt int64, globals []string, err error) {
	size := c.stat.Size()
	br := bufio.NewReader(io.NewSectionReader(c.f, 0, size))
	var pos int64
	var all [5][]byte
	var dupKey error
	seen := map[string]bool{}
	names := []string{"magic number", "protocol version", "system info", "main object", "storage key list"}
	for i := range all {
		res, err := scanPickle(br, size-pos)
		for _, name := range res.globals {
			if !seen[name] {
				seen[name] = true
				globals = append(globals, name)
			}
		}
		if err != nil {
			return pickles, 0, globals, fmt.Errorf("legacy %s pickle at offset %d: %w", names[i], pos, err)
		}
		if res.dupKey != nil && dupKey == nil {
			dupKey = fmt.Errorf("legacy %s pickle: %w", names[i], res.dupKey)
		}
		all[i] = res.data
		pos += int64(len(res.data))
	}
	// The header pickles hold plain numbers and dicts; decode them only
	// once the allowlist has passed.
	if bad := refused(globals); len(bad) > 0 {
		return pickles, pos, globals, &RefusedError{File: c.Path, Part: "the pickle", Refused: bad, Globals: globals}
	}
	if dupKey != nil {
		return pickles, 0, globals, dupKey
	}
	var header [3]Value
	for i := range header {
		u := unpickler{resolve: noStorages}
		if header[i], err = u.load(all[i]); err != nil {
			return pickles, 0, globals, fmt.Errorf("legacy %s pickle: %w", names[i], err)
		}
	}
	if m, ok := header[0].(*big.Int); !ok || m.Cmp(legacyMagic) != 0 {
		return pickles, 0, globals, errNotPickle
	}
	if v, ok := header[1].(int64); !ok || v != 1001 {
		return pickles, 0, globals, fmt.Errorf("legacy protocol version %v, want 1001", header[1])
	}
	if info, ok := header[2].(*Dict); ok {
		if le, ok := info.Get("little_endian"); ok && le != true {
			return pickles, 0, globals, errors.New("storages are big-endian; only little-endian checkpoints are supported")
		}
	}
	return [2][]byte{all[3], all[4]}, pos, globals, nil
}

func noStorages(key string, _ DType, _ int, _ string, _ *Global) (*Storage, error) {
	return nil, fmt.Errorf("unexpected storage %q in a header pickle", key)
}

func (c *Checkpoint) loadLegacy() error {
	pickles, pos, globals, err := c.legacyPickles()
	c.Globals = globals
	if err != nil {
		return err
	}
	u := unpickler{storages: c.storages, resolve: func(key string, dtype DType, numel int, loc string, class *Global) (*Storage, error) {
		return &Storage{Key: key, DType: dtype, Numel: numel, Location: loc, Class: class}, nil
	}}
	root, err := u.load(pickles[0])
	if err != nil {
		return fmt.Errorf("legacy main pickle: %w", err)
	}
	ku := unpickler{resolve: noStorages}
	keyList, err := ku.load(pickles[1])
	if err != nil {
		return fmt.Errorf("legacy storage key list: %w", err)
	}
	keys, ok := keyList.(*List)
	if !ok {
		return fmt.Errorf("legacy storage key list is a %s, not a list", typeName(keyList))
	}
	// The storages follow, in key-list order: an 8-byte little-endian
	// element count, then the raw elements.
	size := c.stat.Size()
	for _, k := range keys.Items {
		key, ok := k.(string)
		if !ok {
			return fmt.Errorf("legacy storage key %v is not a string", k)
		}
		st, ok := c.storages[key]
		if !ok {
			return fmt.Errorf("legacy storage %q is listed but no tensor uses it, so its element size is unknown", key)
		}
		if st.rec.name != "" {
			return fmt.Errorf("legacy storage %q is listed twice", key)
		}
		var hdr [8]byte
		if _, err := c.f.ReadAt(hdr[:], pos); err != nil {
			if errors.Is(err, io.EOF) {
				return fmt.Errorf("legacy storage %q: the file ends at offset %d, before the element count expected at %d", key, size, pos)
			}
			return fmt.Errorf("legacy storage %q: reading its size at offset %d: %w", key, pos, err)
		}
		n := binary.LittleEndian.Uint64(hdr[:])
		es := int64(st.DType.Size())
		if n > uint64(size) || pos+8+int64(n)*es > size {
			return fmt.Errorf("legacy storage %q: %d elements at offset %d run past the end of the file", key, n, pos)
		}
		st.rec = record{name: fmt.Sprintf("legacy storage %s at offset %d", key, pos+8), offset: pos + 8, size: int64(n) * es}
		if err := st.checkSize(); err != nil {
			return err
		}
		pos += 8 + int64(n)*es
	}
	for key, st := range c.storages {
		if st.rec.name == "" {
			return fmt.Errorf("legacy storage %q is used by a tensor but missing from the file", key)
		}
	}
	c.Root = root
	return nil
}

// readRange reads length bytes of a storage's record, starting at start.
// The first read of a zip record checks the record's CRC-32, so that values
// decoded from a corrupt record never reach a conversion (copying a record
// checks it again on the way out).
func (c *Checkpoint) readRange(st *Storage, start, length int64) ([]byte, error) {
	if start < 0 || length < 0 || start > st.rec.size || length > st.rec.size-start {
		return nil, fmt.Errorf("reading %s: bytes [%d, %d+%d) lie outside its %d bytes", st.rec.name, start, start, length, st.rec.size)
	}
	if st.rec.hasCRC && !st.verified {
		whole, err := c.readWhole(st)
		if err != nil {
			return nil, err
		}
		return whole[start : start+length], nil
	}
	if st.kept != nil {
		return st.kept[start : start+length], nil
	}
	buf := make([]byte, length)
	if st.rec.zf == nil {
		if _, err := c.f.ReadAt(buf, st.rec.offset+start); err != nil {
			return nil, fmt.Errorf("reading %s: %w", st.rec.name, err)
		}
		return buf, nil
	}
	rc, err := st.rec.zf.Open()
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", st.rec.name, err)
	}
	defer rc.Close()
	if _, err := io.CopyN(io.Discard, rc, start); err != nil {
		return nil, fmt.Errorf("reading %s: %w", st.rec.name, err)
	}
	if _, err := io.ReadFull(rc, buf); err != nil {
		return nil, fmt.Errorf("reading %s: %w", st.rec.name, err)
	}
	return buf, nil
}

// readWhole reads a zip record whole and checks its CRC-32.
func (c *Checkpoint) readWhole(st *Storage) ([]byte, error) {
	var buf []byte
	if st.rec.zf == nil && st.rec.size <= keepMax {
		buf = c.readSmallRecord(st) // nil: read alone below
	}
	switch {
	case buf != nil:
	case st.rec.zf == nil:
		// A stored record was checked to lie inside the file.
		buf = make([]byte, st.rec.size)
		if _, err := c.f.ReadAt(buf, st.rec.offset); err != nil {
			return nil, fmt.Errorf("reading %s: %w", st.rec.name, err)
		}
	default:
		rc, err := st.rec.zf.Open()
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", st.rec.name, err)
		}
		defer rc.Close()
		// Grow as bytes arrive: a compressed record's declared size is
		// not proof that the data is there.
		var b bytes.Buffer
		if _, err := b.ReadFrom(io.LimitReader(rc, st.rec.size)); err != nil {
			return nil, fmt.Errorf("reading %s: %w", st.rec.name, recordError(err))
		}
		buf = b.Bytes()
	}
	if int64(len(buf)) != st.rec.size {
		return nil, fmt.Errorf("reading %s: the record ends after %d of its %d bytes", st.rec.name, len(buf), st.rec.size)
	}
	if crc := crc32.ChecksumIEEE(buf); crc != st.rec.crc {
		return nil, fmt.Errorf("record %s is corrupt: CRC-32 %08x, the archive records %08x", st.rec.name, crc, st.rec.crc)
	}
	st.verified = true
	if st.rec.size <= keepMax {
		st.kept = buf
	}
	return buf, nil
}

// readAheadState is the read-ahead of readWhole over small stored records:
// a checkpoint's BN vectors (weight, bias, running mean and variance,
// num_batches_tracked) lie one after the other in the file, and validation
// reads them all, a pread each otherwise. The first read of one reads the
// run of small records around it at once; each keeps its bytes, unchecked,
// until its own first read checks its CRC-32 as before. The mutex makes the
// records' ahead fields safe for readers of different storages in parallel.
type readAheadState struct {
	mu     sync.Mutex
	built  bool
	sorted []*Storage // the small stored records with a CRC, by offset
	// pre holds the small records prefetchSmall read, by data offset,
	// each handed out once; preDone (nil without a prefetch) is closed
	// once it is complete.
	pre     map[int64][]byte
	preDone chan struct{}
}

// prefetchSmall reads the archive's small stored records (keepMax bytes
// at most: a checkpoint's BN vectors) in runs, as readSmallRecord would,
// for readSmallRecord to hand out. It runs on the goroutine that read the
// zip directory, once that is done, while the conversion's core goes on
// decoding the pickle: on densenet201 the reads (about 2 MB in 250 runs)
// were a millisecond and a half of its reading the BN weights and
// validating them, with the other core idle.
func (c *Checkpoint) prefetchSmall(a *archive) {
	defer close(c.ahead.preDone)
	type rec struct{ off, size int64 }
	var recs []rec
	for _, zf := range a.z.File {
		if zf.Method == zip.Store && zf.UncompressedSize64 <= keepMax && zf.CompressedSize64 == zf.UncompressedSize64 {
			recs = append(recs, rec{a.offsets[zf], int64(zf.UncompressedSize64)})
		}
	}
	slices.SortFunc(recs, func(x, y rec) int { return cmp.Compare(x.off, y.off) })
	pre := make(map[int64][]byte, len(recs))
	for i := 0; i < len(recs); {
		j, start, end := readAheadRun(i, len(recs), func(k int) (int64, int64) { return recs[k].off, recs[k].size })
		buf := make([]byte, end-start)
		if _, err := c.f.ReadAt(buf, start); err == nil {
			for _, r := range recs[i:j] {
				o := r.off - start
				// Capped, so that no reader of one record reaches the next.
				pre[r.off] = buf[o : o+r.size : o+r.size]
			}
		}
		i = j
	}
	c.ahead.mu.Lock()
	c.ahead.pre = pre
	c.ahead.mu.Unlock()
}

// Bounds on one read-ahead: the bytes read at once, and the largest gap
// between two records of a run (past it lies a large record).
const (
	readAheadMax = 256 << 10
	readAheadGap = 4 << 10
)

// readAheadRun is the run a read-ahead from record i (of n, by offset;
// rec gives each one's offset and size) reads: the bytes [start, end),
// up to record j, the first it leaves out.
func readAheadRun(i, n int, rec func(int) (off, size int64)) (j int, start, end int64) {
	start, size := rec(i)
	end = start + size
	for j = i + 1; j < n; j++ {
		off, size := rec(j)
		if off-end > readAheadGap || max(end, off+size)-start > readAheadMax {
			break
		}
		end = max(end, off+size)
	}
	return j, start, end
}

// readSmallRecord returns a small stored record's bytes, read with the
// small records that follow it in the file, or nil when they could not be
// read that way (readWhole then reads the record alone, and reports its
// errors as it always has).
func (c *Checkpoint) readSmallRecord(st *Storage) []byte {
	a := &c.ahead
	if a.preDone != nil {
		<-a.preDone
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if b := st.ahead; b != nil {
		st.ahead = nil
		return b
	}
	if b, ok := a.pre[st.rec.offset]; ok && int64(len(b)) == st.rec.size {
		delete(a.pre, st.rec.offset)
		return b
	}
	if !a.built {
		a.built = true
		for _, s := range c.storages {
			if s.rec.zf == nil && s.rec.hasCRC && s.rec.size <= keepMax {
				a.sorted = append(a.sorted, s)
			}
		}
		sort.Slice(a.sorted, func(i, j int) bool {
			if a.sorted[i].rec.offset != a.sorted[j].rec.offset {
				return a.sorted[i].rec.offset < a.sorted[j].rec.offset
			}
			return a.sorted[i].Key < a.sorted[j].Key
		})
	}
	i := sort.Search(len(a.sorted), func(i int) bool { return a.sorted[i].rec.offset >= st.rec.offset })
	for i < len(a.sorted) && a.sorted[i] != st && a.sorted[i].rec.offset == st.rec.offset {
		i++
	}
	if i == len(a.sorted) || a.sorted[i] != st {
		return nil
	}
	j, start, end := readAheadRun(i, len(a.sorted), func(k int) (int64, int64) { return a.sorted[k].rec.offset, a.sorted[k].rec.size })
	buf := make([]byte, end-start)
	if _, err := c.f.ReadAt(buf, start); err != nil {
		return nil
	}
	for _, s := range a.sorted[i+1 : j] {
		if r := &s.rec; !s.verified && s.ahead == nil {
			o := r.offset - start
			// Capped, so that no reader of one record reaches the next.
			s.ahead = buf[o : o+r.size : o+r.size]
		}
	}
	return buf[:st.rec.size:st.rec.size]
}

// keepMax is the largest record readWhole keeps once checked: BN vectors,
// which validation reads, then the rewrite, each a system call and a
// buffer otherwise, and which all together are a few MB at most.
const keepMax = 64 << 10

// openRecord streams a storage's whole record.
func (c *Checkpoint) openRecord(st *Storage) (io.ReadCloser, error) {
	if st.rec.zf != nil {
		return st.rec.zf.Open()
	}
	return io.NopCloser(io.NewSectionReader(c.f, st.rec.offset, st.rec.size)), nil
}
