"""dpo_online.py: its loss and pair assignment against plain loops, and end-to-end runs of the tiny policy judged by
a tiny reward model."""

import json
import math
import os

import fixed_rollout
import pytest
import torch
from conftest import SMOLLM2_DIR, assert_eval_ref_perplexity_is_worked_out_here, read_metrics, train_lines
from safetensors.torch import load_file

import dpo_online


def reference_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type):
    """The loss of each pair by its formula, one pair at a time in Python floats."""
    losses = []
    for c, r, rc, rr in zip(chosen.tolist(), rejected.tolist(), ref_chosen.tolist(), ref_rejected.tolist()):
        h = (c - rc) - (r - rr)
        if loss_type == "sigmoid":
            x = beta * h  # -log sigmoid(x) = log(1 + exp(-x)), written stably for both signs
            losses.append(math.log1p(math.exp(-x)) if x >= 0 else -x + math.log1p(math.exp(x)))
        else:
            losses.append((h - 1 / (2 * beta)) ** 2)
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 3.0])
def test_dpo_loss_matches_its_formula_on_random_pairs(loss_type, beta):
    generator = torch.Generator().manual_seed(int(beta * 100))
    # Summed log-probs of responses of a few dozen tokens: large negative numbers, close to each other.
    chosen, rejected, ref_chosen, ref_rejected = (
        -40 + 15 * torch.randn(64, generator=generator, dtype=torch.float64) for _ in range(4)
    )
    losses = dpo_online.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type)
    expected = reference_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type)
    assert losses.shape == (64,) and losses.dtype == torch.float64
    torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)


def test_dpo_loss_at_the_reference():
    """Policy == reference: h = 0, so sigmoid gives log 2 and IPO gives (1 / (2 beta))^2, whatever the log-probs."""
    logps = torch.tensor([-3.0, -17.5, -0.25])
    other = torch.tensor([-9.0, -1.0, -42.0])
    sigmoid = dpo_online.dpo_loss(logps, other, logps, other, 0.1, "sigmoid")
    assert sigmoid.tolist() == [torch.tensor(math.log(2)).item()] * 3
    ipo = dpo_online.dpo_loss(logps, other, logps, other, 0.1, "ipo")
    torch.testing.assert_close(ipo, torch.full((3,), 25.0))
    with pytest.raises(ValueError, match="loss_type"):
        dpo_online.dpo_loss(logps, other, logps, other, 0.1, "hinge")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_falls_when_the_chosen_logp_rises(loss_type):
    generator = torch.Generator().manual_seed(3)
    ref_chosen, ref_rejected = -20 + torch.randn(16, generator=generator), -20 + torch.randn(16, generator=generator)
    chosen = ref_chosen.clone().requires_grad_(True)  # at the reference: IPO's h = 0 is below its target 1 / (2 beta)
    rejected = ref_rejected.clone().requires_grad_(True)
    losses = dpo_online.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.1, loss_type)
    losses.sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    # A step along the gradient: the chosen completion more likely, the rejected one less, every pair's loss falls.
    with torch.no_grad():
        after = dpo_online.dpo_loss(chosen + 0.5, rejected - 0.5, ref_chosen, ref_rejected, 0.1, loss_type)
    assert (after < losses.detach()).all()


def reference_assignment(scores, has_eos, penalty):
    """(chosen, rejected, tie, judged) per pair by a loop. With a penalty a finished completion beats one without EOS,
    which is judged the penalty, or its finished partner's score where that is lower; two without EOS both get the
    penalty. Otherwise (and always without a penalty) the higher score wins, equal scores are a tie."""
    scores, has_eos = scores.tolist(), has_eos.tolist()
    chosen, rejected, tie, judged = [], [], [], []
    for i in range(0, len(scores), 2):
        (a, b), (a_ends, b_ends) = scores[i : i + 2], has_eos[i : i + 2]
        if penalty is None:
            a_ends = b_ends = True
        judged_a = a if a_ends else min(penalty, b) if b_ends else penalty
        judged_b = b if b_ends else min(penalty, a) if a_ends else penalty
        second = b_ends if a_ends != b_ends else judged_b > judged_a
        chosen.append(i + 1 if second else i)
        rejected.append(i if second else i + 1)
        tie.append(a_ends == b_ends and judged_a == judged_b)
        judged += [judged_a, judged_b]
    return chosen, rejected, tie, judged


def test_assign_preferences_by_hand():
    #                   pair 0       pair 1      pair 2        pair 3       pair 4
    scores = torch.tensor([0.3, 0.7, 2.0, -1.0, 5.0, 0.1, 4.0, 6.0, 0.5, 0.5])
    has_eos = torch.tensor([True, True, True, True, False, True, False, False, True, True])
    chosen, rejected, tie, judged = dpo_online.assign_preferences(scores, has_eos, -1.0)
    assert chosen.tolist() == [1, 2, 5, 6, 8]
    assert rejected.tolist() == [0, 3, 4, 7, 9]
    # pair 2: the higher score has no EOS and loses; pair 3: neither has an EOS, both get the penalty: a tie;
    # pair 4: equal scores, a tie.
    assert tie.tolist() == [False, False, False, True, True]
    assert torch.equal(judged, torch.tensor([0.3, 0.7, 2.0, -1.0, -1.0, 0.1, -1.0, -1.0, 0.5, 0.5]))
    # Without a penalty the judge's scores stand: pair 2 goes to the higher score, pair 3 is no longer a tie.
    chosen, rejected, tie, judged = dpo_online.assign_preferences(scores, has_eos, None)
    assert chosen.tolist() == [1, 2, 4, 7, 8] and rejected.tolist() == [0, 3, 5, 6, 9]
    assert tie.tolist() == [False, False, False, False, True]
    assert torch.equal(judged, scores)


@pytest.mark.parametrize("penalty", [None, -1.0, 0.0])
def test_assign_preferences_matches_a_loop(penalty):
    generator = torch.Generator().manual_seed(7)
    scores = torch.randint(-2, 3, (200,), generator=generator).float()  # few values: many ties
    has_eos = torch.rand(200, generator=generator) < 0.7
    chosen, rejected, tie, judged = dpo_online.assign_preferences(scores, has_eos, penalty)
    expected = reference_assignment(scores, has_eos, penalty)
    assert (chosen.tolist(), rejected.tolist(), tie.tolist(), judged.tolist()) == expected
    assert 0 < tie.sum() < len(tie)
    assert (judged[chosen] >= judged[rejected]).all()
    assert sorted(chosen.tolist() + rejected.tolist()) == list(range(200))  # every completion used once


def random_ensemble_scores(generator, K, ensemble, num):
    """An ensemble's scores of num completions: K members on their own scales and offsets (as trained members are:
    score std 0.96 to 1.73, docs/ppo_rlhf.md), combined by ensemble_reward; float64."""
    scales = 0.5 + 1.5 * torch.rand(K, 1, generator=generator, dtype=torch.float64)
    offsets = torch.randn(K, 1, generator=generator, dtype=torch.float64)
    members = offsets + scales * torch.randn(K, num, generator=generator, dtype=torch.float64)
    return dpo_online.ensemble_reward(members, ensemble, 1.0)


@pytest.mark.parametrize("ensemble", ["mean", "wco", "uwo"])
@pytest.mark.parametrize("K", [1, 5])
@pytest.mark.parametrize("penalty", [-1.0, 0.0])
def test_a_completion_without_eos_never_wins_against_a_finished_one(ensemble, K, penalty):
    """Under an ensemble, whose scores go below the missing-EOS penalty (WCO's most of all), the fixed
    penalty let a truncated completion beat a finished one of the same prompt (online DPO with WCO: on 7-10% of
    steps). Whatever the scores, the finished one is chosen and judged no lower; two finished ones go by score."""
    generator = torch.Generator().manual_seed(K * 10 + len(ensemble))
    scores = random_ensemble_scores(generator, K, ensemble, 2000)
    has_eos = torch.rand(2000, generator=generator) < 0.6
    chosen, rejected, tie, judged = dpo_online.assign_preferences(scores, has_eos, penalty)
    mixed = has_eos[0::2] != has_eos[1::2]  # [P] one finished, one not
    assert (has_eos[chosen][mixed]).all() and not tie[mixed].any()
    assert (judged[chosen] >= judged[rejected]).all()
    # The inputs test something: the fixed penalty alone would have put the unfinished one first in many pairs.
    fixed = dpo_online.penalize_missing_eos(scores, has_eos, penalty).view(-1, 2)
    assert ((fixed[:, 1] > fixed[:, 0]) != has_eos[1::2])[mixed].sum() > 20
    both = has_eos[0::2] & has_eos[1::2]
    assert torch.equal(chosen[both] % 2 == 1, scores.view(-1, 2)[both].argmax(1) == 1)
    assert (chosen.tolist(), rejected.tolist(), tie.tolist(), judged.tolist()) == reference_assignment(
        scores, has_eos, penalty
    )


def test_one_reward_model_keeps_the_fixed_penalty_choices_where_they_kept_the_invariant():
    """With one reward model whose finished completions score above the penalty (where the fixed penalty already
    ranked every finished completion first), the choices, ties and judged scores are exactly the fixed penalty's."""
    generator = torch.Generator().manual_seed(54)
    scores = random_ensemble_scores(generator, 1, "mean", 2000)
    has_eos = torch.rand(2000, generator=generator) < 0.6
    scores = torch.where(has_eos, scores.clamp(min=-0.999), scores)  # finished: above the penalty -1
    scores[:20] = 0.25  # a few equal pairs: ties as before
    chosen, rejected, tie, judged = dpo_online.assign_preferences(scores, has_eos, -1.0)
    old_judged = torch.where(has_eos, scores, torch.full_like(scores, -1.0))  # the fixed penalty's rule
    pairs = old_judged.view(-1, 2)
    second = (pairs[:, 1] > pairs[:, 0]).long()
    first = 2 * torch.arange(1000)
    assert torch.equal(chosen, first + second) and torch.equal(rejected, first + 1 - second)
    assert torch.equal(tie, pairs[:, 0] == pairs[:, 1]) and tie.any()
    assert torch.equal(judged, old_judged)


def reference_pair_weights(logprobs, sampler_logprobs, mask, cap):
    """Truncated IS weight of each pair by a loop: exp of the summed token log-ratios of both its completions."""
    b = len(logprobs) // 2
    weights = []
    for i in range(b):
        log_ratio = 0.0
        for row in (i, b + i):
            for lp, slp, m in zip(logprobs[row].tolist(), sampler_logprobs[row].tolist(), mask[row].tolist()):
                log_ratio += (lp - slp) * m
        weights.append(min(math.exp(log_ratio), cap))
    return torch.tensor(weights, dtype=torch.float64)


def random_pair_batch(b, width, seed):
    """Log-probs of the policy, the reference and the sampler [2b, width] (close to each other, as after a few
    updates) and a right-padded response mask with at least one token per completion."""
    generator = torch.Generator().manual_seed(seed)
    logprobs = -3 * torch.rand(2 * b, width, generator=generator, dtype=torch.float64)
    ref_logprobs = logprobs + 0.1 * torch.randn(2 * b, width, generator=generator, dtype=torch.float64)
    sampler_logprobs = logprobs + 0.05 * torch.randn(2 * b, width, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (2 * b,), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).double()
    return logprobs, ref_logprobs, sampler_logprobs, mask


@pytest.mark.parametrize("cap", [0.5, 1.0, 2.0, 1e9])
def test_pair_importance_weights_match_a_loop(cap):
    logprobs, _, sampler_logprobs, mask = random_pair_batch(6, 7, seed=int(cap))
    weights = dpo_online.pair_importance_weights(logprobs, sampler_logprobs, mask, cap)
    expected = reference_pair_weights(logprobs, sampler_logprobs, mask, cap)
    assert weights.shape == (6,)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0)
    assert (weights <= cap).all()


def test_pair_importance_weights_are_one_on_policy_and_ignore_padding():
    logprobs, _, sampler_logprobs, mask = random_pair_batch(4, 5, seed=0)
    assert torch.equal(dpo_online.pair_importance_weights(logprobs, logprobs, mask, 2.0), torch.ones(4).double())
    garbage = torch.where(mask > 0, sampler_logprobs, torch.full_like(sampler_logprobs, 99.0))  # only on padding
    assert torch.equal(
        dpo_online.pair_importance_weights(logprobs, garbage, mask, 2.0),
        dpo_online.pair_importance_weights(logprobs, sampler_logprobs, mask, 2.0),
    )


def dpo_args(**overrides):
    values = dict(beta=0.1, loss_type="sigmoid", kl_estimator="k3", tis_cap=None, reward_model_path="unused")
    return dpo_online.Config(**{**values, **overrides})


def loss_flags(args):
    """online_dpo_loss's keyword-only scalars, from the flags of the same names (as main builds them)."""
    return {name: getattr(args, name) for name in ("beta", "loss_type", "tis_cap", "kl_estimator")}


def reference_online_dpo_loss(logprobs, ref_logprobs, sampler_logprobs, mask, keep, normalizer, args):
    """online_dpo_loss by a loop over pairs and tokens in Python floats: (loss, per pair stats, per completion)."""
    b = len(keep)

    def summed(values, row):
        return sum(v * m for v, m in zip(values[row].tolist(), mask[row].tolist()))

    def kl(lp, ref):
        log_r = lp - ref
        return {"k1": log_r, "k2": 0.5 * log_r**2, "k3": math.exp(-log_r) + log_r - 1}[args.kl_estimator]

    weights = keep.tolist()
    if sampler_logprobs is not None and args.tis_cap is not None:
        tis = reference_pair_weights(logprobs, sampler_logprobs, mask, args.tis_cap).tolist()
        weights = [w * t for w, t in zip(weights, tis)]
    loss, pairs = 0.0, {name: [] for name in ("loss", "chosen", "rejected", "accurate", "logp_c", "logp_r")}
    for i in range(b):
        c, r = summed(logprobs, i), summed(logprobs, b + i)
        rc, rr = summed(ref_logprobs, i), summed(ref_logprobs, b + i)
        pair_loss = reference_dpo_loss(
            *(torch.tensor([x], dtype=torch.float64) for x in (c, r, rc, rr)), args.beta, args.loss_type
        ).item()
        loss += pair_loss * weights[i]
        chosen_reward, rejected_reward = args.beta * (c - rc), args.beta * (r - rr)
        for name, value in zip(
            pairs, (pair_loss, chosen_reward, rejected_reward, float(chosen_reward > rejected_reward), c, r)
        ):
            pairs[name].append(value)
    completions = {
        "kl": [
            sum(
                kl(lp, ref) * m
                for lp, ref, m in zip(logprobs[row].tolist(), ref_logprobs[row].tolist(), mask[row].tolist())
            )
            for row in range(2 * b)
        ],
        "entropy": [-summed(logprobs, row) for row in range(2 * b)],
    }
    return loss / normalizer, pairs, completions


@pytest.mark.parametrize(
    "overrides",
    [{}, {"loss_type": "ipo"}, {"kl_estimator": "k1"}, {"kl_estimator": "k2", "beta": 0.5}, {"tis_cap": 1.05}],
)
def test_online_dpo_loss_matches_a_loop(overrides):
    args = dpo_args(**overrides)
    logprobs, ref_logprobs, sampler_logprobs, mask = random_pair_batch(5, 6, seed=len(overrides))
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # pairs 1 and 4 are ties
    sampled = sampler_logprobs if args.tis_cap is not None else None
    logprobs.requires_grad_(True)
    loss, stats, pair_stats = dpo_online.online_dpo_loss(
        logprobs, ref_logprobs, sampled, mask, keep, 2.5, **loss_flags(args)
    )
    expected_loss, pairs, completions = reference_online_dpo_loss(
        logprobs.detach(), ref_logprobs, sampled, mask, keep, 2.5, args
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    for name, key in (("loss/dpo", "loss"), ("rewards/chosen", "chosen"), ("rewards/rejected", "rejected")):
        expected = torch.tensor(pairs[key], dtype=torch.float64)
        torch.testing.assert_close(pair_stats[name], expected, rtol=1e-12, atol=1e-12)
    assert pair_stats["rewards/accuracies"].tolist() == pairs["accurate"]
    assert pair_stats["logps/chosen"].tolist() == pytest.approx(pairs["logp_c"], rel=1e-12)
    assert pair_stats["logps/rejected"].tolist() == pytest.approx(pairs["logp_r"], rel=1e-12)
    for name in ("kl", "entropy"):
        expected = torch.tensor(completions[name], dtype=torch.float64)
        torch.testing.assert_close(pair_stats[f"objective/{name}"], expected, rtol=1e-12, atol=1e-12)
    assert ("objective/tis_weight" in stats) == (args.tis_cap is not None)
    assert all(isinstance(value, float) for value in stats.values()) and not set(stats) & set(pair_stats)
    # A tie weighs nothing: no gradient reaches its completions, nor any padding token.
    loss.backward()
    assert (logprobs.grad[[1, 4, 6, 9]] == 0).all() and (logprobs.grad[mask == 0] == 0).all()
    assert (logprobs.grad[[0, 2, 3]].sum(1) < 0).all()  # the chosen side rises (IPO: h is below 1 / (2 beta))


def test_online_dpo_loss_with_vllm_samples_reports_the_gap_to_the_sampler():
    logprobs, ref_logprobs, sampler_logprobs, mask = random_pair_batch(3, 4, seed=5)
    keep = torch.ones(3, dtype=torch.float64)
    _, stats, _ = dpo_online.online_dpo_loss(
        logprobs, ref_logprobs, sampler_logprobs, mask, keep, 3.0, **loss_flags(dpo_args())
    )
    gaps = [
        (lp - slp, m)
        for row in range(6)
        for lp, slp, m in zip(logprobs[row].tolist(), sampler_logprobs[row].tolist(), mask[row].tolist())
    ]
    assert stats["objective/logprob_gap"] == pytest.approx(sum(abs(g) for g, m in gaps if m) / mask.sum().item())
    assert stats["objective/logprob_ratio_max"] == pytest.approx(max(math.exp(g) for g, m in gaps if m))
    assert "objective/tis_weight" not in stats  # tis_cap None: measured, not applied


class OneProcess:
    """What pair_metrics asks of an Accelerator, for a single process."""

    def reduce(self, tensor, reduction):
        return tensor


def test_pair_metrics_average_over_kept_pairs_and_every_completion():
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0])  # pair 1 is a tie
    # Two micro-batches of 2 pairs: rows are the chosen completions, then the rejected ones.
    micro_batch_stats = [
        (
            torch.tensor([0, 1]),
            torch.tensor([1, 2, 0, 3]),
            {
                "rewards/chosen": torch.tensor([0.5, 100.0]),
                "rewards/rejected": torch.tensor([0.25, -100.0]),
                "objective/kl": torch.tensor([1.0, 2.0, 3.0, 4.0]),
            },
        ),
        (
            torch.tensor([2, 3]),
            torch.tensor([4, 7, 5, 6]),
            {
                "rewards/chosen": torch.tensor([1.0, 1.5]),
                "rewards/rejected": torch.tensor([2.0, 0.0]),
                "objective/kl": torch.tensor([5.0, 6.0, 7.0, 8.0]),
            },
        ),
    ]
    metrics = dpo_online.pair_metrics(micro_batch_stats, keep, OneProcess())
    assert metrics["rewards/chosen"] == pytest.approx((0.5 + 1.0 + 1.5) / 3)  # the tie's 100 is left out
    assert metrics["rewards/rejected"] == pytest.approx((0.25 + 2.0 + 0.0) / 3)
    assert metrics["rewards/margins"] == pytest.approx((0.25 - 1.0 + 1.5) / 3)
    assert metrics["objective/kl"] == pytest.approx(4.5)  # every completion, ties included
    assert metrics["objective/skipped_ties"] == 1
    tied = {"rewards/chosen": torch.ones(2), "rewards/rejected": torch.ones(2)}
    everything_tied = dpo_online.pair_metrics(
        [(torch.tensor([0, 1]), torch.arange(4), tied)], torch.zeros(2), OneProcess()
    )
    assert everything_tied["rewards/margins"] == 0.0  # no kept pair: 0, not a division by 0


# End-to-end runs


REQUIRED_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "objective/scores",
    "objective/score_gap",
    "objective/kl",
    "objective/skipped_ties",
    "objective/accuracy",
    "val/num_eos_tokens",
    "loss/dpo",
    "time/generation",
    "time/training",
    "perf/generation_tokens_per_second",
    "perf/episodes_per_second",
)


LOG2 = torch.tensor(math.log(2)).item()  # log 2 in float32, what -log sigmoid(0) gives


@pytest.mark.slow
def test_run_logs_the_dpo_metrics_and_starts_at_the_reference(make_config):
    run_dir = dpo_online.main(make_config(dpo_online, total_steps=3, learning_rate=1e-3))

    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)["args"]
    assert config["minibatch_size"] == 4 and config["gradient_accumulation_steps"] == 2 and config["world_size"] == 1
    lines = read_metrics(run_dir)
    assert [line["global_step"] for line in lines] == [0, 1, 2, 3]
    assert [line["episode"] for line in lines] == [0, 8, 16, 24]  # 4 prompts * 2 completions per step
    assert {"eval/score", "eval/accuracy"} <= set(lines[0]) and {"eval/score", "eval/accuracy"} <= set(lines[-1])
    for line in train_lines(lines):
        missing = [k for k in REQUIRED_KEYS if k not in line]
        assert not missing, missing
        assert all(math.isfinite(v) for v in line.values())
        assert line["objective/score_gap"] > 0  # the chosen completion is the one the judge scored higher
        assert line["objective/skipped_ties"] == 4 * line["objective/tie_fraction"]
    # The first update starts at the reference: every log-ratio is exactly 0, so the sigmoid loss is log 2.
    first = train_lines(lines)[0]
    assert first["loss/dpo"] == pytest.approx(LOG2, abs=1e-7)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert first["rewards/accuracies"] == 0.0 and first["objective/kl"] == 0.0
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert lines[-1]["objective/kl"] != 0.0 and lines[-1]["loss/dpo"] != pytest.approx(LOG2)
    assert os.path.isfile(os.path.join(run_dir, "model", "model.safetensors"))


def space_token_scores(sign):
    """A toy reward model the tiny policy can learn against: sign * the number of tokens whose text starts with a
    space (about 65% of the vocabulary), divided by 10, at every position like the real head. Both completions of
    a pair share the prompt, so only the responses decide which is chosen."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    spaced = torch.tensor([t.startswith("Ġ") for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))])

    def scores(model, score_head, input_ids, attention_mask):
        return sign * (spaced[input_ids.cpu()].float() * attention_mask.cpu()).cumsum(1) / 10

    return scores


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1, -1])
def test_policy_moves_towards_what_the_judge_prefers(make_config, monkeypatch, sign):
    """At temperature 0.1 the tiny random policy samples among a handful of tokens per context, so a few DPO updates
    can move the mass. Observed (seed 1, 8 tokens per response): the judge's mean score of the samples goes from
    2.82 to its maximum 3.0 (every response token spaced) with sign 1, from -2.82 to -2.2 (none spaced) with sign
    -1, within 4 steps; after that the two completions of a pair are the same and every pair is a tie. The negated
    judge moves the policy the other way: the direction comes from the preferences, not from the entropy collapse."""
    monkeypatch.setattr(dpo_online, "token_scores", space_token_scores(sign))
    args = make_config(
        dpo_online,
        total_steps=6,
        learning_rate=1e-3,
        temperature=0.1,
        prompts_per_rank=8,
        micro_batch_size=4,
        lr_scheduler="constant",
    )
    lines = train_lines(read_metrics(dpo_online.main(args)))
    scores = [line["objective/scores"] for line in lines]
    assert sum(scores[-3:]) / 3 > scores[0] + 0.15, [round(s, 3) for s in scores]  # 1.5 more preferred tokens of 8
    assert lines[0]["loss/dpo"] == pytest.approx(LOG2, abs=1e-7)
    assert lines[-1]["objective/tie_fraction"] > 0.5  # collapsed onto the preferred completion


@pytest.mark.slow
def test_verifier_judge_skips_and_counts_ties(make_config, tiny_model_dir):
    """The random tiny policy never answers right: every pair is a tie (both wrong), nothing is trained on, and
    the policy is exactly the initial one (Adam with zero gradients and no weight decay does not move)."""
    run_dir = dpo_online.main(
        make_config(dpo_online, judge="verifier", reward_model_path="no/such/model", learning_rate=1e-3)
    )
    lines = read_metrics(run_dir)
    assert lines[0]["eval/score"] == 0.0 and lines[0]["eval/accuracy"] == 0.0
    for line in train_lines(lines):
        assert line["objective/skipped_ties"] == 4 and line["objective/tie_fraction"] == 1.0
        assert line["loss/dpo"] == 0.0 and line["rewards/margins"] == 0.0
        assert line["objective/accuracy"] == 0.0 and line["objective/scores"] == 0.0
    initial, final = (
        load_file(os.path.join(tiny_model_dir, "model.safetensors")),
        load_file(os.path.join(run_dir, "model", "model.safetensors")),
    )
    assert all(torch.equal(initial[k], final[k]) for k in initial)


@pytest.mark.slow
def test_eval_ref_perplexity_is_worked_out_here(make_config, tiny_model_dir, monkeypatch):
    args = make_config(dpo_online, total_steps=1, num_eval_prompts=4)
    assert_eval_ref_perplexity_is_worked_out_here(
        dpo_online, dpo_online.Sampler, args, tiny_model_dir, monkeypatch.setattr
    )


@pytest.mark.slow
def test_lora_ipo_starts_at_the_reference(make_config):
    """With LoRA the reference is the policy with its adapters off; they start at zero, so the first step is at the
    reference exactly: IPO's loss is (1 / (2 beta))^2."""
    every_line = read_metrics(dpo_online.main(make_config(dpo_online, lora_r=4, loss_type="ipo", learning_rate=1e-2)))
    assert not any("eval/ref_perplexity" in line for line in every_line)  # the reference is the adapters off
    lines = train_lines(every_line)
    assert lines[0]["loss/dpo"] == pytest.approx(25.0, rel=1e-6)  # beta 0.1
    assert lines[0]["objective/kl"] == 0.0 and lines[0]["rewards/margins"] == 0.0
    assert lines[1]["objective/kl"] != 0.0


@pytest.mark.slow
def test_non_finite_score_stops_the_run(make_config, monkeypatch):
    monkeypatch.setattr(dpo_online, "token_scores", lambda *args: torch.full(args[2].shape, float("nan")))
    with pytest.raises(RuntimeError, match="objective/scores"):
        dpo_online.main(make_config(dpo_online, num_eval_prompts=1, total_steps=1))


# The fixed rollout (tests/fixed_rollout.py) under bf16 autocast; the launch paths' invariants are
# tests/launch_paths/test_launch_paths.py's table. The judge is the tiny reward model on the fixed completions (no
# patch needed).

INVARIANT_ARGS = dict(
    total_steps=3,  # 3 updates: the old scheduler, stepped once per process, ran the third at -1/3 of the lr
    lr_scheduler="linear",  # the default, a decaying schedule
    learning_rate=1e-4,
    eval_every=0,
)


# Differences of float32 log-prob sums of ~50 (one ulp 4e-6) from batches padded to other widths: an absolute
# tolerance of a few ulps (the implicit rewards are scaled by beta 0.1). Observed: 1.9e-7 and 1.8e-7.
def fixed_rollout_run(monkeypatch, make_config, **overrides):
    fixed_rollout.patch(dpo_online, monkeypatch.setattr)
    return dpo_online.main(make_config(dpo_online, **{**INVARIANT_ARGS, **overrides}))


@pytest.mark.slow
def test_invariant_bf16_autocast_h_is_zero_before_the_first_update(make_config, monkeypatch, bf16_autocast):
    """--mixed_precision bf16 autocasts the prepared policy; the reference runs under the same autocast, so DPO's
    h = (pi_c - ref_c) - (pi_r - ref_r), the implicit rewards and the KL of the first step are exactly 0 and the
    sigmoid loss is log 2 (a fault: the reference ran in fp32)."""
    run_dir = fixed_rollout_run(monkeypatch, make_config, total_steps=1)
    (line,) = train_lines(read_metrics(run_dir))
    assert line["objective/skipped_ties"] < 4  # pairs were trained on: the zeros below are not empty sums
    assert line["rewards/chosen"] == line["rewards/rejected"] == line["rewards/margins"] == 0.0
    assert line["objective/kl"] == 0.0
    assert line["loss/dpo"] == LOG2


@pytest.mark.slow
@pytest.mark.parametrize("ensemble", ["wco", "uwo"])
def test_an_ensemble_of_identical_members_judges_as_the_single_model(
    make_config, tiny_reward_model_dir, tmp_path, ensemble
):
    """Two copies of the judge agree on every completion: WCO and UWO give its score, so the run is the single-model
    run number for number, each member's score logged beside it (in training and evaluation). ensemble_reward itself
    is tested in tests/ppo_rlhf/test_ppo_rlhf.py (one definition: the drift test)."""
    import shutil

    folder = tmp_path / "ensemble"
    for k in range(2):
        shutil.copytree(tiny_reward_model_dir, folder / f"member_{k}")
    single = read_metrics(dpo_online.main(make_config(dpo_online, seed=2)))
    double = read_metrics(
        dpo_online.main(make_config(dpo_online, seed=2, reward_model_path=str(folder), reward_ensemble=ensemble))
    )
    strip = lambda line: {k: v for k, v in line.items() if k != "time" and not k.startswith(("time/", "perf/"))}  # noqa: E731
    for one, two in zip(single, double):
        assert {k: v for k, v in strip(two).items() if "_member_" not in k} == strip(one)
    for line in train_lines(double):
        assert line["objective/scores_member_0"] == line["objective/scores_member_1"]
    assert double[-1]["eval/score_member_1"] == double[-1]["eval/score"]  # missing_eos_penalty None: the members' own
