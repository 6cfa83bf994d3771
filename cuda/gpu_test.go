//go:build cuda

package cuda

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// The GPU tests: they skip where Open finds no device (a machine without a
// GPU or driver). bench/gpu.sh runs them from a test binary built here
// (go test -c -tags cuda ./cuda), since the GPU machine has no Go:
//
//	ABN_GPU_REPORT=out.jsonl   append each measurement as a JSON line
//	ABN_GPU_BENCH=1            run TestGPUThroughput
//	ABN_GPU_SHAPES=NxCxHxW,... its tensors (four activation sizes of resnet50 at batch 32)
//	ABN_GPU_CHECKPOINTS=a,b    run TestGPUTrainingMemory on these .pth files
//	ABN_GPU_BATCH, ABN_GPU_SIZE  its batch and image size (32, 224)
//	ABN_GPU_STEPS              its training steps per network (2: the first warms up the pool)
//	ABN_GPU_COMPARE=a,b        run TestGPUCheckpointsMatchCPU on these .pth files
//	ABN_GPU_COMPARE_BATCH, ABN_GPU_COMPARE_SIZE  its batch and image size (8, 224)

func openOrSkip(t testing.TB) *Backend {
	t.Helper()
	b, err := Open()
	if err != nil {
		t.Skipf("no GPU: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Error(err)
		}
	})
	return b
}

// report logs v and appends it, with its kind, to $ABN_GPU_REPORT.
func report(t testing.TB, kind string, v map[string]any) {
	t.Helper()
	v["kind"] = kind
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s", b)
	path := os.Getenv("ABN_GPU_REPORT")
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(append(b, '\n')); err != nil {
		t.Fatal(err)
	}
}

// TestOpenError: where there is no GPU, Open's error is one line that
// names the cause (what --device cuda prints).
func TestOpenError(t *testing.T) {
	b, err := Open()
	if err == nil {
		report(t, "device", map[string]any{"device": b.Device()})
		b.Close()
		return
	}
	if msg := err.Error(); !strings.HasPrefix(msg, "cuda: ") || strings.Contains(msg, "\n") {
		t.Errorf("error %q: want one line starting with cuda:", msg)
	}
}

func TestGPUOpsMatchCPU(t *testing.T) {
	openOrSkip(t)
	compareOps(t, openOrSkip)
}

// TestGPUNetworksMatchCPU: the fixture networks at 64x64, the size verify
// uses; eval outputs within 1e-4 of the CPU backend's, relative.
func TestGPUNetworksMatchCPU(t *testing.T) {
	openOrSkip(t)
	x := randomInput(1, 2, 3, 64, 64)
	worst := compareNetworks(t, openOrSkip, x)
	for _, name := range sortedKeys(worst) {
		report(t, "cuda_vs_cpu", map[string]any{"network": name, "input": x.Shape, "worst_relative": worst[name]})
	}
}

// TestGPUCheckpointsMatchCPU: full-size networks (torchvision checkpoints,
// recognised by their keys), original and converted, at batch 8 and
// 224x224 by default: one eval forward and one training step on the GPU
// against the CPU backend: eval and training outputs within 1e-4 relative,
// gradients within 25 times their float32 noise (compareNets).
func TestGPUCheckpointsMatchCPU(t *testing.T) {
	list := os.Getenv("ABN_GPU_COMPARE")
	if list == "" {
		t.Skip("set ABN_GPU_COMPARE")
	}
	openOrSkip(t)
	batch, size := envInt("ABN_GPU_COMPARE_BATCH", 8), envInt("ABN_GPU_COMPARE_SIZE", 224)
	var nets []fixtureNet
	for _, path := range strings.Split(list, ",") {
		name := strings.TrimSuffix(filepath.Base(path), ".pth")
		for _, converted := range []bool{false, true} {
			w := loadWeights(t, path)
			g, _, err := arch.Recognize(w, "auto")
			if err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			n := fixtureNet{name: name, g: g, w: w}
			if converted {
				n.name += " converted"
				if _, err := rewrite.Run(g, w, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}); err != nil {
					t.Fatalf("%s: %v", path, err)
				}
			}
			nets = append(nets, n)
		}
	}
	x := randomInput(1, batch, 3, size, size)
	worst := compareNets(t, nets, goruntime.NumCPU(), 2, openOrSkip, x)
	for _, name := range sortedKeys(worst) {
		report(t, "cuda_vs_cpu", map[string]any{"network": name, "input": x.Shape, "worst_relative": worst[name]})
	}
}

// TestGPUMemCheck: after a training step, the backend's count against the
// driver's free-memory figure.
func TestGPUMemCheck(t *testing.T) {
	b := openOrSkip(t)
	if err := b.TrimCache(); err != nil {
		t.Fatal(err)
	}
	before, err := b.MemCheck()
	if err != nil {
		t.Fatal(err)
	}
	nets := fixtureNets(t)
	n := nets[0]
	for _, c := range nets {
		if strings.HasPrefix(c.name, "tiny_densenet") {
			n = c
		}
	}
	e, err := runtime.New(n.g, n.w, b, runtime.Options{})
	if err != nil {
		t.Fatal(err)
	}
	x := randomInput(3, 8, 3, 224, 224)
	out, err := e.Forward(x, true)
	if err != nil {
		t.Fatal(err)
	}
	atSaved, err := b.MemCheck()
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Backward(gradFor(3, out.Shape)); err != nil {
		t.Fatal(err)
	}
	mem := e.Memory()
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	after, err := b.MemCheck()
	if err != nil {
		t.Fatal(err)
	}
	report(t, "memcheck", map[string]any{"network": n.name, "input": x.Shape, "saved_bytes": mem.SavedBytes, "peak_bytes": mem.PeakBytes,
		"before": before, "after_forward": atSaved, "after_close": after, "driver_delta_after_forward": atSaved.DriverDelta() - before.DriverDelta()})
	if atSaved.LiveBytes-before.LiveBytes != mem.SavedBytes+mem.ParamBytes {
		t.Errorf("live bytes after the forward %d, want saved %d + parameters %d", atSaved.LiveBytes-before.LiveBytes, mem.SavedBytes, mem.ParamBytes)
	}
	if d := atSaved.DriverDelta() - before.DriverDelta(); d < atSaved.LiveBytes-before.LiveBytes {
		t.Errorf("the driver shows %d bytes more in use, fewer than the %d live", d, atSaved.LiveBytes-before.LiveBytes)
	}
	if after.LiveBytes != 0 {
		t.Errorf("%d bytes live after closing the executor", after.LiveBytes)
	}
}

// median times fn reps times on the GPU's clock, after warm-up runs.
func median(t testing.TB, b *Backend, reps int, fn func() error) time.Duration {
	t.Helper()
	d, ok := b.dev.(*driver)
	if !ok {
		t.Fatal("not on the driver")
	}
	for i := 0; i < 3; i++ {
		if err := fn(); err != nil {
			t.Fatal(err)
		}
	}
	times := make([]time.Duration, reps)
	for i := range times {
		var err error
		if times[i], err = d.timeGPU(fn); err != nil {
			t.Fatal(err)
		}
	}
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	return times[reps/2]
}

// fill uploads values of a fixed pseudo-random sequence, about N(0, 1).
func fill(t testing.TB, b *Backend, x runtime.Tensor, seed uint64) {
	t.Helper()
	v := make([]float32, numel(x.Shape()))
	s := seed*0x9E3779B97F4A7C15 + 1
	for i := range v {
		// Sum of four uniforms: cheap and near enough to a normal.
		var u float32
		for k := 0; k < 4; k++ {
			s = s*6364136223846793005 + 1442695040888963407
			u += float32(s>>40) / (1 << 24)
		}
		v[i] = (u - 2) * 1.7
	}
	if err := b.Upload(x, v); err != nil {
		t.Fatal(err)
	}
}

// TestGPUThroughput measures InPlace-ABN's kernels on activation-sized
// tensors: bytes moved over time, against the device's own device-to-device
// copy (which reads and writes each byte once). The forward reads x for the
// statistics, then reads and writes it in place: 12 bytes per value. The
// backward reads z and dz for its sums, then reads both and writes dx: 20
// bytes per value.
func TestGPUThroughput(t *testing.T) {
	if os.Getenv("ABN_GPU_BENCH") == "" {
		t.Skip("set ABN_GPU_BENCH=1")
	}
	b := openOrSkip(t)
	shapes := [][]int{{32, 64, 112, 112}, {32, 256, 56, 56}, {32, 512, 28, 28}, {256, 2048, 7, 7}}
	if s := os.Getenv("ABN_GPU_SHAPES"); s != "" {
		shapes = nil
		for _, part := range strings.Split(s, ",") {
			var shape []int
			for _, d := range strings.Split(part, "x") {
				v, err := strconv.Atoi(d)
				if err != nil || v < 1 {
					t.Fatalf("ABN_GPU_SHAPES %q: want NxCxHxW,...", s)
				}
				shape = append(shape, v)
			}
			if len(shape) != 4 {
				t.Fatalf("ABN_GPU_SHAPES %q: want NxCxHxW,...", s)
			}
			shapes = append(shapes, shape)
		}
	}
	p := runtime.NormParams{Eps: 1e-5, AbsWeight: true, Act: runtime.Act{Kind: runtime.ActLeakyReLU, Param: 0.01}}
	const reps = 20
	for _, shape := range shapes {
		n := numel(shape)
		c := shape[1]
		alloc := func(s ...int) runtime.Tensor {
			x, err := b.Alloc(s, runtime.Float32)
			if err != nil {
				t.Fatal(err)
			}
			return x
		}
		x, y, dz, dx := alloc(shape...), alloc(shape...), alloc(shape...), alloc(shape...)
		mean, variance, w, bias, rm, rv, dw, db := alloc(c), alloc(c), alloc(c), alloc(c), alloc(c), alloc(c), alloc(c), alloc(c)
		fill(t, b, x, 1)
		fill(t, b, dz, 2)
		for i, v := range []runtime.Tensor{w, bias, rm, rv} {
			fill(t, b, v, uint64(10+i))
		}
		xt, yt := x.(*tensor), y.(*tensor)
		bytes := n * 4
		copyT := median(t, b, reps, func() error { return b.dev.copy(yt.ptr, xt.ptr, bytes) })
		statsT := median(t, b, reps, func() error { return b.BatchStats(mean, variance, x, nil) })
		// The apply phase alone, out of place so that x stays as it is.
		applyT := median(t, b, reps, func() error { return b.Normalize(y, x, nil, mean, variance, w, bias, p) })
		// The whole training forward, in place on y (a copy of x per run
		// would double the traffic; normalising normalised values keeps
		// them finite).
		if err := b.Copy(y, x); err != nil {
			t.Fatal(err)
		}
		fwdT := median(t, b, reps, func() error {
			if err := b.BatchStats(mean, variance, y, nil); err != nil {
				return err
			}
			if err := b.UpdateRunning(rm, rv, mean, variance, 0.1, int(n/int64(c))); err != nil {
				return err
			}
			return b.Normalize(y, y, nil, mean, variance, w, bias, p)
		})
		// The backward from y (an InPlace-ABN output) and dz into dx.
		bwdT := median(t, b, reps, func() error {
			return b.NormalizeBackwardFromOutput(dx, dw, db, dz, y, nil, variance, w, bias, p, true)
		})
		bw := func(mult int64, d time.Duration) float64 { return float64(mult*bytes) / d.Seconds() / 1e9 }
		copyBW := bw(2, copyT)
		report(t, "throughput", map[string]any{
			"shape": shape, "float4": shape[2]*shape[3]%4 == 0,
			"copy_ms": ms(copyT), "copy_GBps": copyBW,
			"stats_ms": ms(statsT), "stats_GBps": bw(1, statsT),
			"apply_ms": ms(applyT), "apply_GBps": bw(2, applyT),
			"forward_ms": ms(fwdT), "forward_GBps": bw(3, fwdT), "forward_of_copy": bw(3, fwdT) / copyBW,
			"backward_ms": ms(bwdT), "backward_GBps": bw(5, bwdT), "backward_of_copy": bw(5, bwdT) / copyBW,
		})
		for _, v := range []runtime.Tensor{x, y, dz, dx, mean, variance, w, bias, rm, rv, dw, db} {
			if err := b.Free(v); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func ms(d time.Duration) float64 { return math.Round(d.Seconds()*1e6) / 1e3 }

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// TestGPUTrainingMemory runs one training step of each checkpoint's network,
// as read and as converted (InPlace-ABN, leaky ReLU 0.01, DenseNet shared
// buffers), on the GPU: the runtime's memory report (from the backend's
// allocator), the caching pool's peak reservation and the driver's figure,
// the step's time, and the shape-only backend's report for the same step,
// which the allocator's counts must equal.
func TestGPUTrainingMemory(t *testing.T) {
	list := os.Getenv("ABN_GPU_CHECKPOINTS")
	if list == "" {
		t.Skip("set ABN_GPU_CHECKPOINTS")
	}
	b := openOrSkip(t)
	batch, size := envInt("ABN_GPU_BATCH", 32), envInt("ABN_GPU_SIZE", 224)
	steps := envInt("ABN_GPU_STEPS", 2)
	x := randomInput(4, batch, 3, size, size)
	for _, path := range strings.Split(list, ",") {
		for _, converted := range []bool{false, true} {
			w := loadWeights(t, path)
			g, match, err := arch.Recognize(w, "auto")
			if err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			variant := "original"
			if converted {
				variant = "converted"
				if _, err := rewrite.Run(g, w, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}); err != nil {
					t.Fatalf("%s: %v", path, err)
				}
			}
			step := func(be runtime.Backend) (runtime.MemoryReport, time.Duration, MemCheck) {
				e, err := runtime.New(g, w, be, runtime.Options{Seed: 1})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				var mc MemCheck
				var took time.Duration
				for i := 0; i < steps; i++ { // the first of two warms up the pool
					start := time.Now()
					out, err := e.Forward(x, true)
					if err != nil {
						t.Fatal(err)
					}
					if gb, ok := be.(*Backend); ok {
						if mc, err = gb.MemCheck(); err != nil {
							t.Fatal(err)
						}
					}
					if _, _, err := e.Backward(gradFor(4, out.Shape)); err != nil {
						t.Fatal(err)
					}
					took = time.Since(start)
				}
				return e.Memory(), took, mc
			}
			if err := b.TrimCache(); err != nil {
				t.Fatal(err)
			}
			mem, took, atSaved := step(b)
			after, err := b.MemCheck()
			if err != nil {
				t.Fatal(err)
			}
			shapes, _, _ := step(runtime.NewShapes())
			if shapes.SavedBytes != mem.SavedBytes || shapes.PeakBytes != mem.PeakBytes {
				t.Errorf("%s %s: cuda saved %d peak %d, shape-only %d %d", path, variant, mem.SavedBytes, mem.PeakBytes, shapes.SavedBytes, shapes.PeakBytes)
			}
			report(t, "training_memory", map[string]any{
				"checkpoint": filepath.Base(path), "arch": match.Arch, "variant": variant, "batch": batch, "size": size,
				"saved_bytes": mem.SavedBytes, "peak_bytes": mem.PeakBytes, "param_bytes": mem.ParamBytes,
				"shape_only_saved_bytes": shapes.SavedBytes, "shape_only_peak_bytes": shapes.PeakBytes,
				"pool_peak_reserved_bytes": after.PeakReservedBytes, "driver_delta_after_forward": atSaved.DriverDelta(),
				"step_ms": ms(took),
			})
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
