"""What a grpo_math.py model still gets wrong on a sums task: greedy pass@1 on the held-out split, by kind of sum.

    python -m benchmark.claims.grpo_errors --models assets/SmolLM2-135M-Instruct runs/add_2t2d__grpo__[123]__*/model \
        --out benchmark/results/grpo_math_errors.md

Every model is evaluated by benchmark.peers.peer_trl's code (HF generate, greedy, grpo_math's prompt builder, answer
extraction and verifier), so on the same problems its overall accuracy is the run's own `eval/accuracy`. A problem
"Calculate a + b." falls in one kind by the digit counts of its two terms and, for two 2-digit terms, by whether
the ones digits carry.
"""

import argparse
import os
import re

from benchmark.peers.peer_trl import greedy_correct, grpo_prompts
from benchmark.statistics.registry import read_jsonl

KINDS = (
    "two 2-digit terms, no carry",
    "two 2-digit terms, carry",
    "a 1-digit and a 2-digit term",
    "two 1-digit terms",
    "other",
)


def sum_kind(question):
    """The kind of a two-term sum, e.g. "Calculate 56 + 74." -> "two 2-digit terms, carry"; "other" for anything
    that is not the sum of two non-negative terms of 1-2 digits."""
    match = re.fullmatch(r"[^\d-]*(\d+) \+ (\d+)[^\d-]*", question)
    if match is None:
        return "other"
    a, b = match.group(1), match.group(2)
    digits = sorted((len(a), len(b)))
    if digits == [2, 2]:
        return "two 2-digit terms, carry" if int(a[-1]) + int(b[-1]) >= 10 else "two 2-digit terms, no carry"
    if digits == [1, 2]:
        return "a 1-digit and a 2-digit term"
    if digits == [1, 1]:
        return "two 1-digit terms"
    return "other"


def error_table(kinds, correct_by_model):
    """Markdown table: one row per kind present (its problem count), one accuracy column per model."""
    names = list(correct_by_model)
    lines = [
        "| held-out sums | problems | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for kind in KINDS:
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if not rows:
            continue
        cells = [f"{sum(correct_by_model[name][i] for i in rows) / len(rows):.2f}" for name in names]
        lines.append(f"| {kind} | {len(rows)} | " + " | ".join(cells) + " |")
    cells = [f"{sum(c) / len(c):.3f}" for c in correct_by_model.values()]
    lines.append(f"| all | {len(kinds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="Hugging Face folders (a run's model/ folder)")
    parser.add_argument("--tokenizer", default="assets/SmolLM2-135M-Instruct", help="the tokenizer of every model")
    parser.add_argument("--dataset", default="assets/data/add_2t2d", help="a folder with test.jsonl")
    parser.add_argument("--num_eval_prompts", type=int, default=300, help="held-out problems (grpo_math's default)")
    parser.add_argument("--response_length", type=int, default=64, help="maximum completion tokens")
    parser.add_argument("--batch_size", type=int, default=64, help="prompts per greedy HF generate call")
    parser.add_argument("--out", help="also write the table to this .md file")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = read_jsonl(os.path.join(args.dataset, "test.jsonl"))[: args.num_eval_prompts]
    prompts, golds = grpo_prompts(tokenizer, rows)
    if len(prompts) != len(rows):
        raise SystemExit(f"{len(rows) - len(prompts)} prompts are longer than grpo_math's max_prompt_length")
    kinds = [sum_kind(row["question"]) for row in rows]
    correct_by_model = {}
    for model_dir in args.models:
        path = model_dir.rstrip("/")  # a run's model/ folder is named by its run folder
        name = os.path.basename(os.path.dirname(path) if os.path.basename(path) == "model" else path)
        correct_by_model[name] = greedy_correct(
            model_dir, prompts, golds, tokenizer, args.response_length, args.batch_size
        )
        print(f"{name}: {sum(correct_by_model[name]) / len(prompts):.3f}", flush=True)
    table = error_table(kinds, correct_by_model)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"Greedy pass@1 by kind of sum, {args.dataset}, first {len(rows)} held-out problems.\n\n{table}\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
