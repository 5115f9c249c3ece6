"""scripts/sanitize_repeat.sh with a stand-in compute-sanitizer (no GPU): every tool runs the
asked number of times; a run past HANG_S is reported HUNG, killed, and its log gets the host
threads' stacks; a failing run is FAIL; either makes the script exit 1."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Run i of the stand-in hangs if $dir/hang-<i> exists, fails if $dir/fail-<i> does, else passes.
FAKE = """#!/usr/bin/env bash
n=$(( $(cat "{dir}/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "{dir}/count"
echo "$@" >> "{dir}/calls"
echo "[ RUN      ] Fake.Case$n"
[[ -e "{dir}/hang-$n" ]] && exec sleep 60
# A hang two levels down, as compute-sanitizer's launcher holds the tests.
[[ -e "{dir}/deep-$n" ]] && {{ bash "{dir}/level1.sh" & wait; }}
[[ -e "{dir}/fail-$n" ]] && exit 99
echo "[  PASSED  ] 1 test."
"""


def run(tmp_path, runs, tools, hang=(), fail=(), deep=()):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "compute-sanitizer"
    fake.write_text(FAKE.format(dir=tmp_path))
    fake.chmod(0o755)
    for i in hang:
        (tmp_path / f"hang-{i}").touch()
    for i in fail:
        (tmp_path / f"fail-{i}").touch()
    for i in deep:
        (tmp_path / f"deep-{i}").touch()
    (tmp_path / "level1.sh").write_text(f'bash "{tmp_path}/level2.sh"; true\n')
    (tmp_path / "level2.sh").write_text("exec sleep 61\n")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", HANG_S="2", OUT=str(out))
    p = subprocess.run(["bash", str(REPO / "scripts/sanitize_repeat.sh"), "/bin/true", "Sanitize*",
                        str(runs), tools], env=env, capture_output=True, text=True, timeout=60)
    return p, out


def test_every_run_passes(tmp_path):
    p, out = run(tmp_path, 2, "racecheck memcheck")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == [line for line in p.stdout.splitlines() if "PASS" in line]
    assert len(p.stdout.splitlines()) == 4
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[1] for c in calls] == ["racecheck", "racecheck", "memcheck", "memcheck"]
    assert all("--gtest_filter=Sanitize*" in c for c in calls)
    assert sorted(f.name for f in out.iterdir()) == [
        "sanitize-memcheck-1.log", "sanitize-memcheck-2.log",
        "sanitize-racecheck-1.log", "sanitize-racecheck-2.log"]


def test_a_hung_run_is_named_with_its_stacks_and_the_next_runs_go_on(tmp_path):
    p, out = run(tmp_path, 3, "racecheck", hang=(2,))
    assert p.returncode == 1
    lines = p.stdout.splitlines()
    assert lines[0].startswith("racecheck #1: PASS")
    assert lines[1] == "racecheck #2: HUNG (last test: Fake.Case2)"
    assert lines[2].startswith("racecheck #3: PASS")
    log = (out / "sanitize-racecheck-2.log").read_text()
    assert "[ RUN      ] Fake.Case2" in log
    assert "still running after 2 s; the GPU:" in log and "==== host stacks:" in log
    assert "---- process" in log


def test_a_failing_run_fails_the_script(tmp_path):
    p, _ = run(tmp_path, 2, "synccheck", fail=(1,))
    assert p.returncode == 1
    assert p.stdout.splitlines()[0].startswith("synccheck #1: FAIL (rc 99")
    assert p.stdout.splitlines()[1].startswith("synccheck #2: PASS")


def test_the_stacks_reach_the_processes_below_the_children(tmp_path):
    p, out = run(tmp_path, 1, "racecheck", deep=(1,))
    assert p.returncode == 1
    assert p.stdout.splitlines()[0] == "racecheck #1: HUNG (last test: Fake.Case1)"
    log = (out / "sanitize-racecheck-1.log").read_text()
    assert "sleep 61" in log  # level2.sh exec-ed, two levels below the stand-in
    left = subprocess.run(["pgrep", "-f", "sleep 61"], capture_output=True, text=True).stdout
    assert left == "", "a hung run's processes outlive it"
