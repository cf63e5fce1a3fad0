"""A multi-task text classification mixture from installed packages, encoded by a frozen MiniLM.

Tasks (the task id is each example's category; labels are local to their task):

pos       a WordNet gloss -> its part of speech (noun, verb, adjective, adverb)
lexname   a WordNet noun gloss -> its lexicographer file (noun.animal, noun.act, ...: 26)
verblex   a WordNet verb gloss -> its lexicographer file (verb.motion, verb.change, ...: 15)
source    a quote from Debian fortunes-min -> its file (fortunes, literature, riddles)
domain    a 200-character window of the LM corpus -> its domain (fortunes, literature,
          WordNet glosses, Python stdlib code: ``corpus.DOMAINS``)

Each task contributes ``per_task`` examples (a seeded sample). The backbone is
frozen, so every text is encoded once: the cache holds MiniLM's token states
[N, max_tokens, 384] (float16) with padding positions set to zero, which is how
the model finds the padding again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dist_moe.data.corpus import DOMAINS, domain_text
from dist_moe.data.paths import data_dir, load_cache, save_cache
from dist_moe.data.sources import fortune_quotes, wordnet_synsets
from dist_moe.models.minilm import load_minilm
from placement.simulate import check_memory

TASKS = ("pos", "lexname", "verblex", "source", "domain")
POS = ("noun", "verb", "adj", "adv")
SOURCES = ("fortunes", "literature", "riddles")


def task_examples(task: str) -> tuple[list[str], list[int], int]:
    """(texts, local labels, number of classes) of one task."""
    if task == "pos":
        pairs = [(g, i) for i, part in enumerate(POS) for g, _ in wordnet_synsets(part)]
        return [g for g, _ in pairs], [y for _, y in pairs], len(POS)
    if task in ("lexname", "verblex"):
        synsets = wordnet_synsets("noun" if task == "lexname" else "verb")
        files = sorted({f for _, f in synsets})
        index = {f: i for i, f in enumerate(files)}
        return [g for g, _ in synsets], [index[f] for _, f in synsets], len(files)
    if task == "domain":
        texts, labels = [], []
        for i, name in enumerate(DOMAINS):
            flat = " ".join(domain_text(name).split())
            windows = [flat[j : j + 200] for j in range(0, len(flat) - 200, 200)]
            texts += windows
            labels += [i] * len(windows)
        return texts, labels, len(DOMAINS)
    if task == "source":
        texts, labels = [], []
        for i, name in enumerate(SOURCES):
            quotes = [" ".join(q.split()) for q in fortune_quotes(name)]
            texts += quotes
            labels += [i] * len(quotes)
        return texts, labels, len(SOURCES)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


@dataclass
class TextSplit:
    """The trainer's split interface; x holds token states, categories are task ids."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    t_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    t_val: torch.Tensor
    task_classes: tuple
    class_category: torch.Tensor | None = None

    @property
    def num_classes(self) -> int:
        return max(self.task_classes)

    @property
    def category_names(self) -> list[str]:
        return list(TASKS)

    def train_categories(self, rows):
        return self.t_train[rows]

    def val_categories(self, rows=slice(None)):
        return self.t_val[rows]


def encode(texts: list[str], max_tokens: int, batch: int = 64) -> torch.Tensor:
    model, tok = load_minilm()
    out = torch.zeros(len(texts), max_tokens, model.hidden_size, dtype=torch.float16)
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            ids, mask = tok(texts[i : i + batch], max_len=max_tokens)
            states = model(ids, mask) * mask.unsqueeze(-1)  # padding positions become exact zeros
            out[i : i + batch, : ids.shape[1]] = states.half()
    return out


MAX_TOKENS = 512  # MiniLM's positions


def _check_cached(cache, x, y, t, classes, max_tokens: int) -> None:
    if (x.shape[1:] != (max_tokens, 384) or len(classes) != len(TASKS) or not ((0 <= t) & (t < len(TASKS))).all()
            or not ((0 <= y) & (y < classes[t.clamp(0, len(TASKS) - 1)])).all()):
        raise ValueError(f"data cache {cache} does not hold [N, {max_tokens}, 384] states with labels of its "
                         f"{len(TASKS)} tasks: delete it and the next run rebuilds it")


def text_split(per_task: int, max_tokens: int, val_fraction: float, seed: int) -> TextSplit:
    if max_tokens > MAX_TOKENS:
        raise ValueError(f"data.seq_len={max_tokens}: MiniLM reads at most {MAX_TOKENS} tokens per text")
    cache = data_dir() / f"text_tasks_{'-'.join(TASKS)}_{per_task}_{max_tokens}_{seed}.npz"
    cached = load_cache(cache, {"x": ("f", 3), "y": ("iu", 1), "t": ("iu", 1), "classes": ("iu", 1)},
                        same_rows=("x", "y", "t"))
    if cached is not None:
        x, y, t, classes = (torch.from_numpy(cached[k]).to(torch.float16 if k == "x" else torch.int64)
                            for k in ("x", "y", "t", "classes"))
        _check_cached(cache, x, y, t, classes, max_tokens)
    else:
        rng = np.random.default_rng(seed)
        texts, labels, tasks, classes = [], [], [], []
        for ti, task in enumerate(TASKS):
            tx, ty, n = task_examples(task)
            pick = np.sort(rng.choice(len(tx), min(per_task, len(tx)), replace=False))
            texts += [tx[i] for i in pick]
            labels += [ty[i] for i in pick]
            tasks += [ti] * len(pick)
            classes.append(n)

        # the states of every text, float16, held twice (the cache and the split)
        check_memory(2 * len(texts) * max_tokens * 384 * 2, f"{len(texts)} texts (data.per_domain={per_task}) x "
                     f"data.seq_len={max_tokens} MiniLM states", "lower data.per_domain or data.seq_len")
        x = encode(texts, max_tokens)
        y, t, classes = torch.tensor(labels), torch.tensor(tasks), torch.tensor(classes)
        save_cache(cache, x=x.numpy(), y=y.numpy(), t=t.numpy(), classes=classes.numpy())
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(len(perm) * val_fraction)))
    val, train = perm[:n_val], perm[n_val:]
    return TextSplit(x[train], y[train], t[train], x[val], y[val], t[val], tuple(classes.tolist()))
