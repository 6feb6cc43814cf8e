"""tests/plot.py: seeds grouped into mean curves with min-max bands, --x time, --ref, --speed, --pack, bad input;
the run folders kept in tests/figures/runs/ within their size budget."""

import json
import lzma
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.patches import Rectangle

from conftest import ROOT, command, error_line, load, run

plot = load("tests/plot.py")
SCRIPT = "tests/plot.py"
RETURN = "charts/episodic_return"
STEPS = np.arange(1, 6) * 100.0  # global_step of the five rows every synthetic run logs


def write_run(root, env_id, exp_name, seed, rows, with_args=True, **flags):
    """A run folder as the scripts leave it: args.json (unless `with_args` is False, with `flags` added)
    and metrics.jsonl."""
    folder = root / f"{env_id}__{exp_name}__{seed}__{1700000000 + seed}"
    folder.mkdir(parents=True)
    args = {"env_id": env_id, "exp_name": exp_name, "seed": seed, **flags}
    if with_args:
        (folder / "args.json").write_text(json.dumps(args))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def quiet_for_an_hour(folder):
    """The folder of a run whose last row is an hour old: one that has ended, or one that logs that seldom."""
    an_hour_ago = time.time() - 3600
    for path in folder.iterdir():
        os.utime(path, (an_hour_ago, an_hour_ago))
    return folder


def run_small_disk(argv, tmp_path, kib):
    """plot.py allowed to write files of `kib` KiB at most (`ulimit -f`): a longer write fails, as on a full disk."""
    line = f"ulimit -f {kib} && exec {shlex.join(command(SCRIPT, argv))}"
    return subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def packed_rows(folder):
    return [json.loads(line) for line in lzma.decompress((folder / "metrics.jsonl.xz").read_bytes()).splitlines()]


def rows(returns, steps=STEPS, sps=50.0):
    """metrics.jsonl rows; `sps` is one figure or one per row."""
    sps = np.broadcast_to(sps, len(steps))
    return [{"global_step": int(s), "charts/SPS": float(v), RETURN: float(r)} for s, v, r in zip(steps, sps, returns)]


def seed_returns(seed):
    return np.linspace(0, 10, len(STEPS)) * (1 + seed / 10)


@pytest.fixture
def folders(tmp_path):
    """3 seeds of sebulba_impala, 2 of anakin_catch, one anakin_ppo run of 4 seeds in columns."""
    impala = [write_run(tmp_path, "Breakout-v5", "sebulba_impala", s, rows(seed_returns(s))) for s in (1, 2, 3)]
    catch = [write_run(tmp_path, "Catch", "anakin_catch", s, rows(seed_returns(s) - 5)) for s in (1, 2)]
    ppo_rows = rows(np.full(len(STEPS), -99.0))  # the mean column: must not be taken as a seed
    for row, step in zip(ppo_rows, STEPS):
        row.update({f"{RETURN}_seed{i}": step / 100 * i for i in range(4)})
    ppo = write_run(tmp_path, "CartPole-v1", "anakin_ppo", 1, ppo_rows, num_seeds=4)
    return impala + catch + [ppo]


def draw(folders, tmp_path, *extra):
    out = tmp_path / "out.png"
    fig = plot.main([*map(str, folders), "-o", str(out), *extra])
    return fig, out


def curves(fig):
    """{legend label: mean Line2D}, bands and the reference lines of the figure's one axes."""
    (ax,) = fig.axes
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    means = {line.get_label(): line for line in ax.get_lines() if line.get_linestyle() == "-"}
    refs = [line for line in ax.get_lines() if line.get_linestyle() != "-"]
    return means, bands, refs


def test_each_configuration_is_one_mean_line_and_band_over_its_seeds(folders, tmp_path):
    fig, out = draw(folders, tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    means, bands, refs = curves(fig)
    assert sorted(means) == ["Breakout-v5 · sebulba_impala (3 seeds)", "CartPole-v1 · anakin_ppo (4 seeds)",
                             "Catch · anakin_catch (2 seeds)"]
    assert len(bands) == 3 and refs == []
    impala = means["Breakout-v5 · sebulba_impala (3 seeds)"]
    np.testing.assert_allclose(impala.get_xdata(), STEPS)
    np.testing.assert_allclose(impala.get_ydata(), np.mean([seed_returns(s) for s in (1, 2, 3)], axis=0))
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert sorted(legend) == sorted(means)


def test_anakin_ppo_seed_columns_are_the_seeds_of_its_curve(folders, tmp_path):
    fig, _ = draw(folders[-1:], tmp_path)
    means, (band,), _ = curves(fig)
    columns = np.array([STEPS / 100 * i for i in range(4)])  # [seed, row]
    np.testing.assert_allclose(means["CartPole-v1 · anakin_ppo (4 seeds)"].get_ydata(), columns.mean(0))
    low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert (low, high) == (columns.min(), columns.max())


def test_seeds_are_interpolated_onto_the_range_all_of_them_cover(tmp_path):
    a = write_run(tmp_path, "Catch", "anakin_catch", 1, rows([0, 10, 20, 30, 40], steps=[0, 100, 200, 300, 400]))
    b = write_run(tmp_path, "Catch", "anakin_catch", 2, rows([0, 30, 60], steps=[50, 200, 350]))
    fig, _ = draw([a, b], tmp_path)
    (mean,) = curves(fig)[0].values()
    grid = np.array([50, 100, 200, 300, 350])  # both seeds' steps between 50 and 350
    expected = (grid / 10 + (grid - 50) / 5) / 2  # each seed's returns are linear in its steps
    np.testing.assert_allclose(mean.get_xdata(), grid)
    np.testing.assert_allclose(mean.get_ydata(), expected)


def test_x_time_adds_up_step_increments_over_sps_times_num_seeds(tmp_path):
    steps, sps = [100, 200, 300], np.array([10.0, 20.0, 50.0])
    catch = write_run(tmp_path, "Catch", "anakin_catch", 1, rows([1, 2, 3], steps, sps))
    ppo = write_run(tmp_path, "Catch", "anakin_ppo", 1, rows([1, 2, 3], steps, 4 * sps), num_seeds=4)
    fig, _ = draw([catch, ppo], tmp_path, "--x", "time")
    means = curves(fig)[0]
    for line in means.values():
        np.testing.assert_allclose(line.get_xdata(), [10, 15, 17])  # 100/10, +100/20, +100/50 seconds
    assert fig.axes[0].get_xlabel() == "training wall-clock seconds"


def test_reference_lines_are_drawn_and_named_in_the_legend(folders, tmp_path):
    fig, _ = draw(folders[:3], tmp_path, "--ref", "random play=0.46", "--ref", "published = 7.5", "--title", "T")
    means, bands, refs = curves(fig)
    assert len(means) == len(bands) == 1
    assert [line.get_ydata()[0] for line in refs] == [0.46, 7.5]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "random play (0.46)" in legend and "published (7.5)" in legend
    assert fig.axes[0].get_title() == "T"


def test_panels_give_each_env_its_own_axes_curves_and_references(folders, tmp_path):
    fig, _ = draw(folders, tmp_path, "--panels", "--ref", "r=1@Breakout", "--ref", "all=2", "--ref", "c=3@Catch",
                  "--title", "T")
    names = [ax.get_title() for ax in fig.axes]
    assert names == ["Breakout-v5", "Catch", "CartPole-v1"] and fig._suptitle.get_text() == "T"
    for ax, seeds, refs in zip(fig.axes, ("3 seeds", "2 seeds", "4 seeds"), ([1, 2], [2, 3], [2])):
        means = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        assert len(means) == 1 and means[0].get_label().endswith(f"({seeds})")
        assert ax.get_title() not in means[0].get_label()  # the panel's title names the env
        assert [line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() != "-"] == refs


def test_join_makes_one_curve_of_a_run_and_its_resumption_with_a_line_at_the_resume(tmp_path):
    first = write_run(tmp_path, "Pong-v5", "sebulba_ppo_atari", 1, rows([1, 2, 3, 4, 5]))
    resumed = write_run(tmp_path / "b", "Pong-v5", "copy", 1, rows([6, 7], steps=STEPS[-1] + STEPS[:2], sps=100.0))
    for axis, x_resume, x_last in (("steps", 600, 700), ("time", 10 + 1, 10 + 2)):  # 100 steps at 50 then 100 SPS
        fig, _ = draw([resumed, first], tmp_path, "--join", "--x", axis)  # pieces are ordered by their first step
        means, _, others = curves(fig)
        (line,) = means.values()
        assert list(line.get_ydata()) == [1, 2, 3, 4, 5, 6, 7] and line.get_xdata()[-1] == x_last
        assert [(mark.get_label(), mark.get_xdata()[0]) for mark in others] == [("resumed", x_resume)]
    assert "sebulba_ppo_atari (1 seed)" in line.get_label()  # named after the first piece
    again = write_run(tmp_path / "c", "Pong-v5", "again", 1, rows([0, 1], steps=STEPS[-1] + STEPS[:2]))
    overlap = run(SCRIPT, [first, resumed, again, "-o", tmp_path / "overlap.png", "--join"], tmp_path, run_dir=False)
    assert "have the same script, env id and seed but overlap" in error_line(overlap)
    assert not (tmp_path / "overlap.png").exists()


def test_join_keeps_two_scripts_of_one_env_and_seed_apart(tmp_path):
    ppo = write_run(tmp_path / "a", "Pong-v5", "sebulba_ppo_atari", 1, rows([1, 2, 3, 4, 5]))
    impala = write_run(tmp_path / "b", "Pong-v5", "sebulba_impala", 1, rows([5, 4, 3, 2, 1]),
                       vtrace_lambda=1.0)  # another script's flags
    means, _, _ = curves(draw([ppo, impala], tmp_path, "--join")[0])
    assert sorted(list(line.get_ydata()) for line in means.values()) == [[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]]


def test_join_with_panels_joins_each_seeds_pieces_in_its_own_panel(tmp_path):
    pieces = [write_run(tmp_path / "a", "Seaquest", "sebulba_impala", 1, rows([1, 2, 3, 4, 5])),
              write_run(tmp_path / "b", "Seaquest", "resumed", 1, rows([7, 9], steps=STEPS[-1] + STEPS[:2]))]
    seed_2 = write_run(tmp_path, "Seaquest", "sebulba_impala", 2, rows([3, 4, 5, 6, 7], steps=STEPS + 200))
    other = write_run(tmp_path, "Asterix", "sebulba_impala", 1, rows([1, 1, 1, 1, 1]))
    fig, _ = draw([other, *pieces, seed_2], tmp_path, "--join", "--panels")
    asterix, seaquest = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["Asterix", "Seaquest"]
    assert [line.get_linestyle() for line in asterix.get_lines()] == ["-"]  # nothing resumed here
    mean, resume = seaquest.get_lines()
    assert mean.get_label() == "sebulba_impala (2 seeds)" and resume.get_label() == "resumed"
    np.testing.assert_allclose(resume.get_xdata(), [600, 600])
    np.testing.assert_allclose(mean.get_xdata(), [300, 400, 500, 600, 700])  # where both seeds have steps
    np.testing.assert_allclose(mean.get_ydata(), [(3 + 3) / 2, (4 + 4) / 2, (5 + 5) / 2, (7 + 6) / 2, (9 + 7) / 2])


def test_without_args_json_the_folder_name_names_the_curve(tmp_path):
    folders = [write_run(tmp_path, "Pong-v5", "sebulba_ppo_atari", s, rows(seed_returns(s)), with_args=False)
               for s in (1, 2)]
    fig, _ = draw(folders, tmp_path)
    assert list(curves(fig)[0]) == ["Pong-v5 · sebulba_ppo_atari (2 seeds)"]
    assert fig.axes[0].get_ylabel() == RETURN


def test_a_run_without_the_scalar_is_left_out_with_a_warning(folders, tmp_path, capsys):
    no_return = write_run(tmp_path, "Catch", "anakin_catch", 9, [{"global_step": 100, "charts/SPS": 50.0}])
    fig, _ = draw([*folders[:3], no_return], tmp_path)
    assert list(curves(fig)[0]) == ["Breakout-v5 · sebulba_impala (3 seeds)"]
    assert f"warning: {no_return} has no {RETURN}; left out" in capsys.readouterr().err


def test_a_packed_run_keeps_every_row_to_six_digits_and_draws_like_its_original(tmp_path):
    values = [np.pi * 10.0**k for k in range(-3, 2)]
    original = write_run(tmp_path / "a", "Pong-v5", "sebulba_impala", 1, rows(values, sps=[1234.56789] * 5))
    packed = write_run(tmp_path / "b", "Pong-v5", "sebulba_impala", 1, rows(values, sps=[1234.56789] * 5))
    result = run(SCRIPT, ["--pack", packed], tmp_path, run_dir=False)
    assert result.returncode == 0 and f"packed {packed}: 5 rows, " in result.output
    assert sorted(p.name for p in packed.iterdir()) == ["args.json", "metrics.jsonl.xz"]
    kept = packed_rows(packed)
    assert [row["global_step"] for row in kept] == list(STEPS.astype(int))
    assert [row[RETURN] for row in kept] == [0.00314159, 0.0314159, 0.314159, 3.14159, 31.4159]
    for axis in ("steps", "time"):
        (a,), (b,) = (curves(draw([folder], tmp_path, "--x", axis)[0])[0].values() for folder in (original, packed))
        np.testing.assert_allclose(b.get_xdata(), a.get_xdata(), rtol=5e-6)  # 6 digits: 5e-6 at most
        np.testing.assert_allclose(b.get_ydata(), a.get_ydata(), rtol=5e-6)


def test_pack_keeps_the_rows_packed_before_and_those_logged_since_in_order(tmp_path):
    folder = write_run(tmp_path, "Pong-v5", "sebulba_impala", 1, rows(range(100), steps=np.arange(1, 101)))
    assert plot.pack(folder)[0] == 100
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n"  # the run logged on after the pack
                                                  for row in rows(range(100, 120), steps=np.arange(101, 121))))
    assert [row["global_step"] for row in plot.read_run(folder).rows] == list(range(1, 121))  # drawn alike
    assert plot.pack(folder)[0] == 120
    assert [row["global_step"] for row in packed_rows(folder)] == list(range(1, 121))
    assert [row[RETURN] for row in packed_rows(folder)] == list(range(120))
    assert sorted(p.name for p in folder.iterdir()) == ["args.json", "metrics.jsonl.xz"]


def names(folder):
    return sorted(path.name for path in folder.iterdir())


def test_rows_a_stopped_pack_left_aside_are_drawn_and_packed_once_with_those_logged_since(tmp_path):
    folder = write_run(tmp_path, "Pong-v5", "sebulba_impala", 1, rows([np.pi] * 5))
    plain = (folder / "metrics.jsonl").read_text()
    os.replace(folder / "metrics.jsonl", folder / "metrics.jsonl.packing")  # A pack stopped right after its move.
    assert [row["global_step"] for row in plot.read_run(folder).rows] == list(STEPS.astype(int))
    plot.pack(folder)
    (folder / "metrics.jsonl.packing").write_text(plain)  # A pack stopped after packing, before removing the file.
    # The run logged on since.
    (folder / "metrics.jsonl").write_text(json.dumps({"global_step": 600, RETURN: 6.0}) + "\n")
    assert [row["global_step"] for row in plot.read_run(folder).rows] == [*STEPS.astype(int), 600]
    assert plot.pack(folder)[0] == 6
    assert [row[RETURN] for row in packed_rows(folder)] == [3.14159] * 5 + [6.0]
    assert names(folder) == ["args.json", "metrics.jsonl.xz"]


@pytest.mark.parametrize("when", ["compress", "replace", "in flight"])
def test_a_row_a_run_logs_while_it_is_packed_is_never_lost(tmp_path, monkeypatch, capsys, when):
    """A run still going, that logs seldom (its last row an hour old), logs while it is packed: as the rows are
    compressed, at each file moved into place (the last moment before the old --pack removed metrics.jsonl), or
    (in flight) through metrics.jsonl opened just before it was moved aside and written after it was read."""
    folder = quiet_for_an_hour(write_run(tmp_path, "Pong-v5", "sebulba_impala", 1, rows(seed_returns(1))))
    logged, opened = [], []
    replace, compress = plot.os.replace, plot.lzma.compress

    def log(f=None):  # As the scripts' log() does: open metrics.jsonl, append one row, close it.
        logged.append(600 + 100 * len(logged))
        with f or open(folder / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"global_step": logged[-1], RETURN: 6.0}) + "\n")

    def replacing(source, target):
        if when == "in flight" and Path(source).name == "metrics.jsonl":
            opened.append(open(source, "a"))
        replace(source, target)
        if when == "replace":
            log()

    def compressing(data, **kwargs):
        if when in ("compress", "in flight"):
            log(opened.pop() if opened else None)
        return compress(data, **kwargs)

    monkeypatch.setattr(plot.os, "replace", replacing)
    monkeypatch.setattr(plot.lzma, "compress", compressing)
    plot.main(["--pack", str(folder)])
    monkeypatch.undo()
    assert logged and [row["global_step"] for row in plot.read_run(folder).rows] == [*STEPS.astype(int), *logged]
    left = "metrics.jsonl.packing" if when == "in flight" else "metrics.jsonl"
    assert f"; its run logged on meanwhile into {left}: pack it again once the run has ended" in capsys.readouterr().out
    assert plot.pack(folder)[0] == 5 + len(logged)
    assert [row["global_step"] for row in packed_rows(folder)] == [*STEPS.astype(int), *logged]
    assert names(folder) == ["args.json", "metrics.jsonl.xz"]


LOGGER = """import json, sys, time
for step in range(1, int(sys.argv[2]) + 1):
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"global_step": step}) + "\\n")
    time.sleep(0.0005)
"""


def test_packing_a_run_again_and_again_as_it_logs_keeps_every_row_in_order(tmp_path):
    """A real logger, appending a row every half millisecond as the scripts' log() does, races packs of its folder
    one after another: every row ends up packed, in order."""
    folder = write_run(tmp_path, "Pong-v5", "sebulba_impala", 1, [])
    logger = subprocess.Popen([sys.executable, "-c", LOGGER, str(folder / "metrics.jsonl"), "2000"])
    packs = 0
    while logger.poll() is None:
        plot.pack(folder)
        packs += 1
    assert logger.returncode == 0
    plot.pack(folder)
    assert packs >= 3, "the logger ended before the packs could race it"
    assert [row["global_step"] for row in packed_rows(folder)] == list(range(1, 2001))
    assert names(folder) == ["args.json", "metrics.jsonl.xz"]


def test_a_pack_that_cannot_be_written_loses_no_row_and_the_next_one_finishes_it(tmp_path):
    folder = write_run(tmp_path, "Pong-v5", "sebulba_impala", 1, rows(range(100), steps=np.arange(1, 101)))
    plot.pack(folder)
    more = rows(np.random.default_rng(0).random(3000), steps=np.arange(101, 3101))  # noise: xz shrinks it little
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in more))
    before = plot.read_run(folder).rows
    result = run_small_disk(["--pack", folder], tmp_path, kib=4)  # the new file takes about 14 KB
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"error: --pack {folder}: cannot write metrics.jsonl.xz (File too large); no row was "
                             "lost: those not packed wait in metrics.jsonl.packing, which the drawing reads and the "
                             "next --pack takes up\n")
    assert names(folder) == ["args.json", "metrics.jsonl.packing", "metrics.jsonl.xz"]
    assert plot.read_run(folder).rows == before
    assert plot.pack(folder)[0] == 3100
    assert names(folder) == ["args.json", "metrics.jsonl.xz"]


def run_read_only(argv, folder, tmp_path):
    """plot.py with `folder` bind-mounted read-only in a mount namespace of its own (root writes past chmod, not past
    a read-only mount; the mount ends with the process). Skips the test where unshare or mount is not allowed."""
    mount = f"mount --bind {shlex.quote(str(folder))} {shlex.quote(str(folder))} && " \
            f"mount -o remount,ro,bind {shlex.quote(str(folder))}"
    try:
        probe = subprocess.run(["unshare", "-rm", "bash", "-c", f"{mount} && ! touch {shlex.quote(str(folder))}/w"],
                               capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        probe = None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here ({probe.stderr.strip() if probe else 'no unshare'})")
    line = f"{mount} && exec {shlex.join(command(SCRIPT, argv))}"
    return subprocess.run(["unshare", "-rm", "bash", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_a_pack_in_a_read_only_folder_is_one_error_line_and_changes_nothing(tmp_path):
    folder = write_run(tmp_path, "Pong-v5", "sebulba_impala", 1, rows(seed_returns(1)))
    for cannot in ("move metrics.jsonl aside to pack it", "write metrics.jsonl.xz"):  # a plain folder, a packed one
        before = {path.name: path.read_bytes() for path in folder.iterdir()}
        result = run_read_only(["--pack", folder], folder, tmp_path)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr == (f"error: --pack {folder}: cannot {cannot} (Read-only file system); nothing was "
                                 "changed\n")
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
        plot.pack(folder)


def test_a_last_line_cut_off_by_a_kill_is_left_out_with_a_note(tmp_path, capsys):
    folder = write_run(tmp_path, "Catch", "anakin_catch", 1, rows(seed_returns(1)))
    with open(folder / "metrics.jsonl", "a") as f:
        f.write('{"global_step": 600, "charts/SP')
    (mean,) = curves(draw([folder], tmp_path)[0])[0].values()
    np.testing.assert_allclose(mean.get_xdata(), STEPS)
    assert f"note: {folder / 'metrics.jsonl'} line 6 was cut off (a killed run?): left out" in capsys.readouterr().err


def test_each_kept_run_folder_is_packed_and_within_its_budget():
    """tests/figures/README.md, "Adding a run": args.json and metrics.jsonl.xz, at most plot.RUN_BUDGET bytes."""
    folders = {path.parent for path in (ROOT / "tests/figures/runs").rglob("args.json")}
    assert len(folders) >= 90  # the kept runs (97 at the time of writing) are all found
    for folder in sorted(folders):
        files = {path.name: path.stat().st_size for path in folder.iterdir()}
        assert sorted(files) == ["args.json", "metrics.jsonl.xz"], folder
        assert sum(files.values()) <= plot.RUN_BUDGET, f"{folder}: {sum(files.values()):,} bytes"
        assert plot.read_run(folder).rows


def test_the_figures_leave_room_for_the_gpu_copy():
    """The repository and the GPU bundle (tests/figures/README.md, "Copying to a GPU machine": 55.2 MB) fit
    the 64 MiB that can be copied to a GPU machine: pictures and runs take at most 10.5 MB of it."""
    size = sum(path.stat().st_size for path in Path(ROOT / "tests/figures").rglob("*") if path.is_file())
    assert size <= 10_500_000, f"tests/figures holds {size:,} bytes"


BENCHMARK = {  # as tests/benchmark.py writes it: figures are formatted strings
    "machine": "x86_64, 2 CPU cores",
    "catch": [{"devices": 1, "envs/device": 128, "train SPS": "120,000", "rollout-only SPS": "480,000",
               "ratio": "25%", "compile s (train)": 4.0},
              {"devices": 2, "envs/device": 128, "train SPS": "150,000", "rollout-only SPS": "750,000",
               "ratio": "20%", "compile s (train)": 4.5}],
    "impala": [{"env": "Breakout-v5", "network": "shallow", "train SPS": "816", "raw env SPS": "971",
                "ratio": "84.1%", "s/update": "0.391"}],
}


def test_speed_draws_training_sps_beside_its_bound_for_every_row(tmp_path):
    (tmp_path / "benchmark.json").write_text(json.dumps(BENCHMARK))
    out = tmp_path / "speed.png"
    fig = plot.main(["--speed", str(tmp_path / "benchmark.json"), "-o", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    widths = sorted(bar.get_width() for bar in ax.patches if isinstance(bar, Rectangle))
    assert widths == sorted([120_000, 480_000, 150_000, 750_000, 816, 971])  # a training and a bound bar per row
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "catch: devices 1, envs/device 128", "catch: devices 2, envs/device 128",
        "impala: env Breakout-v5, network shallow"]
    assert list(ax.get_yticks()) == [2, 1, 0]  # the first row on top
    assert sorted(t.get_text().strip() for t in ax.texts) == ["20%", "25%", "84%"]
    assert ax.get_xscale() == "log" and "x86_64, 2 CPU cores" in fig.get_suptitle()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["bound: raw env SPS or rollout-only SPS", "train SPS"]


def bad_input(tmp_path, folder, *flags):
    """Run plot.py on bad input; assert one `error:` line (nothing else), status 2, no picture."""
    out = tmp_path / "out.png"
    result = run(SCRIPT, [folder, "-o", out, *flags], tmp_path, run_dir=False)
    line = error_line(result)
    assert result.output.strip() == line and not out.exists()
    return line


@pytest.mark.parametrize("metrics, expected", [
    (None, "no metrics.jsonl in"),
    ('{"global_step": 100\n{"global_step": 200}\n', "metrics.jsonl line 1 is not valid JSON"),
    ('{"global_step": 100}\n{"global_st\n', "metrics.jsonl line 2 is not valid JSON"),
    ('{"charts/SPS": 1.0}\n', "every line should be a JSON object with a global_step"),
])
def test_a_bad_run_folder_is_an_error(tmp_path, metrics, expected):
    folder = tmp_path / "Catch__anakin_catch__1__1700000001"
    folder.mkdir()
    if metrics is not None:
        (folder / "metrics.jsonl").write_text(metrics)
    assert expected in bad_input(tmp_path, folder)


def test_a_damaged_packed_file_is_an_error(tmp_path):
    folder = tmp_path / "Catch__anakin_catch__1__1700000001"
    folder.mkdir()
    (folder / "metrics.jsonl.xz").write_bytes(lzma.compress(b'{"global_step": 100}\n')[:-8])
    assert "metrics.jsonl.xz cannot be read" in bad_input(tmp_path, folder)


@pytest.mark.parametrize("argv, expected", [
    ([], "nothing to draw: give run folders or --speed benchmark.json, and -o FILE"),
    (["{folder}"], "-o FILE is needed"),
    (["--pack", "{folder}", "-o", "out.png"], "--pack takes run folders and nothing else"),
])
def test_a_command_missing_its_parts_says_what_is_missing(tmp_path, argv, expected):
    folder = write_run(tmp_path, "Catch", "anakin_catch", 1, rows(seed_returns(1)))
    result = run(SCRIPT, [a.format(folder=folder) for a in argv], tmp_path, run_dir=False)
    assert expected in error_line(result) and (folder / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, expected", [
    (["--y", "losses/nothing"], "--y losses/nothing: no run has this scalar (they have: charts/SPS, charts/episodic"),
    (["--ref", "random play"], "argument --ref: 'random play' is not LABEL=VALUE"),
    (["--ref", "random play=lots"], "is not LABEL=VALUE"),
    (["--ref", "=0.46"], "is not LABEL=VALUE"),
    (["--ref", "x=nan"], "is not LABEL=VALUE"),
    (["-o", "{tmp}/no/such/out.png"], "no/such does not exist"),
    (["-o", "{tmp}/out.pgn"], "Format 'pgn' is not supported"),
    (["--x", "hours"], "invalid choice: 'hours'"),
    (["--ref", "random=0.5@Asterix"], "a --ref ending in @ENV needs --panels"),
    (["--speed", "benchmark.json"], "give run folders, or --speed benchmark.json, not both"),
    (["--pack"], "--pack takes run folders and nothing else"),
    (["-o", "{tmp}"], "-o {tmp}: a folder; it takes a picture's name"),
    (["-o", "/dev/null"], "-o /dev/null: not a regular file"),
    (["-o", "/sys/out.png"], "-o /sys/out.png: cannot write there ("),  # even for root
])
def test_bad_flags_are_one_error_line_and_status_2(tmp_path, flags, expected):
    folder = write_run(tmp_path, "Catch", "anakin_catch", 1, rows(seed_returns(1)))
    assert expected.format(tmp=tmp_path) in bad_input(tmp_path, folder, *(f.format(tmp=tmp_path) for f in flags))


@pytest.mark.parametrize("metrics, args, expected", [
    ('{"global_step": "100"}\n', None, 'a global_step that is a number (line 1: {"global_step": "100"})'),
    ('{"global_step": 100, "charts/episodic_return": [1, 2]}\n', None,
     "charts/episodic_return should be a number in every row that has it, not [1, 2] (at global_step 100)"),
    ('{"global_step": 100, "charts/episodic_return": 1}\n', [1], "args.json should hold a JSON object"),
    ('{"global_step": 100, "charts/episodic_return": 1}\n', {"env_id": ["Catch"]},
     'env_id should be a string, not ["Catch"]'),
    ('{"global_step": 100, "charts/episodic_return": 1}\n', {"num_seeds": "4"},
     'num_seeds should be a whole number of at least 1, not "4"'),
])
def test_damaged_run_data_is_one_error_line_before_any_drawing(tmp_path, metrics, args, expected):
    folder = tmp_path / "Catch__anakin_catch__1__1700000001"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(metrics)
    if args is not None:
        (folder / "args.json").write_text(json.dumps(args))
    assert expected in bad_input(tmp_path, folder)


def test_time_needs_numeric_sps(tmp_path):
    folder = write_run(tmp_path, "Catch", "anakin_catch", 1, [{"global_step": 100, "charts/SPS": "fast", RETURN: 1}])
    assert "--x time needs charts/SPS > 0 in every row" in bad_input(tmp_path, folder, "--x", "time")


def test_a_picture_that_cannot_be_written_whole_leaves_no_file(folders, tmp_path):
    out = tmp_path / "out.png"
    result = run_small_disk([*folders, "-o", out], tmp_path, kib=4)  # the picture takes about 60 KB
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: -o {out}: cannot write it (File too large)\n"
    assert not out.exists() and not (tmp_path / "out.png.part").exists()


@pytest.mark.parametrize("text, expected", [
    (None, "no such file"),
    ("{", "benchmark.json is not valid JSON"),
    ('{"machine": "m"}', "no benchmark rows in it"),
    ('{"catch": [{"devices": 1, "train SPS": "fast"}]}', "a catch row has no numeric 'train SPS'"),
    ('{"catch": [{"train SPS": "10", "raw env SPS": "0"}]}', "a catch row's 'train SPS' and 'raw env SPS' should be "
                                                             "above 0"),
    ('{"catch": {"train SPS": "10"}}', "catch should be a list of rows, each a JSON object"),
])
def test_bad_speed_input_is_one_error_line(tmp_path, text, expected):
    if text is not None:
        (tmp_path / "benchmark.json").write_text(text)
    assert expected in bad_input(tmp_path, f"--speed={tmp_path / 'benchmark.json'}")
