"""Runs you can repeat, in both Sebulba scripts: equal flags give equal parameters whatever the load
(the rollout for update u acts with version u - 2 of the parameters exactly, not the newest, and
`ParamStore.version_for` alone says so), and each env's seed is drawn from the run seed, so that two
run seeds share no env."""

import subprocess
import sys

import pytest

from conftest import checksum, load, patched, run

BREAKOUT = ["--env-id", "Breakout-v5", "--local-num-envs", 2, "--num-steps", 8, "--num-actor-threads", 2,
            "--total-timesteps", 2 * 2 * 8 * 6, "--log-every", 1]
RUNS = {  # the runs the issue names: Breakout in both scripts, and sebulba_impala on CartPole with 2 threads
    # --async-envs too: each half is an envpool batch of its own, stepped whole, so it repeats as well.
    "impala Breakout": ("sebulba_impala.py", [*BREAKOUT, "--network", "shallow", "--async-envs"]),
    "ppo_atari Breakout": ("sebulba_ppo_atari.py", [*BREAKOUT, "--update-epochs", 1, "--num-minibatches", 2]),
    "impala CartPole": ("sebulba_impala.py", ["--env-id", "CartPole-v1", "--local-num-envs", 4, "--num-steps", 16,
                                             "--num-actor-threads", 2, "--total-timesteps", 2 * 4 * 16 * 30,
                                             "--log-every", 1]),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_equal_flags_give_equal_parameters_even_beside_a_busy_cpu(tmp_path, name):
    script, flags = RUNS[name]
    alone = run(script, flags, tmp_path / "alone")
    # One busy loop a core: the actor threads and the learner are scheduled late and in other orders.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = run(script, flags, tmp_path / "loaded")
    finally:
        for hog in hogs:
            hog.kill()
    for result in (alone, loaded):
        assert result.returncode == 0, result.output[-3000:]
        # The first rollout acts with the start's parameters, every later one exactly one update behind.
        lags = [row["stats/param_lag"] for row in result.metrics]
        assert lags[0] == 0 and set(lags[1:]) == {1}, lags
    assert checksum(alone.output) == checksum(loaded.output)


@pytest.mark.parametrize("script,env_id", [("sebulba_impala.py", "CartPole-v1"),
                                           ("sebulba_ppo_atari.py", "Breakout-v5")])
def test_no_two_envs_share_a_seed_across_threads_hosts_halves_and_run_seeds(script, env_id):
    import jax

    module = load(script)

    def env_seeds(seed, async_envs):  # every env's seed, thread by thread, of two hosts' two threads each
        args = module.Args(env_id=env_id, seed=seed, async_envs=async_envs, local_num_envs=8)
        found = []
        for index in range(4):  # the actor threads, numbered over both hosts (start_actors)
            groups, _ = module.start_groups(args, index, jax.devices()[0], 0)
            found.append([s for envs in groups for s in envs.seeds])
        return found

    runs = {}
    for seed in (1, 2, 3):
        for async_envs in (False, True):
            seeds = [s for thread in env_seeds(seed, async_envs) for s in thread]
            assert len(seeds) == 4 * 8 and len(set(seeds)) == len(seeds)  # distinct within a run
            assert all(0 <= s < 2**31 for s in seeds)  # envpool takes int32 seeds
            runs[seed, async_envs] = set(seeds)
    for (a, _), first in runs.items():
        for (b, _), second in runs.items():
            assert a == b or not first & second, (a, b)  # two run seeds share no env
    assert env_seeds(1, False) == env_seeds(1, False)  # and equal flags give equal seeds


def two_behind(store, update):  # the rule a reader who wants more lag would write: update u - 3's
    return max(update - 3, store.start_update)


TWO_BEHIND = """
from test_sebulba_repeatable import two_behind
script.ParamStore.version_for = two_behind
"""


@pytest.mark.parametrize("name", ["impala CartPole", "ppo_atari Breakout"])
def test_the_version_each_rollout_acts_with_is_set_in_one_place(tmp_path, name):
    script, flags = RUNS[name]
    result = run(patched(script, TWO_BEHIND, tmp_path / "two_behind.py"), flags, tmp_path, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    lags = [row["stats/param_lag"] for row in result.metrics]  # rollouts 1 to 3 act with the start's
    assert lags[:2] == [0, 1] and set(lags[2:]) == {2}, lags


# (script, ParamStore's arguments after the devices and start, version_for's replacement or None)
STORES = {"impala": ("sebulba_impala.py", (), None),
          "impala, two behind": ("sebulba_impala.py", (), two_behind),
          "ppo_atari": ("sebulba_ppo_atari.py", (True,), None),
          "ppo_atari --no-policy-lag": ("sebulba_ppo_atari.py", (False,), None),
          "ppo_atari, two behind": ("sebulba_ppo_atari.py", (True,), two_behind)}


@pytest.mark.parametrize("name", list(STORES))
def test_publish_keeps_exactly_the_versions_the_rollouts_to_come_act_with(name, monkeypatch):
    import jax
    import jax.numpy as jnp

    script, extra, rule = STORES[name]
    module = load(script)
    if rule:  # an actor that finds its version dropped would wait forever: in a run, only if it is slow to ask
        monkeypatch.setattr(module.ParamStore, "version_for", rule)
    start, device = 5, jax.devices()[0]
    store = module.ParamStore([device], start, *extra)
    for version in range(start, start + 8):  # main publishes the start's, then each update its own
        store.publish(version, {"w": jnp.float32(version)})
        # Rollouts version + 1 on act with version_for(version + 1) or newer, and none is newer than version yet.
        assert set(store.versions) == set(range(store.version_for(version + 1), version + 1)), store.versions
        assert float(store.wait(store.version_for(version + 1), device)["w"]) == store.version_for(version + 1)
