"""A rank of ``test_hf_inputs.test_every_rank_ends_as_the_main_ranks_export_did``, apart from the test
module so that a spawned rank imports no more than the export needs."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_moe.errors import _line
from dist_moe.models import hf_export, hf_model


class Failing:
    """An HFCausalLM's export, less the model: the main rank's write fails as ``case`` says."""

    def __init__(self, case: str):
        self.case = case

    def export_state(self, is_main: bool):
        return {} if is_main else None

    def write(self, state, target: Path) -> None:
        from safetensors import SafetensorError

        if self.case == "full":  # as safetensors reports it
            with hf_export.os_errors_of_safetensors(target):
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        if self.case == "denied":
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
        raise ValueError(f"not writing the trained model to {target}: 'x' holds NaN or Inf (nothing was written)")


def export_on_two_ranks(rank: int, world: int, case: str, on_main: tuple[str, int], on_other: tuple[str, int]):
    """Rank 0 writes and fails; each rank's error is the (line, exit code) ``errors.report`` gives it."""
    with pytest.raises((OSError, ValueError)) as failed:
        hf_model.HFCausalLM.export(Failing(case), Path("/run/hf_model"), rank == 0, dist.group.WORLD)
    assert _line(failed.value) == (on_main if rank == 0 else on_other), (rank, _line(failed.value))
