"""Every launch path equals one process: the invariants of the seven scripts as one table.

A setup is a script with the flags of a run on tests/fixed_rollout.py, whose completions depend on the prompt and
the sample's index only (never on the process, the batch or a random stream). Each path runs the setup another way
and must compute what one process computes with the whole batch in one micro-batch (the reference, run in this
process once per setup and shared by its paths):

    two_processes  `accelerate launch`, 2 CPU processes with half of the batch each (the scheduler stepped once per
                   update, the whitening, token counts and held-out counts over every process)
    accumulation   1 process, micro-batches accumulated (the loss's normaliser is the minibatch's, not the slice's)
    zero2 / zero3  DeepSpeed with the shipped configs, 2 processes, micro-batches of half a process's share (DeepSpeed
                   accumulates 2 and clips itself); under ZeRO-3 generation and the final save gather the sharded
                   models, and the saved folders must load with the weights that were trained
    kill_resume    one process killed (SIGKILL) inside a training step, inside a checkpoint write and inside the
                   final save, resumed with --resume after each: metrics, samples and weights equal to the
                   reference's exactly

The same losses, grad norm, lr and held-out metrics (each setup's `keys`) step by step, and the same weights. A new
script or option adds a row (a Setup); a new launch path adds a column (a test below). What a path shows beyond
"= one process" for one script (the async generator's ZeRO-3 copy, bf16, vLLM engines) stays in that script's tests.
"""

import collections
import dataclasses
import glob
import importlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable

import fixed_rollout
import pytest
import torch
from conftest import (
    FAST,
    REPO_ROOT,
    assert_same_trajectory,
    assert_same_weights,
    cli_flags,
    launch_fixed_rollouts,
    read_metrics,
    require_deepspeed,
    require_vllm,
    subprocess_env,
    train_lines,
    without_timing,
)

LOG2 = math.log(2)


@dataclasses.dataclass(frozen=True)
class Setup:
    script: str
    args: dict  # one process, the whole batch in one micro-batch (on FAST[script] and the fixtures' folders)
    keys: tuple  # the metrics every path must match
    paths: dict  # path -> the run's overrides of `args` (two_processes, zero2, zero3: each process's share)
    lr: tuple = ()  # the lr logged at each training step (a linear decay, once per update)
    fixtures: dict = dataclasses.field(default_factory=dict)  # flag -> fixture (on the script's defaults below)
    shared: dict = dataclasses.field(default_factory=dict)  # path -> overrides of the path's run and its reference
    tolerances: dict = dataclasses.field(default_factory=dict)  # path or keys -> abs tolerance (default 1e-7)
    rel: dict = dataclasses.field(default_factory=dict)  # path -> relative tolerance (default 1e-5)
    models: dict = dataclasses.field(default_factory=lambda: {"model": "model_name_or_path"})  # folder -> start
    check: Callable = None  # check(path, lines, run_dir, values): what this script's runs must show beside it


# Each script's folders: flag -> fixture.
FOLDERS = {
    "grpo_math": {"model_name_or_path": "tiny_model_dir", "dataset_path": "task_dir"},
    "grpo_tools": {"model_name_or_path": "tiny_model_dir", "dataset_path": "task_dir"},
    # The classifier starts from the tiny one-label model, so that its start has the saved model's names.
    "reward_modeling": {"model_name_or_path": "tiny_reward_model_dir", "dataset_path": "preference_dir"},
    "ppo_rlhf": {"model_name_or_path": "tiny_model_dir", "dataset_path": "task_dir"},
    "dpo_online": {"model_name_or_path": "tiny_model_dir", "dataset_path": "task_dir"},
    "ppo_prm_clip": {"model_name_or_path": "tiny_model_dir", "dataset_path": "task_dir"},
    "async_rlhf": {"model_name_or_path": "tiny_model_dir", "dataset_path": "task_dir"},
}
for _script in ("ppo_rlhf", "dpo_online", "async_rlhf"):
    FOLDERS[_script]["reward_model_path"] = "tiny_reward_model_dir"


def outputs(script, folder):
    """Where a run writes, all under `folder` (the kill test compares every saved tensor there)."""
    values = {"output_dir": os.path.join(folder, "runs")}
    if script == "reward_modeling":
        values |= {"reward_model_dir": os.path.join(folder, "reward_model"), "prm_dir": os.path.join(folder, "prm")}
    return values


# Script-specific checks


def lines_of(lines, key):
    return [line[key] for line in train_lines(lines) if key in line]


def check_grpo_tools(path, lines, run_dir, values):
    for line in train_lines(lines):
        assert line["tools/calls"] > 0 and line["tools/tool_tokens"] > 0  # multi-turn, tool outputs of any length


def check_reward_model(path, lines, run_dir, values):
    """The saved classifier carries the training's bias (--prm: the step separator) in its config."""
    if path in ("two_processes", "zero3"):
        target = values["prm_dir"] if values.get("prm") else values["reward_model_dir"]
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        if values.get("prm"):
            assert config["prm"]["step_separator"] == " "
            assert lines[0]["eval/num_completions"] == lines[0]["pairs/eval_completions"]
        else:
            assert config["bias"] == pytest.approx(lines[-1]["objective/bias"])


def check_ppo_rlhf(path, lines, run_dir, values):
    with open(os.path.join(run_dir, "value_model", "config.json")) as f:
        assert json.load(f)["bias"] == 0.7  # the value model keeps the reward model's bias (centred values)


def check_dpo(path, lines, run_dir, values):
    first = train_lines(lines)[0]
    assert first["loss/dpo"] == pytest.approx(LOG2, abs=1e-7) and first["rewards/margins"] == 0.0
    assert 0 <= first["objective/skipped_ties"] < 8  # counted over the processes; some pairs are trained on
    assert train_lines(lines)[-1]["objective/kl"] != 0.0  # the update reached the policy


def check_prm_clip(path, lines, run_dir, values):
    for line in train_lines(lines):
        assert line["objective/num_steps"] > 1 and -0.5 <= line["objective/process_reward"] < 0
    assert train_lines(lines)[0]["val/mean"] == 0.0  # the rollout's values of the zero head (ZeRO-3: zeroed whole)


def check_async(path, lines, run_dir, values):
    assert lines_of(lines, "policy/lag") == [0] * values["total_steps"]


def prm_clip_initial_value_model(values, folder):
    """ppo_prm_clip's value model before training: the policy's weights with the zero value head."""
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(values["model_name_or_path"], "model.safetensors"))
    state["score.weight"] = torch.zeros(1, state["model.embed_tokens.weight"].shape[1])
    path = os.path.join(folder, "initial_value_model.safetensors")
    save_file(state, path)
    return path


GRPO_MATH = dict(
    total_steps=2,
    num_iterations=2,  # 4 updates: the old-policy log-probs and the reused batch are in the comparison
    lr_scheduler="linear",  # a decaying schedule shows a scheduler stepped once per process
    learning_rate=1e-4,
    beta=0.04,  # the reference model and the KL term
    scale_rewards="batch",  # the std over every process's rewards
    loss_type="token_mean",  # the token count over every process
    eval_every=0,
    num_eval_prompts=4,
    prompts_per_rank=4,
    micro_batch_size=16,  # 4 prompts x 4 completions
)
GRPO_KEYS = ("loss/policy", "policy/grad_norm", "lr", "objective/scores", "episode", "eval/num_problems")
GRPO_HALF = {"prompts_per_rank": 2, "micro_batch_size": 8}
GRPO_TOOLS = {**GRPO_MATH}
del GRPO_TOOLS["num_eval_prompts"]
GRPO_TOOLS_KEYS = ("loss/policy", "policy/grad_norm", "lr", "objective/scores", "episode", "tools/calls")
NATIVE = dict(tool_format="native", max_prompt_length=640, response_length=64)  # schemas ~350 tokens, JSON calls
# The GRPO variants whose quantities are per sequence (GSPO's ratio, DAPO's overlong penalty and filtering) or add a
# term (CISPO's weights, the entropy bonus). Their losses nearly cancel (about 6e-3 from terms of size 1), so
# float32's summation order shows at 1e-7: compared to 5e-7.
CISPO_DAPO = dict(cispo_cap=1.0, overlong_buffer=4, overlong_filtering=True, entropy_coef=0.01)
GSPO = dict(importance_sampling_level="sequence", loss_type="seq_mean_token_mean")

REWARD_MODEL = dict(
    lr_scheduler="linear",
    learning_rate=1e-3,
    # 17 held-out pairs in batches of 4: shards of 9 and 8 on 2 processes, so the second one runs a stand-in
    # forward to keep the number of forwards equal.
    num_eval_pairs=17,
    eval_batch_size=4,
    num_train_epochs=0.5,  # 4 steps of 8 pairs
    pairs_per_rank=8,
    micro_batch_size=8,
)
REWARD_MODEL_KEYS = ("loss/reward_model", "objective/grad_norm", "lr", "eval/loss", "eval/accuracy", "objective/bias")
PRM = dict(
    REWARD_MODEL,
    prm=True,
    step_separator=" ",  # the fixed completions are word pieces: several steps each, a varying number
    num_train_prompts=16,
    num_eval_prompts=4,
    num_samples_per_prompt=2,
    response_length=12,
    pairs_per_rank=8,  # completions per process and step: 2 steps
    micro_batch_size=8,
    num_eval_pairs=0,
)
PPO_RLHF = dict(
    total_steps=2,
    prompts_per_rank=8,
    num_minibatches=1,  # each update covers the whole batch: the same tokens whether it is split or not
    num_ppo_epochs=2,  # 4 updates: the reshuffled second epoch and the clipped losses are in the comparison
    micro_batch_size=8,
    lr_scheduler="linear",
    learning_rate=1e-3,
    kl_coef=0.05,
    whiten_rewards=True,  # the reward whitening over every process too
    missing_eos_penalty=-1.0,  # half of the fixed completions end with EOS: the stop ids enter the scores
    eval_every=0,
    num_eval_prompts=4,
)
# Not objective/kl: a sum of differences of log-probs near -10, float32 noise of 1e-6 for a KL of 1e-2.
PPO_KEYS = ("loss/policy_avg", "loss/value_avg", "policy/grad_norm", "lr", "objective/scores", "episode")
DPO = dict(
    total_steps=3,  # 3 updates: a scheduler stepped once per process ran the third at -1/3 of the lr
    lr_scheduler="linear",
    learning_rate=1e-4,
    eval_every=0,
    prompts_per_rank=8,
    micro_batch_size=8,
)
DPO_KEYS = (
    *("loss/dpo", "policy/grad_norm", "lr", "objective/scores", "objective/skipped_ties", "rewards/accuracies"),
    *("logps/chosen", "logps/rejected", "eval/score", "eval/ref_perplexity", "episode", "eval/num_prompts"),
)
# Differences of float32 log-prob sums of ~50 (one ulp 4e-6) from batches padded to other widths: a few ulps (the
# implicit rewards are scaled by beta 0.1). Observed: 1.9e-7 and 1.8e-7.
DPO_TOLERANCES = {("rewards/chosen", "rewards/rejected", "rewards/margins"): 1e-6, ("objective/kl",): 5e-6}
PRM_CLIP = dict(
    total_steps=2,
    num_ppo_epochs=2,
    num_minibatches=1,  # with more, each process's minibatch is its own slice of the batch
    prompts_per_rank=8,
    micro_batch_size=8,
    lr_scheduler="linear",
    learning_rate=1e-4,
    kl_coef=0.05,
    whiten_rewards=True,
    reward_mode="clip_delta",
    eta=0.9,  # the verifier's 0.8 for a step without equations is below eta: non-zero process rewards
    eval_every=0,
    num_eval_prompts=4,
)
PRM_CLIP_KEYS = (*PPO_KEYS, "objective/process_reward")
# --sync: every batch has lag 0 whatever the timing; the reward model scores the fixed completions.
ASYNC = dict(
    sync=True,
    total_steps=2,
    lr_scheduler="linear",
    learning_rate=1e-3,
    rloo_k=2,
    eval_every=0,
    num_eval_prompts=4,
    prompts_per_rank=4,
    micro_batch_size=4,
)
ASYNC_KEYS = (
    *("loss/dpo", "loss/policy", "policy/grad_norm", "lr", "objective/scores", "objective/kl", "rewards/margins"),
    *("policy/ratio", "objective/rlhf_reward", "eval/ref_perplexity", "episode", "eval/num_prompts"),
)
# A KL of ~0.03 is a mean of differences of log-probs of size ~10, whose float32 rounding is ~1e-6.
ASYNC_TOLERANCES = {"accumulation": 1e-6, "two_processes": 1e-6}
PPO_HALF = {"prompts_per_rank": 4, "micro_batch_size": 4}
PPO_ZERO = {"prompts_per_rank": 4, "micro_batch_size": 2}
ONE_EVAL_PROMPT = {"num_eval_prompts": 1}  # under ZeRO-3 the process with none still joins the gathering

SETUPS = {
    "grpo_math": Setup(
        "grpo_math",
        GRPO_MATH,
        GRPO_KEYS,
        {
            "two_processes": GRPO_HALF,
            "accumulation": {"micro_batch_size": 2},
            "zero2": {"prompts_per_rank": 2, "micro_batch_size": 4},
            "zero3": {"prompts_per_rank": 2, "micro_batch_size": 4},
            "kill_resume": {},
        },
        lr=(7.5e-5, 2.5e-5),  # the lr of each step's last update
    ),
    "grpo_math-seq_mean_token_mean": Setup(
        "grpo_math",
        {**GRPO_MATH, "loss_type": "seq_mean_token_mean"},
        GRPO_KEYS,
        {"accumulation": {"micro_batch_size": 2}},
    ),
    "grpo_math-constant": Setup(
        "grpo_math", {**GRPO_MATH, "loss_type": "constant"}, GRPO_KEYS, {"accumulation": {"micro_batch_size": 2}}
    ),
    "grpo_math-gspo": Setup(
        "grpo_math",
        {**GRPO_MATH, **GSPO},
        GRPO_KEYS,
        {"two_processes": GRPO_HALF, "accumulation": {"micro_batch_size": 2}},
        tolerances={"two_processes": 5e-7, "accumulation": 5e-7},
    ),
    "grpo_math-cispo_dapo_entropy": Setup(
        "grpo_math",
        {**GRPO_MATH, **CISPO_DAPO},  # cispo_cap 1: the second pass has ratios above the cap
        GRPO_KEYS,
        {"two_processes": GRPO_HALF, "accumulation": {"micro_batch_size": 2}},
        tolerances={"two_processes": 5e-7, "accumulation": 5e-7},
    ),
    "grpo_tools-calc": Setup(
        "grpo_tools",
        GRPO_TOOLS,
        GRPO_TOOLS_KEYS,
        {
            "two_processes": GRPO_HALF,
            "accumulation": {"micro_batch_size": 2},
            "zero2": {"prompts_per_rank": 2, "micro_batch_size": 4},  # ZeRO-3 needs vLLM here (a one-line refusal)
            "kill_resume": {},
        },
        lr=(7.5e-5, 2.5e-5),
        check=check_grpo_tools,
    ),
    "grpo_tools-calc-seq_mean_token_mean": Setup(
        "grpo_tools",
        {**GRPO_TOOLS, "loss_type": "seq_mean_token_mean"},
        GRPO_TOOLS_KEYS,
        {"accumulation": {"micro_batch_size": 2}},
    ),
    "grpo_tools-native": Setup(
        "grpo_tools",
        {**GRPO_TOOLS, **NATIVE},
        GRPO_TOOLS_KEYS,
        {
            "two_processes": GRPO_HALF,
            "accumulation": {"micro_batch_size": 2},
            "zero2": {"prompts_per_rank": 2, "micro_batch_size": 4},
            "kill_resume": {},
        },
        # DeepSpeed sums the gradients in its own order (bucketed all-reduce); over native's prompts of ~350 tokens
        # the grad norm then differs in the 5th digit (1.3e-5 relative measured), a formula error by far more.
        rel={"zero2": 5e-5},
        check=check_grpo_tools,
    ),
    "reward_modeling-bt": Setup(
        "reward_modeling",
        REWARD_MODEL,
        (*REWARD_MODEL_KEYS, "episode", "eval/num_pairs"),
        {
            "two_processes": {"pairs_per_rank": 4, "micro_batch_size": 4},
            "accumulation": {"micro_batch_size": 2},
            "zero3": {"pairs_per_rank": 4, "micro_batch_size": 2},  # the classifier sharded, its save gathered
            "kill_resume": {},
        },
        lr=tuple(1e-3 * (1 - k / 4) for k in range(4)),
        models={"model": "model_name_or_path"},
        check=check_reward_model,
    ),
    "reward_modeling-prm": Setup(
        "reward_modeling",
        PRM,  # samples the fixed rollout (the tiny causal LM is the nominal policy), labelled by the real verifier
        (*REWARD_MODEL_KEYS, "episode", "pairs/eval_prompts", "eval/num_completions"),
        {
            "two_processes": {"pairs_per_rank": 4, "micro_batch_size": 4},
            "accumulation": {"micro_batch_size": 1},  # a mean per micro-batch would weigh a step by its neighbours
            "zero3": {"pairs_per_rank": 4, "micro_batch_size": 2},  # the frozen policy loads whole on each process
        },
        lr=(1e-3, 5e-4),
        fixtures={"dataset_path": "task_dir", "policy_name_or_path": "tiny_model_dir"},
        check=check_reward_model,
    ),
    "ppo_rlhf": Setup(
        "ppo_rlhf",
        PPO_RLHF,
        (*PPO_KEYS, "eval/ref_perplexity", "eval/num_prompts"),
        {
            "two_processes": PPO_HALF,
            "accumulation": {"micro_batch_size": 2},
            # The policy and value model trained together as one DeepSpeed module; the reference and reward model
            # load whole on each process; the final save splits the gathered wrapper into the two folders.
            "zero2": PPO_ZERO,
            "zero3": PPO_ZERO,
            "kill_resume": {},
        },
        lr=(7.5e-4, 2.5e-4),
        fixtures={"reward_model_path": "biased_reward_model_dir"},  # values centred by its bias (0.7)
        shared={"zero2": ONE_EVAL_PROMPT, "zero3": ONE_EVAL_PROMPT},
        models={"model": "model_name_or_path", "value_model": "reward_model_path"},
        check=check_ppo_rlhf,
    ),
    "ppo_rlhf-wco": Setup(
        "ppo_rlhf",
        {**PPO_RLHF, "reward_ensemble": "wco"},  # two members that disagree: each one's score is compared too
        (*PPO_KEYS, "objective/scores_member_0", "objective/scores_member_1", "eval/score_member_1"),
        {"two_processes": PPO_HALF},
        fixtures={"reward_model_path": "distinct_ensemble"},
        models={"model": "model_name_or_path"},
    ),
    "dpo_online": Setup(
        "dpo_online",
        DPO,
        DPO_KEYS,
        {
            "two_processes": {"prompts_per_rank": 4, "micro_batch_size": 4},
            "accumulation": {"micro_batch_size": 1},
            "zero3": {"prompts_per_rank": 4, "micro_batch_size": 2},
            "kill_resume": {},
        },
        lr=(1e-4, 2e-4 / 3, 1e-4 / 3),  # never below 0
        shared={"zero3": ONE_EVAL_PROMPT},
        tolerances=DPO_TOLERANCES,
        check=check_dpo,
    ),
    "dpo_online-minibatches": Setup(
        "dpo_online",
        {**DPO, "total_steps": 2, "prompts_per_rank": 4, "num_minibatches": 2, "micro_batch_size": 2},
        DPO_KEYS,
        {"accumulation": {"micro_batch_size": 1}},  # 2 minibatches a step, each of 2 accumulated pairs
        tolerances=DPO_TOLERANCES,
    ),
    "ppo_prm_clip": Setup(
        "ppo_prm_clip",
        PRM_CLIP,
        PRM_CLIP_KEYS,
        {
            "two_processes": PPO_HALF,
            # Signed per-token terms that cancel: float32 sums in another order move loss/policy_avg (~0.02) by
            # ~1e-7 absolute (2.0e-7 on an AMD EPYC host); a wrong accumulation moves it by ~1e-2.
            "accumulation": {"micro_batch_size": 2},
            "zero3": PPO_ZERO,  # the value head, partitioned as it loads, must be zeroed whole
            "kill_resume": {},
        },
        lr=(7.5e-5, 2.5e-5),
        shared={"zero3": ONE_EVAL_PROMPT},
        # The KL (~0.14) sums differences of log-probs near -10 over batches padded to other widths: 1.5e-6 apart
        # measured between 2 processes and 1.
        tolerances={"accumulation": 1e-6, ("objective/kl",): 5e-6},
        models={"model": "model_name_or_path", "value_model": prm_clip_initial_value_model},
        check=check_prm_clip,
    ),
    "async_rlhf-rloo": Setup(
        "async_rlhf",
        {**ASYNC, "loss": "rloo"},  # RLOO divides by a token count: over every process
        ASYNC_KEYS,
        # ZeRO-3 (the generator thread's whole copy of the sharded policy) is test_async_rlhf.py's own test.
        {"two_processes": {"prompts_per_rank": 2, "micro_batch_size": 2}, "accumulation": {"micro_batch_size": 1}},
        lr=(1e-3, 5e-4),
        tolerances=ASYNC_TOLERANCES,
        check=check_async,
    ),
    "async_rlhf-dpo": Setup(
        "async_rlhf",
        {**ASYNC, "loss": "dpo"},
        ASYNC_KEYS,
        {"accumulation": {"micro_batch_size": 1}},
        tolerances=ASYNC_TOLERANCES,
        check=check_async,
    ),
}
LAUNCHED = ("two_processes", "zero2", "zero3")  # 2 processes: every row's run in one launch
IN_ONE_PROCESS = [
    pytest.param(name, path, id=f"{name}-{path}")
    for name in SETUPS
    for path in ("accumulation", "kill_resume")
    if path in SETUPS[name].paths
]


def run_values(setup, request, folder, overrides):
    """The setup's Config values for a run writing under `folder`: its folders (fixtures), FAST, the setup's args,
    then `overrides`."""
    fixtures = {**FOLDERS[setup.script], **setup.fixtures}
    values = {flag: request.getfixturevalue(name) for flag, name in fixtures.items()}
    return {**values, **FAST[setup.script], **setup.args, **overrides, **outputs(setup.script, folder)}


def in_process(script, values, calls=None):
    """script.main on the fixed rollout in this process; counts the kill points' calls in `calls`."""
    module = importlib.import_module(script)
    with pytest.MonkeyPatch.context() as patcher:
        fixed_rollout.patch(module, patcher.setattr)
        if calls is not None:
            fixed_rollout.install_kill_points(None, calls, patcher.setattr)
        return module.main(module.Config(**values))


_REFERENCES = {}  # (setup, shared overrides) -> (folder, run folder, kill points' call counts), per test process


def reference(name, path, request, tmp_path_factory):
    """The setup's one-process run with the whole batch in one micro-batch, checkpointed every step (the kill test's
    uninterrupted run), computed once per setup (and path's shared overrides) in this test process."""
    setup = SETUPS[name]
    shared = setup.shared.get(path, {})
    key = (name, json.dumps(shared, sort_keys=True))
    if key not in _REFERENCES:
        folder = str(tmp_path_factory.mktemp(f"reference-{name}"))
        calls = collections.Counter()
        run_dir = in_process(setup.script, run_values(setup, request, folder, {**shared, "save_every": 1}), calls)
        lines = read_metrics(run_dir)
        check_run(setup, "reference", lines, run_dir, run_values(setup, request, folder, shared))
        _REFERENCES[key] = folder, run_dir, dict(calls)
    return _REFERENCES[key]


def check_run(setup, path, lines, run_dir, values):
    """What every run of the setup must show, the reference included."""
    for line in train_lines(lines):
        if "policy/ratio_first_minibatch" in line:  # on-policy: the old log-probs are the trainer's own
            assert line["policy/ratio_first_minibatch"] == 1.0, (path, line["global_step"])
    if setup.lr:
        assert lines_of(lines, "lr") == pytest.approx(list(setup.lr)), path
    if setup.check:
        setup.check(path, lines, run_dir, values)


def initial_weights(setup, values, folder):
    """{saved folder: the file of its weights before training}."""
    files = {}
    for name, start in setup.models.items():
        files[name] = start(values, folder) if callable(start) else os.path.join(values[start], "model.safetensors")
    return files


def assert_equals_reference(setup, path, reference_dir, run_dir, values, folder):
    tolerance = setup.tolerances.get(path, 1e-7)
    assert_same_trajectory(reference_dir, run_dir, setup.keys, rel=setup.rel.get(path, 1e-5), abs_=tolerance)
    for keys, key_tolerance in setup.tolerances.items():
        if isinstance(keys, tuple):
            assert_same_trajectory(reference_dir, run_dir, keys, abs_=key_tolerance)
    check_run(setup, path, read_metrics(run_dir), run_dir, values)
    for name, initial in initial_weights(setup, values, folder).items():
        files = (os.path.join(d, name, "model.safetensors") for d in (reference_dir, run_dir))
        assert_same_weights(*files, initial)


@pytest.mark.slow
@pytest.mark.parametrize("name, path", IN_ONE_PROCESS)
def test_invariant_launch_path_equals_one_process(name, path, request, tmp_path, tmp_path_factory):
    """accumulation (in this process) and kill_resume (one launched process a kill) of one row."""
    setup = SETUPS[name]
    reference_run = reference(name, path, request, tmp_path_factory)
    folder = str(tmp_path / path)
    if path == "kill_resume":
        return assert_survives_kills(setup, request, reference_run, folder)
    values = run_values(setup, request, folder, {**setup.shared.get(path, {}), **setup.paths[path]})
    run_dir = in_process(setup.script, values)
    assert_equals_reference(setup, path, reference_run[1], run_dir, values, folder)


@pytest.mark.slow
@pytest.mark.launches
@pytest.mark.parametrize("path", LAUNCHED)
def test_invariant_launched_path_equals_one_process(path, request, tmp_path, tmp_path_factory):
    """two_processes, zero2 or zero3 of every row that has it, all in one `accelerate launch` of 2 processes (the
    runs one after the other: the imports and the process group paid once, not once a row), each against its row's
    reference. A row's failure names the row; a run that fails stops the launch, whose output names the run."""
    if path.startswith("zero"):
        require_deepspeed()
    names = [name for name in SETUPS if path in SETUPS[name].paths]
    values = {}
    for name in names:
        setup = SETUPS[name]
        values[name] = run_values(
            setup, request, str(tmp_path / name), {**setup.shared.get(path, {}), **setup.paths[path]}
        )
    runs = [(f"{SETUPS[name].script}.py", cli_flags(values[name]), values[name]["output_dir"]) for name in names]
    config = None
    if path.startswith("zero"):
        config = os.path.join(REPO_ROOT, "benchmark", "accelerate_configs", f"deepspeed_{path}.yaml")
    run_dirs = launch_fixed_rollouts(runs, config_file=config)
    failures = []
    for name, run_dir in zip(names, run_dirs):
        setup = SETUPS[name]
        try:
            reference_dir = reference(name, path, request, tmp_path_factory)[1]
            assert_equals_reference(setup, path, reference_dir, run_dir, values[name], str(tmp_path / name))
            if path.startswith("zero"):
                with open(os.path.join(run_dir, "config.json")) as f:
                    assert json.load(f)["args"]["gradient_accumulation_steps"] == 2  # DeepSpeed accumulates 2
                assert_saved_folders_load(setup, run_dir)
        except AssertionError as error:
            failures.append(f"{name}-{path}: {error}")
    assert not failures, "\n".join(failures)


def assert_saved_folders_load(setup, run_dir):
    """Each saved folder loads (its config's architecture) with the weights that were trained (the file's)."""
    import transformers
    from safetensors.torch import load_file

    for name in setup.models:
        folder = os.path.join(run_dir, name)
        with open(os.path.join(folder, "config.json")) as f:
            (architecture,) = json.load(f)["architectures"]
        loaded = getattr(transformers, architecture).from_pretrained(folder).state_dict()
        for key, tensor in load_file(os.path.join(folder, "model.safetensors")).items():
            assert torch.equal(loaded[key], tensor), (name, key)


# Fault injection: SIGKILL at three points drawn at random, --resume after each.


def launch_killable(script, flags, kill_at=None, timeout=300):
    """One process of tests/fixed_rollout.py running `script` on the fixed rollout, killing itself at kill_at (see
    that file). Returns the CompletedProcess (returncode -9 when it was killed)."""
    env = {**subprocess_env(), **({"KILL_AT": kill_at} if kill_at else {})}
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tests", "fixed_rollout.py"), script, *flags]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def saved_tensors(folder, run_name):
    """{path/tensor name: tensor} of every safetensors file under `folder` outside checkpoints/, the run folder's
    name in the path written as RUN."""
    from safetensors.torch import load_file

    tensors = {}
    for path in glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True):
        relative = os.path.relpath(path, folder).replace(run_name, "RUN")
        if "checkpoints" not in relative.split(os.sep):
            tensors.update({f"{relative}/{k}": v for k, v in load_file(path).items()})
    return tensors


def assert_survives_kills(setup, request, reference_run, folder):
    """The setup's run (checkpointed every step) killed at three points drawn from the reference's call counts:
    inside a training step after the first checkpoint, inside a later checkpoint write, inside the final save;
    resumed with --resume after each. Its metrics, samples and saved weights must equal the reference's exactly
    (the reference ran in this process: the same code and thread count, so the same numbers)."""
    reference_folder, reference_dir, counts = reference_run
    flags = cli_flags(run_values(setup, request, folder, {"save_every": 1}))
    total_steps = counts["save_state"]  # one checkpoint a step
    assert total_steps >= 2 and counts["save_pretrained"] >= 1, counts
    rng = random.Random(zlib.crc32(setup.script.encode()))
    kills = [f"backward:{rng.randint(counts['backward'] // total_steps + 1, counts['backward'])}"]
    script = f"{setup.script}.py"
    proc = launch_killable(script, flags, kill_at=kills[0])
    assert proc.returncode == -signal.SIGKILL, f"{kills[0]}: {proc.returncode}\n{proc.stderr[-5000:]}"
    (run_dir,) = glob.glob(os.path.join(folder, "runs", "*"))
    checkpoints = os.path.join(run_dir, "checkpoints")
    finished = max(int(d.removeprefix("step_")) for d in os.listdir(checkpoints) if "." not in d)
    kills += [f"save_state:{rng.randint(1, total_steps - finished)}", "save_pretrained:1"]
    for kill_at in kills[1:]:
        proc = launch_killable(script, [*flags, "--resume", run_dir], kill_at=kill_at)
        assert proc.returncode == -signal.SIGKILL, f"{kill_at}: {proc.returncode}\n{proc.stderr[-5000:]}"
        if kill_at.startswith("save_state"):  # the checkpoint being written was left unfinished
            assert any(d.endswith(".tmp") for d in os.listdir(checkpoints)), os.listdir(checkpoints)
    proc = launch_killable(script, [*flags, "--resume", run_dir])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference_dir)), kills
    if os.path.exists(os.path.join(reference_dir, "samples.jsonl")):
        with (
            open(os.path.join(reference_dir, "samples.jsonl")) as a,
            open(os.path.join(run_dir, "samples.jsonl")) as b,
        ):
            assert a.read() == b.read(), kills
    expected = saved_tensors(reference_folder, os.path.basename(reference_dir))
    found = saved_tensors(folder, os.path.basename(run_dir))
    assert expected and sorted(expected) == sorted(found), (sorted(expected), sorted(found))
    assert all(torch.equal(expected[k], found[k]) for k in expected), kills
    assert not any(d.endswith(".tmp") for d in os.listdir(checkpoints)), os.listdir(checkpoints)


# vLLM: the engine samples in this process and takes the trainer's weights after each update.


def check_grpo_math_vllm(lines):
    """TIS, GSPO's sequence-level ratios and MIS correct for the sampler: a matched engine leaves no token outside
    [0.5, 2], so MIS masks none; one pass over the batch is on-policy for the trainer, whatever the sampler."""
    for line in lines:
        assert 1 / 3 < line["objective/logprob_ratio_min"] <= 1 <= line["objective/logprob_ratio_max"] < 3
        assert line["objective/logprob_ratio_outside_0.5_2"] == 0.0 and line["objective/mis_masked_fraction"] == 0.0
        assert line["policy/ratio"] == 1.0


def check_grpo_tools_vllm(lines):
    assert lines[0]["objective/kl"] == 0.0  # no update before the first step's KL
    assert all(line["objective/tis_weight"] == pytest.approx(1, abs=1e-2) for line in lines)


def check_prm_clip_vllm(lines):
    assert all(line["objective/num_steps"] > 1 for line in lines)


def check_async_vllm(lines):
    assert [line["policy/generator_version"] for line in lines] == [0, 1]


VLLM = {  # script -> (flags, check of the training lines)
    "grpo_math": (dict(importance_sampling_level="sequence", mis_range=(0.5, 2.0)), check_grpo_math_vllm),
    "grpo_tools": (dict(beta=0.04), check_grpo_tools_vllm),
    "ppo_rlhf": ({}, None),
    "dpo_online": (dict(tis_cap=2.0), None),
    "ppo_prm_clip": (dict(reward_mode="raw"), check_prm_clip_vllm),
    # --sync: the engine holds the learner's current weights, so only numerics separate the two.
    "async_rlhf": (dict(tis_cap=2.0, sync=True, total_steps=2), check_async_vllm),
}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("script", VLLM)
def test_vllm_run(script, make_config):
    """The engine runs in the trainer's dtype (fp32 here) and gets the new weights after every update, so its
    log-probs match the trainer's at step 2 as at step 1 (a bf16 engine drifted to a mean gap of 0.3-0.5); the
    truncated IS weight stays near 1 and the first minibatch is on-policy."""
    require_vllm()
    flags, check = VLLM[script]
    run_dir = importlib.import_module(script).main(make_config(script, vllm=True, **flags))
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["vllm"] is True
    lines = train_lines(read_metrics(run_dir))
    assert [line["global_step"] for line in lines] == [1, 2]
    for line in lines:
        assert 0 <= line["objective/logprob_gap"] < 1e-3 and "time/weight_sync" in line
        if "objective/tis_weight" in line:
            assert 0.5 < line["objective/tis_weight"] <= 2.0
        if "policy/ratio_first_minibatch" in line:
            assert line["policy/ratio_first_minibatch"] == 1.0
    if "loss/dpo" in lines[0]:
        assert lines[0]["loss/dpo"] == pytest.approx(LOG2, abs=1e-7)  # the first update starts at the reference
    if check:
        check(lines)
