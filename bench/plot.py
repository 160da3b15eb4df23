#!/usr/bin/env python3
"""PNG charts from `hostopt-bench kernel --json` output.

  build/release/bench/hostopt-bench kernel -s 4M,16M,64M -t 1,2 --mix f32:none,bf16:bf16 --json > k.json
  python3 bench/plot.py k.json -o bench/out

Writes throughput_vs_size.png (Mparam/s per dtype mix, each with its roofline dashed) and
thread_scaling.png (GB/s against threads, step and roofline, at the largest size).
"""
import argparse
import collections
import json
import os
import sys


def size_value(s):
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  return float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("json", nargs="+", help="files written by hostopt-bench kernel --json")
  ap.add_argument("-o", "--out", default="bench/out", help="output folder (default bench/out)")
  args = ap.parse_args()
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is missing: apt-get install python3-matplotlib", file=sys.stderr)
    return 1
  rows, context = [], {}
  for path in args.json:
    with open(path) as f:
      doc = json.load(f)
    if doc.get("benchmark") != "kernel":
      print(f"{path}: not a `hostopt-bench kernel --json` file", file=sys.stderr)
      return 1
    rows += doc["results"]
    context = doc["context"]
  os.makedirs(args.out, exist_ok=True)
  title = f"hostopt {context.get('hostopt', '')} on {context.get('cpu', '?')} ({context.get('kernel', '')})"

  # Throughput against size, one colour per (mix, threads), roofline dashed in the same colour.
  fig, ax = plt.subplots(figsize=(8, 5))
  series = collections.defaultdict(list)
  for r in rows:
    series[(f"{r['grad']}:{r['out']}", r["threads"], r["mode"])].append(r)
  for i, ((mix, threads, mode), rs) in enumerate(sorted(series.items())):
    rs.sort(key=lambda r: size_value(r["size"]))
    x = [size_value(r["size"]) for r in rs]
    colour = f"C{i % 10}"
    ax.plot(x, [r["Mparam/s"] for r in rs], "o-", color=colour, label=f"{mode} {mix}, {threads} thr")
    ax.plot(x, [r["Mparam/s"] / (r["%roofline"] / 100) for r in rs], "--",
            color=colour, alpha=0.6, label=f"roofline {mix}, {threads} thr")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("parameters")
  ax.set_ylabel("Mparam/s (median)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "throughput_vs_size.png"), dpi=120)

  # Thread scaling at the largest size.
  largest = max(size_value(r["size"]) for r in rows)
  fig, ax = plt.subplots(figsize=(8, 5))
  by_mix = collections.defaultdict(list)
  for r in rows:
    if size_value(r["size"]) == largest:
      by_mix[(f"{r['grad']}:{r['out']}", r["mode"])].append(r)
  for i, ((mix, mode), rs) in enumerate(sorted(by_mix.items())):
    rs.sort(key=lambda r: r["threads"])
    t = [r["threads"] for r in rs]
    colour = f"C{i % 10}"
    ax.plot(t, [r["GB/s"] for r in rs], "o-", color=colour, label=f"{mode} {mix}")
    ax.set_xticks(t)
    ax.plot(t, [r["roofline_GB/s"] for r in rs], "--", color=colour, alpha=0.6, label=f"roofline {mix}")
  ax.set_xlabel("threads")
  ax.set_ylabel("GB/s moved (median)")
  ax.set_title(f"{title}, {rows and max(rows, key=lambda r: size_value(r['size']))['size']} parameters", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "thread_scaling.png"), dpi=120)
  print(f"wrote {args.out}/throughput_vs_size.png and {args.out}/thread_scaling.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
