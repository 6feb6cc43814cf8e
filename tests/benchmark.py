"""Speed benchmark of the four scripts: `python tests/benchmark.py [--only NAME ...]`.

Prints one markdown table per case and writes `benchmark.json`. Each case runs in child
processes with the fake CPU device count it needs (XLA_FLAGS is read when JAX is imported)
and reports ratios measured in the same run, so the figures hold on a noisy machine.

A case is a function `bench_NAME()` registered in CASES; it calls `worker(...)` to run a
measurement function of this file in a child process and returns a list of table rows.
`--baseline COMMIT` also trains that commit's Sebulba scripts and anakin_ppo.py, in turns with today's.
`--gpu-check [--tiny]` runs the GPU check instead (tests/figures/README.md, "The GPU check").
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, load  # noqa: E402


def worker(func, devices=1, timeout=1800, cpu=True, **kwargs):
    """Run `func(**kwargs)` of this file in a child process with `devices` fake CPU devices (`cpu`: on the
    CPU alone, unless JAX_PLATFORMS says otherwise; else on whatever JAX finds, a GPU first)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    if cpu:
        env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
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
    init = lambda: catch.initial_state(args, mesh, envs * mesh.size)[0]  # noqa: E731
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
# The Sebulba scripts: end-to-end training SPS against two bounds measured in the same process:
# the same envs and threads stepped at random by the script's env_send/env_recv (what this configuration
# allows), and the best random-action throughput of the env on all the host's cores (what the
# machine allows: envpool sync or async, the best batch); seconds per learner update and per
# rollout from the run's last log window. --baseline COMMIT trains that commit's copy of the script
# in turns with today's, each run --rounds times, and keeps each one's best.


def machine_bound(env_id, env_kwargs, num_actions, sizes, seconds):
    """The best random-action steps/s of `env_id` in one envpool batch on all this host's cores: sync
    batches of each size, and async ones (3x the batch in flight). Returns (name, steps/s, all)."""
    import envpool
    import numpy as np

    cores, found = host_cores(), {}
    for mode, size in [("sync", s) for s in sizes] + [("async", s) for s in sizes[:-1] or sizes]:
        n = size if mode == "sync" else 3 * size
        pool = envpool.make(env_id, env_type="gymnasium", num_envs=n, batch_size=size, num_threads=min(n, cores),
                            seed=0, **env_kwargs)
        pool.async_reset()
        rng, steps, start = np.random.default_rng(0), 0, None
        while start is None or time.perf_counter() - start < seconds:
            ids = pool.recv()[-1]["env_id"]
            pool.send(rng.integers(0, num_actions, len(ids)).astype(np.int32), ids)
            steps += len(ids)
            if start is None and steps >= 10 * size:  # warmed up
                steps, start = 0, time.perf_counter()
        pool.close()
        found[f"{mode} {n} envs" + (f" in batches of {size}" if mode == "async" else "") + f", {min(n, cores)} "
              "threads"] = steps / (time.perf_counter() - start)
    best = max(found, key=found.get)
    return best, found[best], found


def host_cores():
    """The cores this process may use (Linux: its affinity, a container's share), else all the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def bound_sizes(env, tiny=False):
    cores = host_cores()
    if tiny:
        return (2, 4)
    return (16, 64, 256, 1024) if len(env.obs_shape) == 1 else (8, 16, 32, 64) + ((128,) if cores >= 8 else ())


def sebulba_worker(script, flags, updates=None, log_every=None, steps=None, bound=True, machine=True, tiny=False):
    """Train `script` (sebulba_impala.py or sebulba_ppo_atari.py, or a copy of it) with these Args for
    `updates` (or about `steps`); then with `bound` step the same envs at random with its env_send/env_recv in as
    many threads, and with `machine` find the machine's bound."""
    import dataclasses
    import threading

    import numpy as np

    sebulba = load(script)
    args, env = sebulba.check_args(sebulba.Args(**flags))

    n, threads = args.local_num_envs, args.num_actor_threads  # one actor device here
    batch = args.num_steps * n * threads
    if steps:
        updates = max(3, steps // batch)
        log_every = max(1, updates // 3)
    with tempfile.TemporaryDirectory() as run_dir:
        args = dataclasses.replace(args, total_timesteps=updates * batch, log_every=log_every, run_dir=run_dir)
        row = sebulba.main(args)  # the last log window: compile time excluded
    result = {"envs": f"{n} x {threads} threads", "batch": batch, "train_sps": row["charts/SPS"],
              "update_s": row["stats/learner_time"], "rollout_s": row["stats/rollout_time"],
              "env_s": row["stats/env_step_time"], "inference_s": row["stats/inference_time"],
              "return": row.get("charts/episodic_return", float("nan"))}  # of the last log window
    if not bound:
        return result

    def random_steps(seed, steps, counts):
        envs, rng = sebulba.make_envs(args, n, list(range(seed, seed + n))), np.random.default_rng(seed)
        sebulba.env_reset(envs)
        ready.wait()  # the clock starts once every thread's envs are made
        for _ in range(steps):
            actions = rng.integers(0, env.num_actions, n).astype(np.int32)
            sebulba.env_send(envs, actions)
            sebulba.env_recv(envs, actions)
        counts.append(steps * n)

    counts, steps, ready = [], 20 if tiny else max(200, 20 * args.num_steps), threading.Barrier(threads + 1)
    pool = [threading.Thread(target=random_steps, args=(i, steps, counts)) for i in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in pool:
        t.join()
    result["raw_sps"] = sum(counts) / (time.perf_counter() - start)
    if machine:
        kwargs = sebulba.atari_kwargs(args.machado) if env.atari else {}
        result["bound"], result["bound_sps"], result["bounds"] = machine_bound(
            args.env_id, kwargs, env.num_actions, bound_sizes(env, tiny), 0.3 if tiny else 2.0)
    return result


def sebulba_runs(script, flags, updates, log_every, baseline=None, rounds=1):
    """sebulba_worker's result for today's script, and with --baseline the best train SPS of its copy at
    that commit, the two trained in turns."""
    best = None
    for i in range(rounds if baseline else 1):
        r = worker("sebulba_worker", script=script, flags=flags, updates=updates, log_every=log_every,
                   bound=i == 0, machine=i == 0)
        best = r if best is None else {**best, "train_sps": max(best["train_sps"], r["train_sps"])}
        if baseline:
            old = worker("sebulba_worker", script=str(baseline / script), flags=flags, updates=updates,
                         log_every=log_every, bound=False, machine=False)
            best["baseline_sps"] = max(best.get("baseline_sps", 0.0), old["train_sps"])
            best.setdefault("baseline_return", old["return"])  # the first round's, as for today's script
    return best


def sebulba_row(r, digits, baseline=None):
    # "raw env SPS" is the first bound column: the one tests/plot.py --speed draws.
    return {"envs": r["envs"], "batch": r["batch"], "train SPS": f"{r['train_sps']:,.0f}",
            "raw env SPS": f"{r['raw_sps']:,.0f}", "ratio": f"{r['train_sps'] / r['raw_sps']:.1%}",
            "machine SPS": f"{r['bound_sps']:,.0f} ({r['bound']})",
            "machine ratio": f"{r['train_sps'] / r['bound_sps']:.1%}",
            **({f"train SPS at {baseline}": f"{r['baseline_sps']:,.0f}" if "baseline_sps" in r else "-"}
               if baseline else {}),
            "return": f"{r['return']:.2f}",
            **({f"return at {baseline}": f"{r['baseline_return']:.2f}" if "baseline_return" in r else "-"}
               if baseline else {}),
            **{name: f"{r[key]:.{digits}f}" for name, key in [("s/update", "update_s"), ("s/rollout", "rollout_s"),
                                                              ("env s/rollout", "env_s"),
                                                              ("inference s/rollout", "inference_s")]}}


def bench_impala(baseline=None, rounds=1):
    cases = [("Breakout-v5", "deep", 9, 3, {}), ("Breakout-v5", "shallow", 30, 10, {}),
             ("Breakout-v5", "shallow", 30, 10, {"async_envs": True}), ("CartPole-v1", "mlp", 200, 50, {})]
    rows = []
    for env_id, network, updates, log_every, extra in cases:
        images = {"local_num_envs": 8, "num_steps": 20} if network != "mlp" else {}
        flags = {"env_id": env_id, "network": network, **images, **extra}
        r = sebulba_runs("sebulba_impala.py", flags, updates, log_every, baseline and baseline[1], rounds)
        rows.append({"env": env_id, "network": network + (" --async-envs" if extra else ""),
                     **sebulba_row(r, 3, baseline and baseline[0])})
    return rows


def bench_ppo_atari(baseline=None, rounds=1):
    # batch 512, minibatches 128
    base = {"env_id": "Breakout-v5", "local_num_envs": 8, "num_actor_threads": 2, "num_steps": 32}
    rows = []
    for epochs in (4, 1):
        r = sebulba_runs("sebulba_ppo_atari.py", {**base, "update_epochs": epochs}, 6, 3, baseline and baseline[1],
                         rounds)
        rows.append({"env": "Breakout-v5", "epochs": epochs, **sebulba_row(r, 2, baseline and baseline[0])})
    return rows


# ---------------------------------------------------------------------------------------
# anakin_ppo.py: CartPole-v1's default run, which is PureJaxRL's configuration (4 envs x 128 steps,
# 4 epochs x 4 minibatches), whole, and wider ones; training SPS against the rollout-only bound (the
# same rollouts, actor forward passes and trajectories, no learning), compile time apart, in the same
# process. --baseline COMMIT also trains that commit's anakin_ppo.py in the same process, in turns.


def ppo_worker(envs, seeds, updates, baseline=None):
    import importlib.util
    import inspect

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    ppo = load("anakin_ppo.py")
    args = ppo.check_args(ppo.Args(num_envs_per_device=envs, num_seeds=seeds))
    env = ppo.ENVS[args.env_id]
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    updates = updates or args.total_timesteps // (args.num_steps * envs * mesh.size)  # the whole run
    n = np.int32(updates)

    def rollouts(state, n):  # per seed and device: what `update` does before learning
        def one(_, s):
            key, k_act, k_reset = jax.random.split(s.key, 3)
            env_state, obs, traj = ppo.rollout(s.params, s.env_state, s.obs, k_act, k_reset, args, env)
            used = (traj.obs.sum() + traj.action.sum() + traj.old_log_prob.sum() + traj.outcome.final_obs.sum()
                    + traj.outcome.reward.sum())
            return s._replace(env_state=env_state, obs=obs, key=jax.random.fold_in(key, used.astype(jnp.int32)))
        return jax.lax.fori_loop(0, n, one, state)

    start = time.perf_counter()  # compile time as a user meets it: the init's and the training call's
    state, _ = ppo.initial_state(args, env, mesh, envs * mesh.size)
    init = lambda: jax.tree.map(jnp.copy, state)  # a fresh copy: the calls donate their state
    train = ppo.make_train(args, env, mesh, updates).lower(init(), n).compile()
    compile_s = time.perf_counter() - start
    measures = []
    if baseline:  # under another module name: conftest's load caches by the file's stem
        spec = importlib.util.spec_from_file_location("anakin_ppo_baseline", Path(baseline) / "anakin_ppo.py")
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        old_args = old.check_args(old.Args(num_envs_per_device=envs, num_seeds=seeds))
        # For a while (7192a5a to e62a0d7) initial_state also took the run's updates.
        budget = [updates] if "num_updates" in inspect.signature(old.initial_state).parameters else []
        old_state, _ = old.initial_state(old_args, old.ENVS[old_args.env_id], mesh, envs * mesh.size, *budget)
        old_init = lambda: jax.tree.map(jnp.copy, old_state)  # noqa: E731
        old_train = old.make_train(old_args, old.ENVS[old_args.env_id], mesh, updates).lower(old_init(), n).compile()
        measures.append(lambda: timed(old_train, jax.block_until_ready(old_init()), n))
    rollout_only = jax.jit(jax.shard_map(jax.vmap(rollouts, in_axes=(0, None)), mesh=mesh,
                                         in_specs=(ppo.STATE_SPECS, P()), out_specs=ppo.STATE_SPECS,
                                         check_vma=False)).lower(init(), n).compile()
    steps = updates * args.num_steps * envs * mesh.size * seeds
    train_s, rollout_s, *baseline_s = best_of(lambda: timed(train, jax.block_until_ready(init()), n),
                                              lambda: timed(rollout_only, jax.block_until_ready(init()), n),
                                              *measures)
    return {"train_sps": steps / train_s, "rollout_sps": steps / rollout_s, "train_compile_s": compile_s,
            **({"baseline_sps": steps / baseline_s[0]} if baseline else {})}


def bench_ppo(baseline=None, rounds=None):
    rows = []
    for envs, seeds, updates in ((4, 1, None), (2048, 1, 3), (4, 16, 50)):  # None: the default run's 976
        r = worker("ppo_worker", envs=envs, seeds=seeds, updates=updates, baseline=baseline and str(baseline[1]))
        rows.append({
            "config": f"{envs} envs x 128 steps" + (f", {seeds} seeds" if seeds > 1 else "")
                      + ("" if updates else ", the default run (PureJaxRL's)"),
            "train SPS": f"{r['train_sps']:,.0f}", "rollout-only SPS": f"{r['rollout_sps']:,.0f}",
            "ratio": f"{r['train_sps'] / r['rollout_sps']:.0%}", "compile s (train)": f"{r['train_compile_s']:.1f}",
            **({f"train SPS at {baseline[0]}": f"{r['baseline_sps']:,.0f}",
                f"today / {baseline[0]}": f"{r['train_sps'] / r['baseline_sps']:.2f}"} if baseline else {}),
        })
    return rows


# ---------------------------------------------------------------------------------------
# The GPU check (tests/figures/README.md, "The GPU check"): on a GPU machine, within about 8 minutes,
# the machine's bound for Breakout, then a small grid of actor configurations of both Sebulba scripts
# (today's defaults first), each against the same envs stepped at random and against that bound;
# one JSON, rewritten after each configuration. --tiny: the same at a tiny size, to test it on a CPU.

GPU_GRID = [  # (script, flags beyond Breakout-v5 and the script's defaults, agent steps to train)
    ("sebulba_impala.py", {}, 120_000),  # deep ResNet, 2 threads x 16 envs
    ("sebulba_ppo_atari.py", {}, 100_000),  # Nature CNN, 2 threads x 16 envs x 128 steps
    ("sebulba_impala.py", {"local_num_envs": 32, "async_envs": True}, 150_000),
    ("sebulba_impala.py", {"num_actor_threads": 4, "local_num_envs": 32}, 200_000),
    ("sebulba_impala.py", {"num_actor_threads": 4, "local_num_envs": 64, "async_envs": True}, 250_000),
    ("sebulba_ppo_atari.py", {"local_num_envs": 32, "async_envs": True}, 120_000),
    ("sebulba_impala.py", {"num_actor_threads": 8, "local_num_envs": 32, "async_envs": True}, 250_000),
    ("sebulba_ppo_atari.py", {"num_actor_threads": 4, "local_num_envs": 32, "async_envs": True}, 150_000),
]
TINY = {"local_num_envs": 2, "num_steps": 4}  # --tiny: these flags, two updates, one config a script
START_S, STOP_S = 400, 480  # no configuration starts after START_S, and none runs past STOP_S (killed)


def bound_worker(env_id, tiny):
    import jax

    impala = load("sebulba_impala.py")
    env = impala.describe_env(env_id, False)
    name, best, found = machine_bound(env_id, impala.atari_kwargs(False), env.num_actions, bound_sizes(env, tiny),
                                      0.3 if tiny else 2.0)
    return {"best": name, "sps": best, "all": found, "jax": jax.__version__, "devices": str(jax.devices())}


def gpu_check(out, tiny):
    start, grid = time.monotonic(), [c for c in GPU_GRID if not c[1]] if tiny else GPU_GRID
    result = {"machine": f"{platform.processor() or platform.machine()}, {host_cores()} CPU cores",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg(), "tiny": tiny,
              "bound": worker("bound_worker", cpu=False, timeout=120, env_id="Breakout-v5", tiny=tiny), "runs": []}
    print(f"Breakout-v5 on all cores: {result['bound']['sps']:,.0f} steps/s ({result['bound']['best']})", flush=True)
    for script, flags, steps in grid:
        flags = {"env_id": "Breakout-v5", **flags, **(TINY if tiny else {})}
        elapsed = time.monotonic() - start
        run = {"script": script, "flags": flags}
        if elapsed > START_S:
            result["runs"].append({**run, "skipped": "out of time"})
            continue
        size = {"updates": 2, "log_every": 1} if tiny else {"steps": steps}
        try:
            r = worker("sebulba_worker", cpu=False, timeout=max(30, STOP_S - elapsed), script=script, flags=flags,
                       **size, machine=False, tiny=tiny)
            run.update(r, ratio=r["train_sps"] / r["raw_sps"], machine_ratio=r["train_sps"] / result["bound"]["sps"])
            print(f"{script} {flags}: {r['train_sps']:,.0f} steps/s, {run['ratio']:.0%} of the same envs at random, "
                  f"{run['machine_ratio']:.0%} of the machine's bound", flush=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            run["error"] = f"{type(e).__name__}: {e}"
            print(f"{script} {flags}: {run['error']}", flush=True)
        result["runs"].append(run)
        out.write_text(json.dumps(result, indent=2))
    result["seconds"] = time.monotonic() - start
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} after {result['seconds']:.0f} s", flush=True)


CASES = {"catch": bench_catch, "impala": bench_impala, "ppo_atari": bench_ppo_atari, "ppo": bench_ppo}


def table(rows):
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to run (default: all)")
    parser.add_argument("--out", help="the JSON written (default: benchmark.json; gpu_check.json)")
    parser.add_argument("--baseline", metavar="COMMIT", help="Sebulba and ppo cases: also train that commit's scripts")
    parser.add_argument("--rounds", type=int, default=2, help="with --baseline: runs of each script, in turns")
    parser.add_argument("--gpu-check", action="store_true", help="the GPU check instead (tests/figures/README.md)")
    parser.add_argument("--tiny", action="store_true", help="--gpu-check at a tiny size, to test it on a CPU")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        func, kwargs = args.worker
        print(json.dumps(globals()[func](**json.loads(kwargs))))
        return
    if args.gpu_check:
        return gpu_check(Path(args.out or "gpu_check.json"), args.tiny)
    machine = f"{platform.processor() or platform.machine()}, {host_cores()} CPU cores"
    results = {"machine": machine}
    with tempfile.TemporaryDirectory() as folder:
        baseline = args.baseline and (args.baseline, checkout(args.baseline, Path(folder)))
        for name in args.only or CASES:
            rows = CASES[name](baseline, args.rounds) if name in ("impala", "ppo_atari", "ppo") else CASES[name]()
            results[name] = rows
            print(f"\n### {name} ({machine})\n\n{table(rows)}\n", flush=True)
    Path(args.out or "benchmark.json").write_text(json.dumps(results, indent=2))


def checkout(commit, folder):
    """`commit`'s Sebulba scripts and anakin_ppo.py, copied into `folder` under their own names."""
    for script in ("sebulba_impala.py", "sebulba_ppo_atari.py", "anakin_ppo.py"):
        text = subprocess.run(["git", "show", f"{commit}:{script}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        (folder / script).write_text(text)
    return folder


if __name__ == "__main__":
    main()
