package pth

import (
	"bytes"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestBatcherOutOfOrder: the batcher reads several groups at once, and
// their reads end in any order; the groups are still written in the
// plan's order, a corrupt record's error still stops the copy, and no
// reader is left running once the write has returned.
func TestBatcherOutOfOrder(t *testing.T) {
	defer func(buf int64) { mapCopy, batchCopy, batchBuf, batchReadHook = true, true, buf, nil }(batchBuf)
	// Groups of 128 bytes: a group or two per record of adam.pth (its
	// 42 records are 4-432 bytes, 64-byte aligned).
	mapCopy, batchCopy, batchBuf = false, true, 128

	src := filepath.Join("testdata", "adam.pth")
	write := func(path string) ([]byte, error) {
		c, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		var b bytes.Buffer
		_, err = c.WriteTo(&b)
		return b.Bytes(), err
	}
	// delayOdd makes each odd group's reader wait, so that the even group
	// after it, read meanwhile, ends first; it records the order in which
	// the readers went on, and fails the test if one goes on after the
	// write returned.
	var (
		mu       sync.Mutex
		order    []int
		returned atomic.Bool
	)
	delayOdd := func(n int) {
		if n%2 == 1 {
			time.Sleep(20 * time.Millisecond)
		}
		if returned.Load() {
			t.Errorf("group %d's reader ran after the write returned", n)
		}
		mu.Lock()
		order = append(order, n)
		mu.Unlock()
	}
	inversions := func() int {
		mu.Lock()
		defer mu.Unlock()
		k := 0
		for i := 1; i < len(order); i++ {
			if order[i] < order[i-1] {
				k++
			}
		}
		return k
	}

	want, err := write(src)
	if err != nil {
		t.Fatal(err)
	}
	batchReadHook = delayOdd
	got, err := write(src)
	returned.Store(true)
	if err != nil {
		t.Fatal(err)
	}
	if len(order) < 6 {
		t.Fatalf("%d groups read: the test needs several", len(order))
	}
	if inversions() == 0 {
		t.Fatalf("groups read in order %v: no read ended before an earlier one, the test checks nothing", order)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("groups read out of order (%v) wrote %d bytes that differ from the %d written in order", order, len(got), len(want))
	}

	// A record of the middle group, corrupted: its CRC error ends the
	// write although the groups after it were read first.
	c, err := Open(src)
	if err != nil {
		t.Fatal(err)
	}
	var recs []record
	for _, st := range c.storages {
		if c.batchable(st) {
			recs = append(recs, st.rec)
		}
	}
	c.Close()
	if len(recs) < 3 {
		t.Fatalf("%d batched records", len(recs))
	}
	bad := recs[len(recs)/2]
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	data[bad.offset] ^= 0x80
	path := filepath.Join(t.TempDir(), "bad.pth")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	order = nil
	mu.Unlock()
	returned.Store(false)
	_, err = write(path)
	returned.Store(true)
	if err == nil || !strings.Contains(err.Error(), "corrupt") || !strings.Contains(err.Error(), bad.name) {
		t.Fatalf("writing with %s corrupt: %v, want a CRC error naming it", bad.name, err)
	}
	// Readers the write stopped early must not run afterwards either.
	time.Sleep(50 * time.Millisecond)
}

// TestBatchGroupsFit: whatever the records' order in the file, every
// group splitBatch makes fits a buffer of its size in readBatch, which
// starts each of the group's reads on a copyAlign boundary, and readBatch
// hands back each record's bytes, aligned where a read starts. Records
// out of the file's order (a checkpoint whose keys are not in its
// records' order) each need a read of their own; so do records far apart.
func TestBatchGroupsFit(t *testing.T) {
	// The file: records of 1 to 200 bytes at offsets chosen below, each
	// filled with its own index.
	sizes := []int64{1, 7, 64, 65, 100, 3, 200, 129, 63, 31, 2, 190, 64, 17, 5, 127}
	tests := []struct {
		name string
		gap  func(i int) int64 // bytes before record i
		perm func(n int) []int // the plan's order of the records
	}{
		{"in order, close", func(int) int64 { return 30 }, inOrder},
		{"in order, far apart", func(int) int64 { return batchGap + 1 }, inOrder},
		{"reversed", func(int) int64 { return 30 }, inReverse},
		{"interleaved", func(i int) int64 { return int64(i%3) * batchGap }, func(n int) []int {
			p := []int{}
			for i := 0; i < n; i += 2 {
				p = append(p, i)
			}
			for i := 1; i < n; i += 2 {
				p = append(p, i)
			}
			return p
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var file []byte
			recs := make([]*Storage, len(sizes))
			for i, n := range sizes {
				file = append(file, make([]byte, tc.gap(i))...)
				rec := bytes.Repeat([]byte{byte(i + 1)}, int(n))
				recs[i] = &Storage{rec: record{name: "r" + string(rune('a'+i)), offset: int64(len(file)), size: n, crc: crc32.ChecksumIEEE(rec), hasCRC: true}}
				file = append(file, rec...)
			}
			path := filepath.Join(t.TempDir(), "in")
			if err := os.WriteFile(path, file, 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			c := &Checkpoint{Path: path, f: f}
			var run []batchRecord
			for _, i := range tc.perm(len(sizes)) {
				run = append(run, batchRecord{name: recs[i].rec.name, st: recs[i]})
			}
			// Every budget from the largest record up: each makes groups
			// filled differently, some to the byte.
			for max := int64(200); max <= 1200; max += 7 {
				groups := splitBatch(run, max)
				n := 0
				for _, g := range groups {
					buf := make([]byte, max)
					data, _, err := c.readBatch(g, buf, nil)
					if err != nil {
						t.Fatalf("budget %d: %v", max, err)
					}
					for k, r := range g {
						want := bytes.Repeat([]byte{byte(slices.Index(recs, r.st) + 1)}, int(r.st.rec.size))
						if !bytes.Equal(data[k], want) {
							t.Fatalf("budget %d: %s read wrong", max, r.name)
						}
						// Where a read starts, its offset in the buffer
						// (what is left of the buffer's capacity says).
						if k == 0 || !readTogether(g[k-1].st.rec, r.st.rec) {
							if at := cap(buf) - cap(data[k]); at%copyAlign != 0 {
								t.Errorf("budget %d: %s read to offset %d of its buffer", max, r.name, at)
							}
						}
					}
					n += len(g)
				}
				if n != len(run) {
					t.Fatalf("budget %d: the groups hold %d records of %d", max, n, len(run))
				}
			}
		})
	}
}

// readTogether reports whether readBatch reads b in the same read as a,
// the record before it in the group.
func readTogether(a, b record) bool {
	gap := b.offset - (a.offset + a.size)
	return gap >= 0 && gap <= batchGap
}

func inOrder(n int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = i
	}
	return p
}

func inReverse(n int) []int {
	p := inOrder(n)
	slices.Reverse(p)
	return p
}
