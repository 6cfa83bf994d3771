// Package cuda is the runtime's CUDA backend: it satisfies runtime.Backend
// and the optional runtime.Broadcasting and runtime.Layout with tensors in
// device memory and kernels written in CUDA C in
// kernels/*.cu, whose PTX is committed (kernels/*.ptx, made by `make ptx`)
// and loaded by the driver at start, which compiles it for the GPU at hand.
// Matrix products use the package's own GEMM kernel, so a binary needs only
// the driver library (libcuda), not the CUDA toolkit's runtime libraries.
//
// The package is split so that all but the driver calls builds and is
// tested without CUDA:
//
//   - Without build tags: the backend's logic (argument checks, launch
//     geometry, the caching allocator and its accounting, every op as a
//     sequence of kernel launches) written against the small device
//     interface, and the embedded PTX with its parser. The default tests
//     drive the backend over a recording fake device that checks every
//     launch against the PTX (kernel name, parameter count and types,
//     pointers into live allocations, grid limits) and run whole networks
//     through the runtime to check that its memory accounting equals the
//     CPU backend's.
//   - Tag cudaemu (needs only a C++ compiler): the same kernel sources
//     compiled for the CPU by emu.cc, with every CUDA thread of a block run
//     as a fiber, so that the kernels' arithmetic is checked against the
//     CPU backend, op by op and on whole networks.
//   - Tag cuda (needs cuda.h to build, see README.md): the driver API,
//     bound in driver.go and opened with dlopen at run time, so that the
//     binary starts anywhere: Open returns a Backend on a real GPU.
package cuda
