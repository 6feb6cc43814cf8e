"""The plumbing all four scripts share (one section, the same text in each) and the faults and
hostile input it must survive: stop signals, a dead peer, unreadable checkpoints, unusable run
folders, bad distributed flags, nonsense floats and seeds, impossible env counts. Every case
runs the real scripts, mostly as subprocesses."""

import dataclasses
import difflib
import math
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, _env, catches, command, error_line, load, run, spawn, spawn_two_hosts

SCRIPTS = ["anakin_catch.py", "anakin_ppo.py", "sebulba_impala.py", "sebulba_ppo_atari.py"]
# The smallest real run of each script, and the steps of one of its updates.
QUICK = {
    "anakin_catch.py": (["--num-envs-per-device", 8], 16 * 8),
    "anakin_ppo.py": ([], 128 * 4),
    "sebulba_impala.py": (["--env-id", "CartPole-v1", "--local-num-envs", 4, "--num-actor-threads", 1], 16 * 4),
    "sebulba_ppo_atari.py": (["--local-num-envs", 4, "--num-actor-threads", 1, "--num-steps", 16], 16 * 4),
}
# Seeds from this value on are refused: JAX keys keep 32 bits; envpool seeds env i with seed + i < 2**31.
SEED_LIMIT = {"anakin_catch.py": 2**32, "anakin_ppo.py": 2**32,
              "sebulba_impala.py": 2**31 - 4 + 1, "sebulba_ppo_atari.py": 2**31 - 4 + 1}


def section(script):
    text = (ROOT / script).read_text()
    start = text.index("\n# ---- Plumbing") + 1
    return text[start:text.index("\n# ----", start) + 1]


def test_the_plumbing_section_is_the_same_text_in_all_four_scripts():
    first = section(SCRIPTS[0])
    for name in ("def fail(", "def check_flags(", "def open_run(", "def catch_stop_signals(", "def save(",
                 "def load(", "def log(", "def checksum("):
        assert name in first
    for script in SCRIPTS[1:]:
        diff = "\n".join(difflib.unified_diff(first.splitlines(), section(script).splitlines(),
                                              SCRIPTS[0], script, lineterm=""))
        assert not diff, diff


def quick(script, *flags, budget=10**9):
    args, _ = QUICK[script]
    return [*args, "--total-timesteps", budget, *flags]


# ---- Stop signals -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped_early(tmp_path_factory):
    """Each script sent SIGTERM the moment its handler is installed, before anything is
    compiled: (exit status, output, checkpoint path). Shared by the tests that need a checkpoint."""
    cache = {}

    def get(script):
        if script not in cache:
            folder = tmp_path_factory.mktemp(Path(script).stem)
            proc = spawn(script, [*quick(script), "--run-dir", folder / "runs"], folder)
            try:
                deadline = time.monotonic() + 60
                while not catches(proc, signal.SIGTERM) and time.monotonic() < deadline:
                    time.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                output = proc.communicate(timeout=300)[0]
            finally:
                proc.kill()
            cache[script] = (proc.returncode, output, next((folder / "runs").glob("*/checkpoint.npz"), None))
        return cache[script]

    return get


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_in_the_first_seconds_writes_a_checkpoint_that_resumes(tmp_path, stopped_early, script):
    returncode, output, ckpt = stopped_early(script)
    assert returncode == 143 and "Traceback" not in output, output[-3000:]
    assert "stopped by SIGTERM after update 0" in output, output[-3000:]
    with np.load(ckpt, allow_pickle=False) as f:
        assert int(f["update"]) == 0
    _, per_update = QUICK[script]
    resumed = run(script, [*quick(script, budget=2 * per_update), "--resume", ckpt, "--log-every", 1], tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [row["update"] for row in resumed.metrics] == [1, 2]


@pytest.mark.parametrize("script", SCRIPTS)
def test_resuming_a_run_that_is_already_at_its_budget_is_refused(tmp_path, stopped_early, script):
    _, _, ckpt = stopped_early(script)
    with np.load(ckpt, allow_pickle=False) as f:
        arrays = dict(f)
    arrays["update"] = np.int64(10**9)  # what a checkpoint at the end of a long run says
    np.savez(tmp_path / "done.npz", **arrays)
    line = error_line(run(script, [*quick(script, budget=10 * QUICK[script][1]), "--resume", tmp_path / "done.npz"],
                          tmp_path))
    assert "raise --total-timesteps" in line


@pytest.mark.parametrize("kind", ["empty", "random bytes", "truncated"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unreadable_checkpoint_is_one_error_line(tmp_path, stopped_early, script, kind):
    _, _, ckpt = stopped_early(script)
    data = {"empty": b"", "random bytes": np.random.default_rng(0).bytes(4096),
            "truncated": ckpt.read_bytes()[:len(ckpt.read_bytes()) // 2]}[kind]
    (tmp_path / "bad.npz").write_bytes(data)
    line = error_line(run(script, [*quick(script), "--resume", tmp_path / "bad.npz"], tmp_path))
    assert "is not a readable checkpoint" in line


# ---- A dead peer --------------------------------------------------------------------------

def test_a_dead_peer_ends_the_survivor_within_two_minutes_leaving_a_checkpoint_to_resume(tmp_path):
    script, args = "anakin_catch.py", ["--num-envs-per-device", 32, "--log-every", 5, "--checkpoint-every", 10]
    procs, roots = spawn_two_hosts(script, [*args, "--total-timesteps", 10**9], tmp_path / "pair", devices=2)
    try:
        deadline = time.monotonic() + 300
        while not list(roots[0].glob("*/checkpoint.npz")) and time.monotonic() < deadline:
            time.sleep(0.5)
        procs[1].kill()  # SIGKILL: no goodbye
        killed = time.monotonic()
        output = procs[0].communicate(timeout=180)[0]
        waited = time.monotonic() - killed
    finally:
        for proc in procs:
            proc.kill()
    readable = "\n".join(line for line in output.splitlines() if not line.lstrip().startswith("@"))  # no C++ stack
    assert waited < 120 and procs[0].returncode == 1, (waited, readable[-3000:])
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    # A collective with the dead peer fails at once (lost_peer) or blocks (watch_peers: 60 s).
    assert len(errors) == 1 and "another process" in errors[0], output[-3000:]
    assert "Traceback" not in output
    ckpt = next(roots[0].glob("*/checkpoint.npz"))
    assert str(ckpt) in errors[0]
    with np.load(ckpt, allow_pickle=False) as f:
        update = int(f["update"])
        assert update >= 10 and f["state/lanes/key"].shape == (128, 2)  # both hosts' lanes
    # The same 4 devices' worth of lanes on one process carry on from it.
    budget = (update + 5) * 16 * 128
    resumed = run(script, [*args, "--total-timesteps", budget, "--resume", ckpt], tmp_path / "resumed", devices=4)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.metrics[0]["update"] == update + 5


# ---- Unusable places and flags ------------------------------------------------------------

@pytest.mark.parametrize("where", ["parent is a file", "not writable"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unusable_run_dir_is_one_error_line_before_compiling(tmp_path, script, where):
    (tmp_path / "file").write_text("")
    # /proc takes no new folders, even from root (who may write anywhere else)
    run_dir = tmp_path / "file" / "runs" if where == "parent is a file" else Path("/proc/podracer-runs")
    result = run(script, [*quick(script), "--run-dir", run_dir], tmp_path, run_dir=False)
    assert "--run-dir" in error_line(result) and "compiled" not in result.output


@pytest.mark.parametrize("flags,words", [
    (["--distributed", "--coordinator-address", "127.0.0.1:1", "--num-processes", 2, "--process-id", 2],
     "--process-id 2 must be in 0..1"),
    (["--distributed"], "--distributed: coordinator_address should be defined"),
    (["--process-id", 1, "--num-processes", 2], "add --distributed"),
], ids=["process-id-out-of-range", "no-coordinator", "without-distributed"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_distributed_flags_are_one_error_line(tmp_path, script, flags, words):
    assert words in error_line(run(script, [*quick(script), *flags], tmp_path, timeout=120))


def float_fields(module):
    return [f.name for f in dataclasses.fields(module.Args) if f.type in (float, float | None, "float", "float | None")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_float_flag_is_checked_up_front(script, capsys):
    module = load(script)
    args = module.Args()
    names = float_fields(module)
    assert names, "no float flags found"
    for name in names:
        for value in (math.nan, math.inf, -1.0) + ((1.5,) if name in ("gamma", "gae_lambda", "q_lambda",
                                                                     "vtrace_lambda", "epsilon") else ()):
            with pytest.raises(SystemExit) as exit_info:
                module.check_args(dataclasses.replace(args, **{name: value}))
            assert exit_info.value.code == 2
            line = capsys.readouterr().err.strip()
            assert line.startswith(f"error: --{name.replace('_', '-')} "), (name, value, line)


@pytest.mark.parametrize("script", ["sebulba_impala.py", "sebulba_ppo_atari.py"])
def test_env_counts_whose_rollouts_cannot_fit_in_memory_are_refused(tmp_path, script):
    line = error_line(run(script, [*quick(script), "--local-num-envs", 100_000_000], tmp_path, timeout=120))
    assert "--local-num-envs 100000000" in line and "GiB" in line


@pytest.mark.parametrize("script", SCRIPTS)
def test_seeds_outside_the_one_to_one_range_are_refused(tmp_path, script):
    limit = SEED_LIMIT[script]
    for seed in (-1, limit):
        line = error_line(run(script, [*quick(script), "--seed", seed], tmp_path / str(seed), timeout=120))
        assert f"--seed {seed} must be in 0..{limit - 1:,}" in line


def test_jax_keys_are_one_to_one_on_32_bit_seeds_and_wrap_beyond():
    import jax
    keys = {tuple(np.asarray(jax.random.key_data(jax.random.PRNGKey(s)))) for s in (0, 1, 2**31, 2**32 - 1)}
    assert len(keys) == 4  # distinct below the limit; at and above it JAX wraps around
    assert np.array_equal(jax.random.PRNGKey(2**32 - 1), jax.random.PRNGKey(-1))


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_parser_error_exits_2_and_errors_go_to_stderr(tmp_path, script):
    proc = subprocess.run(command(script, ["--no-such-flag"]), cwd=tmp_path, env=_env(1, None), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2 and "no-such-flag" in proc.stderr
    proc = subprocess.run(command(script, [*quick(script), "--seed", -1]), cwd=tmp_path, env=_env(1, None),
                          text=True, capture_output=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --seed -1") and "error" not in proc.stdout


def test_non_finite_loss_before_any_checkpoint_says_none_was_written(tmp_path):
    # Adam's first step moves every weight by ~1e30; update 2's loss overflows.
    result = run("anakin_catch.py", ["--learning-rate", 1e30, "--log-every", 1, "--checkpoint-every", 100,
                                     "--total-timesteps", 10**8], tmp_path)
    assert result.returncode == 1, result.output[-3000:]
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "non-finite loss at update 2" in line and "no checkpoint was written yet" in line
    assert not (result.run_dir / "checkpoint.npz").exists()


def test_a_run_never_writes_into_a_folder_it_did_not_create(tmp_path, monkeypatch):
    catch = load("anakin_catch.py")
    monkeypatch.setattr(catch.time, "time", lambda: 1_700_000_000.0)  # every run starts in the same second
    args = catch.Args(run_dir=str(tmp_path))
    taken = tmp_path / "Catch__anakin_catch__1__1700000000"
    taken.mkdir()
    (taken / "checkpoint.npz").write_text("someone else's")
    runs = [catch.open_run(args) for _ in range(2)]
    assert [r.folder.name for r in runs] == [f"{taken.name}_1", f"{taken.name}_2"]
    assert all((r.folder / "args.json").is_file() for r in runs)
    assert (taken / "checkpoint.npz").read_text() == "someone else's" and len(list(taken.iterdir())) == 1
    for r in runs:
        r.writer.close()
