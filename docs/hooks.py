"""MkDocs hooks: let the site see the two things that live outside docs/.

- The API reference. pyproject installs ``adapters/``, ``launch/`` and ``experiments/`` as
  ``pacmpi.adapters`` and so on (``package-dir``), a rename that griffe's search paths cannot
  express, so mkdocstrings is pointed at a temporary tree of symbolic links laid out as the
  installed package, built from pyproject's own mapping.
- The plots under ``results/``, which the results pages show: they are added to the site as
  they are, not copied into docs/. The pages link them by their path in the repository
  (``../results/x.png``, which GitHub shows too), rewritten here to where the site has them.

The docstrings are written for reading in the source (Sphinx roles such as :class:`X`), so the
API pages drop the role names and keep the code spans.
"""
import re
import shutil
import tempfile
from pathlib import Path

import tomllib
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
_tree = None
# What mkdocstrings renders from ":class:`X`": the role's name before the code span.
_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):(?=<code>)")


def _package_tree():
    """A new temporary directory holding ``pacmpi/`` laid out as pyproject installs it."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]  # "pacmpi.adapters" = "adapters"
    root = Path(tempfile.mkdtemp(prefix="pacmpi-docs-api-"))
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        target = root.joinpath(*package.split("."))
        if package.count("."):
            target.symlink_to(REPO / folder, target_is_directory=True)
        else:  # the top package: a real folder, so that the subpackages can be linked into it
            target.mkdir()
            for entry in (REPO / folder).iterdir():
                target.joinpath(entry.name).symlink_to(entry)
    return root


@event_priority(100)  # before mkdocstrings' own on_config, which creates the handler
def on_config(config):
    global _tree
    on_shutdown()  # `mkdocs serve` reloads the config on every change
    _tree = _package_tree()
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(_tree)]
    return config


def on_files(files, config):
    for plot in sorted((REPO / "results").glob("*.png")):
        files.append(File.generated(config, f"results/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown, page, config, files):
    # The pages that show plots are at the top of docs/, one level below the repository.
    return markdown.replace("](../results/", "](results/")


def on_page_content(html, page, config, files):
    return _ROLE.sub("", html)


def on_shutdown():
    global _tree
    if _tree is not None:
        shutil.rmtree(_tree, ignore_errors=True)
        _tree = None
