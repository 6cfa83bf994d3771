package runtime

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
)

// TestHalfStorage: 16-bit tensors of the CPU backend hold values rounded as
// PyTorch rounds them (to nearest, ties to even, overflow to infinity,
// subnormals kept), and ops that compute in float32 from them write their
// results back rounded, in place included.
func TestHalfStorage(t *testing.T) {
	tests := []struct {
		dt       DType
		in, want float32
	}{
		{BFloat16, 1, 1},
		{BFloat16, 1 + 1.0/256, 1},                  // halfway, to the even 1.0
		{BFloat16, 1 + 3.0/256, 1 + 4.0/256},        // halfway, to the even neighbour
		{BFloat16, 1 + 1.0/256 + 1e-7, 1 + 2.0/256}, // past halfway
		{BFloat16, math.MaxFloat32, float32(math.Inf(1))},
		{Float16, 65519, 65504},
		{Float16, 65520, float32(math.Inf(1))}, // halfway to 65536, to the even infinity
		{Float16, 1 + 1.0/2048, 1},
		{Float16, 1 + 3.0/2048, 1 + 4.0/2048},
		{Float16, 1.0 / (1 << 25), 0}, // halfway to the smallest subnormal, to zero
		{Float16, 1.5 / (1 << 25), 1.0 / (1 << 24)},
		{Float16, 1023.5 / (1 << 24), 1.0 / (1 << 14)}, // up into the normals
	}
	b := NewCPU(1)
	for _, dt := range []DType{BFloat16, Float16} {
		var in, want []float32
		for _, tc := range tests {
			if tc.dt == dt {
				in, want = append(in, tc.in), append(want, tc.want)
			}
		}
		x, err := b.Alloc([]int{len(in)}, dt)
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Upload(x, in); err != nil {
			t.Fatal(err)
		}
		got := make([]float32, len(in))
		if err := b.Download(x, got); err != nil {
			t.Fatal(err)
		}
		for k := range in {
			if got[k] != want[k] || Round16(dt, in[k]) != want[k] {
				t.Errorf("%v: %g stored as %g (Round16 %g), want %g", dt, in[k], got[k], Round16(dt, in[k]), want[k])
			}
		}
		// An op computing in place on the 16-bit tensor: 1+2^-12 is exact
		// in float32, and rounds back to 1 in either format.
		y, _ := b.Alloc([]int{2}, dt)
		b.Upload(y, []float32{1, -3})
		one, _ := b.Alloc([]int{2}, Float32)
		b.Upload(one, []float32{1.0 / 4096, 0.5})
		if err := b.Accumulate(y, one); err != nil {
			t.Fatal(err)
		}
		if err := b.Activation(y, y, Act{Kind: ActReLU}); err != nil {
			t.Fatal(err)
		}
		b.Download(y, got[:2])
		if got[0] != 1 || got[1] != 0 {
			t.Errorf("%v: 1 + 2^-12 and relu(-2.5) stored as %v, want [1 0]", dt, got[:2])
		}
		if b.Stats().LiveBytes != int64(2*len(in)+2*2+2*4) {
			t.Errorf("%v: %d bytes live, want 16-bit storage counted at 2 bytes", dt, b.Stats().LiveBytes)
		}
		for _, tt := range []Tensor{x, y, one} {
			b.Free(tt)
		}
	}
}

// TestHalfSavedBytes: under Options.Half what is kept is 16-bit, but BN
// statistics, and Conv2d weights are kept as 16-bit copies, as autocast
// keeps them. Hand-worked sums, both backends.
func TestHalfSavedBytes(t *testing.T) {
	const act16 = 2 * 4 * 5 * 5 * 2
	const w16 = 4 * 4 * 3 * 3 * 2
	h := newHand(4)
	x := h.conv("c1", h.g.Input, 4, 4, 3, 1)
	x = h.norm("bn", graph.OpBatchNorm, x, 4, "", 0)
	x = h.g.Add("relu", graph.OpReLU, graph.Attr{}, nil, x)
	h.conv("c2", x, 4, 4, 3, 1)
	// c1 keeps the (16-bit) input and its weight copy, bn the conv output
	// and float32 statistics, relu its result, which c2 keeps with its
	// weight copy.
	want := int64(act16 + w16 + act16 + 2*16 + act16 + w16)
	for _, dt := range []DType{BFloat16, Float16} {
		var saved []int64
		for _, b := range []Backend{NewCPU(2), NewShapes()} {
			e, err := New(h.g, h.w, b, Options{Half: dt})
			if err != nil {
				t.Fatal(err)
			}
			in := NewHostTensor(2, 4, 5, 5)
			for i := range in.Data {
				in.Data[i] = float32(math.Sin(float64(i)))
			}
			out, err := e.Forward(in, true)
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := e.Backward(NewHostTensor(out.Shape...)); err != nil {
				t.Fatal(err)
			}
			m := e.Memory()
			saved = append(saved, m.SavedBytes)
			checkLayers(t, fmt.Sprintf("%v on %s", dt, b.Name()), m)
			e.Close()
			if live := b.Stats().LiveBytes; live != 0 {
				t.Errorf("%v on %s: %d bytes still allocated after Close", dt, b.Name(), live)
			}
		}
		if saved[0] != want || saved[1] != want {
			t.Errorf("%v: saved %v bytes (cpu, shapes), want %d", dt, saved, want)
		}
	}
	if _, err := New(h.g, h.w, NewShapes(), Options{Half: Int64}); err == nil {
		t.Error("Options.Half int64 accepted")
	}
}

// step is one training step's results.
type stepResult struct {
	out, dx []float32
	grads   map[string][]float32
	running map[string][]float32
	mem     MemoryReport
	work    WorkReport
}

func trainStep(t *testing.T, g *graph.Graph, w graph.Weights, b Backend, opt Options, x *HostTensor, dout []float32) stepResult {
	t.Helper()
	e, err := New(g, w, b, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	out, err := e.Forward(x, true)
	if err != nil {
		t.Fatal(err)
	}
	dy := &HostTensor{Shape: out.Shape}
	if b.Executes() {
		dy.Data = dout
	}
	dx, grads, err := e.Backward(dy)
	if err != nil {
		t.Fatal(err)
	}
	running, err := e.RunningStats()
	if err != nil {
		t.Fatal(err)
	}
	return stepResult{out: out.Data, dx: dx.Data, grads: grads, running: running, mem: e.Memory(), work: e.Work()}
}

// variants are the graphs of a fixture the policies are tried on: the
// original, the original with plain-BN shared buffers where it has dense
// layers, and the conversion, with and without its shared buffers.
type netVariant struct {
	name string
	g    *graph.Graph
	w    graph.Weights
	opt  Options
}

func netVariants(t *testing.T, name string) (*netGolden, []netVariant) {
	t.Helper()
	gold, w := loadNet(t, name)
	g0, _, err := arch.Recognize(w, "auto")
	if err != nil {
		t.Fatal(err)
	}
	vs := []netVariant{{name: "original", g: g0, w: w}}
	if gs, _, _ := arch.Recognize(w, "auto"); MarkSharedBuffers(gs) > 0 {
		vs = append(vs, netVariant{name: "original, shared buffers", g: gs, w: w})
	}
	wc := copyWeights(w)
	gc, _, err := arch.Recognize(wc, "auto")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rewrite.Run(gc, wc, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01}); err != nil {
		t.Fatal(err)
	}
	vs = append(vs, netVariant{name: "InPlace-ABN", g: gc, w: wc, opt: Options{NoRecompute: true}}, netVariant{name: "InPlace-ABN, shared buffers", g: gc, w: wc})
	return gold, vs
}

// TestCheckpointBitwise: checkpointing changes no number of a training step:
// the recomputation reruns the same ops on the same inputs with the batch
// statistics of the forward pass, so outputs, input and parameter gradients
// and running statistics (updated once) are bit for bit those of the plain
// step, on every fixture and graph variant. What it keeps is less, the same
// on both backends, and the recomputed work is the segments' forward work.
func TestCheckpointBitwise(t *testing.T) {
	for _, name := range []string{"tiny_densenet", "tiny_resnext", "tiny_vgg"} {
		gold, vs := netVariants(t, name)
		x := &HostTensor{Shape: gold.Input.Shape, Data: f32(gold.Input.Values)}
		dout := f32(gold.Train.Dout)
		for _, v := range vs {
			for _, half := range []DType{Float32, BFloat16} {
				base := v.opt
				base.Seed, base.Half = gold.Seed, half
				ref := trainStep(t, v.g, v.w, NewCPU(2), base, x, dout)
				for _, c := range []Checkpointing{CheckpointBlocks, CheckpointSqrt} {
					t.Run(fmt.Sprintf("%s/%s/%v/%s", name, v.name, half, c), func(t *testing.T) {
						opt := base
						opt.Checkpoint = c
						got := trainStep(t, v.g, v.w, NewCPU(2), opt, x, dout)
						if !reflect.DeepEqual(got.out, ref.out) || !reflect.DeepEqual(got.dx, ref.dx) {
							t.Errorf("output or input gradient differs from the plain step")
						}
						if !reflect.DeepEqual(got.grads, ref.grads) {
							t.Errorf("parameter gradients differ from the plain step")
						}
						if !reflect.DeepEqual(got.running, ref.running) {
							t.Errorf("running statistics differ from the plain step")
						}
						if got.mem.SavedBytes >= ref.mem.SavedBytes {
							t.Errorf("keeps %d bytes, the plain step %d", got.mem.SavedBytes, ref.mem.SavedBytes)
						}
						shapes := trainStep(t, v.g, v.w, NewShapes(), opt, x, nil)
						if shapes.mem.SavedBytes != got.mem.SavedBytes || shapes.mem.PeakBytes != got.mem.PeakBytes || shapes.work != got.work {
							t.Errorf("shapes backend: saved %d peak %d %+v; cpu: saved %d peak %d %+v", shapes.mem.SavedBytes, shapes.mem.PeakBytes, shapes.work,
								got.mem.SavedBytes, got.mem.PeakBytes, got.work)
						}
						checkLayers(t, "checkpointed", got.mem)
						// The same forward and backward work, plus every
						// segment node's forward once more.
						segs, err := Segments(v.g, c)
						if err != nil {
							t.Fatal(err)
						}
						p, err := makePlan(v.g, indexOf(v.g), x.Shape, true, true, false)
						if err != nil {
							t.Fatal(err)
						}
						want := ref.work.RecomputeFLOPs
						for _, s := range segs {
							for i := s.Start; i <= s.End; i++ {
								want += p.flops[i].fwd
							}
						}
						if got.work.ForwardFLOPs != ref.work.ForwardFLOPs || got.work.BackwardFLOPs != ref.work.BackwardFLOPs || got.work.RecomputeFLOPs != want {
							t.Errorf("work %+v, want the plain step's %+v with %d recomputed", got.work, ref.work, want)
						}
					})
				}
			}
		}
	}
}

// TestSharedBuffersPlainBN: the memory-efficient DenseNet with plain BN and
// ReLU (groups of four nodes) computes the same step bit for bit and keeps
// less.
func TestSharedBuffersPlainBN(t *testing.T) {
	gold, w := loadNet(t, "tiny_densenet")
	g, _, err := arch.Recognize(w, "auto")
	if err != nil {
		t.Fatal(err)
	}
	x := &HostTensor{Shape: gold.Input.Shape, Data: f32(gold.Input.Values)}
	dout := f32(gold.Train.Dout)
	ref := trainStep(t, g, w, NewCPU(2), Options{Seed: gold.Seed}, x, dout)
	gm, _, _ := arch.Recognize(w, "auto")
	n := MarkSharedBuffers(gm)
	if n == 0 {
		t.Fatal("no dense layer marked")
	}
	if again := MarkSharedBuffers(gm); again != 0 {
		t.Errorf("marking twice marked %d more", again)
	}
	got := trainStep(t, gm, w, NewCPU(2), Options{Seed: gold.Seed}, x, dout)
	if !reflect.DeepEqual(got.out, ref.out) || !reflect.DeepEqual(got.dx, ref.dx) || !reflect.DeepEqual(got.grads, ref.grads) || !reflect.DeepEqual(got.running, ref.running) {
		t.Error("the shared-buffer step differs from the plain one")
	}
	if got.mem.SavedBytes >= ref.mem.SavedBytes {
		t.Errorf("shared buffers keep %d bytes, plain %d", got.mem.SavedBytes, ref.mem.SavedBytes)
	}
	if got.work.RecomputeFLOPs <= 0 {
		t.Error("refilling the buffers counts no work")
	}
	// Each marked layer keeps only its statistics for its BN (the ReLU
	// keeps nothing): 2 float32 per channel.
	for i, nd := range gm.Nodes {
		if nd.Recompute != "" && nd.Op == graph.OpBatchNorm {
			if want := int64(8 * nd.Attr.Features); got.mem.Layers[i].SavedBytes != want {
				t.Errorf("%s keeps %d bytes, want %d", nd.Name, got.mem.Layers[i].SavedBytes, want)
			}
		}
		if nd.Recompute != "" && nd.Op == graph.OpReLU && got.mem.Layers[i].SavedBytes != 0 {
			t.Errorf("%s keeps %d bytes, want 0", nd.Name, got.mem.Layers[i].SavedBytes)
		}
	}
}

// TestHalfDrift: a step in 16 bits stays near the float32 one and is not
// exact; float16 (10 mantissa bits) keeps outputs nearer than bfloat16 (7).
// Input gradients of these tiny networks are ill-conditioned (BN layers see
// two values per channel, or tiny running variances): real autocast in
// bfloat16 moves them by 0.25 to 1.0 of their largest magnitude on the same
// fixtures (0.29 of tiny_resnext's training output), so only outputs are
// held to bounds, and gradients to being finite and of that order.
func TestHalfDrift(t *testing.T) {
	for _, name := range []string{"tiny_densenet", "tiny_resnext", "tiny_vgg"} {
		gold, w := loadNet(t, name)
		g, _, err := arch.Recognize(w, "auto")
		if err != nil {
			t.Fatal(err)
		}
		x := &HostTensor{Shape: gold.Input.Shape, Data: f32(gold.Input.Values)}
		dout := f32(gold.Train.Dout)
		for _, training := range []bool{false, true} {
			step := func(dt DType) (out, dx []float32) {
				e, err := New(g, w, NewCPU(2), Options{Seed: gold.Seed, Half: dt, GradInEval: true})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				y, err := e.Forward(x, training)
				if err != nil {
					t.Fatal(err)
				}
				d, _, err := e.Backward(&HostTensor{Shape: y.Shape, Data: dout})
				if err != nil {
					t.Fatal(err)
				}
				return y.Data, d.Data
			}
			refOut, refDx := step(Float32)
			var drift []float64
			for _, dt := range []DType{BFloat16, Float16} {
				gotOut, gotDx := step(dt)
				out, dx := relDiff(gotOut, refOut), relDiff(gotDx, refDx)
				t.Logf("%s training=%v %v: output drift %.2e, input gradient drift %.2e (of the largest magnitude)", name, training, dt, out, dx)
				if out == 0 || dx == 0 || math.IsNaN(out+dx) || dx > 2 {
					t.Errorf("%s training=%v %v: drift %g (output), %g (input gradient)", name, training, dt, out, dx)
				}
				if bound := map[DType]float64{BFloat16: 0.05, Float16: 0.01}[dt]; !training && out > bound {
					t.Errorf("%s eval %v: output drift %g, above %g", name, dt, out, bound)
				}
				drift = append(drift, out)
			}
			if drift[1] > drift[0]/2 {
				t.Errorf("%s training=%v: float16 moves the output by %g, bfloat16 by %g", name, training, drift[1], drift[0])
			}
		}
	}
}

// relDiff is the largest |a-b| over the largest |b|.
func relDiff(a, b []float32) float64 {
	d, m := 0.0, 0.0
	for i := range b {
		d = math.Max(d, math.Abs(float64(a[i])-float64(b[i])))
		m = math.Max(m, math.Abs(float64(b[i])))
	}
	if m == 0 {
		return d
	}
	return d / m
}

// TestSegmentsTorchvision: the segments each policy makes of full-size
// torchvision graphs.
func TestSegmentsTorchvision(t *testing.T) {
	tests := []struct {
		name      string
		convert   bool
		blocks    int
		firstLast [2]string
	}{
		{"resnet50", false, 16, [2]string{"layer1.0.conv1", "layer1.0.relu:3"}},
		{"densenet121", false, 58 + 3, [2]string{"features.denseblock1.denselayer1.cat", "features.denseblock1.denselayer1.conv2"}},
		// The conversion groups each block's last Concat with the next
		// transition (shared buffers): the transition's segment takes it in.
		{"densenet121", true, 58 + 3, [2]string{"features.denseblock1.denselayer1.cat", "features.denseblock1.denselayer1.conv2"}},
		{"vgg16_bn", false, 5, [2]string{"features.0", "features.6"}},
	}
	for _, tc := range tests {
		g, w := recognise(t, tc.name)
		if tc.convert {
			convert(t, g, w)
		}
		blocks, err := Segments(g, CheckpointBlocks)
		if err != nil {
			t.Fatal(err)
		}
		if len(blocks) != tc.blocks || blocks[0].First != tc.firstLast[0] || blocks[0].Last != tc.firstLast[1] {
			t.Errorf("%s: %d blocks, first %s..%s; want %d, %s..%s", tc.name, len(blocks), blocks[0].First, blocks[0].Last, tc.blocks, tc.firstLast[0], tc.firstLast[1])
		}
		for _, s := range blocks {
			if tc.name == "resnet50" && (blockOf(s.First) != blockOf(s.Last) || len(s.Inputs) != 1) {
				t.Errorf("%s: segment %s..%s reads %v", tc.name, s.First, s.Last, s.Inputs)
			}
		}
		if tc.convert {
			if tr := blocks[6]; tr.First != "features.denseblock1.cat" || tr.Last != "features.transition1.pool" {
				t.Errorf("converted %s: transition segment %s..%s, want features.denseblock1.cat..features.transition1.pool", tc.name, tr.First, tr.Last)
			}
		}
		sq, err := Segments(g, CheckpointSqrt)
		if err != nil {
			t.Fatal(err)
		}
		n := len(g.Nodes) - 1
		if k := int(math.Ceil(math.Sqrt(float64(n)))); len(sq) > k || len(sq) < 2 {
			t.Errorf("%s: sqrt schedule makes %d segments of %d nodes (at most %d)", tc.name, len(sq), n, k)
		}
		next := 1
		for _, s := range sq {
			if s.Start != next || len(s.Inputs) != 1 {
				t.Errorf("%s: sqrt segment %d..%d (%s..%s) reads %v", tc.name, s.Start, s.End, s.First, s.Last, s.Inputs)
			}
			if s.Start > 1 && s.Inputs[0] != g.Nodes[s.Start-1].Name {
				t.Errorf("%s: segment %s reads %s, not the previous segment's output", tc.name, s.First, s.Inputs[0])
			}
			next = s.End + 1
		}
		if next != len(g.Nodes) {
			t.Errorf("%s: sqrt segments end at %d of %d nodes", tc.name, next-1, n)
		}
	}
}

// TestSegmentsSqrtChain: on a plain chain every node is a candidate, so the
// sqrt(n) schedule cuts 16 nodes into 4 segments of 4; an in-place
// activation is never the first node of a segment.
func TestSegmentsSqrtChain(t *testing.T) {
	h := newHand(2)
	x := h.g.Input
	for i := 0; i < 16; i++ {
		x = h.conv(fmt.Sprintf("c%d", i), x, 2, 2, 1, 0)
	}
	segs, err := Segments(h.g, CheckpointSqrt)
	if err != nil {
		t.Fatal(err)
	}
	var got [][2]int
	for _, s := range segs {
		got = append(got, [2]int{s.Start, s.End})
	}
	if want := [][2]int{{1, 4}, {5, 8}, {9, 12}, {13, 16}}; !reflect.DeepEqual(got, want) {
		t.Errorf("segments %v, want %v", got, want)
	}

	h = newHand(2)
	x = h.g.Input
	for i := 0; i < 8; i++ {
		x = h.conv(fmt.Sprintf("c%d", i), x, 2, 2, 1, 0)
		x = h.g.Add(fmt.Sprintf("r%d", i), graph.OpReLU, graph.Attr{}, nil, x)
	}
	segs, err = Segments(h.g, CheckpointSqrt)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range segs {
		if h.g.Nodes[s.Start].Op == graph.OpReLU {
			t.Errorf("segment %s..%s starts with an in-place ReLU", s.First, s.Last)
		}
	}
	if len(segs) != 4 {
		t.Errorf("%d segments of 16 nodes, want 4", len(segs))
	}
	if _, err := Segments(h.g, CheckpointBlocks); !errors.Is(err, ErrNoBlocks) {
		t.Errorf("blocks of a plain chain: %v, want ErrNoBlocks", err)
	}
	if _, err := ParseCheckpointing("every other"); err == nil {
		t.Error("unknown policy accepted")
	}
}

// TestCheckpointEval: checkpointing an eval-mode step that keeps what
// backward needs (Options.GradInEval) also changes no number; BN layers use
// their running statistics in the rerun.
func TestCheckpointEval(t *testing.T) {
	gold, vs := netVariants(t, "tiny_resnext")
	x := &HostTensor{Shape: gold.Input.Shape, Data: f32(gold.Input.Values)}
	dout := f32(gold.Train.Dout)
	for _, v := range vs {
		var outs, dxs [][]float32
		var saved []int64
		for _, c := range []Checkpointing{NoCheckpointing, CheckpointBlocks, CheckpointSqrt} {
			opt := v.opt
			opt.GradInEval, opt.Checkpoint = true, c
			e, err := New(v.g, v.w, NewCPU(2), opt)
			if err != nil {
				t.Fatal(err)
			}
			y, err := e.Forward(x, false)
			if err != nil {
				t.Fatal(err)
			}
			dx, _, err := e.Backward(&HostTensor{Shape: y.Shape, Data: dout})
			if err != nil {
				t.Fatal(err)
			}
			outs, dxs, saved = append(outs, y.Data), append(dxs, dx.Data), append(saved, e.Memory().SavedBytes)
			e.Close()
		}
		for k := 1; k < len(outs); k++ {
			if !reflect.DeepEqual(outs[k], outs[0]) || !reflect.DeepEqual(dxs[k], dxs[0]) || saved[k] >= saved[0] {
				t.Errorf("%s, policy %d: eval step differs from the plain one, or keeps %d bytes against %d", v.name, k, saved[k], saved[0])
			}
		}
	}
}
