package emit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/abnconvert/abnconvert/graph"
)

// TestAuxOutputsEmitted: a graph with an auxiliary output returns what the
// model it came from returns, run in real PyTorch: a dict of every output
// (segmentation models), or a namedtuple in training and the main output
// alone in eval (GoogLeNet, Inception3).
func TestAuxOutputsEmitted(t *testing.T) {
	build := func(trainOnly bool) *builder {
		b := newBuilder("aux", 3)
		c := b.conv("conv", b.g.Input, 4, 3, 2, 1, 1, false)
		n := b.norm(graph.OpBatchNorm, "bn", c, "", 0)
		r := b.op("relu", graph.OpReLU, graph.Attr{}, 4, n)
		pool := b.op("pool", graph.OpAdaptiveAvgPool, graph.Attr{OutputSize: [2]int{1, 1}}, 4, r)
		main := b.op("flat", graph.OpFlatten, graph.Attr{StartDim: 1}, 4, pool)
		a := b.conv("aux", n, 2, 1, 1, 0, 1, false)
		b.g.Output = main
		if trainOnly {
			b.g.OutputName = "logits"
			b.g.SetAux("aux_logits", a, true)
		} else {
			b.g.OutputName = "out"
			b.g.SetAux("aux", a, false)
		}
		if err := b.g.Validate(); err != nil {
			t.Fatal(err)
		}
		return b
	}
	srcs := map[string][]byte{}
	for name, trainOnly := range map[string]bool{"dict_mod.py": false, "tuple_mod.py": true} {
		src, err := Python(build(trainOnly).g, Options{})
		if err != nil {
			t.Fatal(err)
		}
		want := `return {"out": `
		if trainOnly {
			want = "return _Outputs("
		}
		if !strings.Contains(string(src), want) {
			t.Errorf("%s lacks %q:\n%s", name, want, src)
		}
		srcs[name] = src
	}
	needTorch(t)
	dir := t.TempDir()
	for name, s := range srcs {
		if err := os.WriteFile(filepath.Join(dir, name), s, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	script := `
import sys, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import dict_mod, tuple_mod
torch.manual_seed(0)
x = torch.randn(2, 3, 8, 8)
for mod in (dict_mod, tuple_mod):
    m = mod.Model()
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if v.dtype.is_floating_point:
                v.copy_(torch.rand_like(v) + 0.5 if "var" in k else torch.randn_like(v))
    sd = m.state_dict()
    bn = F.batch_norm(F.conv2d(x, sd["conv.weight"], stride=2, padding=1), sd["bn.running_mean"], sd["bn.running_var"], sd["bn.weight"], sd["bn.bias"], False, 0.1, 1e-5)
    main = F.adaptive_avg_pool2d(torch.relu(bn), 1).flatten(1)
    aux = F.conv2d(bn, sd["aux.weight"])
    m.eval()
    with torch.no_grad():
        y = m(x)
    if mod is dict_mod:
        assert list(y) == ["out", "aux"], list(y)
        assert (y["out"] - main).abs().max() < 1e-5 and (y["aux"] - aux).abs().max() < 1e-5
        m.train()
        assert list(m(x)) == ["out", "aux"]
    else:
        assert torch.is_tensor(y) and (y - main).abs().max() < 1e-5, type(y)
        m.train()
        t = m(x)
        assert t._fields == ("logits", "aux_logits"), t._fields
        assert t.logits.shape == main.shape and t.aux_logits.shape == aux.shape
        (t.logits.sum() + t.aux_logits.sum()).backward()
        assert m.aux.weight.grad is not None and m.aux.weight.grad.abs().sum() > 0
print("ok")
`
	out, err := standinPython(t, "-c", script, dir).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "ok") {
		t.Fatalf("running the emitted modules: %v\n%s\n%s", err, out, srcs["tuple_mod.py"])
	}
}
