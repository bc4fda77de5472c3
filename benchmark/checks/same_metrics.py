"""Same numbers before and after a refactor: every script on the tiny model, each configuration's metrics recorded.

    python -m benchmark.checks.same_metrics record DIR             # every configuration from this checkout into DIR
    python -m benchmark.checks.same_metrics record DIR --only grpo  # the configurations whose name contains 'grpo'
    python -m benchmark.checks.same_metrics compare BEFORE AFTER    # every logged value equal (time/, perf/ aside)?
    python -m benchmark.checks.same_metrics record DIR --real       # steps 0-3 of each script on the embedded model

Record once on the commit before a change (a `git worktree` of it, with this file copied in if it is older) and once
after; compare exits 1 on the first difference it lists. The configurations cover what a refactor of the loop or the
kit can break: several epochs, minibatches and micro-batches, a reference model, temperature below 1, dynamic
sampling, the token-mean and sequence-mean losses, online DPO and PPO with a reward model, the PRM, reward model
training and async_rlhf (off-policy and --sync). Each run is a subprocess on one thread (tests/conftest.py's
environment) with the tiny random Llama and the tasks the tests use; a run also writes the sha256 of its final model's
weights, so a change in what is saved shows too. About 5 minutes on 2 cores. --real runs REAL instead: three steps of
each script at its defaults on the embedded SmolLM2 and tasks (`make assets`), HF generate, one thread, samples.jsonl
compared too (about an hour).
"""

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
import conftest  # noqa: E402  (sets the cache folders and one thread, as for the tests)

FAST = dict(num_eval_prompts=4, vllm=False, save_every=0, max_prompt_length=256, total_steps=2)
GRPO = dict(FAST, response_length=12, prompts_per_rank=2, num_generations=4, micro_batch_size=4)
RM = "{reward_model}"  # filled in with the tiny reward model's folder
JUDGED = dict(FAST, response_length=8, prompts_per_rank=4, micro_batch_size=2, reward_model_path=RM)
ASYNC = dict(JUDGED, total_steps=3, learning_rate=1e-3, missing_eos_penalty=None)
PPO = dict(FAST, response_length=12, prompts_per_rank=8, micro_batch_size=4, num_minibatches=2, num_ppo_epochs=2)
PAIRS = dict(pairs_per_rank=8, micro_batch_size=4, learning_rate=1e-3, eval_batch_size=16, response_length=8)
CONFIGS = {  # name: (script, flags)
    "grpo_math": ("grpo_math", dict(GRPO, beta=0.0)),
    "grpo_math_epochs": (
        "grpo_math",
        dict(GRPO, beta=0.04, num_iterations=2, num_minibatches=2, micro_batch_size=2, temperature=0.7),
    ),
    "grpo_math_dapo": (
        "grpo_math",
        dict(GRPO, oversample=2, scale_rewards="batch", loss_type="seq_mean_token_mean", shared_prompt=False),
    ),
    "grpo_math_gspo": ("grpo_math", dict(GRPO, importance_sampling_level="sequence", num_iterations=2)),
    "grpo_tools": ("grpo_tools", dict(GRPO, response_length=40, max_turns=2, beta=0.04, num_iterations=2)),
    "grpo_tools_native": (
        "grpo_tools",
        dict(GRPO, tool_format="native", environment="price_list_one", response_length=32, max_prompt_length=768),
    ),
    "dpo_online": ("dpo_online", JUDGED),
    "ppo_rlhf": ("ppo_rlhf", dict(PPO, missing_eos_penalty=None, reward_model_path=RM, temperature=0.7)),
    "ppo_prm_clip": ("ppo_prm_clip", dict(PPO, num_ppo_epochs=1, step_separator=" ", kl_coef=0.0)),
    "reward_modeling": (
        "reward_modeling",
        dict(
            PAIRS,
            vllm=False,
            num_train_epochs=2.0,
            max_prompt_length=128,
            dataset_path="{preferences}",
            reward_model_dir="{out}/reward_model",
        ),
    ),  # fmt: skip
    "async_rlhf": ("async_rlhf", ASYNC),
    "async_rlhf_sync_rloo": ("async_rlhf", dict(ASYNC, sync=True, loss="rloo")),
}
REAL_STEPS = dict(total_steps=3, vllm=False, num_eval_prompts=8, save_every=0)
PRICE_LIST_ONE = dict(tool_format="native", environment="price_list_one", dataset_path="assets/data/price_list_one")
REAL = {  # name: (script, flags): each script at its defaults on the embedded model, steps 0-3
    "grpo_math": ("grpo_math", REAL_STEPS),
    "grpo_tools": ("grpo_tools", REAL_STEPS),
    "grpo_tools_native_price_list_one": ("grpo_tools", dict(REAL_STEPS, **PRICE_LIST_ONE)),
    "ppo_prm_clip_verifier": ("ppo_prm_clip", dict(REAL_STEPS, prm="verifier")),
    "reward_modeling_prm": (
        "reward_modeling",
        dict(prm=True, vllm=False, num_train_prompts=16, num_eval_prompts=8, prm_dir="{out}/prm", save_every=0),
    ),
    "ppo_rlhf": ("ppo_rlhf", REAL_STEPS),
    "dpo_online": ("dpo_online", REAL_STEPS),
    "async_rlhf": ("async_rlhf", REAL_STEPS),
}


def assets(folder):
    """The tiny model, its reward model, the addition task and the good/bad preference pairs, built once."""
    paths = {name: os.path.join(folder, name) for name in ("model", "reward_model", "task", "preferences")}
    if not os.path.isdir(paths["model"]):
        conftest.build_tiny_model(paths["model"])
        conftest.build_tiny_reward_model(paths["model"], paths["reward_model"])
        conftest.write_task(paths["task"])
        conftest.write_preferences(paths["preferences"])
    return paths


def record(out, only="", real=False):
    out = os.path.abspath(out)
    paths = {} if real else assets(os.path.join(out, "assets"))
    for name, (script, values) in (REAL if real else CONFIGS).items():
        if only not in name:
            continue
        folder = os.path.join(out, name)
        if not real:
            values = {"model_name_or_path": paths["model"], "dataset_path": paths["task"], **values}
        values |= {"output_dir": os.path.join(folder, "runs"), "seed": 1}
        fill = dict(reward_model=paths.get("reward_model"), preferences=paths.get("preferences"), out=folder)
        values = {k: v.format(**fill) if isinstance(v, str) else v for k, v in values.items()}
        done = subprocess.run(
            [sys.executable, f"{script}.py", *conftest.cli_flags(values)], cwd=REPO_ROOT, capture_output=True
        )
        if done.returncode:
            print(done.stderr.decode()[-3000:])
            raise SystemExit(f"{name}: exit {done.returncode}")
        (run_dir,) = glob.glob(os.path.join(folder, "runs", "*", "metrics.jsonl"))
        lines = conftest.without_timing(conftest.read_metrics(os.path.dirname(run_dir)))
        samples = os.path.join(os.path.dirname(run_dir), "samples.jsonl")
        if os.path.isfile(samples):  # the texts sampled and their rewards, line by line
            lines += [json.loads(line) for line in open(samples)]
        weights = sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True))
        sums = {os.path.relpath(w, folder).split(os.sep, 2)[-1]: sha256(w) for w in weights}
        with open(os.path.join(folder, "same_metrics.json"), "w") as f:
            json.dump({"metrics": lines, "weights": sums}, f, indent=1)
        print(f"{name}: {len(lines)} lines, {sum(len(line) for line in lines)} values, {len(sums)} weight files")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def compare(before, after):
    differences, values = 0, 0
    for name in {**CONFIGS, **REAL}:
        paths = [os.path.join(folder, name, "same_metrics.json") for folder in (before, after)]
        if not all(os.path.isfile(p) for p in paths):
            continue
        a, b = (json.load(open(p)) for p in paths)
        if len(a["metrics"]) != len(b["metrics"]):
            print(f"{name}: {len(a['metrics'])} lines before, {len(b['metrics'])} after")
            differences += 1
        for i, (x, y) in enumerate(zip(a["metrics"], b["metrics"])):
            for key in sorted(set(x) | set(y)):
                values += 1
                if x.get(key) != y.get(key) and not (x.get(key) != x.get(key) and y.get(key) != y.get(key)):  # NaN
                    print(f"{name} line {i} {key}: {x.get(key)} -> {y.get(key)}")
                    differences += 1
        if a["weights"] != b["weights"]:
            print(f"{name}: saved weights differ")
            differences += 1
    print(f"{values} values compared, {differences} differences")
    return differences


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("record", "compare"))
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--only", default="")
    parser.add_argument("--real", action="store_true", help="REAL: steps 0-3 of each script on the embedded model")
    args = parser.parse_args()
    if args.command == "record":
        record(args.folders[0], args.only, args.real)
    else:
        sys.exit(1 if compare(*args.folders[:2]) else 0)
