package pth

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/output"
)

// setChunked sets the chunked copy's switches for one test, restored
// when it ends.
func setChunked(t *testing.T, on bool, from chunkSource, length int64) {
	t.Helper()
	oldOn, oldFrom, oldLen, oldSlow := chunkCopy, chunkSourceFor, chunkLen, chunkMapSlow
	t.Cleanup(func() {
		chunkCopy, chunkSourceFor, chunkLen, chunkMapSlow, chunkedFrom = oldOn, oldFrom, oldLen, oldSlow, nil
	})
	chunkCopy, chunkSourceFor, chunkLen = on, from, length
}

// TestChunkedSameBytes: the chunked copy writes byte for byte what the
// record by record copy writes (WriteTo, into memory), from a map or from
// reads, in chunks of any length, of every fixture as it is and with
// changes made before the write (negated channels, new contents, records
// of their own); and it is the copy a Write into a file takes.
func TestChunkedSameBytes(t *testing.T) {
	for _, name := range prewriteFixtures {
		for _, changed := range []bool{false, true} {
			for _, from := range []chunkSource{chunkFromMap, chunkFromReads} {
				for _, length := range []int64{1 << 20, 4096, 333, 64} {
					t.Run(fmt.Sprintf("%s/changed=%v/map=%v/%d", name, changed, from == chunkFromMap, length), func(t *testing.T) {
						setChunked(t, true, from, length)
						var took []bool
						chunkedFrom = func(mapped bool) { took = append(took, mapped) }
						c := openFixture(t, strings.TrimSuffix(name, ".pth"))
						if changed {
							changeSome(t, c)
						}
						var want bytes.Buffer
						if _, err := c.WriteTo(&want); err != nil {
							t.Fatal(err)
						}
						if len(took) != 0 {
							t.Fatalf("WriteTo into memory took the chunked copy")
						}
						out := filepath.Join(t.TempDir(), "out.pth")
						if err := c.Write(out, WriteOptions{}); err != nil {
							t.Fatal(err)
						}
						if len(took) != 1 || took[0] != (from == chunkFromMap) {
							t.Fatalf("Write's copies: %v, want one chunked from a map %v", took, from == chunkFromMap)
						}
						got, err := os.ReadFile(out)
						if err != nil {
							t.Fatal(err)
						}
						if !bytes.Equal(got, want.Bytes()) {
							t.Fatalf("chunked copy wrote %d bytes that differ from the record by record copy's %d", len(got), want.Len())
						}
					})
				}
			}
		}
	}
}

// vecRecorder is an output.File whose vectored positioned writes are
// noted.
type vecRecorder struct {
	*output.File
	writes [][2]int64 // offset, length
}

func (v *vecRecorder) WriteVecAt(bufs [][]byte, off int64) (int, error) {
	n, err := v.File.WriteVecAt(bufs, off)
	v.writes = append(v.writes, [2]int64{off, int64(n)})
	return n, err
}

// TestChunkedAligned: the chunked copy writes the records in ranges that
// start and end on multiples of chunkLen, one after the other, but for
// the first's start and the last's end.
func TestChunkedAligned(t *testing.T) {
	setChunked(t, true, chunkFromMap, 256)
	c := openFixture(t, "dtypes")
	set := output.New(output.Options{})
	defer set.Abort()
	f, err := set.Create(filepath.Join(t.TempDir(), "out.pth"))
	if err != nil {
		t.Fatal(err)
	}
	rec := &vecRecorder{File: f}
	z := newZipWriter(rec)
	plan, err := c.plan()
	if err != nil {
		t.Fatal(err)
	}
	pkl, err := newPickler(plan).dump(c.Root)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.writeBody(z, plan, pkl, nil, nil); err != nil {
		t.Fatal(err)
	}
	if len(rec.writes) < 3 {
		t.Fatalf("%d vectored writes; want the records in several 256-byte chunks", len(rec.writes))
	}
	for i, w := range rec.writes {
		if i > 0 && w[0] != rec.writes[i-1][0]+rec.writes[i-1][1] {
			t.Errorf("write %d at %d, not where write %d ended (%d)", i, w[0], i-1, rec.writes[i-1][0]+rec.writes[i-1][1])
		}
		if i > 0 && w[0]%chunkLen != 0 {
			t.Errorf("write %d starts at %d, not a multiple of %d", i, w[0], chunkLen)
		}
		if i < len(rec.writes)-1 && (w[0]+w[1])%chunkLen != 0 {
			t.Errorf("write %d ends at %d, not a multiple of %d", i, w[0]+w[1], chunkLen)
		}
	}
}

// TestChunkedChoosesReads: where populating the input's map takes longer
// than chunkMapSlow, the chunked copy reads the file instead, and writes
// the same bytes.
func TestChunkedChoosesReads(t *testing.T) {
	for _, slow := range []bool{false, true} {
		setChunked(t, true, chunkAuto, 1<<20)
		if slow {
			chunkMapSlow = -1 // anything is slower
		} else {
			chunkMapSlow = 1 << 40
		}
		var took []bool
		chunkedFrom = func(mapped bool) { took = append(took, mapped) }
		c := openFixture(t, "convbn_zip")
		changeSome(t, c)
		var want bytes.Buffer
		if _, err := c.WriteTo(&want); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(t.TempDir(), "out.pth")
		if err := c.Write(out, WriteOptions{}); err != nil {
			t.Fatal(err)
		}
		if len(took) != 1 || took[0] == slow {
			t.Errorf("maps slow %v: copies %v, want one from a map %v", slow, took, !slow)
		}
		if got, err := os.ReadFile(out); err != nil || !bytes.Equal(got, want.Bytes()) {
			t.Errorf("maps slow %v: the chunked copy wrote other bytes (%v)", slow, err)
		}
	}
}

// TestChunkedBadInput: a record that no longer matches its CRC, or a file
// cut short after it was opened, fails the chunked copy with an error
// naming the input and the record, whichever the source; nothing is left
// behind and the input is unchanged.
func TestChunkedBadInput(t *testing.T) {
	for _, from := range []chunkSource{chunkFromMap, chunkFromReads} {
		t.Run(fmt.Sprintf("map=%v", from == chunkFromMap), func(t *testing.T) {
			setChunked(t, true, from, 512)
			dir := t.TempDir()
			c, in := openCorrupted(t, dir, "1.running_mean", 2, []byte{0xde, 0xad})
			before, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(dir, "out.pth")
			err = c.Write(out, WriteOptions{})
			if err == nil || !strings.Contains(err.Error(), "is corrupt") || !strings.Contains(err.Error(), in) || !strings.Contains(err.Error(), "running_mean") && !strings.Contains(err.Error(), "data/") {
				t.Errorf("Write of a corrupt record: %v, want an error naming %s and the record", err, in)
			}
			assertOnly(t, dir, "in.pth")
			if after, _ := os.ReadFile(in); !bytes.Equal(before, after) {
				t.Errorf("the input changed")
			}

			// Cut short once the copy has checked its size and mapped
			// it (or chosen to read it): reading it faults, or ends
			// early.
			if err := os.WriteFile(in, before, 0o644); err != nil {
				t.Fatal(err)
			}
			c2, err := Open(in)
			if err != nil {
				t.Fatal(err)
			}
			defer c2.Close()
			var ws WriteOptions
			chunkedFrom = func(bool) {
				if err := os.Truncate(in, 0); err != nil {
					t.Error(err)
				}
			}
			err = c2.Write(out, ws)
			chunkedFrom = nil
			if err == nil || !strings.Contains(err.Error(), in) {
				t.Errorf("Write of a file cut short while copied: %v, want an error naming %s", err, in)
			} else if from == chunkFromMap && !strings.Contains(err.Error(), "changed or ended while it was read") {
				t.Errorf("Write of a mapped file cut short while copied: %v, want the fault reported as such", err)
			}
			assertOnly(t, dir, "in.pth")

			// Cut short after it was opened, before the copy.
			if err := os.Truncate(in, int64(len(before))/2); err != nil {
				t.Fatal(err)
			}
			err = c.Write(out, WriteOptions{})
			if err == nil || !strings.Contains(err.Error(), in) || !strings.Contains(err.Error(), "past the end") {
				t.Errorf("Write of a file cut short: %v, want an error naming %s", err, in)
			}
			assertOnly(t, dir, "in.pth")
		})
	}
}
