"""Run the Python modules that emit's Go tests generate, with real PyTorch.

Usage: python3 check_model.py cases.json   (inplace_abn importable: the
stand-in in fixtures/standin, or the real package)

For every case: Model() builds; its state_dict keys and shapes are the
graph's; a checkpoint saved with torch.save loads back with
weights_only=True and strict=True; one training step (forward, backward,
SGD step) and eval forwards run in float64 without touching the caller's
input; where the case names a hand-written reference, the outputs match it;
where it names a twin emitted without recomputation, outputs, gradients and
running statistics match the twin's, the recomputed norms count the batch
once, and the recomputed concatenation is not among the saved tensors.
Prints "ok <name>" per case; any failure raises.
"""

import copy
import importlib.util
import json
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

EPS = 1e-5
TOL = dict(rtol=1e-9, atol=1e-9)


def load_module(path):
    name = "emitted_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_state(keys, seed):
    """A checkpoint with values that exercise the conversion: BN scales of
    both signs, positive variances, a nonzero batch count."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key in sorted(keys):
        shape = keys[key]
        role = key.rsplit(".", 1)[1]
        if role == "num_batches_tracked":
            sd[key] = torch.tensor(3, dtype=torch.long)
        elif role == "running_var":
            sd[key] = torch.rand(shape, generator=gen) + 0.5
        elif role == "running_mean":
            sd[key] = torch.randn(shape, generator=gen) * 0.2
        elif role == "weight" and len(shape) == 1:
            mag = torch.rand(shape, generator=gen) + 0.3
            sign = torch.where(torch.rand(shape, generator=gen) < 0.3, -1.0, 1.0)
            sd[key] = mag * sign
        else:
            fan_in = max(1, math.prod(shape[1:]))
            sd[key] = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    return sd


def loaded_model(mod, case, tmp):
    m = mod.Model()
    got = {k: list(v.shape) for k, v in m.state_dict().items()}
    want = {k: list(v) for k, v in case["keys"].items()}
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        raise AssertionError("state_dict mismatch: missing %s, extra %s, wrong shape %s" % (missing, extra, wrong))
    path = os.path.join(tmp, case["name"] + ".pth")
    torch.save(random_state(case["keys"], 1234), path)
    m.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    return m.double()


def state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def train_step(m, x0, norms=(), concat_channels=0):
    """One forward/backward/SGD step; returns what the comparisons need."""
    m.train()
    x = x0.clone().requires_grad_()
    calls = {p: 0 for p in norms}
    first_in = {}

    def pre_hook(path):
        def hook(module, inputs):
            calls[path] += 1
            if path not in first_in:
                # The layer overwrites its input: keep a copy of what it saw.
                first_in[path] = inputs[0].detach().clone()
        return hook

    # What autograd saves, measured on a copy: with saved-tensor hooks
    # installed, autograd skips its check that saved tensors were not
    # modified in place, which the real step below must keep.
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        copy.deepcopy(m)(x0.clone().requires_grad_())

    mods = dict(m.named_modules())
    handles = [mods[p].register_forward_pre_hook(pre_hook(p)) for p in norms]
    before = state(m)
    torch.manual_seed(5)  # the references draw the same dropout mask
    out = m(x)
    # A loss whose gradient differs from element to element.
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    for h in handles:
        h.remove()
    torch.testing.assert_close(x.detach(), x0, rtol=0, atol=0, msg="forward changed its input")
    grads = {}
    for name, p in m.named_parameters():
        if p.grad is None or not torch.isfinite(p.grad).all():
            raise AssertionError("parameter %s has no finite gradient" % name)
        grads[name] = p.grad.clone()
    torch.optim.SGD(m.parameters(), lr=0.05).step()
    m.zero_grad()
    concat_saved = sum(1 for s in saved if len(s) == 4 and s[1] == concat_channels)
    return dict(out=out.detach(), xgrad=x.grad.clone(), grads=grads, before=before, after=state(m),
                calls=calls, first_in=first_in, concat_saved=concat_saved)


def check_counts(case, r):
    for k, v in r["after"].items():
        if k.endswith("num_batches_tracked"):
            if int(v) != int(r["before"][k]) + 1:
                raise AssertionError("%s went from %d to %d in one step" % (k, int(r["before"][k]), int(v)))


def eval_twice(m, x0):
    m.eval()
    x = x0.clone()
    with torch.no_grad():
        a = m(x)
        b = m(x)
    torch.testing.assert_close(x, x0, rtol=0, atol=0, msg="eval forward changed its input")
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg="eval forward is not repeatable")
    return a


# Hand-written references: the same networks spelled with F.* calls straight
# from the state dict, InPlace-ABN scale |w| + eps, signs from the graph.

def make_ops(sd, training, signs):
    def conv(t, p, stride=1, pad=1):
        return F.conv2d(t, sd[p + ".weight"], sd.get(p + ".bias"), stride, pad)

    def norm(t, p, act, inplace_abn=True, eps=EPS):
        if p in signs:
            t = t * torch.tensor(signs[p], dtype=t.dtype).view(1, -1, 1, 1)
        w = sd.get(p + ".weight")
        if inplace_abn:
            w = w.abs() + eps
        y = F.batch_norm(t, sd[p + ".running_mean"].clone(), sd[p + ".running_var"].clone(),
                         w, sd.get(p + ".bias"), training, 0.1, eps)
        return act(y)

    return conv, norm


def leaky(y):
    return F.leaky_relu(y, 0.01)


def ident(y):
    return y


def ref_residual(sd, x, training, signs):
    conv, norm = make_ops(sd, training, signs)
    P = "module."
    stem = norm(conv(x, P + "conv1"), P + "bn1", leaky)
    y = norm(conv(stem, P + "layer1.0.conv1"), P + "layer1.0.bn1", leaky)
    y = norm(conv(y, P + "layer1.0.conv2"), P + "layer1.0.bn2", ident)
    blk = leaky(y + stem)
    y = norm(conv(blk, P + "layer1.1.conv1", 2), P + "layer1.1.bn1", leaky)
    y = norm(conv(y, P + "layer1.1.conv2"), P + "layer1.1.bn2", ident)
    sc = norm(conv(blk, P + "layer1.1.downsample.0", 2, 0), P + "layer1.1.downsample.1", ident)
    y = F.relu(y + sc)
    t = norm(y, P + "layer2.0.bn1", leaky)
    t = norm(conv(t, P + "layer2.0.conv1"), P + "layer2.0.bn2", leaky)
    z = conv(t, P + "layer2.0.conv2") + y
    t = conv(norm(z, P + "layer2.1.bn1", ident), P + "layer2.1.conv1", 1, 0)
    return t + z


def ref_densenet(sd, x, training, signs):
    conv, norm = make_ops(sd, training, signs)
    x = norm(conv(x, "features.conv0"), "features.norm0", leaky)
    feats = [F.max_pool2d(x, 3, 2, 1)]
    for i, act in ((1, leaky), (2, lambda y: F.elu(y, 1.0))):
        p = "features.denseblock1.denselayer%d." % i
        t = conv(norm(torch.cat(feats, 1), p + "norm.1", leaky), p + "conv.1", 1, 0)
        feats.append(conv(norm(t, p + "norm.2", act), p + "conv.2"))
    t = conv(norm(torch.cat(feats, 1), "features.transition1.norm", leaky), "features.transition1.conv", 1, 0)
    t = F.avg_pool2d(t, 2, 2)
    t = norm(t, "features.norm5", F.relu, inplace_abn=False)
    t = torch.flatten(F.adaptive_avg_pool2d(t, 1), 1)
    return F.linear(t, sd["classifier.weight"], sd["classifier.bias"])


def ref_conv_bn_act(sd, x, training, signs):
    conv, norm = make_ops(sd, training, signs)
    x = norm(conv(x, "conv1"), "bn1", F.relu, inplace_abn=False)
    x = F.max_pool2d(x, 3, 2, 1)
    x = F.conv2d(x, sd["conv2.weight"], None, 1, 2, 2, 2)
    x = norm(x, "bn2", lambda y: F.elu(y, 1.0))
    return F.leaky_relu(x, 0.2)


def ref_abn_linear(sd, x, training, signs):
    conv, norm = make_ops(sd, training, signs)
    x = norm(conv(x, "body.conv"), "body.abn", F.relu, inplace_abn=False)
    x = norm(x, "body.bn", lambda y: F.elu(y, 0.5), inplace_abn=False, eps=1e-3)
    x = F.max_pool2d(x, 2)
    x = F.avg_pool2d(x, 3, 1, 1, ceil_mode=True, count_include_pad=False)
    x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
    x = F.dropout(x, 0.3, training=training)
    return F.linear(x, sd["head.fc.weight"], sd["head.fc.bias"])


def ref_activations(sd, x, training, signs):
    conv, norm = make_ops(sd, training, signs)
    x = norm(conv(x, "c1"), "b1", F.relu6, inplace_abn=False)
    x = norm(conv(x, "c2"), "b2", ident)
    x = F.silu(x)
    s = F.adaptive_avg_pool2d(x, 1)
    s = F.relu(F.conv2d(s, sd["se.fc1.weight"], sd["se.fc1.bias"]))
    gate = torch.sigmoid(F.conv2d(s, sd["se.fc2.weight"], sd["se.fc2.bias"]))
    x = x * gate
    x = norm(conv(x, "c3"), "b3", F.hardswish, inplace_abn=False)
    x = norm(F.conv2d(x, sd["c4.weight"]), "b4", F.gelu, inplace_abn=False)
    h = F.hardsigmoid(x)
    h2 = torch.clamp(0.2 * x + 0.5, 0, 1)
    return (h - gate) / F.hardtanh(gate, 0.5, 2.0) + h2


def ref_inverted_residual(sd, x, training, signs):
    conv, norm = make_ops(sd, training, signs)
    stem = norm(conv(x, "stem.conv"), "stem.bn", leaky)
    t = norm(conv(stem, "block1.expand", pad=0), "block1.bn1", leaky)
    t = F.conv2d(t, sd["block1.dw.weight"], None, 1, 1, 1, 12)
    t = conv(norm(t, "block1.bn2", lambda y: F.elu(y, 1.0)), "block1.project", pad=0)
    blk = norm(t, "block1.bn3", ident) + stem
    p = conv(blk, "block2.project", pad=0)
    t = norm(p, "block2.bn", ident) + blk + p
    f = torch.flatten(F.adaptive_avg_pool2d(t, 1), 1)
    t = norm(F.linear(f, sd["block3.fc.weight"], sd["block3.fc.bias"]), "block3.bn", ident) + f
    return F.linear(t, sd["head.weight"], sd["head.bias"])


REFERENCES = {
    "inverted_residual": ref_inverted_residual,
    "activations": ref_activations,
    "conv_bn_act": ref_conv_bn_act,
    "residual": ref_residual,
    "densenet": ref_densenet,
    "abn_linear": ref_abn_linear,
}


def compare(case, r, e, rt, et, other):
    """The emitted model (r, e) against another run of the same network
    (rt, et) from the same state: one with recomputation, one without."""
    torch.testing.assert_close(r["out"], rt["out"], **TOL, msg="output differs from " + other)
    torch.testing.assert_close(r["xgrad"], rt["xgrad"], **TOL, msg="input gradient differs from " + other)
    if set(r["grads"]) != set(rt["grads"]):
        raise AssertionError("parameter names differ from " + other)
    for k in rt["grads"]:
        torch.testing.assert_close(r["grads"][k], rt["grads"][k], **TOL, msg="gradient of " + k)
    for k in rt["after"]:
        torch.testing.assert_close(r["after"][k], rt["after"][k], **TOL, msg="state after the step: " + k)
    torch.testing.assert_close(e, et, **TOL, msg="eval output differs from " + other)
    for p in case.get("norms", []):
        if r["calls"][p] != 2 or rt["calls"][p] != 1:
            raise AssertionError("%s ran %d times (recomputed) and %d times (%s), want 2 and 1"
                                 % (p, r["calls"][p], rt["calls"][p], other))
    if case.get("concat_channels") and (r["concat_saved"] != 0 or rt["concat_saved"] == 0):
        raise AssertionError("saved %d-channel tensors: %d with recomputation, %d in %s; want 0 and some"
                             % (case["concat_channels"], r["concat_saved"], rt["concat_saved"], other))


def run_torchvision_case(case, tmp):
    """The emitted module against torchvision's own model, from torchvision's
    own state dict (BN values randomised so that every BN matters)."""
    import torchvision

    tv = getattr(torchvision.models, case["torchvision"])()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod in tv.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                c = mod.num_features
                mod.weight.copy_((torch.rand(c, generator=gen) + 0.5) * torch.where(torch.rand(c, generator=gen) < 0.3, -1.0, 1.0))
                mod.bias.copy_(torch.randn(c, generator=gen) * 0.1)
                mod.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                mod.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
                mod.num_batches_tracked.fill_(3)
    want = {k: list(v.shape) for k, v in tv.state_dict().items()}
    if want != {k: list(v) for k, v in case["keys"].items()}:
        raise AssertionError("the test graph's keys are not torchvision's")
    path = os.path.join(tmp, case["name"] + ".pth")
    torch.save(tv.state_dict(), path)
    m = load_module(case["module"]).Model()
    m.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    m.double()
    tv.double()
    gen = torch.Generator().manual_seed(99)
    x0 = torch.randn(case["input"], generator=gen, dtype=torch.float64)
    norms = case.get("norms", [])
    r = train_step(m, x0, norms)
    check_counts(case, r)
    rt = train_step(tv, x0, norms)
    compare(case, r, eval_twice(m, x0), rt, eval_twice(tv, x0), "torchvision")
    print("ok", case["name"], flush=True)


def run_case(case, tmp):
    if case.get("torchvision"):
        return run_torchvision_case(case, tmp)
    mod = load_module(case["module"])
    m = loaded_model(mod, case, tmp)
    gen = torch.Generator().manual_seed(99)
    x0 = torch.randn(case["input"], generator=gen, dtype=torch.float64)
    r = train_step(m, x0, case.get("norms", []), case.get("concat_channels", 0))
    check_counts(case, r)
    e = eval_twice(m, x0)
    if not torch.isfinite(e).all():
        raise AssertionError("eval output is not finite")

    ref = REFERENCES.get(case.get("reference", ""))
    if ref is not None:
        signs = case.get("signs", {})
        before = {k: v.double() if v.is_floating_point() else v for k, v in r["before"].items()}
        after = {k: v.double() if v.is_floating_point() else v for k, v in r["after"].items()}
        torch.manual_seed(5)
        torch.testing.assert_close(r["out"], ref(before, x0, True, signs), **TOL,
                                   msg="training output differs from the reference")
        with torch.no_grad():
            torch.testing.assert_close(e, ref(after, x0, False, signs), **TOL,
                                       msg="eval output differs from the reference")

    for p in case.get("norms", []):
        # Running statistics after one step: exactly one update from the
        # batch the layer saw, as nn.BatchNorm2d would make it.
        rm = r["before"][p + ".running_mean"].clone()
        rv = r["before"][p + ".running_var"].clone()
        F.batch_norm(r["first_in"][p], rm, rv, None, None, True, 0.1, EPS)
        torch.testing.assert_close(r["after"][p + ".running_mean"], rm, **TOL, msg=p + ": running_mean")
        torch.testing.assert_close(r["after"][p + ".running_var"], rv, **TOL, msg=p + ": running_var")

    twin = case.get("twin")
    if twin:
        t = loaded_model(load_module(twin["module"]), dict(case, name=case["name"] + "_twin"), tmp)
        rt = train_step(t, x0, case.get("norms", []), case.get("concat_channels", 0))
        compare(case, r, e, rt, eval_twice(t, x0), "the twin")
    print("ok", case["name"], flush=True)


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            try:
                run_case(case, tmp)
            except Exception as e:
                raise SystemExit("case %s: %s: %s" % (case["name"], type(e).__name__, e))


if __name__ == "__main__":
    main()
