"""Both Sebulba scripts: one learner device or two make the same update from the same two threads' rollouts, and a
term of the parameters alone (an L2 penalty) added as each loss's docstring says keeps it so. IMPALA's loss is a sum
over the global batch; PPO's terms are shares of the global mean (one minibatch of all samples here, as each learner
draws its minibatches from its own samples)."""

import pytest

from conftest import ROOT, run

# Per script: the module, its Args, a batch of T = 5 steps x 4 envs (two threads' 2 envs each) and a TrainState.
SETUP = {
    "sebulba_impala.py": '''
module, loss_name = load("sebulba_impala.py"), "impala_loss"
args = module.Args(learning_rate=1e-3, rmsprop_eps=0.01, network="mlp")
batch = module.Rollout(rng.normal(size=(T + 1, B, 6)).astype(np.float32), rng.integers(0, A, (T, B)).astype(np.int32),
                       rng.normal(size=(T, B, A)).astype(np.float32), rng.normal(size=(T, B)).astype(np.float32),
                       (rng.random((T, B)) < 0.2).astype(np.float32), valid)
state = module.init_state(jax.random.PRNGKey(0), args, module.EnvInfo((6,), A, "gymnasium", False), 10)
''',
    "sebulba_ppo_atari.py": '''
module, loss_name = load("sebulba_ppo_atari.py"), "ppo_loss"
args = module.Args(update_epochs=2, num_minibatches=1, learning_rate=1e-3)
ended = (rng.random((T, B)) < 0.2).astype(np.float32)
batch = module.Rollout(rng.integers(0, 255, (T, B, 2, 6, 6), dtype=np.uint8),
                       rng.integers(0, A, (T, B)).astype(np.int32),
                       (np.log(1 / A) + 0.1 * rng.normal(size=(T, B))).astype(np.float32),
                       rng.normal(size=(T + 1, B)).astype(np.float32), rng.normal(size=(T, B)).astype(np.float32),
                       (ended * (rng.random((T, B)) < 0.5)).astype(np.float32), ended, valid)
state = module.init_state(jax.random.PRNGKey(0), args, module.EnvInfo((2, 6, 6), A, "gymnasium", False), 10)
''',
}
# Each term named on the command line is tried: "none" is the loss as it is; "l2" adds an L2 penalty as its
# docstring says a term of the parameters alone must be added (divided by the learner count); "l2-naive" adds it
# as it is. It prints, for each: how far one learner moved the parameters, and the gaps of two learners' update and
# losses from one learner's.
SAME_UPDATE = '''
import sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, {tests!r})
from conftest import load

rng = np.random.default_rng(0)
T, B, A = 5, 4, 3
valid = np.ones((T, B), np.float32)
valid[2, 1] = valid[3, 3] = 0.0
{setup}
loss = getattr(module, loss_name)

def with_l2(naive):
    def loss_fn(params, data, args):  # the script's loss, then the L2 term a student adds at its end
        total, losses = loss(params, data, args)
        l2 = sum((w ** 2).sum() for w in jax.tree.leaves(params))
        return total + 0.5 * l2 / (1 if naive else jax.lax.psum(1, "learners")), losses
    return loss_fn

for term in sys.argv[1:] or ["none"]:
    setattr(module, loss_name, {{"none": loss, "l2": with_l2(False), "l2-naive": with_l2(True)}}[term])
    outs = []
    for n in (1, 2):
        mesh = Mesh(np.array(jax.devices()[:n]), ("learners",))
        # Two actor threads' rollouts of 2 envs each: each learner joins its block of both.
        threads = [jax.tree.map(lambda x: x[:, half], batch) for half in (slice(0, 2), slice(2, 4))]
        placed = jax.device_put(threads, NamedSharding(mesh, P(None, "learners")))
        new, info = module.make_update(args, mesh, 10)(jax.device_put(state, NamedSharding(mesh, P())), placed)
        outs.append((jax.tree.leaves(jax.device_get(new.params)), np.asarray(jax.device_get(info))))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(outs[0][0], jax.tree.leaves(state.params)))
    gap = max(float(np.abs(a - b).max()) for a, b in zip(outs[0][0], outs[1][0]))
    print("term", term, "moved", moved, "gap", gap, "info_gap", float(np.abs(outs[0][1] - outs[1][1]).max()))
'''


def same_update(tmp_path, script, *terms):
    """{term: (moved, gap, info_gap)} from SAME_UPDATE on 2 fake devices."""
    (tmp_path / "same_update.py").write_text(SAME_UPDATE.format(tests=str(ROOT / "tests"), setup=SETUP[script]))
    result = run(tmp_path / "same_update.py", terms, tmp_path, devices=2, run_dir=False, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    rows = [line.split() for line in result.output.splitlines() if line.startswith("term ")]
    return {row[1]: tuple(float(row[row.index(name) + 1]) for name in ("moved", "gap", "info_gap")) for row in rows}


def assert_two_learners_make_one_learners_update(moved, gap, info_gap):
    assert moved > 1e-4 and gap < 1e-6 * max(moved, 1.0) + 1e-7 and info_gap < 1e-5


@pytest.mark.parametrize("script", list(SETUP))
def test_an_update_is_the_same_on_one_or_two_learner_devices(tmp_path, script):
    assert_two_learners_make_one_learners_update(*same_update(tmp_path, script)["none"])


@pytest.mark.parametrize("script", list(SETUP))
def test_a_parameter_only_loss_term_added_as_the_loss_says_gives_the_same_update_on_two_learners(tmp_path, script):
    """An L2 penalty divided by the learner count (jax.lax.psum(1, "learners")), as the loss's docstring says,
    gives two learners one learner's update; added as it is, each learner counts it and the update differs."""
    results = same_update(tmp_path, script, "l2", "l2-naive")
    assert_two_learners_make_one_learners_update(*results["l2"])
    naive_moved, naive_gap, _ = results["l2-naive"]
    assert naive_gap > 1e-3 * naive_moved, results  # the naive term is counted twice: this test would catch it
