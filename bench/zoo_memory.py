#!/usr/bin/python3
"""Helper of bench/zoo_memory.sh: the inputs abnconvert measures, and what
PyTorch itself keeps for the same networks.

    /usr/bin/python3 bench/zoo_memory.py prepare NAME DIR
        DIR/NAME.pth (state dict) and DIR/NAME.onnx (the PRESERVE export that
        gives --graph its structure: eval mode, opset 13, batch and spatial
        axes dynamic, exported at a small size so that the measurement at
        224x224 also shows that no shape was frozen), built as
        ../shared/tools/saved_activations.py builds NAME (weights=None,
        googlenet/inception_v3 aux_logits=False, segmentation aux_loss=False).

    /usr/bin/python3 bench/zoo_memory.py emitted MODULE.py CKPT --batch 8 --size 224
        What PyTorch keeps (saved-tensor hooks, the shared tool's rule) for one
        training forward of abnconvert's emitted module with the pure-PyTorch
        inplace_abn stand-in (fixtures/standin: it saves only the output,
        ctx.mark_dirty on the input, as the real library does), and whether
        the backward then runs. JSON.

    /usr/bin/python3 bench/zoo_memory.py note-method NAME --batch 8 --size 224
        The measurement method of shared/notes/zoo-and-peers.md applied with
        the stand-in to torchvision's own module: every BatchNorm2d made
        InPlaceABN(activation="identity"), every activation made out of place,
        torchvision's forward otherwise unchanged; saved bytes, then whether
        one backward pass runs (torchvision's InvertedResidual does
        `result += input` in place on the last InPlace-ABN's output, which
        that layer saved for its backward). JSON.
"""
import argparse
import importlib.util
import json
import os
import sys
import warnings

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "fixtures"))
sys.path.insert(0, os.path.join(ROOT, "..", "shared", "tools"))
import zoo  # noqa: E402  (build: the same constructors as the shared tool)
from saved_activations import saved_activation_bytes  # noqa: E402

EXPORT_SIZE = {"inception_v3": 75}


def prepare(name, out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    net = zoo.build(name).eval()
    torch.save(net.state_dict(), os.path.join(out, name + ".pth"))
    s = EXPORT_SIZE.get(name, 32)
    torch.onnx.export(net, torch.randn(1, 3, s, s), os.path.join(out, name + ".onnx"), opset_version=13,
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                      input_names=["x"], dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}})


def backward_runs(model, x):
    out = model(x)
    if isinstance(out, dict):
        out = out["out"]
    try:
        out.sum().backward()
        return True, ""
    except RuntimeError as e:
        return False, str(e).splitlines()[0][:200]


def standin():
    sys.path.insert(0, os.path.join(ROOT, "fixtures", "standin"))
    import inplace_abn
    return inplace_abn


def emitted(module_py, ckpt, batch, size):
    standin()
    spec = importlib.util.spec_from_file_location("emitted", module_py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = mod.Model()
    m.load_state_dict(torch.load(ckpt, weights_only=True), strict=True)
    m.train()
    x = torch.randn(batch, 3, size, size)
    b = saved_activation_bytes(m, x)
    ok, err = backward_runs(m, x)
    return {"saved_bytes": b, "backward_runs": ok, "backward_error": err}


def note_method(name, batch, size):
    abn = standin()
    torch.manual_seed(0)
    net = zoo.build(name)

    def swap(parent):
        for k, child in parent.named_children():
            if isinstance(child, nn.BatchNorm2d):
                new = abn.InPlaceABN(child.num_features, eps=child.eps, momentum=child.momentum, activation="identity")
                new.load_state_dict(child.state_dict())
                setattr(parent, k, new)
            else:
                if hasattr(child, "inplace"):
                    child.inplace = False
                swap(child)
    swap(net)
    net.train()
    x = torch.randn(batch, 3, size, size)
    b = saved_activation_bytes(net, x)
    ok, err = backward_runs(net, x)
    return {"saved_bytes": b, "backward_runs": ok, "backward_error": err}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("name")
    p.add_argument("dir")
    e = sub.add_parser("emitted")
    e.add_argument("module")
    e.add_argument("ckpt")
    n = sub.add_parser("note-method")
    n.add_argument("name")
    for q in (e, n):
        q.add_argument("--batch", type=int, default=8)
        q.add_argument("--size", type=int, default=224)
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.cmd == "prepare":
        prepare(a.name, a.dir)
    elif a.cmd == "emitted":
        print(json.dumps(emitted(a.module, a.ckpt, a.batch, a.size)))
    else:
        print(json.dumps(note_method(a.name, a.batch, a.size)))


if __name__ == "__main__":
    main()
