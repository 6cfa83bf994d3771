package memory

import (
	"bytes"
	"errors"
	"image"
	"image/color"
	"image/png"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/runtime"
)

func fixture(name string) string { return filepath.Join("..", "fixtures", "testdata", name+".pth") }

// TestSaving: on every fixture the conversion keeps less for backward, and
// DenseNets get the shared-buffer row.
func TestSaving(t *testing.T) {
	for _, name := range []string{"tiny_resnet_basic", "tiny_resnext", "tiny_densenet", "tiny_vgg"} {
		t.Run(name, func(t *testing.T) {
			r, err := Run(Options{Input: fixture(name), Batch: 4, Size: 32})
			if err != nil {
				t.Fatal(err)
			}
			if r.Original.SavedBytes <= 0 || r.Converted.SavedBytes >= r.Original.SavedBytes {
				t.Fatalf("saved bytes: original %d, converted %d", r.Original.SavedBytes, r.Converted.SavedBytes)
			}
			if r.Converted.PeakBytes > r.Original.PeakBytes || r.Converted.PeakBytes < r.Converted.SavedBytes {
				t.Fatalf("peaks: original %d, converted %d (saved %d)", r.Original.PeakBytes, r.Converted.PeakBytes, r.Converted.SavedBytes)
			}
			want := 2
			if name == "tiny_densenet" {
				want = 3
			}
			if len(r.Techniques) != want {
				t.Fatalf("%d technique rows, want %d", len(r.Techniques), want)
			}
		})
	}
}

// TestShapesMatchCPU: the shape-only measurement is the computing
// backend's, byte for byte.
func TestShapesMatchCPU(t *testing.T) {
	a, err := Run(Options{Input: fixture("tiny_densenet"), Batch: 2, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Run(Options{Input: fixture("tiny_densenet"), Batch: 2, Size: 32, NewBackend: func() (runtime.Backend, error) { return runtime.NewCPU(1), nil }})
	if err != nil {
		t.Fatal(err)
	}
	for i := range a.Techniques {
		if a.Techniques[i].SavedBytes != b.Techniques[i].SavedBytes || a.Techniques[i].PeakBytes != b.Techniques[i].PeakBytes {
			t.Fatalf("%s: shapes %+v, cpu %+v", a.Techniques[i].Name, a.Techniques[i], b.Techniques[i])
		}
	}
}

// TestMaxBatch: the answer fits and the next batch does not, measured.
func TestMaxBatch(t *testing.T) {
	probe, err := Run(Options{Input: fixture("tiny_resnext"), Batch: 10, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	budget := probe.Original.ParamBytes + probe.Original.PeakBytes + probe.Original.PeakBytes/7 // somewhere past batch 10
	r, err := Run(Options{Input: fixture("tiny_resnext"), Batch: 2, Size: 32, Budget: budget})
	if err != nil {
		t.Fatal(err)
	}
	for _, tech := range r.Techniques {
		if tech.MaxBatch < 10 {
			t.Fatalf("%s: max batch %d, but batch 10 fits %d bytes", tech.Name, tech.MaxBatch, budget)
		}
		at := func(b int) int64 {
			x, err := Run(Options{Input: fixture("tiny_resnext"), Batch: b, Size: 32})
			if err != nil {
				t.Fatal(err)
			}
			for _, y := range x.Techniques {
				if y.Name == tech.Name {
					return y.PeakBytes + x.Original.ParamBytes
				}
			}
			t.Fatalf("no row %s", tech.Name)
			return 0
		}
		if p := at(tech.MaxBatch); p > budget {
			t.Errorf("%s: batch %d peaks at %d > budget %d", tech.Name, tech.MaxBatch, p, budget)
		}
		if p := at(tech.MaxBatch + 1); p <= budget {
			t.Errorf("%s: batch %d also fits (%d <= %d)", tech.Name, tech.MaxBatch+1, p, budget)
		}
	}
	if r.Techniques[1].MaxBatch <= r.Techniques[0].MaxBatch {
		t.Errorf("conversion does not raise the max batch: %+v", r.Techniques)
	}
}

func TestPlot(t *testing.T) {
	r, err := Run(Options{Input: fixture("tiny_densenet"), Batch: 2, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	for _, ext := range []string{".svg", ".png"} {
		b, err := Plot("mem"+ext, r)
		if err != nil || len(b) < 100 {
			t.Fatalf("%s: %v (%d bytes)", ext, err, len(b))
		}
	}
	if _, err := Plot("mem.pdf", r); err == nil {
		t.Fatal("pdf accepted")
	}
	// The PNG carries its labels (it once had lines only): dark pixels
	// where the title, the MiB scale and the axis's name are written.
	b, _ := Plot("mem.png", r)
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	dark := func(r image.Rectangle) (n int) {
		for y := r.Min.Y; y < r.Max.Y; y++ {
			for x := r.Min.X; x < r.Max.X; x++ {
				if c := color.GrayModel.Convert(img.At(x, y)).(color.Gray); c.Y < 0x80 {
					n++
				}
			}
		}
		return n
	}
	for _, area := range []struct {
		what string
		r    image.Rectangle
	}{
		{"title", image.Rect(70, 8, 500, 26)},
		{"MiB scale", image.Rect(0, 40, 66, 430)},
		{"x axis's name", image.Rect(300, 455, 600, 475)},
	} {
		if n := dark(area.r); n < 50 {
			t.Errorf("PNG: %d dark pixels where the %s is written; want text", n, area.what)
		}
	}
}

// deviceBackend is the shape-only backend posing as one on a device: its
// pool and driver figures are the live count plus fixed offsets (its pool
// peak the allocator's peak plus an offset), and it records the trims and
// whether measure closed it.
type deviceBackend struct {
	runtime.Backend
	pool, driver, peak int64 // added to live (peak: to the peak) for the pool's and the driver's figures
	err                error
	trims, closed      *int
}

func (d deviceBackend) DeviceMemory() (runtime.DeviceFigures, error) {
	st := d.Stats()
	return runtime.DeviceFigures{LiveBytes: st.LiveBytes, ReservedBytes: st.LiveBytes + d.pool, PeakReservedBytes: st.PeakBytes + d.pool + d.peak,
		DriverUsedBytes: st.LiveBytes + d.driver, TotalBytes: 1 << 30}, d.err
}

func (d deviceBackend) TrimCache() error {
	*d.trims++
	return nil
}

func (d deviceBackend) Close() error {
	*d.closed++
	return nil
}

// TestDeviceCheck: a backend on a device is read after each forward and its
// driver figure judged against the allocator's; it is closed after the step.
func TestDeviceCheck(t *testing.T) {
	tests := []struct {
		name               string
		pool, driver, peak int64
		err                error
		consistent         bool
		wantErr            bool
	}{
		{name: "driver and pool above live", pool: 4096, driver: 8192, consistent: true},
		{name: "all equal", consistent: true},
		{name: "driver below the pool", pool: 4096, driver: 512, consistent: false},
		{name: "driver below live", pool: 0, driver: -1, consistent: false},
		{name: "pool peak below the step's", pool: 512, driver: 512, peak: -513, consistent: false},
		{name: "driver error", err: errors.New("cuMemGetInfo: CUDA_ERROR_UNKNOWN"), wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			trims, closed := 0, 0
			nb := func() (runtime.Backend, error) {
				return deviceBackend{Backend: runtime.NewShapes(), pool: tc.pool, driver: tc.driver, peak: tc.peak, err: tc.err,
					trims: &trims, closed: &closed}, nil
			}
			r, err := Run(Options{Input: fixture("tiny_resnet_basic"), Batch: 2, Size: 32, NewBackend: nb})
			if tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_UNKNOWN") {
					t.Fatalf("error %v, want the driver's", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range []Figures{r.Original, r.Converted} {
				d := f.Device
				if d == nil {
					t.Fatal("no device check")
				}
				// At the end of the forward the parameters and the saved
				// activations are live.
				if d.LiveBytes < f.SavedBytes+f.ParamBytes || d.LiveBytes > f.PeakBytes+f.ParamBytes {
					t.Errorf("live %d at the forward's end: want saved %d + params %d up to peak %d", d.LiveBytes, f.SavedBytes, f.ParamBytes, f.PeakBytes)
				}
				if d.Consistent != tc.consistent {
					t.Errorf("consistent %v, want %v (%+v)", d.Consistent, tc.consistent, d.DeviceFigures)
				}
			}
			if closed != len(r.Techniques) || trims != len(r.Techniques) {
				t.Errorf("%d backends closed and %d caches trimmed, want %d", closed, trims, len(r.Techniques))
			}
		})
	}
	// The shape-only backend has no device to check.
	r, err := Run(Options{Input: fixture("tiny_resnet_basic"), Batch: 2, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	if r.Original.Device != nil {
		t.Errorf("device check %+v from the shape-only backend", r.Original.Device)
	}
}
