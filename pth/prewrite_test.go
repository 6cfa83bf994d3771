package pth

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
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
	for i, key := range c.Keys() {
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

// TestPrewriteSameBytes: an output written early (Prewrite) and completed
// with the changes made meanwhile (Finish) is byte for byte what Write
// writes of the changed checkpoint, whichever way the records are copied
// (mapped, in groups, one by one), whether the copy gets the negations on
// the way (it waits for them) or finished before (every change filled in
// afterwards, in spans of up to editSpan bytes), and where the changes
// change the layout (written again).
func TestPrewriteSameBytes(t *testing.T) {
	files := []string{"dtypes.pth", "views.pth", "shared.pth", "convbn_zip.pth", "nested.pth", "adam.pth", "dtypes_legacy.pth"}
	defer func(buf, span int64, share float64) {
		mapCopy, batchCopy, batchBuf, editSpan, holdCopy, holdCopyAt, prewriteShare = true, true, buf, span, nil, 0, share
	}(batchBuf, editSpan, prewriteShare)
	prewriteShare = 0 // early in every mode
	var taken, patched, rewound, midway int
	for _, name := range files {
		path := filepath.Join("testdata", name)
		ref, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		changeSome(t, ref)
		var want bytes.Buffer
		if _, err := ref.WriteTo(&want); err != nil {
			t.Fatal(err)
		}
		ref.Close()
		for _, mode := range []struct {
			name            string
			mapped, batched bool
			buf, span       int64
		}{
			{"mapped", true, true, batchBuf, editSpan},
			{"batched", false, true, batchBuf, editSpan},
			{"batched in 1 KiB groups, 100-byte edit spans", false, true, 1 << 10, 100},
			{"one by one", false, false, batchBuf, editSpan},
		} {
			for _, when := range []string{"copy done first", "negations first", "negations midway"} {
				early := when == "negations first"
				t.Run(name+"/"+mode.name+"/"+when, func(t *testing.T) {
					mapCopy, batchCopy, batchBuf, editSpan = mode.mapped, mode.batched, mode.buf, mode.span
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
					p, err := c.Prewrite(set, out)
					if err != nil {
						t.Fatal(err)
					}
					defer p.Stop()
					if when == "copy done first" {
						<-p.done
					}
					changeSome(t, c)
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
					if when == "negations midway" && p.plan != nil && !p.rewound && p.editedMidway > 0 {
						midway++
					}
				})
			}
		}
	}
	// Each path was taken somewhere, or the test checks less than it says.
	if taken == 0 || patched == 0 || rewound == 0 || midway == 0 {
		t.Errorf("paths taken: negations on the way %d, filled in afterwards %d, rewritten %d, edits while the copy went on %d: want each", taken, patched, rewound, midway)
	}
}

// TestPrewriteCorruptRecord: a record whose bytes do not match its CRC,
// copied early, fails Finish with the CRC error, and the output set then
// leaves nothing behind; so does a conversion that gives up (Stop) while
// the copy runs.
func TestPrewriteCorruptRecord(t *testing.T) {
	dir := t.TempDir()
	c, _ := openCorrupted(t, dir, "1.running_mean", 2, []byte{0xde, 0xad})
	out := filepath.Join(dir, "out.pth")
	for _, mapped := range []bool{true, false} {
		mapCopy = mapped
		set := output.New(output.Options{})
		p, err := c.Prewrite(set, out)
		if err != nil {
			t.Fatal(err)
		}
		err = p.Finish()
		if err == nil || !strings.Contains(err.Error(), "CRC-32") || !strings.Contains(err.Error(), out) {
			t.Errorf("Finish (mapped %v) after copying a corrupt record: %v, want a CRC-32 error naming %s", mapped, err, out)
		}
		set.Abort()
		assertOnly(t, dir, "in.pth")
	}
	mapCopy = true

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

// TestWorthPrewriting: the early copy is chosen by the share of bytes in
// mapped records: all of a fixture's when every record is mapped (the
// tests' mapMin), none when records under 1 MiB are not (the default).
func TestWorthPrewriting(t *testing.T) {
	c := openFixture(t, "convbn_zip")
	defer func(m int64) { mapMin = m }(mapMin)
	for _, tc := range []struct {
		mapMin int64
		want   bool
	}{{1, true}, {1 << 20, false}} {
		mapMin = tc.mapMin
		if got := c.worthPrewriting(); got != tc.want {
			t.Errorf("mapMin %d: worthPrewriting = %v, want %v", tc.mapMin, got, tc.want)
		}
	}
}
