"""Learning curves and a before/after table from runs' metrics.jsonl files (no wandb account needed).

    python -m benchmark.plot_curves runs/arith_1d__grpo__1__* runs/arith_1d__grpo__2__* \
        --out benchmark/results/grpo_math_curve.png

Plots the held-out greedy accuracy (eval/accuracy, markers) and the training accuracy of the sampled completions
(objective/accuracy, moving average) against the step, one colour per run, and prints a markdown table of the
held-out accuracy before and after training, with the wall-clock time of each run.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def moving_average(values, window):
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (runs/{run_name})")
    parser.add_argument("--out", default="benchmark/results/curve.png", help="where the PNG goes")
    parser.add_argument("--window", type=int, default=8, help="moving-average window of the training accuracy")
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = [
        "| run | eval/accuracy before | after | eval_extra/accuracy before | after | steps | wall-clock |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, run in enumerate(args.runs):
        lines, color, name = read_metrics(run), f"C{i}", os.path.basename(os.path.normpath(run))
        train = [line for line in lines if "objective/accuracy" in line]
        evals = [line for line in lines if "eval/accuracy" in line]
        ax.plot(
            [line["global_step"] for line in train],
            moving_average([line["objective/accuracy"] for line in train], args.window),
            color=color,
            alpha=0.5,
            label=f"{name} train (sampled, avg {args.window})",
        )
        ax.plot(
            [line["global_step"] for line in evals],
            [line["eval/accuracy"] for line in evals],
            "o-",
            color=color,
            label=f"{name} held-out (greedy)",
        )
        gsm = [
            line.get("eval_extra/accuracy", line.get("eval_gsm8k/accuracy", float("nan")))
            for line in (evals[0], evals[-1])
        ]
        rows.append(
            f"| {name} | {evals[0]['eval/accuracy']:.3f} | {evals[-1]['eval/accuracy']:.3f} | "
            f"{gsm[0]:.3f} | {gsm[1]:.3f} | {lines[-1]['global_step']} | {lines[-1]['time']:.0f} s |"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("\n".join(rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
