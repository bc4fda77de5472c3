"""Which CPU setting makes a training step bit-identical from run to run, and what it costs.

The scripts' CPU runs with 2 threads were not always bit-identical (docs/launch_paths.md): one run in four differed
by a float32 ulp in a grad norm. The suspect is MKL, which picks a kernel path by buffer alignment and thread
timing unless its Conditional Numerical Reproducibility mode is set (MKL_CBWR, read once when MKL starts). This runs
the policy's forward and backward on one fixed batch many times in fresh processes, moving the allocator between
repeats (buffers land at other addresses, as they do between real runs), and counts the distinct results
(loss and every gradient, bit for bit) under each setting, and the time a repeat takes.

    python -m benchmark.performance.determinism          # the embedded model, writes benchmark/results/determinism.md
    python -m benchmark.performance.determinism --repeats 6 --processes 3 --variants default MKL_CBWR=AUTO,STRICT

With --runs K it runs the script itself K times per setting instead (`RUN` below, HF generate, 2 threads) and
compares the metrics.jsonl files without their wall-clock keys: the first step and metric where two runs differ.
    python -m benchmark.performance.determinism --runs 4 --variants default MKL_CBWR=AUTO,STRICT \
        --out benchmark/results/determinism_runs.md
"""

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time

VARIANTS = {
    "default": {},
    "MKL_CBWR=AUTO,STRICT": {"MKL_CBWR": "AUTO,STRICT"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL_DYNAMIC=FALSE": {"MKL_DYNAMIC": "FALSE"},
    "1 thread": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
}


def worker(model_path, repeats, batch, length, seed):
    """Forward + backward of the same batch `repeats` times; one line of JSON: the digest of each repeat, seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 20000, (batch, length), generator=g)
    pads = torch.randint(0, length // 4, (batch,), generator=g)  # left padding, as the scripts' prompts have
    mask = (torch.arange(length)[None] >= pads[:, None]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    digests, seconds, ballast = [], [], []
    rng = torch.Generator().manual_seed(seed)  # a different allocation pattern in every process
    for _ in range(repeats):
        ballast.append(torch.empty(int(torch.randint(1, 1 << 20, (1,), generator=rng))))  # moves the next buffers
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        seconds.append(time.perf_counter() - t0)
        h = hashlib.sha256(loss.detach().numpy().tobytes())
        for p in model.parameters():
            h.update(p.grad.numpy().tobytes())
        digests.append(h.hexdigest()[:16])
    print(json.dumps({"digests": digests, "seconds": seconds, "threads": torch.get_num_threads()}))


RUN = "grpo_math.py --no-vllm --total_steps 4 --eval_every 0 --num_eval_prompts 16 --save_every 0 --seed 1"
TIMING = ("time", "time/", "perf/")


def script_runs(variants, runs, out, load):
    """RUN `runs` times under each setting, one at a time; a table of the distinct trajectories and the first
    difference, and the median wall-clock seconds of a step."""
    import tempfile

    lines = [
        "# Bit-identical reruns of the script: `python -m benchmark.performance.determinism "
        f"--runs {runs} --load {load} --variants {shlex.join(variants)}`",
        "",
        f"`{RUN}` (threads: torch's default, 2 on the 2-core hosts), {runs} runs per setting, one at a time, "
        f"{load} busy processes beside them; each "
        "run's metrics.jsonl without its wall-clock keys (time, time/*, perf/*) compared with the first run's.",
        "",
        "| setting | runs | distinct trajectories | first difference (run: step, metric, values) | median s / step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in variants:
        trajectories, step_seconds = [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as output_dir:
                command = [sys.executable, *RUN.split(), "--output_dir", output_dir]
                subprocess.run(command, env={**os.environ, **VARIANTS[name]}, check=True, capture_output=True)
                (run_dir,) = os.listdir(output_dir)
                with open(os.path.join(output_dir, run_dir, "metrics.jsonl")) as f:
                    rows = [json.loads(line) for line in f if line.strip()]
            step_seconds += [row["time/step"] for row in rows if "time/step" in row]
            trajectories.append([{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows])
        first = "none"
        for i, other in enumerate(trajectories[1:], 2):
            diffs = [
                (a["global_step"], k, a[k], b.get(k))
                for a, b in zip(trajectories[0], other)
                for k in a
                if a[k] != b.get(k)
            ]
            if diffs and first == "none":
                step, key, a, b = diffs[0]
                first = f"run {i}: step {step}, {key}, {a!r} vs {b!r}"
        distinct = len({json.dumps(t, sort_keys=True) for t in trajectories})
        median = sorted(step_seconds)[len(step_seconds) // 2]
        lines.append(f"| {name} | {runs} | {distinct} | {first} | {median:.1f} |")
        print(lines[-1], flush=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="assets/SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=8, help="forward + backward passes per process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per setting, one after another")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default="benchmark/results/determinism.md")
    parser.add_argument("--runs", type=int, default=0, help="run the script itself this many times per setting")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the measurement (other work)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.model, args.repeats, args.batch, args.length, args.worker)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        if args.runs:
            return script_runs(args.variants, args.runs, args.out, args.load)
        return passes(args)
    finally:
        for process in busy:
            process.kill()


def passes(args):
    rows = []
    for name in args.variants:
        env = {**os.environ, **VARIANTS[name]}
        results = []
        for process in range(args.processes):
            command = [
                sys.executable,
                "-m",
                "benchmark.performance.determinism",
                "--worker",
                str(process),
                "--model",
                args.model,
            ]
            command += ["--repeats", str(args.repeats), "--batch", str(args.batch), "--length", str(args.length)]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
        digests = [d for r in results for d in r["digests"]]
        seconds = sorted(s for r in results for s in r["seconds"][1:])  # the first repeat warms up
        rows.append((name, results[0]["threads"], len(digests), len(set(digests)), seconds[len(seconds) // 2]))
        print(f"{name}: {len(set(digests))} distinct of {len(digests)}, median {rows[-1][-1]:.3f} s", flush=True)
    base = rows[0][-1]
    lines = [
        f"# Bit-identical reruns on CPU: `python -m benchmark.performance.determinism --repeats {args.repeats} "
        f"--processes {args.processes} --batch {args.batch} --length {args.length} --load {args.load}`",
        "",
        f"Forward + backward of {args.model} (fp32) on one fixed [{args.batch}, {args.length}] batch, {args.repeats} "
        f"times in each of {args.processes} fresh processes per setting, {args.load} busy processes beside them; "
        "distinct = distinct (loss, every gradient) "
        "bit for bit. Time: median seconds a pass (first pass of a process left out), and its ratio to the first row.",
        "",
        "| setting | threads | passes | distinct results | median s / pass | time ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {n} | {t} | {k} | {d} | {s:.3f} | {s / base:.2f} |" for n, t, k, d, s in rows]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
