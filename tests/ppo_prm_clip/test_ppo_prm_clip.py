"""ppo_prm_clip.py: the Clip / Delta refinement, the per-token rewards with process rewards and the micro-batch loss
against float64 loops, step splitting, rewards on the right tokens, the verifier PRM, end-to-end tiny runs of every
reward mode and PRM kind, and bad input."""

import functools
import importlib
import inspect
import json
import math
import os
import random
import shutil
import subprocess
import sys

import fixed_rollout
import pytest
import torch
import tyro
from conftest import (
    REPO_ROOT,
    NoModelLoads,
    one_line_error,
    only_run_dir,
    read_metrics,
    subprocess_env,
    train_lines,
    without_timing,
)

import ppo_prm_clip as prm

MODES = ("none", "raw", "clip", "delta", "clip_delta")


# refine_process_rewards against loops written from the definitions


def reference_rewards(scores, mode, eta):
    """The step rewards of SPEC.md, one step at a time in Python floats."""
    p = [float(s) for s in scores]
    if mode == "none":
        return [0.0] * len(p)
    if mode == "raw":
        return p
    clipped = [min(s - eta, 0.0) for s in p]
    if mode == "clip":
        return clipped
    values = clipped if mode == "clip_delta" else p
    return [values[k] - values[k + 1] if k + 1 < len(values) else values[k] for k in range(len(values))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_refine_matches_the_definition(mode, seed):
    g = torch.Generator().manual_seed(seed)
    num_steps = [1, 2, 3, 5, 9, 17][seed]
    scores = torch.rand(num_steps, generator=g, dtype=torch.float64)
    eta = float(torch.rand(1, generator=g, dtype=torch.float64))
    rewards = prm.refine_process_rewards(scores, mode, eta)
    assert rewards.shape == scores.shape and rewards.dtype == torch.float64
    expected = torch.tensor(reference_rewards(scores.tolist(), mode, eta), dtype=torch.float64)
    torch.testing.assert_close(rewards, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(scores, scores.clone())  # the input is not modified in place


@pytest.mark.parametrize("mode", MODES)
def test_refine_with_every_score_above_or_below_eta(mode):
    above, below, eta = torch.tensor([0.9, 0.7, 1.0, 0.6], dtype=torch.float64), torch.tensor([0.1, 0.3, 0.0]), 0.5
    for scores in (above, below.double()):
        expected = torch.tensor(reference_rewards(scores.tolist(), mode, eta), dtype=torch.float64)
        torch.testing.assert_close(prm.refine_process_rewards(scores, mode, eta), expected, rtol=1e-12, atol=1e-12)
    if mode in ("clip", "clip_delta"):
        assert (prm.refine_process_rewards(above, mode, eta) == 0).all()  # nothing to penalise, nothing paid
        torch.testing.assert_close(prm.refine_process_rewards(below.double(), "clip", eta), below.double() - eta)


def test_one_step_gets_its_own_score_in_every_mode_but_clip():
    scores = torch.tensor([0.8], dtype=torch.float64)
    for mode, expected in (("raw", 0.8), ("delta", 0.8), ("clip", 0.0), ("clip_delta", 0.0), ("none", 0.0)):
        assert prm.refine_process_rewards(scores, mode, 0.5).tolist() == pytest.approx([expected])
    assert prm.refine_process_rewards(torch.tensor([0.2], dtype=torch.float64), "clip_delta", 0.5).item() == (
        pytest.approx(-0.3)
    )


@pytest.mark.parametrize("seed", range(5))
def test_delta_rewards_to_go_are_the_scores(seed):
    """Delta: sum_{j >= k} r_j = p_k for every k (Clip-Delta: the clipped p_k), so any number of extra steps after
    step k changes nothing about the return from k: the return is bounded by max p."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(3 + 4 * seed, generator=g, dtype=torch.float64)
    for mode, values in (("delta", scores), ("clip_delta", torch.clamp(scores - 0.4, max=0))):
        rewards = prm.refine_process_rewards(scores, mode, 0.4)
        to_go = rewards.flip(0).cumsum(0).flip(0)
        torch.testing.assert_close(to_go, values, rtol=1e-12, atol=1e-12)
    # Raw grows with every correct step: the hack the paper found.
    assert prm.refine_process_rewards(torch.ones(10), "raw", 0.5).sum() == 10


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="reward_mode"):
        prm.refine_process_rewards(torch.ones(3), "sqrt", 0.5)


# Steps and their spans


def check_spans(text, steps):
    for step, (start, end) in steps:
        assert text[start:end] == step and step == step.strip() and step
    starts = [start for _, (start, _) in steps]
    assert starts == sorted(starts)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2 + 3 = 5\n\n5 - 1 = 4\n\nAnswer: 4", ["2 + 3 = 5", "5 - 1 = 4", "Answer: 4"]),
        ("\n\nfirst\n\nsecond\n\n", ["first", "second"]),  # separators at the start and the end
        ("a\n\n\n\n\n\nb", ["a", "b"]),  # runs of separators: empty steps are not steps
        ("a\n\n   \n\nb\n\n \t ", ["a", "b"]),  # whitespace-only steps neither
        ("a\n\n\nb", ["a", "b"]),  # three newlines: the left-over one is stripped
        ("no separator here, 1 + 1 = 2", ["no separator here, 1 + 1 = 2"]),
        ("  padded step  ", ["padded step"]),
        ("", []),
        ("\n\n\n\n", []),
        ("line one\nline two\n\nnext", ["line one\nline two", "next"]),
    ],
)
def test_split_steps(text, expected):
    steps = prm._split_steps(text, "\n\n")
    assert [s for s, _ in steps] == expected
    check_spans(text, steps)


def test_split_steps_with_another_separator():
    text = "1 + 1 = 2\n2 + 2 = 4\n\nAnswer: 4\n"
    steps = prm._split_steps(text, "\n")
    assert [s for s, _ in steps] == ["1 + 1 = 2", "2 + 2 = 4", "Answer: 4"]
    check_spans(text, steps)
    assert [s for s, _ in prm._split_steps("a ## b ## ## c", "##")] == ["a", "b", "c"]


@pytest.mark.parametrize("seed", range(10))
def test_split_steps_on_random_texts(seed):
    """Every non-blank character is in exactly one step, and no step holds a separator."""
    rng = random.Random(seed)
    pieces = [rng.choice(["1 + 2 = 3", "ok", "", " ", "\n", "x\ny", "Answer: 3"]) for _ in range(rng.randint(0, 8))]
    text = "\n\n".join(pieces)
    steps = prm._split_steps(text, "\n\n")
    check_spans(text, steps)
    inside = [i for _, (start, end) in steps for i in range(start, end)]
    assert len(inside) == len(set(inside))
    assert {i for i, c in enumerate(text) if not c.isspace()} <= set(inside)
    assert all("\n\n" not in step for step, _ in steps)
    assert len(steps) == sum(1 for p in text.split("\n\n") if p.strip())


# Rewards on the right tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


TEXTS = [
    "To calculate 9 * 1:\n\n1. 9 * 1 = 9\n\nSo, the answer is 9.",
    "Step one.\n\nStep two:\n\n3 + 4 = 7 \n\nAnswer: 7",
    "\n\nleading blank\n\n\n\ntrailing\n\n",
    "no steps at all, 5 - 2 = 3",
    "x)\n\nb\n\n\n12 × 3 = 36. Done.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_step_rewards_land_on_the_token_holding_the_last_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    # An independent map from characters to tokens: the fast tokenizer's offsets (the ids re-tokenize the same).
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    steps = prm._split_steps(text, "\n\n")
    ends = prm._token_char_ends(tokenizer, ids)
    assert len(ends) == len(ids) and ends[-1] == len(text)  # the EOS adds no text
    tokens = prm._step_token_indices(ends, [span for _, span in steps])
    for (step, (_start, end)), t in zip(steps, tokens):
        token_start, token_end = offsets[t]
        assert token_start <= end - 1 < token_end, (step, tokenizer.convert_ids_to_tokens([ids[t]]))
    # Rewards placed on those tokens, for a batch of two right-padded responses (the second with no step).
    step_rewards = [torch.arange(1.0, len(steps) + 1), torch.zeros(0)]
    placed = prm.place_process_rewards(step_rewards, [tokens, []], len(ids) + 3)
    assert placed.shape == (2, len(ids) + 3)
    expected = torch.zeros(len(ids) + 3)
    for k, t in enumerate(tokens):
        expected[t] += k + 1
    torch.testing.assert_close(placed[0], expected)
    assert (placed[1] == 0).all()


def test_two_steps_ending_in_one_token_add_up():
    placed = prm.place_process_rewards([torch.tensor([0.25, 0.5, -1.0])], [[3, 3, 5]], 6)
    assert placed.tolist() == [[0, 0, 0, 0.75, 0, -1.0]]


# The per-token rewards and the loss of ppo_prm_clip, against float64 loops (the shared PPO pieces have their own
# reference tests in tests/ppo_rlhf/test_ppo_rlhf.py: these test what the process rewards and the loss's assembly add)


def right_padded_mask(lengths, width):
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).double()


@pytest.mark.parametrize("seed", range(4))
def test_per_token_rewards_with_process_rewards_match_a_loop(seed):
    """Each token: -kl_coef * kl + its process reward; the last real token also the success. A step that ends on
    the last real token adds to the success there."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lengths, width, kl_coef = [rng.randint(1, 9) for _ in range(5)], 9, rng.random()
    mask = right_padded_mask(lengths, width)
    kl = torch.randn(5, width, generator=g, dtype=torch.float64) * mask
    scores = torch.rand(5, generator=g, dtype=torch.float64)
    step_tokens = [sorted(rng.sample(range(n), rng.randint(0, n))) for n in lengths]
    step_tokens[0] = [lengths[0] - 1]  # a step on the last real token
    # float32 values: place_process_rewards returns float32
    step_rewards = [torch.randn(len(t), generator=g).double() for t in step_tokens]
    process = prm.place_process_rewards(step_rewards, step_tokens, width).double()
    rewards, _ = prm.per_token_rewards(kl, scores, mask, kl_coef, process)
    expected = [[-kl_coef * float(kl[i, t]) for t in range(width)] for i in range(5)]
    for i in range(5):
        for t, r in zip(step_tokens[i], step_rewards[i].tolist()):
            expected[i][t] += r
        expected[i][lengths[i] - 1] += float(scores[i])
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # Return from the first token: KL penalties + every step's reward + the success (gamma = 1).
    total = -kl_coef * kl.sum(1) + torch.stack([r.sum() for r in step_rewards]) + scores
    torch.testing.assert_close(rewards.sum(1), total, rtol=1e-12, atol=1e-12)


def reference_loss(
    logprobs, logits, values, old_logprobs, old_values, advantages, returns, sampler_logprobs, mask, args, n
):
    """ppo_prm_loss one token at a time in Python floats: (policy sum + vf_coef * value sum) / n, and the mean entropy
    of softmax(logits) over the real tokens."""
    policy = value = entropy = 0.0
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logprobs[i][t] - old_logprobs[i][t])
            a = advantages[i][t]
            pg = max(-a * ratio, -a * min(max(ratio, 1 - args.cliprange), 1 + args.cliprange))
            if sampler_logprobs is not None:
                pg *= min(math.exp(old_logprobs[i][t] - sampler_logprobs[i][t]), args.tis_cap)
            v, old_v, ret = values[i][t], old_values[i][t], returns[i][t]
            v_clipped = old_v + min(max(v - old_v, -args.cliprange_value), args.cliprange_value)
            policy += pg
            value += 0.5 * max((v - ret) ** 2, (v_clipped - ret) ** 2)
            probs = [math.exp(x) for x in logits[i][t]]
            entropy -= sum(q / sum(probs) * math.log(q / sum(probs)) for q in probs)
    real = sum(sum(row) for row in mask)
    return (policy + args.vf_coef * value) / n, policy / n, value / n, entropy / real


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tis", [False, True])
def test_ppo_prm_loss_matches_a_loop_and_micro_batches_sum_to_the_minibatch(seed, tis):
    g = torch.Generator().manual_seed(seed)
    args = prm.Config(cliprange=0.2, cliprange_value=0.3, vf_coef=0.1 + seed, tis_cap=1.5)
    mask = right_padded_mask([random.Random(seed).randint(1, 7) for _ in range(6)], 7)

    def rand(scale=1.0):
        return torch.randn(6, 7, generator=g, dtype=torch.float64) * scale

    logprobs, values = rand(0.3).requires_grad_(), rand().requires_grad_()
    old_logprobs, old_values, advantages, returns = rand(0.3), rand(), rand(), rand()
    sampler_logprobs = old_logprobs + rand(0.5) if tis else None
    logits = torch.randn(6, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tensors = (logprobs, logits, values, old_logprobs, old_values, advantages, returns, sampler_logprobs, mask)
    n = mask.sum() * 0.75  # a minibatch token count (averaged over processes, it need not be this batch's)
    flags = {name: getattr(args, name) for name in inspect.getfullargspec(prm.ppo_prm_loss).kwonlyargs}
    loss, stats = prm.ppo_prm_loss(*tensors, n, **flags)
    as_lists = [None if x is None else x.tolist() for x in tensors]
    expected, expected_policy, expected_value, expected_entropy = reference_loss(*as_lists, args, float(n))
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["pg_loss"] == pytest.approx(expected_policy, rel=1e-12)
    assert stats["vf_loss"] == pytest.approx(expected_value, rel=1e-12)
    assert stats["policy/entropy_avg"] == pytest.approx(expected_entropy, rel=1e-12)
    assert ("objective/tis_weight" in stats) == tis
    loss.backward()
    assert logprobs.grad.abs().sum() > 0 and values.grad.abs().sum() > 0
    assert (logprobs.grad[mask == 0] == 0).all() and (values.grad[mask == 0] == 0).all()
    # Gradient accumulation: the micro-batches' losses, each divided by the minibatch's count, sum to its loss.
    halves = [
        prm.ppo_prm_loss(*(None if x is None else x[part] for x in tensors), n, **flags)[0]
        for part in (slice(0, 2), slice(2, 6))
    ]
    assert sum(h.item() for h in halves) == pytest.approx(loss.item(), rel=1e-12)


def test_token_char_ends_follow_a_multi_byte_character(tokenizer):
    text = "café ✓ 2 + 2 = 4\n\nдалее"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    ends = prm._token_char_ends(tokenizer, ids)
    assert ends == sorted(ends) and ends[-1] == len(text)
    steps = prm._split_steps(text, "\n\n")
    tokens = prm._step_token_indices(ends, [span for _, span in steps])
    assert tokenizer.decode(ids[: tokens[0] + 1]).endswith("4")


def test_a_step_ending_in_a_multi_byte_character_ends_at_the_token_that_completes_it(tokenizer):
    """Byte-level BPE splits the emoji over 3 tokens; the prefixes ending in its first two decode to a trailing
    U+FFFD, which is no character of the text: the step ends at the third token, not the first."""
    text = "Done 🎉\n\nAnswer: 4"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids[:2]).endswith("\ufffd")  # the split this test is about
    ends = prm._token_char_ends(tokenizer, ids)
    assert ends == sorted(ends) and ends[-1] == len(text)
    steps = prm._split_steps(text, "\n\n")
    tokens = prm._step_token_indices(ends, [span for _, span in steps])
    assert tokenizer.decode(ids[: tokens[0] + 1]) == "Done 🎉"
    assert tokens[0] == 3 and tokens[1] == len(ids) - 1


# The verifier PRM


@pytest.mark.parametrize(
    "step, verdict",
    [
        ("2 + 3 = 5", True),
        ("1. 9 * 1 = 9", True),  # the list number is not part of the equation
        ("Add 1 to 9: 9 + 1 = 10. Then 10 * 3 = 30.", True),
        ("-3 - -9 = 6", True),
        ("12 × 3 = 36 and 36 ÷ 4 = 9", True),
        ("(2 + 3) * 4 = 20 = 40 / 2", True),  # chained
        ("7.5 + 0.5 = 8.0", True),
        ("1 - 8 - 8 = 1", False),
        ("9 * 1 = 9. 9 + 4 = 12", False),  # one wrong equation is enough
        ("0 + 7 - 0 = (1 + 1) - 0 = 1", False),
        ("So, the answer is 9.", None),  # nothing to check
        ("Answer: 12", None),
        ("x + 3 = 5", None),  # one side does not evaluate: not checkable
        ("Step 1: 9 is the result of <number> = 1", None),
        ("2 + 3 =", None),
        ("", None),
    ],
)
def test_step_arithmetic(step, verdict):
    assert prm.step_arithmetic(step) is verdict


# Operators in words or other symbols between numbers are arithmetic. Each row's verdict was written by hand. The
# "real" rows are steps (blank-line separated, as --step_separator splits them) of completions of the embedded model
# (SmolLM2-135M-Instruct, the scripts' default prompts on assets/data arith_1d and gsm8k_100, sampled with HF
# generate), whole.
STEP_TABLE = [
    ("9 x 6 = 54", True),
    ("9 X 6 = 54", True),
    ("9x6=54", True),
    ("9 times 6 = 54", True),
    ("9 Times 6 = 54", True),
    ("9 multiplied by 6 = 54", True),
    ("9 · 6 = 54", True),
    ("$9 \\times 6 = 54$", True),
    ("9 plus 6 = 15", True),
    ("9 minus 6 = 3", True),
    ("54 divided by 6 = 9", True),
    ("3 over 4 = 0.75", True),
    ("50% of 10 = 5", True),
    ("50 percent of 10 = 5", True),
    ("10 + 20% of 50 = 20", True),
    ("50% x 10 = 5", True),
    ("10 x 50% = 5", True),
    ("9 times -3 = -27", True),
    ("1,000 plus 234 = 1,234", True),
    ("x = 2 x 3 = 6", True),
    ("Multiply 9 by 6: 9 * 6 = 54", True),
    ("9 − 6 = 3", True),
    ("9 x 6 = 56", False),
    ("9 minus 6 = 4", False),
    ("50% of 10 = 6", False),
    ("x + 3 = 5", None),  # a variable
    ("2x + 3 = 7", None),
    ("2 x + 3 = 7", None),
    ("3x = 12", None),
    ("50% = 0.5", True),
    ("A 3 x 4 grid has 12 cells", None),
    ("5 times 2 apples = 10 apples", None),
    ("1. 9 * 1 = 9 \n2. 9 * 1 = 9 ", True),  # real
    ("1. 9 x 1 = 9", True),  # real
    ("A: 9 + 1 = 10", True),  # real
    ("2. 9 + 1 = 2", False),  # real
    ("Multiplication: 3 * 3 = 9", True),  # real
    ("To find 0 + 4, we need to find the value of the sum of the absolute values of the numbers.", None),  # real
    ("We are given that 0 + 4 is 4.\nThe steps to solve it are:", None),  # real
    ("Patch: 10 + 9 = 10", False),  # real
    ("1 - 4 = -2", False),  # real
    ("1. 1 - 4 = 5.\n2. 5 * 1 = 5.\n3. 5 * 1 = 5.", False),  # real
    ("1. 5 + 0 = 5\n2. Add 0 to both sides of the equation: (5 + 0) = 5", True),  # real
    ("1. 4 * 4 = 16\n2. 16 * 4 = 64", True),  # real
    ("You can calculate the result by multiplying 4 and 16, which results in 64.", None),  # real
    ("4 - 5 = 2\n2 * 5 = 10", False),  # real
    ("2 + 87 = 2 * 7 = 19.", False),  # real
    ("2 is an integer and 2 + 3*1 = 2 + 3 = 3 with no fractional parts.", False),  # real
    ("So, we do 6 / 2 = 3. So, we can add 1 to the end of the 3 to get the answer.", True),  # real
    ("2. Calculate the total teaspoons: 3 + 4 = 7 teaspoons of sugar were used.", True),  # real
    ("4. Add the number of teaspoons of sugar used: 7 + 7 = 12 teaspoons of sugar were used.", False),  # real
    ("1. Find the ratio: 7:13\nThe ratio is 7:13, or 3:4 in this context.", None),  # real
    (
        "To convert 63 into hundreds, I need to multiply 6! by 6. So, I multiply 6! by itself, which gives 6 * 6 * 6"
        " * 6 * 6 * 6 * 6 * 6 * 6 = 6 * 6 *",
        None,
    ),  # real, cut at the token limit
    (
        "To solve this, start by adding 5 to the original 6. The first step is just 5 added to itself six times, which"
        " equals 11. Then, multiply 11 by 6 to get 66. So, the answer is 66.",
        None,
    ),  # real
    (
        "To solve this math problem step by step, I will follow the order of operations:\n1. Add the numbers in the "
        "parentheses: 5 + 9 = 14\n2. Subtract the previous equation from the next equation: 14 - 5 = 6\n3. Add the "
        "final answer to the previous equation: 6 + 6 = 12",
        False,
    ),  # real
    (
        "Solving this equation: \nMarvellos = 12 + 17 = 20\nPetunias = 9 + 17 = 26\nBegonias = 17 + 2 = 20",
        False,
    ),  # real
    (
        "Charlie has three times as many Facebook friends as Dorothy, so 3 * 12 = 32 Facebook friends.\nThere are 12 "
        "friends on Facebook, so James has 12 * 4 = 48 Facebook friends.",
        False,
    ),  # real
    (
        "1. John has 10 hectares of pineapple field.\n2. There are 100 pineapples per hectare.\n3. He can harvest his "
        "pineapples every 3 months.\n4. To find out how many pineapples can be harvested within a year, we need to "
        "calculate the total number of pineapples.\n5. We already know that John has 100 pineapples, so we multiply "
        "it by 3.\n6. 100 * 3 = 300",
        True,
    ),  # real
]


@pytest.mark.parametrize("step, verdict", STEP_TABLE)
def test_step_arithmetic_table(step, verdict):
    assert prm.step_arithmetic(step) is verdict


# Steps as Qwen2.5-Math (LaTeX, powers, roots, rounded decimals, Markdown bold) and GSM8K solutions (calculator
# annotations, dollar signs) write them. Each row's verdict was written by hand. "GSM8K" rows are whole lines of GSM8K
# gold solutions.
NOTATION_TABLE = [
    ("2^3 = 8", True),  # the exponent was compared with the result
    ("5^2 = 25", True),
    ("2**10 = 1024", True),
    ("(2 + 3)**2 = 25", True),
    ("5² = 25", True),
    ("2^{10} = 1024", True),
    ("10^{-3} = 0.001", True),
    ("\\( 3^2 + 4^2 = 9 + 16 = 25 \\)", True),
    ("√16 = 4", True),
    ("√(16) = 4", True),
    ("\\sqrt{16} = 4", True),
    ("sqrt(16) = 4", True),
    ("3 \\times \\sqrt{4} = 6", True),
    ("\\( 3 \\times 4 = 12 \\)", True),
    ("$3 \\cdot 4 = 12$", True),
    ("\\[ 12 \\div 4 = 3 \\]", True),
    ("$10 \\times 12 = 120$", True),
    ("\\frac{6}{3} = 2", True),
    ("\\dfrac{10}{4} = 2.5", True),
    ("\\frac{\\sqrt{16}}{2} = 2", True),
    ("\\left( \\frac{1}{2} \\right) \\times 8 = 4", True),
    ("The area is \\( \\pi r^2 = 3.14 \\times 5^2 = 78.5 \\).", True),
    ("10 / 3 = 3.33", True),  # a decimal stands for the values that round to it
    ("10 / 3 = 3.3", True),
    ("2/3 = 0.67", True),
    ("√2 = 1.41", True),
    ("**Step 1:** 2 + 3 = 5", True),  # Markdown bold, not a power
    ("2 + 3 = **5**", True),
    ("x_1 = 2 + 3 = 5", True),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.", True),  # GSM8K
    ("Natalia sold 48/2 = 24 clips in May.", True),
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.", True),  # GSM8K
    ("The total price of the house is $350,000 + $17,500 + $42,000 = $409,500.", True),  # GSM8K
    ("Her tennis shoes were half the original $48 price, so they cost $48*1/2=$24.", True),
    ("2^3 = 9", False),
    ("\\sqrt{16} = 5", False),
    ("\\frac{6}{3} = 3", False),
    ("\\( 3 \\times 4 = 13 \\)", False),
    ("10 / 3 = 3.4", False),
    ("10 / 3 = 3", False),  # a whole number is exact
    ("7 / 2 = 3", False),
    ("48/2 = <<48/2=24>>25", False),  # the written result is checked, not only the annotation
    ("48/2 = <<48/2=25>>25", False),  # a wrong annotation
    ("x^2 = 9", None),  # a variable
    ("x ^ 2 = 9", None),
    ("a_1 = 5", None),
    ("\\frac{x}{2} = 3", None),
    ("2^2^2^2^2^2 = 1", None),  # 2^65536 is not read (exponents beyond 1000), a side alone
    ("10^400 = 1", None),  # overflows
    ("(-8)^(1/3) = -2", None),  # a fractional power of a negative number is not read
]


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])  # reward_modeling.py --prm labels with it
@pytest.mark.parametrize("step, verdict", NOTATION_TABLE)
def test_step_arithmetic_reads_math_notation(step, verdict, script):
    assert importlib.import_module(script).step_arithmetic(step) is verdict


def test_arithmetic_value_bounds_powers():
    assert prm.arithmetic_value("2^10") == prm.arithmetic_value("2 ** 10") == 1024
    assert prm.arithmetic_value("√(9) + sqrt(16) + 2² + 2³") == 19
    for expression in ("2 ** 1001", "10 ^ 400", "(-8) ** 0.5", "√-4", "sqrt(4, 2)", "sqrt(x=4)", "pow(2, 3)"):
        assert prm.arithmetic_value(expression) is None, expression


def test_verifier_scores_are_prefix_scores():
    steps = ["To start:", "2 + 3 = 5", "5 * 2 = 10", "10 - 1 = 8", "8 + 1 = 9", "Answer: 9"]
    assert prm.verifier_step_scores(steps) == [0.8, 0.8, 0.8, 0.0, 0.0, 0.0]
    assert prm.verifier_step_scores(["2 + 3 = 5", "Answer: 5"]) == [1.0, 0.8]
    assert prm.verifier_step_scores([]) == []
    # A correct but useless step is paid like a useful one: raw rewards repeating it.
    useless = ["2 + 3 = 5"] * 10
    assert sum(prm.verifier_step_scores(useless)) == 10


def test_arithmetic_value_refuses_anything_but_arithmetic():
    assert prm.arithmetic_value("2 * (3 + 4)") == 14
    refused = "__import__('os')", "2 ** 100000", "9" * 300, "1 / 0", "abs(-1)", "1 +", "[1]", "True", "rounded(3)"
    for expression in (*refused, "sqrt(x)", "1 / 0.0", "1 / (0.5 - 0.5)", "(-0.5) ** 0.5", "(10 ^ 300) * (10 ^ 300)"):
        assert prm.arithmetic_value(expression) is None, expression


def test_math_shepherd_text_has_one_tag_per_step():
    text = prm._math_shepherd_text("What is 2 + 2?", ["2 + 2 = 4 ки", "Answer: 4"], "ки")
    assert text == "What is 2 + 2? 2 + 2 = 4 ки\nAnswer: 4 ки"
    assert prm._math_shepherd_text("Q?", [], "ки") == "Q? "


# End-to-end runs on the tiny model. The tiny random policy writes random tokens; a space as the step separator
# gives it many steps per response (most tokens start with a space).


RUN_METRICS = (
    "objective/success",
    "objective/num_steps",
    "objective/response_length",
    "objective/prm_score",
    "objective/prm_score_sum",
    "objective/process_reward",
    "objective/scores",
    "objective/kl",
    "loss/policy_avg",
    "loss/value_avg",
    "policy/approxkl_avg",
)


def recorded_run(monkeypatch, args):
    """Run main and record what GAE and place_process_rewards received: [(rewards, mask)], [(step_rewards,
    step_tokens, process)]."""
    gae_inputs, placed = [], []
    gae, place = prm.gae_advantages, prm.place_process_rewards

    def recording_gae(rewards, values, mask, gamma, lam):
        gae_inputs.append((rewards.clone(), mask.clone()))
        return gae(rewards, values, mask, gamma, lam)

    def recording_place(step_rewards, step_tokens, width):
        process = place(step_rewards, step_tokens, width)
        placed.append(([r.clone() for r in step_rewards], step_tokens, process))
        return process

    monkeypatch.setattr(prm, "gae_advantages", recording_gae)
    monkeypatch.setattr(prm, "place_process_rewards", recording_place)
    return prm.main(args), gae_inputs, placed


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_run_of_every_reward_mode(make_config, monkeypatch, mode):
    run_dir, gae_inputs, placed = recorded_run(monkeypatch, make_config(prm, reward_mode=mode, eta=0.9))
    lines = read_metrics(run_dir)
    assert [line["global_step"] for line in lines] == [0, 1, 2]
    for key in ("eval/accuracy", "eval/num_steps", "eval/prm_score", "eval/response_length"):
        assert key in lines[0] and key in lines[-1]
    training = train_lines(lines)
    for line in training:
        missing = [k for k in RUN_METRICS if k not in line]
        assert not missing, missing
        assert all(math.isfinite(v) for v in line.values())
        assert line["policy/ratio_first_minibatch"] == 1.0 and line["policy/approxkl_first_minibatch"] == 0.0
        assert line["objective/num_steps"] > 1  # the space separator gives the random policy several steps
        # accuracy is the verifier's verdict; the success reward is -1 (missing_eos_penalty) without EOS
        assert 0 <= line["objective/accuracy"] <= 1 and line["objective/success"] <= line["objective/accuracy"]
        paid, raw_sum = line["objective/process_reward"], line["objective/prm_score_sum"]
        if mode == "none":
            assert paid == 0.0
        elif mode == "raw":
            assert paid == pytest.approx(0.5 * raw_sum, rel=1e-5)
        elif mode == "clip":
            assert paid <= 0.0
        else:  # delta and clip_delta: the process return is bounded by one step's score, whatever the length
            assert -0.5 <= paid <= 0.5
    for line in (lines[0], lines[-1]):
        assert 0 <= line["eval/accuracy"] <= 1
    # Training steps' rewards into GAE (kl_coef 0): the process rewards, plus the success (1 / 0, or -1 without EOS)
    # on the last real token.
    assert len(gae_inputs) == 2 and len(placed) == 4  # evaluation before, 2 training steps, evaluation after
    for (rewards, mask), (step_rewards, step_tokens, process) in zip(gae_inputs, placed[1:3]):
        last = (mask.sum(1) - 1).long()
        success = rewards[torch.arange(len(last)), last] - process[torch.arange(len(last)), last]
        assert all(min(abs(s), abs(s - 1), abs(s + 1)) < 1e-6 for s in success.tolist())
        without_success = rewards.clone()
        without_success[torch.arange(len(last)), last] -= success
        torch.testing.assert_close(without_success, process * mask)
        for i, tokens in enumerate(step_tokens):
            assert all(t < mask[i].sum() for t in tokens)  # every step ends on a real token
            nonzero = set(torch.nonzero(process[i]).flatten().tolist())
            assert nonzero <= set(tokens)
            assert process[i].sum().item() == pytest.approx(step_rewards[i].sum().item(), abs=1e-6)


@pytest.mark.slow
def test_invariant_same_seed_same_metrics_and_resume(make_config, monkeypatch, tmp_path):
    overrides = dict(total_steps=3, save_every=2, reward_mode="raw")
    run_a = prm.main(make_config(prm, output_dir=str(tmp_path / "a"), **overrides))
    calls, gae = [], prm.gae_advantages

    def interrupting_gae(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return gae(*args)

    monkeypatch.setattr(prm, "gae_advantages", interrupting_gae)
    with pytest.raises(KeyboardInterrupt):
        prm.main(make_config(prm, output_dir=str(tmp_path / "b"), **overrides))
    monkeypatch.setattr(prm, "gae_advantages", gae)
    run_b = only_run_dir(tmp_path / "b")
    prm.main(make_config(prm, output_dir=str(tmp_path / "b"), resume=run_b, **overrides))
    assert [line["global_step"] for line in read_metrics(run_b)] == [0, 1, 2, 3]
    assert without_timing(read_metrics(run_b)) == without_timing(read_metrics(run_a))


@pytest.mark.slow
def test_value_head_starts_at_zero(make_config, monkeypatch):
    values_seen, forward = [], prm.PolicyAndValueModel.forward

    def recording_forward(self, *args):
        out = forward(self, *args)
        values_seen.append(out[2].detach().clone())
        return out

    monkeypatch.setattr(prm.PolicyAndValueModel, "forward", recording_forward)
    run_dir = prm.main(make_config(prm, total_steps=1, reward_mode="raw"))  # non-zero returns to learn
    assert (values_seen[0] == 0).all()  # the first rollout's values: a zero head on the policy's weights
    assert not (values_seen[-1] == 0).all()  # it learns
    with open(os.path.join(run_dir, "value_model", "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForSequenceClassification"]


# A Math-Shepherd style PRM: the tiny random causal LM stands in for a hub PRM, with a one-token step tag.


@pytest.mark.slow
def test_math_shepherd_prm_scores_the_tags(make_config, monkeypatch, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts, scores = [], []
    text_of, refine = prm._math_shepherd_text, prm.refine_process_rewards
    monkeypatch.setattr(prm, "_math_shepherd_text", lambda *a: texts.append(text_of(*a)) or texts[-1])
    monkeypatch.setattr(prm, "refine_process_rewards", lambda s, *a: scores.append(s) or refine(s, *a))
    args = make_config(prm, prm=tiny_model_dir, prm_step_tag="§", total_steps=1, reward_mode="raw")
    lines = read_metrics(prm.main(args))
    assert lines[1]["objective/prm_score"] > 0
    texts = texts[1:]  # the first is the probe that checks the tag before any model loads
    assert len(texts) == len(scores) and len(texts) >= 4
    # Recomputed alone, one text at a time: P(+) / (P(+) + P(-)) of the next token after each tag.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tag, good, bad = tokenizer.convert_tokens_to_ids(["§", "+", "Ġ-"])
    for text, got in list(zip(texts, scores))[:4]:
        ids = torch.tensor([tokenizer(text).input_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        probs = torch.softmax(logits[:, [good, bad]], -1)[:, 0]
        expected = probs[ids[0] == tag]
        assert len(expected) == text.count("§") == len(got)
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


# Bad input: one line, before any model loads


@pytest.fixture
def bad_args(make_config, monkeypatch):
    monkeypatch.setattr(prm, "AutoModelForCausalLM", NoModelLoads)
    monkeypatch.setattr(prm, "AutoModelForSequenceClassification", NoModelLoads)
    return functools.partial(make_config, prm)


@pytest.mark.parametrize(
    "overrides, names",
    [
        (dict(eta=1.5), ["--eta", "[0, 1]"]),
        (dict(eta=-0.1), ["--eta"]),
        (dict(step_separator=""), ["--step_separator"]),
        (dict(prm_coef=-1.0), ["--prm_coef"]),
        (dict(prm="runs/no_such_prm"), ["--prm", "reward_modeling.py --prm"]),
        (dict(answer_column="solution"), ["--answer_column"]),
        (dict(prompts_per_rank=6, num_minibatches=4), ["--num_minibatches"]),
        (dict(temperature=0.0), ["--temperature"]),
    ],
)
def test_bad_input(bad_args, overrides, names):
    one_line_error(prm.main, bad_args(**overrides), *names)


def test_an_unknown_reward_mode_is_refused_by_the_command_line(capsys):
    """tyro checks the Literal choices (the script does not repeat it): --reward_mode sqrt stops with the choices."""
    with pytest.raises(SystemExit):
        tyro.cli(prm.Config, args=["--reward_mode", "sqrt"])
    assert "clip_delta" in capsys.readouterr().err


def test_a_prm_that_gives_no_score_for_a_step(bad_args, monkeypatch):
    verifier = prm.verifier_step_scores
    monkeypatch.setattr(prm, "verifier_step_scores", lambda steps: verifier(steps)[:-1])
    one_line_error(prm.main, bad_args(), "--prm verifier", "2 scores", "3 steps")


def test_a_step_tag_that_does_not_mark_each_step_once(bad_args, tiny_model_dir):
    # ".\n" ends in the newline that also separates the steps: 5 tags for 3 steps of the probe.
    args = bad_args(prm=tiny_model_dir, prm_step_tag=".\n")
    one_line_error(prm.main, args, "--prm_step_tag", "5 scores", "3 probe steps")
    one_line_error(prm.main, bad_args(prm=tiny_model_dir, prm_step_tag=""), "--prm_step_tag")
    one_line_error(prm.main, bad_args(prm=tiny_model_dir, prm_step_tag="§", prm_good_token="++ +"), "--prm_good_token")


def test_a_value_model_with_another_vocabulary(bad_args, tiny_model_dir, tmp_path):
    """The value model reads the policy's tokens: another vocabulary gives silent garbage values."""
    from transformers import AutoTokenizer

    other = tmp_path / "other_vocab"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<not_in_the_policy>"])
    tokenizer.save_pretrained(other)
    one_line_error(prm.main, bad_args(value_model_path=str(other)), "--value_model_path", "vocabulary")


def test_a_whole_response_reward_model_is_not_a_prm(bad_args, tiny_reward_model_dir, tmp_path):
    one_line_error(prm.main, bad_args(prm=tiny_reward_model_dir), "--prm", "reward_modeling.py --prm")
    other = tmp_path / "other"
    shutil.copytree(tiny_reward_model_dir, other)
    with open(other / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["LlamaModel"]
    (other / "config.json").write_text(json.dumps(config))
    one_line_error(prm.main, bad_args(prm=str(other)), "--prm", "LlamaModel")


@pytest.mark.slow
def test_lora_policy_starts_at_the_reference(make_config):
    lines = train_lines(
        read_metrics(prm.main(make_config(prm, lora_r=4, learning_rate=1e-2, kl_coef=0.1, reward_mode="raw")))
    )
    assert lines[0]["objective/kl"] == 0.0  # the adapters start at zero: policy == reference (adapters off)
    assert lines[-1]["objective/kl"] != 0.0


# The fixed rollout (tests/fixed_rollout.py) under bf16 autocast; the launch paths' invariants are
# tests/launch_paths/test_launch_paths.py's table.

INVARIANT_ARGS = dict(
    total_steps=2,
    num_ppo_epochs=2,  # 4 updates: the old-policy log-probs, the clipping and the reused batch are compared
    num_minibatches=1,  # one minibatch per pass: with more, each process's minibatch is its own slice of the batch
    micro_batch_size=2,
    lr_scheduler="linear",  # a decaying schedule shows a scheduler stepped once per process
    learning_rate=1e-4,
    kl_coef=0.05,  # the reference model and the KL rewards
    whiten_rewards=True,  # the rewards' std over every process's tokens, as the advantages'
    reward_mode="clip_delta",
    eta=0.9,  # the verifier's 0.8 for a step without equations is below eta: non-zero process rewards
    eval_every=0,
    num_eval_prompts=4,
)


def fixed_rollout_run(monkeypatch, make_config, **overrides):
    fixed_rollout.patch(prm, monkeypatch.setattr)
    return prm.main(make_config(prm, **{**INVARIANT_ARGS, **overrides}))


@pytest.mark.slow
@pytest.mark.parametrize("lora_r", [0, 4])
def test_invariant_bf16_autocast_kl_is_zero_and_ratio_one_before_the_first_update(
    make_config, monkeypatch, bf16_autocast, lora_r
):
    """--mixed_precision bf16 autocasts the prepared policy and value model; the reference (a copy, or the policy
    with its adapters off) runs under the same autocast, so the first step's KL is exactly 0 and the first
    minibatch's ratio exactly 1 (a reference run in fp32 would not give them)."""
    run_dir = fixed_rollout_run(monkeypatch, make_config, total_steps=1, num_ppo_epochs=1, lora_r=lora_r)
    (line,) = train_lines(read_metrics(run_dir))
    assert line["objective/kl"] == 0.0
    assert line["policy/ratio_first_minibatch"] == 1.0 and line["policy/approxkl_first_minibatch"] == 0.0


def test_cli_help():
    proc = subprocess.run(
        [sys.executable, "ppo_prm_clip.py", "--help"],
        cwd=REPO_ROOT,
        env={**subprocess_env(), "COLUMNS": "250"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--reward-mode", "--eta", "--prm-coef", "--prm", "--step-separator", "--prm-step-tag", "--resume"):
        assert flag in proc.stdout, flag
    assert "{none,raw,clip,delta,clip_delta}" in proc.stdout and "the Clip threshold" in proc.stdout
