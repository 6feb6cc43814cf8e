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


# ---------------------------------------------------------------------------------------
# anakin_catch.py: training SPS against the rollout-only bound (same envs, forward pass,
# no learning), compile time apart.


def catch_worker(envs, iters):
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    catch = load("anakin_catch.py")
    args = catch.Args(num_envs_per_device=envs)
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    init = jax.jit(lambda key: catch.init_learner(key, args, envs * mesh.size), out_shardings=catch.shardings(mesh))
    learner = init(jax.random.PRNGKey(0))

    def rollouts(learner):  # the same vmapped rollouts with their forward passes, no learning
        def one(lanes, _):
            lanes, traj, _ = jax.vmap(catch.rollout, (None, 0, None))(learner.params, lanes, args)
            return lanes, traj.reward.sum()
        return learner._replace(lanes=jax.lax.scan(one, learner.lanes, length=iters)[0])

    specs = catch.Learner(P(), P(), P("devices"))
    rollout_only = jax.jit(jax.shard_map(rollouts, mesh=mesh, in_specs=(specs,), out_specs=specs,
                                         check_vma=False)).lower(learner).compile()
    start = time.perf_counter()
    train = catch.make_train(args, mesh, iters).lower(learner).compile()
    compile_s = time.perf_counter() - start
    steps = iters * args.num_steps * envs * mesh.size
    jax.block_until_ready((rollout_only(learner), train(init(jax.random.PRNGKey(1)))))  # warm up
    fresh = jax.block_until_ready(init(jax.random.PRNGKey(2)))
    return {"train_sps": steps / timed(train, fresh), "rollout_sps": steps / timed(rollout_only, learner),
            "train_compile_s": compile_s}


def bench_catch():
    rows = []
    for devices in (1, 2):
        for envs in (128, 1024):
            r = worker("catch_worker", devices=devices, envs=envs, iters=50 if envs == 1024 else 200)
            rows.append({
                "devices": devices, "envs/device": envs,
                "train SPS": f"{r['train_sps']:,.0f}", "rollout-only SPS": f"{r['rollout_sps']:,.0f}",
                "ratio": f"{r['train_sps'] / r['rollout_sps']:.0%}",
                "compile s (train)": f"{r['train_compile_s']:.1f}",
            })
    return rows


CASES = {"catch": bench_catch}


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
