"""Where the shared-prompt (packed) forward stops paying: training time and memory, packed vs unpacked, by length.

    python -m benchmark.performance.perf_shared_prompt_length                     # R = 64, 256, 512, 1024
    python -m benchmark.performance.perf_shared_prompt_length --lengths 64 512 --layers 8

One group of 8 completions of a 48-token prompt, response lengths spread evenly over [R/2, R], SmolLM2-135M's shape
(random weights: the time does not depend on them), fp32, the policy's log-probs forward + backward, as the training
step computes them: packed (grpo_math.shared_prompt_logits forced to pack) and unpacked (response_logprobs). Each
measurement runs in its own process, packed and unpacked alternating, best of --repeats; reported per R: seconds,
the bytes autograd saved for the backward pass, the process's peak RSS (with --device cuda: the CUDA allocator's
peak, and the time of a second forward + backward after a warm-up), and whether shared_prompt_pays packs.
Results go to benchmark/results/shared_prompt_length.{json,md}.
"""

import argparse
import functools
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO_ROOT, "assets", "SmolLM2-135M-Instruct")


def batch(r, prompt_length=48, group=8, seed=0):
    """input_ids, attention_mask [group, prompt_length + r], with the responses' real lengths evenly in [r/2, r]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(r // 2, r, group).round().long()
    ids = torch.randint(3, 40000, (group, prompt_length + r), generator=g)
    ids[:, :prompt_length] = ids[0, :prompt_length]  # one prompt for the group
    mask = torch.ones_like(ids)
    mask[:, prompt_length:] = (torch.arange(r)[None] < lengths[:, None]).long()
    return ids * mask, mask, prompt_length


def measure(r, packed, layers, device="cpu", dtype="float32", config_dir=MODEL):
    """One forward + backward in this process (on CUDA a second one, timed, after a warm-up); returns seconds,
    saved bytes, peak memory and what the rule decides."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import grpo_math

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    config = AutoConfig.from_pretrained(config_dir)
    config.num_hidden_layers = layers or config.num_hidden_layers
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    ids, mask, p = (t.to(device) if torch.is_tensor(t) else t for t in batch(r))
    group = torch.zeros(len(ids), dtype=torch.long, device=device)
    pays = grpo_math._shared_prompt_pays(config, group, mask[:, p:].sum(1), p, ids.shape[1])
    grpo_math._shared_prompt_pays = lambda *a: True  # forced: the packed run measures packing whatever the rule says
    fn = (
        functools.partial(grpo_math.response_logprobs, packed=grpo_math.shared_prompt_logits)
        if packed
        else grpo_math.response_logprobs
    )
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None  # CUDA kernels run asynchronously
    for _ in range(2 if device == "cuda" else 1):
        saved[0] = 0
        sync()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs = fn(model, ids, mask, p, 1.0)[0]
        (logprobs * mask[:, p:]).sum().backward()
        sync()
        seconds = time.perf_counter() - t0
    if device == "cuda":  # reported in the RSS column: the CUDA allocator's peak
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "saved_bytes": saved[0], "peak_rss_bytes": peak, "rule_packs": bool(pays)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30; 0: the config's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    parser.add_argument("--model_config", default=MODEL, help="a folder with the model's config.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmark/results/shared_prompt_length")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # R and packed|unpacked: a single measurement
    args = parser.parse_args()
    if args.one:
        r, packed = int(args.one[0]), args.one[1] == "packed"
        print(json.dumps(measure(r, packed, args.layers, args.device, args.dtype, args.model_config)))
        return
    rows = []
    for r in args.lengths:
        runs = {"packed": [], "unpacked": []}
        for k in range(args.repeats):
            for mode in ("packed", "unpacked") if k % 2 == 0 else ("unpacked", "packed"):
                cmd = [sys.executable, "-m", "benchmark.performance.perf_shared_prompt_length", "--one", str(r), mode]
                cmd += ["--layers", str(args.layers), "--device", args.device, "--dtype", args.dtype]
                out = subprocess.run(
                    cmd + ["--model_config", args.model_config], cwd=REPO_ROOT, capture_output=True, text=True
                )
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        best = {mode: min(values, key=lambda v: v["seconds"]) for mode, values in runs.items()}
        rows.append({"R": r, **{f"{m}_{k}": v for m, b in best.items() for k, v in b.items()}})
        print(json.dumps(rows[-1]), flush=True)
    info = {
        "command": " ".join(["python -m benchmark.performance.perf_shared_prompt_length", *sys.argv[1:]]),
        "layers": args.layers,
        "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "model_config": os.path.relpath(args.model_config, REPO_ROOT),
        "torch": torch.__version__,
        "threads": int(os.environ.get("THREADS", "2")),
    }
    with open(args.out + ".json", "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    lines = [
        f"`{info['command']}` ({args.layers or 'all'} layers of {info['model_config']}'s shape, {args.dtype}, "
        f"{info['device'] if args.device == 'cuda' else str(info['threads']) + ' threads'}, "
        f"best of {args.repeats}; one group of 8 completions of a 48-token prompt, lengths evenly in [R/2, R]; "
        "forward + backward of the policy's log-probs)",
        "",
        "| R | packed s | unpacked s | unpacked / packed | saved for backward, packed / unpacked (MiB) | peak "
        f"{'CUDA memory' if args.device == 'cuda' else 'RSS'} packed / unpacked (MiB) | shared_prompt_pays packs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    mib = 2**20
    for row in rows:
        lines.append(
            f"| {row['R']} | {row['packed_seconds']:.2f} | {row['unpacked_seconds']:.2f} | "
            f"{row['unpacked_seconds'] / row['packed_seconds']:.2f}x | {row['packed_saved_bytes'] / mib:.0f} / "
            f"{row['unpacked_saved_bytes'] / mib:.0f} | {row['packed_peak_rss_bytes'] / mib:.0f} / "
            f"{row['unpacked_peak_rss_bytes'] / mib:.0f} | {'yes' if row['packed_rule_packs'] else 'no'} |"
        )
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
