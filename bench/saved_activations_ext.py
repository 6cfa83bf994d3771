#!/usr/bin/python3
"""What real PyTorch keeps for the backward pass of a torchvision model under the
memory techniques `abnconvert memory --compare` measures: plain training,
gradient checkpointing (torch.utils.checkpoint) on given segments, and mixed
precision (torch.autocast, bfloat16 on the CPU).

An extension of ../shared/tools/saved_activations.py: the same measurement (the
bytes of the distinct non-parameter storages autograd's saved-tensor hooks see
during one training-mode forward pass), applied to the forward as torch.fx
traces it, so that checkpoint segments can be cut anywhere the runtime cuts
them:

    /usr/bin/python3 bench/saved_activations_ext.py resnet50 --batch 8 --size 224 \\
        --segments segments.json

segments.json (written by the Go test memory.TestAgainstPyTorch -update) holds
the runtime's graph node names in order (input excluded) and, per policy, the
segments it checkpoints as node index ranges: {"nodes": [...], "policies":
{"blocks": [{"start": 5, "end": 16, "first": "layer1.0.conv1", ...}, ...]}}.
The runtime's graph mirrors torchvision's forward operation for operation
(arch's tests check it against the same fx trace), so node i of the runtime is
fx node i here; the script checks every module name on the way.

Checkpointing uses torch.utils.checkpoint's reentrant implementation, which
saves a segment's inputs with save_for_backward and runs the segment under
no_grad: exactly "keep the inputs, recompute the rest". The network input is
made to require grad, as checkpoint needs one input that does (the runtime
computes the input gradient too; the saved figure does not change).

Prints JSON: saved bytes per technique, and the eager baseline for comparison
with the shared tool.

With --drift CHECKPOINT it also runs one training step of the network with that
state dict in float32, under torch.autocast("cpu", bfloat16), and with every
ReLU a leaky ReLU (slope 0.01), on a random input and output gradient
(--drift-batch, --drift-size), and reports how far outputs and input
gradients move (largest difference over the float32 step's largest
magnitude): PyTorch's own figures for what `abnconvert memory --compare`
measures in its drift column.
"""
import argparse
import json

import torch
import torch.fx
import torch.utils.checkpoint as checkpoint
import torchvision


def saved_bytes(model, run):
    """Bytes of the distinct non-parameter storages saved for backward while
    run() executes, and run()'s result (shared/tools/saved_activations.py's
    rule)."""
    owned = {t.storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(t):
        st = t.storage()
        key = st.data_ptr()
        if key not in owned:
            seen[key] = max(seen.get(key, 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


class Traced:
    """torchvision's forward as torch.fx traces it, run node by node, with
    chosen node ranges run through torch.utils.checkpoint."""

    def __init__(self, model, names):
        self.gm = torch.fx.symbolic_trace(model)
        self.modules = dict(self.gm.named_modules())
        self.nodes = [n for n in self.gm.graph.nodes if n.op not in ("placeholder", "output")]
        self.input = next(n for n in self.gm.graph.nodes if n.op == "placeholder")
        self.output = next(n for n in self.gm.graph.nodes if n.op == "output").args[0]
        if names is not None:
            if len(names) != len(self.nodes):
                raise SystemExit(f"the runtime's graph has {len(names)} nodes, torch.fx traces {len(self.nodes)}")
            for i, (n, name) in enumerate(zip(self.nodes, names)):
                if n.op == "call_module" and n.target != name.split(":")[0]:
                    raise SystemExit(f"node {i + 1}: the runtime has {name}, torch.fx calls module {n.target}")

    def run_node(self, n, env):
        args = torch.fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a])
        if n.op == "call_module":
            return self.modules[n.target](*args, **kwargs)
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        raise SystemExit(f"unexpected fx node {n.op} {n.target}")

    def forward(self, x, segments=()):
        env = {self.input: x}
        # The runtime counts its input node as node 0; fx's list starts at
        # the first operation.
        starts = {s["start"] - 1: s for s in segments}
        i = 0
        while i < len(self.nodes):
            s = starts.get(i)
            if s is None:
                env[self.nodes[i]] = self.run_node(self.nodes[i], env)
                i += 1
                continue
            seg = self.nodes[s["start"] - 1:s["end"]]
            inside = set(seg)
            inputs = []
            for n in seg:
                for a in n.all_input_nodes:
                    if a not in inside and a not in inputs:
                        inputs.append(a)
            outputs = [n for n in seg if any(u not in inside for u in n.users)]

            def run(*vals, seg=seg, inputs=inputs, outputs=outputs):
                local = dict(zip(inputs, vals))
                for n in seg:
                    local[n] = self.run_node(n, local)
                return tuple(local[o] for o in outputs)

            res = checkpoint.checkpoint(run, *[env[a] for a in inputs], use_reentrant=True)
            env.update(zip(outputs, res))
            i = s["end"]
        return env[self.output]


def drift(model, batch, size):
    """Output and input-gradient drift of autocast and of leaky ReLUs against
    the float32 training step."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(batch, 3, size, size, generator=g)
    dout = None

    def step(m, autocast=False):
        nonlocal dout
        m.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(x)
        if dout is None:
            dout = torch.randn(y.shape, generator=g)
        y.float().backward(dout)
        return y.detach().float(), x.grad

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    state = {k: v.clone() for k, v in model.state_dict().items()}
    y0, g0 = step(model)
    out = {"batch": batch, "size": size}
    model.load_state_dict(state)  # the step moved the running statistics
    y1, g1 = step(model, autocast=True)
    out["autocast_bfloat16"] = {"output_max_rel": rel(y1, y0), "input_grad_max_rel": rel(g1, g0)}
    model.load_state_dict(state)
    leaky = torch.fx.symbolic_trace(model)
    for n in leaky.graph.nodes:
        if n.op == "call_module" and isinstance(leaky.get_submodule(n.target), torch.nn.ReLU):
            with leaky.graph.inserting_after(n):
                new = leaky.graph.call_function(torch.nn.functional.leaky_relu, n.args, {"negative_slope": 0.01})
            n.replace_all_uses_with(new)
            leaky.graph.erase_node(n)
        elif n.op == "call_function" and n.target is torch.nn.functional.relu:
            n.target = torch.nn.functional.leaky_relu
            n.kwargs = {"negative_slope": 0.01}
    leaky.recompile()
    y2, g2 = step(leaky)
    out["leaky_relu"] = {"output_max_rel": rel(y2, y0), "input_grad_max_rel": rel(g2, g0)}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("arch")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--segments", help="JSON file of the runtime's node names and checkpoint segments")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--drift", metavar="CHECKPOINT", help="also measure autocast's and leaky ReLU's drift with this state dict")
    p.add_argument("--drift-batch", type=int, default=2)
    p.add_argument("--drift-size", type=int, default=64)
    p.add_argument("--no-saved", action="store_true", help="only the drift")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = getattr(torchvision.models, a.arch)().train()
    x = torch.randn(a.batch, 3, a.size, a.size)
    spec = {}
    if a.segments:
        with open(a.segments) as f:
            spec = json.load(f)
    res = {"arch": a.arch, "batch": a.batch, "size": a.size, "torch": torch.__version__, "torchvision": torchvision.__version__}
    if a.drift:
        m = getattr(torchvision.models, a.arch)()
        m.load_state_dict(torch.load(a.drift))
        res["drift"] = drift(m.train(), a.drift_batch, a.drift_size)
    if a.no_saved:
        print(json.dumps(res, indent=1, sort_keys=True))
        return
    traced = Traced(model, spec.get("nodes"))

    res["eager"], _ = saved_bytes(model, lambda: model(x))
    xg = x.clone().requires_grad_(True)
    res["baseline"], ref = saved_bytes(model, lambda: traced.forward(xg))
    ref = ref.detach()
    res["checkpoint"] = {}
    for policy, segs in spec.get("policies", {}).items():
        b, out = saved_bytes(model, lambda: traced.forward(xg, segs))
        # The same forward, only cut: the outputs must agree (running
        # statistics moved twice in the meantime, which changes nothing in
        # training mode).
        if not torch.allclose(out.detach(), ref, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"{policy}: the checkpointed forward's output differs")
        res["checkpoint"][policy] = {"saved_bytes": b, "segments": len(segs)}
        del out
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res["autocast_bfloat16"], out = saved_bytes(model, lambda: traced.forward(xg))
    del out
    print(json.dumps(res, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
