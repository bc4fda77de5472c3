"""The PRM paper's claims as checks on runs of ppo_prm_clip.py, from their config.json and metrics.jsonl.

    python -m benchmark.claims.prm_checks \
        --experiments "none=benchmark/results/ppo_prm_clip/arith_2t3t1d__prm_none__*" \
        "raw=benchmark/results/ppo_prm_clip/arith_2t3t1d__prm_raw__*" ... --out benchmark/results/ppo_prm_checks.md

Writes one row per arm and seed: the final held-out accuracy, steps per response and length (greedy, at the last
evaluation), and over the last `--last` training steps the sampled responses' steps, length, the PRM's score sum per
response (what raw would pay, before prm_coef) and the process reward this arm paid. Then the claims of Gao et al.
(arXiv 2410.15115), each held / not held / inconclusive with its numbers, against the baseline (success only):
(a) raw writes at least 1.5x the baseline's held-out steps per response and ends less accurate;
(b) each bounded arm (clip, delta, clip_delta) stays within 20% of the baseline's held-out steps and within 2 points
    of its accuracy;
(c) some arm ends above the baseline;
(d) the fix against raw, for each bounded arm: fewer held-out steps than raw (per-seed ratio arm / raw
    below 1), and a higher accuracy (difference arm - raw above 0), each by Holm over the bounded arms.
Every comparison is paired over the seeds both arms finished, by the one rule of every check in benchmark/
(benchmark/statistics/registry.py): a step count as the per-seed ratio arm / baseline, an accuracy as the per-seed
difference arm - baseline, and the two-sided 95% interval of their mean, mean ± t(0.975, n - 1) x standard error (std /
sqrt(n); t = 4.30 on 3 seeds), against the bound: held when it lies inside, not held when it lies wholly outside,
inconclusive when it crosses it, when the differences have no spread (no interval), and on fewer than 3 shared seeds.
(a) and each (b) are conjunctions (both halves must hold; either half not held makes the claim not held): no
correction. (c) is "some arm of the k tried": held when Holm's step-down procedure over the arms' one-sided p-values
(the paired t test of "difference > 0") rejects at 0.025 a side, the level of the interval's lower end (registry.holm),
so that trying k arms does not raise the chance of a lucky one; not held when every arm's interval lies below 0; else
inconclusive. (d)'s rows, one per arm and metric: held when Holm over the bounded arms rejects that arm (one-sided
p-values of "1 - ratio > 0" for the steps, "difference > 0" for the accuracy, 0.025 a side), not held when the arm's
interval lies wholly on the other side, else inconclusive. Every part is printed with its exact sign-flip p
(registry.sign_flip_p: one-sided in the claim's direction over all 2^n sign assignments, no normality assumed; for a
"within" part the larger of its two sides), which on 3-4 seeds cannot go below 1/8 or 1/16.
"""

import argparse
import math

import numpy as np

from benchmark.statistics.registry import (
    final_value,
    holm,
    interval,
    interval_text,
    load_experiments,
    p_above,
    shared_seeds,
    sign_flip_text,
    verdict_inside,
    write_text,
)

BOUNDED = ("clip", "delta", "clip_delta")
TRAINING = {
    "objective/num_steps": "training steps / response",
    "objective/response_length": "training length",
    "objective/prm_score_sum": "PRM score sum / response",
    "objective/process_reward": "process reward paid",
}


def last_mean(lines, metric, last):
    """The mean of a metric over the last `last` lines that have it (training steps), or None."""
    values = [line[metric] for line in lines if line.get(metric) is not None][-last:]
    return float(np.mean(values)) if values else None


def per_seed(runs, last):
    """{seed: {name: value}} of one experiment: final held-out metrics, and training means over the last steps."""
    shared = shared_seeds(runs)
    if shared:
        raise ValueError(f"the checks pair arms by seed, and these runs share one: {sorted(shared.values())}")
    table = {}
    for run in runs:
        row = {m: final_value(run["lines"], m) for m in ("eval/accuracy", "eval/num_steps", "eval/response_length")}
        row |= {m: last_mean(run["lines"], m, last) for m in TRAINING}
        table[run["seed"]] = row
    return table


def paired(diffs, low, high, min_seeds):
    """(verdict, mean, se, half) of paired values against the bounds [low, high] (registry.verdict_inside),
    inconclusive on fewer than min_seeds."""
    mean, se, half = interval(diffs)
    verdict = "inconclusive" if len(diffs) < min_seeds else verdict_inside(mean, half, low, high)
    return verdict, mean, se, half


def conjunction(verdicts):
    """A claim whose parts must all hold: held when each is held, not held when one is not, else inconclusive."""
    return "not held" if "not held" in verdicts else "held" if set(verdicts) == {"held"} else "inconclusive"


def ratio_text(mean, se, half):
    if se is None:
        return f"x{mean:.2f} (s.e. –), no interval"
    if half is None:
        return f"x{mean:.2f} (s.e. {se:.2f}), no interval (no spread over seeds)"
    return f"x{mean:.2f} (s.e. {se:.2f}), 95% interval x{mean - half:.2f} to x{mean + half:.2f}"


def checks(values, baseline, min_seeds=3):
    """The claims (a), (b), (c) as [(claim, verdict, numbers)] from {arm: {seed: {metric: value}}}."""
    base = values[baseline]
    results = []

    def shared(arm, other=baseline):  # the seeds both arms finished (a run in progress has no final accuracy yet)
        return sorted(
            seed
            for seed in set(values[other]) & set(values[arm])
            if values[other][seed]["eval/accuracy"] is not None and values[arm][seed]["eval/accuracy"] is not None
        )

    def steps_and_accuracy(arm, steps_bounds, accuracy_bounds):
        """(verdict, numbers): the per-seed steps ratios and accuracy differences of an arm, each on its bounds."""
        seeds = shared(arm)
        ratios = [values[arm][s]["eval/num_steps"] / max(base[s]["eval/num_steps"], 1e-9) for s in seeds]
        diffs = [values[arm][s]["eval/accuracy"] - base[s]["eval/accuracy"] for s in seeds]
        steps, *ratio = paired(ratios, *steps_bounds, min_seeds)
        accuracy, *difference = paired(diffs, *accuracy_bounds, min_seeds)
        text, span = interval_text(*difference)
        numbers = (
            f"steps {' / '.join(f'x{r:.2f}' for r in ratios)}: {ratio_text(*ratio)} ({steps};"
            f" {sign_flip_text(ratios, *steps_bounds, what='ratio')}); accuracy difference {text} (seeds {seeds}),"
            f" {span} ({accuracy}; {sign_flip_text(diffs, *accuracy_bounds)})"
        )
        return conjunction([steps, accuracy]), numbers

    if "raw" in values and shared("raw"):
        verdict, numbers = steps_and_accuracy("raw", (1.5, math.inf), (-math.inf, 0.0))
        results.append(("(a) raw: >= 1.5x the steps and less accurate", verdict, numbers))

    for arm in [a for a in BOUNDED if a in values and shared(a)]:
        verdict, numbers = steps_and_accuracy(arm, (0.8, 1.2), (-0.02, 0.02))
        results.append((f"(b) {arm}: within 20% of the steps and 2 points of the accuracy", verdict, numbers))

    arms = [a for a in values if a != baseline and shared(a)]
    if arms:
        diffs = {
            arm: [values[arm][s]["eval/accuracy"] - base[s]["eval/accuracy"] for s in shared(arm)] for arm in arms
        }
        p_values = [p_above(diffs[arm]) if len(diffs[arm]) >= min_seeds else None for arm in arms]
        rejected = holm(p_values)
        below = [paired(diffs[arm], 0.0, math.inf, min_seeds)[0] == "not held" for arm in arms]
        verdict = "held" if any(rejected) else "not held" if all(below) else "inconclusive"
        notes = []
        for arm, p, above in zip(arms, p_values, rejected):
            difference, span = interval_text(*interval(diffs[arm]))
            test = "no test" if p is None else f"one-sided p {p:.3f}{', above by Holm' if above else ''}"
            notes.append(f"{arm} {difference} ({span}; {test}; {sign_flip_text(diffs[arm], 0.0)})")
        claim = f"(c) some arm above success only (Holm over {len(arms)} arms, 0.025 a side)"
        results.append((claim, verdict, "; ".join(notes)))

    bounded = [a for a in BOUNDED if "raw" in values and a in values and shared(a, "raw")]
    raw = values.get("raw")
    for metric, claim in (
        ("eval/num_steps", "fewer held-out steps than raw"),
        ("eval/accuracy", "more accurate than raw"),
    ):
        # Per seed: 1 - ratio (steps) or the difference (accuracy), so that the claim is "above 0" for both.
        gains = {
            arm: [
                1 - values[arm][s][metric] / max(raw[s][metric], 1e-9)
                if metric == "eval/num_steps"
                else values[arm][s][metric] - raw[s][metric]
                for s in shared(arm, "raw")
            ]
            for arm in bounded
        }
        p_values = [p_above(gains[arm]) if len(gains[arm]) >= min_seeds else None for arm in bounded]
        for arm, p, rejected in zip(bounded, p_values, holm(p_values)):
            below = paired(gains[arm], 0.0, math.inf, min_seeds)[0] == "not held"
            verdict = "held" if rejected else "not held" if below else "inconclusive"
            mean, se, half = interval(gains[arm])
            if metric == "eval/num_steps":  # as ratios arm / raw: 1 - gain
                values_text = " / ".join(f"x{1 - g:.2f}" for g in gains[arm])
                numbers = f"steps {values_text}: {ratio_text(1 - mean, se, half)}"
            else:
                difference, span = interval_text(mean, se, half)
                numbers = f"accuracy difference {difference}, {span}"
            test = "no test" if p is None else f"one-sided p {p:.4f}"
            if metric == "eval/num_steps":  # 1 - ratio >= 0 is ratio <= 1: the same signed values
                flip = sign_flip_text([1 - g for g in gains[arm]], high=1.0, what="ratio")
            else:
                flip = sign_flip_text(gains[arm], 0.0)
            numbers += f" (seeds {shared(arm, 'raw')}; {test}, Holm over {len(bounded)} arms; {flip})"
            results.append((f"(d) {arm}: {claim}", verdict, numbers))
    return results


def report(experiments, baseline, last):
    values = {label: per_seed(runs, last) for label, runs in experiments}
    if baseline not in values:
        raise ValueError(f"--baseline {baseline!r} is not one of the experiments' labels {list(values)}")
    names = ["eval/accuracy", "eval/num_steps", "eval/response_length", *TRAINING]
    header = ["arm", "seed", "held-out accuracy", "held-out steps / response", "held-out length"]
    header += [f"{TRAINING[m]} (last {last} steps)" for m in TRAINING]
    rows = [header, ["---"] * len(header)]
    for label, table in values.items():
        for seed in sorted(table):
            cells = [table[seed][m] for m in names]
            rows.append([label, str(seed)] + ["–" if v is None else f"{v:.3f}" for v in cells])
    text = "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n\n"
    text += "| claim | verdict | numbers |\n| --- | --- | --- |\n"
    text += "".join(
        f"| {claim} | **{verdict}** | {numbers} |\n" for claim, verdict, numbers in checks(values, baseline)
    )
    text += (
        "\nA steps ratio (arm / success only, per seed) and an accuracy difference (arm - success only, per seed) are"
        " the paired values' mean (s.e.: standard error), then the two-sided 95% interval (mean ± t(0.975, n - 1) x"
        " standard error): a part is held or not held when that interval lies inside or wholly outside its bound,"
        " inconclusive when it crosses it, has no spread, or has fewer than 3 seeds; (a) and (b) hold when both parts"
        " do and are not held when one is not. (c) is held when Holm's procedure over the arms' one-sided p-values"
        " (paired t, difference > 0) rejects for some arm at 0.025 a side, not held when every arm's interval lies"
        " below 0. Beside each part, its exact sign-flip p: over all 2^n assignments of signs to the n paired values"
        " minus the bound, the share whose mean is at least the observed one, one-sided in the claim's direction (for"
        ' a "within" part the larger of its two sides); no normality assumed, and never below 1 / 2^n.\n'
    )
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", nargs="+", required=True, help="LABEL=GLOB, the labels none/raw/clip/...")
    parser.add_argument("--baseline", default="none", help="the success-only experiment's label")
    parser.add_argument("--last", type=int, default=10, help="training steps averaged at the end")
    parser.add_argument("--out", default=None, help="also write the tables to this .md file")
    args = parser.parse_args(argv)
    write_text(report(load_experiments(args.experiments), args.baseline, args.last), args.out)


if __name__ == "__main__":
    main()
