#!/usr/bin/env python3
"""Split the Envoy CPU of each filter-bench run by where it ran (bench/profile-envoy.sh).

Reads OUT/bench.log (lines `rep N <side> <rate> req/s ... window START,END`) and every
OUT/envoy-*.perf.data, and prints, per side, Envoy's CPU µs per request in five parts:

- filter code: samples whose leaf is the filter's own code (the native module's .so, or V8's
  JIT-compiled code, where the .wasm runs; perf names it `[JIT]`/`perf-PID.map`);
- Envoy for the filter: Envoy, libc or kernel samples with a filter frame above them on the stack
  (the host calls the filter makes: header maps, buffers, metadata, local replies, callouts);
- Envoy: the rest of Envoy's user space (its own work, and hosting the filter: creating it,
  calling its hooks, V8's entries into the VM);
- kernel and libc outside the filter's calls.

Samples are cpu-clock ticks of FREQ Hz per thread on CPU, so samples / FREQ is CPU seconds; per
request is that over (rate x the window's length). Windows are trimmed by 0.1 s at each end.
"""
import argparse
import collections
import glob
import os
import re
import subprocess
import sys

WINDOW = re.compile(r"rep (\d+) (.+?)\s+(\d+) req/s .* window ([\d.]+),([\d.]+)")
FILTER_DSOS = ("libagent_idempotency_native", "perf-", "[JIT]")


def stacks(data, start, end):
    """Each sample's stack as a list of dso names, leaf first."""
    out = subprocess.run(
        ["perf", "script", "-i", data, "--time", f"{start:.3f},{end:.3f}", "-F", "ip,dso"],
        capture_output=True, text=True, check=False,
    ).stdout
    for block in out.split("\n\n"):
        frames = [l.strip() for l in block.splitlines() if l.strip()]
        dsos = [f[f.rfind("(") + 1:-1] if f.endswith(")") else "?" for f in frames]
        if dsos:
            yield dsos


def is_filter(dso):
    return any(m in dso for m in FILTER_DSOS)


def split(data, start, end):
    parts = collections.Counter()
    for dsos in stacks(data, start, end):
        leaf = dsos[0]
        if is_filter(leaf):
            parts["filter code"] += 1
        elif any(is_filter(d) for d in dsos[1:]):
            parts["Envoy for the filter"] += 1
        elif "kernel" in leaf:
            parts["kernel"] += 1
        elif "/envoy" in leaf or leaf.endswith("envoy") or leaf == "[unknown]":
            parts["Envoy"] += 1
        else:
            parts["libc, vdso"] += 1
    return parts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the directory bench/profile-envoy.sh wrote")
    ap.add_argument("--freq", type=float, default=499.0)
    a = ap.parse_args()
    data = sorted(glob.glob(os.path.join(a.out, "envoy-*.perf.data")))
    if not data:
        sys.exit(f"no envoy-*.perf.data in {a.out}")
    cols = ["filter code", "Envoy for the filter", "Envoy", "kernel", "libc, vdso"]
    print("| side (rep) | req/s | Envoy CPU µs/req | " + " | ".join(cols) + " |")
    print("|---|---:|---:|" + "---:|" * len(cols))
    for line in open(os.path.join(a.out, "bench.log"), encoding="utf-8"):
        m = WINDOW.search(line)
        if not m:
            continue
        rep, side, rate = m.group(1), m.group(2).strip(), float(m.group(3))
        start, end = float(m.group(4)) + 0.1, float(m.group(5)) - 0.1
        if rate <= 0 or end <= start:
            continue
        # The window falls in exactly one Envoy's recording: the one with samples in it.
        parts = collections.Counter()
        for d in data:
            parts = split(d, start, end)
            if parts:
                break
        if not parts:
            continue
        us = lambda n: n / a.freq * 1e6 / (rate * (end - start))
        total = sum(parts.values())
        print(f"| {side} ({rep}) | {rate:.0f} | {us(total):.1f} | " + " | ".join(f"{us(parts[c]):.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
