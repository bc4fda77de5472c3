"""Generation throughput: vLLM against Hugging Face generate, same model, same prompts, same lengths, one run.

    python -m benchmark.performance.perf_generation                       # the embedded model and task, CPU
    python -m benchmark.performance.perf_generation --num_prompts 64 --n 8 --response_length 256 \
        --dtype bfloat16                                                  # a GPU

Both backends sample n completions for each of the same prompts (the embedded task's held-out questions, chat
template + the scripts' instruction). Two settings, each timed --repeats times after one untimed warm-up call:
- `fixed`: EOS ignored, every completion is exactly --response_length tokens, so both backends do the same work
  (the N+ details' fixed-length generation, and the fair throughput comparison);
- `eos`: stop at EOS, as the scripts do by default; HF generate still steps the whole batch until its longest
  completion ends, which is where vLLM's continuous batching saves most.
Tokens/s counts generated tokens (up to and including EOS). HF generate runs first: the CPU build of vLLM binds
its OpenMP threads to the cores, after which torch cannot change its thread count. Results go to
benchmark/results/generation_throughput.{json,md} (with the machine, the versions and every timing).
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="assets/SmolLM2-135M-Instruct", help="a Hugging Face folder or hub id")
    parser.add_argument("--dataset", default="assets/data/arith_1d/test.jsonl", help="a JSONL file with questions")
    parser.add_argument("--question_column", default="question", help="the column with the prompt text")
    parser.add_argument("--instruction", default="Give only the final answer after 'Answer:'.", help="appended")
    parser.add_argument("--num_prompts", type=int, default=8, help="distinct prompts")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--response_length", type=int, default=64, help="maximum new tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="both backends")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per backend and setting")
    parser.add_argument("--seed", type=int, default=1, help="sampling seed")
    parser.add_argument("--settings", nargs="+", default=["fixed", "eos"], choices=["fixed", "eos"], help="see above")
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"], help="to measure")
    parser.add_argument("--out", default="benchmark/results/generation_throughput", help="path without extension")
    return parser.parse_args(argv)


def load_prompts(tokenizer, path, column, instruction, num_prompts):
    """Token ids of the first num_prompts questions, through the chat template (as the scripts build them)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:num_prompts]
    if len(rows) < num_prompts:
        raise SystemExit(f"error: --dataset {path} has {len(rows)} rows; --num_prompts asks for {num_prompts}")
    prompts = []
    for row in rows:
        messages = [{"role": "user", "content": f"{row[column]} {instruction}".strip()}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def generated_tokens(token_ids, eos_token_id, stop_at_eos):
    """Tokens a completion really produced: up to and including its first EOS when generation stops there."""
    if stop_at_eos and eos_token_id in token_ids:
        return token_ids.index(eos_token_id) + 1
    return len(token_ids)


def time_hf(args, model, tokenizer, prompts, stop_at_eos):
    """[(seconds, tokens)] of --repeats calls of HF generate on the whole batch (one untimed warm-up first)."""
    width = max(map(len, prompts))
    batch = [p for p in prompts for _ in range(args.n)]
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    config = GenerationConfig(
        max_new_tokens=args.response_length,
        min_new_tokens=0 if stop_at_eos else args.response_length,
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id if stop_at_eos else [],
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    timings = []
    for call in range(args.repeats + 1):
        torch.manual_seed(args.seed + call)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        seconds = time.perf_counter() - t0
        tokens = sum(generated_tokens(row.tolist(), tokenizer.eos_token_id, stop_at_eos) for row in out[:, width:])
        if call > 0:
            timings.append((seconds, tokens))
    return timings


def time_vllm(args, llm, prompts, stop_at_eos, eos_token_id):
    """[(seconds, tokens)] of --repeats calls of vLLM on the same prompts (one untimed warm-up first)."""
    from vllm import SamplingParams

    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=1.0, max_tokens=args.response_length, ignore_eos=not stop_at_eos
    )
    requests = [{"prompt_token_ids": p} for p in prompts]
    timings = []
    for call in range(args.repeats + 1):
        t0 = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(
            generated_tokens(list(c.token_ids), eos_token_id, stop_at_eos) for o in outputs for c in o.outputs
        )
        if call > 0:
            timings.append((seconds, tokens))
    return timings


def summary(timings):
    rates = [tokens / seconds for seconds, tokens in timings]
    return {
        "tokens_per_second_median": statistics.median(rates),
        "tokens_per_second_min": min(rates),
        "tokens_per_second_max": max(rates),
        "seconds": [s for s, _ in timings],
        "tokens": [t for _, t in timings],
    }


def main(args):
    os.chdir(REPO_ROOT)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(tokenizer, args.dataset, args.question_column, args.instruction, args.num_prompts)
    results = {}
    if "hf" in args.backends:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        for setting in args.settings:
            results[f"hf/{setting}"] = summary(time_hf(args, model, tokenizer, prompts, setting == "eos"))
            print(f"hf generate, {setting}: {results[f'hf/{setting}']['tokens_per_second_median']:.1f} tokens/s")
        del model  # its memory goes back before the vLLM engine takes its share
    if "vllm" in args.backends:
        if not torch.cuda.is_available():  # the CPU build: an in-process engine on all of this machine's cores
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            seed=args.seed,
            enforce_eager=True,
            max_model_len=max(map(len, prompts)) + args.response_length,
            gpu_memory_utilization=0.5,
            distributed_executor_backend="uni",
        )
        results["vllm/startup_seconds"] = time.perf_counter() - t0
        for setting in args.settings:
            results[f"vllm/{setting}"] = summary(
                time_vllm(args, llm, prompts, setting == "eos", tokenizer.eos_token_id)
            )
            print(f"vllm, {setting}: {results[f'vllm/{setting}']['tokens_per_second_median']:.1f} tokens/s")
        llm.llm_engine.engine_core.shutdown()

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import vllm

        versions["vllm"] = vllm.__version__
    except ImportError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    record = {
        "args": vars(args),
        "machine": {"device": device, "platform": platform.platform(), **versions},
        "results": results,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(record, f, indent=2)
    lines = [
        f"Generation throughput, {args.num_prompts} prompts x {args.n} completions, up to {args.response_length} new "
        f"tokens, T = {args.temperature}, {args.dtype}, {args.model}; {device}; median (min-max) of {args.repeats} "
        "calls after a warm-up.",
        "",
        "| setting | HF generate tokens/s | vLLM tokens/s | vLLM / HF generate |",
        "| --- | --- | --- | --- |",
    ]
    for setting in args.settings:
        cells = []
        for backend in ("hf", "vllm"):
            r = results.get(f"{backend}/{setting}")
            low, high = (r["tokens_per_second_min"], r["tokens_per_second_max"]) if r else (0, 0)
            cells.append(f"{r['tokens_per_second_median']:.1f} ({low:.1f}-{high:.1f})" if r else "-")
        both = f"hf/{setting}" in results and f"vllm/{setting}" in results
        ratio = (
            results[f"vllm/{setting}"]["tokens_per_second_median"]
            / results[f"hf/{setting}"]["tokens_per_second_median"]
            if both
            else None
        )
        name = "fixed length (EOS ignored)" if setting == "fixed" else "stop at EOS"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {f'**{ratio:.2f}x**' if ratio else '-'} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return record


if __name__ == "__main__":
    main(parse_args())
