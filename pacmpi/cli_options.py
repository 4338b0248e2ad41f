"""What every command's ``--help`` is built from: a description taken from the command module's
docstring, a formatter that shows each option's default, and the options several commands share,
each defined once here.

Every option of ``pacmpi COMMAND`` and ``pacmpi-run`` says what it does, its unit or format and
its default; ``tests/test_cli_help.py`` walks every parser and fails on an option without help
or on two commands with one description. argparse only, so the core commands, ``launch`` and the
experiments can all import it.

Example::

    parser = command_parser("pacmpi bench memory", __doc__)
    add_json_file(parser, "the report")
"""
import argparse
import re
import textwrap

from .bench.harness import comma_list

__all__ = ["HelpFormatter", "description", "command_parser", "add_json_file", "add_json_flag",
           "add_iters", "add_warmup", "add_seeds", "add_timeout", "add_out_dir", "add_merge",
           "add_no_plots", "add_cache_dir", "add_device", "add_densities", "add_mpirun",
           "add_hostfile", "add_oversubscribe", "add_link", "add_nodes", "add_peer_options"]


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the text already names its default,
    or there is none to show: ``None``, ``False`` or empty (an unset option, an off switch, an
    empty list: the help says what that means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        unset = (default is None or default is False or default is argparse.SUPPRESS
                 or (isinstance(default, (str, list, tuple)) and not default))
        if unset or "%(default)" in text or re.search(r"\bdefault\b", text) \
                or not action.option_strings:
            return text
        return text + " (default: %(default)s)"

    def _split_lines(self, text, width):
        # Not at hyphens, nor inside a word: "pactrain-ternary", "--no-sweep" and a list like
        # "dense,fp16,pactrain" stay whole (a word longer than the column overflows it).
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False,
                             break_long_words=False)


def description(doc):
    """A command's description: the first paragraph of its module docstring ``doc``, without the
    ``pacmpi WORDS``: prefix and reStructuredText's double backquotes, on one line."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    paragraph = re.sub(r"^``[^`]+``:\s*", "", paragraph)
    return paragraph.replace("``", "")


def command_parser(prog, doc, **kwargs):
    """``ArgumentParser(prog, description from doc, formatter HelpFormatter)``."""
    return argparse.ArgumentParser(prog=prog, description=description(doc),
                                   formatter_class=HelpFormatter, **kwargs)


# --------------------------------------------------------------------------- shared options
def add_json_file(parser, what="the results", default=None):
    """``--json FILE``: where the command writes ``what`` (rank 0); ``default`` names the file
    written without it (``None``: none)."""
    where = f"default: {default}" if default else "default: not written"
    parser.add_argument("--json", metavar="FILE", default=None,
                        help=f"write {what} to this JSON file, on rank 0 ({where})")


def add_json_flag(parser, instead_of="the table"):
    """``--json``: print JSON on stdout instead of ``instead_of``."""
    parser.add_argument("--json", action="store_true",
                        help=f"print JSON on stdout instead of {instead_of}")


def add_iters(parser, default, what="timed calls per measurement"):
    parser.add_argument("--iters", type=int, default=default, metavar="N", help=what)


def add_warmup(parser, default, what="untimed calls before the timed ones"):
    parser.add_argument("--warmup", type=int, default=default, metavar="N", help=what)


def add_seeds(parser, default=None, what="training seeds, comma-separated (e.g. 0,1,2); the "
                                         "tables give the median and range over them"):
    shown = ",".join(map(str, default)) if default else None
    parser.add_argument("--seeds", type=comma_list(int), default=default, metavar="S,S",
                        help=what + (f" (default: {shown})" if shown else ""))


def add_timeout(parser, default, what="seconds per training job before it is ended as failed"):
    parser.add_argument("--timeout", type=float, default=default, metavar="SECONDS", help=what)


def add_out_dir(parser, default="results", what="folder for the JSON report and the plots"):
    parser.add_argument("--out-dir", default=default, metavar="DIR", help=what)


def add_merge(parser, what="runs", needs_json=False):
    parser.add_argument("--merge", type=comma_list(), default=None, metavar="JSON,JSON",
                        help=f"run nothing: join these earlier reports' {what} into one report"
                             + (" (--json, required with it)" if needs_json else "")
                             + ", recompute, print the table and plot")


def add_no_plots(parser):
    parser.add_argument("--no-plots", action="store_true",
                        help="write no plots (matplotlib is not needed then)")


def add_cache_dir(parser):
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="where the pretrained models are cached between runs (default: "
                             "$XDG_CACHE_HOME/pacmpi, else ~/.cache/pacmpi)")


def add_device(parser, what="where the arrays live: cpu (NumPy) or cuda (CuPy)"):
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help=what)


def add_densities(parser, default, what="mask densities to measure"):
    parser.add_argument("--densities", default=default, metavar="D,D",
                        help=f"{what}: fractions of the coordinates kept, comma-separated "
                             "(1.0 = dense)")


def add_peer_options(parser):
    """``--topk-ratio``, ``--dgc-ratio`` and ``--powersgd-rank``, defaulting to
    :data:`pacmpi.costmodel.PEER_DEFAULTS` (``pacmpi bench allreduce``, ``pacmpi model
    predict``)."""
    from .costmodel import PEER_DEFAULTS  # here: costmodel builds its parsers from this module

    parser.add_argument("--topk-ratio", type=float, default=PEER_DEFAULTS["topk_ratio"],
                        help="the fraction of the gradient's values topk sends")
    parser.add_argument("--dgc-ratio", type=float, default=PEER_DEFAULTS["dgc_ratio"],
                        help="the fraction of each tensor's values dgc sends, at least one")
    parser.add_argument("--powersgd-rank", type=int, default=PEER_DEFAULTS["powersgd_rank"],
                        help="the rank of powersgd's approximations")


def add_link(parser):
    parser.add_argument("--link", metavar="RATE",
                        help="shape one shared link to RATE (tc units: 100mbit, 1gbit, ...; "
                             "'none' = host network) inside a private network namespace; "
                             "needs root (default: the host network, unshaped)")


def add_nodes(parser):
    parser.add_argument("--nodes", type=int, metavar="K",
                        help="with --link: K simulated nodes, each a network namespace with its "
                             "own Open MPI daemon and a RATE link to a switch; N/K ranks per "
                             "node (default: one host)")


def add_mpirun(parser):
    parser.add_argument("--mpirun", metavar="PATH",
                        help="MPI launcher, a path or a name (default: $PACMPI_MPIRUN, else "
                             "mpirun beside the running Python, else on PATH)")


def add_hostfile(parser):
    parser.add_argument("--hostfile", metavar="FILE",
                        help="MPI host file for multi-node runs (default: all ranks on this "
                             "host)")


def add_oversubscribe(parser):
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more ranks than cores (Open MPI; automatic with --link)")
