"""Anakin on Catch: the Podracer paper's own example (Hessel et al. 2021, section 3, and its colab).

Catch is written in JAX, so acting and learning compile into one XLA program:

    host (Python)          one compiled call = `--log-every` updates
    -------------          ---------------------------------------------------------------------
                           device 0                          device 1  ...  (every host)
    init / resume  ---->   params, opt state (replicated)    params, opt state
                           envs 0..E-1 (lanes, vmap)         envs E..2E-1
                           loop over updates:                loop over updates:
                             rollout 16 steps + Q(lambda)      rollout 16 steps + Q(lambda)
                             grads = mean over lanes           grads = mean over lanes
                                   <------- pmean over "devices" (all hosts) ------->
                             Adam step                         Adam step
    log, checkpoint <---   metrics (psum)

Reading order: `step`, `q_lambda_loss`, `lane_loss` (one lane's rollout and loss: add loss terms
here), `update` (one device's update), `make_train` (the paper's minimal unit: a loop of updates,
shard_mapped over devices), then the run: `initial_state`, `main`.

    python anakin_catch.py  # ~1 min on 2 CPU cores
    python anakin_catch.py --num-envs-per-device 1024 --total-timesteps 20_000_000
"""

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Annotated, NamedTuple

# Before `import jax`, which swallows a Ctrl-C raised in its callbacks: from here a signal is only
# recorded, the run stops at its next safe point, and a second signal ends the process at once.
STOPS = []  # the signals caught
def note_stop(signum, frame):
    STOPS.append(signum)
    signal.signal(signal.SIGINT, signal.SIG_DFL), signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGINT, note_stop), signal.signal(signal.SIGTERM, note_stop)

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorboardX import SummaryWriter


@dataclasses.dataclass
class Args:
    env_id: str = "Catch"  # the only env here
    seed: int = 1  # seeds the parameters, envs and actions
    total_timesteps: int = 16_000_000  # env steps over all envs, devices and hosts
    learning_rate: float = 1e-4  # Adam step size
    num_envs_per_device: int = 128  # env lanes per device
    num_devices: Annotated[int | None, tyro.conf.arg(help_behavior_hint="(default: all)")] = None  # per host
    num_steps: int = 16  # rollout length
    gamma: float = 1.0  # discount
    q_lambda: float = 0.99  # Q(lambda)'s lambda
    epsilon: float = 0.01  # probability of a random action (the colab's: 0)
    log_every: int = 10  # updates per compiled call and per log line
    checkpoint_every: int = 100  # updates between checkpoints
    # The plumbing section at the end of the file reads the flags below.
    exp_name: str = Path(__file__).stem  # in the run folder's name
    run_dir: str = "runs"  # parent folder of run folders
    resume: str | None = None  # a checkpoint.npz
    distributed: bool = False  # call jax.distributed.initialize() (multi-host)
    coordinator_address: str | None = None  # host:port of process 0 (multi-host)
    num_processes: int | None = None  # processes in all (multi-host)
    process_id: int | None = None  # this process's index


# ---- The environment: Catch (bsuite, Osband et al. 2020)

ROWS, COLS = 10, 5
NUM_ACTIONS = 3  # left, stay, right


class Catch(NamedTuple):  # int32 scalars
    ball_x: jax.Array
    ball_y: jax.Array  # 0 at the top
    paddle_x: jax.Array  # on the bottom row


def reset(key):
    return Catch(ball_x=jax.random.randint(key, (), 0, COLS), ball_y=jnp.int32(0), paddle_x=jnp.int32(COLS // 2))


def observe(env):
    """1 at the ball and the paddle."""
    board = jnp.zeros((ROWS, COLS), jnp.float32).at[env.ball_y, env.ball_x].set(1.0)
    return board.at[ROWS - 1, env.paddle_x].set(1.0)


def step(env, action, key):
    """The ball falls a row; on the bottom row the episode ends (+1 caught, -1 missed) and the next begins."""
    paddle_x = jnp.clip(env.paddle_x + action - 1, 0, COLS - 1)
    ball_y = env.ball_y + 1
    done = ball_y == ROWS - 1
    reward = jnp.where(done, jnp.where(paddle_x == env.ball_x, 1.0, -1.0), 0.0)
    moved = env._replace(ball_y=ball_y, paddle_x=paddle_x)
    # `done` is known only inside the compiled program, where a Python `if` cannot branch on it. So
    # every step draws a next episode's start, and `jnp.where` keeps it where this episode ended,
    # field by field (`jax.tree.map` applies the function to each field).
    env = jax.tree.map(lambda new, old: jnp.where(done, new, old), reset(key), moved)
    return env, reward, done


# ---- The network: the colab's MLP

def linear(key, n_in, n_out):
    """As the colab's `hk.Linear`: weights a standard normal cut at +-2, times 1/sqrt(n_in)."""
    w = jax.random.truncated_normal(key, -2.0, 2.0, (n_in, n_out)) / jnp.sqrt(n_in)
    return {"w": w, "b": jnp.zeros(n_out)}


def init_params(key, hidden=256):
    k_hidden, k_out = jax.random.split(key)
    return {"hidden": linear(k_hidden, ROWS * COLS, hidden), "out": linear(k_out, hidden, NUM_ACTIONS)}


def apply(params, obs):
    """Q-values [..., NUM_ACTIONS] of boards [..., ROWS, COLS]."""
    x = obs.reshape(*obs.shape[:-2], -1)
    x = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return x @ params["out"]["w"] + params["out"]["b"]


# ---- The loss: Peng's Q(lambda), bootstrapping with max_a Q

def lambda_returns(rewards, discounts, next_values, lam):
    """The lambda-return of each step t of 0..T-1, computed backwards from G_T = v_T: G_t = r_t +
    d_t ((1 - lam) v_{t+1} + lam G_{t+1}), with d_t step t's discount and v_{t+1} = next_values[t], the
    value of the state step t led to. All arrays are [T]. `jax.lax.scan` is a compiled for-loop: it
    calls `backward` on each row of the inputs, last row first, passes the carry on, stacks the outputs."""
    def backward(g_next, x):
        r, d, v = x
        g = r + d * ((1 - lam) * v + lam * g_next)
        return g, g

    _, returns = jax.lax.scan(backward, next_values[-1], (rewards, discounts, next_values), reverse=True)
    return returns


def q_lambda_loss(q, q_last, actions, rewards, dones, gamma, lam):
    """q: [T, A], q_last: [A] (after the rollout), the rest [T]. Where step t ends an episode, its
    discount is 0, so row t + 1 of `q` (the next episode's first state) is not in t's target. The
    targets are made of the same network's Q-values, but `stop_gradient` holds them fixed: the
    gradient reaches the parameters only through `q_taken`, the Q-values of the actions taken."""
    next_values = jnp.max(jnp.concatenate([q[1:], q_last[None]]), axis=-1)
    targets = lambda_returns(rewards, gamma * (1.0 - dones), next_values, lam)
    q_taken = jnp.take_along_axis(q, actions[:, None], axis=-1)[:, 0]
    return jnp.mean((jax.lax.stop_gradient(targets) - q_taken) ** 2)


# ---- Acting and learning on one device

class Lane(NamedTuple):
    env: Catch
    key: jax.Array  # one per lane, so no result depends on the device layout
    ep_return: jax.Array  # of the episode so far
    ep_length: jax.Array


class Trajectory(NamedTuple):  # one lane's rollout: [T], a row per step
    q: jax.Array  # [T, NUM_ACTIONS]: acted on, and differentiated by the loss
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    ended_return: jax.Array  # the return of an episode ending here, else 0
    ended_length: jax.Array


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    lanes: Lane  # each leaf [envs, ...]


class Stats(NamedTuple):  # sums over lanes, devices and updates
    td_loss: jax.Array  # a sum of lane means
    q_values: jax.Array
    return_sum: jax.Array
    length_sum: jax.Array
    episodes: jax.Array


def make_optimizer(args):
    return optax.adam(args.learning_rate)


def init_state(key, args, num_envs):
    k_params, k_lanes = jax.random.split(key)
    params = init_params(k_params)
    # JAX has no global random state: each draw takes a key, and jax.random.split makes new keys.
    # Under `jax.vmap` (a leading axis, a row an env) each env's key is split in two: one draws the
    # env's first episode, the other becomes the lane's key.
    keys = jax.vmap(jax.random.split)(jax.random.split(k_lanes, num_envs))  # [envs, 2, 2]
    zeros = jnp.zeros(num_envs)
    lanes = Lane(env=jax.vmap(reset)(keys[:, 0]), key=keys[:, 1], ep_return=zeros, ep_length=zeros.astype(jnp.int32))
    return TrainState(params=params, opt_state=make_optimizer(args).init(params), lanes=lanes)


def rollout(params, lane, args):
    """One lane acts epsilon-greedily for `num_steps` steps (`lax.scan` carries the lane from step
    to step), then gives Q at the state it ends in, to bootstrap from."""
    def act_and_step(lane, _):
        key, k_explore, k_random, k_reset = jax.random.split(lane.key, 4)
        q = apply(params, observe(lane.env))
        explore = jax.random.uniform(k_explore) < args.epsilon
        action = jnp.where(explore, jax.random.randint(k_random, (), 0, NUM_ACTIONS), jnp.argmax(q))
        env, reward, done = step(lane.env, action, k_reset)
        ep_return, ep_length = lane.ep_return + reward, lane.ep_length + 1
        out = Trajectory(q=q, action=action, reward=reward, done=done,
                         ended_return=jnp.where(done, ep_return, 0.0), ended_length=jnp.where(done, ep_length, 0))
        return Lane(env=env, key=key, ep_return=jnp.where(done, 0.0, ep_return),
                    ep_length=jnp.where(done, 0, ep_length)), out

    lane, traj = jax.lax.scan(act_and_step, lane, length=args.num_steps)
    return lane, traj, apply(params, observe(lane.env))


def lane_loss(params, lane, args):
    """One lane's rollout, scored with Q(lambda): the colab's `loss_fn`. `update` differentiates it
    whole: the Q-values the lane acted on are the ones the loss trains (no no_grad rollout, no
    second pass). A loss term goes here. `update` pmeans the gradients of each device's mean over
    its lanes (equal lane counts), so a mean over the lane's steps, as this loss is, trains on the
    mean over all steps of all hosts, and a term of the parameters alone (an L2 penalty) counts
    once: add it after `stats`, or td_loss logs it. In a Sebulba script, whose L learners psum their
    sums, a `.mean()` term gets L times the gradient, a parameter term L times."""
    lane, traj, q_last = rollout(params, lane, args)
    loss = q_lambda_loss(traj.q, q_last, traj.action, traj.reward, traj.done, args.gamma, args.q_lambda)
    stats = Stats(td_loss=loss, q_values=traj.q.mean(), return_sum=traj.ended_return.sum(),
                  length_sum=traj.ended_length.sum(), episodes=traj.done.sum())
    return loss, (lane, stats)


def update(state, args):
    """One update on one device. The colab vmaps its `update_fn`, one lane's whole update, over the
    lanes (axis `j`), each lane with its own copy of the parameters and Adam state, and pmeans the
    gradients over `j` and the cores (`i`). Here only `lane_loss` is vmapped: the gradient of the
    lanes' mean is the mean of their gradients, the same update without per-lane copies."""
    def device_loss(params):
        # vmap runs `lane_loss` on all this device's lanes at once: params, args shared (None), lanes split (0).
        losses, aux = jax.vmap(lane_loss, (None, 0, None))(params, state.lanes, args)
        return losses.mean(), aux

    (_, (lanes, stats)), grads = jax.value_and_grad(device_loss, has_aux=True)(state.params)
    # "devices" is the mesh axis of all hosts' devices (`pick_devices`, bound by `shard_map` below),
    # and pmean over it is DDP's all_reduce of the mean. As the devices hold equal lane counts, their
    # gradients' mean is the gradient of the mean over all lanes.
    grads = jax.lax.pmean(grads, "devices")
    deltas, opt_state = make_optimizer(args).update(grads, state.opt_state)
    params = optax.apply_updates(state.params, deltas)
    stats = jax.tree.map(lambda x: jax.lax.psum(x.sum(), "devices"), stats)  # over lanes and devices
    return TrainState(params=params, opt_state=opt_state, lanes=lanes), stats


# ---- The device mapping: shard_map over devices

# shard_map's specs (see `make_train`), one a TrainState field, each covering the field's whole
# subtree (every weight in `params`, every Adam moment in `opt_state`). As an input spec, P() gives
# each device the whole array; P("devices") splits each leaf's first axis: [envs, ...] to [E, ...].
STATE_SPECS = TrainState(params=P(), opt_state=P(), lanes=P("devices"))


def make_train(args, mesh):
    """`train` runs `n` updates on one device, the colab's minimal unit (its `learner_fn`), which
    shard_map runs on every device. `n` is an argument, so a shorter last call needs no new
    compilation."""
    def train(state, n):
        def one_update(_, carry):
            state, total = carry
            state, stats = update(state, args)
            return state, jax.tree.map(jnp.add, total, stats)

        zeros = Stats(**{name: jnp.float32(0) for name in Stats._fields})
        return jax.lax.fori_loop(0, n, one_update, (state, zeros))  # a compiled for-loop

    # shard_map runs `train` on each device with its share of the inputs (in_specs), as DDP runs a
    # process per GPU, and joins the devices' results into the outputs (out_specs). In out_specs,
    # P() promises that every device holds the same value (the params, kept equal by the pmean, and
    # the psum'ed stats), so JAX returns device 0's copy.
    # check_vma=False (vma, "varying manual axes": JAX's record of which values differ by device).
    # With it on, jax.grad would itself sum the gradients over devices, N times their mean (DDP's
    # backward() averages them); off, the pmean in `update` is the one all-reduce of the gradients.
    sharded = jax.shard_map(train, mesh=mesh, in_specs=(STATE_SPECS, P()), out_specs=(STATE_SPECS, P()),
                            check_vma=False)
    # donate_argnums=0 lets XLA reuse the old state's memory for the new: the caller never reads it.
    return jax.jit(sharded, donate_argnums=0)


def pick_devices(args):
    """The first --num-devices of every host, on one mesh axis, "devices"."""
    local = jax.local_devices()
    per_host = len(local) if args.num_devices is None else args.num_devices
    if not 1 <= per_host <= len(local):
        fail(f"--num-devices {per_host} is not possible: this host has {len(local)} device(s)")
    hosts = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    return Mesh(np.array([d for host in hosts for d in host[:per_host]]), ("devices",))


# ---- The run: its state and log, then main

def initial_state(args, mesh, num_envs):
    """The TrainState on the mesh, fresh or resumed, and its updates done."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), STATE_SPECS)
    init = jax.jit(partial(init_state, jax.random.PRNGKey(args.seed), args, num_envs), out_shardings=shardings)
    if not args.resume:
        return init(), 0
    # `eval_shape` gives init's shapes without running it: the template the checkpoint must match.
    ckpt = load(args, {"state": jax.eval_shape(init), "update": np.int64(0), "global_step": np.int64(0)})
    return jax.device_put(ckpt["state"], shardings), int(ckpt["update"])


def checkpoint(state, updates_done, steps_per_update):
    """Every process calls this, as each holds only its own devices' lanes."""
    return {"state": multihost_utils.process_allgather(state, tiled=True), "update": np.int64(updates_done),
            "global_step": np.int64(updates_done * steps_per_update)}


def metrics_row(stats, lane_updates, args):
    """Means of Stats summed over `lane_updates` (updates x lanes)."""
    stats = jax.tree.map(float, stats)
    row = {"charts/learning_rate": args.learning_rate,
           "losses/td_loss": stats.td_loss / lane_updates, "losses/q_values": stats.q_values / lane_updates}
    if stats.episodes > 0:
        row["charts/episodic_return"] = stats.return_sum / stats.episodes
        row["charts/episodic_length"] = stats.length_sum / stats.episodes
    return row


def main(args: Args) -> dict:
    start(args)
    if args.env_id != "Catch":
        fail(f"--env-id {args.env_id!r}: this file defines only 'Catch'")
    mesh = pick_devices(args)
    num_envs = args.num_envs_per_device * mesh.size  # all hosts'
    steps_per_update = args.num_steps * num_envs
    if not 0 < steps_per_update <= args.total_timesteps:
        fail(f"--total-timesteps {args.total_timesteps:,} is less than one update: {steps_per_update:,} steps "
             f"(--num-steps {args.num_steps} x {args.num_envs_per_device} envs x {mesh.size} devices)")
    num_updates = args.total_timesteps // steps_per_update
    state, updates_done = initial_state(args, mesh, num_envs)
    if updates_done >= num_updates:
        fail(f"--resume {args.resume}: its run has done all {num_updates} updates (raise --total-timesteps)")
    train = make_train(args, mesh).lower(state, np.int32(0)).compile()  # before the clock starts
    run, row = open_run(args, updates_done, num_updates), {}
    while updates_done < num_updates:
        n = min(args.log_every, num_updates - updates_done)
        tic = time.time()
        # A JAX call returns before the device is done; device_get waits for the stats, so that the
        # time below counts the whole call.
        state, stats = train(state, np.int32(n))
        stats = jax.device_get(stats)
        updates_done += n
        row = {"global_step": updates_done * steps_per_update, "update": updates_done,
               "charts/SPS": n * steps_per_update / (time.time() - tic), **metrics_row(stats, n * num_envs, args)}
        log(run, row)
        # Checkpoint when a call passes a multiple of --checkpoint-every, and after the last.
        due = updates_done % args.checkpoint_every < n or updates_done == num_updates
        safe_point(args, run, updates_done, due, partial(checkpoint, state, updates_done, steps_per_update))
    row["checksum"] = checksum(state.params)
    print(f"checksum {row['checksum']}", flush=True)
    return row


# ---- Plumbing: run folder, signals, checkpoints, metrics; the same in all four scripts ----
START = []  # the time and update of the first progress line: the ETA's pace is training's alone
def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)
def start(args):
    """First in `main`: refuse counts below 1 and seeds out of range, then join the other hosts."""
    if low := [k for k, v in vars(args).items() if type(v) is int and v < 1 and k not in ("seed", "process_id")]:
        fail(f"--{low[0].replace('_', '-')} {getattr(args, low[0])} must be at least 1")  # a count
    if not 0 <= args.seed < 2**31:  # all four scripts' range: envpool takes int32, default_rng >= 0
        fail(f"--seed {args.seed} must be in 0..{2**31 - 1}")
    if args.distributed:  # flags left unset are found by JAX itself (SLURM, Cloud TPU, Kubernetes)
        try:
            jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        except ValueError as e:  # JAX checks the three where it finds no cluster to fill them in
            fail(f"--distributed could not start ({e}): outside SLURM, Cloud TPU and Kubernetes "
                 "give --coordinator-address, --num-processes and --process-id")
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))  # SIGINT's, not JAX's own
    elif args.coordinator_address or args.num_processes or args.process_id is not None:
        fail("--coordinator-address, --num-processes and --process-id need --distributed")

class Run(NamedTuple):
    folder: Path | None  # {run-dir}/{env}__{exp-name}__{seed}__{unix time}; process 0 only
    writer: SummaryWriter | None  # TensorBoard
    num_updates: int
def open_run(args, update, num_updates):  # other characters become "_", so the folder stays in --run-dir
    if jax.process_index() != 0:
        return Run(folder=None, writer=None, num_updates=num_updates)
    name = "__".join(re.sub(r"[^\w.+-]", "_", str(s)) for s in (args.env_id, args.exp_name, args.seed))
    try:  # a file in the way, no permission, a name too long
        (folder := Path(args.run_dir) / f"{name}__{int(time.time())}").mkdir(parents=True)
    except OSError as e:
        fail(f"--run-dir {args.run_dir} and --exp-name: cannot make the run folder ({e.strerror})")
    (folder / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
    return Run(folder=folder, writer=SummaryWriter(str(folder)), num_updates=num_updates)

def safe_point(args, run, update, due, tree):  # save tree() if due or stopping; then stop
    signum = int(np.max(multihost_utils.process_allgather(np.int32(STOPS[0] if STOPS else 0))))  # any host's
    if due or signum:
        arrays = flat(tree())
        if not all(np.isfinite(x).all() for x in arrays.values() if x.dtype.kind == "f"):
            end(run, 1, f"error: the run diverged: non-finite parameters after update {update}")
        if run.folder is not None:  # moved into place whole: never torn
            np.savez(run.folder / "tmp.npz", **arrays, args=json.dumps(dataclasses.asdict(args)))
            os.replace(run.folder / "tmp.npz", run.folder / "checkpoint.npz")
    if signum:
        end(run, 128 + signum, f"stopped by {signal.Signals(signum).name} after update {update}")
def flat(tree):  # each leaf under its path: {"state/params/<layer>/w": array, ...}
    return {jax.tree_util.keystr(k, simple=True, separator="/"): x for k, x in jax.tree.leaves_with_path(tree)}

def load(args, template):  # template's arrays, if the run had these shapes and flags
    try:
        if (path := Path(args.resume)).exists() and not path.is_file():  # np.load blocks on a pipe
            raise OSError("not a regular file")
        with np.load(args.resume, allow_pickle=False) as f:  # an .npz never runs code
            arrays, saved = {name: f[name] for name in f.files}, dict(json.loads(str(f["args"])))
    except Exception as e:
        fail(f"--resume {args.resume} is not a readable checkpoint ({type(e).__name__}: {e})")
    free = ("total_timesteps", "log_every", "checkpoint_every", "resume", "exp_name", "run_dir",
            "distributed", "coordinator_address", "num_processes", "process_id")  # may change on resume
    for name, value in json.loads(json.dumps(dataclasses.asdict(args))).items():  # lists, as saved
        if name not in free and saved.get(name) != value:
            fail(f"--resume {args.resume}: its run had --{name.replace('_', '-')} {saved.get(name)}")
    for name, like in flat(template).items():
        if name not in arrays or (arrays[name].shape, arrays[name].dtype) != (like.shape, like.dtype):
            fail(f"--resume {args.resume}: its {name} is not {like.dtype}{list(like.shape)} here")
    return jax.tree.unflatten(jax.tree.structure(template), [arrays[n] for n in flat(template)])

def log(run, row):  # process 0 writes and prints for all
    if bad := [k for k, v in row.items() if k.startswith("losses/") and not math.isfinite(v)]:
        end(run, 1, f"error: the run diverged: non-finite {', '.join(bad)} at update {row['update']}")
    if run.folder is None:
        return
    with open(run.folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    for name in [name for name in row if "/" in name]:
        run.writer.add_scalar(name, row[name], row["global_step"])
    run.writer.flush()
    update, n, step, score = row["update"], run.num_updates, row["global_step"], row.get("charts/episodic_return")
    if not START:  # the ETA's clock starts at the first line: start-up and compiling are not training
        START[:] = time.time(), update
    began, first = START
    eta = int((time.time() - began) / (update - first) * (n - update)) if update > first else None
    print(f"update {update}/{n} | step {step:,}/{step // update * n:,} ({update / n:.0%}) "
          f"| SPS {row['charts/SPS']:,.0f} | return {'-' if score is None else f'{score:.2f}'} "
          f"| ETA {'-' if eta is None else f'{eta // 60}m{eta % 60:02d}s'}", flush=True)
def end(run, code, line):
    ckpt = run.folder and run.folder / "checkpoint.npz"
    print(line + (f"; --resume {ckpt} to go on" if ckpt and ckpt.exists() else ""), file=sys.stderr)
    sys.exit(code)
def checksum(params):  # equal runs and hosts print equal sums
    leaves = [x.addressable_data(0) for x in jax.tree.leaves(params)]
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()

if __name__ == "__main__":
    main(tyro.cli(Args))
