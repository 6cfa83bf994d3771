package pth

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/abnconvert/abnconvert/negate"
	"github.com/abnconvert/abnconvert/output"
)

// Prewrite is a write of the checkpoint started before the conversion has
// decided what it changes, so that copying the records, most of the time
// of a conversion, runs on the other core while the conversion reads and
// rewrites.
//
// It works because a conversion changes values, not the layout: the
// pickle, the record names and sizes stay what they were, so every byte's
// place in the output is known as soon as the checkpoint is open. The
// records are copied from the input as they are (CRCs checked on the way,
// as Write checks them). Finish then makes the plan of the changed
// checkpoint; where its pickle and layout are the ones the copy used, it
// hands the copy the negations, which the records it has not yet prepared
// get on the way, and fills in the rest in place once the copy has ended:
// the flipped channel runs read back and written over, new contents
// written over the old, and those records' CRCs in their descriptors and
// in the central directory.
// Where the layout changed (a changed tensor that shares its storage gets
// a new record), Finish empties the file and writes it as Write does. In
// every case the output is byte for byte what Write writes.
//
// A Prewrite may also start once some changes are made: the channel
// negations it finds then are applied by the copy itself (a snapshot of
// them: the conversion goes on beside it), and the new contents it finds
// are written and then written over. Finish checks that the changed
// checkpoint negates what the copy negated, and hands it only the
// negations made since; anything else is written again from the start.
//
// Every checkpoint is copied early, whatever its records' sizes. Where
// most are small (a DenseNet: 1,200 records, most under 1 MiB) the copy's
// groups (copyBatch) share the two cores with the conversion, and that
// once cost more than it saved (densenet201 trained: 83 ms written after,
// 88 ms early); since the conversion stopped collecting garbage on the way
// (convert/gc.go) it pays there too: densenet201 median 55.6 ms to 49.1
// (init) and 62.8 to 60.8 (trained), 15 runs alternated.
type Prewrite struct {
	c    *Checkpoint
	path string
	f    *output.File
	plan *writePlan // nil: no early copy (Finish writes it all)
	// pkl is plan's pickle, made by the copy first (pklErr its error);
	// pklReady is closed once it is.
	pkl      []byte
	pklErr   error
	pklReady chan struct{}
	// whenReady, when not nil, is closed once late.when is set
	// (PrewriteLater): the copy writes no record before.
	whenReady chan struct{}
	z         *zipWriter
	late      lateFlips

	stop     chan struct{}
	stopped  bool
	hold     chan struct{} // holdCopy's, closed by finish
	rewound  bool          // the layout changed: written again from the start
	done     chan struct{}
	err      error // of the copy
	panicked any   // a panic of the copy, raised again by Finish
}

// errStopped ends a copy that Prewrite.Stop stopped.
var errStopped = errors.New("write stopped")

// Prewrite creates the output path in set (see Stage) and starts copying
// the checkpoint, with the changes made so far, into it on a goroutine of
// its own. Finish completes it with the changes made meanwhile; Stop,
// deferred by the caller, ends it on every other path (the set's Abort
// then removes the file).
func (c *Checkpoint) Prewrite(set *output.Set, path string) (*Prewrite, error) {
	return c.prewrite(set, path, false)
}

// When is when the copy of PrewriteLater writes a record.
type When int

const (
	Now     When = iota // from the start
	Settled             // once Settle has handed it the negations
)

// PrewriteLater is Prewrite for a conversion that has yet to decide which
// channels it negates: when says, for each tensor, whether the copy
// writes its record at once or once Settle has handed it the negations
// (a record viewed by several tensors: the latest of theirs). A record
// left until then is written once, in its place, with its negations; one
// written at once that is negated after all is read back and written
// over once the copy has ended, as after Prewrite; one left that is not
// negated costs nothing more. The output is the same bytes whatever when
// says. Settle, where never called, is done by Finish.
//
// Until Settle the copy reads one group of small records at a time (where
// it reads three ahead after), leaving the other core to the conversion,
// whose reading is what Settle waits for.
//
// Copying every record at once costs more where many are negated
// (resnext101_32x8d trained: 62 ms of edits against a 100 ms copy), and
// waiting to start the copy until the signs are settled left the other
// core idle for most of the conversion's reading (densenet201 trained:
// 20 ms of 50) while a third of the bytes (its 32-channel convolutions and
// its classifier) cannot be negated.
//
// The copy starts before when is asked: it makes the pickle first (about
// 1 ms on densenet201), on the other core, while when decides (convert's
// reads the BN weights, another millisecond); it waits for the answers
// before it writes a record.
//
// Where the chunked copy writes the records (writeChunked: an output file,
// an input whose records lie stored in it), when is not asked: every
// record is written at once, and those whose negations or new contents
// come out after it was written are written over as soon as they do,
// beside the conversion, by the copy, which ends no sooner than the
// signs settle.
func (c *Checkpoint) PrewriteLater(set *output.Set, path string, when func(key string, shape []int) When) (*Prewrite, error) {
	p, err := c.prewrite(set, path, true)
	if err != nil || p.plan == nil {
		return p, err
	}
	if c.chunkable(p.z, p.plan) {
		// The chunked copy writes every record at once, and over again
		// those negated once the signs settle (writeChunked): when is
		// not asked.
		p.late.settled = make(chan struct{})
		close(p.whenReady)
		return p, nil
	}
	m := map[*Storage]When{}
	for _, key := range c.Keys() {
		t, ok := c.Tensor(key)
		if !ok || t.Storage == nil {
			continue
		}
		if w := when(key, t.Shape); w > m[t.Storage] && w <= Settled {
			m[t.Storage] = w
		}
	}
	if len(m) > 0 {
		p.late.when = m
		p.late.settled = make(chan struct{})
	}
	close(p.whenReady) // the copy reads late.when from here on
	return p, nil
}

// Settle hands the copy of PrewriteLater the negations made so far, all
// there will be, and lets it write the records it left until then. Only
// its first call does anything.
func (p *Prewrite) Settle() {
	if p.plan == nil || p.late.settled == nil {
		return
	}
	p.late.settle(func() {
		// The tensors negated in place since the checkpoint was opened,
		// whose records the copy's plan copies as they are: what a plan
		// of the changed checkpoint would negate (a tensor negated in
		// place owns its record; one rewritten since is not). Not that
		// plan itself, made and compared on the conversion's path (0.4-0.9
		// ms of densenet201 trained's): what is handed over is only taken
		// on the way, and Finish checks it against its own plan, which
		// writes the file again where the layout changed.
		negated := map[*Storage]*Tensor{}
		for _, t := range p.c.lazyNegated {
			if len(t.negate) > 0 && t.pending == nil && t.stream == nil { // not negated back, nor rewritten since
				negated[t.Storage] = t
			}
		}
		// Copies, which the copy reads while the conversion goes on
		// changing the checkpoint's tensors (its BN vectors); Finish
		// compares them with what it then has.
		flips := make(map[*Storage]*Tensor, len(negated))
		for _, s := range p.plan.storages {
			if t := negated[s.src]; t != nil && s.negated == nil && s.data == nil && s.stream == nil {
				c := *t
				c.negate = slices.Clone(t.negate)
				flips[s.src] = &c
			}
		}
		p.late.flips.Store(&flips)
	})
}

// settle runs publish, then lets the copy write the records left until
// the signs settle, the first time it is called.
func (l *lateFlips) settle(publish func()) {
	if l.settled == nil {
		return
	}
	l.settleOnce.Do(func() {
		defer close(l.settled)
		if publish != nil {
			publish()
		}
	})
}

// prewrite starts the copy; later, it waits before writing any record
// until the caller has set late.when and closed whenReady.
func (c *Checkpoint) prewrite(set *output.Set, path string, later bool) (*Prewrite, error) {
	if c.stat != nil {
		set.Protect(c.Path)
	}
	f, err := set.Create(path)
	if err != nil {
		return nil, err
	}
	p := &Prewrite{c: c, path: path, f: f, stop: make(chan struct{}), done: make(chan struct{})}
	plan, err := c.plan()
	if err != nil || !plan.copyable() { // Finish writes everything (and meets any error again)
		close(p.done)
		return p, nil
	}
	plan.snapshotNegations()
	p.plan = plan
	p.pklReady = make(chan struct{})
	p.late.taken = map[*Storage]*Tensor{}
	if later {
		p.whenReady = make(chan struct{})
		p.late.allWritten = make(chan struct{})
	}
	p.z = newZipWriter(f)
	p.hold = holdCopy
	if holdCopyAt > 0 {
		p.late.hold, p.late.holdAt = make(chan struct{}), holdCopyAt
	}
	go p.run()
	return p, nil
}

// holdCopy, when set (by tests), makes the copy wait until Finish has
// published the negations, so that every record gets them on the way.
var holdCopy chan struct{}

// holdCopyAt, when above 0 (tests), makes the copy wait once it has
// written that many records until Finish has published the negations, so
// that those records are edited afterwards and the rest take theirs on
// the way.
var holdCopyAt int

func (p *Prewrite) run() {
	defer close(p.done)
	defer func() {
		if r := recover(); r != nil {
			p.panicked = r
		}
	}()
	// The pickle too is made here, off the conversion's core: the
	// conversion changes tensors' values, never the tree the pickler
	// reads.
	p.pkl, p.pklErr = newPickler(p.plan).dump(p.c.Root)
	close(p.pklReady)
	if p.err = p.pklErr; p.err != nil {
		return
	}
	if p.whenReady != nil {
		select {
		case <-p.whenReady:
		case <-p.stop:
			p.err = errStopped
			return
		}
	}
	if p.hold != nil {
		select {
		case <-p.hold:
		case <-p.stop:
		}
	}
	p.err = p.c.writeBody(p.z, p.plan, p.pkl, &p.late, p.stop)
	if p.err == nil {
		p.err = p.f.Flush()
	}
}

// Stop ends the copy, if it still runs, and waits for it. It is a no-op
// after Finish.
func (p *Prewrite) Stop() {
	if !p.stopped {
		p.stopped = true
		close(p.stop)
	}
	<-p.done
}

// Finish completes the output with every change made to the checkpoint
// since Prewrite. Errors name the output.
func (p *Prewrite) Finish() error {
	if err := p.finish(); err != nil {
		return fmt.Errorf("%s: %w", p.path, err)
	}
	return nil
}

func (p *Prewrite) finish() error {
	c := p.c
	if p.plan == nil {
		_, err := c.writeTo(p.f, false)
		return err
	}
	plan, err := c.plan()
	if err != nil {
		p.Stop()
		return err
	}
	pkl, err := newPickler(plan).dump(c.Root)
	if err != nil {
		p.Stop()
		return err
	}
	// p.pkl is the copy's, made first: waiting for it is waiting for the
	// copy's first write at most.
	select { // a panic of the copy's pickler ends it before pklReady
	case <-p.pklReady:
	case <-p.done:
		if err := p.failed(); err != nil {
			return err
		}
	}
	same := p.pklErr == nil && bytes.Equal(pkl, p.pkl) && sameLayout(p.plan, plan) && negatesAsCopied(p.plan, plan)
	if same {
		// The negations the copy's plan did not have, and the new
		// contents of records it copies from the input: a record it has
		// not read yet gets them on the way rather than being read back
		// and written over once it ends, on the critical path. On
		// densenet201 about a third of the 402 (trained) and half of the
		// 201 (init) rewritten BN vectors are taken on the way; the
		// edits after the copy went from about 3 ms to 1-2 (init).
		flips := map[*Storage]*Tensor{}
		data := map[*Storage][]byte{}
		for i, s := range plan.storages {
			r := p.plan.storages[i]
			if s.negated != nil && r.negated == nil {
				flips[s.src] = s.negated
			}
			if s.data != nil && r.data == nil && r.stream == nil && int64(len(s.data)) == r.src.rec.size {
				data[r.src] = s.data
			}
		}
		p.late.data.Store(&data)
		p.late.flips.Store(&flips)
	}
	p.late.settle(nil)
	if p.hold != nil {
		close(p.hold)
	}
	if p.late.hold != nil {
		close(p.late.hold) // holdCopyAt's, once the negations are out
	}
	if !same {
		// Nothing the copy wrote stays: stop it rather than let it finish.
		p.Stop()
		if err := p.failed(); err != nil && !errors.Is(err, errStopped) {
			return err
		}
		p.rewound = true
		if err := p.f.Rewind(); err != nil {
			return err
		}
		_, err := c.writeTo(p.f, false)
		return err
	}
	// The records the copy wrote before it had their changes are edited
	// once it has ended. Beside it, each edit waited for the file's lock,
	// which the copy's writes hold, spinning for it on this core while the
	// copy's mapper needed it: on resnext101_32x8d edits made after the
	// copy took median 192 ms to 207 (trained) and 152 to 160 (init), CPU
	// 262 ms to 296 (11 runs each, alternated).
	<-p.done
	if err := p.failed(); err != nil {
		return err
	}
	const first = 2 // data.pkl and byteorder come first
	// The edits of every record are made together, in file order, so
	// that neighbours (a BN's four vectors, whose new values come last)
	// are read and written back in one span: densenet201 trained has
	// about 800 records to edit, 201 spans.
	var ed edits
	if len(p.z.entries) != first+len(plan.storages) {
		return fmt.Errorf("early copy wrote %d records where the plan has %d", len(p.z.entries)-first, len(plan.storages))
	}
	for i, s := range plan.storages {
		e := &p.z.entries[first+i]
		if e.name != "archive/data/"+s.key {
			return fmt.Errorf("early copy wrote %s where the plan has %s", e.name, s.key)
		}
		if s.data != nil && sameBytes(p.late.tookData(p.plan.storages[i].src), s.data) {
			continue // written on the way
		}
		taken := p.late.took(s.src)
		if p.plan.storages[i].negated != nil {
			taken = s.negated // the copy's own plan had them (negatesAsCopied)
		}
		if err := patchRecord(p.f, e, s, taken, &ed); err != nil {
			return err
		}
	}
	if err := ed.apply(p.f); err != nil {
		return fmt.Errorf("editing the records written before their changes: %w", err) // Finish names the output
	}
	return c.writeTail(p.z)
}

// failed is the copy's error, once it has ended (a panic raised again).
func (p *Prewrite) failed() error {
	select {
	case <-p.done:
	default:
		return nil
	}
	if p.panicked != nil {
		panic(p.panicked)
	}
	return p.err
}

// MapEverything makes every copy take each stored record from a map,
// whatever their sizes, until restore is called: for the tests of callers
// (package convert), whose fixtures are too small to take that path
// otherwise. Not safe beside other tests that write checkpoints.
func MapEverything() (restore func()) {
	min := mapMin
	mapMin = 1
	return func() { mapMin = min }
}

// copyable reports whether the copy can write every storage of the plan
// by itself: input records (negated or not) and new contents, none
// streamed.
func (p *writePlan) copyable() bool {
	for _, s := range p.storages {
		if s.stream != nil || (s.src == nil && s.data == nil) {
			return false
		}
	}
	return true
}

// snapshotNegations gives the plan's negated storages copies of their
// tensors as they are now, for the copy to read while the conversion goes
// on changing the checkpoint's own.
func (p *writePlan) snapshotNegations() {
	for _, s := range p.storages {
		if s.negated != nil {
			t := *s.negated
			t.negate = slices.Clone(t.negate)
			s.negated = &t
		}
	}
}

// negatesAsCopied reports, for plan b made after the copy's plan a (the
// same layout), whether the records a negated are negated in b with the
// same channels, or rewritten whole: what the copy wrote of them is then
// right or written over.
func negatesAsCopied(a, b *writePlan) bool {
	for i, s := range b.storages {
		r := a.storages[i].negated
		if r == nil || s.data != nil || s.stream != nil {
			continue
		}
		if s.negated == nil || !slices.Equal(s.negated.negate, r.negate) {
			return false
		}
	}
	return true
}

// sameLayout reports whether plan b writes the records of plan a (all
// copies, Prewrite's) under the same names, with the same sizes, in the
// same order, those it copies from the same input records.
func sameLayout(a, b *writePlan) bool {
	if len(a.storages) != len(b.storages) {
		return false
	}
	for i, s := range b.storages {
		r := a.storages[i]
		if s.key != r.key || s.length() != r.length() {
			return false
		}
		if s.data == nil && s.stream == nil && s.src != r.src {
			return false
		}
	}
	return true
}

// length is the byte length of the storage's record.
func (s *outStorage) length() int64 {
	switch {
	case s.data != nil:
		return int64(len(s.data))
	case s.stream != nil:
		return s.size
	}
	return s.src.rec.size
}

// lateFlips hands a copy that started before they were known the
// negations of the records it copies (Prewrite), and the new contents of
// those it reads in groups (copyBatch): none until published. take and
// takeData are called as a record's copy is prepared, and note the
// records that got theirs on the way.
type lateFlips struct {
	flips atomic.Pointer[map[*Storage]*Tensor]
	data  atomic.Pointer[map[*Storage][]byte] // by the input record they replace
	mu    sync.Mutex
	taken map[*Storage]*Tensor
	// takenData are the contents written in place of input records.
	takenData map[*Storage][]byte

	// when is when the copy writes each input record (PrewriteLater;
	// Now where absent); settled is closed, once, by settle (Settle,
	// Finish).
	when       map[*Storage]When
	settled    chan struct{}
	settleOnce sync.Once

	// hold, when set (holdCopyAt, by tests), stops the copy once it has
	// written holdAt entries until Finish has published the negations.
	hold   chan struct{}
	holdAt int
	held   bool // the copy's: it has waited

	// overwritten counts the records the chunked copy wrote again once
	// their changes came out (overwriter), among those taken;
	// allWritten, when not nil (PrewriteLater), is closed once it has
	// written every record, before it waits for the signs to settle.
	overwritten int
	allWritten  chan struct{}
}

// took is the tensor whose negations the copy applied to st's record on
// the way (nil: none), final once the record is written.
func (l *lateFlips) took(st *Storage) *Tensor {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.taken[st]
}

// wrote is called by the copy z after each step: it makes the copy wait
// there for the tests' hold (holdCopyAt).
func (l *lateFlips) wrote(z *zipWriter, stop <-chan struct{}) error {
	if l.hold != nil && !l.held && len(z.entries) >= l.holdAt {
		select { // a test's: Finish closes it
		case <-l.hold:
		case <-stop:
		}
		l.held = true
	}
	return nil
}

// takeData is the published new contents of st's record (nil: none),
// noted as written.
func (l *lateFlips) takeData(st *Storage) []byte {
	m := l.data.Load()
	if m == nil {
		return nil
	}
	d := (*m)[st]
	if d != nil {
		l.mu.Lock()
		if l.takenData == nil {
			l.takenData = map[*Storage][]byte{}
		}
		l.takenData[st] = d
		l.mu.Unlock()
	}
	return d
}

// tookData is what takeData handed the copy for st (nil: nothing), final
// once the record is written.
func (l *lateFlips) tookData(st *Storage) []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.takenData[st]
}

// sameBytes reports whether a and b are the same slice (not equal
// contents: the plan's own bytes).
func sameBytes(a, b []byte) bool {
	return len(a) == len(b) && len(a) > 0 && &a[0] == &b[0]
}

func (l *lateFlips) take(st *Storage) *Tensor {
	m := l.flips.Load()
	if m == nil {
		return nil
	}
	t := (*m)[st]
	if t != nil {
		l.mu.Lock()
		l.taken[st] = t
		l.mu.Unlock()
	}
	return t
}

// patchRecord fills in, in the copy of a record as it was that the output
// holds at e, what s changes: new contents, streamed contents, or the
// negations the copy did not apply on the way (taken: those it did), and
// the record's CRC in its descriptor and in e (the central directory is
// written after). Streamed contents are written at once; the rest is
// added to ed, for the caller to apply with the other records' edits.
func patchRecord(f *output.File, e *zipEntry, s *outStorage, taken *Tensor, ed *edits) error {
	switch {
	case s.data != nil:
		data := s.data
		e.crc = crc32.ChecksumIEEE(data)
		ed.add(e.data, e.size, func(b []byte, pos int64) { copy(b, data[pos:]) })
	case s.stream != nil:
		// Streamed contents (a checkpoint built from another format)
		// are written where they go, as they come.
		h := crc32.NewIEEE()
		cw := &countingWriter{w: io.MultiWriter(io.NewOffsetWriter(f, e.data), h)}
		if err := s.stream(cw); err != nil {
			return fmt.Errorf("writing %s: %w", e.name, err)
		}
		if cw.n != e.size {
			return fmt.Errorf("writing %s: %d bytes written where the tensor has %d", e.name, cw.n, e.size)
		}
		e.crc = h.Sum32()
	case s.data == nil && taken != s.negated:
		// What the copy applied (taken, a copy Settle made or nil)
		// against what the record needs: the channels in one of them.
		t := s.negated
		var had, want []int
		if taken != nil {
			had, t = taken.negate, taken
		}
		if s.negated != nil {
			want, t = s.negated.negate, s.negated
		}
		chans := negate.Xor(had, want)
		if len(chans) == 0 {
			return nil // as copied
		}
		l, _ := layoutOf(t)
		at := e.data
		l.Runs(chans, 0, e.size, func(a, end int64) {
			ed.add(at+a, end-a, func(b []byte, pos int64) { l.Apply(chans, a+pos, b) })
		})
		e.crc ^= l.CRCDelta(chans, 0, e.size)
	default:
		return nil // as copied
	}
	crc := e.descriptor(nil)[4:8]
	ed.add(e.data+e.size+4, 4, func(b []byte, pos int64) { copy(b, crc[pos:]) })
	return nil
}

// edits are changes to bytes of a file already written, in increasing
// order of offset: each calls fn(b, pos) on the bytes [off+pos,
// off+pos+len(b)) of its range, once or in several pieces.
type edits []edit

type edit struct {
	off, n int64
	fn     func(b []byte, pos int64)
}

// add appends an edit, which must start after the last one ends.
func (ed *edits) add(off, n int64, fn func([]byte, int64)) {
	*ed = append(*ed, edit{off, n, fn})
}

// editGap is the most bytes between two edits that one read and write of
// the file spans rather than making them apart: a system call costs about
// what copying a few KB does.
const editGap = 4 << 10

// apply makes the edits, a span of neighbouring ones at a time: the span
// read from f into a buffer, edited, written back. The bytes must be in
// the file (flushed), not in its buffer. Not through a shared
// map: on ext4 a write fault costs several microseconds a page (the file
// system is told of every page made writable), more than copying it.
//
// The spans are shared among a goroutine per core (up to editWorkers):
// apply runs once the copy has ended, when nothing else is left to do
// but the directory, and a trained densenet201 has 201 spans to edit,
// about 1.5 ms on one core.
func (ed edits) apply(f *output.File) error {
	for i := 1; i < len(ed); i++ {
		if ed[i].off < ed[i-1].off+ed[i-1].n {
			return fmt.Errorf("edits out of order: [%d, +%d) after [%d, +%d)", ed[i].off, ed[i].n, ed[i-1].off, ed[i-1].n)
		}
	}
	// The spans, each with the pieces of edits it holds (an edit longer
	// than editSpan is cut into several).
	type piece struct {
		e    int   // the edit
		a, b int64 // the file's bytes [a, b) of it
	}
	type span struct {
		lo, hi int64
		pieces []piece
	}
	var spans []span
	for i, done := 0, int64(0); i < len(ed); {
		lo := ed[i].off + done
		hi := min(lo+editSpan, ed[i].off+ed[i].n)
		for j := i + 1; j < len(ed) && ed[j].off <= hi+editGap && ed[j].off < lo+editSpan; j++ {
			hi = max(hi, min(lo+editSpan, ed[j].off+ed[j].n))
		}
		sp := span{lo: lo, hi: hi}
		for i < len(ed) && ed[i].off+done < hi {
			e := ed[i]
			a, b := e.off+done, min(e.off+e.n, hi)
			sp.pieces = append(sp.pieces, piece{i, a, b})
			if b == e.off+e.n {
				i, done = i+1, 0
			} else {
				done = b - e.off
			}
		}
		spans = append(spans, sp)
	}
	edit := func(sp span, buf []byte) ([]byte, error) {
		if int64(cap(buf)) < sp.hi-sp.lo {
			buf = make([]byte, sp.hi-sp.lo) // as large as the largest span
		}
		w := buf[:sp.hi-sp.lo]
		if _, err := f.ReadAt(w, sp.lo); err != nil {
			return buf, err
		}
		for _, p := range sp.pieces {
			e := ed[p.e]
			e.fn(w[p.a-sp.lo:p.b-sp.lo], p.a-e.off)
		}
		_, err := f.WriteAt(w, sp.lo)
		return buf, err
	}
	workers := min(runtime.GOMAXPROCS(0), editWorkers, len(spans)/editsPerWorker+1)
	var (
		next   atomic.Int64
		failed atomic.Bool
		mu     sync.Mutex
		first  error
		wg     sync.WaitGroup
	)
	work := func() {
		var buf []byte
		for !failed.Load() {
			k := next.Add(1) - 1
			if k >= int64(len(spans)) {
				return
			}
			var err error
			if buf, err = edit(spans[k], buf); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
				failed.Store(true)
				return
			}
		}
	}
	for range workers - 1 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			work()
		}()
	}
	work()
	wg.Wait()
	return first
}

// editWorkers bounds apply's goroutines; editsPerWorker is the fewest
// spans that make another one worth starting.
const (
	editWorkers    = 4
	editsPerWorker = 16
)

// editSpan is the most bytes apply reads and writes back at a time.
var editSpan int64 = 1 << 20
