"""Training speed with and without the shared-prompt forward, side by side in one run.

    python -m benchmark.performance.perf_shared_prompt     # grpo_math, dpo_online, async_rlhf at their defaults
    python -m benchmark.performance.perf_shared_prompt --steps 3 --scripts grpo_math

Each script runs its default command for --steps steps twice, with `--shared_prompt` (each prompt computed once per
group: shared_prompt_logits) and with `--no-shared_prompt` (each completion with its own copy of the prompt),
the order of the two alternating from one script to the next. Only what the comparison needs changes: HF generate
instead of vLLM (the sampler is not what is timed), 8 held-out prompts, no checkpoints; the seed is the same, so
both runs train on the same first batch. The first step is a warm-up and is left out: the medians are over the
other steps. Reported per step: the training time (policy forward and backward, the old policy's and the
reference's log-probs where the learner computes them), the script's training tokens/s (the real tokens of the
batch, each completion with its prompt, over the training time, the same count with or without sharing), and the
wall-clock of the step. async_rlhf computes the reference's log-probs in its generator thread
(time/reference_logprobs, shared as well) while the learner trains. Results go to
benchmark/results/shared_prompt.{json,md}.
"""

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ("grpo_math", "dpo_online", "async_rlhf")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=SCRIPTS, help="scripts to time")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run (the first is a warm-up)")
    parser.add_argument("--out", default="benchmark/results/shared_prompt", help="output path without extension")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags added to every run")
    return parser.parse_args(argv)


def run_script(script, shared, steps, extra, folder):
    """One run of `script` at its defaults (HF generate, 8 eval prompts, no checkpoints); its training steps'
    metrics lines and the wall-clock of the whole command."""
    flag = "--shared_prompt" if shared else "--no-shared_prompt"
    cmd = [sys.executable, f"{script}.py", "--no-vllm", "--total_steps", str(steps), "--eval_every", "0"]
    cmd += ["--save_every", "0", "--num_eval_prompts", "8", "--output_dir", folder, flag, *extra]
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - t0
    (metrics,) = glob.glob(os.path.join(folder, "*", "metrics.jsonl"))
    with open(metrics) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [line for line in lines if line["global_step"] > 0], wall


def summarize(lines):
    """Medians over the steps after the first."""
    timed = lines[1:]
    summary = {
        "steps": len(timed),
        "training_s": statistics.median(line["time/training"] for line in timed),
        "train_tokens_per_s": statistics.median(line["perf/train_tokens_per_second"] for line in timed),
        "step_s": statistics.median(line["time/step"] for line in timed),
    }
    if "time/reference_logprobs" in timed[0]:
        summary["reference_logprobs_s"] = statistics.median(line["time/reference_logprobs"] for line in timed)
    return summary


def main(argv=None):
    args = parse_args(argv)
    results = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "steps": args.steps,
        "extra": args.extra,
        "runs": {},
    }
    for i, script in enumerate(args.scripts):
        order = (True, False) if i % 2 == 0 else (False, True)
        for shared in order:
            with tempfile.TemporaryDirectory() as folder:
                lines, wall = run_script(script, shared, args.steps, args.extra, folder)
            summary = summarize(lines)
            summary["command_s"] = wall
            results["runs"].setdefault(script, {})["shared" if shared else "unshared"] = summary
            print(script, "shared" if shared else "unshared", json.dumps(summary), flush=True)
    write_results(results, args.out)


def write_results(results, out):
    os.makedirs(os.path.dirname(os.path.join(REPO_ROOT, out)), exist_ok=True)
    with open(os.path.join(REPO_ROOT, out + ".json"), "w") as f:
        json.dump(results, f, indent=2)
    rows = [
        "| script | training s/step, unshared → shared | speed-up | training tokens/s, unshared → shared | "
        "step s, unshared → shared | step speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for script, runs in results["runs"].items():
        a, b = runs["unshared"], runs["shared"]
        rows.append(
            f"| {script} | {a['training_s']:.2f} → {b['training_s']:.2f} | {a['training_s'] / b['training_s']:.2f}x | "
            f"{a['train_tokens_per_s']:.0f} → {b['train_tokens_per_s']:.0f} | {a['step_s']:.2f} → {b['step_s']:.2f} | "
            f"{a['step_s'] / b['step_s']:.2f}x |"
        )
    note = (
        f"\nMedians over steps 2-{results['steps']} of one run each "
        f"(`python -m benchmark.performance.perf_shared_prompt`), {results['machine']['cpus']} CPUs, "
        f"torch {results['versions']['torch']}.\n"
    )
    with open(os.path.join(REPO_ROOT, out + ".md"), "w") as f:
        f.write("\n".join(rows) + "\n" + note)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
