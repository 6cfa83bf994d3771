package pth

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/abnconvert/abnconvert/output"
)

// changeSome negates channels of every third float tensor and sets new
// values on every third other one, the same way on any checkpoint of the
// same file: what a conversion does (sign folds, rewritten BN vectors),
// and, on the fixtures with shared storages and views, changes that give
// a tensor a record of its own (a new layout).
func changeSome(t *testing.T, c *Checkpoint) {
	t.Helper()
	changeSomeOf(t, c, func(int) bool { return true })
}

// changeSomeOf is changeSome on the keys whose index in c.Keys() which
// accepts.
func changeSomeOf(t *testing.T, c *Checkpoint, which func(i int) bool) {
	t.Helper()
	for i, key := range c.Keys() {
		if !which(i) {
			continue
		}
		shape, _ := c.Shape(key)
		tn, _ := c.Tensor(key)
		switch {
		case i%3 == 0 && len(shape) > 0 && shape[0] > 0 && isFloat(tn.DType()):
			chans := []int{0}
			if shape[0] > 2 {
				chans = append(chans, 2)
			}
			if _, err := c.NegateChannels(key, chans); err != nil {
				t.Fatalf("%s: %v", key, err)
			}
		case i%3 == 1:
			change(t, c, key)
		}
	}
}

// prewriteFixtures are the checkpoints the two-phase copy is checked on:
// every dtype, views, shared storages, a state dict, nested trees, an
// optimizer state, a legacy file.
var prewriteFixtures = []string{"dtypes.pth", "views.pth", "shared.pth", "convbn_zip.pth", "nested.pth", "adam.pth", "dtypes_legacy.pth"}

// TestPrewriteSameBytes: an output written early (Prewrite) and completed
// with the changes made meanwhile (Finish) is byte for byte what Write
// writes of the changed checkpoint, whichever way the records are copied
// (mapped, in groups, one by one), whether the copy gets the negations on
// the way (it waits for them) or finished before (every change filled in
// afterwards, in spans of up to editSpan bytes), and where the changes
// change the layout (written again).
func TestPrewriteSameBytes(t *testing.T) {
	defer func(buf, span, chunk int64) {
		mapCopy, batchCopy, batchBuf, editSpan, holdCopy, holdCopyAt = true, true, buf, span, nil, 0
		chunkCopy, chunkSourceFor, chunkLen = true, chunkAuto, chunk
	}(batchBuf, editSpan, chunkLen)
	var taken, patched, rewound, midway, startedNegated, renegated, dataTaken int
	var chunkTaken, chunkOver, chunkPatched int // the chunked copy's paths
	for _, name := range prewriteFixtures {
		path := filepath.Join("testdata", name)
		want, wantAgain, again, keys := referenceBytes(t, path)
		half := keys / 2
		for _, mode := range []struct {
			name            string
			mapped, batched bool
			buf, span       int64
			chunked         chunkSource // 0: record by record
			chunk           int64
		}{
			{"mapped", true, true, batchBuf, editSpan, 0, 0},
			{"batched", false, true, batchBuf, editSpan, 0, 0},
			{"batched in 1 KiB groups, 100-byte edit spans", false, true, 1 << 10, 100, 0, 0},
			{"one by one", false, false, batchBuf, editSpan, 0, 0},
			{"chunked from a map", true, true, batchBuf, editSpan, chunkFromMap, chunkLen},
			{"chunked from a map in 300-byte chunks", true, true, batchBuf, editSpan, chunkFromMap, 300},
			{"chunked from reads in 300-byte chunks", true, true, batchBuf, 100, chunkFromReads, 300},
		} {
			for _, when := range []string{"copy done first", "negations first", "negations midway", "started after half the changes", "negated again after the start"} {
				early := when == "negations first"
				t.Run(name+"/"+mode.name+"/"+when, func(t *testing.T) {
					mapCopy, batchCopy, batchBuf, editSpan = mode.mapped, mode.batched, mode.buf, mode.span
					chunkCopy, chunkSourceFor = mode.chunked != 0, mode.chunked
					if mode.chunked != 0 {
						chunkLen = mode.chunk
					}
					holdCopy, holdCopyAt = nil, 0
					if early {
						holdCopy = make(chan struct{})
					}
					if when == "negations midway" {
						holdCopyAt = 5
					}
					c, err := Open(path)
					if err != nil {
						t.Fatal(err)
					}
					defer c.Close()
					dir := t.TempDir()
					out := filepath.Join(dir, "out.pth")
					set := output.New(output.Options{})
					defer set.Abort()
					negatedBefore := false
					switch when {
					case "started after half the changes":
						changeSomeOf(t, c, func(i int) bool { return i < half })
						negatedBefore = hasNegations(c)
					case "negated again after the start":
						changeSome(t, c)
					}
					p, err := c.Prewrite(set, out)
					if err != nil {
						t.Fatal(err)
					}
					defer p.Stop()
					want := want
					switch when {
					case "copy done first":
						<-p.done
						changeSome(t, c)
					case "started after half the changes":
						changeSomeOf(t, c, func(i int) bool { return i >= half })
						if p.plan != nil && !p.rewound && negatedRecords(p.plan) == 0 && negatedBefore {
							t.Errorf("the copy's plan has none of the negations made before it started")
						}
					case "negated again after the start":
						if again != negateAgain(t, c) {
							t.Fatal("negateAgain picked another tensor")
						}
						want = wantAgain
					default:
						changeSome(t, c)
					}
					if err := p.Finish(); err != nil {
						t.Fatal(err)
					}
					if err := set.Commit(); err != nil {
						t.Fatal(err)
					}
					got, err := os.ReadFile(out)
					if err != nil {
						t.Fatal(err)
					}
					if when == "negated again after the start" && again != "" && p.plan != nil {
						if !p.rewound {
							t.Errorf("channels of %s negated again after the copy negated them: Finish did not write the file again", again)
						} else if sameLayoutOnly(t, c, p.plan) {
							renegated++ // rewound for the negations alone
						}
					}
					if when == "started after half the changes" && p.plan != nil && !p.rewound && negatedRecords(p.plan) > 0 {
						startedNegated++
					}
					if !bytes.Equal(got, want.Bytes()) {
						t.Fatalf("early write gave %d bytes that differ from Write's %d (rewound %v, %d taken on the way)", len(got), want.Len(), p.rewound, len(p.late.taken))
					}
					switch {
					case p.plan == nil:
						t.Errorf("no early copy")
					case p.rewound:
						rewound++
					case len(p.late.taken) > 0:
						taken++
						if when == "copy done first" {
							t.Errorf("%d records took negations published after the copy ended", len(p.late.taken))
						}
					default:
						patched++
					}
					if mode.chunked != 0 && p.plan != nil && !p.rewound {
						switch {
						case p.late.overwritten > 0:
							chunkOver++
						case len(p.late.taken) > 0:
							chunkTaken++
						default:
							chunkPatched++
						}
					}
					if mode.chunked == 0 && p.late.overwritten > 0 {
						t.Errorf("%d records written over by a copy made record by record", p.late.overwritten)
					}
					if n := len(p.late.takenData); n > 0 && !p.rewound {
						dataTaken++
						if when == "copy done first" {
							t.Errorf("%d records took contents published after the copy ended", n)
						}
					}
					if when == "negations midway" && p.plan != nil && !p.rewound && len(p.late.taken) > 0 {
						if plan, err := c.plan(); err == nil && negatedRecords(plan) > len(p.late.taken) {
							midway++ // some negations taken on the way, some edited after, in one run
						}
					}
				})
			}
		}
	}
	// Each path was taken somewhere, or the test checks less than it says.
	if chunkTaken == 0 || chunkOver == 0 || chunkPatched == 0 {
		t.Errorf("the chunked copy's paths taken: changes taken on the way only %d, records written over %d, filled in afterwards %d: want each", chunkTaken, chunkOver, chunkPatched)
	}
	if taken == 0 || patched == 0 || rewound == 0 || midway == 0 || startedNegated == 0 || renegated == 0 || dataTaken == 0 {
		t.Errorf("paths taken: negations on the way %d, filled in afterwards %d, rewritten %d, both in one run %d, "+
			"negations in the copy's own plan %d, rewritten for negations changed after it %d, "+
			"new contents on the way %d: want each",
			taken, patched, rewound, midway, startedNegated, renegated, dataTaken)
	}
}

// referenceBytes is what Write writes of the checkpoint at path after
// changeSome (want), and after negateAgain too (wantAgain), with the key
// negateAgain picked and the checkpoint's number of keys.
func referenceBytes(t *testing.T, path string) (want, wantAgain bytes.Buffer, again string, keys int) {
	t.Helper()
	ref, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	changeSome(t, ref)
	if _, err := ref.WriteTo(&want); err != nil {
		t.Fatal(err)
	}
	again = negateAgain(t, ref)
	if _, err := ref.WriteTo(&wantAgain); err != nil {
		t.Fatal(err)
	}
	return want, wantAgain, again, len(ref.Keys())
}

// sameLayoutOnly reports whether c's plan now has the layout of the
// copy's plan a, so that only the negations can have made Finish write
// the file again.
func sameLayoutOnly(t *testing.T, c *Checkpoint, a *writePlan) bool {
	t.Helper()
	b, err := c.plan()
	if err != nil {
		t.Fatal(err)
	}
	return sameLayout(a, b)
}

// negateAgain negates channel 0 of the first tensor changeSome negated
// once more (so that it is negated on the others only), returning its key
// ("" when changeSome negated none).
func negateAgain(t *testing.T, c *Checkpoint) string {
	t.Helper()
	for _, key := range c.Keys() {
		if tn, _ := c.Tensor(key); len(tn.negate) > 1 {
			if _, err := c.NegateChannels(key, []int{0}); err != nil {
				t.Fatalf("%s: %v", key, err)
			}
			return key
		}
	}
	return ""
}

// hasNegations reports whether a tensor of c has channels negated as its
// record is written (not decoded and set: those are new contents).
func hasNegations(c *Checkpoint) bool {
	for _, key := range c.Keys() {
		if tn, _ := c.Tensor(key); tn.negate != nil && tn.pending == nil {
			return true
		}
	}
	return false
}

// negatedRecords counts the records the plan copies with negations.
func negatedRecords(p *writePlan) int {
	n := 0
	for _, s := range p.storages {
		if s.negated != nil {
			n++
		}
	}
	return n
}

// TestPrewriteCorruptRecord: a record whose bytes do not match its CRC,
// copied early, fails Finish with the CRC error, and the output set then
// leaves nothing behind; so does a conversion that gives up (Stop) while
// the copy runs.
func TestPrewriteCorruptRecord(t *testing.T) {
	dir := t.TempDir()
	c, _ := openCorrupted(t, dir, "1.running_mean", 2, []byte{0xde, 0xad})
	out := filepath.Join(dir, "out.pth")
	defer func() { mapCopy, chunkCopy, chunkSourceFor = true, true, chunkAuto }()
	for _, chunked := range []chunkSource{0, chunkFromMap, chunkFromReads} {
		for _, mapped := range []bool{true, false} {
			mapCopy, chunkCopy, chunkSourceFor = mapped, chunked != 0, chunked
			set := output.New(output.Options{})
			p, err := c.Prewrite(set, out)
			if err != nil {
				t.Fatal(err)
			}
			err = p.Finish()
			if err == nil || !strings.Contains(err.Error(), "CRC-32") || !strings.Contains(err.Error(), out) {
				t.Errorf("Finish (mapped %v, chunked %v) after copying a corrupt record: %v, want a CRC-32 error naming %s", mapped, chunked, err, out)
			}
			set.Abort()
			assertOnly(t, dir, "in.pth")
		}

		// Left until the signs settle, it is copied by copyPlaced, or
		// chunked at once.
		mapCopy = true
		set := output.New(output.Options{})
		p, err := c.PrewriteLater(set, out, func(string, []int) When { return Settled })
		if err != nil {
			t.Fatal(err)
		}
		p.Settle()
		err = p.Finish()
		if err == nil || !strings.Contains(err.Error(), "CRC-32") || !strings.Contains(err.Error(), out) {
			t.Errorf("Finish (chunked %v) after placing a corrupt record: %v, want a CRC-32 error naming %s", chunked, err, out)
		}
		set.Abort()
		assertOnly(t, dir, "in.pth")
	}
	mapCopy, chunkCopy, chunkSourceFor = true, true, chunkAuto

	good, err := Open(filepath.Join("testdata", "convbn_zip.pth"))
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	set := output.New(output.Options{})
	p, err := good.Prewrite(set, out)
	if err != nil {
		t.Fatal(err)
	}
	p.Stop()
	set.Abort()
	assertOnly(t, dir, "in.pth")
}

// TestPrewriteLaterSameBytes: a copy that leaves some records until the
// negations are settled (PrewriteLater) writes, whichever records it
// leaves and however the records are copied, byte for byte what Write
// writes of the changed checkpoint: where the negations come before Settle
// (the records left take them on the way, the others are written over),
// where Settle never comes (Finish lets the copy go on), where a record
// left and written with the negations Settle handed over is negated again
// afterwards (written over with the difference), and where every change
// comes after Settle. A copy stopped while it waits for Settle ends.
func TestPrewriteLaterSameBytes(t *testing.T) {
	defer func(buf, piece, chunk int64) {
		mapCopy, batchCopy, batchBuf, placedPiece = true, true, buf, piece
		chunkCopy, chunkSourceFor, chunkLen = true, chunkAuto, chunk
	}(batchBuf, placedPiece, chunkLen)
	var takenAtSettle, againAfterTaken, overAtSettle int
	for _, name := range prewriteFixtures {
		path := filepath.Join("testdata", name)
		want, wantAgain, again, _ := referenceBytes(t, path)
		for _, mode := range []struct {
			name            string
			mapped, batched bool
			buf, piece      int64
			chunked         chunkSource // 0: record by record, placed once settled
			chunk           int64
		}{
			{"mapped", true, true, batchBuf, placedPiece, 0, 0},
			{"batched", false, true, batchBuf, placedPiece, 0, 0},
			{"batched in 1 KiB groups, placed in 100-byte pieces", false, true, 1 << 10, 100, 0, 0},
			{"one by one", false, false, batchBuf, placedPiece, 0, 0},
			{"chunked from a map", true, true, batchBuf, placedPiece, chunkFromMap, chunkLen},
			{"chunked from reads in 200-byte chunks", true, true, batchBuf, placedPiece, chunkFromReads, 200},
		} {
			for _, which := range []string{"every other tensor", "every tensor"} {
				when := func(key string, shape []int) When {
					if which == "every tensor" || len(key)%2 == 0 {
						return Settled
					}
					return Now
				}
				for _, how := range []string{"changed, settled", "copied, changed, settled", "changed, never settled", "changed, settled, negated again", "settled, changed", "stopped before settling"} {
					t.Run(name+"/"+mode.name+"/"+which+"/"+how, func(t *testing.T) {
						mapCopy, batchCopy, batchBuf, placedPiece = mode.mapped, mode.batched, mode.buf, mode.piece
						chunkCopy, chunkSourceFor = mode.chunked != 0, mode.chunked
						if mode.chunked != 0 {
							chunkLen = mode.chunk
						}
						c, err := Open(path)
						if err != nil {
							t.Fatal(err)
						}
						defer c.Close()
						dir := t.TempDir()
						out := filepath.Join(dir, "out.pth")
						set := output.New(output.Options{})
						defer set.Abort()
						p, err := c.PrewriteLater(set, out, when)
						if err != nil {
							t.Fatal(err)
						}
						defer p.Stop()
						if p.plan != nil && len(p.late.when) == 0 && mode.chunked == 0 {
							t.Fatal("no record left until Settle")
						}
						if mode.chunked != 0 && len(p.late.when) != 0 {
							t.Fatal("records left until Settle by the chunked copy, which writes them at once")
						}
						want := want
						switch how {
						case "changed, settled":
							changeSome(t, c)
							p.Settle()
							<-p.done
							for st := range p.late.taken {
								if p.late.when[st] == Settled {
									takenAtSettle++
									break
								}
							}

						case "copied, changed, settled":
							if mode.chunked != 0 && p.plan != nil {
								select { // every record written as it was
								case <-p.late.allWritten:
								case <-p.done:
								}
							}
							changeSome(t, c)
							p.Settle()
							<-p.done
							if mode.chunked != 0 && p.late.overwritten > 0 {
								overAtSettle++ // and written over once the signs settled
							}
						case "changed, never settled":
							changeSome(t, c)
						case "changed, settled, negated again":
							changeSome(t, c)
							p.Settle()
							<-p.done // every record left took the negations Settle handed over
							key := negateAgain(t, c)
							if key != again {
								t.Fatalf("negateAgain picked %q, not %q", key, again)
							}
							if tn, _ := c.Tensor(key); key != "" && p.late.took(tn.Storage) != nil {
								againAfterTaken++
							}
							want = wantAgain
						case "settled, changed":
							p.Settle()
							changeSome(t, c)
						case "stopped before settling":
							changeSome(t, c)
							p.Stop()
							set.Abort()
							if entries, _ := os.ReadDir(dir); len(entries) != 0 {
								t.Errorf("a stopped copy left %d files behind", len(entries))
							}
							return
						}
						if err := p.Finish(); err != nil {
							t.Fatal(err)
						}
						if err := set.Commit(); err != nil {
							t.Fatal(err)
						}
						got, err := os.ReadFile(out)
						if err != nil {
							t.Fatal(err)
						}
						if !bytes.Equal(got, want.Bytes()) {
							t.Fatalf("the copy in two phases gave %d bytes that differ from Write's %d (rewound %v, %d taken on the way)", len(got), want.Len(), p.rewound, len(p.late.taken))
						}
					})
				}
			}
		}
	}
	// Each path was taken somewhere, or the test checks less than it says.
	if takenAtSettle == 0 || againAfterTaken == 0 || overAtSettle == 0 {
		t.Errorf("records left that took the negations at Settle: %d runs; negated again after that: %d runs; chunked and written over at Settle: %d runs; want each", takenAtSettle, againAfterTaken, overAtSettle)
	}
}

// TestPrewriteLaterFault: a disk that fills up anywhere in a copy in two
// phases, before the records left until Settle or among them, fails
// Finish with the cause, naming the output, and the output set then
// leaves nothing behind; a fault past the file's end changes nothing.
func TestPrewriteLaterFault(t *testing.T) {
	path := filepath.Join("testdata", "convbn_zip.pth")
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	when := func(key string, shape []int) When {
		if len(shape) >= 2 {
			return Settled
		}
		return Now
	}
	failed := 0
	for _, mapped := range []bool{true, false} {
		for _, after := range []int64{0, 100, 1 << 10, st.Size() / 4, st.Size() / 2, 3 * st.Size() / 4, st.Size() - 200, 4 * st.Size()} {
			t.Run(fmt.Sprintf("mapped %v/after %d bytes", mapped, after), func(t *testing.T) {
				defer func() { mapCopy = true }()
				mapCopy = mapped
				defer output.InjectFault("out.pth", after, syscall.ENOSPC)()
				c, err := Open(path)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				dir := t.TempDir()
				out := filepath.Join(dir, "out.pth")
				set := output.New(output.Options{})
				p, err := c.PrewriteLater(set, out, when)
				if err != nil {
					t.Fatal(err)
				}
				changeSome(t, c)
				p.Settle()
				err = p.Finish()
				if err == nil {
					err = set.Commit()
				}
				p.Stop()
				set.Abort()
				switch {
				case after >= st.Size()*2:
					if err != nil {
						t.Fatalf("a fault past the end failed the write: %v", err)
					}
					assertOnly(t, dir, "out.pth")
				case err == nil || !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), out):
					t.Fatalf("Finish after the disk filled at byte %d: %v, want ENOSPC naming %s", after, err, out)
				default:
					failed++
					assertOnly(t, dir)
				}
			})
		}
	}
	if failed == 0 {
		t.Error("no write failed")
	}
}

// TestSettleHandsOver: Settle hands the copy the tensors negated in place
// since the checkpoint was opened, with their channels as they are then
// (negated twice: not at all), and not those rewritten since or negated
// before the copy started (its own plan has them).
func TestSettleHandsOver(t *testing.T) {
	c := openFixture(t, "convbn_zip")
	var four []string // tensors of 4 output channels negated in place
	for _, key := range c.Keys() {
		if tn, _ := c.Tensor(key); len(tn.Shape) == 4 && isFloat(tn.DType()) && c.lazyNegatable(tn) {
			four = append(four, key)
		}
	}
	if len(four) < 1 {
		t.Fatalf("fixture has no convolution weight to negate in place")
	}
	before, key := four[0], four[0]
	if _, err := c.NegateChannels(before, []int{0}); err != nil { // in the copy's plan
		t.Fatal(err)
	}
	set := output.New(output.Options{})
	defer set.Abort()
	p, err := c.PrewriteLater(set, filepath.Join(t.TempDir(), "out.pth"), func(string, []int) When { return Settled })
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	var rewritten, twice string
	for _, k := range c.Keys() {
		tn, _ := c.Tensor(k)
		switch {
		case k == before || len(tn.Shape) == 0 || !isFloat(tn.DType()) || !c.lazyNegatable(tn):
		case rewritten == "":
			rewritten = k
			if _, err := c.NegateChannels(k, []int{0}); err != nil {
				t.Fatal(err)
			}
			change(t, c, k) // rewritten whole since
		case twice == "":
			twice = k
			for range 2 {
				if _, err := c.NegateChannels(k, []int{0}); err != nil {
					t.Fatal(err)
				}
			}
		case key == before:
			key = k
		}
	}
	if key == before || rewritten == "" || twice == "" {
		t.Fatalf("fixture has too few float tensors (negated %q, rewritten %q, twice %q)", key, rewritten, twice)
	}
	if _, err := c.NegateChannels(key, []int{1, 0}); err != nil {
		t.Fatal(err)
	}
	p.Settle()
	fl := p.late.flips.Load()
	if fl == nil {
		t.Fatal("Settle handed over nothing")
	}
	got := map[string][]int{}
	for st, tn := range *fl {
		got[st.Key] = tn.negate
	}
	kt, _ := c.Tensor(key)
	want := map[string][]int{kt.Storage.Key: {0, 1}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Settle handed over %v (storage keys: channels), want %v (%s negated in place; %s rewritten since, %s negated twice, %s before the copy)", got, want, key, rewritten, twice, before)
	}
	if err := p.Finish(); err != nil {
		t.Fatal(err)
	}
}
