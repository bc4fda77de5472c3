"""A policy of grpo_tools.py (the untrained one, or a run's saved model/) on grpo_tools' own prompts: K trajectories
per prompt at a temperature (greedy at 0), through its multi-turn rollout and tool, scored by its verifier; no
training.

Two uses:
- the gate before a tool experiment: does the policy succeed at all? (--min_accuracy / --max_accuracy: the exit
  status is 3 when the accuracy is outside them, after the numbers are written);
- the arm "sharpening without RL": the step-0 policy sampled at a lower temperature, on the held-out prompts the runs
  evaluate on (--prompts eval: the first --num_eval_prompts of --eval_split, as grpo_tools.py's evaluation).

Every grpo_tools.py flag is accepted and means what it means there (the model, --dataset_path, --examples,
--system_prompt, --tool, --max_operations, --max_turns, --response_length, --vllm, --seed, ...): the prompts are built
by grpo_tools' load_tool_prompts (its checks, its prompts), the trajectories by its multi_turn_rollout with its
TurnSampler and ToolCalls, the rewards by its tool format's (compute_rewards, or an environment's own reward). Run
from the repository root:

    python -m benchmark.claims.tool_probe --no-vllm --temperature 0                  # greedy on the held-out prompts
    python -m benchmark.claims.tool_probe --prompts train --terms 3 --num_prompts 64 --max_operations 1 \\
        --dataset_path assets/data/mul_2t3t2d --min_accuracy 0.03             # a gate: exit 3 below 3%

It writes {output_dir}/{task}__{exp_name}__{seed}__{unix_time}/ (task: the --dataset_path folder's name, as a run's):
probe.json (the numbers, by number of terms where the questions are one expression, and a few trajectories),
config.json and metrics.jsonl, one line at global_step 0 with the metrics named as a run logs its evaluation
({prompts}/accuracy, {prompts}/call_rate, ...), so that `python -m benchmark.statistics.registry paired` compares a
probe with runs seed by seed. It prints the JSON, then one markdown table row (markdown_row).
"""

import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro
from accelerate.utils import set_seed
from tqdm.auto import tqdm

import grpo_tools


@dataclass
class ProbeConfig(grpo_tools.Config):
    """grpo_tools.py's flags (the prompt, the tool, the sampler), then the probe's own."""

    temperature: float = 1.0
    """sampling temperature of the probe (0: greedy decoding)"""
    exp_name: str = "probe"
    """the name of this probe; part of its folder's name {task}__{exp_name}__{seed}__{unix_time}"""

    # The probe
    prompts: Literal["eval", "train", "eval_extra"] = "eval"
    """which prompts, each as grpo_tools builds them: eval (the held-out prompts a run evaluates on: the first
    --num_eval_prompts of --eval_split), train (--train_split) or eval_extra (--extra_eval_path's --eval_split, all)"""
    num_prompts: int = 0
    """the first N of those prompts (after --terms; 0: all)"""
    terms: int = 0
    """only the questions of this many terms ("Calculate 5 * 33 * 65." has 3; 0: all)"""
    samples_per_prompt: int = 1
    """K, trajectories per prompt"""
    chunk_prompts: int = 64
    """prompts per rollout call (HF generate batches each call's contexts together)"""
    min_accuracy: float = 0.0
    """the gate: exit status 3 when the accuracy is below this"""
    max_accuracy: float = 1.0
    """the gate: exit status 3 when the accuracy is above this"""


def question_terms(question):
    """The number of terms of a question that is one arithmetic expression after a few words ("Calculate 5 * 33 *
    65." -> 3, "What is 3 + 1?" -> 2), else None (a word problem)."""
    found = re.fullmatch(r"[A-Za-z ]*?([-+*/^()\d.\s]+?)\s*[.?]?", question.strip())
    numbers = re.findall(r"\d+(?:\.\d+)?", found[1]) if found else []
    return len(numbers) or None


def check_probe_args(args):
    """grpo_tools' checks (one line each, before any model loads), the probe's own, and the gate's bounds."""
    temperature = args.temperature
    grpo_tools._require(temperature >= 0, f"--temperature must be >= 0 (0: greedy); got {temperature}")
    args.temperature = temperature or 1.0  # grpo_tools' check wants a sampling temperature; greedy is the probe's
    grpo_tools._check_common_args(args, grpo_tools.check_args(args))
    args.temperature = temperature
    grpo_tools._check_at_least(args, 1, "samples_per_prompt chunk_prompts")
    grpo_tools._check_at_least(args, 0, "num_prompts terms")
    extra = "--prompts eval_extra needs --extra_eval_path"
    grpo_tools._require(args.prompts != "eval_extra" or args.extra_eval_path is not None, extra)
    gate = f"--min_accuracy and --max_accuracy: 0 <= min <= max <= 1; got {args.min_accuracy}, {args.max_accuracy}"
    grpo_tools._require(0 <= args.min_accuracy <= args.max_accuracy <= 1, gate)


def probe_prompts(args, tokenizer, tools):
    """(prompts, golds, terms) of --prompts, as grpo_tools.py builds them for the tool format `tools`
    (load_tool_prompts: its checks, its prompts), then --terms and --num_prompts. terms: question_terms of each
    prompt's question (None: not one expression)."""
    train_prompts, train_golds, sets = grpo_tools.load_tool_prompts(args, tokenizer, 1, tools)
    prompts, golds = (train_prompts, train_golds) if args.prompts == "train" else sets[args.prompts]
    path, split = {
        "train": (args.dataset_path, args.train_split),
        "eval": (args.dataset_path, args.eval_split),
        "eval_extra": (args.extra_eval_path, args.eval_split),
    }[args.prompts]
    terms = [question_terms(tools.questions[tuple(prompt)]) for prompt in prompts]
    chosen = [i for i, t in enumerate(terms) if not args.terms or t == args.terms][: args.num_prompts or None]
    where = f"--prompts {args.prompts} ({path} split {split})"
    grpo_tools._require(chosen, f"{where} has no question of {args.terms} terms (--terms)")
    return [prompts[i] for i in chosen], [golds[i] for i in chosen], [terms[i] for i in chosen]


def summary(records):
    """The numbers of a list of trajectories ({"prompt", "correct", "calls", "failed", "truncated"} each): accuracy,
    its standard error over prompts (the prompts' own accuracies vary, a prompt's K samples do not count as K
    independent draws), the share of prompts with a right trajectory, the shares with a call and with >= 2 calls,
    calls per trajectory, the share of calls answered with an error (NaN without a call) and of trajectories cut at
    the budget."""
    by_prompt = {}
    for r in records:
        by_prompt.setdefault(r["prompt"], []).append(r["correct"])
    means = [sum(v) / len(v) for v in by_prompt.values()]
    n, calls = len(records), sum(r["calls"] for r in records)
    spread = statistics.stdev(means) if len(means) > 1 else 0.0
    return {
        "num_prompts": len(by_prompt),
        "num_samples": n,
        "accuracy": sum(r["correct"] for r in records) / n,
        "accuracy_se": spread / math.sqrt(len(means)),
        "prompts_with_success": sum(m > 0 for m in means) / len(means),
        "call_rate": sum(r["calls"] > 0 for r in records) / n,
        "multi_call_rate": sum(r["calls"] >= 2 for r in records) / n,
        "calls": calls / n,
        "failed_calls": sum(r["failed"] for r in records) / calls if calls else float("nan"),
        "truncated": sum(r["truncated"] for r in records) / n,
    }


def probe_results(records):
    """summary() of every trajectory, and by number of terms where the questions have one ({"2": ..., "3": ...})."""
    results = summary(records)
    terms = sorted({r["terms"] for r in records if r["terms"] is not None})
    if terms:
        results["by_terms"] = {str(t): summary([r for r in records if r["terms"] == t]) for t in terms}
    return results


def markdown_row(args, results):
    """| exp_name | prompts (P x K at T) | accuracy (s.e.) | call rate | >= 2 calls | by terms: accuracy / call rate /
    >= 2 calls |"""
    setting = f"{args.prompts}, {results['num_prompts']} x {args.samples_per_prompt} at T {args.temperature:g}"
    by_terms = "; ".join(
        f"{t} terms: {s['accuracy']:.3f} / {s['call_rate']:.3f} / {s['multi_call_rate']:.3f}"
        for t, s in results.get("by_terms", {}).items()
    )
    cells = [args.exp_name, setting, f"{results['accuracy']:.3f} (s.e. {results['accuracy_se']:.3f})"]
    cells += [f"{results['call_rate']:.3f}", f"{results['multi_call_rate']:.3f}", by_terms or "-"]
    return "| " + " | ".join(cells) + " |"


def main(args):
    """Probe, write the folder, print the JSON and the markdown row; exit 3 outside the gate. Returns the folder."""
    check_probe_args(args)
    start = time.time()
    tokenizer = grpo_tools._load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    tools, K = grpo_tools.make_tool_format(args, tokenizer), args.samples_per_prompt
    prompts, golds, terms = probe_prompts(args, tokenizer, tools)
    accelerator = grpo_tools._make_accelerator(1, 1, args.max_grad_norm)
    set_seed(args.seed)
    sampler = grpo_tools.TurnSampler(args, accelerator, None, tokenizer)
    if sampler.llm is None:  # HF generate on the policy (with vLLM the engine loads the model itself)
        policy = grpo_tools._load_model(
            args.model_name_or_path, grpo_tools.AutoModelForCausalLM, args, tokenizer.pad_token_id
        )
        sampler.policy = policy.to(accelerator.device).eval()
    # (contexts, max_tokens) -> turns
    turn = functools.partial(sampler.turn, temperature=args.temperature, stop_strings=tools.stop_strings)
    records, samples = [], []
    for first in tqdm(range(0, len(prompts), args.chunk_prompts), desc=args.exp_name):
        chunk = range(first, min(first + args.chunk_prompts, len(prompts)))
        with sampler.awake():
            rollout = grpo_tools.multi_turn_rollout(
                turn, tokenizer, [prompts[i] for i in chunk], K, args.response_length, args.max_turns,
                sampler.stop_ids, tools,
            )  # fmt: skip
        chunk_golds = [golds[i] for i in chunk for _ in range(K)]
        _, correct, _ = tools.rewards(rollout.answers, chunk_golds, args.format_reward)
        for j, calls in enumerate(rollout.calls):
            i = chunk[j // K]
            failed = rollout.failed_calls[j]  # as the tool format reports them
            right, cut = correct[j].item(), bool(rollout.truncated[j])
            records.append(
                dict(prompt=i, terms=terms[i], correct=right, calls=len(calls), failed=failed, truncated=cut)
            )
            if len(samples) < args.num_samples_logged:
                prompt, completion = tokenizer.decode(prompts[i]), rollout.texts[j]
                samples.append(
                    dict(prompt=prompt, completion=completion, gold=golds[i], terms=terms[i], correct=right)
                )
    sampler.close()
    results = probe_results(records)
    passed = args.min_accuracy <= results["accuracy"] <= args.max_accuracy
    results["gate"] = dict(min_accuracy=args.min_accuracy, max_accuracy=args.max_accuracy, passed=passed)
    folder = write_probe(args, results, samples, time.time() - start)
    print(json.dumps(results, indent=2))
    print(markdown_row(args, results))
    if not passed:
        bounds = f"[{args.min_accuracy}, {args.max_accuracy}]"
        print(f"gate: accuracy {results['accuracy']:.4f} outside {bounds} ({folder})", file=sys.stderr)
        sys.exit(3)
    return folder


def write_probe(args, results, samples, seconds):
    """{output_dir}/{task}__{exp_name}__{seed}__{unix_time}/: probe.json, config.json (args, git sha) and a one-line
    metrics.jsonl (global_step 0) that benchmark.statistics.registry reads as a run's evaluation. Returns the
    folder."""
    task = os.path.basename(os.path.normpath(args.dataset_path))
    name = grpo_tools._new_run_folder(args.output_dir, f"{task}__{args.exp_name}__{args.seed}__{int(time.time())}")
    folder = os.path.join(args.output_dir, name)
    with open(os.path.join(folder, "probe.json"), "w") as f:
        json.dump({**results, "samples": samples}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"args": dataclasses.asdict(args), "git_sha": grpo_tools._git_sha(), "probe": True}, f, indent=2)
    names = ("accuracy", "call_rate", "multi_call_rate", "calls", "failed_calls", "truncated", "prompts_with_success")
    line = {"global_step": 0, "episode": 0, "time": seconds}
    line |= {f"{args.prompts}/{name}": results[name] for name in names}
    line |= {f"{args.prompts}/num_problems": results["num_prompts"]}
    for t, s in results.get("by_terms", {}).items():
        line |= {f"{args.prompts}/{name}_{t}_terms": s[name] for name in ("accuracy", "call_rate", "multi_call_rate")}
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write(json.dumps(line) + "\n")
    return folder


if __name__ == "__main__":
    grpo_tools._quiet_harmless_logs()
    main(tyro.cli(ProbeConfig))
