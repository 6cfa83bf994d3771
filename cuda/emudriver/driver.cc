// An emulated CUDA driver library: libcuda.so.1 with the driver API calls
// that cuda/driver.go binds, implemented on the CPU over the kernel
// emulator (../emu.cc: kernels/*.cu compiled for the CPU). It exists to
// rehearse the GPU path on machines without a GPU: the cuda-tagged binary
// and test binary, found through LD_LIBRARY_PATH, go through their real
// dlopen/dlsym, module loading, cuLaunchKernel argument marshalling and
// memory calls, and the kernels they launch compute real results.
//
// Built by `make emudriver` (needs cuda.h: every function below is checked
// against its prototype there, under the symbol name cuda.h's macros give
// it). Nothing it prints is a GPU measurement.
//
// What it checks that a real driver would also refuse, with an error code
// rather than a crash: a launch of a function that its module's PTX does
// not declare; a kernel whose PTX parameter list the emulator's compiled
// signature disagrees with; copies and frees outside live allocations; a
// context that is not current; allocations beyond the device's memory
// (ABN_EMU_MEMORY bytes, 4 GiB unless set).
//
// Parameters are read as the real driver reads them: kernelParams[i]
// points to the i-th parameter's value, whose size comes from the .param
// declaration in the loaded PTX.

#include <cuda.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "../emu.cc"

namespace {
std::mutex mu;
bool initialised;
int dummy_ctx;
CUcontext const the_ctx = reinterpret_cast<CUcontext>(&dummy_ctx);
thread_local CUcontext current_ctx;

// Device memory: host memory from the emulator's allocator, each block's
// size kept, so that copies can be checked against live allocations.
std::map<uint64_t, size_t> blocks;
size_t used;

size_t total_memory() {
	const char* s = getenv("ABN_EMU_MEMORY");
	if (s && *s) return strtoull(s, nullptr, 10);
	return size_t(4) << 30;
}

// inside reports whether [p, p+n) lies within one live allocation.
bool inside(uint64_t p, size_t n) {
	auto it = blocks.upper_bound(p);
	if (it == blocks.begin()) return false;
	--it;
	return p >= it->first && p + n <= it->first + it->second;
}

struct Function {
	std::string name;
	std::vector<int> sizes;  // bytes of each parameter, from the PTX
};

struct Module {
	std::map<std::string, Function> fns;
};

struct Event {
	std::chrono::steady_clock::time_point at;
	bool recorded;
};

int param_size(const std::string& type) {
	if (type == ".u64" || type == ".s64" || type == ".b64" || type == ".f64") return 8;
	if (type == ".u32" || type == ".s32" || type == ".b32" || type == ".f32") return 4;
	if (type == ".u16" || type == ".s16" || type == ".b16" || type == ".f16") return 2;
	if (type == ".u8" || type == ".s8" || type == ".b8") return 1;
	return -1;
}

// parse_ptx reads each .entry's name and parameter sizes; false (with why)
// on a declaration it does not understand.
bool parse_ptx(const std::string& ptx, Module* m, std::string* why) {
	size_t pos = 0;
	while ((pos = ptx.find(".entry ", pos)) != std::string::npos) {
		pos += 7;
		size_t open = ptx.find('(', pos);
		if (open == std::string::npos) {
			*why = "an .entry without a parameter list";
			return false;
		}
		Function f;
		size_t a = pos;
		while (a < open && isspace((unsigned char)ptx[a])) a++;
		size_t b = open;
		while (b > a && isspace((unsigned char)ptx[b - 1])) b--;
		f.name = ptx.substr(a, b - a);
		size_t close = ptx.find(')', open);
		if (close == std::string::npos) {
			*why = "an unterminated parameter list for " + f.name;
			return false;
		}
		std::string list = ptx.substr(open + 1, close - open - 1);
		size_t p = 0;
		while ((p = list.find(".param", p)) != std::string::npos) {
			p += 6;
			while (p < list.size() && isspace((unsigned char)list[p])) p++;
			size_t e = p;
			while (e < list.size() && !isspace((unsigned char)list[e])) e++;
			std::string type = list.substr(p, e - p);
			int sz = param_size(type);
			if (sz < 0) {
				*why = "parameter type " + type + " of " + f.name;
				return false;
			}
			f.sizes.push_back(sz);
			p = e;
		}
		m->fns[f.name] = f;
		pos = close;
	}
	if (m->fns.empty()) {
		*why = "no .entry in the image";
		return false;
	}
	return true;
}

#define CURRENT()                                                     \
	do {                                                              \
		if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;          \
		if (current_ctx != the_ctx) return CUDA_ERROR_INVALID_CONTEXT; \
	} while (0)
}  // namespace

extern "C" {

CUresult cuInit(unsigned int flags) {
	if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
	std::lock_guard<std::mutex> l(mu);
	initialised = true;
	return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* v) {
	if (!v) return CUDA_ERROR_INVALID_VALUE;
	*v = CUDA_VERSION;
	return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char** s) {
	if (!s) return CUDA_ERROR_INVALID_VALUE;
	switch (r) {
#define NAME(c) \
	case c:     \
		*s = #c; \
		return CUDA_SUCCESS;
		NAME(CUDA_SUCCESS)
		NAME(CUDA_ERROR_INVALID_VALUE)
		NAME(CUDA_ERROR_OUT_OF_MEMORY)
		NAME(CUDA_ERROR_NOT_INITIALIZED)
		NAME(CUDA_ERROR_NO_DEVICE)
		NAME(CUDA_ERROR_INVALID_DEVICE)
		NAME(CUDA_ERROR_INVALID_IMAGE)
		NAME(CUDA_ERROR_INVALID_CONTEXT)
		NAME(CUDA_ERROR_INVALID_HANDLE)
		NAME(CUDA_ERROR_NOT_FOUND)
		NAME(CUDA_ERROR_LAUNCH_FAILED)
		NAME(CUDA_ERROR_INVALID_PTX)
#undef NAME
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
}

CUresult cuDeviceGetCount(int* n) {
	if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
	*n = 1;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
	if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
	if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
	*d = 0;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
	if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
	if (!name || len < 1) return CUDA_ERROR_INVALID_VALUE;
	snprintf(name, len, "abnconvert emulated driver (CPU, no GPU)");
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
	if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
	switch (a) {
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: {
		// Few multiprocessors: grids are sized from this, and every block
		// runs on the one CPU thread.
		const char* s = getenv("ABN_EMU_SMS");
		*v = s && *s ? atoi(s) : 4;
		return CUDA_SUCCESS;
	}
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
		*v = 9;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
		*v = 0;
		return CUDA_SUCCESS;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
	if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
	if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
	*c = the_ctx;
	return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext c) {
	if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
	if (c != the_ctx && c != nullptr) return CUDA_ERROR_INVALID_CONTEXT;
	current_ctx = c;
	return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
	CURRENT();
	return CUDA_SUCCESS;
}

CUresult cuModuleLoadDataEx(CUmodule* mod, const void* image, unsigned int n, CUjit_option* opts, void** vals) {
	CURRENT();
	if (!mod || !image) return CUDA_ERROR_INVALID_VALUE;
	if (n > 0 && (!opts || !vals)) return CUDA_ERROR_INVALID_VALUE;
	char* log = nullptr;
	size_t log_len = 0;
	for (unsigned i = 0; i < n; i++) {
		if (opts[i] == CU_JIT_ERROR_LOG_BUFFER) log = static_cast<char*>(vals[i]);
		if (opts[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) log_len = reinterpret_cast<uintptr_t>(vals[i]);
	}
	const char* text = static_cast<const char*>(image);
	std::string ptx(text);
	if (ptx.find(".version") == std::string::npos || ptx.find(".target") == std::string::npos) {
		if (log && log_len) snprintf(log, log_len, "not PTX: no .version or .target");
		return CUDA_ERROR_INVALID_PTX;
	}
	Module* m = new Module;
	std::string why;
	if (!parse_ptx(ptx, m, &why)) {
		if (log && log_len) snprintf(log, log_len, "emulated driver: %s", why.c_str());
		delete m;
		return CUDA_ERROR_INVALID_PTX;
	}
	// Every entry must be a kernel the emulator has, with as many
	// parameters as its compiled signature: a .cu edited without `make
	// ptx` fails here, as its launch would on a GPU.
	for (auto& kv : m->fns) {
		int arity = emu_arity(kv.first.c_str());
		if (arity != int(kv.second.sizes.size())) {
			if (log && log_len)
				snprintf(log, log_len, "emulated driver: %s has %zu parameters in the PTX, %d in the emulator",
					kv.first.c_str(), kv.second.sizes.size(), arity);
			delete m;
			return CUDA_ERROR_INVALID_PTX;
		}
	}
	*mod = reinterpret_cast<CUmodule>(m);
	return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* f, CUmodule mod, const char* name) {
	CURRENT();
	if (!f || !mod || !name) return CUDA_ERROR_INVALID_VALUE;
	Module* m = reinterpret_cast<Module*>(mod);
	auto it = m->fns.find(name);
	if (it == m->fns.end()) return CUDA_ERROR_NOT_FOUND;
	*f = reinterpret_cast<CUfunction>(&it->second);
	return CUDA_SUCCESS;
}

CUresult cuMemAlloc(CUdeviceptr* p, size_t n) {
	CURRENT();
	if (!p || n == 0) return CUDA_ERROR_INVALID_VALUE;
	std::lock_guard<std::mutex> l(mu);
	size_t rounded = (n + 255) / 256 * 256;
	if (used + rounded > total_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
	uint64_t a = emu_alloc(rounded);
	if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
	blocks[a] = rounded;
	used += rounded;
	*p = a;
	return CUDA_SUCCESS;
}

CUresult cuMemFree(CUdeviceptr p) {
	CURRENT();
	std::lock_guard<std::mutex> l(mu);
	auto it = blocks.find(p);
	if (it == blocks.end()) return CUDA_ERROR_INVALID_VALUE;
	used -= it->second;
	blocks.erase(it);
	emu_free(p);
	return CUDA_SUCCESS;
}

CUresult cuMemGetInfo(size_t* free, size_t* total) {
	CURRENT();
	std::lock_guard<std::mutex> l(mu);
	*total = total_memory();
	*free = *total - used;
	return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
	CURRENT();
	std::lock_guard<std::mutex> l(mu);
	if (!inside(dst, n) || !src) return CUDA_ERROR_INVALID_VALUE;
	emu_upload(dst, src, n);
	return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
	CURRENT();
	std::lock_guard<std::mutex> l(mu);
	if (!inside(src, n) || !dst) return CUDA_ERROR_INVALID_VALUE;
	emu_download(dst, src, n);
	return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
	CURRENT();
	std::lock_guard<std::mutex> l(mu);
	if (!inside(dst, n) || !inside(src, n)) return CUDA_ERROR_INVALID_VALUE;
	emu_copy(dst, src, n);
	return CUDA_SUCCESS;
}

CUresult cuMemsetD32(CUdeviceptr dst, unsigned int v, size_t n) {
	CURRENT();
	std::lock_guard<std::mutex> l(mu);
	if (dst % 4 != 0 || !inside(dst, n * 4)) return CUDA_ERROR_INVALID_VALUE;
	emu_memset32(dst, v, n);
	return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
	unsigned shared, CUstream stream, void** params, void** extra) {
	CURRENT();
	if (!f || extra) return CUDA_ERROR_INVALID_VALUE;
	// The kernels declare their shared memory statically, and the backend
	// uses one stream, the legacy default.
	if (shared != 0 || stream != nullptr) return CUDA_ERROR_INVALID_VALUE;
	if (gx < 1 || gy < 1 || gz < 1 || gx > 0x7fffffffu || gy > 65535 || gz > 65535) return CUDA_ERROR_INVALID_VALUE;
	if (bx * by * bz < 1 || bx * by * bz > 1024 || bz > 64) return CUDA_ERROR_INVALID_VALUE;
	const Function* fn = reinterpret_cast<const Function*>(f);
	std::vector<uint64_t> args(fn->sizes.size());
	if (!args.empty() && !params) return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < args.size(); i++) {
		uint64_t v = 0;
		memcpy(&v, params[i], fn->sizes[i]);
		args[i] = v;
	}
	std::lock_guard<std::mutex> l(mu);
	char err[256];
	if (emu_launch(fn->name.c_str(), gx, gy, gz, bx, by, bz, args.data(), int(args.size()), err, sizeof err) != 0) {
		fprintf(stderr, "emulated driver: %s\n", err);
		return CUDA_ERROR_LAUNCH_FAILED;
	}
	return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned int flags) {
	CURRENT();
	if (!e || flags != CU_EVENT_DEFAULT) return CUDA_ERROR_INVALID_VALUE;
	*e = reinterpret_cast<CUevent>(new Event{{}, false});
	return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream stream) {
	CURRENT();
	if (!e || stream != nullptr) return CUDA_ERROR_INVALID_VALUE;
	Event* ev = reinterpret_cast<Event*>(e);
	ev->at = std::chrono::steady_clock::now();
	ev->recorded = true;
	return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent e) {
	CURRENT();
	return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
	CURRENT();
	Event* x = reinterpret_cast<Event*>(a);
	Event* y = reinterpret_cast<Event*>(b);
	if (!ms || !x || !y) return CUDA_ERROR_INVALID_HANDLE;
	if (!x->recorded || !y->recorded) return CUDA_ERROR_INVALID_HANDLE;
	*ms = std::chrono::duration<float, std::milli>(y->at - x->at).count();
	return CUDA_SUCCESS;
}

CUresult cuEventDestroy(CUevent e) {
	CURRENT();
	if (!e) return CUDA_ERROR_INVALID_HANDLE;
	delete reinterpret_cast<Event*>(e);
	return CUDA_SUCCESS;
}
}
