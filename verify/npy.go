package verify

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"strconv"
	"strings"

	"github.com/abnconvert/abnconvert/runtime"
)

// ReadNPY reads a float32 or float64 NumPy array of shape [N, C, H, W]
// (C-order, little-endian), the input format of --input-data. Declared
// sizes are checked against the file before anything is allocated.
func ReadNPY(path string) (*runtime.HostTensor, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	fail := func(format string, a ...any) error {
		return fmt.Errorf("%s: not a usable .npy input: "+format, append([]any{path}, a...)...)
	}
	var pre [10]byte
	if _, err := io.ReadFull(f, pre[:]); err != nil || string(pre[:6]) != "\x93NUMPY" {
		return nil, fail("no NumPy magic")
	}
	var hlen int64
	switch pre[6] {
	case 1:
		hlen = int64(binary.LittleEndian.Uint16(pre[8:10]))
	case 2, 3:
		var more [2]byte
		if _, err := io.ReadFull(f, more[:]); err != nil {
			return nil, fail("truncated header")
		}
		hlen = int64(binary.LittleEndian.Uint32(append(pre[8:10:10], more[:]...)))
	default:
		return nil, fail("format version %d", pre[6])
	}
	if hlen > 1<<16 || hlen > st.Size() {
		return nil, fail("header of %d bytes", hlen)
	}
	hdr := make([]byte, hlen)
	if _, err := io.ReadFull(f, hdr); err != nil {
		return nil, fail("truncated header")
	}
	h := string(hdr)
	descr := regexp.MustCompile(`'descr':\s*'([^']*)'`).FindStringSubmatch(h)
	order := regexp.MustCompile(`'fortran_order':\s*(True|False)`).FindStringSubmatch(h)
	shapeM := regexp.MustCompile(`'shape':\s*\(([^)]*)\)`).FindStringSubmatch(h)
	if descr == nil || order == nil || shapeM == nil {
		return nil, fail("header %q", strings.TrimSpace(h))
	}
	if order[1] != "False" {
		return nil, fail("Fortran order; save a C-order array")
	}
	var size int64
	switch descr[1] {
	case "<f4":
		size = 4
	case "<f8":
		size = 8
	default:
		return nil, fail("dtype %s; want float32 (<f4) or float64 (<f8)", descr[1])
	}
	var shape []int
	n := int64(1)
	for _, p := range strings.Split(shapeM[1], ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		d, err := strconv.Atoi(p)
		if err != nil || d <= 0 {
			return nil, fail("shape (%s)", shapeM[1])
		}
		shape = append(shape, d)
		n *= int64(d)
		if n > st.Size() {
			return nil, fail("shape (%s) is larger than the file", shapeM[1])
		}
	}
	if len(shape) != 4 {
		return nil, fail("shape (%s); want [N, C, H, W]", shapeM[1])
	}
	off, _ := f.Seek(0, io.SeekCurrent)
	if st.Size()-off != n*size {
		return nil, fail("%d data bytes for shape %v (%d expected)", st.Size()-off, shape, n*size)
	}
	raw := make([]byte, n*size)
	if _, err := io.ReadFull(f, raw); err != nil {
		return nil, fail("%v", err)
	}
	x := &runtime.HostTensor{Shape: shape, Data: make([]float32, n)}
	for i := range x.Data {
		if size == 4 {
			x.Data[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		} else {
			x.Data[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(raw[8*i:])))
		}
	}
	return x, nil
}
