"""The ``pacmpi`` command; its sub-commands are registered by the installed packages.

A package adds a sub-command with an entry point in the group ``pacmpi.commands``, named by
the command's words and pointing at a ``main(argv)`` function, e.g. in ``pyproject.toml``::

    [project.entry-points."pacmpi.commands"]
    "bench allreduce" = "pacmpi.bench.allreduce:main"
    "train" = "pacmpi.experiments.train:main"

The core therefore never imports the adapters or the launch helpers: it only reads the
metadata of what is installed. ``pacmpi --help`` lists the commands with the first sentence of
each target module's docstring, read from its source without importing it (no torch); the
first paragraph is the command's own ``--help`` description
(:func:`pacmpi.cli_options.description`), and :meth:`Command.parser` builds its parser without
running it, by a naming rule: a ``main`` target's module has ``build_parser()``, an ``X_main``
target's ``build_X_parser()``.
Commands run through :func:`pacmpi.faults.run_main`, so an exception on one rank ends the
whole job instead of leaving the others blocked in a collective.
"""
import ast
import importlib.util
import re
import sys
import textwrap
from dataclasses import dataclass
from importlib.metadata import distributions

from .cli_options import description
from .faults import run_main

__all__ = ["main"]

GROUP = "pacmpi.commands"


@dataclass(frozen=True)
class Command:
    """One registered sub-command: its ``words`` and its ``target`` (``"module:function"``)."""

    words: tuple
    target: str

    @property
    def module(self):
        return self.target.partition(":")[0]

    def load(self):
        """Import the target and return its ``main(argv)`` function."""
        module, _, attr = self.target.partition(":")
        function = importlib.import_module(module)
        for name in (attr or "main").split("."):
            function = getattr(function, name)
        return function

    def parser(self):
        """The command's ``argparse`` parser, built without running the command: the target
        module's ``build_parser()`` for a ``main`` target, ``build_X_parser()`` for an
        ``X_main`` one (this imports the module, torch included where it needs torch)."""
        module, _, attr = self.target.partition(":")
        name = (attr or "main").rpartition(".")[2]
        if not name.endswith("main"):
            raise ValueError(f"{self.target}: a command's target is main or X_main")
        builder = "build_" + name[:-len("main")] + "parser"
        return getattr(importlib.import_module(module), builder)()

    def __call__(self, argv):
        # Loading happens here, inside run_main, so that a failed import (torch missing) is
        # reported like any other failure and ends every rank.
        return self.load()(argv)

    def summary(self):
        """The first sentence of the command's description, without its ``pacmpi WORDS:``
        prefix: the target module's docstring for a ``main`` target, the function's own for an
        ``X_main`` one (two commands in one module); the module is located (its parent packages
        imported) but not run."""
        try:
            spec = importlib.util.find_spec(self.module)
            if spec is None or not spec.has_location:
                return f"(cannot read {self.module}: no such module file)"
            with open(spec.origin, encoding="utf-8") as source:
                tree = ast.parse(source.read())
        except (ImportError, OSError, SyntaxError, ValueError) as exc:
            return f"(cannot read {self.module}: {exc})"
        name = self.target.partition(":")[2] or "main"
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                     and node.name == name and name != "main"]
        doc = ast.get_docstring(functions[0] if functions else tree) or ""
        return re.split(r"(?<=[.;])\s|\s--\s", description(doc))[0].rstrip(".;")


def commands():
    """``{words: Command}`` for every entry point in :data:`GROUP`, longest names first (so
    ``bench train`` is matched before a command named ``bench``).

    Every distribution on ``sys.path`` is read, not only the first of each name as
    ``entry_points()`` does: a stale ``pacmpi.egg-info`` left in the current directory by a
    build would otherwise hide the installed package's commands. The first registration of
    a command wins.
    """
    found = {}
    for distribution in distributions():
        for point in distribution.entry_points:
            if point.group == GROUP:
                words = tuple(point.name.split())
                found.setdefault(words, Command(words, point.value))
    return dict(sorted(found.items(), key=lambda item: (-len(item[0]), item[0])))


def _usage(registered):
    lines = ["usage: pacmpi COMMAND [options]", "", "commands:"]
    width = max((len(" ".join(words)) for words in registered), default=0) + 2
    for words in sorted(registered):
        lines += textwrap.wrap(registered[words].summary(), 96, initial_indent=(
            f"  {' '.join(words):<{width}} "), subsequent_indent=" " * (width + 3))
    if not registered:
        lines.append(f"  (none: no installed package registers entry points in {GROUP!r}; "
                     "is pacmpi installed? `pip install -e .` in a checkout)")
    lines += ["", "`pacmpi COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def main(argv=None):
    """Run the sub-command named by the first words of ``argv``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    registered = commands()
    for words, command in registered.items():
        if tuple(argv[:len(words)]) == words:
            return run_main(command, argv[len(words):])
    if argv and argv[0] not in ("-h", "--help"):
        words = " ".join(word for word in argv[:2] if not word.startswith("-"))
        print(f"pacmpi: unknown command {words!r}\n", file=sys.stderr)
        print(_usage(registered), file=sys.stderr)
        return 2
    print(_usage(registered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
