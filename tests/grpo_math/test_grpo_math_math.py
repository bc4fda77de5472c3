"""The math of grpo_math.py against independent references: plain Python loops in float64. The kit's functions below
the fence are tested in test_kit.py."""

import inspect
import math
import random

import pytest
import torch

import grpo_math
from grpo_math import (
    _gold_answer,
    _left_pad,
    aggregate_loss,
    clipped_surrogate,
    compute_rewards,
    entropy_from_logits,
    extract_answer,
    fixed_logprobs,
    group_advantages,
    grpo_loss,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    response_logprobs,
    select_groups,
    truncated_importance_weights,
    verify_answer,
)

SEEDS = [0, 1, 2]
SHAPES = [(1, 1), (3, 5), (8, 17)]


def loss_flags(args):
    """grpo_loss's keyword-only flags, read from a Config as main() reads them."""
    return {name: getattr(args, name) for name in inspect.getfullargspec(grpo_loss).kwonlyargs}


def rand(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def rand_mask(shape, seed, p=0.7):
    g = torch.Generator().manual_seed(seed + 1000)
    return (torch.rand(shape, generator=g) < p).double()


def tolist2(t):
    return [[float(x) for x in row] for row in t]


# masked_mean


def test_masked_mean_all():
    for seed in SEEDS:
        for shape in SHAPES:
            values, mask = rand(shape, seed), rand_mask(shape, seed)
            total = count = 0.0
            for row_v, row_m in zip(tolist2(values), tolist2(mask)):
                for v, m in zip(row_v, row_m):
                    total += v * m
                    count += m
            expected = total / count if count else 0.0
            assert masked_mean(values, mask).item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_masked_mean_dim1_with_empty_row():
    for seed in SEEDS:
        values, mask = rand((5, 7), seed), rand_mask((5, 7), seed)
        mask[2] = 0  # a row with no real token
        expected = []
        for row_v, row_m in zip(tolist2(values), tolist2(mask)):
            count = sum(row_m)
            expected.append(sum(v * m for v, m in zip(row_v, row_m)) / count if count else 0.0)
        got = masked_mean(values, mask, dim=1)
        assert got.shape == (5,)
        assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert got[2].item() == 0.0  # an empty row gives 0, not nan


def test_masked_mean_bool_and_long_masks():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    for mask in (torch.tensor([[1, 0, 1], [0, 0, 1]]), torch.tensor([[True, False, True], [False, False, True]])):
        assert masked_mean(values, mask).item() == pytest.approx((1 + 3 + 6) / 3)
        assert masked_mean(values, mask, dim=1).tolist() == pytest.approx([2.0, 6.0])


def test_masked_mean_all_zero_mask_is_zero():
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


# kl_estimate


def kl_reference(lp, ref, kind):
    log_r = lp - ref
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    return math.exp(-log_r) + log_r - 1


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimate_matches_loop(kind):
    for seed in SEEDS:
        for shape in SHAPES:
            lp, ref = -rand(shape, seed).abs() * 3, -rand(shape, seed + 7).abs() * 3
            got = kl_estimate(lp, ref, kind)
            rows = zip(tolist2(lp), tolist2(ref))
            expected = [[kl_reference(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in rows]
            assert got.shape == lp.shape
            assert tolist2(got) == [pytest.approx(row, rel=1e-12, abs=1e-12) for row in expected]


def test_k3_is_nonnegative_and_zero_on_policy():
    for seed in SEEDS:
        lp, ref = rand((6, 9), seed, scale=4), rand((6, 9), seed + 1, scale=4)
        assert (kl_estimate(lp, ref, "k3") >= 0).all()
        assert (kl_estimate(lp.float(), ref.float(), "k3") >= 0).all()
        for kind in ("k1", "k2", "k3"):
            assert (kl_estimate(lp, lp.clone(), kind) == 0).all()
            assert (kl_estimate(lp.float(), lp.float().clone(), kind) == 0).all()


def test_kl_estimate_unknown_kind_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")


# group_advantages


def advantages_reference(rewards, group_size, scale, eps=1e-4):
    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):  # unbiased
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    out = []
    batch_std = std(rewards)
    for g in range(len(rewards) // group_size):
        group = rewards[g * group_size : (g + 1) * group_size]
        for r in group:
            centred = r - mean(group)
            if scale == "group":
                out.append(centred / (std(group) + eps))
            elif scale == "batch":
                out.append(centred / (batch_std + eps))
            else:
                out.append(centred)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("num_groups,group_size", [(1, 2), (3, 4), (5, 8)])
def test_group_advantages_matches_loop(scale, num_groups, group_size):
    for seed in SEEDS:
        rng = random.Random(seed)
        rewards = [rng.choice([0.0, 1.0, 1.5, rng.random()]) for _ in range(num_groups * group_size)]
        rewards[:group_size] = [1.0] * group_size  # a group where every completion got the same reward
        got = group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size, scale)
        assert got.tolist() == pytest.approx(advantages_reference(rewards, group_size, scale), rel=1e-10, abs=1e-12)
        assert (got[:group_size] == 0).all()  # exactly zero, not eps-small


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_float32_binary_rewards(scale):
    rewards = [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    got = group_advantages(torch.tensor(rewards), 4, scale)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(advantages_reference(rewards, 4, scale), rel=1e-5, abs=1e-6)
    assert (got[4:8] == 0).all()


def test_group_advantages_unknown_scale_raises():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.ones(4), 2, "std")


# clipped_surrogate


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_clipped_surrogate_matches_loop(eps_low, eps_high):
    for seed in SEEDS:
        lp = -rand((4, 6), seed).abs()
        old = lp + rand((4, 6), seed + 1, scale=0.4)  # ratios around 1, some beyond either clip bound
        adv = rand((4,), seed + 2)
        loss, ratio = clipped_surrogate(lp, old, adv, eps_low, eps_high)
        for b in range(4):
            a = adv[b].item()
            for t in range(6):
                r = math.exp(lp[b, t].item() - old[b, t].item())
                clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
                assert ratio[b, t].item() == pytest.approx(r, rel=1e-12)
                assert loss[b, t].item() == pytest.approx(-min(r * a, clipped_r * a), rel=1e-12, abs=1e-15)


def test_clipped_surrogate_both_sides_by_hand():
    eps_low, eps_high = 0.2, 0.28
    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5], dtype=torch.float64)
    old = torch.zeros(2, 5, dtype=torch.float64)
    lp = ratios.log().repeat(2, 1).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = clipped_surrogate(lp, old, adv, eps_low, eps_high)
    # A > 0: the ratio is capped above at 1 + eps_high (1.5 -> 1.28); below 1 nothing is clipped.
    assert loss[0].tolist() == pytest.approx([-0.5, -0.9, -1.0, -1.1, -1.28])
    # A < 0: the ratio is capped below at 1 - eps_low (0.5 -> 0.8); above 1 nothing is clipped.
    assert loss[1].tolist() == pytest.approx([0.8, 0.9, 1.0, 1.1, 1.5])
    # No gradient through the clipped tokens; d(-r A)/d logprob = -r A elsewhere.
    loss.sum().backward()
    expected_grad = [[-0.5, -0.9, -1.0, -1.1, 0.0], [0.0, 0.9, 1.0, 1.1, 1.5]]
    assert tolist2(lp.grad) == [pytest.approx(row) for row in expected_grad]


# truncated_importance_weights, grpo_loss


def test_truncated_importance_weights_matches_loop():
    for seed in SEEDS:
        lp, sampler = -rand((3, 5), seed).abs(), -rand((3, 5), seed + 1).abs()
        for cap in (0.5, 2.0, math.inf):
            got = truncated_importance_weights(lp, sampler, cap)
            for b in range(3):
                for t in range(5):
                    expected = min(math.exp(lp[b, t].item() - sampler[b, t].item()), cap)
                    assert got[b, t].item() == pytest.approx(expected, rel=1e-12)
    same = -rand((2, 4), 9).abs()
    assert truncated_importance_weights(same, same, 2.0).tolist() == [[1.0] * 4] * 2  # on-policy: weight 1


# The defaults of the GRPO variants' options: plain GRPO.
NO_VARIANT = dict(
    importance_sampling_level="token", cispo_cap=None, mis_range=None, mis_level="token", entropy_coef=0.0
)


def grpo_loss_reference(lp, old, ref, sampler, adv, mask, eps_low, eps_high, beta, cap, tokens):
    """The token-mean GRPO loss with k3 KL and truncated IS, token by token in float64."""
    total = 0.0
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            r = math.exp(lp[b][t] - old[b][t])
            surrogate = -min(r * adv[b], min(max(r, 1 - eps_low), 1 + eps_high) * adv[b])
            if sampler is not None:
                surrogate *= min(math.exp(old[b][t] - sampler[b][t]), cap)
            kl = math.exp(ref[b][t] - lp[b][t]) + (lp[b][t] - ref[b][t]) - 1 if beta > 0 else 0.0
            total += (surrogate + beta * kl) * mask[b][t]
    return total / tokens


@pytest.mark.parametrize("with_sampler", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_loop(with_sampler, beta):
    from types import SimpleNamespace

    args = SimpleNamespace(
        clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0, beta=beta, kl_estimator="k3", loss_type="token_mean",
        response_length=6, **NO_VARIANT,
    )  # fmt: skip
    for seed in SEEDS:
        lp = -rand((4, 6), seed).abs()
        old, ref = lp + rand((4, 6), seed + 1, 0.3), lp + rand((4, 6), seed + 2, 0.3)
        sampler = old + rand((4, 6), seed + 3, 0.5) if with_sampler else None
        adv, mask = rand((4,), seed + 4), rand_mask((4, 6), seed)
        tokens = mask.sum() + 3  # the minibatch holds other micro-batches too
        loss, stats = grpo_loss(lp, old, ref, sampler, adv, mask, None, tokens, 4, **loss_flags(args))
        expected = grpo_loss_reference(
            *map(tolist2, (lp, old, ref)), tolist2(sampler) if with_sampler else None, adv.tolist(), tolist2(mask),
            0.2, 0.28, beta, 2.0, tokens.item(),
        )  # fmt: skip
        assert loss.item() == pytest.approx(expected, rel=1e-10)
        assert ("objective/kl" in stats) == (beta > 0) and ("objective/tis_weight" in stats) == with_sampler
        assert stats["policy/ratio"] == pytest.approx(masked_mean(torch.exp(lp - old), mask).item())


def test_grpo_loss_on_policy_is_minus_the_advantage():
    """Ratio 1 (logprobs = old), no KL: every token's loss is -A, so the token mean is -mean(A) over tokens."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        clip_eps_low=0.2, clip_eps_high=0.2, tis_cap=None, beta=0.0, kl_estimator="k3", loss_type="token_mean",
        response_length=5, **NO_VARIANT,
    )  # fmt: skip
    lp = -rand((3, 5), 0).abs().requires_grad_()
    adv, mask = rand((3,), 1), rand_mask((3, 5), 2)
    loss, stats = grpo_loss(lp, lp.detach(), None, None, adv, mask, None, mask.sum(), 3, **loss_flags(args))
    assert loss.item() == pytest.approx(-(adv.unsqueeze(1) * mask).sum().item() / mask.sum().item(), rel=1e-12)
    assert stats["policy/ratio"] == 1.0 and stats["policy/clipfrac_low"] == stats["policy/clipfrac_high"] == 0.0


# aggregate_loss


def aggregate_reference(token_loss, mask, loss_type, max_len):
    rows = list(zip(tolist2(token_loss), tolist2(mask)))
    if loss_type == "token_mean":
        return sum(v * m for lr, mr in rows for v, m in zip(lr, mr)) / sum(m for _, mr in rows for m in mr)
    if loss_type == "seq_mean_token_mean":
        return sum(sum(v * m for v, m in zip(lr, mr)) / sum(mr) for lr, mr in rows) / len(rows)
    return sum(v * m for lr, mr in rows for v, m in zip(lr, mr)) / (len(rows) * max_len)


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean", "constant"])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_aggregate_loss_micro_batches_sum_to_minibatch_loss(loss_type, micro):
    for seed in SEEDS:
        batch, width, max_len = 8, 6, 10
        token_loss = rand((batch, width), seed)
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, width + 1, (batch,), generator=g)
        mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).double()
        tokens = mask.sum()
        total = sum(
            aggregate_loss(token_loss[i : i + micro], mask[i : i + micro], loss_type, tokens, batch, max_len)
            for i in range(0, batch, micro)
        )
        expected = aggregate_reference(token_loss, mask, loss_type, max_len)
        assert total.item() == pytest.approx(expected, rel=1e-12)


def test_aggregate_loss_unknown_type_raises():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(torch.ones(2, 2), torch.ones(2, 2), "sum", 4, 2, 2)


# logprobs_from_logits, entropy_from_logits


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_logprobs_and_entropy_match_loop(scale):
    for seed in SEEDS:
        vocab = 7
        logits = rand((3, 4, vocab), seed, scale=scale)
        labels = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(seed))
        lp, ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
        assert lp.shape == ent.shape == (3, 4)
        for i in range(3):
            for j in range(4):
                row = [float(x) for x in logits[i, j]]
                top = max(row)
                log_z = top + math.log(sum(math.exp(x - top) for x in row))
                probs = [math.exp(x - log_z) for x in row]
                assert lp[i, j].item() == pytest.approx(row[labels[i, j]] - log_z, rel=1e-10, abs=1e-10)
                entropy = -sum(p * math.log(p) for p in probs if p > 0)
                assert ent[i, j].item() == pytest.approx(entropy, rel=1e-9, abs=1e-9)


def test_logprobs_float32_large_logits_are_finite():
    logits = torch.tensor([[1000.0, -1000.0, 0.0]])
    assert logprobs_from_logits(logits, torch.tensor([0])).item() == pytest.approx(0.0)
    assert logprobs_from_logits(logits, torch.tensor([2])).item() == pytest.approx(-1000.0)
    assert entropy_from_logits(logits).item() == pytest.approx(0.0, abs=1e-6)
    assert entropy_from_logits(torch.zeros(1, 5)).item() == pytest.approx(math.log(5))


# answers and rewards


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Answer: 12", "12"),
        ("the result is 3 and then 5", "5"),
        ("Answer: -4.", "-4"),
        ("Answer: 1,234", "1234"),
        ("Answer: 3.75 apples", "3.75"),
        ("I think 3. Answer: 8 because 8 > 7", "8"),
        ("Answer: 5\nAnswer: 6", "6"),
        ("Answer: forty two\nmore text", "forty two"),
        ("Answer:", None),
        ("no numbers here", None),
        ("", None),
        ("7", "7"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# An answer that states an equation is its result, not its first operand (a first-number rule reads 9 in "9 * 6 =
# 54"). Each row's answer was written by hand. The "real" rows
# are completions of the embedded model (SmolLM2-135M-Instruct, the scripts' default prompts on assets/data arith_1d,
# add_2t2d and gsm8k_100, sampled with HF generate; docs: quoted in docs/ppo_prm_clip.md), whole.
EXTRACTION_TABLE = [
    ("Answer: 9 * 6 = 54", "54"),
    ("Answer: 3 + 4 = 7.", "7"),
    ("Answer: 9 x 6 = 54", "54"),
    ("Answer: 9 times 6 = 54", "54"),
    ("Answer: 50% of 10 = 5", "5"),
    ("Answer: 1 - 4 = -3", "-3"),
    ("Answer: 4 − 9 = −5", "-5"),  # a Unicode minus
    ("Answer: (2 + 3) * 4 = 20", "20"),
    ("Answer: 1,000 + 234 = 1,234", "1234"),
    ("Answer: 12 / 4 = 3", "3"),
    ("Answer: \\frac{3}{4} + \\frac{1}{4} = 1", "1"),
    ("Answer: 46 + 5 = 46 + 5 = 51", "51"),
    ("Answer: 9 x 6 = 54 = 50 + 4", "54"),  # the last side that is a lone number
    ("Answer: The total is 9 * 6 = 54 apples.", "54"),
    ("Answer: 12 + 7 = 19 and 5 + 5 = 10", "19"),  # the equation that starts at the number
    ("2 + 2 = 4\nAnswer: 4 + 1 = 5", "5"),
    ("Answer: −3", "-3"),
    ("Answer: 54 (9 * 6 = 54)", "54"),  # the answer, then its working
    ("Answer: 12. Check: 5 + 8 = 13", "12"),  # a later equation is not the answer
    ("Answer: 5 = 2 + 3", "5"),
    ("Answer: x = 5", "5"),
    ("Answer: 9 * 6 =", "9"),  # no result: the first number
    ("Answer: 3\n4 + 5 = 9", "3"),  # the equation is on another line
    ("Answer: -3", "-3"),
    ("Answer: 1,234", "1234"),
    ("Answer: 3/4", "3/4"),
    ("3 * 4 = 12", "12"),  # no 'Answer:': the last number, as before
    ("The final answer is 141.", "141"),  # real
    ("62 + 50 =", "50"),  # real
    ("2 + 87 = 2 * 7 = 19.", "19"),  # real
    ("57 + 38 = 133", "133"),  # real
    ("10.", "10"),  # real
    ("4.5", "4.5"),  # real
    ("59\n```", "59"),  # real
    ("A simple equation: 3 + 24 = x\nSince the answer is 24, A = 3", "3"),  # real
    ("Answer: 5", "5"),  # real
    (
        "Let's break down the calculation:\n\n4 + 3 = 7\n\n7 simplifies to 11. So, the answer is:\nAnswer: 7",
        "7",
    ),  # real
    ("1 - 4 = 3", "3"),  # real
    ("Solve it step by step:\n\n1 - 4 = -2", "-2"),  # real
    (
        "1. 1 - 4 = 5.\n2. 5 * 1 = 5.\n3. 5 * 1 = 5.\n\nThis is a classic example of a simple equation with 5 steps.",
        "5",
    ),  # real
    ("2 is the final answer.", "2"),  # real
    ("Yes, you have already simplified the calculation.", None),  # real
    ("5 + 0 = 1\n", "1"),  # real
    ("4 - 5 = 2\nA. 4 is the number that you're given and 5 is the answer.", "5"),  # real
    ("The answer to the arithmetic problem of 0 + 4 = 4 is 4.", "4"),  # real
    ("There is an answer for this question: 83 + 34 = 117", "117"),  # real
    ("1. 5 + 0 = 5\n2. Add 0 to both sides of the equation: (5 + 0) = 5\n\nSo, the answer is 5.", "5"),  # real
    (
        "1. 9 * 1 = 9 \n2. 9 * 1 = 9 \n\nSo here's the step-by-step solution using a step-by-step calculator:\n\n"
        "1. 9 x 1 = 9\n\nA: 9 + 1 = 10\n\n2. 9 + 1 = 2\n\nA: 9 + 1 = 2\n\n3. 9 + ",
        "9",
    ),  # real, cut at the token limit
    (
        "One total episode of the favorite show is 104 minutes. 7 hours of TV in all must be 9 hours (one day) and 7 "
        "hours x 1 day = 7 hours of TV in all.\n\nSo, 7 hours of TV in all must be 30 * 7 = 180 days of TV in all."
        "\n\nThe answer is '30 * 7 = 180 days'",
        "180",
    ),  # real
    ("0 + 4 = 4.\n\nAnswer: 4.", "4"),  # real (docs)
]


@pytest.mark.parametrize("text,expected", EXTRACTION_TABLE)
def test_extract_answer_table(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "answer,expected",
    [("42", "42"), (42, "42"), ("Some steps\n#### 1,234", "1234"), ("#### 19", "19"), (" 7 ", "7"), ("-3", "-3")],
)
def test_gold_answer(answer, expected):
    assert _gold_answer(answer) == expected


@pytest.mark.parametrize(
    "prediction,gold,expected",
    [
        ("7", "7", 1.0),
        ("8", "7", 0.0),
        ("7.0", "7", 1.0),
        ("0.5", "1/2", 1.0),
        ("1234", _gold_answer("#### 1,234"), 1.0),
        ("-4", "-4", 1.0),
        ("4", "-4", 0.0),
        (None, "7", 0.0),
        ("forty two", "42", 0.0),
    ],
)
def test_verify_answer(prediction, gold, expected):
    assert verify_answer(prediction, gold) == expected


def test_compute_rewards_with_and_without_format_reward():
    completions = ["Answer: 7", "the sum is 7", "Answer: 8", "nothing", "Answer:", "answer: 7"]
    golds = ["7"] * len(completions)
    rewards, correct, formatted = compute_rewards(completions, golds, 0.5)
    assert correct.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert formatted.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert rewards.tolist() == [1.5, 1.0, 0.5, 0.0, 0.0, 1.0]
    assert all(t.dtype.is_floating_point and t.shape == (6,) for t in (rewards, correct, formatted))
    rewards0, correct0, _ = compute_rewards(completions, golds, 0.0)
    assert torch.equal(rewards0, correct0)


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        ("Answer: 12", "12", 1.0),
        ("Answer: 0.5", "1/2", 1.0),
        ("Answer: 1/2", "1/2", 1.0),
        ("Answer: \\frac{1}{2}", "1/2", 1.0),
        ("Answer: .5", "0.5", 1.0),
        ("Answer: .5", "5", 0.0),
    ],
)
def test_compute_rewards_non_integer_answers(completion, gold, expected):
    assert compute_rewards([completion], [gold], 0.0)[1].tolist() == [expected]


# response_logprobs (the kit's _left_pad builds the batch)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_left_padded_batch_matches_each_alone(tiny_model_dir, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompt_lengths, response_lengths, width = [3, 9, 6, 1], [5, 2, 5, 4], 5
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in prompt_lengths]
    responses = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in response_lengths]
    pad = 2
    prompt_ids, prompt_mask = _left_pad(prompts, pad)
    response_ids = torch.full((4, width), pad)
    response_attention = torch.zeros((4, width), dtype=torch.long)
    for i, r in enumerate(responses):
        response_ids[i, : len(r)] = torch.tensor(r)
        response_attention[i, : len(r)] = 1
    input_ids = torch.cat([prompt_ids, response_ids], 1)
    attention_mask = torch.cat([prompt_mask, response_attention], 1)
    with torch.no_grad():
        batched, logits = response_logprobs(model, input_ids, attention_mask, prompt_ids.shape[1], temperature)
        assert batched.shape == (4, width) and logits.shape == (4, width, model.config.vocab_size)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            alone_ids = torch.tensor([p + r])
            alone, _ = response_logprobs(model, alone_ids, torch.ones_like(alone_ids), len(p), temperature)
            # Independent check of the alone value: a plain forward pass, log-softmax of logits / temperature.
            plain = torch.log_softmax(model(alone_ids).logits[0, len(p) - 1 : -1].double() / temperature, -1)
            expected = [plain[t, tok].item() for t, tok in enumerate(r)]
            assert alone[0].tolist() == pytest.approx(expected, abs=1e-5)
            torch.testing.assert_close(batched[i, : len(r)], alone[0], atol=1e-5, rtol=0)


def test_fixed_logprobs_by_micro_batch_equals_one_batch(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids, attention = _left_pad([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], 0)
    ids = torch.cat([ids, torch.randint(20, 200, (4, 3), generator=torch.Generator().manual_seed(0))], 1)
    attention = torch.cat([attention, torch.ones(4, 3, dtype=torch.long)], 1)
    whole = response_logprobs(model, ids, attention, 4, 0.7)[0]
    assert torch.allclose(fixed_logprobs(response_logprobs, model, ids, attention, 4, 0.7, 3), whole, atol=1e-6)


def test_module_exposes_main_and_args():
    assert callable(grpo_math.main)
    assert grpo_math.Config().num_generations >= 2


# select_groups (DAPO dynamic sampling)


def select_groups_reference(rewards, group_size, num_groups):
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    informative = [g for g, values in enumerate(groups) if any(v != values[0] for v in values)]
    uniform = [g for g, values in enumerate(groups) if all(v == values[0] for v in values)]
    kept = sorted((informative + uniform)[:num_groups])
    return [g * group_size + j for g in kept for j in range(group_size)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_sampled,group_size,num_groups", [(6, 4, 2), (5, 2, 5), (8, 8, 1), (3, 3, 3)])
def test_select_groups_matches_loop(seed, num_sampled, group_size, num_groups):
    rng = random.Random(seed)
    # Binary rewards with many all-equal groups, and some non-binary values (a format bonus).
    rewards = [
        rng.choice([0.0, 0.0, 1.0, 1.1]) if rng.random() < 0.5 else 0.0 for _ in range(num_sampled * group_size)
    ]
    got = select_groups(torch.tensor(rewards), group_size, num_groups).tolist()
    assert got == select_groups_reference(rewards, group_size, num_groups)
    assert len(got) == num_groups * group_size


def test_select_groups_prefers_groups_with_a_signal_by_hand():
    # Groups: [1, 1], [0, 1], [0, 0], [1, 0]; two are kept: the 2nd and the 4th, in their original order.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert select_groups(rewards, 2, 2).tolist() == [2, 3, 6, 7]
    # Three kept: the two with a signal, then the first all-equal group.
    assert select_groups(rewards, 2, 3).tolist() == [0, 1, 2, 3, 6, 7]


# The GRPO variants: GSPO (sequence_mean), CISPO, masked importance sampling, DAPO's overlong penalty, entropy bonus


def test_sequence_mean_matches_loop():
    for seed in SEEDS:
        lp, mask = rand((4, 6), seed), rand_mask((4, 6), seed)
        got = grpo_math.sequence_mean(lp, mask)
        for b in range(4):
            real = [lp[b, t].item() for t in range(6) if mask[b, t]]
            expected = sum(real) / max(1, len(real))
            assert [got[b, t].item() for t in range(6)] == pytest.approx([expected] * 6, rel=1e-12, abs=1e-15)


def test_gspo_with_length_one_sequences_is_the_token_ratio():
    """A sequence of one token: its geometric-mean ratio is that token's ratio, and so is its clipped loss."""
    lp, old, adv = rand((5, 4), 1, 0.4), rand((5, 4), 2, 0.4), rand((5,), 3)
    mask = torch.zeros(5, 4, dtype=torch.float64)
    mask[torch.arange(5), torch.tensor([0, 3, 1, 2, 0])] = 1.0
    seq = grpo_math.sequence_mean
    seq_loss, seq_ratio = clipped_surrogate(seq(lp, mask), seq(old, mask), adv, 0.2, 0.28)
    token_loss, token_ratio = clipped_surrogate(lp, old, adv, 0.2, 0.28)
    real = mask > 0
    assert torch.equal(seq_ratio[real], token_ratio[real]) and torch.equal(seq_loss[real], token_loss[real])


@pytest.mark.parametrize("cap", [0.8, 1.2, 5.0])
def test_cispo_surrogate_matches_loop_and_keeps_every_gradient(cap):
    for seed in SEEDS:
        lp = rand((3, 5), seed, 0.3).requires_grad_()
        old, adv = lp.detach() + rand((3, 5), seed + 1, 0.3), rand((3,), seed + 2)
        loss, ratio = grpo_math.cispo_surrogate(lp, old, lp, adv, cap)
        loss.sum().backward()
        for b in range(3):
            for t in range(5):
                r = math.exp(lp[b, t].item() - old[b, t].item())
                weight = min(r, cap)
                assert ratio[b, t].item() == pytest.approx(r, rel=1e-12)
                assert loss[b, t].item() == pytest.approx(-weight * adv[b].item() * lp[b, t].item(), rel=1e-12)
                # The weight is detached: d loss / d log pi = -min(r, cap) * A, never 0 (PPO's clip would drop it).
                assert lp.grad[b, t].item() == pytest.approx(-weight * adv[b].item(), rel=1e-12)


def test_cispo_with_an_infinite_cap_is_reinforce_with_the_importance_weight():
    """cap = inf: the gradient of -sg(r) * A * log pi is -r * A * d log pi, that of the unclipped -r * A."""
    lp, old, adv = rand((4, 6), 5, 0.3), rand((4, 6), 6, 0.3), rand((4,), 7)
    cispo, plain = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    grpo_math.cispo_surrogate(cispo, old, cispo, adv, math.inf)[0].sum().backward()
    (-torch.exp(plain - old) * adv.unsqueeze(1)).sum().backward()
    torch.testing.assert_close(cispo.grad, plain.grad, rtol=1e-12, atol=0)


def test_overlong_penalty_matches_loop_zero_below_the_buffer_and_minus_one_at_the_limit():
    for response_length, buffer in ((64, 16), (10, 1), (12, 11)):
        lengths = torch.arange(response_length + 1)
        got = grpo_math.overlong_penalty(lengths, response_length, buffer)
        for n in range(response_length + 1):
            expected = 0.0 if n <= response_length - buffer else (response_length - buffer - n) / buffer
            assert got[n].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
        assert (got[: response_length - buffer + 1] == 0).all() and got[response_length].item() == -1.0


def variant_loss_reference(lp, old, sampler, adv, mask, logits, args, tokens):
    """grpo_loss with its variants (GSPO's sequence-level ratios, CISPO, TIS, MIS, the entropy bonus), token_mean
    and no KL, token by token in float64."""
    rows, width = len(lp), len(lp[0])

    def seq(x, b):  # the sequence's mean log-prob over its real tokens
        real = [x[b][t] for t in range(width) if mask[b][t]]
        return sum(real) / max(1, len(real))

    total = 0.0
    for b in range(rows):
        for t in range(width):
            if not mask[b][t]:
                continue
            if args.importance_sampling_level == "sequence":
                log_ratio, sampler_log_ratio = seq(lp, b) - seq(old, b), seq(old, b) - seq(sampler, b)
            else:
                log_ratio, sampler_log_ratio = lp[b][t] - old[b][t], old[b][t] - sampler[b][t]
            real = [t2 for t2 in range(width) if mask[b][t2]]
            if args.mis_level == "sequence":  # the ratio the mask reads: the sequence's likelihood ratio
                mis_log_ratio = sum(old[b][t2] - sampler[b][t2] for t2 in real)
            elif args.mis_level == "geometric":  # its geometric mean
                mis_log_ratio = seq(old, b) - seq(sampler, b)
            else:
                mis_log_ratio = old[b][t] - sampler[b][t]
            r, w, m = math.exp(log_ratio), math.exp(sampler_log_ratio), math.exp(mis_log_ratio)
            if args.cispo_cap is None:
                clipped = min(max(r, 1 - args.clip_eps_low), 1 + args.clip_eps_high)
                surrogate = -min(r * adv[b], clipped * adv[b])
            else:
                surrogate = -min(r, args.cispo_cap) * adv[b] * lp[b][t]
            if args.mis_range is None:
                surrogate *= min(w, args.tis_cap) if args.tis_cap else 1.0
            else:  # IcePop: a kept token carries its ratio, truncated only if a cap is set
                kept = args.mis_range[0] <= m <= args.mis_range[1]
                surrogate *= (min(m, args.tis_cap) if args.tis_cap else m) if kept else 0.0
            z = [math.exp(v) for v in logits[b][t]]
            entropy = -sum(p / sum(z) * math.log(p / sum(z)) for p in z)
            total += surrogate - args.entropy_coef * entropy
    return total / tokens


# A sequence's likelihood ratio, a product, spreads wider than a token's ratio or their geometric mean.
MIS_RANGES = {"token": (0.6, 1.6), "sequence": (0.2, 5.0), "geometric": (0.6, 1.6)}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mis_level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("cispo_cap", [None, 1.1])
@pytest.mark.parametrize("tis_cap", [0.0, 1.5])
def test_grpo_loss_with_the_variants_matches_loop(level, mis_level, cispo_cap, tis_cap):
    from types import SimpleNamespace

    args = SimpleNamespace(
        clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=tis_cap, beta=0.0, kl_estimator="k3", loss_type="token_mean",
        response_length=6, importance_sampling_level=level, cispo_cap=cispo_cap, mis_range=MIS_RANGES[mis_level],
        mis_level=mis_level, entropy_coef=0.05,
    )  # fmt: skip
    for seed in SEEDS:
        lp = -rand((4, 6), seed).abs()
        old = lp + rand((4, 6), seed + 1, 0.3)
        # Some tokens (and whole sequences) outside mis_range, some weights above tis_cap.
        sampler = old + rand((4, 6), seed + 3, 0.5) + rand((4, 1), seed + 6, 0.6)
        adv, mask, logits = rand((4,), seed + 4), rand_mask((4, 6), seed), rand((4, 6, 5), seed + 5)
        tokens = mask.sum() + 3
        loss, stats = grpo_loss(lp, old, None, sampler, adv, mask, logits, tokens, 4, **loss_flags(args))
        expected = variant_loss_reference(
            *map(tolist2, (lp, old, sampler)), adv.tolist(), tolist2(mask), logits.tolist(), args, tokens.item()
        )
        assert loss.item() == pytest.approx(expected, rel=1e-10)
        assert 0 < stats["objective/mis_masked_fraction"] < 1


def gspo_objective_reference(lp, old, adv, mask, eps_low, eps_high):
    """GSPO's loss (Zheng et al., arXiv 2507.18071, Eq. 5-7), sequence by sequence in float64: s_i = (pi(y_i) /
    pi_old(y_i)) ** (1 / |y_i|), loss = -mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)."""
    total = 0.0
    for b in range(len(lp)):
        real = [t for t in range(lp.shape[1]) if mask[b, t] > 0]
        s = torch.exp(sum(lp[b, t] - old[b, t] for t in real) / len(real))
        total = total - torch.min(s * adv[b], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[b])
    return total / len(lp)


def test_gspo_by_one_flag_gives_the_papers_gradient():
    """--importance_sampling_level sequence alone, parsed as the command line is: GSPO's clip range, its mean over
    sequences and no KL term (beta 0: the paper's objective has none, TRL's GSPO recipe sets it to 0) come with it, so
    the loss and the gradient are the paper's (with the token mean a sequence would weigh by its length; a 0.2 clip
    would not bind; beta 0.04 would add a KL to the reference)."""
    import tyro

    with pytest.warns(UserWarning, match="GSPO's defaults.*'beta': 0.0"):  # as check_args resolves them
        args = grpo_math.resolve_defaults(tyro.cli(grpo_math.Config, args=["--importance_sampling_level", "sequence"]))
    assert (args.clip_eps_low, args.clip_eps_high, args.loss_type, args.beta) == (3e-4, 4e-4, "seq_mean_token_mean", 0)
    clipped_count = 0
    for seed in SEEDS:
        lp, adv = -rand((6, 7), seed).abs(), rand((6,), seed + 1)
        mask = rand_mask((6, 7), seed)
        mask[:, 0] = 1  # every sequence has a token
        old = lp + rand((6, 7), seed + 2, 1e-3)  # sequence ratios within 1e-3 of 1: some clipped, some not
        ref = lp + rand((6, 7), seed + 3, 0.3)  # a reference main() would not load: a KL term would show
        x = lp.clone().requires_grad_()
        loss = grpo_loss(x, old, ref, None, adv, mask, None, mask.sum(), 6, **loss_flags(args))[0]
        loss.backward()
        y = lp.clone().requires_grad_()
        expected = gspo_objective_reference(y, old, adv, mask, 3e-4, 4e-4)
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-13)
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-13)
        ratios = torch.exp(grpo_math.masked_mean(lp - old, mask, dim=1))
        clipped = ((ratios < 1 - 3e-4) & (adv < 0)) | ((ratios > 1 + 4e-4) & (adv > 0))
        clipped_count += int(clipped.sum())
    assert 0 < clipped_count < 6 * len(SEEDS), "some sequences are clipped, some not"


def test_defaults_resolve_once_and_a_set_value_stays():
    resolve = lambda **kw: grpo_math.resolve_defaults(grpo_math.Config(**kw))
    plain = resolve()
    assert (plain.clip_eps_low, plain.clip_eps_high, plain.loss_type, plain.tis_cap) == (0.2, 0.2, "token_mean", 2.0)
    assert plain.beta == 0.04
    gspo = resolve(importance_sampling_level="sequence", clip_eps_high=0.28, loss_type="token_mean", beta=0.01)
    assert (gspo.clip_eps_low, gspo.clip_eps_high, gspo.loss_type, gspo.beta) == (3e-4, 0.28, "token_mean", 0.01)
    assert resolve(importance_sampling_level="sequence").beta == 0.0 and resolve(beta=0.0).beta == 0.0
    assert resolve(mis_range=(0.5, 5.0)).tis_cap == 0.0  # IcePop: the kept tokens carry their ratio
    assert resolve(mis_range=(0.5, 5.0), tis_cap=1.5).tis_cap == 1.5
    assert resolve(tis_cap=0.0).tis_cap == 0.0  # off
    again = grpo_math.resolve_defaults(resolve(mis_range=(0.5, 5.0)))
    assert again.tis_cap == 0.0, "resolving twice (a --resume of the recorded config) changes nothing"


def test_masked_importance_weights_match_loop():
    """IcePop: a kept token weighs its ratio pi / pi_sampler (min(ratio, cap) with a cap), a dropped one 0."""
    for seed in SEEDS:
        lp, sampler = -rand((3, 5), seed).abs(), -rand((3, 5), seed + 1).abs()
        for low, high, cap in ((0.5, 5.0, None), (0.5, 5.0, 2.0), (0.2, 1.1, None)):
            got = grpo_math.masked_importance_weights(lp - sampler, low, high, cap)
            for b in range(3):
                for t in range(5):
                    r = math.exp(lp[b, t].item() - sampler[b, t].item())
                    expected = (min(r, cap) if cap else r) if low <= r <= high else 0.0
                    assert got[b, t].item() == pytest.approx(expected, rel=1e-12)
        everything = grpo_math.masked_importance_weights(lp - sampler, 0.0, math.inf)
        torch.testing.assert_close(everything, torch.exp(lp - sampler), rtol=1e-12, atol=0)  # nothing masked


def mis_weights_reference(lp, sampler, mask, level, low, high, cap):
    """Masked IS weights token by token in float64, at verl's rollout_is_level: the token's ratio, its sequence's
    likelihood ratio prod_t pi / pi_sampler (TRL's sequence_mask / sequence_truncate, verl's sequence) or that
    product's |y|-th root (verl's geometric); kept within [low, high], then min(ratio, cap) with a cap."""
    weights = []
    for b in range(len(lp)):
        real = [t for t in range(len(lp[b])) if mask[b][t]]
        product = 1.0
        for t in real:
            product *= math.exp(lp[b][t] - sampler[b][t])
        row = []
        for t in range(len(lp[b])):
            if level == "token":
                r = math.exp(lp[b][t] - sampler[b][t])
            else:
                r = product if level == "sequence" else product ** (1 / max(1, len(real)))
            row.append((min(r, cap) if cap else r) if low <= r <= high else 0.0)
        weights.append(row)
    return weights


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mis_weights_at_each_level_match_loop(level):
    """--mis_level token / sequence / geometric: the mask and the weight read the level's ratio, for mask ranges
    and caps that keep some sequences and drop others, and [0, inf) with a cap (TRL's sequence_truncate)."""
    for seed in SEEDS:
        lp, mask = -rand((4, 6), seed).abs(), rand_mask((4, 6), seed)
        sampler = lp + rand((4, 6), seed + 1, 0.3) + rand((4, 1), seed + 2, 0.4)
        for low, high, cap in ((0.6, 1.6, None), (0.5, 3.0, 1.5), (0.0, math.inf, 1.2), (0.0, 2.0, None)):
            log_ratio = grpo_math.importance_log_ratio(lp, sampler, mask, level)
            got = grpo_math.masked_importance_weights(log_ratio, low, high, cap)
            expected = mis_weights_reference(*map(tolist2, (lp, sampler, mask)), level, low, high, cap)
            for b in range(4):
                for t in range(6):
                    if mask[b, t]:
                        assert got[b, t].item() == pytest.approx(expected[b][t], rel=1e-12, abs=1e-300)


def test_one_token_in_64_a_thousand_times_off_is_masked_by_the_product_kept_by_the_geometric_mean():
    """A 64-token sequence with one token 1000x likelier under the sampler (ratio 1e-3, the others 1) has the
    likelihood ratio 1e-3, which TRL's sequence_mask and verl's sequence level mask; its geometric mean 1000^(-1/64) =
    0.898 stays in [0.5, 2], so verl's geometric level keeps every token at weight 0.898. The other way round (the
    token 1000x likelier under the trainer) the product 1000 is masked, the geometric mean 1.114 kept."""
    mask = torch.ones(1, 64, dtype=torch.float64)
    for sign, geometric in ((-1, 0.8977), (1, 1.1139)):
        sampler = -torch.full((1, 64), 2.0, dtype=torch.float64)
        lp = sampler.clone()
        lp[0, 17] += sign * math.log(1000.0)
        weights = {
            level: grpo_math.masked_importance_weights(
                grpo_math.importance_log_ratio(lp, sampler, mask, level), 0.5, 2.0
            )
            for level in ("token", "sequence", "geometric")
        }
        assert (weights["sequence"] == 0).all(), "the product (TRL, verl's sequence) masks the whole sequence"
        assert weights["geometric"][0].tolist() == pytest.approx([1000.0 ** (sign / 64)] * 64, rel=1e-12)
        assert weights["geometric"][0, 0].item() == pytest.approx(geometric, abs=1e-4)
        assert weights["token"][0, 17] == 0 and (weights["token"][0, :17] == 1).all(), "IcePop drops the one token"
        for level in ("token", "sequence", "geometric"):
            expected = mis_weights_reference(*map(tolist2, (lp, sampler, mask)), level, 0.5, 2.0, None)
            assert weights[level][0].tolist() == pytest.approx(expected[0], rel=1e-12)


def test_the_sequence_ratio_is_summed_in_log_space():
    """A 400-token sequence whose tokens are each 1.3x likelier under the trainer: the product 1.3^400 = 1e45 is past
    float32's range, but its log (105) is not; the mask drops it and no inf or NaN reaches the weights."""
    lp, mask = torch.zeros(1, 400), torch.ones(1, 400)
    log_ratio = grpo_math.importance_log_ratio(lp, lp - math.log(1.3), mask, "sequence")
    assert log_ratio[0, 0].item() == pytest.approx(400 * math.log(1.3), rel=1e-5)
    weights = grpo_math.masked_importance_weights(log_ratio, 0.5, 2.0)
    assert (weights == 0).all() and torch.isfinite(weights).all()
    assert (grpo_math.masked_importance_weights(log_ratio, 0.0, math.inf, 3.0) == 3.0).all()  # sequence_truncate


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean"])
def test_on_policy_gspo_and_cispo_give_grpos_gradient(loss_type):
    """On the first pass over a fresh batch (ratio 1: one pass, one minibatch, the default), GSPO's sequence ratio and
    CISPO's weight are 1: their gradients are GRPO's. They differ only once updates go off-policy."""
    from types import SimpleNamespace

    lp, adv, mask = -rand((4, 6), 11).abs(), rand((4,), 12), rand_mask((4, 6), 13)
    grads = []
    for variant in (dict(), dict(importance_sampling_level="sequence"), dict(cispo_cap=1.28)):
        args = SimpleNamespace(
            clip_eps_low=3e-4, clip_eps_high=4e-4, tis_cap=None, beta=0.0, kl_estimator="k3", loss_type=loss_type,
            response_length=6, **{**NO_VARIANT, **variant},
        )  # fmt: skip
        x = lp.clone().requires_grad_()
        grpo_loss(x, x.detach(), None, None, adv, mask, None, mask.sum(), 4, **loss_flags(args))[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-12, atol=1e-15)


def test_token_mean_is_nan_without_tokens_and_the_averages_leave_it_out():
    """A micro-batch whose completions all left the loss (--overlong_filtering) has no statistics: NaN, which the
    averages over micro-batches and processes skip (all NaN: NaN)."""
    values, empty = rand((2, 3), 0), torch.zeros(2, 3, dtype=torch.float64)
    assert math.isnan(grpo_math.token_mean(values, empty))
    assert grpo_math.token_mean(values, torch.ones(2, 3)) == pytest.approx(values.mean().item(), rel=1e-12)
    assert grpo_math._reduce_values("policy/ratio", [1.0, math.nan, 0.5]) == 0.75
    assert grpo_math._reduce_values("x_max", [math.nan, 2.0]) == 2.0 and math.isnan(
        grpo_math._reduce_values("x", [math.nan])
    )


def test_an_unknown_importance_level_is_refused_not_read_as_geometric():
    """Since --mis_level defaults to None, a None reaching importance_log_ratio must not fall through to the
    geometric mean, as any name but token and sequence did."""
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    for level in (None, "geo", "Sequence"):
        with pytest.raises(ValueError, match="unknown level"):
            grpo_math.importance_log_ratio(lp, lp, mask, level)
