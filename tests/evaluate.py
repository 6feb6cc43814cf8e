"""Score and watch a trained agent: whole games played with the policy of a run's checkpoint.npz.

usage: python tests/evaluate.py CHECKPOINT [--episodes N] [--num-envs E] [--greedy] [--seed S] [--agent I]
                                           [--gif FILE] [--gif-every K] [--allow-import MODULE]

A checkpoint records its run's flags, and their names are the fields of one script's `Args`: that
says which of the four scripts wrote it. That script's own pieces then play, loaded by the test
harness: its environment with the run's flags (Catch and the JAX CartPole and Pendulum, or the
envpool and gymnasium envs of the Sebulba scripts, Atari with its training protocol), its network
and its action sampling (as trained; --greedy: the arg-max action, or the Gaussian's mean). E envs
(--num-envs) play N whole games (Atari: every life, the unclipped score): an env whose game ends starts
the next until N have started, and every game started is played to its end, so that short games are
not favoured. A progress line comes every few seconds; then the mean, std, min and max of the scores
and lengths (agent steps). Ctrl-C stops at once with the figures of the games played so far (exit 130).

    python tests/evaluate.py runs/Catch__anakin_catch__1__1700000000/checkpoint.npz --greedy
    python tests/evaluate.py runs/Pong-v5__sebulba_impala__1__1700000000/checkpoint.npz --gif pong.gif

--gif writes the first game as an animated GIF, one frame per agent step at about the game's speed:
Atari in envpool's colour (from a twin of the first env: same seed, same actions, so the same game),
MinAtar's channels in colour, the boards of Catch the agent acted on, CartPole's cart and pole,
Pendulum's pendulum (drawn from the observations; other vector envs have no picture).
--gif-every K keeps every K-th step, to keep a long game's GIF small.
--agent picks one agent of an `anakin_ppo.py --num-seeds N` run (default: the first).
A checkpoint is data: the module of a recorded `--env-id module:Name` is imported (its code run) only if
this repository ships it (tests.minatar_envs) or --allow-import names it.
"""

import argparse
import dataclasses
import itertools
import json
import os
import select
import signal
import sys
import threading
import time
import types
import typing
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import envpool
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from matplotlib import colormaps
from PIL import Image, ImageDraw

from conftest import ROOT, load

sys.path.insert(0, str(ROOT))  # gymnasium ids such as tests.minatar_envs:MinAtar/Breakout-v1 import from here
SCRIPTS = ("anakin_catch.py", "anakin_ppo.py", "sebulba_impala.py", "sebulba_ppo_atari.py")
SHIPPED = ("tests.minatar_envs",)  # the modules of this repository that a recorded env id may import
PROGRESS_SECONDS = 2  # between progress lines
# Memory an env takes, measured here: an envpool Atari env about 1.2 MB (the host envs' largest; CartPole's
# about 8 KB), a JAX env (Catch, CartPole, Pendulum) far less than the 10 KB counted for it.
HOST_ENV_BYTES, JAX_ENV_BYTES = 1_300_000, 10_000
GAME_BYTES = 16  # a game's score and length, kept to the end


class Outcome(NamedTuple):
    """One step of every env, [E] each."""
    score: np.ndarray  # the game's own reward (Atari: unclipped)
    counted: np.ndarray  # a step of the game, not an env's reset step after a lost life
    over: np.ndarray  # the whole game ended at this step


class Game(NamedTuple):
    """E envs of a script with the checkpoint's policy."""
    carry: object  # what the next step starts from
    step: Callable  # carry -> (carry, Outcome)
    shown: Callable  # carry -> env 0's observation now


class Evaluation(NamedTuple):
    scores: np.ndarray  # [N] whole-game scores
    lengths: np.ndarray  # [N] agent steps of each game
    seconds: float  # playing them, compilation included
    frames: list  # env 0's pictures, one a step of its game (--gif only)


class Tally:
    """The games ended so far, as (score, length): the main thread appends, the reporting thread reads."""

    def __init__(self, total):
        self.total, self.games, self.start = total, [], None  # start: when play began


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# ---- The checkpoint: which script, its flags, the policy's parameters ------------------------

def read_checkpoint(path):
    """Its arrays (the flags' JSON string popped off) and the run's flags."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = dict(f)
    except Exception as e:  # missing, empty, truncated, random bytes, pickled
        fail(f"{path} is not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})")
    try:
        flags = json.loads(str(arrays.pop("args")))
    except (KeyError, ValueError):
        flags = None
    if not isinstance(flags, dict):
        fail(f"{path} records no flags (a checkpoint.npz of {', '.join(SCRIPTS)} holds its run's as `args`)")
    return arrays, flags


def check_imports(path, flags, allowed):
    """Whoever wrote the file chose its env id: a `module:Name` one would run that module's code."""
    module = str(flags.get("env_id")).rpartition(":")[0]
    if module and module not in (*SHIPPED, *allowed):
        fail(f"{path} records --env-id {flags['env_id']!r}, which imports module {module!r} (runs its code): "
             f"add --allow-import {module} if you trust it")


def identify(path, flags):
    """The script whose `Args` has exactly these flags, each of the type its field says, as a module, and the
    run's Args."""
    for script in SCRIPTS:
        module = load(script)
        if {field.name for field in dataclasses.fields(module.Args)} == set(flags):
            for name, hint in typing.get_type_hints(module.Args).items():
                if not of_type(flags[name], hint):
                    fail(f"{path} records --{name.replace('_', '-')} {json.dumps(flags[name])}, which is not "
                         f"{typing_name(hint)} (a damaged or edited file?)")
            return script, module, module.Args(**flags)
    fail(f"{path}: its flags are those of none of {', '.join(SCRIPTS)} (another program's file, or another "
         "version's?)")


def of_type(value, hint):
    """Whether a JSON value is of an `Args` field's type: int, float, bool, str, list[...], Literal[...], X | None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(of_type(value, member) for member in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return type(value) is list and all(of_type(item, typing.get_args(hint)[0]) for item in value)
    if hint is float:  # JSON writes a whole float such as 1e6 as 1000000.0, but a person may write 1000000
        return type(value) in (int, float)
    return type(value) is hint  # a bool is not an int here, nor null a string


def typing_name(hint):
    """As `Args` writes the type: int, str | None, list[int] | None."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("NoneType", "None")


def state_template(script, module, args):
    """The run's flags, checked by the script itself, and the shapes of the TrainState its init makes
    (Anakin: with one env on one device, as only the envs' leaves depend on the layout)."""
    args = dataclasses.replace(args, resume=None)  # the file it was resumed from need not exist any more
    one_device = Mesh(np.array(jax.devices()[:1]), ("devices",))
    if script == "anakin_catch.py":
        return args, module.initial_state(args, one_device, 1)[0]
    if script == "anakin_ppo.py":
        args = module.check_args(args)
        return args, module.initial_state(args, module.ENVS[args.env_id], one_device, 1)[0]
    args, env = module.check_args(args)
    return args, jax.eval_shape(partial(module.init_state, jax.random.PRNGKey(args.seed), args, env, 1))


def check_memory(script, opts):
    """Refuse envs and games that cannot fit in this host's memory: the envs are made before the first game."""
    env_bytes = JAX_ENV_BYTES if script.startswith("anakin") else HOST_ENV_BYTES
    needed = opts.num_envs * env_bytes + opts.episodes * GAME_BYTES
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        fail(f"--num-envs {opts.num_envs:,} and --episodes {opts.episodes:,} would need {needed / 2**30:,.1f} GiB, "
             f"more than the {memory / 2**30:,.1f} GiB here")


def read_params(path, script, module, arrays, template):
    """The parameters, named as the script's `save` names them, unflattened as its `load` does."""
    names = {f"state/params/{name}": like for name, like in module.flat(template.params).items()}
    for name, like in names.items():
        got = arrays.get(name)
        if got is None or got.shape != like.shape or got.dtype != like.dtype:
            found = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            fail(f"{path} does not match {script}'s network for its flags: {name} is {found}, expected "
                 f"{like.dtype}{list(like.shape)}")
    return jax.tree.unflatten(jax.tree.structure(template.params), [arrays[name] for name in names])


def pick_agent(path, script, args, params, agent):
    """anakin_ppo.py's parameters have a leading axis of --num-seeds agents; the others hold one agent."""
    agents = args.num_seeds if script == "anakin_ppo.py" else 1
    if not 0 <= agent < agents:
        fail(f"--agent {agent}: this checkpoint holds {agents} agent(s), 0..{agents - 1}")
    if script == "anakin_ppo.py":
        params = jax.tree.map(lambda x: x[agent], params)
    if not all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params)):
        fail(f"{path}: this agent's parameters are not finite: its run diverged")
    return jax.device_put(params)


# ---- Each script's envs and acting, E envs at once -------------------------------------------

def catch_game(module, args, params, opts):
    """Catch in JAX with the script's own rollout, one step a call: epsilon-greedy as trained, or with
    epsilon 0 (--greedy). Carries the script's Lanes, one an env."""
    args = dataclasses.replace(args, num_steps=1, epsilon=0.0 if opts.greedy else args.epsilon)
    rollout = jax.jit(jax.vmap(lambda lane: module.rollout(params, lane, args)[:2]))
    counted = np.ones(opts.num_envs, bool)

    def step(lanes):
        lanes, traj = rollout(lanes)  # traj: [N, 1] leaves
        return lanes, Outcome(np.asarray(traj.reward[:, 0]), counted, np.asarray(traj.done[:, 0]))

    first_board = lambda lanes: module.observe(jax.tree.map(lambda x: x[0], lanes.env))
    lanes = module.init_state(jax.random.PRNGKey(opts.seed), args, opts.num_envs).lanes
    return Game(lanes, step, first_board)


def anakin_ppo_game(module, args, params, opts):
    """The file's JAX env with its time limit, and the script's `sample` (with zero noise under --greedy:
    the arg-max, or the Gaussian's mean). Carries the script's TrainState of N envs."""
    env, counted = module.ENVS[args.env_id], np.ones(opts.num_envs, bool)

    @jax.jit
    def step_on_device(state):
        key, k_act, k_reset = jax.random.split(state.key, 3)
        out, _ = module.apply(params, state.obs)
        noise = module.draw_noise(env, k_act, out.shape)
        action = module.sample(env, params, out, jnp.zeros_like(noise) if opts.greedy else noise)
        fresh = jax.vmap(lambda k: module.env_reset(env, k))(jax.random.split(k_reset, opts.num_envs))
        env_state, ended = jax.vmap(partial(module.env_step, env))(state.env_state, action, fresh)
        return state._replace(env_state=env_state, obs=ended.obs, key=key), ended

    def step(state):
        state, ended = step_on_device(state)
        over = np.asarray(ended.terminated | ended.truncated)
        return state, Outcome(np.asarray(ended.reward), counted, over)

    state = module.init_state(jax.random.PRNGKey(opts.seed), params, args, env, opts.num_envs)
    return Game(state, step, lambda state: state.obs[0])


class Acting(NamedTuple):
    """What a Sebulba step starts from."""
    obs: np.ndarray  # [N, *obs_shape]
    key: jax.Array
    ended: np.ndarray  # [N] obs is an episode's last: the next step is the env's reset step
    colour: np.ndarray | None  # [1, 3, 210, 160] the frame of env 0's twin in colour (Atari, --gif)


def sebulba_game(module, args, params, opts):
    """The script's envs (make_envs, env_reset, env_send, env_recv) and its `act`, or the arg-max of its `apply`.
    For a GIF of Atari, a twin of env 0 in colour: the same game (same seed, same actions), other frames."""
    envs, twin = module.make_envs(args, opts.num_envs, list(range(opts.seed, opts.seed + opts.num_envs))), None
    if opts.gif and envs.env_info.atari:
        twin = envpool.make(args.env_id, env_type="gymnasium", num_envs=1, seed=opts.seed, gray_scale=False,
                            img_height=210, img_width=160, stack_num=1, **module.atari_kwargs(args.machado))
    network = {"network": args.network} if hasattr(args, "network") else {}  # sebulba_impala's apply takes it
    argmax = jax.jit(lambda params, obs, key: (jnp.argmax(module.apply(params, obs, **network)[0], -1), key))
    act = argmax if opts.greedy else partial(module.act, **network)

    def step(now):
        actions, *_, key = act(params, now.obs, now.key)
        actions = np.asarray(actions)  # once, for env_send, env_recv and the twin
        module.env_send(envs, actions)
        stepped = module.env_recv(envs, actions)
        colour = now.colour
        if twin is not None:
            colour, _, _, _, info = twin.step(actions[:1])
            if info["reward"][0] != stepped.score[0]:
                fail("the colour twin of env 0 played another game: run again without --gif")
        outcome = Outcome(stepped.score, ~now.ended, stepped.game_over)
        return Acting(stepped.obs, key, stepped.ended, colour), outcome

    start = Acting(module.env_reset(envs), jax.random.PRNGKey(opts.seed), np.zeros(opts.num_envs, bool),
                   None if twin is None else twin.reset()[0])
    return Game(start, step, lambda now: (now.obs if twin is None else now.colour)[0])


GAMES = {"anakin_catch.py": catch_game, "anakin_ppo.py": anakin_ppo_game,
         "sebulba_impala.py": sebulba_game, "sebulba_ppo_atari.py": sebulba_game}


def play(game, num_envs, tally, record):
    """Step the envs until `tally.total` games have ended: env i starts game i, and an env whose game ends starts
    the next one until all have started; each is played to its end. Returns every game's score and length, and
    env 0's observations in game 0 if `record`."""
    carry, shown, n = game.carry, [], tally.total
    scores, lengths = np.zeros(n), np.zeros(n, int)
    playing = np.arange(num_envs)  # the game each env plays; -1 once all have started
    started = num_envs
    while len(tally.games) < n:
        obs = np.asarray(game.shown(carry)) if record and playing[0] == 0 else None
        carry, out = game.step(carry)
        if obs is not None and out.counted[0]:
            shown.append(obs)
        on = playing >= 0
        scores[playing[on]] += out.score[on]
        lengths[playing[on]] += out.counted[on]
        for env in np.flatnonzero(on & out.over):
            tally.games.append((scores[playing[env]], lengths[playing[env]]))
            playing[env] = started if started < n else -1
            started = min(started + 1, n)
    return scores, lengths, shown


def report_until_done(tally, stops, opts):
    """A thread: a progress line every PROGRESS_SECONDS while games are played, and at Ctrl-C (a byte on the
    `stops` pipe) the figures of the games ended so far, then the end of the process, exit 130. A thread, as
    Python's own handler would wait for the main thread's envpool or XLA call to return."""
    while True:
        ready, _, _ = select.select([stops], [], [], PROGRESS_SECONDS)
        news = os.read(stops, 1) if ready else None
        if news == b"":  # the other end closed: main has returned
            os.close(stops)
            return
        games = list(tally.games)  # the main thread appends on
        if news and news[0] == signal.SIGINT:
            played = f"after {len(games):,} of {tally.total:,} games" if tally.start else "before any game"
            print(f"stopped by SIGINT {played}", flush=True)
            if games:
                print_figures(games, opts, time.time() - tally.start)
            os._exit(130)  # at once: a normal exit would wait for the main thread
        if tally.start is not None and not news and len(games) < tally.total:
            mean = f" | mean score {np.mean([score for score, _ in games]):.2f}" if games else ""
            print(f"games {len(games):,}/{tally.total:,}{mean} | {time.time() - tally.start:.0f} s", flush=True)


# ---- Pictures: one RGB frame [H, W, 3] uint8 per observation ---------------------------------

HEIGHT = 160  # pixels of a picture, about
PALETTE = (np.array(colormaps["tab10"].colors) * 255).astype(np.uint8)  # one colour per image channel


def upscaled(rgb):
    scale = -(-HEIGHT // rgb.shape[0])
    return rgb.repeat(scale, axis=0).repeat(scale, axis=1)


def board(obs):  # Catch [rows, cols]: 1 at the ball and at the paddle
    return upscaled(np.repeat((obs[..., None] * 255).astype(np.uint8), 3, axis=-1))


def image(obs):  # [C, H, W]: uint8 RGB, or greys (Atari's stack: the newest last), or channels of objects
    if obs.dtype == np.uint8:
        return upscaled(obs.transpose(1, 2, 0) if len(obs) == 3 else np.repeat(obs[-1][..., None], 3, -1))
    rgb = np.zeros((*obs.shape[1:], 3), np.uint8)
    for channel, colour in zip(obs.astype(bool), itertools.cycle(PALETTE)):
        rgb[channel] = colour
    return upscaled(rgb)


def drawing(draw, size=(2 * HEIGHT, HEIGHT)):
    picture = Image.new("RGB", size, "white")
    draw(ImageDraw.Draw(picture))
    return np.asarray(picture)


def cartpole(obs):  # [x, x_dot, theta, theta_dot]: gymnasium's picture, the track +-2.4 wide
    scale, ground = HEIGHT / 2.4, 0.75 * HEIGHT
    x = HEIGHT + obs[0] * scale
    tip = (x + scale * np.sin(obs[2]), ground - 10 - scale * np.cos(obs[2]))  # the pole is 1.0 long

    def draw(d):
        d.line([(0, ground), (2 * HEIGHT, ground)], fill="black")
        d.rectangle([x - 16, ground - 20, x + 16, ground], fill="black")
        d.line([(x, ground - 10), tip], fill=(202, 152, 101), width=6)
        d.ellipse([x - 3, ground - 13, x + 3, ground - 7], fill=(129, 132, 203))
    return drawing(draw)


def pendulum(obs):  # [cos theta, sin theta, theta_dot]; theta 0 is upright
    centre, length = HEIGHT / 2, 0.4 * HEIGHT
    tip = (centre - length * obs[1], centre - length * obs[0])

    def draw(d):
        d.line([(centre, centre), tip], fill=(204, 77, 77), width=10)
        d.ellipse([centre - 4, centre - 4, centre + 4, centre + 4], fill="black")
    return drawing(draw, (HEIGHT, HEIGHT))


def pictures(env_id, obs):
    """(drawing function, seconds a frame shows) for this env's observations, or None."""
    if env_id == "Catch":
        return board, 0.25
    if obs.ndim == 3:
        return image, 4 / 60 if obs.dtype == np.uint8 else 0.1  # Atari: 4 frames of 60 Hz a step
    if "CartPole" in env_id and obs.shape == (4,):
        return cartpole, 0.02
    if "Pendulum" in env_id and obs.shape == (3,):
        return pendulum, 0.05
    return None


GIF_LONGEST_FRAME = 655.35  # seconds: a GIF counts a frame's duration in hundredths of a second, in 16 bits


def write_gif(path, frames, seconds):
    """One palette for all frames: exact if they have at most 256 colours (all do but some RGB images). Written
    beside `path` and moved into place: a full disk leaves no half GIF."""
    frames = np.stack(frames)
    codes = frames.astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], np.uint32)
    colours, index = np.unique(codes, return_inverse=True)
    if len(colours) > 256:  # 3-3-2 bits of red, green, blue
        colours, index = np.unique(codes & 0xE0E0C0, return_inverse=True)
    palette = np.stack([colours >> 16, colours >> 8 & 255, colours & 255], -1).astype(np.uint8)
    images = [Image.fromarray(i.astype(np.uint8), "P") for i in index.reshape(frames.shape[:3])]
    for i in images:
        i.putpalette(palette.tobytes())
    ms = 10 * round(100 * seconds)  # GIFs count in hundredths of a second
    partial = path.with_name(path.name + ".part")
    try:
        images[0].save(partial, format="GIF", save_all=True, append_images=images[1:], duration=ms, loop=0)
        os.replace(partial, path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        fail(f"--gif {path}: cannot write it ({e.strerror or e}); no GIF was left")


# ---- The command line ------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.error = fail  # one `error:` line and status 2, as for every other bad input
    parser.add_argument("checkpoint", type=Path, help="a run's checkpoint.npz")
    parser.add_argument("--episodes", type=int, default=10, help="whole games to play")
    parser.add_argument("--num-envs", type=int, default=16, metavar="E",
                        help="envs playing at once (at most --episodes): memory and start-up grow with it")
    parser.add_argument("--greedy", action="store_true", help="the arg-max action (Pendulum: the mean)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the envs and the action sampling")
    parser.add_argument("--agent", type=int, default=0, help="the agent of an anakin_ppo.py --num-seeds run")
    parser.add_argument("--gif", type=Path, help="write the first game as an animated GIF")
    parser.add_argument("--gif-every", type=int, default=1, metavar="K",
                        help="keep every K-th step in the GIF, each shown K times as long (a whole Atari game: 2)")
    parser.add_argument("--allow-import", action="append", default=[], metavar="MODULE",
                        help="let the checkpoint's --env-id MODULE:Name import MODULE (it runs its code)")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        fail(f"--episodes {args.episodes} must be at least 1")
    if args.num_envs < 1:
        fail(f"--num-envs {args.num_envs} must be at least 1")
    # envpool seeds env i with seed + i, an int32: even seed 0 allows only so many envs, and the seed's range
    # below would be empty (its message nonsense) were the env count past that.
    if min(args.num_envs, args.episodes) > 2**31 - 1:
        fail(f"--num-envs {args.num_envs:,} must be at most {2**31 - 1:,} (envpool seeds env i with --seed + i, "
             "an int32)")
    args.num_envs = min(args.num_envs, args.episodes)
    if not 0 <= args.seed < 2**31 - args.num_envs:  # envpool seeds env i with seed + i, an int32
        fail(f"--seed {args.seed} must be in 0..{2**31 - args.num_envs - 1:,}")
    if args.gif_every < 1:
        fail(f"--gif-every {args.gif_every} must be at least 1")
    if args.gif and args.gif.suffix.lower() != ".gif":
        fail(f"--gif {args.gif}: the file's name must end in .gif")
    if args.gif:
        check_writable(args.gif)
    return args


def check_writable(path):
    """A file written after all the games: whether it can be is found out before the first."""
    if path.exists() and not path.is_file() and not path.is_dir():
        fail(f"--gif {path}: not a regular file")
    new = not path.exists()
    try:
        with open(path, "ab"):
            pass
        if new:
            path.unlink()
    except OSError as e:
        fail(f"--gif {path}: cannot write there ({e.strerror})")


def print_figures(games, opts, seconds):
    """The figures of these (score, length) games."""
    scores, lengths = np.array(games, dtype=float).T
    how = "arg-max" if opts.greedy else "sampled"
    print(f"{len(games):,} games, {how} actions, seed {opts.seed}: {seconds:.1f} s")
    print(summary("score", scores, 2))
    print(summary("length", lengths, 1), flush=True)


def summary(name, values, digits):
    figures = {"mean": values.mean(), "std": values.std(), "min": values.min(), "max": values.max()}
    return f"{name:<7} " + "  ".join(f"{k} {v:.{digits}f}" for k, v in figures.items())


def main(argv=None):
    """Play, print the figures (and write the GIF); return the Evaluation."""
    opts = parse_args(argv)
    tally = Tally(opts.episodes)
    stops, stop_writer = os.pipe()
    os.set_blocking(stop_writer, False)
    old_wakeup = signal.set_wakeup_fd(stop_writer)  # a signal's number goes down the pipe to the thread
    old_handler = signal.signal(signal.SIGINT, lambda *_: None)
    threading.Thread(target=report_until_done, args=(tally, stops, opts), daemon=True).start()
    try:
        return evaluate(opts, tally)
    finally:  # as it was, for a caller such as a test
        signal.signal(signal.SIGINT, old_handler)
        signal.set_wakeup_fd(old_wakeup)
        os.close(stop_writer)


def evaluate(opts, tally):
    arrays, flags = read_checkpoint(opts.checkpoint)
    script, module, args = identify(opts.checkpoint, flags)
    check_imports(opts.checkpoint, flags, opts.allow_import)
    check_memory(script, opts)
    args, template = state_template(script, module, args)
    params = read_params(opts.checkpoint, script, module, arrays, template)
    params = pick_agent(opts.checkpoint, script, args, params, opts.agent)
    game = GAMES[script](module, args, params, opts)
    picture = pictures(args.env_id, np.asarray(game.shown(game.carry))) if opts.gif else None
    if opts.gif and picture is None:
        fail(f"--gif: no picture for {args.env_id}'s observations (Atari, MinAtar and other images, Catch, "
             "CartPole and Pendulum have one)")
    if opts.gif and opts.gif_every * picture[1] > GIF_LONGEST_FRAME:
        fail(f"--gif-every {opts.gif_every}: a frame would show {opts.gif_every} steps of {picture[1]:.3g} s, longer "
             f"than a GIF frame can last ({GIF_LONGEST_FRAME} s): at most {int(GIF_LONGEST_FRAME / picture[1])}")
    steps = f", {int(arrays['global_step']):,} steps" if "global_step" in arrays else ""
    print(f"{opts.checkpoint}: {script} on {args.env_id}{steps}; {opts.episodes:,} games on {opts.num_envs} envs",
          flush=True)
    tally.start = time.time()
    scores, lengths, shown = play(game, opts.num_envs, tally, record=bool(opts.gif))
    seconds = time.time() - tally.start
    print_figures(list(zip(scores, lengths)), opts, seconds)
    frames = []
    if opts.gif and opts.gif_every >= len(shown) > 1:
        fail(f"--gif-every {opts.gif_every}: game 1 lasted {len(shown)} steps, so its GIF would be one picture "
             f"(take fewer than {len(shown)}); no GIF was written")
    if opts.gif:
        draw, frame_seconds = picture
        frames = [draw(obs) for obs in shown[::opts.gif_every]]
        write_gif(opts.gif, frames, frame_seconds * opts.gif_every)
        print(f"wrote {opts.gif}: game 1 (score {scores[0]:g}), {len(frames)} frames, "
              f"{opts.gif.stat().st_size / 1000:.0f} KB")
    return Evaluation(scores, lengths, seconds, frames)


if __name__ == "__main__":
    main()
