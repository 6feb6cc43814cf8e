"""tests/evaluate.py: every script's checkpoint plays whole games and draws a GIF of one, a trained
Catch agent scores near the optimum, a few envs play many games, Ctrl-C ends with the figures so far,
and damaged, foreign or mismatched files are one error line."""

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image, ImageSequence

from conftest import ROOT, error_line, load, run, spawn

evaluate = load("tests/evaluate.py")
SMALL = ["--num-actor-threads", 1, "--local-num-envs", 2, "--num-steps", 4, "--total-timesteps", 8]
# name: (script, flags, milliseconds a GIF frame shows one agent step). The Sebulba runs are one update
# long; the Catch agent is trained, with the default flags and seed for 4M steps: seeds 1, 2, 3 and 5
# then score 1.0 greedily (seed 1, 0.28 after 2M steps, passes 0.9 in training at 2.2M), the slow seed 4
# about 0.1 (in training it reaches 0.9 at 13M steps).
RUNS = {
    "catch": ("anakin_catch.py", ["--total-timesteps", 4_000_000, "--log-every", 100], 250),
    "pendulum": ("anakin_ppo.py", ["--env-id", "Pendulum-v1", "--num-seeds", 2, "--total-timesteps", 4096],
                 50),
    "impala cartpole": ("sebulba_impala.py", ["--env-id", "CartPole-v1", *SMALL], 20),
    "atari": ("sebulba_impala.py", ["--env-id", "Breakout-v5", "--network", "shallow", *SMALL], 70),
    "minatar": ("sebulba_ppo_atari.py", ["--env-id", "tests.minatar_envs:MinAtar/Breakout-v1",
                                         "--update-epochs", 1, "--num-minibatches", 1, *SMALL], 100),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: checkpoint.npz} of every run of RUNS, run side by side."""
    root = tmp_path_factory.mktemp("runs")
    procs = {name: spawn(script, [*flags, "--run-dir", root / name], root)
             for name, (script, flags, _) in RUNS.items()}
    try:
        for name, proc in procs.items():
            output = proc.communicate(timeout=600)[0]
            assert proc.returncode == 0, f"{name}:\n{output[-3000:]}"
    finally:
        for proc in procs.values():
            proc.kill()
    return {name: next((root / name).glob("*/checkpoint.npz")) for name in RUNS}


def evaluate_gif(checkpoint, gif, *flags):
    """The Evaluation, and the GIF's frames as RGB arrays with their durations in milliseconds."""
    result = evaluate.main([str(checkpoint), "--gif", str(gif), *map(str, flags)])
    with Image.open(gif) as image:
        frames = [(np.asarray(frame.convert("RGB")), frame.info["duration"])
                  for frame in ImageSequence.Iterator(image)]
    return result, frames


@pytest.mark.parametrize("name", RUNS)
def test_a_short_runs_checkpoint_plays_whole_games_and_its_gif_shows_each_step_of_the_first(
        name, checkpoints, tmp_path, capsys):
    result, frames = evaluate_gif(checkpoints[name], tmp_path / "game.gif", "--episodes", 3)
    assert len(result.scores) == 3 and np.isfinite(result.scores).all() and (result.lengths >= 1).all()
    assert len(result.frames) == result.lengths[0]
    # Pillow stores a frame equal to the one before it as one longer frame.
    assert 1 <= len(frames) <= len(result.frames)
    assert sum(ms for _, ms in frames) == len(result.frames) * RUNS[name][2]
    out = capsys.readouterr().out
    assert "3 games, sampled actions" in out and "score   mean" in out and "length  mean" in out


def test_gif_every_keeps_every_kth_step_each_shown_k_times_as_long(checkpoints, tmp_path):
    result, frames = evaluate_gif(checkpoints["catch"], tmp_path / "game.gif", "--episodes", 1, "--gif-every", 3)
    assert len(result.frames) == -(-result.lengths[0] // 3)
    assert sum(ms for _, ms in frames) == len(result.frames) * 3 * RUNS["catch"][2]


def as_at_the_start(checkpoint, path):
    """A copy of an anakin_catch.py checkpoint with the parameters its run started from."""
    catch = load("anakin_catch.py")
    with np.load(checkpoint, allow_pickle=False) as f:
        arrays = dict(f)
    args = catch.Args(**json.loads(str(arrays["args"])))
    start = catch.flat({"state": catch.init_state(jax.random.PRNGKey(args.seed), args, 1)})
    np.savez(path, **{**arrays, **{name: start[name] for name in arrays if name.startswith("state/params/")}})
    return path


def test_a_trained_catch_agent_catches_nearly_every_ball_greedily_and_an_untrained_one_far_fewer(
        checkpoints, tmp_path):
    trained = evaluate.main([str(checkpoints["catch"]), "--greedy", "--episodes", "100"])
    untrained = evaluate.main([str(as_at_the_start(checkpoints["catch"], tmp_path / "start.npz")), "--greedy",
                               "--episodes", "100"])
    assert trained.scores.mean() >= 0.9
    assert untrained.scores.mean() < 0.5
    assert set(trained.lengths) == {9}  # every game of Catch: the ball falls nine rows


def test_atari_gifs_show_the_game_played_in_envpools_colour_frames(checkpoints, tmp_path):
    result, frames = evaluate_gif(checkpoints["atari"], tmp_path / "game.gif", "--episodes", 1, "--greedy")
    first = frames[0][0].astype(int)
    assert first.shape == (210, 160, 3)
    assert np.abs(first[..., 0] - first[..., 2]).max() > 100  # Breakout's coloured bricks
    assert result.lengths[0] == len(result.frames)


def test_agent_picks_one_agent_of_an_anakin_ppo_run_of_several_seeds(checkpoints, capsys):
    scores = [evaluate.main([str(checkpoints["pendulum"]), "--agent", str(i), "--episodes", "2"]).scores
              for i in (0, 1)]
    assert not np.array_equal(*scores)  # the same envs, two policies
    assert "2 agent(s), 0..1" in refused([checkpoints["pendulum"], "--agent", 2], capsys)
    assert "1 agent(s), 0..0" in refused([checkpoints["catch"], "--agent", 1], capsys)


def refused(argv, capsys):
    """The one `error:` line of an evaluation refused with exit status 2."""
    with pytest.raises(SystemExit) as stop:
        evaluate.main(list(map(str, argv)))
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    return lines[0]


def test_a_damaged_file_is_one_error_line_with_status_2_and_no_traceback(tmp_path):
    damaged = tmp_path / "checkpoint.npz"
    damaged.write_bytes(b"PK\x03\x04 the first bytes of a zip, then nothing")
    result = run("tests/evaluate.py", [damaged], tmp_path, run_dir=False)
    assert "is not a readable checkpoint" in error_line(result)


def test_foreign_files_and_bad_flags_are_refused(checkpoints, tmp_path, capsys):
    path = tmp_path / "foreign.npz"
    np.savez(path, x=np.zeros(3))
    assert "records no flags" in refused([path], capsys)
    np.savez(path, args=json.dumps({"lr": 0.1}))
    assert "flags are those of none of" in refused([path], capsys)
    np.savez(path, args=np.array([{"lr": 0.1}], dtype=object))  # pickled
    assert "is not a readable checkpoint" in refused([path], capsys)
    assert "is not a readable checkpoint" in refused([tmp_path / "missing.npz"], capsys)
    assert "--episodes 0 must be at least 1" in refused([checkpoints["catch"], "--episodes", 0], capsys)
    assert "--gif-every 0 must be at least 1" in refused([checkpoints["catch"], "--gif-every", 0], capsys)


def test_more_envs_than_int32_seeds_allow_is_refused_by_name_before_the_checkpoint_is_read(tmp_path, capsys):
    missing = tmp_path / "missing.npz"  # It is read after the flags, so a bad flag is the error.
    assert refused([missing, "--num-envs", 3 * 10**9, "--episodes", 3 * 10**9], capsys) == (
        "error: --num-envs 3,000,000,000 must be at most 2,147,483,647 (envpool seeds env i with --seed + i, an int32)")
    assert refused([missing, "--num-envs", 2**31 - 1, "--episodes", 3 * 10**9, "--seed", 1], capsys) == (
        "error: --seed 1 must be in 0..0")  # At the most envs there can be, only seed 0 is left.
    assert "is not a readable checkpoint" in refused([missing, "--num-envs", 3 * 10**9, "--episodes", 5], capsys)


def test_a_gif_that_cannot_be_written_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    (tmp_path / "folder.gif").mkdir()
    (tmp_path / "file").touch()
    for gif, words in [(tmp_path / "folder.gif", "cannot write there (Is a directory)"),
                       (tmp_path / "game.txt", "the file's name must end in .gif"),
                       (tmp_path / "no" / "game.gif", "cannot write there (No such file or directory)"),
                       (tmp_path / "file" / "game.gif", "cannot write there (Not a directory)"),
                       (Path("/sys/game.gif"), "cannot write there")]:  # read-only, even for root
        line = refused([tmp_path / "missing.npz", "--gif", gif], capsys)
        assert line.startswith(f"error: --gif {gif}: {words}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder.gif"]


def test_a_checkpoint_whose_arrays_do_not_fit_its_flags_is_refused(checkpoints, tmp_path, capsys):
    with np.load(checkpoints["pendulum"], allow_pickle=False) as f:
        arrays = dict(f)
    flags = json.loads(str(arrays.pop("args")))
    path = tmp_path / "cartpole_flags.npz"
    np.savez(path, **arrays, args=json.dumps({**flags, "env_id": "CartPole-v1"}))  # 3 inputs: not CartPole's
    line = refused([path], capsys)
    assert "does not match anakin_ppo.py's network" in line and "state/params/actor/layer0/w" in line


def test_a_checkpoint_whose_env_id_names_a_module_imports_it_only_when_the_user_allows_it(tmp_path, monkeypatch,
                                                                                          capsys):
    (tmp_path / "planted.py").write_text("from pathlib import Path\nPath(__file__).with_name('ran').touch()\n")
    monkeypatch.syspath_prepend(tmp_path)  # importable, as a module beside the repository's files would be
    path = tmp_path / "checkpoint.npz"
    np.savez(path, args=json.dumps(dataclasses.asdict(load("sebulba_impala.py").Args(env_id="planted:CartPole-v1"))))
    assert refused([path], capsys) == (f"error: {path} records --env-id 'planted:CartPole-v1', which imports module "
                                       "'planted' (runs its code): add --allow-import planted if you trust it")
    assert not (tmp_path / "ran").exists()
    line = refused([path, "--allow-import", "planted"], capsys)  # imported, then found to hold no network
    assert (tmp_path / "ran").exists() and "does not match sebulba_impala.py's network" in line


def test_more_games_or_envs_than_memory_holds_are_refused_before_any_is_played(tmp_path, capsys):
    path = tmp_path / "checkpoint.npz"
    np.savez(path, args=json.dumps(dataclasses.asdict(load("anakin_catch.py").Args())))  # flags, then no network
    line = refused([path, "--episodes", 10**12], capsys)  # 16 bytes a game: 16 TB
    assert re.match(r"error: --num-envs 16 and --episodes 1,000,000,000,000 would need [\d,.]+ GiB, more than the "
                    r"[\d,.]+ GiB here$", line)
    np.savez(path, args=json.dumps(dataclasses.asdict(load("sebulba_impala.py").Args(env_id="Breakout-v5"))))
    line = refused([path, "--episodes", 10**6, "--num-envs", 10**6], capsys)  # 1.3 MB an Atari env: 1.3 TB
    assert re.match(r"error: --num-envs 1,000,000 and --episodes 1,000,000 would need [\d,.]+ GiB", line)


def test_a_few_envs_play_many_games_each_to_its_end(checkpoints, monkeypatch):
    catch = evaluate.main([str(checkpoints["catch"]), "--greedy", "--episodes", "50", "--num-envs", "4"])
    assert len(catch.scores) == 50 and set(catch.lengths) == {9}  # every game whole: the ball falls nine rows
    impala, made = load("sebulba_impala.py"), []
    make_envs = impala.make_envs

    def counting_make_envs(args, num_envs, seeds):
        made.append(num_envs)
        return make_envs(args, num_envs, seeds)

    monkeypatch.setattr(impala, "make_envs", counting_make_envs)
    cartpole = evaluate.main([str(checkpoints["impala cartpole"]), "--episodes", "7", "--num-envs", "3"])
    assert made == [3] and len(cartpole.scores) == 7 and (cartpole.lengths >= 1).all()
    # CartPole scores 1 a step: each game's score is its length, so none was cut short or joined to another.
    np.testing.assert_array_equal(cartpole.scores, cartpole.lengths)


def test_ctrl_c_while_playing_ends_at_once_with_the_figures_of_the_games_played(checkpoints, tmp_path):
    proc = spawn("tests/evaluate.py", [checkpoints["catch"], "--episodes", 10**7], tmp_path)
    killer = threading.Timer(120, proc.kill)  # a hung process fails the test instead of hanging it
    killer.start()
    try:
        lines = [proc.stdout.readline()]
        while lines[-1] and not re.match(r"games [1-9]", lines[-1]):  # a progress line after games have ended
            lines.append(proc.stdout.readline())
        proc.send_signal(signal.SIGINT)
        tic = time.monotonic()
        rest = proc.communicate()[0]
        seconds = time.monotonic() - tic
    finally:
        killer.cancel()
        proc.kill()
    output = "".join(lines) + rest
    assert re.match(r"games [\d,]+/10,000,000 \| mean score -?[\d.]+ \| \d+ s$", lines[-1].strip()), output
    assert proc.returncode == 130 and seconds < 5, (proc.returncode, seconds, output)
    stopped, figures, score, length = rest.splitlines()[-4:]
    assert re.match(r"stopped by SIGINT after [\d,]+ of 10,000,000 games$", stopped), output
    assert re.match(r"[\d,]+ games, sampled actions, seed 0: [\d.]+ s$", figures), output
    assert score.startswith("score   mean") and length.startswith("length  mean 9.0"), output
    assert "Traceback" not in output


def with_flags(checkpoint, path, **changes):
    """A copy of a checkpoint whose recorded flags are changed."""
    with np.load(checkpoint, allow_pickle=False) as f:
        arrays = dict(f)
    np.savez(path, **{**arrays, "args": json.dumps({**json.loads(str(arrays["args"])), **changes})})
    return path


@pytest.mark.parametrize("changes, words", [
    ({"env_id": ["CartPole-v1"]}, '--env-id ["CartPole-v1"], which is not str'),
    ({"env_id": 3}, "--env-id 3, which is not str"),
    ({"seed": 1.5}, "--seed 1.5, which is not int"),
    ({"actor_device_ids": [0.5]}, "--actor-device-ids [0.5], which is not list[int]"),
])
def test_recorded_flags_of_the_wrong_type_are_refused(checkpoints, tmp_path, capsys, changes, words):
    path = with_flags(checkpoints["impala cartpole"], tmp_path / "typed.npz", **changes)
    assert refused([path], capsys) == f"error: {path} records {words} (a damaged or edited file?)"


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_an_agent_whose_parameters_are_not_finite_is_refused(checkpoints, tmp_path, capsys, bad):
    with np.load(checkpoints["catch"], allow_pickle=False) as f:
        arrays = dict(f)
    name = next(name for name in arrays if name.startswith("state/params/"))
    arrays[name] = np.where(np.arange(arrays[name].size).reshape(arrays[name].shape) == 0, bad, arrays[name])
    np.savez(tmp_path / "diverged.npz", **{**arrays, name: arrays[name].astype(np.float32)})
    assert refused([tmp_path / "diverged.npz"], capsys) == (f"error: {tmp_path / 'diverged.npz'}: this agent's "
                                                            "parameters are not finite: its run diverged")


def test_gif_every_past_what_a_gif_frame_can_last_or_past_the_game_is_refused(checkpoints, tmp_path, capsys):
    line = refused([checkpoints["catch"], "--gif", tmp_path / "game.gif", "--gif-every", 3000], capsys)
    assert line == ("error: --gif-every 3000: a frame would show 3000 steps of 0.25 s, longer than a GIF frame can "
                    "last (655.35 s): at most 2621")
    assert not (tmp_path / "game.gif").exists()
    line = refused([checkpoints["catch"], "--gif", tmp_path / "game.gif", "--gif-every", 9], capsys)  # after play
    assert line == ("error: --gif-every 9: game 1 lasted 9 steps, so its GIF would be one picture (take fewer than 9); "
                    "no GIF was written")
    assert not (tmp_path / "game.gif").exists()


def test_a_gif_that_cannot_be_written_whole_leaves_no_file(checkpoints, tmp_path):
    gif = tmp_path / "game.gif"
    argv = shlex.join([sys.executable, str(ROOT / "tests/evaluate.py"), str(checkpoints["pendulum"]), "--episodes",
                       "1", "--gif", str(gif)])
    # `ulimit -f 4`: files of 4 KiB at most, a longer write fails as on a full disk (the GIF of 200 steps: about 47 KB)
    result = subprocess.run(["bash", "-c", f"ulimit -f 4 && exec {argv}"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2 and "1 games, sampled actions" in result.stdout, result.stdout + result.stderr
    assert result.stderr == f"error: --gif {gif}: cannot write it (File too large); no GIF was left\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == []
