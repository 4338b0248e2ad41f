"""The documentation: the site builds with warnings as errors (a broken link, anchor or API
reference fails), the README stays a front door (at most 250 lines, links that resolve, a
headline table that is the results JSON's), and every marked snippet is run by a test: the
user guide's training script on 2 ranks, and every quick-start command (the torchrun ones too)
from a shell in which the venv is NOT activated (the block's own first line activates it), in
a scratch directory so that nothing lands in the checkout."""
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pacmpi.launch.doctor import usable_cpus
from pacmpi.launch.testbed import probe_testbed

from doc_snippets import README, REPO, all_snippets, snippet
from mpi_util import SUITE_ENV, mpirun_argv, run_bounded

README_MAX_LINES = 250
# Every marked snippet and the test that runs it: a new marker without a test fails here.
RUN_BY = {"raw-loop": "test_readme", "horovod": "test_readme", "ddp": "test_readme",
          "sharded": "test_readme", "sharded-ddp": "test_readme", "outer": "test_readme",
          "outer-ddp": "test_readme",
          "lightning": "test_snippet_runs_as_a_python_script",
          "guide-script": "test_guide_script_runs_on_two_ranks",
          "quick-start": "test_quick_start_command_runs_as_written",
          "torchrun": "test_quick_start_torchrun_command_runs_as_written",
          "accelerate": "test_accelerate_snippet", "hf-trainer": "test_trainer_snippet",
          "elastic": "test_snippet_restarts_and_finishes",
          "horovod-elastic": "test_snippet_survives_a_lost_worker"}


def build_site(config, site_dir):
    """``mkdocs build --strict`` of ``config`` into ``site_dir``; the CompletedProcess."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (`make setup` installs it)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(config), "--site-dir", str(site_dir)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    done = build_site(REPO / "mkdocs.yml", site_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    return site_dir


def test_site_builds_with_warnings_as_errors(site):
    for page in ("user-guide", "testbed", "results", "cost-model", "reliability", "design"):
        assert (site / page / "index.html").is_file(), page
    assert list((site / "results").glob("*.png")), "the results plots are not on the site"


@pytest.mark.parametrize("page, public", [
    ("core", ["pacmpi.PacTrainReducer", "pacmpi.MaskMismatchError"]),
    ("adapters", ["pacmpi.adapters.ddp.PacTrainHookState", "pacmpi.adapters.ddp.pactrain_hook",
                  "pacmpi.adapters.horovod.PacTrainCompressor",
                  "pacmpi.adapters.torch_sync.PacTrainSync",
                  "pacmpi.adapters.checkpoint.save_checkpoint",
                  "pacmpi.adapters.pruning.prune"]),
    ("launch", ["pacmpi.launch.run_command", "pacmpi.launch.NodeTestbed"]),
])
def test_api_reference_documents_the_public_names_only(site, page, public):
    html = (site / "api" / page / "index.html").read_text()
    for name in public:
        assert f'id="{name}"' in html, f"{name} is missing from the {page} API page"
    # Private names (pacmpi.adapters.ddp._on_stream, methods such as _launch) stay out.
    private = re.findall(r'id="([\w.]*\._(?!_)[\w.]*)"', html)
    assert not private, f"private names on the {page} API page: {private}"


def test_a_broken_link_fails_the_build(tmp_path):
    # Negative control: the same site with one page linking to a page that does not exist.
    import yaml

    docs = tmp_path / "docs"
    docs.mkdir()
    for page in (REPO / "docs").rglob("*.md"):
        target = docs / page.relative_to(REPO / "docs")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(page.read_text())
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](no-such-page.md)\n")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), hooks=[str(REPO / "docs" / "hooks.py")])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build_site(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stdout + done.stderr, done.stderr


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    assert "make demo" in README.read_text() and "make test" in README.read_text()


def _slugs(markdown_file):
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", markdown_file.read_text(), flags=re.S | re.M)
    return {slugify(heading.strip().replace("`", ""), "-")
            for heading in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_links_resolve():
    """The site checks its own links; the README is not on it, so its relative links (to
    docs/ pages and their headings) are checked here."""
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", README.read_text())
    relative = [(path, anchor) for path, anchor in links if not re.match(r"\w+://", path)]
    assert relative, "the README links to no page of the documentation"
    for path, anchor in relative:
        target = REPO / path
        assert target.exists(), f"README.md links to {path}, which does not exist"
        if anchor:
            assert anchor in _slugs(target), f"README.md links to {path}#{anchor}: no such heading"


# README headline row -> the method's key in results/bench_text.json.
HEADLINE = {"dense fp32": "dense", "dense fp16": "fp16", "TopK 1% + error feedback": "topk-1%",
            "PowerSGD rank 4 (DDP)": "ddp-powersgd-4", "PacTrain 0.5": "pactrain-0.5",
            "PacTrain 0.8": "pactrain-0.8",
            "PacTrain+ternary, unpruned, a scale per tensor": "pactrain-ternary-0-noef",
            "PacTrain+ternary, unpruned, a scale per 256 values":
                "pactrain-ternary-0-noef-block256"}


def _median_range(stat, spec):
    return f"{stat['median']:{spec}} [{stat['min']:{spec}}, {stat['max']:{spec}}]"


def _tta_cell(row):
    """``median [min, max]`` of the seeds that reached the target, then the ones that did not
    (``never`` alone when none did)."""
    stat = row["tta_seconds"]
    never = [seed for seed, value in zip(row["seeds"], stat["values"]) if value is None]
    if stat["n"] == 0:
        return "never"
    return _median_range(stat, ".0f") + (f", seed {', '.join(map(str, never))} never"
                                         if never else "")


def _readme_section(title):
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_predicted_table_is_the_predictions_json():
    """Each "fastest" cell of the README's predicted table, its step time and its speedup over
    dense, against scripts/plot_costmodel.py's JSON."""
    report = json.loads((REPO / "results" / "costmodel_predictions.json").read_text())
    by = {(r["model"], r["ranks"], r["link"]): r for r in report["contenders"]}
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in _readme_section("At scale (predicted)").splitlines()
            if line.startswith("| ") and not line.startswith("| ranks")]
    assert len(rows) == 12
    for ranks, link, *cells in rows:
        for model, (fastest, seconds, speedup) in zip(("resnet152", "bert-base"),
                                                     (cells[:3], cells[3:])):
            row = by[(model, int(ranks), link)]
            assert fastest == row["fastest"] == min(row["seconds"], key=row["seconds"].get)
            assert seconds == f"{row['seconds'][fastest]:.3f}"
            assert speedup == f"{row['seconds']['dense fp32'] / row['seconds'][fastest]:.1f}"


def test_readme_headline_table_is_the_results_json():
    report = json.loads((REPO / "results" / "bench_text.json").read_text())
    repeats, config = report["repeats"], report["config"]
    global_batch = config["ranks"] * config["batch_size"]
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip("|").split("|")]
        for line in _readme_section("Results").splitlines()
        if line.startswith("| ") and not line.startswith("| method"))}
    assert set(rows) == set(HEADLINE)
    for label, key in HEADLINE.items():
        accuracy, step100, tta100, x100, step1g, tta1g, x1g, nbytes, ties = rows[label]
        slow, fast = repeats["100mbit"][key], repeats["1gbit"][key]
        assert len(slow["seeds"]) >= 3, label
        assert accuracy == _median_range(slow["final_accuracy"], ".3f"), label
        for step, tta, x, stats in ((step100, tta100, x100, slow), (step1g, tta1g, x1g, fast)):
            # the shaped step is timed on the first seed only, so it is one number
            assert step == f"{global_batch / stats['samples_per_second']['median']:.1f}", label
            assert tta == _tta_cell(stats), label
            speedup = stats["speedup_vs_dense"]
            assert x == (_median_range(speedup, ".2f") if speedup["n"] else "-"), label
        # bytes over the whole unshaped epoch: the 6 timed steps over-weight the warm-up
        assert nbytes == f"{repeats['none'][key]['bytes_per_step']['median']:,.0f}", label
        assert ties == ", ".join(other for other, twin in HEADLINE.items()
                                 if twin in slow["tta_ties"]), label


def test_every_marked_snippet_is_run_by_a_test():
    assert sorted(all_snippets()) == sorted(RUN_BY)  # also: copies of one name are the same


def test_two_versions_of_one_snippet_are_refused(tmp_path):
    pages = [tmp_path / "a.md", tmp_path / "b.md"]
    for page, code in zip(pages, ["x = 1\n", "x = 2\n"]):
        page.write_text(f"<!-- snippet: demo -->\n```python\n{code}```\n")
    with pytest.raises(ValueError, match="differs"):
        all_snippets(pages)


@pytest.mark.mpi
def test_guide_script_runs_on_two_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(snippet("guide-script"))
    argv = mpirun_argv(2) + [sys.executable, str(script)]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = run_bounded(["bash", "-c", 'cd "$0" && exec "$@"', str(tmp_path), *argv],
                       timeout=180, env=env, what="the user guide's training script")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        packed = re.search(rf"rank {rank}: (\d+) packed all-reduces in 20 steps", done.stdout)
        assert packed and int(packed.group(1)) > 0, done.stdout
        assert f"rank {rank}: back at step 9" in done.stdout, done.stdout
    assert list(tmp_path.glob("run.pt*")), "no checkpoint written where the script ran"


# The user guide's quick start: every command, run as written from a fresh shell.
ACTIVATE = "source .venv/bin/activate"
RANKS_IN_GUIDE = 4


def _commands(block):
    """A bash snippet's commands, backslash-continued lines joined, comments dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+", " ", re.sub(r"\s+#.*$", "", line)) for line in lines
            if line.strip() and not line.startswith("#")]


COMMANDS = _commands(snippet("quick-start"))
COMMENTS = "\n".join(line for line in snippet("quick-start").splitlines()
                     if line.startswith("#"))
TORCHRUN_COMMANDS = _commands(snippet("torchrun"))


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def as_one_node(command):
    """The multi-node form run here as its one node: ``--nnodes 1``, rendezvous on localhost."""
    return (command.replace("--nnodes 2", "--nnodes 1")
            .replace("HOST:29500", f"localhost:{_free_port()}"))


def short_run(command, cache):
    """Flags appended to keep a command to seconds (the guide shows the plain form); with
    argparse the last occurrence of a flag wins."""
    if "bench train" in command:
        return (f" --quick --methods dense-fp32 --sweep-ratios '' --epochs 1 "
                f"--no-plots --timeout 150 --cache-dir {cache}")
    if "bench allreduce --model" in command:  # a model's 60 M values: one row, not eight
        return " --densities 0.2 --methods pactrain --iters 1 --warmup 0"
    if "bench allreduce" in command:
        return " --sizes 64K --densities 1.0,0.2 --iters 1 --warmup 0"
    if re.search(r"(pacmpi|pacmpi\.cli) train ", command):
        return (f" --epochs 1 --max-steps 2 --pretrain-epochs 1 --width 8 --hidden 64 "
                f"--no-progress --pretrained {cache}/pretrained.pt")
    return ""


def on_two_ranks(command):
    """``command`` with the guide's 4 ranks made 2 (``-n``, ``-np`` and its host slots,
    ``--nproc-per-node``). What these tests check is that each form starts and ends well as
    written; a rank costs a few seconds of imports on the suite's 2 cores, and what 4 ranks
    add is checked by the scenarios at 4 ranks and the node test bed's tests."""
    return re.sub(r"(-n |-np |localhost:|--nproc-per-node )4\b", r"\g<1>2", command)


def plain_mpirun_flags():
    """What the quick start's comment tells a user to add to plain ``mpirun`` here."""
    flags = []
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    if usable_cpus()[0] < RANKS_IN_GUIDE:
        flags.append("--oversubscribe")
    return flags


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory with ``.venv`` pointing at the venv these tests run in."""
    where = tmp_path_factory.mktemp("quickstart")
    (where / ".venv").symlink_to(sys.prefix)
    (where / "cache").mkdir()
    return where


def fresh_shell_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PACMPI_", "OMPI_", "PRTE_", "PMIX_")) and k != "VIRTUAL_ENV"}
    env.update(SUITE_ENV)  # the test machine's setting, not the user's (mpi_util)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d != venv_bin)
    return env


def test_quick_start_starts_by_activating_the_venv():
    assert COMMANDS[0] == ACTIVATE
    for flag in plain_mpirun_flags():  # the test adds only what the guide says to add
        assert flag in COMMENTS
    assert [c.split()[:2] for c in TORCHRUN_COMMANDS] == [["torchrun", "--standalone"],
                                                          ["torchrun", "--nnodes"]]


EXPECTED = [  # (what identifies the command, what its output must contain)
    ("pacmpi doctor", "every required part works"),
    ("pacmpi info", "bits/value"),
    ("bench allreduce", "#wrong"),
    ("bench train", "== link none (2 ranks) =="),
    ("model predict", "s per step"),
    (" train ", ""),
]


def run_in_fresh_shell(line, scratch):
    """``line`` from a shell in ``scratch`` whose only set-up is the guide's activate line."""
    return run_bounded(["bash", "-c", f"cd {shlex.quote(str(scratch))} && {ACTIVATE} && {line}"],
                       timeout=300, env=fresh_shell_env(), what=line)


@pytest.mark.slow
@pytest.mark.timeout(330)
@pytest.mark.parametrize("command", TORCHRUN_COMMANDS,
                         ids=["standalone", "multi-node form as one node"])
def test_quick_start_torchrun_command_runs_as_written(command, scratch):
    line = on_two_ranks(as_one_node(command) if "--rdzv-endpoint" in command else command)
    line += short_run(command, scratch / "cache")
    done = run_in_fresh_shell(line, scratch)
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    ranks = int(re.search(r"--nproc-per-node (\d+)", line).group(1))
    method = re.search(r"--method (\S+)", command).group(1)
    assert f"on {ranks} ranks, method {method}" in done.stdout, done.stdout[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(330)
@pytest.mark.parametrize("command", COMMANDS[1:])
def test_quick_start_command_runs_as_written(command, scratch):
    if "--link" in command:
        problem = probe_testbed()
        if problem:
            pytest.skip(f"the shaped test bed is unavailable here: {problem}")
    line = on_two_ranks(command) + short_run(command, scratch / "cache")
    if line.startswith("mpirun "):
        line = " ".join(["mpirun", *plain_mpirun_flags(), line[len("mpirun "):]])
    done = run_in_fresh_shell(line, scratch)
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    expected = next(text for key, text in EXPECTED if key in command)
    assert expected in done.stdout, done.stdout[-3000:]
