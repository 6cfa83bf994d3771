package cuda

// device is what the backend needs of a GPU: memory, copies and kernel
// launches, all ordered on one stream. The cuda build tag implements it
// with the driver API; the tests implement it with a recording fake and,
// under the cudaemu tag, with kernels compiled for the CPU.
type device interface {
	props() deviceProps
	// alloc returns bytes of device memory, 256-byte aligned; free
	// returns it. Both bypass the caching pool, which sits on top.
	alloc(bytes int64) (uint64, error)
	free(ptr uint64) error
	// memInfo is the driver's free and total device memory.
	memInfo() (free, total int64, err error)
	// upload and download copy between host and device; download waits
	// for the work queued before it.
	upload(dst uint64, src []byte) error
	download(dst []byte, src uint64) error
	copy(dst, src uint64, bytes int64) error
	// memset32 sets n 32-bit words.
	memset32(dst uint64, v uint32, n int64) error
	// launch queues a kernel; args are its parameters, each widened to 64
	// bits as kernelSpecs describes.
	launch(k kernelID, d launchDims, args []uint64) error
	// sync waits for the queued work and reports its first error.
	sync() error
}

// deviceProps are the facts of a device the backend plans with.
type deviceProps struct {
	name string
	// sms is the number of multiprocessors: grids are sized from it.
	sms int
	// cc is the compute capability (major, minor).
	cc [2]int
}
