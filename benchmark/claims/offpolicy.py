"""The Asynchronous RLHF paper's off-policyness figure from runs' config.json and metrics.jsonl.

    python -m benchmark.claims.offpolicy \
        --experiments "online DPO=benchmark/results/async_rlhf/arith_1d__offpolicy_dpo_n*" \
        "RLOO=benchmark/results/async_rlhf/arith_1d__offpolicy_rloo_n*" "PPO=..." --out benchmark/results/offpolicy

N, the off-policyness of Noukhovitch et al. (arXiv 2410.18252), is the number of minibatches (optimizer updates) per
generated batch: each run's `num_minibatches` in its config.json (runs with more than one PPO epoch, or async_rlhf.py
runs without --sync, add staleness of another kind and are refused). An experiment is LABEL=GLOB, one objective: its
runs are grouped by N, and within an N by seed (several runs of one (N, seed) are refused). Writes {out}.md: one row
per objective, N and seed (the final held-out accuracy, reward-model score and reference perplexity; at the last
training step, the KL to the reference, the staleness the updates saw and the approximate KL of the last minibatch's
policy to the sampler's), the mean ± std per objective and N, and the paper's claim as a check; and {out}.png: accuracy
and score against N (mean ± std over seeds, one line per objective), and score against the reference's perplexity, one
point per run. That perplexity (eval/ref_perplexity: the reference's exp(-mean log-prob), at temperature 1, of the
final policy's greedy held-out completions) is the paper's x-axis, "KL (perplexity)" (its code divides by the prompt's
tokens too), and it measures the final policy of every run whatever the script's sampling temperature. The last step's
objective/kl, in the table only, does not at N > 1: ppo_rlhf.py's is the sampling policy's (N updates before the end),
async_rlhf.py's the mean over the last N updates' policies, on the batch the first of them sampled.

The check: online DPO's drop from N = 1 to the largest N (the mean over seeds of each seed's final accuracy at N = 1
minus at the largest N) is the smallest of the objectives. Against each other objective, the paired difference of the
drops over the seeds both ran at both ends, their mean (s.e.: its standard error) and its two-sided 95% t interval
(mean ± t(0.975, n - 1) x s.e.; t = 4.30 on 3 seeds), the rule of every check in benchmark/
(benchmark/statistics/registry.py): held when every interval lies above 0 (a conjunction: no correction), not held when
some other objective's drop is below the subject's by Holm's procedure over the objectives' one-sided p-values at 0.025
a side (a disjunction: registry.holm), else inconclusive; fewer than 3 seeds is inconclusive. Each difference is
printed with its exact sign-flip p (registry.sign_flip_p: one-sided, their drop - the subject's >= 0, no normality
assumed). With --baseline LABEL (controls of one objective, e.g. PPO with and without advantage whitening), the check
is replaced by each objective minus the baseline at each N both ran, seed by seed (the mean (s.e.) and the 95%
interval; no verdict).
"""

import argparse
import math
import os

import numpy as np

from benchmark.statistics.registry import (
    claim_verdict,
    final_value,
    find_runs,
    holm,
    interval,
    interval_text,
    mean_std,
    p_above,
    parse_experiment,
    shared_seeds,
    sign_flip_text,
    write_text,
)

FINAL = {"eval/accuracy": "held-out accuracy", "eval/score": "held-out score"}  # checked, and plotted against N
PERPLEXITY = "eval/ref_perplexity"  # the paper's "KL (perplexity)": the x-axis of the score panel
TRAINING = {  # their value at the last training step
    "objective/kl": "KL to the reference",
    "policy/staleness": "staleness (mean)",
    "policy/staleness_max": "staleness (max)",
    "policy/approxkl_last_minibatch": "approx. KL, last minibatch",
}


def by_n(runs):
    """{N: {seed: {metric: final value}}} of one objective's runs; several runs of one (N, seed) are refused
    (ValueError naming them), never reduced to one without saying so."""
    for run in runs:
        if run["args"].get("num_ppo_epochs", 1) != 1 or not run["args"].get("sync", True):
            raise ValueError(
                f"{run['path']}: its staleness is not num_minibatches - 1 (PPO epochs > 1, or not --sync)"
            )
    key = lambda run: (run["args"].get("num_minibatches", 1), run["seed"])  # noqa: E731
    shared = shared_seeds(runs, key)
    if shared:
        raise ValueError(f"several runs of one (N, seed), keep one of each: {sorted(shared.values())}")
    table = {}
    for run in sorted(runs, key=lambda run: (key(run)[0], key(run)[1] if key(run)[1] is not None else 0)):
        n, seed = key(run)
        table.setdefault(n, {})[seed] = {m: final_value(run["lines"], m) for m in (*FINAL, PERPLEXITY, *TRAINING)}
    return table


def drops(table, metric):
    """({seed: value at the smallest N minus value at the largest N} over the seeds that ran both, (smallest N,
    largest N))."""
    low, high = min(table), max(table)
    both = set(table[low]) & set(table[high])
    seeds = sorted(s for s in both if None not in (table[low][s][metric], table[high][s][metric]))
    return {s: table[low][s][metric] - table[high][s][metric] for s in seeds}, (low, high)


def check(values, subject, metric="eval/accuracy", min_seeds=3):
    """(claim, verdict, numbers): `subject`'s drop in `metric` from the smallest to the largest N is the smallest.
    Against each other objective, the paired differences (their drop - the subject's) over the seeds both ran at
    both ends, judged by their two-sided 95% t interval (registry.claim_verdict): held when every interval lies at or
    above 0, not held when Holm's procedure over the objectives (one-sided p-values of "difference < 0", 0.025 a side)
    finds one below, else inconclusive (and with fewer than min_seeds seeds, or different N ranges)."""
    all_drops = {label: drops(table, metric) for label, table in values.items()}
    mine, ends = all_drops[subject]
    notes = [f"{label} drop {np.mean(list(d.values())):+.3f}" for label, (d, _) in all_drops.items() if d]
    verdicts, p_below = [], []  # p_below: the one-sided p-value of "their drop is below the subject's"
    for label, (theirs, their_ends) in all_drops.items():
        if label == subject:
            continue
        seeds = sorted(set(mine) & set(theirs))
        if not seeds or their_ends != ends:
            verdicts.append("inconclusive")
            p_below.append(None)
            notes.append(f"{label}: no seeds or N range shared with {subject}")
            continue
        diffs = [theirs[s] - mine[s] for s in seeds]
        mean, std, n = mean_std(diffs)
        verdicts.append(claim_verdict(mean, std, n, 0.0, min_seeds))
        p_below.append(p_above([-d for d in diffs]) if n >= min_seeds else None)
        difference, span = interval_text(*interval(diffs))
        flip = sign_flip_text(diffs, 0.0, what=f"{label} - {subject}")
        notes.append(f"{label} - {subject}: {difference} (seeds {seeds}), {span}; {flip}")
    verdict = "held" if set(verdicts) == {"held"} else "not held" if any(holm(p_below)) else "inconclusive"
    return (
        f"{subject}'s drop in {metric} from N = {ends[0]} to N = {ends[1]} is the smallest",
        verdict,
        "; ".join(notes),
    )


def paired_at_n(values, baseline):
    """[(label, N, seeds, {metric: (mean, standard error, half-width of the 95% interval)})]: each other objective
    minus `baseline` at each N both ran, seed by seed over the seeds both ran (the controls of one objective, whose N
    range is not the claim's)."""
    rows = []
    for label, table in values.items():
        for n in sorted(set(table) & set(values[baseline])) if label != baseline else []:
            mine, theirs = table[n], values[baseline][n]
            seeds = sorted(
                s for s in set(mine) & set(theirs) if None not in [r[s][m] for r in (mine, theirs) for m in FINAL]
            )
            if not seeds:
                continue
            cells = {m: interval([mine[s][m] - theirs[s][m] for s in seeds]) for m in FINAL}
            rows.append((label, n, seeds, cells))
    return rows


def fmt(value, digits=3):
    return "–" if value is None else f"{value:.{digits}f}"


def report(values, subject, baseline=None):
    names = [*FINAL, PERPLEXITY, *TRAINING]
    header = ["objective", "N", "seed", *FINAL.values(), "reference perplexity"]
    header += [f"{t} (last step)" for t in TRAINING.values()]
    rows = [header, ["---"] * len(header)]
    summary = [["objective", "N", "seeds", *FINAL.values(), "reference perplexity", "KL (last step)"], ["---"] * 7]
    for label, table in values.items():
        for n, seeds in table.items():
            for seed, row in seeds.items():
                rows.append([label, str(n), str(seed)] + [fmt(row[m]) for m in names])
            cells = []
            for m in (*FINAL, PERPLEXITY, "objective/kl"):
                mean, std, _ = mean_std([row[m] for row in seeds.values()])
                cells.append("–" if mean is None else f"{mean:.3f}" + ("" if std is None else f" ± {std:.3f}"))
            summary.append([label, str(n), str(len(seeds)), *cells])
    text = "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n\n"
    text += "Mean ± std over seeds (ddof 1):\n\n" + "\n".join("| " + " | ".join(r) + " |" for r in summary) + "\n\n"
    if baseline:
        text += f"Each objective minus {baseline} at the same N, seed by seed (mean (s.e.); 95% t"
        text += " interval):\n\n"
        text += "| objective | N | seeds | " + " | ".join(f"{t} - {baseline}" for t in FINAL.values()) + " |\n"
        text += "| --- | --- | --- |" + " --- |" * len(FINAL) + "\n"
        for label, n, seeds, cells in paired_at_n(values, baseline):
            diffs = ["; ".join(interval_text(*cell)) for cell in cells.values()]
            text += f"| {label} | {n} | {', '.join(map(str, seeds))} | " + " | ".join(diffs) + " |\n"
        return text
    text += "| claim | verdict | numbers |\n| --- | --- | --- |\n"
    for metric in FINAL:
        claim, verdict, numbers = check(values, subject, metric)
        text += f"| {claim} | **{verdict}** | {numbers} |\n"
    return text


def plot(values, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    for i, (label, table) in enumerate(values.items()):
        color, ns = f"C{i % 10}", sorted(table)
        for ax, metric in zip(axes[:2], FINAL):
            stats = [mean_std([row[metric] for row in table[n].values()]) for n in ns]
            means = [m if m is not None else np.nan for m, _, _ in stats]
            stds = [s or 0.0 for _, s, _ in stats]
            seeds = max(c for _, _, c in stats)
            ax.errorbar(ns, means, yerr=stds, color=color, marker="o", capsize=3, label=f"{label} (≤{seeds} seeds)")
        points = [(row[PERPLEXITY], row["eval/score"], n) for n in ns for row in table[n].values()]
        points = [p for p in points if None not in p]
        if points:
            perplexity, score, n = zip(*points)
            axes[2].scatter(
                perplexity, score, color=color, s=[12 + 6 * math.log2(x) ** 2 for x in n], alpha=0.7, label=label
            )
    for ax, metric in zip(axes[:2], FINAL):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N: minibatches per generated batch (the last is N - 1 updates stale)")
        ax.set_title(f"final {metric} (mean ± std over seeds)", fontsize=10)
    axes[2].set_xlabel("the reference's perplexity of the final policy's held-out completions")
    axes[2].set_title(
        "final eval/score against the paper's KL (perplexity), a point per run (larger: larger N)", fontsize=10
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", nargs="+", required=True, help="LABEL=GLOB, one objective each")
    parser.add_argument("--subject", default=None, help="the objective the claim is about (default: the first)")
    parser.add_argument(
        "--baseline", default=None, help="instead of the claim, each objective minus this one at the same N"
    )
    parser.add_argument("--out", default=None, help="write {out}.md and {out}.png")
    args = parser.parse_args(argv)
    values = {}
    for spec in args.experiments:
        label, pattern = parse_experiment(spec)
        values[label] = by_n(find_runs(pattern, all_runs=True))
    subject = args.baseline or args.subject or parse_experiment(args.experiments[0])[0]
    if not values.get(subject):
        raise SystemExit(f"error: {subject!r} has no runs (labels: {list(values)})")
    values = {label: table for label, table in values.items() if table}
    write_text(report(values, subject, args.baseline), f"{args.out}.md" if args.out else None)
    if args.out:
        print(f"wrote {plot(values, args.out + '.png')}")


if __name__ == "__main__":
    main()
