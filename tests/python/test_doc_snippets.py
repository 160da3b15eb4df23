"""Every ```python snippet of README.md and docs/*.md runs, one test per snippet.

A snippet is a complete small program: it runs in a fresh interpreter (this one's, with
its PYTHONPATH), in an empty directory, and must exit 0 within its timeout. It skips, with
the reason, when a module it imports is not installed, or when it says `# needs: gpu` on a
line of its own and there is no CUDA device or hostopt was built without CUDA, or says
`# needs: PACKAGE >= VERSION` and the installed one is older.

Also: every relative link of README.md names a file that exists and, with `#anchor`, a
heading of that file (GitHub's and MyST's anchors: the docs build checks its own links).

Run by .ci/docs: `python -m pytest -q tests/python/test_doc_snippets.py`.
"""
import ast
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
TIMEOUT_S = 120
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def snippets():
  out = []
  for page in PAGES:
    text = page.read_text(encoding="utf-8")
    for m in FENCE.finditer(text):
      line = text.count("\n", 0, m.start()) + 1
      out.append(pytest.param(m.group(1), id=f"{page.relative_to(ROOT)}:{line}"))
  return out


SNIPPETS = snippets()


def test_found_snippets():
  """The fences were read at all: README's torch and JAX examples are among them."""
  assert sum(p.id.startswith("README.md:") for p in SNIPPETS) >= 2, [p.id for p in SNIPPETS]


def _missing_modules(code: str):
  missing = []
  for node in ast.walk(ast.parse(code)):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module]
    for name in names:
      top = name.split(".")[0]
      if top not in missing and importlib.util.find_spec(top) is None:
        missing.append(top)
  return missing


def _too_old(code: str):
  """The first `# needs: PACKAGE >= VERSION` line the installed package does not meet, or None."""
  for name, wanted in re.findall(r"^# needs: ([\w.-]+) >= ([\d.]+)$", code, re.MULTILINE):
    try:
      have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return f"{name} >= {wanted} (not installed)"

    def numbers(v):
      return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

    if numbers(have) < numbers(wanted):
      return f"{name} >= {wanted} (installed: {have})"
  return None


def _gpu_usable() -> bool:
  """A CUDA device, and a hostopt built with its CUDA engine (asked in a fresh process)."""
  probe = "import sys, hostopt._core as c; sys.exit(0 if c.CopyEngine.cuda_available() else 1)"
  return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=TIMEOUT_S).returncode == 0


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet(code, tmp_path):
  missing = _missing_modules(code)
  if missing:
    pytest.skip(f"needs {', '.join(missing)} (not installed)")
  too_old = _too_old(code)
  if too_old:
    pytest.skip(f"needs {too_old}")
  if re.search(r"^# needs: gpu$", code, re.MULTILINE) and not _gpu_usable():
    pytest.skip("needs a CUDA GPU and a hostopt built with CUDA (hostopt._core.CopyEngine.cuda_available() is False)")
  script = tmp_path / "snippet.py"
  script.write_text(code, encoding="utf-8")
  # (DeepSpeed builds its CPU ops under TORCH_EXTENSIONS_DIR: kept in the test's directory.)
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
  r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=TIMEOUT_S)
  assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"


def _anchor(heading: str) -> str:
  """GitHub's heading anchor (MyST's default slug is the same): lower case, punctuation
  other than '-' and '_' dropped, spaces to '-'."""
  s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return s.replace(" ", "-")


def _anchors(page: pathlib.Path):
  text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
  heads = [_anchor(re.sub(r"`", "", m.group(1))) for m in re.finditer(r"^#{1,6} +(.*?) *#*$", text, re.MULTILINE)]
  seen, out = {}, set()
  for h in heads:  # a repeated heading gets -1, -2, ... as on GitHub
    out.add(h if h not in seen else f"{h}-{seen[h]}")
    seen[h] = seen.get(h, 0) + 1
  return out


def test_readme_links():
  text = re.sub(r"^```.*?^```", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
  bad = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target):
      continue  # external: not checked (no network)
    path, _, anchor = target.partition("#")
    page = ROOT / path if path else ROOT / "README.md"
    if not page.exists():
      bad.append(f"{target}: no file {path}")
    elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
      bad.append(f"{target}: no heading with anchor #{anchor} in {path or 'README.md'}")
  assert not bad, "\n".join(bad)
