#!/usr/bin/python3
"""Regenerates torchvision_tree_keys.json.gz: the state-dict keys and shapes
(no values) of every torchvision 0.14 classifier whose state dict arch
recognises by synthesising its module tree (MobileNetV2, MobileNetV3,
MNASNet, RegNet, ShuffleNetV2, GoogLeNet and Inception3 without auxiliary
classifiers,
EfficientNet V1 and V2, and the MobileNetV3 segmentation models),
straight from torchvision's constructors (weight initialisation skipped: only
shapes are kept). It prints arch's treeNames table, the signature (SHA-256
of the sorted "key [shape]" lines, the final Linear (the segmentation heads'
num_classes layers) and num_batches_tracked aside, first 8 bytes) of each.

Run from this directory with the interpreter that has torch:
    /usr/bin/python3 gen_tree_keys.py
"""
import gzip
import hashlib
import json

import torch
import torchvision

# Shapes only: skip the initialisers, whose cost dominates the big RegNets.
for f in ("kaiming_normal_", "kaiming_uniform_", "normal_", "uniform_", "zeros_", "ones_", "constant_", "trunc_normal_", "xavier_uniform_"):
    setattr(torch.nn.init, f, lambda t, *a, **k: t)

M = torchvision.models
NAMES = ["mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3"] + \
    ["regnet_%s_%s" % (k, s) for k in "xy" for s in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")] + \
    ["regnet_y_128gf", "googlenet", "inception_v3", "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5", "shufflenet_v2_x2_0"] + ["efficientnet_b%d" % i for i in range(8)] + \
    ["efficientnet_v2_s", "efficientnet_v2_m", "efficientnet_v2_l", "lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large"]
# The segmentation heads' modules whose shapes follow num_classes.
SEG_HEAD = ("classifier.low_classifier", "classifier.high_classifier", "classifier.4")


def make(name):
    if "_mobilenet_v3_" in name:
        from torchvision.models import segmentation
        return getattr(segmentation, name)(weights=None, weights_backbone=None, aux_loss=False)
    if name in ("googlenet", "inception_v3"):
        return getattr(M, name)(aux_logits=False, init_weights=False)
    return getattr(M, name)()


def signature(sd, heads):
    lines = sorted("%s [%s]" % (k, " ".join(str(d) for d in v.shape)) for k, v in sd.items()
                   if not any(k.startswith(h + ".") for h in heads) and not k.endswith(".num_batches_tracked"))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


out = {}
for name in NAMES:
    with torch.no_grad():
        m = make(name)
    sd = m.state_dict()
    heads = SEG_HEAD if "_mobilenet_v3_" in name else [[n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)][-1]]
    out[name] = [[k, list(v.shape)] for k, v in sd.items()]
    print('\t"%s": "%s",' % (signature(sd, heads), name))
    del m, sd
with gzip.open("torchvision_tree_keys.json.gz", "wt") as f:
    json.dump(out, f)
