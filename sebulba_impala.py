"""Sebulba: IMPALA with V-trace, on environments stepped by the host CPU.

The Sebulba architecture of Podracer (Hessel et al. 2021, arXiv 2104.06272, section 4)
running IMPALA (Espeholt et al. 2018, arXiv 1802.01561). Environments are anything the
host can step: envpool ids (Atari `*-v5` with the IMPALA paper's protocol, classic
control) or any id registered with gymnasium. Actor threads step their env batches and
pick actions on actor devices; rollouts go straight to the learner devices, whose update
is one `jit(shard_map(...))` over the learner devices of every host.

  host CPU (per host)              actor devices               learner devices (every host)
  -----------------------------    ------------------------    --------------------------------
  actor thread: B envs ---obs----> policy(params, obs, key)
               (envpool/gym) <-action-  sampling inside the jit
  (--num-actor-threads per actor device, each with --local-num-envs envs; while one
   thread waits on its envs another runs its policy)

  rollout: T+1 obs (x_T is carried into the next rollout), T actions, logits, rewards
  split along the env axis, device_put straight onto the learner devices:
       B/L envs ---------------------------------------------> learner device 0 -+ bounded
       B/L envs ---------------------------------------------> learner device 1 -+ queue
                                                               update = jit(shard_map(...)):
                                                               V-trace loss, gradients
                                                               summed over the mesh, RMSProp
  new params <---------------- copied to every actor device after each update: actors act
                               with params at most one update old (logged as
                               stats/param_lag); V-trace corrects for that lag.

  python sebulba_impala.py --env-id CartPole-v1
  python sebulba_impala.py --env-id Pong-v5 --actor-device-ids 0 --learner-device-ids 1 2 3 4
  python sebulba_impala.py --env-id Breakout-v5 --distributed   # once per host (SLURM, TPU pods)
"""

import dataclasses
import difflib
import hashlib
import importlib
import json
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import envpool
import gymnasium as gym
from tensorboardX import SummaryWriter

# envpool's classic-control specs trip a harmless gymnasium warning about float64 bounds.
warnings.filterwarnings("ignore", message=".*precision lowered.*")


@dataclasses.dataclass
class Args:
    env_id: str = "Breakout-v5"
    """an envpool id (Atari `*-v5`, `CartPole-v1`, ...) or any gymnasium id (`module:Name-v0` imports `module` first)"""
    exp_name: str = Path(__file__).stem
    """name of the experiment, part of the run folder's name"""
    seed: int = 1
    """one integer seeds the network, the action sampling and the environments"""
    total_timesteps: int | None = None
    """environment steps over all envs, devices and hosts (default: 10M for images, 300k for vectors)"""
    learning_rate: float | None = None
    """RMSProp step size (default: 6e-4 for images, the IMPALA paper's; 5e-3 for vectors)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the run (IMPALA paper)"""
    local_num_envs: int = 16
    """envs per actor thread"""
    num_steps: int | None = None
    """rollout length T, the unroll of the IMPALA paper (default: 20 for images, 16 for vectors)"""
    num_actor_threads: int = 2
    """Python actor threads per actor device, each stepping its own env batch"""
    actor_device_ids: list[int] | None = None
    """local device indices that act (default: [0])"""
    learner_device_ids: list[int] | None = None
    """local device indices that learn (default: the other local devices, or [0] when there is one)"""
    gamma: float = 0.99
    """discount factor"""
    vtrace_lambda: float = 1.0
    """lambda of V-trace's trace coefficients c_t = lambda * min(1, pi/mu)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (IMPALA paper's Atari value)"""
    vf_coef: float = 0.5
    """baseline (value) loss coefficient (IMPALA paper: 0.5)"""
    max_grad_norm: float = 40.0
    """clip gradients to this global norm (IMPALA paper: 40)"""
    rmsprop_eps: float | None = None
    """RMSProp epsilon, inside the square root (default: 0.01, the IMPALA paper's, for images; 1e-5 for vectors)"""
    network: Literal["deep", "shallow"] = "deep"
    """image network, IMPALA paper figure 3: the deep ResNet or the shallow CNN (vectors always get an MLP)"""
    machado: bool = False
    """Atari only: Machado et al. (2018): sticky actions 0.25, full action set, no life loss, no no-op starts"""
    log_every: int | None = None
    """write a metrics row and a progress line every this many updates (default: 10 images, 40 vectors)"""
    checkpoint_every: int = 100
    """write checkpoint.npz every this many updates (one is always written at the end)"""
    resume: str | None = None
    """path of a checkpoint.npz to continue from"""
    run_dir: str = "runs"
    """parent folder of the run folders"""
    distributed: bool = False
    """call jax.distributed.initialize() (multi-host: each host runs its own actors)"""
    coordinator_address: str | None = None
    """host:port of process 0, for jax.distributed.initialize"""
    num_processes: int | None = None
    """number of processes, for jax.distributed.initialize"""
    process_id: int | None = None
    """this process's index, for jax.distributed.initialize"""


# Defaults that depend on the observations. Images: the IMPALA paper's Atari settings
# (Espeholt et al. 2018, appendix G: batch 32 trajectories = 2 threads x 16 envs, unroll 20,
# lr 6e-4, RMSProp eps 0.01). Vectors: CartPole's values grow to ~100 and RMSProp moves each
# weight by about one step size per update, so the value head needs a large step size and
# many small updates.
DEFAULTS = {
    "image": dict(total_timesteps=10_000_000, learning_rate=6e-4, num_steps=20, rmsprop_eps=0.01, log_every=10),
    "vector": dict(total_timesteps=300_000, learning_rate=5e-3, num_steps=16, rmsprop_eps=1e-5, log_every=40),
}


# ---------------------------------------------------------------------------------------
# Environments, stepped on the host (Sebulba's point: any environment the host can run).


class EnvInfo(NamedTuple):
    source: str  # "envpool" or "gymnasium"
    atari: bool  # envpool Atari: IMPALA protocol; info["reward"] is the unclipped score
    obs_shape: tuple  # images are [C, H, W] (envpool's layout)
    num_actions: int


def atari_kwargs(machado):
    # IMPALA paper: life loss ends a training episode, rewards clipped to [-1, 1], 30 no-op
    # starts (frame skip 4, 4-frame stack, 84x84 grey are envpool's defaults).
    if machado:  # Machado et al. 2018: stochasticity from sticky actions instead of no-ops
        # noop_max=1 means no no-op starts: envpool 1.2.5 crashes at reset with noop_max=0.
        return dict(episodic_life=False, reward_clip=True, noop_max=1,
                    repeat_action_probability=0.25, full_action_space=True)
    return dict(episodic_life=True, reward_clip=True, noop_max=30)


def describe_env(env_id, machado):
    """Find the id in envpool or gymnasium and check its spaces before any env is stepped."""
    if env_id in envpool.list_all_envs():
        spec = envpool.make_spec(env_id)
        atari = hasattr(spec.config, "episodic_life")
        if atari:
            spec = envpool.make_spec(env_id, **atari_kwargs(machado))
        obs_space, act_space, source = spec.observation_space, spec.action_space, "envpool"
    else:
        module, _, name = env_id.rpartition(":")
        try:
            importlib.import_module(module) if module else None
        except ImportError as err:
            fail(f"--env-id {env_id!r}: cannot import module {module!r} ({err})")
        if name not in gym.registry:
            close = difflib.get_close_matches(name, [*envpool.list_all_envs(), *gym.registry], n=3)
            fail(f"--env-id {env_id!r}: unknown environment; close matches: {', '.join(close) or 'none'}")
        probe = gym.make(name)  # gymnasium's spaces need an instance
        obs_space, act_space, source, atari = probe.observation_space, probe.action_space, "gymnasium", False
        probe.close()
    if machado and not atari:
        fail(f"--machado applies to Atari ids only, not {env_id!r}")
    if not isinstance(act_space, gym.spaces.Discrete):
        fail(f"--env-id {env_id!r} needs a discrete action space, not {act_space}")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) not in (1, 3):
        fail(f"--env-id {env_id!r} needs a vector or image observation space, not {obs_space}")
    shape = obs_space.shape
    if source == "gymnasium" and len(shape) == 3:  # gymnasium images are [H, W, C]
        shape = (shape[2], shape[0], shape[1])
    return EnvInfo(source, atari, tuple(shape), int(act_space.n))


def make_envs(env_id, env, num_envs, seed, machado):
    if env.source == "envpool":
        kwargs = atari_kwargs(machado) if env.atari else {}
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, **kwargs)
    # gymnasium's vector envs autoreset on the next step by default, like envpool.
    return gym.make_vec(env_id.rpartition(":")[2], num_envs=num_envs, vectorization_mode="sync")


def host_obs(obs, env):
    if env.source == "gymnasium" and obs.ndim == 4:
        obs = np.moveaxis(obs, -1, 1)  # [B, H, W, C] -> [B, C, H, W]
    return obs.astype(np.float32) if obs.dtype == np.float64 else obs


def reset_envs(envs, env, seed):
    obs, _ = envs.reset() if env.source == "envpool" else envs.reset(seed=seed)
    return host_obs(obs, env)


class Step(NamedTuple):
    obs: np.ndarray  # [B, *obs_shape] next observation
    reward: np.ndarray  # [B] training reward (Atari: clipped to [-1, 1])
    terminated: np.ndarray  # [B] the episode ended for training (Atari: also a life lost): no bootstrap
    ended: np.ndarray  # [B] terminated or truncated: the next step is the env's reset step
    score: np.ndarray  # [B] the game's own reward (Atari: unclipped)
    game_over: np.ndarray  # [B] the whole game ended (Atari: last life lost) or was truncated


def env_step(envs, env, actions):
    obs, reward, terminated, truncated, info = envs.step(actions)
    if env.atari:  # the true game: unclipped reward, ends when all lives are gone
        score, game_over = info["reward"], info["terminated"].astype(bool) | truncated
    else:
        score, game_over = reward, terminated | truncated
    return Step(host_obs(obs, env), reward.astype(np.float32), terminated, terminated | truncated,
                score, game_over)


class ActorState(NamedTuple):
    obs: np.ndarray  # [B, *obs_shape] x_t
    ended: np.ndarray  # [B] x_t is an episode's last observation: step t is a reset step
    returns: np.ndarray  # [B] score of the current game so far
    lengths: np.ndarray  # [B] agent steps of the current game so far


def track_episodes(state, step):
    """Whole-game bookkeeping: the new state and (scores, lengths) of the games that ended on
    this step. A reset step (after any episode end, life loss included) ignores the action, so
    it is no step of any game."""
    returns = state.returns + step.score
    lengths = state.lengths + ~state.ended
    over = step.game_over
    new = ActorState(step.obs, step.ended, np.where(over, 0.0, returns), np.where(over, 0, lengths))
    return new, (returns[over], lengths[over])


# ---------------------------------------------------------------------------------------
# Network: the IMPALA paper's networks (figure 3, without the LSTM) for images, the deep
# ResNet by default or the shallow CNN; an MLP for vectors. Chosen from the observation
# shape and --network.

IMPALA_CHANNELS = (16, 32, 32)  # deep: channels of the three conv + max-pool + 2 residual block stacks
SHALLOW_CONVS = ((16, 8, 4), (32, 4, 2))  # shallow: (channels, kernel, stride) of its two convs


def dense_init(key, n_in, n_out, scale):
    return {"w": jax.nn.initializers.orthogonal(scale)(key, (n_in, n_out)), "b": jnp.zeros(n_out)}


def conv_init(key, c_in, c_out, size=3):
    return {"w": jax.nn.initializers.he_normal()(key, (size, size, c_in, c_out)), "b": jnp.zeros(c_out)}


def init_params(key, obs_shape, num_actions, network="deep"):
    keys = iter(jax.random.split(key, 32))
    params = {}
    if len(obs_shape) == 3 and network == "deep":
        c_in, (h, w) = obs_shape[0], obs_shape[1:]
        for i, c in enumerate(IMPALA_CHANNELS):  # conv, max-pool, two residual blocks
            params[f"stack{i}"] = {"conv": conv_init(next(keys), c_in, c),
                                   **{f"res{j}": conv_init(next(keys), c, c) for j in range(4)}}
            c_in, h, w = c, -(-h // 2), -(-w // 2)
        params["torso"], hidden = dense_init(next(keys), h * w * c_in, 256, np.sqrt(2)), 256
    elif len(obs_shape) == 3:
        c_in, (h, w) = obs_shape[0], obs_shape[1:]
        for i, (c, size, stride) in enumerate(SHALLOW_CONVS):  # "valid" padding
            params[f"conv{i}"] = conv_init(next(keys), c_in, c, size)
            c_in, h, w = c, (h - size) // stride + 1, (w - size) // stride + 1
        params["torso"], hidden = dense_init(next(keys), h * w * c_in, 256, np.sqrt(2)), 256
    else:
        for head in ("policy", "value"):  # two MLPs: a shared torso lets value errors swamp the policy
            params[f"{head}_hidden0"] = dense_init(next(keys), obs_shape[0], 64, np.sqrt(2))
            params[f"{head}_hidden1"] = dense_init(next(keys), 64, 64, np.sqrt(2))
        hidden = 64
    params["policy"] = dense_init(next(keys), hidden, num_actions, 0.01)
    params["value"] = dense_init(next(keys), hidden, 1, 1.0)
    return params


def dense(p, x):
    return x @ p["w"] + p["b"]


def conv(p, x, stride=1, padding="SAME"):  # x [N, H, W, C]
    return jax.lax.conv_general_dilated(x, p["w"], (stride, stride), padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]


def image_input(obs):  # [N, C, H, W] -> [N, H, W, C] float: uint8 frames scaled to [0, 1], others as they are
    x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32)
    return x / 255.0 if obs.dtype == jnp.uint8 else x


def resnet_torso(params, obs):  # obs [N, C, H, W] -> [N, 256]
    x = image_input(obs)
    for i in range(len(IMPALA_CHANNELS)):
        p = params[f"stack{i}"]
        x = conv(p["conv"], x)  # then a 3x3 max-pool with stride 2:
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        for j in (0, 2):  # residual block: x + conv(relu(conv(relu(x))))
            x = x + conv(p[f"res{j + 1}"], jax.nn.relu(conv(p[f"res{j}"], jax.nn.relu(x))))
    x = jax.nn.relu(x).reshape(x.shape[0], -1)
    return jax.nn.relu(dense(params["torso"], x))


def shallow_torso(params, obs):  # obs [N, C, H, W] -> [N, 256]
    x = image_input(obs)
    for i, (_, _, stride) in enumerate(SHALLOW_CONVS):
        x = jax.nn.relu(conv(params[f"conv{i}"], x, stride, "VALID"))
    return jax.nn.relu(dense(params["torso"], x.reshape(x.shape[0], -1)))


def mlp_torso(params, obs, head):  # obs [N, D] -> [N, 64]
    return jnp.tanh(dense(params[f"{head}_hidden1"], jnp.tanh(dense(params[f"{head}_hidden0"], obs))))


def apply(params, obs):
    """obs [..., *obs_shape] -> (policy logits [..., A], value [...])."""
    image = "torso" in params
    batch_shape = obs.shape[: obs.ndim - (3 if image else 1)]
    x = obs.reshape(-1, *obs.shape[len(batch_shape):])
    if image:
        policy_h = value_h = (resnet_torso if "stack0" in params else shallow_torso)(params, x)
    else:
        policy_h, value_h = mlp_torso(params, x, "policy"), mlp_torso(params, x, "value")
    logits, value = dense(params["policy"], policy_h), dense(params["value"], value_h)[:, 0]
    return logits.reshape(*batch_shape, -1), value.reshape(batch_shape)


# ---------------------------------------------------------------------------------------
# Loss: V-trace (IMPALA paper, section 4.1, rho-bar = c-bar = 1), policy gradient with
# V-trace advantages, baseline loss and entropy bonus.


class Rollout(NamedTuple):
    obs: np.ndarray  # [T+1, B, *obs_shape] x_0..x_T; x_T bootstraps and starts the next rollout
    actions: np.ndarray  # [T, B] int32
    logits: np.ndarray  # [T, B, A] behaviour policy mu (the actor's params)
    rewards: np.ndarray  # [T, B]
    terminated: np.ndarray  # [T, B] 1.0: the episode ended after step t, no bootstrap
    valid: np.ndarray  # [T, B] 0.0: x_t is an episode's last obs, step t is the env's reset step


class VTrace(NamedTuple):
    vs: jax.Array  # [T, B] value targets v_s
    pg_advantages: jax.Array  # [T, B] rho_s (r_s + gamma_s v_{s+1} - V(x_s))


def vtrace(values, rewards, discounts, rhos, valid, lambda_):
    """V-trace targets by the paper's recursion v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1})).

    values [T+1, B] are V(x_0..x_T); the rest are [T, B]. discounts are gamma, or 0 where the
    episode terminated (a time-limit truncation keeps gamma: x_{t+1} is then the final
    observation, so it bootstraps from its value). A reset step (valid 0) contributes
    nothing and cuts the trace, so no target reaches across an episode boundary.
    """
    clipped_rhos = jnp.minimum(1.0, rhos)  # rho-bar = c-bar = 1
    cs = lambda_ * clipped_rhos
    deltas = valid * clipped_rhos * (rewards + discounts * values[1:] - values[:-1])

    def backward(correction, x):  # correction = v_{s+1} - V(x_{s+1})
        delta, discount, c, ok = x
        correction = delta + ok * discount * c * correction
        return correction, correction

    _, corrections = jax.lax.scan(backward, jnp.zeros_like(values[-1]),
                                  (deltas, discounts, cs, valid), reverse=True)
    vs = values[:-1] + corrections
    vs_next = jnp.concatenate([vs[1:], values[-1:]])
    pg_advantages = valid * clipped_rhos * (rewards + discounts * vs_next - values[:-1])
    return VTrace(jax.lax.stop_gradient(vs), jax.lax.stop_gradient(pg_advantages))


class LossInfo(NamedTuple):
    loss: jax.Array
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array


def impala_loss(params, batch, gamma, lambda_, vf_coef, ent_coef):
    """Summed over this batch's valid steps, not averaged: the IMPALA paper's loss is a sum over
    time and batch, and under RMSProp with epsilon 0.01 its scale matters (a mean's gradients
    are T x B times smaller, so epsilon swamps them). The learner adds the devices' sums."""
    logits, values = apply(params, batch.obs)  # [T+1, B, A], [T+1, B]
    logp = jax.nn.log_softmax(logits[:-1])
    logp_taken = jnp.take_along_axis(logp, batch.actions[..., None], -1)[..., 0]
    mu_taken = jnp.take_along_axis(jax.nn.log_softmax(batch.logits), batch.actions[..., None], -1)[..., 0]
    rhos = jnp.exp(logp_taken - mu_taken)  # pi / mu, importance weights of the lag
    targets = vtrace(values, batch.rewards, gamma * (1.0 - batch.terminated), rhos, batch.valid, lambda_)
    policy_loss = -jnp.sum(batch.valid * logp_taken * targets.pg_advantages)
    value_loss = 0.5 * jnp.sum(batch.valid * (targets.vs - values[:-1]) ** 2)
    entropy = -jnp.sum(batch.valid * jnp.sum(jnp.exp(logp) * logp, -1))
    loss = policy_loss + vf_coef * value_loss - ent_coef * entropy
    return loss, LossInfo(loss, policy_loss, value_loss, entropy)


# ---------------------------------------------------------------------------------------
# Acting (actor threads on actor devices) and learning (jit + shard_map over the learner
# mesh): Sebulba's device mapping, paper section 4.


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState


def make_optimizer(args, num_updates):
    # IMPALA paper: RMSProp (decay 0.99, no momentum), global-norm clipping, linear decay to 0.
    lr = optax.linear_schedule(args.learning_rate, 0.0, num_updates) if args.anneal_lr else args.learning_rate
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm),
                       optax.rmsprop(lr, decay=0.99, eps=args.rmsprop_eps))


def sample_action(params, obs, key):  # jitted by each actor thread: sampling stays on its device
    key, subkey = jax.random.split(key)
    logits, _ = apply(params, obs)
    return jax.random.categorical(subkey, logits).astype(jnp.int32), logits, key


def make_learner(args, mesh, optimizer):
    """One update per call over every learner device of every host. Runs with
    check_vma=False, so the gradient computed inside the body is this device's own; the
    explicit psum then adds the devices' sums into the global batch's, the same on any
    number of devices. Losses are logged per valid step."""
    hyper = dict(gamma=args.gamma, lambda_=args.vtrace_lambda, vf_coef=args.vf_coef, ent_coef=args.ent_coef)

    def update(state, batch):  # batch: this device's B/L envs of every actor thread
        grads, info = jax.grad(impala_loss, has_aux=True)(state.params, batch, **hyper)
        grads, info, num_valid = jax.lax.psum((grads, info, batch.valid.sum()), "devices")
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        info = jax.tree.map(lambda x: x / jnp.maximum(num_valid, 1.0), info)
        return TrainState(optax.apply_updates(state.params, updates), opt_state), info

    env_axis = Rollout(*[P(None, "devices")] * len(Rollout._fields))
    return jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), env_axis), out_specs=(P(), P()),
                                 check_vma=False))


class Stopped(Exception):
    """Another thread failed or the run was interrupted."""


def until_stopped(op, stop, *op_args):
    """`q.put`/`q.get` on a bounded queue: wait, but never past a stop."""
    while not stop.is_set():
        try:
            return op(*op_args, timeout=0.5)
        except (queue.Full, queue.Empty):
            pass
    raise Stopped


def local(x):  # this host's copy of a replicated array
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


class ParamStore:
    """The newest learner parameters, one copy per actor device, and their version (the
    number of updates applied). A lock-owning object, so a small class."""

    def __init__(self, actor_devices):
        self.devices, self.copies, self.version = actor_devices, None, -1
        self.cond = threading.Condition()

    def publish(self, params, version):
        copies = [jax.device_put(jax.tree.map(local, params), d) for d in self.devices]
        with self.cond:
            self.copies, self.version = copies, version
            self.cond.notify_all()

    def wait(self, device_index, min_version, stop):
        with self.cond:
            while self.version < min_version and not stop.is_set():
                self.cond.wait(timeout=0.5)
            if stop.is_set():
                raise Stopped
            return self.copies[device_index], self.version


class Payload(NamedTuple):  # what an actor thread sends the learner per rollout
    shards: list  # one Rollout per local learner device, already on that device
    version: int  # version of the params that acted
    scores: np.ndarray  # whole-game scores of games that ended in this rollout
    lengths: np.ndarray
    stats: dict  # seconds per rollout: in env.step, in the policy, in all, and the last put's wait


def collect_rollout(envs, env, policy, params, key, state, num_steps):
    obs, trajectory, finished = [state.obs], [], []
    env_time = inference_time = 0.0
    for _ in range(num_steps):
        start = time.perf_counter()
        action, logit, key = policy(params, state.obs, key)
        action, logit = jax.device_get((action, logit))
        inference_time += time.perf_counter() - start
        start = time.perf_counter()
        step = env_step(envs, env, action)
        env_time += time.perf_counter() - start
        trajectory.append((action, logit, step.reward, step.terminated, ~state.ended))
        obs.append(step.obs)
        state, done = track_episodes(state, step)
        finished.append(done)
    actions, logits, rewards, terminated, valid = (np.stack(x) for x in zip(*trajectory))
    rollout = Rollout(np.stack(obs), actions, logits, rewards, terminated.astype(np.float32),
                      valid.astype(np.float32))
    scores, lengths = (np.concatenate(x) for x in zip(*finished))
    return rollout, state, key, (scores, lengths, env_time, inference_time)


def run_actor(args, env, store, stop, out, device_index, learner_devices, seed, key, updates):
    """One actor thread: its own envs, acting on actor device `device_index`."""
    envs = make_envs(args.env_id, env, args.local_num_envs, seed, args.machado)
    policy = jax.jit(sample_action)
    key = jax.device_put(key, store.devices[device_index])
    n = args.local_num_envs
    state = ActorState(reset_envs(envs, env, seed), np.zeros(n, bool), np.zeros(n), np.zeros(n, int))
    queue_wait, width = 0.0, n // len(learner_devices)
    try:
        for update in updates:
            # Act with params at most one update old: rollout u may start once update u-2 is done.
            params, version = store.wait(device_index, update - 2, stop)
            start = time.perf_counter()
            rollout, state, key, (scores, lengths, env_time, infer_time) = collect_rollout(
                envs, env, policy, params, key, state, args.num_steps)
            shards = [jax.device_put(jax.tree.map(lambda x: x[:, i * width:(i + 1) * width], rollout), d)
                      for i, d in enumerate(learner_devices)]  # split along envs, straight to learners
            stats = {"stats/env_step_time": env_time, "stats/inference_time": infer_time,
                     "stats/rollout_time": time.perf_counter() - start, "stats/actor_queue_wait": queue_wait}
            start = time.perf_counter()
            until_stopped(out.put, stop, Payload(shards, version, scores, lengths, stats))
            queue_wait = time.perf_counter() - start
    finally:
        envs.close()


def guarded(fn, stop, errors, *fn_args):
    """A thread's body: on an exception keep its traceback and stop everything."""
    try:
        fn(*fn_args)
    except Stopped:
        pass
    except BaseException:
        errors.append(f"in thread {threading.current_thread().name}:\n{traceback.format_exc()}")
        stop.set()


class Layout(NamedTuple):
    actor_devices: list  # this host's acting devices
    learner_devices: list  # this host's learner devices (its shards of the mesh)
    mesh: Mesh  # every host's learner devices, one axis "devices"


def device_layout(args):
    devices = sorted(jax.local_devices(), key=lambda d: d.id)
    n = len(devices)
    actor_ids = args.actor_device_ids if args.actor_device_ids is not None else [0]
    learner_ids = args.learner_device_ids
    if learner_ids is None:
        learner_ids = [0] if n == 1 else [i for i in range(n) if i not in actor_ids]
    for flag_name, ids in (("--actor-device-ids", actor_ids), ("--learner-device-ids", learner_ids)):
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < n for i in ids):
            fail(f"{flag_name} {ids}: give distinct indices of the {n} local devices, 0..{n - 1}")
    if n > 1 and set(actor_ids) & set(learner_ids):
        fail(f"--learner-device-ids {learner_ids} must not reuse actor devices {actor_ids} when {n} devices exist")
    if args.local_num_envs % len(learner_ids):
        fail(f"--local-num-envs {args.local_num_envs} must be a multiple of the {len(learner_ids)} learner devices")
    hosts = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in range(jax.process_count())]
    mesh = Mesh(np.array([host[i] for host in hosts for i in learner_ids]), ("devices",))
    print(f"actor devices {actor_ids} x {args.num_actor_threads} threads | learner devices {learner_ids}"
          f" | {len(hosts)} host(s), {mesh.size} learner devices in all", flush=True)
    return Layout([devices[i] for i in actor_ids], [devices[i] for i in learner_ids], mesh)


def to_learner_batch(payloads, sharding):
    """This host's rollouts -> one global batch sharded along envs over the whole mesh."""
    per_device = [jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *shards) if len(shards) > 1
                  else shards[0] for shards in zip(*(p.shards for p in payloads))]

    def global_array(*pieces):
        shape = (pieces[0].shape[0], pieces[0].shape[1] * sharding.mesh.size, *pieces[0].shape[2:])
        return jax.make_array_from_single_device_arrays(shape, sharding, list(pieces))

    return jax.tree.map(global_array, *per_device)


class Loop(NamedTuple):
    """What the learner loop works with besides its state."""
    learn: object  # the jitted update
    queues: list  # one bounded queue per local actor thread
    store: ParamStore
    stop: threading.Event  # set by a failing thread, and at the end
    sharding: NamedSharding  # of a global batch: envs split over the mesh
    caught: list  # stop signals caught (catch_stop_signals)
    run: object  # the run folder's Run
    steps_per_update: int


def checkpoint(run, state, update, key, steps_per_update):  # the learner state, the count, the run's RNG key
    if run.checkpoint is None:  # not process 0: the state is replicated, so nothing to fetch
        return
    save(run.checkpoint, {"state": jax.device_get(jax.tree.map(local, state)), "update": np.int64(update),
                          "global_step": np.int64(update * steps_per_update), "key": jax.random.key_data(key)})


def learner_loop(args, loop, state, key, start_update, num_updates):
    """The learner (main thread): one update per set of rollouts, new params to the actors. Returns
    the state, the updates done, the last metrics row and the stop signal (0: none)."""
    window, row, since, per_update = defaultdict(list), {}, time.time(), loop.steps_per_update
    beat = watch_peers(loop.run)
    for update in range(start_update + 1, num_updates + 1):
        beat()
        if signum := stop_signal(loop.caught):
            return state, update - 1, row, signum
        start = time.perf_counter()
        payloads = [until_stopped(q.get, loop.stop) for q in loop.queues]
        waited = time.perf_counter() - start
        state, info = loop.learn(state, to_learner_batch(payloads, loop.sharding))
        info = LossInfo(*(float(local(x)) for x in info))  # waits for the update
        check_finite(info._asdict(), update, loop.run)
        loop.store.publish(state.params, update)
        record(window, payloads, info, update, {"stats/learner_queue_wait": waited,
                                                "stats/learner_time": time.perf_counter() - start - waited})
        # Also log the run's first update: on a CPU an Atari update takes a while, so show life early.
        if update % args.log_every == 0 or update in (start_update + 1, num_updates):
            lr = args.learning_rate * (1 - (update - 1) / num_updates if args.anneal_lr else 1.0)
            seconds = (time.time() - since) / len(window["losses/loss"])
            row = {"global_step": update * per_update, "update": update, "charts/learning_rate": lr,
                   "charts/SPS": per_update / seconds,
                   **{name: float(np.max(v) if name == "stats/param_lag" else np.mean(v))
                      for name, v in window.items() if len(v)}}
            log(loop.run, row, update, num_updates, num_updates * per_update, (num_updates - update) * seconds)
            window, since = defaultdict(list), time.time()
        if update % args.checkpoint_every == 0:
            checkpoint(loop.run, state, update, key, per_update)
    return state, num_updates, row, 0


# ---------------------------------------------------------------------------------------
# This script's flag checks and metrics.


def check_args(args):
    """Fill the per-family defaults and check every flag; returns the args and the env's EnvInfo."""
    env = describe_env(args.env_id, args.machado)
    family = DEFAULTS["image" if len(env.obs_shape) == 3 else "vector"]
    args = dataclasses.replace(args, **{k: v for k, v in family.items() if getattr(args, k) is None})
    check_flags(args, counts=("total_timesteps", "local_num_envs", "num_steps", "num_actor_threads", "log_every",
                              "checkpoint_every"),
                unit=("gamma", "vtrace_lambda"), positive=("learning_rate", "rmsprop_eps"),
                nonnegative=("ent_coef", "vf_coef", "max_grad_norm"))
    if args.network == "shallow" and (len(env.obs_shape) != 3 or min(env.obs_shape[1:]) < 20):
        fail(f"--network shallow takes images of at least 20x20, not observations of shape {env.obs_shape}")
    return args, env


def record(window, payloads, info, update, learner_stats):
    """Add one update to the log window. stats/param_lag is the learner's params version minus
    the acting params' version (at most 1)."""
    for name, value in [*info._asdict().items(), *learner_stats.items()]:
        window[name if "/" in name else f"losses/{name}"].append(value)
    for p in payloads:
        window["charts/episodic_return"].extend(p.scores)
        window["charts/episodic_length"].extend(p.lengths)
        window["stats/param_lag"].append(update - 1 - p.version)
        for name, value in p.stats.items():
            window[name].append(value)


# ---- Plumbing: the same text in all four scripts (tests/test_plumbing.py keeps it so) ----
# Not the algorithm: flag checks, joining a multi-host run, the run folder, stop signals,
# checkpoints, metrics rows and the progress line. Read once, skip in the other files; what
# differs between the scripts comes in as arguments.

def fail(message):
    """Bad input: one line on stderr and exit status 2, before anything is compiled."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def flag(name):
    return "--" + name.replace("_", "-")


def check_flags(args, counts=(), unit=(), positive=(), nonnegative=()):
    """Counts at least 1; floats finite and in range (`unit`: [0, 1], `positive`: > 0,
    `nonnegative`: >= 0); a --resume file that exists."""
    for name in counts:
        if getattr(args, name) < 1:
            fail(f"{flag(name)} {getattr(args, name)} must be at least 1")
    for names, ok, valid in ((unit, lambda x: 0 <= x <= 1, "in [0, 1]"), (positive, lambda x: x > 0, "above 0"),
                             (nonnegative, lambda x: x >= 0, "at least 0")):
        for name in names:
            value = getattr(args, name)
            if not (math.isfinite(value) and ok(value)):
                fail(f"{flag(name)} {value} must be a finite number {valid}")
    if args.resume is not None and not Path(args.resume).is_file():
        fail(f"--resume {args.resume!r}: no such checkpoint file")


def check_seed(seed, limit):
    """Seeds in [0, limit) each give their own random numbers: JAX keeps a seed's low 32 bits
    (limit 2**32), envpool takes int32 seeds (Sebulba: the seed plus each env's index < 2**31)."""
    if not 0 <= seed < limit:
        fail(f"--seed {seed} must be in 0..{limit - 1:,}: other seeds repeat these seeds' random numbers "
             "or are refused by the environments")


def start_distributed(args):
    """Join a multi-host run (jax.distributed) if --distributed is given. A dead peer ends the
    others within two minutes (`lost_peer`, `watch_peers`)."""
    given = [flag(name) for name in ("coordinator_address", "num_processes", "process_id")
             if getattr(args, name) is not None]
    if not args.distributed:
        if given:
            fail(f"{', '.join(given)} only apply to a multi-host run: add --distributed")
        return
    if args.num_processes is not None and args.num_processes < 1:
        fail(f"--num-processes {args.num_processes} must be at least 1")
    if None not in (args.num_processes, args.process_id) and not 0 <= args.process_id < args.num_processes:
        fail(f"--process-id {args.process_id} must be in 0..{args.num_processes - 1} (--num-processes "
             f"{args.num_processes})")
    # JAX's preemption service would take SIGTERM from `catch_stop_signals`; `stop_signal` does its job.
    jax.config.update("jax_enable_preemption_service", False)
    try:
        # JAX's heartbeat (150 s here) only ends the run if `watch_peers` (at most 120 s) has not.
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                                   heartbeat_timeout_seconds=150)
    except (ValueError, TypeError, RuntimeError) as e:
        fail(f"--distributed: {str(e).splitlines()[0]} (outside a cluster JAX detects (SLURM, Cloud TPU, "
             "Kubernetes), give --coordinator-address, --num-processes and --process-id)")


def check_fits(num_bytes, what):
    """Refuse, up front, buffers that cannot fit in this host's memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > memory:
        fail(f"{what} would need {num_bytes / 2**30:,.1f} GiB, more than this host's {memory / 2**30:,.1f} GiB")


class Run(NamedTuple):
    folder: Path | None  # process 0 only: the other processes write nothing
    writer: SummaryWriter | None
    checkpoint: Path | None


def open_run(args):
    """{run-dir}/{env}__{exp-name}__{seed}__{unix time}, flat for namespaced ids. A run only writes into
    a folder it created: a second run started in the same second gets the suffix _1, _2, ..."""
    if jax.process_index() != 0:
        return Run(None, None, None)
    base = f"{args.env_id.replace(':', '_').replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"
    folder, n = Path(args.run_dir) / base, 0
    while True:
        try:
            folder.mkdir(parents=True)
            break
        except FileExistsError:
            n += 1
            folder = Path(args.run_dir) / f"{base}_{n}"
        except OSError as e:
            fail(f"--run-dir {args.run_dir!r}: cannot make a run folder in it ({e.strerror})")
    (folder / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
    return Run(folder, SummaryWriter(str(folder)), folder / "checkpoint.npz")


def catch_stop_signals():
    """Ctrl-C (SIGINT) and SIGTERM (what SLURM and Kubernetes send before a kill) only note the
    signal: the run stops at its next safe point, writes a checkpoint and exits 128 + the signal's
    number (130, 143). Raising inside JAX or envpool could hang. A second signal exits at once."""
    caught = []

    def note(signum, _):
        if caught:
            os._exit(128 + signum)
        caught.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, note)
    return caught


def stop_signal(caught):
    """0 to go on, else the signal to stop for; the same on every process of a multi-host run (the
    largest caught anywhere), so that every process stops after the same update."""
    mine = caught[0] if caught else 0
    if jax.process_count() == 1:
        return mine
    return int(np.max(multihost_utils.process_allgather(np.int32(mine))))


def flat(tree):
    """{key path: leaf}: the names of a checkpoint's arrays."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save(path, tree):
    """Write host arrays to `path` (None: not process 0) through a temporary file moved into place,
    so a crash or a kill never leaves a torn checkpoint."""
    if path is None:
        return
    tmp = path.with_name("checkpoint.tmp.npz")
    np.savez(tmp, **flat(tree))
    os.replace(tmp, path)


def load(path, template, num_updates, hint):
    """The checkpoint at `path` as host arrays shaped like `template` (a dict with an "update" count).
    Unreadable files, other runs' checkpoints (`hint`: which flags must match) and runs already at
    this run's last update are one error line."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = dict(f)
    except Exception as e:  # empty, truncated, random bytes, pickled
        fail(f"--resume {path!r} is not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})")
    names = flat(template)
    for name, like in names.items():
        got = arrays.get(name)
        if got is None or got.shape != like.shape or got.dtype != like.dtype:
            found = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            fail(f"--resume {path!r} does not match this run: {name} is {found}, expected "
                 f"{like.dtype}{list(like.shape)} ({hint})")
    tree = jax.tree.unflatten(jax.tree.structure(template), [arrays[name] for name in names])
    if tree["update"] >= num_updates:
        fail(f"--resume {path!r} is at update {int(tree['update'])}, the end of a {num_updates}-update run: "
             "raise --total-timesteps to go on")
    return tree


def on_disk(run):
    """What a stopping run leaves behind, said exactly."""
    if run.folder is None:
        return "process 0 writes this run's checkpoints"
    if not run.checkpoint.is_file():
        return f"no checkpoint was written yet ({run.folder} holds args.json and the metrics)"
    with np.load(run.checkpoint) as f:
        return f"the checkpoint {run.checkpoint} holds update {int(f['update'])}: go on with --resume {run.checkpoint}"


def close(run):
    if run.writer is not None:
        run.writer.close()


def exit_now(code, run):
    """Close the logs and end the process without the interpreter's shutdown, which could wait on a
    thread inside envpool or XLA, or on a dead peer (jax.distributed's shutdown barrier)."""
    close(run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stopped(signum, update, run):
    print(f"stopped by {signal.Signals(signum).name} after update {update}: {on_disk(run)}", flush=True)
    exit_now(128 + signum, run)


def check_finite(losses, update, run):
    """Stop the run (exit status 1) at a NaN or infinite loss, saying which checkpoint is on disk."""
    bad = {name: value for name, value in losses.items() if not math.isfinite(value)}
    if bad:
        print(f"error: non-finite loss at update {update} ({bad}); {on_disk(run)}", file=sys.stderr, flush=True)
        exit_now(1, run)


def lost_peer(error, run):
    """Multi-host: a collective failed, nearly always because another process died. One line, then exit:
    a normal exit would wait for the dead peer at jax.distributed's shutdown and abort 100 s later."""
    print(f"error: lost contact with another process of this {jax.process_count()}-process run "
          f"({str(error).splitlines()[0]}); {on_disk(run)} on every process", file=sys.stderr,
          flush=True)
    exit_now(1, run)


def watch_peers(run):
    """Multi-host: a collective whose peer died often fails at once (`lost_peer`), but it can also
    block until JAX's heartbeat aborts the process with a C++ stack. From the end of the first log
    interval on, a thread ends the run with one line when `beat` (called at each safe point) goes
    quiet for 3 times the longest interval so far, at least 60 s and at most 120 s."""
    beats = [0, time.monotonic(), 0.0]  # calls so far, time of the last one, longest interval

    def beat():
        now = time.monotonic()
        longest = max(beats[2], now - beats[1]) if beats[0] >= 1 else 0.0
        beats[:] = [beats[0] + 1, now, longest]

    def limit():
        return min(120.0, max(60.0, 3 * beats[2]))

    def watch():
        while beats[0] < 2 or time.monotonic() - beats[1] < limit():
            time.sleep(1)
        print(f"error: no progress for {limit():.0f} s in this {jax.process_count()}-process run: another process "
              f"has probably died; {on_disk(run)} on every process", file=sys.stderr, flush=True)
        exit_now(1, run)

    if jax.process_count() > 1:
        threading.Thread(target=watch, daemon=True).start()
    return beat


def duration(seconds):
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


def log(run, row, update, num_updates, total_steps, eta):
    """A metrics row (CleanRL's names) to metrics.jsonl and TensorBoard, and the progress line; process 0."""
    if run.folder is None:
        return
    with open(run.folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    for name, value in row.items():
        if "/" in name:
            run.writer.add_scalar(name, value, row["global_step"])
    step, ret = row["global_step"], row.get("charts/episodic_return")
    print(f"update {update}/{num_updates} | step {step:,}/{total_steps:,} ({step / total_steps:.0%}) | "
          f"SPS {row['charts/SPS']:,.0f} | return {'-' if ret is None else f'{ret:.2f}'} | ETA {duration(eta)}",
          flush=True)


def checksum(params):
    """sha256 of this host's copy of the parameters in key-path order: equal runs, equal hosts, equal sums."""
    digest = hashlib.sha256()
    for leaf in flat(params).values():
        digest.update(np.ascontiguousarray(leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf).tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------
# The run.


def main(args: Args) -> dict:
    caught = catch_stop_signals()
    args, env = check_args(args)
    start_distributed(args)
    layout = device_layout(args)
    pid, hosts = jax.process_index(), jax.process_count()
    threads_per_host = len(layout.actor_devices) * args.num_actor_threads
    check_seed(args.seed, 2**31 - threads_per_host * hosts * args.local_num_envs + 1)  # env i: seed + i
    # Each actor thread holds a rollout it collects, one in its queue and one being learned from.
    obs_bytes = np.prod(env.obs_shape) * (1 if env.atari else 4)
    check_fits(3 * threads_per_host * (args.num_steps + 1) * args.local_num_envs * obs_bytes,
               f"the rollouts of {threads_per_host} actor threads x --local-num-envs {args.local_num_envs}")
    steps_per_update = args.num_steps * args.local_num_envs * threads_per_host * hosts
    num_updates = args.total_timesteps // steps_per_update
    if num_updates < 1:
        fail(f"--total-timesteps {args.total_timesteps:,} is less than one update: {steps_per_update:,} steps")

    # The learner's state, replicated over the mesh (every host builds the same one from the seed).
    optimizer = make_optimizer(args, num_updates)
    key = jax.random.key(args.seed)

    def build():
        params = init_params(key, env.obs_shape, env.num_actions, args.network)
        return TrainState(params, optimizer.init(params))

    start_update = 0
    if args.resume:  # checked against this run's shapes before anything compiles
        template = {"state": jax.eval_shape(build), "update": np.int64(0), "global_step": np.int64(0),
                    "key": jax.random.key_data(key)}
        ckpt = load(args.resume, template, num_updates, "same --env-id and --network?")
        host_state, start_update, key = ckpt["state"], int(ckpt["update"]), jax.random.wrap_key_data(ckpt["key"])
    else:
        host_state = jax.device_get(build())
    run = open_run(args)
    replicated = NamedSharding(layout.mesh, P())
    state = jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), replicated, lambda i: np.asarray(x)[i]),
                         host_state)

    # Actor threads: each has its envs, a bounded queue to the learner and a seed of its own.
    store, stop, errors = ParamStore(layout.actor_devices), threading.Event(), []
    store.publish(state.params, start_update)
    queues, threads = [], []
    updates, actor_key = range(start_update + 1, num_updates + 1), jax.random.fold_in(key, start_update)
    for t in range(threads_per_host):
        index = pid * threads_per_host + t  # this thread across all hosts
        queues.append(queue.Queue(maxsize=1))
        thread_args = (args, env, store, stop, queues[-1], t // args.num_actor_threads, layout.learner_devices,
                       args.seed + index * args.local_num_envs, jax.random.fold_in(actor_key, index), updates)
        threads.append(threading.Thread(target=guarded, args=(run_actor, stop, errors, *thread_args),
                                        name=f"actor{t}", daemon=True))
        threads[-1].start()

    loop = Loop(make_learner(args, layout.mesh, optimizer), queues, store, stop,
                NamedSharding(layout.mesh, P(None, "devices")), caught, run, steps_per_update)
    try:
        state, update, row, signum = learner_loop(args, loop, state, key, start_update, num_updates)
    except jax.errors.JaxRuntimeError as e:
        if hosts == 1:
            raise
        lost_peer(e, run)
    except BaseException:  # a failed actor thread (Stopped) or the learner itself
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
        print("".join(errors) or traceback.format_exc(), file=sys.stderr, flush=True)
        exit_now(1, run)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    checkpoint(run, state, update, key, steps_per_update)
    if signum:
        stopped(signum, update, run)
    close(run)
    row["checksum"] = checksum(state.params)
    print(f"checksum {row['checksum']}", flush=True)
    return {**row, "run_dir": str(run.folder)}


if __name__ == "__main__":
    main(tyro.cli(Args))
