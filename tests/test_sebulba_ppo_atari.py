"""Tests of sebulba_ppo_atari.py: GAE and PPO pieces against NumPy, the learner update, acting
against the original env, device layouts, two hosts, faults, bad input and resume."""

import hashlib
import signal
import time
from collections import defaultdict

import numpy as np
import pytest

from conftest import checksum, error_line, load, patched, run, run_two_hosts, spawn

SCRIPT = "sebulba_ppo_atari.py"
# A tiny Breakout run: 8 steps x 4 envs per actor thread, one epoch of two minibatches.
TINY = ["--env-id", "Breakout-v5", "--num-steps", "8", "--local-num-envs", "4", "--num-actor-threads", "1",
        "--update-epochs", "1", "--num-minibatches", "2"]


@pytest.fixture(scope="module")
def ppo():
    return load(SCRIPT)


# ---- GAE and the PPO loss pieces ---------------------------------------------------------

def numpy_gae(rewards, values, terminated, dones, gamma, lam):
    """GAE as the forward sum over each step's own episode: A_t = sum_k (gamma lam)^k delta_{t+k},
    stopping after the first step that ends the episode (terminated or truncated)."""
    T, E = rewards.shape
    adv = np.zeros((T, E))
    for e in range(E):
        for t in range(T):
            for k in range(t, T):
                delta = rewards[k, e] + gamma * values[k + 1, e] * (1 - terminated[k, e]) - values[k, e]
                adv[t, e] += (gamma * lam) ** (k - t) * delta
                if dones[k, e]:
                    break
    return adv


def test_gae_matches_numpy_with_terminations_truncations_and_autoreset_steps(ppo):
    rng = np.random.default_rng(0)
    T, E = 24, 5
    rewards, values = rng.normal(size=(T, E)), rng.normal(size=(T + 1, E))
    terminated = (rng.random((T, E)) < 0.1).astype(np.float32)
    truncated = (rng.random((T, E)) < 0.1) * (1 - terminated)
    dones = np.maximum(terminated, truncated).astype(np.float32)
    # envpool's autoreset step after each end: reward 0, its action did nothing.
    rewards[1:][dones[:-1] == 1] = 0.0
    got = np.asarray(ppo.gae(*(x.astype(np.float32) for x in (rewards, values, terminated, dones)), 0.99, 0.95))
    np.testing.assert_allclose(got, numpy_gae(rewards, values, terminated, dones, 0.99, 0.95), rtol=1e-4, atol=1e-4)


def test_gae_bootstraps_truncation_from_final_obs_and_ignores_the_autoreset_step(ppo):
    # Step 1 is truncated; step 2 is envpool's autoreset step (values[2] = V(final obs)).
    rewards = np.array([[1.0], [1.0], [0.0], [1.0]], np.float32)
    values = np.array([[0.5], [0.5], [10.0], [0.5], [0.5]], np.float32)
    terminated, dones = np.zeros((4, 1), np.float32), np.array([[0], [1], [0], [0]], np.float32)
    adv = np.asarray(ppo.gae(rewards, values, terminated, dones, 0.9, 1.0))
    assert adv[1, 0] == pytest.approx(1.0 + 0.9 * 10.0 - 0.5)  # truncation bootstraps from V(final obs)
    assert adv[0, 0] == pytest.approx(1.0 + 0.9 * 0.5 - 0.5 + 0.9 * adv[1, 0])
    changed = np.asarray(ppo.gae(rewards + np.array([[0], [0], [100], [100]], np.float32), values, terminated,
                                 dones, 0.9, 1.0))
    np.testing.assert_allclose(changed[:2], adv[:2])  # nothing after the end leaks into the old episode
    terminated[1, 0] = 1.0  # a real termination does not bootstrap
    assert np.asarray(ppo.gae(rewards, values, terminated, dones, 0.9, 1.0))[1, 0] == pytest.approx(0.5)


def test_clipped_surrogate_takes_the_pessimistic_term(ppo):
    ratio = np.array([1.5, 0.5, 1.5, 0.5, 1.05], np.float32)
    adv = np.array([1.0, 1.0, -1.0, -1.0, 2.0], np.float32)
    expected = [-1.1, -0.5, 1.5, 0.9, -2.1]  # clip 0.1: gains capped, losses kept
    np.testing.assert_allclose(ppo.clipped_surrogate(ratio, adv, 0.1), expected, rtol=1e-6)


def test_decoupled_loss_is_ppo_when_the_proximal_policy_is_the_behaviour_policy(ppo):
    import jax

    rng = np.random.default_rng(4)
    behaviour = np.log(rng.uniform(0.1, 0.9, 64)).astype(np.float32)
    logp = behaviour + rng.uniform(-0.3, 0.3, 64).astype(np.float32)  # ratios on both sides of the window
    adv = rng.normal(size=64).astype(np.float32)
    decoupled = lambda lp: ppo.decoupled_surrogate(lp, behaviour, behaviour, adv, 0.1)
    plain = lambda lp: ppo.clipped_surrogate(jax.numpy.exp(lp - behaviour), adv, 0.1)
    np.testing.assert_allclose(decoupled(logp), plain(logp), rtol=1e-6)
    grad = lambda f: np.asarray(jax.grad(lambda lp: f(lp).sum())(logp))
    np.testing.assert_allclose(grad(decoupled), grad(plain), rtol=1e-6)
    assert (grad(plain) == 0).any() and (grad(plain) != 0).any()


def test_decoupled_loss_learns_from_samples_the_lag_put_outside_the_window(ppo):
    import jax

    # pi == pi_prox, but mu (one update older) makes pi / mu 0.5 / 0.3 and 0.3 / 0.5: outside the
    # 0.1 window in the direction the advantage pushes, so plain PPO gives these samples no gradient.
    logp = prox = np.log(np.array([0.5, 0.3], np.float32))
    behaviour = np.log(np.array([0.3, 0.5], np.float32))
    adv = np.array([1.0, -1.0], np.float32)
    plain = jax.grad(lambda lp: ppo.clipped_surrogate(jax.numpy.exp(lp - behaviour), adv, 0.1).sum())(logp)
    np.testing.assert_array_equal(plain, [0.0, 0.0])
    grad_logp, grad_prox = jax.grad(lambda lp, px: ppo.decoupled_surrogate(lp, px, behaviour, adv, 0.1).sum(),
                                    argnums=(0, 1))(logp, prox)
    np.testing.assert_allclose(grad_logp, -np.exp(prox - behaviour) * adv, rtol=1e-6)  # weight pi_prox / mu
    np.testing.assert_array_equal(grad_prox, [0.0, 0.0])  # pi_prox and the weight are constants


def test_clipped_value_loss_and_entropy_on_hand_cases(ppo):
    v, old, ret = (np.array(x, np.float32) for x in ([2.0, 0.0, 1.05], [1.0, 0.0, 1.0], [3.0, 1.0, 1.0]))
    # case 0: clipped value 1.1 is further from 3 -> 0.5 * 1.9^2; case 2: unclipped 1.05 -> 0.5 * 0.05^2
    np.testing.assert_allclose(ppo.clipped_value_loss(v, old, ret, 0.1), [0.5 * 1.9 ** 2, 0.5, 0.5 * 0.05 ** 2],
                               rtol=1e-5)
    np.testing.assert_allclose(ppo.entropy(np.zeros((1, 4), np.float32)), [np.log(4)], rtol=1e-6)
    assert float(ppo.entropy(np.array([[100.0, 0.0, 0.0]], np.float32))[0]) == pytest.approx(0.0, abs=1e-6)


def test_advantage_normalisation_spans_all_learners_and_skips_masked_samples(ppo):
    import jax

    rng = np.random.default_rng(1)
    adv = rng.normal(3.0, 2.0, size=(2, 6)).astype(np.float32)  # 2 learners x 6 samples
    mask = np.ones((2, 6), np.float32)
    mask[0, :2] = 0
    got = np.asarray(jax.vmap(ppo.normalize, axis_name="learners")(adv, mask))
    valid = adv[mask == 1]
    np.testing.assert_allclose(got[mask == 1], (valid - valid.mean()) / valid.std(), rtol=1e-4, atol=1e-5)


def test_uint8_frames_are_scaled_and_bool_or_float_inputs_enter_as_they_are(ppo):
    import jax

    params = ppo.init_params(jax.random.PRNGKey(0), (4, 84, 84), 4)
    frames = np.random.default_rng(3).integers(0, 256, (2, 4, 84, 84), dtype=np.uint8)
    bits = frames > 127
    same = lambda a, b: [np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
                         for x, y in zip(ppo.apply(params, a), ppo.apply(params, b))]
    same(frames, frames.astype(np.float32) / 255)
    same(bits, bits.astype(np.float32))
    np.testing.assert_array_equal(ppo.image_input(bits), np.transpose(bits, (0, 2, 3, 1)).astype(np.float32))
    floats = frames.astype(np.float32)
    np.testing.assert_array_equal(ppo.image_input(floats), np.transpose(floats, (0, 2, 3, 1)))


def test_small_images_get_the_minatar_network_and_atari_frames_the_nature_cnn(ppo):
    import jax

    for shape, kernels, hidden in (((4, 10, 10), [3], 128), ((4, 84, 84), [8, 4, 3], 512)):
        params = ppo.init_params(jax.random.PRNGKey(0), shape, 3)
        convs = sorted(k for k in params["torso"] if k.startswith("conv"))
        assert [params["torso"][k]["w"].shape[0] for k in convs] == kernels
        assert params["torso"]["dense"]["w"].shape[1] == hidden
        logits, values = ppo.apply(params, np.zeros((5, *shape), bool))
        assert logits.shape == (5, 3) and values.shape == (5,)


def test_images_too_small_for_a_convolution_are_refused_before_anything_runs(ppo, monkeypatch, capsys):
    monkeypatch.setattr(ppo, "describe_env", lambda *_: ppo.EnvInfo((1, 2, 5), 3, "gymnasium", False))
    with pytest.raises(SystemExit) as exit:
        ppo.check_args(ppo.Args(env_id="tiny"))
    assert exit.value.code == 2 and "below 3x3" in capsys.readouterr().err


# ---- The learner update and acting --------------------------------------------------------

def test_repeated_updates_on_one_batch_favour_positive_advantage_actions_and_fit_values(ppo):
    import jax
    from jax.sharding import Mesh

    args = ppo.Args(update_epochs=2, num_minibatches=2, learning_rate=1e-3, anneal_lr=False)
    rng = np.random.default_rng(2)
    T, E, A = 8, 4, 4
    state = ppo.init_state(jax.random.PRNGKey(0), args, ppo.EnvInfo((4, 84, 84), A, "envpool", True), 100)
    obs = rng.integers(0, 255, (T, E, 4, 84, 84), dtype=np.uint8)
    logits, values = jax.vmap(ppo.apply, (None, 0))(state.params, obs)
    actions = rng.integers(0, A, (T, E))
    logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), actions[..., None], -1)[..., 0]
    values = np.concatenate([np.asarray(values), np.zeros((1, E), np.float32)])
    rewards = rng.choice([-1.0, 1.0], (T, E)).astype(np.float32)
    zeros = np.zeros((T, E), np.float32)
    rollout = ppo.Rollout(obs, actions.astype(np.int32), logp.astype(np.float32), values, rewards, zeros, zeros,
                          np.ones((T, E), np.float32))
    adv = np.asarray(ppo.gae(rewards, values, zeros, zeros, args.gamma, args.gae_lambda))
    returns = adv + values[:-1]
    update = ppo.make_update(args, Mesh(np.array(jax.devices()[:1]), ("learners",)), 100)

    def measure(params):
        logits, v = jax.vmap(ppo.apply, (None, 0))(params, obs)
        lp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), actions[..., None], -1)[..., 0]
        return lp[adv > 0].mean(), lp[adv < 0].mean(), np.mean((np.asarray(v) - returns) ** 2)

    before = measure(state.params)
    state, losses = update(state, [rollout])
    assert float(losses.clipfrac_first) == 0  # pi_prox == mu: the rollout's own parameters
    for _ in range(4):  # the same rollout again: its log-probs go stale, as under policy lag
        state, losses = update(state, [rollout])
    after = measure(state.params)
    assert after[0] > before[0] + 0.05, (before, after)  # positive-advantage actions more likely
    assert after[1] < before[1] - 0.05, (before, after)  # negative-advantage actions less likely
    assert after[2] < 0.8 * before[2], (before, after)  # values closer to the returns
    assert float(losses.approx_kl) > 0 and 0 <= float(losses.clipfrac) <= 1
    assert float(losses.clipfrac_first) > 0  # samples whose pi / mu left the window


@pytest.mark.parametrize("async_envs", [False, True], ids=["one-batch", "two-halves-taking-turns"])
def test_collect_returns_unclipped_whole_game_scores_and_marks_autoreset_steps(ppo, async_envs):
    """Replays the rollout's actions in a fresh env and scores the games independently."""
    import jax

    args = ppo.Args(seed=7, local_num_envs=2, async_envs=async_envs, num_steps=600)
    params = ppo.init_params(jax.random.PRNGKey(0), (4, 84, 84), 4)
    groups, states = ppo.start_groups(args, 0, jax.devices()[0], 0)
    assert len(groups) == (2 if async_envs else 1)
    stats = ppo.ActorStats(returns=[], lengths=[], lag=0, timings=defaultdict(float))
    rollout, _ = ppo.collect(args, groups, params, states, stats)
    assert rollout.values.shape == (601, 2) and rollout.obs.shape == (600, 2, 4, 84, 84)

    replay = ppo.make_envs(args, 2, [s for envs in groups for s in envs.seeds]).pool  # the same games
    replay.reset()
    score, scores, life_losses, prev_done = np.zeros(2), [], 0, np.zeros(2, bool)
    for t in range(600):
        _, reward, term, trunc, info = replay.step(rollout.actions[t])
        np.testing.assert_array_equal(rollout.rewards[t], np.sign(info["reward"]))  # learning reward: clipped
        np.testing.assert_array_equal(rollout.valid[t], ~prev_done)  # step after an end: masked
        score += info["reward"]
        over = info["terminated"].astype(bool) | trunc
        life_losses += int((term & ~over).sum())
        scores += score[over].tolist()
        score[over], prev_done = 0, term | trunc
    assert len(scores) >= 2 and life_losses >= 2, (scores, life_losses)  # games spanning several lives
    assert sorted(stats.returns) == sorted(scores)
    assert len(stats.lengths) == len(stats.returns) and min(stats.lengths) > 20


def test_machado_envs_reset_and_step(ppo):
    envs = ppo.make_envs(ppo.Args(machado=True), 2, [3, 4]).pool
    obs, _ = envs.reset()
    for _ in range(5):
        obs, *_ = envs.step(np.random.default_rng(0).integers(0, 18, 2))
    assert obs.shape == (2, 4, 84, 84) and envs.action_space.n == 18  # the full action set
    assert envs.config["repeat_action_probability"] == 0.25 and not envs.config["episodic_life"]


# ---- Whole runs: learning, device layouts, policy lag, two hosts ----------------------------

def check_run(result, updates, envs):
    assert result.returncode == 0, result.output[-3000:]
    assert result.last("global_step") == updates * 8 * envs
    assert len(result.metrics) == updates
    for key in ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
                "losses/clipfrac", "losses/clipfrac_first", "charts/SPS", "charts/learning_rate", "stats/learner_time",
                "stats/inference_time", "stats/env_step_time"):
        assert np.isfinite(result.last(key)), key
    assert (result.run_dir / "checkpoint.npz").exists() and (result.run_dir / "args.json").exists()
    assert list(result.run_dir.glob("events.out.tfevents.*"))
    return [m["stats/param_lag"] for m in result.metrics]


@pytest.mark.parametrize("flags", [[], ["--async-envs"]], ids=["one-batch", "async-envs"])
def test_one_device_runs_with_at_most_one_update_of_lag(tmp_path, flags):
    result = run(SCRIPT, [*TINY, *flags, "--total-timesteps", 96], tmp_path)
    lags = check_run(result, updates=3, envs=4)
    assert max(lags) <= 1
    assert result.last("charts/learning_rate") < 2.5e-4  # annealed


def test_two_devices_actor_and_learner_without_lag_is_on_policy_and_reproducible(tmp_path):
    flags = [*TINY, "--total-timesteps", 64, "--actor-device-ids", 0, "--learner-device-ids", 1, "--no-policy-lag"]
    first = run(SCRIPT, flags, tmp_path / "a", devices=2)
    assert check_run(first, updates=2, envs=4) == [0, 0]
    assert [m["losses/clipfrac_first"] for m in first.metrics] == [0, 0]  # pi_prox == mu
    second = run(SCRIPT, flags, tmp_path / "b", devices=2)
    assert checksum(first.output) == checksum(second.output)  # exact on-policy runs are deterministic


def test_four_devices_two_actors_with_two_threads_and_two_learners(tmp_path):
    flags = ["--env-id", "Breakout-v5", "--num-steps", 8, "--local-num-envs", 2, "--num-actor-threads", 2,
             "--update-epochs", 1, "--num-minibatches", 2, "--total-timesteps", 128,
             "--actor-device-ids", 0, 1, "--learner-device-ids", 2, 3]
    result = run(SCRIPT, flags, tmp_path, devices=4)
    assert max(check_run(result, updates=2, envs=8)) <= 1


def test_two_hosts_end_with_identical_learner_parameters(tmp_path):
    flags = [*TINY, "--total-timesteps", 128, "--actor-device-ids", 0, "--learner-device-ids", 1]
    results = run_two_hosts(SCRIPT, flags, tmp_path)
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    assert checksum(results[0].output) == checksum(results[1].output)
    assert results[0].last("global_step") == 128  # 2 updates x 8 steps x 4 envs x 2 hosts
    assert results[1].metrics == []  # only process 0 writes the run folder


def test_minatar_breakout_from_bool_images_beats_random_play(tmp_path):
    from tests.minatar_envs import random_play

    random = random_play("MinAtar/Breakout-v1", episodes=200, seed=0)
    flags = ["--env-id", "tests.minatar_envs:MinAtar/Breakout-v1", "--num-actor-threads", 1, "--local-num-envs", 16,
             "--num-steps", 32, "--total-timesteps", 160_000, "--log-every", 20, "--seed", 3]
    result = run(SCRIPT, flags, tmp_path, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    trained = np.mean([row["charts/episodic_return"] for row in result.metrics[-3:]])
    assert trained > random + 1.5, (trained, random)


# ---- Faults, Ctrl-C, bad input, resume -------------------------------------------------------

# Faults go in from outside (`patched`), and travel through the script's real error paths: an
# envpool step raising inside an actor thread, a publish raising in the main thread.
ENV_FAULT = """
import time, envpool
from pathlib import Path
make = envpool.make
def faulty_make(*args, **kwargs):
    envs, calls = make(*args, **kwargs), [0]
    def faulty(method):  # envpool's step, and its recv (the actors send, then recv)
        def call(*a, **k):
            calls[0] += 1
            if calls[0] > 12:
                Path("fault_time").write_text(str(time.time()))
                raise RuntimeError("injected env fault")
            return method(*a, **k)
        return call
    envs.step, envs.recv = faulty(envs.step), faulty(envs.recv)
    return envs
envpool.make = faulty_make
"""
LEARNER_FAULT = """
import time
from pathlib import Path
publish, calls = script.ParamStore.publish, [0]
def faulty_publish(*args):  # on the main thread: in `main`, then after each update
    calls[0] += 1
    if calls[0] == 3:
        Path("fault_time").write_text(str(time.time()))
        raise RuntimeError("injected learner fault")
    return publish(*args)
script.ParamStore.publish = faulty_publish
"""


@pytest.mark.parametrize("patch,message", [(ENV_FAULT, "injected env fault"),
                                           (LEARNER_FAULT, "injected learner fault")])
def test_a_failing_thread_ends_the_run_with_its_traceback(tmp_path, patch, message):
    wrapper = patched(SCRIPT, patch, tmp_path / "wrapper.py")
    result = run(wrapper, [*TINY, "--total-timesteps", 100_000], tmp_path, timeout=300)
    ended = time.time()
    assert result.returncode not in (0, None), result.output[-3000:]
    assert "Traceback" in result.output and message in result.output, result.output[-3000:]
    assert "checksum" not in result.output
    assert ended - float((tmp_path / "fault_time").read_text()) < 30  # the run ends within 30 s


def test_ctrl_c_writes_a_loadable_checkpoint_and_exits(tmp_path):
    args = [*TINY, "--total-timesteps", 1_000_000, "--run-dir", tmp_path / "runs"]
    proc = spawn(SCRIPT, args, tmp_path)
    try:
        deadline = time.monotonic() + 400
        while not list((tmp_path / "runs").glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    ckpt = next((tmp_path / "runs").glob("*/checkpoint.npz"))
    with np.load(ckpt, allow_pickle=False) as f:
        assert int(f["update"]) >= 1 and int(f["global_step"]) == int(f["update"]) * 32
        assert any(name.startswith("state/params") for name in f.files)


def write_bad_checkpoint(path):
    np.savez(path, **{".params['value']['w']": np.zeros((3, 3), np.float32)})
    return path


@pytest.mark.parametrize("flags,devices,expect", [
    (["--env-id", "Breakout-v4"], 1, "--env-id"),
    (["--env-id", "CartPole-v1"], 1, "--env-id"),
    (["--num-minibatches", "3"], 1, "--num-minibatches"),
    (["--max-grad-norm", "0"], 1, "--max-grad-norm"),
    (["--local-num-envs", "3", "--learner-device-ids", "1", "2"], 3, "--local-num-envs"),
    ([], 4, "or --learner-device-ids (default: all but the actors)"),  # 3 learners by default, 4 envs
    (["--learner-device-ids", "4"], 2, "--learner-device-ids"),
    (["--actor-device-ids"], 1, "--actor-device-ids"),  # none: no actor
    (["--actor-device-ids", "0", "--learner-device-ids", "0", "1"], 2, "share a device"),
    (["--total-timesteps", "10"], 1, "--total-timesteps"),
    (["--async-envs", "--local-num-envs", "3"], 1, "--local-num-envs"),
    (["--resume", "missing.npz"], 1, "--resume"),
    (["--resume", "bad.npz"], 1, "--resume"),
])
def test_bad_input_is_one_error_line_with_status_2(tmp_path, flags, devices, expect):
    write_bad_checkpoint(tmp_path / "bad.npz")
    result = run(SCRIPT, [*TINY, *flags], tmp_path, devices=devices)
    assert expect in error_line(result)


def params_digest(ckpt):
    with np.load(ckpt, allow_pickle=False) as f:
        names = sorted(n for n in f.files if n.startswith("state/params"))
        return hashlib.sha256(b"".join(np.ascontiguousarray(f[n]).tobytes() for n in names)).hexdigest()


def test_resume_continues_from_the_checkpoint(tmp_path):
    first = run(SCRIPT, [*TINY, "--total-timesteps", 64], tmp_path / "a")
    assert first.returncode == 0, first.output[-3000:]
    ckpt = first.run_dir / "checkpoint.npz"
    assert params_digest(ckpt) == checksum(first.output)
    resumed = run(SCRIPT, [*TINY, "--total-timesteps", 128, "--resume", ckpt], tmp_path / "b")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [m["update"] for m in resumed.metrics] == [3, 4]
    assert resumed.metrics[0]["global_step"] == 96
    with np.load(ckpt) as before, np.load(resumed.run_dir / "checkpoint.npz") as after:
        counts = [n for n in before.files if n.endswith("count")]  # Adam's steps so far
        assert counts and all(int(after[n]) == 2 * int(before[n]) > 0 for n in counts)  # 2 updates, then 2 more
    again = run(SCRIPT, [*TINY, "--total-timesteps", 64, "--resume", ckpt], tmp_path / "c")  # no update left
    assert "--resume" in error_line(again)
