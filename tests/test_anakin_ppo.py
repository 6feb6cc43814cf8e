"""Tests of anakin_ppo.py: the JAX envs against gymnasium's, GAE and the PPO loss pieces
against NumPy, then end-to-end runs (learning, devices, seeds, hosts, resume, bad input)."""

import dataclasses
import math
import re
import signal

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro

from conftest import ROOT, checksum, error_line, load, run, run_two_hosts, spawn

ppo = load("anakin_ppo.py")
SCRIPT = "anakin_ppo.py"
DEFAULT = ppo.check_args(ppo.Args())  # the default flags, CartPole-v1's
STEPS_PER_UPDATE = DEFAULT.num_steps * DEFAULT.num_envs_per_device


def test_every_env_gives_a_value_to_each_flag_left_at_none_and_help_names_it(capsys):
    """check_args fills such a flag from the env's record in ENVS; its --help names the same values."""
    plumbing = {"num_devices", "resume", "coordinator_address", "num_processes", "process_id"}
    at_none = {f.name for f in dataclasses.fields(ppo.Args) if f.default is None} - plumbing
    for env_id, env in ppo.ENVS.items():
        assert set(env.defaults) == at_none, env_id
        assert all(getattr(ppo.check_args(ppo.Args(env_id=env_id)), name) == env.defaults[name] for name in at_none)
    with pytest.raises(SystemExit):
        tyro.cli(ppo.Args, args=["--help"])
    helptext = " ".join(capsys.readouterr().out.replace("│", " ").split())  # without the box around it
    for name in at_none:
        flag_help = helptext.split(f"--{name.replace('_', '-')} {{None")[1].split("(default: ")[1].split(")")[0] + ")"
        for env_id, env in ppo.ENVS.items():
            said = re.search(rf"{env_id} (\S+?)[,)]", flag_help).group(1)
            value = env.defaults[name]
            assert said == str(value) or float(said.replace("_", "")) == value, (name, env_id)


# ---- The environments against gymnasium 1.4 ------------------------------------------------
# The JAX envs compute in float32, gymnasium in float64 (its state) with float32 observations.
# In lockstep gymnasium starts every step from the JAX state (float32 widened to float64), so
# the only difference is one step's float32 rounding: ~1e-7 relative on values of at most ~10
# (Pendulum's speed is clipped to 8, CartPole's state stays in single digits), hence 1e-5.
# Open-loop, rounding differences grow with the dynamics; over 50 steps they stay far below
# 1e-4. Termination compares float32 and float64 positions with the same threshold: it could
# only differ for a state within ~1e-7 of the limit, which these seeded runs do not hit.


def jax_trajectory(env, policy, key, n):
    """n steps of one JAX env with auto-reset: (state before each step, action, Outcome)."""
    def body(carry, key):
        state, obs = carry
        k_act, k_reset = jax.random.split(key)
        action = policy(k_act, obs)
        new_state, outcome = ppo.env_step(env, state, action, ppo.env_reset(env, k_reset))
        return (new_state, outcome.obs), (state, action, outcome)

    k0, k1 = jax.random.split(key)
    _, out = jax.lax.scan(body, ppo.env_reset(env, k0), jax.random.split(k1, n))
    return jax.tree.map(np.asarray, out)


def to_gym_action(env_id, action):
    return int(action) if env_id == "CartPole-v1" else np.asarray(action, np.float32)


def lockstep(env_id, policy, seed, n):
    """Step gymnasium from each JAX state with the same action; compare everything."""
    env = ppo.ENVS[env_id]
    states, actions, outcomes = jax_trajectory(env, policy, jax.random.PRNGKey(seed), n)
    gym_env = gym.make(env_id)
    gym_obs, gym_rewards, gym_terminated, gym_truncated = [], [], [], []
    for i in range(n):
        if states.t[i] == 0:  # the JAX env began an episode: so does gymnasium's TimeLimit
            gym_env.reset(seed=seed + i)
        gym_env.unwrapped.state = states.inner[i].astype(np.float64)
        obs, reward, terminated, truncated, _ = gym_env.step(to_gym_action(env_id, actions[i]))
        gym_obs.append(obs), gym_rewards.append(reward)
        gym_terminated.append(terminated), gym_truncated.append(truncated)
    np.testing.assert_allclose(outcomes.final_obs, np.array(gym_obs), rtol=0, atol=1e-5)
    np.testing.assert_allclose(outcomes.reward, np.array(gym_rewards), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outcomes.terminated, gym_terminated)
    np.testing.assert_array_equal(outcomes.truncated, gym_truncated)
    ends = {"terminated": int(np.sum(gym_terminated)), "truncated": int(np.sum(gym_truncated))}
    return ends


def cartpole_policy(w, eps):
    """A linear controller acting randomly with probability eps (long episodes reach the limit)."""
    def policy(key, obs):
        k1, k2 = jax.random.split(key)
        greedy = (obs @ jnp.array(w) > 0).astype(jnp.int32)
        return jnp.where(jax.random.uniform(k1) < eps, jax.random.randint(k2, (), 0, 2), greedy)
    return policy


def test_cartpole_matches_gymnasium_in_lockstep_over_12k_steps():
    random_ends = lockstep("CartPole-v1", cartpole_policy((0, 0, 0, 0), 1.0), seed=0, n=6000)
    steered_ends = lockstep("CartPole-v1", cartpole_policy((0.1, 0.5, 10.0, 1.0), 0.3), seed=1, n=6000)
    assert random_ends["terminated"] > 100  # the comparison saw many terminations
    assert steered_ends["truncated"] >= 5  # and episodes cut by the 500-step limit


def test_pendulum_matches_gymnasium_in_lockstep_over_10k_steps():
    # Torques beyond [-2, 2] check the env's own clipping.
    ends = lockstep("Pendulum-v1", lambda k, obs: jax.random.uniform(k, (1,), minval=-3, maxval=3), seed=2, n=10_000)
    assert ends == {"terminated": 0, "truncated": 50}  # 200-step episodes, never terminated


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_open_loop_replay_of_50_steps_matches_gymnasium(env_id):
    env = ppo.ENVS[env_id]
    policy = (cartpole_policy((0.1, 0.5, 10.0, 1.0), 0.0) if env_id == "CartPole-v1"
              else lambda k, obs: jax.random.uniform(k, (1,), minval=-2, maxval=2))
    states, actions, outcomes = jax_trajectory(env, policy, jax.random.PRNGKey(3), 50)
    assert states.t[-1] == 49  # one episode, no reset inside the replay
    gym_env = gym.make(env_id)
    gym_env.reset(seed=3)
    gym_env.unwrapped.state = states.inner[0].astype(np.float64)  # only the start is shared
    for i in range(50):
        obs, reward, terminated, truncated, _ = gym_env.step(to_gym_action(env_id, actions[i]))
        np.testing.assert_allclose(outcomes.final_obs[i], obs, rtol=0, atol=1e-4, err_msg=f"step {i}")
        np.testing.assert_allclose(outcomes.reward[i], reward, rtol=1e-4, atol=1e-4)
        assert not terminated and not truncated and not outcomes.terminated[i] and not outcomes.truncated[i]


@pytest.mark.parametrize("env_id, low, high", [
    ("CartPole-v1", [-0.05] * 4, [0.05] * 4), ("Pendulum-v1", [-math.pi, -1.0], [math.pi, 1.0])])
def test_reset_draws_uniformly_from_gymnasiums_ranges(env_id, low, high):
    env = ppo.ENVS[env_id]
    states, obs = jax.vmap(lambda k: ppo.env_reset(env, k))(jax.random.split(jax.random.PRNGKey(0), 20_000))
    inner = np.asarray(states.inner)
    assert inner.dtype == np.float32 and np.asarray(obs).dtype == np.float32
    assert obs.shape == (20_000, env.obs_size) and np.all(np.asarray(states.t) == 0)
    low, high = np.array(low), np.array(high)
    assert np.all(inner >= low) and np.all(inner <= high)
    np.testing.assert_allclose(inner.mean(0), (low + high) / 2, atol=0.02 * (high - low).max())
    np.testing.assert_allclose(inner.std(0), (high - low) / math.sqrt(12), rtol=0.03)  # uniform's std


def test_time_limit_truncates_and_keeps_the_final_observation():
    env = ppo.ENVS["Pendulum-v1"]
    state, _ = ppo.env_reset(env, jax.random.PRNGKey(0))
    state = state._replace(t=jnp.int32(env.max_steps - 1))
    fresh = ppo.env_reset(env, jax.random.PRNGKey(1))
    new_state, outcome = ppo.env_step(env, state, jnp.array([1.0]), fresh)
    inner, _, _ = env.step(state.inner, jnp.array([1.0]))
    assert bool(outcome.truncated) and not bool(outcome.terminated)
    np.testing.assert_array_equal(outcome.final_obs, env.observe(inner))  # bootstrapped from this
    np.testing.assert_array_equal(outcome.obs, fresh[1])  # the agent goes on from a new episode
    assert int(new_state.t) == 0 and int(outcome.ep_length) == env.max_steps


# ---- GAE and the PPO loss pieces -------------------------------------------------------------

def gae_reference(rewards, values, next_values, terminated, truncated, gamma, lam):
    """GAE written as loops: bootstrap unless terminated, restart the sum at any episode end."""
    T, B = rewards.shape
    advantages = np.zeros((T, B))
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            bootstrap = 0.0 if terminated[t, b] else next_values[t, b]
            delta = rewards[t, b] + gamma * bootstrap - values[t, b]
            ended = terminated[t, b] or truncated[t, b]
            running = delta if ended else delta + gamma * lam * running
            advantages[t, b] = running
    return advantages, advantages + values


def test_gae_matches_numpy_with_terminations_and_truncations():
    rng = np.random.default_rng(0)
    T, B = 64, 5
    rewards, values, next_values = (rng.normal(size=(T, B)).astype(np.float32) for _ in range(3))
    terminated = rng.random((T, B)) < 0.08
    truncated = (rng.random((T, B)) < 0.08) & ~terminated
    assert terminated.any() and truncated.any()
    adv, targets = ppo.gae(rewards, values, next_values, terminated.astype(np.float32),
                           (terminated | truncated).astype(np.float32), 0.99, 0.95)
    ref_adv, ref_targets = gae_reference(rewards, values, next_values, terminated, truncated, 0.99, 0.95)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(targets, ref_targets, rtol=1e-5, atol=1e-5)
    # A truncated step keeps the discounted value of the observation it reached.
    t, b = np.argwhere(truncated)[0]
    np.testing.assert_allclose(adv[t, b], rewards[t, b] + 0.99 * next_values[t, b] - values[t, b], rtol=1e-5)


def test_policy_loss_ratio_clipping_and_kl_on_hand_made_cases():
    ratio = np.array([1.0, 1.5, 0.5, 1.1])
    advantages = np.array([1.0, 1.0, -1.0, -2.0])
    loss, approx_kl, clipfrac = ppo.policy_loss(jnp.log(ratio), jnp.zeros(4), advantages, 0.2)
    # Pessimistic bound per row: -A*r unless clipping makes it worse: [-1, -1.2, 0.8, 2.2].
    np.testing.assert_allclose(loss, np.mean([-1.0, -1.2, 0.8, 2.2]), rtol=1e-6)
    np.testing.assert_allclose(clipfrac, 0.5)  # 1.5 and 0.5 are outside [0.8, 1.2]
    np.testing.assert_allclose(approx_kl, np.mean(ratio - 1 - np.log(ratio)), rtol=1e-6)


def test_value_loss_clips_around_old_values_only_when_asked():
    new, old, target = jnp.array([2.0, 0.0]), jnp.array([0.0, 0.0]), jnp.array([3.0, 1.0])
    np.testing.assert_allclose(ppo.value_loss(new, old, target, 0.2, False), 0.5 * np.mean([1.0, 1.0]))
    # Clipped: new 2.0 -> 0.2 (error 2.8, worse than 1.0); new 0.0 is inside the range.
    np.testing.assert_allclose(ppo.value_loss(new, old, target, 0.2, True), 0.5 * np.mean([2.8**2, 1.0]), rtol=1e-6)


CARTPOLE, PENDULUM = ppo.ENVS["CartPole-v1"], ppo.ENVS["Pendulum-v1"]  # discrete and continuous actions


def test_categorical_log_prob_and_entropy():
    logits = jnp.array([[0.0, math.log(3.0)], [1.0, 1.0]])
    log_probs = ppo.log_prob(CARTPOLE, {}, logits, jnp.array([1, 0]))
    np.testing.assert_allclose(log_probs, np.log([0.75, 0.5]), rtol=1e-6)
    expected = [-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)), np.log(2)]
    np.testing.assert_allclose(ppo.entropy(CARTPOLE, {}, logits), expected, rtol=1e-6)


def test_gaussian_log_prob_and_entropy_match_the_closed_form():
    mean, log_std, action = np.array([0.5, -1.0]), np.array([0.3, -0.7]), np.array([1.2, -0.4])
    std = np.exp(log_std)
    density = np.prod(np.exp(-((action - mean) ** 2) / (2 * std**2)) / (std * np.sqrt(2 * np.pi)))
    params = {"log_std": log_std}
    np.testing.assert_allclose(ppo.log_prob(PENDULUM, params, mean, action), np.log(density), rtol=1e-5)
    np.testing.assert_allclose(ppo.entropy(PENDULUM, params, mean), np.sum(0.5 * np.log(2 * np.pi * np.e * std**2)),
                               rtol=1e-6)


def test_sampling_follows_the_policy():
    n = 200_000
    logits = jnp.log(jnp.array([0.2, 0.5, 0.3]))
    params = {}
    noise = ppo.draw_noise(CARTPOLE, jax.random.PRNGKey(0), (n, 3))
    counts = np.bincount(np.asarray(ppo.sample(CARTPOLE, params, jnp.broadcast_to(logits, (n, 3)), noise)),
                         minlength=3)
    np.testing.assert_allclose(counts / n, [0.2, 0.5, 0.3], atol=0.005)
    params = {"log_std": jnp.log(jnp.array([0.5]))}
    noise = ppo.draw_noise(PENDULUM, jax.random.PRNGKey(1), (n, 1))
    actions = np.asarray(ppo.sample(PENDULUM, params, jnp.full((n, 1), 1.5), noise))
    np.testing.assert_allclose([actions.mean(), actions.std()], [1.5, 0.5], atol=0.005)


# One minibatch of S seeds' rows, as 1 device x 2E envs' rows or 2 devices x E envs' rows.
MINIBATCH = f'''
import sys
import numpy as np
import jax
from jax.sharding import Mesh, PartitionSpec as P
sys.path.insert(0, {str(ROOT / "tests")!r})
from conftest import load

ppo = load("anakin_ppo.py")
args = ppo.check_args(ppo.Args())
env = ppo.ENVS[args.env_id]
rng = np.random.default_rng(0)
S, N = 2, 64  # seeds; rows of one minibatch: 2E envs' rows on one device, or E envs' on each of two
rows = lambda *shape: rng.normal(size=(S, N, *shape)).astype(np.float32)
advantage = rows() * np.float32([[1], [10]]) + np.float32([[0], [5]])  # the seeds' scales differ
batch = ppo.Batch(rows(env.obs_size), rng.integers(0, 2, (S, N)).astype(np.int32), rows() - 0.7, rows(), advantage,
                  rows())
params = jax.tree.map(lambda *p: np.stack(p), *[ppo.init_params(np.random.default_rng(i), env) for i in range(S)])
'''
SAME_MINIBATCH = MINIBATCH + '''

def step(params, batch):  # what an update does with one minibatch
    grads = jax.grad(lambda p: ppo.ppo_loss(p, batch, args, env)[0])(params)
    return ppo.normalize(batch.advantage), jax.lax.pmean(grads, "devices")


for n in (1, 2):
    mesh = Mesh(np.array(jax.devices()[:n]), ("devices",))
    mapped = jax.shard_map(jax.vmap(step), mesh=mesh, in_specs=(P(), P(None, "devices")),
                           out_specs=(P(None, "devices"), P()), check_vma=False)
    normalized, grads = jax.jit(mapped)(params, batch)
    flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
    np.savez(f"{n}.npz", advantage=advantage, normalized=normalized, grads=flat)
'''


def test_advantages_are_normalized_per_seed_over_the_minibatch_on_all_devices(tmp_path):
    """1 device x 2E envs and 2 devices x E envs: the same normalized advantages and gradients."""
    (tmp_path / "same_minibatch.py").write_text(SAME_MINIBATCH)
    result = run(tmp_path / "same_minibatch.py", [], tmp_path, devices=2, run_dir=False, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    one, two = np.load(tmp_path / "1.npz"), np.load(tmp_path / "2.npz")
    adv = one["advantage"]
    expected = (adv - adv.mean(axis=1, keepdims=True)) / adv.std(axis=1, keepdims=True)  # each seed's own
    np.testing.assert_allclose(one["normalized"], expected, atol=1e-5)
    np.testing.assert_allclose(two["normalized"], expected, atol=1e-5)
    assert np.abs(one["grads"]).max() > 1e-3
    np.testing.assert_allclose(two["grads"], one["grads"], rtol=1e-4, atol=1e-6)


# An L2 penalty on the parameters added to `ppo_loss`, as a student would add a loss term, then the
# file's own `gradient_steps` on the minibatch. SGD with step 1 makes the change of the parameters
# the gradient itself (Adam's first step, about the learning rate times its sign, would hide a factor).
L2_STEP = MINIBATCH + '''
import dataclasses
import jax.numpy as jnp
import optax

ppo_loss, one_step, sgd = ppo.ppo_loss, dataclasses.replace(args, update_epochs=1, num_minibatches=1), optax.sgd(1.0)


def with_l2(coef):
    def loss(params, minibatch, args, env):
        value, losses = ppo_loss(params, minibatch, args, env)
        return value + coef * sum(jnp.sum(w**2) for w in jax.tree.leaves(params)), losses
    return loss


def step(params, batch):
    key = jax.random.PRNGKey(0)
    new, _, _ = ppo.gradient_steps(params, sgd.init(params), batch, key, sgd, one_step, env)
    return jax.tree.map(lambda a, b: a - b, params, new)


for n, coef in ((1, 0.1), (2, 0.1), (1, 0.2)):
    ppo.ppo_loss = with_l2(coef)  # read by gradient_steps when jit traces it
    mesh = Mesh(np.array(jax.devices()[:n]), ("devices",))
    mapped = jax.shard_map(jax.vmap(step), mesh=mesh, in_specs=(P(), P(None, "devices")), out_specs=P(),
                           check_vma=False)
    grads = jax.jit(mapped)(params, batch)
    np.save(f"{n}_{coef}.npy", np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)]))
'''


def test_an_l2_penalty_added_to_ppo_loss_counts_once_on_any_device_count(tmp_path):
    """ppo_loss's rule: the term is right as written, so 2 devices take the gradient step of 1. Counted
    once per device, it would weigh twice as much on 2 devices: the step of 1 device with twice the
    coefficient shows that the comparison would see it."""
    (tmp_path / "l2_step.py").write_text(L2_STEP)
    result = run(tmp_path / "l2_step.py", [], tmp_path, devices=2, run_dir=False, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    one, two, doubled = (np.load(tmp_path / name) for name in ("1_0.1.npy", "2_0.1.npy", "1_0.2.npy"))
    np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    assert np.abs(doubled - one).max() > 100 * 1e-5


# ---- End to end ------------------------------------------------------------------------------
# Short CartPole budget used by the device, seed and host tests: 50 updates of the default size.
SHORT_BUDGET = 50 * STEPS_PER_UPDATE
SHORT = ["--total-timesteps", SHORT_BUDGET, "--log-every", 25]


def test_cartpole_default_config_solves_it(tmp_path):
    result = run(SCRIPT, [], tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert result.last("global_step") == DEFAULT.total_timesteps // STEPS_PER_UPDATE * STEPS_PER_UPDATE
    assert result.last("charts/episodic_return") >= 475  # last log window (50 updates)
    assert (result.run_dir / "checkpoint.npz").exists() and (result.run_dir / "args.json").exists()
    assert any(p.name.startswith("events.out.tfevents") for p in result.run_dir.iterdir())


def test_pendulum_reduced_budget_swings_up_every_seed(tmp_path):
    pendulum = ppo.check_args(ppo.Args(env_id="Pendulum-v1"))
    budget = 100 * pendulum.num_steps * pendulum.num_envs_per_device  # 100 updates of Pendulum's default size
    result = run(SCRIPT, ["--env-id", "Pendulum-v1", "--total-timesteps", budget, "--num-seeds", 2], tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert result.last("charts/episodic_return_max") <= 0
    assert result.last("charts/episodic_return_min") > -400  # random play: about -1200


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_learns_on_1_2_and_4_devices(tmp_path, devices):
    # The default envs, split across the devices; each device draws minibatches from its own data.
    result = run(SCRIPT, [*SHORT, "--num-envs-per-device", DEFAULT.num_envs_per_device // devices], tmp_path,
                 devices=devices)
    assert result.returncode == 0, result.output[-3000:]
    assert result.last("global_step") == SHORT_BUDGET
    assert result.last("charts/episodic_return") > 60  # random play: about 22


def test_num_seeds_trains_independent_agents_and_logs_each(tmp_path):
    result = run(SCRIPT, [*SHORT, "--num-seeds", 4], tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    row = result.metrics[-1]
    seeds = [row[f"charts/episodic_return_seed{i}"] for i in range(4)]
    assert len(set(seeds)) == 4  # different agents
    assert row["charts/episodic_return_min"] == min(seeds) and row["charts/episodic_return_max"] == max(seeds)
    np.testing.assert_allclose(row["charts/episodic_return"], np.mean(seeds), rtol=1e-6)
    assert min(seeds) > 40


def test_same_seed_gives_bitwise_identical_parameters(tmp_path):
    first = run(SCRIPT, SHORT, tmp_path / "a")
    second = run(SCRIPT, SHORT, tmp_path / "b")
    other = run(SCRIPT, [*SHORT, "--seed", 2], tmp_path / "c")
    assert checksum(first.output) == checksum(second.output) != checksum(other.output)


def test_resuming_from_a_checkpoint_continues_bitwise(tmp_path):
    # The default envs on 2 devices, so updates of the default size; the schedule must not depend on the budget.
    args = ["--no-anneal-lr", "--log-every", 5, "--num-envs-per-device", DEFAULT.num_envs_per_device // 2]
    straight = run(SCRIPT, [*args, "--total-timesteps", 10 * STEPS_PER_UPDATE], tmp_path / "straight", devices=2)
    half = run(SCRIPT, [*args, "--total-timesteps", 5 * STEPS_PER_UPDATE], tmp_path / "half", devices=2)
    resumed = run(SCRIPT, [*args, "--total-timesteps", 10 * STEPS_PER_UPDATE, "--resume",
                           half.run_dir / "checkpoint.npz"], tmp_path / "resumed", devices=2)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [m["global_step"] for m in resumed.metrics] == [10 * STEPS_PER_UPDATE]  # updates 6 to 10 only
    assert checksum(resumed.output) == checksum(straight.output) != checksum(half.output)


def test_two_hosts_end_with_identical_parameters(tmp_path):
    hosts = run_two_hosts(SCRIPT, [*SHORT, "--num-envs-per-device", 1], tmp_path)
    for host in hosts:
        assert host.returncode == 0, host.output[-3000:]
    assert checksum(hosts[0].output) == checksum(hosts[1].output)
    assert hosts[0].last("global_step") == SHORT_BUDGET and not hosts[1].metrics  # only process 0 writes
    assert hosts[0].last("charts/episodic_return") > 60


@pytest.mark.parametrize("args, expected", [
    (["--env-id", "CartPole-v0"], "'CartPole-v1'"),
    (["--env-id", "Pong"], "'Pendulum-v1'"),
    (["--num-minibatches", 3], "--num-minibatches 3"),
    (["--total-timesteps", 100], "--total-timesteps 100"),
    (["--num-devices", 3], "--num-devices 3"),
    (["--num-minibatches", 0], "--num-minibatches 0"),
    (["--max-grad-norm", 0], "--max-grad-norm 0"),
    (["--resume", "missing.npz"], "missing.npz"),
])
def test_bad_input_is_one_clear_error_line(tmp_path, args, expected):
    assert expected in error_line(run(SCRIPT, args, tmp_path))


def test_resuming_a_checkpoint_of_another_configuration_is_a_clear_error(tmp_path):
    first = run(SCRIPT, ["--total-timesteps", STEPS_PER_UPDATE], tmp_path / "a")
    assert first.returncode == 0, first.output[-3000:]
    ckpt = first.run_dir / "checkpoint.npz"
    line = error_line(run(SCRIPT, ["--num-envs-per-device", 8, "--resume", ckpt], tmp_path / "b"))
    assert "its run had --num-envs-per-device 4" in line
    # The same flags on 2 devices: twice the envs, other shapes.
    line = error_line(run(SCRIPT, ["--resume", ckpt], tmp_path / "c", devices=2))
    assert "state/env_state" in line and "is not" in line


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    # Update 1 is one Adam step, which moves every weight by ~1e30 (still finite); update 2's
    # forward pass overflows.
    args = ["--learning-rate", 1e30, "--update-epochs", 1, "--num-minibatches", 1, "--log-every", 1,
            "--checkpoint-every", 1, "--total-timesteps", 10**7]
    result = run(SCRIPT, args, tmp_path)
    assert result.returncode == 1, result.output[-3000:]
    assert re.search(r"error: the run diverged: non-finite losses/\w+.* at update 2", result.output)
    with np.load(result.run_dir / "checkpoint.npz", allow_pickle=False) as f:
        assert int(f["update"]) == 1
        assert all(np.isfinite(f[k]).all() for k in f if k.startswith("state/params"))


def test_ctrl_c_after_the_first_update_checkpoints_at_the_next_call_exits_130_and_resumes(tmp_path):
    args = ["--total-timesteps", 50_000_000, "--log-every", 5]
    proc = spawn(SCRIPT, [*args, "--run-dir", tmp_path / "runs"], tmp_path)
    try:
        for line in proc.stdout:  # training has started: interrupt it
            if line.startswith("update "):
                break
        proc.send_signal(signal.SIGINT)
        output = line + proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, output[-3000:]
    stopped = int(re.search(r"stopped by SIGINT after update (\d+)", output)[1])
    ckpt = next((tmp_path / "runs").glob("*/checkpoint.npz"))
    with np.load(ckpt, allow_pickle=False) as f:
        assert int(f["update"]) == stopped and stopped % 5 == 0  # the state after a whole call
    budget = (stopped + 5) * STEPS_PER_UPDATE
    resumed = run(SCRIPT, [*args[2:], "--total-timesteps", budget, "--resume", ckpt], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [m["update"] for m in resumed.metrics] == [stopped + 5]
