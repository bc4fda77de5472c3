"""The seeds a paired claim check needs (the power plan, docs/power_plan.md), from runs' config.json and
metrics.jsonl.

    python -m benchmark.statistics.power \
        --experiments "none=benchmark/results/ppo_prm_clip/arith_2t3t1d__prm_none__*" \
        "raw=benchmark/results/ppo_prm_clip/arith_2t3t1d__prm_raw__*" --baseline none --metric eval/accuracy \
        --at_most 0 --out benchmark/results/power_prm_a.md

Each experiment but the baseline is paired with it seed by seed: the per-seed difference of the metric's final value
(arm - baseline; with --ratio the ratio arm / baseline), its mean ± std over the seeds both ran, and the claim's bound
(--at_least, --at_most, or both: "within"). The check is the one rule of benchmark/ (registry.claim_verdict: held when
the two-sided 95% t interval lies inside the bounds, not held when wholly outside, else inconclusive). From the
observed mean and std, as if they were the truth:
- seeds needed: the smallest n >= 3 whose interval decides it with the given power, by the normal-theory formula
  (t(0.975, n - 1) + t(power, n - 1)) x std / sqrt(n) <= the distance from the mean to the nearest bound;
- its simulated power: the share of `--draws` simulated sets of n normal paired differences (that mean and std)
  that the rule decides, held or not held (the formula is approximate, the simulation is the rule itself);
- the minimum detectable effect (MDE) at the seeds there are: the distance from the bound that the formula's power
  needs at that n.
Beside the verdict now, the claim's exact sign-flip p (registry.sign_flip_p: one-sided, no normality assumed; never
below 1 / 2^n, so no number of seeds under 6 brings it under 0.025).
With --holm (a family "every arm beyond the bound", one-sided, the arms tried together), the simulation applies Holm's
procedure over the arms' one-sided p-values at 0.025 a side (registry.holm) to independent draws of every arm, and
reports each arm's share rejected at its seeds needed. Every std rests on the seeds there are: with 3 seeds (2
degrees of freedom) the true one can be twice the estimate, and the seeds needed four times.
"""

import argparse
import math

import numpy as np

from benchmark.statistics.registry import (
    claim_verdict,
    holm,
    load_experiments,
    mean_std,
    p_above,
    seed_values,
    sign_flip_p,
    t_975,
    t_cdf,
    write_text,
)

HOLM_MAX_SEEDS = 30


def t_quantile(q, df):
    """The q quantile of Student's t with integer df >= 1, by bisection on registry.t_cdf (to 1e-10)."""
    low, high = -1e4, 1e4
    while high - low > 1e-10:
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < q else (low, mid)
    return (low + high) / 2


def mde(std, n, power=0.8, alpha=0.025):
    """The distance from the bound at which a two-sided 95% interval on n paired differences of this std decides the
    claim with this power (normal theory, the rule's t(0.975) as registry.t_975 gives it). alpha: the one-sided level
    of the interval's end, 0.025 for the rule; another (Holm's first step over k arms, 0.025 / k) by t_quantile."""
    critical = t_975(n - 1) if alpha == 0.025 else t_quantile(1 - alpha, n - 1)
    return (critical + t_quantile(power, n - 1)) * std / math.sqrt(n)


def gap_to_bound(mean, low, high):
    """The distance from the mean to the nearest bound (inside or outside the claim's range)."""
    return min(abs(mean - bound) for bound in (low, high) if math.isfinite(bound))


def seeds_needed(mean, std, low, high, power=0.8, n_max=10000, alpha=0.025):
    """The smallest n >= 3 with mde(std, n, power, alpha) <= the mean's distance to its nearest bound; None beyond
    n_max."""
    gap = gap_to_bound(mean, low, high)
    n = 3
    while mde(std, n, power, alpha) > gap:
        if n >= n_max:
            return None
        n = n + 1 if n < 100 else int(n * 1.05) + 1
    return n


def simulated_decided(mean, std, n, low, high, draws=20000, seed=0):
    """The share of `draws` simulated sets of n normal paired differences (this mean and std) that registry's rule
    decides (held or not held)."""
    samples = np.random.default_rng(seed).normal(mean, std, size=(draws, n))
    verdicts = [claim_verdict(*mean_std(list(row)), low, at_most=high) for row in samples]
    return sum(v != "inconclusive" for v in verdicts) / draws


def simulated_holm(means, stds, n, bound, above=True, draws=20000, seed=0):
    """[share of draws in which Holm's procedure rejects arm i] for "arm i's difference > bound" (above) or "< bound",
    each arm's n differences drawn independently from its normal (mean, std)."""
    rng = np.random.default_rng(seed)
    sign = 1.0 if above else -1.0
    rejected = np.zeros(len(means))
    for _ in range(draws):
        p = [p_above(list(sign * (rng.normal(m, s, n) - bound))) for m, s in zip(means, stds)]
        rejected += holm(p)
    return list(rejected / draws)


def paired_values(experiments, baseline, metric, ratio):
    """{arm: {seed: arm - baseline (or arm / baseline)}} over the seeds both ran."""
    runs_of = dict(experiments)
    if baseline not in runs_of:
        raise SystemExit(f"error: --baseline {baseline!r} is not one of the experiments' labels {list(runs_of)}")
    base = seed_values(runs_of[baseline], metric)
    values = {}
    for label, runs in experiments:
        if label != baseline:
            other = seed_values(runs, metric)
            seeds = sorted(set(base) & set(other))
            values[label] = {s: other[s] / base[s] if ratio else other[s] - base[s] for s in seeds}
    return values


def report(values, metric, baseline, low, high, ratio, power=0.8, holm_family=False, draws=20000):
    """The markdown table: a row per arm."""
    kind = f"{metric}, arm / {baseline}" if ratio else f"{metric}, arm - {baseline}"
    bound = " and ".join([f">= {low:g}"] * math.isfinite(low) + [f"<= {high:g}"] * math.isfinite(high))
    verdict_now = "verdict now (this arm alone)" if holm_family else "verdict now"
    side = "the larger one-sided" if math.isfinite(low) and math.isfinite(high) else "one-sided"
    head = ["arm", "seeds", "per seed", "mean ± std", "claim", verdict_now, f"exact sign-flip p now ({side})"]
    head += [f"seeds for {power:.0%} power"]
    head += ["simulated power there", "MDE at the seeds there are"]
    rows = [head, ["---"] * len(head)]
    plans = []
    for label, per_seed in values.items():
        mean, std, n = mean_std(list(per_seed.values()))
        verdict = claim_verdict(mean, std, n, low, at_most=high) if n else "inconclusive"
        row = [label, " ".join(map(str, per_seed)), " / ".join(f"{v:.3f}" for v in per_seed.values())]
        shown = "–" if not n else f"{mean:.3f}" if ratio else f"{mean:+.3f}"
        p = sign_flip_p(list(per_seed.values()), low, high)
        row += [shown if std is None else f"{shown} ± {std:.3f}", bound, verdict, "–" if p is None else f"{p:.4f}"]
        if std is None or std == 0 or n < 2:
            row += ["– (no spread yet)", "–", "–"]
            plans.append(None)
        else:
            need = seeds_needed(mean, std, low, high, power)
            plans.append((mean, std, need))
            decided = (
                "–" if need is None or holm_family else f"{simulated_decided(mean, std, need, low, high, draws):.2f}"
            )
            row += [str(need) if need else "> 10000", decided, f"{mde(std, n, power):.3f}"]
        rows.append(row)
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    text = f"Paired {kind}; claim: the {'ratio' if ratio else 'difference'} {bound}.\n\n" + "\n".join(lines) + "\n"
    if holm_family and plans and all(plans):
        text += "\n" + holm_plan(list(values), plans, low, high, power, draws) + "\n"
    return text


def holm_plan(labels, plans, low, high, power, draws):
    """The seeds at which Holm's procedure over the arms rejects every arm in >= power of the simulated draws: from the
    most any arm needs alone (Holm's first step is stricter than one arm's test), up to HOLM_MAX_SEEDS; not simulated
    when some arm's mean is not beyond the bound (then no number of seeds rejects it) or it needs more alone."""
    above = math.isfinite(low)
    bound = low if above else high
    means, stds, needs = zip(*plans)
    head = f"Holm over the {len(plans)} arms (one-sided, 0.025; {draws} simulated draws): "
    stuck = [
        label
        for label, mean, need in zip(labels, means, needs)
        if not (mean > bound if above else mean < bound) or need is None or need > HOLM_MAX_SEEDS
    ]
    if stuck:
        return (
            head + f"not simulated: {', '.join(stuck)} not beyond the bound or needing > {HOLM_MAX_SEEDS} seeds alone."
        )
    for n in range(max(needs), HOLM_MAX_SEEDS + 1):
        shares = simulated_holm(means, stds, n, bound, above, draws)
        if min(shares) >= power:
            break
    reached = (
        f"every arm rejected in >= {power:.0%} of draws at {n} seeds each"
        if min(shares) >= power
        else (f"not every arm rejected in {power:.0%} of draws by {n} seeds")
    )
    return head + reached + f" ({', '.join(f'{label} {share:.2f}' for label, share in zip(labels, shares))})."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", nargs="+", required=True, help="LABEL=GLOB, the baseline among them")
    parser.add_argument("--baseline", required=True, help="the label every other experiment is paired with")
    parser.add_argument("--metric", default="eval/accuracy", help="its final value per run")
    parser.add_argument("--ratio", action="store_true", help="arm / baseline per seed instead of arm - baseline")
    parser.add_argument("--at_least", type=float, default=-math.inf, help="the claim: the difference >= this")
    parser.add_argument("--at_most", type=float, default=math.inf, help="the claim: the difference <= this")
    parser.add_argument("--holm", action="store_true", help="the arms are one family (Holm), one-sided at one bound")
    parser.add_argument("--power", type=float, default=0.8)
    parser.add_argument("--draws", type=int, default=20000)
    parser.add_argument("--out", help="write the table to this .md file (else stdout)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.at_least) or math.isfinite(args.at_most)):
        parser.error("give the claim's bound: --at_least, --at_most or both")
    if args.holm and math.isfinite(args.at_least) and math.isfinite(args.at_most):
        parser.error("--holm takes one bound (a one-sided claim)")
    experiments = load_experiments(args.experiments)
    values = paired_values(experiments, args.baseline, args.metric, args.ratio)
    text = report(values, args.metric, args.baseline, args.at_least, args.at_most, args.ratio, args.power, args.holm,
                  args.draws)  # fmt: skip
    write_text(text, args.out)


if __name__ == "__main__":
    main()
