package emit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// layoutNet: conv (stride 2) -> BN -> ReLU, torchvision's channel shuffle
// with sizes read from the tensor, an asymmetric Pad, a channel Slice and
// a bilinear Resize back to the input's size; and a head: global pool,
// flatten, Linear, BatchNorm on (N, C).
func layoutNet() (*builder, *builder) {
	b := newBuilder("layout", 3)
	x := b.g.Input
	c := b.conv("conv", x, 4, 3, 2, 1, 1, false)
	n := b.norm(graph.OpBatchNorm, "bn", c, "", 0)
	r := b.op("relu", graph.OpReLU, graph.Attr{}, 4, n)
	v := b.op("view", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{
		graph.RefDim(0, 0), graph.ConstDim(2), {Ref: 0, From: 1, To: 2, Div: 2}, graph.RefDim(0, 2), graph.RefDim(0, 3)}}}, 0, r)
	t := b.op("transpose", graph.OpTranspose, graph.Attr{Layout: &graph.Layout{Perm: []int{0, 2, 1, 3, 4}}}, 0, v)
	s := b.op("shuffled", graph.OpReshape, graph.Attr{Layout: &graph.Layout{Shape: []graph.Dim{
		graph.RefDim(1, 0), graph.ConstDim(-1), graph.RefDim(1, 2), graph.RefDim(1, 3)}}}, 4, t, r)
	p := b.op("pad", graph.OpPad, graph.Attr{Layout: &graph.Layout{Pads: []int{0, 0, 1, 0, 0, 0, 0, 2}, PadValue: 0.5}}, 4, s)
	sl := b.op("slice", graph.OpSlice, graph.Attr{Axis: 1, Layout: &graph.Layout{Start: 1, End: 1 << 40}}, 3, p)
	b.op("resize", graph.OpResize, graph.Attr{Mode: "bilinear"}, 3, sl, x)

	h := newBuilder("head", 3)
	hc := h.conv("conv", h.g.Input, 4, 3, 2, 1, 1, false)
	pool := h.op("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 4, hc)
	f := h.op("flat", graph.OpFlatten, graph.Attr{StartDim: 1}, 4, pool)
	l := h.linear("fc", f, 5)
	h.norm(graph.OpBatchNorm, "bn1", l, "", 0)
	return b, h
}

// TestLayoutEmitted emits the layout ops and runs the modules with real
// PyTorch against hand-written references, at two batch sizes and
// resolutions: the computed shapes come from the tensors.
func TestLayoutEmitted(t *testing.T) {
	b, h := layoutNet()
	src, err := Python(b.g, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{".reshape(", ".shape[1] // 2", ".permute(0, 2, 1, 3, 4).contiguous()", "F.pad(", "value=0.5", "[:, 1:]",
		`F.interpolate(`, `.shape[-2:], mode="bilinear", align_corners=False)`} {
		if !strings.Contains(string(src), want) {
			t.Errorf("emitted module lacks %q:\n%s", want, src)
		}
	}
	head, err := Python(h.g, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(head), "torch.nn.BatchNorm1d(5") {
		t.Errorf("a BN after a Linear is not BatchNorm1d:\n%s", head)
	}
	needTorch(t)
	dir := t.TempDir()
	for name, s := range map[string][]byte{"layout_mod.py": src, "head_mod.py": head} {
		if err := os.WriteFile(filepath.Join(dir, name), s, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	script := `
import sys, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import layout_mod, head_mod
torch.manual_seed(0)
def randomize(m):
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if v.dtype.is_floating_point:
                v.copy_(torch.rand_like(v) + 0.5 if "var" in k else torch.randn_like(v))
    return m.eval()
m, h = randomize(layout_mod.Model()), randomize(head_mod.Model())
sd, hd = m.state_dict(), h.state_dict()
def bn(y, p, d):
    return F.batch_norm(y, d[p + ".running_mean"], d[p + ".running_var"], d[p + ".weight"], d[p + ".bias"], False, 0.1, 1e-5)
def ref(x):
    y = torch.relu(bn(F.conv2d(x, sd["conv.weight"], stride=2, padding=1), "bn", sd))
    n, c, hh, ww = y.size()
    y = y.view(n, 2, c // 2, hh, ww).transpose(1, 2).contiguous().view(n, -1, hh, ww)
    y = F.pad(y, (0, 2, 1, 0), value=0.5)[:, 1:]
    return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
def href(x):
    y = F.adaptive_avg_pool2d(F.conv2d(x, hd["conv.weight"], stride=2, padding=1), 1).flatten(1)
    return bn(F.linear(y, hd["fc.weight"], hd["fc.bias"]), "bn1", hd)
for shape in ((2, 3, 8, 8), (3, 3, 13, 10)):
    x = torch.randn(*shape)
    with torch.no_grad():
        for mod, r in ((m, ref), (h, href)):
            got, want = mod(x), r(x)
            assert got.shape == want.shape, (shape, got.shape, want.shape)
            e = (got - want).abs().max().item()
            assert e < 1e-5, (shape, e)
print("ok")
`
	out, err := standinPython(t, "-c", script, dir).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "ok") {
		t.Fatalf("running the emitted modules: %v\n%s\n%s", err, out, src)
	}
}

// TestResizeEmitted emits a Resize by a scale factor (nearest by 2,
// bilinear by 1.5 x 0.5 with align_corners) and to a fixed size, and
// runs the module with real PyTorch against F.interpolate called as
// nn.Upsample calls it, at two input sizes.
func TestResizeEmitted(t *testing.T) {
	b := newBuilder("resize", 3)
	c := b.conv("conv", b.g.Input, 4, 3, 2, 1, 1, false)
	u := b.op("up", graph.OpResize, graph.Attr{Mode: "nearest", Scale: [2]float64{2, 2}}, 4, c)
	v := b.op("up2", graph.OpResize, graph.Attr{Mode: "bilinear", AlignCorners: true, Scale: [2]float64{1.5, 0.5}}, 4, u)
	b.op("fixed", graph.OpResize, graph.Attr{Mode: "bilinear", Size: [2]int{5, 7}}, 4, v)
	if err := b.g.Validate(); err != nil {
		t.Fatal(err)
	}
	src, err := Python(b.g, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`scale_factor=2.0, mode="nearest")`, `scale_factor=(1.5, 0.5), mode="bilinear", align_corners=True)`,
		`size=(5, 7), mode="bilinear", align_corners=False)`} {
		if !strings.Contains(string(src), want) {
			t.Errorf("emitted module lacks %q:\n%s", want, src)
		}
	}
	needTorch(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "resize_mod.py"), src, 0o644); err != nil {
		t.Fatal(err)
	}
	script := `
import sys, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import resize_mod
torch.manual_seed(0)
m = resize_mod.Model().eval()
w = m.state_dict()["conv.weight"]
ref = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Upsample(scale_factor=(1.5, 0.5), mode="bilinear", align_corners=True),
                    nn.Upsample(size=(5, 7), mode="bilinear", align_corners=False))
for shape in ((2, 3, 8, 8), (1, 3, 11, 14)):
    x = torch.randn(*shape)
    with torch.no_grad():
        got, want = m(x), ref(F.conv2d(x, w, stride=2, padding=1))
    assert got.shape == want.shape, (shape, got.shape, want.shape)
    e = (got - want).abs().max().item()
    assert e < 1e-6, (shape, e)
print("ok")
`
	out, err := standinPython(t, "-c", script, dir).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "ok") {
		t.Fatalf("running the emitted module: %v\n%s\n%s", err, out, src)
	}
}
