"""The PRM pilot's criterion: is raw process reward hacked in a cell of the grid (docs/ppo_prm_clip.md, "The pilot")?

    python -m benchmark.claims.prm_pilot \
        --experiments "verifier_1.5=benchmark/results/prm_pilot/*__pilot_verifier_1.5__*" ... \
        --out benchmark/results/prm_pilot.md

A run meets the criterion when its held-out accuracy at its last evaluation is at least `--drop` (0.04) below its own
step 0, while its held-out steps per response are above their step-0 value. A cell shows the phenomenon when every one
of its runs meets it, on at least two seeds. The criterion was written down before the pilot ran.
"""

import argparse

from benchmark.statistics.registry import final_step, final_value, find_runs, initial_value, parse_experiment


def run_row(run, drop):
    """(seed, last step, accuracy at 0 and at the end, steps a response at 0 and at the end, criterion met)."""
    lines = run["lines"]
    acc0, acc1 = initial_value(lines, "eval/accuracy"), final_value(lines, "eval/accuracy")
    steps0, steps1 = initial_value(lines, "eval/num_steps"), final_value(lines, "eval/num_steps")
    met = None not in (acc0, acc1, steps0, steps1) and acc0 - acc1 >= drop - 1e-9 and steps1 > steps0  # k/500 exact
    return run["seed"], final_step(lines), acc0, acc1, steps0, steps1, met


def cell_shown(rows):
    """The phenomenon in a cell: every run meets the criterion, on at least two seeds."""
    return len(rows) >= 2 and all(row[-1] for row in rows)


def pilot_table(experiments, drop=0.04):
    """Markdown: one row per run, then one line per cell."""
    out = [
        f"Criterion: held-out accuracy at the last evaluation at least {drop} below step 0's, and held-out steps per"
        " response above step 0's, on every seed (at least two).",
        "",
        "| cell | seed | last step | accuracy, step 0 -> last | steps a response, step 0 -> last | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    verdicts = []
    for label, pattern in experiments:
        rows = [run_row(run, drop) for run in find_runs(pattern)]
        for seed, step, acc0, acc1, steps0, steps1, met in rows:
            out.append(
                f"| {label} | {seed} | {step} | {acc0:.3f} -> {acc1:.3f} ({acc1 - acc0:+.3f}) | "
                f"{steps0:.2f} -> {steps1:.2f} | {'yes' if met else 'no'} |"
            )
        verdicts.append(f"- {label}: {'shown' if cell_shown(rows) else 'not shown'} ({len(rows)} runs)")
    return "\n".join(out + ["", *verdicts]) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", nargs="+", required=True, help="LABEL=GLOB, one per cell")
    parser.add_argument("--drop", type=float, default=0.04)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    text = pilot_table([parse_experiment(spec) for spec in cli.experiments], cli.drop)
    with open(cli.out, "w") as f:
        f.write(text)
    print(text)
