//go:build cudaemu

package cuda

/*
#cgo CXXFLAGS: -std=c++17 -O2 -fno-strict-aliasing
#cgo LDFLAGS: -lstdc++
#include <stdint.h>
#include <stdlib.h>
int emu_count(void);
const char* emu_name(int i);
int emu_arity(const char* name);
int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
	const uint64_t* args, int nargs, char* err, int errlen);
uint64_t emu_alloc(uint64_t bytes);
void emu_free(uint64_t p);
void emu_upload(uint64_t dst, const void* src, uint64_t n);
void emu_download(void* dst, uint64_t src, uint64_t n);
void emu_copy(uint64_t dst, uint64_t src, uint64_t n);
void emu_memset32(uint64_t dst, uint32_t v, uint64_t n);
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// emuDevice runs the kernels compiled for the CPU (emu.cc): a device for
// checking the kernels' arithmetic on machines without a GPU. Memory is
// host memory; operations run at once, in order.
type emuDevice struct {
	mu     sync.Mutex
	sms    int
	blocks map[uint64]int64
	used   int64
	names  [numKernels]*C.char
}

// newEmuDevice returns an emulated device with sms multiprocessors (which
// only sizes the grids: fewer means fewer fibers per launch).
func newEmuDevice(sms int) *emuDevice {
	d := &emuDevice{sms: sms, blocks: map[uint64]int64{}}
	for k := range d.names {
		d.names[k] = C.CString(kernelSpecs[k].name)
	}
	return d
}

// emuKernels lists the emulator's kernels and their arities.
func emuKernels() map[string]int {
	out := map[string]int{}
	for i := 0; i < int(C.emu_count()); i++ {
		name := C.emu_name(C.int(i))
		out[C.GoString(name)] = int(C.emu_arity(name))
	}
	return out
}

func (d *emuDevice) props() deviceProps {
	return deviceProps{name: "emulator", sms: d.sms, cc: [2]int{7, 0}}
}

func (d *emuDevice) alloc(bytes int64) (uint64, error) {
	p := uint64(C.emu_alloc(C.uint64_t(bytes)))
	if p == 0 {
		return 0, fmt.Errorf("emulator: out of host memory for %d bytes", bytes)
	}
	d.mu.Lock()
	d.blocks[p] = bytes
	d.used += bytes
	d.mu.Unlock()
	return p, nil
}

func (d *emuDevice) free(p uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	n, ok := d.blocks[p]
	if !ok {
		return fmt.Errorf("emulator: free of %#x, not allocated", p)
	}
	delete(d.blocks, p)
	d.used -= n
	C.emu_free(C.uint64_t(p))
	return nil
}

func (d *emuDevice) memInfo() (int64, int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	const total = 1 << 40
	return total - d.used, total, nil
}

func (d *emuDevice) upload(dst uint64, src []byte) error {
	if len(src) > 0 {
		C.emu_upload(C.uint64_t(dst), unsafe.Pointer(&src[0]), C.uint64_t(len(src)))
	}
	return nil
}

func (d *emuDevice) download(dst []byte, src uint64) error {
	if len(dst) > 0 {
		C.emu_download(unsafe.Pointer(&dst[0]), C.uint64_t(src), C.uint64_t(len(dst)))
	}
	return nil
}

func (d *emuDevice) copy(dst, src uint64, n int64) error {
	C.emu_copy(C.uint64_t(dst), C.uint64_t(src), C.uint64_t(n))
	return nil
}

func (d *emuDevice) memset32(dst uint64, v uint32, n int64) error {
	C.emu_memset32(C.uint64_t(dst), C.uint32_t(v), C.uint64_t(n))
	return nil
}

func (d *emuDevice) launch(k kernelID, l launchDims, args []uint64) error {
	var errBuf [256]C.char
	var argp *C.uint64_t
	if len(args) > 0 {
		// Go memory without Go pointers in it may be passed to C.
		argp = (*C.uint64_t)(unsafe.Pointer(&args[0]))
	}
	rc := C.emu_launch(d.names[k], C.uint(l.grid[0]), C.uint(l.grid[1]), C.uint(l.grid[2]),
		C.uint(l.block[0]), C.uint(l.block[1]), C.uint(l.block[2]), argp, C.int(len(args)), &errBuf[0], C.int(len(errBuf)))
	if rc != 0 {
		return fmt.Errorf("emulator: %s", C.GoString(&errBuf[0]))
	}
	return nil
}

func (d *emuDevice) sync() error { return nil }
