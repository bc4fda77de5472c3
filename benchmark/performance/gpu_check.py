"""The GPU check of benchmark/gpu_check.sh (docs/launch_paths.md, "On a GPU"): random Qwen2-shaped models with the
embedded SmolLM2 tokenizer, the first-step invariants of each run, and a script's CUDA peak memory.

    python -m benchmark.performance.gpu_check build DIR TOKENIZER_DIR [1|0]  # the models (1: the 1.5B one too) and
                                                                             #   a preference set
    python -m benchmark.performance.gpu_check peak JSON SCRIPT [ARGS...]     # runs SCRIPT, its CUDA peak to JSON
    python -m benchmark.performance.gpu_check summary RUNS_DIR               # a Markdown table of each run there
"""

import glob
import json
import os
import random
import runpy
import sys

import torch

# Qwen2.5-0.5B-Instruct's layer shape (hidden 896, 14 heads, 2 KV heads, biased q/k/v, tied embeddings) with 4
# layers, and Qwen2.5-Math-1.5B-Instruct's (benchmark/configs/qwen2.5-1.5b) with all 28: both with SmolLM2's
# vocabulary, so the embedded tokenizer decodes every sampled token.
SMALL = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14)
SMALL.update(num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True)
LARGE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
LARGE.update(num_key_value_heads=2, rope_theta=1e4, max_position_embeddings=4096, tie_word_embeddings=True)
# The sampling fields of Qwen2.5-*-Instruct's generation_config.json: HF generate must apply none of them.
CHECKPOINT_SAMPLING = dict(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20)


def build(root, tokenizer_dir, large="1"):
    import accelerate
    import transformers
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    ids.update(pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
    window = dict(use_sliding_window=True, sliding_window=32, max_window_layers=0)  # every layer slides
    models = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SMALL, **ids), torch.float32),
        "qwen2-window32": (Qwen2ForCausalLM, Qwen2Config(**SMALL, **ids, **window), torch.float32),
        "qwen2-reward": (Qwen2ForSequenceClassification, Qwen2Config(**SMALL, **ids, num_labels=1), torch.float32),
    }
    if large == "1":
        models["qwen2-1.5b"] = (Qwen2ForCausalLM, Qwen2Config(**LARGE, **ids), torch.bfloat16)
    for seed, (name, (cls, config, dtype)) in enumerate(models.items()):
        torch.manual_seed(seed)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = cls(config).to(dtype)
        if cls is Qwen2ForSequenceClassification:
            model.config.bias = 0.0  # as reward_modeling.py saves a reward model
        else:
            model.generation_config = GenerationConfig(**CHECKPOINT_SAMPLING, **ids)
        model.save_pretrained(os.path.join(root, name))
        tokenizer.save_pretrained(os.path.join(root, name))
    rng = random.Random(0)  # a preference dataset whose chosen responses end in " good", rejected in " bad"
    os.makedirs(os.path.join(root, "preferences"), exist_ok=True)
    for split, n in (("train", 64), ("test", 32)):
        with open(os.path.join(root, "preferences", f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                filler = " ".join(rng.choice(["apple", "river", "stone", "cloud"]) for _ in range(rng.randint(2, 6)))
                row = {"prompt": f"What is {rng.randint(0, 9)} + {rng.randint(0, 9)}? ", "chosen": filler + " good"}
                f.write(json.dumps({**row, "rejected": filler + " bad"}) + "\n")


def peak(path, script, *args):
    """Runs SCRIPT with ARGS in this process (as `python SCRIPT ARGS` would) and writes torch's CUDA peak."""
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        gib = {k: getattr(torch.cuda, k)() / 2**30 for k in ("max_memory_allocated", "max_memory_reserved")}
        with open(path, "w") as f:
            json.dump({"command": " ".join(sys.argv), **gib}, f)


FIRST_STEP = ("objective/kl", "policy/ratio_first_minibatch", "policy/approxkl_first_minibatch", "policy/grad_norm")


def summary(runs_dir):
    print("| run | steps | step 1: " + " | ".join(FIRST_STEP) + " | s / step (after step 1) | last eval |")
    print("|" + " --- |" * (len(FIRST_STEP) + 4))
    for path in sorted(glob.glob(os.path.join(runs_dir, "**", "metrics.jsonl"), recursive=True)):
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        train = [line for line in lines if line["global_step"] > 0 and "lr" in line]
        evals = [line for line in lines if any(k.startswith("eval/") for k in line)]
        first = train[0] if train else {}
        first.setdefault("policy/grad_norm", first.get("objective/grad_norm"))  # reward_modeling logs the latter
        cells = [f"{first[k]:.6g}" if first.get(k) is not None else "-" for k in FIRST_STEP]
        per_step = (train[-1]["time"] - train[0]["time"]) / (len(train) - 1) if len(train) > 1 else float("nan")
        last = {k: round(v, 4) for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval/")}
        name = os.path.relpath(os.path.dirname(path), runs_dir)
        print(f"| {name} | {len(train)} | " + " | ".join(cells) + f" | {per_step:.2f} | {last} |")


if __name__ == "__main__":
    commands = {"build": build, "peak": peak, "summary": summary}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    commands[sys.argv[1]](*sys.argv[2:])
