"""Load a checkpoint written by package pth with real torch and compare it
with what the Go test expects.

    /usr/bin/python3 verify.py OUT.pth EXPECTED.json
    /usr/bin/python3 verify.py --serve   (pairs "OUT<TAB>EXPECTED" on stdin)

The file is loaded with torch.load(weights_only=True). torch 1.13's
weights-only unpickler refuses BINFLOAT (any Python float, such as an
optimizer's lr), even in files torch 1.13 wrote itself; for such files the
same unpickler is loaded again with BINFLOAT added (as torch >= 2.0 has it)
and nothing else changed, so every other rule (globals, opcodes, BUILD
targets) still applies. The mode used is printed.

EXPECTED.json is the Go side's flattening of the object tree: a list of
[path, descriptor] pairs in tree order (see flatten below). Prints "OK
<mode>" and exits 0 when they agree; prints the differences and exits 1
otherwise.
"""

import inspect
import json
import sys
import types

import torch
import torch._weights_only_unpickler as wo


def binfloat_unpickler():
    src = inspect.getsource(wo)
    if "BINFLOAT[0]" in src:
        return wo
    src = src.replace("from pickle import (", "from pickle import (\n    BINFLOAT,", 1)
    anchor = "            elif key[0] == BININT[0]:"
    assert anchor in src
    src = src.replace(anchor, "            elif key[0] == BINFLOAT[0]:\n"
                      "                self.append(unpack('>d', read(8))[0])\n" + anchor, 1)
    mod = types.ModuleType("weights_only_binfloat")
    exec(compile(src, "weights_only_binfloat", "exec"), mod.__dict__)
    return mod


def load(path):
    try:
        return torch.load(path, weights_only=True), "strict"
    except Exception as e:  # torch 1.13 refuses BINFLOAT: opcode 71
        if "Unsupported operand 71" not in str(e):
            raise
    return torch.load(path, pickle_module=binfloat_unpickler()), "binfloat"


def flatten(obj, path, out, groups):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        st = None
        if t.numel() > 0:
            ptr = t.storage().data_ptr()
            st = groups.setdefault(ptr, path)
        out.append([path, {"t": "tensor", "dtype": str(t.dtype).replace("torch.", ""),
                           "shape": list(t.shape), "values": t.double().flatten().tolist(),
                           "param": isinstance(obj, torch.nn.Parameter),
                           "requires_grad": obj.requires_grad,
                           "storage": st, "offset": t.storage_offset(), "stride": list(t.stride())}])
    elif isinstance(obj, dict):
        kind = "odict" if isinstance(obj, __import__("collections").OrderedDict) else "dict"
        out.append([path, {"t": kind, "n": len(obj)}])
        for k, v in obj.items():
            flatten(v, path + "/" + key(k), out, groups)
        if kind == "odict":
            for k, v in sorted(vars(obj).items()):
                flatten(v, path + "/@" + k, out, groups)
    elif isinstance(obj, (list, tuple)):
        out.append([path, {"t": "list" if isinstance(obj, list) else "tuple", "n": len(obj)}])
        for i, v in enumerate(obj):
            flatten(v, path + "/#" + str(i), out, groups)
    elif obj is None or isinstance(obj, bool):
        out.append([path, {"t": "const", "v": obj}])
    elif isinstance(obj, int):
        out.append([path, {"t": "int", "v": str(obj)}])
    elif isinstance(obj, float):
        out.append([path, {"t": "float", "v": obj}])
    elif isinstance(obj, str):
        out.append([path, {"t": "str", "v": obj}])
    elif isinstance(obj, bytes):
        out.append([path, {"t": "bytes", "v": obj.hex()}])
    elif isinstance(obj, torch.dtype):
        out.append([path, {"t": "global", "v": str(obj)}])
    else:
        out.append([path, {"t": "other", "v": repr(obj)}])


def key(k):
    if isinstance(k, str):
        return "s:" + k
    if isinstance(k, int) and not isinstance(k, bool):
        return "i:" + str(k)
    return "k:" + repr(k)


def check(out, expected):
    obj, mode = load(out)
    with open(expected) as f:
        want = json.load(f)
    got = []
    flatten(obj, "", got, {})
    bad = []
    if len(got) != len(want):
        bad.append("%d entries, want %d" % (len(got), len(want)))
    for g, w in zip(got, want):
        if g != w:
            bad.append("got  %s\n  want %s" % (json.dumps(g)[:400], json.dumps(w)[:400]))
    if bad:
        return "MISMATCH (%s)\n" % mode + "\n".join(bad[:20])
    return "OK " + mode


def main():
    if sys.argv[1:] == ["--serve"]:
        # One torch import for a whole test run: read "OUT<TAB>EXPECTED"
        # lines, answer each with one JSON string.
        for line in sys.stdin:
            out, expected = line.rstrip("\n").split("\t")
            try:
                res = check(out, expected)
            except Exception as e:
                res = "ERROR %s: %s" % (type(e).__name__, e)
            print(json.dumps(res), flush=True)
        return
    res = check(sys.argv[1], sys.argv[2])
    print(res)
    sys.exit(0 if res.startswith("OK") else 1)


if __name__ == "__main__":
    main()
