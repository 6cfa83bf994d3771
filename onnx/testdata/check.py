#!/usr/bin/python3
"""Independent checks of what package onnx writes, with Debian's python3-onnx
(1.12, which has no onnx.reference) and numpy.

    /usr/bin/python3 check.py TASKS.json

TASKS.json is a list of tasks; the script prints a JSON list of results,
one per task, each with "ok" and details. Tasks:

  {"op": "roundtrip", "a": A, "b": B}
      onnx.load both (external data resolved against each file's own
      directory); compare the graph protos with every initializer replaced by
      its decoded numpy array, compare every initializer array exactly, and
      report whether the files are byte-identical.
  {"op": "checker", "path": P, "full": bool}
      onnx.checker.check_model (full: with strict shape inference, which
      needs standard ops only).
  {"op": "eval", "path": P, "golden": G, "reference": R, "slope": s}
      Run P with the numpy evaluator below on the golden input of G.json and
      compare with R: "golden" (torch's output stored in G) or the path of an
      ONNX model evaluated with every Relu that reads a BatchNormalization's
      only output replaced by LeakyRelu(slope) -- the network the rewrite's
      leaky policy converts to.

The evaluator computes inference mode: BatchNormalization and the
ai.abnconvert ops use their running statistics. The ai.abnconvert ops
follow onnx/DOMAIN.md: y = act(BN(x * sign)) with scale |weight| + epsilon
for InPlaceABN and InPlaceABNSync, weight as stored for ABN.
"""
import json
import math
import os
import sys

import numpy as np
import onnx
import onnx.checker
import onnx.numpy_helper
from numpy.lib.stride_tricks import sliding_window_view

DOMAIN = "ai.abnconvert"


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def pads2(a, rank=2):
    p = list(a.get("pads", [0] * (2 * rank)))
    return p[:rank], p[rank:]


def pool_out(size, k, s, p0, p1, d, ceil):
    eff = (k - 1) * d + 1
    num = size + p0 + p1 - eff
    out = (-(-num // s) if ceil else num // s) + 1
    if ceil and (out - 1) * s >= size + p0:
        out -= 1  # the last window must start inside the input or left pad
    return out


def windows(x, kh, kw, sh, sw, dh, dw, oh, ow):
    """x: N,C,H,W already padded enough; returns N,C,oh,ow,kh,kw."""
    v = sliding_window_view(x, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(2, 3))
    v = v[:, :, ::sh, ::sw, ::dh, ::dw]
    return v[:, :, :oh, :ow]


def conv(x, w, b, a):
    g = a.get("group", 1)
    kh, kw = w.shape[2:]
    sh, sw = a.get("strides", [1, 1])
    dh, dw = a.get("dilations", [1, 1])
    (pt, pl), (pb, pr) = pads2(a)
    x = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    n, c, h, ww = x.shape
    oh = (h - ((kh - 1) * dh + 1)) // sh + 1
    ow = (ww - ((kw - 1) * dw + 1)) // sw + 1
    win = windows(x, kh, kw, sh, sw, dh, dw, oh, ow)
    cin, cout = c // g, w.shape[0] // g
    outs = []
    for i in range(g):
        wi = w[i * cout:(i + 1) * cout]
        xi = win[:, i * cin:(i + 1) * cin]
        outs.append(np.einsum("nchwij,ocij->nohw", xi, wi, optimize=True))
    y = np.concatenate(outs, axis=1)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y


def pool(x, a, kind):
    kh, kw = a["kernel_shape"]
    sh, sw = a.get("strides", [1, 1])
    dh, dw = a.get("dilations", [1, 1])
    (pt, pl), (pb, pr) = pads2(a)
    ceil = a.get("ceil_mode", 0)
    n, c, h, w = x.shape
    oh = pool_out(h, kh, sh, pt, pb, dh, ceil)
    ow = pool_out(w, kw, sw, pl, pr, dw, ceil)
    # Extra padding on the far side for ceil mode; it never counts.
    need_h = (oh - 1) * sh + (kh - 1) * dh + 1 - (h + pt)
    need_w = (ow - 1) * sw + (kw - 1) * dw + 1 - (w + pl)
    eb, er = max(need_h, pb), max(need_w, pr)
    if kind == "max":
        xp = np.pad(x, ((0, 0), (0, 0), (pt, eb), (pl, er)), constant_values=-np.inf)
        return windows(xp, kh, kw, sh, sw, dh, dw, oh, ow).max(axis=(4, 5))
    xp = np.pad(x, ((0, 0), (0, 0), (pt, eb), (pl, er)))
    cnt_val = 1.0 if a.get("count_include_pad", 0) else 0.0
    mask = np.pad(np.ones((1, 1, h, w)), ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=cnt_val)
    mask = np.pad(mask, ((0, 0), (0, 0), (0, eb - pb), (0, er - pr)))
    s = windows(xp, kh, kw, sh, sw, dh, dw, oh, ow).sum(axis=(4, 5))
    cnt = windows(mask, kh, kw, sh, sw, dh, dw, oh, ow).sum(axis=(4, 5))
    return s / cnt


def bn(x, scale, bias, mean, var, eps):
    shp = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shp)) / np.sqrt(var.reshape(shp) + eps) * scale.reshape(shp) + bias.reshape(shp)


def act(x, name, param):
    if name == "relu":
        return np.maximum(x, 0)
    if name == "leaky_relu":
        return np.where(x >= 0, x, x * param)
    if name == "elu":
        return np.where(x >= 0, x, param * np.expm1(np.minimum(x, 0)))
    if name == "identity":
        return x
    raise ValueError("activation " + name)


def evaluate(model, x, leaky=None):
    g = model.graph
    env = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) if t.data_type in (1, 10, 11, 16) else onnx.numpy_helper.to_array(t) for t in g.initializer}
    real_inputs = [i.name for i in g.input if i.name not in env]
    env[real_inputs[0]] = x.astype(np.float64)
    readers = {}
    producer = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
        for o in n.output:
            producer[o] = n
    for n in g.node:
        a = attrs(n)
        ins = [env[i] if i else None for i in n.input]
        op = n.op_type
        if n.domain == DOMAIN:
            xi, w, b, m, v = ins
            if "sign" in a:
                xi = xi * np.array(a["sign"], dtype=np.float64).reshape((1, -1) + (1,) * (xi.ndim - 2))
            eps = a["epsilon"]
            gamma = np.abs(w) + eps if op in ("InPlaceABN", "InPlaceABNSync") else w
            name = a["activation"].decode() if isinstance(a["activation"], bytes) else a["activation"]
            out = act(bn(xi, gamma, b, m, v, eps), name, a.get("activation_param", 0.0))
        elif n.domain not in ("", "ai.onnx"):
            raise ValueError("domain " + n.domain)
        elif op == "Conv":
            out = conv(ins[0], ins[1], ins[2] if len(ins) > 2 else None, a)
        elif op == "BatchNormalization":
            out = bn(ins[0], ins[1], ins[2], ins[3], ins[4], a.get("epsilon", 1e-5))
        elif op == "Relu":
            p = producer.get(n.input[0])
            if leaky is not None and p is not None and p.op_type == "BatchNormalization" and readers[n.input[0]] == 1:
                out = act(ins[0], "leaky_relu", leaky)
            else:
                out = np.maximum(ins[0], 0)
        elif op == "LeakyRelu":
            out = act(ins[0], "leaky_relu", a.get("alpha", 0.01))
        elif op == "Elu":
            out = act(ins[0], "elu", a.get("alpha", 1.0))
        elif op == "Sigmoid":
            out = 1 / (1 + np.exp(-ins[0]))
        elif op == "HardSigmoid":
            out = np.clip(a.get("alpha", 0.2) * ins[0] + a.get("beta", 0.5), 0, 1)
        elif op == "HardSwish":
            out = ins[0] * np.clip(ins[0] / 6 + 0.5, 0, 1)
        elif op == "Clip":
            # min and max: inputs from opset 11, attributes before.
            lo = ins[1] if len(ins) > 1 and ins[1] is not None else a.get("min", -np.inf)
            hi = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("max", np.inf)
            out = np.clip(ins[0], lo, hi)
        elif op in ("Add", "Mul", "Sub", "Div"):
            f = {"Add": np.add, "Mul": np.multiply, "Sub": np.subtract, "Div": np.divide}[op]
            out = f(ins[0], ins[1])
        elif op == "Concat":
            out = np.concatenate(ins, axis=a["axis"])
        elif op == "MaxPool":
            out = pool(ins[0], a, "max")
        elif op == "AveragePool":
            out = pool(ins[0], a, "avg")
        elif op == "GlobalAveragePool":
            out = ins[0].mean(axis=tuple(range(2, ins[0].ndim)), keepdims=True)
        elif op == "Flatten":
            ax = a.get("axis", 1)
            out = ins[0].reshape(int(np.prod(ins[0].shape[:ax])), -1)
        elif op == "Gemm":
            A, B = ins[0], ins[1]
            if a.get("transA", 0):
                A = A.T
            if a.get("transB", 0):
                B = B.T
            out = a.get("alpha", 1.0) * A @ B
            if len(ins) > 2 and ins[2] is not None:
                out = out + a.get("beta", 1.0) * ins[2]
        elif op == "MatMul":
            out = ins[0] @ ins[1]
        elif op in ("Identity", "Dropout"):
            out = ins[0]
        elif op == "Reshape":
            shape = [d if d != 0 else ins[0].shape[i] for i, d in enumerate(ins[1].astype(np.int64))]
            out = ins[0].reshape(shape)
        elif op == "Constant":
            out = onnx.numpy_helper.to_array(a["value"]) if "value" in a else np.array(list(a.values())[0])
            if out.dtype.kind == "f":
                out = out.astype(np.float64)
        elif op == "Pad":
            pads = list(a["pads"]) if "pads" in a else list(ins[1].astype(np.int64))
            r = ins[0].ndim
            out = np.pad(ins[0], list(zip(pads[:r], pads[r:])))
        else:
            raise ValueError("op " + op)
        env[n.output[0]] = out
    return env[g.output[0].name]


_models = {}


def load(path):
    # Each model is loaded once per run: several tasks read the same files.
    if path not in _models:
        _models[path] = onnx.load(path)
    return _models[path]


_refs = {}


def reference(path, x, leaky, key):
    if key not in _refs:
        _refs[key] = evaluate(load(path), x, leaky=leaky)
    return _refs[key]


def arrays(model):
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def roundtrip(task):
    a, b = onnx.load(task["a"]), onnx.load(task["b"])  # copies: modified below
    ta, tb = arrays(a), arrays(b)
    res = {"bytes_equal": open(task["a"], "rb").read() == open(task["b"], "rb").read()}
    mism = [k for k in ta if k not in tb or ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or ta[k].tobytes() != tb[k].tobytes()]
    mism += [k for k in tb if k not in ta]
    res["initializers_equal"] = not mism
    res["initializer_mismatch"] = mism[:10]
    # Graphs compared with tensor payloads stripped: where the data lives
    # (inline or external) is not part of the model's meaning.
    for m in (a, b):
        for t in m.graph.initializer:
            t.ClearField("raw_data")
            t.ClearField("external_data")
            t.ClearField("data_location")
            for f in ("float_data", "int64_data", "int32_data", "double_data"):
                t.ClearField(f)
    res["graph_equal"] = a == b
    res["ok"] = res["graph_equal"] and res["initializers_equal"]
    return res


def checker(task):
    m = load(task["path"])
    try:
        onnx.checker.check_model(m, full_check=bool(task.get("full")))
    except Exception as e:  # the checker raises several exception types
        return {"ok": False, "error": str(e)[:2000]}
    return {"ok": True}


def run_eval(task):
    with open(task["golden"]) as f:
        gold = json.load(f)
    x = np.array(gold["input"], dtype=np.float32).reshape(gold["input_shape"])
    y = evaluate(load(task["path"]), x)
    if task["reference"] == "golden":
        ref = np.array(gold["output"], dtype=np.float64).reshape(gold["output_shape"])
    else:
        ref = reference(task["reference"], x, task.get("slope"), (task["reference"], task.get("slope"), task["golden"]))
    if y.shape != ref.shape:
        return {"ok": False, "error": "shape %s, reference %s" % (y.shape, ref.shape)}
    diff = float(np.abs(y - ref).max())
    scale = float(np.abs(ref).max())
    return {"ok": True, "max_abs": diff, "ref_max": scale, "rel": diff / max(scale, 1e-12),
            "output": [float(v) for v in y.reshape(-1)[:8]]}


def main():
    with open(sys.argv[1]) as f:
        tasks = json.load(f)
    out = []
    for t in tasks:
        try:
            r = {"roundtrip": roundtrip, "checker": checker, "eval": run_eval}[t["op"]](t)
        except Exception as e:
            r = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
        r["task"] = t
        out.append(r)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
