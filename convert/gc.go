package convert

import (
	"runtime"
	"runtime/debug"
	"sync"
)

// collectLate turns the garbage collector off until the heap reaches
// lateGCHeap, and for good after the first collection, whichever comes
// first; restore (deferred by the caller) hands back the settings it found.
//
// Why: a conversion is one short process whose heap only grows. Streaming
// the tensors (package pth), it allocates what the structure needs: about
// 22 MB in all on densenet201 (1,200 records), most of it live to the end.
// At the default pacing the collector still runs several cycles on the
// way, on the core the early copy needs, each marking the same live graph
// again: on densenet201 trained that was 8 ms of a 73 ms conversion
// (median of 11 runs alternated with the build before, 2026-12-02), about
// the cost of the copy of a third of the file. Nothing is gained by
// collecting a heap that small before the process ends.
//
// The limit bounds the peak all the same: where a checkpoint's structure
// (or an ONNX model held in memory) needs more, the collector runs as the
// heap reaches lateGCHeap, and that collection ends the deferral (its
// finalizer restores the default pacing), so a live heap above the limit
// never makes it collect continually.
func collectLate() (restore func()) {
	lateGC.Lock()
	defer lateGC.Unlock()
	// Conversions may run side by side (the tests): the first one in
	// saves the settings, the last one out restores them. One that a
	// process left deferred (ProcessEndsAfterRun) is still in force: its
	// saved settings and pending finalizer stay.
	if lateGC.depth++; lateGC.depth == 1 && !lateGC.on {
		if lateGC.leave && !lateGC.huge {
			hugeHeap(hugeHeapBytes) // heap_thp.go
			lateGC.huge = true
		}
		lateGC.pct = debug.SetGCPercent(-1)
		lateGC.limit = debug.SetMemoryLimit(lateGCHeap)
		lateGC.on = true
		// Unreachable at once: the first collection, whatever starts
		// it, queues the finalizer. (A pointer keeps the sentinel out
		// of the tiny allocator, whose blocks are finalized together.)
		runtime.SetFinalizer(&gcSentinel{}, func(*gcSentinel) { endLateGC() })
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			lateGC.Lock()
			defer lateGC.Unlock()
			if lateGC.depth--; lateGC.depth == 0 && !lateGC.leave {
				lateGC.endLocked()
			}
		})
	}
}

var lateGC lateGCState

type lateGCState struct {
	sync.Mutex
	depth int   // collectLate calls not yet restored
	on    bool  // the collector is off
	leave bool  // ProcessEndsAfterRun: restore leaves it off
	huge  bool  // hugeHeap has run (once a process, if leave)
	pct   int   // the settings found,
	limit int64 // restored when it ends
}

func endLateGC() {
	lateGC.Lock()
	defer lateGC.Unlock()
	lateGC.endLocked()
}

func (s *lateGCState) endLocked() {
	if s.on {
		debug.SetMemoryLimit(s.limit)
		debug.SetGCPercent(s.pct)
		s.on = false
	}
}

type gcSentinel struct{ _ *byte }

// ProcessEndsAfterRun tells the package that the process ends once its
// conversion is reported (the command line): the collector then stays
// deferred after Run returns, until the heap reaches lateGCHeap (the
// first collection ends the deferral, as during Run). Ending it at
// return made the next allocation, printing the report, start a
// collection of the whole heap just before exit: 3 ms wall and more CPU
// on densenet201 (a VM measured 2026-12-02). A process that goes on
// (convert --verify) keeps the same bound on its heap.
//
// The first conversion of such a process also readies the heap it fills
// for huge pages (hugeHeap); help, inspect and the like, which allocate
// little, do not pay the collection that takes (about 3 ms).
func ProcessEndsAfterRun() {
	lateGC.Lock()
	defer lateGC.Unlock()
	lateGC.leave = true
}

// hugeHeapBytes is the block advised for huge pages (hugeHeap):
// what the largest bench conversions allocate (densenet201 about 30 MB,
// 40 MB of huge pages took its page faults from 8,100 to 1,100 where 32
// left 1,400), under lateGCHeap.
const hugeHeapBytes = 40 << 20

// lateGCHeap is the heap at which collectLate's collector runs: under the
// 64 MB of resident memory a conversion is held to (bench/convert.sh),
// with the binary, the stacks and the copy's mapped windows beside it; a
// variable for the tests.
var lateGCHeap int64 = 48 << 20
