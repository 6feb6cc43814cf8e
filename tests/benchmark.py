"""Speed benchmark of the four scripts: `python tests/benchmark.py [--only NAME ...]`.

Prints one markdown table per case and writes `benchmark.json`. Each case runs in child
processes with the fake CPU device count it needs (XLA_FLAGS is read when JAX is imported)
and reports ratios measured in the same run, so the figures hold on a noisy machine.

A case is a function `bench_NAME()` registered in CASES; it calls `worker(...)` to run a
measurement function of this file in a child process and returns a list of table rows.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import load  # noqa: E402


def worker(func, devices=1, timeout=1800, **kwargs):
    """Run `func(**kwargs)` of this file in a child process with `devices` fake CPU devices."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", func, json.dumps(kwargs)],
        env=env, stdout=subprocess.PIPE, text=True, timeout=timeout, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def timed(fn, *args):
    """Seconds one call of `fn` takes, waiting for its device results."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def best_of(*measures, rounds=8):
    """Calls each `measure()` (it returns seconds) in turn, `rounds` + 1 times, and keeps each one's
    best after the first (warm-up) round. Interleaved, so a machine whose speed drifts slows all
    alike; the best of many rounds, as the best of a few still varies with the drift."""
    times = [[measure() for measure in measures] for _ in range(rounds + 1)]
    return [min(column) for column in zip(*times[1:])]


# ---------------------------------------------------------------------------------------
# anakin_catch.py: training SPS against the rollout-only bound (same envs, forward pass,
# no learning), compile time apart.


def catch_worker(envs, iters):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    catch = load("anakin_catch.py")
    args = catch.Args(num_envs_per_device=envs)
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    init, _ = catch.init_on_mesh(args, mesh, envs * mesh.size)
    state = init()

    def rollouts(state):  # the same vmapped rollouts with their forward passes, no learning
        def one(lanes, _):
            lanes, traj, _ = jax.vmap(catch.rollout, (None, 0, None))(state.params, lanes, args)
            return lanes, traj.reward.sum()
        return state._replace(lanes=jax.lax.scan(one, state.lanes, length=iters)[0])

    rollout_only = jax.jit(jax.shard_map(rollouts, mesh=mesh, in_specs=(catch.STATE_SPECS,),
                                         out_specs=catch.STATE_SPECS, check_vma=False)).lower(state).compile()
    start = time.perf_counter()
    n = np.int32(iters)
    train = catch.make_train(args, mesh).lower(state, n).compile()
    compile_s = time.perf_counter() - start
    steps = iters * args.num_steps * envs * mesh.size
    train_s, rollout_s = best_of(
        lambda: timed(train, jax.block_until_ready(init()), n),  # train donates its input
        lambda: timed(rollout_only, state))
    return {"train_sps": steps / train_s, "rollout_sps": steps / rollout_s, "train_compile_s": compile_s}


def bench_catch():
    rows = []
    for devices in (1, 2):
        for envs in (128, 1024):
            r = worker("catch_worker", devices=devices, envs=envs, iters=25 if envs == 1024 else 200)
            rows.append({
                "devices": devices, "envs/device": envs,
                "train SPS": f"{r['train_sps']:,.0f}", "rollout-only SPS": f"{r['rollout_sps']:,.0f}",
                "ratio": f"{r['train_sps'] / r['rollout_sps']:.0%}",
                "compile s (train)": f"{r['train_compile_s']:.1f}",
            })
    return rows


# ---------------------------------------------------------------------------------------
# The Sebulba scripts: end-to-end training SPS against the random-action SPS of the same envs
# and threads stepped by the script's env_step (the bound the actors cannot beat), measured in
# the same process; seconds per learner update and per rollout from the run's last log window.


def sebulba_worker(script, flags, updates, log_every):
    """Train `script` (sebulba_impala.py or sebulba_ppo_atari.py) with these Args, then step the same
    envs at random with its env_step in as many threads."""
    import dataclasses
    import tempfile
    import threading

    import numpy as np

    sebulba = load(script)
    args, env = sebulba.check_args(sebulba.Args(**flags))

    n, threads = args.local_num_envs, args.num_actor_threads  # one actor device here
    batch = args.num_steps * n * threads
    with tempfile.TemporaryDirectory() as run_dir:
        args = dataclasses.replace(args, total_timesteps=updates * batch, log_every=log_every, run_dir=run_dir)
        row = sebulba.main(args)  # the last log window: compile time excluded

    def random_steps(seed, steps, counts):
        envs, rng = sebulba.make_envs(args, n, seed), np.random.default_rng(seed)
        sebulba.env_reset(envs)
        for _ in range(steps):
            sebulba.env_step(envs, rng.integers(0, env.num_actions, n).astype(np.int32))
        counts.append(steps * n)

    counts, steps = [], max(200, 20 * args.num_steps)
    start = time.perf_counter()
    pool = [threading.Thread(target=random_steps, args=(i, steps, counts)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"envs": f"{n} x {threads} threads", "batch": batch, "train_sps": row["charts/SPS"],
            "raw_sps": sum(counts) / (time.perf_counter() - start), "update_s": row["stats/learner_time"],
            "rollout_s": row["stats/rollout_time"], "env_s": row["stats/env_step_time"],
            "inference_s": row["stats/inference_time"]}


def sebulba_row(r, digits):
    return {"envs": r["envs"], "batch": r["batch"], "train SPS": f"{r['train_sps']:,.0f}",
            "raw env SPS": f"{r['raw_sps']:,.0f}", "ratio": f"{r['train_sps'] / r['raw_sps']:.1%}",
            **{name: f"{r[key]:.{digits}f}" for name, key in [("s/update", "update_s"), ("s/rollout", "rollout_s"),
                                                              ("env s/rollout", "env_s"),
                                                              ("inference s/rollout", "inference_s")]}}


def bench_impala():
    cases = [("Breakout-v5", "deep", 9, 3), ("Breakout-v5", "shallow", 30, 10), ("CartPole-v1", "mlp", 200, 50)]
    rows = []
    for env_id, network, updates, log_every in cases:
        images = {"local_num_envs": 8, "num_steps": 20} if network != "mlp" else {}
        flags = {"env_id": env_id, "network": network, **images}
        r = worker("sebulba_worker", script="sebulba_impala.py", flags=flags, updates=updates, log_every=log_every)
        rows.append({"env": env_id, "network": network, **sebulba_row(r, digits=3)})
    return rows


def bench_ppo_atari():
    # batch 512, minibatches 128
    base = {"env_id": "Breakout-v5", "local_num_envs": 8, "num_actor_threads": 2, "num_steps": 32}
    rows = []
    for epochs in (4, 1):
        r = worker("sebulba_worker", script="sebulba_ppo_atari.py", flags={**base, "update_epochs": epochs}, updates=6,
                   log_every=3)
        rows.append({"env": "Breakout-v5", "envs": r["envs"], "batch": r["batch"], "epochs": epochs,
                     **sebulba_row(r, digits=2)})
    return rows


# ---------------------------------------------------------------------------------------
# anakin_ppo.py: CartPole-v1 with PureJaxRL's configuration (4 envs x 128 steps, 4 epochs x 4
# minibatches) and wider ones; training SPS against the rollout-only bound (the same rollouts,
# actor forward passes and trajectories, no learning), compile time apart, in the same process.


def ppo_worker(envs, seeds, updates):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    ppo = load("anakin_ppo.py")
    args = ppo.check_args(ppo.Args(num_envs_per_device=envs, num_seeds=seeds))
    env = ppo.ENVS[args.env_id]
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    first, n = np.int32(0), np.int32(updates)

    def rollouts(state, n):  # per seed and device: what `update` does before learning
        def one(_, s):
            key, k_act, k_reset = jax.random.split(s.key, 3)
            env_state, obs, traj = ppo.rollout(s.params, s.env_state, s.obs, k_act, k_reset, args, env)
            used = (traj.obs.sum() + traj.action.sum() + traj.log_prob.sum() + traj.step.final_obs.sum()
                    + traj.step.reward.sum())
            return s._replace(env_state=env_state, obs=obs, key=jax.random.fold_in(key, used.astype(jnp.int32)))
        return jax.lax.fori_loop(0, n, one, state)

    start = time.perf_counter()  # compile time as a user meets it: the init's and the training call's
    init, _ = ppo.init_on_mesh(args, env, mesh, envs * mesh.size)
    train = ppo.make_train(args, env, mesh, updates).lower(init(), first, n).compile()
    compile_s = time.perf_counter() - start
    rollout_only = jax.jit(jax.shard_map(jax.vmap(rollouts, in_axes=(0, None)), mesh=mesh,
                                         in_specs=(ppo.STATE_SPECS, P()), out_specs=ppo.STATE_SPECS,
                                         check_vma=False)).lower(init(), n).compile()
    steps = updates * args.num_steps * envs * mesh.size * seeds
    train_s, rollout_s = best_of(lambda: timed(train, jax.block_until_ready(init()), first, n),
                                 lambda: timed(rollout_only, jax.block_until_ready(init()), n))
    return {"train_sps": steps / train_s, "rollout_sps": steps / rollout_s, "train_compile_s": compile_s}


def bench_ppo():
    rows = []
    for envs, seeds, updates in ((4, 1, 400), (2048, 1, 3), (4, 16, 50)):
        r = worker("ppo_worker", envs=envs, seeds=seeds, updates=updates)
        rows.append({
            "config": f"{envs} envs x 128 steps" + (f", {seeds} seeds" if seeds > 1 else ""),
            "train SPS": f"{r['train_sps']:,.0f}", "rollout-only SPS": f"{r['rollout_sps']:,.0f}",
            "ratio": f"{r['train_sps'] / r['rollout_sps']:.0%}", "compile s (train)": f"{r['train_compile_s']:.1f}",
        })
    return rows


CASES = {"catch": bench_catch, "impala": bench_impala, "ppo_atari": bench_ppo_atari, "ppo": bench_ppo}


def table(rows):
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to run (default: all)")
    parser.add_argument("--out", default="benchmark.json")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        func, kwargs = args.worker
        print(json.dumps(globals()[func](**json.loads(kwargs))))
        return
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"
    results = {"machine": machine}
    for name in args.only or CASES:
        rows = CASES[name]()
        results[name] = rows
        print(f"\n### {name} ({machine})\n\n{table(rows)}\n", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
