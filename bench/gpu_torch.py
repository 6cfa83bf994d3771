#!/usr/bin/env python3
"""The PyTorch side of bench/gpu.sh, and the renderer of its report.

    python3 bench/gpu_torch.py env
    python3 bench/gpu_torch.py throughput --shapes 32x64x112x112,... [--device cuda] [--reps 20]
    python3 bench/gpu_torch.py checkpoints --out DIR [--models resnet50,densenet121] [--trained]
    python3 bench/gpu_torch.py zoo --out DIR --models mobilenet_v3_small,...
    python3 bench/gpu_torch.py memory --model resnet50 --checkpoint DIR/resnet50.pth \\
        --converted DIR/resnet50_abn.pth --module DIR/resnet50_abn.py [--batch 32 --size 224]
    python3 bench/gpu_torch.py render --jsonl a.jsonl b.jsonl ... > gpu.md

Each measuring subcommand prints JSON lines. "throughput" times PyTorch's own
batch norm (training mode) followed by an in-place leaky ReLU, forward and
backward, on the tensors TestGPUThroughput uses, and counts bytes the same
way (forward 12 bytes per value, backward 20), so the figures compare with
the CUDA backend's kernels directly. "memory" runs one training step of
torchvision's network and of the module abnconvert emitted for its
converted checkpoint (with fixtures/standin's inplace_abn unless the real
package is importable): bytes saved for backward (saved-tensor hooks,
parameters excluded, each storage once) and the allocator's peak above
what was allocated before the forward.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def emit(kind, **v):
    v["kind"] = kind
    print(json.dumps(v), flush=True)


def timer(device):
    """A function timing fn() on the device's clock, in milliseconds."""
    import torch

    if device == "cuda":
        def run(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
    else:
        def run(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    return run


def median_ms(device, fn, reps):
    run = timer(device)
    for _ in range(3):
        fn()
    return statistics.median(run(fn) for _ in range(reps))


def cmd_env(a):
    import torch
    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        v.update(gpu=p.name, capability="%d.%d" % (p.major, p.minor), multiprocessors=p.multi_processor_count,
                 memory_bytes=p.total_memory)
    emit("torch_env", **v)


def parse_shapes(s):
    return [[int(d) for d in part.split("x")] for part in s.split(",") if part]


def cmd_throughput(a):
    import torch
    import torch.nn.functional as F

    dev = a.device
    torch.manual_seed(0)
    for shape in parse_shapes(a.shapes):
        c = shape[1]
        n = 1
        for d in shape:
            n *= d
        x = torch.randn(shape, device=dev)
        y = torch.empty_like(x)
        w = torch.rand(c, device=dev) + 0.5
        b = torch.randn(c, device=dev)
        rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
        copy = median_ms(dev, lambda: y.copy_(x), a.reps)

        def forward():
            out = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
            return F.leaky_relu_(out, 0.01)

        fwd = median_ms(dev, forward, a.reps)
        xg = x.clone().requires_grad_(True)
        wg, bg = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        out = F.leaky_relu(F.batch_norm(xg, rm, rv, wg, bg, training=True, momentum=0.1, eps=1e-5), 0.01)
        dy = torch.randn_like(out)
        bwd = median_ms(dev, lambda: torch.autograd.grad(out, [xg, wg, bg], dy, retain_graph=True), a.reps)
        nbytes = 4 * n
        gbps = lambda mult, ms: mult * nbytes / (ms * 1e-3) / 1e9
        emit("torch_throughput", shape=shape, device=dev, copy_ms=copy, copy_GBps=gbps(2, copy), forward_ms=fwd,
             forward_GBps=gbps(3, fwd), backward_ms=bwd, backward_GBps=gbps(5, bwd))
        del x, y, xg, out, dy
        if dev == "cuda":
            torch.cuda.empty_cache()


def cmd_checkpoints(a):
    import torch
    import torchvision

    os.makedirs(a.out, exist_ok=True)
    for name in a.models.split(","):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)()
        if a.trained:
            # Gammas of both signs, a few below eps, measured running
            # statistics (fixtures/models.py): the sign folding a trained
            # checkpoint needs, which torchvision's initialisation (every
            # gamma 1) skips.
            sys.path.insert(0, os.path.join(ROOT, "fixtures"))
            import models

            models.trained_like(model, 64, seed=1)
        path = os.path.join(a.out, name + ".pth")
        torch.save(model.state_dict(), path)
        emit("checkpoint", model=name, path=path, bytes=os.path.getsize(path), trained=a.trained)


def cmd_zoo(a):
    """Whole pickled modules (torch.save(model)) of fixtures/zoo.py's
    networks, trained-like and calibrated as zoo.py makes them, for
    bench/gpu.sh's verify rows. Classification heads have 10 classes, so
    that the files travel to the GPU machine within its size limit; the
    blocks are torchvision's own."""
    import torch
    import torchvision

    sys.path.insert(0, os.path.join(ROOT, "fixtures"))
    import models
    import zoo

    os.makedirs(a.out, exist_ok=True)
    seg = torchvision.models.segmentation
    for name in a.models.split(","):
        torch.manual_seed(0)
        if hasattr(seg, name) or name.endswith("_aux") or name in ("googlenet", "inception_v3"):
            net = zoo.build(name)
        else:
            net = getattr(torchvision.models, name)(weights=None, num_classes=10)
        export_size, test_size, _ = zoo.ZOO[name]
        models.trained_like(net, export_size, seed=1)
        zoo.calibrate(net, test_size)
        path = os.path.join(a.out, name + ".module.pth")
        torch.save(net, path)
        emit("zoo_module", model=name, path=path, bytes=os.path.getsize(path), torch=torch.__version__)


def load_module(path):
    try:
        import inplace_abn  # noqa: F401  (the real package, when installed)
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "fixtures", "standin"))
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(model, x, dy, dev):
    """One training step: saved bytes, peak above the start, step time."""
    import torch

    params = {p.untyped_storage().data_ptr() if hasattr(p, "untyped_storage") else p.storage().data_ptr()
              for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() if hasattr(b, "untyped_storage") else b.storage().data_ptr()
               for b in model.buffers()}
    saved = {}

    def pack(t):
        s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        ptr = s.data_ptr()
        if ptr not in params:
            nbytes = s.nbytes() if hasattr(s, "nbytes") else s.size() * t.element_size()
            saved[ptr] = nbytes
        return t

    def step():
        model.zero_grad(set_to_none=True)
        model(x).backward(dy)

    step()  # warm up (and let the caching allocator settle)
    model.zero_grad(set_to_none=True)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    v = {"saved_bytes": sum(saved.values()), "saved_tensors": len(saved)}
    if dev == "cuda":
        v["allocated_after_forward"] = torch.cuda.memory_allocated() - base
    out.backward(dy)
    if dev == "cuda":
        torch.cuda.synchronize()
        v["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    del out
    v["step_ms"] = median_ms(dev, step, 3)
    return v


def cmd_memory(a):
    import torch
    import torchvision

    dev = a.device
    torch.manual_seed(0)
    x = torch.randn(a.batch, 3, a.size, a.size, device=dev)
    original = getattr(torchvision.models, a.model)()
    original.load_state_dict(torch.load(a.checkpoint, map_location="cpu"))
    variants = [("original", original)]
    if a.converted:
        m = load_module(a.module).Model()
        m.load_state_dict(torch.load(a.converted, map_location="cpu"), strict=True)
        variants.append(("converted", m))
    for name, model in variants:
        model = model.to(dev).train()
        dy = torch.full((a.batch, 1000), 1e-3, device=dev)
        v = measure(model, x, dy, dev)
        emit("torch_memory", model=a.model, variant=name, batch=a.batch, size=a.size, device=dev, **v)
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()


def mib(b):
    return "%.1f MiB" % (b / 2**20) if isinstance(b, (int, float)) else "n/a"


def cmd_render(a):
    rows = []
    for path in a.jsonl:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
    by = lambda k: [r for r in rows if r.get("kind") == k]
    out = []
    p = out.append
    p("## CUDA backend against the CPU runtime\n")
    cmp = by("cuda_vs_cpu")
    if cmp:
        p("| network | input | eval output | training output | input gradient | parameter gradients | running statistics |")
        p("|---|---|---|---|---|---|---|")
        for r in cmp:
            w = r["worst_relative"]
            def cell(k):
                v = "%.1e" % w.get(k, float("nan"))
                if k.endswith("gradient") or k.endswith("gradients"):
                    if k + "_of_limit" in w:
                        v += " (%.2f of limit)" % w[k + "_of_limit"]
                    if k == "parameter_gradients" and w.get("skipped"):
                        v += ", %d skipped" % w["skipped"]
                return v
            p("| %s | %s | %s |" % (r["network"], "x".join(map(str, r.get("input", []))), " | ".join(
                cell(k) for k in ["eval_output", "train_output", "input_gradient", "parameter_gradients",
                                  "running_statistics"])))
        p("\nLargest absolute difference over the CPU's largest magnitude, per result; limits 1e-4 (eval and "
          "training outputs, running statistics) and for gradients 5e-3 (verify's training floor) or, on the "
          "full-size checkpoints, 25 times the gradient's float32 noise where that is larger (the largest "
          "difference among the CPU run and two CPU runs on the input moved by one rounding; a gradient whose "
          "limit reaches 1 is skipped): \"of limit\" is the worst difference over its limit.\n")
    else:
        p("(not run: no GPU)\n")
    thr, tthr = by("throughput"), {tuple(r["shape"]): r for r in by("torch_throughput")}
    p("## InPlace-ABN kernel throughput\n")
    if thr:
        p("| shape | copy GB/s | forward GB/s (of copy) | backward GB/s (of copy) | PyTorch BN+LeakyReLU fwd / bwd GB/s | vs PyTorch fwd / bwd |")
        p("|---|---|---|---|---|---|")
        for r in thr:
            t = tthr.get(tuple(r["shape"]), {})
            vs = ("%.2fx / %.2fx" % (t["forward_ms"] / r["forward_ms"], t["backward_ms"] / r["backward_ms"])) if t else "n/a"
            tb = ("%.0f / %.0f" % (t["forward_GBps"], t["backward_GBps"])) if t else "n/a"
            p("| %s%s | %.0f | %.0f (%.0f%%) | %.0f (%.0f%%) | %s | %s |" % (
                "x".join(map(str, r["shape"])), "" if r.get("float4") else " (scalar)", r["copy_GBps"], r["forward_GBps"],
                100 * r["forward_of_copy"], r["backward_GBps"], 100 * r["backward_of_copy"], tb, vs))
        p("\nBytes counted per value: forward 12 (statistics read x; the in-place transform reads and writes it), "
          "backward 20 (the sums read z and dz; the apply reads both and writes dx); copy 8 (cuMemcpyDtoD). "
          "PyTorch's times are counted with the same bytes; \"vs PyTorch\" is its time over ours.\n")
        for r in thr:
            p("- %s: statistics %.3f ms (%.0f GB/s), apply %.3f ms (%.0f GB/s), forward %.3f ms, backward %.3f ms, copy %.3f ms" % (
                "x".join(map(str, r["shape"])), r["stats_ms"], r["stats_GBps"], r["apply_ms"], r["apply_GBps"],
                r["forward_ms"], r["backward_ms"], r["copy_ms"]))
        p("")
    elif tthr:
        p("(CUDA backend not run: no GPU.) PyTorch on %s:\n" % next(iter(tthr.values()))["device"])
        for t in tthr.values():
            p("- %s: forward %.3f ms, backward %.3f ms" % ("x".join(map(str, t["shape"])), t["forward_ms"], t["backward_ms"]))
        p("")
    else:
        p("(not run)\n")
    p("## Training-step memory before and after conversion\n")
    mem, tmem = by("training_memory"), by("torch_memory")
    if mem or tmem:
        p("| network | variant | runtime saved | runtime peak | pool peak reserved | driver delta after forward | step | PyTorch saved | PyTorch peak | PyTorch step |")
        p("|---|---|---|---|---|---|---|---|---|---|")
        keys = []
        for r in mem:
            keys.append((r["arch"], r["checkpoint"].replace(".pth", ""), r["variant"]))
        for r in tmem:
            k = (None, r["model"], r["variant"])
            if not any(kk[1] == k[1] and kk[2] == k[2] for kk in keys):
                keys.append(k)
        for _, model, variant in keys:
            g = next((r for r in mem if r["checkpoint"].replace(".pth", "") == model and r["variant"] == variant), {})
            t = next((r for r in tmem if r["model"] == model and r["variant"] == variant), {})
            p("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                model, variant, mib(g.get("saved_bytes")), mib(g.get("peak_bytes")), mib(g.get("pool_peak_reserved_bytes")),
                mib(g.get("driver_delta_after_forward")), ("%.0f ms" % g["step_ms"]) if g else "n/a",
                mib(t.get("saved_bytes")), mib(t.get("peak_bytes")), ("%.0f ms" % t["step_ms"]) if t else "n/a"))
        b = (mem or tmem)[0]
        p("\nBatch %s, %sx%s, float32. Runtime: the CUDA backend's allocator (tensor bytes; parameters excluded, "
          "as they are resident before and after), the caching pool's reservation and the driver's used-memory "
          "change (both include parameters and the pool's cached blocks). PyTorch: saved-tensor hooks (each storage "
          "once, parameters excluded) and torch.cuda.max_memory_allocated above the start of the step; the converted "
          "module is the one abnconvert emitted, run with %s.\n" % (b.get("batch"), b.get("size"), b.get("size"),
                                                                     "fixtures/standin's inplace_abn"))
        if any(r.get("arch", "").startswith("densenet") and r["variant"] == "converted" for r in mem):
            p("For a converted DenseNet the runtime's saved figure includes the two shared buffers (the widest "
              "dense layer's concatenation and normalised output), which the memory-efficient DenseNet allocates "
              "once and keeps through the backward; the emitted module recomputes under torch.utils.checkpoint, "
              "which allocates them only during the backward, so PyTorch's hooks see less at the end of the "
              "forward.\n")
        for r in mem:
            if r["shape_only_saved_bytes"] != r["saved_bytes"] or r["shape_only_peak_bytes"] != r["peak_bytes"]:
                p("- MISMATCH %s %s: shape-only backend saved %d peak %d" % (r["checkpoint"], r["variant"],
                                                                           r["shape_only_saved_bytes"], r["shape_only_peak_bytes"]))
    else:
        p("(not run)\n")
    mc = by("memcheck")
    if mc:
        r = mc[0]
        p("\n## Allocator against the driver\n")
        p("%s, input %s: saved %s; after the forward the backend counts %s live (parameters included), the pool "
          "reserves %s, and the driver's used memory grew by %s since the device was opened." % (
              r["network"], "x".join(map(str, r["input"])), mib(r["saved_bytes"]), mib(r["after_forward"]["live_bytes"]),
              mib(r["after_forward"]["reserved_bytes"]), mib(r["after_forward"]["driver_used_bytes"] - r["after_forward"]["driver_baseline_bytes"])))
    print("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env")
    t = sub.add_parser("throughput")
    t.add_argument("--shapes", required=True)
    t.add_argument("--device", default="cuda")
    t.add_argument("--reps", type=int, default=20)
    c = sub.add_parser("checkpoints")
    c.add_argument("--out", required=True)
    c.add_argument("--models", default="resnet50,densenet121")
    c.add_argument("--trained", action="store_true", help="trained-like BatchNorm parameters (fixtures/models.py)")
    z = sub.add_parser("zoo")
    z.add_argument("--out", required=True)
    z.add_argument("--models", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--model", required=True)
    m.add_argument("--checkpoint", required=True)
    m.add_argument("--converted")
    m.add_argument("--module")
    m.add_argument("--batch", type=int, default=32)
    m.add_argument("--size", type=int, default=224)
    m.add_argument("--device", default="cuda")
    r = sub.add_parser("render")
    r.add_argument("--jsonl", nargs="+", required=True)
    a = ap.parse_args()
    {"env": cmd_env, "throughput": cmd_throughput, "checkpoints": cmd_checkpoints, "zoo": cmd_zoo, "memory": cmd_memory,
     "render": cmd_render}[a.cmd](a)


if __name__ == "__main__":
    main()
