"""The plumbing all four scripts share (one section, the same text in each) and the contract a copier keeps
(CONVENTIONS.md, "Errors and faults"): stop signals, checkpoints that resume or are refused in one line, the
run folder, a diverged run. Every case runs the real scripts, mostly as subprocesses."""

import ast
import difflib
import re
import signal
import subprocess
import time

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


def section(script):
    """From the `# ---- Plumbing` line to the end of the file."""
    text = (ROOT / script).read_text()
    return text[text.index("\n# ---- Plumbing") + 1:]


def quick(script, *flags, budget=10**9):
    args, _ = QUICK[script]
    return [*args, "--total-timesteps", budget, *flags]


# ---- One plumbing section -----------------------------------------------------------------

def test_the_plumbing_section_is_the_same_text_in_all_four_scripts_and_at_most_90_lines_after_main():
    first = section(SCRIPTS[0])
    assert len(first.splitlines()) <= 90
    for script in SCRIPTS:  # an appendix: the script's own code, main last, comes before it
        text = (ROOT / script).read_text()
        assert text.index("\ndef main(") < text.index("\n# ---- Plumbing") < text.rindex("\nif __name__")
    for script in SCRIPTS[1:]:
        diff = "\n".join(difflib.unified_diff(first.splitlines(), section(script).splitlines(),
                                              SCRIPTS[0], script, lineterm=""))
        assert not diff, diff


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_algorithm_part_calls_at_most_8_plumbing_names_and_nothing_runs_before_import_jax(script):
    text = (ROOT / script).read_text()
    algorithm, plumbing = text[:text.index("\n# ---- Plumbing")], ast.parse(section(script))
    defined = {node.name for node in plumbing.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for node in plumbing.body if isinstance(node, ast.Assign) for t in node.targets}
    used = {node.id for node in ast.walk(ast.parse(algorithm)) if isinstance(node, ast.Name)} & defined
    assert len(used) <= 8, sorted(used)
    body = ast.parse(text).body
    first_jax = next(i for i, node in enumerate(body) if isinstance(node, ast.Import)
                     and any(alias.name == "jax" for alias in node.names))
    assert all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body[1:first_jax])
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value.value, str)  # the docstring


# ---- Stop signals -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped_early(tmp_path_factory):
    """Each script sent SIGTERM the moment its handler is installed (just before its first update):
    (exit status, output, checkpoint path). Shared by the tests that need a checkpoint."""
    cache = {}

    def get(script):
        if script not in cache:
            folder = tmp_path_factory.mktemp(script.removesuffix(".py"))
            proc = spawn(script, [*quick(script), "--run-dir", folder / "runs"], folder)
            try:
                deadline = time.monotonic() + 120
                while not catches(proc, signal.SIGTERM) and time.monotonic() < deadline:
                    time.sleep(0.001)
                proc.send_signal(signal.SIGTERM)
                output = proc.communicate(timeout=300)[0]
            finally:
                proc.kill()
            cache[script] = (proc.returncode, output, next((folder / "runs").glob("*/checkpoint.npz"), None))
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


HANGING_ENV = '''
import time
import gymnasium as gym
import numpy as np


class Hang(gym.Env):
    """CartPole-sized observations; after 40 steps every step hangs."""
    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)
    steps = 0

    def reset(self, seed=None, options=None):
        return np.zeros(4, np.float32), {}

    def step(self, action):
        Hang.steps += 1
        while Hang.steps > 40:
            time.sleep(1)
        return np.zeros(4, np.float32), 1.0, False, False, {}


gym.register("Hang-v0", entry_point=Hang)
'''


def test_a_second_signal_ends_the_process_at_once_while_the_first_waits_for_the_update(tmp_path):
    # The learner waits for a rollout that never comes (its env hangs): the first SIGINT cannot stop it at an
    # update boundary, so the second one, a second later, must end the process at once (the OS default).
    (tmp_path / "hanging_env.py").write_text(HANGING_ENV)
    flags = ["--env-id", "hanging_env:Hang-v0", "--local-num-envs", 1, "--num-steps", 4, "--num-actor-threads", 1,
             "--total-timesteps", 10**6, "--run-dir", tmp_path / "runs"]
    proc = spawn("sebulba_impala.py", flags, tmp_path, env={"PYTHONPATH": str(tmp_path)})
    try:
        deadline = time.monotonic() + 120
        while not catches(proc, signal.SIGTERM) and time.monotonic() < deadline:  # SIGINT's is Python's too
            time.sleep(0.01)
        time.sleep(3)  # the env hangs after 40 steps: 10 rollouts of 4
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]  # it waits for the next update
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT and took < 5, (proc.returncode, took, output[-3000:])


# ---- Checkpoints refused in one line -------------------------------------------------------

@pytest.mark.parametrize("kind", ["missing", "empty", "random bytes", "truncated"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unreadable_checkpoint_is_one_error_line(tmp_path, stopped_early, script, kind):
    _, _, ckpt = stopped_early(script)
    bad = tmp_path / "bad.npz"
    if kind != "missing":
        data = ckpt.read_bytes()
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


def test_a_checkpoint_never_runs_code(tmp_path, stopped_early):
    _, _, ckpt = stopped_early("anakin_catch.py")
    with np.load(ckpt, allow_pickle=False) as f:
        arrays = dict(f)
    arrays["state/params/hidden/w"] = np.array([{"pickled": "object"}], dtype=object)
    np.savez(tmp_path / "pickled.npz", **arrays)
    line = error_line(run("anakin_catch.py", [*quick("anakin_catch.py"), "--resume", tmp_path / "pickled.npz"],
                          tmp_path, timeout=120))
    assert "not a readable checkpoint (ValueError: Object arrays cannot be loaded when allow_pickle=False" in line


# ---- The run folder and a diverged run ------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS)
def test_a_parser_error_exits_2_on_stderr(tmp_path, script):
    proc = subprocess.run(command(script, ["--no-such-flag"]), cwd=tmp_path, env=_env(1, None), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2 and "no-such-flag" in proc.stderr and not proc.stdout


def test_run_folders_stay_inside_run_dir_whatever_exp_name_says(tmp_path, monkeypatch):
    catch = load("anakin_catch.py")
    monkeypatch.setattr(catch.signal, "signal", lambda *_: None)  # no handlers in the test process
    for i, name in enumerate(("../../../escaped", "a/b", "two\nlines", "/abs")):
        run_ = catch.open_run(catch.Args(run_dir=str(tmp_path / str(i)), exp_name=name), 1)
        run_.writer.close()
        assert run_.folder.parent == tmp_path / str(i) and (run_.folder / "args.json").is_file()
        assert re.sub(r"[^\w.+-]", "_", name) in run_.folder.name
    assert {p.name for p in tmp_path.iterdir()} == {"0", "1", "2", "3"}


def test_a_diverged_run_writes_no_checkpoint_of_non_finite_parameters_and_names_the_last_good_one(tmp_path):
    # With this step size the first update's parameters overflow while its loss is still finite.
    flags = ["--env-id", "CartPole-v1", "--num-actor-threads", 1, "--local-num-envs", 2, "--num-steps", 8,
             "--total-timesteps", 64, "--checkpoint-every", 1]
    result = run("sebulba_impala.py", [*flags, "--learning-rate", 1e308], tmp_path / "diverged")
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-3000:]
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert line.startswith("error: the run diverged: non-finite parameters after update 1"), line
    assert not (result.run_dir / "checkpoint.npz").exists() and not list(result.run_dir.glob("*.npz"))
