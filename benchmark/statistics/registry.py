"""Run registry: list runs, plot learning curves over seeds, tabulate final metrics (no wandb needed).

Reads only runs/{run_name}/config.json ({"args": {...}, "git_sha": ..., ...}) and runs/{run_name}/metrics.jsonl
(one JSON object per logged step, with global_step, episode, wall-clock `time` and namespaced metrics).

    python -m benchmark.statistics.registry list [--runs_dir runs] [--filter arith_1d__grpo] [--metrics eval/accuracy]
    python -m benchmark.statistics.registry plot \
        --experiments "grpo=runs/arith_1d__grpo__*" "lr2e-5=runs/arith_1d__lr2e-5__*" \
        --metric eval/accuracy objective/accuracy --x step --smooth 8 --out benchmark/results/grpo_math.png
    python -m benchmark.statistics.registry table --experiments "grpo=runs/arith_1d__grpo__*" \
        --metrics eval/accuracy objective/scores --out benchmark/results/grpo_math.md
    python -m benchmark.statistics.registry paired \
        --experiments "grpo=runs/arith_1d__grpo__*" "lr2e-5=runs/arith_1d__lr2e-5__*" \
        --baseline grpo --metrics eval/accuracy wall_clock --out benchmark/results/grpo_lr_paired.md
    python -m benchmark.statistics.registry perf --experiments "grpo_math=runs/arith_1d__grpo__1__*" \
        "ppo_rlhf=runs/arith_1d__ppo__1__*" --out benchmark/results/training_throughput
    python -m benchmark.statistics.registry copy --out benchmark/results/grpo_variants runs/add_2t2d__grpo_mb4__*

An experiment is LABEL=GLOB: the run folders the glob matches are its seeds. Several matches of one seed (a repeat, or
an older or interrupted launch of it) are refused with a message naming them, never silently reduced to one: narrow the
glob (or remove the stale folder), or pass --all_runs to use every match (table and plot then count each run as a
sample; paired comparisons still refuse, as they need one run per seed; perf always shows every run, one row each).
Curves are the mean over seeds with a shaded band of +- one standard deviation; by step, the seeds are read at the
steps where they logged the metric; by wall-clock time, each seed is interpolated onto a common grid over the time span
all seeds cover. Standard deviations are sample standard deviations (ddof=1) everywhere; a single seed has none.

`time` in metrics.jsonl counts from the start of the process that logged the line, so a resumed run starts again
near 0; wall_clock() adds the earlier segments back, making it monotonic.

`copy` copies run folders' config.json and metrics.jsonl (a few kB each) to OUT/<run folder name>/: the copies are
committed, and every published figure and table is made from them, so it regenerates from the repository alone. It
copies finished runs only: every script saves its policy to model/ after the last line of metrics.jsonl, so a folder
without model/ is a run in progress (or killed), whose last line would otherwise pass for its final value.
"""

import argparse
import fnmatch
import glob
import json
import math
import os
import shutil
import sys

import numpy as np

DDOF = 1  # sample standard deviation over seeds, in the plots and the tables


# ---------------------------------------------------------------------------------------------------------------
# Reading runs


def read_jsonl(path):
    """The JSON objects of a JSONL file; blank lines and a last line cut short by a kill are skipped."""
    lines = []
    with open(path) as f:
        for text in f:
            if not text.strip():
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    return lines


def load_run(path):
    """A run folder as a dict: path, name, args (from config.json), git_sha, seed, exp_name, stamp, lines."""
    path = os.path.normpath(path)
    name = os.path.basename(path)
    config = {}
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    args = config.get("args", {})
    metrics_path = os.path.join(path, "metrics.jsonl")
    lines = read_jsonl(metrics_path) if os.path.isfile(metrics_path) else []
    parts = name.split("__")  # {task}__{exp_name}__{seed}__{unix_time}
    seed = args.get("seed")
    if seed is None and len(parts) >= 4 and parts[-2].lstrip("-").isdigit():
        seed = int(parts[-2])
    stamp = int(parts[-1]) if len(parts) >= 2 and parts[-1].isdigit() else None
    if stamp is None:
        stamp = os.path.getmtime(metrics_path if os.path.isfile(metrics_path) else path)
    return {
        "path": path,
        "name": name,
        "args": args,
        "git_sha": config.get("git_sha") or "",
        "seed": seed,
        "exp_name": args.get("exp_name", parts[1] if len(parts) >= 4 else ""),
        "stamp": stamp,
        "lines": lines,
    }


def is_run_dir(path):
    """A folder with a metrics.jsonl, or a config.json written by a script (not, e.g., a saved model's config)."""
    if os.path.isfile(os.path.join(path, "metrics.jsonl")):
        return True
    try:
        with open(os.path.join(path, "config.json")) as f:
            return "args" in json.load(f)
    except (OSError, ValueError):
        return False


def shared_seeds(runs, key=lambda run: run["seed"]):
    """{key: [run names]} of the keys (by default the seed) that more than one run has; runs without a seed are
    their own."""
    names = {}
    for run in runs:
        if run["seed"] is not None:
            names.setdefault(key(run), []).append(run.get("name", "?"))
    return {k: v for k, v in names.items() if len(v) > 1}


def find_runs(pattern, all_runs=False):
    """The runs whose folders match a glob, sorted by seed then start time. Several runs of one seed are all kept with
    all_runs, and refused without it (ValueError naming them): a repeat, or an older launch of the seed, is never
    silently dropped."""
    runs = [load_run(p) for p in sorted(glob.glob(pattern)) if is_run_dir(p)]
    shared = shared_seeds(runs)
    if shared and not all_runs:
        named = "; ".join(f"seed {seed}: {', '.join(names)}" for seed, names in sorted(shared.items()))
        raise ValueError(
            f"several runs of one seed match {pattern} ({named}): narrow the glob (or remove the stale folders) to"
            " one run per seed, or pass --all_runs to use every one"
        )
    return sorted(runs, key=lambda r: (r["seed"] is None, r["seed"] if r["seed"] is not None else 0, r["stamp"]))


def parse_experiment(spec):
    """'LABEL=GLOB' -> (label, glob); a bare glob is its own label."""
    label, sep, pattern = spec.partition("=")
    return (label, pattern) if sep and label else (spec, spec)


# ---------------------------------------------------------------------------------------------------------------
# Values of one run


def wall_clock(lines):
    """The `time` of every line, made monotonic across resumes (a resumed process counts from 0 again); None where a
    line has no time."""
    out, offset, previous = [], 0.0, None
    for line in lines:
        t = line.get("time")
        if t is None:
            out.append(None)
            continue
        if previous is not None and t < previous:
            offset += previous
        previous = t
        out.append(offset + t)
    return out


def metric_series(lines, metric, x="step", smooth=1):
    """(xs, ys) of the lines that have the metric (non-null), x = global_step ("step") or wall-clock seconds
    ("time"). smooth > 1: each value becomes the mean of the values logged in the last `smooth` steps (a trailing
    window in steps, so a metric logged every 20 steps is left as it is by a window of 8)."""
    if x not in ("step", "time"):
        raise ValueError(f"x must be 'step' or 'time', not {x!r}")
    times = wall_clock(lines)
    steps, xs, ys = [], [], []
    for line, t in zip(lines, times):
        value, step = line.get(metric), line.get("global_step")
        xv = step if x == "step" else t
        if value is None or step is None or xv is None:
            continue
        steps.append(float(step))
        xs.append(float(xv))
        ys.append(float(value))
    if smooth > 1:
        ys = moving_average(ys, smooth, steps)
    return xs, ys


def final_value(lines, metric):
    """The metric on the last line that has it, or None."""
    for line in reversed(lines):
        if line.get(metric) is not None:
            return float(line[metric])
    return None


def initial_value(lines, metric):
    """The metric on the step-0 line (the evaluation before training), or None when that line lacks it."""
    for line in lines:
        if line.get("global_step") == 0 and line.get(metric) is not None:
            return float(line[metric])
    return None


def final_step(lines):
    steps = [line["global_step"] for line in lines if "global_step" in line]
    return max(steps) if steps else None


def final_time(lines):
    times = [t for t in wall_clock(lines) if t is not None]
    return times[-1] if times else None


def moving_average(values, window, steps=None):
    """Trailing moving average: value i becomes the mean of the values whose step is in (steps[i] - window,
    steps[i]]; steps default to 0, 1, 2, ... (a window of `window` points, fewer at the start)."""
    if window <= 1:
        return list(values)
    steps = np.arange(len(values), dtype=np.float64) if steps is None else np.asarray(steps, dtype=np.float64)
    cumsum = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
    hi = np.arange(1, len(values) + 1)
    lo = np.searchsorted(steps, steps - window, side="right")  # steps are in logging order, non-decreasing
    return ((cumsum[hi] - cumsum[lo]) / (hi - lo)).tolist()


# ---------------------------------------------------------------------------------------------------------------
# Over seeds


def mean_std(values):
    """(mean, sample std with ddof=DDOF or None for fewer than 2 values, n) of the values that are not None."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None, 0
    array = np.asarray(values, dtype=np.float64)
    std = float(array.std(ddof=DDOF)) if len(values) > DDOF else None
    return float(array.mean()), std, len(values)


def aggregate(runs, metric, x="step", smooth=1, num_points=200):
    """Mean and std over seeds of a metric against step or wall-clock time.

    Returns (grid, mean, std, n_seeds) as numpy arrays (std is zeros for one seed), or None when no run has the
    metric. Each run's series is smoothed first (trailing moving average over `smooth` steps). The grid spans what
    every seed covers: by step, the steps any seed logged in that span; by time, num_points evenly spaced seconds.
    Each seed is linearly interpolated onto the grid (exact where a seed logged at a grid step)."""
    series = []
    for run in runs:
        xs, ys = metric_series(run["lines"], metric, x, smooth)
        if xs:
            order = np.argsort(xs, kind="stable")
            series.append((np.asarray(xs)[order], np.asarray(ys)[order]))
    if not series:
        return None
    lo, hi = max(s[0][0] for s in series), min(s[0][-1] for s in series)
    if hi < lo:  # the seeds do not overlap: fall back to the span of the first
        lo, hi = series[0][0][0], series[0][0][-1]
        series = series[:1]
    if x == "step":
        grid = np.unique(np.concatenate([s[0] for s in series]))
        grid = grid[(grid >= lo) & (grid <= hi)]
    else:
        grid = np.linspace(lo, hi, num_points) if hi > lo else np.asarray([lo])
    values = np.stack([np.interp(grid, xs, ys) for xs, ys in series])
    std = values.std(axis=0, ddof=DDOF) if len(series) > DDOF else np.zeros(len(grid))
    return grid, values.mean(axis=0), std, len(series)


def summarize(runs, metrics):
    """{metric: {"final": (mean, std, n), "initial": (mean, std, n)}, "wall_clock": (mean, std, n), "seeds": n}."""
    summary = {"seeds": len(runs), "wall_clock": mean_std([final_time(run["lines"]) for run in runs])}
    for metric in metrics:
        summary[metric] = {
            "final": mean_std([final_value(run["lines"], metric) for run in runs]),
            "initial": mean_std([initial_value(run["lines"], metric) for run in runs]),
        }
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Performance: where a training step's time goes

PERF_METRICS = (
    "time/generation",
    "time/reward",
    "time/training",
    "time/weight_sync",
    "perf/generation_tokens_per_second",
    "perf/train_tokens_per_second",
)


def step_seconds(lines):
    """Wall-clock of every training step: the time between consecutive logged steps, leaving out the steps that
    ran an evaluation (a line with an eval metric) and the first step after a resume (time restarts near 0)."""
    steps = [line for line in lines if "time" in line]
    return [
        b["time"] - a["time"]
        for a, b in zip(steps, steps[1:])
        if b["global_step"] == a["global_step"] + 1
        and b["time"] >= a["time"]
        and not any(k.startswith("eval") for k in b)
    ]


def logged_step_seconds(lines):
    """The script's own `time/step` of every training step that logged it: the step from its start to its metrics,
    before any evaluation or checkpoint (so, unlike step_seconds, a step that ran an evaluation is kept)."""
    return [float(line["time/step"]) for line in lines if isinstance(line.get("time/step"), (int, float))]


def perf_summary(run):
    """Medians over the training steps of one run: step wall-clock (step_seconds; `time/step`, the script's own,
    where logged) and each PERF_METRICS present."""
    training = [line for line in run["lines"] if line.get("global_step", 0) > 0]
    summary = {"steps": len(training)}
    seconds = step_seconds(run["lines"])
    if seconds:
        summary["step_seconds"] = float(np.median(seconds))
    logged = logged_step_seconds(training)
    if logged:
        summary["time/step"] = float(np.median(logged))
    for metric in PERF_METRICS:
        values = [line[metric] for line in training if isinstance(line.get(metric), (int, float))]
        if values:
            summary[metric] = float(np.median(values))
    return summary


def perf_table(experiments):
    """(markdown, records): one row per run (every run, repeats of a seed included), medians over its training
    steps; the time split as seconds and as a share of s/step. Then one row per experiment: the medians over all its
    runs' steps together of s/step and of the scripts' own time/step, and the latter against the first experiment's.
    s/step is the time between consecutive log lines, without the steps that ran an evaluation (the last one always
    does); time/step is the script's clock of every step, evaluation excluded."""
    header = ["experiment", "run", "steps", "s/step", "time/step", "generation", "reward", "training", "weight sync"]
    header += ["generation tok/s", "training tok/s"]
    rows, records = [header, ["---"] * len(header)], []
    pooled = []  # (label, number of runs, step_seconds of all its runs, time/step of all its runs)
    for label, runs in experiments:
        for run in runs:
            s = perf_summary(run)
            records.append({"experiment": label, "run": run["name"], **s})
            step = s.get("step_seconds")

            def cell(metric, s=s, step=step):
                if metric not in s:
                    return "–"
                share = f" ({100 * s[metric] / step:.0f}%)" if step else ""
                return f"{s[metric]:.2f} s{share}"

            rows.append(
                [label, run["name"], str(s["steps"]), "–" if step is None else f"{step:.2f}"]
                + ["–" if "time/step" not in s else f"{s['time/step']:.2f}"]
                + [cell(m) for m in PERF_METRICS[:4]]
                + [f"{s[m]:.0f}" if m in s else "–" for m in PERF_METRICS[4:]]
            )
        pooled.append(
            (
                label,
                len(runs),
                [x for run in runs for x in step_seconds(run["lines"])],
                [x for run in runs for x in logged_step_seconds(run["lines"])],
            )
        )
    header = ["experiment", "runs", "s/step, median over all runs' steps", "time/step, median over all runs' steps"]
    header.append(f"time/step against {pooled[0][0]}" if pooled else "time/step against the first")
    summary = [header, ["---"] * len(header)]
    first = float(np.median(pooled[0][3])) if pooled and pooled[0][3] else None
    for label, n, seconds, logged in pooled:
        median = float(np.median(logged)) if logged else None
        ratio = "–" if median is None or not first else f"x{median / first:.2f} ({100 * (median / first - 1):+.0f}%)"
        summary.append(
            [label, str(n), f"{np.median(seconds):.2f}" if seconds else "–"]
            + ["–" if median is None else f"{median:.2f}", ratio]
        )
    text = "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n\n"
    return text + "\n".join("| " + " | ".join(row) + " |" for row in summary) + "\n", records


# ---------------------------------------------------------------------------------------------------------------
# Tables


def format_mean_std(stats, digits=3):
    """'0.712 ± 0.031' (or '0.712' for one seed, '–' for none)."""
    mean, std, n = stats
    if n == 0:
        return "–"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def format_seconds(seconds):
    return "–" if seconds is None else f"{seconds:.0f} s"


def markdown_table(experiments, metrics, digits=3):
    """A markdown table, one row per experiment ((label, runs) pairs): seeds, for each metric its step-0 value (when
    any run has one) and its final value as mean ± std over seeds, and the mean wall-clock."""
    summaries = [(label, summarize(runs, metrics)) for label, runs in experiments]
    header = [f"experiment (mean ± std over seeds, ddof={DDOF})", "seeds"]
    columns = []  # (metric, "initial" | "final")
    for metric in metrics:
        if any(s[metric]["initial"][2] for _, s in summaries):
            columns.append((metric, "initial"))
            header.append(f"{metric} step 0")
        columns.append((metric, "final"))
        header.append(f"{metric} final")
    header.append("wall-clock (mean)")
    rows = [header, ["---"] * len(header)]
    for label, s in summaries:
        row = [label, str(s["seeds"])]
        row += [format_mean_std(s[metric][which], digits) for metric, which in columns]
        row.append(format_seconds(s["wall_clock"][0]))
        rows.append(row)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def seed_values(runs, metric, statistic="final"):
    """{seed: value} of a metric for the runs that have it: its final value ("wall_clock": the final wall-clock
    seconds), its peak (the largest value logged) or its fall (the peak minus the final value: how much a run lost
    after its best evaluation, over-optimisation's signature). Pairing needs one run per seed: several are refused
    (ValueError)."""
    shared = shared_seeds(runs)
    if shared:
        raise ValueError(f"a paired comparison needs one run per seed, and these share one: {sorted(shared.values())}")
    values = {}
    for run in runs:
        if metric == "wall_clock":
            value = final_time(run["lines"])
        elif statistic == "final":
            value = final_value(run["lines"], metric)
        else:
            logged = metric_series(run["lines"], metric)[1]
            peak = max(logged) if logged else None
            value = peak if statistic == "peak" or peak is None else peak - logged[-1]
        if value is not None:
            values[run["seed"]] = value
    return values


# The one verdict rule of every claim check in benchmark/ (registry paired --at_least, offpolicy, prm_checks): a claim
# about paired differences over seeds is held or not held only when the two-sided 95% t interval of their mean,
# mean ± t(0.975, n - 1) x standard error (std / sqrt(n)), clears the bound; an interval that crosses it, or fewer
# than 3 seeds, is inconclusive. So a verdict needs a difference significant at the 5% level (|paired t| > 4.30 on 3
# seeds); one standard error clear of the bound (|t| > 1) is not enough.
# Differences with no spread (all n equal: standard error 0) have no interval, and are inconclusive: a zero-width
# interval would settle any bound with certainty, while equal differences of a metric measured on a finite evaluation
# (an accuracy is a multiple of 1 / its number of problems) say that the spread between seeds is below the metric's
# resolution, not that it is zero, and the t interval has no estimate of it. More seeds or a finer evaluation decide.
# A claim about several arms at once: "every arm ..." (a conjunction) holds when each arm's check holds, with no
# correction (each must clear its own bound); "some arm ..." (a disjunction) holds only when Holm's step-down
# procedure over the arms' one-sided p-values rejects at the interval's own level, 0.025 a side (holm below), since
# trying several arms raises the chance that one clears the bound by luck. With one arm Holm is the rule above.
# Every verdict is printed with the claim's exact paired sign-flip p (sign_flip_p below: one-sided, all 2^n sign
# assignments), which assumes no normality: its smallest value is 1 / 2^n (1/8 on 3 seeds, 1/16 on 4), so on 3-4 seeds
# no normality-free test reaches 0.025 (or 0.05), and a t verdict there leans on the differences being normal.
# Student's t: the 0.975 quantile by degrees of freedom, 1-30 (beyond 30 the value at 30, a little wider than exact).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
T_975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_975(df):
    """The 0.975 quantile of Student's t with df >= 1 degrees of freedom (the value at 30 beyond 30)."""
    return T_975[min(df, len(T_975)) - 1]


def interval(diffs):
    """(mean, standard error, half-width of the two-sided 95% interval) of paired differences (None values left out),
    from mean_std; no error and no interval for fewer than 2, and no interval (None) when they are all equal."""
    mean, std, n = mean_std(diffs)
    if std is None:
        return mean, None, None
    se = std / math.sqrt(n)
    return mean, se, (None if no_spread(mean, std) else t_975(n - 1) * se)  # no spread: no interval (the rule above)


def no_spread(mean, std):
    """Whether differences are all equal, up to floating-point rounding (0.45 - 0.40 and 0.50 - 0.45 differ in the
    last bit): a std of at most 1e-12 of the mean's size (or of 1)."""
    return std <= 1e-12 * max(1.0, abs(mean))


def verdict_inside(mean, half, low, high):
    """held / not held / inconclusive for the interval mean ± half against the bounds [low, high] (math.inf for no
    upper bound): held when it lies inside, not held when it lies wholly outside, else inconclusive."""
    if half is None:
        return "inconclusive"
    if low <= mean - half and mean + half <= high:
        return "held"
    if mean + half < low or mean - half > high:
        return "not held"
    return "inconclusive"


def interval_text(mean, se, half):
    """('+0.062 (s.e. 0.044)', '95% interval -0.127 to +0.251'): the mean and its standard error, and the 95%
    interval. ± is kept for a standard deviation (format_mean_std)."""
    if se is None:
        return f"{mean:+.3f} (s.e. –)", "no interval"
    if half is None:
        return f"{mean:+.3f} (s.e. {se:.3f})", "no interval (no spread over seeds)"
    return f"{mean:+.3f} (s.e. {se:.3f})", f"95% interval {mean - half:+.3f} to {mean + half:+.3f}"


def claim_verdict(mean, std, n, at_least, min_seeds=3, at_most=math.inf):
    """Whether paired differences support "difference >= at_least" (and <= at_most), by the rule above: held when
    the 95% interval mean ± t(0.975, n - 1) x std / sqrt(n) lies inside the bounds, not held when it lies wholly
    outside, else inconclusive; inconclusive on fewer than min_seeds."""
    if n < min_seeds or std is None or no_spread(mean, std):  # too few seeds, or no spread (no interval)
        return "inconclusive"
    se = std / math.sqrt(n)
    return verdict_inside(mean, t_975(n - 1) * se, at_least, at_most)


def t_cdf(t, df):
    """P(T <= t) for Student's t with an integer df >= 1, exact: the finite series of Abramowitz and Stegun 26.7.3
    (odd df) and 26.7.4 (even df) for A = P(|T| <= |t|), in theta = atan(|t| / sqrt(df))."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # 2 / pi (theta + sin cos (1 + 2/3 cos^2 + 2.4/(3.5) cos^4 + ... up to cos^(df-3)))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(2, df - 1, 2):
            term *= c2 * k / (k + 1)
            total += term
        inside = 2 / math.pi * (theta + s * math.cos(theta) * total)
    else:  # sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ... up to cos^(df-2))
        term, total = 1.0, 1.0
        for k in range(1, df - 2, 2):
            term *= c2 * k / (k + 1)
            total += term
        inside = s * total
    return 0.5 + inside / 2 if t >= 0 else 0.5 - inside / 2


def p_above(diffs, bound=0.0):
    """The one-sided p-value of paired differences for "their mean is above bound" (the paired t test's upper tail,
    n - 1 df), or None where the rule gives no interval (fewer than 2, or no spread)."""
    mean, se, half = interval(diffs)
    if half is None:
        return None
    return 1.0 - t_cdf((mean - bound) / se, len([d for d in diffs if d is not None]) - 1)


SIGN_FLIP_MAX = 20  # 2^20 sign assignments at most (~1M): enumerated exactly, never sampled


def sign_flip_p(diffs, low=-math.inf, high=math.inf):
    """The exact paired sign-flip (permutation) p-value of a claim about paired differences (None values left out),
    one-sided in the claim's direction and free of any normality assumption: for "difference >= low", over all 2^n
    assignments of signs to the n values d - low, the share whose mean is at least the observed mean of d - low (the
    observed assignment among them, so p >= 1 / 2^n: 1/8 at n = 3, 1/16 at 4, 1/256 at 8); "<= high" likewise on
    high - d; a claim with both bounds ("within") takes the larger of the two (both sides must be shown). Means
    within 1e-12 of the observed one (relative to the values' size) count as equal. None for no values, or for more
    than SIGN_FLIP_MAX (too many assignments to enumerate)."""
    values = np.asarray([d for d in diffs if d is not None], dtype=np.float64)
    n = len(values)
    if n == 0 or n > SIGN_FLIP_MAX:
        return None
    # signs [2^n, n]: row k's bit j set -> the j-th value's sign flipped
    signs = 1.0 - 2.0 * ((np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1)
    p = []
    for shifted in ([values - low] if math.isfinite(low) else []) + ([high - values] if math.isfinite(high) else []):
        sums, observed = signs @ shifted, shifted.sum()
        tolerance = 1e-12 * max(1.0, float(np.abs(shifted).sum()))
        p.append(float(np.mean(sums >= observed - tolerance)))
    return max(p) if p else None


def sign_flip_text(diffs, low=-math.inf, high=math.inf, what="difference"):
    """'exact sign-flip p 0.0625 (one-sided, difference >= -0.02)': sign_flip_p with the claim it is one-sided for."""
    p = sign_flip_p(diffs, low, high)
    bounds = [f">= {low:g}"] * math.isfinite(low) + [f"<= {high:g}"] * math.isfinite(high)
    side = "the larger of the two one-sided" if len(bounds) == 2 else "one-sided"
    return "exact sign-flip p –" if p is None else f"exact sign-flip p {p:.4f} ({side}, {what} {' and '.join(bounds)})"


def holm(p_values, alpha=0.025):
    """Holm's step-down procedure: [rejected] for p-values (None: no test, never rejected), the family-wise error rate
    held at alpha. The i-th smallest p (i = 0, 1, ...) is rejected when it and every smaller one is at most
    alpha / (m - i), m the number of hypotheses (None ones included, as they were tried)."""
    m = len(p_values)
    order = sorted((i for i, p in enumerate(p_values) if p is not None), key=lambda i: p_values[i])
    rejected = [False] * m
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


def clopper_pearson(k, n, level=0.95):
    """The exact (Clopper-Pearson) two-sided interval of a binomial share, k of n: from the p at which
    P(X >= k | p) = (1 - level) / 2 (0 when k = 0) to the p at which P(X <= k | p) = (1 - level) / 2 (1 when k = n),
    found by bisection on the binomial tail sums. For an outcome that is all or nothing per seed (a seed learns the
    task or does not), the share of seeds it happens on, where a t interval over the values would be meaningless:
    1 of 3 gives 0.008 to 0.906."""
    alpha = (1 - level) / 2

    def at_least(j, p):  # P(X >= j | p), increasing in p
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(j, n + 1))

    def solve(j, target):
        low, high = 0.0, 1.0
        for _ in range(100):
            middle = (low + high) / 2
            low, high = (middle, high) if at_least(j, middle) < target else (low, middle)
        return (low + high) / 2

    return 0.0 if k == 0 else solve(k, alpha), 1.0 if k == n else solve(k + 1, 1 - alpha)


def paired_table(
    experiments,
    metrics,
    baseline,
    digits=3,
    at_least=None,
    statistic="final",
    fixed_baseline=False,
    count_above=None,
    at_most=None,
):
    """A markdown table comparing each experiment with the baseline experiment (a label) seed by seed: for each
    metric, the final values (or the peaks, or the falls from the peak: seed_values' statistic) of both on the seeds
    they share, the differences (experiment - baseline), their mean ± std (ddof=1) and the paired t statistic mean /
    (std / sqrt(n)) with n - 1 degrees of freedom. With at_least (or at_most, or both), two more columns: the mean
    and its standard error with the two-sided 95% interval, and the claim "difference >= at_least" ("<= at_most")
    checked on that interval (claim_verdict); then the exact sign-flip p of the claim (sign_flip_p: one-sided in the
    claim's direction, no normality assumed). fixed_baseline: the baseline is one run, paired with every seed of the
    others: exact for a run no seed changes (a greedy probe of the untrained policy); for a sampled one
    the interval leaves out its own sampling error. count_above: one more column, the seeds whose difference is at
    least count_above, k of n, with the 95% Clopper-Pearson interval of that share (for an outcome that is bimodal
    over seeds, where the t interval says little)."""
    runs_of = dict(experiments)
    if baseline not in runs_of:
        raise ValueError(f"--baseline {baseline!r} is not one of the experiments' labels {list(runs_of)}")
    if fixed_baseline and len(runs_of[baseline]) != 1:
        raise ValueError(f"--fixed_baseline needs one {baseline} run, not {len(runs_of[baseline])}")
    header = ["experiment", "metric", "seeds", f"{baseline} per seed", "experiment per seed", "difference per seed"]
    rows = [header + ["difference (mean ± std)", "paired t (df)"]]
    low, high = -math.inf if at_least is None else at_least, math.inf if at_most is None else at_most
    bounds = [f">= {low:g}"] * (at_least is not None) + [f"<= {high:g}"] * (at_most is not None)
    if bounds:
        rows[0] += ["difference (mean (s.e.); 95% t interval)", f"difference {' and '.join(bounds)} (95% interval)"]
        side = "the larger one-sided" if len(bounds) == 2 else "one-sided"
        rows[0] += [f"exact sign-flip p ({side}: difference {' and '.join(bounds)})"]
    if count_above is not None:
        rows[0] += [f"seeds with difference >= {count_above:g} (95% Clopper-Pearson interval of the share)"]
    rows.append(["---"] * len(rows[0]))
    for label, runs in experiments:
        if label == baseline:
            continue
        for metric in metrics:
            base, other = seed_values(runs_of[baseline], metric, statistic), seed_values(runs, metric, statistic)
            if fixed_baseline:
                base = dict.fromkeys(other, *base.values()) if base else {}
            seeds = sorted(set(base) & set(other))
            diffs = [other[seed] - base[seed] for seed in seeds]
            mean, std, n = mean_std(diffs)
            t = "–" if not std else f"{mean / (std / math.sqrt(n)):.2f} ({n - 1})"
            columns = [base[seed] for seed in seeds], [other[seed] for seed in seeds], diffs
            name = metric if statistic == "final" else f"{metric} ({statistic})"
            row = [label, name, " ".join(map(str, seeds))] + [
                " / ".join(f"{v:.{digits}f}" for v in c) for c in columns
            ]
            row += [format_mean_std((mean, std, n), digits), t]
            if bounds:
                row += ["; ".join(interval_text(*interval(diffs))) if diffs else "–"]
                row.append(f"**{claim_verdict(mean, std, n, low, at_most=high)}**")
                p = sign_flip_p(diffs, low, high)
                row.append("–" if p is None else f"{p:.4f}")
            if count_above is not None:
                k = sum(d >= count_above for d in diffs)
                share_low, share_high = clopper_pearson(k, len(diffs)) if diffs else (0.0, 1.0)
                row.append(f"{k} of {len(diffs)} ({share_low:.3f} to {share_high:.3f})")
            rows.append(row)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def change_table(experiments, metrics, window, digits=3, at_least=None):
    """A markdown table of each experiment's within-run change per metric: for each seed, the mean of the last
    `window` logged values minus the mean of the first `window` (a per-step metric of a few samples is noisy), their
    mean ± std over seeds (ddof=1), and with at_least the claim "change >= at_least" checked on the 95% t interval of
    the mean (claim_verdict), with its exact one-sided sign-flip p (sign_flip_p): does the metric rise from the start
    of training to its end? A run with fewer than 2 x window values is left out."""
    header = ["experiment", "metric", f"first {window} steps per seed", f"last {window} steps per seed"]
    header += ["change per seed", "change (mean ± std)"]
    if at_least is not None:
        header += ["change (mean (s.e.); 95% t interval)", f"change >= {at_least:g} (95% interval)"]
        header += [f"exact sign-flip p (one-sided: change >= {at_least:g})"]
    rows = [header, ["---"] * len(header)]
    for label, runs in experiments:
        for metric in metrics:
            series = [(run["seed"], metric_series(run["lines"], metric)[1]) for run in runs]
            series = sorted((seed, ys) for seed, ys in series if len(ys) >= 2 * window)
            starts = [float(np.mean(ys[:window])) for _, ys in series]
            ends = [float(np.mean(ys[-window:])) for _, ys in series]
            changes = [end - start for start, end in zip(starts, ends)]
            row = [label, metric] + [" / ".join(f"{v:.{digits}f}" for v in c) for c in (starts, ends, changes)]
            row.append(format_mean_std(mean_std(changes), digits))
            if at_least is not None:
                mean, std, n = mean_std(changes)
                row += ["; ".join(interval_text(*interval(changes))) if changes else "–"]
                row.append(f"**{claim_verdict(mean, std, n, at_least)}**")
                p = sign_flip_p(changes, at_least)
                row.append("–" if p is None else f"{p:.4f}")
            rows.append(row)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def runs_table(runs, metrics, digits=3):
    """The `list` table: one row per run with its name, exp_name, seed, short git sha, steps, wall-clock, and the
    final value of each metric."""
    header = ["run", "exp_name", "seed", "git sha", "steps", "wall-clock", *metrics]
    rows = [header, ["---"] * len(header)]
    for run in runs:
        finals = [final_value(run["lines"], m) for m in metrics]
        step = final_step(run["lines"])
        rows.append(
            [
                run["name"],
                str(run["exp_name"]),
                "–" if run["seed"] is None else str(run["seed"]),
                run["git_sha"][:7] or "–",
                "–" if step is None else str(step),
                format_seconds(final_time(run["lines"])),
                *("–" if v is None else f"{v:.{digits}f}" for v in finals),
            ]
        )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Plots


def plot(experiments, metrics, x="step", out="benchmark/results/curve.png", smooth=1, title=None):
    """One panel per metric, one line per experiment ((label, runs) pairs): the mean over seeds, shaded ± one std.
    Writes a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(len(metrics), 2)
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4 * nrows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for i, (label, runs) in enumerate(experiments):
            result = aggregate(runs, metric, x=x, smooth=smooth)
            if result is None:
                if runs:
                    print(f"warning: no run of {label!r} logged {metric}", file=sys.stderr)
                continue
            grid, mean, std, n = result
            color = f"C{i % 10}"
            marker = "o" if len(grid) <= 30 else None
            ax.plot(grid, mean, color=color, marker=marker, markersize=3, label=f"{label} ({n} seed{'s' * (n > 1)})")
            if n > 1:
                ax.fill_between(grid, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
        ax.set_title(metric + (f" (moving average over {smooth} steps)" if smooth > 1 else ""), fontsize=10)
        ax.set_xlabel("step" if x == "step" else "wall-clock time (s)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def frontier_points(runs, y_metric, x_metric, x_at_step0=None):
    """The points of a y-against-x curve over seeds (Coste et al.'s gold score against KL): for every step at which
    each run logged y and x on one line (an evaluation step: the evaluation and the step's own metrics share a line),
    the mean over runs of x and of y and the std over runs of y. x_at_step0: x on the step-0 line, which has no step
    metrics (KL 0 before any update). Returns (steps, x means, y means, y stds) as numpy arrays, by step."""
    by_step = {}
    for run in runs:
        for line in run["lines"]:
            y, x, step = line.get(y_metric), line.get(x_metric), line.get("global_step")
            x = x_at_step0 if x is None and step == 0 else x
            if y is not None and x is not None and step is not None:
                by_step.setdefault(step, {})[run["path"]] = (float(x), float(y))
    steps = sorted(step for step, points in by_step.items() if len(points) == len(runs))  # every run has the point
    xs = np.asarray([np.mean([x for x, _ in by_step[s].values()]) for s in steps])
    ys = np.asarray([[y for _, y in by_step[s].values()] for s in steps]).reshape(len(steps), -1)
    std = ys.std(axis=1, ddof=DDOF) if ys.shape[1] > DDOF else np.zeros(len(steps))
    return np.asarray(steps), xs, ys.mean(axis=1), std


def plot_frontier(experiments, y_metric, x_metric, out, x_at_step0=None, title=None):
    """One line per experiment: y against x over the evaluation steps (frontier_points), ± one std of y over seeds.
    Writes a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, (label, runs) in enumerate(experiments):
        steps, xs, ys, std = frontier_points(runs, y_metric, x_metric, x_at_step0)
        if not len(steps):
            print(f"warning: no run of {label!r} logged {y_metric} with {x_metric}", file=sys.stderr)
            continue
        ax.errorbar(xs, ys, yerr=std if len(runs) > 1 else None, color=f"C{i % 10}", marker="o", markersize=3,
                    capsize=2, label=f"{label} ({len(runs)} seed{'s' * (len(runs) > 1)})")  # fmt: skip
    ax.set_xlabel(x_metric)
    ax.set_ylabel(y_metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Command line


def load_experiments(specs, all_runs=False):
    experiments = []
    for spec in specs:
        label, pattern = parse_experiment(spec)
        try:
            runs = find_runs(pattern, all_runs=all_runs)
        except ValueError as error:
            sys.exit(f"error: experiment {label!r}: {error}")
        if not runs:
            print(f"warning: experiment {label!r}: no run folder matches {pattern}", file=sys.stderr)
        else:
            print(f"{label}: {len(runs)} run(s): {', '.join(run['name'] for run in runs)}", file=sys.stderr)
        experiments.append((label, runs))
    if not any(runs for _, runs in experiments):
        sys.exit("error: no run folder matches any --experiments glob")
    return experiments


def write_text(text, out):
    print(text, end="")
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}", file=sys.stderr)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.statistics.registry", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("list", help="a table of runs with their final metrics")
    p.add_argument("--runs_dir", default="runs", help="the folder holding the run folders")
    p.add_argument("--filter", default=None, help="only runs whose name contains this (or matches it as a glob)")
    p.add_argument("--metrics", nargs="*", default=[], help="metrics whose final value is shown")
    p.add_argument("--digits", type=int, default=3, help="decimals of the metric values")

    def experiments_args(p):
        p.add_argument(
            "--experiments",
            nargs="+",
            required=True,
            help='LABEL=GLOB of run folders (its seeds), e.g. "grpo=runs/x__*"',
        )
        p.add_argument(
            "--all_runs",
            action="store_true",
            help="use every matching run when several share a seed (refused without it); perf always does",
        )

    p = commands.add_parser("plot", help="learning curves: mean ± std over seeds, by step or wall-clock time")
    experiments_args(p)
    p.add_argument("--metric", "--metrics", dest="metrics", nargs="+", required=True, help="one panel per metric")
    p.add_argument("--x", choices=["step", "time"], default="step", help="global_step or wall-clock seconds")
    p.add_argument("--out", default="benchmark/results/curve.png", help="where the PNG goes")
    p.add_argument("--smooth", type=int, default=1, help="trailing moving-average window, in steps, per seed")
    p.add_argument("--title", default=None, help="a title over the figure")

    p = commands.add_parser("frontier", help="one metric against another over the evaluation steps, mean over seeds")
    experiments_args(p)
    p.add_argument("--y", required=True, help="the metric up the side, e.g. eval/accuracy (the gold score)")
    p.add_argument("--x", required=True, help="the metric along the bottom, e.g. objective/kl")
    p.add_argument("--x_at_step0", type=float, default=None, help="x on the step-0 line (e.g. 0 for the KL)")
    p.add_argument("--out", default="benchmark/results/frontier.png", help="where the PNG goes")
    p.add_argument("--title", default=None, help="a title over the figure")

    p = commands.add_parser("table", help="a markdown table of initial and final metrics, mean ± std over seeds")
    experiments_args(p)
    p.add_argument("--metrics", nargs="+", required=True, help="the metrics in the table")
    p.add_argument("--out", default=None, help="also write the table to this .md file")
    p.add_argument("--digits", type=int, default=3, help="decimals of the metric values")

    p = commands.add_parser("paired", help="each experiment against a baseline, seed by seed: differences, paired t")
    experiments_args(p)
    p.add_argument("--baseline", required=True, help="the label of the experiment the others are compared with")
    p.add_argument("--metrics", nargs="+", required=True, help="final values compared (wall_clock: seconds)")
    p.add_argument("--out", default=None, help="also write the table to this .md file")
    p.add_argument("--digits", type=int, default=3, help="decimals of the values")
    p.add_argument("--at_least", type=float, default=None, help="check the claim: difference >= this, per metric")
    p.add_argument("--at_most", type=float, default=None, help="check the claim: difference <= this, per metric")
    p.add_argument(
        "--statistic", choices=("final", "peak", "fall"), default="final",
        help="what is compared: the final value, the peak (largest logged), or the fall (peak - final)",
    )  # fmt: skip
    p.add_argument(
        "--fixed_baseline", action="store_true",
        help="the baseline is one run, paired with every seed (exact for a greedy probe of the untrained policy; a "
        "sampled one's own error is left out of the interval)",
    )  # fmt: skip
    p.add_argument(
        "--count_above", type=float, default=None,
        help="also count the seeds whose difference is at least this, with the 95%% Clopper-Pearson interval of "
        "their share (an outcome that is all or nothing per seed)",
    )  # fmt: skip

    p = commands.add_parser("change", help="each run's metric, last steps minus first steps, over seeds")
    experiments_args(p)
    p.add_argument("--metrics", nargs="+", required=True, help="per-step metrics")
    p.add_argument("--window", type=int, default=5, help="logged values averaged at each end")
    p.add_argument("--out", default=None, help="also write the table to this .md file")
    p.add_argument("--digits", type=int, default=3, help="decimals of the values")
    p.add_argument("--at_least", type=float, default=None, help="check the claim: change >= this, per metric")

    p = commands.add_parser("perf", help="per-step time split and throughput (medians over steps), JSON + markdown")
    experiments_args(p)
    p.add_argument("--out", default=None, help="also write {out}.md and {out}.json")

    p = commands.add_parser(
        "copy", help="copy finished run folders' config.json and metrics.jsonl to OUT/<run folder name>/"
    )
    p.add_argument("runs", nargs="*", help="run folders; one without both files (an unmatched glob) is skipped")
    p.add_argument("--out", required=True, help="the folder the copies go to")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "list":
        names = sorted(os.listdir(args.runs_dir)) if os.path.isdir(args.runs_dir) else []
        if args.filter:
            names = [n for n in names if args.filter in n or fnmatch.fnmatch(n, args.filter)]
        runs = [load_run(os.path.join(args.runs_dir, n)) for n in names if is_run_dir(os.path.join(args.runs_dir, n))]
        print(runs_table(runs, args.metrics, args.digits), end="")
    elif args.command == "plot":
        experiments = load_experiments(args.experiments, args.all_runs)
        out = plot(experiments, args.metrics, x=args.x, out=args.out, smooth=args.smooth, title=args.title)
        print(f"wrote {out}")
    elif args.command == "frontier":
        experiments = load_experiments(args.experiments, args.all_runs)
        print(f"wrote {plot_frontier(experiments, args.y, args.x, args.out, args.x_at_step0, args.title)}")
    elif args.command == "table":
        experiments = load_experiments(args.experiments, args.all_runs)
        write_text(markdown_table(experiments, args.metrics, args.digits), args.out)
    elif args.command == "paired":
        experiments = load_experiments(args.experiments, args.all_runs)
        try:
            table = paired_table(
                experiments, args.metrics, args.baseline, args.digits, args.at_least, args.statistic,
                args.fixed_baseline, args.count_above, args.at_most,
            )  # fmt: skip
        except ValueError as error:
            sys.exit(f"error: {error}")
        write_text(table, args.out)
    elif args.command == "change":
        experiments = load_experiments(args.experiments, args.all_runs)
        write_text(change_table(experiments, args.metrics, args.window, args.digits, args.at_least), args.out)
    elif args.command == "perf":
        experiments = load_experiments(args.experiments, all_runs=True)  # every run is a row: repeats are measurements
        table, records = perf_table(experiments)
        write_text(table, args.out and args.out + ".md")
        if args.out:
            with open(args.out + ".json", "w") as f:
                json.dump(records, f, indent=2)
    elif args.command == "copy":
        files = ("config.json", "metrics.jsonl")
        runs = [run for run in args.runs if all(os.path.isfile(os.path.join(run, f)) for f in files)]
        unfinished = [run for run in runs if not os.path.isdir(os.path.join(run, "model"))]
        for run in unfinished:
            print(f"not copied, not finished (no model/): {run}", file=sys.stderr)
        runs = [run for run in runs if run not in unfinished]
        names = [os.path.basename(os.path.abspath(run)) for run in runs]
        if len(set(names)) < len(names):
            sys.exit(f"error: two run folders share a name: {sorted(n for n in names if names.count(n) > 1)}")
        for run, name in zip(runs, names):
            os.makedirs(os.path.join(args.out, name), exist_ok=True)
            for f in files:
                shutil.copy(os.path.join(run, f), os.path.join(args.out, name))


if __name__ == "__main__":
    main()
