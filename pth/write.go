package pth

import (
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/output"
)

// WriteOptions controls Write.
type WriteOptions struct {
	// Force allows replacing an existing file (never the input itself).
	Force bool
	// Sync flushes the file to disk before renaming it into place, for
	// durability against power loss. The rename alone already guarantees
	// that a failed or interrupted abnconvert leaves no partial output;
	// syncing costs about the time of writing the whole file to disk, which
	// on a 500 MB checkpoint is more than the conversion itself.
	Sync bool
}

// writePlan says where each tensor's bytes go in the output.
type writePlan struct {
	tensors  map[*Tensor]outTensor
	storages []*outStorage // sorted by key, the order torch writes records in
}

type outTensor struct {
	st     *outStorage
	offset int
	stride []int
}

type outStorage struct {
	key      string
	class    *Global
	location string
	numel    int
	src      *Storage              // copy this input record when data is nil
	data     []byte                // new contents
	negated  *Tensor               // copy src with this tensor's negations applied
	stream   func(io.Writer) error // or write what this streams,
	size     int64                 // this many bytes
}

// walkTensors visits every distinct tensor of the tree once, in the order
// the pickler meets them.
func walkTensors(v Value, seen map[any]bool, visit func(*Tensor)) {
	switch v := v.(type) {
	case *Tensor:
		if !seen[v] {
			seen[v] = true
			visit(v)
		}
	case *List:
		if !seen[v] {
			seen[v] = true
			for _, it := range v.Items {
				walkTensors(it, seen, visit)
			}
		}
	case *Tuple:
		if !seen[v] {
			seen[v] = true
			for _, it := range v.Items {
				walkTensors(it, seen, visit)
			}
		}
	case *Call:
		walkTensors(v.Args, seen, visit)
	case *Dict:
		if !seen[v] {
			seen[v] = true
			for i := range v.keys {
				walkTensors(v.keys[i], seen, visit)
				walkTensors(v.vals[i], seen, visit)
			}
			if v.State != nil {
				walkTensors(v.State, seen, visit)
			}
		}
	}
}

// plan decides the output storage of every tensor. An unchanged tensor
// keeps its storage, copied byte for byte. A changed tensor that owns its
// storage exactly (offset 0, contiguous, sole user, same element count) has
// that record rewritten under the same key; any other changed tensor gets a
// fresh contiguous storage under a new key, so that the tensors it shared
// its storage with keep their values.
func (c *Checkpoint) plan() (*writePlan, error) {
	// Sized from the storages (a state dict has a tensor for each), so
	// that no map is rehashed as it fills: every conversion plans twice,
	// and each page of the heap's growth is a fault (on densenet201 the
	// maps' growth was 1 MB of the plans' 2.8).
	n := len(c.storages)
	order := make([]*Tensor, 0, n)
	users := make(map[*Storage]int, n)
	walkTensors(c.Root, make(map[any]bool, n+16), func(t *Tensor) {
		order = append(order, t)
		users[t.Storage]++
	})
	var used map[string]bool // the keys taken, made on first need
	next := 0
	newKey := func() string {
		if used == nil {
			used = make(map[string]bool, n+1)
			for k := range c.storages {
				used[k] = true
			}
		}
		for used[strconv.Itoa(next)] {
			next++
		}
		used[strconv.Itoa(next)] = true
		return strconv.Itoa(next)
	}
	p := &writePlan{tensors: make(map[*Tensor]outTensor, len(order)), storages: make([]*outStorage, 0, n)}
	byInput := make(map[*Storage]*outStorage, n)
	for _, t := range order {
		st := t.Storage
		if !t.Changed() {
			out := byInput[st]
			if out == nil {
				out = &outStorage{key: st.Key, class: st.Class, location: st.Location, numel: st.Numel, src: st}
				byInput[st] = out
				p.storages = append(p.storages, out)
			}
			p.tensors[t] = outTensor{out, t.Offset, t.Stride}
			continue
		}
		if t.stream != nil && t.pending == nil {
			out := &outStorage{key: st.Key, class: st.Class, location: st.Location, numel: st.Numel, stream: t.stream, size: int64(st.Numel) * int64(st.DType.Size())}
			byInput[st] = out
			p.storages = append(p.storages, out)
			p.tensors[t] = outTensor{out, 0, t.Stride}
			continue
		}
		if t.pending == nil {
			// Only negations, on a tensor that owns its record (NegateChannels
			// checked): the record streams through with sign bits flipped.
			out := &outStorage{key: st.Key, class: st.Class, location: st.Location, numel: st.Numel, src: st, negated: t}
			byInput[st] = out
			p.storages = append(p.storages, out)
			p.tensors[t] = outTensor{out, 0, t.Stride}
			continue
		}
		data, err := encode(st.DType, t.pending)
		if err != nil {
			return nil, err
		}
		if t.Offset == 0 && t.Contiguous() && users[st] == 1 && t.Numel() == st.Numel {
			out := &outStorage{key: st.Key, class: st.Class, location: st.Location, numel: st.Numel, data: data}
			byInput[st] = out
			p.storages = append(p.storages, out)
			p.tensors[t] = outTensor{out, 0, t.Stride}
			continue
		}
		out := &outStorage{key: newKey(), class: &Global{"torch", st.DType.storageClass()}, location: st.Location, numel: t.Numel(), data: data}
		p.storages = append(p.storages, out)
		p.tensors[t] = outTensor{out, 0, contiguousStride(t.Shape)}
	}
	sort.Slice(p.storages, func(i, j int) bool { return p.storages[i].key < p.storages[j].key })
	for _, s := range p.storages {
		if s.key == "" || strings.ContainsAny(s.key, "/\\\x00") || s.key == "." || s.key == ".." {
			return nil, fmt.Errorf("storage key %q cannot name a zip record", s.key)
		}
	}
	return p, nil
}

func contiguousStride(shape []int) []int {
	s := make([]int, len(shape))
	n := 1
	for i := len(shape) - 1; i >= 0; i-- {
		s[i] = n
		n *= shape[i]
	}
	return s
}

// WriteTo writes the checkpoint, with every SetValues change, as a zip
// archive laid out as torch.save lays it out (folder "archive", stored
// records aligned to 64 bytes), to w. Unchanged storages are streamed from
// the input through a fixed buffer; a zip input's CRC is checked on the
// way. The output depends only on the checkpoint and its changes.
func (c *Checkpoint) WriteTo(w io.Writer) (int64, error) {
	return c.writeTo(w, false)
}

func (c *Checkpoint) writeTo(w io.Writer, force64 bool) (int64, error) {
	plan, err := c.plan()
	if err != nil {
		return 0, err
	}
	pkl, err := newPickler(plan).dump(c.Root)
	if err != nil {
		return 0, err
	}
	z := newZipWriter(w)
	z.force64 = force64
	if err := c.writeBody(z, plan, pkl, nil, nil); err != nil {
		return z.off, err
	}
	return z.off, c.writeTail(z)
}

// writeBody writes the archive up to its last storage record: the pickle
// pkl of plan, the byte order and every storage's record. late, when not
// nil, gives negations that were not known when plan was made (Prewrite):
// a record copied from the input gets those its storage has by the time
// the copy starts preparing it. stop, when closed, ends the copy early
// (with an error).
func (c *Checkpoint) writeBody(z *zipWriter, plan *writePlan, pkl []byte, late *lateFlips, stop <-chan struct{}) error {
	add := z.addBytes
	// The archive holds at least the pickle's and every record's bytes
	// (headers, the byte order and the directory come on top): their
	// blocks are allocated in one call rather than as the writes extend
	// the file (output.File.Reserve), and none past its end.
	if r, ok := z.w.(reserver); ok {
		n := z.off + int64(len(pkl))
		for _, s := range plan.storages {
			n += s.length()
		}
		r.Reserve(n)
	}
	if err := add("archive/data.pkl", pkl); err != nil {
		return err
	}
	if err := add("archive/byteorder", []byte("little")); err != nil {
		return err
	}
	// Each record is written when its phase comes (PrewriteLater): the
	// records a conversion may still negate once it has settled the
	// signs, each in its place, the others around them from the start;
	// the entries are put back in the file's order at the end.
	var phases [Settled + 1][]int
	for i, s := range plan.storages {
		w := Now
		if late != nil && s.data == nil && s.stream == nil && s.negated == nil {
			w = late.when[s.src]
		}
		phases[w] = append(phases[w], i)
	}
	// Where the chunked copy can write them, every record is written at
	// once, whatever its phase, and those negated or rewritten once the
	// copy has passed them are written over whole (writeChunked): faster
	// than leaving them until the signs settle (densenet201 trained
	// median -1.7 ms, resnext101_32x8d -4.3, wide_resnet101_2 -6.7, CPU
	// 6-12% less, 2026-12-06), since the copy's writes, then aligned
	// chunks, cost about half as much per byte, and so does writing over
	// what the page cache holds.
	if c.chunkable(z, plan) {
		return c.writeChunked(z, plan, late, stop)
	}
	if len(phases[Now]) == len(plan.storages) {
		return c.writeRecords(z, plan, phases[Now], nil, batchInFlight, late, stop)
	}
	offs := make([]int64, len(plan.storages)+1)
	offs[0] = z.off
	for i, s := range plan.storages {
		offs[i+1] = z.recordEnd("archive/data/"+s.key, s.length(), offs[i])
	}
	settled := func() error {
		select {
		case <-late.settled:
			return nil
		case <-stop:
			return errStopped
		}
	}
	// The records left are placed by a goroutine per core (copyPlaced)
	// as soon as the signs settle, beside what remains of the others,
	// which are read one group at a time meanwhile: the conversion needs
	// the other core until the signs settle (densenet201 trained: 3 ms
	// sooner in the median of 50 runs than three groups ahead). Those
	// copied from maps follow in turn.
	c.chooseMaps(z, plan) // (placeable asks it)
	later := phases[Settled]
	var placing chan error
	var placed []zipEntry
	if pw, ok := z.w.(placedWriter); ok {
		var place, rest []int
		for _, i := range later {
			if c.placeable(plan.storages[i]) {
				place = append(place, i)
			} else {
				rest = append(rest, i)
			}
		}
		later = rest
		if len(place) > 0 {
			placing = make(chan error, 1)
			go func() {
				err := settled()
				if err == nil {
					placed, err = c.copyPlaced(z, pw, plan, place, offs, late, stop)
				}
				placing <- err
			}()
		}
	}
	first := len(z.entries)
	err := c.writeRecords(z, plan, phases[Now], offs, 1, late, stop)
	if placing != nil {
		// Waited for on every path: the file is not the copy's to leave
		// while a goroutine writes into it.
		if perr := <-placing; err == nil {
			err = perr
		}
	}
	if err == nil && len(later) > 0 {
		if err = settled(); err == nil {
			err = c.writeRecords(z, plan, later, offs, batchInFlight, late, stop)
		}
	}
	if err != nil {
		return err
	}
	z.entries = append(z.entries, placed...)
	sort.Slice(z.entries[first:], func(i, j int) bool { return z.entries[first+i].off < z.entries[first+j].off })
	return z.seek(offs[len(plan.storages)])
}

// writeRecords writes the records of the storages of plan at the indices
// idx, in that order: each at its offset in offs (offs[i] for storage i)
// where offs is not nil, else one after the other from z.off; the batcher
// reads up to inFlight groups at a time.
func (c *Checkpoint) writeRecords(z *zipWriter, plan *writePlan, idx []int, offs []int64, inFlight int, late *lateFlips, stop <-chan struct{}) error {
	// How each storage's record is copied is decided first, so that the
	// goroutines that read and prepare the input's records work ahead of
	// the writing from the start, across records: those copied from a
	// map (mapper), and the runs of small records copied together
	// (copyBatch, batcher). A run holds neighbours in the file only.
	type step struct {
		i   int // the storage's index in plan (the run's first)
		s   *outStorage
		run []batchRecord // or a run for copyBatch
	}
	var (
		steps  []step
		runs   [][]batchRecord
		run    []batchRecord
		runAt  int
		mapped []mappedRecord
	)
	endRun := func() {
		if len(run) > 0 {
			runs = append(runs, run)
			steps = append(steps, step{i: runAt, run: run})
			run = nil
		}
	}
	c.chooseMaps(z, plan)
	for k, i := range idx {
		s := plan.storages[i]
		if k > 0 && idx[k-1] != i-1 {
			endRun()
		}
		name := "archive/data/" + s.key
		var r batchRecord
		switch {
		case s.data != nil && batchCopy && int64(len(s.data)) < batchBuf:
			r = batchRecord{name: name, data: s.data}
		case s.data == nil && s.stream == nil && c.batchable(s.src):
			r = batchRecord{name: name, st: s.src, t: s.negated}
		default:
			endRun()
			if s.data == nil && s.stream == nil && c.mappable(s.src) {
				mapped = append(mapped, mappedRecord{s.src, s.negated})
			}
			steps = append(steps, step{i: i, s: s})
			continue
		}
		if len(run) == 0 {
			runAt = i
		}
		run = append(run, r)
	}
	endRun()
	var mp *mapper
	if len(mapped) > 0 {
		mp = c.startMapper(mapped, late)
		defer mp.close()
	}
	var bt *batcher
	if len(runs) > 0 {
		bt = c.startBatcher(runs, late, z.batchBufs, inFlight)
		z.batchBufs = nil
		defer func() { z.batchBufs = bt.close() }()
	}

	add := z.addBytes
	for _, step := range steps {
		select {
		case <-stop:
			return errStopped
		default:
		}
		if late != nil {
			if err := late.wrote(z, stop); err != nil {
				return err
			}
		}
		if offs != nil {
			if err := z.seek(offs[step.i]); err != nil {
				return err
			}
		}
		if step.run != nil {
			if err := c.copyBatch(z, step.run, bt, late, stop); err != nil {
				return err
			}
			continue
		}
		s := step.s
		name := "archive/data/" + s.key
		if s.data != nil {
			if err := add(name, s.data); err != nil {
				return err
			}
			continue
		}
		if s.stream != nil {
			if err := z.addStream(name, s.size, s.stream); err != nil {
				return err
			}
			continue
		}
		if c.mappable(s.src) {
			if err := c.copyMapped(z, name, s.src, mp); err != nil {
				return err
			}
			continue
		}
		t := s.negated
		if t == nil && late != nil {
			t = late.take(s.src)
		}
		if t != nil {
			if err := c.copyNegated(z, name, s.src, t); err != nil {
				return err
			}
			continue
		}
		if err := c.copyRecord(z, name, s.src); err != nil {
			return err
		}
	}
	if late != nil {
		return late.wrote(z, stop)
	}
	return nil
}

// writeTail writes what follows the storage records: the provenance
// record, the version and the central directory.
func (c *Checkpoint) writeTail(z *zipWriter) error {
	add := z.addBytes
	if c.Provenance != nil {
		if err := add("archive/"+ProvenanceRecord, c.Provenance); err != nil {
			return err
		}
	}
	// torch writes "3\n"; its loader reads the leading number.
	if err := add("archive/version", []byte("3\n")); err != nil {
		return err
	}
	return z.close()
}

func (c *Checkpoint) copyRecord(z *zipWriter, name string, st *Storage) error {
	rc, err := c.openRecord(st)
	if err != nil {
		return fmt.Errorf("%s: %s: %w", c.Path, st.rec.name, err)
	}
	defer rc.Close()
	crc, err := z.add(name, st.rec.size, rc)
	if err != nil {
		return fmt.Errorf("%s: copying %s: %w", c.Path, st.rec.name, err)
	}
	if st.rec.hasCRC && crc != st.rec.crc {
		return fmt.Errorf("%s: record %s is corrupt: CRC-32 %08x, the archive records %08x", c.Path, st.rec.name, crc, st.rec.crc)
	}
	return nil
}

// Write writes the checkpoint to path (see WriteTo) as a one-file output
// set (package output): through a temporary file in the same directory,
// renamed into place once complete, so that a failed or interrupted write
// leaves nothing behind. It refuses to overwrite the input file, and any
// existing file unless opt.Force is set. A command with several outputs
// stages them together with Stage instead.
func (c *Checkpoint) Write(path string, opt WriteOptions) error {
	return c.write(path, opt, false)
}

func (c *Checkpoint) write(path string, opt WriteOptions, force64 bool) error {
	set := output.New(output.Options{Force: opt.Force, Sync: opt.Sync})
	defer set.Abort()
	if err := c.stage(set, path, force64); err != nil {
		return err
	}
	return set.Commit()
}

// Stage writes the checkpoint (see WriteTo) into a new output of set at
// path, streamed to its temporary file; it is renamed into place when the
// set commits. The input checkpoint is never overwritten.
func (c *Checkpoint) Stage(set *output.Set, path string) error {
	return c.stage(set, path, false)
}

func (c *Checkpoint) stage(set *output.Set, path string, force64 bool) error {
	if c.stat != nil {
		set.Protect(c.Path)
	}
	f, err := set.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.writeTo(f, force64); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// reserver is a writer that can allocate a file's blocks ahead of the
// writes (output.File).
type reserver interface {
	Reserve(n int64)
}
