package runtime

import (
	"math"
	"os"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/model"
)

// benchWeights fills a shapes state dict with values: He-uniform convolution
// and linear weights from a fixed generator, BN at its initial state (so
// activations stay in range and no denormals slow the arithmetic down).
func benchWeights(ts []tvTensor) *graph.MemWeights {
	w := graph.NewMemWeights()
	state := uint64(1)
	next := func() float64 {
		state = state*6364136223846793005 + 1442695040888963407
		return float64(state>>11)/(1<<53)*2 - 1
	}
	for _, t := range ts {
		n := graph.Numel(t.shape)
		v := make([]float64, n)
		switch {
		case len(t.shape) >= 2:
			fan := n / t.shape[0]
			s := math.Sqrt(6 / float64(fan))
			for i := range v {
				v[i] = s * next()
			}
		case hasSuffix(t.key, ".running_var") || bnWeight(ts, t.key):
			for i := range v {
				v[i] = 1
			}
		}
		w.Put(t.key, t.shape, v)
	}
	return w
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// BenchmarkResNet50Step times one training step (forward and backward) of
// torchvision's resnet50 on the CPU backend: batch 8, 3x224x224 (the issue's
// target), or batch 2, 3x64x64 with -short. RUNTIME_BENCH_BATCH,
// RUNTIME_BENCH_SIZE and RUNTIME_BENCH_THREADS override.
func BenchmarkResNet50Step(b *testing.B) {
	batch, size := 8, 224
	if testing.Short() {
		batch, size = 2, 64
	}
	g, _ := recognise(b, "resnet50")
	benchStep(b, g, benchWeights(tvModels["resnet50"]()), batch, size)
}

// BenchmarkModelStep times the same step for the network in the file
// RUNTIME_BENCH_MODEL names: a whole pickled module, or a state dict with
// RUNTIME_BENCH_GRAPH (its ONNX export) or of a recognised architecture. It
// opens the file the way verify and memory do (model.OpenNetwork), so any
// network abnconvert reads can be timed, and bench/runtime.sh gives
// PyTorch the very module it saved. Batch 8, 3x224x224 unless the
// variables above say otherwise; skipped when no file is named.
func BenchmarkModelStep(b *testing.B) {
	path := os.Getenv("RUNTIME_BENCH_MODEL")
	if path == "" {
		b.Skip("RUNTIME_BENCH_MODEL names no model file (bench/runtime.sh sets it)")
	}
	n, err := model.OpenNetwork(path, model.Options{Graph: os.Getenv("RUNTIME_BENCH_GRAPH")})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Close()
	benchStep(b, n.Graph, n.Weights, 8, 224)
}

// benchStep times forward+backward in training mode of g over w, batch x
// 3 x size x size unless RUNTIME_BENCH_BATCH and RUNTIME_BENCH_SIZE say
// otherwise. RUNTIME_BENCH_OPS=1 prints where the time of the last step
// went, by op and direction.
func benchStep(b *testing.B, g *graph.Graph, w graph.Weights, batch, size int) {
	batch, size = envInt("RUNTIME_BENCH_BATCH", batch), envInt("RUNTIME_BENCH_SIZE", size)
	byOp := map[string]time.Duration{}
	var opt Options
	if os.Getenv("RUNTIME_BENCH_OPS") != "" {
		opt.Trace = func(phase string, _, _ int, n *graph.Node, d time.Duration) {
			k := phase + " " + string(n.Op)
			if n.Op == graph.OpConv && n.Attr.Groups > 1 && n.Attr.Groups == n.Attr.InChannels {
				k += " (depthwise)"
			}
			byOp[k] += d
		}
		defer func() {
			keys := make([]string, 0, len(byOp))
			for k := range byOp {
				keys = append(keys, k)
			}
			sort.Slice(keys, func(i, j int) bool { return byOp[keys[i]] > byOp[keys[j]] })
			for _, k := range keys {
				b.Logf("%-28s %8.3fs", k, byOp[k].Seconds()/float64(b.N))
			}
		}()
	}
	e, err := New(g, w, NewCPU(envInt("RUNTIME_BENCH_THREADS", 0)), opt)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	x := NewHostTensor(batch, 3, size, size)
	state := uint32(7)
	for i := range x.Data {
		state = state*1664525 + 1013904223
		x.Data[i] = float32(state>>8)/(1<<24)*2 - 1
	}
	// The output's shape is the network's (logits, or a segmentation map
	// at the input's resolution): one untimed step learns it and warms up.
	y, err := e.Forward(x, true)
	if err != nil {
		b.Fatal(err)
	}
	dOut := NewHostTensor(y.Shape...)
	for i := range dOut.Data {
		dOut.Data[i] = 1e-3
	}
	if _, _, err := e.Backward(dOut); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(batch), "batch")
	b.ReportMetric(float64(size), "size")
	b.ResetTimer()
	clear(byOp)
	for i := 0; i < b.N; i++ {
		if _, err := e.Forward(x, true); err != nil {
			b.Fatal(err)
		}
		if _, _, err := e.Backward(dOut); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkGEMM measures the micro-kernel on a product the size of a
// resnet50 layer3 3x3 convolution for one image (256x196x2304).
func BenchmarkGEMM(b *testing.B) {
	m, n, k := 256, 196, 2304
	a, bb, c := make([]float32, m*k), make([]float32, k*n), make([]float32, m*n)
	for i := range a {
		a[i] = float32(i%7) * 0.1
	}
	for i := range bb {
		bb[i] = float32(i%5) * 0.1
	}
	b.SetBytes(0)
	for i := 0; i < b.N; i++ {
		sgemm(false, false, m, n, k, a, k, bb, n, c, n, false)
	}
	b.ReportMetric(2*float64(m*n*k)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}
