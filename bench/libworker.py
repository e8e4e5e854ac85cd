"""Child process for the in-process library rows of bench/run.py.

    python bench/libworker.py create OUT TARGET BASE FMT
    python bench/libworker.py apply  IN  TARGET BASE
    python bench/libworker.py import

Imports blockdiff.engine.diff, then times one create_diff / apply_diff call with
time.perf_counter and prints one JSON line: seconds, peak RSS of this process
(ru_maxrss) before and after the call, and the result's ranges / data_bytes.
Running each call in its own process keeps the peak RSS figure per call.
"""

import json
import resource
import sys
import time


def _maxrss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    from blockdiff.engine.diff import apply_diff, create_diff

    import_s = time.perf_counter() - t0
    rss0 = _maxrss_kb()
    op = argv[0]
    res = None
    if op == "create":
        out, target, base, fmt = argv[1:5]
        t0 = time.perf_counter()
        res = create_diff(out, target, base=base, format=fmt)
        seconds = time.perf_counter() - t0
    elif op == "apply":
        diff, target, base = argv[1:4]
        t0 = time.perf_counter()
        res = apply_diff(diff, target, base=base)
        seconds = time.perf_counter() - t0
    elif op == "import":
        seconds = import_s
    else:
        print(f"unknown op {op!r}", file=sys.stderr)
        return 2
    rec = {
        "op": op,
        "seconds": seconds,
        "import_s": import_s,
        "maxrss_kb_before": rss0,
        "maxrss_kb": _maxrss_kb(),
    }
    for attr in ("ranges", "data_bytes"):
        v = getattr(res, attr, None)
        if isinstance(v, int):
            rec[attr] = v
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
