"""bench/run.sh's multi-GPU and multi-node front as commands (MKERNEL_DRY_RUN=1 prints them instead
of running them; a dry run pretends GPUS_PER_NODE GPUs): node i >= 1 started over ssh with its
node rank and the forwarded MKERNEL_* / NCCL_* variables, node 0 here, results named
-w<world>-n<nodes>; virtual nodes on one machine; the expert- and sequence-parallel kernels on
several GPUs through bench/bench_dist.py; and the refusals (a missing NODE<i>_IP, a kernel that
runs on one node only, ranks that do not split). Needs bash only (no GPU, no torch)."""

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
    # Four ranks on two GPUs: the fused GEMMs (ranks may share GPUs in check mode); the MoE and
    # ring kernels, which need one GPU a rank across GPUs, are skipped with a note.
    r = front("all", "check", "2", "512x512x512", MKERNEL_VIRTUAL_NODES="1", MKERNEL_RANKS="4")
    assert r.returncode == 0, r.stderr
    runs = commands(r.stdout)
    assert [c[c.index("--kernel") + 1] for c in runs] == ["ag_gemm", "gemm_rs", "gemm_ar"]
    for c in runs:
        assert c[:2] == ["env", "MKERNEL_GPUS_PER_NODE=2"]
        assert c[c.index("--nproc-per-node") + 1] == "4"
        assert c[c.index("--shapes") + 1] == "512x512x512"
    assert "ring_attention skipped: one GPU a rank" in r.stderr
    # Two ranks on two GPUs: all six, the MoE and ring kernels through bench_dist.py on their own
    # points (the sizes are the GEMMs').
    r = front("all", "check", "2", "512x512x512", MKERNEL_VIRTUAL_NODES="1", MKERNEL_RANKS="2")
    assert r.returncode == 0, r.stderr
    runs = commands(r.stdout)
    kernels = ["ag_gemm", "gemm_rs", "gemm_ar", "moe_dispatch_gemm", "moe_layer", "ring_attention"]
    assert [c[c.index("--kernel") + 1] for c in runs] == kernels
    for c, kernel in zip(runs, kernels):
        script = "bench/bench_fused.py" if kernel in kernels[:3] else "bench/bench_dist.py"
        assert c[c.index("--kernel") - 1] == script, c
        assert ("--shapes" in c) == (kernel in kernels[:3]) and "--points" not in c, c


def test_expert_and_sequence_parallel_kernels_across_gpus():
    for kernel, sizes, flag in (("moe_dispatch_gemm", "qwen3_235b:4096", "--points"),
                                ("moe_layer", "", None),
                                ("ring_attention", "1:32:8:4096:128:1", "--points")):
        r = front(kernel, "bench", "1", *([sizes] if sizes else []))
        assert r.returncode == 0, r.stderr
        (c,) = commands(r.stdout)
        assert c[:3] == ["python3", "-m", "torch.distributed.run"], c
        assert c[c.index("--nproc-per-node") + 1] == "2"
        assert c[c.index("--kernel") - 1] == "bench/bench_dist.py"
        assert c[c.index("--kernel") + 1] == kernel
        assert c[c.index("--json") + 1] == f"bench/results/{kernel}-h200-w2.json"
        if flag:
            assert c[c.index(flag) + 1] == sizes
    r = front("moe_layer", "bench", "2", "deepseek_v3:8192", NODE0_IP="10.0.0.1",
              NODE1_IP="10.0.0.2")
    assert r.returncode == 0, r.stderr
    ssh, local = commands(r.stdout)
    node0 = shlex.split(local[2])
    assert "bench/bench_dist.py" in node0
    assert node0[node0.index("--points") + 1] == "deepseek_v3:8192"
    assert node0[node0.index("--json") + 1] == "bench/results/moe_layer-h200-w4-n2.json"
    r = front("ring_attention", "bench", "1", MKERNEL_RANKS="3")
    assert r.returncode == 2 and "3 ranks on 2 GPUs" in r.stderr
    r = front("moe_layer", "bench", "1", MKERNEL_RANKS="x")
    assert r.returncode == 2 and "MKERNEL_RANKS 'x' is not a positive number" in r.stderr


def test_refusals_name_the_problem():
    r = front("gemm_rs", "check", "3", NODE0_IP="10.0.0.1", NODE1_IP="10.0.0.2")
    assert r.returncode == 2 and "NODE2_IP is not set" in r.stderr
    r = front("collectives", "check", "2", NODE0_IP="a", NODE1_IP="b")
    assert r.returncode == 2 and "collectives runs on one node only" in r.stderr
    r = front("gemm_ar", "check", "2", MKERNEL_VIRTUAL_NODES="1", MKERNEL_RANKS="3")
    assert r.returncode == 2 and "3 ranks do not split into 2 virtual nodes" in r.stderr
    r = front("ag_gemm", "check", "two")
    assert r.returncode == 2 and "not a positive number" in r.stderr
    r = front("attention", "check", "2", NODE0_IP="a", NODE1_IP="b")
    assert r.returncode == 2 and "attention runs on one node only" in r.stderr
