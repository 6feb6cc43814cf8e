"""Both Sebulba scripts on two hosts: which envs each learner joins.

Each actor thread makes its host's rollout [T, E, ...] one global array over all hosts' learners
(`make_array_from_process_local_data` with P(None, "learners")): env block k goes to learner k, the
mesh ordering learners host by host. The two-host tests compare checksums, which the learners' psum
makes equal whatever each learner saw, so a rollout declared replicated (P()), which on two hosts
drops half of each host's envs, passes them; this test fails it. The real run (`main`, its actors,
its compiled update) learns from rewards stamped with each env's host, thread and index."""

import json

import pytest

from conftest import patched, run_two_hosts

# Stamps the rollout `collect` returns (rewards: host * 100 + thread * 10
# + env) and records, inside the compiled update, the stamps each learner (its index on the mesh) joined.
PROBE = '''
import threading
import jax, numpy as np
collect, observed, records = script.collect, script.{observed}, []

def stamped(*args):
    rollout, states = collect(*args)
    thread = int(threading.current_thread().name.removeprefix("actor"))  # start_actors' names
    stamps = jax.process_index() * 100 + thread * 10 + np.arange(rollout.rewards.shape[1])
    return rollout._replace(rewards=np.broadcast_to(stamps, rollout.rewards.shape).astype(np.float32)), states

def observing(*args):
    record = lambda learner, stamps: records.append([int(learner), np.asarray(stamps).astype(int).tolist()])
    jax.debug.callback(record, jax.lax.axis_index("learners"), {rewards})
    return observed(*args)

script.collect, script.{observed} = stamped, observing
'''
REPORT = 'import json\njax.effects_barrier()\nprint("joined", json.dumps(records), flush=True)'  # after main
# Per host: 2 actor threads on device 0, 4 envs each, learners on devices 1 and 2: each of the 4 learners
# joins 2 envs of each thread of its host.
HOSTS, THREADS, ENVS, LEARNERS, STEPS, UPDATES = 2, 2, 4, 2, 4, 2
LAYOUT = ["--actor-device-ids", 0, "--learner-device-ids", 1, 2, "--num-actor-threads", THREADS,
          "--local-num-envs", ENVS, "--num-steps", STEPS, "--total-timesteps", UPDATES * HOSTS * THREADS * ENVS * STEPS]


# `observed` receives a learner's whole joined rollout (before any minibatch); `rewards`: where its arguments
# hold the rewards.
@pytest.mark.parametrize("script,observed,rewards,flags", [
    ("sebulba_impala.py", "impala_loss", "args[1].rewards", ["--env-id", "CartPole-v1"]),
    ("sebulba_ppo_atari.py", "gae", "args[0]", ["--env-id", "Breakout-v5", "--update-epochs", 1,
                                                "--num-minibatches", 1]),
], ids=["impala", "ppo_atari"])
def test_each_learner_joins_its_env_block_of_each_thread_of_its_host(tmp_path, script, observed, rewards, flags):
    probe = patched(script, PROBE.format(observed=observed, rewards=rewards), tmp_path / "probe.py", after=REPORT)
    joined = {}  # learner -> the stamps it joined, a row per step of each update
    for result in run_two_hosts(probe, [*flags, *LAYOUT], tmp_path, devices=3, timeout=300):
        assert result.returncode == 0, result.output[-3000:]
        line = [line for line in result.output.splitlines() if line.startswith("joined ")][-1]
        for learner, stamps in json.loads(line.removeprefix("joined ")):
            joined.setdefault(learner, []).extend(stamps)
    decode = lambda stamp: (stamp // 100, stamp // 10 % 10, stamp % 10)  # (host, thread, env)
    seen = {k: sorted({tuple(map(decode, row)) for row in rows}) for k, rows in joined.items()}
    block = ENVS // LEARNERS  # learner k: host k // 2, local learner k % 2
    want = {k: [tuple((k // LEARNERS, thread, env) for thread in range(THREADS)
                      for env in range(k % LEARNERS * block, (k % LEARNERS + 1) * block))]
            for k in range(HOSTS * LEARNERS)}
    assert seen == want, "learner: [(host, thread, env) of each env it joined, in order]"
    assert {k: len(rows) for k, rows in joined.items()} == {k: UPDATES * STEPS for k in want}  # every step
