#!/usr/bin/env python3
"""PNG charts from `hostopt-bench ... --json` output (kernel, model, roofline, pipeline).

  build/release/bench/hostopt-bench kernel -s 4M,16M,64M -t 1,2 --mix f32:none,bf16:bf16 --json > k.json
  build/release/bench/hostopt-bench roofline -t 1,2 --json > r.json
  python3 bench/plot.py k.json r.json -o bench/out

Writes, for each kind of file given (files of one kind are drawn together):
  kernel    throughput_vs_size.png (Mparam/s per dtype mix, each with its roofline dashed) and
            thread_scaling.png (GB/s against threads, step and roofline, at the largest size)
  model     model_throughput.png (Mparam/s against threads, the model's tensor list and one flat tensor)
  roofline  roofline.png (copy, triad and Adam-pattern GB/s against threads)
  pipeline  pipeline_stages.png (each stage's busy time, the wall time and the synchronous step)

Exit status: 0 success; 1 a run-time failure (matplotlib missing, a chart that cannot be
written); 2 a usage error (a file missing, not JSON, or not hostopt-bench --json output).
Needs matplotlib (pip install matplotlib) only to draw: files are checked first.
"""
import argparse
import collections
import json
import os
import sys

EXIT_FAILURE, EXIT_USAGE = 1, 2

# The fields each kind's rows must have for its charts (hostopt-bench --json writes more).
NUMBERS = {
    "kernel": ("threads", "Mparam/s", "%roofline", "GB/s", "roofline_GB/s"),
    "model": ("threads", "Mparam/s", "flat_Mparam/s"),
    "roofline": ("threads", "copy_GB/s", "triad_GB/s", "adam_pattern_GB/s"),
    "pipeline": ("threads", "copy_in_ms", "update_ms", "copy_out_ms", "wall_ms", "sync_ms"),
}
STRINGS = {
    "kernel": ("size", "grad", "out", "mode"),
    "model": ("mix",),
    "roofline": (),
    "pipeline": ("size", "mix"),
}


class InputError(Exception):
  """A file that is not hostopt-bench --json output: one line, exit 2."""


def size_value(s):
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  return float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)


def load(path):
  """(kind, context, rows) of one file; raises InputError naming the file and the problem."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise InputError(f"{path}: cannot read it: {e.strerror or e}") from None
  except UnicodeDecodeError:
    raise InputError(f"{path}: not text (expected the output of hostopt-bench ... --json)") from None
  try:
    doc = json.loads(text)
  except json.JSONDecodeError as e:
    raise InputError(f"{path}: not JSON ({e.msg} at line {e.lineno}); expected the output of hostopt-bench ... --json "
                     "(not --csv or the table)") from None
  if not isinstance(doc, dict) or "benchmark" not in doc:
    raise InputError(f"{path}: not hostopt-bench --json output (no 'benchmark' field)")
  kind = doc["benchmark"]
  if kind not in NUMBERS:
    raise InputError(f"{path}: benchmark {kind!r} is not one plot.py draws: expected one of {', '.join(NUMBERS)}")
  rows, context = doc.get("results"), doc.get("context", {})
  if not isinstance(rows, list) or not rows:
    raise InputError(f"{path}: no results to draw")
  if not isinstance(context, dict):
    raise InputError(f"{path}: 'context' is not an object")
  for i, r in enumerate(rows):
    if not isinstance(r, dict):
      raise InputError(f"{path}: results[{i}] is not an object")
    for field in NUMBERS[kind]:
      if isinstance(r.get(field), bool) or not isinstance(r.get(field), (int, float)):
        raise InputError(f"{path}: results[{i}] has no number '{field}' (a {kind} file of another hostopt-bench version?)")
    for field in STRINGS[kind]:
      if not isinstance(r.get(field), str):
        raise InputError(f"{path}: results[{i}] has no string '{field}' (a {kind} file of another hostopt-bench version?)")
    if kind == "kernel":
      try:
        size_value(r["size"])
      except (ValueError, IndexError):
        raise InputError(f"{path}: results[{i}] size {r['size']!r} is not a count like 1000 or 64M") from None
  return kind, context, rows


def title_of(context):
  return f"hostopt {context.get('hostopt', '')} on {context.get('cpu', '?')} ({context.get('kernel', '')})"


def finish(plt, fig, ax, out, name):
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, name), dpi=120)
  plt.close(fig)
  return os.path.join(out, name)


def plot_kernel(plt, rows, context, out):
  title = title_of(context)
  state = lambda r: "" if r.get("state", "f32") == "f32" else f" {r['state']} state"
  # Throughput against size, one colour per (mix, threads), roofline dashed in the same colour.
  fig, ax = plt.subplots(figsize=(8, 5))
  series = collections.defaultdict(list)
  for r in rows:
    series[(f"{r['grad']}:{r['out']}{state(r)}", r["threads"], r["mode"])].append(r)
  for i, ((mix, threads, mode), rs) in enumerate(sorted(series.items())):
    rs.sort(key=lambda r: size_value(r["size"]))
    x = [size_value(r["size"]) for r in rs]
    colour = f"C{i % 10}"
    ax.plot(x, [r["Mparam/s"] for r in rs], "o-", color=colour, label=f"{mode} {mix}, {threads} thr")
    ax.plot(x, [r["Mparam/s"] / (r["%roofline"] / 100) if r["%roofline"] else float("nan") for r in rs], "--",
            color=colour, alpha=0.6, label=f"roofline {mix}, {threads} thr")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("parameters")
  ax.set_ylabel("Mparam/s (median)")
  ax.set_title(title, fontsize=9)
  written = [finish(plt, fig, ax, out, "throughput_vs_size.png")]

  # Thread scaling at the largest size.
  largest_row = max(rows, key=lambda r: size_value(r["size"]))
  largest = size_value(largest_row["size"])
  fig, ax = plt.subplots(figsize=(8, 5))
  by_mix = collections.defaultdict(list)
  for r in rows:
    if size_value(r["size"]) == largest:
      by_mix[(f"{r['grad']}:{r['out']}{state(r)}", r["mode"])].append(r)
  for i, ((mix, mode), rs) in enumerate(sorted(by_mix.items())):
    rs.sort(key=lambda r: r["threads"])
    t = [r["threads"] for r in rs]
    colour = f"C{i % 10}"
    ax.plot(t, [r["GB/s"] for r in rs], "o-", color=colour, label=f"{mode} {mix}")
    ax.set_xticks(t)
    ax.plot(t, [r["roofline_GB/s"] for r in rs], "--", color=colour, alpha=0.6, label=f"roofline {mix}")
  ax.set_xlabel("threads")
  ax.set_ylabel("GB/s moved (median)")
  ax.set_title(f"{title}, {largest_row['size']} parameters", fontsize=9)
  written.append(finish(plt, fig, ax, out, "thread_scaling.png"))
  return written


def plot_model(plt, rows, context, out):
  fig, ax = plt.subplots(figsize=(8, 5))
  series = collections.defaultdict(list)
  for r in rows:
    series[(str(r.get("model", context.get("model", ""))), r["mix"], str(r.get("state", "f32")))].append(r)
  threads = set()
  for i, ((model, mix, state), rs) in enumerate(sorted(series.items())):
    rs.sort(key=lambda r: r["threads"])
    t = [r["threads"] for r in rs]
    threads.update(t)
    colour = f"C{i % 10}"
    ax.plot(t, [r["Mparam/s"] for r in rs], "o-", color=colour, label=f"{model} {mix}, {state} state")
    ax.plot(t, [r["flat_Mparam/s"] for r in rs], "--", color=colour, alpha=0.6, label=f"one flat tensor, {state} state")
  ax.set_xticks(sorted(threads))
  ax.set_xlabel("threads")
  ax.set_ylabel("Mparam/s (median)")
  ax.set_title(f"{title_of(context)}, {context.get('model', '')}: {context.get('tensors', '?')} tensors, "
               f"{context.get('parameters', '?')} parameters", fontsize=9)
  return [finish(plt, fig, ax, out, "model_throughput.png")]


def plot_roofline(plt, rows, context, out):
  fig, ax = plt.subplots(figsize=(8, 5))
  rows = sorted(rows, key=lambda r: r["threads"])
  t = [r["threads"] for r in rows]
  for i, (field, label) in enumerate((("copy_GB/s", "copy"), ("triad_GB/s", "triad"),
                                      ("adam_pattern_GB/s", "Adam pattern (4 reads, 3 writes)"))):
    ax.plot(t, [r[field] for r in rows], "o-", color=f"C{i}", label=label)
  ax.set_xticks(sorted(set(t)))
  ax.set_xlabel("threads")
  ax.set_ylabel("GB/s (median)")
  ax.set_title(f"{title_of(context)}, {context.get('elements per array', '?')} elements per array", fontsize=9)
  return [finish(plt, fig, ax, out, "roofline.png")]


def plot_pipeline(plt, rows, context, out):
  fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.2), 5))
  fields = (("copy_in_ms", "copy in"), ("update_ms", "update"), ("copy_out_ms", "copy out"), ("wall_ms", "wall"),
            ("sync_ms", "synchronous step"))
  width = 0.8 / len(fields)
  for j, (field, label) in enumerate(fields):
    ax.bar([i + j * width for i in range(len(rows))], [r[field] for r in rows], width, color=f"C{j}", label=label)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
  cap = lambda c: "uncapped" if c == 0 else c if isinstance(c, str) else f"cap {c:g} GB/s"
  ax.set_xticklabels([f"{r['size']} {r['mix']}\n{r['threads']} thr, {cap(r.get('cap_GB/s', '?'))}" for r in rows],
                     fontsize=7)
  ax.set_ylabel("ms (median)")
  ax.set_title(f"{title_of(context)}, {context.get('engine', '?')} engine, chunk {context.get('chunk', '?')}", fontsize=9)
  return [finish(plt, fig, ax, out, "pipeline_stages.png")]


PLOTS = {"kernel": plot_kernel, "model": plot_model, "roofline": plot_roofline, "pipeline": plot_pipeline}


def error(message, status):
  print(f"plot.py: error: {message}", file=sys.stderr)
  return status


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("json", nargs="+", help="files written by hostopt-bench kernel|model|roofline|pipeline --json")
  ap.add_argument("-o", "--out", default="bench/out", help="output folder (default bench/out)")
  args = ap.parse_args()
  # Every file is checked before anything is imported or drawn.
  kinds = {}
  for path in args.json:
    try:
      kind, context, rows = load(path)
    except InputError as e:
      return error(e, EXIT_USAGE)
    entry = kinds.setdefault(kind, [[], {}])
    entry[0] += rows
    entry[1] = context
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return error("matplotlib is not installed: pip install matplotlib", EXIT_FAILURE)
  written = []
  try:
    os.makedirs(args.out, exist_ok=True)
    for kind, (rows, context) in kinds.items():
      written += PLOTS[kind](plt, rows, context, args.out)
  except OSError as e:
    return error(f"cannot write the charts to {args.out}: {e.strerror or e}", EXIT_FAILURE)
  print("wrote " + ", ".join(written))
  return 0


if __name__ == "__main__":
  sys.exit(main())
