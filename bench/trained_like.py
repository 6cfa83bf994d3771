#!/usr/bin/python3
"""Checkpoints for the conversion benchmark, as users have them.

A freshly initialised torchvision checkpoint has every BatchNorm gamma equal
to 1, so a conversion folds no sign and copies every record; a trained one
does not. This writes, seeded, a torchvision state dict in one of two forms:

  init     torchvision's default initialisation (every gamma 1)
  trained  BN parameters as training leaves them: about 11% of the gammas
           negative, about 1% below eps (|gamma| < 1e-5), random betas and
           positive running statistics

and a synthetic checkpoint of wide_resnet101_2's layout widened until it
weighs about --gb gigabytes.

    python3 bench/trained_like.py MODEL {init,trained} OUT.pth [--seed 0]
    python3 bench/trained_like.py synthetic trained OUT.pth --gb 2
"""
import argparse

import torch
import torchvision
from torchvision.models.resnet import Bottleneck, ResNet


def synthetic(gb):
    # wide_resnet101_2 is 126.9M parameters at width_per_group 128; the
    # inner convolutions' weights grow with the square of the width.
    width = 128
    while True:
        m = ResNet(Bottleneck, [3, 4, 23, 3], width_per_group=width)
        n = sum(p.numel() for p in m.parameters())
        if n * 4 >= gb * 1e9:
            return m
        width += 32


def trained(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, torch.nn.BatchNorm2d):
                continue
            c = m.num_features
            gamma = 0.2 + torch.rand(c, generator=g)
            u = torch.rand(c, generator=g)
            gamma[u < 0.11] *= -1
            tiny = torch.rand(c, generator=g) < 0.01
            gamma[tiny] = 1e-6 * torch.sign(torch.randn(int(tiny.sum()), generator=g))
            m.weight.copy_(gamma)
            m.bias.copy_(0.1 * torch.randn(c, generator=g))
            m.running_mean.copy_(0.1 * torch.randn(c, generator=g))
            m.running_var.copy_(0.5 + torch.rand(c, generator=g))
            m.num_batches_tracked.fill_(1000)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("form", choices=["init", "trained"])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gb", type=float, default=2.0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    if a.model == "synthetic":
        model = synthetic(a.gb)
    else:
        model = getattr(torchvision.models, a.model)()
    if a.form == "trained":
        trained(model, a.seed)
    torch.save(model.state_dict(), a.out)


if __name__ == "__main__":
    main()
