"""Sphinx configuration of hostopt's documentation (built by .ci/docs).

The package is imported from the build given on PYTHONPATH (.ci/docs's first argument), so
the API reference shows the docstrings of the code that was built, not a copy.
"""
import re
import sys

project = "hostopt"
author = "hostopt contributors"
copyright = "hostopt contributors, Apache License 2.0"

try:
  import hostopt
  release = version = hostopt.__version__
except ImportError as e:  # the API page cannot be built without the package: say so at once
  sys.exit(f"docs/conf.py: cannot import hostopt ({e}); pass the built package's PYTHONPATH to .ci/docs")

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Headings get anchors up to ###, so pages link to sections as `page.md#a-heading`.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# nitpicky (-n): every cross-reference must resolve. There is no network, so no intersphinx:
# references to the types of these third-party packages (in signatures and base classes) have
# no target here and are the only ones ignored.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|torch|jax|jnp|optax|chex|ml_dtypes)(\..*)?"),
    (r"py:class", r"ArrayTree"),  # chex.ArrayTree, as the installed optax's signatures name it
    (r"py:class", r"(collections\.abc|typing|os)\..*"),  # the standard library's, without intersphinx
    # The extension module's own classes that no public wrapper documents yet
    # (StoredOptimizer's export and import take a hostopt._core.ShardedOptimizer).
    (r"py:class", r"hostopt\._core\.ShardedOptimizer"),
]



def _public_bases(app, name, obj, options, bases):
  """A class's bases as a user may name them: a private base (hostopt.torch._HostAdam) is
  shown as its own public bases (torch.optim.Optimizer), pybind11's object as object."""
  out = []
  for b in bases:
    if getattr(b, "__module__", "") == "pybind11_builtins":
      out.append(object)
    elif getattr(b, "__name__", "").startswith("_"):
      sub = list(b.__bases__)
      _public_bases(app, name, obj, options, sub)
      out.extend(sub)
    else:
      out.append(b)
  bases[:] = [b for i, b in enumerate(out) if b not in out[:i]]


_TYPE_DEFAULT = re.compile(r"^(\s*:type (\S+): )(.*?),\s*default\s+(.+?)\s*$")
# Types written as words in Google-style "name (type)" entries, as torch's docstrings do.
_WORD_TYPES = {"iterable": "~collections.abc.Iterable", "callable": "~collections.abc.Callable"}


def _defaults_out_of_types(lines):
  """hostopt's docstrings write "name (type, default value): ..." (torch's convention).
  napoleon puts "type, default value" in the :type: field, where every word would be a
  cross-reference; the default moves to the start of the parameter's description."""
  for i, line in enumerate(lines):
    m = _TYPE_DEFAULT.match(line)
    if not m:
      continue
    head, pname, typ, default = m.groups()
    lines[i] = head + _WORD_TYPES.get(typ.strip(), typ)
    for j, other in enumerate(lines):
      prefix = f":param {pname}:"
      if other.lstrip().startswith(prefix):
        k = other.index(prefix) + len(prefix)
        lines[j] = f"{other[:k]} (default ``{default}``){other[k:]}"
        break
  for i, line in enumerate(lines):
    m = re.match(r"^(\s*:type \S+: )(\w+)\s*$", line)
    if m and m.group(2) in _WORD_TYPES:
      lines[i] = m.group(1) + _WORD_TYPES[m.group(2)]


def setup(app):
  app.connect("autodoc-process-bases", _public_bases)
  # napoleon reads the first line of a property's docstring as "type: description", so a
  # prose line with a colon ("Bytes of host state (masters and moments: 12 per ...") would
  # become a type. hostopt's properties are documented in prose: napoleon sees them as
  # methods (its Args/Returns sections still work).
  from sphinx.ext import napoleon
  for listener in list(app.events.listeners.get("autodoc-process-docstring", [])):
    if listener.handler is napoleon._process_docstring:
      app.disconnect(listener.id)

  def process(app, what, name, obj, options, lines):
    napoleon._process_docstring(app, "method" if what == "property" else what, name, obj, options, lines)
    _defaults_out_of_types(lines)

  app.connect("autodoc-process-docstring", process)


html_theme = "alabaster"
html_title = f"hostopt {release}"
html_static_path = []
