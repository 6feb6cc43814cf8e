"""Anakin on Catch: the Podracer paper's own example (Hessel et al. 2021, section 3).

The environment is written in JAX, so acting and learning are one XLA program. Its minimal
unit is `lane_loss`: one environment lane rolls out 16 steps with the Q-network and scores
them with Q(lambda). That unit is `vmap`ped over the envs of a device, many updates loop
(`fori_loop`) inside one compiled call, and the call is replicated over every device (and
host) with `jit` + `shard_map`; gradients are averaged over envs and then across devices.

The agent is the paper colab's: a Q-network with one hidden layer of 256, Adam with step size
1e-4, 128 envs a device, rollouts of 16 steps, discount 1, lambda 0.99, the mean squared
Q(lambda) error with max_a Q bootstraps. Where this file departs from the colab: it acts
epsilon-greedily (the colab greedily: a greedy agent that misses the ball in some columns may
never try the moves that would catch it); its episodes are bsuite's 9 steps (the colab also
spends a step on the final board); all 16 steps of a rollout are learned from (the colab's loss
leaves out the last); and a device holds one copy of the parameters, not one a lane.

    host (Python)          one call = `--log-every` updates, no return to Python between them
    -------------          ---------------------------------------------------------------------
                           device 0                          device 1  ...  (every host)
    init / resume  ---->   params, opt state (one copy)      params, opt state (same copy)
                           envs 0..E-1 (lanes, vmap)         envs E..2E-1
                           loop over updates:                loop over updates:
                             rollout 16 steps + Q(lambda)      rollout 16 steps + Q(lambda)
                             grads = mean over lanes           grads = mean over lanes
                                   <------- pmean over "devices" (all hosts) ------->
                             Adam step (identical everywhere)  Adam step
    log, checkpoint <---   metrics (psum / pmean)

Examples:
    python anakin_catch.py                                   # ~1 min on a 2-core CPU
    python anakin_catch.py --num-envs-per-device 1024 --total-timesteps 20_000_000
    python anakin_catch.py --resume runs/Catch__anakin_catch__1__1700000000/checkpoint.npz
"""

import difflib
import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorboardX import SummaryWriter


@dataclass
class Args:
    env_id: str = "Catch"
    """environment: the only one in this file is `Catch` (bsuite's rules)"""
    exp_name: str = Path(__file__).stem
    """experiment name, part of the run folder's name"""
    seed: int = 1
    """seeds parameters, environments and exploration"""
    total_timesteps: int = 16_000_000
    """environment steps summed over all envs, devices and hosts"""
    learning_rate: float = 1e-4
    """Adam step size"""
    num_envs_per_device: int = 128
    """environment lanes vmapped on each device"""
    num_devices: int | None = None
    """devices used on each host (default: all local devices)"""
    num_steps: int = 16
    """rollout length of one update, per env"""
    gamma: float = 1.0
    """agent discount"""
    q_lambda: float = 0.99
    """lambda of the Q(lambda) returns"""
    epsilon: float = 0.01
    """probability of a uniformly random action (acting is otherwise greedy; the colab's is 0)"""
    log_every: int = 10
    """updates per compiled call (no return to Python between them); one log line per call"""
    checkpoint_every: int = 100
    """updates between checkpoints (one is always written at the end)"""
    run_dir: str = "runs"
    """parent folder of run folders"""
    resume: str | None = None
    """checkpoint.npz to continue from"""
    distributed: bool = False
    """call jax.distributed.initialize() for a multi-host run"""
    coordinator_address: str | None = None
    """host:port of process 0 (multi-host; JAX detects it on SLURM, Cloud TPU, Kubernetes)"""
    num_processes: int | None = None
    """number of processes (multi-host)"""
    process_id: int | None = None
    """index of this process (multi-host)"""


# ---- The environment: Catch (bsuite, Osband et al. 2020), pure functions in JAX ----------

ROWS, COLS = 10, 5
NUM_ACTIONS = 3  # left, stay, right


class Catch(NamedTuple):
    ball_x: jax.Array  # int32 column of the ball
    ball_y: jax.Array  # int32 row of the ball, 0 at the top
    paddle_x: jax.Array  # int32 column of the paddle, which lives on the bottom row


def reset(key):
    return Catch(jax.random.randint(key, (), 0, COLS), jnp.int32(0), jnp.int32(COLS // 2))


def observe(state):
    """The board, [ROWS, COLS] float32: 1 at the ball and at the paddle."""
    board = jnp.zeros((ROWS, COLS), jnp.float32).at[state.ball_y, state.ball_x].set(1.0)
    return board.at[ROWS - 1, state.paddle_x].set(1.0)


def step(state, action, key):
    """Move the paddle, drop the ball one row; at the bottom row score +-1 and reset."""
    paddle_x = jnp.clip(state.paddle_x + action - 1, 0, COLS - 1)
    ball_y = state.ball_y + 1
    done = ball_y == ROWS - 1
    reward = jnp.where(done, jnp.where(paddle_x == state.ball_x, 1.0, -1.0), 0.0)
    moved = Catch(state.ball_x, ball_y, paddle_x)
    state = jax.tree.map(lambda new, old: jnp.where(done, new, old), reset(key), moved)
    return state, reward, done


# ---- The network: the paper's Q-network, one hidden layer of 256 units ------------------

def linear(key, n_in, n_out):
    """A layer initialised as Haiku's `hk.Linear` (the colab's): normal truncated at 2 std, std 1/sqrt(n_in)."""
    return {"w": jax.random.truncated_normal(key, -2.0, 2.0, (n_in, n_out)) / jnp.sqrt(n_in), "b": jnp.zeros(n_out)}


def init_params(key, hidden=256):
    k_hidden, k_out = jax.random.split(key)
    return {"hidden": linear(k_hidden, ROWS * COLS, hidden), "out": linear(k_out, hidden, NUM_ACTIONS)}


def apply(params, obs):
    """Q-values [..., NUM_ACTIONS] of boards [..., ROWS, COLS]: Flatten, Linear(256), ReLU, Linear(3)."""
    x = obs.reshape(*obs.shape[:-2], -1)
    x = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return x @ params["out"]["w"] + params["out"]["b"]


# ---- The loss: Q(lambda) (Watkins/Peng-style lambda-returns that bootstrap with max_a Q) --

def lambda_returns(rewards, discounts, next_values, lam):
    """G_t = r_t + d_t ((1 - lam) v_{t+1} + lam G_{t+1}), with G_T-1 bootstrapping on v_T.

    All inputs are [T]; `discounts` is zero where an episode ended at step t.
    """
    def backward(g_next, x):
        r, d, v = x
        g = r + d * ((1 - lam) * v + lam * g_next)
        return g, g

    _, returns = jax.lax.scan(backward, next_values[-1], (rewards, discounts, next_values), reverse=True)
    return returns


class Lane(NamedTuple):
    """What one environment lane carries from update to update."""
    env: Catch
    key: jax.Array  # the lane's own RNG, so results do not depend on the device layout
    ep_return: jax.Array  # return of the episode in progress
    ep_length: jax.Array


class Trajectory(NamedTuple):
    """One lane's rollout; every field is [T] except q, [T, NUM_ACTIONS]."""
    q: jax.Array  # Q-values computed to act (the loss differentiates these)
    action: jax.Array
    reward: jax.Array
    done: jax.Array  # the episode ended at this step
    ended_return: jax.Array  # return of the episode that ended here, else 0
    ended_length: jax.Array


def rollout(params, lane, args):
    """Act greedily (epsilon-greedy) for `num_steps` in one lane; also the bootstrap Q-values."""
    def act_and_step(lane, _):
        key, k_explore, k_random, k_reset = jax.random.split(lane.key, 4)
        q = apply(params, observe(lane.env))
        explore = jax.random.uniform(k_explore) < args.epsilon
        action = jnp.where(explore, jax.random.randint(k_random, (), 0, NUM_ACTIONS), jnp.argmax(q))
        env, reward, done = step(lane.env, action, k_reset)
        ep_return, ep_length = lane.ep_return + reward, lane.ep_length + 1
        out = Trajectory(q, action, reward, done, jnp.where(done, ep_return, 0.0), jnp.where(done, ep_length, 0))
        return Lane(env, key, jnp.where(done, 0.0, ep_return), jnp.where(done, 0, ep_length)), out

    lane, traj = jax.lax.scan(act_and_step, lane, length=args.num_steps)
    return lane, traj, apply(params, observe(lane.env))


def q_lambda_loss(q, q_last, actions, rewards, dones, gamma, lam):
    """Mean squared TD error of Q(s_t, a_t) against Q(lambda) returns (the colab's loss).

    q: [T, A] Q-values at s_0..s_T-1; q_last: [A] at s_T; the rest [T]. Q at s_t+1 is the
    next step's row of `q`; after an episode end that row belongs to the reset state, and
    the zero discount masks it out.
    """
    next_values = jnp.max(jnp.concatenate([q[1:], q_last[None]]), axis=-1)
    targets = lambda_returns(rewards, gamma * (1.0 - dones), next_values, lam)
    q_taken = jnp.take_along_axis(q, actions[:, None], axis=-1)[:, 0]
    return jnp.mean((jax.lax.stop_gradient(targets) - q_taken) ** 2)


class Stats(NamedTuple):
    loss: jax.Array
    q_mean: jax.Array
    return_sum: jax.Array  # summed over the episodes that ended
    length_sum: jax.Array
    episodes: jax.Array


def lane_loss(params, lane, args):
    """The minimal unit: one lane's rollout, scored with Q(lambda) (the paper's example)."""
    lane, traj, q_last = rollout(params, lane, args)
    loss = q_lambda_loss(traj.q, q_last, traj.action, traj.reward, traj.done, args.gamma, args.q_lambda)
    stats = Stats(loss, traj.q.mean(), traj.ended_return.sum(), traj.ended_length.sum(), traj.done.sum())
    return loss, (lane, stats)


# ---- Acting and learning on one device, then replicated (the Anakin mapping) --------------

class Learner(NamedTuple):
    params: dict
    opt_state: optax.OptState
    lanes: Lane  # leaves [envs, ...], split across devices


def make_optimizer(args):
    return optax.adam(args.learning_rate)


def init_learner(key, args, num_envs):
    k_params, k_lanes = jax.random.split(key)
    params = init_params(k_params)
    keys = jax.vmap(jax.random.split)(jax.random.split(k_lanes, num_envs))  # [envs, 2, 2]
    envs = jax.vmap(reset)(keys[:, 0])
    zeros = jnp.zeros(num_envs)
    lanes = Lane(envs, keys[:, 1], zeros, zeros.astype(jnp.int32))
    return Learner(params, make_optimizer(args).init(params), lanes)


def update(learner, args):
    """One update on one device: its lanes' rollouts, then gradients averaged everywhere."""
    def device_loss(params):  # the lanes' mean loss: its gradient is the lanes' mean gradient
        losses, aux = jax.vmap(lane_loss, (None, 0, None))(params, learner.lanes, args)
        return losses.mean(), aux

    (_, (lanes, stats)), grads = jax.value_and_grad(device_loss, has_aux=True)(learner.params)
    # The paper vmaps the whole update with params broadcast to each lane and pmeans the
    # per-lane gradients over the batch axis. Every lane holds the same parameters, so that
    # mean is the gradient of the lanes' mean loss taken once here: the same numbers without
    # a copy of params and Adam state per lane. Then average across devices (and hosts).
    grads = jax.lax.pmean(grads, "devices")
    updates, opt_state = make_optimizer(args).update(grads, learner.opt_state)
    params = optax.apply_updates(learner.params, updates)
    stats = Stats(jax.lax.pmean(stats.loss.mean(), "devices"), jax.lax.pmean(stats.q_mean.mean(), "devices"),
                  *(jax.lax.psum(x.sum(), "devices") for x in stats[2:]))
    return Learner(params, opt_state, lanes), stats


def make_train(args, mesh):
    """The compiled call: `num_updates` updates on every device of `mesh`, and their Stats summed.

    The count is an argument (at most --log-every), so one compilation serves every call.
    """
    def train(learner, num_updates):
        def one_update(_, carry):
            learner, totals = carry
            learner, stats = update(learner, args)
            return learner, jax.tree.map(jnp.add, totals, stats)

        return jax.lax.fori_loop(0, num_updates, one_update, (learner, Stats(*[jnp.float32(0)] * 5)))

    # check_vma=False: params enter replicated (P()) and we average their gradients
    # ourselves with pmean; with check_vma=True JAX would already sum them across devices.
    specs = Learner(P(), P(), P("devices"))
    sharded = jax.shard_map(train, mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=0)


def shardings(mesh):
    return Learner(NamedSharding(mesh, P()), NamedSharding(mesh, P()), NamedSharding(mesh, P("devices")))


# ---- Plumbing: input checks, devices, checkpoints, logging -------------------------------

def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    if args.env_id != "Catch":
        close = difflib.get_close_matches(args.env_id, ["Catch"], n=1, cutoff=0.3)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        fail(f"--env-id {args.env_id!r} is not available{hint}; this file defines: 'Catch'")
    for flag in ("num_envs_per_device", "num_steps", "log_every", "checkpoint_every"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    if not 0 <= args.epsilon <= 1:
        fail(f"--epsilon {args.epsilon} must be in [0, 1]")
    if args.resume and not Path(args.resume).is_file():
        fail(f"--resume {args.resume!r}: no such checkpoint file")


def pick_devices(args):
    local = jax.local_devices()
    n = len(local) if args.num_devices is None else args.num_devices
    if not 1 <= n <= len(local):
        fail(f"--num-devices {n} is not possible: this host has {len(local)} device(s)")
    devices = [d for p in range(jax.process_count())
               for d in [d for d in jax.devices() if d.process_index == p][:n]]
    return Mesh(np.array(devices), ("devices",))


def flat(tree):
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


COUNTER = jax.ShapeDtypeStruct((), np.int64)


def save(path, learner, update, global_step):
    # every process takes part in gathering the lanes of all hosts; process 0 writes them
    arrays = {**flat(multihost_utils.process_allgather(learner, tiled=True)),
              "update": np.int64(update), "global_step": np.int64(global_step)}
    if jax.process_index() != 0:
        return
    tmp = Path(path).with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # a crash never leaves a torn checkpoint


def place(learner, mesh):
    """Put a host Learner (NumPy leaves, all lanes) onto the mesh: params replicated, lanes split."""
    def put(sharding, part):
        return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]), part)

    return Learner(*map(put, shardings(mesh), learner))


def load(path, template):
    """A host Learner and counters from a checkpoint, checked against `template` (shapes)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = dict(f)
    except Exception as e:
        fail(f"--resume {path!r} is not a readable checkpoint ({type(e).__name__}: {e})")
    expected = {**flat(template), "update": COUNTER, "global_step": COUNTER}
    for name, spec in expected.items():
        got = arrays.get(name)
        if got is None or got.shape != spec.shape or got.dtype != spec.dtype:
            found = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            fail(f"--resume {path!r} does not match this run: {name} is {found}, expected "
                 f"{spec.dtype}{list(spec.shape)} (same --num-envs-per-device and device count?)")
    learner = jax.tree.unflatten(jax.tree.structure(template), [arrays[name] for name in flat(template)])
    return learner, int(arrays["update"]), int(arrays["global_step"])


def checksum(params):
    """sha256 of the parameters' bytes in key-path order, to compare runs and hosts."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
    return digest.hexdigest()


def summarize(stats, n, args, sps):
    """The metrics row of one call, from its Stats summed over `n` updates."""
    row = {"charts/SPS": sps, "charts/learning_rate": args.learning_rate,
           "losses/td_loss": stats.loss / n, "losses/q_values": stats.q_mean / n}
    if stats.episodes > 0:
        row["charts/episodic_return"] = stats.return_sum / stats.episodes
        row["charts/episodic_length"] = stats.length_sum / stats.episodes
    return row


class Logger:
    """Console progress line, metrics.jsonl and TensorBoard; files on process 0 only."""

    def __init__(self, args):
        self.start = time.time()
        self.dir = Path(args.run_dir) / f"{args.env_id}__{args.exp_name}__{args.seed}__{int(self.start)}"
        self.main = jax.process_index() == 0
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
            self.writer = SummaryWriter(str(self.dir))

    def log(self, row, update, num_updates, total_steps, eta):
        if not self.main:
            return
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        for name, value in row.items():
            if "/" in name:
                self.writer.add_scalar(name, value, row["global_step"])
        step = row["global_step"]
        print(f"update {update}/{num_updates} | step {step:,}/{total_steps:,} ({step / total_steps:.0%}) | "
              f"SPS {row['charts/SPS']:,.0f} | return {row.get('charts/episodic_return', float('nan')):.2f} | "
              f"ETA {int(eta) // 60}m{int(eta) % 60:02d}s", flush=True)


def main(args):
    check_args(args)
    if args.distributed:
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    mesh = pick_devices(args)
    num_envs = args.num_envs_per_device * mesh.size
    steps_per_update = num_envs * args.num_steps
    num_updates = args.total_timesteps // steps_per_update
    if num_updates < 1:
        fail(f"--total-timesteps {args.total_timesteps:,} is less than one update: {steps_per_update:,} steps "
             f"(--num-steps {args.num_steps} x {args.num_envs_per_device} envs x {mesh.size} devices)")
    init = partial(init_learner, args=args, num_envs=num_envs)
    key = jax.random.PRNGKey(args.seed)
    if args.resume:
        host_learner, update, global_step = load(args.resume, jax.eval_shape(init, key))
        learner = place(host_learner, mesh)
    else:
        learner, update, global_step = jax.jit(init, out_shardings=shardings(mesh))(key), 0, 0

    logger = Logger(args)
    checkpoint = logger.dir / "checkpoint.npz"
    stop = []  # Ctrl-C: finish the call in flight, write a checkpoint, exit
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    tic = time.time()  # compiled ahead of time, so SPS never includes compilation
    train = make_train(args, mesh).lower(learner, np.int32(args.log_every)).compile()
    print(f"compiled in {time.time() - tic:.1f}s", flush=True)
    last_saved, row = update, {}
    while update < num_updates and not stop:
        n = min(args.log_every, num_updates - update)
        tic = time.time()
        learner, stats = train(learner, np.int32(n))
        stats = Stats(*(float(x.addressable_data(0)) for x in stats))  # sums over n updates; waits
        update, global_step, seconds = update + n, global_step + n * steps_per_update, time.time() - tic
        if not np.isfinite(stats.loss):
            sys.exit(f"error: non-finite loss at update {update}; last good checkpoint: {checkpoint}")
        row = {"global_step": global_step, "update": update, **summarize(stats, n, args, n * steps_per_update / seconds)}
        logger.log(row, update, num_updates, num_updates * steps_per_update, (num_updates - update) / n * seconds)
        if update - last_saved >= args.checkpoint_every:
            save(checkpoint, learner, update, global_step)
            last_saved = update
    save(checkpoint, learner, update, global_step)
    if stop:
        print(f"interrupted at update {update}: checkpoint written to {checkpoint}", flush=True)
        sys.exit(130)
    row["checksum"] = checksum(learner.params)
    print(f"checksum {row['checksum']}", flush=True)
    return row


if __name__ == "__main__":
    main(tyro.cli(Args))
