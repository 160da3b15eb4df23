"""optax's own tests, with hostopt's adam/adamw/nadam/nadamw in place of optax's.

Takes the test modules the installed optax wheel ships (optax/_src/alias_test.py,
float64_test.py and sharding_test.py, those present), keeps only what exercises the Adam
family — the optimizer tables filtered to adam/adamw/nadam/nadamw, the test classes that
use them — writes them to a temporary directory beside a conftest.py that substitutes
hostopt.optax's functions for optax's before the tests import, and runs pytest there.
The tests themselves are optax's, unedited; a test that fails with optax's own functions
too is reported as such by running the same selection with HOSTOPT_PEER_REFERENCE=1.

  python tests/python/optax_peer.py [pytest args]
"""

import ast
import os
import pathlib
import subprocess
import sys
import tempfile

FAMILY = ("adam", "adamw", "nadam", "nadamw")
MODULES = {  # test module -> the test classes kept (the others test other optimizers)
    "alias_test.py": {"AliasTest"},
    "float64_test.py": {"Float64Test"},
    "sharding_test.py": {"ShardingTest"},
}
DROPPED_TESTS = {"test_microbatch_with_explicit_sharding"}  # optax.microbatching: no optimizer in it

CONFTEST = '''
import os
import optax
import optax._src.alias as alias
if os.environ.get("HOSTOPT_PEER_REFERENCE") != "1":
  import hostopt.optax
  for name in {family!r}:
    setattr(optax, name, getattr(hostopt.optax, name))
    setattr(alias, name, getattr(hostopt.optax, name))
'''


def _string(node):
  return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _keep_element(node) -> bool:
  """Whether one entry of an optimizer table names the Adam family (or is no table entry)."""
  if isinstance(node, ast.Dict):  # {'opt_name': 'adam', 'opt_kwargs': {...}}
    for k, v in zip(node.keys, node.values):
      if _string(k) == "opt_name":
        return _string(v) in FAMILY
  if isinstance(node, ast.Tuple) and node.elts and _string(node.elts[0]) is not None:  # ('adam', alias.adam, {...})
    return _string(node.elts[0]) in FAMILY
  return True


def _filter_tables(tree: ast.Module) -> None:
  for node in tree.body:
    if not isinstance(node, ast.Assign):
      continue
    value = node.value
    if isinstance(value, (ast.Tuple, ast.List)) and value.elts and any(isinstance(e, (ast.Dict, ast.Tuple))
                                                                       for e in value.elts):
      value.elts = [e for e in value.elts if _keep_element(e)]
    elif isinstance(value, ast.Dict) and value.keys and all(_string(k) is not None for k in value.keys):
      if any(_string(k) in FAMILY for k in value.keys):  # {'adam': optax.adam(1.0), ...}
        pairs = [(k, v) for k, v in zip(value.keys, value.values) if _string(k) in FAMILY]
        value.keys, value.values = [k for k, _ in pairs], [v for _, v in pairs]


def filtered_source(path: pathlib.Path, classes) -> str:
  tree = ast.parse(path.read_text())
  body = []
  for node in tree.body:
    if isinstance(node, ast.ClassDef):
      if node.name not in classes:
        continue
      node.body = [n for n in node.body if not (isinstance(n, ast.FunctionDef) and n.name in DROPPED_TESTS)]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sklearn"):
      continue  # used only by the L-BFGS tests, which are dropped
    body.append(node)
  tree.body = body
  _filter_tables(tree)
  return ast.unparse(tree)


def main(argv) -> int:
  try:
    import optax
  except ImportError:
    print("optax is not installed: nothing to run")
    return 77  # CTest's skip
  src = pathlib.Path(optax.__file__).parent / "_src"
  with tempfile.TemporaryDirectory(prefix="hostopt-optax-peer-") as tmp:
    out = pathlib.Path(tmp)
    (out / "conftest.py").write_text(CONFTEST.format(family=FAMILY))
    found = []
    for name, classes in MODULES.items():
      if (src / name).exists():
        (out / name).write_text(filtered_source(src / name, classes))
        found.append(name)
    print(f"optax {optax.__version__}: {', '.join(found)} filtered to {'/'.join(FAMILY)}"
          f" ({'optax itself' if os.environ.get('HOSTOPT_PEER_REFERENCE') == '1' else 'hostopt substituted'})",
          flush=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", tmp, *found, *argv]
    # The tests run in the temporary directory: a relative PYTHONPATH would point nowhere there.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    return subprocess.call(cmd, cwd=tmp, env=env)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
