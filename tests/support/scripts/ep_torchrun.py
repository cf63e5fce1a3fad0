"""Run by torchrun (one invocation per simulated node): EP equivalence on the launcher's topology."""
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from placement import Topology  # noqa: E402
from tests.support.ep_checks import run_all  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    topology = Topology.from_env()  # WORLD_SIZE / LOCAL_WORLD_SIZE from torchrun
    n = run_all(topology, routers=sys.argv[1:] or None)
    if dist.get_rank() == 0:
        print(f"OK {topology.describe()} {n} configurations", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
