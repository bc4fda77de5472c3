"""ppo_rlhf.py: its math against float64 loops, and end-to-end runs of the tiny policy against a tiny reward model."""

import inspect
import json
import math
import os
import shutil

import fixed_rollout
import pytest
import torch
from conftest import (
    SMOLLM2_DIR,
    assert_eval_ref_perplexity_is_worked_out_here,
    read_metrics,
    train_lines,
    without_timing,
)

import ppo_rlhf

# The metric names of summarize_from_feedback_details' PPO, which a reader of the N+ paper looks for.
N_PLUS_METRICS = (
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "val/ratio",
    "val/num_eos_tokens",
)


def random_right_padded(batch, width, generator):
    """rewards, values [B, R] float64 and a right-padded mask with lengths from 1 to R (both ends included)."""
    lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    lengths[0], lengths[-1] = 1, width
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).double()
    rewards = torch.randn(batch, width, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, width, generator=generator, dtype=torch.float64)
    return rewards, values, mask, lengths


def reference_gae(rewards, values, lengths, gamma, lam):
    """GAE by its definition, one response at a time in plain Python floats: A_t = sum_k (gamma lam)^k delta_{t+k},
    delta_t = r_t + gamma V_{t+1} - V_t, with V = 0 after the last real token."""
    advantages = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for i, length in enumerate(lengths.tolist()):
        r, v = rewards[i].tolist()[:length], values[i].tolist()[:length]
        deltas = [r[t] + gamma * (v[t + 1] if t + 1 < length else 0.0) - v[t] for t in range(length)]
        for t in range(length):
            advantages[i][t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t))
    return torch.tensor(advantages, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_the_definition_on_random_right_padded_batches(seed):
    generator = torch.Generator().manual_seed(seed)
    rewards, values, mask, lengths = random_right_padded(7, 9, generator)
    gamma, lam = [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.5, 0.0)][seed]
    # Garbage on the padding must not leak into the real tokens.
    rewards = torch.where(mask > 0, rewards, torch.full_like(rewards, 1e3))
    values = torch.where(mask > 0, values, torch.full_like(values, -1e3))
    advantages, returns = ppo_rlhf.gae_advantages(rewards, values, mask, gamma, lam)
    expected = reference_gae(rewards, values, lengths, gamma, lam)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, (expected + values) * mask, rtol=1e-12, atol=1e-12)
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_gae_with_lambda_one_and_gamma_one_gives_reward_to_go_minus_value():
    generator = torch.Generator().manual_seed(5)
    rewards, values, mask, lengths = random_right_padded(5, 6, generator)
    advantages, returns = ppo_rlhf.gae_advantages(rewards * mask, values * mask, mask, 1.0, 1.0)
    for i, length in enumerate(lengths.tolist()):
        for t in range(length):
            reward_to_go = sum(rewards[i, t:length].tolist())
            assert math.isclose(returns[i, t].item(), reward_to_go, abs_tol=1e-12)
            assert math.isclose(advantages[i, t].item(), reward_to_go - values[i, t].item(), abs_tol=1e-12)


def reference_whiten(values, mask, shift_mean):
    kept = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(kept) / len(kept)
    variance = sum((v - mean) ** 2 for v in kept) / (len(kept) - 1)
    out = [(v - mean) / math.sqrt(variance + 1e-8) + (0.0 if shift_mean else mean) for v in values.flatten().tolist()]
    return torch.tensor(out, dtype=torch.float64).view_as(values)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_masked_whiten_matches_a_loop(shift_mean, seed):
    generator = torch.Generator().manual_seed(seed)
    values = 3 + 2 * torch.randn(6, 8, generator=generator, dtype=torch.float64)
    mask = (torch.rand(6, 8, generator=generator) < 0.6).double()
    mask[0, 0] = 1
    whitened = ppo_rlhf.masked_whiten(values, mask, shift_mean=shift_mean)
    torch.testing.assert_close(whitened, reference_whiten(values, mask, shift_mean), rtol=1e-10, atol=1e-10)
    kept = whitened[mask > 0]
    assert math.isclose(kept.std().item(), 1.0, rel_tol=1e-6)
    assert math.isclose(kept.mean().item(), 0.0 if shift_mean else values[mask > 0].mean().item(), abs_tol=1e-9)


def reference_per_token_rewards(kl, scores, lengths, kl_coef, process_rewards):
    """Per-token rewards by the N+ recipe, one token at a time in plain floats: -kl_coef * kl on every real token,
    the process reward where it falls, the score on the last real token; 0 on padding."""
    rewards = [[0.0] * kl.shape[1] for _ in range(kl.shape[0])]
    for i, length in enumerate(lengths.tolist()):
        for t in range(length):
            rewards[i][t] = -kl_coef * kl[i, t].item() + process_rewards[i, t].item()
            if t == length - 1:
                rewards[i][t] += scores[i].item()
    return torch.tensor(rewards, dtype=torch.float64)


@pytest.mark.parametrize("with_process_rewards", [False, True])
def test_per_token_rewards_match_a_loop(with_process_rewards):
    generator = torch.Generator().manual_seed(1)
    kl, _, mask, lengths = random_right_padded(7, 9, generator)
    kl = kl * mask  # the caller's KL is 0 on padding
    scores = torch.randn(7, generator=generator, dtype=torch.float64)
    process = torch.randn(7, 9, generator=generator, dtype=torch.float64) * mask
    rewards, non_score_reward = ppo_rlhf.per_token_rewards(
        kl, scores, mask, 0.3, process if with_process_rewards else None
    )
    expected = reference_per_token_rewards(kl, scores, lengths, 0.3, process * with_process_rewards)
    torch.testing.assert_close(rewards, expected, rtol=1e-12, atol=1e-12)
    # Summed over tokens: the score, the process rewards, minus the KL penalty; the non-score part is the KL penalty
    # alone (the score is not added into it).
    process_sum = process.sum(1) if with_process_rewards else 0.0
    torch.testing.assert_close(rewards.sum(1), scores + process_sum - 0.3 * kl.sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(non_score_reward.sum(1), -0.3 * kl.sum(1), rtol=1e-12, atol=1e-12)


def random_ppo_batch(seed, batch=6, width=7):
    """float64 log-probs, old log-probs (ratios from about 0.4 to 2.5), advantages, values, old values, returns
    [B, R] and a right-padded mask."""
    generator = torch.Generator().manual_seed(seed)
    old_logprobs = -3 * torch.rand(batch, width, generator=generator, dtype=torch.float64)
    logprobs = old_logprobs + 0.5 * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    advantages, values, mask, _ = random_right_padded(batch, width, generator)
    old_values = values + 0.4 * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    returns = torch.randn(batch, width, generator=generator, dtype=torch.float64)
    return logprobs, old_logprobs, advantages, values, old_values, returns, mask


def reference_policy_loss(logprobs, old_logprobs, advantages, eps):
    """PPO's clipped objective in its paper form, per token in plain floats: -min(r A, clip(r, 1 - eps, 1 + eps) A),
    and whether the clip is active: the ratio left the trust region in the direction the advantage pushes it."""
    loss, clipped = [], []
    for lp, old, a in zip(logprobs.flatten().tolist(), old_logprobs.flatten().tolist(), advantages.flatten().tolist()):
        r = math.exp(lp - old)
        loss.append(-min(r * a, min(max(r, 1 - eps), 1 + eps) * a))
        clipped.append((a > 0 and r > 1 + eps) or (a < 0 and r < 1 - eps))
    shape = logprobs.shape
    return torch.tensor(loss, dtype=torch.float64).view(shape), torch.tensor(clipped).view(shape)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cliprange", [0.1, 0.2])
def test_ppo_policy_loss_matches_a_loop(seed, cliprange):
    logprobs, old_logprobs, advantages = random_ppo_batch(seed)[:3]
    loss, ratio, clipped = ppo_rlhf.ppo_policy_loss(logprobs, old_logprobs, advantages, cliprange)
    expected, expected_clipped = reference_policy_loss(logprobs, old_logprobs, advantages, cliprange)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ratio, torch.exp(logprobs - old_logprobs), rtol=1e-12, atol=0)
    assert torch.equal(clipped, expected_clipped)
    assert 0 < clipped.sum() < clipped.numel()  # both cases occur


def test_ppo_policy_loss_at_ratio_one_is_minus_the_advantage_and_clipped_tokens_get_no_gradient():
    logprobs, _, advantages = random_ppo_batch(3)[:3]
    loss, ratio, clipped = ppo_rlhf.ppo_policy_loss(logprobs, logprobs, advantages, 0.2)
    assert torch.equal(loss, -advantages) and (ratio == 1).all() and not clipped.any()
    # Away from ratio 1, the clipped tokens stop pushing: their loss is -A (1 +- eps), with no gradient.
    logprobs, old_logprobs, advantages = (t.clone() for t in random_ppo_batch(4)[:3])
    logprobs.requires_grad_(True)
    loss, ratio, clipped = ppo_rlhf.ppo_policy_loss(logprobs, old_logprobs, advantages, 0.2)
    loss.sum().backward()
    bound = 1 + 0.2 * torch.sign(advantages)  # 1 + eps where A > 0, 1 - eps where A < 0
    torch.testing.assert_close(loss[clipped], (-advantages * bound)[clipped], rtol=1e-12, atol=1e-12)
    assert (logprobs.grad[clipped] == 0).all() and (logprobs.grad[~clipped] != 0).all()


def reference_value_loss(values, old_values, returns, eps):
    """0.5 * max((V - G)^2, (V_clip - G)^2) per token in plain floats, V_clip = V moved back to within eps of V_old,
    and whether the clipped error is the larger."""
    loss, clipped = [], []
    for v, old, g in zip(values.flatten().tolist(), old_values.flatten().tolist(), returns.flatten().tolist()):
        v_clip = old + eps if v > old + eps else old - eps if v < old - eps else v
        loss.append(0.5 * max((v - g) ** 2, (v_clip - g) ** 2))
        clipped.append((v_clip - g) ** 2 > (v - g) ** 2)
    shape = values.shape
    return torch.tensor(loss, dtype=torch.float64).view(shape), torch.tensor(clipped).view(shape)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cliprange_value", [0.1, 0.2])
def test_clipped_value_loss_matches_a_loop(seed, cliprange_value):
    values, old_values, returns = random_ppo_batch(seed)[3:6]
    loss, clipped = ppo_rlhf.clipped_value_loss(values, old_values, returns, cliprange_value)
    expected, expected_clipped = reference_value_loss(values, old_values, returns, cliprange_value)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(clipped, expected_clipped)
    assert 0 < clipped.sum() < clipped.numel()


def test_clipped_value_loss_with_an_infinite_clip_is_half_the_squared_error():
    values, old_values, returns = random_ppo_batch(5)[3:6]
    loss, _ = ppo_rlhf.clipped_value_loss(values, old_values, returns, math.inf)
    # V_clip = V_old + (V - V_old) is V up to rounding.
    torch.testing.assert_close(loss, 0.5 * (values - returns) ** 2, rtol=1e-12, atol=1e-12)


def test_ppo_rlhf_loss_shares_sum_to_the_minibatch_token_means():
    """Micro-batch losses divided by the minibatch's token count add up to the minibatch's token-mean policy loss +
    vf_coef * its token-mean value loss (what gradient accumulation sums); a sampler that agrees with the trainer
    gives truncated importance weights of 1 and the same loss."""
    logprobs, old_logprobs, advantages, values, old_values, returns, mask = random_ppo_batch(6)
    logits = torch.randn(*mask.shape, 11, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    flags = dict(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, tis_cap=2.0)
    tensors = (logprobs, logits, values, old_logprobs, old_values, returns, advantages)

    def loss_of(rows, sampler_logprobs=None):
        sampler = None if sampler_logprobs is None else sampler_logprobs[rows]
        return ppo_rlhf.ppo_rlhf_loss(*(t[rows] for t in tensors), sampler, mask[rows], mask.sum(), **flags)

    shares = [loss_of(rows) for rows in (slice(0, 2), slice(2, 6))]
    policy, _ = reference_policy_loss(logprobs, old_logprobs, advantages, 0.2)
    value, _ = reference_value_loss(values, old_values, returns, 0.2)
    expected = (policy * mask).sum() / mask.sum() + 0.1 * (value * mask).sum() / mask.sum()
    torch.testing.assert_close(sum(loss for loss, _ in shares), expected, rtol=1e-12, atol=1e-12)
    assert math.isclose(sum(stats["pg_loss"] for _, stats in shares), ((policy * mask).sum() / mask.sum()).item())
    whole, _ = loss_of(slice(0, 6))
    same, stats = loss_of(slice(0, 6), sampler_logprobs=old_logprobs)
    assert torch.equal(same, whole) and stats["objective/tis_weight"] == 1.0


def test_policy_and_value_gives_each_sequence_its_own_values(tiny_model_dir, tiny_reward_model_dir):
    """Values of a left-padded batch: for response token t, the value model's output at the position that predicts
    it, the same as for the sequence alone."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    value_model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    model = ppo_rlhf.PolicyAndValue(policy, value_model)
    prompts, responses = [[1, 9690, 198, 5248, 314], [1, 4093]], torch.tensor([[11, 12, 13], [21, 22, 23]])
    prompt_ids, prompt_mask = ppo_rlhf._left_pad(prompts, 2)
    input_ids = torch.cat([prompt_ids, responses], 1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(responses)], 1)
    with torch.no_grad():
        logprobs, _, values = model(input_ids, attention_mask, prompt_ids.shape[1], 1.0)
        for i, prompt in enumerate(prompts):
            alone = torch.tensor([prompt + responses[i].tolist()])
            full = value_model(alone, output_hidden_states=True).hidden_states[-1]
            expected = value_model.score(full).squeeze(-1)[0, len(prompt) - 1 : -1]
            torch.testing.assert_close(values[i], expected, rtol=1e-4, atol=1e-5)
            alone_logprobs = ppo_rlhf.response_logprobs(policy, alone, torch.ones_like(alone), len(prompt), 1.0)[0][0]
            torch.testing.assert_close(logprobs[i], alone_logprobs, rtol=1e-4, atol=1e-5)
    assert values.shape == logprobs.shape == responses.shape


def test_token_scores_equal_the_head_on_the_last_hidden_states(tiny_reward_model_dir):
    """The hook on the score head gives what the head applied to output_hidden_states' last layer gave (the
    computation before the hook), for a left-padded batch, in float64."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir, dtype=torch.float64).eval()
    input_ids, attention_mask = ppo_rlhf._left_pad([[1, 9690, 198, 5248, 314, 11], [1, 4093, 12]], 2)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ppo_rlhf.token_scores(model, model.score, input_ids, attention_mask)
        hidden = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
            use_cache=False,
        ).hidden_states[-1]
        expected = model.score(hidden).squeeze(-1).float()
    assert got.shape == input_ids.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected.double(), rtol=0, atol=1e-6)
    assert not model.score._forward_hooks  # the hook is removed


@pytest.mark.slow
def test_initial_values_are_the_centred_reward_model_scores(make_config, biased_reward_model_dir, monkeypatch):
    """The value model starts from the reward model, whose scores are centred by config.bias (0.7 here): its first
    values are the reward model's raw head output minus 0.7 at every position, on the scale of the centred scores
    and returns (a fault: the values were the raw output, 0.7 above)."""
    calls, gae_inputs = [], []
    original_scores, original_gae = ppo_rlhf.token_scores, ppo_rlhf.gae_advantages

    def recording_scores(model, score_head, input_ids, attention_mask):
        out = original_scores(model, score_head, input_ids, attention_mask)
        if not any(p.requires_grad for p in model.parameters()):  # the frozen reward model
            calls.append((input_ids.clone(), out.detach().clone()))
        return out

    def recording_gae(rewards, values, mask, gamma, lam):
        gae_inputs.append((values.clone(), mask.clone(), len(calls)))
        return original_gae(rewards, values, mask, gamma, lam)

    monkeypatch.setattr(ppo_rlhf, "token_scores", recording_scores)
    monkeypatch.setattr(ppo_rlhf, "gae_advantages", recording_gae)
    fixed_rollout.patch(ppo_rlhf, monkeypatch.setattr)
    ppo_rlhf.main(
        make_config(ppo_rlhf, reward_model_path=biased_reward_model_dir, total_steps=1, missing_eos_penalty=-1.0)
    )
    ((values, mask, num_calls),) = gae_inputs
    input_ids, raw = calls[num_calls - 1]  # the reward model's pass over the step's batch, just before GAE
    context_length = input_ids.shape[1] - mask.shape[1]
    expected = raw[:, context_length - 1 : -1] - 0.7
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
    assert (raw[mask.sum(1) > 0].abs() > 0).any()


# End-to-end runs


@pytest.mark.slow
def test_run_logs_the_n_plus_metrics_and_starts_on_policy(make_config, monkeypatch):
    seen, original = [], ppo_rlhf.gae_advantages  # GAE's input: the score on the last real token, and only there

    def recording_gae(rewards, values, mask, gamma, lam):
        seen.append((rewards.clone(), mask.clone()))
        return original(rewards, values, mask, gamma, lam)

    monkeypatch.setattr(ppo_rlhf, "gae_advantages", recording_gae)
    args = make_config(ppo_rlhf, total_steps=3, kl_coef=0.0, learning_rate=1e-3)
    run_dir = ppo_rlhf.main(args)

    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)["args"]
    assert config["minibatch_size"] == 4 and config["gradient_accumulation_steps"] == 1
    lines = read_metrics(run_dir)
    assert [line["global_step"] for line in lines] == [0, 1, 2, 3]
    assert [line["episode"] for line in lines] == [0, 8, 16, 24]
    assert {"eval/score", "eval/accuracy"} <= set(lines[0]) and {"eval/score", "eval/accuracy"} <= set(lines[-1])
    for line in train_lines(lines):
        missing = [k for k in N_PLUS_METRICS if k not in line]
        assert not missing, missing
        assert all(math.isfinite(v) for v in line.values())
        # The first minibatch of the first epoch is exactly on-policy; later ones are not.
        assert line["policy/ratio_first_minibatch"] == 1.0
        assert line["policy/approxkl_first_minibatch"] == 0.0
        assert line["policy/approxkl_avg"] > 0
        # 2 epochs x 2 minibatches: the batch's updates are 0, 1, 2, 3 updates after the rollout's weights.
        assert line["policy/staleness"] == 1.5 and line["policy/staleness_max"] == 3
        assert line["policy/approxkl_last_minibatch"] > 0
        assert line["objective/non_score_reward"] == 0.0  # kl_coef 0: the KL is measured, not paid
    assert lines[1]["objective/kl"] == 0.0  # policy == reference before the first update
    assert lines[-1]["objective/kl"] != 0.0

    assert len(seen) == 3
    for rewards, mask in seen:
        last = (mask.sum(1) - 1).long()
        on_last = torch.zeros_like(mask, dtype=torch.bool)
        on_last[torch.arange(len(last)), last] = True
        assert (rewards[~on_last] == 0).all()  # kl_coef 0: only the score, and only on the last real token
        assert (rewards[on_last] != 0).all()
    for name in ("model", "value_model"):
        assert os.path.isfile(os.path.join(run_dir, name, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("whiten", [True, False])
def test_the_loss_gets_gae_advantages_whitened_over_the_batch_or_as_they_are(make_config, monkeypatch, whiten):
    """--whiten_advantages (default): (A - mean) / std over every real token of the batch, unbiased variance, worked
    out here in float64; --no-whiten_advantages: GAE's advantages reach the loss unchanged."""
    gae_out, loss_in = [], []
    original_gae, original_loss = ppo_rlhf.gae_advantages, ppo_rlhf.ppo_rlhf_loss

    def recording_gae(rewards, values, mask, gamma, lam):
        advantages, returns = original_gae(rewards, values, mask, gamma, lam)
        gae_out.append((advantages.clone(), mask.clone()))
        return advantages, returns

    def recording_loss(*args, advantages, **kwargs):
        loss_in.append(advantages.clone())
        return original_loss(*args, advantages=advantages, **kwargs)

    recording_loss.__signature__ = inspect.signature(original_loss)  # main reads the loss's flags from it
    monkeypatch.setattr(ppo_rlhf, "gae_advantages", recording_gae)
    monkeypatch.setattr(ppo_rlhf, "ppo_rlhf_loss", recording_loss)
    ppo_rlhf.main(make_config(ppo_rlhf, total_steps=1, num_ppo_epochs=1, num_eval_prompts=4, whiten_advantages=whiten))

    ((advantages, mask),) = gae_out
    received = torch.cat(loss_in)  # 2 minibatches x 1 micro-batch of 4, in rollout order: the batch's 8 rows
    assert received.shape == advantages.shape
    if not whiten:
        assert torch.equal(received, advantages)
        return
    real = [float(a) for row, m in zip(advantages.double(), mask) for a, keep in zip(row, m) if keep]
    mean = sum(real) / len(real)
    std = (sum((a - mean) ** 2 for a in real) / (len(real) - 1) + 1e-8) ** 0.5
    expected = (advantages.double() - mean) / std * mask
    torch.testing.assert_close(received.double(), expected, rtol=1e-5, atol=1e-5)
    assert abs(float(received[mask.bool()].mean())) < 1e-5  # mean 0 over the real tokens


def space_token_scores(original, sign):
    """A toy reward model the tiny policy can learn against: sign * the number of tokens so far whose text starts
    with a space (about 65% of the vocabulary), divided by 10, at every position like the real head. The prompt's
    count is fixed, so only the response moves the score. The value model keeps its real head."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    spaced = torch.tensor([t.startswith("Ġ") for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))])

    def scores(model, score_head, input_ids, attention_mask):
        if any(p.requires_grad for p in model.parameters()):
            return original(model, score_head, input_ids, attention_mask)
        return sign * (spaced[input_ids.cpu()].float() * attention_mask.cpu()).cumsum(1) / 10

    return scores


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1, -1])
def test_policy_raises_a_learnable_score(make_config, monkeypatch, sign):
    """At temperature 0.2 the tiny random policy samples a handful of tokens per context; PPO moves the mass to the
    rewarded ones. Observed (seed 1, sign 1): 2.87 -> 3.30 in 8 steps (all 12 response tokens spaced). The negated
    reward must move the other way: the direction comes from the reward, not from the entropy collapse."""
    monkeypatch.setattr(ppo_rlhf, "token_scores", space_token_scores(ppo_rlhf.token_scores, sign))
    args = make_config(
        ppo_rlhf,
        total_steps=10,
        learning_rate=5e-3,
        temperature=0.2,
        kl_coef=0.0,
        prompts_per_rank=16,
        lr_scheduler="constant",
    )
    scores = [line["objective/scores"] for line in train_lines(read_metrics(ppo_rlhf.main(args)))]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.15, [round(s, 3) for s in scores]  # 1.5 more rewarded tokens of 12


@pytest.mark.slow
def test_eval_ref_perplexity_is_worked_out_here(make_config, tiny_model_dir, monkeypatch):
    args = make_config(ppo_rlhf, total_steps=1, num_eval_prompts=4)
    assert_eval_ref_perplexity_is_worked_out_here(
        ppo_rlhf, ppo_rlhf.Sampler, args, tiny_model_dir, monkeypatch.setattr
    )


@pytest.mark.slow
def test_lora_policy_starts_at_the_reference(make_config):
    every_line = read_metrics(ppo_rlhf.main(make_config(ppo_rlhf, lora_r=4, learning_rate=1e-2, kl_coef=0.1)))
    assert not any("eval/ref_perplexity" in line for line in every_line)  # the reference is the adapters off
    lines = train_lines(every_line)
    assert lines[0]["objective/kl"] == 0.0  # the adapters start at zero: policy == reference (adapters off)
    assert lines[-1]["objective/kl"] != 0.0


# The fixed rollout (tests/fixed_rollout.py) under bf16 autocast; the launch paths' invariants are
# tests/launch_paths/test_launch_paths.py's table.

INVARIANT_ARGS = dict(
    total_steps=2,
    prompts_per_rank=8,
    num_minibatches=1,  # each update covers the whole batch: the same tokens whether it is split or not
    num_ppo_epochs=2,  # 4 updates: the reshuffled second epoch and the clipped losses are in the comparison
    micro_batch_size=4,
    lr_scheduler="linear",  # a decaying schedule shows a scheduler stepped once per process
    learning_rate=1e-3,
    kl_coef=0.05,
    whiten_rewards=True,  # the reward whitening over every process too
    missing_eos_penalty=-1.0,  # half of the fixed completions end with EOS: the stop ids enter the scores
    eval_every=0,
    num_eval_prompts=4,
)


def fixed_rollout_run(monkeypatch, make_config, **overrides):
    fixed_rollout.patch(ppo_rlhf, monkeypatch.setattr)
    return ppo_rlhf.main(make_config(ppo_rlhf, **{**INVARIANT_ARGS, **overrides}))


@pytest.mark.slow
def test_invariant_bf16_autocast_kl_is_zero_and_ratio_is_one_before_the_first_update(
    make_config, monkeypatch, bf16_autocast
):
    """--mixed_precision bf16 autocasts the prepared policy and value model; the reference runs under the same
    autocast, so the KL of the first step is exactly 0, and the first minibatch's ratio exactly 1."""
    run_dir = fixed_rollout_run(monkeypatch, make_config, total_steps=1)
    (line,) = train_lines(read_metrics(run_dir))
    assert line["objective/kl"] == 0.0
    assert line["policy/ratio_first_minibatch"] == 1.0
    assert line["policy/approxkl_first_minibatch"] == 0.0


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id, model.config.bias = 2, 0.0
    path = str(tmp_path_factory.mktemp("tiny-rm"))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


@pytest.mark.parametrize("num_items,world_size,chunk_size", [(0, 2, 4), (1, 2, 64), (7, 3, 2), (16, 4, 4), (5, 1, 2)])
def test_process_chunks_cover_every_item_once_with_the_same_count_on_every_process(num_items, world_size, chunk_size):
    """Every item on exactly one process (rank r takes r, r + W, ...); every process gets as many chunks (a collective
    under ZeRO-3 per chunk), each at most chunk_size long."""
    shares = [ppo_rlhf.process_chunks(range(num_items), r, world_size, chunk_size) for r in range(world_size)]
    assert len({len(chunks) for chunks in shares}) == 1
    assert len(shares[0]) == math.ceil(math.ceil(num_items / world_size) / chunk_size)
    for rank, chunks in enumerate(shares):
        assert all(len(chunk) <= chunk_size for chunk in chunks)
        assert [i for chunk in chunks for i in chunk] == list(range(rank, num_items, world_size))


def test_reference_perplexity_matches_a_loop():
    """eval/ref_perplexity per completion: exp of minus the mean of the reference's log-probs over its real tokens
    (a completion with none counts as 1). async_rlhf and dpo_online have the same function (drift test)."""
    g = torch.Generator().manual_seed(0)
    ref_logprobs = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(5, 7, generator=g) > 0.4).double()
    mask[2] = 0.0
    expected = []
    for b in range(5):
        tokens = [ref_logprobs[b, t].item() for t in range(7) if mask[b, t]]
        expected.append(math.exp(-sum(tokens) / len(tokens)) if tokens else 1.0)
    assert ppo_rlhf.reference_perplexity(ref_logprobs, mask).tolist() == pytest.approx(expected, rel=1e-12)


def test_sampler_gap_metrics_against_a_loop():
    """objective/logprob_gap is the mean over micro-batches (in rollout order) of each one's masked mean of
    |log pi_train - log pi_sampler|; the ratio max is the largest pi_train / pi_sampler on a real token. ppo_prm_clip
    has the same function (drift test)."""
    g = torch.Generator().manual_seed(0)
    old, sampler = (
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.randn(6, 5, generator=g, dtype=torch.float64),
    )
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    mask[4] = 0.0  # a micro-batch row with no real token still counts in its micro-batch's mean
    metrics = ppo_rlhf.sampler_gap_metrics(old, sampler, mask, micro_batch_size=2)
    means, largest = [], -math.inf
    for start in range(0, 6, 2):
        total = count = 0.0
        for b in range(start, start + 2):
            for t in range(5):
                if mask[b, t]:
                    d = old[b, t].item() - sampler[b, t].item()
                    total, count, largest = total + abs(d), count + 1, max(largest, math.exp(d))
        means.append(total / max(count, 1.0))
    assert metrics == {
        "objective/logprob_gap": pytest.approx(sum(means) / len(means), rel=1e-12),
        "objective/logprob_ratio_max": pytest.approx(largest, rel=1e-12),
    }


def ensemble_reference(member_scores, ensemble, uwo_coef):
    """The ensemble's reward by a plain loop in float64: per response, the members' mean, their minimum, or the mean
    minus uwo_coef x the population variance (1 / K) of the K scores."""
    rewards = []
    for column in member_scores.double().T.tolist():
        mean = sum(column) / len(column)
        variance = sum((x - mean) ** 2 for x in column) / len(column)
        rewards.append({"mean": mean, "wco": min(column), "uwo": mean - uwo_coef * variance}[ensemble])
    return torch.tensor(rewards, dtype=torch.float64)


@pytest.mark.parametrize("ensemble", ["mean", "wco", "uwo"])
@pytest.mark.parametrize("K", [1, 2, 5])
def test_ensemble_reward_matches_a_float64_loop(ensemble, K):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        members = (torch.randn(K, 16, generator=g) * 2).double()
        uwo_coef = float(torch.rand(1, generator=g)) * 3
        got = ppo_rlhf.ensemble_reward(members, ensemble, uwo_coef)
        torch.testing.assert_close(got, ensemble_reference(members, ensemble, uwo_coef), rtol=1e-12, atol=1e-12)
        if K == 1:  # one model: its own score, exactly, whatever the combination
            assert torch.equal(got, members[0])


def test_ensemble_reward_properties():
    g = torch.Generator().manual_seed(0)
    members = torch.randn(4, 64, generator=g)
    mean = ppo_rlhf.ensemble_reward(members, "mean", 1.0)
    assert (ppo_rlhf.ensemble_reward(members, "wco", 1.0) <= mean).all()  # the worst case is never above the mean
    assert torch.equal(ppo_rlhf.ensemble_reward(members, "uwo", 0.0), mean)  # UWO at lambda 0 is the mean
    assert (ppo_rlhf.ensemble_reward(members, "uwo", 2.0) <= mean).all()
    for K in (2, 3):  # members that agree: every combination is their score (exactly for 2: x + x halves exactly)
        agree = members[:1].expand(K, -1)
        for ensemble in ("mean", "wco", "uwo"):
            got = ppo_rlhf.ensemble_reward(agree, ensemble, 5.0)
            assert torch.equal(got, members[0]) if K == 2 else torch.allclose(got, members[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unknown ensemble"):
        ppo_rlhf.ensemble_reward(members, "median", 1.0)


def missing_eos_reference(scores, has_eos, penalty):
    """The missing-EOS rule by a plain loop in float64: a response without EOS scores the penalty, or the lowest
    score of a finished response in the batch where that is lower."""
    finished = [x for x, ends in zip(scores.double().tolist(), has_eos.tolist()) if ends]
    floor = min([penalty, *finished])
    rule = [x if ends else floor for x, ends in zip(scores.double().tolist(), has_eos.tolist())]
    return torch.tensor(rule, dtype=torch.float64)


class OneProcess:
    """The accelerator as reward_model_scores uses it: gather, over one process, or over others whose batches'
    lowest finished scores are `others`."""

    def __init__(self, others=()):
        self.others = torch.tensor(others, dtype=torch.float64)

    def gather(self, tensor):
        return torch.cat([tensor, self.others.to(tensor.dtype)])


def scored_batch(monkeypatch, member_scores, has_eos, stop_id=2):
    """reward_model_scores' inputs for B responses (prompts of 3 tokens, responses of 6, an EOS at a random place in
    the finished ones) whose reward models score member_scores [K, B]."""
    generator = torch.Generator().manual_seed(len(has_eos))
    B, R = len(has_eos), 6
    responses = torch.randint(10, 100, (B, R), generator=generator)
    ends = torch.randint(0, R, (B,), generator=generator)
    responses[has_eos, ends[has_eos]] = stop_id
    query_responses = torch.cat([torch.randint(10, 100, (B, 3), generator=generator), responses], 1)
    monkeypatch.setattr(ppo_rlhf, "member_scores_of", lambda *args: member_scores)
    return query_responses, torch.ones_like(query_responses), 3, torch.ones(B, R), [stop_id]


@pytest.mark.parametrize("penalty", [-1.0, 0.0, None])
def test_missing_eos_scores_matches_a_float64_loop(penalty):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        scores, has_eos = (torch.randn(32, generator=g) * 2).double(), torch.rand(32, generator=g) < 0.7
        lowest = scores[has_eos].min().item() if has_eos.any() else math.inf
        got = ppo_rlhf.missing_eos_scores(scores, has_eos, penalty, lowest)
        assert torch.equal(got, scores if penalty is None else missing_eos_reference(scores, has_eos, penalty))
    unfinished = ppo_rlhf.missing_eos_scores(torch.tensor([0.5, -3.0]), torch.tensor([False, False]), -1.0, math.inf)
    assert unfinished.tolist() == [-1.0, -1.0]  # nothing finished to rank against: the constant


@pytest.mark.parametrize("ensemble", ["mean", "wco", "uwo"])
@pytest.mark.parametrize("K", [1, 5])
@pytest.mark.parametrize("penalty", [-1.0, 0.0])
def test_a_response_without_eos_never_scores_above_a_finished_one(monkeypatch, ensemble, K, penalty):
    """Under an ensemble, whose reward sits below a member's score (WCO most of all: 0.378 against the
    members' 0.84-1.57), the fixed penalty scored truncated responses above finished ones of the batch. The training
    reward keeps them at or below every finished response of the batch, over every process's batch."""
    g = torch.Generator().manual_seed(K * 10 + len(ensemble))
    scales = 0.5 + 1.5 * torch.rand(K, 1, generator=g, dtype=torch.float64)  # members on their own scales
    members = torch.randn(K, 1, generator=g, dtype=torch.float64) + scales * torch.randn(K, 64, generator=g)
    has_eos = torch.rand(64, generator=g) < 0.6
    inputs = scored_batch(monkeypatch, members, has_eos)
    flags = dict(missing_eos_penalty=penalty, reward_ensemble=ensemble, uwo_coef=1.0)
    scores, got_eos, _ = ppo_rlhf.reward_model_scores(None, *inputs, OneProcess(), batch_floor=True, **flags)
    assert torch.equal(got_eos, has_eos)
    assert scores[~has_eos].max() <= scores[has_eos].min()
    combined = ppo_rlhf.ensemble_reward(members, ensemble, 1.0)
    assert (combined[has_eos] < penalty).any()  # the fixed penalty alone would have broken the invariant
    assert torch.equal(scores, missing_eos_reference(combined, has_eos, penalty))
    # Over two processes: the other one's batch has a finished response scoring lower still; the floor follows it.
    lower = combined[has_eos].min().item() - 1.0
    scores, _, _ = ppo_rlhf.reward_model_scores(None, *inputs, OneProcess([lower]), batch_floor=True, **flags)
    assert (scores[~has_eos] == lower).all() and torch.equal(scores[has_eos], combined[has_eos])
    # Evaluation (no batch_floor) keeps the constant: a score that does not depend on the other responses.
    scores, _, _ = ppo_rlhf.reward_model_scores(None, *inputs, OneProcess(), **flags)
    assert (scores[~has_eos] == penalty).all() and torch.equal(scores[has_eos], combined[has_eos])


def test_one_reward_model_keeps_the_fixed_penalty_where_it_kept_the_invariant(monkeypatch):
    """One reward model whose finished responses all score above the penalty (the invariant already held): the
    reward is exactly the fixed penalty's, torch.where(has_eos, score, -1)."""
    g = torch.Generator().manual_seed(54)
    member = torch.randn(1, 64, generator=g)
    has_eos = torch.rand(64, generator=g) < 0.6
    member[0, has_eos] = member[0, has_eos].clamp(min=-0.999)
    inputs = scored_batch(monkeypatch, member, has_eos)
    for ensemble in ("mean", "wco", "uwo"):
        flags = dict(missing_eos_penalty=-1.0, reward_ensemble=ensemble, uwo_coef=1.0)
        scores, _, _ = ppo_rlhf.reward_model_scores(None, *inputs, OneProcess([0.5]), batch_floor=True, **flags)
        assert torch.equal(scores, torch.where(has_eos, member[0], torch.full_like(member[0], -1.0)))


@pytest.fixture(scope="module")
def two_member_ensemble(tiny_reward_model_dir, tmp_path_factory):
    """An ensemble folder of two copies of the tiny reward model (member_0, member_1), with a README beside them."""
    folder = tmp_path_factory.mktemp("ensemble")
    for k in range(2):
        shutil.copytree(tiny_reward_model_dir, folder / f"member_{k}")
    (folder / "README.md").write_text("not a model")
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("ensemble", ["mean", "wco", "uwo"])
def test_an_ensemble_of_identical_members_trains_as_the_single_model(make_config, two_member_ensemble, ensemble):
    """Two copies of one reward model agree on every response: mean, WCO and UWO all give that model's score, so the
    run is the single-model run number for number (KL 0 and ratio 1 before the first update included), with each
    member's score logged beside it, in training and in evaluation."""
    single = read_metrics(ppo_rlhf.main(make_config(ppo_rlhf, seed=3)))
    double = read_metrics(
        ppo_rlhf.main(make_config(ppo_rlhf, seed=3, reward_model_path=two_member_ensemble, reward_ensemble=ensemble))
    )
    members = [f"{prefix}_member_{k}" for prefix in ("objective/scores", "eval/score") for k in range(2)]
    for one, two in zip(without_timing(single), without_timing(double)):
        assert {k: v for k, v in two.items() if "_member_" not in k} == one
    for line in train_lines(double):
        assert line["objective/scores_member_0"] == line["objective/scores_member_1"] == line["objective/scores"]
    assert double[-1]["eval/score_member_0"] == double[-1]["eval/score"] and set(members) <= set(double[-1])
    assert not any("_member_" in key for line in single for key in line)
    assert (
        train_lines(single)[0]["objective/kl"] == 0.0 and train_lines(single)[0]["policy/ratio_first_minibatch"] == 1.0
    )


def test_reward_model_members_reads_a_model_or_an_ensemble_folder(tiny_reward_model_dir, two_member_ensemble):
    assert ppo_rlhf._reward_model_members(tiny_reward_model_dir) == [tiny_reward_model_dir]
    members = ppo_rlhf._reward_model_members(two_member_ensemble)
    assert [os.path.basename(m) for m in members] == ["member_0", "member_1"]
    assert ppo_rlhf._reward_model_members("org/hub-model") == ["org/hub-model"]
