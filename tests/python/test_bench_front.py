"""bench/run.sh's multi-node front as commands (MKERNEL_DRY_RUN=1 prints them instead of running
them): node i >= 1 started over ssh with its node rank and the forwarded MKERNEL_* / NCCL_*
variables, node 0 here, results named -w<world>-n<nodes>; virtual nodes on one machine; and
the refusals (a missing NODE<i>_IP, a kernel that runs on one node only, ranks that do not split).
Needs bash only (no GPU, no torch)."""

import os
import shlex
import subprocess
from pathlib import Path

RUN = Path(__file__).resolve().parents[2] / "bench" / "run.sh"


def front(*args, **env):
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("MKERNEL_", "NODE", "GPUS_PER_NODE", "MASTER_PORT"))}
    full.update({"MKERNEL_DRY_RUN": "1", "GPUS_PER_NODE": "2"}, **env)
    return subprocess.run(["bash", str(RUN), *args], env=full, capture_output=True, text=True,
                          cwd=RUN.parents[1], timeout=60)


def commands(out):
    return [shlex.split(line) for line in out.splitlines() if not line.startswith("bench/run.sh")]


def test_two_nodes_start_torchrun_on_each():
    r = front("ag_gemm", "bench", "2", "4096x4096x4096", NODE0_IP="10.0.0.1",
              NODE1_IP="10.0.0.2", NODE1_SSH="me@gpu1", MKERNEL_SOCKET_IFNAME="eth0",
              MKERNEL_REMOTE_DIR="/srv/mk")
    assert r.returncode == 0, r.stderr
    ssh, local = commands(r.stdout)
    assert ssh[:4] == ["ssh", "-o", "BatchMode=yes", "me@gpu1"]
    remote = shlex.split(ssh[4])
    assert remote[:3] == ["cd", "/srv/mk", "&&"]
    assert "MKERNEL_SOCKET_IFNAME=eth0" in remote and "NCCL_NVLS_ENABLE=0" in remote
    torchrun = remote[remote.index("python3"):]
    for flag, value in (("--nnodes", "2"), ("--node-rank", "1"), ("--nproc-per-node", "2"),
                        ("--master-addr", "10.0.0.1"), ("--kernel", "ag_gemm"),
                        ("--json", "bench/results/ag_gemm-h200-w4-n2.json")):
        assert torchrun[torchrun.index(flag) + 1] == value, (flag, torchrun)
    assert local[:2] == ["bash", "-c"]
    node0 = shlex.split(local[2])
    assert node0[node0.index("--node-rank") + 1] == "0"


def test_virtual_nodes_run_here():
    r = front("all", "check", "2", MKERNEL_VIRTUAL_NODES="1", MKERNEL_RANKS="4")
    assert r.returncode == 0, r.stderr
    runs = commands(r.stdout)
    assert [c[c.index("--kernel") + 1] for c in runs] == ["ag_gemm", "gemm_rs", "gemm_ar"]
    for c in runs:
        assert c[:2] == ["env", "MKERNEL_GPUS_PER_NODE=2"]
        assert c[c.index("--nproc-per-node") + 1] == "4"


def test_refusals_name_the_problem():
    r = front("gemm_rs", "check", "3", NODE0_IP="10.0.0.1", NODE1_IP="10.0.0.2")
    assert r.returncode == 2 and "NODE2_IP is not set" in r.stderr
    r = front("collectives", "check", "2", NODE0_IP="a", NODE1_IP="b")
    assert r.returncode == 2 and "collectives runs on one node only" in r.stderr
    r = front("gemm_ar", "check", "2", MKERNEL_VIRTUAL_NODES="1", MKERNEL_RANKS="3")
    assert r.returncode == 2 and "3 ranks do not split into 2 virtual nodes" in r.stderr
    r = front("ag_gemm", "check", "two")
    assert r.returncode == 2 and "not a positive number" in r.stderr
    r = front("moe_layer", "check", "2", NODE0_IP="a", NODE1_IP="b")
    assert r.returncode == 2 and "moe_layer runs on one node only" in r.stderr
