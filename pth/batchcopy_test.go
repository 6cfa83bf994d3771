package pth

import (
	"bytes"
	"os"
	"path/filepath"
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
