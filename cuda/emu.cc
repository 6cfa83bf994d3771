//go:build cudaemu

// The kernel emulator: kernels/*.cu compiled for the CPU against
// kernels/emu.cuh. A launch runs the grid's blocks one after another. The
// threads of a kernel that synchronises (__syncthreads, warp shuffles) run
// as fibers: the scheduler resumes each unfinished fiber in turn until all
// return, and a round in which no fiber finishes and no barrier opens is a
// deadlock (a barrier not reached by every thread), reported as an error.
// The threads of the other kernels run as plain calls, one after another;
// a barrier reached by one of those is reported as a wrong declaration.

#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "kernels/emu.cuh"
#include "kernels/broadcast.cu"
#include "kernels/conv.cu"
#include "kernels/elementwise.cu"
#include "kernels/gemm.cu"
#include "kernels/layout.cu"
#include "kernels/norm.cu"
#include "kernels/pool.cu"

// emu_switch saves the callee-saved registers on the current stack, stores
// the stack pointer in *from, loads to and restores the registers saved
// there: a fiber switch without ucontext's signal-mask system calls.
#if defined(__x86_64__)
extern "C" void emu_switch(void** from, void* to);
asm(R"(
	.text
	.globl emu_switch
	.type emu_switch, @function
emu_switch:
	pushq %rbp
	pushq %rbx
	pushq %r12
	pushq %r13
	pushq %r14
	pushq %r15
	movq %rsp, (%rdi)
	movq %rsi, %rsp
	popq %r15
	popq %r14
	popq %r13
	popq %r12
	popq %rbx
	popq %rbp
	ret
	.size emu_switch, .-emu_switch
)");
#else
#error "the kernel emulator's fiber switch is written for x86-64"
#endif

namespace emu {
dim3 block_idx, block_dim, grid_dim;
Thread* current;

namespace {
const size_t kStack = 64 << 10;
const int kMaxThreads = 1024;

struct Fiber {
	void* sp;
	Thread th;
	bool done;
	char* stack;
};

void* sched_sp;
std::vector<Fiber> fibers;
int nthreads;
long events;  // fibers finished and barriers opened, for deadlock detection
long bar_gen;
int bar_count;
long warp_gen[kMaxThreads / 32];
int warp_count[kMaxThreads / 32];
uint64_t slots[kMaxThreads];
void (*body)(const uint64_t*);
const uint64_t* body_args;
// direct is set while a kernel declared free of barriers runs its threads
// as plain calls; a barrier reached then is a wrong declaration.
bool direct, misdeclared;

void yield() { emu_switch(&fibers[current->linear].sp, sched_sp); }

void fiber_entry() {
	body(body_args);
	fibers[current->linear].done = true;
	emu_switch(&fibers[current->linear].sp, sched_sp);
	__builtin_unreachable();
}

// fiber_init lays out a fresh stack as emu_switch leaves one: six saved
// registers, then fiber_entry as the return address, placed so that
// fiber_entry starts with the stack aligned as after a call.
void fiber_init(Fiber& f) {
	// The tops are staggered: stacks a power of two apart would put every
	// fiber's live frames in the same cache sets.
	uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStack - (f.th.linear % 61) * 80) & ~uintptr_t(15);
	void** sp = reinterpret_cast<void**>(top);
	*--sp = nullptr;
	*--sp = reinterpret_cast<void*>(fiber_entry);
	for (int i = 0; i < 6; i++) *--sp = nullptr;
	f.sp = sp;
}

void warp_barrier() {
	if (direct) {
		misdeclared = true;
		return;
	}
	int w = current->linear / 32;
	int size = nthreads - w * 32 < 32 ? nthreads - w * 32 : 32;
	long g = warp_gen[w];
	if (++warp_count[w] == size) {
		warp_count[w] = 0;
		warp_gen[w]++;
		events++;
		return;
	}
	while (warp_gen[w] == g) yield();
}

void set_thread(Thread& th, int t) {
	th.linear = t;
	th.idx.x = t % block_dim.x;
	th.idx.y = (t / block_dim.x) % block_dim.y;
	th.idx.z = t / (block_dim.x * block_dim.y);
}

// run_block_direct runs a barrier-free block's threads one after another.
void run_block_direct() {
	Thread th;
	for (int t = 0; t < nthreads; t++) {
		set_thread(th, t);
		current = &th;
		body(body_args);
	}
}

// run_block runs one block as fibers; false on deadlock.
bool run_block() {
	if ((int)fibers.size() < nthreads) {
		size_t old = fibers.size();
		fibers.resize(nthreads);
		for (size_t i = old; i < fibers.size(); i++) fibers[i].stack = static_cast<char*>(malloc(kStack));
	}
	bar_gen = 0;
	bar_count = 0;
	for (int w = 0; w < kMaxThreads / 32; w++) warp_gen[w] = warp_count[w] = 0;
	for (int t = 0; t < nthreads; t++) {
		Fiber& f = fibers[t];
		f.done = false;
		set_thread(f.th, t);
		fiber_init(f);
	}
	int remaining = nthreads;
	while (remaining > 0) {
		long before = events;
		for (int t = 0; t < nthreads; t++) {
			if (fibers[t].done) continue;
			current = &fibers[t].th;
			emu_switch(&sched_sp, fibers[t].sp);
			if (fibers[t].done) {
				remaining--;
				events++;
			}
		}
		if (events == before) return false;
	}
	return true;
}
}  // namespace

void syncthreads() {
	if (direct) {
		misdeclared = true;
		return;
	}
	long g = bar_gen;
	if (++bar_count == nthreads) {
		bar_count = 0;
		bar_gen++;
		events++;
		return;
	}
	while (bar_gen == g) yield();
}

uint64_t shfl_down_bits(uint64_t v, int delta) {
	int lt = current->linear, lane = lt % 32, w = lt / 32;
	int size = nthreads - w * 32 < 32 ? nthreads - w * 32 : 32;
	slots[lt] = v;
	warp_barrier();
	uint64_t r = lane + delta < size ? slots[w * 32 + lane + delta] : v;
	warp_barrier();
	return r;
}
}  // namespace emu

namespace {
// Arguments arrive as 64-bit words, each holding its value in the low
// bytes as cuLaunchKernel reads them.
template <class T>
T unpack(uint64_t v) {
	if constexpr (std::is_pointer_v<T>) {
		return reinterpret_cast<T>(static_cast<uintptr_t>(v));
	} else if constexpr (std::is_same_v<T, float>) {
		uint32_t u = static_cast<uint32_t>(v);
		float f;
		memcpy(&f, &u, 4);
		return f;
	} else if constexpr (std::is_same_v<T, double>) {
		double d;
		memcpy(&d, &v, 8);
		return d;
	} else {
		return static_cast<T>(v);
	}
}

template <class... A, size_t... I>
void call_with(void (*f)(A...), const uint64_t* a, std::index_sequence<I...>) {
	f(unpack<A>(a[I])...);
}

template <class... A>
constexpr int arity(void (*)(A...)) {
	return sizeof...(A);
}

struct Entry {
	const char* name;
	int arity;
	void (*call)(const uint64_t*);
	bool sync;  // uses barriers: its threads run as fibers
};

#define ENTRY(k, sync) \
	{ #k, arity(k), [](const uint64_t* a) { call_with(k, a, std::make_index_sequence<arity(k)>{}); }, sync }
#define REG(k) ENTRY(k, false)
#define REG_SYNC(k) ENTRY(k, true)

const Entry registry[] = {
	REG(ew_act), REG(ew_act_bwd), REG(ew_add), REG(ew_acc), REG(ew_mul), REG(ew_dropout), REG(ew_slices),
	REG_SYNC(bn_stats), REG(bn_stats_final), REG(bn_update_running), REG(bn_coeffs), REG(bn_apply),
	REG_SYNC(bn_bwd_reduce), REG(bn_bwd_final), REG(bn_bwd_apply), REG(im2col), REG(col2im), REG(bias_add),
	REG_SYNC(chan_sum), REG(batch_sum), REG_SYNC(sgemm), REG(maxpool), REG(maxpool_bwd), REG(avgpool), REG(avgpool_bwd), REG(adaptive_pool),
	REG(adaptive_pool_bwd), REG(bc_binary), REG(bc_binary_bwd), REG_SYNC(bc_binary_sum), REG(lay_copy),
	REG(lay_resize), REG(lay_resize_bwd),
};
const int nregistry = sizeof registry / sizeof registry[0];

const Entry* find(const char* name) {
	for (int i = 0; i < nregistry; i++)
		if (strcmp(registry[i].name, name) == 0) return &registry[i];
	return nullptr;
}
}  // namespace

extern "C" {
int emu_count() { return nregistry; }
const char* emu_name(int i) { return i >= 0 && i < nregistry ? registry[i].name : nullptr; }
int emu_arity(const char* name) {
	const Entry* e = find(name);
	return e ? e->arity : -1;
}

// emu_launch runs a kernel; 0 on success, else an error message in err.
int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
	const uint64_t* args, int nargs, char* err, int errlen) {
	const Entry* e = find(name);
	if (!e) {
		snprintf(err, errlen, "no kernel %s in the emulator", name);
		return 1;
	}
	if (e->arity != nargs) {
		snprintf(err, errlen, "%s takes %d arguments, got %d", name, e->arity, nargs);
		return 1;
	}
	int n = (int)(bx * by * bz);
	if (n < 1 || n > emu::kMaxThreads) {
		snprintf(err, errlen, "block of %d threads", n);
		return 1;
	}
	emu::grid_dim = {gx, gy, gz};
	emu::block_dim = {bx, by, bz};
	emu::nthreads = n;
	emu::body = e->call;
	emu::body_args = args;
	emu::direct = !e->sync;
	emu::misdeclared = false;
	for (unsigned z = 0; z < gz; z++)
		for (unsigned y = 0; y < gy; y++)
			for (unsigned x = 0; x < gx; x++) {
				emu::block_idx = {x, y, z};
				if (emu::direct) {
					emu::run_block_direct();
					if (emu::misdeclared) {
						snprintf(err, errlen, "%s reached a barrier but is registered without REG_SYNC in emu.cc", name);
						return 1;
					}
					continue;
				}
				if (!emu::run_block()) {
					snprintf(err, errlen, "%s: block (%u,%u,%u) deadlocked: a barrier not reached by every thread", name, x,
						y, z);
					return 1;
				}
			}
	return 0;
}

uint64_t emu_alloc(uint64_t bytes) { return (uint64_t)(uintptr_t)aligned_alloc(256, (bytes + 255) / 256 * 256); }
void emu_free(uint64_t p) { free((void*)(uintptr_t)p); }
void emu_upload(uint64_t dst, const void* src, uint64_t n) { memcpy((void*)(uintptr_t)dst, src, n); }
void emu_download(void* dst, uint64_t src, uint64_t n) { memcpy(dst, (const void*)(uintptr_t)src, n); }
void emu_copy(uint64_t dst, uint64_t src, uint64_t n) { memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n); }
void emu_memset32(uint64_t dst, uint32_t v, uint64_t n) {
	uint32_t* p = (uint32_t*)(uintptr_t)dst;
	for (uint64_t i = 0; i < n; i++) p[i] = v;
}
}
