"""anakin_catch.py: Catch's rules, the Q(lambda) loss, learning, devices, hosts, resume, errors."""

import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import checksum, error_line, load, patched, run, run_two_hosts, spawn

catch = load("anakin_catch.py")
SCRIPT = "anakin_catch.py"
DEFAULT = catch.Args()  # the default flags
ENVS = DEFAULT.num_envs_per_device
STEPS_PER_UPDATE = DEFAULT.num_steps * ENVS


def play(actions, ball_x=3, key=0):
    """Step Catch from a known start; returns the states, rewards and dones after each step."""
    state = catch.Catch(jnp.int32(ball_x), jnp.int32(0), jnp.int32(2))
    states, rewards, dones = [], [], []
    for i, a in enumerate(actions):
        state, reward, done = catch.step(state, jnp.int32(a), jax.random.PRNGKey(key + i))
        states.append(state), rewards.append(float(reward)), dones.append(bool(done))
    return states, rewards, dones


# ---- Catch --------------------------------------------------------------------------------

def test_reset_puts_ball_in_top_row_at_random_column_and_paddle_in_middle():
    states = [catch.reset(jax.random.PRNGKey(i)) for i in range(100)]
    assert {int(s.ball_y) for s in states} == {0}
    assert {int(s.paddle_x) for s in states} == {2}
    assert {int(s.ball_x) for s in states} == set(range(5))


def test_ball_falls_one_row_per_step_and_episode_lasts_nine_steps():
    states, _, dones = play([1] * 9)
    assert [int(s.ball_y) for s in states[:8]] == list(range(1, 9))
    assert dones == [False] * 8 + [True]


def test_reward_is_plus_one_when_caught_minus_one_when_missed_and_zero_before():
    _, caught, _ = play([1] * 9, ball_x=2)  # stay under a ball that falls in the middle
    _, missed, _ = play([1] * 9, ball_x=0)
    _, chased, _ = play([0, 0] + [1] * 7, ball_x=0)  # move left twice, then wait
    assert caught == [0.0] * 8 + [1.0]
    assert missed == [0.0] * 8 + [-1.0]
    assert chased == [0.0] * 8 + [1.0]


def test_episode_end_resets_automatically():
    states, _, dones = play([2] * 12, ball_x=4)
    assert dones[8]
    after = states[8]
    assert int(after.ball_y) == 0 and int(after.paddle_x) == 2
    assert [int(s.ball_y) for s in states[9:]] == [1, 2, 3]  # the next episode runs on


def test_observation_marks_ball_and_paddle_only():
    obs = np.asarray(catch.observe(catch.Catch(jnp.int32(1), jnp.int32(4), jnp.int32(3))))
    expected = np.zeros((10, 5), np.float32)
    expected[4, 1] = expected[9, 3] = 1.0
    np.testing.assert_array_equal(obs, expected)
    assert obs.dtype == np.float32


def test_paddle_is_clipped_at_the_walls():
    left, _, _ = play([0] * 5)
    right, _, _ = play([2] * 5)
    assert [int(s.paddle_x) for s in left] == [1, 0, 0, 0, 0]
    assert [int(s.paddle_x) for s in right] == [3, 4, 4, 4, 4]


# ---- The network ----------------------------------------------------------------------------

def test_network_is_the_colabs_one_hidden_layer_of_256_initialised_as_haiku_does():
    params = catch.init_params(jax.random.PRNGKey(0))
    shapes = {"hidden": {"w": (50, 256), "b": (256,)}, "out": {"w": (256, 3), "b": (3,)}}
    assert jax.tree.map(np.shape, params) == shapes
    for layer in params.values():  # hk.Linear: normal truncated at 2 std, std 1/sqrt(fan_in), zero bias
        w = np.asarray(layer["w"]) * np.sqrt(layer["w"].shape[0])
        assert np.abs(w).max() <= 2.0 and (np.asarray(layer["b"]) == 0).all()
    hidden = np.asarray(params["hidden"]["w"]) * np.sqrt(50)
    np.testing.assert_allclose(hidden.std(), 0.8796, rtol=0.02)  # a standard normal cut at +-2: std 0.88
    # Flatten, Linear(256), ReLU, Linear(3)
    p = jax.tree.map(np.asarray, params)
    boards = np.random.default_rng(0).random((4, 10, 5)).astype(np.float32)
    x = np.maximum(boards.reshape(4, 50) @ p["hidden"]["w"] + p["hidden"]["b"], 0)
    np.testing.assert_allclose(catch.apply(params, boards), x @ p["out"]["w"] + p["out"]["b"], rtol=1e-5, atol=1e-5)


# ---- Q(lambda) ----------------------------------------------------------------------------

def numpy_q_lambda(q, q_last, actions, rewards, dones, gamma, lam):
    """Q(lambda) targets and loss from the definition: a lambda-weighted mix of n-step returns."""
    T = len(rewards)
    q_all = np.concatenate([q, q_last[None]])
    targets = np.zeros(T)
    for t in range(T):
        # G_t = sum_n (1-lam) lam^(n-1) G_t^(n), cut at the rollout's end (the last n-step
        # return takes the remaining weight); the discount is zero past an episode's end.
        weight_left, ret, disc = 1.0, 0.0, 1.0
        for n in range(1, T - t + 1):
            ret += disc * rewards[t + n - 1]
            disc *= gamma * (1 - dones[t + n - 1])
            w = weight_left if n == T - t else (1 - lam) * weight_left
            targets[t] += w * (ret + disc * q_all[t + n].max())
            weight_left -= w
    q_taken = q[np.arange(T), actions]
    return targets, np.mean((targets - q_taken) ** 2)


def random_rollout(seed, T=16, A=3):
    rng = np.random.default_rng(seed)
    dones = np.zeros(T)
    dones[rng.choice(T, 3, replace=False)] = 1.0  # episode ends inside the rollout
    return rng.normal(size=(T, A)), rng.normal(size=A), rng.integers(0, A, T), rng.normal(size=T), dones


def jax_loss(q, q_last, actions, rewards, dones, gamma, lam):
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return catch.q_lambda_loss(f32(q), f32(q_last), jnp.asarray(actions), f32(rewards), f32(dones), gamma, lam)


@pytest.mark.parametrize("seed", range(5))
def test_q_lambda_loss_matches_numpy_with_episode_ends_inside_the_rollout(seed):
    inputs = random_rollout(seed)
    _, expected = numpy_q_lambda(*inputs, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(float(jax_loss(*inputs, 0.9, 0.8)), expected, rtol=1e-5)


def test_q_lambda_gradient_moves_only_the_taken_q_values_towards_fixed_targets():
    q, q_last, actions, rewards, dones = random_rollout(7)
    targets, _ = numpy_q_lambda(q, q_last, actions, rewards, dones, 1.0, 0.99)
    grad_q, grad_last = jax.grad(jax_loss, argnums=(0, 1))(q, q_last, actions, rewards, dones, 1.0, 0.99)
    expected = np.zeros_like(q)
    T = len(actions)
    expected[np.arange(T), actions] = 2 * (q[np.arange(T), actions] - targets) / T
    np.testing.assert_allclose(np.asarray(grad_q), expected, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(grad_last), 0.0)  # the bootstrap is only a target


# ---- End to end ---------------------------------------------------------------------------

def final_params(result):
    with np.load(result.run_dir / "checkpoint.npz") as f:
        return {k: f[k] for k in f if k.startswith("state/params")}


def test_default_run_learns_catch(tmp_path):
    result = run(SCRIPT, [], tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert result.last("charts/episodic_return") >= 0.9
    assert result.last("charts/episodic_length") == 9.0
    assert result.last("global_step") == DEFAULT.total_timesteps // STEPS_PER_UPDATE * STEPS_PER_UPDATE


@pytest.mark.parametrize("devices", [2, 4])
def test_default_run_learns_on_several_devices_and_counts_steps_over_all(tmp_path, devices):
    """The default run (1 device: test above) with its envs split over 2 or 4 devices."""
    result = run(SCRIPT, ["--num-envs-per-device", ENVS // devices, "--log-every", 25], tmp_path, devices=devices)
    assert result.returncode == 0, result.output[-3000:]
    per_update = DEFAULT.num_steps * (ENVS // devices) * devices
    assert [m["global_step"] for m in result.metrics] == [m["update"] * per_update for m in result.metrics]
    assert result.last("global_step") == DEFAULT.total_timesteps // per_update * per_update
    assert result.last("charts/episodic_return") >= 0.9


def test_splitting_envs_over_devices_gives_the_same_updates(tmp_path):
    """The default envs on 1 device, or split over 2 or 4: gradients are averaged, so parameters agree."""
    params = []
    for devices in (1, 2, 4):
        result = run(SCRIPT, ["--num-envs-per-device", ENVS // devices, "--total-timesteps", 10 * STEPS_PER_UPDATE],
                     tmp_path / str(devices), devices=devices)
        assert result.returncode == 0, result.output[-3000:]
        params.append(final_params(result))
    for other in params[1:]:
        for name in params[0]:
            np.testing.assert_allclose(other[name], params[0][name], atol=2e-5, err_msg=name)


# An L2 penalty on the parameters added to `lane_loss`, as a student would add a loss term.
WITH_L2 = """
import jax, jax.numpy as jnp
lane_loss = script.lane_loss
def lane_loss_with_l2(params, lane, args):
    loss, aux = lane_loss(params, lane, args)
    return loss + {coef} * sum(jnp.sum(w**2) for w in jax.tree.leaves(params)), aux
script.lane_loss = lane_loss_with_l2
"""


def test_an_l2_penalty_added_to_lane_loss_counts_once_on_any_device_count(tmp_path):
    """lane_loss's rule: the term is right as written, so 2 devices make the updates of 1. Counted once
    per device, it would weigh twice as much on 2 devices: the run of 1 device with twice the
    coefficient shows that the comparison would see it."""
    coef, params = 1e-3, {}
    for devices, c in ((1, coef), (2, coef), (1, 2 * coef)):
        with_l2 = patched(SCRIPT, WITH_L2.format(coef=c), tmp_path / f"with_l2_{c}.py")
        flags = ["--num-envs-per-device", ENVS // devices, "--total-timesteps", 10 * STEPS_PER_UPDATE]
        result = run(with_l2, flags, tmp_path / f"{devices}_{c}", devices=devices)
        assert result.returncode == 0, result.output[-3000:]
        params[devices, c] = final_params(result)
    one, two, doubled = params[1, coef], params[2, coef], params[1, 2 * coef]
    for name in one:
        np.testing.assert_allclose(two[name], one[name], atol=2e-5, err_msg=name)
    assert max(np.abs(doubled[name] - one[name]).max() for name in one) > 50 * 2e-5


def test_same_seed_is_bitwise_reproducible_and_another_seed_differs(tmp_path):
    args = ["--total-timesteps", 20 * STEPS_PER_UPDATE]
    a, b, c = (run(SCRIPT, [*args, "--seed", s], tmp_path / str(i), devices=2)
               for i, s in enumerate([3, 3, 4]))
    assert all(r.returncode == 0 for r in (a, b, c))
    assert checksum(a.output) == checksum(b.output)
    assert checksum(a.output) != checksum(c.output)


def test_resume_continues_bitwise_as_one_straight_run(tmp_path):
    n = 20 * STEPS_PER_UPDATE
    first = run(SCRIPT, ["--total-timesteps", n], tmp_path / "first")
    resumed = run(SCRIPT, ["--total-timesteps", 2 * n, "--resume", first.run_dir / "checkpoint.npz"],
                  tmp_path / "resumed")
    straight = run(SCRIPT, ["--total-timesteps", 2 * n], tmp_path / "straight")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.metrics[0]["update"] == 30  # continues after update 20
    assert checksum(resumed.output) == checksum(straight.output)
    assert resumed.metrics[-1]["global_step"] == straight.metrics[-1]["global_step"] == 2 * n


def test_two_hosts_hold_identical_parameters_and_count_all_devices(tmp_path):
    budget = 10 * DEFAULT.num_steps * 32 * 4  # 10 updates of 32 envs on each of 4 devices in all
    args = ["--num-envs-per-device", 32, "--total-timesteps", budget]
    hosts = run_two_hosts(SCRIPT, args, tmp_path, devices=2)
    for host in hosts:
        assert host.returncode == 0, host.output[-3000:]
    assert checksum(hosts[0].output) == checksum(hosts[1].output)
    assert hosts[0].last("global_step") == budget
    assert hosts[1].run_dir is None  # only process 0 writes the run folder
    # the same 128 lanes on one host with 4 devices make the same updates
    single = run(SCRIPT, args, tmp_path / "single", devices=4)
    for name, value in final_params(single).items():
        np.testing.assert_allclose(final_params(hosts[0])[name], value, atol=2e-5, err_msg=name)


def test_ctrl_c_writes_a_loadable_checkpoint_and_exits(tmp_path):
    proc = spawn(SCRIPT, ["--total-timesteps", 10**9, "--run-dir", tmp_path / "runs"], tmp_path)
    for line in proc.stdout:  # wait until training is under way
        if line.startswith("update 20/"):
            break
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output
    (run_dir,) = (tmp_path / "runs").iterdir()
    with np.load(run_dir / "checkpoint.npz", allow_pickle=False) as f:
        assert int(f["update"]) >= 20
        assert f["state/lanes/key"].shape == (ENVS, 2)


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    # Adam's first step moves every weight by ~1e30 (still finite); the next forward pass
    # overflows, so update 2's loss is not finite.
    args = ["--learning-rate", 1e30, "--log-every", 1, "--checkpoint-every", 1, "--total-timesteps", 10**8]
    result = run(SCRIPT, args, tmp_path)
    assert result.returncode == 1, result.output[-3000:]
    assert "error: the run diverged: non-finite losses/td_loss" in result.output
    assert "at update 2; --resume" in result.output  # names the last good checkpoint
    with np.load(result.run_dir / "checkpoint.npz", allow_pickle=False) as f:
        assert int(f["update"]) == 1
        assert all(np.isfinite(f[k]).all() for k in f if k.startswith("state/params"))


# ---- Bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--env-id", "Catc"], ["--env-id", "'Catc'", "only 'Catch'"]),
    (["--num-devices", 3], ["--num-devices 3", "2 device"]),
    (["--total-timesteps", 1000], ["--total-timesteps", "one update", f"{2 * STEPS_PER_UPDATE:,}"]),
    (["--num-envs-per-device", 0], ["--num-envs-per-device 0", "at least 1"]),
    (["--resume", "nowhere.npz"], ["--resume", "nowhere.npz", "No such file"]),
])
def test_bad_input_is_one_clear_line_and_exit_2_before_compiling(tmp_path, args, words):
    result = run(SCRIPT, args, tmp_path, devices=2)
    line = error_line(result)
    assert all(w in line for w in words), line
    assert result.run_dir is None


def test_corrupt_or_mismatched_checkpoint_is_refused(tmp_path):
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"not a checkpoint")
    assert "not a readable checkpoint" in error_line(run(SCRIPT, ["--resume", corrupt], tmp_path / "a"))
    small = run(SCRIPT, ["--num-envs-per-device", 8, "--total-timesteps", DEFAULT.num_steps * 16], tmp_path / "b",
                devices=2)
    assert small.returncode == 0, small.output[-3000:]
    ckpt = small.run_dir / "checkpoint.npz"
    line = error_line(run(SCRIPT, ["--resume", ckpt, "--total-timesteps", 10**6], tmp_path / "c"))
    assert "its run had --num-envs-per-device 8" in line, line  # a changed flag of the algorithm
    line = error_line(run(SCRIPT, ["--resume", ckpt, "--num-envs-per-device", 8, "--total-timesteps", 10**6],
                          tmp_path / "d"))  # the same flags on 1 device: 8 lanes, not 16
    assert "its state/lanes/" in line and "[8" in line, line
