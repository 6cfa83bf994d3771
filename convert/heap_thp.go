//go:build linux && (amd64 || arm64)

package convert

import (
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"unsafe"
)

// hugeHeap asks the kernel to back the heap a conversion is about to
// fill with transparent huge pages (madvise MADV_HUGEPAGE), where the
// system leaves them to the program ("madvise" in
// /sys/kernel/mm/transparent_hugepage/enabled, the default of Debian and
// most distributions); it returns the range advised (0, 0: none).
//
// Why: with the collector deferred (collectLate) every page a conversion
// allocates is a fresh one, and each first touch is a page fault. On this
// project's paravirtualised VM a fault costs 11-15 µs (a page-table change
// is a call to the hypervisor): a trained resnext101_32x8d took 6,600
// faults, about 80 ms of CPU in a 180 ms conversion, more than its
// conversion work. A huge page is one fault for 512 pages.
//
// Go does not advise its heap (it stopped in Go 1.21.1), and it maps the
// heap 4 MB at a time with mmap(MAP_FIXED), which drops any advice given
// before. So one block of n bytes is allocated (the runtime maps it in one
// piece and, fresh from the kernel, does not touch it), the heap arena it
// lies in is advised from its start to the end of the block's last huge
// page (64 MB arenas on 64-bit Linux: the runtime's first pages and the
// block; a range that ended inside a huge page would leave that page, the
// first the conversion allocates from after the block, to small pages),
// and the block is freed with a collection while the heap is still tiny;
// the conversion's allocations then fill it, lowest addresses first. n is
// kept under the collector's memory limit (lateGCHeap), which counts the
// free pages too.
//
// Before the collection, the huge pages below the block, the runtime's
// first pages, are collapsed into huge pages (madvise MADV_COLLAPSE,
// Linux 6.1): the process touched some of them before the advice, so a
// page table of small pages maps them, and the runtime allocates from
// there first. On densenet201 trained (2026-12-06) the conversion's
// faults in its heap went from about 480 to 245, and its median time by
// 1.2 ms (30 rounds alternated). Elsewhere the call fails at once (EINVAL
// on the arena's reserved, inaccessible pages, or a kernel without it),
// and nothing is lost.
//
// GODEBUG=disablethp=1, Go's own switch against huge pages for the heap,
// leaves it alone.
func hugeHeap(n int) (lo, hi uintptr) {
	if strings.Contains(os.Getenv("GODEBUG"), "disablethp=1") {
		return 0, 0
	}
	pct := debug.SetGCPercent(-1) // no collection while the block is live
	b := make([]byte, n)
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	lo, hi = p&^(heapArena-1), (p+uintptr(n)+hugePage-1)&^(hugePage-1)
	// The raw calls, not syscall.Madvise: the range starts below the
	// block, at the arena's first pages, which no Go slice spans.
	if _, _, e := syscall.Syscall(syscall.SYS_MADVISE, lo, hi-lo, syscall.MADV_HUGEPAGE); e != 0 {
		lo, hi = 0, 0 // no THP in this kernel: nothing lost
	} else {
		collapses = collapses[:0]
		for q := lo; q < p; q += hugePage {
			_, _, e := syscall.Syscall(syscall.SYS_MADVISE, q, hugePage, madvCollapse)
			if e == syscall.EAGAIN {
				// Transient (a page locked or referenced elsewhere
				// for the moment): once more.
				_, _, e = syscall.Syscall(syscall.SYS_MADVISE, q, hugePage, madvCollapse)
			}
			collapses = append(collapses, collapse{q, e})
		}
	}
	runtime.KeepAlive(b) // live until advised; the collection below frees it
	runtime.GC()
	debug.SetGCPercent(pct)
	return lo, hi
}

// collapses is what hugeHeap's MADV_COLLAPSE calls answered, each huge
// page's (for the tests: the kernel may refuse for reasons of its own).
var collapses []collapse

type collapse struct {
	addr  uintptr
	errno syscall.Errno
}

// hugePage is a transparent huge page on amd64, and on arm64 with 4 KB
// pages (Debian's kernels).
const hugePage = 2 << 20

// madvCollapse is MADV_COLLAPSE (Linux 6.1), which package syscall lacks.
const madvCollapse = 25

// heapArena is the runtime's heap arena size on 64-bit Linux
// (runtime.heapArenaBytes).
const heapArena = 64 << 20
