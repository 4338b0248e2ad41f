"""The command line explains itself: every option of every ``pacmpi`` command and of
``pacmpi-run`` has help text that shows its default, no two commands share a description (nor a
line in ``pacmpi --help``), and every option the docs put on a command line exists. The checkers
get negative controls: a parser given one bare option, two with one description, a doc line with
an option no parser has."""
import argparse
import re
from pathlib import Path

import pytest

from pacmpi.cli import commands
from pacmpi.cli_options import HelpFormatter, command_parser
from pacmpi.launch.cli import build_parser as pacmpi_run_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md", REPO / "launch" / "README.md"]
# Options hidden from --help on purpose (argparse.SUPPRESS): {(command, option): why}. None yet.
HIDDEN = {}


def all_parsers():
    """``{"pacmpi WORDS": parser}`` for every registered command, and ``pacmpi-run``'s."""
    found = {"pacmpi " + " ".join(words): command.parser()
             for words, command in commands().items()}
    found["pacmpi-run"] = pacmpi_run_parser()
    return found


def _walk(parsers):
    """``(name, parser)`` for ``parsers`` and, recursively, their argparse sub-commands."""
    stack = list(parsers.items())
    while stack:
        name, parser = stack.pop(0)
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += [(f"{name} {sub}", p) for sub, p in action.choices.items()]


def undocumented(parsers, hidden=HIDDEN):
    """What ``--help`` leaves unsaid in ``parsers`` (``{name: ArgumentParser}``), one line per
    problem: a command without a description, two commands with one, an option without help
    (or hidden without a reason in ``hidden``), an option whose help does not show its
    default."""
    problems, described = [], {}
    for name, parser in _walk(parsers):
        text = " ".join((parser.description or "").split())
        if not text:
            problems.append(f"{name}: no description")
        elif text in described:
            problems.append(f"{name} and {described[text]} share one description")
        described.setdefault(text, name)
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            option = "/".join(action.option_strings) or action.dest
            if action.help is argparse.SUPPRESS:
                if (name, option) not in hidden:
                    problems.append(f"{name}: {option} is hidden without a reason")
                continue
            if not (action.help or "").strip():
                problems.append(f"{name}: {option} has no help text")
                continue
            shown = formatter._expand_help(action)
            default = action.default
            unset = (default is None or default is False or action.required
                     or (isinstance(default, (str, list, tuple)) and not default))
            if not unset and "default" not in shown:
                problems.append(f"{name}: {option}'s help does not show its default {default!r}")
    return problems


@pytest.fixture(scope="module")
def parsers():
    return all_parsers()


def test_every_option_has_help_and_every_command_its_own_description(parsers):
    assert len(parsers) >= 13, sorted(parsers)  # 12 pacmpi commands and pacmpi-run
    assert undocumented(parsers) == []


def test_negative_control_a_bare_option_and_a_shared_description_fail():
    bare = argparse.ArgumentParser(prog="bare", description="one job")
    bare.add_argument("--warmup", type=int, default=2)
    twin = argparse.ArgumentParser(prog="twin", description="one  job")
    hidden = argparse.ArgumentParser(prog="hidden", description="another job")
    hidden.add_argument("--secret", help=argparse.SUPPRESS)
    quiet = argparse.ArgumentParser(prog="quiet", description="a third job")
    quiet.add_argument("--iters", type=int, default=5, help="timed calls")
    problems = undocumented({"bare": bare, "twin": twin, "hidden": hidden, "quiet": quiet})
    assert problems == ["bare: --warmup has no help text", "twin and bare share one description",
                        "hidden: --secret is hidden without a reason",
                        "quiet: --iters's help does not show its default 5"]
    # ... and the shared formatter is what makes the last one pass.
    shown = argparse.ArgumentParser(prog="shown", description="d", formatter_class=HelpFormatter)
    shown.add_argument("--iters", type=int, default=5, help="timed calls")
    assert undocumented({"shown": shown}) == []
    assert "(default: 5)" in shown.format_help()


def test_sub_commands_are_walked():
    parser = command_parser("tool", "``tool``: does things.")
    sub = parser.add_subparsers().add_parser("inner", description="inner job")
    sub.add_argument("--bare")
    assert undocumented({"tool": parser}) == ["tool inner: --bare has no help text"]


def test_pacmpi_help_lines_differ():
    summaries = {}
    for words, command in commands().items():
        summaries.setdefault(command.summary(), []).append(" ".join(words))
    assert not [names for names in summaries.values() if len(names) > 1]


# ---------------------------------------------------------------------------- the docs
_COMMAND = re.compile(r"(?<![\w./-])(pacmpi-run|pacmpi(?:\.cli)?)(?![\w.-])")


def _command_lines(text):
    """Command lines in ``text`` (Markdown): code-block lines with their backslash
    continuations joined, and inline code spans."""
    lines = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += re.findall(r"`([^`\n]+)`", prose)
    return lines


def unknown_doc_options(text, parsers):
    """``[(command, option)]`` for each option ``text`` puts on a ``pacmpi WORDS`` or
    ``pacmpi-run`` command line that the command's parser does not have. ``pacmpi-run``'s
    options end at ``--`` or at its COMMAND (the first word that is not an option's value)."""
    names = sorted((name.split() for name in parsers), key=len, reverse=True)
    found = []
    for line in _command_lines(text):
        for match in _COMMAND.finditer(line):
            tokens = line[match.start():].split()
            tokens[0] = "pacmpi-run" if tokens[0] == "pacmpi-run" else "pacmpi"
            words = next((n for n in names if tokens[:len(n)] == n), None)
            if words is None:
                continue
            name, rest = " ".join(words), tokens[len(words):]
            ends = [i for i, token in enumerate(rest) if token in ("|", "&&", ";", "#", ">")]
            rest = rest[:ends[0]] if ends else rest
            options = parsers[name]._option_string_actions
            expects_value = False
            for token in rest:
                if token == "--":
                    break
                if expects_value:
                    expects_value = False
                    continue
                if not token.startswith("-"):
                    if name == "pacmpi-run":
                        break  # the COMMAND starts here
                    continue
                flag = token.split("=")[0]
                if not re.fullmatch(r"--?[a-zA-Z][\w-]*", flag):
                    continue  # "-" placeholders, "-1" values
                action = options.get(flag)
                if action is None:
                    found.append((name, flag))
                else:
                    expects_value = "=" not in token and action.nargs != 0
    return found


# Options of other programs that the docs name on their own (`--map-by`): by program.
OTHER_PROGRAMS = {
    "mpirun (Open MPI, MPICH)": {"--allow-run-as-root", "--bind-to", "--map-by", "--mca",
                                 "--tag-output", "--output", "--oversubscribe"},
    "horovodrun": {"--blacklist-cooldown-range", "--max-np", "--min-np", "--mpi",
                   "--network-interface", "--gloo"},
    "torchrun": {"--node-rank", "--nproc-per-node", "--nnodes", "--standalone"},
    "python -m pacmpi.launch.bench_spread": {"--seconds"},
}


def unknown_bare_options(text, parsers, others=OTHER_PROGRAMS):
    """Options named on their own in ``text``'s inline code (`--ratio 0.8`) that neither a
    parser of ``parsers`` nor one of the ``others`` programs has."""
    known = set().union(*(p._option_string_actions for p in parsers.values()), *others.values())
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [span for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith("-")]
    return sorted({flag for span in spans
                   for flag in re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", span)} - known)


def test_every_option_the_docs_name_exists(parsers):
    unknown = {str(path.relative_to(REPO)): unknown_doc_options(path.read_text(), parsers)
               + unknown_bare_options(path.read_text(), parsers)
               for path in DOCS if path.exists()}
    assert {path: found for path, found in unknown.items() if found} == {}


def test_negative_control_a_bare_option_no_parser_has_is_found(parsers):
    text = "`--ratio 0.8` and `--map-by slot`, not `--rattio`; ```\n`--in-a-block`\n```"
    assert unknown_bare_options(text, parsers) == ["--rattio"]


@pytest.mark.parametrize("text, expected", [
    ("```bash\nmpirun -n 4 pacmpi train --epochs 1 \\\n    --no-such-flag 3\n```\n",
     [("pacmpi train", "--no-such-flag")]),
    ("run `pacmpi bench allreduce --sizes 1M --warmpu 2` first", [("pacmpi bench allreduce",
                                                                   "--warmpu")]),
    ("`pacmpi-run -n 4 --lnik 1gbit -- python t.py --whatever`", [("pacmpi-run", "--lnik")]),
    ("`pacmpi-run -n 4 --link 1gbit -- python t.py --whatever`", []),
    ("`torchrun --nproc-per-node 4 -m pacmpi.cli train --backend ddp`", []),
])
def test_negative_control_the_docs_checker_finds_a_wrong_option(text, expected, parsers):
    assert unknown_doc_options(text, parsers) == expected
