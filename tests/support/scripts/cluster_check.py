"""Run under launch/emulate_cluster.sh: the ranks form one gloo world with the launcher's topology."""
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from placement import Topology  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    topo = Topology.from_env()
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    world = dist.get_world_size()
    assert float(t) == world * (world - 1) / 2
    if dist.get_rank() == 0:
        print(f"CLUSTER OK {topo.describe()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
