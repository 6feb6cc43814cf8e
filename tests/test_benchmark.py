"""tests/benchmark.py --gpu-check at its tiny size, on the CPU: the command a GPU machine runs measures
the machine's bound for Breakout and trains each Sebulba script, and writes all of it in one JSON."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


def test_the_gpu_check_at_tiny_size_writes_the_bound_and_one_run_of_each_script(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "tests/benchmark.py", "--gpu-check", "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    bound = data["bound"]
    assert data["tiny"] and bound["sps"] == max(bound["all"].values()) > 0
    assert {name.split()[0] for name in bound["all"]} == {"sync", "async"}
    assert [run["script"] for run in data["runs"]] == ["sebulba_impala.py", "sebulba_ppo_atari.py"]
    for run in data["runs"]:
        assert run["batch"] == 4 * 2 * 2  # --num-steps 4 x --local-num-envs 2 x the default 2 threads
        assert run["train_sps"] > 0 and run["raw_sps"] > 0
        assert run["machine_ratio"] == pytest.approx(run["train_sps"] / bound["sps"])
    assert f"wrote {out}" in proc.stdout
