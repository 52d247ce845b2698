"""Sphinx configuration of cupy_parallel's documentation site.

Sphinx, because it is what the scientific-Python projects this library sits beside document
themselves with (NumPy, SciPy, CuPy, PyTorch and JAX all build their sites with it): autodoc reads
the docstrings, napoleon their Google sections, MyST the markdown pages and myst-nb the notebooks,
which it executes at build time so that the site shows their outputs.

Build it (warnings are errors, as in CI)::

    python -m pip install -e '.[docs]' --config-settings editable_mode=compat
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, whatever is installed
# The notebooks' kernels and the doctests run the checkout's package too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)

import cupy_parallel  # noqa: E402 - after the path is set

# Imported on first access (lazy): loaded now, so that autodoc finds it among the package's names.
_ = cupy_parallel.DistributedDataParallel
# cupy_parallel.testing's hypothesis strategies are imported on first use too.
import cupy_parallel.testing  # noqa: E402

for _name in cupy_parallel.testing.__all__:
    getattr(cupy_parallel.testing, _name)

project = "cupy_parallel"
author = "cupy_parallel developers"
copyright = "2026, cupy_parallel developers"
release = cupy_parallel.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",  # MyST markdown pages and notebooks (brings myst_parser)
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]
root_doc = "index"

# -- autodoc / napoleon ---------------------------------------------------------------------------
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = False  # values, not the private constants that hold them
autodoc_inherit_docstrings = False
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_preprocess_types = False
napoleon_attr_annotations = True
add_module_names = False
python_display_short_literal_types = True

# References that go to modules outside the site (the private core, which docstrings name so
# that a reader of the source can follow them) are not errors.
nitpicky = True  # every cross-reference must resolve: a broken one fails the build
nitpick_ignore_regex = [
    (r"py:.*", r"cupy_parallel\._src(\..*)?"),
    (r"py:.*", r"cupy_parallel\._tools(\..*)?"),
    # Python's, NumPy's and CuPy's own names (the build runs offline: no intersphinx inventories)
    (r"py:.*", r"(datetime|os|types|concurrent\.futures|contextvars|collections)\b.*"),
    (r"py:.*", r"(numpy|np|cupy|hypothesis)\b.*"),
    (r"py:class", r"'[a-z]+'"),  # Literal["cpu", "host", ...] values in signatures
    (r"py:class", r"SearchStrategy"),  # hypothesis's
]
# The private core's type aliases and classes that signatures name (documented where used).
nitpick_ignore = [
    ("py:class", name)
    for name in (
        "ArrayLike",
        "CupyArray",
        "DTypeLike",
        "DeviceLike",
        "Future",
        "HookHandle",
        "Kind",
        "ModuleType",
        "NDArray",
        "Operand",
        "Output",
        "Params",
        "ProcessGroupBackend",
        "Tree",
        "timedelta",
    )
]

# -- MyST / myst-nb -------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "cache"  # executed once; re-run only when a notebook's code changes
nb_execution_cache_path = str(ROOT / "docs" / "_build" / ".jupyter_cache")
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# -- Examples ------------------------------------------------------------------------------------
# The pages' examples run in the test suite (tests/test_readme.py: ">>>" blocks as doctests, the
# other python blocks as scripts, under mpiexec where they say so), and the API reference's are the
# docstrings' doctests (pytest --doctest-modules): the build itself only renders them.

# -- HTML -----------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "cupy_parallel"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_static_path: list[str] = []
html_show_sourcelink = False

linkcheck_ignore = [r"https?://.*"]  # CI has no network: internal links are what is checked

# -- The API reference: one page per public module, generated from the docstrings ---------------
# A module is listed when it imports, so the reference follows the package: a public module added
# later (cupy_parallel.optim, cupy_parallel.distributed.checkpoint, ...) gets its page from this
# list without editing the pages.
PUBLIC_MODULES = [
    "cupy_parallel",
    "cupy_parallel.comm",
    "cupy_parallel.functions",
    "cupy_parallel.ops",
    "cupy_parallel.optim",
    "cupy_parallel.optim.lr_scheduler",
    "cupy_parallel.distributed",
    "cupy_parallel.distributed.nn.functional",
    "cupy_parallel.distributed.algorithms.ddp_comm_hooks",
    "cupy_parallel.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "cupy_parallel.distributed.checkpoint",
    "cupy_parallel.distributed.optim",
    "cupy_parallel.testing",
]


def _directive(obj: object) -> str:
    """The autodoc directive documenting ``obj``: a class (with its members), a function, data."""
    import inspect

    if inspect.isclass(obj):
        return "autoclass"
    if callable(obj):
        return "autofunction"
    return "autodata"


def _write_api_pages() -> None:
    import importlib
    import inspect

    out = ROOT / "docs" / "api" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for name in PUBLIC_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # not in this checkout
        page = out / f"{name}.md"  # listed by name: the package first, then its modules
        wanted.add(page.name)
        module = sys.modules[name]
        names = [
            n
            for n in getattr(module, "__all__", [])
            if not n.startswith("__") and not inspect.ismodule(getattr(module, n, None))
        ]
        summary = "".join(f"   {n}\n" for n in names)
        entries = "".join(f"\n.. {_directive(getattr(module, n))}:: {n}\n" for n in names)
        text = (
            f"# `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n   :no-members:\n\n"
            f".. currentmodule:: {name}\n\n"
            f".. autosummary::\n   :nosignatures:\n\n{summary}{entries}```\n"
        )
        if not page.exists() or page.read_text(encoding="utf-8") != text:
            page.write_text(text, encoding="utf-8")  # unchanged pages keep their time stamps
    for page in out.glob("*.md"):
        if page.name not in wanted:
            page.unlink()


_write_api_pages()


def _copy_notebooks() -> None:
    """The tutorial notebooks (kept in notebooks/, without outputs) into the site's sources.

    myst-nb executes them at build time and caches the outputs; a copy is rewritten only when
    its notebook changed, so that the cache and Sphinx's own environment stay valid.
    """
    out = ROOT / "docs" / "notebooks"
    out.mkdir(exist_ok=True)
    wanted = set()
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        copy = out / notebook.name
        wanted.add(copy.name)
        data = notebook.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:
            copy.write_bytes(data)
    for copy in out.glob("*.ipynb"):
        if copy.name not in wanted:
            copy.unlink()


_copy_notebooks()

# The guides, in reading order; a page not named here (a new guide) comes after them, by name.
GUIDES = [
    "devices",
    "comm",
    "tape",
    "data_parallel",
    "process_groups",
    "distributed_training",
    "optimizers",
    "checkpoints",
    "sharded_training",
    "zero",
    "testing",
    "contributing",
]


def _write_guides_index() -> None:
    """docs/guides/index.md: the guides' table of contents, from the pages that exist.

    Guide pages are added by the changes that bring their features; listing them here (instead
    of in a hand-kept toctree) keeps every page in the site and the build free of warnings.
    """
    folder = ROOT / "docs" / "guides"
    pages = {p.stem for p in folder.glob("*.md")} - {"index"}
    order = [name for name in GUIDES if name in pages] + sorted(pages - set(GUIDES))
    text = (
        "# Guides\n\nHow each part of the library works, with examples that the test suite runs"
        " (`tests/test_readme.py`).\n\n```{toctree}\n:maxdepth: 1\n\n"
        + "".join(f"{name}\n" for name in order)
        + "```\n"
    )
    index = folder / "index.md"
    if not index.exists() or index.read_text(encoding="utf-8") != text:
        index.write_text(text, encoding="utf-8")


_write_guides_index()
