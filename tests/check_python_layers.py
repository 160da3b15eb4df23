"""The Python package's layers, checked (the twin of check_layers.cmake for C++).

bindings/python/hostopt has three fronts, torch.py, jax.py and optax.py, each a user's
door (hostopt.torch, hostopt.jax, hostopt.optax), over one shared layer: the package's
core API (__init__.py: hostopt.Optimizer, ...) and the private modules (_*.py), which
hold every rule the fronts share, over the extension _core. A front imports the shared
layer and _core, never another front; nothing in the shared layer imports a front; and
the package's own imports have no circle. Prints the import graph; exits 1 naming what
breaks a rule.
Usage: python3 tests/check_python_layers.py [PACKAGE_DIR]   (default: bindings/python/hostopt)
"""

import ast
import pathlib
import sys

FRONTS = ("torch", "jax", "optax")


def imports_of(path: pathlib.Path, modules: set) -> set:
  """The package's own modules that `path` imports (relative or as hostopt.X), at any depth
  of the file (a function-level import counts as much as a top-level one)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom):
      if node.level == 1 or (node.level == 0 and node.module and node.module.split(".")[0] == "hostopt"):
        base = node.module if node.level == 1 else node.module.partition(".")[2] if node.module else ""
        if base:
          found.add(base.split(".")[0])
        else:  # from . import X, Y: each a module, or a name of __init__
          found.update(a.name if a.name in modules else "__init__" for a in node.names)
    elif isinstance(node, ast.Import):
      for a in node.names:
        parts = a.name.split(".")
        if parts[0] == "hostopt":
          found.add(parts[1] if len(parts) > 1 else "__init__")
  return found & modules


def main() -> int:
  root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent /
                      "bindings/python/hostopt")
  files = {p.stem: p for p in sorted(root.glob("*.py"))}
  modules = set(files) | {"_core", "_xla_ffi"}
  graph = {name: sorted(imports_of(path, modules) - {name}) for name, path in files.items()}
  bad = []
  for name, deps in graph.items():
    for dep in deps:
      if dep in FRONTS and name in FRONTS:
        bad.append(f"front {name}.py imports the front {dep}: fronts share code through the shared layer only")
      elif dep in FRONTS:
        bad.append(f"{name}.py (the shared layer) imports the front {dep}: the layer below never imports a front")
  # Circles: a depth-first walk over the package's own modules.
  state, stack = {}, []

  def walk(name):
    state[name] = "open"
    stack.append(name)
    for dep in graph.get(name, []):
      if state.get(dep) == "open":
        bad.append("import circle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
      elif dep not in state:
        walk(dep)
    stack.pop()
    state[name] = "done"

  for name in graph:
    if name not in state:
      walk(name)
  for name, deps in graph.items():
    kind = "front" if name in FRONTS else "shared"
    print(f"{kind:6s} {name:14s} -> {', '.join(deps) or '(nothing of the package)'}")
  if bad:
    print("Python layering violated:\n  " + "\n  ".join(bad))
    return 1
  print(f"Python layers hold: {len(FRONTS)} fronts over {len(graph) - len(FRONTS)} shared modules, no circle")
  return 0


if __name__ == "__main__":
  sys.exit(main())
