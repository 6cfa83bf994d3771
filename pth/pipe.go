package pth

import (
	"hash/crc32"
	"io"
)

// pipeBuffers is how many buffers pipeCopy reads ahead into.
const pipeBuffers = 3

// pipeCopy copies exactly size bytes from src to dst and returns their
// CRC-32 (0 unless sum). Reading (and checksumming) runs in its own goroutine, a few
// buffers ahead of writing, so that on two cores a record is read and
// written at the same time: the copy then costs about as much as its
// slower half, not the sum. It reads into bufs (the caller's, reused from
// record to record), so memory stays at their size.
func pipeCopy(dst io.Writer, src io.Reader, size int64, bufs [][]byte, sum bool) (int64, uint32, error) {
	type chunk struct {
		b   []byte
		err error
	}
	free := make(chan []byte, len(bufs))
	for _, b := range bufs {
		free <- b
	}
	full := make(chan chunk, len(bufs))
	stop := make(chan struct{})
	var crc uint32
	go func() {
		defer close(full)
		src := io.LimitReader(src, size)
		for {
			var b []byte
			select {
			case b = <-free:
			case <-stop:
				return
			}
			n, err := io.ReadFull(src, b)
			if sum {
				crc = crc32.Update(crc, crc32.IEEETable, b[:n])
			}
			if n > 0 {
				full <- chunk{b: b[:n]}
			}
			if err == io.EOF || err == io.ErrUnexpectedEOF {
				return
			}
			if err != nil {
				full <- chunk{err: err}
				return
			}
		}
	}()
	var written int64
	var werr error
	for c := range full {
		if c.err != nil {
			werr = c.err
			break
		}
		n, err := dst.Write(c.b)
		written += int64(n)
		if err != nil {
			werr = err
			break
		}
		free <- c.b[:cap(c.b)]
	}
	close(stop)
	for range full { // let the reader finish before crc is read
	}
	return written, crc, werr
}
