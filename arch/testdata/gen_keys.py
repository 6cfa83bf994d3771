#!/usr/bin/python3
"""Regenerates torchvision_keys.json.gz: the state-dict keys and shapes (no
values) of every architecture package arch recognises, straight from
torchvision, plus a few non-standard networks built with torchvision's own
classes. The Go tests check arch's key generator and recogniser against it.

It also writes torchvision_fx.json.gz: the forward of a few of them as traced
by torch.fx, one entry per operation with the module's hyper-parameters, so
that the tests can check the graphs arch builds against torchvision's own
forward, order and wiring included.

Run from this directory with the interpreter that has torch:
    /usr/bin/python3 gen_keys.py
"""
import gzip
import json
import re

import torch
import torch.fx
import torchvision
from torchvision.models import densenet, resnet, vgg

NAMES = [
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
    "wide_resnet50_2", "wide_resnet101_2",
    "densenet121", "densenet161", "densenet169", "densenet201",
    "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn",
]


def keys(model):
    return [[k, list(v.shape)] for k, v in model.state_dict().items()]


def pair(v):
    return list(v) if isinstance(v, (tuple, list)) else [v, v]


def module_attrs(m):
    nn = torch.nn
    if isinstance(m, nn.Conv2d):
        return {"kind": "Conv2d", "in": m.in_channels, "out": m.out_channels, "kernel": pair(m.kernel_size),
                "stride": pair(m.stride), "padding": pair(m.padding), "dilation": pair(m.dilation),
                "groups": m.groups, "bias": m.bias is not None}
    if isinstance(m, nn.BatchNorm2d):
        return {"kind": "BatchNorm2d", "features": m.num_features, "eps": m.eps, "momentum": m.momentum}
    if isinstance(m, nn.ReLU):
        return {"kind": "ReLU"}
    if isinstance(m, nn.MaxPool2d):
        return {"kind": "MaxPool2d", "kernel": pair(m.kernel_size), "stride": pair(m.stride),
                "padding": pair(m.padding), "dilation": pair(m.dilation), "ceil_mode": m.ceil_mode}
    if isinstance(m, nn.AvgPool2d):
        return {"kind": "AvgPool2d", "kernel": pair(m.kernel_size), "stride": pair(m.stride),
                "padding": pair(m.padding), "ceil_mode": m.ceil_mode, "count_include_pad": m.count_include_pad}
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return {"kind": "AdaptiveAvgPool2d", "output_size": pair(m.output_size)}
    if isinstance(m, nn.Linear):
        return {"kind": "Linear", "in": m.in_features, "out": m.out_features, "bias": m.bias is not None}
    if isinstance(m, nn.Dropout):
        return {"kind": "Dropout", "p": m.p}
    raise ValueError("unexpected module %r" % m)


def trace(model):
    """The forward as a list of operations; inputs index into the list, the
    network input being -1."""
    mods = dict(model.named_modules())
    index, ops = {}, []
    for n in torch.fx.symbolic_trace(model).graph.nodes:
        if n.op == "placeholder":
            index[n] = -1
            continue
        if n.op == "output":
            continue
        ins = []
        torch.fx.node.map_arg(n.args, lambda a: ins.append(index[a]))
        consts = [a for a in n.args if not isinstance(a, (torch.fx.Node, list, tuple))]
        consts += [list(a) for a in n.args if isinstance(a, tuple)]
        if n.op == "call_module":
            op = {"target": n.target, **module_attrs(mods[n.target])}
        elif n.op == "call_function":
            op = {"target": "", "kind": n.target.__name__, "args": consts}
        else:
            raise ValueError("unexpected fx node %s %s" % (n.op, n.target))
        op["inputs"] = ins
        index[n] = len(ops)
        ops.append(op)
    return ops


def legacy(entries):
    # The inverse of torchvision's densenet _load_state_dict rename: the
    # spelling of checkpoints written before torchvision 0.3.
    pat = re.compile(r"^(.*denselayer\d+\.(?:norm|conv))([12])\.(weight|bias|running_mean|running_var)$")
    out = []
    for k, s in entries:
        if k.endswith("num_batches_tracked"):
            continue  # those checkpoints predate num_batches_tracked
        out.append([pat.sub(r"\1.\2.\3", k), s])
    return out


def main():
    torch.manual_seed(0)
    out = {}
    for name in NAMES:
        out[name] = keys(getattr(torchvision.models, name)())
    # Non-standard networks from the same classes: names starting with
    # "custom_" must get a descriptive, non-exact match, "invalid_" an error.
    out["custom_resnet_basic_1111_c10"] = keys(resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=10))
    out["custom_resnet_bottleneck_1211_g2w16"] = keys(
        resnet.ResNet(resnet.Bottleneck, [1, 2, 1, 1], groups=2, width_per_group=16, num_classes=7))
    out["custom_densenet_k4_bn2_22_i8_c10"] = keys(
        densenet.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=10))
    out["custom_densenet121_legacy"] = legacy(keys(torchvision.models.densenet121()))
    tiny = vgg.VGG(vgg.make_layers([8, "M", 16, "M"], batch_norm=True), num_classes=5)
    # torchvision's VGG hard-codes a 512*7*7 classifier input, which these
    # features cannot feed: recognition must refuse this one...
    out["invalid_vgg_bn_8M16M"] = keys(tiny)
    # ...and accept it once the classifier fits.
    tiny.classifier[0] = torch.nn.Linear(16 * 7 * 7, 32)
    tiny.classifier[3] = torch.nn.Linear(32, 24)
    tiny.classifier[6] = torch.nn.Linear(24, 5)
    out["custom_vgg_bn_8M16M_h32_24_c5"] = keys(tiny)
    with gzip.open("torchvision_keys.json.gz", "wt", compresslevel=9) as f:
        json.dump(out, f, separators=(",", ":"), sort_keys=True)
    print(torch.__version__, torchvision.__version__, {k: len(v) for k, v in out.items()})

    fx = {name: trace(getattr(torchvision.models, name)()) for name in
          ["resnet18", "resnet50", "resnext50_32x4d", "densenet121", "vgg11_bn"]}
    fx["custom_densenet_k4_bn2_22_i8_c10"] = trace(
        densenet.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=10))
    with gzip.open("torchvision_fx.json.gz", "wt", compresslevel=9) as f:
        json.dump(fx, f, separators=(",", ":"), sort_keys=True)
    print({k: len(v) for k, v in fx.items()})


if __name__ == "__main__":
    main()
