"""Learning curves from run folders: one curve per configuration, the mean of its seeds
with a min-max band.

usage: python tests/plot.py RUN_FOLDER... -o FILE.png [--x steps|time] [--y SCALAR]
                            [--ref LABEL=VALUE[@ENV] ...] [--panels | --join] [--title T]
       python tests/plot.py --speed benchmark.json -o FILE.png [--title T]
       python tests/plot.py --pack RUN_FOLDER...

Runs are grouped by env id and experiment name (from `args.json`, else from the folder
name `{env_id}__{exp_name}__{seed}__{time}`); each run is one seed, except an
`anakin_ppo.py --num-seeds N` run, whose per-seed columns `{SCALAR}_seed{i}` are N seeds.
Each seed is interpolated onto the x values of all seeds, over the range they all cover.

    python tests/plot.py runs/* -o curves.png --ref "random play=0.46"
    python tests/plot.py runs/Breakout* -o sps.png --x time --y charts/SPS
    python tests/plot.py runs/*MinAtar* -o minatar.png --panels --ref "random=0.5@Asterix" --ref "random=0.46@Breakout"

--panels draws one panel per env id; a reference ending in @ENV is drawn only in the panels
whose env id contains ENV. --join takes the folders of one script (the same flag names), env id
and seed as one run and its resumptions (`--resume` starts a new folder), ordered by their first
step: one seed, named after its first piece, with a dotted line where each resumption starts.

--speed draws tests/benchmark.py's benchmark.json instead: for every row, its training SPS
beside the bound it was measured against (the `... SPS` column that is not `train SPS`), on a
log scale, with the ratio written at the end of the training bar.

--pack makes copied run folders light enough to keep in the repository (`pack` says how); the
drawing reads metrics.jsonl or the packed metrics.jsonl.xz alike, and both where a run logged on after a pack
(also metrics.jsonl.packing, where --pack moves metrics.jsonl before reading it, where a pack left it).
"""

import argparse
import lzma
import itertools
import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np

X_LABELS = {"steps": "environment steps", "time": "training wall-clock seconds"}
RUN_BUDGET = 1_000_000  # bytes a run folder kept in tests/figures/runs/ may hold (tests/figures/README.md)
# A run folder's metrics files, in the order their rows were logged: those packed, those --pack moved aside to
# pack them (left there where a pack stopped part-way), and those a run logs (also after a pack).
METRICS = ("metrics.jsonl.xz", "metrics.jsonl.packing", "metrics.jsonl")


class Run(NamedTuple):
    folder: Path
    env_id: str
    exp_name: str
    seed: str
    num_seeds: int  # anakin_ppo's --num-seeds (1 elsewhere): its charts/SPS counts every seed's steps
    rows: list  # metrics.jsonl, one dict a line
    flags: frozenset  # args.json's names: which script made the run


class Bar(NamedTuple):
    label: str  # "{case}: {the row's configuration}"
    train: float  # training SPS
    bound: float  # the SPS the row measured training against
    bound_name: str  # its column: "rollout-only SPS" or "raw env SPS"


class Ref(NamedTuple):
    label: str
    value: float
    where: str  # drawn in the panels whose env id contains it ("": every panel)


class Panel(NamedTuple):
    name: str | None  # its env id under --panels
    curves: list
    refs: list
    resumes: list  # x of each resumption's start, under --join


class Curve(NamedTuple):
    label: str
    x: np.ndarray  # the grid: every seed's x values inside the range all seeds cover
    mean: np.ndarray
    low: np.ndarray  # min over seeds
    high: np.ndarray  # max over seeds


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_json(path, text):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        fail(f"{path} is not valid JSON ({e})")


def number(value):
    """A JSON number (a bool is not one, though Python counts it an int)."""
    return type(value) in (int, float)


def rounded(row):
    """A row as --pack keeps it: floats to 6 significant digits (float32 holds about 7; pictures and tables need 3)."""
    return {k: float(f"{v:.6g}") if type(v) is float else v for k, v in row.items()}


def read_rows(folder, names=METRICS):
    """The rows of a run folder's metrics files (`names`, of METRICS), in the order they were logged."""
    paths = [folder / name for name in names if (folder / name).is_file()]
    if not paths:
        fail(f"no metrics.jsonl in {folder} (a run folder holds args.json and metrics.jsonl or metrics.jsonl.xz)")
    rows = []
    for path in paths:
        # A pack stopped after moving its new file into place leaves the rows it packed in their old file too.
        kept = {json.dumps(rounded(row)) for row in rows}
        rows += [row for row in read_metrics(path) if json.dumps(rounded(row)) not in kept]
    return rows


def read_metrics(metrics):
    """The rows of one metrics.jsonl or metrics.jsonl.xz."""
    try:
        text = lzma.decompress(metrics.read_bytes()).decode() if metrics.suffix == ".xz" else metrics.read_text()
    except (OSError, lzma.LZMAError, UnicodeDecodeError) as e:
        fail(f"{metrics} cannot be read ({e})")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):  # a run killed while it wrote a row leaves that row cut off
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            print(f"note: {metrics} line {len(lines)} was cut off (a killed run?): left out", file=sys.stderr)
            lines.pop()
    rows = [read_json(f"{metrics} line {i}", line) for i, line in enumerate(lines, 1) if line.strip()]
    for i, row in enumerate(rows, 1):
        if not (isinstance(row, dict) and number(row.get("global_step")) and math.isfinite(row["global_step"])):
            fail(f"{metrics}: every line should be a JSON object with a global_step that is a number (line {i}: "
                 f"{textwrap.shorten(json.dumps(row), 80)})")
    return rows


def read_run(folder):
    folder = Path(folder)
    rows = read_rows(folder)
    parts = folder.name.rsplit("__", 3)  # {env_id}__{exp_name}__{seed}__{time}, if args.json is missing
    env_id, exp_name, seed = parts[:3] if len(parts) == 4 else ("unknown env", folder.name, folder.name)
    args_file = folder / "args.json"
    args = read_json(args_file, args_file.read_text()) if args_file.is_file() else {}
    if not isinstance(args, dict):
        fail(f"{args_file} should hold a JSON object, the run's flags by name")
    for name in ("env_id", "exp_name"):
        if name in args and type(args[name]) is not str:
            fail(f"{args_file}: {name} should be a string, not {json.dumps(args[name])}")
    if "num_seeds" in args and not (type(args["num_seeds"]) is int and args["num_seeds"] >= 1):
        fail(f"{args_file}: num_seeds should be a whole number of at least 1, not {json.dumps(args['num_seeds'])}")
    return Run(folder, args.get("env_id", env_id), args.get("exp_name", exp_name), str(args.get("seed", seed)),
               args.get("num_seeds", 1), rows, frozenset(args))


def pack(folder):
    """--pack: a run folder as the repository keeps it (tests/figures/README.md, "Adding a run"): every row
    (those packed before and those logged since), rounded, compressed by xz in place of metrics.jsonl.
    metrics.jsonl is moved aside to metrics.jsonl.packing before it is read, so a run still logging starts a new
    metrics.jsonl, which this pack leaves to the next: no row is lost, however often or seldom the run logs.
    Returns the number of rows packed and the folder's size in bytes."""
    folder = Path(folder)
    plain, aside = folder / "metrics.jsonl", folder / "metrics.jsonl.packing"
    if aside.is_file() and plain.is_file():  # A stopped pack's rows aside, packed first: none may be moved onto them.
        pack_aside(folder)
    if plain.is_file() and not aside.is_file():
        try:
            os.replace(plain, aside)
        except OSError as e:  # a read-only folder
            fail(f"--pack {folder}: cannot move metrics.jsonl aside to pack it ({e.strerror or e}); nothing was "
                 "changed")
    rows = pack_aside(folder)
    return rows, sum(path.stat().st_size for path in folder.iterdir())


def pack_aside(folder):
    """The rows of metrics.jsonl.xz and metrics.jsonl.packing into a new metrics.jsonl.xz; the number of rows."""
    aside, packed, new = (folder / name for name in ("metrics.jsonl.packing", "metrics.jsonl.xz",
                                                     "metrics.jsonl.xz.part"))
    before = written(aside)
    rows = read_rows(folder, METRICS[:2])
    text = "".join(json.dumps(rounded(row)) + "\n" for row in rows)
    try:
        new.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
        os.replace(new, packed)  # the old file stays whole until the new one is
        # A run that opened metrics.jsonl just before the move writes its row here, maybe after it was read: the
        # file then stays, for the drawing and the next pack. Only such a row written in the instant between this
        # check and the removal could be lost.
        if written(aside) == before:
            aside.unlink(missing_ok=True)
    except OSError as e:  # a full disk
        try:
            new.unlink(missing_ok=True)
        except OSError:  # A read-only file system refuses even to remove a file it does not hold.
            pass
        kept = ("no row was lost: those not packed wait in metrics.jsonl.packing, which the drawing reads and the "
                "next --pack takes up") if aside.is_file() else "nothing was changed"
        fail(f"--pack {folder}: cannot write metrics.jsonl.xz ({e.strerror or e}); {kept}")
    return len(rows)


def written(path):
    """(size, modification time in ns) of a file, or None: what changes when a run appends a row."""
    return (path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None


def seed_columns(run, y):
    """The columns of `y` that are seeds: anakin_ppo's `{y}_seed0`, `{y}_seed1`, ... if any, else `y`."""
    pattern = re.compile(re.escape(y) + r"_seed(\d+)")
    found = {int(m[1]): key for row in run.rows for key in row if (m := pattern.fullmatch(key))}
    if found:
        return [found[i] for i in sorted(found)]
    return [y] if any(y in row for row in run.rows) else []


def seconds(run):
    """Training seconds at each row, from charts/SPS (no script logs a clock).

    Each of the four scripts measures a row's SPS over exactly the steps since its previous
    row (anakin_ppo over all its seeds' steps, global_step counting one seed's), so that window
    lasted step increment x num_seeds / SPS seconds. Summed, this is the time the training loop
    ran: the Anakin scripts leave compilation out of SPS, the Sebulba ones count it in their
    first row. The first row counts from step 0, which overstates it for a resumed run
    (--join counts a resumption's first row from the last row before it).
    """
    if not all(number(row.get("charts/SPS")) and row["charts/SPS"] > 0 for row in run.rows):
        fail(f"{run.folder}: --x time needs charts/SPS > 0 in every row of metrics.jsonl")
    steps = np.array([row["global_step"] for row in run.rows], dtype=float)
    sps = np.array([row["charts/SPS"] for row in run.rows], dtype=float)
    return np.cumsum(np.diff(steps, prepend=0.0) * run.num_seeds / sps)


def x_values(run, x_axis):
    """The x of every row of `run`: training seconds or global_step."""
    return seconds(run) if x_axis == "time" else np.array([row["global_step"] for row in run.rows], dtype=float)


def seed_series(run, y, x_axis):
    """One (x, y) pair of arrays per seed of `run`, from the rows that hold the value."""
    xs = x_values(run, x_axis)
    series = []
    for column in seed_columns(run, y):
        kept = [i for i, row in enumerate(run.rows) if column in row]
        if bad := next((run.rows[i] for i in kept if not number(run.rows[i][column])), None):
            fail(f"{run.folder}: {column} should be a number in every row that has it, not "
                 f"{textwrap.shorten(json.dumps(bad[column]), 60)} (at global_step {bad['global_step']})")
        series.append((xs[kept], np.array([run.rows[i][column] for i in kept], dtype=float)))
    return series


def group_seeds(runs, y, x_axis):
    """{(env_id, exp_name): [(x, y) per seed]}, in the order the runs were given."""
    groups = {}
    for run in runs:
        groups.setdefault((run.env_id, run.exp_name), []).extend(seed_series(run, y, x_axis))
    return {key: seeds for key, seeds in groups.items() if seeds}


def join(runs, x_axis):
    """--join: the runs of each script, env id and seed as one run and its resumptions. Returns the
    joined runs and {env_id: x of each resumption's start}."""
    pieces, joined, resumes = {}, [], {}
    for run in runs:
        if run.rows:
            pieces.setdefault((run.flags, run.env_id, run.seed), []).append(run)
        else:  # left out later, with a warning
            joined.append(run)
    for (_, env_id, _), group in pieces.items():
        group.sort(key=lambda run: run.rows[0]["global_step"])
        for before, after in zip(group, group[1:]):
            if after.rows[0]["global_step"] <= before.rows[-1]["global_step"]:
                fail(f"--join: {after.folder} and {before.folder} have the same script, env id and seed but "
                     f"overlap (one does not start after the other's last step)")
        run = group[0]._replace(rows=[row for piece in group for row in piece.rows])
        starts = list(itertools.accumulate(len(piece.rows) for piece in group))[:-1]
        joined.append(run)
        resumes.setdefault(env_id, []).extend(x_values(run, x_axis)[starts])
    return joined, resumes


def make_curve(label, seeds):
    """Mean and min-max over seeds, each interpolated onto their common x values."""
    start, end = max(x[0] for x, _ in seeds), min(x[-1] for x, _ in seeds)
    if start > end:
        fail(f"the seeds of {label} share no x range (one ends before another starts)")
    grid = np.unique(np.concatenate([x for x, _ in seeds]))
    grid = grid[(grid >= start) & (grid <= end)]
    ys = np.array([np.interp(grid, x, y) for x, y in seeds])
    return Curve(label, grid, ys.mean(0), ys.min(0), ys.max(0))


def new_figure(size):
    """An empty figure that only ever goes to a file (matplotlib is imported here, as it takes a
    second: bad input is answered before that)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def plot(panels, x_axis, y, title=None):
    """The figure: one axes per Panel, with a mean line and a min-max band per curve and a grey
    broken line per reference."""
    from matplotlib.ticker import EngFormatter

    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig = new_figure((8, 5) if len(panels) == 1 else (4.5 * cols, 3.6 * rows))
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for curve in panel.curves:
            (line,) = ax.plot(curve.x, curve.mean, label=curve.label, linewidth=1.8)
            ax.fill_between(curve.x, curve.low, curve.high, color=line.get_color(), alpha=0.2, linewidth=0)
        for n, x in enumerate(panel.resumes):
            ax.axvline(x, color="0.5", linestyle=(0, (1, 3)), linewidth=1.2, label="resumed" if n == 0 else None)
        for ref, style in zip(panel.refs, itertools.cycle(["--", ":", "-."])):
            ax.axhline(ref.value, color="0.3", linestyle=style, linewidth=1.2, label=f"{ref.label} ({ref.value:g})")
        ax.set_xlabel(X_LABELS[x_axis])
        ax.set_ylabel(y)
        if x_axis == "steps":
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 1.5M steps, not 1.5e6
        ax.grid(alpha=0.3)
        if panel.name:  # each panel has its own references: its legend is inside it
            ax.set_title(panel.name, fontsize=9)
            ax.legend(fontsize=7)
    if title and not panels[0].name:
        fig.axes[0].set_title(textwrap.fill(title, 80))  # a long title wraps instead of running off the figure
    elif title:  # above the panels, whose own titles name their envs
        fig.suptitle(textwrap.fill(title, 100))
    if not panels[0].name:  # below the axes: labels carry long env ids and must not hide the curves
        fig.legend(loc="outside lower center", ncols=2 if len(fig.axes[0].get_lines()) > 3 else 1, frameon=False)
    return fig


def measured(column):
    """benchmark.json's measured columns, as opposed to those that say what was run."""
    return (column.endswith("SPS") or column == "ratio" or column.startswith("compile")
            or column.split()[-1].startswith("s/"))


def read_speed(path):
    """(machine, [Bar per row]) of benchmark.json; its figures are strings like "1,461"."""
    path = Path(path)
    if not path.is_file():
        fail(f"--speed {path}: no such file (python tests/benchmark.py writes benchmark.json)")
    data, bars = read_json(path, path.read_text()), []
    cases = {case: rows for case, rows in data.items() if case != "machine"} if isinstance(data, dict) else {}
    for case, rows in cases.items():
        if not (isinstance(rows, list) and all(isinstance(row, dict) for row in rows)):
            fail(f"--speed {path}: {case} should be a list of rows, each a JSON object")
        for row in rows:
            bound = next((c for c in row if c.endswith("SPS") and c != "train SPS"), None)
            try:
                train, limit = (float(str(row[c]).replace(",", "")) for c in ("train SPS", bound))
            except (KeyError, ValueError):
                fail(f"--speed {path}: a {case} row has no numeric 'train SPS' and bound '... SPS' columns: {row}")
            if not (0 < train < math.inf and 0 < limit < math.inf):  # a log scale and a ratio need both
                fail(f"--speed {path}: a {case} row's 'train SPS' and '{bound}' should be above 0: {row}")
            label = ", ".join(f"{c} {v}" for c, v in row.items() if not measured(c))
            bars.append(Bar(f"{case}: {label}", train, limit, bound))
    if not bars:
        fail(f"--speed {path}: no benchmark rows in it")
    return data.get("machine"), bars


def plot_speed(bars, machine, title=None):
    """Two bars a row, training SPS and its bound, on a log scale; the ratio at the training bar's end."""
    fig = new_figure((10, 1.6 + 0.5 * len(bars)))
    ax = fig.add_subplot()
    y = np.arange(len(bars))[::-1]
    bounds = sorted({bar.bound_name for bar in bars})
    ax.barh(y + 0.2, [bar.bound for bar in bars], height=0.4, color="0.75", label=f"bound: {' or '.join(bounds)}")
    ax.barh(y - 0.2, [bar.train for bar in bars], height=0.4, color="C0", label="train SPS")
    for yi, bar in zip(y, bars):
        ax.text(bar.train, yi - 0.2, f" {bar.train / bar.bound:.0%}", va="center", fontsize=8)
    ax.set_yticks(y, [bar.label for bar in bars], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("environment steps per second (log scale)")
    ax.grid(axis="x", alpha=0.3)
    fig.suptitle(textwrap.fill(title or f"training SPS against its bound ({machine or 'machine not recorded'})", 100))
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    return fig


def reference(text):
    """--ref "LABEL=VALUE[@ENV]" -> Ref."""
    label, _, value = text.rpartition("=")
    value, _, where = value.partition("@")
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not label.strip() or not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{text!r} is not LABEL=VALUE with a finite number, e.g. \"random play=0.46\"")
    return Ref(label.strip(), number, where.strip())


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.error = fail  # one `error:` line and status 2, as for every other bad input
    parser.add_argument("runs", nargs="*", metavar="RUN_FOLDER", help="run folders holding metrics.jsonl")
    parser.add_argument("--speed", type=Path, metavar="BENCHMARK_JSON", help="draw benchmark.json instead of runs")
    parser.add_argument("--pack", action="store_true",
                        help="instead of drawing, make the run folders light to keep in the repository")
    parser.add_argument("-o", "--output", type=Path, help="picture to write (.png, .pdf, .svg)")
    parser.add_argument("--x", choices=X_LABELS, default="steps", help="global_step, or training seconds")
    parser.add_argument("--y", default="charts/episodic_return", help="scalar to plot")
    parser.add_argument("--ref", type=reference, action="append", default=[], metavar="LABEL=VALUE[@ENV]",
                        help="horizontal reference line, e.g. \"random play=0.46\" (repeatable); @ENV: only "
                             "in the panels whose env id contains ENV")
    parser.add_argument("--panels", action="store_true", help="one panel per env id")
    parser.add_argument("--join", action="store_true",
                        help="the folders of one script, env id and seed are one run and its resumptions")
    parser.add_argument("--title", help="title above the plot")
    args = parser.parse_args(argv)
    if args.pack:
        if not args.runs or args.speed or args.output:
            fail("--pack takes run folders and nothing else: python tests/plot.py --pack RUN_FOLDER...")
        return args
    if not args.runs and not args.speed:
        fail("nothing to draw: give run folders or --speed benchmark.json, and -o FILE")
    if args.runs and args.speed:
        fail("give run folders, or --speed benchmark.json, not both")
    if args.output is None:
        fail("-o FILE is needed: the picture to write")
    if not args.panels and any(ref.where for ref in args.ref):
        fail("a --ref ending in @ENV needs --panels")
    if not args.output.parent.is_dir():
        fail(f"-o {args.output}: folder {args.output.parent} does not exist")
    check_writable(args.output)
    return args


def partial(output):
    """Where a picture is drawn before it is moved into place: a full disk never leaves half a picture."""
    return output.with_name(output.name + ".part")


def check_writable(output):
    """The picture is written after all the reading and drawing: whether it can be is found out before."""
    if output.is_dir() or (output.exists() and not output.is_file()):
        fail(f"-o {output}: {'a folder' if output.is_dir() else 'not a regular file'}; it takes a picture's name")
    try:
        partial(output).open("wb").close()
        partial(output).unlink()
    except OSError as e:
        fail(f"-o {output}: cannot write there ({e.strerror or e})")


def main(argv=None):
    """Plot, write the picture and return the figure."""
    args = parse_args(argv)
    if args.pack:
        for folder in args.runs:
            rows, size = pack(folder)
            over = f", over the budget of {RUN_BUDGET:,}: log less often" if size > RUN_BUDGET else ""
            left = [name for name in METRICS[1:] if (Path(folder) / name).is_file()]
            more = f"; its run logged on meanwhile into {' and '.join(left)}: pack it again once the run has ended"
            print(f"packed {folder}: {rows:,} rows, {size:,} bytes{over}{more if left else ''}")
        return None
    if args.speed:
        machine, bars = read_speed(args.speed)
        return save(plot_speed(bars, machine, args.title), args.output)
    runs, resumes = [read_run(folder) for folder in args.runs], {}
    if args.join:
        runs, resumes = join(runs, args.x)
    groups = group_seeds(runs, args.y, args.x)
    if not groups:
        names = sorted({key for run in runs for row in run.rows for key in row} - {"global_step"})
        fail(f"--y {args.y}: no run has this scalar (they have: {', '.join(names) or 'no rows'})")
    for run in runs:
        if not seed_columns(run, args.y):
            print(f"warning: {run.folder} has no {args.y}; left out", file=sys.stderr)
    name = lambda env_id, exp_name: exp_name if args.panels else f"{env_id} · {exp_name}"  # a panel names its env
    curves = {key: make_curve(f"{name(*key)} ({len(seeds)} seed{'s' * (len(seeds) > 1)})", seeds)
              for key, seeds in groups.items()}
    if not args.panels:
        panels = [Panel(None, list(curves.values()), args.ref, [x for xs in resumes.values() for x in xs])]
    else:
        envs = dict.fromkeys(env_id for env_id, _ in curves)
        panels = [Panel(env, [c for (e, _), c in curves.items() if e == env], [r for r in args.ref if r.where in env],
                        resumes.get(env, [])) for env in envs]
    return save(plot(panels, args.x, args.y, args.title), args.output)


def save(fig, output):
    try:  # the format is the output's, not the partial file's
        fig.savefig(partial(output), format=output.suffix[1:].lower() or "png", dpi=150)
        os.replace(partial(output), output)
    except (ValueError, OSError) as e:  # an unknown format (matplotlib lists the ones it knows), a full disk
        partial(output).unlink(missing_ok=True)
        fail(f"-o {output}: {e}" if isinstance(e, ValueError) else f"-o {output}: cannot write it ({e.strerror or e})")
    print(f"wrote {output}")
    return fig


if __name__ == "__main__":
    main()
