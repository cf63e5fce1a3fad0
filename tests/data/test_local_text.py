"""A user's own text for the LM (``data.name`` a local text file, folder or token file): what the model
reads is the source cut into sequences, cached until the source changes, and every bad source is
refused in one line before a run starts."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_moe.cli import main
from dist_moe.data.local_text import load_sequences, local_split
from dist_moe.data.token_rows import TokenFile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_MOE_DATA", str(tmp_path / "data"))


def _rows(split) -> set:
    """Every sequence of the split (inputs + the last target), as bytes."""
    rows = torch.cat([torch.cat([split.x_train[:], split.y_train[:, -1:]], 1),
                      torch.cat([split.x_val[:], split.y_val[:, -1:]], 1)])
    return {bytes(r.tolist()) for r in rows.to(torch.uint8)}


def test_a_text_file_is_its_bytes_cut_into_sequences(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(40)).encode()
    (tmp_path / "a.txt").write_bytes(text)
    split = local_split(str(tmp_path / "a.txt"), 15, 0.25, 0)
    n = len(text) // 16
    assert _rows(split) == {text[i * 16:(i + 1) * 16] for i in range(n)}
    assert len(split.x_val) == round(n * 0.25) and len(split.x_train) == n - len(split.x_val)
    assert torch.equal(split.x_train[:, 1:], split.y_train[:, :-1])  # targets: the next bytes
    assert split.category_names is None and split.num_classes == 256


def test_a_folder_joins_its_files_in_path_order_leaving_hidden_ones_out(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_bytes(b"B" * 40)
    (folder / "sub" / "a.md").write_bytes(b"A" * 40)  # sorted by path: b.txt < sub/a.md
    (folder / ".hidden").write_bytes(b"H" * 400)
    got = load_sequences(folder, 9)
    assert got.tobytes() == np.frombuffer(b"B" * 40 + b"\n" + b"A" * 40, np.uint8).astype(np.uint16)[:80].tobytes()


def test_a_folder_reads_neither_links_nor_the_data_cache(tmp_path, monkeypatch):
    outside = tmp_path / "secret.txt"
    outside.write_bytes(b"S" * 200)
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"A" * 40)
    (folder / "link.txt").symlink_to(outside)  # a folder from elsewhere must not pull this in
    monkeypatch.setenv("DIST_MOE_DATA", str(folder / "data"))  # the cache written inside the folder
    first = load_sequences(folder, 9)
    assert set(first.reshape(-1).tolist()) == {ord("A")}
    assert list((folder / "data").glob("local_*.npz"))
    assert np.array_equal(load_sequences(folder, 9), first)  # the next run: the same source, not the cache


def test_token_files_that_are_not_one_array_of_ids_are_refused(tmp_path):
    with open(tmp_path / "two.npy", "wb") as f:  # an .npz archive under an .npy name
        np.savez(f, a=np.arange(10), b=np.arange(10))
    with pytest.raises(ValueError, match="is not one .npy array"):
        load_sequences(tmp_path / "two.npy", 3)
    np.save(tmp_path / "huge.npy", np.array([7, 2**32 + 7, 1, 2, 3, 4, 5, 6], dtype=np.int64))
    with pytest.raises(ValueError, match="holds token id 4294967303, beyond any vocabulary"):
        load_sequences(tmp_path / "huge.npy", 1)


@pytest.mark.parametrize("dtype,write", [("uint16", "bin"), ("uint32", "bin"), ("uint16", "npy")])
def test_token_files_are_read_as_their_flat_layout(tmp_path, dtype, write):
    ids = np.arange(100, dtype=dtype) % 250
    path = tmp_path / f"tokens.{write}"
    if write == "bin":
        ids.tofile(path)
    else:
        np.save(path, ids.astype(np.int64))
    got = load_sequences(path, 9, dtype)
    assert isinstance(got, TokenFile) and got.shape == (10, 10)  # read where it lies, never copied
    assert np.array_equal(got.take(np.arange(10)).reshape(-1), ids)
    split = local_split(str(path), 9, 0.2, 0, token_dtype=dtype)
    assert len(split.x_train) + len(split.x_val) == 10
    assert _rows(split) == {bytes(r.tolist()) for r in ids.reshape(10, 10).astype(np.uint8)}
    assert not (tmp_path / "data").exists()  # no cache copy of a token file


def test_a_token_file_beyond_memory_trains_in_place_and_text_of_that_size_is_refused_unread(tmp_path, monkeypatch):
    ids = np.arange(40_000, dtype=np.uint16) % 256
    ids.tofile(tmp_path / "tokens.bin")
    (tmp_path / "text.txt").write_bytes(ids.astype(np.uint8).tobytes())
    budget = 40_000  # bytes: less than either source's bytes in memory
    split = local_split(str(tmp_path / "tokens.bin"), 63, 0.2, 0, memory=budget)
    assert len(split.x_train) == 500 and split.x_train[torch.tensor([0])].dtype == torch.int64
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read {self}"))
    with pytest.raises(ValueError, match=r"data.name='.*text.txt': to read its 3.73e-05 GiB of text this process "
                                         r"needs about 0.000186 GiB, more than the 3.73e-05 GiB of memory available"):
        local_split(str(tmp_path / "text.txt"), 63, 0.2, 0, memory=budget)


def test_the_cache_is_read_again_only_when_the_source_changes(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"x" * 100)
    first = load_sequences(path, 9)
    caches = list((tmp_path / "data").glob("local_*.npz"))
    assert len(caches) == 1
    np.savez(caches[0], tokens=first[:3])  # the cache is what is read while the source is unchanged
    assert len(load_sequences(path, 9)) == 3
    path.write_bytes(b"y" * 200)  # a changed source is read again, into a cache of its own
    assert load_sequences(path, 9)[0, 0] == ord("y") and len(list((tmp_path / "data").glob("local_*.npz"))) == 2


@pytest.mark.parametrize("source,args,message", [
    ("missing.txt", [], "no such file or folder"),
    ("big.npy", [], "holds token id 259; the model reads ids below 256"),  # the largest id of the sequences read
    ("odd.bin", [], "not a whole number of uint16 tokens"),
    ("empty", [], "is a folder without files"),
    ("short.txt", [], "fewer than 3 sequences of data.seq_len + 1 = 65"),
    ("short.txt", ["data.categories=domains"], "data.categories must be null for a local source"),
    ("short.txt", ["data.token_dtype=int8"], "data.token_dtype"),
])
def test_bad_sources_are_refused_in_one_line(tmp_path, capsys, source, args, message):
    np.save(tmp_path / "big.npy", np.arange(300))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "empty").mkdir()
    (tmp_path / "short.txt").write_bytes(b"too short")
    rc = main(["train", "--quiet", "--config", str(ROOT / "configs/lm_branch.yaml"), f"data.name={tmp_path / source}",
               f"output.dir={tmp_path / 'run'}", "train.max_steps=2", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_dist_moe_train_learns_a_text_file_in_one_command(tmp_path):
    (tmp_path / "mine.txt").write_text("".join(f"{i} little ducks went out one day\n" for i in range(300)))
    out = tmp_path / "run"
    rc = main(["train", "--quiet", "--config", str(ROOT / "configs/lm_branch.yaml"),
               f"data.name={tmp_path / 'mine.txt'}", f"output.dir={out}", "train.max_steps=30", "train.log_every=5"])
    assert rc == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert losses[-1] < losses[0] - 1.0  # a repetitive text is learned fast


def test_the_cache_is_never_written_through_a_link_at_a_name_known_beforehand(tmp_path, monkeypatch):
    """The cache's name, and the temporary name it had, are knowable before a run (a hash of the source's
    path, size and time; the writer's pid): links planted at both leave their target as it was."""
    import os

    from dist_moe.data import local_text

    (tmp_path / "a.txt").write_bytes(b"A" * 400)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    key = local_text._key(tmp_path / "a.txt", [tmp_path / "a.txt"], 9, "uint16")
    data = tmp_path / "data"
    data.mkdir()
    for name in (f"local_{key}.{os.getpid()}.tmp.npz", f"local_{key}.npz.tmp"):
        (data / name).symlink_to(outside)
    load_sequences(tmp_path / "a.txt", 9)
    assert outside.read_text() == "keep me"
    cache = data / f"local_{key}.npz"
    assert cache.is_file() and not cache.is_symlink()
    assert np.array_equal(load_sequences(tmp_path / "a.txt", 9), load_sequences(tmp_path / "a.txt", 9))


def test_validation_and_the_routing_record_read_a_bounded_prefix_of_a_large_split(tmp_path, monkeypatch):
    """train.eval_batches=5 of train.batch_size=16: each validation pass and the routing record read the first 80
    validation rows, not the whole 20% split of the token file."""
    from dist_moe.data.token_rows import TokenRows
    from placement.simulate import RoutingRecord

    (np.arange(78_000, dtype=np.uint16) % 256).tofile(tmp_path / "tokens.bin")  # 26,000 rows of 2 + 1 tokens
    read = []
    real = TokenRows.__getitem__

    def spy(self, index):
        if len(self) == 5_200:  # the validation split
            read.append(self.rows[index if not isinstance(index, tuple) else index[0]])
        return real(self, index)

    monkeypatch.setattr(TokenRows, "__getitem__", spy)
    rc = main(["train", "--quiet", "--config", str(ROOT / "configs/lm_branch.yaml"),
               f"data.name={tmp_path / 'tokens.bin'}", "data.seq_len=2", f"output.dir={tmp_path / 'run'}",
               "train.eval_batches=5", "train.batch_size=16", "train.max_steps=1", "model.layers=1"])
    assert rc == 0 and read
    seen = torch.cat([r.reshape(-1) for r in read])
    assert set(seen.tolist()) == set(read[0].tolist()) and len(read[0]) == 80  # the same first 80, every time
    assert len(RoutingRecord.load(tmp_path / "run").expert_idx) == 80 * 2  # two tokens a row


def test_every_rank_takes_an_equal_part_of_the_rows_in_as_many_forwards():
    from dist_moe.train.metrics.evaluate import shared_rows

    for total, world in ((10_000, 2), (5, 4), (9_000, 3)):
        parts = [shared_rows(total, world, r, 4096) for r in range(world)]
        assert torch.equal(torch.cat([mine for mine, _ in parts]), torch.arange(total))
        assert len({len(batches) for _, batches in parts}) == 1  # every rank: the same number of forwards
        for mine, batches in parts:
            assert torch.equal(torch.cat(batches), torch.arange(len(mine)))
            assert max(len(b) for b in batches) <= 4096
