"""The test harness shared by every script's tests (the only code the scripts share).

- `load(script)`: import a top-level script as a module, to unit-test its pure functions (the
  process keeps its own SIGINT and SIGTERM handlers).
- `run(script, args, tmp_path, devices=N)`: run a script as a subprocess with N fake CPU
  devices (XLA_FLAGS must be set before JAX is imported, hence the subprocess), returning
  its exit status, output and parsed `metrics.jsonl`.
- `run_two_hosts(script, args, tmp_path)`: the same script as two processes on 127.0.0.1
  joined by `jax.distributed` (`--distributed` with a free coordinator port);
  `spawn_two_hosts` starts them without waiting (for the test that signals one host).
- `spawn(script, args, cwd)`: start a script without waiting (for signal tests), and
  `catches(proc, signum)`: whether it has installed its handler for that signal yet.
- `patched(script, patch, path)`: write a program that runs the script with some of its functions
  replaced (a fault, a probe, a loss term a student would add), to `run` like the script itself.
- `checksum(output)`: the parameter checksum a script prints at the end of a run.
- `error_line(result)`: the one `error:` line of a run refused with exit status 2.
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Compiled programs are cached across the test session's subprocesses (XLA_FLAGS are part of
# the cache key, so different fake device counts never share an entry).
CACHE_DIR = Path(os.environ.get("PODRACER_TEST_CACHE", "/tmp/podracer-test-jax-cache"))


def load(script):
    """Import `script` (e.g. "anakin_catch.py") from the repository root as a module."""
    path = ROOT / script
    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    spec.loader.exec_module(module)
    for signum, handler in handlers.items():  # a script only records stop signals, from its first lines: not here
        signal.signal(signum, handler)
    return module


@dataclass
class Result:
    returncode: int
    output: str  # stdout and stderr together
    run_dir: Path | None = None  # the run folder the script made, if any
    metrics: list = field(default_factory=list)  # rows of metrics.jsonl

    def last(self, key):
        """The last logged value of a metric."""
        rows = [m for m in self.metrics if key in m]
        assert rows, f"no {key!r} in metrics:\n{self.output[-3000:]}"
        return rows[-1][key]


def _env(devices, extra):
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        JAX_COMPILATION_CACHE_DIR=str(CACHE_DIR),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    env.update(extra or {})
    return env


def _collect(returncode, output, run_root):
    runs = sorted(p for p in Path(run_root).glob("*") if p.is_dir()) if Path(run_root).exists() else []
    run_dir = runs[-1] if runs else None
    metrics = []
    if run_dir is not None and (run_dir / "metrics.jsonl").exists():
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return Result(returncode, output, run_dir, metrics)


def command(script, args):
    return [sys.executable, str(ROOT / script), *map(str, args)]


def run(script, args, tmp_path, devices=1, timeout=600, env=None, run_dir=True):
    """Run a script in a subprocess with `devices` fake CPU devices.

    Its run folder goes under `tmp_path/runs` (unless `run_dir=False`, for tests that pass
    their own `--run-dir`). A run that outlives `timeout` seconds fails the test.
    """
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    run_root = Path(tmp_path) / "runs"
    args = [*args, "--run-dir", run_root] if run_dir else list(args)
    proc = subprocess.run(
        command(script, args), cwd=tmp_path, env=_env(devices, env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )
    return _collect(proc.returncode, proc.stdout, run_root)


def spawn(script, args, cwd, devices=1, env=None):
    """Start a script as a subprocess (output on `.stdout`, text) and return the Popen."""
    return subprocess.Popen(command(script, args), cwd=cwd, env=_env(devices, env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def patched(script, patch, path, after=""):
    """Write to `path` a program that imports `script` as the module `script` (as `python script`
    would run it, its stop handlers included), runs the Python source `patch`, which replaces some of
    the module's functions, then `script.main` on the command line's flags, then `after`. The failure
    or the measurement goes in from outside: the scripts carry no test-only flag or hook."""
    path.write_text(f"import sys, tyro\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                    f"import {Path(script).stem} as script\n{patch}\nscript.main(tyro.cli(script.Args))\n{after}\n")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_flags(port, pid, num_processes=2):
    """The flags of process `pid` of a `jax.distributed` job whose coordinator is 127.0.0.1:`port`."""
    return ["--distributed", "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", num_processes,
            "--process-id", pid]


def spawn_two_hosts(script, args, tmp_path, devices=2, env=None, extra=((), ())):
    """Start `script` as two processes of one `jax.distributed` job on 127.0.0.1, each with
    `devices` fake CPU devices, its own folder and its own `extra` flags; returns the Popens and
    their run roots."""
    port = free_port()
    procs, roots = [], []
    for pid in range(2):
        root = Path(tmp_path) / f"host{pid}"
        root.mkdir(parents=True, exist_ok=True)
        host_args = [*args, *extra[pid], "--run-dir", root / "runs", *host_flags(port, pid)]
        procs.append(spawn(script, host_args, root, devices, env))
        roots.append(root / "runs")
    return procs, roots


def run_two_hosts(script, args, tmp_path, devices=2, timeout=600, env=None, extra=((), ())):
    """Run `script` as two processes of one `jax.distributed` job on 127.0.0.1 (`spawn_two_hosts`)
    and wait for both; returns both Results."""
    procs, roots = spawn_two_hosts(script, args, tmp_path, devices, env, extra)
    results = []
    try:
        for proc, root in zip(procs, roots):
            out, _ = proc.communicate(timeout=timeout)
            results.append(_collect(proc.returncode, out, root))
    finally:
        for proc in procs:
            proc.kill()
    return results


def catches(proc, signum):
    """Whether process `proc` has installed a handler for `signum` (Linux: SigCgt in /proc)."""
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def checksum(output):
    """The `checksum <hex>` line a script prints after training (its final parameters)."""
    found = re.findall(r"^checksum ([0-9a-f]+)$", output, re.M)
    assert found, f"no checksum line in output:\n{output[-3000:]}"
    return found[-1]


def error_line(result):
    """For a bad-input run: assert exit status 2 and one `error:` line, no traceback; return it."""
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output[-3000:]
    return lines[0]


@pytest.fixture(scope="session", autouse=True)
def _cache_dir():
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
