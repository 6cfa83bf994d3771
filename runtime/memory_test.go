package runtime

import (
	"math"
	"testing"

	"github.com/abnconvert/abnconvert/arch"
	"github.com/abnconvert/abnconvert/graph"
	"github.com/abnconvert/abnconvert/rewrite"
)

const mib = 1 << 20

// torchSaved are the bytes PyTorch 1.13's saved-tensor hooks count for one
// training forward at batch 8, 3x224x224 (shared/tools/saved_activations.py).
var torchSaved = map[string]int64{
	"resnet50":    687488512, // 655.6 MiB
	"densenet121": 1043225344,
	"vgg16_bn":    1020396544,
}

// realInPlaceABNResNet50 is what the real inplace_abn 1.1.0 (its CPU
// extension built against torch 1.13) keeps for torchvision's resnet50 with
// every BN + ReLU an InPlaceABN(leaky_relu 0.01), every other BN an
// InPlaceABN(identity), out-of-place residual adds, at batch 8, 3x224x224:
// 530.74 MiB, measured with shared/tools/saved_activations.py's hooks (the
// anchor's 530.7 MiB, to the byte).
const realInPlaceABNResNet50 = 556523656

// standinInPlaceABNResNet50 is what the module abnconvert emits for
// torchvision's resnet50 (convert's defaults) keeps under fixtures/standin
// at batch 8, 3x224x224, by the same hooks: an 8-byte sample count per
// InPlaceABN included, as the library keeps it.
const standinInPlaceABNResNet50 = 556523688

// measure runs one training step of g on the shape-only backend.
func measure(t testing.TB, g *graph.Graph, w graph.Weights, batch, size int, opt Options) MemoryReport {
	t.Helper()
	e, err := New(g, w, NewShapes(), opt)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	out, err := e.Forward(&HostTensor{Shape: []int{batch, 3, size, size}}, true)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.Backward(&HostTensor{Shape: out.Shape}); err != nil {
		t.Fatal(err)
	}
	return e.Memory()
}

func recognise(t testing.TB, name string) (*graph.Graph, *graph.MemWeights) {
	t.Helper()
	w := shapeWeights(tvModels[name]())
	g, m, err := arch.Recognize(w, "auto")
	if err != nil {
		t.Fatal(err)
	}
	if m.Arch != name {
		t.Fatalf("recognised %s as %s", name, m.Arch)
	}
	return g, w
}

func convert(t testing.TB, g *graph.Graph, w graph.Weights) *rewrite.Report {
	t.Helper()
	rep, err := rewrite.Run(g, w, rewrite.Options{ReLU: rewrite.ReLULeaky, Slope: 0.01})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// TestMemoryCalibration measures the torchvision networks at batch 8,
// 3x224x224 with the shape-only backend: the original networks within 3% of
// what PyTorch keeps, converted ResNet-50 no more than the real InPlace-ABN
// keeps (530.7 MiB), converted DenseNet-121 (InPlace-ABN and shared
// buffers) no more than 35% of its original.
func TestMemoryCalibration(t *testing.T) {
	if testing.Short() {
		t.Skip("full-size graphs")
	}
	orig := map[string]int64{}
	for _, name := range []string{"resnet50", "densenet121", "vgg16_bn"} {
		g, w := recognise(t, name)
		m := measure(t, g, w, 8, 224, Options{})
		want := torchSaved[name]
		orig[name] = m.SavedBytes
		dev := float64(m.SavedBytes-want) / float64(want)
		t.Logf("%-12s original: saved %.1f MiB (PyTorch %.1f MiB, %+.2f%%), peak %.1f MiB", name, mb(m.SavedBytes), mb(want), 100*dev, mb(m.PeakBytes))
		if math.Abs(dev) > 0.03 {
			t.Errorf("%s: saved %.1f MiB, PyTorch %.1f MiB: %+.1f%%, outside 3%%", name, mb(m.SavedBytes), mb(want), 100*dev)
		}
		checkLayers(t, name, m)
	}

	g, w := recognise(t, "resnet50")
	convert(t, g, w)
	m := measure(t, g, w, 8, 224, Options{})
	t.Logf("resnet50     converted: saved %.1f MiB (%d bytes), peak %.1f MiB", mb(m.SavedBytes), m.SavedBytes, mb(m.PeakBytes))
	// The runtime keeps what the emitted module keeps under the
	// inplace_abn stand-in (z, the variance and the sample count per
	// layer), to the byte; the real library's figure for its own
	// conversion of resnet50 is 32 bytes less.
	if m.SavedBytes != standinInPlaceABNResNet50 {
		t.Errorf("converted resnet50 keeps %d bytes (%.2f MiB), the emitted module under the stand-in %d (the real InPlace-ABN %d)", m.SavedBytes, mb(m.SavedBytes), standinInPlaceABNResNet50, realInPlaceABNResNet50)
	}
	checkLayers(t, "converted resnet50", m)

	g, w = recognise(t, "densenet121")
	convert(t, g, w)
	m = measure(t, g, w, 8, 224, Options{})
	plain := measure(t, g, w, 8, 224, Options{NoRecompute: true})
	ratio := float64(m.SavedBytes) / float64(orig["densenet121"])
	t.Logf("densenet121  converted: saved %.1f MiB (%.1f%% of original; InPlace-ABN alone %.1f MiB), peak %.1f MiB", mb(m.SavedBytes), 100*ratio, mb(plain.SavedBytes), mb(m.PeakBytes))
	if ratio > 0.35 {
		t.Errorf("converted densenet121 keeps %.1f%% of the original, want <= 35%%", 100*ratio)
	}
	checkLayers(t, "converted densenet121", m)
	// A marked layer keeps neither its concatenation nor its ABN output:
	// the ABN keeps only its batch mean and variance (and InPlaceABN its
	// sample count), the concatenation
	// only the inputs no earlier node keeps (the dense layers' outputs).
	for i, n := range g.Nodes {
		if n.Recompute == "" || !n.Op.IsBNFamily() {
			continue
		}
		want := int64(2 * 4 * n.Attr.Features)
		if info, _ := n.Op.Info(); info.Saves == graph.SaveInPlaceABN {
			want += 8 // the sample count
		}
		if m.Layers[i].SavedBytes != want {
			t.Errorf("marked %s keeps %d bytes, want %d (its statistics)", n.Name, m.Layers[i].SavedBytes, want)
		}
	}
}

// checkLayers checks that the per-layer breakdown adds up.
func checkLayers(t *testing.T, name string, m MemoryReport) {
	t.Helper()
	var sum int64
	for _, l := range m.Layers {
		sum += l.SavedBytes
	}
	if sum != m.SavedBytes {
		t.Errorf("%s: layers keep %d bytes in all, the report says %d", name, sum, m.SavedBytes)
	}
	if last := m.Layers[len(m.Layers)-1]; last.LiveBytes != m.SavedBytes {
		t.Errorf("%s: %d bytes live after the forward pass, %d kept", name, last.LiveBytes, m.SavedBytes)
	}
	if m.PeakBytes < m.SavedBytes {
		t.Errorf("%s: peak %d below the saved %d", name, m.PeakBytes, m.SavedBytes)
	}
}

func mb(b int64) float64 { return float64(b) / mib }
