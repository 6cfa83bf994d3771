package cuda

import "fmt"

// launchDims is a kernel launch's grid and block, in threads per axis.
type launchDims struct {
	grid, block [3]int
	shared      int
}

const (
	// blockSize is BLOCK in kernels/common.cuh: the threads per block of
	// every kernel. The GEMM kernel's 64x64 tiles take 256 threads too.
	blockSize = 256
	// The driver's limits on grid and block extents.
	maxGridX        = 1<<31 - 1
	maxGridYZ       = 65535
	maxBlockThreads = 1024
	// loopBlocksPerSM caps the grid of a grid-stride loop: 8 blocks of 256
	// threads fill a multiprocessor's 2048 thread slots, and 4 such waves
	// keep it busy to the end without paying for more block starts.
	loopBlocksPerSM = 32
	// gemmTile is the GEMM kernel's tile (TM and TN in gemm.cu).
	gemmTile = 64
	// maxUnits bounds the units one launch of a kernel that divides flat
	// indices with fdiv may cover (see fastDiv).
	maxUnits = maxDividend
)

// validate checks the launch against the driver's limits.
func (d launchDims) validate() error {
	for i, g := range d.grid {
		limit := maxGridYZ
		if i == 0 {
			limit = maxGridX
		}
		if g < 1 || g > limit {
			return fmt.Errorf("grid %v out of range", d.grid)
		}
	}
	t := 1
	for _, b := range d.block {
		if b < 1 {
			return fmt.Errorf("block %v out of range", d.block)
		}
		t *= b
	}
	if t > maxBlockThreads || t%32 != 0 {
		return fmt.Errorf("block %v: %d threads, want a multiple of 32 up to %d", d.block, t, maxBlockThreads)
	}
	return nil
}

func blocks1(n int) launchDims {
	return launchDims{grid: [3]int{n, 1, 1}, block: [3]int{blockSize, 1, 1}}
}

// loopDims is the launch of a grid-stride loop over n items, one item per
// thread up to loopBlocksPerSM blocks per multiprocessor. n must be
// positive: callers skip empty work.
func loopDims(n int64, sms int) launchDims {
	b := (n + blockSize - 1) / blockSize
	b = min(b, int64(max(sms, 1))*loopBlocksPerSM)
	return blocks1(int(max(b, 1)))
}

// vecDims is the launch of an elementwise kernel over n floats: a loop over
// its n/4 float4 units, whose tail of n%4 floats the first threads of block
// 0 take, so there is always a block.
func vecDims(n int64, sms int) launchDims {
	return loopDims(max(n>>2, 1), sms)
}

// splitsFor is how many blocks share one channel's reduction of units
// units (bn_stats, bn_bwd_reduce): enough blocks over all c channels for
// four waves of the GPU, but no block with less than one unit per thread.
func splitsFor(c int, units int64, sms int) int {
	target := int64(max(sms, 1)) * 4 * 8 // 8 blocks per SM, 4 waves
	s := (target + int64(c) - 1) / int64(c)
	s = min(s, (units+blockSize-1)/blockSize, 1024)
	return int(max(s, 1))
}

// reduceDims is the launch of a per-channel reduction: splits blocks per
// channel along x, channels along y.
func reduceDims(c, splits int) (launchDims, error) {
	d := launchDims{grid: [3]int{splits, c, 1}, block: [3]int{blockSize, 1, 1}}
	if c > maxGridYZ {
		return d, fmt.Errorf("%d channels: the CUDA backend reduces at most %d", c, maxGridYZ)
	}
	return d, d.validate()
}

// gemmDims is the launch of the GEMM kernel for an m×n product, batch
// products at once (batch <= maxGridYZ; the caller splits larger ones).
func gemmDims(m, n, batch int) (launchDims, error) {
	d := launchDims{grid: [3]int{(n + gemmTile - 1) / gemmTile, (m + gemmTile - 1) / gemmTile, batch}, block: [3]int{blockSize, 1, 1}}
	if d.grid[1] > maxGridYZ {
		return d, fmt.Errorf("matrix product with %d rows: the CUDA backend takes at most %d", m, maxGridYZ*gemmTile)
	}
	return d, d.validate()
}

// chunks splits n images into consecutive runs whose per-image size times
// their length stays within limit.
func chunks(n int, perImage, limit int64) ([][2]int, error) {
	if perImage > limit {
		return nil, fmt.Errorf("one image holds %d units, over the %d one launch takes", perImage, limit)
	}
	step := n
	if perImage > 0 {
		step = int(min(int64(n), limit/perImage))
	}
	var out [][2]int
	for i := 0; i < n; i += step {
		out = append(out, [2]int{i, min(i+step, n)})
	}
	return out, nil
}
