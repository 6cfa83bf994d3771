#!/usr/bin/python3
"""Export the ONNX fixtures of package onnx with real PyTorch.

    /usr/bin/python3 gen.py tiny DIR   # the small committed fixtures (< 1 MB)
    /usr/bin/python3 gen.py big DIR    # resnet18 / densenet121, made at test time

Every model is exported twice over where it matters: with
training=TrainingMode.PRESERVE from a model in eval mode, which keeps the
BatchNormalization nodes the converter rewrites, and with TrainingMode.EVAL,
which folds every BN into the Conv before it (what the reader must detect).

BN parameters and statistics are randomised (with some negative gammas) so
that torch's exporter, which deduplicates equal tensors into Identity chains,
does not hide bugs behind tensors that happen to be equal; the "fresh"
fixtures are exported straight after construction, where deduplication does
happen (ones and zeros everywhere).

Each model NAME.onnx comes with NAME.golden.json: a seeded input, torch's
eval-mode output for it, and a fingerprint (dims, dtype, sum, sum of squares,
first values) of every initializer, so that Go tests can check decoding and
later runtime tests can check outputs without Python.
"""
import json
import os
import sys
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import torch
import torch.nn as nn
import torchvision

warnings.filterwarnings("ignore")

PRESERVE = torch.onnx.TrainingMode.PRESERVE
EVAL = torch.onnx.TrainingMode.EVAL


class TinyCNN(nn.Module):
    """A custom network no architecture recogniser knows: BN followed by
    ReLU, LeakyReLU, ELU and nothing; a residual add; max and average
    pooling; a sigmoid gate (ops the IR does not model, carried through);
    dropout; global pooling and a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.leaky = nn.LeakyReLU(0.1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.down = nn.Conv2d(8, 12, 3, stride=2, padding=1, bias=True)
        self.bn3 = nn.BatchNorm2d(12)
        self.elu = nn.ELU(alpha=0.7)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.bn4 = nn.BatchNorm2d(12, eps=1e-3, momentum=0.05)
        self.gate = nn.Conv2d(12, 12, 1)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.bn5 = nn.BatchNorm2d(12)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        x = self.relu(self.stem_bn(self.stem(x)))
        y = self.leaky(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(y)) + x)
        x = self.elu(self.bn3(self.down(x)))
        x = self.leaky(self.bn4(self.pool(x)))
        x = x * torch.sigmoid(self.gate(x))
        x = self.bn5(self.avg(x))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(self.drop(x))


def tiny_dense():
    """A tiny torchvision DenseNet: the real dense-layer and transition code,
    two blocks of two layers."""
    return torchvision.models.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=3)


def randomise(model, seed):
    """Give every BN distinct statistics and affine parameters, a quarter of
    the gammas negative, so that no two tensors are equal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=g) * 1.5 + 0.25)
                m.weight[torch.rand(c, generator=g) < 0.25] *= -1
                m.bias.copy_(torch.randn(c, generator=g) * 0.3)
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
    return model


def fingerprint(path):
    model = onnx.load(path)
    out = {}
    for t in model.graph.initializer:
        a = onnx.numpy_helper.to_array(t).astype(np.float64)
        out[t.name] = {
            "dims": list(t.dims),
            "data_type": t.data_type,
            "sum": float(a.sum()),
            "sumsq": float((a * a).sum()),
            "first": [float(v) for v in a.reshape(-1)[:4]],
        }
    return out


def export(model, name, outdir, size, mode=PRESERVE, opset=13, seed=1, golden=True, **kw):
    model.eval()
    path = os.path.join(outdir, name + ".onnx")
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(seed))
    torch.onnx.export(model, x, path, training=mode, opset_version=opset,
                      input_names=["x"], output_names=["y"], **kw)
    if golden:
        with torch.no_grad():
            y = model(x)
        g = {
            "model": name + ".onnx",
            "input_shape": list(x.shape),
            "input": [float(v) for v in x.reshape(-1)],
            "output_shape": list(y.shape),
            "output": [float(v) for v in y.reshape(-1)],
            "initializers": fingerprint(path),
        }
        with open(os.path.join(outdir, name + ".golden.json"), "w") as f:
            json.dump(g, f)
    return path


def tiny(outdir):
    torch.manual_seed(0)
    cnn = randomise(TinyCNN(), 1)
    export(cnn, "tiny_cnn", outdir, 12)
    for opset in (9, 11, 15, 17):
        export(cnn, "tiny_cnn_op%d" % opset, outdir, 12, opset=opset, golden=False)
    export(cnn, "tiny_cnn_eval", outdir, 12, mode=EVAL)
    # Training mode: BatchNormalization with its running-statistics outputs.
    cnn.train()
    torch.onnx.export(cnn, torch.randn(2, 3, 12, 12), os.path.join(outdir, "tiny_cnn_train.onnx"),
                      training=PRESERVE, opset_version=15, input_names=["x"], output_names=["y"])
    cnn.eval()
    torch.manual_seed(0)
    export(TinyCNN(), "tiny_cnn_fresh", outdir, 12)
    dense = randomise(tiny_dense(), 2)
    export(dense, "tiny_dense", outdir, 16)
    path = export(dense, "tiny_dense_ext", outdir, 16, golden=False)
    m = onnx.load(path)
    os.remove(path)
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="tiny_dense_ext.data", size_threshold=256)


def big(outdir):
    torch.manual_seed(0)
    r = torchvision.models.resnet18()
    export(r, "resnet18_fresh", outdir, 32, golden=False)
    randomise(r, 3)
    export(r, "resnet18", outdir, 32)
    export(r, "resnet18_eval", outdir, 32, mode=EVAL, golden=False)
    d = randomise(torchvision.models.densenet121(), 4)
    export(d, "densenet121", outdir, 32)
    export(d, "densenet121_eval", outdir, 32, mode=EVAL, golden=False)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("tiny", "big"):
        sys.exit(__doc__)
    os.makedirs(sys.argv[2], exist_ok=True)
    {"tiny": tiny, "big": big}[sys.argv[1]](sys.argv[2])
