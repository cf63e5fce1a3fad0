"""Several nodes on loopback: two `torchrun --nnodes 2 --node_rank i` invocations (2 simulated nodes x 2 ranks),
and launch/torchrun.sh's node options (what it passes torchrun, and two invocations training one run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dist_utils import free_port

SCRIPT = Path(__file__).parents[1] / "support" / "scripts" / "ep_torchrun.py"


def test_two_torchrun_nodes_detect_topology_and_match_single_process():
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DIST_MOE_TOPOLOGY", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, str(SCRIPT),
             "branch", "switch_node_limited", "specdrop"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for i in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert "OK node=2,gpu=2" in outs[0]


ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"


def _recording_environment(tmp_path) -> dict:
    """An active environment whose python records a `-m torch.distributed.run` call's arguments (and starts
    nothing) and runs everything else (the scripts' supervise.py) as this interpreter."""
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then\n'
        '  shift 2; printf "%s\\n" "$@" >"$ARGV_OUT"; exit 0\n'
        'fi\n'
        f'exec "{sys.executable}" "$@"\n')
    (bin_dir / "dist-moe").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("CONDA_PREFIX", "WORLD_SIZE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "VIRTUAL_ENV": str(tmp_path / "env"), "ARGV_OUT": str(tmp_path / "argv"), "TMPDIR": str(tmp_path)}


NODE_CASES = [  # (torchrun.sh arguments, environment) -> torchrun's node arguments
    ([], {}, ["--standalone", "--nproc-per-node", "2", "--master-port", "29500"]),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--port", "29511"], {},
     ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--nproc-per-node", "2", "--master-port",
      "29511"]),
    # a scheduler's job script exported them
    ([], {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node-a.cluster", "MASTER_PORT": "29600"},
     ["--nnodes", "4", "--node-rank", "3", "--master-addr", "node-a.cluster", "--nproc-per-node", "2",
      "--master-port", "29600"]),
    # an option wins over the variable
    (["--node-rank", "1", "--nproc", "8"], {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "[fd00::1]"},
     ["--nnodes", "2", "--node-rank", "1", "--master-addr", "[fd00::1]", "--nproc-per-node", "8", "--master-port",
      "29500"]),
    # one node: MASTER_ADDR is not needed, torchrun's standalone rendezvous picks its own
    ([], {"MASTER_ADDR": "node-a", "NODE_RANK": "0"}, ["--standalone", "--nproc-per-node", "2", "--master-port",
                                                        "29500"]),
]


@pytest.mark.parametrize("args, environ, expected", NODE_CASES, ids=[str(i) for i in range(len(NODE_CASES))])
def test_torchrun_sh_passes_the_nodes_to_torchrun(tmp_path, args, environ, expected):
    """Several nodes: torchrun's --nnodes --node-rank --master-addr --master-port in place of --standalone
    (before: one node only, --standalone always)."""
    env = {**_recording_environment(tmp_path), **environ}
    proc = subprocess.run([str(TORCHRUN_SH), *args, "--config", "configs/x.yaml", "a.b=1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:len(expected)] == expected
    assert argv[len(expected):len(expected) + 2] == ["--log-dir", argv[len(expected) + 1]]
    assert argv[len(expected) + 2:] == [str(ROOT / "launch/rank.py"), str(tmp_path / "env/bin/dist-moe"), "train",
                                        "--config", "configs/x.yaml", "a.b=1"]


def test_torchrun_sh_on_two_nodes_trains_one_run_of_two_ranks(tmp_path):
    """Two invocations, one per "node" on this host (--nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1), one
    process each: both finish, and the run they trained has 2 ranks on 2 nodes."""
    out = tmp_path / "run"
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX", "WORLD_SIZE", "DIST_MOE_TOPOLOGY")}
    env.update(OMP_NUM_THREADS="1", VIRTUAL_ENV=sys.prefix, DIST_MOE_DATA=str(tmp_path / "data"),
               TMPDIR=str(tmp_path))
    procs = [subprocess.Popen([str(TORCHRUN_SH), "--nproc", "1", "--nnodes", "2", "--node-rank", str(i),
                               "--master-addr", "127.0.0.1", "--port", port, "--quiet", "data.max_rows=300",
                               "train.max_steps=2", "train.checkpoint_every=1", f"output.dir={out}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o + e for o, e in outs)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["topology"] == "node=2,gpu=1"
    # each node's script shows its own rank
    assert [line for line in outs[0][0].splitlines() if line.startswith("rank ")][0].startswith("rank 0/2: ")
    assert [line for line in outs[1][0].splitlines() if line.startswith("rank ")][0].startswith("rank 1/2: ")
