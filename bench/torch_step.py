#!/usr/bin/python3
"""Time one training step (forward and backward) of torchvision's resnet50 in
PyTorch on the CPU, the same work as the Go benchmark BenchmarkResNet50Step.

    /usr/bin/python3 bench/torch_step.py --batch 8 --size 224 --threads 2 --repeat 3

Prints JSON: the median and every time in seconds.
"""
import argparse
import json
import statistics
import time

import torch
import torchvision


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet50().train()
    x = torch.randn(a.batch, 3, a.size, a.size)
    dout = torch.full((a.batch, 1000), 1e-3)
    times = []
    for i in range(a.repeat + 1):  # the first run warms up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(x).backward(dout)
        dt = time.perf_counter() - t0
        if i > 0:
            times.append(dt)
    print(json.dumps({"torch": torch.__version__, "threads": a.threads, "batch": a.batch, "size": a.size,
                      "median_s": statistics.median(times), "times_s": times}))


if __name__ == "__main__":
    main()
