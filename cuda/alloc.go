package cuda

import (
	"fmt"
	"sync"
)

// memory is what the caching pool needs of a device.
type memory interface {
	alloc(bytes int64) (uint64, error)
	free(ptr uint64) error
}

// blockRound is the pool's granularity, as PyTorch's caching allocator's
// smallest block: sizes are rounded up to it, so that tensors of nearly
// equal sizes share cached blocks.
const blockRound = 512

// pool is a caching allocator over a device's memory. cuMemAlloc and
// cuMemFree are slow, and cuMemFree waits for the whole device, so freed
// blocks are kept by rounded size and handed out again: a training loop
// allocates the same sizes every step. The pool is shared by every backend
// on a device (each keeps its own count of live tensor bytes) and by their
// scratch buffers; it accounts for the memory it holds from the driver
// (reserved), which MemCheck compares with the driver's own figure.
type pool struct {
	mu   sync.Mutex
	mem  memory
	used map[uint64]int64   // blocks handed out, by pointer: rounded size
	free map[int64][]uint64 // cached blocks by rounded size

	reserved, peakReserved, cached int64
	hits, misses                   int
}

func newPool(mem memory) *pool {
	return &pool{mem: mem, used: map[uint64]int64{}, free: map[int64][]uint64{}}
}

func roundBlock(bytes int64) int64 {
	return (bytes + blockRound - 1) / blockRound * blockRound
}

// get returns a block of at least bytes; 0 bytes gives the null pointer,
// which no kernel reads (callers skip empty work).
func (p *pool) get(bytes int64) (uint64, error) {
	if bytes < 0 {
		return 0, fmt.Errorf("cuda: allocation of %d bytes", bytes)
	}
	if bytes == 0 {
		return 0, nil
	}
	size := roundBlock(bytes)
	p.mu.Lock()
	defer p.mu.Unlock()
	if l := p.free[size]; len(l) > 0 {
		ptr := l[len(l)-1]
		p.free[size] = l[:len(l)-1]
		p.cached -= size
		p.used[ptr] = size
		p.hits++
		return ptr, nil
	}
	ptr, err := p.mem.alloc(size)
	if err != nil {
		// Out of memory, perhaps only for want of the cached blocks of
		// other sizes: give them back and try once more.
		if p.cached == 0 {
			return 0, fmt.Errorf("cuda: allocating %d bytes: %w", size, err)
		}
		if terr := p.trimLocked(); terr != nil {
			return 0, fmt.Errorf("cuda: allocating %d bytes: %w (and releasing the cache: %v)", size, err, terr)
		}
		if ptr, err = p.mem.alloc(size); err != nil {
			return 0, fmt.Errorf("cuda: allocating %d bytes with an empty cache: %w", size, err)
		}
	}
	if _, dup := p.used[ptr]; dup {
		return 0, fmt.Errorf("cuda: the device returned block %#x twice", ptr)
	}
	p.used[ptr] = size
	p.misses++
	p.reserved += size
	p.peakReserved = max(p.peakReserved, p.reserved)
	return ptr, nil
}

// put takes a block back into the cache.
func (p *pool) put(ptr uint64) error {
	if ptr == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	size, ok := p.used[ptr]
	if !ok {
		return fmt.Errorf("cuda: freeing block %#x, which the pool did not hand out (or already took back)", ptr)
	}
	delete(p.used, ptr)
	p.free[size] = append(p.free[size], ptr)
	p.cached += size
	return nil
}

// trim gives every cached block back to the driver and starts the peak
// of reserved bytes again from what is left.
func (p *pool) trim() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	err := p.trimLocked()
	p.peakReserved = p.reserved
	return err
}

func (p *pool) trimLocked() error {
	var first error
	for size, l := range p.free {
		for _, ptr := range l {
			if err := p.mem.free(ptr); err != nil {
				if first == nil {
					first = fmt.Errorf("cuda: releasing block %#x: %w", ptr, err)
				}
				continue
			}
			p.reserved -= size
			p.cached -= size
		}
		delete(p.free, size)
	}
	return first
}

// poolStats is the pool's count.
type poolStats struct {
	reserved, peakReserved, cached int64
	hits, misses                   int
}

func (p *pool) stats() poolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return poolStats{reserved: p.reserved, peakReserved: p.peakReserved, cached: p.cached, hits: p.hits, misses: p.misses}
}

// counter is a backend's count of its live tensors, kept exactly as the
// runtime's CPU and shape-only backends keep theirs (tensor bytes, not
// rounded block sizes), so that every backend reports the same memory
// figures for the same plan.
type counter struct {
	live, peak int64
	allocs     int
}

func (c *counter) add(n int64) {
	c.live += n
	c.allocs++
	c.peak = max(c.peak, c.live)
}

func (c *counter) sub(n int64) { c.live -= n }
