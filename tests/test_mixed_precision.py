"""What every script does under the precisions a user picks on a GPU (issue 45): fp16's loss scaler owns overflow,
and DeepSpeed is new enough for the reference to match the policy before the first update. The end-to-end fp16 run is
in test_grpo_math_run.py; clip_gradients and make_accelerator are identical in every script (the drift test)."""

import collections
import math
import os
import re
from types import SimpleNamespace

import pytest
import tomllib
import torch
from conftest import REPO_ROOT
from packaging.version import Version

import async_rlhf
import dpo_online
import grpo_math
import grpo_tools
import ppo_prm_clip
import ppo_rlhf
import reward_modeling

SCRIPTS = [grpo_math, dpo_online, ppo_rlhf, reward_modeling, ppo_prm_clip, async_rlhf]


def stand_in_accelerator(norm, scaler=None, mixed_precision="no", deepspeed_plugin=None):
    """Just what clip_gradients reads of an Accelerator: a clip that returns `norm`, the scaler, the precision."""
    return SimpleNamespace(
        clip_grad_norm_=lambda parameters, max_norm: torch.tensor(norm),
        scaler=scaler,
        mixed_precision=mixed_precision,
        state=SimpleNamespace(deepspeed_plugin=deepspeed_plugin),
        gather=lambda tensor: tensor,
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_under_a_loss_scaler_an_overflow_skips_the_update_instead_of_stopping(script):
    model = torch.nn.Linear(2, 2)
    for norm in (math.inf, math.nan):
        # accelerate's GradScaler (fp16 on a GPU), or DeepSpeed's own scaler (its fp16 config): NaN, left out of the
        # averages, and the scaler skips the update.
        native = stand_in_accelerator(norm, scaler=torch.amp.GradScaler("cpu"))
        assert math.isnan(script._clip_gradients(native, model, 1.0, 3, "runs/x/checkpoints/step_2"))
        deepspeed = stand_in_accelerator(norm, mixed_precision="fp16", deepspeed_plugin=object())
        assert math.isnan(script._clip_gradients(deepspeed, model, 1.0, 3, None))
        # Without a scaler (bf16, fp32, DeepSpeed bf16) nothing would skip it: the run stops, naming the checkpoint.
        for plain in (stand_in_accelerator(norm), stand_in_accelerator(norm, None, "bf16", object())):
            with pytest.raises(RuntimeError, match=r"step 4: non-finite gradient norm .*step_2"):
                script._clip_gradients(plain, model, 1.0, 3, "runs/x/checkpoints/step_2")
    assert (
        script._clip_gradients(stand_in_accelerator(0.5, scaler=torch.amp.GradScaler("cpu")), model, 1, 0, None) == 0.5
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_deepspeed_older_than_0_19_2_is_refused_before_anything_starts(script, monkeypatch):
    """Before 0.19.2 DeepSpeed's bf16 cast rounded the policy's buffers (RoPE's inv_freq) too, while frozen() keeps
    the reference's fp32, as DeepSpeed does from 0.19.2 on: KL would not be 0 before the first update."""
    import deepspeed

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(deepspeed, "__version__", "0.18.3")
    with pytest.raises(SystemExit, match=r"^error: DeepSpeed 0\.18\.3 is installed; the scripts need >= 0\.19\.2$"):
        script._make_accelerator(4, 1, 1.0)
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["deepspeed"]
    assert Version(re.search(r">=([\d.]+)", extra[0]).group(1)) >= Version("0.19.2")


@pytest.mark.parametrize("script", SCRIPTS + [grpo_tools], ids=lambda m: m.__name__)
def test_deepspeed_without_a_gradient_norm_is_not_an_error(script):
    """zero_optimization.compute_grad_norm false (ZeRO-1/2 with gradient_clipping 0): accelerate's clip_grad_norm_
    returns None. The norm is unknown (NaN, left out of the averages); float(None) raised a TypeError before."""
    for mixed_precision in ("fp16", "bf16", "no"):
        accelerator = stand_in_accelerator(0.0, mixed_precision=mixed_precision, deepspeed_plugin=object())
        accelerator.clip_grad_norm_ = lambda parameters, max_norm: None
        assert math.isnan(script._clip_gradients(accelerator, torch.nn.Linear(2, 2), 1.0, 3, None))


@pytest.mark.parametrize("script", SCRIPTS + [grpo_tools], ids=lambda m: m.__name__)
def test_updates_skipped_in_a_row_are_bounded(script):
    """Run.optimizer_step stops the run at max_skipped skipped updates in a row, naming the step and the last
    checkpoint; a taken update starts the count again. The end-to-end run is in test_grpo_math_run.py."""
    stepped = []
    run = object.__new__(script.Run)  # the attributes optimizer_step reads, without a run folder
    run.args, run.step, run.last_checkpoint = SimpleNamespace(max_grad_norm=1.0), 9, "runs/x/checkpoints/step_8"
    run.metrics, run.stats, run.skipped_in_a_row = {}, collections.defaultdict(list), 0
    optimizer = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None)
    scheduler = SimpleNamespace(get_last_lr=lambda: [1e-5], step=lambda: stepped.append(1))
    for skipped in [True] * 29 + [False] + [True] * 29:
        accelerator = stand_in_accelerator(math.inf if skipped else 0.5, scaler=torch.amp.GradScaler("cpu"))
        run.accelerator, accelerator.optimizer_step_was_skipped = accelerator, skipped
        run.optimizer_step(torch.nn.Linear(2, 2), optimizer, scheduler)
    assert run.skipped_in_a_row == 29 and len(stepped) == 1 and len(run.stats["policy/grad_norm"]) == 59
    with pytest.raises(RuntimeError, match=r"^step 10: the fp16 loss scaler skipped 30 updates in a row .*step_8$"):
        run.optimizer_step(torch.nn.Linear(2, 2), optimizer, scheduler)
