//go:build cuda

package cuda

/*
#cgo LDFLAGS: -ldl
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

// The driver is opened with dlopen rather than linked: a binary built with
// the cuda tag then starts on machines without a GPU or a driver (for the
// CPU commands) and says why --device cuda cannot run there. Each pointer
// has the type of the cuda.h prototype it stands for, and each symbol is
// looked up under the name cuda.h's macros give it (cuMemAlloc is
// cuMemAlloc_v2).
#define ABN_STR(x) #x
#define ABN_XSTR(x) ABN_STR(x)
#define ABN_FN(f) static __typeof__(&f) p_##f;
ABN_FN(cuInit)
ABN_FN(cuDriverGetVersion)
ABN_FN(cuGetErrorName)
ABN_FN(cuDeviceGetCount)
ABN_FN(cuDeviceGet)
ABN_FN(cuDeviceGetName)
ABN_FN(cuDeviceGetAttribute)
ABN_FN(cuDevicePrimaryCtxRetain)
ABN_FN(cuCtxSetCurrent)
ABN_FN(cuCtxSynchronize)
ABN_FN(cuModuleLoadDataEx)
ABN_FN(cuModuleGetFunction)
ABN_FN(cuMemAlloc)
ABN_FN(cuMemFree)
ABN_FN(cuMemGetInfo)
ABN_FN(cuMemcpyHtoD)
ABN_FN(cuMemcpyDtoH)
ABN_FN(cuMemcpyDtoD)
ABN_FN(cuMemsetD32)
ABN_FN(cuLaunchKernel)
ABN_FN(cuEventCreate)
ABN_FN(cuEventRecord)
ABN_FN(cuEventSynchronize)
ABN_FN(cuEventElapsedTime)
ABN_FN(cuEventDestroy)

static char abn_load_err[512];
static CUcontext abn_ctx;

static int abn_load(void) {
	void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		snprintf(abn_load_err, sizeof abn_load_err, "%s", dlerror());
		return 1;
	}
#define ABN_LOAD(f)                                                                               \
	p_##f = (__typeof__(&f))dlsym(h, ABN_XSTR(f));                                                \
	if (!p_##f) {                                                                                 \
		snprintf(abn_load_err, sizeof abn_load_err, "the driver library has no %s", ABN_XSTR(f)); \
		return 1;                                                                                 \
	}
	ABN_LOAD(cuInit)
	ABN_LOAD(cuDriverGetVersion)
	ABN_LOAD(cuGetErrorName)
	ABN_LOAD(cuDeviceGetCount)
	ABN_LOAD(cuDeviceGet)
	ABN_LOAD(cuDeviceGetName)
	ABN_LOAD(cuDeviceGetAttribute)
	ABN_LOAD(cuDevicePrimaryCtxRetain)
	ABN_LOAD(cuCtxSetCurrent)
	ABN_LOAD(cuCtxSynchronize)
	ABN_LOAD(cuModuleLoadDataEx)
	ABN_LOAD(cuModuleGetFunction)
	ABN_LOAD(cuMemAlloc)
	ABN_LOAD(cuMemFree)
	ABN_LOAD(cuMemGetInfo)
	ABN_LOAD(cuMemcpyHtoD)
	ABN_LOAD(cuMemcpyDtoH)
	ABN_LOAD(cuMemcpyDtoD)
	ABN_LOAD(cuMemsetD32)
	ABN_LOAD(cuLaunchKernel)
	ABN_LOAD(cuEventCreate)
	ABN_LOAD(cuEventRecord)
	ABN_LOAD(cuEventSynchronize)
	ABN_LOAD(cuEventElapsedTime)
	ABN_LOAD(cuEventDestroy)
	return 0;
}

static const char* abn_load_error(void) { return abn_load_err; }

static const char* abn_error_name(CUresult r) {
	const char* s = 0;
	if (p_cuGetErrorName && p_cuGetErrorName(r, &s) == CUDA_SUCCESS && s) return s;
	return "unknown CUDA error";
}

// abn_open initialises the driver and makes device 0's primary context the
// one every later call uses.
static CUresult abn_open(int* sms, int* major, int* minor, char* name, int name_len, int* version) {
	CUresult r;
	CUdevice dev;
	int n = 0;
	if ((r = p_cuInit(0)) != CUDA_SUCCESS) return r;
	if ((r = p_cuDriverGetVersion(version)) != CUDA_SUCCESS) return r;
	if ((r = p_cuDeviceGetCount(&n)) != CUDA_SUCCESS) return r;
	if (n < 1) return CUDA_ERROR_NO_DEVICE;
	if ((r = p_cuDeviceGet(&dev, 0)) != CUDA_SUCCESS) return r;
	if ((r = p_cuDeviceGetName(name, name_len, dev)) != CUDA_SUCCESS) return r;
	if ((r = p_cuDeviceGetAttribute(sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)) != CUDA_SUCCESS) return r;
	if ((r = p_cuDeviceGetAttribute(major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)) != CUDA_SUCCESS) return r;
	if ((r = p_cuDeviceGetAttribute(minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)) != CUDA_SUCCESS) return r;
	if ((r = p_cuDevicePrimaryCtxRetain(&abn_ctx, dev)) != CUDA_SUCCESS) return r;
	return p_cuCtxSetCurrent(abn_ctx);
}

// Every call below makes the context current first: a cgo call runs on one
// OS thread from start to end, while a goroutine may move between threads
// between calls, and the current context is per thread.
#define ABN_CURRENT()                                               \
	do {                                                            \
		CUresult rc = p_cuCtxSetCurrent(abn_ctx);                   \
		if (rc != CUDA_SUCCESS) return rc;                          \
	} while (0)

static CUresult abn_load_module(const char* ptx, CUmodule* mod, char* log, unsigned log_len) {
	ABN_CURRENT();
	CUjit_option opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
	void* vals[2] = {log, (void*)(uintptr_t)log_len};
	return p_cuModuleLoadDataEx(mod, ptx, 2, opts, vals);
}

static CUresult abn_function(CUfunction* f, CUmodule m, const char* name) {
	ABN_CURRENT();
	return p_cuModuleGetFunction(f, m, name);
}

static CUresult abn_alloc(uint64_t* p, uint64_t n) {
	ABN_CURRENT();
	CUdeviceptr d = 0;
	CUresult r = p_cuMemAlloc(&d, n);
	*p = d;
	return r;
}

static CUresult abn_free(uint64_t p) {
	ABN_CURRENT();
	return p_cuMemFree(p);
}

static CUresult abn_mem_info(size_t* free, size_t* total) {
	ABN_CURRENT();
	return p_cuMemGetInfo(free, total);
}

static CUresult abn_upload(uint64_t dst, const void* src, size_t n) {
	ABN_CURRENT();
	return p_cuMemcpyHtoD(dst, src, n);
}

static CUresult abn_download(void* dst, uint64_t src, size_t n) {
	ABN_CURRENT();
	return p_cuMemcpyDtoH(dst, src, n);
}

static CUresult abn_copy(uint64_t dst, uint64_t src, size_t n) {
	ABN_CURRENT();
	return p_cuMemcpyDtoD(dst, src, n);
}

static CUresult abn_memset32(uint64_t dst, unsigned v, size_t n) {
	ABN_CURRENT();
	return p_cuMemsetD32(dst, v, n);
}

// abn_launch passes each argument as a pointer to its 64-bit slot: the
// driver reads as many bytes as the kernel's parameter takes, the low ones
// on this little-endian machine, and copies them at launch.
static CUresult abn_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
	unsigned bz, unsigned shared, uint64_t* args, int n) {
	void* ptrs[64];
	if (n > 64) return CUDA_ERROR_INVALID_VALUE;
	for (int i = 0; i < n; i++) ptrs[i] = &args[i];
	ABN_CURRENT();
	return p_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, 0, ptrs, 0);
}

static CUresult abn_sync(void) {
	ABN_CURRENT();
	return p_cuCtxSynchronize();
}

static CUresult abn_event(CUevent* e) {
	ABN_CURRENT();
	return p_cuEventCreate(e, CU_EVENT_DEFAULT);
}

static CUresult abn_record(CUevent e) {
	ABN_CURRENT();
	return p_cuEventRecord(e, 0);
}

static CUresult abn_elapsed(float* ms, CUevent start, CUevent stop) {
	ABN_CURRENT();
	CUresult r = p_cuEventSynchronize(stop);
	if (r != CUDA_SUCCESS) return r;
	return p_cuEventElapsedTime(ms, start, stop);
}

static CUresult abn_event_destroy(CUevent e) {
	ABN_CURRENT();
	return p_cuEventDestroy(e);
}
*/
import "C"

import (
	"fmt"
	"strings"
	"sync"
	"time"
	"unsafe"
)

// driver is a device on the CUDA driver API: device 0's primary context,
// the embedded PTX loaded into it, and the default stream.
type driver struct {
	p       deviceProps
	version int
	fns     [numKernels]C.CUfunction
}

func check(what string, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return fmt.Errorf("%s: %s (CUDA error %d)", what, C.GoString(C.abn_error_name(r)), int(r))
}

var (
	openOnce   sync.Once
	shared     *driver
	sharedPool *pool
	baseline   int64
	openErr    error
)

// openDriver loads the driver library, opens device 0 and loads the PTX.
func openDriver() (*driver, error) {
	if C.abn_load() != 0 {
		return nil, fmt.Errorf("cuda: no CUDA driver: %s", C.GoString(C.abn_load_error()))
	}
	d := &driver{}
	var sms, major, minor, version C.int
	var name [256]C.char
	if err := check("cuda: opening device 0", C.abn_open(&sms, &major, &minor, &name[0], C.int(len(name)), &version)); err != nil {
		return nil, err
	}
	d.p = deviceProps{name: C.GoString(&name[0]), sms: int(sms), cc: [2]int{int(major), int(minor)}}
	d.version = int(version)
	src, err := ptxSources()
	if err != nil {
		return nil, err
	}
	mods := map[string]C.CUmodule{}
	for _, m := range modules() {
		text, ok := src[m]
		if !ok {
			return nil, fmt.Errorf("cuda: kernels/%s.ptx is not embedded", m)
		}
		ctext := C.CString(text)
		var log [4096]C.char
		var mod C.CUmodule
		r := C.abn_load_module(ctext, &mod, &log[0], C.uint(len(log)))
		C.free(unsafe.Pointer(ctext))
		if err := check("cuda: loading kernels/"+m+".ptx", r); err != nil {
			if msg := strings.TrimSpace(C.GoString(&log[0])); msg != "" {
				err = fmt.Errorf("%w: %s", err, msg)
			}
			return nil, err
		}
		mods[m] = mod
	}
	for k, s := range kernelSpecs {
		cname := C.CString(s.name)
		r := C.abn_function(&d.fns[k], mods[s.module], cname)
		C.free(unsafe.Pointer(cname))
		if err := check("cuda: kernel "+s.name, r); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// Open returns a new Backend on CUDA device 0 (the first that
// CUDA_VISIBLE_DEVICES shows). The driver, the device's context, the
// loaded kernels and the caching pool are made once per process and shared
// by every Backend; each Backend counts its own tensors.
func Open() (*Backend, error) {
	openOnce.Do(func() {
		shared, openErr = openDriver()
		if openErr != nil {
			return
		}
		sharedPool = newPool(shared)
		free, total, err := shared.memInfo()
		if err != nil {
			openErr = err
			return
		}
		baseline = total - free
	})
	if openErr != nil {
		return nil, openErr
	}
	return newBackend(shared, sharedPool, baseline), nil
}

// Device describes the device Open uses: its name, compute capability,
// multiprocessors and driver version.
func (b *Backend) Device() string {
	p := b.dev.props()
	s := fmt.Sprintf("%s (compute %d.%d, %d multiprocessors)", p.name, p.cc[0], p.cc[1], p.sms)
	if d, ok := b.dev.(*driver); ok {
		s += fmt.Sprintf(", driver API %d.%d", d.version/1000, d.version%1000/10)
	}
	return s
}

func (d *driver) props() deviceProps { return d.p }

func (d *driver) alloc(bytes int64) (uint64, error) {
	var p C.uint64_t
	if err := check(fmt.Sprintf("cuMemAlloc(%d)", bytes), C.abn_alloc(&p, C.uint64_t(bytes))); err != nil {
		return 0, err
	}
	return uint64(p), nil
}

func (d *driver) free(p uint64) error { return check("cuMemFree", C.abn_free(C.uint64_t(p))) }

func (d *driver) memInfo() (int64, int64, error) {
	var free, total C.size_t
	if err := check("cuMemGetInfo", C.abn_mem_info(&free, &total)); err != nil {
		return 0, 0, err
	}
	return int64(free), int64(total), nil
}

func (d *driver) upload(dst uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return check("cuMemcpyHtoD", C.abn_upload(C.uint64_t(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

func (d *driver) download(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return nil
	}
	return check("cuMemcpyDtoH", C.abn_download(unsafe.Pointer(&dst[0]), C.uint64_t(src), C.size_t(len(dst))))
}

func (d *driver) copy(dst, src uint64, n int64) error {
	return check("cuMemcpyDtoD", C.abn_copy(C.uint64_t(dst), C.uint64_t(src), C.size_t(n)))
}

func (d *driver) memset32(dst uint64, v uint32, n int64) error {
	return check("cuMemsetD32", C.abn_memset32(C.uint64_t(dst), C.uint(v), C.size_t(n)))
}

func (d *driver) launch(k kernelID, l launchDims, args []uint64) error {
	var argp *C.uint64_t
	if len(args) > 0 {
		argp = (*C.uint64_t)(unsafe.Pointer(&args[0]))
	}
	return check("cuLaunchKernel", C.abn_launch(d.fns[k], C.uint(l.grid[0]), C.uint(l.grid[1]), C.uint(l.grid[2]),
		C.uint(l.block[0]), C.uint(l.block[1]), C.uint(l.block[2]), C.uint(l.shared), argp, C.int(len(args))))
}

func (d *driver) sync() error { return check("cuCtxSynchronize", C.abn_sync()) }

// timeGPU runs fn and returns the device time between events recorded
// before and after it on the stream.
func (d *driver) timeGPU(fn func() error) (time.Duration, error) {
	var start, stop C.CUevent
	if err := check("cuEventCreate", C.abn_event(&start)); err != nil {
		return 0, err
	}
	defer C.abn_event_destroy(start)
	if err := check("cuEventCreate", C.abn_event(&stop)); err != nil {
		return 0, err
	}
	defer C.abn_event_destroy(stop)
	if err := check("cuEventRecord", C.abn_record(start)); err != nil {
		return 0, err
	}
	if err := fn(); err != nil {
		return 0, err
	}
	if err := check("cuEventRecord", C.abn_record(stop)); err != nil {
		return 0, err
	}
	var ms C.float
	if err := check("cuEventElapsedTime", C.abn_elapsed(&ms, start, stop)); err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}
