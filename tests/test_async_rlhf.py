"""async_rlhf.py: its losses against plain loops, the generator/learner pipeline (bounded lag, weight versions, the
generator really holding the learner's weights, shutdown on errors in either thread), end-to-end tiny runs async
and --sync, resume, two processes, vLLM, and bad input."""

import contextlib
import faulthandler
import json
import math
import os
import sys
import threading
import time

import pytest
import torch
from conftest import (
    NoModelLoads,
    cli_flags,
    free_port,
    one_line_error,
    only_run_dir,
    read_metrics,
    require_vllm,
    run_checked,
    subprocess_env,
    train_lines,
    vllm_env,
    without_timing,
)
from safetensors.torch import load_file

import async_rlhf

GENERATOR_THREAD = "async_rlhf-generator"


# The math, in float64 against plain Python loops


def loop_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type):
    losses = []
    for c, r, rc, rr in zip(chosen.tolist(), rejected.tolist(), ref_chosen.tolist(), ref_rejected.tolist()):
        h = (c - rc) - (r - rr)
        if loss_type == "sigmoid":
            x = beta * h  # -log sigmoid(x), written stably for both signs
            losses.append(math.log1p(math.exp(-x)) if x >= 0 else -x + math.log1p(math.exp(x)))
        else:
            losses.append((h - 1 / (2 * beta)) ** 2)
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.05, 0.5, 2.0])
def test_dpo_loss_matches_a_loop(loss_type, beta):
    generator = torch.Generator().manual_seed(int(beta * 100))
    chosen, rejected, ref_chosen, ref_rejected = (
        -40 + 15 * torch.randn(64, generator=generator, dtype=torch.float64) for _ in range(4)
    )
    losses = async_rlhf.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type)
    expected = loop_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type)
    assert losses.dtype == torch.float64
    torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)


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
def test_clipped_surrogate_matches_a_loop(eps):
    generator = torch.Generator().manual_seed(11)
    old = -3 * torch.rand(6, 9, generator=generator, dtype=torch.float64)
    new = old + 0.4 * torch.randn(6, 9, generator=generator, dtype=torch.float64)  # ratios on both sides of the clip
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)
    loss, ratio = async_rlhf.clipped_surrogate(new, old, advantages, eps, eps)
    for i in range(6):
        for t in range(9):
            r = math.exp(new[i, t].item() - old[i, t].item())
            a = advantages[i].item()
            expected = -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            assert ratio[i, t].item() == pytest.approx(r, rel=1e-12)
            assert loss[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


# End-to-end runs of the tiny policy

FAST_ARGS = dict(
    num_eval_prompts=4,
    vllm=False,
    response_length=8,
    prompts_per_rank=4,
    micro_batch_size=2,
    total_steps=3,
    save_every=0,
    max_prompt_length=128,
    learning_rate=1e-3,
    missing_eos_penalty=None,  # the random tiny policy never says EOS in 8 tokens: read the reward model instead
)

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


@pytest.fixture
def make_async_args(tiny_model_dir, tiny_reward_model_dir, task_dir, tmp_path):
    def _make(**overrides):
        values = {
            **FAST_ARGS,
            "model_name_or_path": tiny_model_dir,
            "reward_model_path": tiny_reward_model_dir,
            "dataset_path": task_dir,
            "output_dir": str(tmp_path / "runs"),
            **overrides,
        }
        return async_rlhf.Args(**values)

    return _make


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
def test_sync_run_has_lag_zero_and_logs_the_pipeline(make_async_args):
    run_dir = async_rlhf.main(make_async_args(sync=True))
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)["args"]
    assert config["num_completions"] == 2 and config["gradient_accumulation_steps"] == 2 and config["sync"] is True
    lines = read_metrics(run_dir)
    assert [line["global_step"] for line in lines] == [0, 1, 2, 3]
    assert all(isinstance(line["time"], float) for line in lines)  # wall clock on every line, evaluation included
    assert [line["time"] for line in lines] == sorted(line["time"] for line in lines)
    for step, line in enumerate(train_lines(lines)):
        assert line["policy/lag"] == 0 and line["policy/generator_version"] == step  # every batch on-policy
        missing = [k for k in TIME_KEYS if k not in line]
        assert not missing, missing
        assert all(math.isfinite(v) for v in line.values())
    first = train_lines(lines)[0]
    assert first["loss/dpo"] == pytest.approx(LOG2, abs=1e-7)  # the first update starts at the reference
    assert first["rewards/margins"] == 0.0 and first["objective/kl"] == 0.0
    assert lines[-1]["objective/kl"] != 0.0
    assert not generator_threads()


@pytest.mark.slow
def test_one_step_off_policy_pipeline_and_the_generator_holds_the_learners_weights(
    make_async_args, monkeypatch, tmp_path
):
    """N = 1 with a slow learner (so that the lags are certain): batch 0 from the initial weights, batch 1 from the
    initial weights too (generated while the learner trains on batch 0), batch t + 1 from the weights after step t.
    The generator's model at every batch is exactly the learner's checkpoint of that version, and its greedy output
    changes as the weights change."""
    probe = [1, 2, 3, 4]  # a fixed prompt for the generator's greedy output
    seen = []  # per sampled batch: (generator's weights, its greedy answer to the probe)
    original = async_rlhf.hf_generate

    def recording_generate(model, prompts, n, response_length, temperature, *rest):
        if temperature > 0:  # a training batch (evaluation is greedy)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            greedy = original(model, [probe], 1, 6, 0.0, *rest)[0][0].tolist()
            seen.append((weights, greedy))
        return original(model, prompts, n, response_length, temperature, *rest)

    monkeypatch.setattr(async_rlhf, "hf_generate", recording_generate)
    monkeypatch.setattr(async_rlhf, "dpo_loss", slowed(async_rlhf.dpo_loss, 0.3))
    args = make_async_args(total_steps=4, max_staleness=1, save_every=1, keep_checkpoints=10, learning_rate=3e-2)
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
def test_rloo_lags_reach_but_never_pass_max_staleness(make_async_args, monkeypatch):
    """N = 2 with a slow learner: the generator runs two batches ahead, each batch two updates old."""
    monkeypatch.setattr(async_rlhf, "clipped_surrogate", slowed(async_rlhf.clipped_surrogate, 0.15))
    args = make_async_args(
        loss="rloo", rloo_k=3, prompts_per_rank=2, micro_batch_size=1, total_steps=5, max_staleness=2
    )
    with hang_guard():
        run_dir = async_rlhf.main(args)
    lines = train_lines(read_metrics(run_dir))
    assert [line["policy/lag"] for line in lines] == [0, 1, 2, 2, 2]
    assert [line["policy/generator_version"] for line in lines] == [0, 0, 0, 1, 2]
    assert [line["episode"] for line in lines] == [6, 12, 18, 24, 30]  # 2 prompts * 3 completions per step
    for line in lines:
        for key in ("loss/policy", "policy/ratio", "policy/clipfrac", "policy/approxkl", "objective/rlhf_reward"):
            assert math.isfinite(line[key]), key
    assert lines[-1]["policy/approxkl"] > 0  # off-policy batches: the learner's policy is not the generator's


@pytest.mark.slow
def test_sync_rloo_with_lora_starts_on_policy(make_async_args):
    """--sync RLOO: the generator's copy (LoRA merged into it) scores the samples as the learner does, so the first
    ratio is 1 and nothing is clipped; the reference is the adapters switched off, so the KL starts at 0."""
    args = make_async_args(sync=True, loss="rloo", rloo_k=2, lora_r=4, total_steps=2, learning_rate=1e-2)
    lines = train_lines(read_metrics(async_rlhf.main(args)))
    first = lines[0]
    assert first["policy/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert first["policy/approxkl"] < 1e-10 and first["policy/clipfrac"] == 0.0
    assert first["objective/kl"] == 0.0 and first["objective/non_score_reward"] == 0.0
    assert [line["policy/lag"] for line in lines] == [0, 0]
    assert lines[1]["objective/kl"] != 0.0  # the adapters moved, and the generator sampled from the moved policy


@pytest.mark.slow
def test_learner_error_stops_the_generator(make_async_args, monkeypatch):
    monkeypatch.setattr(async_rlhf, "token_scores", lambda *args: torch.full(args[2].shape, float("nan")))
    with hang_guard(), pytest.raises(RuntimeError, match="objective/scores"):
        async_rlhf.main(make_async_args(num_eval_prompts=1, total_steps=4, max_staleness=2))
    assert not generator_threads()


@pytest.mark.slow
def test_generator_error_reaches_the_user(make_async_args, monkeypatch):
    calls = []
    original = async_rlhf.hf_generate

    def failing_generate(model, prompts, n, response_length, temperature, *rest):
        if temperature > 0:
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("generator broke at batch 1")
        return original(model, prompts, n, response_length, temperature, *rest)

    monkeypatch.setattr(async_rlhf, "hf_generate", failing_generate)
    with hang_guard(), pytest.raises(ValueError, match="generator broke at batch 1"):
        async_rlhf.main(make_async_args(total_steps=4))
    assert not generator_threads()


@pytest.mark.slow
def test_sync_resume_after_interrupt_gives_the_uninterrupted_run(make_async_args, monkeypatch, tmp_path):
    overrides = dict(sync=True, total_steps=4, save_every=2)
    run_a = async_rlhf.main(make_async_args(output_dir=str(tmp_path / "a"), **overrides))

    calls = []  # pairs are assigned once per learner step: interrupt step 3
    original = async_rlhf.assign_preferences

    def interrupting_assignment(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(async_rlhf, "assign_preferences", interrupting_assignment)
    with hang_guard(), pytest.raises(KeyboardInterrupt):
        async_rlhf.main(make_async_args(output_dir=str(tmp_path / "b"), **overrides))
    assert not generator_threads()
    monkeypatch.setattr(async_rlhf, "assign_preferences", original)
    run_b = only_run_dir(tmp_path / "b")
    assert [line["global_step"] for line in read_metrics(run_b)] == [0, 1, 2]
    async_rlhf.main(make_async_args(output_dir=str(tmp_path / "b"), resume=run_b, **overrides))
    lines_a, lines_b = read_metrics(run_a), read_metrics(run_b)
    assert [line["global_step"] for line in lines_b] == [0, 1, 2, 3, 4]
    assert [line["policy/generator_version"] for line in train_lines(lines_b)] == [0, 1, 2, 3]
    assert without_timing(lines_b) == without_timing(lines_a)  # deterministic, and the resume is exact


@pytest.mark.slow
def test_two_processes_with_accelerate_launch(tiny_model_dir, tiny_reward_model_dir, task_dir, tmp_path):
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out = str(tmp_path / "runs")
    paths = dict(model_name_or_path=tiny_model_dir, reward_model_path=tiny_reward_model_dir, dataset_path=task_dir)
    flags = cli_flags({**FAST_ARGS, **paths, "output_dir": out, "total_steps": 2})
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    run_checked([*cmd, "async_rlhf.py", *flags], subprocess_env(), timeout=240)
    run_dir = only_run_dir(out)  # one run folder: the processes agreed on the name (rank 0's time)
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["args"]["world_size"] == 2
    lines = read_metrics(run_dir)
    assert [line["episode"] for line in lines] == [0, 16, 32]  # 2 processes * 4 prompts * 2 completions
    assert lines[0]["eval/num_prompts"] == 4  # sharded over the processes, counts summed
    first, second = train_lines(lines)
    assert first["loss/dpo"] == pytest.approx(LOG2, abs=1e-7) and first["policy/lag"] == 0
    assert 0 <= second["policy/lag"] <= 1
    assert second["objective/kl"] != 0.0  # the update reached the policy


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_run(tiny_model_dir, tiny_reward_model_dir, task_dir, tmp_path):
    """The generator thread generates with the vLLM engine and reloads the learner's weights into it."""
    require_vllm()
    out = str(tmp_path / "runs")
    values = {**FAST_ARGS, "vllm": True, "vllm_cpu_kvcache_gib": 1, "tis_cap": 2.0, "sync": True, "total_steps": 2}
    paths = dict(model_name_or_path=tiny_model_dir, reward_model_path=tiny_reward_model_dir, dataset_path=task_dir)
    run_checked([sys.executable, "async_rlhf.py", *cli_flags({**values, **paths, "output_dir": out})], vllm_env(), 300)
    run_dir = only_run_dir(out)
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["vllm"] is True
    lines = train_lines(read_metrics(run_dir))
    assert [line["policy/generator_version"] for line in lines] == [0, 1]
    for line in lines:
        # --sync: the engine holds the learner's current weights, so only numerics separate the two.
        assert 0 <= line["objective/logprob_gap"] < 1e-3
        assert 0.5 < line["objective/tis_weight"] <= 2.0
    assert lines[0]["loss/dpo"] == pytest.approx(LOG2, abs=1e-7)


# Bad input: one clear line naming the argument, before any model is loaded


@pytest.fixture
def args_for(tiny_model_dir, task_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(async_rlhf, "AutoModelForCausalLM", NoModelLoads)
    monkeypatch.setattr(async_rlhf, "AutoModelForSequenceClassification", NoModelLoads)

    def _make(**overrides):
        values = dict(
            model_name_or_path=tiny_model_dir,
            judge="verifier",
            dataset_path=task_dir,
            output_dir=str(tmp_path / "runs"),
            vllm=False,
        )
        return async_rlhf.Args(**{**values, **overrides})

    return _make


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(max_staleness=0), "--max_staleness"),
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
