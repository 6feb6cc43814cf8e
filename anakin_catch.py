"""Anakin on Catch: the Podracer paper's own example (Hessel et al. 2021, section 3).

Catch is in JAX, so acting and learning are one XLA program: `lane_loss` (one env lane's rollout scored with
Q(lambda)) is vmapped over a device's lanes, fori_looped over updates and shard_mapped over devices:

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
    log, checkpoint <---   metrics (psum)

    python anakin_catch.py                                   # ~1 min on a 2-core CPU
    python anakin_catch.py --num-envs-per-device 1024 --total-timesteps 20_000_000
"""

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple

STOP_PIPE = os.pipe()  # set before the slow `import jax`: stop signals only write their numbers here
if __name__ == "__main__":
    os.set_blocking(STOP_PIPE[1], False)
    signal.set_wakeup_fd(STOP_PIPE[1])
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.summary import scalar


@dataclasses.dataclass
class Args:
    env_id: str = "Catch"  # the only env in this file; names the run folder
    seed: int = 1  # seeds parameters, envs and exploration
    total_timesteps: int = 16_000_000  # env steps, all hosts together
    learning_rate: float = 1e-4  # Adam step size
    num_envs_per_device: int = 128  # env lanes per device
    num_devices: int | None = None  # devices per host (None: all)
    num_steps: int = 16  # rollout length
    gamma: float = 1.0  # discount
    q_lambda: float = 0.99  # lambda of the returns
    epsilon: float = 0.01  # probability of a random action (the colab's: 0)
    log_every: int = 10  # updates per compiled call and log line
    checkpoint_every: int = 100  # updates between checkpoints, taken at the next log line (and one at the end)
    # Read by the plumbing appendix only:
    exp_name: str = Path(__file__).stem  # part of the run folder's name
    run_dir: str = "runs"  # parent folder of run folders
    resume: str | None = None  # checkpoint.npz to continue from, with the same flags, up to --total-timesteps
    distributed: bool = False  # call jax.distributed.initialize() (multi-host)
    coordinator_address: str | None = None  # host:port of process 0 (JAX finds it on SLURM, Cloud TPU, Kubernetes)
    num_processes: int | None = None  # number of processes (multi-host)
    process_id: int | None = None  # this process's index (multi-host)
    peer_timeout: int = 300  # seconds to wait for all processes to join


# ---- The environment: Catch (bsuite, Osband et al. 2020) -----------------------------------

ROWS, COLS = 10, 5
NUM_ACTIONS = 3  # left, stay, right


class Catch(NamedTuple):  # int32 scalars
    ball_x: jax.Array
    ball_y: jax.Array  # 0 at the top
    paddle_x: jax.Array  # on the bottom row


def reset(key):
    return Catch(ball_x=jax.random.randint(key, (), 0, COLS), ball_y=jnp.int32(0), paddle_x=jnp.int32(COLS // 2))


def observe(state):
    """1 at the ball and the paddle."""
    board = jnp.zeros((ROWS, COLS), jnp.float32).at[state.ball_y, state.ball_x].set(1.0)
    return board.at[ROWS - 1, state.paddle_x].set(1.0)


def step(state, action, key):
    """On the bottom row: reward +-1, then reset."""
    paddle_x = jnp.clip(state.paddle_x + action - 1, 0, COLS - 1)
    ball_y = state.ball_y + 1
    done = ball_y == ROWS - 1
    reward = jnp.where(done, jnp.where(paddle_x == state.ball_x, 1.0, -1.0), 0.0)
    moved = state._replace(ball_y=ball_y, paddle_x=paddle_x)
    state = jax.tree.map(lambda new, old: jnp.where(done, new, old), reset(key), moved)
    return state, reward, done


# ---- The network: the colab's MLP ---------------------------------------------------------

def linear(key, n_in, n_out):
    """Haiku's `hk.Linear` init: normal truncated at 2 std, std 1/sqrt(n_in)."""
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


# ---- The loss: Q(lambda), bootstrapping with max_a Q ---------------------------------------

def lambda_returns(rewards, discounts, next_values, lam):
    """G_t = r_t + d_t ((1 - lam) v_t+1 + lam G_t+1), G_T = v_T; [T] each."""
    def backward(g_next, x):
        r, d, v = x
        g = r + d * ((1 - lam) * v + lam * g_next)
        return g, g

    _, returns = jax.lax.scan(backward, next_values[-1], (rewards, discounts, next_values), reverse=True)
    return returns


def q_lambda_loss(q, q_last, actions, rewards, dones, gamma, lam):
    """q: [T, A], q_last: [A], the rest [T]. At an episode end the zero discount masks the next row of
    `q`, the reset state's."""
    next_values = jnp.max(jnp.concatenate([q[1:], q_last[None]]), axis=-1)
    targets = lambda_returns(rewards, gamma * (1.0 - dones), next_values, lam)
    q_taken = jnp.take_along_axis(q, actions[:, None], axis=-1)[:, 0]
    return jnp.mean((jax.lax.stop_gradient(targets) - q_taken) ** 2)


# ---- Acting and learning on one device ----------------------------------------------------

class Lane(NamedTuple):
    env: Catch
    key: jax.Array  # its own: results do not depend on the device layout
    ep_return: jax.Array  # of the episode in progress
    ep_length: jax.Array


class Trajectory(NamedTuple):  # one lane's rollout, [T]
    q: jax.Array  # [T, NUM_ACTIONS]; the loss differentiates these
    action: jax.Array
    reward: jax.Array
    done: jax.Array  # the episode ended here
    ended_return: jax.Array  # if done, else 0
    ended_length: jax.Array


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    lanes: Lane  # [envs, ...] split across devices


class Stats(NamedTuple):  # sums over all lanes and a call's updates
    td_loss: jax.Array  # of each lane's mean
    q_values: jax.Array
    return_sum: jax.Array
    length_sum: jax.Array
    episodes: jax.Array


def make_optimizer(args):
    return optax.adam(args.learning_rate)


def init_state(key, args, num_envs):
    k_params, k_lanes = jax.random.split(key)
    params = init_params(k_params)
    keys = jax.vmap(jax.random.split)(jax.random.split(k_lanes, num_envs))  # [envs, 2, 2]
    zeros = jnp.zeros(num_envs)
    lanes = Lane(env=jax.vmap(reset)(keys[:, 0]), key=keys[:, 1], ep_return=zeros, ep_length=zeros.astype(jnp.int32))
    return TrainState(params=params, opt_state=make_optimizer(args).init(params), lanes=lanes)


def rollout(params, lane, args):
    """Also returns Q at the last state."""
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
    """The paper's minimal unit: one lane's rollout scored with Q(lambda)."""
    lane, traj, q_last = rollout(params, lane, args)
    loss = q_lambda_loss(traj.q, q_last, traj.action, traj.reward, traj.done, args.gamma, args.q_lambda)
    stats = Stats(td_loss=loss, q_values=traj.q.mean(), return_sum=traj.ended_return.sum(),
                  length_sum=traj.ended_length.sum(), episodes=traj.done.sum())
    return loss, (lane, stats)


def update(state, args):
    """One update on one device. The paper vmaps the whole update over lanes; with params shared, the
    lanes' mean loss has the same gradient, without per-lane params and Adam state."""
    def device_loss(params):
        losses, aux = jax.vmap(lane_loss, (None, 0, None))(params, state.lanes, args)
        return losses.mean(), aux

    (_, (lanes, stats)), grads = jax.value_and_grad(device_loss, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, "devices")  # across devices and hosts
    updates, opt_state = make_optimizer(args).update(grads, state.opt_state)
    params = optax.apply_updates(state.params, updates)
    stats = jax.tree.map(lambda x: jax.lax.psum(x.sum(), "devices"), stats)  # over lanes, devices and hosts
    return TrainState(params=params, opt_state=opt_state, lanes=lanes), stats


def metrics_row(stats, lane_updates, args, sps):
    """Means of Stats summed over `lane_updates` (updates x lanes)."""
    stats = jax.tree.map(float, stats)
    row = {"charts/SPS": sps, "charts/learning_rate": args.learning_rate,
           "losses/td_loss": stats.td_loss / lane_updates, "losses/q_values": stats.q_values / lane_updates}
    if stats.episodes > 0:
        row["charts/episodic_return"] = stats.return_sum / stats.episodes
        row["charts/episodic_length"] = stats.length_sum / stats.episodes
    return row


# ---- The device mapping: shard_map over devices -------------------------------------------

STATE_SPECS = TrainState(params=P(), opt_state=P(), lanes=P("devices"))  # params replicated, lanes split


def make_train(args, mesh):
    """`n` updates; `n` is traced: a shorter last call compiles nothing."""
    def train(state, n):
        def one_update(_, carry):
            state, total = carry
            state, stats = update(state, args)
            return state, jax.tree.map(jnp.add, total, stats)

        zeros = Stats(**{name: jnp.float32(0) for name in Stats._fields})
        return jax.lax.fori_loop(0, n, one_update, (state, zeros))

    # check_vma=False: `update` pmeans the replicated params' gradients; the check would sum them first
    sharded = jax.shard_map(train, mesh=mesh, in_specs=(STATE_SPECS, P()), out_specs=(STATE_SPECS, P()),
                            check_vma=False)
    return jax.jit(sharded, donate_argnums=0)


def init_on_mesh(args, mesh, num_envs):
    key = jax.random.PRNGKey(args.seed)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), STATE_SPECS)
    init = jax.jit(partial(init_state, args=args, num_envs=num_envs), out_shardings=shardings)
    return lambda: init(key), jax.eval_shape(init, key)


def pick_devices(args):
    local = jax.local_devices()
    n = len(local) if args.num_devices is None else args.num_devices
    if not 1 <= n <= len(local):
        fail(f"--num-devices {n} is not possible: this host has {len(local)} device(s)")
    hosts = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    return Mesh(np.array([d for host in hosts for d in host[:n]]), ("devices",))  # the first n of every host


def initial_state(args, mesh, batch):
    """The TrainState's maker (fresh or --resume's), its shapes, the updates done."""
    if args.total_timesteps < batch:
        fail(f"--total-timesteps {args.total_timesteps:,} is less than one update: {batch:,} steps "
             f"(--num-steps {args.num_steps} x {args.num_envs_per_device} envs x {mesh.size} devices)")
    init, shapes = init_on_mesh(args, mesh, args.num_envs_per_device * mesh.size)
    if not args.resume:
        return init, shapes, 0
    template = {"state": shapes, "update": np.int64(0), "global_step": np.int64(0)}
    ckpt = load(args, template, batch, f"here {args.num_envs_per_device} envs on each of {mesh.size} devices")
    shardings = jax.tree.map(lambda like: like.sharding, shapes)
    return partial(jax.device_put, ckpt["state"], shardings), shapes, int(ckpt["update"])


def compile_train(args, mesh, shapes, run):
    """Compiled ahead: SPS excludes compiling, and what cannot fit is refused."""
    tic = time.time()
    train = make_train(args, mesh).lower(shapes, np.int32(args.log_every)).compile()
    say(f"compiled in {time.time() - tic:.1f}s")
    used = train.memory_analysis()
    check_fits(used.temp_size_in_bytes + used.argument_size_in_bytes + used.output_size_in_bytes,
               f"--num-envs-per-device {args.num_envs_per_device}", mesh.local_devices, run)
    return train


def checkpoint(args, run, state, updates_done, batch):
    """All processes gather the lanes; process 0 saves."""
    host = multihost_utils.process_allgather(state, tiled=True)
    save(run, {"state": host, "update": np.int64(updates_done), "global_step": np.int64(updates_done * batch)}, args)


# ---- The run ------------------------------------------------------------------------------

def check_args(args):
    if args.env_id != "Catch":  # the common flag: it names the run folder
        fail(f"--env-id {args.env_id!r}: this file defines only 'Catch'")
    check_flags(args, unit=("gamma", "q_lambda", "epsilon"), positive=("learning_rate",))
    check_seed(args.seed, 2**32)
    return args


def main(args: Args) -> dict:
    caught = catch_stop_signals()
    args = check_args(args)
    start_distributed(args, caught)
    mesh = pick_devices(args)
    batch = args.num_steps * args.num_envs_per_device * mesh.size  # env steps per update
    num_updates = args.total_timesteps // batch
    make_state, shapes, updates_done = initial_state(args, mesh, batch)
    run = open_run(args)
    train = compile_train(args, mesh, shapes, run)
    state = make_state()
    start_update, start_time, n, row = updates_done, time.time(), 0, {}
    while updates_done < num_updates:
        due = updates_done // args.checkpoint_every > (updates_done - n) // args.checkpoint_every  # a multiple passed
        safe_point(caught, updates_done, run, partial(checkpoint, args, run, state, updates_done, batch), due=due)
        n = min(args.log_every, num_updates - updates_done)
        tic = time.time()
        state, stats = train(state, np.int32(n))
        stats = jax.device_get(stats)  # waits for the call
        updates_done += n
        row = {"global_step": updates_done * batch, "update": updates_done,
               **metrics_row(stats, n * batch // args.num_steps, args, sps=n * batch / (time.time() - tic))}
        check_finite({name: value for name, value in row.items() if name.startswith("losses/")}, updates_done, run)
        eta = (time.time() - start_time) / (updates_done - start_update) * (num_updates - updates_done)
        log(run, row, num_updates, num_updates * batch, eta)
    safe_point(caught, updates_done, run, partial(checkpoint, args, run, state, updates_done, batch), due=True)
    row["checksum"] = checksum(state.params)
    say(f"checksum {row['checksum']}")
    return row


# ---- Plumbing: not the algorithm; the same text in all four scripts (tests/test_plumbing.py) ----

def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_flags(args, unit=(), positive=()):
    """Counts fit the compiled programs' int32 (the step budget: int64); floats finite, >= 0 (`unit` <= 1,
    `positive` > 0); --resume a file."""
    for name, value in dataclasses.asdict(args).items():
        top = 2**62 if name == "total_timesteps" else 2**31
        if type(value) is int and name not in ("seed", "num_processes", "process_id") and not 1 <= value < top:
            fail(f"--{name.replace('_', '-')} {value} must be in 1..{top - 1:,}")
        if type(value) is float:
            ok = value <= 1 if name in unit else value > 0 if name in positive else True
            if not (math.isfinite(value) and value >= 0 and ok):
                valid = "in [0, 1]" if name in unit else "above 0" if name in positive else "at least 0"
                fail(f"--{name.replace('_', '-')} {value} must be a finite number {valid}")
    if args.resume is not None and not (resume := Path(args.resume)).is_file():
        what = "a folder" if resume.is_dir() else "not a file" if resume.exists() else "no such file"
        fail(f"--resume {args.resume!r}: {what}; it takes a run's checkpoint.npz")


def check_fits(num_bytes, what, devices=(), run=None):
    """Refuse `num_bytes` per device (CPU devices share the host's memory), removing the `run` folder just made."""
    memory = (devices[0].memory_stats() or {}).get("bytes_limit") if devices else None
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        num_bytes *= max(1, len(devices))
    if num_bytes > memory:
        if run is not None and run.folder is not None:
            run.events.close()
            shutil.rmtree(run.folder, ignore_errors=True)
        fail(f"{what} would need {num_bytes / 2**30:,.1f} GiB, more than the {memory / 2**30:,.1f} GiB here")


def check_seed(seed, limit):
    if not 0 <= seed < limit:  # JAX keys keep 32 bits; envpool seeds are int32
        fail(f"--seed {seed} must be in 0..{limit - 1:,}: others repeat these seeds' random numbers or are refused")


def start_distributed(args, caught):
    """With --distributed, join in a thread: JAX's join blocks, deaf to --peer-timeout and stop signals."""
    given = [n for n in ("coordinator_address", "num_processes", "process_id") if getattr(args, n) is not None]
    if given and not args.distributed:
        fail(f"{', '.join('--' + n.replace('_', '-') for n in given)} only apply to multi-host runs: add --distributed")
    if not args.distributed:
        return
    jax.config.update("jax_enable_preemption_service", False)  # it would take SIGTERM from us
    address = args.coordinator_address
    if address and args.process_id == 0:  # JAX's server fails obscurely on a port in use
        try:
            socket.create_server(("", int(address.rpartition(":")[2]))).close()
        except (OSError, ValueError, OverflowError) as e:
            fail(f"--coordinator-address {address}: process 0 cannot listen there ({getattr(e, 'strerror', e)})")
    # JAX's own timeout aborts the process: set past --peer-timeout, so that ours ends the wait first
    joining = ThreadPoolExecutor(1).submit(jax.distributed.initialize, address, args.num_processes, args.process_id,
                                           initialization_timeout=args.peer_timeout + 60)
    say(f"waiting for {args.num_processes or 'all'} processes at {address or 'the address JAX detects'} (at most "
        f"--peer-timeout {args.peer_timeout} s)")
    deadline = time.monotonic() + args.peer_timeout
    while not joining.done() and not caught and time.monotonic() < deadline:
        time.sleep(0.1)
    if caught:
        exit_now(128 + caught[0], None, f"stopped by {signal.Signals(caught[0]).name} while waiting for the other "
                                        "processes, before any update")
    error = joining.exception() if joining.done() else f"not all joined in --peer-timeout {args.peer_timeout} s"
    if error:
        exit_now(2, None, f"error: --distributed: {str(error).splitlines()[0]} (start every process with the same "
                          "--coordinator-address, --num-processes and its own --process-id, or all in a cluster)")
    sys.excepthook = lost_peer
    agree(args)


def lost_peer(kind, error, trace):
    """A collective with a dead peer may raise: exit before JAX's heartbeat aborts from C++."""
    if not issubclass(kind, jax.errors.JaxRuntimeError):
        return sys.__excepthook__(kind, error, trace)
    exit_now(1, RUN, f"error: a collective with the other processes failed (one died?): {str(error).splitlines()[0]}")


def agree(args):
    """Every process must run the same script and flags (but PER_HOST); all exit if not."""
    mine = {n: v for n, v in dataclasses.asdict(args).items() if n not in PER_HOST}
    mine["script"] = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    text = np.frombuffer(json.dumps(mine).encode(), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.int32(text.size))))
    texts = multihost_utils.process_allgather(np.pad(text, (0, size - text.size)))
    process_0, *others = [json.loads(bytes(t).rstrip(b"\0")) for t in texts]
    for i, theirs in enumerate(others, 1):
        for name in [n for n in process_0 if theirs.get(n) != process_0[n]]:
            what = "a script whose sha256 starts" if name == "script" else f"--{name.replace('_', '-')}"
            exit_now(2, None, f"error: process {i} runs with {what} {json.dumps(theirs.get(name))}, process 0 with "
                              f"{json.dumps(process_0[name])}: every process needs the same")


class Run(NamedTuple):
    folder: Path | None  # process 0 only: the other processes write nothing
    events: EventsWriter | None  # written from this thread, so its failures are seen
    checkpoint: Path | None


RUN = None  # this process's Run, for `lost_peer`
SAVING = []  # what `save` is writing, for `exit_now` to remove
PER_HOST = ("process_id", "coordinator_address", "run_dir", "exp_name", "peer_timeout")  # flags peers may differ in


def open_run(args):
    """Process 0's new folder {run-dir}/{env}__{exp-name}__{seed}__{unix time}[_1, _2, ...]."""
    global RUN
    RUN = Run(None, None, None)
    if jax.process_index() != 0:
        return RUN
    name = "__".join("".join(c if c.isalnum() or c in "-_.+" else "_" for c in str(s))
                     for s in (args.env_id, args.exp_name, args.seed))
    base = Path(args.run_dir) / f"{name}__{int(time.time())}"
    for folder in (base.with_name(f"{base.name}_{n}") if n else base for n in itertools.count()):
        try:
            folder.mkdir(parents=True)
            (folder / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
            RUN = Run(folder, EventsWriter(str(folder / "events")), folder / "checkpoint.npz")
            return RUN
        except FileExistsError:
            pass
        except OSError as e:
            blame = f"--exp-name {args.exp_name!r}" if e.errno == errno.ENAMETOOLONG else f"--run-dir {args.run_dir!r}"
            fail(f"{blame}: cannot make the run folder {folder} ({e.strerror})")


def catch_stop_signals():
    """A thread notes stop signals for `safe_point`: handlers wait for XLA calls, and raising in JAX may hang."""
    caught, stops = [], (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    os.set_blocking(STOP_PIPE[1], False)
    signal.set_wakeup_fd(STOP_PIPE[1])  # also for a script loaded as a module
    for signum in stops:
        signal.signal(signum, lambda *_: None)

    def listen():
        while True:
            signum = os.read(STOP_PIPE[0], 1)[0]
            if signum in stops and caught:
                exit_now(128 + signum, None, f"{signal.Signals(signum).name} again: stopped at once, without writing "
                                             "a checkpoint")
            if signum in stops:
                caught.append(signum)
                say(f"{signal.Signals(signum).name}: stopping after the update in flight, with a checkpoint; a "
                    "second signal stops at once, without one")

    threading.Thread(target=listen, daemon=True).start()
    return caught


def safe_point(caught, updates_done, run, checkpoint, due):
    """`checkpoint()` if `due`; if any process caught a stop signal, all checkpoint and exit."""
    if due:
        checkpoint()
    signum = caught[0] if caught else 0
    if jax.process_count() > 1:
        signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
    if signum and not due:
        checkpoint()
    if signum:
        exit_now(128 + signum, run, f"stopped by {signal.Signals(signum).name} after update {updates_done}")


def flat(tree):
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save(run, tree, args):
    """A temporary file moved into place: never a torn checkpoint."""
    if run.checkpoint is None:
        return
    tmp = run.checkpoint.with_name("checkpoint.tmp.npz")
    SAVING[:] = [tmp]
    try:
        np.savez(tmp, **flat(tree), args=json.dumps(dataclasses.asdict(args)))
        os.replace(tmp, run.checkpoint)
    except OSError as e:
        exit_now(1, run, f"error: cannot write {tmp} ({e.strerror or e})")
    SAVING.clear()


def load(args, template, batch, hint):
    """`template`'s arrays from --resume, if its run matches this one (`hint` says how) and has budget left."""
    resume, names = f"--resume {args.resume!r}", {*flat(template), "args"}
    try:
        with np.load(args.resume, allow_pickle=False) as f:
            if unknown := sorted(set(f.files) - names):  # refused unread
                fail(f"{resume} does not match this run: it holds arrays this run does not make "
                     f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}; {hint})")
            arrays = {name: f[name] for name in names & set(f.files)}
    except Exception as e:  # empty, truncated, random bytes, pickled
        fail(f"{resume} is not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})")
    saved = None
    with contextlib.suppress(KeyError, ValueError):
        saved = json.loads(str(arrays["args"]))
    if not isinstance(saved, dict):
        fail(f"{resume} does not match this run: it records no flags as a JSON object ({hint})")
    hosts = saved.get("num_processes") if saved.get("distributed") else 1
    if isinstance(hosts, int) and hosts != jax.process_count():  # shapes and steps count every host's envs
        hint = f"its run had {hosts} processes, this one {jax.process_count()}; {hint}"
    for name, like in flat(template).items():
        want, got = f"{like.dtype}{list(like.shape)}", arrays.get(name)
        found = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
        if found != want:
            fail(f"{resume} does not match this run: {name} is {found}, expected {want} ({hint})")
    now = json.loads(json.dumps(dataclasses.asdict(args)))
    free = (*PER_HOST, "total_timesteps", "log_every", "checkpoint_every", "resume", "distributed", "num_processes")
    for name in [n for n in now if n not in free and saved.get(n) != now[n]]:
        fail(f"{resume} comes from a run with --{name.replace('_', '-')} {json.dumps(saved.get(name))}, not "
             f"{json.dumps(now[name])} (a resumed run may change only budget, logging, checkpoint and folder flags)")
    done = int(arrays["update"])
    if done < 0:
        fail(f"{resume} is damaged: it holds update {done}")
    if arrays["global_step"] != done * batch:
        fail(f"{resume} comes from a run whose updates were not of {batch:,} steps (another number of hosts?)")
    if done >= args.total_timesteps // batch:
        fail(f"{resume} is at update {done} of {args.total_timesteps // batch}: raise --total-timesteps to go on")
    return jax.tree.unflatten(jax.tree.structure(template), [arrays[name] for name in flat(template)])


def exit_now(code, run, line):
    """Exit at once (a normal exit could hang), saying which checkpoint is on disk."""
    for tmp in SAVING:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        line += f"; {tmp.name} could not be removed: delete it" if tmp.exists() else ""
    if run is not None and run.folder is None:
        line += "; process 0 holds the checkpoints"
    elif run is not None:
        try:
            with np.load(run.checkpoint) as f:
                line += f"; the checkpoint {run.checkpoint} holds update {int(f['update'])}: --resume it to go on"
        except OSError:
            line += f"; no checkpoint is in {run.folder}"
    with contextlib.suppress(OSError):  # a closed stdout or stderr
        print(line, file=sys.stdout if code >= 128 else sys.stderr, flush=True)
    os._exit(code)


def check_finite(losses, updates_done, run):
    if bad := {name: float(value) for name, value in losses.items() if not math.isfinite(value)}:
        exit_now(1, run, f"error: non-finite loss at update {updates_done} ({bad})")


def say(line):
    try:
        print(line, flush=True)
    except OSError:  # stdout closed (`| head`): train on without it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def log(run, row, num_updates, total_steps, eta):
    """`row` (CleanRL's names) to metrics.jsonl and TensorBoard, and the progress line (process 0)."""
    if run.folder is None:
        return
    step, ret = row["global_step"], row.get("charts/episodic_return")
    try:
        with open(run.folder / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        for name in [name for name in row if "/" in name]:
            run.events.write_event(Event(wall_time=time.time(), step=step, summary=scalar(name, row[name])))
        run.events.flush()
    except OSError as e:
        exit_now(1, run, f"error: cannot write the metrics in {run.folder} ({e.strerror or e})")
    minutes = int(eta) // 60
    eta = f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{int(eta) % 60:02d}s"
    say(f"update {row['update']}/{num_updates} | step {step:,}/{total_steps:,} ({step / total_steps:.0%}) | "
        f"SPS {row['charts/SPS']:,.0f} | return {'-' if ret is None else f'{ret:.2f}'} | ETA {eta}")


def checksum(params):
    """sha256 of this host's parameters: equal runs and hosts print equal sums."""
    leaves = [x.addressable_data(0) if isinstance(x, jax.Array) else x for x in jax.tree.leaves(params)]
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()


if __name__ == "__main__":
    main(tyro.cli(Args))
