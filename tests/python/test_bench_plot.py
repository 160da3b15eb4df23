"""bench/plot.py's error paths: one line on stderr, no traceback, the documented exit status.

None of these needs matplotlib: plot.py checks every file before importing it, and the
missing-matplotlib case hides it from the child process.
"""
import json
import pathlib
import subprocess
import sys

import pytest

PLOT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "plot.py"

# Run plot.py with matplotlib unimportable (a None entry in sys.modules makes `import` fail).
WITHOUT_MATPLOTLIB = ("import runpy, sys\n"
                      "sys.modules['matplotlib'] = None\n"
                      "sys.argv = sys.argv[1:]\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def run(*args, hide_matplotlib=False):
  cmd = [sys.executable, "-c", WITHOUT_MATPLOTLIB, str(PLOT)] if hide_matplotlib else [sys.executable, str(PLOT)]
  return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(p, status, pattern):
  assert p.returncode == status, (p.returncode, p.stdout, p.stderr)
  assert "Traceback" not in p.stderr, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("plot.py: error: "), p.stderr
  assert pattern in lines[0], lines[0]


def write(path, doc):
  path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
  return path


KERNEL = {"benchmark": "kernel", "context": {}, "results": [
    {"size": "1000", "threads": 1, "mode": "adamw", "grad": "f32", "out": "none", "Mparam/s": 1.0,
     "%roofline": 50.0, "GB/s": 2.0, "roofline_GB/s": 4.0}]}


def test_missing_file(tmp_path):
  assert_one_line_error(run(tmp_path / "nothere.json", "-o", tmp_path / "out"), 2, "nothere.json: cannot read it")


def test_not_json(tmp_path):
  bad = write(tmp_path / "table.json", "size  threads  mode\n1000  1  adamw\n")
  assert_one_line_error(run(bad, "-o", tmp_path / "out"), 2, "table.json: not JSON")


@pytest.mark.parametrize("doc,words", [
    ({"benchmark": "gpu", "results": [{}]}, "benchmark 'gpu' is not one plot.py draws: expected one of kernel, model, "
                                            "roofline, pipeline"),
    ([1, 2], "not hostopt-bench --json output"),
    ({"benchmark": "roofline", "results": []}, "no results to draw"),
    ({"benchmark": "roofline", "results": [{"threads": 1, "copy_GB/s": 1.0, "triad_GB/s": 1.0}]},
     "results[0] has no number 'adam_pattern_GB/s'"),
    ({"benchmark": "kernel", "results": [dict(KERNEL["results"][0], size="lots")]}, "size 'lots' is not a count"),
])
def test_not_bench_output(tmp_path, doc, words):
  assert_one_line_error(run(write(tmp_path / "x.json", doc), "-o", tmp_path / "out"), 2, words)


def test_a_bad_file_among_good_ones_draws_nothing(tmp_path):
  good = write(tmp_path / "k.json", KERNEL)
  bad = write(tmp_path / "bad.json", {"benchmark": "nope", "results": [{}]})
  assert_one_line_error(run(good, bad, "-o", tmp_path / "out"), 2, "bad.json: benchmark 'nope'")
  assert not (tmp_path / "out").exists()


def test_missing_matplotlib_says_pip(tmp_path):
  p = run(write(tmp_path / "k.json", KERNEL), "-o", tmp_path / "out", hide_matplotlib=True)
  assert_one_line_error(p, 1, "matplotlib is not installed: pip install matplotlib")
  assert "apt" not in p.stderr
