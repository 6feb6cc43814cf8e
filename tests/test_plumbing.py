"""The plumbing all four scripts share (one section, the same text in each) and the contract a copier keeps
(README.md, "Bad input and faults"): bad input in one line, stop signals, checkpoints that resume or are refused
in one line, the run folder, a diverged run. Most cases run the real scripts as subprocesses; a few call the
plumbing's functions directly, where a subprocess could not make the fault happen on purpose."""

import ast
import dataclasses
import difflib
import os
import re
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import (ROOT, _env, catches, command, error_line, load, run, run_two_hosts, spawn,
                      spawn_two_hosts)

SCRIPTS = ["anakin_catch.py", "anakin_ppo.py", "sebulba_impala.py", "sebulba_ppo_atari.py"]
# The smallest real run of each script, and the steps of one of its updates.
QUICK = {
    "anakin_catch.py": (["--num-envs-per-device", 8], 16 * 8),
    "anakin_ppo.py": ([], 128 * 4),
    "sebulba_impala.py": (["--env-id", "CartPole-v1", "--local-num-envs", 4, "--num-actor-threads", 1], 16 * 4),
    "sebulba_ppo_atari.py": (["--local-num-envs", 4, "--num-actor-threads", 1, "--num-steps", 16], 16 * 4),
}


def section(script):
    """From the `# ---- Plumbing` line to the end of the file."""
    text = (ROOT / script).read_text()
    return text[text.index("\n# ---- Plumbing") + 1:]


def quick(script, *flags, budget=10**9):
    args, _ = QUICK[script]
    return [*args, "--total-timesteps", budget, *flags]


# ---- One plumbing section -----------------------------------------------------------------

def test_the_plumbing_section_is_the_same_text_in_all_four_scripts_and_at_most_96_lines_after_main():
    first = section(SCRIPTS[0])
    assert len(first.splitlines()) <= 96
    for script in SCRIPTS:  # an appendix: the script's own code, main last, comes before it
        text = (ROOT / script).read_text()
        assert text.index("\ndef main(") < text.index("\n# ---- Plumbing") < text.rindex("\nif __name__")
    for script in SCRIPTS[1:]:
        diff = "\n".join(difflib.unified_diff(first.splitlines(), section(script).splitlines(),
                                              SCRIPTS[0], script, lineterm=""))
        assert not diff, diff


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_algorithm_part_calls_at_most_8_plumbing_names_and_only_the_stop_handler_precedes_import_jax(script):
    text = (ROOT / script).read_text()
    algorithm, plumbing = text[:text.index("\n# ---- Plumbing")], ast.parse(section(script))
    defined = {node.name for node in plumbing.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    defined |= {name.id for node in plumbing.body if isinstance(node, ast.Assign) for target in node.targets
                for name in ast.walk(target) if isinstance(name, ast.Name)}
    used = {node.id for node in ast.walk(ast.parse(algorithm)) if isinstance(node, ast.Name)} & defined
    assert len(used) <= 8, sorted(used)
    docstring, imports, block, lines = before_import_jax(script)
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value.value, str)
    assert imports and all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in imports)
    assert lines == before_import_jax(SCRIPTS[0])[3], script  # the same lines, comments too, in all four
    assert [type(node) for node in block] == [ast.Assign, ast.FunctionDef, ast.Expr]
    assert ast.unparse(block[0]) == "STOPS = []"
    assert ast.unparse(block[1]).splitlines() == [  # a handler that only records the signal
        "def note_stop(signum, frame):", "    STOPS.append(signum)",
        "    (signal.signal(signal.SIGINT, signal.SIG_DFL), signal.signal(signal.SIGTERM, signal.SIG_DFL))"]
    assert ast.unparse(block[2]) == ("(signal.signal(signal.SIGINT, note_stop), "
                                     "signal.signal(signal.SIGTERM, note_stop))")


def before_import_jax(script):
    """The docstring, the imports after it, the statements after them up to `import jax`, and their lines."""
    text = (ROOT / script).read_text()
    body = ast.parse(text).body
    first_jax = next(i for i, node in enumerate(body) if isinstance(node, ast.Import)
                     and any(alias.name == "jax" for alias in node.names))
    n = next(i for i, node in enumerate(body) if i > 0 and not isinstance(node, (ast.Import, ast.ImportFrom)))
    lines = text.splitlines()[body[n - 1].end_lineno:body[first_jax].lineno - 1]
    return body[0], body[1:n], body[n:first_jax], lines


# ---- Stop signals -------------------------------------------------------------------------

def wait_for_the_stop_handler(proc):
    """Until the script has installed its stop handler, before `import jax`: from then on a signal stops the run at
    its first safe point. SIGTERM's is the marker (SIGINT has Python's own handler from the interpreter's start);
    a SIGTERM sent before it would end the process at once."""
    deadline = time.monotonic() + 120
    while not catches(proc, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.001)


def stop_a_run(script, flags, folder, signum, wait=lambda proc: None):
    """Start `script` in `folder`, send `signum` once its stop handler is in place and `wait(proc)` has returned,
    and let the run end: (exit status, output)."""
    proc = spawn(script, [*flags, "--run-dir", folder / "runs"], folder)
    try:
        wait_for_the_stop_handler(proc)
        wait(proc)
        proc.send_signal(signum)
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    return proc.returncode, output


@pytest.fixture(scope="module")
def stopped_early(tmp_path_factory):
    """Each script sent SIGTERM the moment its stop handler is in place (while it imports JAX):
    (exit status, output, checkpoint path). Shared by the tests that need a checkpoint."""
    cache = {}

    def get(script):
        if script not in cache:
            folder = tmp_path_factory.mktemp(script.removesuffix(".py"))
            returncode, output = stop_a_run(script, quick(script), folder, signal.SIGTERM)
            cache[script] = (returncode, output, next((folder / "runs").glob("*/checkpoint.npz"), None))
        return cache[script]

    return get


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_stops_after_the_next_update_with_a_checkpoint_that_resumes(tmp_path, stopped_early, script):
    returncode, output, ckpt = stopped_early(script)
    assert returncode == 143 and "Traceback" not in output, output[-3000:]
    stopped = int(re.search(r"^stopped by SIGTERM after update (\d+); --resume (.+) to go on$", output, re.M)[1])
    with np.load(ckpt, allow_pickle=False) as f:
        assert int(f["update"]) == stopped >= 1
    per_update = QUICK[script][1]
    resumed = run(script, [*quick(script, budget=(stopped + 2) * per_update), "--resume", ckpt, "--log-every", 1],
                  tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [row["update"] for row in resumed.metrics] == [stopped + 1, stopped + 2]


# A budget a run finishes in about 5-20 s here if a stop were lost, and its updates.
START_UP = {"anakin_catch.py": 600_000, "sebulba_impala.py": 20_000}


@pytest.mark.parametrize("moment", ["at once", "0.5 s later", "2 s later", "after the first progress line"])
@pytest.mark.parametrize("script", list(START_UP))
def test_a_ctrl_c_during_start_up_stops_the_run_at_its_first_safe_point(tmp_path, script, moment):
    # Sent while the script imports, sets up, compiles or runs its first update: before issue 60, JAX ignored the
    # KeyboardInterrupt in most such tries and the run trained to its end (during the imports until issue 65).
    def wait(proc):
        if moment == "after the first progress line":
            next(line for line in proc.stdout if line.startswith("update "))
        else:
            time.sleep({"at once": 0, "0.5 s later": 0.5, "2 s later": 2}[moment])

    budget = START_UP[script]
    returncode, output = stop_a_run(script, quick(script, budget=budget), tmp_path, signal.SIGINT, wait)
    assert returncode == 130 and "checksum" not in output, output[-3000:]
    stopped = int(re.search(r"^stopped by SIGINT after update (\d+); --resume .+ to go on$", output, re.M)[1])
    assert 1 <= stopped < budget // QUICK[script][1]


# Put on PYTHONPATH as sitecustomize.py, it sends its process one SIGINT as `import jax` first imports one of its
# modules, the Python handler running in that import or inside a gc callback, as JAX's own (where a Ctrl-C was lost).
SIGINT_IN_IMPORT_JAX = """import gc, os, signal, sys
def sigint(*_):
    gc.callbacks.remove(sigint) if sigint in gc.callbacks else None
    os.kill(os.getpid(), signal.SIGINT)
class SigintOnce:
    def find_spec(self, name, path, target=None):
        if name == "jax._src.numpy.ufuncs":
            sys.meta_path.remove(self)
            {where}
sys.meta_path.insert(0, SigintOnce())
"""


@pytest.mark.parametrize("where", ["in the import", "in a gc callback"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_ctrl_c_during_import_jax_stops_the_run_at_its_first_safe_point(tmp_path, script, where):
    where = {"in the import": "sigint()", "in a gc callback": "gc.callbacks.insert(0, sigint), gc.collect()"}[where]
    (tmp_path / "sitecustomize.py").write_text(SIGINT_IN_IMPORT_JAX.format(where=where))
    flags = quick(script, "--log-every", 1, budget=20 * QUICK[script][1])
    result = run(script, flags, tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 130 and "Traceback" not in result.output, result.output[-3000:]
    assert "checksum" not in result.output, result.output[-3000:]  # the run did not train to its end
    ckpt = result.run_dir / "checkpoint.npz"
    assert f"stopped by SIGINT after update 1; --resume {ckpt} to go on" in result.output, result.output[-3000:]
    with np.load(ckpt, allow_pickle=False) as f:
        assert int(f["update"]) == 1


def test_a_signal_during_the_last_call_exits_with_its_status_after_the_final_checkpoint(tmp_path):
    # One compiled call makes all 10 updates, so a SIGTERM sent during the imports is still pending at its end.
    flags = [*quick("anakin_catch.py", budget=10 * QUICK["anakin_catch.py"][1]), "--log-every", 10]
    returncode, output = stop_a_run("anakin_catch.py", flags, tmp_path, signal.SIGTERM)
    assert returncode == 143 and "checksum" not in output, output[-3000:]
    ckpt = next((tmp_path / "runs").glob("*/checkpoint.npz"))
    assert f"stopped by SIGTERM after update 10; --resume {ckpt} to go on" in output, output[-3000:]
    with np.load(ckpt, allow_pickle=False) as f:
        assert int(f["update"]) == 10
    line = error_line(run("anakin_catch.py", [*flags, "--resume", ckpt], tmp_path))
    assert line == f"error: --resume {ckpt}: its run has done all 10 updates (raise --total-timesteps)"


@pytest.mark.parametrize("script", SCRIPTS)
def test_resuming_a_finished_run_is_one_line_in_every_script(tmp_path, stopped_early, script):
    _, output, ckpt = stopped_early(script)
    stopped = int(re.search(r"^stopped by SIGTERM after update (\d+)", output, re.M)[1])
    result = run(script, quick(script, "--resume", ckpt, budget=stopped * QUICK[script][1]), tmp_path, timeout=120)
    line = error_line(result)
    assert line == f"error: --resume {ckpt}: its run has done all {stopped} updates (raise --total-timesteps)"
    assert result.run_dir is None


def test_a_signal_to_one_host_stops_every_host_after_the_same_update(tmp_path):
    procs, _ = spawn_two_hosts("anakin_catch.py", quick("anakin_catch.py"), tmp_path, devices=1)
    try:
        for line in procs[0].stdout:  # process 0 prints the progress lines
            if line.startswith("update 20/"):
                break
        procs[1].send_signal(signal.SIGTERM)
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [143, 143], outputs
    stops = [re.findall(r"^stopped by SIGTERM after update (\d+)", out, re.M) for out in outputs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, outputs


# ---- Checkpoints refused in one line -------------------------------------------------------

@pytest.mark.parametrize("kind", ["missing", "empty", "random bytes", "truncated", "a pipe", "args a list",
                                  "args a number"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unreadable_checkpoint_is_one_error_line(tmp_path, stopped_early, script, kind):
    _, _, ckpt = stopped_early(script)
    bad = tmp_path / "bad.npz"
    data = ckpt.read_bytes()
    if kind == "a pipe":  # np.load would wait forever for a writer
        os.mkfifo(bad)
    elif kind.startswith("args"):  # JSON, but not the object of flags a checkpoint holds
        with np.load(ckpt, allow_pickle=False) as f:
            np.savez(bad, **{**f, "args": "[1, 2]" if kind == "args a list" else "7"})
    elif kind != "missing":
        bad.write_bytes({"empty": b"", "random bytes": np.random.default_rng(0).bytes(4096),
                         "truncated": data[: len(data) // 2]}[kind])
    line = error_line(run(script, [*quick(script), "--resume", bad], tmp_path, timeout=120))
    assert line.startswith(f"error: --resume {bad} is not a readable checkpoint ("), line


@pytest.mark.parametrize("changed", [["--seed", 7], ["--num-steps", 8], ["--learning-rate", 0.5]],
                         ids=["seed", "num-steps", "learning-rate"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resume_that_changes_a_flag_of_the_run_is_one_line_naming_it(tmp_path, stopped_early, script, changed):
    _, _, ckpt = stopped_early(script)
    line = error_line(run(script, [*quick(script), "--resume", ckpt, *changed], tmp_path, timeout=120))
    assert line.startswith(f"error: --resume {ckpt}: its run had {changed[0]} "), line


@pytest.mark.parametrize("script", ["sebulba_impala.py", "sebulba_ppo_atari.py"])
def test_a_sebulba_resume_on_another_number_of_hosts_is_one_line_on_each(tmp_path, stopped_early, script):
    # Each host adds its envs to the batch: on two hosts a one-host run's updates would be twice the size.
    _, _, ckpt = stopped_early(script)
    per_update = QUICK[script][1]
    hosts = run_two_hosts(script, [*quick(script), "--resume", ckpt], tmp_path, devices=1, timeout=300)
    for host in hosts:
        assert error_line(host) == (f"error: --resume {ckpt}: its run made {per_update:,} steps an update, "
                                    f"here 2 hosts make {2 * per_update:,}: resume on as many hosts as it had")


def test_a_checkpoint_never_runs_code(tmp_path, stopped_early):
    _, _, ckpt = stopped_early("anakin_catch.py")
    with np.load(ckpt, allow_pickle=False) as f:
        arrays = dict(f)
    arrays["state/params/hidden/w"] = np.array([{"pickled": "object"}], dtype=object)
    np.savez(tmp_path / "pickled.npz", **arrays)
    line = error_line(run("anakin_catch.py", [*quick("anakin_catch.py"), "--resume", tmp_path / "pickled.npz"],
                          tmp_path, timeout=120))
    assert "not a readable checkpoint (ValueError: Object arrays cannot be loaded when allow_pickle=False" in line


# ---- Bad input: one line on stderr, exit 2, before compiling ------------------------------

@pytest.mark.parametrize("script", SCRIPTS)
def test_every_count_below_1_is_refused_in_one_place_before_anything_else(script, monkeypatch, capsys):
    module = load(script)
    monkeypatch.setattr(module.signal, "signal", lambda *_: None)  # no handlers in the test process
    types = typing.get_type_hints(module.Args)  # without Annotated's --help hints
    counts = [name for name, kind in types.items() if kind in (int, int | None)]
    counts = [name for name in counts if name not in ("seed", "process_id")]  # these may be 0
    assert {"total_timesteps", "log_every", "checkpoint_every", "num_processes"} < set(counts)
    for name in counts:
        for value in (0, -1):
            with pytest.raises(SystemExit) as stop:
                module.start(dataclasses.replace(module.Args(), **{name: value}))
            out, err = capsys.readouterr()
            assert stop.value.code == 2 and not out
            assert err == f"error: --{name.replace('_', '-')} {value} must be at least 1\n"


RAISES = "raise RuntimeError('its own error')\n"
BAD_INPUT = [  # (script, flags, the error line's start and a word it names)
    ("anakin_catch.py", ["--log-every", -1], "error: --log-every -1 must be at least 1"),
    ("anakin_ppo.py", ["--log-every", -1], "error: --log-every -1 must be at least 1"),
    ("sebulba_impala.py", ["--num-steps", -1], "error: --num-steps -1 must be at least 1"),
    ("sebulba_impala.py", ["--num-actor-threads", -1], "error: --num-actor-threads -1 must be at least 1"),
    ("sebulba_ppo_atari.py", ["--num-minibatches", 0], "error: --num-minibatches 0 must be at least 1"),
    ("sebulba_impala.py", ["--env-id", "nosuchmod:Foo-v0"],
     "error: --env-id 'nosuchmod:Foo-v0': module 'nosuchmod' does not import (ModuleNotFoundError"),
    ("sebulba_impala.py", ["--env-id", "../x:Foo-v0"], "error: --env-id '../x:Foo-v0': module '../x' does not import"),
    ("sebulba_impala.py", ["--env-id", "broken:Foo-v0"],
     "error: --env-id 'broken:Foo-v0': module 'broken' does not import (SyntaxError"),
    ("sebulba_ppo_atari.py", ["--env-id", "raising:Foo-v0"],
     "error: --env-id 'raising:Foo-v0': module 'raising' does not import (RuntimeError: its own error)"),
    ("sebulba_impala.py", ["--env-id", "CartPole-v1", "--machado"],
     "error: --machado is Atari's protocol; --env-id 'CartPole-v1' is not an envpool Atari game"),
    ("anakin_catch.py", ["--process-id", 1, "--num-processes", 2],
     "error: --coordinator-address, --num-processes and --process-id need --distributed"),
    ("anakin_catch.py", ["--distributed"], "error: --distributed could not start (coordinator_address should be "
     "defined.): outside SLURM, Cloud TPU and Kubernetes give --coordinator-address, --num-processes and --process-id"),
    ("sebulba_impala.py", ["--env-id", "Hopper-v2"], "error: --env-id 'Hopper-v2': gymnasium cannot make it "
     "(ImportError: The mujoco v2 and v3 based environments have been moved to the gymnasium-robotics project"),
    ("sebulba_ppo_atari.py", ["--env-id", "Hopper-v2"], "error: --env-id 'Hopper-v2': gymnasium cannot make it "
     "(ImportError: "),
    *[(script, ["--seed", -1], "error: --seed -1 must be in 0..2147483647") for script in SCRIPTS],
    ("sebulba_impala.py", ["--seed", 2**31], "error: --seed 2147483648 must be in 0..2147483647"),
    # The run folder, where the OS refuses it: a path under a regular file (tests run as root, who may write
    # anywhere), a name too long.
    ("anakin_catch.py", ["--run-dir", "a_file/runs"],
     "error: --run-dir a_file/runs and --exp-name: cannot make the run folder (Not a directory)"),
    ("sebulba_impala.py", ["--env-id", "CartPole-v1", "--run-dir", "a_file"],
     "error: --run-dir a_file and --exp-name: cannot make the run folder (Not a directory)"),
    ("anakin_ppo.py", ["--exp-name", "x" * 300, "--run-dir", "elsewhere"],
     "error: --run-dir elsewhere and --exp-name: cannot make the run folder (File name too long)"),
    ("sebulba_ppo_atari.py", ["--env-id", "tests.minatar_envs:MinAtar/Breakout-v1", "--exp-name", "x" * 300,
                              "--run-dir", "elsewhere"],
     "error: --run-dir elsewhere and --exp-name: cannot make the run folder (File name too long)"),
]


@pytest.mark.parametrize("script, flags, start", BAD_INPUT,
                         ids=[" ".join(map(str, c[:2]))[:60] for c in BAD_INPUT])
def test_bad_input_is_one_error_line_on_stderr_and_nothing_on_stdout(tmp_path, script, flags, start):
    (tmp_path / "broken.py").write_text("def (\n")
    (tmp_path / "raising.py").write_text(RAISES)
    (tmp_path / "a_file").write_text("")
    # A --run-dir among `flags` comes last, so it is the one taken.
    proc = subprocess.run(command(script, ["--run-dir", tmp_path / "runs", *flags]), cwd=tmp_path, text=True,
                          env=_env(1, {"PYTHONPATH": str(tmp_path)}), capture_output=True, timeout=120)
    assert proc.returncode == 2 and not proc.stdout, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith(start) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "runs").exists()


def help_defaults(script):
    """{flag: the texts of each `(default: ...)` beside it} in `script --help`, on a screen wide enough for one line
    of help a flag."""
    proc = subprocess.run(command(script, ["--help"]), env=_env(1, {"COLUMNS": "250"}), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    defaults, flag = {}, None
    for line in proc.stdout.splitlines():
        if found := re.match(r"│ (--[\w-]+)", line):
            flag = defaults.setdefault(found[1], [])
        if flag is not None:
            flag += re.findall(r"\(default: ([^)]*)\)", line)
    return defaults


UNSET = {"--resume", "--coordinator-address", "--num-processes", "--process-id"}  # None: no checkpoint, or JAX's


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_gives_each_flag_one_default_and_the_values_a_none_stands_for(script):
    defaults, module = help_defaults(script), load(script)
    assert len(defaults) == len(dataclasses.fields(module.Args)), defaults
    assert all(len(texts) == 1 for texts in defaults.values()), defaults  # not "(default: 0) (default: None)"
    assert {flag for flag, texts in defaults.items() if texts == ["None"]} == UNSET, defaults
    flags_of = lambda names: ["--" + name.replace("_", "-") for name in names]
    if script.startswith("anakin"):
        assert defaults["--num-devices"] == ["all"]
    if script == "anakin_ppo.py":  # each env's value, from ENVS
        envs = module.ENVS
        for flag, name in zip(flags_of(envs["CartPole-v1"].defaults), envs["CartPole-v1"].defaults):
            assert defaults[flag] == [", ".join(f"{env_id} {env.defaults[name]}" for env_id, env in envs.items())]
        assert defaults["--learning-rate"] == ["CartPole-v1 0.00025, Pendulum-v1 0.001"]
    if script.startswith("sebulba"):
        assert defaults["--actor-device-ids"] == ["0"] and defaults["--learner-device-ids"] == ["others, or 0"]
    if script == "sebulba_impala.py":  # the values for images and for vectors, from DEFAULTS
        image, vector = module.DEFAULTS["image"], module.DEFAULTS["vector"]
        assert set(image) == set(vector) == {"total_timesteps", "learning_rate", "num_steps", "rmsprop_eps",
                                             "network", "log_every"}
        for flag, name in zip(flags_of(image), image):
            assert defaults[flag] == [f"images {image[name]}, vectors {vector[name]}"]
        assert defaults["--num-steps"] == ["images 20, vectors 16"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_parser_error_exits_2_on_stderr(tmp_path, script):
    proc = subprocess.run(command(script, ["--no-such-flag"]), cwd=tmp_path, env=_env(1, None), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2 and "no-such-flag" in proc.stderr and not proc.stdout


# ---- The run folder, the progress line, checkpoint writes and a diverged run ---------------

@pytest.fixture
def catch(monkeypatch):
    """anakin_catch.py as a module: its plumbing is the same text in all four scripts (the first test above)."""
    module = load("anakin_catch.py")
    monkeypatch.setattr(module, "STOPS", [])
    monkeypatch.setattr(module, "START", [])
    return module


def test_run_folders_stay_one_flat_folder_inside_run_dir(tmp_path, catch):
    names = [("Catch", "../../../escaped"), ("Catch", "a/b"), ("Catch", "two\nlines"), ("Catch", "/abs"),
             ("tests.minatar_envs:MinAtar/Breakout-v1", "x"), ("../m:a/b-v0", "x")]
    for i, (env_id, exp_name) in enumerate(names):
        run_ = catch.open_run(catch.Args(env_id=env_id, run_dir=str(tmp_path / str(i)), exp_name=exp_name), 0, 1)
        run_.writer.close()
        assert run_.folder.parent == tmp_path / str(i) and (run_.folder / "args.json").is_file()
        assert re.sub(r"[^\w.+-]", "_", exp_name) in run_.folder.name and "/" not in run_.folder.name
    assert {p.name for p in tmp_path.iterdir()} == {str(i) for i in range(len(names))}


def test_the_eta_is_the_wall_time_per_update_since_the_first_line_whatever_the_sps(tmp_path, catch, monkeypatch,
                                                                                    capsys):
    run_ = catch.open_run(catch.Args(run_dir=str(tmp_path)), 0, 100)
    # The times of the three lines below: start-up and compiling before the first (at 1000 s) do not count.
    now = iter([1000.0, 1030.0, 1150.0])
    monkeypatch.setattr(catch, "time", SimpleNamespace(time=lambda: next(now)))
    # An SPS of all --num-seeds agents' steps (8 here) while global_step counts one agent's, as anakin_ppo logs.
    for update in (10, 20, 40):
        catch.log(run_, {"global_step": update * 512, "update": update, "charts/SPS": 8 * 512 / 3.0})
    run_.writer.close()
    etas = re.findall(r"\| ETA (\S+)$", capsys.readouterr().out, re.M)
    assert etas == ["-", "4m00s", "5m00s"]  # 30 s for 10 updates, 80 left; then 150 s for 30, 60 left


def test_a_checkpoint_write_that_fails_part_way_leaves_the_previous_checkpoint_as_it_was(tmp_path, catch,
                                                                                        monkeypatch):
    run_ = catch.open_run(catch.Args(run_dir=str(tmp_path)), 0, 10)
    catch.safe_point(catch.Args(), run_, 1, True, lambda: {"w": np.ones(3, np.float32)})
    before = (run_.folder / "checkpoint.npz").read_bytes()

    def torn(path, **arrays):  # as a full disk would: half a file, then the error
        Path(path).write_bytes(before[: len(before) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(catch.np, "savez", torn)
    with pytest.raises(OSError, match="No space left"):
        catch.safe_point(catch.Args(), run_, 2, True, lambda: {"w": np.full(3, 2.0, np.float32)})
    assert (run_.folder / "checkpoint.npz").read_bytes() == before
    run_.writer.close()


def test_a_run_that_diverges_after_a_good_checkpoint_names_it_and_keeps_it(tmp_path, catch, capsys):
    run_ = catch.open_run(catch.Args(run_dir=str(tmp_path)), 0, 10)
    catch.safe_point(catch.Args(), run_, 1, True, lambda: {"w": np.ones(3, np.float32)})
    ckpt = run_.folder / "checkpoint.npz"
    before = ckpt.read_bytes()
    with pytest.raises(SystemExit) as stop:
        catch.safe_point(catch.Args(), run_, 2, True, lambda: {"w": np.array([1.0, np.nan, 1.0], np.float32)})
    assert stop.value.code == 1 and ckpt.read_bytes() == before
    assert capsys.readouterr().err == (f"error: the run diverged: non-finite parameters after update 2; "
                                       f"--resume {ckpt} to go on\n")
    run_.writer.close()


def test_a_diverged_run_writes_no_checkpoint_of_non_finite_parameters(tmp_path):
    # With this step size the first update's parameters overflow while its loss is still finite.
    flags = ["--env-id", "CartPole-v1", "--num-actor-threads", 1, "--local-num-envs", 2, "--num-steps", 8,
             "--total-timesteps", 64, "--checkpoint-every", 1]
    result = run("sebulba_impala.py", [*flags, "--learning-rate", 1e308], tmp_path / "diverged")
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-3000:]
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert line == "error: the run diverged: non-finite parameters after update 1", line
    assert not list(result.run_dir.glob("*.npz"))


# ---- The machines users have ------------------------------------------------------------------

# macOS and Windows have no os.sched_getaffinity: run a script as there, without it.
WITHOUT_AFFINITY = ("import os, runpy, sys; del os.sched_getaffinity; sys.argv = sys.argv[1:]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("script, flags, notes", [
    ("sebulba_impala.py", [], 1), ("sebulba_ppo_atari.py", [], 1), ("sebulba_impala.py", ["--network", "shallow"], 0),
], ids=["impala deep", "ppo nature", "impala shallow"])
def test_sebulba_runs_without_sched_getaffinity_and_names_the_cpu_recipe_once(tmp_path, script, flags, notes):
    flags = ["--env-id", "Breakout-v5", "--num-actor-threads", 1, "--local-num-envs", 4, "--num-steps", 8,
             "--total-timesteps", 64, *flags, "--run-dir", tmp_path / "runs"]
    proc = subprocess.run([sys.executable, "-c", WITHOUT_AFFINITY, ROOT / script, *map(str, flags)], cwd=tmp_path,
                          env=_env(1, None), text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"^checksum [0-9a-f]{64}$", proc.stdout, re.M), proc.stdout[-3000:]
    assert proc.stdout.count("note: a CPU learner trains ") == notes, proc.stdout[-3000:]
