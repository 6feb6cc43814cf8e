"""The plumbing all four scripts share (one section, the same text in each) and the faults and
hostile input it must survive: stop signals, a dead peer, unreadable checkpoints, unusable run
folders, bad distributed flags, nonsense floats and seeds, impossible env counts. Every case
runs the real scripts, mostly as subprocesses."""

import dataclasses
import difflib
import json
import math
import os
import re
import shutil
import sys
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (ROOT, Result, _env, catches, command, error_line, free_port, host_flags, load, run,
                      run_two_hosts, spawn, spawn_two_hosts)

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
    return text[start:text.index('\nif __name__ == "__main__":', start) + 1]


def test_the_plumbing_section_is_the_same_text_in_all_four_scripts_after_main():
    first = section(SCRIPTS[0])
    for name in ("def fail(", "def check_flags(", "def open_run(", "def catch_stop_signals(", "def safe_point(",
                 "def save(", "def load(", "def log(", "def checksum("):
        assert name in first
    for script in SCRIPTS:  # an appendix: the script's own code, main last, comes before it
        text = (ROOT / script).read_text()
        assert text.index("\ndef main(") < text.index("\n# ---- Plumbing") < text.rindex("\nif __name__")
    for script in SCRIPTS[1:]:
        diff = "\n".join(difflib.unified_diff(first.splitlines(), section(script).splitlines(),
                                              SCRIPTS[0], script, lineterm=""))
        assert not diff, diff


def quick(script, *flags, budget=10**9):
    args, _ = QUICK[script]
    return [*args, "--total-timesteps", budget, *flags]


# ---- Stop signals -------------------------------------------------------------------------

def signal_once(proc, ready, signum):
    """Send `signum` to `proc` once `ready()` holds (at most a minute on); return its output when it has ended."""
    try:
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signum)
        return proc.communicate(timeout=300)[0]
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def stopped_early(tmp_path_factory):
    """Each script sent SIGTERM the moment its handler is installed, before anything is
    compiled: (exit status, output, checkpoint path). Shared by the tests that need a checkpoint."""
    cache = {}

    def get(script):
        if script not in cache:
            folder = tmp_path_factory.mktemp(Path(script).stem)
            proc = spawn(script, [*quick(script), "--run-dir", folder / "runs"], folder)
            output = signal_once(proc, lambda: catches(proc, signal.SIGTERM), signal.SIGTERM)
            cache[script] = (proc.returncode, output, next((folder / "runs").glob("*/checkpoint.npz"), None))
        return cache[script]

    return get


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_in_the_first_seconds_writes_a_checkpoint_that_resumes(tmp_path, stopped_early, script):
    returncode, output, ckpt = stopped_early(script)
    assert returncode == 143 and "Traceback" not in output, output[-3000:]
    assert "stopped by SIGTERM after update 0" in output, output[-3000:]
    assert output.count("SIGTERM: stopping after the update in flight, with a checkpoint; a second signal") == 1
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
    arrays["global_step"] = arrays["update"] * QUICK[script][1]
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


# The arrays of a small run's checkpoint, and what the error line says when one thing is wrong with them.
DAMAGED = {
    "an unknown array": ({"junk": np.zeros(4)},
                         "does not match this run: it holds arrays this run does not make (junk;"),
    "a negative update": ({"update": np.int64(-5), "global_step": np.int64(-5 * 16)}, "is damaged: it holds update -5"),
    "flags as garbled JSON": ({"args": "{seed: 1"}, "it records no flags as a JSON object"),
    "flags as a list": ({"args": "[1, 2]"}, "it records no flags as a JSON object"),
    "flags as a number": ({"args": "7"}, "it records no flags as a JSON object"),
    "a seed recorded as a string": ({"args": {"seed": "1"}}, 'comes from a run with --seed "1", not 1 ('),
    "the envs of two processes": ({"w": np.ones(6, np.float32), "args": {"distributed": True, "num_processes": 2}},
                                  "w is float32[6], expected float32[3] (its run had 2 processes, this one 1; hint)"),
}


@pytest.mark.parametrize("case", [*DAMAGED, "nothing"])
def test_a_damaged_checkpoint_is_one_error_line_and_its_unknown_arrays_stay_unread(tmp_path, monkeypatch, capsys,
                                                                                    case):
    catch = load("anakin_catch.py")
    args = catch.Args(resume=str(tmp_path / "c.npz"), total_timesteps=10**6)
    template = {"w": np.zeros(3, np.float32), "update": np.int64(0), "global_step": np.int64(0)}
    changes, words = DAMAGED.get(case, ({}, None))
    if isinstance(changes.get("args"), dict):  # these flags changed
        changes = {**changes, "args": json.dumps({**dataclasses.asdict(args), **changes["args"]})}
    np.savez(args.resume, **{"w": np.ones(3, np.float32), "update": np.int64(2), "global_step": np.int64(32),
                             "args": json.dumps(dataclasses.asdict(args)), **changes})
    read, real = [], np.lib.npyio.NpzFile.__getitem__
    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", lambda f, name: read.append(name) or real(f, name))
    if words is None:  # the undamaged file resumes
        assert int(catch.load(args, template, 16, "hint")["update"]) == 2
        return
    with pytest.raises(SystemExit) as exit_info:
        catch.load(args, template, 16, "hint")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: --resume {args.resume!r} ") and words in err, err
    assert err.count("\n") == 1 and "junk" not in read


def signals_in_the_last_call(tmp_path, signum, count):
    """`count` signals 50 ms apart half a second into the last of a run's two compiled calls (seconds long each;
    no safe point follows it); returns the exit status, the output and the seconds from the last signal to the
    exit."""
    proc = spawn("anakin_catch.py", [*quick("anakin_catch.py", budget=6000 * 16 * 8), "--log-every", 3000,
                                     "--run-dir", tmp_path / "runs"], tmp_path)
    try:
        before = wait_for_line(proc, "update 3000/6000")  # the last call comes next, after a checkpoint
        time.sleep(0.5)
        for i in range(count):
            time.sleep(0.05 if i else 0)
            proc.send_signal(signum)
        sent = time.monotonic()
        output = before + proc.communicate(timeout=300)[0]
        return proc.returncode, output, time.monotonic() - sent
    finally:
        proc.kill()


def test_a_second_signal_50_ms_after_the_first_exits_at_once_while_xla_computes(tmp_path):
    returncode, output, took = signals_in_the_last_call(tmp_path, signal.SIGINT, 2)
    assert returncode == 130 and took < 3 and "stopped by" not in output, (returncode, took, output[-3000:])
    assert output.splitlines()[-2:] == ["SIGINT: stopping after the update in flight, with a checkpoint; a second "
                                        "signal stops at once, without one",
                                        "SIGINT again: stopped at once, without writing a checkpoint"], output[-3000:]


def test_a_signal_in_the_last_call_still_exits_with_its_status_after_the_final_checkpoint(tmp_path):
    returncode, output, _ = signals_in_the_last_call(tmp_path, signal.SIGTERM, 1)
    assert returncode == 143 and "stopped by SIGTERM after update 6000; the checkpoint" in output, output[-3000:]
    with np.load(next((tmp_path / "runs").glob("*/checkpoint.npz")), allow_pickle=False) as f:
        assert int(f["update"]) == 6000


def test_a_resume_naming_a_folder_or_a_device_says_so(tmp_path, capsys):
    catch = load("anakin_catch.py")
    (tmp_path / "zero.npz").symlink_to("/dev/zero")
    for path, what in [(tmp_path, "a folder"), (tmp_path / "zero.npz", "not a file"),
                       (tmp_path / "no.npz", "no such file")]:
        with pytest.raises(SystemExit):
            catch.check_flags(catch.Args(resume=str(path)))
        assert capsys.readouterr().err == f"error: --resume {str(path)!r}: {what}; it takes a run's checkpoint.npz\n"


def test_a_sigint_while_jax_is_imported_stops_the_run_before_any_update(tmp_path):
    # Sent once jaxlib's libraries are mapped, while `import jax` runs: a KeyboardInterrupt raised there could
    # be swallowed and the run would train to the end, so the stop handlers are installed before it.
    script = "sebulba_impala.py"
    proc = spawn(script, [*quick(script), "--run-dir", tmp_path / "runs"], tmp_path)
    output = signal_once(proc, lambda: "jaxlib" in Path(f"/proc/{proc.pid}/maps").read_text(), signal.SIGINT)
    assert proc.returncode == 130 and "stopped by SIGINT after update 0" in output, output[-3000:]
    assert "Traceback" not in output and "Exception ignored" not in output and "update 1/" not in output, output
    with np.load(next((tmp_path / "runs").glob("*/checkpoint.npz")), allow_pickle=False) as f:
        assert int(f["update"]) == 0


def test_two_sigints_while_jax_is_imported_exit_at_once_with_one_line_each(tmp_path):
    script = "sebulba_impala.py"
    proc = spawn(script, [*quick(script), "--run-dir", tmp_path / "runs"], tmp_path)

    def twice():
        if "jaxlib" not in Path(f"/proc/{proc.pid}/maps").read_text():
            return False
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        return True

    output = signal_once(proc, twice, signal.SIGINT)
    assert proc.returncode == 130 and output.splitlines() == [
        "SIGINT: stopping after the update in flight, with a checkpoint; a second signal stops at once, without one",
        "SIGINT again: stopped at once, without writing a checkpoint"], output[-3000:]
    assert not (tmp_path / "runs").exists()


# ---- Multi-host: peers agree before they train, a missing one is a bounded wait, a dead one ends the run ----

def with_flag(flags, flag, value):
    """`flags` with `flag` set to `value` (replaced where it is already given)."""
    flags = list(flags)
    if flag in flags:
        flags[flags.index(flag) + 1] = value
        return flags
    return [*flags, flag, value]


@pytest.mark.parametrize("script,flag,values", [
    ("anakin_catch.py", "--total-timesteps", (400_000, 800_000)),
    ("anakin_catch.py", "--num-envs-per-device", (8, 16)),
    ("anakin_catch.py", "--seed", (1, 2)),
    ("sebulba_impala.py", "--env-id", ("CartPole-v1", "Acrobot-v1")),
])
def test_peers_started_with_different_flags_both_refuse_before_compiling(tmp_path, script, flag, values):
    start = time.monotonic()
    hosts = run_two_hosts(script, [], tmp_path, timeout=120,
                          extra=[with_flag(quick(script), flag, value) for value in values])
    for host in hosts:
        line = error_line(host)
        assert line == (f"error: process 1 runs with {flag} {json.dumps(values[1])}, process 0 with "
                        f"{json.dumps(values[0])}: every process needs the same"), host.output[-3000:]
        assert "update 1/" not in host.output and host.run_dir is None
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("pid", [0, 1])
def test_a_process_whose_peer_never_comes_says_so_and_gives_up_after_peer_timeout(tmp_path, pid):
    port = free_port()
    start = time.monotonic()
    result = run("anakin_catch.py", [*quick("anakin_catch.py"), *host_flags(port, pid), "--peer-timeout", 5],
                 tmp_path, devices=2, timeout=120)
    line = error_line(result)
    assert f"waiting for 2 processes at 127.0.0.1:{port} (at most --peer-timeout 5 s)" in result.output
    assert line.startswith("error: --distributed: not all joined in --peer-timeout 5 s (start every process")
    assert time.monotonic() - start < 60 and result.run_dir is None


def wait_for_line(proc, words, seconds=120):
    """Read `proc`'s output until a line holds `words`; returns what was read."""
    lines, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and (line := proc.stdout.readline()):
        lines.append(line)
        if words in line:
            return "".join(lines)
    raise AssertionError(f"no line with {words!r} in:\n{''.join(lines)[-3000:]}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_ends_the_wait_for_a_peer_within_seconds(tmp_path, signum):
    proc = spawn("anakin_catch.py", [*quick("anakin_catch.py"), *host_flags(free_port(), 1), "--run-dir",
                                     tmp_path / "runs"], tmp_path, devices=2)
    try:
        wait_for_line(proc, "waiting for 2 processes at")
        sent = time.monotonic()
        proc.send_signal(signum)
        output = proc.communicate(timeout=60)[0]
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum and took < 10, (took, output[-3000:])
    assert f"stopped by {signum.name} while waiting for the other processes, before any update" in output
    assert not (tmp_path / "runs").exists()


def test_a_coordinator_port_in_use_is_one_error_line(tmp_path):
    with socket.socket() as other:  # another program listens on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = run("anakin_catch.py", [*quick("anakin_catch.py"), *host_flags(port, 0)], tmp_path, devices=2,
                     timeout=120)
    line = error_line(result)
    assert line.startswith(f"error: --coordinator-address 127.0.0.1:{port}: process 0 cannot listen there (Address "
                           "already in use")


def test_two_processes_given_process_id_0_are_each_one_error_line(tmp_path):
    port = free_port()
    first = spawn("anakin_catch.py", [*quick("anakin_catch.py"), *host_flags(port, 0), "--peer-timeout", 10,
                                      "--run-dir", tmp_path / "first"], tmp_path, devices=2)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the first one's coordinator listens
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        second = run("anakin_catch.py", [*quick("anakin_catch.py"), *host_flags(port, 0)], tmp_path / "second",
                     devices=2, timeout=120)
        assert f"--coordinator-address 127.0.0.1:{port}: process 0 cannot listen there" in error_line(second)
        output = first.communicate(timeout=120)[0]
    finally:
        first.kill()
    assert "not all joined in --peer-timeout 10 s" in error_line(Result(first.returncode, output))


def test_a_dead_peer_ends_the_survivor_and_its_last_checkpoint_resumes(tmp_path):
    script, args = "anakin_catch.py", ["--num-envs-per-device", 32, "--log-every", 5, "--checkpoint-every", 10]
    procs, roots = spawn_two_hosts(script, [*args, "--total-timesteps", 10**9], tmp_path / "pair", devices=2)
    try:
        deadline = time.monotonic() + 300
        while not list(roots[0].glob("*/checkpoint.npz")) and time.monotonic() < deadline:
            time.sleep(0.5)
        procs[1].kill()  # SIGKILL: no goodbye
        killed = time.monotonic()
        output = procs[0].communicate(timeout=300)[0]
        waited = time.monotonic() - killed
    finally:
        for proc in procs:
            proc.kill()
    # A collective with the dead peer fails, or JAX's heartbeat (100 s) aborts the survivor.
    assert procs[0].returncode != 0 and waited < 200, (procs[0].returncode, waited, output[-3000:])
    ckpt = next(roots[0].glob("*/checkpoint.npz"))
    assert not list(roots[0].glob("*/checkpoint.tmp.npz"))
    with np.load(ckpt, allow_pickle=False) as f:
        update = int(f["update"])
        assert update >= 10 and f["state/lanes/key"].shape == (128, 2)  # both hosts' lanes
    # The same 4 devices' worth of lanes on one process carry on from it.
    budget = (update + 5) * 16 * 128
    resumed = run(script, [*args, "--total-timesteps", budget, "--resume", ckpt], tmp_path / "resumed", devices=4)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.metrics[0]["update"] == update + 5


def test_a_peer_that_dies_before_the_first_update_ends_the_survivor_at_once_with_one_line(tmp_path):
    # The survivor's first collective with it (the stop-signal check before update 1) raises; one that hangs
    # inside a compiled call instead ends with JAX's own abort (the test above).
    procs, roots = spawn_two_hosts("anakin_catch.py", quick("anakin_catch.py"), tmp_path, devices=2)
    try:
        before = wait_for_line(procs[0], "compiled in")
        procs[1].kill()
        killed = time.monotonic()
        output = before + procs[0].communicate(timeout=300)[0]
        waited = time.monotonic() - killed
    finally:
        for proc in procs:
            proc.kill()
    line = one_error(Result(procs[0].returncode, output))
    assert line.startswith("error: a collective with the other processes failed (one died?): UNKNOWN: Gloo ")
    assert line.endswith(f"; no checkpoint is in {next(roots[0].iterdir())}") and waited < 30, (waited, line)


# ---- Faults of the run folder, stdout and the terminal ------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 16 KiB file system (a tmpfs: mounting one needs root, as CI has)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", disk], check=True)
    yield disk
    subprocess.run(["umount", "-l", disk], check=True)


def one_error(result):
    """A run that failed at run time: exit status 1 and one `error:` line, no traceback; returns it."""
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-3000:]
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output[-3000:]
    return lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_disk_that_fills_while_logging_ends_the_run_with_one_line(tmp_path, small_disk, script):
    result = run(script, [*quick(script), "--log-every", 1, "--checkpoint-every", 10**6, "--run-dir", small_disk],
                 tmp_path, run_dir=False, timeout=300)
    line = one_error(result)
    assert "cannot write the metrics" in line and "No space left on device" in line and "no checkpoint is in" in line


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_disk_too_full_for_the_checkpoint_ends_the_run_leaving_no_temporary_file(tmp_path, small_disk, script):
    _, per_update = QUICK[script]
    result = run(script, [*quick(script, budget=4 * per_update), "--log-every", 4, "--run-dir", small_disk],
                 tmp_path, run_dir=False, timeout=300)
    line = one_error(result)
    assert "checkpoint.tmp.npz" in line and "No space left on device" in line and "no checkpoint is in" in line
    (folder,) = small_disk.iterdir()
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("events")) == ["args.json", "metrics.jsonl"]


@pytest.mark.parametrize("fault", ["made immutable", "made immutable with a directory in it", "deleted"])
def test_a_run_folder_made_immutable_or_deleted_mid_run_ends_the_run_with_one_line(tmp_path, fault):
    """What holds in every timing: one line, the last checkpoint intact, the temporary file gone where the folder
    lets it go. An immutable folder keeps a temporary file that was there (the run's own, when the fault lands
    while it is written), and then the line must say so; the last case forces that with a directory in the
    temporary file's place, which no save can replace or remove."""
    proc = spawn("anakin_catch.py", [*quick("anakin_catch.py"), "--log-every", 5, "--checkpoint-every", 5,
                                     "--run-dir", tmp_path / "runs"], tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "runs").glob("*/checkpoint.npz")) and time.monotonic() < deadline:
            time.sleep(0.05)
        (folder,) = (tmp_path / "runs").iterdir()
        tmp = folder / "checkpoint.tmp.npz"
        if fault == "deleted":  # moved away first, so the run cannot add a file while it is removed
            folder.rename(tmp_path / "gone")
            shutil.rmtree(tmp_path / "gone")
        else:
            while fault.endswith("in it"):
                try:
                    tmp.mkdir()  # once the run's own temporary file, if any, has been moved into place
                    break
                except FileExistsError:
                    time.sleep(0.001)
            subprocess.run(["chattr", "+i", folder], check=True)  # no new, renamed or removed entries, even for root
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
        subprocess.run(["chattr", "-i", folder], check=False)
    line = one_error(Result(proc.returncode, output))
    if fault == "deleted":
        assert "cannot write" in line and "No such file or directory" in line
        return
    assert "cannot write" in line and "checkpoint.tmp.npz" in line
    with np.load(folder / "checkpoint.npz", allow_pickle=False) as f:
        assert f"holds update {int(f['update'])}:" in line
    assert tmp.exists() == ("checkpoint.tmp.npz could not be removed: delete it" in line), line
    assert tmp.exists() or not fault.endswith("in it")


SECOND_SIGNAL_WHILE_SAVING = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from conftest import load
catch = load("anakin_catch.py")
caught = catch.catch_stop_signals()
os.kill(os.getpid(), signal.SIGTERM)  # the first: noted, and said
while not caught:
    time.sleep(0.001)
write = catch.np.savez
def savez(file, **arrays):  # the second arrives once the temporary file is written, before it is moved into place
    write(file, **arrays)
    print("written:", os.path.exists(file), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)  # a slow disk
catch.np.savez = savez
folder = Path(sys.argv[2])
catch.save(catch.Run(folder, None, folder / "checkpoint.npz"), {"w": catch.np.zeros(3)}, catch.Args())
print("not stopped")
"""


def test_a_second_signal_while_the_checkpoint_is_written_exits_at_once_leaving_no_temporary_file(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL_WHILE_SAVING, ROOT / "tests", tmp_path], cwd=tmp_path,
                          env=_env(1, None), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["SIGTERM: stopping after the update in flight, with a checkpoint; a second "
                                        "signal stops at once, without one", "written: True",
                                        "SIGTERM again: stopped at once, without writing a checkpoint"], proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_closed_stdout_does_not_stop_training(tmp_path):
    _, per_update = QUICK["anakin_catch.py"]
    budget = 200 * per_update
    proc = spawn("anakin_catch.py", [*quick("anakin_catch.py", budget=budget), "--log-every", 5,
                                     "--run-dir", tmp_path / "runs"], tmp_path)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]  # `| head -3`
        proc.stdout.close()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, lines
    (folder,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["global_step"] == budget and len(rows) == 40
    with np.load(folder / "checkpoint.npz", allow_pickle=False) as f:
        assert int(f["update"]) == 200


@pytest.mark.parametrize("script", ["anakin_catch.py", "sebulba_ppo_atari.py"])
def test_sighup_stops_the_run_with_a_checkpoint_as_sigterm_does(tmp_path, script):
    proc = spawn(script, [*quick(script), "--log-every", 1, "--run-dir", tmp_path / "runs"], tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "runs").glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGHUP)  # a closed terminal or SSH session
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGHUP and "stopped by SIGHUP after update" in output, output[-3000:]
    with np.load(next((tmp_path / "runs").glob("*/checkpoint.npz")), allow_pickle=False) as f:
        assert int(f["update"]) >= 1


# ---- Resume under other settings ----------------------------------------------------------

@pytest.mark.parametrize("changed", [["--seed", 7], ["--num-steps", 8], ["--learning-rate", 0.5]],
                         ids=["seed", "num-steps", "learning-rate"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resume_that_changes_a_flag_of_the_run_is_one_line_naming_it(tmp_path, stopped_early, script, changed):
    _, _, ckpt = stopped_early(script)
    line = error_line(run(script, [*quick(script), "--resume", ckpt, *changed], tmp_path, timeout=120))
    assert line.startswith(f"error: --resume {str(ckpt)!r} comes from a run with {changed[0]} "), line


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resume_with_another_number_of_steps_per_update_is_refused(tmp_path, stopped_early, script):
    # What a Sebulba checkpoint resumed on another number of hosts looks like: its updates were of
    # other sizes, so this run could not count its budget in steps.
    _, _, ckpt = stopped_early(script)
    with np.load(ckpt, allow_pickle=False) as f:
        arrays = dict(f)
    arrays["update"], arrays["global_step"] = np.int64(3), np.int64(3 * 2 * QUICK[script][1])
    np.savez(tmp_path / "other.npz", **arrays)
    line = error_line(run(script, [*quick(script), "--resume", tmp_path / "other.npz"], tmp_path, timeout=120))
    assert f"comes from a run whose updates were not of {QUICK[script][1]:,} steps" in line


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
     "process_id < num_processes"),
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


# Counts within the budget check whose buffers would need terabytes, and the flags the error line names.
TOO_BIG = {
    "anakin_catch.py": (["--num-envs-per-device", 2**30, "--total-timesteps", 10**12],
                        f"--num-envs-per-device {2**30}"),
    "anakin_ppo.py": (["--num-seeds", 64, "--num-envs-per-device", 2**17, "--total-timesteps", 10**10],
                      f"--num-seeds 64 x --num-envs-per-device {2**17}"),
    **{script: ([*quick(script), "--local-num-envs", 10**8], "the rollouts of 1 actor threads x --local-num-envs "
                f"{10**8}") for script in ("sebulba_impala.py", "sebulba_ppo_atari.py")},
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_env_counts_that_cannot_fit_in_memory_are_refused_before_the_run_folder(tmp_path, script):
    flags, what = TOO_BIG[script]
    result = run(script, flags, tmp_path, timeout=120)
    assert re.match(rf"error: {what} would need [\d,.]+ GiB, more than the [\d,.]+ GiB here$", error_line(result))
    assert result.run_dir is None


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
    assert "non-finite loss at update 2" in line and "no checkpoint is in" in line
    assert re.search(r"'losses/td_loss': (nan|-?inf)[,}]", line) and "array" not in line, line
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
        r.events.close()


def test_run_folders_stay_flat_inside_run_dir_whatever_exp_name_says(tmp_path, capsys):
    catch = load("anakin_catch.py")
    for name in ("../../../escaped", "a/b", "two\nlines"):
        run_ = catch.open_run(catch.Args(run_dir=str(tmp_path), exp_name=name))
        run_.events.close()
        assert run_.folder.parent == tmp_path and re.sub(r"[^\w.+-]", "_", name) in run_.folder.name
    with pytest.raises(SystemExit) as exit_info:
        catch.open_run(catch.Args(run_dir=str(tmp_path), exp_name="x" * 300))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --exp-name 'xxx")


@pytest.mark.parametrize("script", SCRIPTS)
def test_counts_too_large_for_the_programs_are_refused_before_the_run_folder(tmp_path, script):
    result = run(script, [*quick(script), "--log-every", 3_000_000_000], tmp_path, timeout=120)
    assert error_line(result).startswith("error: --log-every 3000000000 must be in 1..2,147,483,647")
    assert result.run_dir is None
