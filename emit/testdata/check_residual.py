"""Check the emitted _inplace_abn_add against inplace_abn itself and against
plain PyTorch, with real PyTorch.

Usage: python3 check_residual.py spec.json   (inplace_abn importable: the
stand-in in fixtures/standin, or the real package)

spec.json: {"module": path of an emitted module, "keys": {key: shape},
"input": [N, C, H, W], "saving_sites": s}, where s is the number of its
residual InPlaceABN layers whose sum the next layer saves (so that adding out
of place keeps one tensor more there).

1. modules: for every InPlaceABN(identity) configuration (momentum 0.1 and
   None, affine or not, running statistics tracked, absent, or present but
   not tracked (track_running_stats set False after construction); (N, C, H, W) and
   (N, C)), in training and eval, _inplace_abn_add(m, x, r) against the
   library's own m(x) + r from the same state: output, gradients of x, r,
   weight and bias, running statistics and num_batches_tracked after.
2. gradcheck of _InPlaceABNAdd in float64, training and eval, 4-D and 2-D.
3. the emitted model, in float64 and float32, training and eval: the emitted
   forward against the same module with _inplace_abn_add replaced by the
   library's m(x) + r and by a plain reference (F.batch_norm with scale
   |weight| + eps, then + r): outputs, input gradient, every parameter
   gradient, every buffer after one step (float32: no less accurate than
   the references, see check_model).
4. saved activations (distinct non-parameter storages that autograd keeps,
   as ../shared/tools/saved_activations.py counts them, less the per-channel
   vectors): the emitted forward
   keeps exactly saving_sites tensors fewer than with m(x) + r, and fewer
   bytes by their size.
Prints "ok <section>" per section; any failure raises.
"""

import copy
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

import inplace_abn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_model import random_state  # noqa: E402

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10)}


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def library_add(module, x, residual):
    """The unfused form: inplace_abn's own layer, then an out-of-place add."""
    return module(x) + residual


def plain_add(module, x, residual):
    """nn.BatchNorm's functional form with InPlace-ABN's scale |weight| + eps."""
    momentum = 0.0
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked += 1
        momentum = 1.0 / int(module.num_batches_tracked) if module.momentum is None else module.momentum
    use_batch = module.training or module.running_mean is None
    weight = None if module.weight is None else module.weight.abs() + module.eps
    stats = module.running_mean, module.running_var
    if module.training and not module.track_running_stats:
        stats = None, None
    return F.batch_norm(x, stats[0], stats[1], weight, module.bias, use_batch, momentum, module.eps) + residual


def same(a, b, dtype, what):
    """a == b within dtype's rounding, the absolute part relative to b's
    largest entry (an entry near 0 of a large gradient carries its error)."""
    tol = dict(TOL[dtype])
    if b.is_floating_point() and b.numel():
        tol["atol"] *= max(1.0, float(b.abs().max()))
    torch.testing.assert_close(a, b, **tol, msg=what)


def trained_like(m, gen):
    """Scales of both signs, nonzero shifts and running statistics."""
    c = m.num_features
    with torch.no_grad():
        if m.weight is not None:
            m.weight.copy_((torch.rand(c, generator=gen, dtype=torch.float64) + 0.3)
                           * torch.where(torch.rand(c, generator=gen) < 0.4, -1.0, 1.0).double())
            m.bias.copy_(torch.randn(c, generator=gen, dtype=torch.float64) * 0.5)
        if m.running_mean is not None:
            m.running_mean.copy_(torch.randn(c, generator=gen, dtype=torch.float64) * 0.3)
            m.running_var.copy_(torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
            m.num_batches_tracked.fill_(3)


def run_layer(fn, m, x0, r0, dz):
    x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    out = fn(m, x * 1.0, r)  # x * 1.0: a non-leaf for the in-place layer
    out.backward(dz)
    torch.testing.assert_close(r.detach(), r0, rtol=0, atol=0, msg="the residual was modified")
    grads = {"x": x.grad, "r": r.grad}
    for name, p in m.named_parameters():
        grads[name] = p.grad
    return out.detach(), grads, {k: v.clone() for k, v in m.state_dict().items()}


def check_modules(helper):
    gen = torch.Generator().manual_seed(11)
    n = 0
    for shape in ((4, 5, 3, 3), (6, 5)):
        for momentum in (0.1, None):
            for affine in (True, False):
                for track in (True, False, "switched off"):
                    for training in (True, False):
                        m = inplace_abn.InPlaceABN(5, momentum=momentum, affine=affine, track_running_stats=bool(track),
                                                   activation="identity").double()
                        trained_like(m, gen)
                        if track == "switched off":
                            # Built with running statistics, then told not to
                            # track them: training ignores them, eval uses them.
                            m.track_running_stats = False
                        m.train(training)
                        x0 = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
                        r0 = torch.randn(shape, generator=gen, dtype=torch.float64)
                        dz = torch.randn(shape, generator=gen, dtype=torch.float64)
                        what = "modules %s momentum=%s affine=%s track=%s training=%s: " % (
                            shape, momentum, affine, track, training)
                        for fn_name, fn in (("library", library_add), ("plain", plain_add)):
                            want = run_layer(fn, copy.deepcopy(m), x0, r0, dz)
                            got = run_layer(helper, copy.deepcopy(m), x0, r0, dz)
                            same(got[0], want[0], torch.float64, what + "output vs " + fn_name)
                            if set(got[1]) != set(want[1]):
                                raise AssertionError(what + "gradients of %s, want %s" % (sorted(got[1]), sorted(want[1])))
                            for k in want[1]:
                                same(got[1][k], want[1][k], torch.float64, what + "gradient of %s vs %s" % (k, fn_name))
                            for k in want[2]:
                                same(got[2][k], want[2][k], torch.float64, what + "%s after vs %s" % (k, fn_name))
                        n += 1
    return n


def check_gradcheck(fn):
    gen = torch.Generator().manual_seed(3)
    for shape in ((3, 4, 2, 3), (7, 4)):
        for training in (True, False):
            c = shape[1]
            x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
            r = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
            w = (torch.tensor([0.7, -1.3, 0.4, -0.5], dtype=torch.float64)).requires_grad_()
            b = torch.randn(c, generator=gen, dtype=torch.float64, requires_grad=True)
            rm = torch.randn(c, generator=gen, dtype=torch.float64)
            rv = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5

            def f(x, r, w, b):
                # Copies: the function overwrites x and updates the statistics.
                return fn.apply(x.clone(), r, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5)

            if not torch.autograd.gradcheck(f, (x, r, w, b), eps=1e-6, atol=1e-6):
                raise AssertionError("gradcheck failed for %s training=%s" % (shape, training))


def step(m, x0, training):
    m.train(training)
    x = x0.clone().requires_grad_()
    out = m(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {name: p.grad.clone() for name, p in m.named_parameters()}
    return dict(out=out.detach(), xgrad=x.grad.clone(), grads=grads,
                state={k: v.clone() for k, v in m.state_dict().items()})


def quantities(run):
    """Every compared tensor of a step, by name."""
    q = {"output": run["out"], "input gradient": run["xgrad"]}
    q.update(("gradient of " + k, v) for k, v in run["grads"].items())
    q.update((k + " after the step", v) for k, v in run["state"].items())
    return q


def check_model(spec):
    """float64: the emitted model equals both references within 1e-9.
    float32: its error against the float64 plain reference is at most 4x the
    worse of the two references' own float32 errors (plus 1e-6 of the
    tensor's scale): as accurate as inplace_abn itself. Batch statistics on
    (N, C) over 4 samples make some gradients ill-conditioned, so a fixed
    float32 tolerance would measure the references' rounding, not ours."""
    sd = random_state(spec["keys"], 1234)
    variants = {}
    for name, fn in (("emitted", None), ("library", library_add), ("plain", plain_add)):
        mod = load(spec["module"], "residual_" + name)
        if fn is not None:
            # forward looks the helper up in the module's globals.
            mod._inplace_abn_add = fn
        variants[name] = mod
    gen = torch.Generator().manual_seed(99)
    x64 = torch.randn(spec["input"], generator=gen, dtype=torch.float64)
    runs = {}
    for dtype in (torch.float64, torch.float32):
        for training in (True, False):
            for name, mod in variants.items():
                m = mod.Model()
                m.load_state_dict(sd, strict=True)
                runs[dtype, training, name] = quantities(step(m.to(dtype), x64.to(dtype), training))
    for training in (True, False):
        got = runs[torch.float64, training, "emitted"]
        for other in ("library", "plain"):
            want = runs[torch.float64, training, other]
            for k in want:
                same(got[k], want[k], torch.float64, "model float64 training=%s vs %s: %s" % (training, other, k))
        truth = runs[torch.float64, training, "plain"]
        for k, t in truth.items():
            got32 = {name: runs[torch.float32, training, name][k] for name in variants}
            if not t.is_floating_point():  # num_batches_tracked
                if any(not torch.equal(v, t) for v in got32.values()):
                    raise AssertionError("model float32 training=%s: %s differs" % (training, k))
                continue
            err = {name: (v.double() - t).abs().max().item() for name, v in got32.items()}
            if err["emitted"] > 4 * max(err["library"], err["plain"]) + 1e-6 * max(1.0, t.abs().max().item()):
                raise AssertionError("model float32 training=%s: %s off by %.3g from float64, the references by %.3g "
                                     "(library) and %.3g (plain)" % (training, k, err["emitted"], err["library"], err["plain"]))
        if training:
            for k, v in got.items():
                if k.endswith("num_batches_tracked after the step"):
                    key = k.split(" ")[0]
                    if int(v) != int(sd[key]) + 1:
                        raise AssertionError("%s: %d after one step from %d" % (key, int(v), int(sd[key])))
    return variants, sd, x64


def saved(m, x):
    """Distinct non-parameter storages of activations (2-D and more: not the
    per-channel statistics) that autograd keeps in one training forward."""
    owned = {t.storage().data_ptr() for t in list(m.parameters()) + list(m.buffers())}
    seen = {}

    def pack(t):
        st = t.storage()
        if st.data_ptr() not in owned and t.dim() >= 2:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = m(x.clone().requires_grad_())
    return len(seen), sum(seen.values()), out


def check_saved(spec, variants, sd, x):
    counts = {}
    for name in ("emitted", "library"):
        m = variants[name].Model()
        m.load_state_dict(sd, strict=True)
        m.double().train()
        counts[name] = saved(m, x)
    (n, b, _), (n0, b0, _) = counts["emitted"], counts["library"]
    if n != n0 - spec["saving_sites"] or not b < b0:
        raise AssertionError("saved %d tensors (%d bytes) with _inplace_abn_add, %d (%d bytes) with m(x) + r; "
                             "want %d fewer and fewer bytes" % (n, b, n0, b0, spec["saving_sites"]))
    return n, b, n0, b0


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    torch.manual_seed(0)
    emitted = load(spec["module"], "residual_helpers")
    print("ok modules (%d configurations)" % check_modules(emitted._inplace_abn_add), flush=True)
    check_gradcheck(emitted._InPlaceABNAdd)
    print("ok gradcheck", flush=True)
    variants, sd, x = check_model(spec)
    print("ok model", flush=True)
    n, b, n0, b0 = check_saved(spec, variants, sd, x)
    print("ok saved: %d tensors, %d bytes (m(x) + r: %d tensors, %d bytes)" % (n, b, n0, b0), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        raise SystemExit("%s: %s" % (type(e).__name__, e))
