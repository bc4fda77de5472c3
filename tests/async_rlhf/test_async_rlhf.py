"""async_rlhf.py: its losses, rewards and advantages against plain loops, the generator/learner pipeline (bounded
lag, weight versions, the generator really holding the learner's weights, shutdown on errors in either thread),
end-to-end tiny runs async and --sync, resume, vLLM, golden-trajectory invariants (two processes = one, DeepSpeed
ZeRO-3 = one process, gradient accumulation, staleness 0 = --sync, bf16 autocast at lag 0), and bad input."""

import collections
import contextlib
import faulthandler
import functools
import inspect
import json
import math
import os
import shutil
import threading
import time

import fixed_rollout
import pytest
import torch
from conftest import (
    FAST,
    REPO_ROOT,
    NoModelLoads,
    assert_eval_ref_perplexity_is_worked_out_here,
    assert_same_trajectory,
    assert_same_weights,
    cli_flags,
    launch_fixed_rollout,
    one_line_error,
    only_run_dir,
    read_metrics,
    require_deepspeed,
    train_lines,
    without_timing,
)
from safetensors.torch import load_file

import async_rlhf

GENERATOR_THREAD = "async_rlhf-generator"


# The math, in float64 against plain Python loops (dpo_loss is tested in test_dpo_online.py, clipped_surrogate and
# kl_estimate in test_grpo_math_math.py: the drift test keeps the copies identical)


def loop_kl(log_ratio, kind):
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return math.exp(-log_ratio) + log_ratio - 1


def random_completions(generator, rows, width):
    """Log-probs [rows, width] in float64 and a mask of 1..width real tokens per row (then 0)."""
    logprobs = -3 * torch.rand(rows, width, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).double()
    return logprobs, mask


def loop_async_dpo(logprobs, mask, ref_sequence_logps, sampler_logprobs, keep, normalizer, beta, loss_type, cap):
    """async_dpo_loss by a loop over pairs: (loss, the 8 sums, the mean truncated importance weight or None)."""
    b, width = len(keep), logprobs.shape[1]
    lp, m, ref, k = logprobs.tolist(), mask.tolist(), ref_sequence_logps.tolist(), keep.tolist()
    total, sums, weights = 0.0, [0.0] * 8, []
    for i in range(b):
        c, r = (sum(lp[j][t] * m[j][t] for t in range(width)) for j in (i, b + i))
        h = (c - ref[i]) - (r - ref[b + i])
        if loss_type == "sigmoid":
            x = beta * h  # -log sigmoid(x), written stably for both signs
            loss = math.log1p(math.exp(-x)) if x >= 0 else -x + math.log1p(math.exp(x))
        else:
            loss = (h - 1 / (2 * beta)) ** 2
        tis = 1.0
        if sampler_logprobs is not None and cap is not None:
            s = sampler_logprobs.tolist()
            sampled = sum(s[j][t] * m[j][t] for j in (i, b + i) for t in range(width))
            tis = min(math.exp(c + r - sampled), cap)
            weights.append(tis)
        total += loss * k[i] * tis
        chosen_reward, rejected_reward = beta * (c - ref[i]), beta * (r - ref[b + i])
        row = [loss, chosen_reward, rejected_reward, float(chosen_reward > rejected_reward), c, r, 1.0, 0.0]
        sums = [acc + v * k[i] for acc, v in zip(sums, row[:7])] + [sums[7] + 1 - k[i]]
    return total / normalizer, sums, (sum(weights) / len(weights) if weights else None)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("cap", [None, 1.2])
def test_async_dpo_loss_matches_a_loop(loss_type, cap):
    generator = torch.Generator().manual_seed(5)
    b, width = 6, 9
    logprobs, mask = random_completions(generator, 2 * b, width)
    ref_sequence_logps = ((logprobs + 0.3 * torch.randn(2 * b, width, generator=generator)) * mask).sum(1)
    sampler_logprobs = logprobs + 0.1 * torch.randn(2 * b, width, generator=generator, dtype=torch.float64)
    keep = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # pairs 2 and 4 are ties
    normalizer = torch.tensor(3.5, dtype=torch.float64)
    args = async_rlhf.Config(beta=0.3, loss_type=loss_type, tis_cap=cap)
    logprobs.requires_grad_(True)
    loss, sums, stats = async_rlhf.async_dpo_loss(
        logprobs, mask, ref_sequence_logps, sampler_logprobs, keep, normalizer, args
    )
    expected_loss, expected_sums, expected_tis = loop_async_dpo(
        logprobs.detach(), mask, ref_sequence_logps, sampler_logprobs, keep, normalizer.item(), 0.3, loss_type, cap
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert sums.tolist() == pytest.approx(expected_sums, rel=1e-12, abs=1e-12)
    if cap is None:
        assert stats == {}
    else:
        assert stats["objective/tis_weight"] == pytest.approx(expected_tis, rel=1e-12)
        assert expected_tis < 1.2  # some pairs are clipped at the cap, others are not
    # A tied pair carries no preference: no gradient reaches its completions; every kept pair's completions get one.
    loss.backward()
    grad_per_row = logprobs.grad.abs().sum(1)
    tied_rows = [2, 4, b + 2, b + 4]
    assert (grad_per_row[tied_rows] == 0).all()
    assert (grad_per_row[[i for i in range(2 * b) if i not in tied_rows]] > 0).all()
    # Without vLLM samples there is nothing to reweight.
    plain, _, plain_stats = async_rlhf.async_dpo_loss(logprobs, mask, ref_sequence_logps, None, keep, normalizer, args)
    assert plain_stats == {}
    if cap is None:
        assert plain.item() == loss.item()


def test_async_dpo_loss_at_the_reference_and_the_pair_metrics():
    """Policy == reference: every kept pair's loss is log 2, its implicit rewards 0; a tie only counts as skipped."""
    generator = torch.Generator().manual_seed(2)
    logprobs, mask = random_completions(generator, 8, 5)
    at_reference = (logprobs, mask, (logprobs * mask).sum(1), None)
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    args = async_rlhf.Config(beta=0.1)
    loss, sums, _ = async_rlhf.async_dpo_loss(*at_reference, keep, torch.tensor(1.5, dtype=torch.float64), args)
    assert loss.item() == pytest.approx(3 * math.log(2) / 1.5, rel=1e-12)
    metrics = async_rlhf.dpo_pair_metrics(sums.tolist())
    assert metrics["loss/dpo"] == pytest.approx(math.log(2), rel=1e-12)
    assert metrics["rewards/margins"] == metrics["rewards/accuracies"] == 0.0
    assert metrics["objective/skipped_ties"] == 1.0
    # No kept pair anywhere: the pair means read 0 (not a division by zero).
    _, all_tied, _ = async_rlhf.async_dpo_loss(*at_reference, torch.zeros(4, dtype=torch.float64), 1.0, args)
    metrics = async_rlhf.dpo_pair_metrics(all_tied.tolist())
    assert metrics["loss/dpo"] == 0.0 and metrics["objective/skipped_ties"] == 4.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_rloo_rewards_match_a_loop(kind):
    generator = torch.Generator().manual_seed(len(kind) + ord(kind[1]))
    logprobs, mask = random_completions(generator, 12, 7)
    ref_logprobs = logprobs + 0.5 * torch.randn(12, 7, generator=generator, dtype=torch.float64)
    scores = torch.randn(12, generator=generator, dtype=torch.float64)
    rewards, non_score = async_rlhf.rloo_rewards(scores, logprobs, ref_logprobs, mask, 0.05, kind)
    for i in range(12):
        penalty = sum(
            loop_kl(logprobs[i, t].item() - ref_logprobs[i, t].item(), kind) for t in range(7) if mask[i, t] > 0
        )
        assert non_score[i].item() == pytest.approx(-0.05 * penalty, rel=1e-12, abs=1e-15)
        assert rewards[i].item() == pytest.approx(scores[i].item() - 0.05 * penalty, rel=1e-12, abs=1e-15)
    # Tokens after a completion's end change nothing; no KL coefficient leaves the scores as they are.
    moved = ref_logprobs + 10 * (1 - mask)
    torch.testing.assert_close(async_rlhf.rloo_rewards(scores, logprobs, moved, mask, 0.05, kind)[0], rewards)
    torch.testing.assert_close(async_rlhf.rloo_rewards(scores, logprobs, ref_logprobs, mask, 0.0, kind)[0], scores)


def missing_eos_reference(scores, has_eos, penalty, others=()):
    """RLOO's missing-EOS rule by a plain loop in float64: a completion without EOS scores the penalty, or the lowest
    score of a finished completion of the step (this process's and the others') where that is lower."""
    finished = [x for x, ends in zip(scores.double().tolist(), has_eos.tolist()) if ends]
    floor = min([penalty, *finished, *others])
    rule = [x if ends else floor for x, ends in zip(scores.double().tolist(), has_eos.tolist())]
    return torch.tensor(rule, dtype=torch.float64)


@pytest.mark.parametrize("penalty", [-1.0, 0.0, None])
def test_rloo_missing_eos_scores_match_a_loop(penalty):
    """RLOO judged a completion without EOS missing_eos_penalty, above every finished one a centred reward
    model scores below it. Now it never scores above a finished completion of the step, on any process."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        scores, has_eos = (torch.randn(24, generator=g) * 2).double(), torch.rand(24, generator=g) < 0.7
        others = [scores.min().item() - 1.0] if seed % 2 else []  # another process's lowest finished score
        gather = functools.partial(lambda t, more: torch.cat([t, torch.tensor(more, dtype=t.dtype)]), more=others)
        got = async_rlhf.step_missing_eos_scores(scores, has_eos, penalty, gather)
        if penalty is None:
            assert torch.equal(got, scores)
            continue
        assert torch.equal(got, missing_eos_reference(scores, has_eos, penalty, others))
        assert got[~has_eos].max() <= got[has_eos].min()
    unfinished = async_rlhf.step_missing_eos_scores(
        torch.tensor([0.5, -3.0]), torch.tensor([False, False]), -1.0, torch.clone
    )
    assert unfinished.tolist() == [-1.0, -1.0]  # nothing finished anywhere: the constant


@pytest.mark.slow
def test_rloo_trains_on_the_missing_eos_rule(make_config, monkeypatch):
    """The loop: a batch whose finished completions score below the penalty (-1) reaches rloo_update with its
    unfinished ones at the step's lowest finished score, not at -1; the logged objective/scores is their mean."""
    scores = torch.tensor([-2.0, 0.5, -1.5, 0.3, -3.0, 1.0])
    has_eos = torch.tensor([True, False, True, False, False, True])
    next_batch, seen = async_rlhf.AsyncGenerator.next_batch, []

    def fixed_judgement(self, step):
        batch, metrics = next_batch(self, step)
        return batch | {"scores": scores.to(batch["mask"].device), "has_eos": has_eos.clone()}, metrics

    def recorded(*args):
        seen.append(args[6].clone())
        return rloo_update(*args)

    rloo_update = async_rlhf.rloo_update
    monkeypatch.setattr(async_rlhf.AsyncGenerator, "next_batch", fixed_judgement)
    monkeypatch.setattr(async_rlhf, "rloo_update", recorded)
    args = make_config(
        async_rlhf,
        loss="rloo",
        rloo_k=3,
        prompts_per_rank=2,
        micro_batch_size=1,
        total_steps=1,
        missing_eos_penalty=-1.0,
    )
    with hang_guard():
        lines = train_lines(read_metrics(async_rlhf.main(args)))
    expected = missing_eos_reference(scores, has_eos, -1.0)
    assert seen[0].tolist() == expected.tolist() == [-2.0, -2.0, -1.5, -2.0, -2.0, 1.0]
    assert lines[0]["objective/scores"] == pytest.approx(expected.mean().item())


@pytest.mark.parametrize("k", [2, 3, 5])
def test_rloo_advantages_match_a_loop(k):
    generator = torch.Generator().manual_seed(k)
    rewards = torch.randn(7 * k, generator=generator, dtype=torch.float64) * 3
    expected = []
    for prompt in range(7):
        group = rewards[prompt * k : (prompt + 1) * k].tolist()
        for j, r in enumerate(group):
            others = [x for i, x in enumerate(group) if i != j]
            expected.append(r - sum(others) / len(others))
    advantages = async_rlhf.rloo_advantages(rewards, k)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # Each prompt's advantages sum to 0, and a constant added to a prompt's rewards changes nothing.
    torch.testing.assert_close(advantages.view(7, k).sum(1), torch.zeros(7, dtype=torch.float64))
    shifted = rewards + torch.arange(7, dtype=torch.float64).repeat_interleave(k) * 10
    torch.testing.assert_close(async_rlhf.rloo_advantages(shifted, k), advantages)


@pytest.mark.parametrize("eps", [0.1, 0.2])
def test_rloo_loss_matches_a_loop(eps):
    generator = torch.Generator().manual_seed(11)
    old, mask = random_completions(generator, 6, 9)
    new = old + 0.4 * torch.randn(6, 9, generator=generator, dtype=torch.float64)  # ratios on both sides of the clip
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)
    loss, stats = async_rlhf.rloo_loss(new, old, advantages, mask, eps, 13.0)
    total, ratios, clipped, approxkl = 0.0, [], [], []
    for i in range(6):
        for t in range(9):
            if mask[i, t] > 0:
                r, a = math.exp(new[i, t].item() - old[i, t].item()), advantages[i].item()
                total += -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
                ratios.append(r)
                clipped.append(float(abs(r - 1) > eps))
                approxkl.append(0.5 * (new[i, t].item() - old[i, t].item()) ** 2)
    assert loss.item() == pytest.approx(total / 13.0, rel=1e-12)
    assert stats["policy/ratio"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
    assert stats["policy/clipfrac"] == pytest.approx(sum(clipped) / len(clipped), rel=1e-6)  # a float32 mean
    assert 0 < stats["policy/clipfrac"] < 1
    assert stats["policy/approxkl"] == pytest.approx(sum(approxkl) / len(approxkl), rel=1e-12)
    # On-policy (ratio 1) the loss is -A per real token: the policy gradient of REINFORCE with the RLOO baseline.
    loss, stats = async_rlhf.rloo_loss(old, old, advantages, mask, eps, 13.0)
    assert loss.item() == pytest.approx(-(advantages * mask.sum(1)).sum().item() / 13.0, rel=1e-12)
    assert stats == {"policy/ratio": 1.0, "policy/clipfrac": 0.0, "policy/approxkl": 0.0}


# End-to-end runs of the tiny policy

TIME_KEYS = (
    "time/generation",
    "time/training",
    "time/weight_sync",
    "time/weight_load",
    "time/learner_idle",
    "time/generator_idle",
    "time/reward",
    "time/step",
)

LOG2 = torch.tensor(math.log(2)).item()


def generator_threads():
    return [t for t in threading.enumerate() if t.name == GENERATOR_THREAD]


@contextlib.contextmanager
def hang_guard(seconds=120):
    """A hung run dumps every thread's stack and ends the test process instead of blocking CI."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def slowed(function, seconds):
    """`function` that first sleeps: makes one side of the pipeline the slow one, so that the lags are certain."""

    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)

    return wrapper


@pytest.mark.slow
def test_sync_run_has_lag_zero_and_logs_the_pipeline(make_config):
    run_dir = async_rlhf.main(make_config(async_rlhf, sync=True))
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)["args"]
    assert config["num_completions"] == 2 and config["gradient_accumulation_steps"] == 2 and config["sync"] is True
    lines = read_metrics(run_dir)
    assert [line["global_step"] for line in lines] == [0, 1, 2, 3]
    assert all(isinstance(line["time"], float) for line in lines)  # wall clock on every line, evaluation included
    assert [line["time"] for line in lines] == sorted(line["time"] for line in lines)
    for step, line in enumerate(train_lines(lines)):
        assert line["policy/lag"] == 0 and line["policy/generator_version"] == step  # every batch on-policy
        assert line["policy/staleness"] == 0 and line["policy/staleness_max"] == 0  # one update per batch
        missing = [k for k in TIME_KEYS if k not in line]
        assert not missing, missing
        assert all(math.isfinite(v) for v in line.values())
    first = train_lines(lines)[0]
    assert first["loss/dpo"] == pytest.approx(LOG2, abs=1e-7)  # the first update starts at the reference
    assert first["rewards/margins"] == 0.0 and first["objective/kl"] == 0.0
    assert lines[-1]["objective/kl"] != 0.0
    assert not generator_threads()


@pytest.mark.slow
def test_one_step_off_policy_pipeline_and_the_generator_holds_the_learners_weights(make_config, monkeypatch, tmp_path):
    """N = 1 with a slow learner (so that the lags are certain): batch 0 from the initial weights, batch 1 from the
    initial weights too (generated while the learner trains on batch 0), batch t + 1 from the weights after step t.
    The generator's model at every batch is exactly the learner's checkpoint of that version, and its greedy output
    changes as the weights change."""
    probe = [1, 2, 3, 4]  # a fixed prompt for the generator's greedy output
    seen = []  # per sampled batch: (generator's weights, its greedy answer to the probe)
    original = async_rlhf._hf_generate

    def recording_generate(model, prompts, n, response_length, temperature, *rest):
        if temperature > 0:  # a training batch (evaluation is greedy)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            greedy = original(model, [probe], 1, 6, 0.0, *rest)[0][0].tolist()
            seen.append((weights, greedy))
        return original(model, prompts, n, response_length, temperature, *rest)

    monkeypatch.setattr(async_rlhf, "_hf_generate", recording_generate)
    monkeypatch.setattr(async_rlhf, "dpo_loss", slowed(async_rlhf.dpo_loss, 0.3))
    args = make_config(
        async_rlhf, total_steps=4, max_staleness=1, save_every=1, keep_checkpoints=10, learning_rate=3e-2
    )
    with hang_guard():
        run_dir = async_rlhf.main(args)
    lines = train_lines(read_metrics(run_dir))
    assert [line["policy/generator_version"] for line in lines] == [0, 0, 1, 2]
    assert [line["policy/lag"] for line in lines] == [0, 1, 1, 1]
    assert len(seen) == 4
    initial = load_file(os.path.join(args.model_name_or_path, "model.safetensors"))
    for (weights, _), version in zip(seen, [0, 0, 1, 2]):
        expected = (
            initial
            if version == 0
            else load_file(os.path.join(run_dir, "checkpoints", f"step_{version:06d}", "model.safetensors"))
        )
        assert expected.keys() <= weights.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in expected), f"batch of version {version}"
    greedy = [answer for _, answer in seen]
    assert greedy[0] == greedy[1]  # same weights, same greedy answer
    assert greedy[3] != greedy[0]  # two updates later the generator answers differently: it got the new weights


@pytest.mark.slow
def test_rloo_lags_reach_but_never_pass_max_staleness(make_config, monkeypatch):
    """N = 2 with a slow learner: the generator runs two batches ahead, each batch two updates old."""
    monkeypatch.setattr(async_rlhf, "clipped_surrogate", slowed(async_rlhf.clipped_surrogate, 0.15))
    args = make_config(
        async_rlhf, loss="rloo", rloo_k=3, prompts_per_rank=2, micro_batch_size=1, total_steps=5, max_staleness=2
    )
    with hang_guard():
        run_dir = async_rlhf.main(args)
    lines = train_lines(read_metrics(run_dir))
    assert [line["policy/lag"] for line in lines] == [0, 1, 2, 2, 2]
    # One update per batch: the update is as many updates stale as its batch's lag.
    assert [(line["policy/staleness"], line["policy/staleness_max"]) for line in lines] == [(0, 0), (1, 1)] + [
        (2, 2)
    ] * 3
    assert [line["policy/generator_version"] for line in lines] == [0, 0, 0, 1, 2]
    assert [line["episode"] for line in lines] == [6, 12, 18, 24, 30]  # 2 prompts * 3 completions per step
    for line in lines:
        for key in ("loss/policy", "policy/ratio", "policy/clipfrac", "policy/approxkl", "objective/rlhf_reward"):
            assert math.isfinite(line[key]), key
    assert lines[-1]["policy/approxkl"] > 0  # off-policy batches: the learner's policy is not the generator's


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["rloo", "dpo"])
def test_sync_minibatch_i_is_i_updates_stale(make_config, tmp_path, loss):
    """--sync with N minibatches per batch (the paper's off-policyness N): minibatch i is trained i updates after the
    weights that generated it. With one minibatch the update is on-policy (the policy's log-probs are the
    generator's); with two the last minibatch sees a policy one update away from the generator's. DPO (no ratio in
    its loss) logs that figure only with several minibatches, where its generator scores its samples."""
    values = dict(sync=True, loss=loss, rloo_k=2, total_steps=2, learning_rate=1e-2)
    one, two = (
        train_lines(
            read_metrics(
                async_rlhf.main(
                    make_config(async_rlhf, num_minibatches=n, output_dir=str(tmp_path / f"{n}"), **values)
                )
            )
        )
        for n in (1, 2)
    )
    assert all(line["policy/staleness"] == 0 and line["policy/staleness_max"] == 0 for line in one)
    if loss == "rloo":
        assert all(line["policy/approxkl_last_minibatch"] < 1e-10 for line in one)
    else:
        assert all("policy/approxkl_last_minibatch" not in line for line in one)
    assert all(line["policy/staleness"] == 0.5 and line["policy/staleness_max"] == 1 for line in two)
    assert all(line["policy/approxkl_last_minibatch"] > 1e-6 for line in two)


@pytest.mark.slow
def test_eval_ref_perplexity_is_worked_out_here(make_config, tiny_model_dir, monkeypatch):
    args = make_config(async_rlhf, total_steps=1, num_eval_prompts=4, sync=True)
    assert_eval_ref_perplexity_is_worked_out_here(
        async_rlhf, async_rlhf.AsyncGenerator, args, tiny_model_dir, monkeypatch.setattr
    )


@pytest.mark.slow
def test_sync_rloo_with_lora_starts_on_policy(make_config):
    """--sync RLOO: the generator's copy (LoRA merged into it) scores the samples as the learner does, so the first
    ratio is 1 and nothing is clipped; the reference is the adapters switched off, so the KL starts at 0."""
    args = make_config(async_rlhf, sync=True, loss="rloo", rloo_k=2, lora_r=4, total_steps=2, learning_rate=1e-2)
    every_line = read_metrics(async_rlhf.main(args))
    assert not any("eval/ref_perplexity" in line for line in every_line)  # the reference is the adapters off
    lines = train_lines(every_line)
    first = lines[0]
    assert first["policy/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert first["policy/approxkl"] < 1e-10 and first["policy/clipfrac"] == 0.0
    assert first["objective/kl"] == 0.0 and first["objective/non_score_reward"] == 0.0
    assert [line["policy/lag"] for line in lines] == [0, 0]
    assert lines[1]["objective/kl"] != 0.0  # the adapters moved, and the generator sampled from the moved policy


@pytest.mark.slow
def test_learner_error_stops_the_generator(make_config, monkeypatch):
    monkeypatch.setattr(async_rlhf, "token_scores", lambda *args: torch.full(args[2].shape, float("nan")))
    with hang_guard(), pytest.raises(RuntimeError, match="objective/scores"):
        async_rlhf.main(make_config(async_rlhf, num_eval_prompts=1, total_steps=4, max_staleness=2))
    assert not generator_threads()


@pytest.mark.slow
def test_generator_error_reaches_the_user(make_config, monkeypatch):
    calls = []
    original = async_rlhf._hf_generate

    def failing_generate(model, prompts, n, response_length, temperature, *rest):
        if temperature > 0:
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("generator broke at batch 1")
        return original(model, prompts, n, response_length, temperature, *rest)

    monkeypatch.setattr(async_rlhf, "_hf_generate", failing_generate)
    with hang_guard(), pytest.raises(ValueError, match="generator broke at batch 1"):
        async_rlhf.main(make_config(async_rlhf, total_steps=4))
    assert not generator_threads()


@pytest.mark.slow
def test_invariant_sync_resume_after_interrupt_gives_the_uninterrupted_run(make_config, monkeypatch, tmp_path):
    overrides = dict(sync=True, total_steps=4, save_every=2)
    run_a = async_rlhf.main(make_config(async_rlhf, output_dir=str(tmp_path / "a"), **overrides))

    calls = []  # pairs are assigned once per learner step: interrupt step 3
    original = async_rlhf.assign_preferences

    def interrupting_assignment(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(async_rlhf, "assign_preferences", interrupting_assignment)
    with hang_guard(), pytest.raises(KeyboardInterrupt):
        async_rlhf.main(make_config(async_rlhf, output_dir=str(tmp_path / "b"), **overrides))
    assert not generator_threads()
    monkeypatch.setattr(async_rlhf, "assign_preferences", original)
    run_b = only_run_dir(tmp_path / "b")
    assert [line["global_step"] for line in read_metrics(run_b)] == [0, 1, 2]
    async_rlhf.main(make_config(async_rlhf, output_dir=str(tmp_path / "b"), resume=run_b, **overrides))
    lines_a, lines_b = read_metrics(run_a), read_metrics(run_b)
    assert [line["global_step"] for line in lines_b] == [0, 1, 2, 3, 4]
    assert [line["policy/generator_version"] for line in train_lines(lines_b)] == [0, 1, 2, 3]
    assert without_timing(lines_b) == without_timing(lines_a)  # deterministic, and the resume is exact


# The fixed rollout (tests/fixed_rollout.py) under bf16 autocast; the launch paths' invariants are
# tests/launch_paths/test_launch_paths.py's table. --sync, so that every batch has lag 0 whatever the timing; the
# reward model scores the fixed completions (no patch needed).

INVARIANT_ARGS = dict(
    sync=True,
    total_steps=2,
    lr_scheduler="linear",  # a decaying schedule shows a scheduler stepped once per process
    learning_rate=1e-3,
    rloo_k=2,
    eval_every=0,
    num_eval_prompts=4,
)
INVARIANT_KEYS = (
    "loss/dpo",
    "loss/policy",
    "policy/grad_norm",
    "lr",
    "objective/scores",
    "objective/kl",
    "rewards/margins",
    "policy/ratio",
    "objective/rlhf_reward",
    "eval/ref_perplexity",  # sharded over the processes, then summed
)


def fixed_rollout_run(monkeypatch, make_config, **overrides):
    fixed_rollout.patch(async_rlhf, monkeypatch.setattr)
    return async_rlhf.main(make_config(async_rlhf, **{**INVARIANT_ARGS, **overrides}))


def final_weights(run_dir):
    return os.path.join(run_dir, "model", "model.safetensors")


PROBE_PROMPT = [1, 4093, 198, 2683]  # a fixed prompt that the generator's copy answers greedily at every batch


def instrument(module, setter, real_generate, record):
    """Record, per thread, how often `module`'s gathered_parameters is entered (under ZeRO-3 a collective call: the
    weight pushes to the generator's copy), and at every call of its sampler (the fixed rollout by now): the thread,
    whether the model's parameters are whole, a greedy answer to PROBE_PROMPT by the real HF generate, and the sum of
    each parameter (float64). `record` is {"gathered": Counter, "calls": list}."""
    sampler, gathered = module._hf_generate, module._gathered_parameters

    def counting_gathered(accelerator, model):
        record["gathered"][threading.current_thread().name] += 1
        return gathered(accelerator, model)

    def recording_generate(model, prompts, n, response_length, temperature, *rest):
        greedy = real_generate(model, [PROBE_PROMPT], 1, 4, 0.0, *rest)[0][0].tolist()
        sums = {name: p.detach().double().sum().item() for name, p in model.named_parameters()}
        whole = all(p.numel() > 0 for p in model.parameters())
        call = {"thread": threading.current_thread().name, "temperature": temperature, "whole": whole}
        record["calls"].append({**call, "greedy": greedy, "sums": sums})
        return sampler(model, prompts, n, response_length, temperature, *rest)

    setter(module, "_gathered_parameters", counting_gathered)
    setter(module, "_hf_generate", recording_generate)


# The program that tests/fixed_rollout.py launches for the ZeRO-3 test (as a module on PYTHONPATH): async_rlhf's
# Config and main, with main instrumented once fixed_rollout has put its sampler in place (here), and each process's
# record written to a file. `instrument` is this file's, by its source (the test module is not imported there).
ZERO3_PROBE = f"""import collections, json, os, threading

import async_rlhf

PROBE_PROMPT = {PROBE_PROMPT!r}
Config = async_rlhf.Config
REAL_GENERATE = _hf_generate = async_rlhf._hf_generate  # fixed_rollout.patch replaces _hf_generate here


def main(args):
    async_rlhf._hf_generate = _hf_generate
    record = {{"gathered": collections.Counter(), "calls": []}}
    instrument(async_rlhf, setattr, REAL_GENERATE, record)
    run_dir = async_rlhf.main(args)
    with open(os.path.join(os.environ["ZERO3_PROBE_DIR"], f"rank{{os.environ['RANK']}}.json"), "w") as f:
        json.dump(record, f)
    return run_dir


""" + inspect.getsource(instrument)


def parameter_sums(file):
    return {name: t.double().sum().item() for name, t in load_file(file).items()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3])
def test_invariant_deepspeed_equals_one_process(
    tiny_model_dir, tiny_reward_model_dir, task_dir, tmp_path, make_config, monkeypatch, stage
):
    """DeepSpeed ZeRO-3 with the shipped config, 2 CPU processes (gloo) with 2 prompts each = 1 process with the 4
    prompts, through the async pipeline (the generator thread, at max_staleness 0 so that every batch has lag 0
    whatever the timing): the same loss, grad norm, lr, ratio and saved weights (micro-batches of 1 prompt: DeepSpeed
    accumulates 2 per update). Under ZeRO-3 the policy is sharded: the generator thread must generate from its whole
    copy (HF generate with synced_gpus off: no collective from the thread), whose weights every process refreshes
    from the policy's gathered parameters on the main thread, as often on each; the reference and the reward model
    load whole. RLOO: the generator's copy scores the old log-probs, so a copy without the policy's weights breaks
    the ratio."""
    require_deepspeed()
    values = dict(loss="rloo", sync=False, max_staleness=0)
    original = async_rlhf._hf_generate
    fixed_rollout.patch(async_rlhf, monkeypatch.setattr)
    one_record = {"gathered": collections.Counter(), "calls": []}
    instrument(async_rlhf, monkeypatch.setattr, original, one_record)
    with hang_guard():
        one = async_rlhf.main(
            make_config(
                async_rlhf, **{**INVARIANT_ARGS, **values, "prompts_per_rank": 4, "output_dir": str(tmp_path / "1")}
            )
        )
    out, probe_dir = str(tmp_path / f"zero{stage}"), tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "zero3_probe.py").write_text(ZERO3_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(probe_dir))
    monkeypatch.setenv("ZERO3_PROBE_DIR", str(probe_dir))
    paths = dict(model_name_or_path=tiny_model_dir, reward_model_path=tiny_reward_model_dir, dataset_path=task_dir)
    flags = {**FAST["async_rlhf"], **INVARIANT_ARGS, **paths, **values, "prompts_per_rank": 2, "micro_batch_size": 1}
    config = os.path.join(REPO_ROOT, "benchmark", "accelerate_configs", f"deepspeed_zero{stage}.yaml")
    zero = launch_fixed_rollout("zero3_probe.py", cli_flags({**flags, "output_dir": out}), out, config_file=config)
    lines = read_metrics(zero)
    assert [line["policy/lag"] for line in train_lines(lines)] == [0, 0]
    assert train_lines(lines)[0]["policy/ratio"] == pytest.approx(1.0, abs=1e-6)  # the copy holds the policy
    # abs 1e-6 as in the accumulation test: the KL (~0.03) is a mean of differences of log-probs of size ~10, whose
    # float32 rounding is ~1e-6 (observed with deepspeed 0.19.8: 7.2e-7 at step 2, every other key within 2e-6 rel).
    assert_same_trajectory(one, zero, INVARIANT_KEYS, abs_=1e-6)

    records = [json.loads((probe_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        # The weight pushes: once before training and once per step, on the main thread of every process.
        assert record["gathered"] == {"MainThread": 3}
        assert all(call["whole"] for call in record["calls"])  # the generator's copy is never sharded
        batches = [call for call in record["calls"] if call["temperature"] > 0]
        assert [call["thread"] for call in batches] == [GENERATOR_THREAD] * 2  # batches 0 and 1
        # Evaluations (before and after training) on the main thread, after the last push.
        assert [call["thread"] for call in record["calls"] if call["temperature"] == 0] == ["MainThread"] * 2
    # Both processes' copies hold the same weights at every call: the same greedy answers, the same sums.
    assert [c["greedy"] for c in records[0]["calls"]] == [c["greedy"] for c in records[1]["calls"]]
    assert [c["sums"] for c in records[0]["calls"]] == [c["sums"] for c in records[1]["calls"]]
    calls = records[0]["calls"]
    initial = os.path.join(tiny_model_dir, "model.safetensors")
    saved = os.path.join(zero, "model", "model.safetensors")
    # Batch 0 from the initial weights, the last evaluation from the trained ones, exactly.
    for call, file in ((calls[1], initial), (calls[-1], saved)):
        sums = parameter_sums(file)
        assert call["sums"].keys() <= sums.keys()
        assert all(call["sums"][name] == sums[name] for name in call["sums"])
    # Batch 1 from the weights after step 1: as in the one-process run.
    one_batch_1 = [call for call in one_record["calls"] if call["temperature"] > 0][1]
    assert one_record["gathered"] == {"MainThread": 3}
    assert calls[2]["temperature"] > 0 and calls[2]["sums"] != calls[1]["sums"]
    for name, value in one_batch_1["sums"].items():
        assert calls[2]["sums"][name] == pytest.approx(value, rel=1e-5, abs=1e-4), name

    from transformers import AutoModelForCausalLM  # the saved folder loads, with the weights that were trained

    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(zero, "model")).state_dict()
    for name, tensor in load_file(saved).items():
        assert torch.equal(loaded[name], tensor), name
    assert_same_weights(final_weights(one), saved, initial)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dpo", "rloo"])
def test_invariant_staleness_zero_equals_sync(make_config, tmp_path, loss):
    """The async pipeline with max_staleness 0 (the generator thread waits for the current weights) = --sync: the
    same metrics step by step, sampled completions included (a fault: max_staleness 0 was refused)."""
    values = dict(loss=loss, rloo_k=2, total_steps=3, eval_every=2)
    sync = async_rlhf.main(make_config(async_rlhf, sync=True, output_dir=str(tmp_path / "sync"), **values))
    with hang_guard():
        zero = async_rlhf.main(make_config(async_rlhf, max_staleness=0, output_dir=str(tmp_path / "zero"), **values))
    lines = read_metrics(zero)
    assert [line["policy/lag"] for line in train_lines(lines)] == [0, 0, 0]
    assert without_timing(lines) == without_timing(read_metrics(sync))
    assert not generator_threads()


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dpo", "rloo"])
def test_invariant_bf16_autocast_lag_zero_starts_at_the_reference_and_ratio_one(
    make_config, monkeypatch, bf16_autocast, loss
):
    """--mixed_precision bf16 autocasts the prepared policy; the generator thread's policy copy, reference and
    reward model run under the same autocast (entered in that thread: autocast is per thread), so at the first
    step DPO's h is exactly 0 (chosen and rejected rewards 0), the RLOO ratio exactly 1 and the KL exactly 0
    (a fault: they ran in fp32)."""
    run_dir = fixed_rollout_run(monkeypatch, make_config, loss=loss, total_steps=1)
    (line,) = train_lines(read_metrics(run_dir))
    assert line["objective/kl"] == 0.0
    if loss == "dpo":
        assert line["rewards/chosen"] == 0.0 and line["rewards/rejected"] == 0.0
    else:
        assert line["policy/ratio"] == 1.0 and line["policy/approxkl"] == 0.0


def test_generator_gpu_counts_the_gpus_of_this_machine():
    # 7 learners and 1 spare GPU: 7 generators there would hold 7 copies of the policy, reference and reward model
    # (130 GB for a 1.5B model in fp32); each stays on its learner's GPU.
    assert [async_rlhf._generator_gpu(r, 7, 8) for r in range(7)] == [None] * 7
    # 4 learners and 4 spare GPUs: one each.
    assert [async_rlhf._generator_gpu(r, 4, 8) for r in range(4)] == [4, 5, 6, 7]
    # 2 learners per machine of 4 GPUs (on any machine of a multi-node run): GPUs 2 and 3 of each.
    assert [async_rlhf._generator_gpu(r, 2, 4) for r in range(2)] == [2, 3]
    # 3 learners, 2 spare GPUs: not one each, so on the learners' GPUs.
    assert [async_rlhf._generator_gpu(r, 3, 5) for r in range(3)] == [None] * 3
    # 1 learner, 7 spare GPUs: one of them.
    assert async_rlhf._generator_gpu(0, 1, 8) == 1
    # No spare GPU: the learner's own.
    assert async_rlhf._generator_gpu(0, 8, 8) is None
    assert async_rlhf._generator_gpu(1, 2, 1) is None


# Bad input: one clear line naming the argument, before any model is loaded


@pytest.fixture
def args_for(make_config, monkeypatch):
    monkeypatch.setattr(async_rlhf, "AutoModelForCausalLM", NoModelLoads)
    monkeypatch.setattr(async_rlhf, "AutoModelForSequenceClassification", NoModelLoads)
    return functools.partial(make_config, async_rlhf, fast=False, judge="verifier")


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(max_staleness=-1), "--max_staleness"),
        (dict(max_staleness=-1, sync=True), "--max_staleness"),
        (dict(generator_threads=-1), "--generator_threads"),
        (dict(loss="rloo", rloo_k=1), "--rloo_k"),
        (dict(clip_eps=0.0), "--clip_eps"),
        (dict(kl_coef=-0.1), "--kl_coef"),
        (dict(beta=0.0), "--beta"),
        (dict(prompts_per_rank=8, num_minibatches=2, micro_batch_size=3), "--micro_batch_size"),
        (dict(temperature=0.0), "--temperature"),
        (dict(judge="reward_model", reward_model_path="runs/no-such-reward-model"), "--reward_model_path"),
    ],
)
def test_bad_input_stops_before_any_model_loads(args_for, overrides, name):
    one_line_error(async_rlhf.main, args_for(**overrides), name)


def test_verifier_judge_goes_on_to_load_the_policy(args_for):
    with pytest.raises(AssertionError, match="model loaded"):
        async_rlhf.main(args_for())


def test_reward_model_with_the_policys_vocabulary_goes_on_to_load_the_policy(args_for, tiny_reward_model_dir):
    with pytest.raises(AssertionError, match="model loaded"):
        async_rlhf.main(args_for(judge="reward_model", reward_model_path=tiny_reward_model_dir))


def test_an_ensemble_of_reward_models_is_refused_in_one_line(args_for, tiny_reward_model_dir, tmp_path):
    """async_rlhf.py judges with one reward model: a folder of several (what ppo_rlhf.py and dpo_online.py take as an
    ensemble) stops before any model loads, naming the flag and where ensembles are read."""
    for k in range(2):
        shutil.copytree(tiny_reward_model_dir, tmp_path / "ensemble" / f"member_{k}")
    args = args_for(judge="reward_model", reward_model_path=str(tmp_path / "ensemble"))
    message = one_line_error(async_rlhf.main, args, "--reward_model_path", "2 reward models", "ppo_rlhf.py")
    assert "dpo_online.py" in message
