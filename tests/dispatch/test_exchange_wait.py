"""``exchange_wait_s``: the time waited in exchanges. On the CPU the host's blocked time; on CUDA the
current stream's, from CUDA event pairs read once when the total is asked for, never synchronising
per exchange. The CUDA bookkeeping runs here with stand-in events on a stream clock of the test's."""
import time

import torch

from dist_moe.dispatch import all_to_all
from dist_moe.dispatch.all_to_all import Pending, WaitClock
from tests.support.dist_utils import run_workers

CUDA = torch.device("cuda")


class FakeEvent:
    """``torch.cuda.Event`` on a stream whose time the test moves (``now``): ``elapsed_time`` refuses an
    event that has not run yet, as CUDA does; ``synchronize`` and ``query`` are counted."""

    now = [0.0]
    synchronized = [0]
    queried = [0]
    ran = [False]  # whether every recorded event has run on the stream (what query reports)

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at, self.done = None, False

    def record(self, stream=None):
        self.at = FakeEvent.now[0]

    def query(self):
        FakeEvent.queried[0] += 1
        return FakeEvent.ran[0]

    def synchronize(self):
        FakeEvent.synchronized[0] += 1
        self.done = True

    def elapsed_time(self, end):
        if not (FakeEvent.ran[0] or end.done):
            raise RuntimeError("CUDA event has not completed")
        return (end.at - self.at) * 1e3


class FakeWork:
    def __init__(self, stream_s: float, host_s: float):
        self.stream_s, self.host_s = stream_s, host_s

    def wait(self):  # the stream waits stream_s for the collective; the host returns after host_s
        FakeEvent.now[0] += self.stream_s
        time.sleep(self.host_s)


class CudaOut:
    device = CUDA


def _fake_cuda(monkeypatch) -> WaitClock:
    FakeEvent.now[0], FakeEvent.synchronized[0], FakeEvent.queried[0], FakeEvent.ran[0] = 0.0, 0, 0, False
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = WaitClock()
    monkeypatch.setattr(all_to_all, "WAITS", clock)
    return clock


def test_cuda_waits_are_timed_on_the_stream_and_read_once_per_total(monkeypatch):
    clock = _fake_cuda(monkeypatch)
    for stream_s in (0.25, 0.5, 0.125):
        FakeEvent.now[0] += 1.0  # compute queued before the exchange: not counted
        Pending(CudaOut(), FakeWork(stream_s, host_s=0.02), None).wait()
    assert FakeEvent.synchronized[0] == 0 and FakeEvent.queried[0] == 0  # nothing read per exchange
    assert len(clock.pending) == 3
    assert all_to_all.blocked_seconds() == 0.875  # the stream's time, not the host's 0.06 s
    assert FakeEvent.synchronized[0] == 3 and not clock.pending
    assert all_to_all.blocked_seconds() == 0.875 and FakeEvent.synchronized[0] == 3  # read once


def test_pending_event_pairs_stay_bounded_without_waiting(monkeypatch):
    clock = _fake_cuda(monkeypatch)
    monkeypatch.setattr(WaitClock, "FOLD_AT", 4)
    for _ in range(3):
        with clock.timing(CUDA):
            FakeEvent.now[0] += 0.5
    assert len(clock.pending) == 3 and FakeEvent.queried[0] == 0
    FakeEvent.ran[0] = True  # the stream has run them: the fourth pair folds all four in, by query
    with clock.timing(CUDA):
        FakeEvent.now[0] += 0.5
    assert not clock.pending and clock.seconds == 2.0 and FakeEvent.synchronized[0] == 0


def test_a_cpu_wait_is_the_hosts_blocked_time(monkeypatch):
    clock = WaitClock()
    with clock.timing(torch.device("cpu")):
        time.sleep(0.05)
    assert 0.05 <= clock.total() < 1.0 and not clock.pending


def _late_peer(rank, world, out):
    import torch.distributed as dist

    from dist_moe.dispatch.all_to_all import blocked_seconds, start_a2a

    if rank == 1:
        time.sleep(0.5)  # rank 0 waits for it in the exchange
    before = blocked_seconds()
    start_a2a(torch.ones(2, 3), [1, 1], [1, 1], dist.group.WORLD).wait()
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(str(blocked_seconds() - before))


def test_a_gloo_exchange_counts_the_wait_for_a_late_peer(tmp_path):
    run_workers(_late_peer, 2, args=(str(tmp_path),), timeout=60)
    waited = [float((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)]
    assert waited[0] > 0.3 and waited[1] < waited[0], waited


def test_the_trainer_waits_for_the_timing_events_only_outside_its_steps(tmp_path, monkeypatch):
    """On CUDA a settled read waits for the last exchange's timing events: the trainer asks for one at
    its start, around each evaluation and at the end, never in a step; a log step reads unsettled."""
    from dist_moe.train import trainer
    from dist_moe.train.config import load_config
    from dist_moe.train.metrics import log

    calls = []
    real = log.blocked_seconds

    def counted(settled=True):
        calls.append(settled)
        return real(settled)

    monkeypatch.setattr(log, "blocked_seconds", counted)
    summary = trainer.train(load_config(None, ["data.max_rows=600", "train.max_steps=6", "train.log_every=2",
                                               f"output.dir={tmp_path}"]), quiet=True)
    assert summary["steps"] == 6
    evaluations = 3  # batch 256 of 480 training rows: the epochs end at steps 2, 4 and 6
    assert calls.count(False) == 3, calls  # the log steps 2, 4, 6
    assert calls.count(True) == 1 + 2 * evaluations + 1, calls
