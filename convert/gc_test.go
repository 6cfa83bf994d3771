package convert

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"testing"
	"time"
)

// gcPercent reads the collector's setting without changing it. Why not
// debug.SetGCPercent(-1) and back: that read writes, and a deferral's
// finalizer restoring the setting between the two calls was undone by the
// second (CI saw GC percent stay -1 after a collection, 2026-12-04).
func gcPercent() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(int64(s[0].Value.Uint64())) // -1 (off) is stored as its bits
}

// endsWithin polls until the deferral has ended (its finalizer runs on a
// goroutine of its own, after the collection).
func endsWithin(t *testing.T, want int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); gcPercent() != want; {
		if time.Now().After(deadline) {
			t.Fatalf("GC percent %d after a collection, want the deferral ended (%d)", gcPercent(), want)
		}
		runtime.Gosched()
		time.Sleep(time.Millisecond)
	}
}

func TestCollectLate(t *testing.T) {
	orig := gcPercent()
	origLimit := debug.SetMemoryLimit(-1)
	if orig < 0 {
		t.Fatalf("GC off before the test (%d)", orig)
	}
	tests := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"off until restored", func(t *testing.T) {
			restore := collectLate()
			if p := gcPercent(); p != -1 {
				t.Errorf("GC percent %d while deferred, want -1 (off)", p)
			}
			if l := debug.SetMemoryLimit(-1); l != lateGCHeap {
				t.Errorf("memory limit %d while deferred, want %d", l, lateGCHeap)
			}
			restore()
			restore() // twice is once
			if p := gcPercent(); p != orig {
				t.Errorf("GC percent %d after restore, want %d", p, orig)
			}
		}},
		{"nested: the last restore ends it", func(t *testing.T) {
			r1, r2 := collectLate(), collectLate()
			r1()
			if p := gcPercent(); p != -1 {
				t.Errorf("GC percent %d with one deferral left, want -1", p)
			}
			r2()
			if p := gcPercent(); p != orig {
				t.Errorf("GC percent %d after both restores, want %d", p, orig)
			}
		}},
		{"a collection ends it", func(t *testing.T) {
			restore := collectLate()
			defer restore()
			runtime.GC()
			endsWithin(t, orig)
			if l := debug.SetMemoryLimit(-1); l != origLimit {
				t.Errorf("memory limit %d after the first collection, want %d back", l, origLimit)
			}
		}},
		{"the heap limit starts a collection", func(t *testing.T) {
			defer func(h int64) { lateGCHeap = h }(lateGCHeap)
			lateGCHeap = 16 << 20
			var before runtime.MemStats
			runtime.ReadMemStats(&before)
			restore := collectLate()
			defer restore()
			var keep [][]byte
			for i := 0; i < 64; i++ { // 64 MiB, a quarter kept
				b := make([]byte, 1<<20)
				if i%4 == 0 {
					keep = append(keep, b)
				}
			}
			endsWithin(t, orig)
			var after runtime.MemStats
			runtime.ReadMemStats(&after)
			if after.NumGC == before.NumGC {
				t.Errorf("no collection while 64 MiB were allocated under a 16 MiB limit")
			}
			runtime.KeepAlive(keep)
		}},
		{"left deferred for a process that ends", func(t *testing.T) {
			defer func() { lateGC.Lock(); lateGC.leave, lateGC.huge = false, false; lateGC.Unlock() }()
			ProcessEndsAfterRun()
			if lateGC.huge {
				t.Fatalf("heap readied for huge pages before any conversion")
			}
			collectLate()()
			if !lateGC.huge {
				t.Errorf("the first conversion of a process that ends did not ready its heap (hugeHeap)")
			}
			if p := gcPercent(); p != -1 {
				t.Fatalf("GC percent %d after restore in a process that ends, want -1 (still deferred)", p)
			}
			// A second conversion neither saves the deferred settings as
			// the ones to restore nor ends the deferral.
			collectLate()()
			if p := gcPercent(); p != -1 {
				t.Fatalf("GC percent %d after a second conversion, want -1", p)
			}
			// The first collection still ends it, with the settings found
			// before the first conversion.
			runtime.GC()
			endsWithin(t, orig)
			if l := debug.SetMemoryLimit(-1); l != origLimit {
				t.Errorf("memory limit %d after the first collection, want %d back", l, origLimit)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, tt.run)
		if p := gcPercent(); p != orig {
			t.Fatalf("%s: GC percent %d after it, want %d", tt.name, p, orig)
		}
	}
}
