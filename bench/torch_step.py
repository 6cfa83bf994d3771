#!/usr/bin/python3
"""Time one training step (forward and backward) of a torchvision network in
PyTorch on the CPU, the same work as the Go benchmark BenchmarkModelStep.

    /usr/bin/python3 bench/torch_step.py --model resnet50 --batch 8 --size 224 --threads 2 --repeat 3
    /usr/bin/python3 bench/torch_step.py --model deeplabv3_resnet50 --save /tmp/m.pth   # write the module, time nothing
    /usr/bin/python3 bench/torch_step.py --load /tmp/m.pth --batch 2                     # time that very module

--save writes the network (built as fixtures/zoo.py builds it: weights=None;
segmentation models with aux_loss=False, their "out" is the output) as a whole pickled
module, torch.save(model), which the Go benchmark reads, so that both sides
time the same network with the same parameters. Prints JSON: the median and
every time in seconds.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
from zoo import build  # noqa: E402  (torchvision's networks as the zoo test builds them)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50", help="a torchvision classification or segmentation name")
    p.add_argument("--load", help="time this whole pickled module instead of building --model")
    p.add_argument("--save", help="write the built module here (torch.save(model)) and time nothing")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.save:
        torch.save(build(a.model), a.save)
        return
    model = (torch.load(a.load) if a.load else build(a.model)).train()
    x = torch.randn(a.batch, 3, a.size, a.size)

    def step():
        y = model(x)
        return y["out"] if isinstance(y, dict) else y

    dout = torch.full(step().shape, 1e-3)
    times = []
    for i in range(a.repeat + 1):  # the first run warms up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step().backward(dout)
        dt = time.perf_counter() - t0
        if i > 0:
            times.append(dt)
    print(json.dumps({"torch": torch.__version__, "model": a.load or a.model, "threads": a.threads, "batch": a.batch,
                      "size": a.size, "median_s": statistics.median(times), "times_s": times}))


if __name__ == "__main__":
    main()
