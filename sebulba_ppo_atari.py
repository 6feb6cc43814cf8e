"""Sebulba PPO: the Podracer paper's actor/learner split (Hessel et al. 2021) with PPO for Atari (Schulman et al. 2017).

    host CPU (per host)                 actor device(s)              learner devices (all hosts)
    -------------------                 ---------------              ---------------------------
    actor thread k: env batch      -->  act(params, obs): sample (jit)
      (--local-num-envs envs)      <--  actions (log-prob, value stay until the rollout ends)
      --num-steps steps, then the rollout [T, E, ...] is split along E
                                   ------------------------------>  learner 0 | learner 1 | ...
                                        (device_put, bounded queue)  GAE, then epochs x minibatches
                                                                     of PPO, grads psum'd over all
                                   <------------------------------  new params (one update later)
    Actors act with parameters at most one update old (stats/param_lag); decoupled PPO corrects for the lag.

    python sebulba_ppo_atari.py --env-id Breakout-v5
    python sebulba_ppo_atari.py --env-id Pong-v5 --actor-device-ids 0 --learner-device-ids 1 2 3
    python sebulba_ppo_atari.py --resume runs/Breakout-v5__sebulba_ppo_atari__1__1700000000/checkpoint.npz
"""

import contextlib
import dataclasses
import difflib
import errno
import hashlib
import importlib
import itertools
import json
import math
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
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

import envpool
import gymnasium as gym


@dataclasses.dataclass
class Args:
    """Defaults use one GPU; fill it with 2-4 actor threads x 32-64 envs and --async-envs (a larger batch learns
    differently)."""

    env_id: str = "Breakout-v5"  # envpool (Atari `*-v5`) or gymnasium (`module:Name-v0`) id with images
    seed: int = 1  # seeds parameters, envs and sampling
    total_timesteps: int = 10_000_000  # agent steps, all hosts
    learning_rate: float = 2.5e-4  # Adam step size
    anneal_lr: bool = True  # decay the step size linearly to 0 over the run
    actor_device_ids: list[int] | None = None  # local device indices that act (default: 0)
    learner_device_ids: list[int] | None = None  # local device indices that learn (default: the others, else 0)
    num_actor_threads: int = 2  # per actor device: one steps envs while another acts
    local_num_envs: int = 16  # envs per actor thread
    async_envs: bool = False  # step half the envs while acting for the other half
    num_steps: int = 128  # rollout length per env per update
    gamma: float = 0.99  # discount
    gae_lambda: float = 0.95  # GAE's lambda
    num_minibatches: int = 4  # minibatches per epoch (one gradient step each)
    update_epochs: int = 4  # passes over each rollout
    clip_coef: float = 0.1  # PPO ratio clipping (also clips the value update)
    ent_coef: float = 0.01  # entropy bonus weight
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # global-norm gradient clipping
    policy_lag: bool = True  # act with parameters one update old (--no-policy-lag: the newest)
    machado: bool = False  # Machado et al. (2018): sticky actions, full action set, no life loss
    log_every: int = 1  # updates between metrics rows
    checkpoint_every: int = 50  # updates between checkpoints (and one at the end)
    # Read by the plumbing appendix only:
    exp_name: str = Path(__file__).stem  # part of the run folder's name
    run_dir: str = "runs"  # parent folder of run folders
    resume: str | None = None  # checkpoint.npz to continue from, with the same flags (envs start afresh)
    distributed: bool = False  # call jax.distributed.initialize() (multi-host)
    coordinator_address: str | None = None  # host:port of process 0 (JAX finds it on SLURM, Cloud TPU, Kubernetes)
    num_processes: int | None = None  # number of processes (multi-host)
    process_id: int | None = None  # this process's index (multi-host)
    peer_timeout: int = 300  # seconds to wait for all processes to join


# ---- The environment: envpool or gymnasium on the host

def atari_kwargs(machado):
    """The IMPALA and PPO papers' Atari protocol, or --machado's."""
    if machado:  # noop_max=1: no no-op starts (0 would crash envpool 1.2.5)
        return dict(episodic_life=False, reward_clip=True, noop_max=1,
                    repeat_action_probability=0.25, full_action_space=True)
    return dict(episodic_life=True, reward_clip=True, noop_max=30)


class EnvInfo(NamedTuple):
    obs_shape: tuple  # [C, H, W], envpool's layout
    num_actions: int
    source: str  # "envpool" or "gymnasium"
    atari: bool  # envpool Atari: info["reward"] is the unclipped score


def env_spaces(env_id, machado):
    if env_id in envpool.list_all_envs():
        atari = hasattr(envpool.make_spec(env_id).config, "episodic_life")
        spec = envpool.make_spec(env_id, **(atari_kwargs(machado) if atari else {}))
        return spec.observation_space, spec.action_space, "envpool", atari
    module, _, name = env_id.rpartition(":")
    try:
        importlib.import_module(module) if module else None
    except Exception as err:  # also a relative name such as "../x"
        fail(f"--env-id {env_id!r}: cannot import module {module!r} ({type(err).__name__}: {err})")
    if name not in gym.registry:
        close = difflib.get_close_matches(name, [*envpool.list_all_envs(), *gym.registry], n=3)
        fail(f"--env-id {env_id!r}: unknown environment; close matches: {', '.join(close) or 'none'}")
    probe = gym.make(name)  # gymnasium's spaces need an instance
    probe.close()
    return probe.observation_space, probe.action_space, "gymnasium", False


@cache  # one probe per run
def describe_env(env_id, machado):
    obs_space, act_space, source, atari = env_spaces(env_id, machado)
    if machado and not atari:
        fail(f"--machado applies to Atari ids only, not {env_id!r}")
    if not isinstance(act_space, gym.spaces.Discrete) or act_space.start != 0:
        fail(f"--env-id {env_id!r} needs a discrete action space numbered from 0, not {act_space}")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 3:
        fail(f"--env-id {env_id!r} needs image observations, not {obs_space} (vectors: sebulba_impala.py)")
    shape = obs_space.shape
    if source == "gymnasium" and len(shape) == 3:  # [H, W, C]
        shape = (shape[2], shape[0], shape[1])
    return EnvInfo(obs_shape=tuple(shape), num_actions=int(act_space.n), source=source, atari=atari)


class Step(NamedTuple):
    obs: np.ndarray  # [E, *obs_shape]
    reward: np.ndarray  # [E] (Atari: clipped to [-1, 1])
    terminated: np.ndarray  # [E] no bootstrap (Atari: a life lost too)
    ended: np.ndarray  # [E] the next step resets
    score: np.ndarray  # [E] (Atari: unclipped)
    game_over: np.ndarray  # [E] (Atari: the last life lost) or truncated


class Envs(NamedTuple):  # a batch of envs stepped together
    pool: object  # envpool's or gymnasium's vector env
    env_info: EnvInfo
    seed: int


def make_envs(args, num_envs, seed):
    env_info = describe_env(args.env_id, args.machado)
    if env_info.source == "gymnasium":  # autoresets on the next step, like envpool
        pool = gym.make_vec(args.env_id.rpartition(":")[2], num_envs=num_envs, vectorization_mode="sync")
        return Envs(pool=pool, env_info=env_info, seed=seed)
    # the host's cores shared among all env batches
    batches = len(args.actor_device_ids or [0]) * args.num_actor_threads * (2 if args.async_envs else 1)
    threads = min(num_envs, max(1, len(os.sched_getaffinity(0)) // batches))
    pool = envpool.make(args.env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, num_threads=threads,
                        **(atari_kwargs(args.machado) if env_info.atari else {}))
    return Envs(pool=pool, env_info=env_info, seed=seed)


def host_obs(obs, env_info):
    if env_info.source == "gymnasium" and obs.ndim == 4:
        obs = np.moveaxis(obs, -1, 1)
    return obs.astype(np.float32) if obs.dtype == np.float64 else obs


def env_reset(envs):
    obs, _ = envs.pool.reset() if envs.env_info.source == "envpool" else envs.pool.reset(seed=envs.seed)
    return host_obs(obs, envs.env_info)


def env_send(envs, actions):
    """Start a step in envpool's threads; env_step(..., sent=True) collects it."""
    if envs.env_info.source == "envpool":
        envs.pool.send(actions)


def env_step(envs, actions, sent=False):
    """The Step of `actions`, or with `sent` of those env_send started."""
    if sent and envs.env_info.source == "envpool":
        obs, reward, terminated, truncated, info = envs.pool.recv()
    else:
        obs, reward, terminated, truncated, info = envs.pool.step(actions)
    if envs.env_info.atari:
        score, game_over = info["reward"], info["terminated"].astype(bool) | truncated  # the whole game's
    else:
        score, game_over = reward, terminated | truncated
    return Step(obs=host_obs(obs, envs.env_info), reward=reward.astype(np.float32), terminated=terminated,
                ended=terminated | truncated, score=score, game_over=game_over)


# ---- The network: a CNN and two heads, PPO's orthogonal init

# (channels, kernel, stride) of each "VALID" conv, and the hidden width
NATURE = ((32, 8, 4), (64, 4, 2), (64, 3, 1)), 512  # Nature DQN's (Mnih et al. 2015)
MINATAR = ((16, 3, 1),), 128  # MinAtar's (Young and Tian 2019)


def layers(obs_shape):  # the Nature CNN needs 36x36 or more
    return NATURE if min(obs_shape[1:]) >= 36 else MINATAR


def dense_init(key, n_in, n_out, scale):
    return {"w": jax.nn.initializers.orthogonal(scale)(key, (n_in, n_out)), "b": jnp.zeros(n_out)}


def conv_init(key, c_in, c_out, size):
    return {"w": jax.nn.initializers.orthogonal(np.sqrt(2))(key, (size, size, c_in, c_out)), "b": jnp.zeros(c_out)}


def init_params(key, obs_shape, num_actions):
    convs, hidden = layers(obs_shape)
    keys, torso = iter(jax.random.split(key, 32)), {}  # a key a layer: split's i-th key is the same for any count
    c_in, (h, w) = obs_shape[0], obs_shape[1:]
    for i, (c, size, stride) in enumerate(convs):
        torso[f"conv{i}"] = conv_init(next(keys), c_in, c, size)
        c_in, h, w = c, (h - size) // stride + 1, (w - size) // stride + 1
    torso["dense"] = dense_init(next(keys), h * w * c_in, hidden, np.sqrt(2))
    return {"torso": torso, "policy": dense_init(next(keys), hidden, num_actions, 0.01),  # near-uniform first policy
            "value": dense_init(next(keys), hidden, 1, 1.0)}


def dense(p, x):
    return x @ p["w"] + p["b"]


def conv(p, x, stride=1, padding="SAME"):  # x [N, H, W, C]
    return jax.lax.conv_general_dilated(x, p["w"], (stride, stride), padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]


def image_input(obs):  # [N, C, H, W] -> [N, H, W, C] float, uint8 scaled to [0, 1]
    x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32)
    return x / 255.0 if obs.dtype == jnp.uint8 else x


def apply(params, obs):
    """obs [N, C, H, W] -> (policy logits [N, A], value [N])."""
    x, torso = image_input(obs), params["torso"]
    for i, (_, _, stride) in enumerate(layers(obs.shape[1:])[0]):
        x = jax.nn.relu(conv(torso[f"conv{i}"], x, stride, "VALID"))
    x = jax.nn.relu(dense(torso["dense"], x.reshape(x.shape[0], -1)))
    return dense(params["policy"], x), dense(params["value"], x)[:, 0]


def log_prob(logits, actions):
    return jnp.take_along_axis(jax.nn.log_softmax(logits), actions[..., None], -1)[..., 0]


def entropy(logits):
    logp = jax.nn.log_softmax(logits)
    return -(jnp.exp(logp) * logp).sum(-1)


# ---- The loss: GAE and PPO's clipped objective (Schulman et al. 2016, 2017), decoupled

def gae(rewards, values, terminated, dones, gamma, lam):
    """Advantages [T, E]; values [T + 1, E]. A truncation bootstraps from V of its final observation (envpool
    resets on the next step); `dones` cuts the recursion."""
    deltas = rewards + gamma * values[1:] * (1.0 - terminated) - values[:-1]

    def backward(next_adv, x):
        delta, done = x
        adv = delta + gamma * lam * (1.0 - done) * next_adv
        return adv, adv

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(deltas[0]), (deltas, dones), reverse=True)
    return advantages


def normalize(advantages, mask, axis_name):
    """Zero mean, unit std over the valid samples of all learners."""
    n = jax.lax.psum(mask.sum(), axis_name)
    mean = jax.lax.psum((advantages * mask).sum(), axis_name) / n
    var = jax.lax.psum((((advantages - mean) ** 2) * mask).sum(), axis_name) / n
    return (advantages - mean) / (jnp.sqrt(var) + 1e-8)


def clipped_surrogate(ratio, advantages, clip):
    """PPO's per-sample policy loss: the pessimistic of the plain and clipped terms."""
    return jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip, 1 + clip))


def decoupled_surrogate(logp, prox_logp, behaviour_logp, advantages, clip):
    """Decoupled PPO (Hilton et al. 2021): the ratio is clipped around pi_prox (the parameters at the update's
    start), and pi_prox / mu, unclipped as in the paper (clipping biases toward mu), reweights the samples: near 1
    one update apart, and the gradient clip bounds an outlier."""
    weight = jax.lax.stop_gradient(jnp.exp(prox_logp - behaviour_logp))
    ratio = jnp.exp(logp - jax.lax.stop_gradient(prox_logp))
    return weight * clipped_surrogate(ratio, advantages, clip)


def clipped_value_loss(values, old_values, returns, clip):
    """Per-sample value loss, clipped around the acting-time value."""
    clipped = old_values + jnp.clip(values - old_values, -clip, clip)
    return 0.5 * jnp.maximum((values - returns) ** 2, (clipped - returns) ** 2)


class Samples(NamedTuple):  # [N] samples on one learner
    obs: jax.Array  # [N, *obs_shape]
    actions: jax.Array
    logprobs: jax.Array  # log mu
    values: jax.Array  # acting-time values
    advantages: jax.Array
    returns: jax.Array
    mask: jax.Array  # 0 on reset steps
    prox_logprobs: jax.Array | None = None  # log pi_prox, set by learner_update


class Losses(NamedTuple):
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array  # of pi from pi_prox
    clipfrac: jax.Array  # pi / pi_prox outside the clip window
    clipfrac_first: jax.Array  # pi / mu outside it at an update's start: what plain PPO would not learn from


def ppo_loss(params, mb, args, axis_name):
    """This learner's share of the minibatch's mean PPO loss (the psum is the mean)."""
    logits, values = apply(params, mb.obs)
    logp = log_prob(logits, mb.actions)
    log_ratio = logp - mb.prox_logprobs
    ratio = jnp.exp(log_ratio)
    outside = lambda r: jax.lax.stop_gradient(jnp.abs(r - 1) > args.clip_coef)
    advantages = normalize(mb.advantages, mb.mask, axis_name)
    n = jax.lax.psum(mb.mask.sum(), axis_name)
    share = lambda x: (x * mb.mask).sum() / n
    losses = Losses(
        policy_loss=share(decoupled_surrogate(logp, mb.prox_logprobs, mb.logprobs, advantages, args.clip_coef)),
        value_loss=share(clipped_value_loss(values, mb.values, mb.returns, args.clip_coef)),
        entropy=share(entropy(logits)),
        approx_kl=share(jax.lax.stop_gradient((ratio - 1) - log_ratio)),  # the low-variance KL estimate
        clipfrac=share(outside(ratio)),
        clipfrac_first=share(outside(jnp.exp(logp - mb.logprobs))))
    loss = losses.policy_loss - args.ent_coef * losses.entropy + args.vf_coef * losses.value_loss
    return loss, losses


# ---- Acting (actor devices)

@jax.jit
def act(params, obs, key):
    key, sub = jax.random.split(key)
    logits, values = apply(params, obs)
    actions = jax.random.categorical(sub, logits)
    return actions, log_prob(logits, actions), values, key


class Rollout(NamedTuple):  # --num-steps steps of E envs
    obs: np.ndarray  # [T, E, *obs_shape]
    actions: np.ndarray  # [T, E]
    logprobs: np.ndarray  # [T, E] of the behaviour policy mu
    values: np.ndarray  # [T + 1, E]; the last bootstraps
    rewards: np.ndarray  # [T, E]
    terminated: np.ndarray  # [T, E] 1.0: no bootstrap after step t
    dones: np.ndarray  # [T, E] terminated or truncated
    valid: np.ndarray  # [T, E] 0.0: step t is a reset step


class ActorState(NamedTuple):  # carried from step to step
    obs: np.ndarray  # [E, *obs_shape] to act on
    key: jax.Array  # on the actor device
    ended: np.ndarray  # [E] obs ends an episode: the next step resets
    game_return: np.ndarray  # [E] (Atari: unclipped)
    game_length: np.ndarray  # [E] agent steps


class ActorStats(NamedTuple):  # sent with each rollout
    returns: list  # of the games that ended
    lengths: list
    lag: int  # updates behind the learner's parameters
    seconds: dict  # timings of the rollout


def track_games(state, step, stats):
    """The ActorState after `step`; the games it ended go to `stats`."""
    game_return = state.game_return + step.score
    game_length = state.game_length + np.where(state.ended, 0, 1)  # a reset step is no step of a game
    over = step.game_over
    stats.returns.extend(game_return[over].tolist())
    stats.lengths.extend(game_length[over].tolist())
    return ActorState(obs=step.obs, key=state.key, ended=step.ended,
                      game_return=np.where(over, 0.0, game_return), game_length=np.where(over, 0, game_length))


def collect(args, groups, params, states, stats):
    """--num-steps steps of each group, taking turns: envpool steps one while the policy acts for the next."""
    steps, states = [[] for _ in groups], list(states)  # per group: a dict of [E] arrays a step
    for t in range(args.num_steps + 1):
        for g, envs in enumerate(groups):
            if t > 0:  # the step this group sent at t - 1
                with timer(stats.seconds, "env_step_time"):
                    step = env_step(envs, steps[g][-1]["actions"], sent=True)
                steps[g][-1].update(rewards=step.reward, terminated=step.terminated.astype(np.float32),
                                    dones=step.ended.astype(np.float32), valid=(~states[g].ended).astype(np.float32))
                states[g] = track_games(states[g], step, stats)
            if t < args.num_steps:
                with timer(stats.seconds, "inference_time"):
                    actions, logprobs, values, key = act(params, states[g].obs, states[g].key)
                    actions = np.asarray(actions)  # the rest: fetched once, at the end
                env_send(envs, actions)
                steps[g].append(dict(obs=states[g].obs, actions=actions, logprobs=logprobs, values=values))
                states[g] = states[g]._replace(key=key)
    bootstrap = []  # V of each group's last observation
    for g, state in enumerate(states):
        _, _, value, key = act(params, state.obs, state.key)
        bootstrap, states[g] = bootstrap + [value], state._replace(key=key)
    rollout = jax.tree.map(lambda *x: np.concatenate(x, axis=1), *[  # [T, E, ...]
        jax.tree.map(lambda *x: np.stack(jax.device_get(x)), *group) for group in steps])
    rollout["values"] = np.concatenate([rollout["values"], np.concatenate(jax.device_get(bootstrap))[None]])
    return Rollout(**rollout), states


def start_groups(args, index, device, start_update):
    """Actor thread `index`'s env groups (with --async-envs two halves that take turns, else one), first states."""
    num_groups = 2 if args.async_envs else 1
    n = args.local_num_envs // num_groups
    groups, states = [], []
    for i in range(index * num_groups, (index + 1) * num_groups):
        groups.append(make_envs(args, n, args.seed + i * n))
        # Each group, and a resumed run, samples from its own stream.
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(args.seed), start_update), 1 + i)
        states.append(ActorState(obs=env_reset(groups[-1]), key=jax.device_put(key, device), ended=np.zeros(n, bool),
                                 game_return=np.zeros(n), game_length=np.zeros(n, int)))
    return groups, states


@contextlib.contextmanager
def timer(seconds, name):
    start = time.perf_counter()
    yield
    seconds[name] += time.perf_counter() - start


class Stopped(Exception):
    """The run is stopping: whoever waits gives up."""


def until_stopped(op, stopping, *op_args):
    """`q.put` or `q.get`, raising Stopped once `stopping()`."""
    while not stopping():
        with contextlib.suppress(queue.Full, queue.Empty):
            return op(*op_args, timeout=0.5)
    raise Stopped


class ParamStore:
    """The newest parameters on each actor device, and their version (updates made)."""

    def __init__(self, devices):
        self.cond, self.devices, self.version, self.params = threading.Condition(), devices, -1, None

    def publish(self, version, params):  # params: the learners' replicated global arrays
        params = {d: jax.device_put(local(params), d) for d in self.devices}
        with self.cond:
            self.version, self.params = version, params
            self.cond.notify_all()

    def wait(self, min_version, stop):
        with self.cond:
            while not self.cond.wait_for(lambda: self.version >= min_version, timeout=0.5):
                if stop.is_set():
                    raise Stopped
            return self.version, self.params


class Shared(NamedTuple):  # among this host's threads
    layout: "Layout"
    store: ParamStore
    queues: list  # one bounded queue of rollouts per actor thread
    stop: threading.Event  # set at the end or when an actor thread fails
    errors: list  # the failed threads' tracebacks
    caught: list  # stop signals (catch_stop_signals)
    run: "Run"
    start_update: int  # the update resumed after (else 0)
    num_updates: int
    batch: int  # steps per update


def actor_loop(args, shared, i):
    device = shared.layout.actor_devices[i // args.num_actor_threads]
    index = jax.process_index() * len(shared.queues) + i  # among all hosts' threads
    groups, states = start_groups(args, index, device, shared.start_update)
    seconds = defaultdict(float, actor_queue_wait=0.0)  # this rollout's timings
    for u in range(shared.start_update, shared.num_updates):
        # Rollout u feeds update u + 1 and may act with version u - 1; --no-policy-lag waits for u.
        with timer(seconds, "actor_params_wait"):
            version, params = shared.store.wait(u - int(args.policy_lag), shared.stop)
        stats = ActorStats(returns=[], lengths=[], lag=u - version, seconds=seconds)
        with timer(seconds, "rollout_time"):
            rollout, states = collect(args, groups, params[device], states, stats)
            learners = shared.layout.learner_devices  # a share of the envs each
            parts = [jax.device_put(jax.tree.map(lambda x: np.split(x, len(learners), axis=1)[k], rollout), d)
                     for k, d in enumerate(learners)]
        seconds = defaultdict(float)  # the next rollout's
        with timer(seconds, "actor_queue_wait"):
            until_stopped(shared.queues[i].put, shared.stop.is_set, (parts, stats))


def actor_thread(args, shared, i):
    """A failure stops the run; main prints its traceback."""
    try:
        actor_loop(args, shared, i)
    except Stopped:
        pass
    except BaseException:
        shared.errors.append(f"in thread {threading.current_thread().name}:\n{traceback.format_exc()}")
        shared.stop.set()


# ---- Learning (learner devices): one PPO update in one compiled call

class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    key: jax.Array  # minibatch shuffling, the same on every learner


def learning_rate(args, num_updates, update_index):  # 0 is the first update
    return args.learning_rate * (1.0 - update_index / num_updates if args.anneal_lr else 1.0)


def make_optimizer(args, num_updates):
    """Adam; its learning rate steps down once per update, not per step."""
    steps_per_update = args.update_epochs * args.num_minibatches
    lr = lambda count: learning_rate(args, num_updates, count // steps_per_update)
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adam(lr, eps=1e-5))


def init_state(key, args, env_info, num_updates):
    k_params, k_learn = jax.random.split(key)
    params = init_params(k_params, env_info.obs_shape, env_info.num_actions)
    return TrainState(params=params, opt_state=make_optimizer(args, num_updates).init(params), key=k_learn)


def prox_log_probs(params, samples, chunks):
    """log pi_prox of every sample, in `chunks` pieces to bound memory."""
    split = lambda x: x.reshape(chunks, -1, *x.shape[1:])
    logp = jax.lax.map(lambda c: log_prob(apply(params, c[0])[0], c[1]), (split(samples.obs), split(samples.actions)))
    return logp.reshape(-1)


def learner_update(state, rollout, args, optimizer):
    """One PPO update on this learner's share [T, E_l, ...] of the rollouts (inside shard_map)."""
    advantages = gae(rollout.rewards, rollout.values, rollout.terminated, rollout.dones, args.gamma, args.gae_lambda)
    old_values = rollout.values[:-1]
    samples = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]),  # [T, E_l, ...] -> [N, ...]
                           Samples(obs=rollout.obs, actions=rollout.actions, logprobs=rollout.logprobs,
                                   values=old_values, advantages=advantages, returns=advantages + old_values,
                                   mask=rollout.valid))
    params, opt_state, key = state
    samples = samples._replace(prox_logprobs=prox_log_probs(params, samples, args.num_minibatches))
    losses = []
    # Python loops, not lax.scan: on XLA:CPU a conv gradient in a scan runs far slower (jax 12868).
    for _ in range(args.update_epochs):
        key, sub = jax.random.split(key)
        order = jax.random.permutation(sub, samples.actions.shape[0]).reshape(args.num_minibatches, -1)
        for idx in order:
            mb = jax.tree.map(lambda x: x[idx], samples)
            grads, mb_losses = jax.grad(ppo_loss, has_aux=True)(params, mb, args, "devices")
            grads = jax.lax.psum(grads, "devices")  # each learner's share -> the global mean's gradient
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(jax.lax.psum(mb_losses, "devices"))
    mean = jax.tree.map(lambda *x: jnp.stack(x).mean(), *losses)
    mean = mean._replace(clipfrac_first=losses[0].clipfrac_first)
    return TrainState(params=params, opt_state=opt_state, key=key), mean


def make_update(args, mesh, num_updates):
    body = partial(learner_update, args=args, optimizer=make_optimizer(args, num_updates))
    # check_vma=False: the body psums the gradients itself; with the check, JAX would already have summed
    # those of the replicated (P()) parameters.
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "devices")), out_specs=(P(), P()),
                                 check_vma=False))


# ---- The device mapping

class Layout(NamedTuple):
    actor_devices: list  # this host's
    learner_devices: list  # this host's, in mesh order
    mesh: Mesh  # every host's learner devices, one axis "devices"
    num_envs: int  # of all hosts


def pick_devices(args):
    n = len(jax.local_devices())
    actors = args.actor_device_ids or [0]
    learners = args.learner_device_ids or ([i for i in range(n) if i not in actors] or [0])
    for flag_name, ids in (("--actor-device-ids", actors), ("--learner-device-ids", learners)):
        if not all(0 <= i < n for i in ids) or len(set(ids)) < len(ids):
            fail(f"{flag_name} {' '.join(map(str, ids))}: give distinct indices in 0..{n - 1} (this host has "
                 f"{n} devices)")
    if n > 1 and set(actors) & set(learners):
        fail(f"--learner-device-ids {' '.join(map(str, learners))} share a device with --actor-device-ids "
             f"{' '.join(map(str, actors))}; with {n} devices give each role its own")
    hosts = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    mesh = Mesh(np.array([host[i] for host in hosts for i in learners]), ("devices",))
    mine = hosts[jax.process_index()]
    num_envs = jax.process_count() * len(actors) * args.num_actor_threads * args.local_num_envs
    return Layout(actor_devices=[mine[i] for i in actors], learner_devices=[mine[i] for i in learners], mesh=mesh,
                  num_envs=num_envs)


def start_actors(args, shared):
    threads = [threading.Thread(target=actor_thread, args=(args, shared, i), name=f"actor{i}", daemon=True)
               for i in range(len(shared.queues))]
    for t in threads:
        t.start()
    return threads


def assemble(parts, layout):
    """One global Rollout [T, all envs, ...] from the actor threads' parts."""
    per_device = [jax.tree.map(lambda *x: jnp.concatenate(x, axis=1), *shares) for shares in zip(*parts)]
    sharding = NamedSharding(layout.mesh, P(None, "devices"))

    def glue(*shards):
        shape = (shards[0].shape[0], shards[0].shape[1] * layout.mesh.size, *shards[0].shape[2:])
        return jax.make_array_from_single_device_arrays(shape, sharding, list(shards))

    return jax.tree.map(glue, *per_device)


def local(tree):
    """This host's copy of replicated global arrays."""
    return jax.tree.map(lambda x: x.addressable_shards[0].data, tree)


# ---- The learner loop (main thread)

def receive(shared):
    """Each local actor thread's (parts, ActorStats); None once a stop signal is caught."""
    with contextlib.suppress(Stopped):
        return [until_stopped(q.get, lambda: shared.stop.is_set() or bool(shared.caught)) for q in shared.queues]
    if shared.stop.is_set():  # an actor thread failed
        raise Stopped
    return None


def learn(args, shared, state):
    update_fn, start, row = make_update(args, shared.layout.mesh, shared.num_updates), time.perf_counter(), {}
    window = Window(start=start, actors=[], losses=[], learner=[])
    for update in range(shared.start_update + 1, shared.num_updates + 1):
        seconds = defaultdict(float)
        with timer(seconds, "learner_queue_wait"):
            received = receive(shared)
        safe_point_after(args, shared, state, update - 1)  # on a stop signal (received is None) it exits
        with timer(seconds, "learner_time"):
            state, losses = update_fn(state, assemble([parts for parts, _ in received], shared.layout))
            shared.store.publish(update, state.params)
            losses = jax.device_get(local(losses))
        check_finite(losses._asdict(), update, shared.run)
        window.losses.append(losses)
        window.learner.append(seconds)
        window.actors.extend(stats for _, stats in received)
        if update % args.log_every == 0 or update in (shared.start_update + 1, shared.num_updates):
            row = report(args, shared, window, update, start)
            window = Window(start=time.perf_counter(), actors=[], losses=[], learner=[])
    return state, row


def safe_point_after(args, shared, state, update, last=False):
    """The safe point after `update`: a checkpoint when due or `last`; on a stop signal in any process, one and exit."""
    def write():  # process 0 alone fetches: the others would only pay the transfer
        if shared.run.checkpoint is not None:
            save(shared.run, {"state": jax.device_get(local(state)), "update": np.int64(update),
                              "global_step": np.int64(update * shared.batch)}, args)

    due = last or (update > shared.start_update and update % args.checkpoint_every == 0)
    safe_point(shared.caught, update, shared.run, write, due)


def initial_state(args, env_info, layout, batch):
    """The replicated TrainState, fresh or --resume's, and the update it starts after."""
    init = partial(init_state, jax.random.PRNGKey(args.seed), args, env_info, args.total_timesteps // batch)
    template = {"state": jax.eval_shape(init), "update": np.int64(0), "global_step": np.int64(0)}
    ckpt = load(args, template, batch, "a checkpoint of sebulba_ppo_atari.py?") if args.resume else None
    replicated = NamedSharding(layout.mesh, P())
    state = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, replicated, lambda i: a[i]),
                         ckpt["state"] if ckpt else jax.device_get(init()))
    return state, int(ckpt["update"]) if ckpt else 0


# ---- The metrics: CleanRL's names and Cleanba's timing scalars

class Window(NamedTuple):  # since the last metrics row
    start: float  # time.perf_counter()
    actors: list  # ActorStats of every rollout
    losses: list  # Losses of every update
    learner: list  # timings of every update


def report(args, shared, window, update, start):
    mean = lambda xs: float(np.mean(xs))
    row = {"global_step": update * shared.batch, "update": update,
           "charts/SPS": len(window.losses) * shared.batch / (time.perf_counter() - window.start),
           "charts/learning_rate": learning_rate(args, shared.num_updates, update - 1),  # the last update's
           "stats/param_lag": max(s.lag for s in window.actors),
           **{f"losses/{k}": mean(v) for k, v in zip(Losses._fields, zip(*window.losses))},
           **{f"stats/{k}": mean([s.seconds[k] for s in window.actors]) for k in window.actors[0].seconds},
           **{f"stats/{k}": mean([seconds[k] for seconds in window.learner]) for k in window.learner[0]}}
    if returns := [r for s in window.actors for r in s.returns]:
        row["charts/episodic_return"] = mean(returns)
        row["charts/episodic_length"] = mean([n for s in window.actors for n in s.lengths])
    eta = (time.perf_counter() - start) / (update - shared.start_update) * (shared.num_updates - update)
    log(shared.run, row, shared.num_updates, shared.num_updates * shared.batch, eta)
    return row


# ---- This script's flags

def check_args(args):
    """Returns the args and the EnvInfo."""
    env_info = describe_env(args.env_id, args.machado)
    check_flags(args, unit=("gamma", "gae_lambda"), positive=("learning_rate",))
    if min(env_info.obs_shape[1:]) < 3:
        fail(f"--env-id {args.env_id!r}: its images of shape {env_info.obs_shape} are too small for a 3x3 convolution")
    return args, env_info


def check_sizes(args, layout, env_info):
    """Counts that must divide or fit; returns the steps per update."""
    n_learners = len(layout.learner_devices)
    if args.local_num_envs % n_learners:
        fail(f"--local-num-envs {args.local_num_envs} must divide evenly across {n_learners} learner devices")
    if args.async_envs and args.local_num_envs % 2:
        fail(f"--local-num-envs {args.local_num_envs} must be even with --async-envs (two halves take turns)")
    check_seed(args.seed, 2**31 - layout.num_envs + 1)  # env i of the run is seeded with seed + i
    # Each actor thread's rollouts: one collected, one queued, one learned from.
    threads = len(layout.actor_devices) * args.num_actor_threads
    obs_bytes = np.prod(env_info.obs_shape) * (1 if env_info.atari else 4)  # uint8 frames, else floats
    check_fits(3 * threads * (args.num_steps + 1) * args.local_num_envs * obs_bytes,
               f"the rollouts of {threads} actor threads x --local-num-envs {args.local_num_envs}")
    batch = args.num_steps * layout.num_envs
    if args.total_timesteps < batch:
        fail(f"--total-timesteps {args.total_timesteps} is less than one update ({batch:,} steps = "
             f"--num-steps {args.num_steps} x {layout.num_envs} envs)")
    if (batch // layout.mesh.size) % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide the {batch // layout.mesh.size} samples "
             "on each learner (--num-steps x envs per learner)")
    return batch


# ---- The run

def main(args):
    caught = catch_stop_signals()
    args, env_info = check_args(args)
    start_distributed(args, caught)
    layout = pick_devices(args)
    batch = check_sizes(args, layout, env_info)
    num_updates = args.total_timesteps // batch
    state, start_update = initial_state(args, env_info, layout, batch)
    run = open_run(args)
    queues = [queue.Queue(maxsize=1) for _ in layout.actor_devices for _ in range(args.num_actor_threads)]
    shared = Shared(layout=layout, store=ParamStore(layout.actor_devices), queues=queues, stop=threading.Event(),
                    errors=[], caught=caught, run=run, start_update=start_update, num_updates=num_updates, batch=batch)
    shared.store.publish(start_update, state.params)
    threads = start_actors(args, shared)
    say(f"{args.env_id}: {num_updates - start_update} updates of {batch:,} steps; actor devices "
        f"{[d.id for d in layout.actor_devices]} x {args.num_actor_threads} threads x {args.local_num_envs} envs; "
        f"learner devices {[d.id for d in layout.learner_devices]} x {jax.process_count()} host(s)")
    try:
        state, row = learn(args, shared, state)
    except Stopped:  # an actor thread failed
        exit_now(1, run, "".join(shared.errors).rstrip())
    finally:
        shared.stop.set()
    for t in threads:
        t.join(timeout=10)
    safe_point_after(args, shared, state, num_updates, last=True)
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
