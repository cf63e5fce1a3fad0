"""`dist-moe report | place | simulate | plan | calibrate` on inputs that cannot work: each is refused in one
line and exit 2 before any work or output (or, where a result is still well defined, warned about in one
line), and every number they print or write is finite and strict JSON."""
import json
import shutil

import numpy as np
import pytest

from dist_moe.cli import calibrate as cli_calibrate
from dist_moe.cli import report as cli_report
from dist_moe.train.rundir import RunLock
from tests.faults.test_user_errors import TINY, _cli, _one_line

REPORT_FILES = ("report.json", "report.md", "traffic_heatmap.png", "bytes_by_level.png", "expert_load.png",
                "tree_distance.png")
PLAN = ["plan", "--topology", "node=2,gpu=2", "--hidden", "8", "--ffn", "8", "--experts", "8", "--top-k", "2",
        "--tokens-per-rank", "8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny trained run (8 experts, top-2), shared by the tests: copy it before changing it."""
    from dist_moe.cli import main

    run = tmp_path_factory.mktemp("trained")
    assert main(["train", *TINY, f"output.dir={run}"]) == 0
    return run


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run, for a test to change."""
    return shutil.copytree(trained, tmp_path / "run")


def _record(folder, tokens: int, expert_idx=None, probs=None):
    """A hand-written routing record of 8 experts on one rank."""
    folder.mkdir(exist_ok=True)
    idx = np.zeros((tokens, 2), dtype=np.int64) if expert_idx is None else expert_idx
    probs = np.full((tokens, 8), 0.125, dtype=np.float32) if probs is None else probs
    np.savez(folder / "routing.npz", expert_idx=idx, src_rank=np.zeros(tokens, dtype=np.int64),
             meta=np.array([8, 1, 64]), probs=probs)
    return folder


def _warned(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dist-moe: warning: "), err
    for f in fragments:
        assert f in lines[0], (f, err)


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")
    return json.loads(text, parse_constant=refuse)


def _uses(args, record, out):
    """The command line of a command that reads ``record``'s routing; it writes only to ``out``."""
    return {"report": ["report", str(record)],
            "place": ["place", "--topology", "node=2,gpu=2", "--stats", str(record), "--out", str(out / "p.yaml")],
            "simulate": ["simulate", "--topology", "node=2,gpu=2", "--stats", str(record), "--json"],
            "plan": [*PLAN, "--routing", str(record), "--json"]}[args]


@pytest.mark.parametrize("command", ["report", "place", "simulate", "plan"])
def test_an_empty_routing_record_is_refused_naming_the_file(capsys, tmp_path, command):
    record = _record(tmp_path / "empty", 0)
    code, err = _cli(capsys, *_uses(command, record, tmp_path))
    assert code == 2
    _one_line(err, f"routing record {record / 'routing.npz'} holds no tokens")
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["routing.npz"]  # nothing written


@pytest.mark.parametrize("command", ["report", "place", "simulate"])
def test_negative_probabilities_in_a_routing_record_are_refused(capsys, tmp_path, command):
    probs = np.full((6, 8), 0.125, dtype=np.float32)
    probs[2, 3] = -0.5
    record = _record(tmp_path / "neg", 6, probs=probs)
    code, err = _cli(capsys, *_uses(command, record, tmp_path))
    assert code == 2
    _one_line(err, str(record / "routing.npz"), "'probs' must hold probabilities", "-0.5")


def test_a_record_without_a_kept_slot_gives_a_strict_report(capsys, tmp_path):
    """Every slot dropped: no co-selected pair (tree distance) and no dispatched slot (node share CV);
    report.json leaves them out or null, never NaN."""
    record = _record(tmp_path / "dropped", 6, expert_idx=np.full((6, 2), -1, dtype=np.int64))
    code, err = _cli(capsys, "report", str(record))
    assert code == 0, err
    report = _strict((record / "report.json").read_text())
    assert "tree_distance" not in report and report["placements"]["contiguous"]["node_share_cv"] is None


def test_a_torn_last_metrics_row_is_skipped_with_one_warning(capsys, run):
    metrics = run / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join(rows) + "\n" + rows[0][:40])  # a run killed while writing its next row
    code, err = _cli(capsys, "report", str(run))
    assert code == 0
    _warned(err, str(metrics), f"line {len(rows) + 1} is cut short")
    report = _strict((run / "report.json").read_text())
    assert report["training"]["torn_last_row"] == len(rows) + 1 and report["training"]["steps"] == [1]


def test_a_last_row_with_an_integer_beyond_a_float_is_read_not_called_cut_short(capsys, run):
    """Python refuses to read an integer of over 4,300 digits; the row is whole, its value reads as null."""
    metrics = run / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join(rows) + "\n" + '{"step": 2, "loss": 1' + "0" * 5000 + "}\n")
    code, err = _cli(capsys, "report", str(run))
    assert code == 0 and err == "", err
    report = _strict((run / "report.json").read_text())
    assert report["training"]["torn_last_row"] is None and report["training"]["steps"] == [1, 2]


@pytest.mark.parametrize("line2,fragments", [
    (b"garbage", ["line 2 is not JSON"]),
    (b"\xff\xfe\x00\x01", ["line 2 is not JSON", "not UTF-8"]),
    (b"[1, 2]", ["line 2 must hold a JSON object"]),
    (b'{"step": 2, "loss": 1.0, "bytes_node": "many"}', ["line 2: 'bytes_node' must be a count of bytes"]),
])
def test_a_damaged_metrics_row_names_the_file_and_its_line(capsys, run, line2, fragments):
    metrics = run / "metrics.jsonl"
    first, *rest = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(first + line2 + b"\n" + b"".join(rest))
    code, err = _cli(capsys, "report", str(run))
    assert code == 2
    _one_line(err, f"metrics file {metrics}", *fragments)
    assert not any((run / name).exists() for name in REPORT_FILES)


def _report_while_training(capsys, run) -> tuple[int, str]:
    """``dist-moe report`` while the lock a training run holds for its life is held."""
    lock = RunLock(run)
    lock.acquire()
    try:
        return _cli(capsys, "report", str(run))
    finally:
        lock.release()


def test_a_report_on_a_run_still_training_warns_and_goes_on(capsys, run):
    code, err = _report_while_training(capsys, run)
    assert code == 0
    _warned(err, f"the run in {run} is still in progress", "snapshot", "routing record may be from an earlier run")
    code, err = _cli(capsys, "report", str(run))  # the lock file stays after the run: no warning then
    assert code == 0 and err == ""


def test_a_report_on_a_run_in_its_first_stretch_says_when_to_run_it(capsys, run):
    """Still training and no routing record yet (it is written at the run's end): not "train with dist-moe"."""
    (run / "routing.npz").unlink()
    code, err = _report_while_training(capsys, run)
    assert code == 2
    _one_line(err, f"the run in {run} is still training and writes its routing record (routing.npz) when it ends")


@pytest.mark.parametrize("args,fragments", [
    (["--tflops", "nan"], ["--tflops must be a finite number in [0.001, 1e+06]", "got nan"]),
    (["--tflops", "inf"], ["--tflops must be a finite number", "got inf"]),
    (["--ep", "0"], ["--ep must be an int >= 1, got 0"]),
    (["--link", "gpu=1e999GB/s"], ["--link gpu=1e999GB/s: bandwidth_Bps must be a finite number in [1, 1e+18]"]),
    (["--link", "node=1GB/s@1000s"], ["--link node=1GB/s@1000s: alpha_s must be a finite number in [0, 60] s"]),
    (["--hidden", str(10 ** 30)], ["--hidden must be an int in [1, 1048576]"]),
    (["--pipeline-chunks", "100000000000000000000"], ["--pipeline-chunks '100000000000000000000'", "[1, 64]"]),
    (["--pipeline-chunks", "1,65"], ["--pipeline-chunks '1,65'", "[1, 64]"]),
])
def test_plan_refuses_numbers_out_of_range(capsys, args, fragments):
    code, err = _cli(capsys, *PLAN, *args)
    assert code == 2
    _one_line(err, *fragments)


@pytest.mark.parametrize("cost,fragments", [
    ("{node: {bandwidth_Bps: 5e-324}}", ["'cost.node.bandwidth_Bps' must be a finite number in [1, 1e+18] bytes/s",
                                         "5e-324"]),
    ('{node: {shared: "yes"}}', ["'cost.node.shared' must be true or false, got 'yes'"]),
])
@pytest.mark.parametrize("command", ["report", "simulate"])
def test_a_topology_file_out_of_range_is_refused_at_load(capsys, trained, tmp_path, cost, fragments, command):
    topology = tmp_path / "t.yaml"
    topology.write_text(f"levels: [node, gpu]\nsizes: [2, 2]\ncost: {cost}\n")
    run = shutil.copytree(trained, tmp_path / "run") if command == "report" else trained
    args = ["report", str(run)] if command == "report" else ["simulate", "--stats", str(run), "--json"]
    code, err = _cli(capsys, *args, "--topology", str(topology))
    assert code == 2
    _one_line(err, f"topology file {topology}", *fragments)
    assert not (run / "report.json").exists()


def test_place_refuses_a_folder_as_out_before_the_work(capsys, trained, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_report.RoutingRecord, "load", lambda *a: pytest.fail("read the record first"))
    code, err = _cli(capsys, "place", "--topology", "node=2,gpu=2", "--stats", str(trained), "--out", str(tmp_path))
    assert code == 2
    _one_line(err, f"--out {str(tmp_path)!r} is a folder")


def test_report_refuses_a_report_file_it_cannot_write_before_the_work(capsys, run):
    (run / "report.json").mkdir()
    code, err = _cli(capsys, "report", str(run))
    assert code == 2
    _one_line(err, f"report file {str(run / 'report.json')!r} is a folder")
    assert not any((run / name).exists() for name in REPORT_FILES[1:])  # no plot drawn first


def test_plan_refuses_a_folder_as_plot_before_the_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("dist_moe.cli.plan.forecast", lambda *a, **k: pytest.fail("planned first"))
    code, err = _cli(capsys, *PLAN, "--plot", str(tmp_path))
    assert code == 2
    _one_line(err, f"--plot {str(tmp_path)!r} is a folder")


@pytest.fixture
def launched(monkeypatch):
    """Rank 0 of two launched ranks whose group is never joined: a command that gets as far as
    measuring fails the test (exit 1, not the refusal's 2)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)

    def joined(*args, **kwargs):
        raise AssertionError("joined the group")
    monkeypatch.setattr(cli_calibrate, "init_from_env", joined)


@pytest.mark.parametrize("seconds", ["0", "1e-300", "0.001", "nan", "604801"])
def test_calibrate_refuses_a_timeout_out_of_range(capsys, launched, seconds):
    code, err = _cli(capsys, "calibrate", "--topology", "node=1,gpu=2", "--timeout-s", seconds)
    assert code == 2
    _one_line(err, "--timeout-s must be a number of seconds in [1, 604800]", f"got {float(seconds)}")


def test_calibrate_refuses_an_out_in_a_missing_folder_before_measuring(capsys, launched, tmp_path):
    out = tmp_path / "missing" / "dir" / "x.yaml"
    code, err = _cli(capsys, "calibrate", "--topology", "node=1,gpu=2", "--out", str(out))
    assert code == 2
    _one_line(err, f"--out {str(out)!r}: the folder {str(out.parent)!r} does not exist")


def _linked(tmp_path, name: str):
    """``name`` in tmp_path planted as a symlink to a file outside, whose bytes must survive."""
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    link = tmp_path / name
    link.symlink_to(outside)
    return link, outside


def _replaced(link, outside) -> None:
    assert outside.read_text() == "keep me", "written through the link"
    assert not link.is_symlink() and link.is_file()


def test_place_replaces_a_link_at_out_instead_of_writing_through_it(capsys, trained, tmp_path):
    link, outside = _linked(tmp_path, "placement.yaml")
    code, _ = _cli(capsys, "place", "--topology", "node=2,gpu=2", "--stats", str(trained), "--out", str(link))
    assert code == 0
    _replaced(link, outside)
    assert "expert_to_rank" in link.read_text()


def test_plan_writes_its_plot_where_told_and_never_through_a_link(capsys, tmp_path):
    from dist_moe.cli import main

    link, outside = _linked(tmp_path, "plan.png")
    assert _cli(capsys, *PLAN, "--plot", str(link))[0] == 0
    _replaced(link, outside)
    bare = tmp_path / "x"  # the name as given, not x.png beside it
    assert main([*PLAN, "--plot", str(bare)]) == 0
    assert f"plot: {bare}" in capsys.readouterr().out
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "x.png").exists()


def test_calibrate_replaces_a_link_at_out_instead_of_writing_through_it(capsys, tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli_calibrate, "init_from_env", lambda *a, **k: (0, 2, None))
    monkeypatch.setattr(cli_calibrate, "shutdown", lambda: None)
    from placement.calibrate import Spread

    monkeypatch.setattr(cli_calibrate, "calibration", lambda topo, repeats: SimpleNamespace(
        cost=SimpleNamespace(latency_s=1e-5, overlap=0.5, chunked=1.0, levels={}),
        latency=Spread(1e-5, 1e-5, 1e-5, 40)))
    monkeypatch.setattr(cli_calibrate, "to_yaml", lambda topo, cost: {"levels": ["node", "gpu"]})
    link, outside = _linked(tmp_path, "calibrated.yaml")
    assert _cli(capsys, "calibrate", "--topology", "node=1,gpu=2", "--out", str(link))[0] == 0
    _replaced(link, outside)
