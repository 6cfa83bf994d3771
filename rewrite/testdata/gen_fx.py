#!/usr/bin/python3
"""Real-PyTorch fixtures for package rewrite's tests.

For each small torchvision network of fixtures/models.py (BN parameters as
training leaves them, negative and tiny gammas included), this writes

    NAME.fx.json      the network traced by torch.fx: one entry per node
                      (op, module path, inputs, attributes, output shape),
                      the state-dict index into NAME.weights.bin, a fixed
                      input, and the float64 eval outputs of the original
                      network and of its leaky-ReLU(0.01) reference
    NAME.weights.bin  the state dict, float32 little-endian, in key order

The Go tests rebuild the graph from the trace, check their reference
evaluator against these PyTorch outputs, convert, and check again.

    /usr/bin/python3 rewrite/testdata/gen_fx.py   # from the repository root
"""
import json
import operator
import os
import struct
import sys

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "fixtures"))
import models  # noqa: E402  (the project's fixture builders)

NAMES = ["tiny_densenet", "tiny_resnext"]


def pair(v):
    return list(v) if isinstance(v, (tuple, list)) else [v, v]


def module_entry(m):
    if isinstance(m, nn.Conv2d):
        return "Conv2d", {
            "kernel_size": pair(m.kernel_size), "stride": pair(m.stride), "padding": pair(m.padding),
            "dilation": pair(m.dilation), "groups": m.groups, "in_channels": m.in_channels,
            "out_channels": m.out_channels, "bias": m.bias is not None}
    if isinstance(m, nn.BatchNorm2d):
        return "BatchNorm2d", {"features": m.num_features, "eps": m.eps, "momentum": m.momentum}
    if isinstance(m, nn.ReLU):
        return "ReLU", {}
    if isinstance(m, nn.LeakyReLU):
        return "LeakyReLU", {"activation_param": m.negative_slope}
    if isinstance(m, nn.ELU):
        return "ELU", {"activation_param": m.alpha}
    if isinstance(m, nn.MaxPool2d):
        return "MaxPool2d", {"kernel_size": pair(m.kernel_size), "stride": pair(m.stride),
                             "padding": pair(m.padding), "dilation": pair(m.dilation), "ceil_mode": m.ceil_mode}
    if isinstance(m, nn.AvgPool2d):
        return "AvgPool2d", {"kernel_size": pair(m.kernel_size), "stride": pair(m.stride),
                             "padding": pair(m.padding), "ceil_mode": m.ceil_mode,
                             "count_include_pad": m.count_include_pad}
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return "AdaptiveAvgPool2d", {"output_size": pair(m.output_size)}
    if isinstance(m, nn.Linear):
        return "Linear", {"in_channels": m.in_features, "out_channels": m.out_features, "bias": m.bias is not None}
    if isinstance(m, nn.Dropout):
        return "Dropout", {"p": m.p}
    raise ValueError("unsupported module %r" % m)


def function_entry(n):
    t = n.target
    if t in (torch.cat,):
        return "Concat", {"axis": n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)}, list(n.args[0])
    if t in (operator.add, operator.iadd, torch.add):
        return "Add", {}, list(n.args[:2])
    if t in (F.relu, torch.relu):
        return "ReLU", {}, [n.args[0]]
    if t is torch.flatten:
        return "Flatten", {"start_dim": n.args[1] if len(n.args) > 1 else 0}, [n.args[0]]
    if t is F.adaptive_avg_pool2d:
        return "AdaptiveAvgPool2d", {"output_size": pair(n.args[1])}, [n.args[0]]
    raise ValueError("unsupported function %r" % t)


def trace(model, x):
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    mods = dict(gm.named_modules())
    nodes, output = [], None
    for n in gm.graph.nodes:
        shape = list(n.meta["tensor_meta"].shape) if "tensor_meta" in n.meta else []
        if n.op == "placeholder":
            nodes.append({"name": n.name, "op": "Input", "inputs": [], "attr": {}, "shape": shape})
        elif n.op == "call_module":
            op, attr = module_entry(mods[n.target])
            nodes.append({"name": n.name, "module": n.target, "op": op, "inputs": [n.args[0].name],
                          "attr": attr, "shape": shape})
        elif n.op == "call_function":
            op, attr, ins = function_entry(n)
            nodes.append({"name": n.name, "op": op, "inputs": [i.name for i in ins], "attr": attr, "shape": shape})
        elif n.op == "output":
            output = n.args[0].name
        else:
            raise ValueError("unsupported node %s %s" % (n.op, n.target))
    return nodes, output


def write(name):
    model = models.make(name)
    x = models.fixed_input(name)
    nodes, output = trace(model, x)
    ref, changed = models.leaky_reference(model, 0.01)
    sd = model.state_dict()
    index, blob = [], bytearray()
    for key, t in sd.items():
        vals = t.detach().to(torch.float32).flatten().tolist()
        index.append({"key": key, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                      "offset": len(blob) // 4, "numel": len(vals)})
        blob += struct.pack("<%df" % len(vals), *vals)
    with torch.no_grad():
        out = model.double()(x.double())
        leaky = ref.double()(x.double())
    doc = {
        "name": name, "nodes": nodes, "output": output, "tensors": index,
        "input": {"shape": list(x.shape), "values": x.double().flatten().tolist()},
        "eval_output": out.flatten().tolist(), "leaky_output": leaky.flatten().tolist(),
        "leaky_sites": changed,
    }
    with open(os.path.join(HERE, name + ".fx.json"), "w") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(HERE, name + ".weights.bin"), "wb") as f:
        f.write(blob)
    print("%s: %d nodes, %d tensors, %d bytes of weights, %d BN+ReLU sites" % (name, len(nodes), len(index), len(blob), changed))


if __name__ == "__main__":
    for name in sys.argv[1:] or NAMES:
        write(name)
