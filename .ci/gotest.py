#!/usr/bin/python3
"""go test -json ./... read as it runs: prints each package's closing line
(ok / FAIL / no test files) and the whole output of every failing test,
then every skipped test with its reason, and exits 1 when any test or
package failed, or when a test skipped that .ci/skips.allow does not list
(a skip is visible and justified, never silent).

    go test -json ./... | python3 .ci/gotest.py .ci/skips.allow
"""
import json
import sys


def main():
    allowed = {}
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, why = line.partition(":")
                allowed[tuple(key.split())] = why.strip()
    out = {}  # (package, test) -> output lines
    skips, failed, passed, npkg = [], [], 0, 0
    for line in sys.stdin:
        try:
            e = json.loads(line)
        except ValueError:
            print(line, end="")  # a build error's plain text
            if "build failed" in line or line.startswith("FAIL"):
                failed.append(line.strip())
            continue
        pkg, test, act = e.get("Package", ""), e.get("Test"), e["Action"]
        key = (pkg, test)
        if act == "output":
            if test is None:
                # The package's own lines: its closing "ok"/"FAIL".
                o = e["Output"]
                if not o.startswith(("=== ", "--- ", "PASS\n", "FAIL\n")) and o.strip():
                    print(o, end="", flush=True)
            else:
                out.setdefault(key, []).append(e["Output"])
        elif test is not None and act in ("pass", "fail", "skip"):
            lines = out.pop(key, [])
            if act == "pass":
                passed += 1
            elif act == "fail":
                failed.append("%s %s" % (pkg, test))
                print("".join(lines), end="", flush=True)
            else:
                why = [l.strip() for l in lines if l.strip() and not l.startswith(("=== ", "--- "))]
                skips.append((pkg.rsplit("/", 1)[-1], test, why[-1] if why else "(no reason given)"))
        elif test is None and act in ("pass", "fail", "skip"):
            npkg += 1
            if act == "fail":
                failed.append(pkg)
    bad = 0
    if skips:
        print("skipped tests (%d):" % len(skips))
    for pkg, test, why in skips:
        top = test.split("/")[0]
        ok = (pkg, top) in allowed
        bad += not ok
        print("  %s %s.%s: %s%s" % ("SKIP" if ok else "UNJUSTIFIED SKIP", pkg, test, why,
                                   "" if ok else " (not in .ci/skips.allow: a skip in CI must be listed there with why)"))
    print("go test: %d packages" % npkg)
    print("gotest: %d passed, %d failed, %d skipped" % (passed, len(failed), len(skips)))
    for f in failed:
        print("FAILED: " + f)
    sys.exit(1 if failed or bad else 0)


if __name__ == "__main__":
    main()
