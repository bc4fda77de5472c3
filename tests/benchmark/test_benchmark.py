"""benchmark/: the launcher on a fake script, the registry's numbers against statistics computed here from the same
inputs, its plots, and every flag that benchmark/*.sh passes to a script against that script's --help."""

import functools
import glob
import itertools
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, subprocess_env

from benchmark.statistics import registry
from benchmark.statistics import run as launcher

# A stand-in for a real script: same run folder layout (runs/{task}__{exp_name}__{seed}__{unix_time}/config.json and
# metrics.jsonl), the same --seed/--output_dir/--exp_name/--track/--wandb_tags flags; --fail_seed makes one seed fail.
FAKE_SCRIPT = textwrap.dedent(
    """
    import argparse, json, os, sys, time
    start = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output_dir", default="runs")
    parser.add_argument("--exp_name", default="fake")
    parser.add_argument("--track", action="store_true")
    parser.add_argument("--wandb_tags", nargs="*", default=[])
    parser.add_argument("--fail_seed", type=int, default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    print(f"seed {args.seed} starting")
    if args.seed == args.fail_seed:
        print("simulated failure", file=sys.stderr)
        sys.exit(3)
    run_dir = os.path.join(args.output_dir, f"task__{args.exp_name}__{args.seed}__{int(time.time())}")
    os.makedirs(run_dir)
    time.sleep(args.sleep)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(4):
            line = {"global_step": step, "episode": 8 * step, "time": 0.5 * step, "eval/accuracy": args.seed + step}
            f.write(json.dumps(line) + "\\n")
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"args": {**vars(args), "start": start, "end": time.time()}, "git_sha": "f" * 40}, f)
    print(f"done: {run_dir}")
    """
)


def launch(cwd, *argv):
    return subprocess.run(
        [sys.executable, "-m", "benchmark.statistics.run", *argv],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def fake_script(tmp_path):
    (tmp_path / "fake.py").write_text(FAKE_SCRIPT)
    return tmp_path


# ---------------------------------------------------------------------------------------------------------------
# Launcher


def test_launcher_runs_seeds_in_parallel_and_tags_them(fake_script):
    result = launch(
        fake_script, "--script", "fake.py", "--seeds", "1", "2", "--workers", "2", "--track", "--", "--sleep", "1"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for seed in (1, 2):
        assert re.search(rf"\[seed {seed}\] \S+ fake.py --seed {seed} --sleep 1 --track --wandb_tags ", out), out
    assert "all 2 seed(s) succeeded" in out

    runs = registry.find_runs(str(fake_script / "runs" / "task__fake__*"))
    assert [run["seed"] for run in runs] == [1, 2]
    sha = launcher.git_sha()
    for run in runs:
        assert run["args"]["track"] is True and run["args"]["wandb_tags"] == [sha or "no-git"]
        assert os.path.join("runs", run["name"]) in out  # the summary names the run folder
        assert registry.final_value(run["lines"], "eval/accuracy") == run["seed"] + 3
    # Two workers: both seeds ran at the same time.
    assert max(r["args"]["start"] for r in runs) < min(r["args"]["end"] for r in runs)
    # One log per seed under runs/_logs, and nothing written anywhere else.
    logs = sorted(os.listdir(fake_script / "runs" / "_logs"))
    assert [name.split("__")[:2] for name in logs] == [["fake", "1"], ["fake", "2"]]
    for name, seed in zip(logs, (1, 2)):
        assert f"seed {seed} starting" in (fake_script / "runs" / "_logs" / name).read_text()
    assert sorted(os.listdir(fake_script)) == ["fake.py", "runs"]


def test_launcher_failing_seed_does_not_stop_the_others(fake_script):
    result = launch(
        fake_script, "--script", "fake.py", "--seeds", "1", "2", "--workers", "2", "--", "--fail_seed", "1"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED: seed(s) 1 of 2" in result.stdout
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if re.match(r"[12] ", line)}
    assert rows["1"][1:4] == ["3", "not", "found"]
    assert rows["2"][1] == "0" and rows["2"][2].startswith(os.path.join("runs", "task__fake__2__"))
    assert [run["seed"] for run in registry.find_runs(str(fake_script / "runs" / "task__*"))] == [2]
    (log,) = glob.glob(str(fake_script / "runs" / "_logs" / "fake__1__*.log"))
    assert "simulated failure" in open(log).read()


def test_launcher_dry_run_only_prints(fake_script):
    result = launch(
        fake_script,
        *("--script", "fake.py", "--seeds", "3", "4", "--workers", "2", "--dry_run"),
        *("--accelerate_config", "cfg.yaml", "--num_processes", "2", "--", "--exp_name", "x"),
    )
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert commands == [
        [
            sys.executable,
            *("-m", "accelerate.commands.launch", "--config_file", "cfg.yaml", "--num_processes", "2"),
            *("--main_process_port", str(29500 + i), "fake.py", "--seed", str(seed), "--exp_name", "x"),
        ]
        for i, seed in enumerate((3, 4))
    ]
    assert sorted(os.listdir(fake_script)) == ["fake.py"]


def test_launcher_resume_unfinished_skips_finished_runs_and_resumes_checkpointed_ones(fake_script):
    """An experiment that spans sessions: seed 1 finished (its metrics reach total_steps), seed 2 was killed after a
    checkpoint, seed 3 before its first one, seed 4 never started; another exp_name's finished run is not seed 2's."""

    def run_folder(name, seed, exp_name, last_step, checkpoint):
        path = fake_script / "runs" / name
        (path / "checkpoints" / "step_000002" if checkpoint else path).mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({"args": {"seed": seed, "exp_name": exp_name, "total_steps": 4}}))
        lines = [json.dumps({"global_step": step}) for step in range(last_step + 1)]
        (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return os.path.join("runs", name)

    run_folder("task__x__1__100", 1, "x", last_step=4, checkpoint=True)
    resumable = run_folder("task__x__2__100", 2, "x", last_step=3, checkpoint=True)
    run_folder("task__y__2__100", 2, "y", last_step=4, checkpoint=True)
    run_folder("task__x__3__100", 3, "x", last_step=0, checkpoint=False)
    argv = ("--script", "fake.py", "--seeds", "1", "2", "3", "4", "--dry_run", "--resume_unfinished", "--")
    result = launch(fake_script, *argv, "--exp_name", "x")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        f"[seed 1] {os.path.join('runs', 'task__x__1__100')}: finished",
        f"[seed 2] {resumable}: resumable",
        f"[seed 3] {os.path.join('runs', 'task__x__3__100')}: empty",
    ]
    assert [shlex.split(line)[1:] for line in lines[3:]] == [
        ["fake.py", "--seed", "2", "--exp_name", "x", "--resume", resumable],
        ["fake.py", "--seed", "3", "--exp_name", "x"],
        ["fake.py", "--seed", "4", "--exp_name", "x"],
    ]
    assert launch(fake_script, *argv).returncode != 0  # without --exp_name the runs cannot be told apart


def test_launcher_argument_helpers():
    assert launcher.split_argv(["--seeds", "1", "--", "--lr", "1"]) == (["--seeds", "1"], ["--lr", "1"])
    assert launcher.with_tracking(["--wandb_tags", "a", "b", "--lr", "1"], "sha") == [
        *("--wandb_tags", "a", "b", "sha", "--lr", "1", "--track")
    ]
    assert launcher.with_tracking(["--track", "--wandb-tags=a"], "sha") == ["--track", "--wandb-tags", "a", "sha"]
    assert launcher.flag_value(["--output-dir", "x", "--output_dir=y"], "output_dir") == "y"
    assert launcher.flag_value(["--lr", "1"], "output_dir", "runs") == "runs"
    assert launcher.build_command("s.py", 7, ["--a", "1"]) == [sys.executable, "s.py", "--seed", "7", "--a", "1"]


# ---------------------------------------------------------------------------------------------------------------
# Registry


def write_run(root, name, seed, lines, sha="0123456789abcdef"):
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"args": {"seed": seed, "exp_name": name.split("__")[1], "run_name": name}, "git_sha": sha}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return path


# Experiment A: 3 seeds; eval/accuracy at steps 0, 5, 10; objective/scores at steps 1..10; a different pace per seed.
SEED_FINAL = {1: 0.5, 2: 0.6, 3: 0.85}
SEED_INITIAL = {1: 0.1, 2: 0.1, 3: 0.25}
SEED_SECONDS_PER_STEP = {1: 10.0, 2: 12.0, 3: 9.0}


def synthetic_lines(seed):
    rng = np.random.default_rng(seed)
    lines = []
    for step in range(11):
        line = {"global_step": step, "episode": 16 * step, "time": 3.0 + SEED_SECONDS_PER_STEP[seed] * step}
        if step > 0:
            line["objective/scores"] = float(rng.uniform())
        if step in (0, 5, 10):
            line["eval/accuracy"] = {0: SEED_INITIAL[seed], 5: 0.3, 10: SEED_FINAL[seed]}[step]
        lines.append(line)
    lines.append({"global_step": 10, "episode": 160, "time": lines[-1]["time"] + 1.0, "perf/x": 1.0})
    return lines


@pytest.fixture
def synthetic_runs(tmp_path):
    root = str(tmp_path / "runs")
    for seed in (1, 2, 3):
        write_run(root, f"arith__grpo__{seed}__{1000 + seed}", seed, synthetic_lines(seed))
    write_run(root, "arith__other__1__2000", 1, [{"global_step": 0, "time": 1.0, "eval/accuracy": 0.2}])
    os.makedirs(os.path.join(root, "_logs"))
    return root


def test_registry_values_of_one_run():
    lines = synthetic_lines(2)
    assert registry.final_value(lines, "eval/accuracy") == SEED_FINAL[2]  # the last line lacks it
    assert registry.initial_value(lines, "eval/accuracy") == SEED_INITIAL[2]
    assert registry.initial_value(lines, "objective/scores") is None
    assert registry.final_value(lines, "missing") is None
    assert registry.metric_series(lines, "eval/accuracy") == ([0.0, 5.0, 10.0], [0.1, 0.3, 0.6])
    assert registry.metric_series(lines, "eval/accuracy", x="time") == ([3.0, 63.0, 123.0], [0.1, 0.3, 0.6])
    # A resumed run's process counts from 0 again: the wall clock adds the earlier segment back.
    resumed = [{"global_step": 0, "time": 5.0}, {"global_step": 1, "time": 9.0}, {"global_step": 2, "time": 2.0}]
    assert registry.wall_clock(resumed) == [5.0, 9.0, 11.0]
    # The smoothing window counts steps: sparse points are left alone, dense ones averaged.
    assert registry.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert registry.moving_average([1.0, 3.0, 5.0], 4, steps=[0, 5, 10]) == [1.0, 3.0, 5.0]
    assert registry.moving_average([1.0, 3.0, 5.0], 6, steps=[0, 5, 10]) == [1.0, 2.0, 4.0]


def test_registry_table_is_mean_and_std_over_seeds(synthetic_runs):
    runs = registry.find_runs(os.path.join(synthetic_runs, "arith__grpo__*"))
    assert [(run["seed"], run["name"]) for run in runs] == [(s, f"arith__grpo__{s}__{1000 + s}") for s in (1, 2, 3)]

    finals = [SEED_FINAL[s] for s in (1, 2, 3)]
    initials = [SEED_INITIAL[s] for s in (1, 2, 3)]
    scores = [
        [line["objective/scores"] for line in synthetic_lines(s) if "objective/scores" in line][-1] for s in (1, 2, 3)
    ]
    seconds = [synthetic_lines(s)[-1]["time"] for s in (1, 2, 3)]
    summary = registry.summarize(runs, ["eval/accuracy", "objective/scores"])
    assert summary["seeds"] == 3
    for (mean, std, n), values in (
        (summary["eval/accuracy"]["final"], finals),
        (summary["eval/accuracy"]["initial"], initials),
        (summary["objective/scores"]["final"], scores),
        (summary["wall_clock"], seconds),
    ):
        assert n == 3
        assert mean == pytest.approx(statistics.mean(values), abs=1e-12)
        assert std == pytest.approx(statistics.stdev(values), abs=1e-12)  # ddof=1
    assert summary["objective/scores"]["initial"] == (None, None, 0)

    single = registry.find_runs(os.path.join(synthetic_runs, "arith__other__*"))
    table = registry.markdown_table([("A", runs), ("B", single)], ["eval/accuracy", "objective/scores"], digits=4)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()]
    assert rows[0] == [
        "experiment (mean ± std over seeds, ddof=1)",
        "seeds",
        "eval/accuracy step 0",
        "eval/accuracy final",
        "objective/scores final",
        "wall-clock (mean)",
    ]
    ms = lambda values: f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"  # noqa: E731
    assert rows[2] == ["A", "3", ms(initials), ms(finals), ms(scores), f"{statistics.mean(seconds):.0f} s"]
    assert rows[3] == ["B", "1", "0.2000", "0.2000", "–", "1 s"]  # one seed: no ±

    out = os.path.join(os.path.dirname(synthetic_runs), "results", "table.md")
    registry.main(
        ["table", "--experiments", f"A={synthetic_runs}/arith__grpo__*", f"B={synthetic_runs}/arith__other__*"]
        + ["--metrics", "eval/accuracy", "objective/scores", "--digits", "4", "--out", out]
    )
    assert open(out).read() == table


def test_registry_copy_keeps_config_and_metrics_of_run_folders_only(tmp_path):
    """copy: each finished run folder's config.json and metrics.jsonl, byte for byte, under OUT/<its name>/ (a
    trailing slash too); its other files (weights, samples) stay behind; an argument without both (an unmatched glob)
    and a run in progress (no model/ yet) are skipped; two folders of one name are refused."""
    runs = [
        write_run(str(tmp_path / "runs"), f"t__x__{seed}__{seed}", seed, [{"global_step": seed}]) for seed in (1, 2, 3)
    ]
    for run in runs[:2]:
        os.makedirs(os.path.join(run, "model"))
    with open(os.path.join(runs[0], "samples.jsonl"), "w") as f:
        f.write("{}\n")
    os.makedirs(tmp_path / "runs" / "not_a_run")
    out = str(tmp_path / "results")
    skipped = [str(tmp_path / "runs" / "not_a_run"), str(tmp_path / "runs/y__*"), runs.pop()]
    registry.main(["copy", "--out", out, runs[0] + "/", runs[1], *skipped])
    assert sorted(os.listdir(out)) == ["t__x__1__1", "t__x__2__2"]
    for run in runs:
        copied = os.path.join(out, os.path.basename(run))
        assert sorted(os.listdir(copied)) == ["config.json", "metrics.jsonl"]
        for name in ("config.json", "metrics.jsonl"):
            assert open(os.path.join(copied, name)).read() == open(os.path.join(run, name)).read()
    other = write_run(str(tmp_path / "other"), "t__x__1__1", 1, [])  # the same name as a run above: refused
    os.makedirs(os.path.join(other, "model"))
    with pytest.raises(SystemExit, match="share a name"):
        registry.main(["copy", "--out", out, runs[0], other])


def test_registry_paired_table_against_differences_worked_out_here(synthetic_runs, tmp_path):
    """Experiment B (seeds 1 and 3, final accuracy shifted by +0.1 and -0.05; seed 2 missing) against A: only the
    shared seeds are paired; the mean ± std of the differences and t = mean / (std / sqrt(n)) as computed here."""
    root = str(tmp_path / "b")
    shifts = {1: 0.1, 3: -0.05}
    for seed, shift in shifts.items():
        lines = synthetic_lines(seed)
        lines[10]["eval/accuracy"] += shift
        lines[-1]["time"] += 7.0 * seed
        write_run(root, f"arith__b__{seed}__{1000 + seed}", seed, lines)
    specs = [f"A={synthetic_runs}/arith__grpo__*", f"B={root}/arith__b__*"]
    out = str(tmp_path / "paired.md")
    registry.main(["paired", "--experiments", *specs, "--baseline", "A", "--metrics", "eval/accuracy", "wall_clock"]
                  + ["--digits", "4", "--out", out])  # fmt: skip
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in open(out).read().strip().splitlines()]
    assert rows[0][:3] == ["experiment", "metric", "seeds"] and len(rows) == 4
    diffs = [shifts[1], shifts[3]]
    mean, std = statistics.mean(diffs), statistics.stdev(diffs)
    a = [SEED_FINAL[1], SEED_FINAL[3]]
    assert rows[2][:6] == ["B", "eval/accuracy", "1 3", f"{a[0]:.4f} / {a[1]:.4f}"] + [
        f"{a[0] + shifts[1]:.4f} / {a[1] + shifts[3]:.4f}",
        f"{diffs[0]:.4f} / {diffs[1]:.4f}",
    ]
    assert rows[2][6:] == [f"{mean:.4f} ± {std:.4f}", f"{mean / (std / 2**0.5):.2f} (1)"]
    assert rows[3][1] == "wall_clock" and rows[3][5] == f"{7.0:.4f} / {21.0:.4f}"
    with pytest.raises(ValueError, match="--baseline"):
        registry.paired_table([("A", [])], ["eval/accuracy"], "C")
    # --at_least adds the claim's verdict: 2 seeds are too few.
    registry.main(["paired", "--experiments", *specs, "--baseline", "A", "--metrics", "eval/accuracy"]
                  + ["--at_least", "-0.02", "--out", out])  # fmt: skip
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in open(out).read().strip().splitlines()]
    assert rows[0][-3:] == [
        "difference (mean (s.e.); 95% t interval)",
        "difference >= -0.02 (95% interval)",
        "exact sign-flip p (one-sided: difference >= -0.02)",
    ]
    se, half = std / 2**0.5, 12.706 * std / 2**0.5  # t(0.975) at 1 df
    span = f"95% interval {mean - half:+.3f} to {mean + half:+.3f}"
    # Beside the verdict, the sign-flip p: of the 4 assignments of signs to +0.12 and -0.03 (the differences + 0.02),
    # the sums +0.09 (observed), +0.15, -0.15 and -0.09: 2 of 4 at least the observed one.
    assert rows[2][-3:] == [f"{mean:+.3f} (s.e. {se:.3f}); {span}", "**inconclusive**", "0.5000"]
    table = registry.paired_table(registry.load_experiments(specs), ["eval/accuracy"], "A", at_least=-1, at_most=0)
    assert table.splitlines()[0].endswith(
        "| difference >= -1 and <= 0 (95% interval) | exact sign-flip p (the larger one-sided: difference >= -1 and "
        "<= 0) |"
    )


def test_registry_claim_verdicts_worked_out_here():
    """ "difference >= at_least" from paired differences: held / not held when the two-sided 95% t interval, mean ±
    t(0.975, n - 1) x standard error (4.303 at 2 df), clears the bound, inconclusive when it crosses it or on fewer
    than 3 seeds."""
    for diffs, at_least, verdict in [
        ([0.01, 0.02, 0.03], -0.02, "held"),  # 0.02 - 4.303 x 0.0058 = -0.005 >= -0.02
        ([-0.05, -0.04, -0.06], -0.02, "not held"),  # -0.05 + 0.025 < -0.02
        ([0.05, -0.05, 0.0], -0.02, "inconclusive"),  # 0 ± 0.124 crosses -0.02
        ([0.1, 0.2], 0.0, "inconclusive"),  # 2 seeds
        ([-0.03, -0.01, -0.02], -0.02, "inconclusive"),  # -0.02 ± 0.025
        ([0.03, 0.10, 0.06], 0.0, "inconclusive"),  # paired t 3.1: one standard error clear of 0, not 4.30
        ([-0.03, -0.10, -0.06], 0.0, "inconclusive"),
        ([0.04, 0.06, 0.08], 0.0, "held"),  # paired t 5.2
        ([-0.04, -0.06, -0.08], 0.0, "not held"),
    ]:
        mean, std, n = registry.mean_std(diffs)
        assert registry.claim_verdict(mean, std, n, at_least) == verdict, (diffs, at_least)
    # "difference <= at_most" (async faster than sync: seconds <= 0), the mirror image.
    for diffs, at_most, verdict in [
        ([-35.4, -18.2, -20.8], 0.0, "held"),  # -24.8 + 4.303 x 5.37 = -1.7 <= 0
        ([35.4, 18.2, 20.8], 0.0, "not held"),
        ([-35.4, 18.2, -20.8], 0.0, "inconclusive"),
    ]:
        mean, std, n = registry.mean_std(diffs)
        assert registry.claim_verdict(mean, std, n, -math.inf, at_most=at_most) == verdict, (diffs, at_most)
    assert registry.claim_verdict(*registry.mean_std([0.01, 0.02, 0.03]), -0.02, at_most=0.025) == "inconclusive"
    assert registry.t_975(2) == 4.303 and registry.t_975(1) == 12.706 and registry.t_975(100) == registry.t_975(30)


def sign_flip_reference(diffs, bound, above=True):
    """The one-sided exact sign-flip p written plainly: every assignment of signs to the values minus the bound (or the
    bound minus the values, for "<= bound"), one at a time, counting those whose sum is at least the observed one."""
    values = [(d - bound) if above else (bound - d) for d in diffs]
    observed = sum(values)
    signs = list(itertools.product((1, -1), repeat=len(values)))
    at_least = sum(1 for s in signs if sum(x * v for x, v in zip(s, values)) >= observed - 1e-9)
    return at_least / len(signs)


def test_sign_flip_p_against_every_assignment_written_out():
    """registry.sign_flip_p against a loop over itertools.product of signs, and the known values: n values all on the
    claim's side give 1 / 2^n, the smallest there is (1/16 at n = 4, 1/256 at 8); ties count as at least as extreme."""
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 9)
        diffs = [round(rng.uniform(-0.2, 0.2), rng.choice((2, 3))) for _ in range(n)]
        bound = rng.choice((0.0, -0.02, 0.02))
        assert registry.sign_flip_p(diffs, bound) == pytest.approx(sign_flip_reference(diffs, bound)), diffs
        assert registry.sign_flip_p(diffs, high=bound) == pytest.approx(sign_flip_reference(diffs, bound, False))
        within = max(sign_flip_reference(diffs, -0.05), sign_flip_reference(diffs, 0.05, False))
        assert registry.sign_flip_p(diffs, -0.05, 0.05) == pytest.approx(within)
    assert registry.sign_flip_p([0.01, 0.03, 0.02, 0.05], 0.0) == 1 / 16
    assert registry.sign_flip_p([0.1 * k for k in range(1, 9)], 0.0) == 1 / 256
    assert registry.sign_flip_p([-35.4, -18.2, -20.8], high=0.0) == 1 / 8  # async's wall-clock: 3 seeds, 1/8 at best
    assert registry.sign_flip_p([1.0, -1.0], 0.0) == 3 / 4  # sums 0 (observed), 0, +2, -2: the tie counts
    assert registry.sign_flip_p([0.1, 0.2, -0.3], 0.0) == 5 / 8  # observed 5.6e-17: -5.6e-17 is a tie, counted
    assert registry.sign_flip_p([0.04, 0.06, 0.08], 0.05) == sign_flip_reference([0.04, 0.06, 0.08], 0.05) == 3 / 8
    assert registry.sign_flip_p([]) is None and registry.sign_flip_p([0.1]) is None  # no bound: no claim
    assert registry.sign_flip_p([0.1] * (registry.SIGN_FLIP_MAX + 1), 0.0) is None  # too many to enumerate
    assert registry.sign_flip_p([None, 0.1, 0.2], 0.0) == 1 / 4
    assert registry.sign_flip_text([0.1, 0.2], 0.0) == "exact sign-flip p 0.2500 (one-sided, difference >= 0)"


def test_registry_list(synthetic_runs, capsys):
    registry.main(["list", "--runs_dir", synthetic_runs, "--filter", "grpo", "--metrics", "eval/accuracy"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| arith")]
    assert len(rows) == 3  # no _logs
    cells = [cell.strip() for cell in rows[-1].strip("|").split("|")]
    assert cells == ["arith__grpo__3__1003", "grpo", "3", "0123456", "10", "94 s", "0.850"]


def test_registry_aggregate_by_step_and_time(synthetic_runs):
    runs = registry.find_runs(os.path.join(synthetic_runs, "arith__grpo__*"))
    grid, mean, std, n = registry.aggregate(runs, "eval/accuracy", x="step")
    assert n == 3 and grid.tolist() == [0, 5, 10]
    per_seed = np.array([[SEED_INITIAL[s], 0.3, SEED_FINAL[s]] for s in (1, 2, 3)])
    np.testing.assert_allclose(mean, per_seed.mean(0))
    np.testing.assert_allclose(std, per_seed.std(0, ddof=1))

    grid, mean, std, n = registry.aggregate(runs, "objective/scores", x="time", num_points=50)
    starts = [3.0 + SEED_SECONDS_PER_STEP[s] for s in (1, 2, 3)]
    ends = [3.0 + 10 * SEED_SECONDS_PER_STEP[s] for s in (1, 2, 3)]
    assert len(grid) == 50 and grid[0] == max(starts) and grid[-1] == min(ends)  # the span every seed covers
    curves = []
    for run in runs:
        xs, ys = registry.metric_series(run["lines"], "objective/scores", x="time")
        curves.append(np.interp(grid, xs, ys))
    np.testing.assert_allclose(mean, np.mean(curves, 0))
    np.testing.assert_allclose(std, np.std(curves, 0, ddof=1))
    assert registry.aggregate(runs, "missing", x="step") is None


def test_registry_plots_png_by_step_and_time(synthetic_runs, tmp_path):
    experiments = [
        ("A", registry.find_runs(os.path.join(synthetic_runs, "arith__grpo__*"))),
        ("B", registry.find_runs(os.path.join(synthetic_runs, "arith__other__*"))),
    ]
    for x in ("step", "time"):
        out = registry.plot(experiments, ["eval/accuracy", "objective/scores"], x=x, out=str(tmp_path / f"{x}.png"))
        with open(out, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    out = str(tmp_path / "cli.png")
    registry.main(
        ["plot", "--experiments", f"A={synthetic_runs}/arith__grpo__*", "--metric", "objective/scores"]
        + ["--x", "time", "--smooth", "3", "--out", out]
    )
    assert os.path.getsize(out) > 5000


def test_registry_perf_medians_and_step_seconds(tmp_path):
    """Steps of 2, 3, 4, ... seconds, an evaluation at step 4 (its step is left out of the step times), a resume at
    step 7 (time restarts near 0: that step is left out too). Every median is that of the values written."""
    rng = np.random.default_rng(0)
    lines, t = [{"global_step": 0, "time": 5.0, "eval/accuracy": 0.1}], 5.0
    written = {m: [] for m in registry.PERF_METRICS}
    for step in range(1, 11):
        t = 1.0 if step == 7 else t + step + 1
        line = {"global_step": step, "time": t}
        for metric in registry.PERF_METRICS:
            line[metric] = float(rng.uniform(0, 100))
            written[metric].append(line[metric])
        if step == 4:
            line["eval/accuracy"] = 0.2
        lines.append(line)
    path = write_run(str(tmp_path / "runs"), "arith__grpo__1__1000", 1, lines)
    expected_steps = [step + 1.0 for step in range(1, 11) if step not in (4, 7)]
    assert registry.step_seconds(lines) == pytest.approx(expected_steps)
    summary = registry.perf_summary(registry.load_run(path))
    assert summary["steps"] == 10
    assert summary["step_seconds"] == pytest.approx(statistics.median(expected_steps))
    for metric in registry.PERF_METRICS:
        assert summary[metric] == pytest.approx(statistics.median(written[metric]))
    out = tmp_path / "results" / "perf"
    registry.main(["perf", "--experiments", f"g={path}", "--out", str(out)])
    with open(str(out) + ".json") as f:
        assert json.load(f) == [{"experiment": "g", "run": "arith__grpo__1__1000", **summary}]
    with open(str(out) + ".md") as f:
        table = f.read()
    generation = summary["time/generation"]
    assert f"| {generation:.2f} s ({100 * generation / summary['step_seconds']:.0f}%) |" in table


def test_registry_runs_of_one_seed_are_all_used_or_refused(synthetic_runs, tmp_path):
    """A repeat or an older launch of a seed is never dropped without a word. Several runs of one seed are refused,
    naming them; --all_runs uses every one (the table counts each); a paired comparison needs one run per seed and
    refuses them even then."""
    write_run(synthetic_runs, "arith__grpo__1__900", 1, synthetic_lines(1)[:3])  # an older launch of seed 1
    pattern = os.path.join(synthetic_runs, "arith__grpo__*")
    with pytest.raises(ValueError, match=r"seed 1: arith__grpo__1__1001, arith__grpo__1__900\).*--all_runs"):
        registry.find_runs(pattern)
    names = [run["name"] for run in registry.find_runs(pattern, all_runs=True)]
    assert names == ["arith__grpo__1__900", "arith__grpo__1__1001", "arith__grpo__2__1002", "arith__grpo__3__1003"]
    with pytest.raises(SystemExit, match="experiment 'A': several runs of one seed"):
        registry.main(["table", "--experiments", f"A={pattern}", "--metrics", "eval/accuracy"])
    out = str(tmp_path / "table.md")
    registry.main(["table", "--all_runs", "--experiments", f"A={pattern}", "--metrics", "eval/accuracy", "--out", out])
    assert "| A | 4 |" in open(out).read()
    specs = [f"A={pattern}", f"B={synthetic_runs}/arith__other__*"]
    with pytest.raises(SystemExit, match="one run per seed"):
        registry.main(
            ["paired", "--all_runs", "--experiments", *specs, "--baseline", "B", "--metrics", "eval/accuracy"]
        )


def test_registry_perf_shows_every_run_and_the_scripts_step_time(tmp_path):
    """perf shows every run, repeats of a seed included (the reward-ensemble cost table shows two runs of seed 1
    an experiment), the median of the script's own time/step next to s/step (which leaves out the steps that ran an
    evaluation: the last one always does), and per experiment the median over all its runs' steps of both, time/step
    against the first experiment's."""
    root = str(tmp_path / "runs")
    logged = {"a_1": [30, 20, 16, 20], "a_2": [33, 22, 15, 19], "b_1": [36, 22, 18, 33], "b_2": [38, 24, 18, 32]}
    for i, (name, seconds) in enumerate(logged.items()):
        lines, t = [{"global_step": 0, "time": 2.0, "eval/accuracy": 0.1}], 2.0
        for step, x in enumerate(seconds, start=1):
            t += x + 0.5  # the log line's clock: the step and a little more
            lines.append({"global_step": step, "time": t, "time/step": float(x)})
        lines[-1]["eval/accuracy"] = 0.2
        write_run(root, f"t__{name}__1__{100 + i}", 1, lines)
    out = str(tmp_path / "results" / "perf")
    registry.main(["perf", "--experiments", f"A={root}/t__a_*", f"B={root}/t__b_*", "--out", out])
    tables = open(out + ".md").read().split("\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in tables[0].strip().splitlines()[2:]]
    assert [row[1] for row in rows] == [f"t__{name}__1__{100 + i}" for i, name in enumerate(logged)]
    for row, seconds in zip(rows, logged.values()):
        assert row[3] == f"{statistics.median([x + 0.5 for x in seconds[:3]]):.2f}"  # step 4 evaluated: left out
        assert row[4] == f"{statistics.median(seconds):.2f}"
    summary = [[c.strip() for c in line.strip("|").split("|")] for line in tables[1].strip().splitlines()]
    assert summary[0][-1] == "time/step against A"
    a, b = (statistics.median(logged[f"{x}_1"] + logged[f"{x}_2"]) for x in "ab")
    assert (a, b) == (20, 28)
    assert summary[2] == ["A", "2", "21.50", "20.00", "x1.00 (+0%)"]
    assert summary[3] == ["B", "2", "23.50", "28.00", "x1.40 (+40%)"]


def test_registry_no_spread_is_no_interval():
    """Paired differences that are all equal have a standard error of 0: a zero-width interval would settle any
    bound. The rule calls them inconclusive (a spread below the metric's resolution, not a spread of zero)."""
    for diffs in ([0.05] * 3, [0.0] * 3, [-0.05] * 3):
        mean, std, n = registry.mean_std(diffs)
        assert registry.claim_verdict(mean, std, n, 0.0) == "inconclusive"
        assert registry.claim_verdict(mean, std, n, -0.02) == "inconclusive"
        assert registry.interval(diffs)[2] is None and registry.p_above(diffs) is None
        assert registry.interval_text(*registry.interval(diffs))[1] == "no interval (no spread over seeds)"


def test_registry_t_cdf_and_holm_against_independent_computations():
    """t_cdf (exact series) against the t table and a numerical integral of Student's density; holm against Holm's
    adjusted p-values (the i-th smallest p times m - i, made monotone), and a case worked out by hand."""
    for df in range(1, 31):
        assert registry.t_cdf(registry.t_975(df), df) == pytest.approx(0.975, abs=5e-5)

    def density(x, df):
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    for df in (1, 2, 3, 4, 5, 7, 10, 30):
        for t in (-3.1, -0.5, 0.0, 0.7, 1.9, 4.303, 9.0):
            xs = np.linspace(0.0, abs(t), 4001)  # Simpson's rule on [0, |t|]
            ys = np.array([density(x, df) for x in xs])
            half = (xs[1] - xs[0]) / 3 * (ys[0] + ys[-1] + 4 * ys[1:-1:2].sum() + 2 * ys[2:-1:2].sum())
            assert registry.t_cdf(t, df) == pytest.approx(0.5 + math.copysign(half, t), abs=1e-8), (t, df)
    diffs = [0.04, 0.06, 0.08]
    t = np.mean(diffs) / (np.std(diffs, ddof=1) / math.sqrt(3))
    assert registry.p_above(diffs) == pytest.approx(1 - registry.t_cdf(t, 2))
    assert registry.p_above(diffs, bound=0.06) == pytest.approx(0.5)

    def adjusted(p_values):  # Holm's adjusted p-values; an untested hypothesis (None) counts in m with p = 1
        ps = [1.0 if p is None else p for p in p_values]
        order, m, running, out = sorted(range(len(ps)), key=lambda i: ps[i]), len(ps), 0.0, [0.0] * len(ps)
        for rank, i in enumerate(order):
            running = max(running, min(1.0, (m - rank) * ps[i]))
            out[i] = running
        return out

    rng = np.random.default_rng(0)
    for _ in range(500):
        m = int(rng.integers(1, 6))
        ps = [None if rng.uniform() < 0.15 else float(rng.uniform(0, 0.05)) ** 1.5 for _ in range(m)]
        assert registry.holm(ps) == [a <= 0.025 for a in adjusted(ps)], ps
    # By hand: 0.004 <= 0.025 / 4, then 0.01 > 0.025 / 3 stops; three at 0.005 / 0.006 / 0.02 all go (Bonferroni,
    # 0.025 / 3 each, would keep the third).
    assert registry.holm([0.01, 0.004, 0.03, None]) == [False, True, False, False]
    assert registry.holm([0.005, 0.006, 0.02]) == [True, True, True]
    assert registry.holm([]) == []


# ---------------------------------------------------------------------------------------------------------------
# benchmark/*.sh: every flag given to a script (or to benchmark.statistics.run / benchmark.statistics.registry) exists
# in its --help


PYTHON_SH = os.path.join(REPO_ROOT, "benchmark", "python.sh")
# benchmark/python.sh is sourced by the others: it runs no command of its own.
SHELL_FILES = sorted(set(glob.glob(os.path.join(REPO_ROOT, "benchmark", "*.sh"))) - {PYTHON_SH})


def test_every_benchmark_script_runs_the_venvs_python_or_stops_in_one_line(tmp_path):
    """Each benchmark/*.sh sources benchmark/python.sh right after it changes to the repository root (gpu_check.sh runs
    on the GPU machine's own python3): with make setup's .venv, `python` is its interpreter whatever PATH holds;
    without one, and no python with torch on PATH, the script stops with one line naming the fix; a `python` shell
    function the caller defined (benchmark.checks.tables records the commands with one) is kept, so nothing runs."""
    for path in SHELL_FILES:
        if os.path.basename(path) != "gpu_check.sh":
            assert 'cd "$(dirname "$0")/.."\nsource benchmark/python.sh' in open(path).read(), path
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = "source benchmark/python.sh && python -c 'import sys, torch; print(sys.prefix)'"
    if os.path.isfile(os.path.join(REPO_ROOT, ".venv", "bin", "python")):
        done = subprocess.run(["bash", "-c", probe], cwd=REPO_ROOT, env=bare, capture_output=True, text=True)
        assert done.returncode == 0 and os.path.realpath(done.stdout.strip()) == os.path.realpath(
            os.path.join(REPO_ROOT, ".venv")
        ), done.stderr
    os.makedirs(tmp_path / "benchmark")
    with open(PYTHON_SH) as f:
        (tmp_path / "benchmark" / "python.sh").write_text(f.read())
    done = subprocess.run(["bash", "-c", probe], cwd=tmp_path, env=bare, capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["error: no .venv/bin/python here and no python with torch on PATH: "
                                                "run 'make setup' first"]  # fmt: skip
    # benchmark.checks.tables' recorder:
    recorder = 'python() { echo recorded "$@"; }; source benchmark/python.sh && python -m x'
    done = subprocess.run(["bash", "-c", recorder], cwd=tmp_path, env=bare, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "recorded -m x\n"


def shell_commands(path):
    """The commands of a shell file as argument lists: continuation lines joined, comments and blank lines dropped."""
    commands, pending = [], ""
    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            text, pending = pending + line, ""
            tokens = shlex.split(text, comments=True)
            if tokens:
                commands.append(tokens)
    return commands


def script_invocations(tokens):
    """[(help command, flags)] for one shell command: the flags each program in it is given, and how to get that
    program's --help. Commands that run no Python program give []."""
    if not os.path.basename(tokens[0]).startswith("python"):
        return []
    rest = tokens[1:]
    if rest[:2] == ["-m", "benchmark.statistics.run"]:
        own, script_args = launcher.split_argv(rest[2:])
        script = launcher.flag_value(own, "script")
        # The launcher adds --seed (and --track --wandb_tags with --track) to every run.
        added = ["--seed", "--track", "--wandb_tags"]
        return [(("-m", "benchmark.statistics.run"), own), ((script,), script_args + added)]
    if rest[:2] == ["-m", "benchmark.statistics.registry"]:
        return [(("-m", "benchmark.statistics.registry", rest[2]), rest[3:])]
    if rest[:2] == ["-m", "benchmark.performance.memory_plan"]:  # its own flags, then a script and its arguments
        i = next(i for i, token in enumerate(rest) if token.endswith(".py"))
        return [(("-m", "benchmark.performance.memory_plan"), rest[2:i]), ((rest[i],), rest[i + 1 :])]
    if rest[0] == "-m":
        return [(("-m", rest[1]), rest[2:])]
    assert rest and rest[0].endswith(".py"), f"unexpected command: {shlex.join(tokens)}"
    return [((rest[0],), rest[1:])]


def normalized_flags(tokens):
    return {t.split("=", 1)[0].replace("_", "-") for t in tokens if t.startswith("--") and t != "--"}


@functools.cache
def help_flags(program):
    """The flags a program's --help lists (dashes for underscores: tyro prints --learning-rate)."""
    result = _HELP_RUNS[program]
    assert result["returncode"] == 0, f"{shlex.join(program)} --help failed:\n{result['output']}"
    return normalized_flags(re.findall(r"--[A-Za-z0-9][\w.-]*", result["output"]))


_HELP_RUNS = {}


# Every program's --help in one process: each script imports torch, a few seconds apiece in a process of its own.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
runs = {}
for program in json.loads(sys.argv[1]):
    output, returncode = io.StringIO(), 0
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            if program[0] == "-m":
                sys.argv = [program[1], *program[2:], "--help"]
                runpy.run_module(program[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [program[0], "--help"]
                runpy.run_path(program[0], run_name="__main__")
        except SystemExit as exit:
            returncode = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    runs[json.dumps(program)] = {"returncode": returncode, "output": output.getvalue()}
print(json.dumps(runs))
"""


@pytest.fixture(scope="module")
def help_runs():
    programs = sorted({p for path in SHELL_FILES for cmd in shell_commands(path) for p, _ in script_invocations(cmd)})
    env = {**subprocess_env(), "COLUMNS": "300"}  # no wrapped help lines
    cmd = [sys.executable, "-c", HELP_RUNNER, json.dumps(programs)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _HELP_RUNS.update({tuple(json.loads(k)): v for k, v in json.loads(proc.stdout).items()})
    return _HELP_RUNS


def test_shell_files_exist():
    names = {os.path.basename(p) for p in SHELL_FILES}
    assert {"grpo_math.sh", "ppo_rlhf.sh", "reward_modeling.sh"} <= names


@pytest.mark.parametrize("path", SHELL_FILES, ids=os.path.basename)
def test_shell_file_flags_exist(path, help_runs):
    with open(path) as f:
        assert "set -euo pipefail" in f.read()
    invocations = [inv for cmd in shell_commands(path) for inv in script_invocations(cmd)]
    scripts = [prog[0] for prog, _ in invocations if prog[0].endswith(".py")]
    assert scripts, f"{path} runs no script"
    for script in scripts:
        assert os.path.isfile(os.path.join(REPO_ROOT, script)), f"{path}: {script} is not a top-level script"
    for program, args in invocations:
        unknown = normalized_flags(args) - help_flags(program)
        assert not unknown, f"{os.path.basename(path)}: {shlex.join(program)} has no {sorted(unknown)} in its --help"


def test_flag_check_catches_a_renamed_flag(help_runs):
    script_args = ["--learning_rate", "1e-5", "--no-vllm", "--wandb-tags", "a", "--learning_rat", "1"]
    assert normalized_flags(script_args) - help_flags(("grpo_math.py",)) == {"--learning-rat"}
    registry_args = ["--experiments", "a=b", "--metric", "m", "--smooth", "2", "--x", "time", "--smoth", "2"]
    assert normalized_flags(registry_args) - help_flags(("-m", "benchmark.statistics.registry", "plot")) == {"--smoth"}


# benchmark.performance.perf_generation


def test_generated_tokens_counts_up_to_the_first_eos():
    from benchmark.performance.perf_generation import generated_tokens

    assert generated_tokens([5, 6, 2, 2, 2], 2, stop_at_eos=True) == 3  # the EOS counts, the padding after it not
    assert generated_tokens([5, 6, 7], 2, stop_at_eos=True) == 3  # no EOS: cut at the length limit
    assert generated_tokens([5, 2, 7, 2], 2, stop_at_eos=False) == 4  # fixed length: every token was computed


def test_perf_generation_hf_run_writes_its_tables(tiny_model_dir, task_dir, tmp_path):
    from benchmark.performance import perf_generation

    out = str(tmp_path / "gen")
    args = perf_generation.parse_args(
        ["--model", tiny_model_dir, "--dataset", os.path.join(task_dir, "test.jsonl"), "--num_prompts", "3", "--n",
         "2", "--response_length", "5", "--repeats", "2", "--backends", "hf", "--out", out]
    )  # fmt: skip
    record = perf_generation.main(args)
    with open(out + ".json") as f:
        assert json.load(f)["results"] == record["results"]
    fixed, eos = record["results"]["hf/fixed"], record["results"]["hf/eos"]
    assert fixed["tokens"] == [3 * 2 * 5] * 2  # EOS ignored: exactly num_prompts x n x response_length tokens
    assert all(0 < t <= 3 * 2 * 5 for t in eos["tokens"])
    rates = [t / s for s, t in zip(fixed["seconds"], fixed["tokens"])]
    assert fixed["tokens_per_second_min"] <= fixed["tokens_per_second_median"] <= fixed["tokens_per_second_max"]
    assert min(rates) == pytest.approx(fixed["tokens_per_second_min"], rel=1e-9)
    with open(out + ".md") as f:
        table = f.read()
    assert "| fixed length (EOS ignored) |" in table and "| stop at EOS |" in table


# ---------------------------------------------------------------------------------------------------------------
# benchmark/peers/peer_trl.py: the TRL comparison


def test_peer_step_seconds_leave_out_evaluated_steps():
    from benchmark.peers import peer_trl

    assert peer_trl.step_seconds(10.0, [11.0, 13.5, 14.0, 20.0]) == [1.0, 2.5, 0.5, 6.0]
    assert peer_trl.step_seconds(10.0, [11.0, 13.5, 14.0, 20.0], skip={2, 4}) == [1.0, 0.5]


def test_peer_summary_gives_each_seed_the_std_and_the_ratio_to_trl():
    """Two sides over three seeds: means, the sample std (ddof=1, computed here by hand), each seed's accuracy in
    seed order, and the step-time ratio to TRL's mean of medians."""
    from benchmark.peers import peer_trl

    records = []
    for side, accuracies, step, wall in (
        ("trl", [0.5, 0.4, 0.6], 20.0, 400.0),
        ("ours_vllm", [0.55, 0.5, 0.5], 5.0, 180.0),
    ):
        for seed, accuracy in zip((1, 2, 3), accuracies):
            records.append(dict(side=side, seed=seed, final_accuracy=accuracy, median_step_seconds=step + seed,
                                wall_clock_seconds=wall + seed))  # fmt: skip
    summary = peer_trl.summarize(records)
    ours = summary["ours_vllm"]
    mean = (0.55 + 0.5 + 0.5) / 3
    std = (sum((a - mean) ** 2 for a in (0.55, 0.5, 0.5)) / 2) ** 0.5
    assert ours["final_accuracies"] == [0.55, 0.5, 0.5] and ours["seeds"] == [1, 2, 3]
    assert ours["final_accuracy"] == pytest.approx(mean) and ours["final_accuracy_std"] == pytest.approx(std)
    assert ours["wall_clock_seconds"] == pytest.approx(182.0)
    assert ours["step_time_over_trl"] == pytest.approx(7.0 / 22.0)
    assert summary["trl"]["final_accuracy_std"] == pytest.approx(0.1)


def test_peer_evaluate_is_greedy_pass_at_1_with_grpo_maths_verifier(tiny_model_dir, task_dir, monkeypatch):
    """hf_generate replaced by one that answers the even-numbered held-out problems right and the others wrong:
    the accuracy must be exactly the fraction of even-numbered problems, over every held-out problem."""
    from transformers import AutoTokenizer

    import grpo_math
    from benchmark.peers import peer_trl

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = peer_trl.read_jsonl(os.path.join(task_dir, "test.jsonl"))
    prompts, golds = peer_trl.grpo_prompts(tokenizer, rows)
    calls = []

    def fake_generate(model, batch, n, response_length, temperature, *rest):
        # evaluate() walks the held-out problems in order: the i-th prompt seen is problem i.
        first = sum(c[0] for c in calls)
        calls.append((len(batch), n, temperature))
        assert batch == prompts[first : first + len(batch)]
        texts = [f"Answer: {golds[i]}" if i % 2 == 0 else "Answer: 12345" for i in range(first, first + len(batch))]
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        width = max(map(len, ids))
        responses = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
        return responses, torch.tensor([len(row) for row in ids])

    monkeypatch.setattr(grpo_math, "_hf_generate", fake_generate)
    args = peer_trl.parse_args(["--model", tiny_model_dir, "--dataset", task_dir, "--eval_batch_size", "5"])
    accuracy, num_problems = peer_trl.evaluate(tiny_model_dir, args)
    assert num_problems == len(rows) == 16
    assert accuracy == sum(1 for i in range(16) if i % 2 == 0) / 16
    assert [c[0] for c in calls] == [5, 5, 5, 1] and all(c[1:] == (1, 0.0) for c in calls)


@pytest.mark.slow
def test_peer_trl_runs_both_sides_and_writes_the_table(tiny_model_dir, task_dir, tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "results" / "peer"
    command = [sys.executable, "-m", "benchmark.peers.peer_trl", "--model", tiny_model_dir, "--dataset", task_dir]
    command += ["--steps", "2", "--sides", "trl", "ours_hf", "--output_dir", str(tmp_path / "runs")]
    command += ["--out", str(out), "--num_eval_prompts", "4", "--response_length", "8"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(str(out) + ".json") as f:
        results = json.load(f)
    runs = {r["side"]: r for r in results["runs"]}
    assert set(runs) == {"trl", "ours_hf"}
    assert runs["trl"]["steps"] == 2  # both optimizer steps timed
    assert runs["ours_hf"]["steps"] == 1  # the last step ran the final evaluation: left out
    assert all(r["num_eval_problems"] == 4 and 0.0 <= r["final_accuracy"] <= 1.0 for r in runs.values())
    assert results["summary"]["trl"]["step_time_over_trl"] == 1.0
    ratio = results["summary"]["ours_hf"]["step_time_over_trl"]
    assert ratio == pytest.approx(runs["ours_hf"]["median_step_seconds"] / runs["trl"]["median_step_seconds"])
    with open(str(out) + ".md") as f:
        table = f.read()
    assert "| trl | 1 |" in table and "| ours_hf | 1 |" in table and "trl 1.16.0" in table
    assert (
        f"Command: `python -m benchmark.peers.peer_trl --model {tiny_model_dir} --dataset {task_dir} --steps 2"
        in table
    )


# ---------------------------------------------------------------------------------------------------------------
# benchmark/peers/peer_trl_dpo.py: the TRL online DPO comparison


@pytest.fixture
def biased_reward_model_dir(tiny_reward_model_dir, tmp_path):
    """The tiny reward model with config.bias = 0.25, so that the bias subtraction shows in the scores."""
    import shutil

    folder = tmp_path / "biased_reward_model"
    shutil.copytree(tiny_reward_model_dir, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config["bias"] = 0.25
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return str(folder)


def unpadded_score(reward_model, ids):
    """The reward model's head at the last token of one unpadded sequence, computed without dpo_online's code."""
    with torch.no_grad():
        hidden = reward_model.model(input_ids=torch.tensor([ids])).last_hidden_state
        return reward_model.score(hidden)[0, -1, 0].item()


def test_peer_dpo_trl_judge_scores_as_dpo_online(tiny_model_dir, biased_reward_model_dir, task_dir):
    """TRL's call: text prompts repeated twice, completion ids padded after their EOS. Each score must be the reward
    model's at the completion's EOS (unpadded, alone) minus config.bias, or -1.0 for a completion without EOS; pair i
    is completions i and B + i, and the tied pairs are counted."""
    from transformers import AutoTokenizer

    from benchmark.peers import peer_trl_dpo

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids, _ = peer_trl_dpo.dpo_prompts(tokenizer, peer_trl_dpo.read_jsonl(os.path.join(task_dir, "test.jsonl")))
    prompt_ids = prompt_ids[:3]
    texts = [tokenizer.decode(p) for p in prompt_ids]
    words = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    # Pair 0: two different completions with EOS. Pair 1: both without EOS (a tie at the penalty). Pair 2: the same
    # completion twice (a tie at its score). As from generate, a completion without EOS has the full width (with
    # pad == EOS, as SmolLM2's, padding after it would read as an EOS) and the others are padded after their EOS.
    width = 16
    completions = [
        words("Answer: 7") + [eos],
        (words(" no end") * width)[:width],
        words("Answer: 3") + [eos],
        words("I think it is 12, so") + [eos],
        (words(" still going") * width)[:width],
        words("Answer: 3") + [eos],
    ]
    assert all(len(c) < width for c in completions if c[-1] == eos)
    padded = [c + [pad] * (width - len(c)) for c in completions]
    reward_model, bias = peer_trl_dpo.load_reward_model(biased_reward_model_dir, pad)
    assert bias == 0.25
    judge = peer_trl_dpo.RewardModelJudge(reward_model, bias, tokenizer, [eos], -1.0)
    scores = judge(prompts=texts * 2, completions=["unused"] * 6, completion_ids=padded, gold=["1"] * 6)
    prompts = prompt_ids * 2
    expected = [
        unpadded_score(reward_model, prompts[i] + completions[i]) - 0.25 if completions[i][-1] == eos else -1.0
        for i in range(6)
    ]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert scores[1] == scores[4] == -1.0 and scores[2] == scores[5] and scores[0] != scores[3]
    assert judge.tie_fractions == [pytest.approx(2 / 3)]


def test_peer_dpo_evaluate_scores_and_accuracy(tiny_model_dir, biased_reward_model_dir, task_dir, monkeypatch):
    """hf_generate replaced by one that answers the even-numbered held-out problems right (with EOS) and the others
    wrong, without EOS: the accuracy is the fraction of even-numbered problems, and the score the mean of the reward
    model's unpadded scores (minus config.bias) of the even ones and -1.0 (no EOS) for the odd ones."""
    from transformers import AutoTokenizer

    import dpo_online
    from benchmark.peers import peer_trl_dpo

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = peer_trl_dpo.read_jsonl(os.path.join(task_dir, "test.jsonl"))
    prompts, golds = peer_trl_dpo.dpo_prompts(tokenizer, rows)
    answers = [
        tokenizer(f"Answer: {golds[i]}", add_special_tokens=False).input_ids + [eos]
        if i % 2 == 0
        else tokenizer("Answer: 12345", add_special_tokens=False).input_ids
        for i in range(len(prompts))
    ]
    calls = []

    def fake_generate(model, batch, n, response_length, temperature, *rest):
        # evaluate() walks the held-out problems in order: the i-th prompt seen is problem i.
        first = sum(c[0] for c in calls)
        calls.append((len(batch), n, temperature))
        assert batch == prompts[first : first + len(batch)]
        ids = answers[first : first + len(batch)]
        width = max(map(len, ids))
        responses = torch.tensor([row + [pad] * (width - len(row)) for row in ids])
        return responses, torch.tensor([len(row) for row in ids])

    monkeypatch.setattr(dpo_online, "_hf_generate", fake_generate)
    args = peer_trl_dpo.parse_args(
        ["--model", tiny_model_dir, "--dataset", task_dir, "--reward_model", biased_reward_model_dir]
        + ["--eval_batch_size", "5"]
    )
    result = peer_trl_dpo.evaluate(tiny_model_dir, args)
    assert result["num_problems"] == len(rows) == 16
    assert result["accuracy"] == 8 / 16
    reward_model, _ = peer_trl_dpo.load_reward_model(biased_reward_model_dir, pad)
    expected = [
        unpadded_score(reward_model, prompts[i] + answers[i]) - 0.25 if i % 2 == 0 else -1.0 for i in range(16)
    ]
    assert result["score"] == pytest.approx(statistics.mean(expected), abs=1e-5)
    assert [c[0] for c in calls] == [5, 5, 5, 1] and all(c[1:] == (1, 0.0) for c in calls)


def test_peer_dpo_our_command_sets_the_matched_settings():
    """The flags given to dpo_online.py parse into the settings TRL gets: constant lr, no warmup, sigmoid loss..."""
    import tyro

    import dpo_online
    from benchmark.peers import peer_trl, peer_trl_dpo

    assert peer_trl_dpo.step_seconds is peer_trl.step_seconds  # one definition of the timing
    args = peer_trl_dpo.parse_args(["--steps", "7", "--learning_rate", "3e-6", "--beta", "0.2"])
    expected = dict(total_steps=7, learning_rate=3e-6, beta=0.2, prompts_per_rank=8,
                    micro_batch_size=4, num_minibatches=1, response_length=64, temperature=1.0, top_p=1.0,
                    lr_scheduler="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, judge="reward_model",
                    reward_model_path="runs/reward_model", loss_type="sigmoid", missing_eos_penalty=-1.0,
                    eval_every=0)  # fmt: skip
    for side, vllm in (("ours_hf", False), ("ours_vllm", True)):
        command = peer_trl_dpo.our_command(args, 5, side, "runs/x")
        assert command[1] == "dpo_online.py"
        ours = tyro.cli(dpo_online.Config, args=command[2:])
        wanted = {**expected, "seed": 5, "vllm": vllm}
        assert {key: getattr(ours, key) for key in wanted} == wanted
    trl_args = peer_trl_dpo.parse_args(peer_trl_dpo.trl_command(args, 5, "runs/y")[3:])
    assert trl_args.side == "trl" and trl_args.seed == 5 and trl_args.run_dir == "runs/y"
    for key in ("steps", "model", "dataset", "reward_model", "prompts_per_step", "response_length", "learning_rate",
                "temperature", "beta", "missing_eos_penalty"):  # fmt: skip
        assert getattr(trl_args, key) == getattr(args, key), key


def test_peer_dpo_summary_and_table(tmp_path):
    """Synthetic records of two seeds: the summary is the mean over seeds of each side's numbers, the ratio is to
    TRL's mean median step time, and the markdown rows show those values."""
    from benchmark.peers import peer_trl_dpo

    def record(side, seed, seconds, score, accuracy, ties):
        return {"side": side, "seed": seed, "median_step_seconds": seconds, "final_score": score,
                "final_accuracy": accuracy, "tie_fraction": ties}  # fmt: skip

    records = [
        record("ours_hf", 1, 9.0, 0.5, 0.6, 0.125),
        record("trl", 1, 12.0, 0.25, 0.5, 0.0),
        record("trl", 2, 14.0, 0.75, 0.7, 0.25),
        record("ours_hf", 2, 11.0, 1.5, 0.8, 0.375),
        record("ours_vllm", 1, 6.5, -0.5, 0.4, None),
    ]
    summary = peer_trl_dpo.summarize(records)
    assert list(summary) == ["trl", "ours_hf", "ours_vllm"]  # table order, whatever the record order
    assert summary["trl"] == {"seeds": [1, 2], "median_step_seconds": 13.0, "final_score": 0.5,
                              "final_accuracy": pytest.approx(0.6), "tie_fraction": 0.125,
                              "step_time_over_trl": 1.0}  # fmt: skip
    assert summary["ours_hf"]["median_step_seconds"] == 10.0 and summary["ours_hf"]["final_score"] == 1.0
    assert summary["ours_hf"]["final_accuracy"] == pytest.approx(0.7) and summary["ours_hf"]["tie_fraction"] == 0.25
    assert summary["ours_hf"]["step_time_over_trl"] == pytest.approx(10.0 / 13.0)
    assert (
        summary["ours_vllm"]["step_time_over_trl"] == pytest.approx(0.5)
        and summary["ours_vllm"]["tie_fraction"] is None
    )
    assert "step_time_over_trl" not in peer_trl_dpo.summarize(records[:1])["ours_hf"]  # no TRL run, no ratio

    out = str(tmp_path / "results" / "dpo")
    args = peer_trl_dpo.parse_args(["--steps", "3", "--seeds", "1", "2", "--out", out])
    peer_trl_dpo.write_results(args, records, summary, out)
    with open(out + ".json") as f:
        saved = json.load(f)
    assert saved["runs"] == records and saved["summary"]["ours_hf"]["final_score"] == 1.0
    with open(out + ".md") as f:
        text = f.read()
    assert "python -m benchmark.peers.peer_trl_dpo --steps 3 --seeds 1 2" in text
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    assert rows[0][0] == "side" and len(rows) == 4
    assert rows[1] == ["trl", "1 2", "13.0", "1.00", "0.500", "0.600", "0.125"]
    assert rows[2] == ["ours_hf", "1 2", "10.0", "0.77", "1.000", "0.700", "0.250"]
    assert rows[3] == ["ours_vllm", "1", "6.5", "0.50", "-0.500", "0.400", "-"]


@pytest.mark.slow
def test_peer_trl_dpo_runs_both_sides_and_writes_the_table(tiny_model_dir, tiny_reward_model_dir, task_dir, tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "results" / "peer_dpo"
    command = [sys.executable, "-m", "benchmark.peers.peer_trl_dpo", "--model", tiny_model_dir, "--dataset", task_dir]
    command += ["--reward_model", tiny_reward_model_dir, "--steps", "2", "--sides", "trl", "ours_hf"]
    command += ["--prompts_per_step", "2", "--micro_batch_size", "1", "--output_dir", str(tmp_path / "runs")]
    command += ["--out", str(out), "--num_eval_prompts", "4", "--response_length", "8"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(str(out) + ".json") as f:
        results = json.load(f)
    runs = {r["side"]: r for r in results["runs"]}
    assert set(runs) == {"trl", "ours_hf"}
    assert runs["trl"]["steps"] == 2  # both optimizer steps timed
    assert runs["ours_hf"]["steps"] == 1  # the last step ran the final evaluation: left out
    with open(tmp_path / "runs" / "trl__1" / "step_times.json") as f:
        assert len(json.load(f)["tie_fractions"]) == 2  # the judge ran once per TRL step
    for r in runs.values():
        assert r["num_eval_problems"] == 4 and 0.0 <= r["final_accuracy"] <= 1.0 and np.isfinite(r["final_score"])
        assert 0.0 <= r["tie_fraction"] <= 1.0
    # dpo_online's own final evaluation (same greedy HF generate, same scoring) agrees with this file's evaluator.
    assert runs["ours_hf"]["own_eval"]["score"] == pytest.approx(runs["ours_hf"]["final_score"], abs=1e-4)
    assert runs["ours_hf"]["own_eval"]["accuracy"] == runs["ours_hf"]["final_accuracy"]
    assert results["summary"]["trl"]["step_time_over_trl"] == 1.0
    ratio = results["summary"]["ours_hf"]["step_time_over_trl"]
    assert ratio == pytest.approx(runs["ours_hf"]["median_step_seconds"] / runs["trl"]["median_step_seconds"])
    with open(str(out) + ".md") as f:
        table = f.read()
    assert "| trl | 1 |" in table and "| ours_hf | 1 |" in table and "trl 1.16.0" in table


def test_grpo_errors_sum_kind_against_arithmetic():
    """sum_kind on random sums against the kind worked out here from the numbers; anything else is "other"."""
    from benchmark.claims import grpo_errors

    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, 120, size=(300, 2)).tolist():
        if a >= 100 or b >= 100:
            expected = "other"
        elif a >= 10 and b >= 10:
            expected = "two 2-digit terms, carry" if a % 10 + b % 10 >= 10 else "two 2-digit terms, no carry"
        elif a >= 10 or b >= 10:
            expected = "a 1-digit and a 2-digit term"
        else:
            expected = "two 1-digit terms"
        assert grpo_errors.sum_kind(f"Calculate {a} + {b}.") == expected, (a, b)
    for question in ["Calculate -5 + 3.", "Calculate 5 + 3 - 2.", "Calculate 5 * 3.", "What is 7 + 8 + 9?"]:
        assert grpo_errors.sum_kind(question) == "other", question


def test_grpo_errors_table_counts_each_kind(tiny_model_dir, tmp_path, monkeypatch):
    """hf_generate replaced by one that answers the even-numbered problems right: every kind's accuracy in the
    written table is the fraction of its problems that are even-numbered, worked out here."""
    from transformers import AutoTokenizer

    import grpo_math
    from benchmark.claims import grpo_errors

    sums = [(23, 41), (56, 74), (2, 31), (8, 57), (3, 4), (12, 13), (99, 1), (100, 5), (45, 45), (7, 70)]
    data = tmp_path / "sums"
    data.mkdir()
    with open(data / "test.jsonl", "w") as f:
        for a, b in sums:
            f.write(json.dumps({"question": f"Calculate {a} + {b}.", "answer": str(a + b)}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen = []

    def fake_generate(model, batch, n, response_length, temperature, *rest):
        first = len(seen)
        seen.extend(batch)
        texts = [f"Answer: {sum(sums[i]) if i % 2 == 0 else -1}" for i in range(first, first + len(batch))]
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        width = max(map(len, ids))
        responses = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
        return responses, torch.tensor([len(row) for row in ids])

    monkeypatch.setattr(grpo_math, "_hf_generate", fake_generate)
    out = tmp_path / "errors.md"
    grpo_errors.main(
        ["--models", tiny_model_dir, "--tokenizer", tiny_model_dir, "--dataset", str(data), "--batch_size", "3"]
        + ["--out", str(out)]
    )
    assert len(seen) == len(sums)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in out.read_text().splitlines()[2:]}
    expected = {}
    for i, (a, b) in enumerate(sums):
        expected.setdefault(grpo_errors.sum_kind(f"Calculate {a} + {b}."), []).append(i % 2 == 0)
    for kind, right in expected.items():
        count, accuracy = rows[kind][0], float(rows[kind][1].rstrip(" |"))
        assert int(count) == len(right) and accuracy == pytest.approx(sum(right) / len(right), abs=0.005), kind
    assert float(rows["all"][1].rstrip(" |")) == 0.5
    assert set(expected) == set(rows) - {"all", "held-out sums", "---"}


def test_prm_preflight_kinds_of_wrong_answers():
    from benchmark.claims.prm_preflight import kind_of, step_verdicts

    assert step_verdicts("2 + 3 = 5\n5 * 2 = 11\nAnswer: 11", "\n") == [True, False, None]
    assert kind_of([True, False, None]) == "false and true steps"
    assert kind_of([None, False]) == "false steps only"
    assert kind_of([True, None]) == "true steps only"
    assert kind_of([None]) == kind_of([]) == "nothing to check"


def test_prm_preflight_counts_against_hand_made_responses(tiny_model_dir, tmp_path, monkeypatch):
    """hf_generate replaced by one that writes known responses: accuracy, EOS, steps and the kinds of wrong answers
    in the summary are the ones counted here by hand."""
    from transformers import AutoTokenizer

    import ppo_prm_clip
    from benchmark.claims import prm_preflight

    data = tmp_path / "task"
    data.mkdir()
    with open(data / "test.jsonl", "w") as f:
        for a, b in [(2, 3), (4, 4)]:
            f.write(json.dumps({"question": f"Calculate {a} + {b} + 1.", "answer": str(a + b + 1)}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # For each prompt (in the sampled order), 2 samples then 1 greedy: (text, ends with EOS)
    texts = {
        "6": ["2 + 3 = 5\n5 + 1 = 6\nAnswer: 6", "2 + 3 = 6\n6 + 1 = 7\nAnswer: 7", "Answer: 6"],
        "9": ["4 + 4 = 8\n8 + 1 = 10\nAnswer: 10", "I think\nAnswer: 3", "4 + 4 = 8\n8 + 1 = 9"],
    }
    calls = []

    def fake_generate(model, prompts, n, response_length, temperature, top_p, pad_token_id, stop_ids):
        calls.append((len(prompts), n, temperature))
        rows = []
        for prompt in prompts:
            gold = "6" if "2 + 3" in tokenizer.decode(prompt) else "9"
            chosen = texts[gold][:2] if n == 2 else texts[gold][2:]
            for text in chosen:
                ids = tokenizer(text, add_special_tokens=False).input_ids
                rows.append(ids + ([] if text.endswith("= 9") else [stop_ids[0]]))  # the last one runs out
        width = max(map(len, rows))
        responses = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return responses, torch.tensor([len(r) for r in rows])

    monkeypatch.setattr(ppo_prm_clip, "_hf_generate", fake_generate)
    summary, _ = prm_preflight.main(
        ["--dataset_path", str(data), "--model", tiny_model_dir, "--samples", "2", "--step_separator", "\n"]
        + ["--temperature", "0.7", "--num_prompts", "2"]
    )
    assert calls == [(2, 2, 0.7), (2, 1, 0.0)]
    sampled, greedy = summary["sampled"], summary["greedy"]
    assert sampled["responses"] == 4 and sampled["accuracy"] == 0.25 and sampled["eos_fraction"] == 1.0
    assert sampled["steps_per_response"] == (3 + 3 + 3 + 2) / 4
    # wrong: "2 + 3 = 6 / 6 + 1 = 7" (false then true), "4 + 4 = 8 / 8 + 1 = 10" (true then false), "I think"
    assert sampled["wrong"] == 3
    assert sampled["wrong_by_kind"] == {"false and true steps": round(2 / 3, 3), "nothing to check": round(1 / 3, 3)}
    assert sampled["wrong_with_a_false_step"] == 2 / 3 and sampled["right_with_a_false_step"] == 0.0
    # greedy: "Answer: 6" right; "4 + 4 = 8 / 8 + 1 = 9" right (the last number) but without EOS
    assert greedy["accuracy"] == 1.0 and greedy["eos_fraction"] == 0.5


# benchmark/claims/prm_checks.py: the PRM paper's claims as checks. Each arm's final held-out accuracy and steps per
# seed are set here, so every verdict is known in advance.
def prm_arm_lines(accuracy, steps, train_steps):
    """Lines of a run: evaluations at steps 0 and 4, training steps 1-4 with objective/num_steps from train_steps."""
    lines = [{"global_step": 0, "time": 1.0, "eval/accuracy": 0.2, "eval/num_steps": 3.0, "eval/response_length": 50}]
    for step, value in enumerate(train_steps, start=1):
        lines.append({"global_step": step, "time": 1.0 + step, "objective/num_steps": value})
    lines[-1] |= {"eval/accuracy": accuracy, "eval/num_steps": steps, "eval/response_length": 10 * steps}
    return lines


def write_prm_arms(root, arms):
    """arms: {label: {seed: (accuracy, steps)}} -> experiment specs LABEL=GLOB."""
    for label, seeds in arms.items():
        for seed, (accuracy, steps) in seeds.items():
            write_run(
                root, f"t__prm_{label}__{seed}__{100 + seed}", seed, prm_arm_lines(accuracy, steps, [1, 2, 3, 4])
            )
    return [f"{label}={os.path.join(root, f't__prm_{label}__*')}" for label in arms]


def test_prm_checks_verdicts_worked_out_here(tmp_path):
    """Every part of a claim on the paired 95% interval over seeds: a step count as the per-seed ratio arm / success
    only, an accuracy as the per-seed difference."""
    from benchmark.claims import prm_checks

    none = {1: (0.40, 1.0), 2: (0.50, 1.2), 3: (0.45, 1.1)}
    arms = {
        "none": none,
        # (a) held: steps x2.0 / x2.1 / x2.2 (95% interval x1.85 to x2.35 >= 1.5), accuracy -0.10 / -0.12 / -0.11
        "raw": {1: (0.30, 2.0), 2: (0.38, 1.2 * 2.1), 3: (0.34, 1.1 * 2.2)},
        # (b) held: steps x1.00 / x1.01 / x0.99, differences +0.005 / -0.005 / 0 (interval within 2 points)
        "clip": {1: (0.405, 1.0), 2: (0.495, 1.2 * 1.01), 3: (0.45, 1.1 * 0.99)},
        # (b) inconclusive: differences +0.05 / -0.05 / 0 (SE 0.0289 crosses the 2-point bound); steps within 20%
        "delta": {1: (0.45, 1.1), 2: (0.45, 1.3), 3: (0.45, 1.2)},
        # (b) not held: steps x1.50 / x1.54 / x1.45, the interval above 1.2; (c) held: +0.05 / +0.07 / +0.06 (one-sided
        # p 0.0046, under Holm's first threshold 0.025 / 4)
        "clip_delta": {1: (0.45, 1.5), 2: (0.57, 1.85), 3: (0.51, 1.6)},
    }
    specs = write_prm_arms(str(tmp_path / "runs"), arms)
    out = str(tmp_path / "checks.md")
    prm_checks.main(["--experiments", *specs, "--last", "2", "--out", out])
    text = open(out).read()
    verdicts = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in text.splitlines() if "**" in line}
    assert verdicts == {
        "(a) raw: >= 1.5x the steps and less accurate": "**held**",
        "(b) clip: within 20% of the steps and 2 points of the accuracy": "**held**",
        "(b) delta: within 20% of the steps and 2 points of the accuracy": "**inconclusive**",
        "(b) clip_delta: within 20% of the steps and 2 points of the accuracy": "**not held**",
        "(c) some arm above success only (Holm over 4 arms, 0.025 a side)": "**held**",
        # (d) against raw: every bounded arm writes about half raw's steps (x0.45-0.75 a seed) and is 0.07-0.19 more
        # accurate on every seed (one-sided p <= 0.021, under Holm's thresholds 0.025 / 3, / 2, / 1 in turn)
        **{f"(d) {arm}: fewer held-out steps than raw": "**held**" for arm in ("clip", "delta", "clip_delta")},
        **{f"(d) {arm}: more accurate than raw": "**held**" for arm in ("clip", "delta", "clip_delta")},
    }
    # The per-seed table: the final held-out values, and the mean of the last 2 training steps (3 and 4 -> 3.5).
    assert "| raw | 1 | 0.300 | 2.000 | 20.000 | 3.500 |" in text
    se = np.std([0.05, -0.05, 0.0], ddof=1) / np.sqrt(3)
    assert f"accuracy difference +0.000 (s.e. {se:.3f})" in text
    assert (
        "steps x2.00 / x2.10 / x2.20: x2.10 (s.e. 0.06), 95% interval x1.85 to x2.35 (held; exact sign-flip p 0.1250"
        " (one-sided, ratio >= 1.5))" in text
    )
    assert (
        "clip_delta +0.060 (s.e. 0.006) (95% interval +0.035 to +0.085; one-sided p 0.005, above by Holm; exact "
        "sign-flip p 0.1250 (one-sided, difference >= 0))" in text
    )
    # (b) clip's accuracy, +0.005 / -0.005 / 0 within ±0.02: each side's values (0.025 / 0.015 / 0.02 above -0.02,
    # 0.015 / 0.025 / 0.02 below 0.02) all positive, 1/8 each, the larger 1/8.
    assert "exact sign-flip p 0.1250 (the larger of the two one-sided, difference >= -0.02 and <= 0.02)" in text
    # (d) steps against raw: ratios below 1 on every seed.
    assert "exact sign-flip p 0.1250 (one-sided, ratio <= 1))" in text

    values = {
        label: {s: {"eval/accuracy": a, "eval/num_steps": n} for s, (a, n) in seeds.items()}
        for label, seeds in arms.items()
    }

    def verdict(values, prefix):
        (found,) = [v for claim, v, _ in prm_checks.checks(values, "none") if claim.startswith(prefix)]
        return found

    # (a) was held when 2 of 3 seeds had >= 1.5x the steps and less accuracy: x2.0 / x1.5 / x1.4 and -0.10 / -0.05 /
    # -0.05 leave the steps' interval (x0.84 to x2.43) across 1.5: inconclusive. Not held once the steps' interval
    # lies below 1.5 (x1.1 / x1.2 / x1.0).
    old_a = {1: (0.30, 2.0), 2: (0.45, 1.2 * 1.5), 3: (0.40, 1.1 * 1.4)}
    values["raw"] = {s: {"eval/accuracy": a, "eval/num_steps": n} for s, (a, n) in old_a.items()}
    assert verdict(values, "(a)") == "inconclusive"
    for seed, ratio in zip((1, 2, 3), (1.1, 1.2, 1.0)):
        values["raw"][seed]["eval/num_steps"] = none[seed][1] * ratio
    assert verdict(values, "(a)") == "not held"
    # (b) was not held when the mean steps were more than 20% off (x1.35 here), with no interval: per seed x2.36 /
    # x0.72 / x1.12 cross the bound, inconclusive.
    for seed, ratio in zip((1, 2, 3), (2.36, 0.72, 1.12)):
        values["clip"][seed]["eval/num_steps"] = none[seed][1] * ratio
    assert verdict(values, "(b) clip:") == "inconclusive"
    # An arm exactly level with success only on every seed has no spread, so no interval: inconclusive, not held
    # within 2 points nor "above" (a zero-width interval at 0 did both).
    level = {"none": values["none"], "clip": {s: dict(v) for s, v in values["none"].items()}}
    assert verdict(level, "(b) clip:") == "inconclusive" and verdict(level, "(c)") == "inconclusive"

    # (c) with Holm: an arm at paired t 5.2 (+0.04 / +0.06 / +0.08, one-sided p 0.018) holds alone, its interval
    # clear of 0; among 4 arms tried it needs p <= 0.025 / 4, and the claim is inconclusive.
    def arm(differences):
        return {s: {"eval/accuracy": values["none"][s]["eval/accuracy"] + d, "eval/num_steps": 1.0} for s, d in
                zip((1, 2, 3), differences)}  # fmt: skip

    one = {"none": values["none"], "clip": arm([0.04, 0.06, 0.08])}
    assert verdict(one, "(c)") == "held"
    four = one | {name: arm([0.01, -0.01, 0.0]) for name in ("raw", "delta", "clip_delta")}
    assert verdict(four, "(c)") == "inconclusive"
    # Not held only when every arm's interval lies below 0.
    below = {name: arm([-0.04, -0.06, -0.08]) for name in ("raw", "clip", "delta", "clip_delta")}
    assert verdict({"none": values["none"]} | below, "(c)") == "not held"
    assert verdict({"none": values["none"]} | below | {"clip": arm([0.01, -0.01, 0.0])}, "(c)") == "inconclusive"

    # (d), the fix against raw, by Holm over the bounded arms: the committed runs' accuracy differences
    # (arm - raw per seed) have one-sided p 0.028 / 0.025 / 0.013, each above its Holm threshold (0.025 / 3 first):
    # inconclusive, though clip_delta's own interval (+0.039 to +0.233) lies above 0. An arm below raw on every seed
    # is not held; raw's steps x1 per seed (no spread) give no test.
    raw = {s: {"eval/accuracy": 0.3, "eval/num_steps": 4.0} for s in (1, 2, 3)}

    def against_raw(differences, ratios=(0.5, 0.4, 0.45)):
        return {s: {"eval/accuracy": 0.3 + d, "eval/num_steps": 4.0 * r} for s, d, r in zip((1, 2, 3), differences,
                ratios)}  # fmt: skip

    fix = {"none": raw, "raw": raw, "clip": against_raw([0.056, 0.126, 0.144]),
           "delta": against_raw([0.082, 0.094, 0.168]), "clip_delta": against_raw([0.166, 0.092, 0.150])}  # fmt: skip
    for arm in ("clip", "delta", "clip_delta"):
        assert verdict(fix, f"(d) {arm}: more accurate") == "inconclusive"
        assert verdict(fix, f"(d) {arm}: fewer") == "held"  # x0.45 (s.e. 0.03): p 0.003, 0.005 and 0.008 in turn
    fix["clip_delta"] = against_raw([0.166, 0.092, 0.150], ratios=(1.0, 1.0, 1.0))
    fix["delta"] = against_raw([-0.05, -0.06, -0.07])
    assert (
        verdict(fix, "(d) delta: more accurate") == "not held"
        and verdict(fix, "(d) clip_delta: fewer") == "inconclusive"
    )
    # delta far above raw: p 0.0045 clears Holm's first threshold (0.025 / 3); clip_delta's 0.0131 then meets
    # 0.025 / 2 and stays above it (Holm steps down one arm at a time), and clip's 0.028 is not reached.
    fix["delta"] = against_raw([0.5, 0.6, 0.7])
    assert verdict(fix, "(d) delta: more accurate") == "held"
    assert verdict(fix, "(d) clip_delta: more accurate") == verdict(fix, "(d) clip: more accurate") == "inconclusive"

    two = {label: {s: v for s, v in seeds.items() if s < 3} for label, seeds in values.items()}
    assert {verdict for _, verdict, _ in prm_checks.checks(two, "none")} == {"inconclusive"}
    # A seed whose run has no final evaluation yet (still in progress) is left out, as if it had not run: 2 seeds.
    values["clip"][3] = {"eval/accuracy": None, "eval/num_steps": None}
    clip = [row for row in prm_checks.checks(values, "none") if row[0].startswith("(b) clip:")][0]
    assert clip[1] == "inconclusive" and "(seeds [1, 2])" in clip[2]
    # Runs that share a seed are refused, not reduced to one.
    write_run(str(tmp_path / "runs"), "t__prm_raw__1__99", 1, prm_arm_lines(0.3, 2.0, [1, 2, 3, 4]))
    with pytest.raises(ValueError, match="share one"):
        prm_checks.per_seed(registry.find_runs(specs[1].split("=")[1], all_runs=True), 2)
    with pytest.raises(SystemExit, match="several runs of one seed"):
        prm_checks.main(["--experiments", *specs])


# benchmark/claims/offpolicy.py: the Asynchronous RLHF paper's off-policyness check. Each objective's final accuracy
# per N and seed is set here, so the verdicts are known in advance.
def write_offpolicy_runs(root, objectives):
    """objectives: {label: {N: {seed: final accuracy}}} -> experiment specs LABEL=GLOB. The score is 2 x accuracy."""
    for label, by_n in objectives.items():
        for n, seeds in by_n.items():
            for seed, accuracy in seeds.items():
                lines = [{"global_step": 0, "eval/accuracy": 0.3, "eval/score": 0.6, "eval/ref_perplexity": 1.5}]
                lines += [{"global_step": 1, "objective/kl": 0.1 * n, "policy/staleness": (n - 1) / 2}]
                lines += [{"global_step": 2, "objective/kl": 0.2 * n, "policy/staleness": (n - 1) / 2}]
                lines[-1] |= {"eval/accuracy": accuracy, "eval/score": 2 * accuracy, "eval/ref_perplexity": 1 + n}
                lines[-1] |= {"policy/staleness_max": n - 1}
                path = write_run(root, f"t__off_{label}_n{n}__{seed}__{100 * n + seed}", seed, lines)
                with open(os.path.join(path, "config.json")) as f:
                    config = json.load(f)
                config["args"]["num_minibatches"] = n
                with open(os.path.join(path, "config.json"), "w") as f:
                    json.dump(config, f)
    return [f"{label}={os.path.join(root, f't__off_{label}_*')}" for label in objectives]


def test_offpolicy_check_verdicts_worked_out_here(tmp_path):
    from benchmark.claims import offpolicy

    objectives = {
        # drops 1 - 16: 0.02 / 0.00 / 0.04 (mean 0.02)
        "dpo": {1: {1: 0.50, 2: 0.52, 3: 0.54}, 4: {1: 0.49, 2: 0.50, 3: 0.52}, 16: {1: 0.48, 2: 0.52, 3: 0.50}},
        # drops 0.10 / 0.08 / 0.12: RLOO's drop - DPO's = 0.08 on every seed (standard error 0): above 0
        "rloo": {1: {1: 0.50, 2: 0.50, 3: 0.52}, 16: {1: 0.40, 2: 0.42, 3: 0.40}},
        # drops 0.05 / 0.03 / 0.01: differences +0.03 / +0.03 / -0.03, mean 0.01 ± 0.02: inconclusive
        "ppo": {1: {1: 0.45, 2: 0.45, 3: 0.45}, 16: {1: 0.40, 2: 0.42, 3: 0.44}},
    }
    specs = write_offpolicy_runs(str(tmp_path / "runs"), objectives)
    out = str(tmp_path / "offpolicy")
    offpolicy.main(["--experiments", *specs, "--out", out])
    text = open(out + ".md").read()
    assert os.path.getsize(out + ".png") > 0
    verdicts = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in text.splitlines() if "**" in line}
    assert verdicts == {
        "dpo's drop in eval/accuracy from N = 1 to N = 16 is the smallest": "**inconclusive**",
        "dpo's drop in eval/score from N = 1 to N = 16 is the smallest": "**inconclusive**",
    }
    se = np.std([0.03, 0.03, -0.03], ddof=1) / np.sqrt(3)
    assert f"ppo - dpo: +0.010 (s.e. {se:.3f}) (seeds [1, 2, 3])" in text
    assert "rloo - dpo: +0.080 (s.e. 0.000) (seeds [1, 2, 3]), no interval (no spread over seeds)" in text
    # Every seed's row (final values; KL, staleness at the last training step), and the mean ± std per N.
    assert "| dpo | 16 | 2 | 0.520 | 1.040 | 17.000 | 3.200 | 7.500 | 15.000 | – |" in text
    assert f"| dpo | 4 | 3 | 0.503 ± {np.std([0.49, 0.50, 0.52], ddof=1):.3f} |" in text
    assert "| 17.000 ± 0.000 | 3.200 ± 0.000 |" in text  # N = 16: the final reference perplexity, the last KL

    values = {
        label: offpolicy.by_n(offpolicy.find_runs(spec.split("=")[1], all_runs=True))
        for label, spec in zip(objectives, specs)
    }
    values["ppo"][16][3]["eval/accuracy"] = 0.36  # PPO's drops now 0.05 / 0.03 / 0.09: above DPO's on every seed
    # RLOO's +0.08 on every seed has no spread, so no interval: inconclusive, not held with a zero-width interval.
    assert offpolicy.check(values, "dpo")[1] == "inconclusive"
    values["rloo"][16][3]["eval/accuracy"] = 0.41  # RLOO - DPO +0.08 / +0.08 / +0.07
    assert offpolicy.check(values, "dpo")[1] == "held"
    values["rloo"][16] = {s: {**v, "eval/accuracy": 0.55} for s, v in values["rloo"][16].items()}  # RLOO gains
    assert offpolicy.check(values, "dpo")[1] == "not held"
    # "Not held" is "some other objective's drop is below", so Holm over the two: RLOO's drop below DPO's at paired t
    # 5.2 (one-sided p 0.018) is enough alone, not with PPO also tried (0.018 > 0.025 / 2).
    dpo_drops = {1: 0.02, 2: 0.00, 3: 0.04}
    for seed, d in zip((1, 2, 3), (0.04, 0.06, 0.08)):
        values["rloo"][16][seed]["eval/accuracy"] = values["rloo"][1][seed]["eval/accuracy"] - dpo_drops[seed] + d
    assert offpolicy.check({k: values[k] for k in ("dpo", "rloo")}, "dpo")[1] == "not held"
    assert offpolicy.check(values, "dpo")[1] == "inconclusive"
    two = {
        label: {n: {s: v for s, v in seeds.items() if s < 3} for n, seeds in t.items()} for label, t in values.items()
    }
    assert offpolicy.check(two, "dpo")[1] == "inconclusive"

    # A run whose staleness is not num_minibatches - 1 is refused: two PPO epochs, or async_rlhf.py without --sync.
    for i, extra in enumerate([{"num_ppo_epochs": 2}, {"sync": False}]):
        path = write_run(str(tmp_path / "other"), f"t__off_x__1__{i}", 1, [])
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["args"] |= extra
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        with pytest.raises(ValueError, match="staleness"):
            offpolicy.by_n(offpolicy.find_runs(path, all_runs=True))


def test_offpolicy_baseline_compares_at_the_same_n_seed_by_seed(tmp_path):
    """--baseline: each control minus the baseline at every N both ran, over the seeds both ran; no claim."""
    from benchmark.claims import offpolicy

    objectives = {
        "ppo": {1: {1: 0.50, 2: 0.60, 3: 0.40}, 16: {1: 0.60, 2: 0.62}},
        "nowhiten": {1: {1: 0.40, 2: 0.70}, 16: {2: 0.66}},  # N = 1: -0.10 / +0.10; N = 16: +0.04 (seed 2 only)
        "batch8": {1: {1: 0.70}},
        "other": {4: {1: 0.5}},  # no N shared with ppo: no row
    }
    specs = write_offpolicy_runs(str(tmp_path / "runs"), objectives)
    out = str(tmp_path / "controls")
    offpolicy.main(["--experiments", *specs, "--baseline", "ppo", "--out", out])
    text = open(out + ".md").read()
    assert "claim" not in text and "**" not in text
    rows = [line for line in text.splitlines() if line.startswith("| nowhiten |") or line.startswith("| batch8 |")]
    rows = [line for line in rows if line.count("|") == 6]
    se = np.std([-0.10, 0.10], ddof=1) / np.sqrt(2)
    half = 12.706 * se  # t(0.975) at 1 df
    assert rows == [
        f"| nowhiten | 1 | 1, 2 | +0.000 (s.e. {se:.3f}); 95% interval {-half:+.3f} to {half:+.3f} | +0.000 "
        f"(s.e. {2 * se:.3f}); 95% interval {-2 * half:+.3f} to {2 * half:+.3f} |",
        "| nowhiten | 16 | 2 | +0.040 (s.e. –); no interval | +0.080 (s.e. –); no interval |",
        "| batch8 | 1 | 1 | +0.200 (s.e. –); no interval | +0.400 (s.e. –); no interval |",
    ]
    assert not any(line.startswith("| other | 4 | 1 | +") for line in text.splitlines())


def test_one_verdict_rule_for_every_claim_check():
    """registry paired --at_least, offpolicy's check and prm_checks judge paired differences over seeds by one rule,
    registry's: held / not held only when the two-sided 95% t interval clears the bound. A difference of paired t 3.1
    on 2 df (+0.03 / +0.10 / +0.06, one standard error clear of 0 but under t(0.975, 2) = 4.30) is inconclusive
    everywhere; one of t 5.2 (+0.04 / +0.06 / +0.08) is held, and its negative not held."""
    from benchmark.claims import offpolicy, prm_checks

    weak, strong = (0.03, 0.10, 0.06), (0.04, 0.06, 0.08)
    mean, std, n = registry.mean_std(weak)
    assert 3.0 < mean / (std / np.sqrt(n)) < 3.2 and mean - std / np.sqrt(n) > 0  # held by mean - one s.e.
    mean, std, n = registry.mean_std(strong)
    assert 5.0 < mean / (std / np.sqrt(n)) < 5.5
    cases = [(weak, "inconclusive"), (tuple(-d for d in weak), "inconclusive")]
    cases += [(strong, "held"), (tuple(-d for d in strong), "not held")]

    # registry paired --at_least 0: the last column.
    def runs(values):
        return [{"seed": seed, "lines": [{"eval/accuracy": v}]} for seed, v in zip((1, 2, 3), values)]

    experiments = [("base", runs([0.5] * 3))]
    experiments += [(f"arm{i}", runs([0.5 + d for d in diffs])) for i, (diffs, _) in enumerate(cases)]
    table = registry.paired_table(experiments, ["eval/accuracy"], "base", at_least=0.0)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    assert [row[-2] for row in rows] == [f"**{verdict}**" for _, verdict in cases]
    se = np.std(weak, ddof=1) / np.sqrt(3)
    assert rows[0][-3] == f"+0.063 (s.e. {se:.3f}); 95% interval {np.mean(weak) - 4.303 * se:+.3f} to +0.151"
    # The exact sign-flip p beside each: held on 3 seeds by t, yet 1/8 at best without normality (all three above 0);
    # the negatives' 8/8.
    assert [row[-1] for row in rows] == ["0.1250", "1.0000", "0.1250", "1.0000"]

    # offpolicy: another objective's drop from N = 1 to 16 minus the subject's, seed by seed.
    for diffs, verdict in cases:
        values = {
            "dpo": {
                1: {s: {"eval/accuracy": 0.5} for s in (1, 2, 3)},
                16: {s: {"eval/accuracy": 0.5} for s in (1, 2, 3)},
            },
            "rloo": {
                1: {s: {"eval/accuracy": 0.5} for s in (1, 2, 3)},
                16: {s: {"eval/accuracy": 0.5 - d} for s, d in zip((1, 2, 3), diffs)},
            },
        }
        claim, got, numbers = offpolicy.check(values, "dpo")
        assert got == verdict, (diffs, numbers)
        flip = "0.1250" if diffs[0] > 0 else "1.0000"
        assert numbers.endswith(f"; exact sign-flip p {flip} (one-sided, rloo - dpo >= 0)"), numbers
    assert "95% interval" in numbers

    # prm_checks (c): an arm above success only.
    for diffs, verdict in cases:
        values = {"none": {s: {"eval/accuracy": 0.5, "eval/num_steps": 1.0} for s in (1, 2, 3)}}
        values["clip"] = {s: {"eval/accuracy": 0.5 + d, "eval/num_steps": 1.0} for s, d in zip((1, 2, 3), diffs)}
        assert [v for claim, v, _ in prm_checks.checks(values, "none") if claim.startswith("(c)")] == [verdict]
    assert prm_checks.verdict_inside is registry.verdict_inside and prm_checks.interval is registry.interval


def test_gpu_check_summary_reads_the_first_training_step_and_the_last_evaluation(tmp_path, capsys):
    """benchmark/performance/gpu_check.py's table: step 1's KL / ratio / approxkl / grad norm (reward_modeling's
    objective/grad_norm in the same column), seconds per step after step 1, the last evaluation's eval/ keys."""
    from benchmark.performance import gpu_check

    def write(name, lines):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    write(
        "a",
        [
            {"global_step": 0, "time": 5.0, "eval/score": 0.5},
            {"global_step": 1, "time": 10.0, "lr": 1e-5, "objective/kl": 0.0, "policy/ratio_first_minibatch": 1.0},
            {"global_step": 2, "time": 13.0, "lr": 1e-5, "objective/kl": 0.25, "policy/grad_norm": 2.0},
            {"global_step": 3, "time": 20.0, "lr": 1e-5, "eval/score": 0.75},
        ],
    )
    write("b", [{"global_step": 1, "time": 1.0, "lr": 1e-3, "objective/grad_norm": 3.5}])
    gpu_check.summary(str(tmp_path))
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0] == "| a | 3 | 0 | 1 | - | - | 5.00 | {'eval/score': 0.75} |"
    assert rows[1] == "| b | 1 | - | - | - | 3.5 | nan | {} |"


# benchmark.claims.reward_ensemble


def test_agreement_of_ensemble_members_against_a_loop():
    from benchmark.claims.reward_ensemble import agreement

    g = torch.Generator().manual_seed(0)
    prefers = torch.rand(4, 50, generator=g) > 0.3
    pairwise, unanimous = agreement(prefers)
    rows = prefers.tolist()
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    expected = sum(sum(x == y for x, y in zip(rows[a], rows[b])) / 50 for a, b in pairs) / len(pairs)
    assert pairwise == pytest.approx(expected, abs=1e-6)
    assert unanimous == pytest.approx(sum(len(set(column)) == 1 for column in zip(*rows)) / 50, abs=1e-6)
    assert agreement(prefers[:1]) == (1.0, 1.0)
    assert agreement(torch.stack([prefers[0], ~prefers[0]])) == (0.0, 0.0)


def test_reward_ensemble_report_on_two_copies(tiny_reward_model_dir, tmp_path):
    """Two copies of one reward model: each member's accuracy is the model's, the members agree on every pair, and
    every combination of the ensemble is as accurate as one member."""
    import shutil

    from benchmark.claims.reward_ensemble import report

    for k in range(2):
        shutil.copytree(tiny_reward_model_dir, tmp_path / "ensemble" / f"member_{k}")
    rows = [{"prompt_ids": [1, 5, 6], "chosen_ids": [7 + i, 2], "rejected_ids": [30 + 2 * i]} for i in range(6)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(str(tmp_path / "ensemble"), str(tmp_path / "test.jsonl"), uwo_coefs=(0.5, 2.0))
    table = [line for line in text.splitlines() if line.startswith("| member") or line.startswith("| ensemble")]
    accuracies = {line.split(" | ")[1] for line in table}
    assert len(table) == 6 and len(accuracies) == 1, text
    assert [line.split(" | ")[0] for line in table[-2:]] == [
        "| ensemble: uwo (lambda 0.5)",
        "| ensemble: uwo (lambda 2)",
    ]
    assert "Members agreeing on a pair: 1.000 (two members, averaged), 1.000 (all of them)." in text
    assert "over the held-out responses: median 0.000, 90th percentile 0.000, max 0.000." in text


def test_frontier_points_average_the_seeds_at_each_evaluation_step(tmp_path):
    """Gold against KL over seeds: at each step every run evaluated, the mean KL and the mean and std of the gold
    score; the step-0 line (no KL logged) sits at x_at_step0; a step only one seed reached is left out."""
    from benchmark.statistics.registry import frontier_points, load_run

    def write_run(name, lines):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return load_run(str(folder))

    a = write_run("t__x__1__1", [
        {"global_step": 0, "eval/accuracy": 0.5},
        {"global_step": 1, "objective/kl": 0.1},
        {"global_step": 2, "objective/kl": 0.4, "eval/accuracy": 0.6},
        {"global_step": 4, "objective/kl": 0.9, "eval/accuracy": 0.7},
    ])  # fmt: skip
    b = write_run("t__x__2__1", [
        {"global_step": 0, "eval/accuracy": 0.3},
        {"global_step": 2, "objective/kl": 0.2, "eval/accuracy": 0.8},
    ])  # fmt: skip
    steps, xs, ys, std = frontier_points([a, b], "eval/accuracy", "objective/kl", x_at_step0=0.0)
    assert steps.tolist() == [0, 2]
    assert xs.tolist() == pytest.approx([0.0, 0.3]) and ys.tolist() == pytest.approx([0.4, 0.7])
    assert std.tolist() == pytest.approx([0.02**0.5, 0.02**0.5])  # sample std of two values 0.2 apart
    assert frontier_points([a, b], "eval/accuracy", "objective/kl")[0].tolist() == [2]  # no x at step 0


def test_registry_change_is_each_runs_last_steps_minus_its_first_worked_out_here(tmp_path):
    """change: per seed, the mean of the last W values minus the mean of the first W, then mean ± std over seeds and
    the claim verdict on the 95% t interval; a run with fewer than 2 W values is left out."""
    from benchmark.statistics.registry import change_table, load_run

    def run(name, values):
        folder = tmp_path / name
        folder.mkdir()
        lines = [{"global_step": i + 1, "tools/call_rate": v} for i, v in enumerate(values)]
        (folder / "config.json").write_text(json.dumps({"args": {"seed": int(name[-1])}}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return load_run(str(folder))

    runs = [run("t__x__1", [0.5, 0.6, 0.7, 0.9, 1.0, 0.9]), run("t__x__2", [0.2, 0.4, 0.5, 0.8, 0.8, 0.9]),
            run("t__x__3", [0.4, 0.4, 0.5, 0.7, 0.8, 0.8]), run("t__x__4", [0.1, 0.2, 0.3])]  # fmt: skip
    text = change_table([("tools", runs)], ["tools/call_rate"], window=2, at_least=0.0)
    row = text.splitlines()[2].split(" | ")
    changes = [(0.95 - 0.55), (0.85 - 0.3), (0.8 - 0.4)]
    assert row[2] == "0.550 / 0.300 / 0.400" and row[3] == "0.950 / 0.850 / 0.800"
    assert row[4] == " / ".join(f"{c:.3f}" for c in changes)
    assert row[5] == f"{statistics.mean(changes):.3f} ± {statistics.stdev(changes):.3f}"
    half = 4.303 * statistics.stdev(changes) / 3**0.5
    assert statistics.mean(changes) - half > 0 and row[-2] == "**held**"
    assert row[-1] == "0.1250 |"  # every change above 0: 1 of the 2^3 sign assignments


def test_registry_paired_peak_and_fall_worked_out_here(tmp_path):
    """paired --statistic peak / fall: each run's largest logged value, and that minus its final value (how much it
    lost after its best evaluation), paired by seed."""

    def runs(name, series):
        return [
            registry.load_run(write_run(str(tmp_path), f"t__{name}__{seed}__1", seed, [
                {"global_step": 10 * i, "eval/accuracy": v} for i, v in enumerate(values)]))
            for seed, values in series.items()
        ]  # fmt: skip

    single = runs("single", {1: [0.5, 0.64, 0.57, 0.50], 2: [0.5, 0.61, 0.60, 0.61]})
    wco = runs("wco", {1: [0.5, 0.60, 0.62, 0.61], 2: [0.5, 0.58, 0.63, 0.59]})
    experiments = [("single", single), ("wco", wco)]
    peak = registry.paired_table(experiments, ["eval/accuracy"], "single", statistic="peak").splitlines()[2]
    assert peak.split(" | ")[1:6] == [
        "eval/accuracy (peak)",
        "1 2",
        "0.640 / 0.610",
        "0.620 / 0.630",
        "-0.020 / 0.020",
    ]
    fall = registry.paired_table(experiments, ["eval/accuracy"], "single", statistic="fall").splitlines()[2]
    assert fall.split(" | ")[1:6] == [
        "eval/accuracy (fall)",
        "1 2",
        "0.140 / 0.000",
        "0.010 / 0.040",
        "-0.130 / 0.040",
    ]


def test_registry_paired_fixed_baseline_pairs_one_run_with_every_seed(tmp_path):
    """paired --fixed_baseline: the baseline's one run (seed 1, a greedy probe that any seed would repeat) is the
    baseline of every seed of the other experiment; two baseline runs are refused."""

    def run(name, seed, value):
        lines = [{"global_step": 0, "eval/accuracy": value}]
        return registry.load_run(write_run(str(tmp_path), f"t__{name}__{seed}__1", seed, lines))

    finals = {1: 1.0, 2: 0.02, 3: 0.5}
    experiments = [("step0", [run("step0", 1, 0.1)]), ("final", [run("final", s, v) for s, v in finals.items()])]
    row = registry.paired_table(experiments, ["eval/accuracy"], "step0", at_least=0.0, fixed_baseline=True)
    cells = [cell.strip() for cell in row.splitlines()[2].strip("|").split("|")]
    diffs = [v - 0.1 for v in finals.values()]
    mean, std = statistics.mean(diffs), statistics.stdev(diffs)
    assert cells[2:7] == ["1 2 3", "0.100 / 0.100 / 0.100", "1.000 / 0.020 / 0.500"] + [
        " / ".join(f"{d:.3f}" for d in diffs),
        f"{mean:.3f} ± {std:.3f}",
    ]
    assert cells[7] == f"{mean / (std / 3**0.5):.2f} (2)" and cells[-2] == "**inconclusive**"  # t 1.6 < 4.30
    assert cells[-1] == "0.2500"  # +0.90 / -0.08 / +0.40: sums >= +1.22 by (+ + +) and (+ - +), 2 of 8
    plain = registry.paired_table(experiments, ["eval/accuracy"], "step0").splitlines()[2]
    assert plain.split(" | ")[2] == "1"  # without the flag only seed 1 has a baseline
    with pytest.raises(ValueError, match="needs one step0 run"):
        registry.paired_table(experiments[1:] + [("step0", experiments[1][1])], ["eval/accuracy"], "step0",
                              fixed_baseline=True)  # fmt: skip


def test_registry_clopper_pearson_against_its_definition():
    """The exact binomial interval of k of n, checked by its definition with the tail sums written here as a
    plain loop in float64 (P(X >= k | low) = 0.025, P(X <= k | high) = 0.025), by the closed forms at k = 0 and k = n,
    and by a fine grid: no p between its ends is rejected by either tail, none just outside accepted."""

    def tail(n, p, ks):
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in ks)

    assert registry.clopper_pearson(1, 3) == pytest.approx(
        (0.0084038, 0.9057007), abs=1e-6
    )  # docs/grpo_tools.md's 1 of 3 seeds: 0.01 to 0.91
    rng = random.Random(65)
    for _ in range(30):
        n = rng.randint(1, 60)
        k = rng.randint(0, n)
        low, high = registry.clopper_pearson(k, n)
        assert 0.0 <= low <= k / n <= high <= 1.0
        if k == 0:
            assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / n), abs=1e-9)
        else:
            assert tail(n, low, range(k, n + 1)) == pytest.approx(0.025, abs=1e-9)
        if k == n:
            assert high == 1.0 and low == pytest.approx(0.025 ** (1 / n), abs=1e-9)
        else:
            assert tail(n, high, range(0, k + 1)) == pytest.approx(0.025, abs=1e-9)
        for p in (low - 1e-4, high + 1e-4):  # just outside: one tail is below 0.025
            if 0 < p < 1:
                assert min(tail(n, p, range(k, n + 1)), tail(n, p, range(0, k + 1))) < 0.025


def test_registry_paired_counts_the_seeds_of_a_bimodal_outcome(tmp_path):
    """paired --count_above: the seeds whose difference reaches the bound, k of n, with the Clopper-Pearson interval of
    that share; grpo_tools' chaining (1 seed of 3 learns) reads 1 of 3 (0.008 to 0.906)."""

    def run(name, seed, value):
        lines = [{"global_step": 0, "eval/accuracy": value}]
        return registry.load_run(write_run(str(tmp_path), f"t__{name}__{seed}__1", seed, lines))

    experiments = [
        ("step0", [run("step0", 1, 0.0)]),
        ("final", [run("final", s, v) for s, v in ((1, 1.0), (2, 0.02), (3, 0.02))]),
    ]
    table = registry.paired_table(experiments, ["eval/accuracy"], "step0", fixed_baseline=True, count_above=0.5)
    header, _, row = table.splitlines()
    assert header.split(" | ")[-1].startswith("seeds with difference >= 0.5")
    assert row.split(" | ")[-1] == "1 of 3 (0.008 to 0.906) |"
    everyone = registry.paired_table(experiments, ["eval/accuracy"], "step0", fixed_baseline=True, count_above=0.0)
    low, _ = registry.clopper_pearson(3, 3)
    assert everyone.splitlines()[2].split(" | ")[-1] == f"3 of 3 ({low:.3f} to 1.000) |"


# ---------------------------------------------------------------------------------------------------------------
# benchmark.claims.best_of_n: the subset estimator, the rules, the bootstrap, the stages' files


def brute_force_best_of_n(score, has_eos, values, n):
    """The mean over every n-subset of the value of its pick: the best (has_eos, score), ties broken at random (the
    mean value of the tied best)."""
    total, subsets = np.zeros(values.shape[1:]), 0
    for subset in itertools.combinations(range(len(score)), n):
        best = max((has_eos[i], score[i]) for i in subset)
        tied = [i for i in subset if (has_eos[i], score[i]) == best]
        total += values[tied].mean(0)
        subsets += 1
    return total / subsets


def test_best_of_n_estimator_matches_every_subset():
    from benchmark.claims import best_of_n as bon

    rng = np.random.default_rng(0)
    for trial in range(200):
        N = int(rng.integers(1, 9))
        score = rng.integers(0, 3, N).astype(float) if trial % 2 else rng.normal(size=N)  # ties on odd trials
        has_eos = rng.uniform(size=N) < 0.7
        values = np.stack([rng.integers(0, 2, N), rng.normal(size=N)], 1).astype(float)
        got = bon.best_of_n_values(score, has_eos, values, bon.pick_weights(N))
        want = np.stack([brute_force_best_of_n(score, has_eos, values, n) for n in range(1, N + 1)])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    W = bon.pick_weights(64)
    np.testing.assert_allclose(W.sum(1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(W[0], np.full(64, 1 / 64))  # n = 1: a random response
    assert W[-1, 0] == 1.0 and W[-1, 1:].sum() == 0.0  # n = N: the best


def test_best_of_n_never_picks_an_unfinished_response_over_a_finished_one():
    from benchmark.claims import best_of_n as bon

    score, has_eos, correct = [5.0, 0.1, -2.0, 9.0], [False, True, True, False], [0.0, 1.0, 0.0, 0.0]
    curve = bon.best_of_n_values(score, has_eos, correct, bon.pick_weights(4))
    assert curve[-1] == 1.0  # the best finished one, not the 5.0 or the 9.0
    # Two finished of four: a subset of 3 always holds one of them, so no unfinished response is ever picked.
    assert curve[2] == pytest.approx(brute_force_best_of_n(*map(np.array, (score, has_eos, correct)), 3))
    assert bon.best_of_n_values([1.0, 2.0], [False, False], [1.0, 0.0], bon.pick_weights(2))[-1] == 0.0  # none


def test_best_of_n_rules_against_loops():
    from benchmark.claims import best_of_n as bon

    rng = np.random.default_rng(1)
    P, K, N = 3, 4, 5
    S = rng.normal(size=(P, K, N)) * np.array([1.0, 2.0, 0.5, 1.5])[None, :, None]
    names = [f"member_{k}" for k in range(K)]
    rules = bon.rule_scores(S, names, [0.5, 2.0])
    assert list(rules) == [*names, "mean", "wco", "wco_std", "uwo_0.5", "uwo_2"]
    every = {k: [S[p, k, i] for p in range(P) for i in range(N)] for k in range(K)}
    centre = {k: statistics.fmean(every[k]) for k in range(K)}
    spread = {k: statistics.pstdev(every[k]) for k in range(K)}
    for p in range(P):
        for i in range(N):
            members = [S[p, k, i] for k in range(K)]
            for k in range(K):
                assert rules[names[k]][p, i] == members[k]
            assert rules["mean"][p, i] == pytest.approx(statistics.fmean(members), abs=1e-12)
            assert rules["wco"][p, i] == min(members)
            z = [(S[p, k, i] - centre[k]) / spread[k] for k in range(K)]
            assert rules["wco_std"][p, i] == pytest.approx(min(z), abs=1e-12)
            for coef in (0.5, 2.0):
                uwo = statistics.fmean(members) - coef * statistics.pvariance(members)
                assert rules[f"uwo_{coef:g}"][p, i] == pytest.approx(uwo, abs=1e-12)
    assert list(bon.rule_scores(S[:, :1], names[:1], [1.0])) == ["member_0"]  # one member: no ensemble rules


def test_best_of_n_bootstrap_is_deterministic_and_the_verdict_rule():
    from benchmark.claims import best_of_n as bon

    a, b = bon.bootstrap_counts(7, 50, seed=3), bon.bootstrap_counts(7, 50, seed=3)
    np.testing.assert_array_equal(a, b)
    assert (a.sum(1) == 7).all() and not np.array_equal(a, bon.bootstrap_counts(7, 50, seed=4))
    values = np.arange(7.0)
    np.testing.assert_allclose(bon.bootstrap_means(a, values), (a * values).sum(1) / 7)
    assert bon.bootstrap_verdict(0.01, 0.2) == "held"
    assert bon.bootstrap_verdict(-0.2, -0.01) == "not held"
    assert bon.bootstrap_verdict(-0.01, 0.2) == "inconclusive"
    assert bon.bootstrap_verdict(0.3, 0.3) == "inconclusive"  # no spread: no interval
    assert bon.p_above(np.array([0.1, 0.2, -0.1, 0.3])) == pytest.approx(2 / 5)
    assert bon.peak_index(np.array([0.5, 0.7, 0.6])) == 1
    assert bon.peak_index(np.array([0.5, 0.7, 0.7 - 1e-15])) == 2  # saturated: it does not turn down


def test_best_of_n_drops_are_measured_at_the_other_halfs_peak():
    """Cross-fitting against a loop (float64, random curves): a prompt's drop is its accuracy at the peak of the mean
    curve of the other half's prompts minus its accuracy at n = N; the halves split the prompts evenly, by seed."""
    from benchmark.claims import best_of_n as bon

    rng = np.random.default_rng(5)
    for P, N in [(9, 6), (40, 12)]:
        curve, half = rng.uniform(size=(P, N)), bon.prompt_halves(P, seed=3)
        assert sorted(np.bincount(half)) == [P // 2, P - P // 2]
        assert (half == bon.prompt_halves(P, seed=3)).all() and (half != bon.prompt_halves(P, seed=4)).any()
        drops, peaks = bon.cross_fitted_drops(curve, half)
        for p in range(P):
            others = [q for q in range(P) if half[q] != half[p]]
            mean = [sum(curve[q, n] for q in others) / len(others) for n in range(N)]
            peak = max(range(N), key=lambda n: (mean[n], -n))  # the first maximum
            if mean[-1] >= mean[peak] - 1e-12:
                peak = N - 1
            assert drops[p] == pytest.approx(curve[p, peak] - curve[p, -1], abs=1e-12)
            assert peaks[1 - half[p]] == peak
    # A curve that rises on one half and falls on the other: the drops need not be >= 0.
    curve = np.array([[0.0, 1.0, 0.5], [0.0, 0.2, 0.9]])
    drops, peaks = bon.cross_fitted_drops(curve, np.array([0, 1]))
    assert peaks == (1, 2) and drops.tolist() == pytest.approx([0.0, 0.2 - 0.9])


def test_best_of_n_splits_are_seeded_halvings_the_first_the_one_split():
    from benchmark.claims import best_of_n as bon

    for P in (9, 40):
        halves = bon.prompt_splits(P, seed=3, num_splits=50)
        assert halves.shape == (50, P) and (halves == bon.prompt_splits(P, seed=3, num_splits=50)).all()
        assert (halves[0] == bon.prompt_halves(P, seed=3)).all()  # --splits 1 is the one-split analysis
        assert all(sorted(np.bincount(row)) == [P // 2, P - P // 2] for row in halves)
        assert len({tuple(row) for row in halves}) > 30  # different halvings (126 exist at P = 9), not one repeated
    rng = np.random.default_rng(6)
    curve, halves = rng.uniform(size=(12, 5)), bon.prompt_splits(12, seed=1, num_splits=7)
    drops, peaks = bon.split_drops(curve, halves)
    for s, half in enumerate(halves):
        one, peak = bon.cross_fitted_drops(curve, half)
        assert (drops[s] == one).all() and peaks[s] == (peak[0] + 1, peak[1] + 1)


def test_best_of_n_cross_fitted_estimate_is_the_average_over_the_splits(tmp_path):
    """The registered drop of each rule is each prompt's cross-fitted drop averaged over --splits halvings (worked out
    here from the per-prompt curves, split by split); the flattening is the members' average of those minus the rule's.
    With one split the analysis is the one-split one, and "held on single splits" is that split's own verdict."""
    from benchmark.claims import best_of_n as bon

    write_best_of_n_files(str(tmp_path / "run"), P=30, N=8)
    rows, names, _ = bon.load_responses(str(tmp_path / "run"))
    result = bon.analysis(rows, names, [1.0], 200, seed=2, num_splits=25)
    halves = bon.prompt_splits(30, seed=2, num_splits=25)
    averaged = {}
    for name, curve in result["curves"].items():
        per_prompt = np.zeros(30)
        for half in halves:
            per_prompt += bon.cross_fitted_drops(curve, half)[0] / 25
        averaged[name] = per_prompt
        assert result["drop"][name][0] == pytest.approx(per_prompt.mean(), abs=1e-12), name
        assert len(result["peak_n"][name]) == 50
    members_average = np.mean([averaged[name] for name in names], 0)
    for name in ("mean", "wco", "uwo_1"):
        assert result["flatten"][name][0] == pytest.approx((members_average - averaged[name]).mean(), abs=1e-12)
    assert result["splits"] == 25 and all(0 <= v <= 1 for v in result["split_held"]["flatten"].values())
    one = bon.analysis(rows, names, [1.0], 200, seed=2, num_splits=1)
    half = bon.prompt_halves(30, seed=2)
    for name, curve in one["curves"].items():
        drops, peaks = bon.cross_fitted_drops(curve, half)
        assert one["drop"][name][0] == pytest.approx(drops.mean(), abs=1e-12)
        assert one["peak_n"][name] == (peaks[0] + 1, peaks[1] + 1)
        assert one["split_held"]["drop"][name] == (one["drop"][name][3] == "held")
    for name, (*_, verdict, _) in one["flatten"].items():
        assert one["split_held"]["flatten"][name] == (verdict == "held")
    with pytest.raises(SystemExit, match="--splits must be at least 1"):
        bon.main(["analyse", "--out_dir", str(tmp_path / "run"), "--splits", "0"])


def write_best_of_n_files(folder, P=60, N=16, seed=0):
    """A synthetic sample file and score files: member_0 is over-optimised (a planted hack: one or two wrong responses
    of every odd prompt score 3 above the rest), member_1 and member_2 rank correct above wrong (noise 0.1); every
    sixth prompt has no right answer."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "scores"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"num_samples": N}, f)
    samples, scores = [], {f"member_{k}": [] for k in range(3)}
    for p in range(P):
        correct = (rng.uniform(size=N) < 0.5).astype(float)
        correct[0], correct[1], correct[2] = 1.0, 0.0, 0.0
        if p % 6 == 0:  # no right answer: every rule errs there, where the members agree
            correct[:] = 0.0
        hack = np.zeros(N)
        if p % 2:
            hack[1 : 2 + int(rng.integers(0, 2))] = 1.0
        has_eos = rng.uniform(size=N) < 0.95
        has_eos[0] = True
        for i in range(N):
            samples.append(dict(prompt_index=p, sample=i, gold="1", correct=correct[i], has_eos=bool(has_eos[i])))
            base = correct[i] + 0.1 * rng.normal(size=3)
            for k, value in enumerate([base[0] + 3 * hack[i], base[1], base[2]]):
                scores[f"member_{k}"].append(dict(prompt_index=p, sample=i, score=float(np.float32(value))))
    for name, path in [("samples", "samples.jsonl")] + [(k, f"scores/{k}.jsonl") for k in scores]:
        with open(os.path.join(folder, path), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in (samples if name == "samples" else scores[name]))


def test_best_of_n_analyse_finds_the_planted_over_optimisation(tmp_path):
    from benchmark.claims import best_of_n as bon

    write_best_of_n_files(str(tmp_path / "run"))
    out = str(tmp_path / "results" / "bon")
    flags = ["--out_dir", str(tmp_path / "run"), "--out", out, "--bootstrap", "400", "--uwo_coef", "0.5", "1"]
    result = bon.main(["analyse", *flags])
    acc = result["accuracy"]
    assert acc["member_0"][0] == acc["member_1"][0] == acc["wco"][0]  # n = 1: a random response, whatever the rule
    assert result["drop"]["member_0"][3] == "held" and result["drop"]["member_0"][0] > 0.15
    assert max(result["peak_n"]["member_0"]) < 8 and result["members_turn_down"] == "held"
    for name in ("member_1", "member_2", "wco", "uwo_1"):
        assert result["drop"][name][3] == "not held (peak at n = N)", name
    # The baseline is the members' average drop: member_0's planted one over 3, the others' 0.
    assert result["average_drop"][0] == pytest.approx(result["drop"]["member_0"][0] / 3)
    for name in ("wco", "wco_std", "uwo_0.5", "uwo_1"):
        assert result["flatten"][name][3] == "held", name
        assert result["flatten_each"][name]["member_1"][0] == 0.0  # each member paired too
    assert result["flatten_family"] == {"WCO (raw or standardised)": "held", "UWO (some lambda)": "held"}
    # member_0's picks at n = N are the hacks on the hackable prompts: wrong, and the members disagree on them
    above, below, diff, *_, verdict = result["disagreement"]["member_0"][0]
    assert verdict == "held" and above > 0.8 and 0.1 < below < 0.5
    text = open(out + ".md").read()
    assert "| member_0 |" in text and "| UWO, lambda 0.5 |" in text and "**held**" in text
    assert os.path.getsize(out + ".png") > 0
    # The committed per-prompt file makes the same table and figure alone; the bootstrap is the same under its seed.
    again = str(tmp_path / "again" / "bon")
    bon.main(["analyse", "--from_responses", out + ".jsonl", "--out", again, *flags[4:]])
    assert open(again + ".md").read() == text


def test_best_of_n_analyse_leaves_out_prompts_not_yet_scored(tmp_path):
    from benchmark.claims import best_of_n as bon

    folder = str(tmp_path / "run")
    write_best_of_n_files(folder, P=6, N=4)
    path = os.path.join(folder, "scores", "member_2.jsonl")
    rows = registry.read_jsonl(path)
    with open(path, "w") as f:  # the score stage was stopped inside prompt 4
        f.writelines(json.dumps(row) + "\n" for row in rows[:18])
    loaded, names, left_out = bon.load_responses(folder)
    assert [r["prompt_index"] for r in loaded] == [0, 1, 2, 3] and left_out == 2
    assert names == ["member_0", "member_1", "member_2"]


def fake_generate(prompts, n):
    """Responses of ids 0-5 (0 is the stop id), from torch's generator (seeded by the stage for each chunk)."""
    responses = torch.randint(0, 6, (len(prompts) * n, 5))
    lengths = torch.randint(1, 6, (len(prompts) * n,))
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    return responses, mask, [" ".join(map(str, r.tolist())) for r in responses]


def test_best_of_n_sample_resumes_to_the_uninterrupted_file(tmp_path):
    from benchmark.claims import best_of_n as bon

    prompts, golds = [[1, 2], [3], [4, 5, 6], [7], [8, 9]], ["1", "2", "3", "4", "5"]
    verify = lambda texts, chunk_golds: [float(t.startswith(g)) for t, g in zip(texts, chunk_golds)]
    indices = bon.select_prompts(len(prompts), 4, seed=1)
    assert len(indices) == 4 and indices == sorted(indices) and indices == bon.select_prompts(5, 4, seed=1)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for folder in (whole, parts):
        os.makedirs(folder)

    def run(folder, generate):
        return bon.sample_rows(str(folder), indices, prompts, golds, 3, 1, 7, generate, verify, {0})

    assert run(whole, fake_generate) == 4
    calls = []

    def dies_on_the_third_chunk(chunk_prompts, n):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return fake_generate(chunk_prompts, n)

    with pytest.raises(KeyboardInterrupt):
        run(parts, dies_on_the_third_chunk)
    with open(parts / "samples.jsonl", "a") as f:
        f.write('{"prompt_index": 99, "sam')  # a line a kill cut short
    assert run(parts, fake_generate) == 2
    assert (parts / "samples.jsonl").read_text() == (whole / "samples.jsonl").read_text()
    rows = registry.read_jsonl(str(whole / "samples.jsonl"))
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [(i, j) for i in indices for j in range(3)]
    for row in rows:
        assert row["has_eos"] == (row["response_ids"][-1:] == [0]) and row["gold"] == golds[row["prompt_index"]]
    assert run(parts, fake_generate) == 0  # complete: nothing sampled again


def test_best_of_n_score_resumes_and_checks_the_settings(tmp_path):
    """Two members scored batch by batch, killed inside the second batch (the first member's scores of it written,
    the second's not, and a line cut short): the rerun scores the rest and gives the uninterrupted files."""
    from benchmark.claims import best_of_n as bon

    samples = [dict(prompt_index=p, sample=j, response_ids=[1] * (j + 1)) for p in range(3) for j in range(4)]
    score_a = lambda batch: [0.1 * len(r["response_ids"]) + r["prompt_index"] for r in batch]
    score_b = lambda batch: [-0.1 * len(r["response_ids"]) for r in batch]
    whole = {str(tmp_path / "whole_a.jsonl"): score_a, str(tmp_path / "whole_b.jsonl"): score_b}
    assert list(bon.score_rows(whole, samples, 5).values()) == [12, 12]
    batches = []

    def dies_on_the_second_batch(batch):
        batches.append(1)
        if len(batches) == 2:
            raise KeyboardInterrupt
        return score_b(batch)

    parts_a, parts_b = str(tmp_path / "parts_a.jsonl"), str(tmp_path / "parts_b.jsonl")
    with pytest.raises(KeyboardInterrupt):
        bon.score_rows({parts_a: score_a, parts_b: dies_on_the_second_batch}, samples, 5)
    assert len(registry.read_jsonl(parts_a)) == 10 and len(registry.read_jsonl(parts_b)) == 5
    with open(parts_b, "a") as f:
        f.write('{"prompt_index": 1, "sample"')
    assert list(bon.score_rows({parts_a: score_a, parts_b: score_b}, samples, 5).values()) == [2, 7]
    for part, name in ((parts_a, "whole_a"), (parts_b, "whole_b")):
        assert open(part).read() == open(str(tmp_path / name) + ".jsonl").read()
    assert [r["score"] for r in registry.read_jsonl(str(tmp_path / "whole_a.jsonl"))][:2] == [0.1, 0.2]
    meta = {"num_samples": 4, "temperature": 1.0, "samplers": ["hf_generate"]}
    assert bon.check_meta(str(tmp_path / "run"), meta) is None
    bon.write_meta(str(tmp_path / "run"), meta)
    assert bon.check_meta(str(tmp_path / "run"), meta | {"samplers": ["vllm"]}) == meta  # the sampler may change
    with pytest.raises(SystemExit, match="temperature"):
        bon.check_meta(str(tmp_path / "run"), meta | {"temperature": 0.7})


@pytest.mark.slow
def test_best_of_n_stages_on_the_tiny_model(tiny_model_dir, tiny_reward_model_dir, task_dir, tmp_path):
    """sample (HF generate) -> score (two members: the same weights, biases 0 and 0.5) -> analyse on the tiny model:
    the files line up, each score (the prompt's keys and values computed once, its responses in chunks of 3 by length)
    is member_scores_of's on the prompt and the response alone, centred by the member's bias."""
    import shutil

    import ppo_rlhf
    from benchmark.claims import best_of_n as bon

    ensemble = tmp_path / "ensemble"
    for name, bias in (("member_a", 0.0), ("member_b", 0.5)):
        shutil.copytree(tiny_reward_model_dir, ensemble / name)
        config = json.loads((ensemble / name / "config.json").read_text())
        (ensemble / name / "config.json").write_text(json.dumps(config | {"bias": bias}))
    out = str(tmp_path / "run")
    sample = ["sample", "--out_dir", out, "--model_name_or_path", tiny_model_dir, "--dataset_path", task_dir]
    sample += ["--num_samples", "4", "--num_prompts", "3", "--response_length", "8", "--prompts_per_chunk", "2"]
    bon.main([*sample, "--no-vllm"])
    bon.main(["score", "--out_dir", out, "--ensemble", str(ensemble), "--batch_size", "5", "--chunk_size", "3"])
    meta = json.loads(open(os.path.join(out, "meta.json")).read())
    assert meta["samplers"] == ["hf_generate"] and len(meta["prompt_indices"]) == 3
    rows = registry.read_jsonl(os.path.join(out, "samples.jsonl"))
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [
        (i, j) for i in meta["prompt_indices"] for j in range(4)
    ]
    a = registry.read_jsonl(os.path.join(out, "scores", "member_a.jsonl"))
    b = registry.read_jsonl(os.path.join(out, "scores", "member_b.jsonl"))
    assert [(r["prompt_index"], r["sample"]) for r in a] == [(r["prompt_index"], r["sample"]) for r in rows]
    np.testing.assert_allclose([r["score"] - 0.5 for r in a], [r["score"] for r in b], atol=1e-5)
    args = ppo_rlhf.Config(model_name_or_path=tiny_model_dir)
    model = ppo_rlhf._load_model(
        str(ensemble / "member_a"), ppo_rlhf.AutoModelForSequenceClassification, args, meta["pad_token_id"]
    )
    accelerator = ppo_rlhf.Accelerator()
    for row, scored in zip(rows, a):
        prompt = meta["prompts"][str(row["prompt_index"])]
        ids = torch.tensor([prompt + row["response_ids"]])
        want = ppo_rlhf.member_scores_of([model.eval()], ids, torch.ones_like(ids), accelerator)[0, 0].item()
        assert scored["score"] == pytest.approx(want, abs=1e-5)
        assert row["has_eos"] == (row["response_ids"][-1] in meta["stop_ids"])
        assert row["correct"] == ppo_rlhf.verifier_correct([row["text"]], [row["gold"]]).item()
    result = bon.main(["analyse", "--out_dir", out, "--out", str(tmp_path / "bon"), "--bootstrap", "50"])
    assert result["num_prompts"] == 3 and result["rules"][:2] == ["member_a", "member_b"]
    assert bon.main([*sample, "--no-vllm"]) is None  # complete: resumes to nothing


# benchmark/statistics/power.py: the seeds a paired check needs (docs/power_plan.md).
# Student's t quantiles from printed tables (independent of registry's): t(0.8, df) and t(0.975, df).
T_80 = {2: 1.0607, 3: 0.9785, 4: 0.9410, 9: 0.8834, 29: 0.8542}
T_975_PRINTED = {2: 4.3027, 4: 2.7764, 9: 2.2622}


def test_power_t_quantile_against_printed_tables():
    from benchmark.statistics import power

    for df, t in T_80.items():
        assert power.t_quantile(0.8, df) == pytest.approx(t, abs=5e-5)
        assert power.t_quantile(0.2, df) == pytest.approx(-t, abs=5e-5)
    for df, t in T_975_PRINTED.items():
        assert power.t_quantile(0.975, df) == pytest.approx(t, abs=5e-5)


def test_power_at_holms_first_step_and_the_prompts_best_of_n_needs():
    """mde and seeds_needed at another one-sided level (Holm's first step over k arms, 0.025 / k): t(0.995, df) from
    printed tables (3.169 at 10 df, 2.845 at 20); best_of_n's prompts to decide a flattening are seeds_needed on the
    per-prompt values."""
    from benchmark.claims import best_of_n as bon
    from benchmark.statistics import power

    assert power.mde(0.3, 8) == power.mde(0.3, 8, alpha=0.025)
    for df, t in ((10, 3.169), (20, 2.845)):
        want = (t + power.t_quantile(0.8, df)) * 0.3 / math.sqrt(df + 1)
        assert power.mde(0.3, df + 1, alpha=0.005) == pytest.approx(want, abs=2e-4)
    alone, holm5 = power.seeds_needed(0.2, 0.3, 0, math.inf), power.seeds_needed(0.2, 0.3, 0, math.inf, alpha=0.005)
    assert holm5 > alone and power.mde(0.3, holm5, alpha=0.005) <= 0.2 < power.mde(0.3, holm5 - 1, alpha=0.005)
    values = np.random.default_rng(2).normal(0.05, 0.2, 128)
    want = power.seeds_needed(values.mean(), values.std(ddof=1), 0, math.inf, alpha=0.005)
    assert bon.prompts_needed(values, 0.005) == want and bon.prompts_needed(values) < want


def test_power_seeds_needed_is_the_first_n_whose_mde_reaches_the_bound():
    from benchmark.statistics import power

    # MDE by hand at n = 3 and 10 with the printed quantiles: (t975 + t80) x std / sqrt(n).
    assert power.mde(0.074, 3) == pytest.approx((4.3027 + 1.0607) * 0.074 / math.sqrt(3), abs=1e-3)
    assert power.mde(0.074, 10) == pytest.approx((2.2622 + 0.8834) * 0.074 / math.sqrt(10), abs=1e-4)
    for mean, std, low, high in [
        (-0.074, 0.074, -math.inf, 0.0),
        (2.27, 0.33, 1.5, math.inf),
        (0.05, 0.1, -0.02, 0.02),
    ]:
        gap = min(abs(mean - b) for b in (low, high) if math.isfinite(b))
        n = power.seeds_needed(mean, std, low, high)
        assert power.mde(std, n) <= gap and (n == 3 or power.mde(std, n - 1) > gap)
    assert power.seeds_needed(0.0, 0.1, -math.inf, 0.0) is None  # on the bound: no number of seeds decides it


def test_power_simulated_share_decided_against_a_plain_loop():
    from benchmark.statistics import power

    # The rule written out here: a one-sided claim "difference <= 0" is decided when the 95% interval
    # mean ± t975 x s / sqrt(n) lies wholly below or wholly above 0; draws from a generator of its own.
    mean, std, n, draws = -0.074, 0.074, 6, 4000
    rng, decided = random.Random(3), 0
    for _ in range(draws):
        xs = [rng.gauss(mean, std) for _ in range(n)]
        m = sum(xs) / n
        s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
        half = 2.5706 * s / math.sqrt(n)
        decided += m + half < 0 or m - half > 0
    share = power.simulated_decided(mean, std, n, -math.inf, 0.0, draws=draws)
    assert share == pytest.approx(decided / draws, abs=0.04)  # two Monte Carlo estimates (s.e. ~0.008 each)
    # And the formula's 80% point lands where the simulation says about 80%.
    need = power.seeds_needed(mean, std, -math.inf, 0.0)
    assert 0.75 <= power.simulated_decided(mean, std, need, -math.inf, 0.0, draws=draws) <= 0.9


def test_power_holm_rejects_less_often_than_one_arm_alone():
    from benchmark.statistics import power

    alone = power.simulated_holm([0.1], [0.05], 4, 0.0, draws=2000)[0]
    three = power.simulated_holm([0.1, 0.0, 0.0], [0.05, 0.05, 0.05], 4, 0.0, draws=2000)
    assert three[0] < alone  # a family of three: the first step at 0.025 / 3
    assert max(three[1:]) < 0.05  # arms at the bound are rarely rejected


def test_power_table_from_runs(tmp_path):
    from benchmark.statistics import power

    root = str(tmp_path / "runs")
    finals = {"none": {1: 0.39, 2: 0.33, 3: 0.24}, "raw": {1: 0.24, 2: 0.25, 3: 0.24}, "one": {1: 0.3}}
    for arm, seeds in finals.items():
        for seed, value in seeds.items():
            write_run(
                root, f"t__{arm}__{seed}__{seed}", seed, [{"global_step": 30, "time": 1.0, "eval/accuracy": value}]
            )
    out = str(tmp_path / "power.md")
    specs = [f"{arm}={root}/t__{arm}__*" for arm in finals]
    power.main(["--experiments", *specs, "--baseline", "none", "--at_most", "0", "--draws", "500", "--out", out])
    rows = {row[0]: row for row in ([c.strip() for c in line.strip("|").split("|")] for line in open(out)) if row}
    diffs = [finals["raw"][s] - finals["none"][s] for s in (1, 2, 3)]
    assert rows["raw"][3] == f"{statistics.mean(diffs):+.3f} ± {statistics.stdev(diffs):.3f}"
    assert rows["raw"][7] == str(power.seeds_needed(statistics.mean(diffs), statistics.stdev(diffs), -math.inf, 0))
    assert rows["one"][7] == "– (no spread yet)"  # one seed: no std to plan with
    # Beside the verdict, the exact sign-flip p of "<= 0": -0.15, -0.08, 0 (the zero's two signs tie): 2 of 8.
    assert rows["arm"][6] == "exact sign-flip p now (one-sided)" and rows["raw"][6] == "0.2500"


def test_power_holm_plan_is_not_simulated_when_an_arm_cannot_be_rejected():
    from benchmark.statistics import power

    # clip's mean is on the wrong side of "> 0": no number of seeds rejects it, so no search over seeds is run.
    values = {"clip": {1: -0.08, 2: -0.05, 3: -0.02}, "delta": {1: 0.08, 2: 0.1, 3: 0.12}}
    text = power.report(values, "eval/accuracy", "raw", 0.0, math.inf, False, holm_family=True, draws=200)
    assert "not simulated: clip" in text and "delta" not in text.split("not simulated:")[1]
    values["clip"] = {1: 0.1, 2: 0.12, 3: 0.14}
    assert "every arm rejected in >= 80% of draws at" in power.report(
        values, "eval/accuracy", "raw", 0.0, math.inf, False, holm_family=True, draws=200
    )
