"""PPO in the Anakin architecture (Hessel et al. 2021, section 3) on environments written in JAX.

The envs are in JAX, so rollouts and PPO's epochs (Schulman et al. 2017) are one XLA program: `update` (one
agent's rollout and epochs on one device) is fori_looped over updates, vmapped over seeds, shard_mapped over devices:

    host (Python)      one call = `--log-every` updates of every seed, no return to Python between
    -------------      -----------------------------------------------------------------------------
                       device 0                            device 1  ...  (every host)
    init / resume -->  params, Adam state (one copy/seed)  params, Adam state (same copies)
                       envs 0..E-1 of each seed            envs E..2E-1 of each seed
                       loop over updates (vmap seeds):     loop over updates (vmap seeds):
                         rollout T steps, GAE                rollout T steps, GAE
                         epochs x minibatches (own data):    epochs x minibatches (own data):
                           normalise advantages                normalise advantages
                                <-- psum: mean, std of the minibatch on all devices -->
                           grads of the PPO loss               grads of the PPO loss
                                <------ pmean over "devices" (all hosts) ------>
                           Adam step (identical everywhere)    Adam step
    log, checkpoint <- episode returns (psum), losses (pmean), per seed

    python anakin_ppo.py
    python anakin_ppo.py --env-id Pendulum-v1 --num-seeds 8
    python anakin_ppo.py --num-envs-per-device 2048 --total-timesteps 50_000_000
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

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


@dataclass
class Args:
    env_id: str = "CartPole-v1"  # CartPole-v1 (discrete) or Pendulum-v1 (continuous)
    seed: int = 1  # agent i of --num-seeds draws from (seed, i)
    num_seeds: int = 1  # independent agents, side by side (vmap)
    total_timesteps: int | None = None  # env steps of one agent (None: CartPole-v1 500_000, Pendulum-v1 1_000_000)
    learning_rate: float | None = None  # Adam step size (None: CartPole-v1 2.5e-4, Pendulum-v1 1e-3)
    anneal_lr: bool = True  # decay the step size linearly to zero over the run
    num_envs_per_device: int | None = None  # envs per agent and device (None: CartPole-v1 4, Pendulum-v1 32)
    num_devices: int | None = None  # devices per host (None: all)
    num_steps: int | None = None  # rollout length (None: CartPole-v1 128, Pendulum-v1 128)
    update_epochs: int | None = None  # passes over each rollout (None: CartPole-v1 4, Pendulum-v1 10)
    num_minibatches: int | None = None  # minibatches per epoch on each device (None: CartPole-v1 4, Pendulum-v1 32)
    gamma: float | None = None  # discount (None: CartPole-v1 0.99, Pendulum-v1 0.95)
    gae_lambda: float = 0.95  # GAE's lambda
    clip_coef: float = 0.2  # PPO's ratio (and value) clip range
    clip_vloss: bool | None = None  # clip the value loss around old values (None: CartPole-v1 True, Pendulum-v1 False)
    ent_coef: float | None = None  # entropy bonus coefficient (None: CartPole-v1 0.01, Pendulum-v1 0.0)
    vf_coef: float = 0.5  # value loss coefficient
    max_grad_norm: float = 0.5  # global-norm gradient clip
    log_every: int = 50  # updates per compiled call and log line
    checkpoint_every: int = 500  # updates between checkpoints, taken at the next log line (and one at the end)
    # Read by the plumbing appendix only:
    exp_name: str = Path(__file__).stem  # part of the run folder's name
    run_dir: str = "runs"  # parent folder of run folders
    resume: str | None = None  # checkpoint.npz to continue from, with the same flags, up to --total-timesteps
    distributed: bool = False  # call jax.distributed.initialize() (multi-host)
    coordinator_address: str | None = None  # host:port of process 0 (JAX finds it on SLURM, Cloud TPU, Kubernetes)
    num_processes: int | None = None  # number of processes (multi-host)
    process_id: int | None = None  # this process's index (multi-host)
    peer_timeout: int = 300  # seconds to wait for all processes to join


# CartPole: CleanRL's. Pendulum: rl-zoo's, gamma 0.95 (a swing-up takes ~100 steps), no value clip.
DEFAULTS = {
    "CartPole-v1": dict(total_timesteps=500_000, learning_rate=2.5e-4, num_envs_per_device=4, num_steps=128,
                        update_epochs=4, num_minibatches=4, gamma=0.99, clip_vloss=True, ent_coef=0.01),
    "Pendulum-v1": dict(total_timesteps=1_000_000, learning_rate=1e-3, num_envs_per_device=32, num_steps=128,
                        update_epochs=10, num_minibatches=32, gamma=0.95, clip_vloss=False, ent_coef=0.0),
}


# ---- The environments: JAX copies of gymnasium 1.4's CartPole and Pendulum
# Bring your own: an `Env`; time limit and auto-reset are generic.

class Env(NamedTuple):
    reset: Callable  # key -> state, any pytree of arrays
    step: Callable  # (state, action) -> (state, reward, terminated), no time limit or reset
    observe: Callable  # state -> observation [obs_size] float32
    obs_size: int
    action_size: int  # actions, or the action's dimension if continuous
    continuous: bool
    max_steps: int  # then the episode is truncated, not terminated


# CartPole (Barto et al. 1983), gymnasium's constants and Euler steps.
GRAVITY, MASS_CART, MASS_POLE, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS, POLE_MOMENT = MASS_CART + MASS_POLE, MASS_POLE * HALF_LENGTH
THETA_LIMIT, X_LIMIT = 12 * 2 * math.pi / 360, 2.4


def cartpole_reset(key):
    return jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)  # x, x_dot, theta, theta_dot


def cartpole_step(state, action):
    x, x_dot, theta, theta_dot = state
    force = jnp.where(action == 1, FORCE, -FORCE)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + POLE_MOMENT * theta_dot**2 * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / TOTAL_MASS))
    x_acc = temp - POLE_MOMENT * theta_acc * cos / TOTAL_MASS
    state = jnp.stack([x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc])
    terminated = (jnp.abs(state[0]) > X_LIMIT) | (jnp.abs(state[2]) > THETA_LIMIT)
    return state, jnp.float32(1.0), terminated


# Pendulum: gymnasium's swing-up.
MAX_SPEED, MAX_TORQUE, DT, G = 8.0, 2.0, 0.05, 10.0  # mass and length are 1


def pendulum_reset(key):
    return jax.random.uniform(key, (2,), minval=jnp.array([-jnp.pi, -1.0]), maxval=jnp.array([jnp.pi, 1.0]))


def pendulum_step(state, action):
    theta, theta_dot = state
    u = jnp.clip(action[0], -MAX_TORQUE, MAX_TORQUE)
    angle = (theta + jnp.pi) % (2 * jnp.pi) - jnp.pi
    cost = angle**2 + 0.1 * theta_dot**2 + 0.001 * u**2
    theta_dot = jnp.clip(theta_dot + (3 * G / 2 * jnp.sin(theta) + 3.0 * u) * DT, -MAX_SPEED, MAX_SPEED)
    return jnp.stack([theta + theta_dot * DT, theta_dot]), -cost, jnp.bool_(False)


def pendulum_observe(state):
    return jnp.stack([jnp.cos(state[0]), jnp.sin(state[0]), state[1]])


ENVS = {
    "CartPole-v1": Env(reset=cartpole_reset, step=cartpole_step, observe=lambda state: state, obs_size=4,
                       action_size=2, continuous=False, max_steps=500),
    "Pendulum-v1": Env(reset=pendulum_reset, step=pendulum_step, observe=pendulum_observe, obs_size=3,
                       action_size=1, continuous=True, max_steps=200),
}


class EnvState(NamedTuple):
    inner: jax.Array  # the env's own state
    t: jax.Array  # steps in this episode
    ep_return: jax.Array  # of the episode so far


class Step(NamedTuple):
    obs: jax.Array  # what the agent sees next: a new episode's first obs if this one ended
    final_obs: jax.Array  # before any reset, to bootstrap from
    reward: jax.Array
    terminated: jax.Array  # a terminal state, of value zero
    truncated: jax.Array  # cut by the time limit
    ep_return: jax.Array  # of the episode that ended here, else 0
    ep_length: jax.Array


def env_reset(env, key):
    inner = env.reset(key)
    return EnvState(inner=inner, t=jnp.int32(0), ep_return=jnp.float32(0)), env.observe(inner)


def env_step(env, env_state, action, fresh):
    """Where an episode ends, go on from `fresh` = env_reset(env, key)."""
    inner, reward, terminated = env.step(env_state.inner, action)
    t, ep_return = env_state.t + 1, env_state.ep_return + reward
    truncated = t >= env.max_steps
    done = terminated | truncated
    final_obs = env.observe(inner)
    fresh_state, first_obs = fresh
    going_on = EnvState(inner=inner, t=t, ep_return=ep_return)
    env_state = jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh_state, going_on)
    step = Step(obs=jnp.where(done, first_obs, final_obs), final_obs=final_obs, reward=reward, terminated=terminated,
                truncated=truncated, ep_return=jnp.where(done, ep_return, 0.0), ep_length=jnp.where(done, t, 0))
    return env_state, step


# ---- The network: actor and critic MLPs (64, 64, tanh), CleanRL's initialisation

def init_mlp(rng, sizes, last_scale):
    """Orthogonal weights, zero biases; in NumPy, as XLA takes seconds to compile a QR."""
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        scale = last_scale if i == len(sizes) - 2 else math.sqrt(2)
        q, r = np.linalg.qr(rng.standard_normal((max(n_in, n_out), min(n_in, n_out))))
        q *= np.sign(np.diag(r))  # uniform over orthogonal matrices
        w = scale * (q if n_in >= n_out else q.T)
        params[f"layer{i}"] = {"w": w.astype(np.float32), "b": np.zeros(n_out, np.float32)}
    return params


def mlp(params, x):
    layers = list(params.values())
    for layer in layers[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


def init_params(rng, env, hidden=64):
    params = {"actor": init_mlp(rng, (env.obs_size, hidden, hidden, env.action_size), 0.01),
              "critic": init_mlp(rng, (env.obs_size, hidden, hidden, 1), 1.0)}
    if env.continuous:  # a state-independent learned log-std
        params["log_std"] = np.zeros(env.action_size, np.float32)
    return params


def apply(params, obs):
    """Logits or Gaussian mean [..., A], and value [...], of obs [..., O]."""
    return mlp(params["actor"], obs), mlp(params["critic"], obs)[..., 0]


# The policy: a diagonal Gaussian if the parameters hold a log-std, else categorical.

def draw_noise(key, params, shape):
    """`sample`'s randomness, drawn for many steps at once: [..., A]."""
    if "log_std" in params:
        return jax.random.normal(key, shape)
    return jax.random.gumbel(key, shape)


def sample(params, out, noise):
    if "log_std" in params:  # unclipped: the env clips
        return out + jnp.exp(params["log_std"]) * noise
    return jnp.argmax(out + noise, axis=-1)  # Gumbel-max: a draw from softmax(out)


def log_prob(params, out, action):
    if "log_std" in params:
        z = (action - out) * jnp.exp(-params["log_std"])
        return jnp.sum(-0.5 * z**2 - params["log_std"] - 0.5 * math.log(2 * math.pi), axis=-1)
    return jnp.take_along_axis(jax.nn.log_softmax(out), action[..., None], axis=-1)[..., 0]


def entropy(params, out):
    if "log_std" in params:
        return jnp.sum(jnp.broadcast_to(0.5 + 0.5 * math.log(2 * math.pi) + params["log_std"], out.shape), axis=-1)
    log_p = jax.nn.log_softmax(out)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


# ---- The loss: GAE (Schulman et al. 2016) and PPO's clipped objective (2017)

def gae(rewards, values, next_values, terminated, done, gamma, lam):
    """Advantages and value targets [T, B]. Only a termination zeroes the bootstrap `next_values`, not a
    time-limit cut (as many JAX PPOs do); any end (`done`) stops the lambda-chain."""
    deltas = rewards + gamma * next_values * (1.0 - terminated) - values

    def backward(adv_next, x):
        delta, d = x
        adv = delta + gamma * lam * (1.0 - d) * adv_next
        return adv, adv

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(deltas[0]), (deltas, done), reverse=True)
    return advantages, advantages + values


def policy_loss(new_log_prob, old_log_prob, advantages, clip_coef):
    """Clipped surrogate loss, approx. KL (Schulman's k3) and clip fraction."""
    log_ratio = new_log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    loss = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    approx_kl = ((ratio - 1) - log_ratio).mean()
    clipfrac = (jnp.abs(ratio - 1) > clip_coef).mean()
    return loss, approx_kl, clipfrac


def value_loss(new_values, old_values, targets, clip_coef, clip):
    loss = (new_values - targets) ** 2
    if clip:
        clipped = old_values + jnp.clip(new_values - old_values, -clip_coef, clip_coef)
        loss = jnp.maximum(loss, (clipped - targets) ** 2)
    return 0.5 * loss.mean()


class Batch(NamedTuple):
    """Leaves [N, ...]: one row a transition."""
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array


class Losses(NamedTuple):
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clipfrac: jax.Array


def normalize(advantages):
    """Over the minibatch's rows on all devices: per device, N devices would run another algorithm than
    one. Under `vmap`, a psum sums each seed's own."""
    n = jax.lax.psum(jnp.float32(advantages.size), "devices")
    mean = jax.lax.psum(advantages.sum(), "devices") / n
    var = jax.lax.psum(((advantages - mean) ** 2).sum(), "devices") / n
    return (advantages - mean) / (jnp.sqrt(var) + 1e-8)


def ppo_loss(params, batch, args):
    out, values = apply(params, batch.obs)
    adv = normalize(batch.advantage)
    pg_loss, approx_kl, clipfrac = policy_loss(log_prob(params, out, batch.action), batch.log_prob, adv, args.clip_coef)
    v_loss = value_loss(values, batch.value, batch.target, args.clip_coef, args.clip_vloss)
    ent = entropy(params, out).mean()
    loss = pg_loss - args.ent_coef * ent + args.vf_coef * v_loss
    return loss, Losses(policy_loss=pg_loss, value_loss=v_loss, entropy=ent, approx_kl=approx_kl, clipfrac=clipfrac)


# ---- Acting and learning on one device: the Anakin unit

class Trajectory(NamedTuple):
    """One agent's rollout on one device; leaves [T, E, ...]."""
    obs: jax.Array  # what the agent saw when it acted
    action: jax.Array
    log_prob: jax.Array  # under the acting policy
    step: Step


class TrainState(NamedTuple):
    """One agent, from update to update."""
    params: dict
    opt_state: optax.OptState
    env_state: EnvState  # leaves [E, ...]
    obs: jax.Array  # [E, O]
    key: jax.Array  # the same on every device, which folds in its index


class Stats(NamedTuple):
    """Summed over a call's updates."""
    losses: Losses  # means over minibatches and devices
    return_sum: jax.Array  # on all devices
    length_sum: jax.Array
    episodes: jax.Array


def make_optimizer(args):
    # `gradient_steps` applies the step size. Flat: a few kernels a step, not a few per array.
    return optax.flatten(optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.scale_by_adam(eps=1e-5)))


def learning_rate(args, num_updates, update_index):
    return args.learning_rate * (1.0 - update_index / num_updates if args.anneal_lr else 1.0)


def init_state(key, params, args, env, num_envs):
    k_envs, k_run = jax.random.split(key)
    env_state, obs = jax.vmap(lambda k: env_reset(env, k))(jax.random.split(k_envs, num_envs))
    return TrainState(params=params, opt_state=make_optimizer(args).init(params), env_state=env_state, obs=obs,
                      key=k_run)


def rollout(params, env_state, obs, k_act, k_reset, args, env):
    num_envs = obs.shape[0]
    # All randomness in two draws: action noise, and a new episode for each env and step.
    noise = draw_noise(k_act, params, (args.num_steps, num_envs, env.action_size))
    resets = jax.random.split(k_reset, (args.num_steps, num_envs))
    fresh = jax.vmap(jax.vmap(lambda k: env_reset(env, k)))(resets)

    def act_and_step(carry, x):
        env_state, obs = carry
        noise, fresh = x
        out = mlp(params["actor"], obs)  # the actor alone, which gives the old log-probs
        action = sample(params, out, noise)
        env_state, step = jax.vmap(lambda s, a, f: env_step(env, s, a, f))(env_state, action, fresh)
        traj = Trajectory(obs=obs, action=action, log_prob=log_prob(params, out, action), step=step)
        return (env_state, step.obs), traj

    (env_state, obs), traj = jax.lax.scan(act_and_step, (env_state, obs), (noise, fresh))
    return env_state, obs, traj


def permutations(key, num, n):
    """`num` permutations of range(n), [num, n]: a sort by `words` random uint32 keys, the row index in the
    last one's low bits. Ties would keep time order: 2 log2(n) + 32 random bits make them rarer than 2^-33."""
    bits = max(1, (n - 1).bit_length())
    words = 1 + -(-3 * bits // 32)  # ceil: 32 * words - bits >= 2 * bits + 32
    keys = list(jax.random.bits(key, (words, num, n)))
    keys[-1] = (keys[-1] << bits) | jnp.arange(n, dtype=jnp.uint32)
    return (jax.lax.sort(keys, num_keys=words)[-1] & ((1 << bits) - 1)).astype(jnp.int32)


def gradient_steps(params, opt_state, batch, key, lr, args):
    """Epochs of shuffled minibatches of `batch`, a step each, with all devices' mean gradient."""
    def sgd_step(carry, minibatch):
        params, opt_state = carry
        grads, losses = jax.grad(ppo_loss, has_aux=True)(params, minibatch, args)
        grads = jax.lax.pmean(grads, "devices")
        updates, opt_state = make_optimizer(args).update(grads, opt_state)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return (params, opt_state), losses

    n = len(batch.obs)
    order = permutations(key, args.update_epochs, n).reshape(-1)  # epoch after epoch
    minibatches = jax.tree.map(lambda x: x[order].reshape(-1, n // args.num_minibatches, *x.shape[1:]), batch)
    (params, opt_state), losses = jax.lax.scan(sgd_step, (params, opt_state), minibatches)
    return params, opt_state, losses


def update(state, lr, args, env):
    """One PPO update of one agent on one device."""
    key, k_device = jax.random.split(state.key)
    k_act, k_reset, k_perm = jax.random.split(jax.random.fold_in(k_device, jax.lax.axis_index("devices")), 3)
    env_state, obs, traj = rollout(state.params, state.env_state, state.obs, k_act, k_reset, args, env)
    # V(obs) and V(final_obs), [T, E] each, in one pass.
    values, next_values = mlp(state.params["critic"], jnp.stack([traj.obs, traj.step.final_obs]))[..., 0]
    done = (traj.step.terminated | traj.step.truncated).astype(jnp.float32)
    advantages, targets = gae(traj.step.reward, values, next_values, traj.step.terminated.astype(jnp.float32), done,
                              args.gamma, args.gae_lambda)
    batch = Batch(obs=traj.obs, action=traj.action, log_prob=traj.log_prob, value=values, advantage=advantages,
                  target=targets)
    batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)  # [T*E, ...]
    params, opt_state, losses = gradient_steps(state.params, state.opt_state, batch, k_perm, lr, args)
    stats = Stats(losses=jax.lax.pmean(jax.tree.map(jnp.mean, losses), "devices"),
                  return_sum=jax.lax.psum(traj.step.ep_return.sum(), "devices"),
                  length_sum=jax.lax.psum(traj.step.ep_length.sum(), "devices"),
                  episodes=jax.lax.psum(done.sum(), "devices"))
    return TrainState(params=params, opt_state=opt_state, env_state=env_state, obs=obs, key=key), stats


# ---- The device mapping: loop updates, vmap seeds, shard_map devices

# Leaves [seeds, (envs), ...]: parameters replicated, envs split.
STATE_SPECS = TrainState(params=P(), opt_state=P(), env_state=P(None, "devices"), obs=P(None, "devices"), key=P())


def make_train(args, env, mesh, num_updates):
    """Updates first..first + n - 1 of every seed, Stats summed; counts traced: one compilation."""
    def train(state, first, n):
        def one_update(i, carry):
            state, total = carry
            state, stats = update(state, learning_rate(args, num_updates, i), args, env)
            return state, jax.tree.map(jnp.add, total, stats)

        zero = jnp.float32(0)
        losses = Losses(policy_loss=zero, value_loss=zero, entropy=zero, approx_kl=zero, clipfrac=zero)
        zeros = Stats(losses=losses, return_sum=zero, length_sum=jnp.int32(0), episodes=zero)
        return jax.lax.fori_loop(first, first + n, one_update, (state, zeros))

    # check_vma=False: the body pmeans the replicated params' gradients; the check would sum them first
    sharded = jax.shard_map(jax.vmap(train, in_axes=(0, None, None)), mesh=mesh, in_specs=(STATE_SPECS, P(), P()),
                            out_specs=(STATE_SPECS, P()), check_vma=False)
    # LLVM -O1 on CPU: it compiles faster, runs as fast.
    options = {"xla_backend_optimization_level": 1} if jax.default_backend() == "cpu" else {}
    return jax.jit(sharded, donate_argnums=0, compiler_options=options)


def shardings(mesh):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), STATE_SPECS)


def init_on_mesh(args, env, mesh, num_envs):
    """Every seed's compiled init on the mesh, and its shapes."""
    keys = jax.random.split(jax.random.PRNGKey(args.seed), args.num_seeds)
    params = [init_params(np.random.default_rng([args.seed, i]), env) for i in range(args.num_seeds)]
    params = jax.tree.map(lambda *p: np.stack(p), *params)
    init = jax.jit(jax.vmap(lambda k, p: init_state(k, p, args, env, num_envs)), out_shardings=shardings(mesh))
    return lambda: init(keys, params), jax.eval_shape(init, keys, params)


def place(state, mesh):
    """A host TrainState (every host's envs) onto the mesh."""
    leaf_shardings = jax.tree.broadcast(shardings(mesh), state)
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), state, leaf_shardings)


def pick_devices(args):
    local = jax.local_devices()
    n = len(local) if args.num_devices is None else args.num_devices
    if not 1 <= n <= len(local):
        fail(f"--num-devices {n} is not possible: this host has {len(local)} device(s)")
    hosts = [[d for d in jax.devices() if d.process_index == p][:n] for p in range(jax.process_count())]
    return Mesh(np.array(hosts).reshape(-1), ("devices",))


# ---- The run

def check_args(args):
    """Every flag, before anything is compiled; None takes the env's DEFAULTS."""
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not available; this file defines: {', '.join(map(repr, ENVS))}")
    args = dataclasses.replace(args, **{k: v for k, v in DEFAULTS[args.env_id].items() if getattr(args, k) is None})
    check_flags(args, unit=("gamma", "gae_lambda"), positive=("learning_rate",))
    check_seed(args.seed, 2**32)
    rollout_size = args.num_steps * args.num_envs_per_device
    if rollout_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide the rollout on each device, "
             f"--num-steps x --num-envs-per-device = {rollout_size}")
    if rollout_size > 2**24:  # `permutations` packs row indices in 32 bits
        fail(f"--num-steps x --num-envs-per-device = {rollout_size} is more than 2**24 rows per device")
    return args


def initial_state(args, env, mesh, steps_per_update):
    """The TrainState's maker (fresh or --resume's), its shapes, the updates done."""
    if args.total_timesteps < steps_per_update:
        fail(f"--total-timesteps {args.total_timesteps:,} is less than one update: {steps_per_update:,} steps "
             f"(--num-steps {args.num_steps} x {args.num_envs_per_device} envs x {mesh.size} devices)")
    init, shapes = init_on_mesh(args, env, mesh, args.num_envs_per_device * mesh.size)
    if not args.resume:
        return init, shapes, 0
    template = {"state": shapes, "update": np.int64(0), "global_step": np.int64(0)}
    hint = f"here {args.num_envs_per_device} envs on each of {mesh.size} devices"
    ckpt = load(args, template, steps_per_update, hint)
    return partial(place, ckpt["state"], mesh), shapes, int(ckpt["update"])


def compile_train(args, env, mesh, shapes, start_update, num_updates, run):
    """Compiled ahead, out of SPS; refused if it cannot fit."""
    tic = time.time()
    lowered = make_train(args, env, mesh, num_updates).lower(shapes, np.int32(start_update), np.int32(args.log_every))
    train = lowered.compile()
    say(f"compiled in {time.time() - tic:.1f}s")
    used = train.memory_analysis()
    check_fits(used.temp_size_in_bytes + used.argument_size_in_bytes + used.output_size_in_bytes,
               f"--num-seeds {args.num_seeds} x --num-envs-per-device {args.num_envs_per_device}", mesh.local_devices,
               run)
    return train


def checkpoint(args, run, state, updates_done, steps_per_update):
    """All processes gather every host's envs, process 0 saves."""
    host = multihost_utils.process_allgather(state, tiled=True)
    save(run, {"state": host, "update": np.int64(updates_done),
               "global_step": np.int64(updates_done * steps_per_update)}, args)


def metrics_row(stats, n, lr, sps):
    """CleanRL's names; `stats` are sums over `n` updates, leaves [seeds]."""
    stats = jax.tree.map(np.asarray, stats)
    row = {"charts/SPS": sps, "charts/learning_rate": lr,
           **{f"losses/{name}": float(np.mean(value) / n) for name, value in stats.losses._asdict().items()}}
    if stats.episodes.min() > 0:  # every seed ended episodes
        returns = stats.return_sum / stats.episodes
        row.update({"charts/episodic_return": float(returns.mean()), "charts/episodic_return_min": float(returns.min()),
                    "charts/episodic_return_max": float(returns.max()),
                    "charts/episodic_length": float((stats.length_sum / stats.episodes).mean())})
        if len(returns) > 1:
            row.update({f"charts/episodic_return_seed{i}": float(r) for i, r in enumerate(returns)})
    return row


def main(args: Args) -> dict:
    caught = catch_stop_signals()
    args = check_args(args)
    env = ENVS[args.env_id]
    start_distributed(args, caught)
    mesh = pick_devices(args)
    steps_per_update = args.num_steps * args.num_envs_per_device * mesh.size
    num_updates = args.total_timesteps // steps_per_update
    make_state, shapes, start_update = initial_state(args, env, mesh, steps_per_update)
    run = open_run(args)
    train = compile_train(args, env, mesh, shapes, start_update, num_updates, run)
    state = make_state()
    updates_done, n, start_time, row = start_update, 0, time.time(), {}
    while updates_done < num_updates:
        due = updates_done // args.checkpoint_every > (updates_done - n) // args.checkpoint_every  # a multiple passed
        safe_point(caught, updates_done, run, partial(checkpoint, args, run, state, updates_done, steps_per_update),
                   due=due)
        n = min(args.log_every, num_updates - updates_done)
        tic = time.time()
        state, stats = train(state, np.int32(updates_done), np.int32(n))
        stats = jax.device_get(stats)  # waits for the call
        updates_done += n
        sps = n * steps_per_update * args.num_seeds / (time.time() - tic)
        lr = learning_rate(args, num_updates, updates_done - 1)  # of the call's last update
        row = {"global_step": updates_done * steps_per_update, "update": updates_done, **metrics_row(stats, n, lr, sps)}
        check_finite({name: value for name, value in row.items() if name.startswith("losses/")}, updates_done, run)
        eta = (time.time() - start_time) / (updates_done - start_update) * (num_updates - updates_done)
        log(run, row, num_updates, num_updates * steps_per_update, eta)
    safe_point(caught, updates_done, run, partial(checkpoint, args, run, state, updates_done, steps_per_update),
               due=True)
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
