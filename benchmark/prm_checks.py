"""The PRM paper's claims as checks on runs of ppo_prm_clip.py (issue 30), from their config.json and metrics.jsonl.

    python -m benchmark.prm_checks --experiments "none=benchmark/results/ppo_prm_clip/arith_2t3t1d__prm_none__*" \
        "raw=benchmark/results/ppo_prm_clip/arith_2t3t1d__prm_raw__*" ... --out benchmark/results/ppo_prm_checks.md

Writes one row per arm and seed: the final held-out accuracy, steps per response and length (greedy, at the last
evaluation), and over the last `--last` training steps the sampled responses' steps, length, the PRM's score sum per
response (what raw would pay, before prm_coef) and the process reward this arm paid. Then the claims of Gao et al.
(arXiv 2410.15115), each held / not held / inconclusive with its numbers, against the baseline (success only):
(a) raw writes at least 1.5x the baseline's held-out steps per response and ends less accurate, on at least 2 of
    3 seeds;
(b) each bounded arm (clip, delta, clip_delta) stays within 20% of the baseline's held-out steps (means over seeds)
    and within 2 points of its accuracy;
(c) some arm ends above the baseline.
An accuracy comparison in (b) and (c) uses the paired differences over the seeds both arms ran: the two-sided 95%
interval of their mean, mean ± t(0.975, n - 1) x standard error (std / sqrt(n); t = 4.30 for 3 seeds); the check holds
when that interval lies inside the bound (above 0 for (c)), does not when it lies outside, and is inconclusive when it
crosses the bound. So "held" and "not held" need a difference significant at the 5% level (|paired t| > 4.30 on 3
seeds); one standard error clear of the bound (|t| > 1) is not enough. Any check on fewer than 3 shared seeds is
inconclusive. The rule and its t table are benchmark/registry.py's, the one rule of every check in benchmark/.
"""

import argparse
import math

import numpy as np

from benchmark.registry import final_value, interval, interval_text, load_experiments, verdict_inside, write_text

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
    table = {}
    for run in runs:
        row = {m: final_value(run["lines"], m) for m in ("eval/accuracy", "eval/num_steps", "eval/response_length")}
        row |= {m: last_mean(run["lines"], m, last) for m in TRAINING}
        table[run["seed"]] = row
    return table


def checks(values, baseline, min_seeds=3):
    """The claims (a), (b), (c) as [(claim, verdict, numbers)] from {arm: {seed: {metric: value}}}."""
    base = values[baseline]
    results = []

    def shared(arm):  # the seeds both arms finished (a run still in progress has no final accuracy yet)
        return sorted(
            seed
            for seed in set(base) & set(values[arm])
            if base[seed]["eval/accuracy"] is not None and values[arm][seed]["eval/accuracy"] is not None
        )

    if "raw" in values:
        seeds = shared("raw")
        hits, notes = 0, []
        for seed in seeds:
            b, r = base[seed], values["raw"][seed]
            ratio = r["eval/num_steps"] / max(b["eval/num_steps"], 1e-9)
            ok = ratio >= 1.5 and r["eval/accuracy"] < b["eval/accuracy"]
            hits += ok
            notes.append(
                f"seed {seed}: steps x{ratio:.2f}, accuracy {r['eval/accuracy']:.3f} vs {b['eval/accuracy']:.3f}"
                f" ({'yes' if ok else 'no'})"
            )
        verdict = "inconclusive" if len(seeds) < min_seeds else "held" if hits >= 2 else "not held"
        results.append(("(a) raw: >= 1.5x the steps and less accurate, on >= 2 of 3 seeds", verdict, "; ".join(notes)))

    for arm in [a for a in BOUNDED if a in values]:
        seeds = shared(arm)
        if not seeds:
            continue
        diffs = [values[arm][s]["eval/accuracy"] - base[s]["eval/accuracy"] for s in seeds]
        steps_ratio = np.mean([values[arm][s]["eval/num_steps"] for s in seeds]) / max(
            np.mean([base[s]["eval/num_steps"] for s in seeds]), 1e-9
        )
        mean, se, half = interval(diffs)
        accuracy = verdict_inside(mean, half, -0.02, 0.02)
        if len(seeds) < min_seeds:
            verdict = "inconclusive"
        elif abs(steps_ratio - 1) > 0.2 or accuracy == "not held":
            verdict = "not held"
        else:
            verdict = accuracy
        difference, span = interval_text(mean, se, half)
        numbers = f"steps x{steps_ratio:.2f}; accuracy difference {difference} (seeds {seeds}), {span}"
        results.append((f"(b) {arm}: within 20% of the steps and 2 points of the accuracy", verdict, numbers))

    verdicts, notes = [], []
    for arm in [a for a in values if a != baseline]:
        seeds = shared(arm)
        if not seeds:
            continue
        mean, se, half = interval([values[arm][s]["eval/accuracy"] - base[s]["eval/accuracy"] for s in seeds])
        above = "inconclusive" if len(seeds) < min_seeds else verdict_inside(mean, half, 0.0, math.inf)
        verdicts.append(above)
        notes.append("{} {} ({})".format(arm, *interval_text(mean, se, half)))
    if verdicts:
        verdict = "held" if "held" in verdicts else "not held" if set(verdicts) == {"not held"} else "inconclusive"
        results.append(("(c) some arm above success only", verdict, "; ".join(notes)))
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
        "\nAn accuracy difference is the paired differences' mean ± its standard error, then the two-sided 95%"
        " interval (mean ± t(0.975, n - 1) x standard error): held or not held when that interval clears the bound"
        " (above 0 for (c)), inconclusive when it crosses it, and on fewer than 3 seeds.\n"
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
