"""Tests of sebulba_impala.py: V-trace and the loss against NumPy references of the IMPALA
paper, the networks' inputs and shapes, episode bookkeeping against envpool's own counters,
learning on CartPole and on MinAtar's images, a custom gymnasium env, Atari device layouts
and --machado, two hosts, faults, Ctrl-C and resume, divergence, bad input."""

import signal
import time
from collections import defaultdict
from functools import partial

import numpy as np
import pytest

from conftest import checksum, error_line, load, run, run_two_hosts, spawn

SCRIPT = "sebulba_impala.py"
MINATAR = "tests.minatar_envs:MinAtar/Breakout-v1"  # tests/minatar_envs.py registers MinAtar's ids

# Environments registered by the tests, imported by the script through `test_envs:Name-v0`.
# Every episode of Fixed lasts 7 steps and scores 7; Crash raises inside an actor thread
# after 40 steps; NanReward hands the learner a NaN reward after 40 steps; Hang's step never returns
# after 40 steps. These three write the time of their first fault so a test can bound how long the
# run takes to end after it. FromOne numbers its two actions 1 and 2.
TEST_ENVS = '''
import time
import gymnasium as gym
import numpy as np


class Fixed(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)
    fault = None

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.total = 0, getattr(self, "total", 0)
        return np.full(3, 0.5, np.float32), {}

    def step(self, action):
        self.t, self.total = self.t + 1, self.total + 1
        reward = 1.0
        if self.fault and self.total > 40:
            if self.total == 41:  # once: a run exiting mid-write would leave the file empty
                with open("fault_time", "w") as f:
                    f.write(repr(time.time()))
            if self.fault == "crash":
                raise RuntimeError("injected actor fault")
            if self.fault == "hang":
                time.sleep(3600)
            reward = float("nan")
        return np.full(3, self.t / 7, np.float32), reward, self.t == 7, False, {}


class Crash(Fixed):
    fault = "crash"


class NanReward(Fixed):
    fault = "nan"


class Hang(Fixed):
    fault = "hang"


class FromOne(Fixed):
    action_space = gym.spaces.Discrete(2, start=1)


gym.register("Fixed-v0", entry_point=Fixed)
gym.register("Hang-v0", entry_point=Hang)
gym.register("FromOne-v0", entry_point=FromOne)
gym.register("Crash-v0", entry_point=Crash)
gym.register("NanReward-v0", entry_point=NanReward)
'''


@pytest.fixture
def envs_path(tmp_path):
    (tmp_path / "test_envs.py").write_text(TEST_ENVS)
    return {"PYTHONPATH": str(tmp_path)}


@pytest.fixture(scope="module")
def impala():
    return load(SCRIPT)


def finite_losses(result):
    for row in result.metrics:
        for key in ("losses/loss", "losses/policy_loss", "losses/value_loss", "losses/entropy"):
            assert np.isfinite(row[key]), row


# --- V-trace and the loss, against the IMPALA paper's formulas in NumPy ------------------


def vtrace_reference(values, rewards, discounts, rhos, valid, lam):
    """IMPALA paper eq. (1) as its explicit sum:
    v_s = V(x_s) + sum_t (prod_{i<t} gamma_i c_i) rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),
    summing until the episode's reset step (invalid steps are not learned from)."""
    T, B = rewards.shape
    rho, c = np.minimum(1.0, rhos), lam * np.minimum(1.0, rhos)
    vs = values[:-1].copy()
    for b in range(B):
        for s in range(T):
            weight = 1.0
            for t in range(s, T):
                if not valid[t, b]:
                    break
                vs[s, b] += weight * rho[t, b] * (rewards[t, b] + discounts[t, b] * values[t + 1, b] - values[t, b])
                weight *= discounts[t, b] * c[t, b]
    vs_next = np.concatenate([vs[1:], values[-1:]])
    advantages = valid * rho * (rewards + discounts * vs_next - values[:-1])
    return vs, advantages


def random_rollout(rng, T, B):
    """Random V-trace inputs with episode ends inside the rollout (both kinds) and the reset
    step after each end marked invalid."""
    terminated = rng.random((T, B)) < 0.1
    truncated = rng.random((T, B)) < 0.05
    ended = terminated | truncated
    valid = np.ones((T, B), bool)
    valid[1:] = ~ended[:-1]
    return terminated, valid


def test_vtrace_matches_the_papers_sum_with_clipping_and_episode_ends(impala):
    rng = np.random.default_rng(0)
    T, B, gamma, lam = 12, 6, 0.97, 0.9
    terminated, valid = random_rollout(rng, T, B)
    values = rng.normal(size=(T + 1, B))
    rewards = rng.normal(size=(T, B))
    rhos = np.exp(rng.normal(0.0, 0.8, size=(T, B)))
    discounts = gamma * (1.0 - terminated)
    assert (rhos > 1).mean() > 0.2 and (rhos < 1).mean() > 0.2 and (~valid).any() and terminated.any()

    got = impala.vtrace(*(np.float32(x) for x in (values, rewards, discounts, rhos, valid)), lam)
    vs, advantages = vtrace_reference(values, rewards, discounts, rhos, valid, lam)
    np.testing.assert_allclose(got.vs, vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.pg_advantages, advantages, rtol=1e-5, atol=1e-5)


def test_vtrace_on_policy_with_lambda_one_is_the_discounted_return(impala):
    # pi = mu and lambda = 1: v_s is the n-step return bootstrapped at the rollout's end.
    T, gamma = 5, 0.9
    values = np.arange(T + 1, dtype=np.float32)[:, None]
    rewards = np.ones((T, 1), np.float32)
    got = impala.vtrace(values, rewards, np.full((T, 1), gamma, np.float32), np.ones((T, 1), np.float32),
                        np.ones((T, 1), np.float32), 1.0)
    expected = [sum(gamma ** k for k in range(T - s)) + gamma ** (T - s) * T for s in range(T)]
    np.testing.assert_allclose(got.vs[:, 0], expected, rtol=1e-6)


def test_impala_loss_pieces_are_sums_over_valid_steps_matching_numpy(impala):
    import jax

    rng = np.random.default_rng(1)
    T, B, A, gamma, lam, vf_coef, ent_coef = 6, 4, 3, 0.99, 0.95, 0.5, 0.01
    params = impala.init_params(jax.random.key(0), (5,), A, "mlp")
    terminated, valid = random_rollout(rng, T, B)
    batch = impala.Rollout(
        obs=rng.normal(size=(T + 1, B, 5)).astype(np.float32), actions=rng.integers(0, A, (T, B)).astype(np.int32),
        logits=rng.normal(size=(T, B, A)).astype(np.float32), rewards=rng.normal(size=(T, B)).astype(np.float32),
        terminated=terminated.astype(np.float32), valid=valid.astype(np.float32))
    args = impala.Args(gamma=gamma, vtrace_lambda=lam, vf_coef=vf_coef, ent_coef=ent_coef, network="mlp")
    _, info = jax.jit(lambda params, batch: impala.impala_loss(params, batch, args))(params, batch)

    outputs = jax.vmap(impala.apply, (None, 0, None))(params, batch.obs, "mlp")  # apply takes [N, ...]: map T + 1
    logits, values = (np.asarray(x, np.float64) for x in outputs)
    logp = logits[:-1] - np.log(np.exp(logits[:-1]).sum(-1, keepdims=True))
    mu = batch.logits - np.log(np.exp(batch.logits).sum(-1, keepdims=True))
    taken = lambda x: np.take_along_axis(x, batch.actions[..., None], -1)[..., 0]  # noqa: E731
    rhos = np.exp(taken(logp) - taken(mu))
    vs, advantages = vtrace_reference(values, batch.rewards, gamma * (1 - terminated), rhos, valid, lam)
    policy_loss = -(valid * taken(logp) * advantages).sum()
    value_loss = 0.5 * (valid * (vs - values[:-1]) ** 2).sum()
    entropy = -(valid * (np.exp(logp) * logp).sum(-1)).sum()
    np.testing.assert_allclose(
        [info.policy_loss, info.value_loss, info.entropy, info.loss],
        [policy_loss, value_loss, entropy, policy_loss + vf_coef * value_loss - ent_coef * entropy], rtol=1e-4)


def test_image_observations_get_the_impala_resnet(impala):
    import jax

    # Shapes only (eval_shape): the ResNet's arithmetic is XLA's own convolution and pooling.
    params = jax.eval_shape(lambda key: impala.init_params(key, (4, 84, 84), 6, "deep"), jax.random.key(0))
    torso = params["torso"]
    assert [torso[f"stack{i}"]["conv"]["w"].shape[-1] for i in range(3)] == [16, 32, 32]
    assert [sorted(torso[f"stack{i}"]) for i in range(3)] == [["block0", "block1", "conv"]] * 3
    assert torso["dense"]["w"].shape == (11 * 11 * 32, 256)  # 84 -> 42 -> 21 -> 11 after three pools
    logits, value = jax.eval_shape(partial(impala.apply, network="deep"), params,
                                   jax.ShapeDtypeStruct((3, 4, 84, 84), np.uint8))
    assert logits.shape == (3, 6) and value.shape == (3,)


def test_shallow_network_is_the_papers_two_conv_cnn(impala):
    import jax

    params = jax.eval_shape(lambda key: impala.init_params(key, (4, 84, 84), 6, "shallow"), jax.random.key(0))
    torso = params["torso"]
    assert torso["conv0"]["w"].shape == (8, 8, 4, 16) and torso["conv1"]["w"].shape == (4, 4, 16, 32)
    assert torso["dense"]["w"].shape == (9 * 9 * 32, 256)  # 84 -> 20 -> 9, no padding
    assert sorted(torso) == ["conv0", "conv1", "dense"]
    logits, value = jax.eval_shape(partial(impala.apply, network="shallow"), params,
                                   jax.ShapeDtypeStruct((3, 4, 84, 84), np.uint8))
    assert logits.shape == (3, 6) and value.shape == (3,)


def test_uint8_frames_are_scaled_and_other_images_enter_as_they_are(impala):
    frames = np.full((1, 2, 3, 3), 255, np.uint8)  # [N, C, H, W]
    np.testing.assert_array_equal(impala.image_input(frames), np.ones((1, 3, 3, 2)))
    flags = np.ones((1, 2, 3, 3), bool)  # MinAtar's observations are bool
    np.testing.assert_array_equal(impala.image_input(flags), np.ones((1, 3, 3, 2)))
    floats = np.full((1, 2, 3, 3), 0.5, np.float32)
    np.testing.assert_array_equal(impala.image_input(floats), np.full((1, 3, 3, 2), 0.5))


def test_rmsprop_adds_epsilon_outside_the_root_as_torchbeast_and_cleanba_do(impala):
    """Three updates against the formula in NumPy: clip the gradient to global norm 40, then
    nu = 0.99 nu + 0.01 g^2 (nu starts at 0) and a step of lr_t g / (sqrt(nu) + eps), lr_t annealed.
    With epsilon inside the root (optax's default) a gradient of 0.01 would move a weight 9 times
    less: sqrt(0.01) = 0.1 floors the denominator instead of 0.01."""
    args = impala.Args(learning_rate=6e-4, rmsprop_eps=0.01, max_grad_norm=40.0)
    optimizer = impala.make_optimizer(args, num_updates=10)
    params = {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    grads = [{"w": np.array([0.01, -0.02, 0.5], np.float32), "b": np.array([3.0, -1e-4], np.float32)},
             {"w": np.array([0.01, 0.03, -0.5], np.float32), "b": np.array([-2.0, 1e-4], np.float32)},
             {"w": np.array([60.0, 0.0, 0.0], np.float32), "b": np.array([0.0, 80.0], np.float32)}]  # clipped
    state, nu = optimizer.init(params), {k: np.zeros_like(v) for k, v in params.items()}
    for t, g in enumerate(grads):
        updates, state = optimizer.update(g, state, params)
        norm = np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        lr = 6e-4 * (1 - t / 10)
        for k in g:
            clipped = g[k] * min(1.0, 40.0 / norm)
            nu[k] = 0.99 * nu[k] + 0.01 * clipped**2
            np.testing.assert_allclose(updates[k], -lr * clipped / (np.sqrt(nu[k]) + 0.01), rtol=1e-5, err_msg=k)
    first, _ = optimizer.update(grads[0], optimizer.init(params), params)
    assert float(-first["w"][0]) > 0.9 * 6e-4  # 0.01 / (0.001 + 0.01) of a step, not 0.1 of one


# --- Episodes: the true game score, against envpool's own counters ------------------------


@pytest.mark.parametrize("async_envs", [False, True], ids=["one-batch", "two-halves-taking-turns"])
def test_episode_scores_are_unclipped_and_span_the_whole_game(impala, async_envs):
    """Collects with the policy, then replays its actions in a fresh envpool batch and scores the games there."""
    import envpool
    import jax

    # Space Invaders pays 5-30 points per alien and has 3 lives: clipping and life loss show.
    n, steps = 2, 1500
    args = impala.Args(env_id="SpaceInvaders-v5", seed=3, local_num_envs=n, async_envs=async_envs, num_steps=steps,
                       network="shallow")
    env = impala.describe_env(args.env_id, False)
    params = impala.init_params(jax.random.PRNGKey(0), env.obs_shape, env.num_actions, "shallow")
    groups, states = impala.start_groups(args, 0, jax.devices()[0], 0)
    assert len(groups) == (2 if async_envs else 1)
    stats = impala.ActorStats(returns=[], lengths=[], lag=0, timings=defaultdict(float))
    rollout, _ = impala.collect(args, groups, params, states, stats)
    seeds = [seed for envs in groups for seed in envs.seeds]  # the rollout's envs, group after group
    replay = envpool.make(args.env_id, env_type="gymnasium", num_envs=n, seed=seeds, **impala.atari_kwargs(False))
    replay.reset()
    score, clipped, life_losses, games = np.zeros(n), np.zeros(n), np.zeros(n, int), []
    for t in range(steps):
        _, reward, terminated, truncated, info = replay.step(rollout.actions[t])
        score, clipped = score + info["reward"], clipped + reward
        over = info["terminated"].astype(bool) | truncated
        life_losses += terminated & ~over
        games += [(score[b], info["elapsed_step"][b], clipped[b], life_losses[b]) for b in np.flatnonzero(over)]
        score[over], clipped[over], life_losses[over] = 0, 0, 0
    assert len(games) >= 2 and sorted(stats.returns) == sorted(g[0] for g in games)
    assert sorted(stats.lengths) == sorted(g[1] for g in games)  # agent steps of the whole game
    for true_score, _, clipped_score, lives_lost in games:
        assert true_score > clipped_score and lives_lost == 2  # unclipped; one game = all three lives


def test_machado_switch_gives_sticky_actions_and_the_full_action_set(impala):
    assert impala.describe_env("Pong-v5", False).num_actions == 6
    assert impala.describe_env("Pong-v5", True).num_actions == 18
    kwargs = impala.atari_kwargs(True)
    assert kwargs["repeat_action_probability"] == 0.25 and not kwargs["episodic_life"]


def test_machado_atari_run_resets_steps_and_learns_with_the_shallow_network(tmp_path):
    # A separate process: envpool crashes the whole interpreter on a bad --machado config.
    flags = [*ATARI, "--machado", "--network", "shallow", "--num-actor-threads", 1, "--total-timesteps", 2 * 2 * 8]
    result = run(SCRIPT, flags, tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert [row["global_step"] for row in result.metrics] == [16, 32]
    finite_losses(result)
    with np.load(result.run_dir / "checkpoint.npz", allow_pickle=False) as data:
        assert data["state/params/torso/conv0/w"].shape == (8, 8, 4, 16)
        assert data["state/params/policy/w"].shape == (256, 18)  # the full action set


# --- End to end ---------------------------------------------------------------------------


def test_cartpole_default_run_reaches_400(tmp_path):
    result = run(SCRIPT, ["--env-id", "CartPole-v1"], tmp_path, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert result.last("charts/episodic_return") >= 400
    assert result.last("global_step") <= 300_000
    checksum(result.output)


def test_custom_gymnasium_env_runs_end_to_end_with_exact_episode_scores(tmp_path, envs_path):
    flags = ["--env-id", "test_envs:Fixed-v0", "--local-num-envs", 4, "--num-steps", 8, "--num-actor-threads", 1,
             "--total-timesteps", 320, "--log-every", 2, "--checkpoint-every", 2, "--learning-rate", 1e-3,
             "--no-anneal-lr", "--gamma", 0.9, "--vtrace-lambda", 0.95, "--ent-coef", 0.02, "--vf-coef", 0.25,
             "--max-grad-norm", 1.0, "--rmsprop-eps", 1e-4, "--exp-name", "fixed", "--seed", 5]
    result = run(SCRIPT, flags, tmp_path, env=envs_path)
    assert result.returncode == 0, result.output[-3000:]
    assert [row["global_step"] for row in result.metrics] == [32, 64, 128, 192, 256, 320]  # first, every 2nd
    assert {row["charts/episodic_return"] for row in result.metrics} == {7.0}
    assert {row["charts/episodic_length"] for row in result.metrics} == {7.0}
    assert {row["charts/learning_rate"] for row in result.metrics} == {1e-3}
    assert all(row["stats/param_lag"] <= 1 for row in result.metrics)
    finite_losses(result)
    assert result.run_dir.name.startswith("test_envs_Fixed-v0__fixed__5__")
    assert (result.run_dir / "checkpoint.npz").exists()


def test_minatar_breakout_from_bool_images_beats_random_play(tmp_path):
    from tests.minatar_envs import random_play

    random = random_play("MinAtar/Breakout-v1", episodes=200, seed=0)
    result = run(SCRIPT, ["--env-id", MINATAR, "--total-timesteps", 160_000, "--seed", 3], tmp_path, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    trained = np.mean([row["charts/episodic_return"] for row in result.metrics[-3:]])
    assert trained > random + 1.5, (trained, random)
    assert result.run_dir.parent == tmp_path / "runs"  # the namespaced id gives a flat folder name
    assert result.run_dir.name.startswith("tests.minatar_envs_MinAtar_Breakout-v1__sebulba_impala__3__")


ATARI = ["--env-id", "Breakout-v5", "--local-num-envs", 2, "--num-steps", 8, "--log-every", 1]


@pytest.mark.parametrize("devices,layout,threads", [
    (1, [], 2),
    (1, ["--async-envs"], 2),
    (2, ["--actor-device-ids", 0, "--learner-device-ids", 1], 1),
    (4, ["--actor-device-ids", 0, 1, "--learner-device-ids", 2, 3], 2),
], ids=["1-device", "1-device-async-envs", "actor0-learner1", "actors01x2-learners23"])
def test_atari_runs_a_few_updates_on_each_device_layout(tmp_path, devices, layout, threads):
    actor_threads = threads * (2 if devices == 4 else 1)
    batch = 2 * 8 * actor_threads
    flags = [*ATARI, *layout, "--num-actor-threads", threads, "--total-timesteps", 3 * batch]
    result = run(SCRIPT, flags, tmp_path, devices=devices)
    assert result.returncode == 0, result.output[-3000:]
    assert [row["global_step"] for row in result.metrics] == [batch, 2 * batch, 3 * batch]
    assert all(row["stats/param_lag"] <= 1 for row in result.metrics)
    finite_losses(result)


def test_two_hosts_finish_with_identical_learner_params(tmp_path):
    flags = ["--env-id", "CartPole-v1", "--local-num-envs", 8, "--num-steps", 16, "--num-actor-threads", 1,
             "--total-timesteps", 2 * 8 * 16 * 6, "--log-every", 3]
    first, second = run_two_hosts(SCRIPT, flags, tmp_path, devices=2)
    assert first.returncode == 0 and second.returncode == 0, first.output[-2000:] + second.output[-2000:]
    assert checksum(first.output) == checksum(second.output)
    assert first.last("global_step") == 2 * 8 * 16 * 6  # steps of both hosts
    assert second.run_dir is None  # only process 0 writes a run folder


# --- Faults, Ctrl-C and resume --------------------------------------------------------------


@pytest.mark.parametrize("env_id,message", [
    ("test_envs:Crash-v0", "Traceback"),  # the actor thread's
    ("test_envs:NanReward-v0", "error: the run diverged: non-finite losses/"),  # one line, no traceback
])
def test_a_failing_thread_or_a_nan_ends_the_run_quickly(tmp_path, envs_path, env_id, message):
    flags = ["--env-id", env_id, "--local-num-envs", 2, "--num-steps", 4, "--num-actor-threads", 1,
             "--total-timesteps", 10**6]
    result = run(SCRIPT, flags, tmp_path, env=envs_path, timeout=180)
    ended = time.time()
    assert result.returncode not in (0, 2), result.output[-3000:]
    assert message in result.output, result.output[-3000:]
    if "Crash" in env_id:
        assert "injected actor fault" in result.output
    else:
        assert "Traceback" not in result.output and "losses/loss" in result.output
    assert ended - float((tmp_path / "fault_time").read_text()) < 30


def test_a_second_ctrl_c_ends_a_run_whose_env_hangs_at_once(tmp_path, envs_path):
    flags = ["--env-id", "test_envs:Hang-v0", "--local-num-envs", 2, "--num-steps", 4, "--num-actor-threads", 1,
             "--total-timesteps", 10**6, "--run-dir", tmp_path / "runs"]
    proc = spawn(SCRIPT, flags, tmp_path, env=envs_path)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "fault_time").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # the learner now waits for a rollout that never comes
        proc.send_signal(signal.SIGINT)
        time.sleep(2)
        assert proc.poll() is None  # the first only asks for a stop at the next update
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGINT and time.monotonic() - sent < 5
    finally:
        proc.kill()


def test_a_diverging_run_writes_no_checkpoint_with_non_finite_parameters(tmp_path):
    flags = ["--env-id", "CartPole-v1", "--num-actor-threads", 1, "--local-num-envs", 2, "--num-steps", 8,
             "--total-timesteps", 64, "--learning-rate", 1e308, "--checkpoint-every", 1]
    result = run(SCRIPT, flags, tmp_path)
    assert result.returncode == 1, result.output[-3000:]
    assert "error: the run diverged: non-finite parameters after update " in result.output
    for ckpt in (tmp_path / "runs").glob("*/checkpoint.npz"):
        with np.load(ckpt, allow_pickle=False) as data:
            assert all(np.isfinite(data[name]).all() for name in data.files if data[name].dtype.kind == "f")


def test_ctrl_c_writes_a_loadable_checkpoint_and_resume_continues_from_it(tmp_path):
    flags = ["--env-id", "CartPole-v1", "--local-num-envs", 8, "--num-steps", 16, "--num-actor-threads", 1,
             "--log-every", 5, "--checkpoint-every", 1000]
    proc = spawn(SCRIPT, [*flags, "--total-timesteps", 10**7, "--run-dir", tmp_path / "first"], tmp_path)
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.startswith("update 10/"):
            break
    start = time.time()
    proc.send_signal(signal.SIGINT)
    output.append(proc.communicate(timeout=30)[0])
    assert time.time() - start < 30 and proc.returncode == 130, "".join(output)[-3000:]
    ckpt = next((tmp_path / "first").glob("*/checkpoint.npz"))
    with np.load(ckpt, allow_pickle=False) as data:
        update = int(data["update"])
        assert update >= 10 and np.isfinite(data["state/params/policy/w"]).all()

    batch = 8 * 16
    result = run(SCRIPT, [*flags, "--total-timesteps", (update + 5) * batch, "--resume", ckpt], tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert result.metrics[0]["global_step"] > update * batch
    assert result.last("global_step") == (update + 5) * batch


# --- Bad input --------------------------------------------------------------------------------


def mismatched_checkpoint(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, **{"state/params/policy/w": np.zeros((3, 3))})
    return path


@pytest.mark.parametrize("devices,flags,flag", [
    (1, ["--env-id", "Breakout-v55"], "--env-id"),
    (1, ["--env-id", "Pendulum-v1"], "--env-id"),
    (1, ["--env-id", "test_envs:FromOne-v0"], "--env-id"),
    (1, ["--env-id", "CartPole-v1", "--network", "shallow"], "--network"),
    (1, ["--env-id", "CartPole-v1", "--max-grad-norm", 0], "--max-grad-norm"),
    (1, ["--env-id", MINATAR, "--network", "shallow"], "--network"),
    (2, ["--env-id", "CartPole-v1", "--actor-device-ids", 2], "--actor-device-ids"),
    (1, ["--env-id", "CartPole-v1", "--actor-device-ids"], "--actor-device-ids"),  # none: no actor
    (2, ["--env-id", "CartPole-v1", "--actor-device-ids", 0, "--learner-device-ids", 0, 1], "--learner-device-ids"),
    (3, ["--env-id", "CartPole-v1", "--learner-device-ids", 1, 2, "--local-num-envs", 3], "--local-num-envs"),
    (4, ["--env-id", "CartPole-v1"], "--local-num-envs"),  # the default learners, 3, take no 16 envs
    (1, ["--env-id", "CartPole-v1", "--async-envs", "--local-num-envs", 3], "--local-num-envs"),
    (1, ["--env-id", "CartPole-v1", "--total-timesteps", 100], "--total-timesteps"),
    (1, ["--env-id", "CartPole-v1", "--resume", "missing.npz"], "--resume"),
    (1, ["--env-id", "CartPole-v1", "--resume", mismatched_checkpoint], "--resume"),
], ids=["unknown-env", "continuous-actions", "actions-from-1", "shallow-vectors", "max-grad-norm-0", "shallow-10x10",
        "device-out-of-range", "no-actor-device", "device-reused",
        "envs-not-divisible", "envs-not-divisible-by-default-learners",
        "async-envs-odd", "budget-below-one-update", "missing-checkpoint",
        "mismatched-checkpoint"])
def test_bad_input_is_one_error_line_naming_the_flag(tmp_path, envs_path, devices, flags, flag):
    flags = [f(tmp_path) if callable(f) else f for f in flags]
    line = error_line(run(SCRIPT, flags, tmp_path, devices=devices, timeout=120, env=envs_path))
    assert line.startswith(f"error: {flag} ")
