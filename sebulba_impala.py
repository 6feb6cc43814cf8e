"""Sebulba IMPALA: the Podracer paper's actor/learner split (Hessel et al. 2021) with V-trace
(Espeholt et al. 2018).

    host CPU (per host)             actor device(s)            learner devices (all hosts)
    actor thread i: env batch  -->  act(params, obs): sample (jit)
      (--local-num-envs envs)  <--  actions (the logits stay on it until the rollout ends)
      --num-steps steps, then the rollout [T, E, ...] is split along E
                               ------------------------->  learner 0 | learner 1 | ...
                                 (env block k to learner k,  each joins its blocks;
                                  a queue of one rollout)    V-trace loss, grads summed
                               <-------------------------  publish: new params to actors

Rollout u is collected during update u - 1, so it acts with params u - 2 (update u - 2's); update u,
which learns from it, starts from params u - 1, one version on: stats/param_lag is 1. Exactly u - 2,
not whichever is newest: equal flags train an equal agent however busy the machine. In time:
    actors:    rollout 1, params 0 | rollout 2, params 0 | rollout 3, params 1 | rollout 4, params 2
    learners:  wait for rollout 1  | update 1: rollout 1 | update 2: rollout 2 | update 3: rollout 3

Sections: envs, network, loss, optimizer, one rollout's path (a map heads it), `main`. New to JAX?
Read the map first, then `actor`, `collect`, `learn`, `make_update`, `ParamStore`, with the network
and loss as black boxes; main's checks and the plumbing appendix can wait. Where to change: the
network in `init_params` and `features`, the loss in `impala_loss` (its docstring says how to add a
term), the env in `describe_env`, `make_envs`, `env_*` (it must reset as the reset-step table says).
In PyTorch terms: `shard_map` runs the update on every learner at once, each on its share of the
data, as DDP runs a process per GPU; `psum` over "learners" is all_reduce with SUM (not DDP's mean:
each learner's loss is its share of the global loss). The `Mesh` is the learners' process group,
`NamedSharding(mesh, P(...))` which part of an array each holds (P(): all), `addressable_data(0)`
one local learner's copy, `make_array_from_process_local_data` a device_put of each host's part.
A pytree is any nesting of tuples, lists, dicts and NamedTuples of arrays: JAX acts on its leaves.

    python sebulba_impala.py --env-id CartPole-v1
    python sebulba_impala.py --env-id Pong-v5 --actor-device-ids 0 --learner-device-ids 1 2
"""

import contextlib
import dataclasses
import hashlib
import importlib
import json
import math
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import defaultdict
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

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

import envpool
import gymnasium as gym

warnings.filterwarnings("ignore", message=".*precision lowered.*")  # envpool's CartPole: harmless


# Images: the IMPALA paper's values (appendix G). Vectors: a larger step size, since RMSProp moves a
# weight about one step size an update, whatever the gradient's scale, and CartPole's values reach 100.
DEFAULTS = {"image": dict(total_timesteps=10_000_000, learning_rate=6e-4, num_steps=20,
                          rmsprop_eps=0.01, network="deep", log_every=10),
            "vector": dict(total_timesteps=300_000, learning_rate=5e-3, num_steps=16,
                           rmsprop_eps=1e-5, network="mlp", log_every=40)}

def default_is(text):  # what --help says a flag left at None stands for (tyro would say None)
    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")

def by_obs(name):  # the flag's values in DEFAULTS, for --help
    return default_is(", ".join(f"{obs}s {values[name]}" for obs, values in DEFAULTS.items()))


@dataclasses.dataclass
class Args:
    """A flag of DEFAULTS left at None takes its value for the env's observations (check_args)."""
    env_id: str = "Breakout-v5"  # envpool (`Pong-v5`, `CartPole-v1`) or gymnasium `module:Name-v0`
    seed: int = 1  # seeds parameters, envs and sampling
    total_timesteps: Annotated[int | None, by_obs("total_timesteps")] = None  # env steps, all hosts (reset steps too)
    learning_rate: Annotated[float | None, by_obs("learning_rate")] = None  # RMSProp step size
    anneal_lr: bool = True  # decay the step size linearly to 0
    actor_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])  # local devices that act
    learner_device_ids: Annotated[list[int] | None, default_is("others, or 0")] = None  # local devices that learn
    num_actor_threads: int = 2  # per actor device: one steps envs while another acts
    local_num_envs: int = 16  # envs per actor thread
    async_envs: bool = False  # envpool: step half the envs while acting for the other half
    num_steps: Annotated[int | None, by_obs("num_steps")] = None  # rollout length per env
    gamma: float = 0.99  # discount
    vtrace_lambda: float = 1.0  # V-trace's lambda: c_t = lambda * min(1, pi/mu)
    ent_coef: float = 0.01  # entropy bonus weight
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 40.0  # global-norm gradient clipping
    rmsprop_eps: Annotated[float | None, by_obs("rmsprop_eps")] = None  # RMSProp epsilon
    # deep or shallow (IMPALA's CNNs) for images, mlp for vectors
    network: Annotated[Literal["deep", "shallow", "mlp"] | None, by_obs("network")] = None
    machado: bool = False  # Atari as Machado et al. (2018): sticky actions, all 18, no life loss
    log_every: Annotated[int | None, by_obs("log_every")] = None  # updates between metrics rows
    checkpoint_every: int = 100  # updates between checkpoints (and one at the end)
    # The plumbing appendix's flags:
    exp_name: str = Path(__file__).stem  # part of the run folder's name
    run_dir: str = "runs"  # parent folder of run folders
    resume: str | None = None  # a checkpoint.npz to continue from (its envs start new episodes)
    distributed: bool = False  # call jax.distributed.initialize() (multi-host)
    coordinator_address: str | None = None  # host:port of process 0 (or JAX detects it)
    num_processes: int | None = None  # processes in all (multi-host)
    process_id: int | None = None  # this process's index


# ---- The environment: envpool or gymnasium on the host

def atari_kwargs(machado):
    """The IMPALA and PPO papers' Atari protocol, or --machado's."""
    if machado:  # noop_max=1: no no-op starts (0 crashes envpool 1.2.5)
        return dict(episodic_life=False, reward_clip=True, noop_max=1,
                    repeat_action_probability=0.25, full_action_space=True)
    return dict(episodic_life=True, reward_clip=True, noop_max=30)

class EnvInfo(NamedTuple):
    obs_shape: tuple  # [D] or [C, H, W]
    num_actions: int
    source: str  # envpool or gymnasium
    atari: bool  # envpool's Atari: the only envs whose config has episodic_life

@cache  # asked by check_args and by each make_envs: the spaces are read once
def describe_env(env_id, machado):
    module, _, name = env_id.rpartition(":")
    if env_id in envpool.list_all_envs():
        source, atari = "envpool", hasattr(envpool.make_spec(env_id).config, "episodic_life")
        spaces = envpool.make_spec(env_id, **(atari_kwargs(machado) if atari else {}))
    else:
        source, atari = "gymnasium", False
        try:  # the module registers `name` with gymnasium
            importlib.import_module(module) if module else None
        except Exception as e:  # whatever the import raised
            fail(f"--env-id {env_id!r}: module {module!r} does not import ({type(e).__name__}: {e})")
        if name not in gym.registry:
            fail(f"--env-id {env_id!r}: no such envpool or gymnasium environment")
        try:  # a registered env may still not make: a dependency missing, a version retired
            with warnings.catch_warnings(action="ignore"):  # they come again in make_envs
                spaces = gym.make(name)
        except Exception as e:  # whatever its maker raised
            fail(f"--env-id {env_id!r}: gymnasium cannot make it ({type(e).__name__}: {e})")
    obs_space, act_space = spaces.observation_space, spaces.action_space
    if not isinstance(act_space, gym.spaces.Discrete) or act_space.start != 0 or not isinstance(
            obs_space, gym.spaces.Box) or len(obs_space.shape) not in (1, 3):
        fail(f"--env-id {env_id!r} has {act_space}, {obs_space}: not actions from 0, vectors or images")
    shape = obs_space.shape
    if source == "gymnasium" and len(shape) == 3:  # [H, W, C] to envpool's [C, H, W]
        shape = (shape[2], shape[0], shape[1])
    return EnvInfo(obs_shape=tuple(shape), num_actions=int(act_space.n), source=source, atari=atari)

class Envs(NamedTuple):  # a batch of envs stepped together
    pool: object
    env_info: EnvInfo
    seeds: list  # one per env

def make_envs(args, num_envs, seeds):
    env_info = describe_env(args.env_id, args.machado)
    if env_info.source == "gymnasium":
        pool = gym.make_vec(args.env_id.rpartition(":")[2], num_envs, vectorization_mode="sync")
    else:  # all env groups step at once: each gets its part of the cores this process may run on,
        # which Linux's sched_getaffinity counts (a container may allow fewer than os.cpu_count()).
        n_groups = len(args.actor_device_ids) * args.num_actor_threads * (1 + args.async_envs)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = min(num_envs, max(1, cores // n_groups))
        pool = envpool.make(args.env_id, env_type="gymnasium", num_envs=num_envs, seed=seeds,
                            num_threads=threads, **(atari_kwargs(args.machado) if env_info.atari else {}))
    return Envs(pool, env_info, seeds)

def host_obs(obs, env_info):  # images channels first; float64 vectors as float32
    obs = np.moveaxis(obs, -1, 1) if env_info.source == "gymnasium" and obs.ndim == 4 else obs
    return obs.astype(np.float32) if obs.dtype == np.float64 else obs

def env_reset(envs):
    obs, _ = envs.pool.reset() if envs.env_info.source == "envpool" else envs.pool.reset(seed=envs.seeds)
    return host_obs(obs, envs.env_info)

# The reset step: envpool and gymnasium reset an env on the step after its episode ends; that step
# ignores the action, rewards 0 and returns the next episode's first observation x_0. It is no move,
# so it is not `valid`. The rows around an episode whose last move returned x_end (cut: truncated):
#   row    obs    action   reward  terminated    valid  what the loss does with the row
#   t      x      a move   r       1 (0 if cut)  1      learns; if cut, bootstraps from V(x_end)
#   t + 1  x_end  ignored  0       0             0      leaves it out; row t's targets stop here
#   t + 2  x_0    a move   r'      as any row    1      learns, as from any move
# `collect` makes a row not valid if `ended` was set the step before; `next_state` does not count
# the reset step in a game's length. A rollout may end at row t: its x_T is then x_end.

class Step(NamedTuple):  # what one step of E envs returns
    obs: np.ndarray  # [E, *obs_shape]
    reward: np.ndarray  # [E] (Atari: clipped)
    terminated: np.ndarray  # [E] ended, not cut (Atari: a lost life too, by default): no bootstrap
    ended: np.ndarray  # [E] terminated or truncated: the next step is a reset step, not `valid`
    score: np.ndarray  # [E] (Atari: unclipped)
    game_over: np.ndarray  # [E] the game ended or was cut: log it (Atari: not at each lost life)

def env_send(envs, actions):  # envpool steps them in its threads
    if envs.env_info.source == "envpool":
        envs.pool.send(actions)

def env_recv(envs, actions):  # the step env_send began (gymnasium steps here)
    if envs.env_info.source == "envpool":
        obs, reward, terminated, truncated, info = envs.pool.recv()
    else:
        obs, reward, terminated, truncated, info = envs.pool.step(actions)
    score, game_over = reward, terminated | truncated
    if envs.env_info.atari:  # info: the unclipped reward; the game's end, not each lost life
        score, game_over = info["reward"], info["terminated"].astype(bool) | truncated
    return Step(obs=host_obs(obs, envs.env_info), reward=reward.astype(np.float32),
                terminated=terminated, ended=terminated | truncated, score=score, game_over=game_over)


# ---- The network: IMPALA's figure 3 CNNs (no LSTM) or an MLP

IMPALA_CHANNELS = (16, 32, 32)  # deep: stacks of a conv, a max-pool, 2 residual blocks
SHALLOW_CONVS = ((16, 8, 4), (32, 4, 2))  # shallow: (channels, kernel, stride), "VALID" padding

def dense_init(key, n_in, n_out, scale):
    return {"w": jax.nn.initializers.orthogonal(scale)(key, (n_in, n_out)), "b": jnp.zeros(n_out)}

def conv_init(key, c_in, c_out, size=3):
    return {"w": jax.nn.initializers.he_normal()(key, (size, size, c_in, c_out)), "b": jnp.zeros(c_out)}

def init_params(key, obs_shape, num_actions, network):
    # 32 keys, more than any network here has layers: each layer takes the next one.
    keys, torso = iter(jax.random.split(key, 32)), {}
    if network == "mlp":
        for head in ("policy", "value"):  # two MLPs: in one, the value's gradients swamp the policy's
            torso[f"{head}0"] = dense_init(next(keys), obs_shape[0], 64, np.sqrt(2))
            torso[f"{head}1"] = dense_init(next(keys), 64, 64, np.sqrt(2))
        hidden = 64
    else:
        c_in, (h, w) = obs_shape[0], obs_shape[1:]
        if network == "deep":
            for i, c in enumerate(IMPALA_CHANNELS):
                stack = torso[f"stack{i}"] = {"conv": conv_init(next(keys), c_in, c)}
                for j in range(2):
                    stack[f"block{j}"] = {"conv0": conv_init(next(keys), c, c), "conv1": conv_init(next(keys), c, c)}
                c_in, h, w = c, (h + 1) // 2, (w + 1) // 2  # the max-pool ("SAME", stride 2)
        else:
            for i, (c, size, stride) in enumerate(SHALLOW_CONVS):
                torso[f"conv{i}"] = conv_init(next(keys), c_in, c, size)
                c_in, h, w = c, (h - size) // stride + 1, (w - size) // stride + 1
        hidden = 256
        torso["dense"] = dense_init(next(keys), h * w * c_in, hidden, np.sqrt(2))
    return {"torso": torso, "policy": dense_init(next(keys), hidden, num_actions, 0.01),
            "value": dense_init(next(keys), hidden, 1, 1.0)}

def dense(p, x):
    return x @ p["w"] + p["b"]

def conv(p, x, stride=1, padding="SAME"):  # x [N, H, W, C]
    return jax.lax.conv_general_dilated(x, p["w"], (stride, stride), padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]

def image_input(obs):  # [N, C, H, W] -> [N, H, W, C] float, uint8 scaled to [0, 1]
    x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32)
    return x / 255.0 if obs.dtype == jnp.uint8 else x

def features(p, obs, network):  # obs [N, *obs_shape] -> policy, value features [N, 256 or 64]
    if network == "mlp":  # two MLPs of two layers, one for each head
        policy = jnp.tanh(dense(p["policy1"], jnp.tanh(dense(p["policy0"], obs))))
        value = jnp.tanh(dense(p["value1"], jnp.tanh(dense(p["value0"], obs))))
        return policy, value
    x = image_input(obs)
    if network == "deep":
        for i in range(len(IMPALA_CHANNELS)):
            stack = p[f"stack{i}"]
            x = conv(stack["conv"], x)
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")  # max-pool
            for block in (stack["block0"], stack["block1"]):  # residual: x + two convs of x
                y = conv(block["conv0"], jax.nn.relu(x))
                x = x + conv(block["conv1"], jax.nn.relu(y))
        x = jax.nn.relu(x)
    else:
        for i, (_, _, stride) in enumerate(SHALLOW_CONVS):
            x = jax.nn.relu(conv(p[f"conv{i}"], x, stride, "VALID"))
    x = jax.nn.relu(dense(p["dense"], x.reshape(x.shape[0], -1)))
    return x, x  # shared by both heads

def apply(params, obs, network):
    """obs [N, *obs_shape] -> (policy logits [N, A], value [N])."""
    policy_h, value_h = features(params["torso"], obs, network)
    return dense(params["policy"], policy_h), dense(params["value"], value_h)[:, 0]

def log_prob(logits, actions):
    return jnp.take_along_axis(jax.nn.log_softmax(logits), actions[..., None], -1)[..., 0]

def entropy(logits):
    logp = jax.nn.log_softmax(logits)
    return -(jnp.exp(logp) * logp).sum(-1)


# ---- The loss: V-trace (IMPALA paper 4.1, rho-bar = c-bar = 1), its policy gradient

class VTrace(NamedTuple):
    vs: jax.Array  # [T, E] value targets v_s
    pg_advantages: jax.Array  # [T, E] rho_s (r_s + gamma_s v_{s+1} - V(x_s))

def vtrace(values, rewards, discounts, rhos, valid, lambda_):
    """V-trace targets by the paper's recursion v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} -
    V(x_{s+1})). values [T+1, E], the rest [T, E]. A cut row t keeps gamma and bootstraps: the
    reset row t + 1 (valid 0) adds nothing, so v_{t+1} = V(x_end), ending the recursion."""
    clipped_rhos = jnp.minimum(1.0, rhos)
    cs = lambda_ * clipped_rhos * valid
    deltas = valid * clipped_rhos * (rewards + discounts * values[1:] - values[:-1])

    def backward(correction, x):  # carries v_{s+1} - V(x_{s+1}) in, v_s - V(x_s) out
        delta, discount, c = x
        correction = delta + discount * c * correction
        return correction, correction

    # lax.scan, a compiled loop, calls `backward` on each step's inputs, last step first.
    _, corrections = jax.lax.scan(backward, jnp.zeros_like(values[-1]), (deltas, discounts, cs), reverse=True)
    vs = values[:-1] + corrections
    vs_next = jnp.concatenate([vs[1:], values[-1:]])
    pg_advantages = valid * clipped_rhos * (rewards + discounts * vs_next - values[:-1])
    return VTrace(vs=jax.lax.stop_gradient(vs), pg_advantages=jax.lax.stop_gradient(pg_advantages))

class Losses(NamedTuple):
    loss: jax.Array
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array

def impala_loss(params, rollout, args):
    """Summed over this learner's valid steps, as in the IMPALA paper, whose coefficients (vf_coef,
    ent_coef) weigh sums: a mean's gradients, batch size times smaller, would sit below the images'
    RMSProp epsilon 0.01. The psum in `learner_update` adds the L learners' sums and gradients: each
    learner's sum is its share of the global batch's.
    A term you add must be a share too. Not a .mean() of this learner's steps: the psum adds L
    means. Every learner counts a term of the parameters alone (an L2 penalty), so divide it by L:
    `loss += coef * sum(jnp.sum(w ** 2) for w in jax.tree.leaves(params)) / jax.lax.psum(1, "learners")`."""
    # The network takes one batch axis: merge time and envs into it, then split them again, to
    # pi's logits [T+1, E, A] and values [T+1, E] (rollout.logits are mu's).
    obs, time_envs = rollout.obs, rollout.obs.shape[:2]
    pi_logits, values = apply(params, obs.reshape(-1, *obs.shape[2:]), args.network)
    pi_logits, values = pi_logits.reshape(*time_envs, -1), values.reshape(time_envs)
    logp_taken = log_prob(pi_logits[:-1], rollout.actions)  # log pi
    rhos = jnp.exp(logp_taken - log_prob(rollout.logits, rollout.actions))
    discounts = args.gamma * (1.0 - rollout.terminated)
    targets = vtrace(values, rollout.rewards, discounts, rhos, rollout.valid, args.vtrace_lambda)
    policy_loss = -jnp.sum(rollout.valid * logp_taken * targets.pg_advantages)
    value_loss = 0.5 * jnp.sum(rollout.valid * (targets.vs - values[:-1]) ** 2)
    entropy_sum = jnp.sum(rollout.valid * entropy(pi_logits[:-1]))
    loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy_sum
    return loss, Losses(loss, policy_loss, value_loss, entropy_sum)


# ---- The optimizer and its state

class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState

def annealed_lr(args, num_updates, update_index):  # update_index counts from 0
    return args.learning_rate * (1.0 - update_index / num_updates if args.anneal_lr else 1.0)

def make_optimizer(args, num_updates):
    """RMSProp as torchbeast and Cleanba run it: the paper's decay 0.99 (optax's default: 0.9), and
    epsilon outside the root. Inside it (the paper's and optax's way) 0.01 floors the denominator
    at 0.1 and the policy barely moves."""
    lr = lambda count: annealed_lr(args, num_updates, count)
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm),
                       optax.rmsprop(lr, decay=0.99, eps=args.rmsprop_eps, eps_in_sqrt=False))

def init_state(key, args, env_info, num_updates):
    params = init_params(key, env_info.obs_shape, env_info.num_actions, args.network)
    return TrainState(params, make_optimizer(args, num_updates).init(params))


# ---- One rollout's path, device placements included, as its data flows
# 1. `actor`, a host thread, collects rollout u with the parameters update u - 2 made
#    (`ParamStore.version_for`) on its actor device: the newest would depend on which thread ran
#    first, and reruns could differ. V-trace corrects the lag.
# 2. `collect` steps the envs on the host. jit runs `act` where its inputs (parameters, key) are, on
#    the actor device; only the actions come to the host each step (np.asarray waits for them),
#    the logits at the rollout's end (one device_get).
# 3. `actor` splits the host Rollout [T, E, ...] along the envs, like torch.chunk(L, dim=1) with
#    chunk k moved to learner k: one jax.Array with the sharding P(None, "learners"). It goes from
#    the host, not the actor device as in Cleanba: the observations, most of the bytes, are there.
# 4. `learn`, the main thread, takes one rollout from each thread; `make_update`'s `learner_update`
#    runs on every learner at once (`shard_map`), each on its blocks; `psum` sums over them all.
#    With one learner (one or two devices, at the defaults), each thread's obs [T + 1, E, ...] is
#    [17, 16, 4] for CartPole-v1, the learner joins [17, 32, 4], and the loss sums 16 x 32 steps.
# 5. `ParamStore.publish` copies the new parameters to each actor device, for step 1. JAX returns
#    before the device is done: an actor's `act` may wait for them.
# Across hosts, step 3's array of thread i holds every host's E envs, host by host: with 2 hosts of
# 2 learners and E = 4, host 0's envs are 0-3, host 1's 4-7, and learner k (0-3) gets 2k and 2k + 1.

class Layout(NamedTuple):
    actor_devices: list  # this host's
    learner_devices: list  # this host's, in mesh order
    mesh: Mesh  # all hosts' learners, host by host, along an axis named "learners"

def pick_devices(args):
    """The devices that act and learn."""
    num_devices = jax.local_device_count()
    actors = args.actor_device_ids
    learners = args.learner_device_ids or [i for i in range(num_devices) if i not in actors] or [0]
    for flag, ids in (("--actor-device-ids", actors), ("--learner-device-ids", learners)):
        if not ids or not all(0 <= i < num_devices for i in ids) or len(set(ids)) < len(ids):
            fail(f"{flag} {ids}: give distinct indices in 0..{num_devices - 1}")
    if num_devices > 1 and set(actors) & set(learners):
        fail(f"--learner-device-ids {learners} share a device with --actor-device-ids {actors}")
    hosts = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    mesh = Mesh(np.array([host[i] for host in hosts for i in learners]), ("learners",))
    mine = hosts[jax.process_index()]
    return Layout(actor_devices=[mine[i] for i in actors],
                  learner_devices=[mine[i] for i in learners], mesh=mesh)

def initial_state(args, env_info, layout, num_updates, batch_size):
    """The TrainState (new or --resume's), whole on every learner (P()), and its update."""
    init = partial(init_state, jax.random.PRNGKey(args.seed), args, env_info, num_updates)
    ckpt = resumed(args, jax.eval_shape(init), num_updates, batch_size) if args.resume else None
    tree = ckpt["state"] if ckpt else jax.device_get(init())  # the same on every host
    state = jax.make_array_from_process_local_data(NamedSharding(layout.mesh, P()), tree)
    return state, int(ckpt["update"]) if ckpt else 0

def local(tree):  # addressable_data(0): a local learner's copy of an array that every learner holds
    return jax.tree.map(lambda x: x.addressable_data(0), tree)

@partial(jax.jit, static_argnames="network")  # `network` picks code: each value compiles anew
def act(params, obs, key, network):
    key, sub = jax.random.split(key)
    logits, _ = apply(params, obs, network)
    actions = jax.random.categorical(sub, logits)
    return actions, logits, key

class Rollout(NamedTuple):  # T steps of E envs: numpy arrays, then jax.Arrays on the learners
    obs: np.ndarray  # [T + 1, E, *obs_shape]: x_T too, as the learner computes every value
    actions: np.ndarray  # [T, E]
    logits: np.ndarray  # [T, E, A] of the behaviour policy mu
    rewards: np.ndarray  # [T, E]
    terminated: np.ndarray  # [T, E] True: no bootstrap after step t
    valid: np.ndarray  # [T, E] False: step t is a reset step

class ActorState(NamedTuple):  # an env group's, carried from step to step
    obs: np.ndarray  # [E, *obs_shape] to act on
    key: jax.Array  # on the actor device
    ended: np.ndarray  # [E] obs ends an episode: the next step is a reset step
    game_return: np.ndarray  # [E] (Atari: unclipped)
    game_length: np.ndarray  # [E]

class ActorStats(NamedTuple):  # sent with each rollout
    returns: list  # of the games that ended
    lengths: list
    lag: int  # stats/param_lag
    timings: dict  # seconds spent, by name

@contextlib.contextmanager
def timer(timings, name):
    began = time.perf_counter()
    yield
    timings[name] += time.perf_counter() - began

class ParamStore:
    """The parameters on each actor device, by version, and the version each rollout acts with."""

    def __init__(self, devices, start_update):
        self.cond, self.devices, self.versions = threading.Condition(), devices, {}
        self.start_update = start_update  # the first rollouts act with the start's parameters

    def version_for(self, update):  # rollout u acts with what update u - 2 made (the map's step 1)
        return max(update - 2, self.start_update)

    def publish(self, version, params):
        params = {d: jax.device_put(local(params), d) for d in self.devices}
        with self.cond:
            self.versions[version] = params
            # Rollouts to come (version + 1 on) act with version_for(version + 1) or newer, so the
            # one below it is done: publish(5) drops 3, as rollout 6 acts with 4, rollout 7 with 5.
            self.versions.pop(self.version_for(version + 1) - 1, None)
            self.cond.notify_all()

    def wait(self, version, device):
        with self.cond:
            self.cond.wait_for(lambda: version in self.versions)
            return self.versions[version][device]

def start_actors(args, layout, store, num_updates):
    """This host's actor threads, each handing its rollouts to `learn` through a queue of one: a
    thread whose last rollout the learner has not taken yet waits."""
    def crash(hook):  # a raise ends the run, or the learner would wait forever
        traceback.print_exception(hook.exc_value)
        os._exit(1)
    threading.excepthook = crash
    num_threads = len(layout.actor_devices) * args.num_actor_threads
    queues = [queue.Queue(maxsize=1) for _ in range(num_threads)]
    for i, rollout_queue in enumerate(queues):
        index = jax.process_index() * num_threads + i
        device = layout.actor_devices[i // args.num_actor_threads]
        threading.Thread(target=actor, name=f"actor{i}", daemon=True, args=(
            args, index, device, layout.mesh, store, rollout_queue, num_updates)).start()
    return queues

def actor(args, index, device, mesh, store, rollout_queue, num_updates):
    """Actor thread `index`, numbered over all hosts' threads (no two share an env seed)."""
    groups, states = start_groups(args, index, device, store.start_update)
    to_learners = NamedSharding(mesh, P(None, "learners"))  # the envs (axis 1) split over learners
    for update in range(store.start_update + 1, num_updates + 1):  # the rollout this update learns from
        version = store.version_for(update)
        params = store.wait(version, device)
        stats = ActorStats(returns=[], lengths=[], lag=update - 1 - version, timings=defaultdict(float))
        with timer(stats.timings, "rollout_time"):
            rollout, states = collect(args, groups, params, states, stats)
            rollout = jax.make_array_from_process_local_data(to_learners, rollout)
        rollout_queue.put((rollout, stats))

def start_groups(args, index, device, start_update):
    """The thread's env groups (--async-envs: two halves) and their first states."""
    num_groups = 2 if args.async_envs else 1
    n = args.local_num_envs // num_groups
    groups, states = [], []
    for i in range(index * num_groups, (index + 1) * num_groups):
        # Each env's seed is drawn from a stream of its own (--seed, group i), so that other groups
        # and other run seeds draw unrelated seeds, where --seed + i would share all but one.
        seeds = np.random.default_rng([args.seed, i]).integers(2**31, size=n).tolist()
        groups.append(make_envs(args, n, seeds))
        # Each group and each resumed run samples its own stream (any distinct numbers would do).
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(args.seed), start_update), 1 + i)
        states.append(ActorState(obs=env_reset(groups[-1]), key=jax.device_put(key, device),
            ended=np.zeros(n, bool), game_return=np.zeros(n), game_length=np.zeros(n, int)))
    return groups, states

def collect(args, groups, params, states, stats):
    """--num-steps (T) steps of each env group: CleanRL's `a = act(obs); obs, r = step(a)`, the step
    split into env_send (start it) and env_recv (wait for it) for --async-envs. T = 3, each group:
        pass 0: act on x_0, send a_0
        pass 1: receive step 0, so row 0 (x_0, a_0, its reward) is whole; act on x_1, send a_1
        pass 2: receive step 1 (row 1: if step 0 ended, the reset step); act on x_2, send a_2
        pass 3: receive step 2 (row 2); x_3, left in the state, is what the loss bootstraps from"""
    rows, pending = [[] for _ in groups], [None] * len(groups)  # per group: rows; step in flight
    for t in range(args.num_steps + 1):
        for g, (envs, state) in enumerate(zip(groups, states)):
            if t > 0:  # state.ended is from before the step: a reset step is not valid
                with timer(stats.timings, "env_step_time"):
                    step = env_recv(envs, pending[g]["actions"])
                rows[g].append(dict(pending[g], rewards=step.reward, terminated=step.terminated,
                                    valid=~state.ended))
                state = next_state(state, step, stats)
            if t < args.num_steps:
                with timer(stats.timings, "inference_time"):
                    actions, logits, key = act(params, state.obs, state.key, args.network)
                    actions = np.asarray(actions)  # to the host; the logits stay on the device
                env_send(envs, actions)
                pending[g] = dict(obs=state.obs, actions=actions, logits=logits)
                state = state._replace(key=key)
            states[g] = state
    # One device_get brings every array that stayed on the actor device; rows stack along time.
    rows = jax.device_get(rows)
    per_group = [{k: np.stack([row[k] for row in group]) for k in group[0]} for group in rows]
    rollout = {k: np.concatenate([group[k] for group in per_group], axis=1) for k in per_group[0]}
    last_obs = np.concatenate([state.obs for state in states])  # x_T
    rollout["obs"] = np.concatenate([rollout["obs"], last_obs[None]])
    return Rollout(**rollout), states

def next_state(state, step, stats):
    """The ActorState after `step`; the games that ended go to `stats`."""
    game_return = state.game_return + step.score
    game_length = state.game_length + np.where(state.ended, 0, 1)
    over = step.game_over
    stats.returns.extend(game_return[over].tolist())
    stats.lengths.extend(game_length[over].tolist())
    return state._replace(obs=step.obs, ended=step.ended,
        game_return=np.where(over, 0.0, game_return), game_length=np.where(over, 0, game_length))

def learn(args, layout, run, store, queues, state, start_update, batch_size):
    """The learner loop, on the main thread."""
    num_updates = run.num_updates
    update_fn = make_update(args, layout.mesh, num_updates)
    window, since = [], time.perf_counter()  # (Losses, timings, stats) of each update since a row
    for update in range(start_update + 1, num_updates + 1):
        timings = defaultdict(float)
        with timer(timings, "learner_queue_wait"):
            received = [q.get() for q in queues]  # each thread's rollout for this update
        with timer(timings, "learner_time"):
            state, losses = update_fn(state, [rollout for rollout, _ in received])
            # JAX dispatches asynchronously: update_fn returns before the learners are done. publish
            # queues the copies to the actor devices, to start the moment the update ends; the
            # learner waits for the update only at device_get (and at a checkpoint's).
            store.publish(update, state.params)
            losses = jax.device_get(local(losses))
        window.append((losses, timings, [stats for _, stats in received]))
        if update % args.log_every == 0 or update in (start_update + 1, num_updates):
            row = report(args, run, window, time.perf_counter() - since, update, batch_size)
            window, since = [], time.perf_counter()
        checkpoint = lambda: {"state": jax.device_get(local(state)), "update": np.int64(update),
            "global_step": np.int64(update * batch_size)}
        due = update % args.checkpoint_every == 0 or update == num_updates
        safe_point(args, run, update, due, checkpoint)
    return state, row

def make_update(args, mesh, num_updates):
    """One IMPALA update on every learner at once. shard_map gives each learner its part of each
    input (in_specs): all of the TrainState (P(), for every array in it), and its block of the envs,
    axis 1, of every field of each thread's rollout (P(None, "learners"), the mesh's axis)."""
    optimizer = make_optimizer(args, num_updates)

    def learner_update(state, rollouts):  # on one learner, in shard_map
        # One Rollout per thread; zip(*rollouts) gathers each field's blocks [T (+ 1), E / L, ...].
        rollout = Rollout(*[jnp.concatenate(field, axis=1) for field in zip(*rollouts)])
        grads, losses = jax.grad(impala_loss, has_aux=True)(state.params, rollout, args)
        # Every learner gets the sums over all learners, so all take the same step.
        grads, losses, num_valid = jax.lax.psum((grads, losses, rollout.valid.sum()), "learners")
        # optax is functional: it returns the changes and its new state.
        changes, opt_state = optimizer.update(grads, state.opt_state, state.params)
        losses = jax.tree.map(lambda x: x / jnp.maximum(num_valid, 1.0), losses)  # per valid step
        params = optax.apply_updates(state.params, changes)
        return TrainState(params, opt_state), losses

    # The psum above is DDP's gradient all-reduce: each learner's grads are its share's, their psum
    # the whole batch's (2 learners of 320 steps: all 640 steps'). P() in out_specs promises
    # that all learners return the same value, as the psum makes them. check_vma=False (vma,
    # "varying manual axes": JAX's record of which values differ by learner): on, jax.grad would
    # all-reduce too: each learner's grads would be the whole batch's already, the psum L times it.
    return jax.jit(jax.shard_map(learner_update, mesh=mesh, in_specs=(P(), P(None, "learners")),
                                 out_specs=(P(), P()), check_vma=False))


# ---- Metrics, this script's flags, and the run

def report(args, run, window, elapsed, update, batch_size):
    """CleanRL's metrics and Cleanba's timings (mean seconds) over `window`'s updates."""
    mean = lambda xs: float(np.mean(xs))
    losses, learner_timings, actor_stats = zip(*window)
    actor_stats = [stats for update_stats in actor_stats for stats in update_stats]
    row = {"global_step": update * batch_size, "update": update,
           "charts/SPS": len(window) * batch_size / elapsed,
           "charts/learning_rate": annealed_lr(args, run.num_updates, update - 1),  # counts from 0
           "stats/param_lag": max(stats.lag for stats in actor_stats)}
    for name, values in zip(Losses._fields, zip(*losses)):
        row[f"losses/{name}"] = mean(values)
    for timings in (learner_timings, [stats.timings for stats in actor_stats]):
        for name in timings[0]:
            row[f"stats/{name}"] = mean([t[name] for t in timings])
    if returns := [r for stats in actor_stats for r in stats.returns]:
        row["charts/episodic_return"] = mean(returns)
        row["charts/episodic_length"] = mean([n for stats in actor_stats for n in stats.lengths])
    log(run, row)
    return row

def check_args(args):
    env_info = describe_env(args.env_id, args.machado)
    image = len(env_info.obs_shape) == 3
    family = DEFAULTS["image" if image else "vector"]
    args = dataclasses.replace(args, **{k: v for k, v in family.items() if getattr(args, k) is None})
    if (args.network == "mlp") == image:  # the CNNs take images, the MLP vectors
        fail(f"--network {args.network} does not fit {env_info.obs_shape}: mlp takes vectors")
    # Its "VALID" convs (8x8 stride 4, then 4x4 stride 2) leave no pixel below 20x20.
    if args.network == "shallow" and min(env_info.obs_shape[1:]) < 20:
        fail(f"--network shallow takes images of 20x20 or more, not {env_info.obs_shape}")
    if args.max_grad_norm <= 0:
        fail(f"--max-grad-norm {args.max_grad_norm} would clip every gradient to 0")
    if args.machado and not env_info.atari:
        fail(f"--machado is Atari's protocol; --env-id {args.env_id!r} is not an envpool Atari game")
    return args, env_info

def check_sizes(args, layout):
    if args.local_num_envs % (n_learners := len(layout.learner_devices)):
        fail(f"--local-num-envs {args.local_num_envs} must divide among {n_learners} learners: give "
             f"a multiple of {n_learners}, or --learner-device-ids (default: all but the actors)")
    if args.async_envs and args.local_num_envs % 2:
        fail(f"--local-num-envs {args.local_num_envs} must be even with --async-envs")
    envs_per_host = len(layout.actor_devices) * args.num_actor_threads * args.local_num_envs
    batch_size = args.num_steps * envs_per_host * jax.process_count()
    if args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one update ({batch_size:,} steps)")
    return batch_size

def resumed(args, state_shapes, num_updates, batch_size):  # --resume's checkpoint, if it can go on
    ckpt = load(args, {"state": state_shapes, "update": np.int64(0), "global_step": np.int64(0)})
    # load refused other flags, so another batch size means another number of hosts.
    if ckpt["global_step"] != ckpt["update"] * batch_size:
        fail(f"--resume {args.resume}: its run made {ckpt['global_step'] // ckpt['update']:,} steps an update, "
             f"here {jax.process_count()} hosts make {batch_size:,}: resume on as many hosts as it had")
    if ckpt["update"] >= num_updates:
        fail(f"--resume {args.resume}: its run has done all {num_updates} updates (raise --total-timesteps)")
    return ckpt

def note_a_cpu_learner(args, env_info, layout):  # where a run would take days
    if layout.learner_devices[0].platform == "cpu" and args.network == "deep" and min(env_info.obs_shape[1:]) > 35:
        print("note: a CPU learner trains the deep ResNet at about 100 steps/s (2 cores); README's CPU recipe: "
              "--network shallow --num-actor-threads 2 --local-num-envs 1 --num-steps 16", flush=True)

def main(args):
    start(args)
    args, env_info = check_args(args)
    layout = pick_devices(args)
    batch_size = check_sizes(args, layout)
    note_a_cpu_learner(args, env_info, layout)
    num_updates = args.total_timesteps // batch_size
    state, start_update = initial_state(args, env_info, layout, num_updates, batch_size)
    run = open_run(args, start_update, num_updates)
    store = ParamStore(layout.actor_devices, start_update)
    store.publish(start_update, state.params)
    queues = start_actors(args, layout, store, num_updates)
    # A stop exits by os._exit: Python's shutdown would abort if an actor thread is in envpool.
    try:
        state, row = learn(args, layout, run, store, queues, state, start_update, batch_size)
    except SystemExit as stop:
        os._exit(stop.code)
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
