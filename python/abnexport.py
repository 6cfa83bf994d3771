#!/usr/bin/env python3
"""Export a PyTorch model for abnconvert, with a probe of what it computes.

abnconvert rebuilds your network from its state dict's keys and shapes, or
from an ONNX export (--graph), and runs it in its own runtime. `verify`
compares the conversion with that rebuild; if the rebuild itself is wrong
(a ResNet with maxpool = nn.Identity(), a last stride of 1, a layer read
wrongly), both sides share the mistake. The probe is the ground truth from
outside: what real PyTorch computed on your model object. `abnconvert
verify --probe PREFIX.probe.pth` (and `convert --verify --probe`) compares
the rebuild with it first.

As a library (any nn.Module: torchvision, timm, your own):

    from abnexport import export
    export(model, (2, 3, 224, 224), "net")      # net.pth, net.onnx, net.probe.pth

From the command line (FACTORY is an importable callable returning the
module; --weights loads a state dict into it first):

    python3 abnexport.py mypkg.models:build_net --weights ckpt.pth --shape 2,3,224,224 --out net

then

    abnconvert convert -i net.pth -o net_abn.pth --graph net.onnx --emit-module net_abn.py --verify --probe net.probe.pth

It writes, without changing the model you pass (every forward runs on a
deep copy):

- PREFIX.pth: the state dict, copied before any forward moves the running
  statistics.
- PREFIX.onnx: the --graph export abnconvert's README asks for: train mode,
  training=TrainingMode.PRESERVE, do_constant_folding=False, dynamic batch,
  height and width, opset 13 by default; under torch 1.x, torch 2's
  symbolic for aten::bernoulli is registered when the model holds
  torchvision's StochasticDepth (torch 1.13 cannot export it otherwise).
  Its initializers are given the saved state's values (the export's trace
  moved the running statistics), when the onnx package is installed.
- PREFIX.probe.pth: a plain dict saved with torch.save (torch.load(...,
  weights_only=True) reads it), keys:
    "abnconvert_probe"        int64 [1]: the format version (1)
    "note"                    a string saying what the probe holds
    "seed"                    int64 [1]: the seed of the input and of g
    "input"                   the input, float32, drawn from the seed
    "eval.output.K"           eval-mode output K (outputs flattened: a
                              tensor; tuples and lists in order; dicts in
                              their order)
    "train.grad_output.K"     g for training output K
    "train.output.K"          training-mode output K of one step on a copy
                              of the saved state
    "train.input_grad"        d/d input of sum_K sum(train.output.K * g_K)
    "train.stats.KEY"         every BN buffer (running_mean, running_var,
                              num_batches_tracked) after the step, KEY as in
                              the state dict
    "after.output.K"          eval-mode output K after the step
    "random_layers_eval"      int64 [1]: how many Dropout / StochasticDepth
                              / DropPath layers ran in eval mode during the
                              training step: their masks cannot be
                              reproduced outside torch's generator, so the
                              step is recorded without them, and abnconvert
                              runs its step without them too.

Only torch (and torchvision, when the model uses it) are needed. Python 3.8+.
"""
import argparse
import copy
import importlib
import os
import sys
import warnings

import torch
import torch.nn as nn

FORMAT_VERSION = 1

# Layers whose training-mode output is random. Matched by class name too, so
# that timm's DropPath and DropBlock count without importing timm.
RANDOM_NAMES = {"StochasticDepth", "DropPath", "DropBlock2d", "DropBlock"}


def _is_random(m):
    return isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ in RANDOM_NAMES


def _flatten(y, what):
    """The model's output as a list of tensors, in a fixed order."""
    if torch.is_tensor(y):
        return [y]
    if isinstance(y, dict):
        out = []
        for v in y.values():
            out += _flatten(v, what)
        return out
    if isinstance(y, (tuple, list)):  # namedtuples too (GoogLeNetOutputs)
        out = []
        for v in y:
            if v is not None:
                out += _flatten(v, what)
        return out
    raise TypeError("%s: the model returned a %s; abnexport records tensors, tuples, lists and dicts of them"
                    % (what, type(y).__name__))


def _has_stochastic_depth(model):
    return any(type(m).__name__ == "StochasticDepth" for m in model.modules())


def _bernoulli_symbolic(g, input, p=None, generator=None, out=None):
    """torch 2.6's symbolic_opset9.bernoulli, for torch 1.13's exporter
    (the same as fixtures/stochdepth.py's): uniform noise like input, kept
    where below p, cast to float32."""
    from torch.onnx import symbolic_helper
    if generator is not None and not symbolic_helper._is_none(generator):
        symbolic_helper._unimplemented("Bernoulli", "generator is not supported for bernoulli", input)
    rands = g.op("RandomUniformLike", input, high_f=1.0, low_f=0.0, dtype_i=1)
    if p is None or symbolic_helper._is_none(p):
        prob = input
    else:
        prob = g.op("Constant", value_t=torch.tensor(symbolic_helper._maybe_get_const(p, "f"), dtype=torch.float32))
    return g.op("Cast", g.op("Less", rands, prob), to_i=1)


def _bn_buffers(model):
    """Every BatchNorm buffer, keyed as in the state dict."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            for b in ("running_mean", "running_var", "num_batches_tracked"):
                t = getattr(m, b, None)
                if t is not None:
                    out[(name + "." if name else "") + b] = t.detach().clone()
    return out


def probe(model, input_shape, seed=0):
    """The probe dict of model (not changed) on a seeded input of input_shape."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*input_shape, generator=gen)
    p = {"abnconvert_probe": torch.tensor([FORMAT_VERSION], dtype=torch.int64),
         "seed": torch.tensor([seed], dtype=torch.int64), "input": x.clone()}

    ev = copy.deepcopy(model).eval()
    with torch.no_grad():
        for k, y in enumerate(_flatten(ev(x), "eval")):
            p["eval.output.%d" % k] = y.detach().float().clone()

    tr = copy.deepcopy(model).train()
    randoms = [m for m in tr.modules() if _is_random(m)]
    for m in randoms:
        m.eval()
    xt = x.clone().requires_grad_(True)
    ys = _flatten(tr(xt), "training")
    loss = 0
    for k, y in enumerate(ys):
        g = torch.randn(y.shape, generator=gen)
        p["train.grad_output.%d" % k] = g
        p["train.output.%d" % k] = y.detach().float().clone()
        loss = loss + (y * g).sum()
    loss.backward()
    p["train.input_grad"] = xt.grad.detach().clone()
    for k, v in _bn_buffers(tr).items():
        p["train.stats." + k] = v
    tr.eval()
    with torch.no_grad():
        for k, y in enumerate(_flatten(tr(x), "eval after the step")):
            p["after.output.%d" % k] = y.detach().float().clone()
    p["random_layers_eval"] = torch.tensor([len(randoms)], dtype=torch.int64)
    p["note"] = ("abnconvert probe v%d: seeded input; eval outputs; one training step from the saved state "
                 "(%d Dropout/StochasticDepth layers in eval mode during it: their masks cannot be reproduced); "
                 "its outputs, input gradient of sum(output * g), BN buffers after it; eval outputs after it"
                 % (FORMAT_VERSION, len(randoms)))
    return p


def export(model, input_shape, prefix, opset=13, seed=0):
    """Write prefix.pth, prefix.onnx and prefix.probe.pth for model (which
    is left as it was). Returns the three paths."""
    input_shape = tuple(int(d) for d in input_shape)
    if len(input_shape) < 2:
        raise ValueError("input_shape %s: give at least (batch, channels, ...)" % (input_shape,))
    paths = (prefix + ".pth", prefix + ".onnx", prefix + ".probe.pth")
    # The state dict first, deep-copied: every forward below (the export's
    # train-mode trace included) would move the running statistics.
    state = copy.deepcopy(model.state_dict())
    p = probe(model, input_shape, seed)

    exp = copy.deepcopy(model).train()
    if _has_stochastic_depth(exp) and int(torch.__version__.split(".")[0]) < 2:
        torch.onnx.register_custom_op_symbolic("aten::bernoulli", _bernoulli_symbolic, opset)
    dyn = {0: "n"}
    for d in range(2, len(input_shape)):
        dyn[d] = ("h", "w", "d")[d - 2] if d - 2 < 3 else "s%d" % d
    x = torch.randn(*input_shape, generator=torch.Generator().manual_seed(seed + 1))
    with warnings.catch_warnings():
        # torch 1.13 warns once per BN that the export drops the
        # num_batches_tracked update: expected (abnconvert reads the
        # buffers from PREFIX.pth), and noise to a user.
        warnings.filterwarnings("ignore", message=".*Removing mutation from node aten::add_.*")
        try:
            torch.onnx.export(exp, x, paths[1], opset_version=opset,
                              training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                              input_names=["x"], dynamic_axes={"x": dyn})
        except Exception as err:  # noqa: BLE001  (torch's SymbolicValueError; its class moved between versions)
            # torch 1.13 has no train-mode symbolic for Dropout2d/3d
            # (aten::feature_dropout): export them in eval mode, where they
            # are the identity and leave the graph, and say so.
            drops = [m for m in exp.modules() if isinstance(m, (nn.Dropout2d, nn.Dropout3d))]
            if "feature_dropout" not in str(err) or not drops:
                raise
            for m in drops:
                m.eval()
            torch.onnx.export(exp, x, paths[1], opset_version=opset,
                              training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                              input_names=["x"], dynamic_axes={"x": dyn})
            print("abnexport: warning: torch %s cannot export Dropout2d/Dropout3d in train mode (aten::feature_dropout): "
                  "%d such layer(s) exported in eval mode, so %s and the emitted module have none; add "
                  "F.dropout2d(x, p, self.training) back in the emitted module where the model had them"
                  % (torch.__version__, len(drops), paths[1]), file=sys.stderr)
    _restore_initializers(paths[1], state)
    torch.save(state, paths[0])
    torch.save(p, paths[2])
    return paths


def _restore_initializers(path, state):
    """Give the export's initializers the saved state's values: the export's
    train-mode trace moved the running statistics before torch wrote them,
    so that PREFIX.onnx converted on its own would not be the model the
    probe was recorded from. Needs the onnx package; without it the file is
    left as torch wrote it, with a warning (use it as --graph: the weights
    then come from PREFIX.pth)."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        print("abnexport: warning: no onnx package: %s holds the running statistics after the export's trace; "
              "convert PREFIX.pth with --graph %s (the probe matches PREFIX.pth)" % (path, path), file=sys.stderr)
        return False
    m = onnx.load(path)
    for init in m.graph.initializer:
        t = state.get(init.name)
        if torch.is_tensor(t) and list(t.shape) == list(init.dims) and t.is_floating_point():
            init.CopyFrom(numpy_helper.from_array(t.detach().cpu().float().numpy()
                                                  if init.data_type == onnx.TensorProto.FLOAT else t.detach().cpu().numpy(), init.name))
    onnx.save(m, path)
    return True


def _factory(spec):
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise SystemExit("abnexport: %r: give the factory as MODULE:CALLABLE, e.g. torchvision.models:resnet50" % spec)
    sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv=None):
    ap = argparse.ArgumentParser(description="Export a model for abnconvert: PREFIX.pth, PREFIX.onnx (--graph) and PREFIX.probe.pth (--probe).")
    ap.add_argument("factory", help="MODULE:CALLABLE returning the nn.Module, e.g. torchvision.models:resnet50")
    ap.add_argument("--weights", help="a state dict (or a dict holding one under 'state_dict') to load into the model, strictly")
    ap.add_argument("--shape", required=True, help="input shape, e.g. 2,3,224,224 (batch of 2 or more: one training step needs batch statistics)")
    ap.add_argument("--out", required=True, help="output prefix: writes PREFIX.pth, PREFIX.onnx, PREFIX.probe.pth")
    ap.add_argument("--opset", type=int, default=13)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        shape = tuple(int(s) for s in a.shape.split(","))
    except ValueError:
        raise SystemExit("abnexport: --shape %r: give integers separated by commas, e.g. 2,3,224,224" % a.shape)
    model = _factory(a.factory)()
    if not isinstance(model, nn.Module):
        raise SystemExit("abnexport: %s returned a %s, not an nn.Module" % (a.factory, type(model).__name__))
    if a.weights:
        sd = torch.load(a.weights, map_location="cpu")
        if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
            sd = sd["state_dict"]
        model.load_state_dict(sd)
    for path in export(model, shape, a.out, opset=a.opset, seed=a.seed):
        print(path)


if __name__ == "__main__":
    main()
