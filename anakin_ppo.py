"""PPO (Schulman et al. 2017) in the Anakin architecture (Hessel et al. 2021, section 3).

The envs are in JAX, so rollouts and PPO's epochs are one XLA program:

    host (Python)      one call = `--log-every` updates of every seed
    -------------      ---------------------------------------------------------------------
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
                           Adam step                           Adam step
    log, checkpoint <- episode returns (psum), losses (pmean), per seed

In PyTorch terms: `vmap` runs a function written for one env (or agent) on a batch of them;
`shard_map` runs one on every device with its share of the data, as DDP runs a process per GPU;
`pmean` and `psum` over "devices" are DDP's all_reduce (a mean, a sum).
A pytree is any nesting of tuples, lists, dicts and NamedTuples of arrays: JAX acts on its leaves.

Reading order:
1. `Env`, `env_step`: a JAX env, its time limit, auto-reset and `final_obs`.
2. `gae`, `policy_loss`, `value_loss`, `ppo_loss`: the loss (add loss terms in `ppo_loss`).
3. `rollout`, `gradient_steps`, `update`: one agent's update on one device.
4. `make_train`: `update` looped over updates, vmapped over independent seeds (the colab vmaps env
   lanes; here `rollout` batches the envs), shard_mapped over devices; `STATE_SPECS` gives shapes.
5. `initial_state`, `main`: the run; skip the plumbing after it.

    python anakin_ppo.py
    python anakin_ppo.py --env-id Pendulum-v1 --num-seeds 8
    python anakin_ppo.py --num-envs-per-device 2048 --total-timesteps 50_000_000
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
from typing import Annotated, Callable, NamedTuple

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


def by_env(name):  # --help gives each env's value of the flag, from ENVS (below: read when tyro.cli runs)
    return tyro.conf.arg(help_behavior_hint=lambda _: "(default: " + ", ".join(
        f"{env_id} {env.defaults[name]}" for env_id, env in ENVS.items()) + ")")


@dataclasses.dataclass
class Args:
    env_id: str = "CartPole-v1"  # CartPole-v1 (discrete) or Pendulum-v1 (continuous)
    seed: int = 1  # agent i of --num-seeds draws all its randomness from (seed, i)
    num_seeds: int = 1  # independent agents, side by side (vmap)
    # Some defaults depend on the env: each Env in ENVS (below) holds them, check_args fills them.
    total_timesteps: Annotated[int | None, by_env("total_timesteps")] = None  # env steps of one agent
    learning_rate: Annotated[float | None, by_env("learning_rate")] = None  # Adam step size
    anneal_lr: bool = True  # the step size falls linearly to zero
    num_envs_per_device: Annotated[int | None, by_env("num_envs_per_device")] = None  # envs per agent and device
    num_devices: Annotated[int | None, tyro.conf.arg(help_behavior_hint="(default: all)")] = None  # per host
    num_steps: Annotated[int | None, by_env("num_steps")] = None  # rollout length
    update_epochs: Annotated[int | None, by_env("update_epochs")] = None  # passes over each rollout
    num_minibatches: Annotated[int | None, by_env("num_minibatches")] = None  # per epoch and device
    gamma: Annotated[float | None, by_env("gamma")] = None  # discount
    gae_lambda: float = 0.95  # GAE's lambda
    clip_coef: float = 0.2  # PPO's ratio (and value) clip range
    clip_vloss: Annotated[bool | None, by_env("clip_vloss")] = None  # clip the value loss
    ent_coef: Annotated[float | None, by_env("ent_coef")] = None  # entropy bonus
    vf_coef: float = 0.5  # value loss coefficient
    max_grad_norm: float = 0.5  # global-norm gradient clip
    log_every: int = 50  # updates per compiled call and log line
    checkpoint_every: int = 500  # updates between checkpoints
    # The plumbing section at the end of the file reads the flags below.
    exp_name: str = Path(__file__).stem  # in the run folder's name
    run_dir: str = "runs"  # parent folder of run folders
    resume: str | None = None  # a checkpoint.npz to continue
    distributed: bool = False  # call jax.distributed.initialize() (multi-host)
    coordinator_address: str | None = None  # host:port of process 0 (multi-host)
    num_processes: int | None = None  # processes in all (multi-host)
    process_id: int | None = None  # this process's index


# ---- The environments: JAX copies of gymnasium 1.4's CartPole and Pendulum
# Bring your own env as an `Env`: `env_step` adds the time limit, auto-reset and episode statistics.
# JAX has no global random state: each draw takes a key, and jax.random.split makes new keys.

class Env(NamedTuple):
    reset: Callable  # key -> state, any pytree of arrays
    step: Callable  # (state, action) -> (state, reward, terminated), no time limit
    observe: Callable  # state -> observation [obs_size] float32
    obs_size: int
    action_size: int  # actions, or the action's dimension if continuous
    continuous: bool  # Gaussian policy, else categorical
    max_steps: int  # then the episode is truncated, not terminated
    defaults: dict  # a value for every by_env flag, taken where it is left at None (check_args)


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
    state = jnp.stack([x + TAU * x_dot, x_dot + TAU * x_acc,
                       theta + TAU * theta_dot, theta_dot + TAU * theta_acc])
    terminated = (jnp.abs(state[0]) > X_LIMIT) | (jnp.abs(state[2]) > THETA_LIMIT)
    return state, jnp.float32(1.0), terminated


# Pendulum: gymnasium's swing-up.
MAX_SPEED, MAX_TORQUE, DT, G = 8.0, 2.0, 0.05, 10.0  # mass and length are 1


def pendulum_reset(key):
    return jax.random.uniform(key, (2,), minval=jnp.array([-jnp.pi, -1.0]),
                              maxval=jnp.array([jnp.pi, 1.0]))


def pendulum_step(state, action):
    theta, theta_dot = state
    u = jnp.clip(action[0], -MAX_TORQUE, MAX_TORQUE)
    angle = (theta + jnp.pi) % (2 * jnp.pi) - jnp.pi
    cost = angle**2 + 0.1 * theta_dot**2 + 0.001 * u**2
    theta_dot = theta_dot + (3 * G / 2 * jnp.sin(theta) + 3.0 * u) * DT
    theta_dot = jnp.clip(theta_dot, -MAX_SPEED, MAX_SPEED)
    return jnp.stack([theta + theta_dot * DT, theta_dot]), -cost, jnp.bool_(False)


def pendulum_observe(state):
    return jnp.stack([jnp.cos(state[0]), jnp.sin(state[0]), state[1]])


# Where the values come from. CartPole-v1: CleanRL's ppo.py. Pendulum-v1: the learning rate 1e-3
# (constant in the zoo, lowered by --anneal-lr here), 10 epochs and no entropy bonus are
# rl-baselines3-zoo's tuned PPO (hyperparams/ppo.yml), as are lambda 0.95 and clip 0.2, which
# CartPole shares. The rest are ours: gamma 0.95 (the zoo's: 0.9); 32 envs x 128 steps a device
# (the zoo's 4 envs x 1,024 steps make as many an update on one device); 32 minibatches of 128 rows
# (the zoo's: 64 of 64); no value clipping (as in the zoo); 1M steps (the zoo's 100k explore with
# gSDE, which this file does not have).
ENVS = {
    "CartPole-v1": Env(
        reset=cartpole_reset, step=cartpole_step, observe=lambda state: state, obs_size=4, action_size=2,
        continuous=False, max_steps=500,
        defaults=dict(total_timesteps=500_000, learning_rate=2.5e-4, num_envs_per_device=4, num_steps=128,
                      update_epochs=4, num_minibatches=4, gamma=0.99, clip_vloss=True, ent_coef=0.01)),
    "Pendulum-v1": Env(
        reset=pendulum_reset, step=pendulum_step, observe=pendulum_observe, obs_size=3, action_size=1,
        continuous=True, max_steps=200,
        defaults=dict(total_timesteps=1_000_000, learning_rate=1e-3, num_envs_per_device=32, num_steps=128,
                      update_epochs=10, num_minibatches=32, gamma=0.95, clip_vloss=False, ent_coef=0.0)),
}


class EnvState(NamedTuple):
    inner: jax.Array  # the env's own state
    t: jax.Array  # steps in this episode
    ep_return: jax.Array  # of the episode so far


class Outcome(NamedTuple):  # of one env step
    obs: jax.Array  # what the agent sees next: a new episode's if this one ended
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
    """One step of one env; where the episode ends, it goes on from `fresh`, an `env_reset`."""
    inner, reward, terminated = env.step(env_state.inner, action)
    t, ep_return = env_state.t + 1, env_state.ep_return + reward
    truncated = t >= env.max_steps
    done = terminated | truncated
    final_obs = env.observe(inner)
    fresh_state, first_obs = fresh
    going_on = EnvState(inner=inner, t=t, ep_return=ep_return)
    # jax.tree.map applies the function to each leaf (array).
    env_state = jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh_state, going_on)
    outcome = Outcome(obs=jnp.where(done, first_obs, final_obs), final_obs=final_obs, reward=reward,
                      terminated=terminated, truncated=truncated,
                      ep_return=jnp.where(done, ep_return, 0.0), ep_length=jnp.where(done, t, 0))
    return env_state, outcome


# ---- The network: actor and critic MLPs (64, 64, tanh), CleanRL's initialisation

def init_mlp(rng, sizes, last_scale):
    """Orthogonal weights, zero biases. NumPy draws them, as XLA would take seconds to compile a QR."""
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        scale = last_scale if i == len(sizes) - 2 else math.sqrt(2)
        q, r = np.linalg.qr(rng.standard_normal((max(n_in, n_out), min(n_in, n_out))))
        q *= np.sign(np.diag(r))  # uniform over orthogonal matrices
        w = scale * (q if n_in >= n_out else q.T)
        params[f"layer{i}"] = {"w": w.astype(np.float32), "b": np.zeros(n_out, np.float32)}
    return params


def mlp(params, x):
    # The layers in order, looked up by name: JAX rebuilds a dict with its keys sorted, and
    # "layer10" sorts before "layer2".
    layers = [params[f"layer{i}"] for i in range(len(params))]
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
    """Logits or Gaussian mean [..., A], and value [...], of obs [..., O]. Where a caller uses only
    one output (acting uses only the logits), XLA leaves the other network out of the program."""
    return mlp(params["actor"], obs), mlp(params["critic"], obs)[..., 0]


# ---- The policy: categorical, or a diagonal Gaussian over continuous actions

def draw_noise(env, key, shape):
    """`sample`'s randomness [..., A], drawn for a whole rollout at once."""
    return jax.random.normal(key, shape) if env.continuous else jax.random.gumbel(key, shape)


def sample(env, params, out, noise):
    if env.continuous:  # unclipped: the env clips it
        return out + jnp.exp(params["log_std"]) * noise
    return jnp.argmax(out + noise, axis=-1)  # the Gumbel-max trick: a draw from softmax(out)


def log_prob(env, params, out, action):
    if env.continuous:
        z = (action - out) * jnp.exp(-params["log_std"])
        return jnp.sum(-0.5 * z**2 - params["log_std"] - 0.5 * math.log(2 * math.pi), axis=-1)
    return jnp.take_along_axis(jax.nn.log_softmax(out), action[..., None], axis=-1)[..., 0]


def entropy(env, params, out):
    if env.continuous:
        per_dim = 0.5 + 0.5 * math.log(2 * math.pi) + params["log_std"]
        return jnp.sum(jnp.broadcast_to(per_dim, out.shape), axis=-1)
    log_p = jax.nn.log_softmax(out)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


# ---- The loss: GAE (Schulman et al. 2016) and PPO's clipped objective (2017)

def gae(rewards, values, next_values, terminated, done, gamma, lam):
    """Advantages and value targets [T, B]. Only a termination zeroes the next value; a time-limit
    cut bootstraps from it (many JAX PPOs treat a cut as a termination and zero it). Any episode
    end (`done`) stops the lambda-weighted sum from running into the next episode."""
    deltas = rewards + gamma * next_values * (1.0 - terminated) - values

    def backward(adv_next, x):
        delta, d = x
        adv = delta + gamma * lam * (1.0 - d) * adv_next
        return adv, adv

    # jax.lax.scan, a compiled loop, calls `backward` on each row, last first, carrying `adv_next`
    # and stacking the outputs.
    _, advantages = jax.lax.scan(backward, jnp.zeros_like(deltas[0]), (deltas, done), reverse=True)
    return advantages, advantages + values


def policy_loss(new_log_prob, old_log_prob, advantages, clip_coef):
    """Clipped surrogate loss, approx. KL (Schulman's k3) and clip fraction."""
    log_ratio = new_log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef)
    loss = jnp.maximum(-advantages * ratio, -advantages * clipped).mean()
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
    old_log_prob: jax.Array
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
    """Normalise over the minibatch's rows on all devices, so that N devices of E envs run the
    algorithm of one device of N x E envs. "devices" is the mesh axis (`pick_devices`) that
    `make_train`'s shard_map binds, so psum over it runs only inside that call; under the vmap over
    seeds, psum(x, "devices") sums x over the devices for each seed apart."""
    n = jax.lax.psum(jnp.float32(advantages.size), "devices")
    mean = jax.lax.psum(advantages.sum(), "devices") / n
    var = jax.lax.psum(((advantages - mean) ** 2).sum(), "devices") / n
    return (advantages - mean) / (jnp.sqrt(var) + 1e-8)


def ppo_loss(params, minibatch, args, env):
    """The loss of one minibatch, on one device, for one seed. A loss term goes here. Each
    device's loss is a mean over its own rows, and `gradient_steps` pmeans the gradients over
    devices, which hold as many rows each: a term that is a `.mean()` over the rows, as each term
    here is, trains on the mean over all rows of all devices of all hosts. A term of the parameters
    alone (an L2 penalty) is the same on every device: the pmean counts it once, so it is right as
    written. The Sebulba scripts instead psum the gradients of each learner's share, a sum over its
    own samples: a loss moved there that keeps its `.mean()` gets L (learners) times the gradient,
    and a term of the parameters alone is counted once per learner."""
    out, values = apply(params, minibatch.obs)
    adv = normalize(minibatch.advantage)
    new_log_prob = log_prob(env, params, out, minibatch.action)
    pg_loss, approx_kl, clipfrac = policy_loss(new_log_prob, minibatch.old_log_prob, adv, args.clip_coef)
    v_loss = value_loss(values, minibatch.value, minibatch.target, args.clip_coef, args.clip_vloss)
    ent = entropy(env, params, out).mean()
    loss = pg_loss - args.ent_coef * ent + args.vf_coef * v_loss
    return loss, Losses(pg_loss, v_loss, ent, approx_kl, clipfrac)


# ---- Acting and learning on one device

class Trajectory(NamedTuple):
    """One agent's rollout on one device; leaves [T, E, ...]."""
    obs: jax.Array  # what the agent saw when it acted
    action: jax.Array
    old_log_prob: jax.Array  # under the policy that acted
    outcome: Outcome


class TrainState(NamedTuple):
    """One agent's (one seed's) state on one device. `make_train` vmaps over the seeds, so the state
    held between calls has a leading axis of seeds: `STATE_SPECS` gives the shapes at each level."""
    params: dict
    opt_state: optax.OptState
    env_state: EnvState  # leaves [E, ...]
    obs: jax.Array  # [E, O]
    key: jax.Array  # the same on every device; `update` folds in the device's index


class Stats(NamedTuple):
    """Sums over one call's updates."""
    losses: Losses  # each a mean over minibatches and devices
    return_sum: jax.Array  # of the episodes ended on all devices
    length_sum: jax.Array
    episodes: jax.Array


def learning_rate_at(args, num_updates, update_index):
    return args.learning_rate * (1.0 - update_index / num_updates if args.anneal_lr else 1.0)


def make_optimizer(args, num_updates):
    """Adam on the clipped gradient, flattened into one vector: a few XLA kernels a step, not a few
    per array, which trains CartPole 1.4x faster."""
    minibatches_per_update = args.update_epochs * args.num_minibatches
    # optax counts gradient steps; the learning rate changes once an update.
    schedule = lambda count: learning_rate_at(args, num_updates, count // minibatches_per_update)
    adam = optax.adam(schedule, eps=1e-5)
    return optax.flatten(optax.chain(optax.clip_by_global_norm(args.max_grad_norm), adam))


def init_state(key, params, args, env, num_envs):
    k_envs, k_run = jax.random.split(key)
    # jax.vmap runs a function of one env on many: each array gains a leading axis, a row per env.
    env_state, obs = jax.vmap(partial(env_reset, env))(jax.random.split(k_envs, num_envs))
    # Adam's initial state (step count, zero moments) does not depend on the schedule: any
    # num_updates will do.
    opt_state = make_optimizer(args, num_updates=1).init(params)
    return TrainState(params=params, opt_state=opt_state, env_state=env_state, obs=obs, key=k_run)


def rollout(params, env_state, obs, k_act, k_reset, args, env):
    num_envs = obs.shape[0]
    # Every env draws a fresh episode each step, used where one ended: under vmap, a reset only
    # where needed would run for all envs anyway.
    noise = draw_noise(env, k_act, (args.num_steps, num_envs, env.action_size))
    resets = jax.random.split(k_reset, (args.num_steps, num_envs))
    fresh = jax.vmap(jax.vmap(partial(env_reset, env)))(resets)

    def act_and_step(carry, x):
        env_state, obs = carry
        noise, fresh = x
        out, _ = apply(params, obs)  # values come in one pass after the rollout
        action = sample(env, params, out, noise)
        env_state, outcome = jax.vmap(partial(env_step, env))(env_state, action, fresh)
        old_log_prob = log_prob(env, params, out, action)
        traj = Trajectory(obs=obs, action=action, old_log_prob=old_log_prob, outcome=outcome)
        return (env_state, outcome.obs), traj

    (env_state, obs), traj = jax.lax.scan(act_and_step, (env_state, obs), (noise, fresh))
    return env_state, obs, traj


def gradient_steps(params, opt_state, batch, key, optimizer, args, env):
    """Epochs of shuffled minibatches, a step each on the devices' mean gradient."""
    def gradient_step(carry, minibatch):
        params, opt_state = carry
        grads, losses = jax.grad(ppo_loss, has_aux=True)(params, minibatch, args, env)
        grads = jax.lax.pmean(grads, "devices")  # the devices' mean: all take the same Adam step
        changes, opt_state = optimizer.update(grads, opt_state)
        return (optax.apply_updates(params, changes), opt_state), losses

    rows = len(batch.obs)
    keys = jax.random.split(key, args.update_epochs)
    order = jax.vmap(jax.random.permutation, (0, None))(keys, rows).reshape(-1)  # epoch after epoch
    size = rows // args.num_minibatches
    minibatches = jax.tree.map(lambda x: x[order].reshape(-1, size, *x.shape[1:]), batch)
    (params, opt_state), losses = jax.lax.scan(gradient_step, (params, opt_state), minibatches)
    return params, opt_state, losses


def update(state, optimizer, args, env):
    """One PPO update of one agent on one device."""
    key, k_device = jax.random.split(state.key)
    k_device = jax.random.fold_in(k_device, jax.lax.axis_index("devices"))
    k_act, k_reset, k_shuffle = jax.random.split(k_device, 3)
    params, opt_state, env_state, obs, _ = state
    env_state, obs, traj = rollout(params, env_state, obs, k_act, k_reset, args, env)
    outcome = traj.outcome
    # V(obs) and V(final_obs), [T, E] each, in one pass.
    _, (values, next_values) = apply(params, jnp.stack([traj.obs, outcome.final_obs]))
    done = (outcome.terminated | outcome.truncated).astype(jnp.float32)
    terminated = outcome.terminated.astype(jnp.float32)
    advantages, targets = gae(outcome.reward, values, next_values, terminated, done, args.gamma, args.gae_lambda)
    batch = Batch(obs=traj.obs, action=traj.action, old_log_prob=traj.old_log_prob, value=values,
                  advantage=advantages, target=targets)
    batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)  # [T*E, ...]
    params, opt_state, losses = gradient_steps(params, opt_state, batch, k_shuffle, optimizer, args, env)
    stats = Stats(losses=jax.lax.pmean(jax.tree.map(jnp.mean, losses), "devices"),
                  return_sum=jax.lax.psum(outcome.ep_return.sum(), "devices"),
                  length_sum=jax.lax.psum(outcome.ep_length.sum(), "devices"),
                  episodes=jax.lax.psum(done.sum(), "devices"))
    return TrainState(params, opt_state, env_state, obs, key), stats


# ---- The device mapping: loop updates, vmap seeds, shard_map devices

# shard_map's specs (see `make_train`), one for each TrainState field, each covering the field's
# whole subtree: P() for `params` stands for every weight array in it (for `opt_state`, every Adam
# moment). As an input spec, P() gives each device the whole array, and P(None, "devices") splits
# each leaf's axis 1 over the mesh axis "devices". PureJaxRL trains seeds side by side with
# jit(vmap(train)); this file also splits each seed's envs over the devices, with
# jit(shard_map(vmap(train))). A leaf's leading axes at each level, for S seeds (--num-seeds),
# N devices on all hosts and E envs a device:
#   between calls:          params, opt_state [S, ...]   env_state, obs [S, N x E, ...]   key [S, 2]
#   on one device:          params, opt_state [S, ...]   env_state, obs [S, E, ...]       key [S, 2]
#   one agent (`update`):   params, opt_state [...]      env_state, obs [E, ...]          key [2]
STATE_SPECS = TrainState(params=P(), opt_state=P(), env_state=P(None, "devices"), obs=P(None, "devices"),
                         key=P())


def make_train(args, env, mesh, num_updates):
    """`train` runs `n` updates of one agent; vmapped over the seeds, it is one device's work, the
    paper's minimal unit, which shard_map runs on every device. `n` is an argument, so a shorter
    last call needs no new compilation."""
    optimizer = make_optimizer(args, num_updates)

    def train(state, n):
        def one_update(_, carry):
            state, total = carry
            state, stats = update(state, optimizer, args, env)
            return state, jax.tree.map(jnp.add, total, stats)

        zero = jnp.float32(0)
        losses = Losses(*[zero] * len(Losses._fields))
        zeros = Stats(losses=losses, return_sum=zero, length_sum=jnp.int32(0), episodes=zero)
        return jax.lax.fori_loop(0, n, one_update, (state, zeros))

    # shard_map runs the vmapped `train` on each device with its share of the inputs (in_specs) and
    # joins the devices' results into the outputs (out_specs). The vmap gives `train` one seed's
    # agent, and the same `n` to all; under it, pmean and psum over "devices" reduce each seed's
    # values over the devices, never across seeds. In out_specs, P() is a promise that every device
    # holds the same value (the params, kept equal by the pmean, and the stats, reduced over
    # devices), so JAX returns device 0's copy.
    # check_vma=False (vma, "varying manual axes": JAX's record of which values differ by device).
    # With it on, jax.grad would itself sum the gradients over devices, N times their mean (DDP's
    # backward() averages them); off, the pmean in `gradient_steps` is the one all-reduce of them.
    sharded = jax.shard_map(jax.vmap(train, in_axes=(0, None)), mesh=mesh, in_specs=(STATE_SPECS, P()),
                            out_specs=(STATE_SPECS, P()), check_vma=False)
    # On the CPU, LLVM's -O1 compiles this program 2-3x faster than its default -O2; it runs as fast.
    options = {"xla_backend_optimization_level": 1} if jax.default_backend() == "cpu" else {}
    # donate_argnums=0 lets XLA reuse the old state's memory for the new: the caller never reads it.
    return jax.jit(sharded, donate_argnums=0, compiler_options=options)


def pick_devices(args):
    """The first --num-devices of every host, on one mesh axis named "devices"."""
    local = jax.local_devices()
    per_host = len(local) if args.num_devices is None else args.num_devices
    if not 1 <= per_host <= len(local):
        fail(f"--num-devices {per_host} is not possible: this host has {len(local)} device(s)")
    hosts = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    return Mesh(np.array([d for host in hosts for d in host[:per_host]]), ("devices",))


# ---- The run: its state and log, then main

def initial_state(args, env, mesh, num_envs):
    """Every seed's TrainState on the mesh, fresh or resumed, and the number of updates done."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), STATE_SPECS)
    keys = jax.random.split(jax.random.PRNGKey(args.seed), args.num_seeds)
    params = [init_params(np.random.default_rng([args.seed, i]), env) for i in range(args.num_seeds)]
    params = jax.tree.map(lambda *p: np.stack(p), *params)  # [seeds, ...]
    init = partial(init_state, args=args, env=env, num_envs=num_envs)
    init = jax.jit(jax.vmap(init), out_shardings=shardings)
    if not args.resume:
        return init(keys, params), 0
    shapes = jax.eval_shape(init, keys, params)
    ckpt = load(args, {"state": shapes, "update": np.int64(0), "global_step": np.int64(0)})
    return jax.device_put(ckpt["state"], shardings), int(ckpt["update"])


def checkpoint(state, updates_done, steps_per_update):
    """Every process calls this, as each holds only its own devices' envs."""
    return {"state": multihost_utils.process_allgather(state, tiled=True),
            "update": np.int64(updates_done), "global_step": np.int64(updates_done * steps_per_update)}


def metrics_row(stats, n, lr):
    """CleanRL's names; `stats` are sums over `n` updates, leaves [seeds]."""
    stats = jax.tree.map(np.asarray, stats)
    row = {"charts/learning_rate": lr}
    row.update({f"losses/{name}": float(np.mean(x) / n) for name, x in stats.losses._asdict().items()})
    if stats.episodes.min() > 0:  # every seed ended episodes
        returns = stats.return_sum / stats.episodes
        row.update({"charts/episodic_return": float(returns.mean()),
                    "charts/episodic_return_min": float(returns.min()),
                    "charts/episodic_return_max": float(returns.max()),
                    "charts/episodic_length": float((stats.length_sum / stats.episodes).mean())})
        if len(returns) > 1:
            row.update({f"charts/episodic_return_seed{i}": float(r) for i, r in enumerate(returns)})
    return row


def check_args(args):
    """Flags left at None take the env's defaults; then the script's own constraints."""
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not available; this file defines {', '.join(map(repr, ENVS))}")
    defaults = ENVS[args.env_id].defaults
    args = dataclasses.replace(args, **{k: v for k, v in defaults.items() if getattr(args, k) is None})
    rollout_size = args.num_steps * args.num_envs_per_device
    if rollout_size % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} must divide the rollout on each device, "
             f"--num-steps x --num-envs-per-device = {rollout_size}")
    if args.max_grad_norm <= 0:
        fail(f"--max-grad-norm {args.max_grad_norm} must be above 0: clipped to 0, nothing trains")
    return args


def main(args: Args) -> dict:
    start(args)
    args = check_args(args)
    env = ENVS[args.env_id]
    mesh = pick_devices(args)
    num_envs = args.num_envs_per_device * mesh.size  # of one agent, all hosts'
    steps_per_update = args.num_steps * num_envs
    if not 0 < steps_per_update <= args.total_timesteps:
        fail(f"--total-timesteps {args.total_timesteps:,} is less than one update: {steps_per_update:,} steps "
             f"(--num-steps {args.num_steps} x {args.num_envs_per_device} envs x {mesh.size} devices)")
    num_updates = args.total_timesteps // steps_per_update
    state, updates_done = initial_state(args, env, mesh, num_envs)
    if updates_done >= num_updates:
        fail(f"--resume {args.resume}: its run has done all {num_updates} updates (raise --total-timesteps)")
    train = make_train(args, env, mesh, num_updates)
    train = train.lower(state, np.int32(0)).compile()  # before the clock starts
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
               "charts/SPS": n * steps_per_update * args.num_seeds / (time.time() - tic),
               **metrics_row(stats, n, learning_rate_at(args, num_updates, updates_done - 1))}
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
