package memory

import (
	"encoding/json"
	"encoding/xml"
	"flag"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
	"github.com/abnconvert/abnconvert/runtime"
)

// The PyTorch figures are made by real PyTorch: -update reruns
// bench/saved_activations_ext.py (with /usr/bin/python3, or $PYTHON) on the
// segments the runtime chooses, and rewrites testdata/pytorch_saved.json.
var update = flag.Bool("update", false, "refresh testdata/pytorch_saved.json with bench/saved_activations_ext.py (needs PyTorch; about two minutes)")

func rowsByKey(c *Comparison) map[string]Row {
	m := map[string]Row{}
	for _, r := range c.Rows {
		m[r.Key] = r
	}
	return m
}

// TestCompareFixtures checks the table on the tiny fixtures, drift measured
// with real arithmetic: which rows there are, that checkpointing changes no
// number (its drift is its counterpart's, bit for bit), that half precision
// does and says so, and that the rows agree with the plain memory report.
func TestCompareFixtures(t *testing.T) {
	for _, name := range []string{"tiny_densenet", "tiny_resnext", "tiny_vgg"} {
		t.Run(name, func(t *testing.T) {
			c, err := Compare(Options{Input: fixture(name), Batch: 4, Size: 32})
			if err != nil {
				t.Fatal(err)
			}
			want := []string{"baseline", "checkpoint-blocks", "checkpoint-sqrt", "half", "inplace-abn",
				"inplace-abn+checkpoint-blocks", "inplace-abn+checkpoint-sqrt", "inplace-abn+half"}
			if name == "tiny_densenet" {
				want = []string{"baseline", "checkpoint-blocks", "checkpoint-sqrt", "half", "shared", "inplace-abn",
					"inplace-abn+checkpoint-blocks", "inplace-abn+checkpoint-sqrt", "inplace-abn+half",
					"inplace-abn+shared", "inplace-abn+shared+checkpoint-blocks", "inplace-abn+shared+checkpoint-sqrt", "inplace-abn+shared+half"}
			}
			var keys []string
			for _, r := range c.Rows {
				keys = append(keys, r.Key)
			}
			if !reflect.DeepEqual(keys, want) {
				t.Fatalf("rows %v, want %v", keys, want)
			}
			rows := rowsByKey(c)
			base := rows["baseline"]
			if base.Drift == nil || *base.Drift != (Drift{}) || base.Saving != 0 || !base.Exact || base.ExtraCompute != 0 {
				t.Errorf("baseline row %+v", base)
			}
			for _, r := range c.Rows {
				if got := 1 - float64(r.SavedBytes)/float64(base.SavedBytes); math.Abs(got-r.Saving) > 1e-12 {
					t.Errorf("%s: saving %g, bytes say %g", r.Key, r.Saving, got)
				}
				if r.PeakBytes < r.SavedBytes || r.StepFLOPs != base.StepFLOPs {
					t.Errorf("%s: peak %d < saved %d, or step FLOPs %d differ from the baseline's %d", r.Key, r.PeakBytes, r.SavedBytes, r.StepFLOPs, base.StepFLOPs)
				}
				half := strings.Contains(r.Key, "half")
				if half == r.Exact && !strings.Contains(r.Key, "inplace-abn") {
					t.Errorf("%s: exact %v", r.Key, r.Exact)
				}
				if half && (r.Drift.OutputMaxAbs == 0 || r.Drift.InputGradMaxAbs == 0 || !strings.Contains(r.Note, "bfloat16")) {
					t.Errorf("%s: drift %+v, note %q", r.Key, *r.Drift, r.Note)
				}
				if strings.Contains(r.Key, "checkpoint") {
					plain := strings.NewReplacer("+checkpoint-blocks", "", "+checkpoint-sqrt", "").Replace(r.Key)
					if strings.HasPrefix(plain, "checkpoint") {
						plain = "baseline"
					}
					counterpart, found := rows[plain]
					if !found {
						t.Fatalf("%s: no row %s", r.Key, plain)
					}
					// Checkpointing reruns the same arithmetic: the same
					// numbers as the row without it, bit for bit.
					if *r.Drift != *counterpart.Drift || r.Exact != counterpart.Exact {
						t.Errorf("%s: drift %+v, %s without checkpointing %+v", r.Key, *r.Drift, plain, *counterpart.Drift)
					}
					if r.ExtraCompute <= counterpart.ExtraCompute || r.Segments == 0 || r.SavedBytes >= counterpart.SavedBytes {
						t.Errorf("%s: extra %g, %d segments, keeps %d; without checkpointing extra %g, keeps %d", r.Key, r.ExtraCompute, r.Segments, r.SavedBytes, counterpart.ExtraCompute, counterpart.SavedBytes)
					}
				}
			}
			if rows["half"].ExtraCompute != 0 || rows["inplace-abn"].ExtraCompute <= 0 {
				t.Errorf("extra compute: half %g, InPlace-ABN %g (its inversion)", rows["half"].ExtraCompute, rows["inplace-abn"].ExtraCompute)
			}
			// The tiny fixtures' ReLUs become leaky ReLUs: approximate, and
			// measured so.
			ip := rows["inplace-abn"]
			if ip.Exact || !strings.Contains(ip.Note, "leaky_relu") || ip.Drift.OutputMaxAbs == 0 {
				t.Errorf("InPlace-ABN row: exact %v, note %q, drift %+v", ip.Exact, ip.Note, *ip.Drift)
			}
			plain, err := Run(Options{Input: fixture(name), Batch: 4, Size: 32})
			if err != nil {
				t.Fatal(err)
			}
			if ip.SavedBytes != plain.Techniques[1].SavedBytes || ip.PeakBytes != plain.Techniques[1].PeakBytes {
				t.Errorf("InPlace-ABN row %d/%d bytes, memory's own %+v", ip.SavedBytes, ip.PeakBytes, plain.Techniques[1])
			}
			if s, ok := rows["inplace-abn+shared"]; ok && (s.SavedBytes != plain.Converted.SavedBytes || s.PeakBytes != plain.Converted.PeakBytes) {
				t.Errorf("InPlace-ABN + shared row %d/%d bytes, memory's converted %+v", s.SavedBytes, s.PeakBytes, plain.Converted)
			}
		})
	}
}

// TestCompareMaxBatch: each row's answer fits and the next batch does not,
// measured again here.
func TestCompareMaxBatch(t *testing.T) {
	probe, err := Run(Options{Input: fixture("tiny_resnext"), Batch: 12, Size: 32})
	if err != nil {
		t.Fatal(err)
	}
	budget := probe.Original.ParamBytes + probe.Original.PeakBytes
	c, err := Compare(Options{Input: fixture("tiny_resnext"), Batch: 2, Size: 32, Budget: budget, NoDrift: true})
	if err != nil {
		t.Fatal(err)
	}
	opt := Options{Arch: "auto", ReLU: rewrite.ReLULeaky, Slope: 0.01}
	s, err := newSetup(FileSource(fixture("tiny_resnext")), opt)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i, tech := range techniques(false, runtime.BFloat16) {
		r := c.Rows[i]
		v := s.variant(tech, runtime.BFloat16)
		at := func(b int) int64 {
			f, _, err := measure(v, b, 32, shapes)
			if err != nil {
				t.Fatal(err)
			}
			return f.ParamBytes + f.PeakBytes
		}
		if r.Key == "baseline" && r.MaxBatch != 12 {
			t.Errorf("baseline: max batch %d within its own batch-12 figure", r.MaxBatch)
		}
		if p := at(r.MaxBatch); p > budget {
			t.Errorf("%s: batch %d needs %d > %d", r.Key, r.MaxBatch, p, budget)
		}
		if p := at(r.MaxBatch + 1); p <= budget {
			t.Errorf("%s: batch %d also fits (%d <= %d)", r.Key, r.MaxBatch+1, p, budget)
		}
	}
}

// torchRun is what bench/saved_activations_ext.py measured for one network,
// with the segments the runtime cut (Segments).
type torchRun struct {
	Arch        string `json:"arch"`
	Batch       int    `json:"batch"`
	Size        int    `json:"size"`
	Torch       string `json:"torch"`
	Torchvision string `json:"torchvision"`
	Eager       int64  `json:"eager"`
	Baseline    int64  `json:"baseline"`
	Checkpoint  map[string]struct {
		SavedBytes int64 `json:"saved_bytes"`
		Segments   int   `json:"segments"`
	} `json:"checkpoint"`
	Autocast int64               `json:"autocast_bfloat16"`
	Segments map[string][][2]int `json:"runtime_segments"`
}

func resnetWeights(layers [4]int) func() *graph.MemWeights {
	return func() *graph.MemWeights {
		w := graph.NewMemWeights()
		bn := func(m string, c int) {
			w.Put(m+".weight", []int{c}, fill(c, 1))
			w.Put(m+".bias", []int{c}, fill(c, 0))
			w.Put(m+".running_mean", []int{c}, fill(c, 0))
			w.Put(m+".running_var", []int{c}, fill(c, 1))
			w.Put(m+".num_batches_tracked", []int{}, []float64{0})
		}
		w.Put("conv1.weight", []int{64, 3, 7, 7}, nil)
		bn("bn1", 64)
		in := 64
		for l, n := range layers {
			planes := 64 << l
			for i := 0; i < n; i++ {
				m := fmt.Sprintf("layer%d.%d.", l+1, i)
				w.Put(m+"conv1.weight", []int{planes, in, 1, 1}, nil)
				bn(m+"bn1", planes)
				w.Put(m+"conv2.weight", []int{planes, planes, 3, 3}, nil)
				bn(m+"bn2", planes)
				w.Put(m+"conv3.weight", []int{planes * 4, planes, 1, 1}, nil)
				bn(m+"bn3", planes*4)
				if i == 0 {
					w.Put(m+"downsample.0.weight", []int{planes * 4, in, 1, 1}, nil)
					bn(m+"downsample.1", planes*4)
				}
				in = planes * 4
			}
		}
		w.Put("fc.weight", []int{1000, in}, nil)
		w.Put("fc.bias", []int{1000}, nil)
		return w
	}
}

var torchNets = []struct {
	name    string
	weights func() *graph.MemWeights
}{
	{"resnet50", resnetWeights([4]int{3, 4, 6, 3})},
	{"densenet121", DepthSeries[0].Weights},
}

// realInPlaceABNResNet50 is what the real inplace_abn 1.1.0 keeps for
// torchvision's resnet50 converted (every BN an InPlaceABN) at batch 8,
// 3x224x224, measured with PyTorch's saved-tensor hooks: the runtime
// package's calibration figure, an 8-byte sample count per layer included.
const realInPlaceABNResNet50 = 556523656

// standinInPlaceABNResNet50 is the same for the module abnconvert emits,
// under fixtures/standin: what the runtime keeps for its conversion, to the
// byte (32 bytes more than the real library's own conversion).
const standinInPlaceABNResNet50 = 556523688

// TestAgainstPyTorch compares rows with what real PyTorch 1.13 keeps for the
// same networks at batch 8, 3x224x224 (testdata/pytorch_saved.json, made by
// bench/saved_activations_ext.py on the runtime's own segments): the
// baseline to the byte, the checkpointing rows within 5% of
// torch.utils.checkpoint on the same segments, the bfloat16 row within 5%
// of torch.autocast("cpu", bfloat16); the InPlace-ABN row is the runtime's
// figure for the converted network.
func TestAgainstPyTorch(t *testing.T) {
	golden := filepath.Join("testdata", "pytorch_saved.json")
	runs := map[string]*torchRun{}
	if *update {
		for _, n := range torchNets {
			runs[n.name] = runTorch(t, n.name, n.weights)
		}
		b, err := json.MarshalIndent(runs, "", " ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(golden, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (make it with go test ./memory -run TestAgainstPyTorch -update)", err)
	}
	if err := json.Unmarshal(b, &runs); err != nil {
		t.Fatalf("%s: %v", golden, err)
	}
	for _, n := range torchNets {
		t.Run(n.name, func(t *testing.T) {
			tr := runs[n.name]
			if tr == nil {
				t.Fatalf("%s has no %s", golden, n.name)
			}
			c, err := Compare(Options{Source: MemSource(n.weights), Batch: tr.Batch, Size: tr.Size, NoDrift: true})
			if err != nil {
				t.Fatal(err)
			}
			if c.Arch != n.name {
				t.Fatalf("recognised as %s", c.Arch)
			}
			rows := rowsByKey(c)
			if got := rows["baseline"].SavedBytes; got != tr.Baseline || got != tr.Eager {
				t.Errorf("baseline keeps %d bytes; PyTorch %d (fx), %d (eager)", got, tr.Baseline, tr.Eager)
			}
			within := func(key string, got, want int64) {
				dev := float64(got-want) / float64(want)
				t.Logf("%-20s runtime %8.1f MiB, PyTorch %8.1f MiB (%+.2f%%)", key, mibOf(got), mibOf(want), 100*dev)
				if math.Abs(dev) > 0.05 {
					t.Errorf("%s: runtime keeps %d bytes, PyTorch %d: %+.1f%%, outside 5%%", key, got, want, 100*dev)
				}
			}
			for _, policy := range []string{"blocks", "sqrt"} {
				var cuts [][2]int
				for _, s := range c.Segments[policy] {
					cuts = append(cuts, [2]int{s.Start, s.End})
				}
				if !reflect.DeepEqual(cuts, tr.Segments[policy]) {
					t.Errorf("%s: the runtime now cuts %v, the PyTorch figure is for %v: refresh with -update", policy, cuts, tr.Segments[policy])
				}
				within("checkpoint-"+policy, rows["checkpoint-"+policy].SavedBytes, tr.Checkpoint[policy].SavedBytes)
			}
			within("half (bfloat16)", rows["half"].SavedBytes, tr.Autocast)

			// The InPlace-ABN row is the runtime's own measurement of the
			// converted network.
			w := n.weights()
			g, _, err := arch.Recognize(w, "auto")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := rewrite.Run(g, w, rewrite.Options{}); err != nil {
				t.Fatal(err)
			}
			f, _, err := measure(variant{name: "converted", g: g, w: w, opt: runtime.Options{NoRecompute: true}}, tr.Batch, tr.Size, shapes)
			if err != nil {
				t.Fatal(err)
			}
			ip := rows["inplace-abn"]
			t.Logf("%-20s runtime %8.1f MiB", "inplace-abn", mibOf(ip.SavedBytes))
			if ip.SavedBytes != f.SavedBytes || ip.PeakBytes != f.PeakBytes {
				t.Errorf("InPlace-ABN row %d/%d bytes, the runtime measures %d/%d", ip.SavedBytes, ip.PeakBytes, f.SavedBytes, f.PeakBytes)
			}
			if n.name == "resnet50" && ip.SavedBytes != standinInPlaceABNResNet50 {
				t.Errorf("InPlace-ABN row keeps %d bytes, the emitted module under the stand-in %d (the real library %d)", ip.SavedBytes, standinInPlaceABNResNet50, realInPlaceABNResNet50)
			}
		})
	}
}

// runTorch writes the runtime's node names and segments for a network and
// runs bench/saved_activations_ext.py on them.
func runTorch(t *testing.T, name string, weights func() *graph.MemWeights) *torchRun {
	t.Helper()
	const batch, size = 8, 224
	c, err := Compare(Options{Source: MemSource(weights), Batch: batch, Size: size, NoDrift: true})
	if err != nil {
		t.Fatal(err)
	}
	g, _, err := arch.Recognize(weights(), "auto")
	if err != nil {
		t.Fatal(err)
	}
	var nodes []string
	for _, n := range g.Nodes[1:] {
		nodes = append(nodes, n.Name)
	}
	spec := map[string]any{"nodes": nodes, "policies": c.Segments}
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), name+"_segments.json")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	py := os.Getenv("PYTHON")
	if py == "" {
		py = "/usr/bin/python3"
	}
	cmd := exec.Command(py, filepath.Join("..", "bench", "saved_activations_ext.py"), name,
		"--batch", fmt.Sprint(batch), "--size", fmt.Sprint(size), "--segments", path)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("bench/saved_activations_ext.py %s: %v", name, err)
	}
	var tr torchRun
	if err := json.Unmarshal(out, &tr); err != nil {
		t.Fatalf("bench/saved_activations_ext.py %s printed %q: %v", name, out, err)
	}
	tr.Segments = map[string][][2]int{}
	for policy, segs := range c.Segments {
		for _, s := range segs {
			tr.Segments[policy] = append(tr.Segments[policy], [2]int{s.Start, s.End})
		}
	}
	return &tr
}

// fitQuadratic fits y = a*x^2 + b*x + c by least squares.
func fitQuadratic(xs, ys []float64) (a, b, c float64) {
	// Normal equations, 3x3, solved by Cramer's rule.
	var s [5]float64
	var r [3]float64
	for i, x := range xs {
		p := 1.0
		for k := 0; k < 5; k++ {
			s[k] += p
			if k < 3 {
				r[k] += p * ys[i]
			}
			p *= x
		}
	}
	m := [3][3]float64{{s[4], s[3], s[2]}, {s[3], s[2], s[1]}, {s[2], s[1], s[0]}}
	v := [3]float64{r[2], r[1], r[0]}
	det := func(m [3][3]float64) float64 {
		return m[0][0]*(m[1][1]*m[2][2]-m[1][2]*m[2][1]) - m[0][1]*(m[1][0]*m[2][2]-m[1][2]*m[2][0]) + m[0][2]*(m[1][0]*m[2][1]-m[1][1]*m[2][0])
	}
	d := det(m)
	var out [3]float64
	for k := 0; k < 3; k++ {
		mk := m
		for i := 0; i < 3; i++ {
			mk[i][k] = v[i]
		}
		out[k] = det(mk) / d
	}
	return out[0], out[1], out[2]
}

// fitLine fits y = b*x + c by least squares and returns the largest
// residual relative to y.
func fitLine(xs, ys []float64) float64 {
	n := float64(len(xs))
	var sx, sy, sxx, sxy float64
	for i, x := range xs {
		sx, sy, sxx, sxy = sx+x, sy+ys[i], sxx+x*x, sxy+x*ys[i]
	}
	b := (n*sxy - sx*sy) / (n*sxx - sx*sx)
	c := (sy - b*sx) / n
	worst := 0.0
	for i, x := range xs {
		worst = math.Max(worst, math.Abs(ys[i]-(b*x+c))/ys[i])
	}
	return worst
}

// TestDepthCurve measures densenet121 to 264 built from their configurations
// and fits what they keep against depth: the baseline grows faster than
// linearly (the quadratic term of a least-squares fit carries much of the
// deepest value, and a line misses the points), the shared-buffer curves
// linearly (a small quadratic term, a line within 2%).
func TestDepthCurve(t *testing.T) {
	pts, err := DepthCurve(Options{Batch: 8, Size: 224})
	if err != nil {
		t.Fatal(err)
	}
	wantArch := []string{"densenet121", "densenet169", "densenet201", "densenet (growth 32, bn_size 4, blocks [6 12 64 48], init 64)"}
	var xs []float64
	for i, p := range pts {
		if p.Arch != wantArch[i] {
			t.Errorf("%s recognised as %q, want %q", p.Name, p.Arch, wantArch[i])
		}
		xs = append(xs, float64(p.Depth)/100)
	}
	if xs[0] != 1.21 || xs[3] != 2.65 {
		t.Errorf("depths %v", xs)
	}
	for _, tc := range []struct {
		key       string
		quadratic bool
	}{{"baseline", true}, {"inplace-abn", true}, {"shared", false}, {"inplace-abn+shared", false}} {
		var ys []float64
		for _, p := range pts {
			ys = append(ys, mibOf(p.Rows[tc.key].SavedBytes))
		}
		a, _, _ := fitQuadratic(xs, ys)
		share := a * xs[3] * xs[3] / ys[3]
		miss := fitLine(xs, ys)
		t.Logf("%-20s %v MiB: quadratic term %.0f%% of the deepest, a line misses by up to %.1f%%", tc.key, ys, 100*share, 100*miss)
		if tc.quadratic && (share < 0.3 || miss < 0.04) {
			t.Errorf("%s does not grow faster than linearly: quadratic share %.2f, line misses by %.3f", tc.key, share, miss)
		}
		if !tc.quadratic && (math.Abs(share) > 0.1 || miss > 0.02) {
			t.Errorf("%s is not linear in depth: quadratic share %.2f, line misses by %.3f", tc.key, share, miss)
		}
	}
}

func TestPlotComparison(t *testing.T) {
	for _, tc := range []struct {
		name   string
		panels int
	}{{"tiny_densenet", 2}, {"tiny_vgg", 1}} {
		c, err := Compare(Options{Input: fixture(tc.name), Batch: 2, Size: 32, NoDrift: true, Curves: true, CurveBatches: []int{2, 4, 8}})
		if err != nil {
			t.Fatal(err)
		}
		if tc.panels == 2 && len(c.Depth) != len(DepthSeries) {
			t.Fatalf("%s: %d depth points", tc.name, len(c.Depth))
		}
		for _, r := range c.Rows {
			if len(r.ByBatch) != 3 || r.ByBatch[0].TotalBytes >= r.ByBatch[2].TotalBytes {
				t.Errorf("%s %s: by batch %+v", tc.name, r.Key, r.ByBatch)
			}
		}
		b, err := PlotComparison("cmp.svg", c)
		if err != nil {
			t.Fatal(err)
		}
		var doc struct {
			Polylines []struct {
				Points string `xml:"points,attr"`
				Title  string `xml:"title"`
			} `xml:"polyline"`
		}
		if err := xml.Unmarshal(b, &doc); err != nil {
			t.Fatalf("%s: not XML: %v", tc.name, err)
		}
		if want := tc.panels * len(c.Rows); len(doc.Polylines) != want {
			t.Errorf("%s: %d lines, want %d", tc.name, len(doc.Polylines), want)
		}
		for _, p := range doc.Polylines {
			if strings.Contains(p.Points, "NaN") || strings.Contains(p.Points, "Inf") {
				t.Errorf("%s: line %s has points %s", tc.name, p.Title, p.Points)
			}
		}
		if _, err := PlotComparison("cmp.png", c); err == nil {
			t.Error("png accepted")
		}
	}
	c, err := Compare(Options{Input: fixture("tiny_vgg"), Batch: 2, Size: 32, NoDrift: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := PlotComparison("cmp.svg", c); err == nil {
		t.Error("a comparison without curves plotted")
	}
}

func mibOf(b int64) float64 { return float64(b) / (1 << 20) }
