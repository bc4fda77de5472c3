"""Preflight of a task for ppo_prm_clip.py: can process rewards say anything on it? (~5 min on 2 CPU cores)

    python -m benchmark.claims.prm_preflight --num_prompts 100 --out benchmark/results/prm_preflight.json  # defaults
    python -m benchmark.claims.prm_preflight --dataset_path assets/data/chain_sum --temperature 0.7 \
        --step_separator ' '

Samples `--samples` completions of `--num_prompts` held-out prompts (HF generate, ppo_prm_clip.py's prompts, stop
tokens, step splitter, answer extraction and verifier PRM; the sampling settings are the script's defaults unless
given) and the greedy completion of each, and prints: accuracy (sampled and greedy: the training reward and the
evaluation), responses ended by EOS, steps and tokens per response, and what the verifier PRM sees in them: among
wrong answers, how many have a false step, how many mix true and false steps, how many have only true ones or
nothing to check; among right answers, how many have a false step. A task the process reward can inform has
accuracy well inside (0, 1) (the issue asks for 0.15-0.6) and wrong answers whose steps the verifier can tell apart.
"""

import argparse
import collections
import json
import random

import torch
from transformers import AutoModelForCausalLM

import ppo_prm_clip as prm
from benchmark.statistics.registry import read_jsonl


def step_verdicts(text, separator):
    """The verifier's verdict on each step of a response: True (its equations hold), False (one is wrong), None
    (nothing to check)."""
    return [prm.step_arithmetic(step) for step, _ in prm._split_steps(text, separator)]


def kind_of(verdicts):
    """How a response's steps look to the verifier: "false and true steps", "false steps only", "true steps only"
    (at least one true, none false), "nothing to check"."""
    if False in verdicts:
        return "false and true steps" if True in verdicts else "false steps only"
    return "true steps only" if True in verdicts else "nothing to check"


def summarize(records):
    """Counts and fractions over records ({"correct", "eos", "steps", "tokens", "kind"})."""
    n = len(records)
    wrong = [r for r in records if not r["correct"]]
    right = [r for r in records if r["correct"]]
    kinds = collections.Counter(r["kind"] for r in wrong)
    return {
        "responses": n,
        "accuracy": sum(r["correct"] for r in records) / max(n, 1),
        "eos_fraction": sum(r["eos"] for r in records) / max(n, 1),
        "steps_per_response": sum(r["steps"] for r in records) / max(n, 1),
        "tokens_per_response": sum(r["tokens"] for r in records) / max(n, 1),
        "wrong": len(wrong),
        "wrong_by_kind": {k: round(kinds[k] / max(len(wrong), 1), 3) for k in sorted(kinds)},
        "wrong_with_a_false_step": sum(False in r["verdicts"] for r in wrong) / max(len(wrong), 1),
        "right_with_a_false_step": sum(False in r["verdicts"] for r in right) / max(len(right), 1),
    }


def sample(model, tokenizer, prompts, golds, n, temperature, args, stop_ids):
    """Records of n completions per prompt at a temperature (0: greedy)."""
    records = []
    for i in range(0, len(prompts), args.batch_size):
        batch = prompts[i : i + args.batch_size]
        responses, lengths = prm._hf_generate(
            model, batch, n, args.response_length, temperature, 1.0,
            tokenizer.pad_token_id, stop_ids,
        )  # fmt: skip
        mask = prm._response_mask(responses, lengths, stop_ids)
        for j, (response, length) in enumerate(zip(responses, lengths)):
            gold = golds[i + j // n]
            text = tokenizer.decode(response[: int(length)], skip_special_tokens=True)
            verdicts = step_verdicts(text, args.step_separator)
            records.append(
                {
                    "prompt": i + j // n,
                    "text": text,
                    "correct": bool(prm.verify_answer(prm.extract_answer(text), gold)),
                    "eos": bool(torch.isin(response[: int(length)], torch.tensor(stop_ids)).any()),
                    "steps": len(verdicts),
                    "tokens": int(mask[j].sum()),
                    "verdicts": verdicts,
                    "kind": kind_of(verdicts),
                }
            )
    return records


def main(argv=None):
    defaults = prm.Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset_path", default=defaults.dataset_path)
    parser.add_argument("--split", default=defaults.eval_split)
    parser.add_argument("--model", default=defaults.model_name_or_path)
    parser.add_argument("--num_prompts", type=int, default=100)
    parser.add_argument("--samples", type=int, default=4, help="sampled completions per prompt")
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--response_length", type=int, default=defaults.response_length)
    parser.add_argument("--step_separator", default=defaults.step_separator)
    parser.add_argument("--instruction", default=defaults.instruction)
    parser.add_argument("--batch_size", type=int, default=32, help="prompts per generate call")
    parser.add_argument("--examples", type=int, default=6, help="sampled wrong answers to print")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    config = prm.Config(instruction=args.instruction)
    tokenizer = prm._load_tokenizer(args.model, False)
    rows = read_jsonl(f"{args.dataset_path}/{args.split}.jsonl")
    rows = random.Random(args.seed).sample(rows, min(args.num_prompts, len(rows)))
    prompts, golds = prm._build_prompts(tokenizer, rows, config)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    stop_ids = prm._stop_token_ids(tokenizer, args.model)

    sampled = sample(model, tokenizer, prompts, golds, args.samples, args.temperature, args, stop_ids)
    greedy = sample(model, tokenizer, prompts, golds, 1, 0.0, args, stop_ids)
    summary = {
        "dataset_path": args.dataset_path,
        "prompts": len(prompts),
        "temperature": args.temperature,
        "response_length": args.response_length,
        "step_separator": args.step_separator,
        "sampled": summarize(sampled),
        "greedy": summarize(greedy),
    }
    print(json.dumps(summary, indent=2))
    print(f"\nsampled wrong answers (first {args.examples}), with the verifier's verdict per step:")
    for record in [r for r in sampled if not r["correct"]][: args.examples]:
        print(f"--- gold {golds[record['prompt']]}, verdicts {record['verdicts']}\n{record['text']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary, sampled


if __name__ == "__main__":
    main()
