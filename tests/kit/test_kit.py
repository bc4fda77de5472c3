"""The kit below the fence, tested once: it is identical in every script that has it (tests/kit/test_drift.py), so its
tests use grpo_math's copy, except where a test runs every script's (the gradient checks). In the kit's order: the
Accelerator and the precisions a user picks on a GPU (fp16's loss scaler owns overflow, DeepSpeed is new
enough for the reference to match the policy before the first update), Run (the data order, the averages, the
optimizer step's checks), the models, the Sampler (stop ids, HF generate, the response mask, vLLM's weight sync) and
the shared-prompt forward. End-to-end runs that use the kit are in each script's test file."""

import collections
import functools
import json
import math
import os
import re
import shutil
import sys
import textwrap
from types import SimpleNamespace

import pytest
import tomllib
import torch
from conftest import MICRO_CONFIG, REPO_ROOT, require_vllm, run_checked, vllm_env
from packaging.version import Version

import async_rlhf
import dpo_online
import grpo_math
import grpo_tools
import ppo_prm_clip
import ppo_rlhf
import reward_modeling
from grpo_math import _left_pad, _response_mask, _step_prompt_indices, response_logprobs


def shared_prompt_logprobs(*args):
    """grpo_math's response_logprobs with --shared_prompt's packing."""
    return grpo_math.response_logprobs(*args, packed=grpo_math.shared_prompt_logits)


SCRIPTS = [grpo_math, dpo_online, ppo_rlhf, reward_modeling, ppo_prm_clip, async_rlhf]
SEEDS = [0, 1, 2]


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
        # In fp32 (and bf16 without check_grad_overflow) DeepSpeed then checks no overflow either, and a
        # non-finite gradient was applied: non-finite weights stop the run (returned NaN before, and were saved).
        broken = torch.nn.Linear(2, 2)
        with torch.no_grad():
            broken.weight[0, 1] = math.nan if mixed_precision != "bf16" else math.inf
        with pytest.raises(RuntimeError, match=r"^step 4: non-finite weights after an update with no gradient norm"):
            script._clip_gradients(accelerator, broken, 1.0, 3, "runs/x/checkpoints/step_2")


@pytest.mark.parametrize("script", SCRIPTS + [grpo_tools], ids=lambda m: m.__name__)
def test_updates_skipped_in_a_row_are_bounded(script):
    """The loop's optimizer calls (Run.clip_gradients, the optimizer's step, the schedule's only on a taken update,
    Run.count_update) stop the run at max_skipped skipped updates in a row, naming the step and the last checkpoint; a
    taken update starts the count again. The end-to-end run is in test_grpo_math_run.py."""
    stepped = []
    run = object.__new__(script.Run)  # the attributes the update reads, without a run folder
    run.args, run.step, run.last_checkpoint = SimpleNamespace(max_grad_norm=1.0), 9, "runs/x/checkpoints/step_8"
    run.metrics, run.stats, run.skipped_in_a_row = {}, collections.defaultdict(list), 0
    optimizer = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None)
    scheduler = SimpleNamespace(get_last_lr=lambda: [1e-5], step=lambda: stepped.append(1))

    def update(model):  # as the scripts' loops write it
        grad_norm, lr = run.clip_gradients(model), scheduler.get_last_lr()[0]
        optimizer.step()
        if not run.accelerator.optimizer_step_was_skipped:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.count_update(grad_norm, lr)

    for skipped in [True] * 29 + [False] + [True] * 29:
        accelerator = stand_in_accelerator(math.inf if skipped else 0.5, scaler=torch.amp.GradScaler("cpu"))
        run.accelerator, accelerator.optimizer_step_was_skipped = accelerator, skipped
        update(torch.nn.Linear(2, 2))
    assert run.skipped_in_a_row == 29 and len(stepped) == 1 and len(run.stats["policy/grad_norm"]) == 59
    with pytest.raises(RuntimeError, match=r"^step 10: the fp16 loss scaler skipped 30 updates in a row .*step_8$"):
        update(torch.nn.Linear(2, 2))
    # DeepSpeed's bf16 check_grad_overflow skips updates too: the message names the precision.
    run.skipped_in_a_row = 29
    run.accelerator = stand_in_accelerator(math.inf, mixed_precision="bf16", deepspeed_plugin=object())
    run.accelerator.clip_grad_norm_, run.accelerator.optimizer_step_was_skipped = lambda *args: None, True
    with pytest.raises(RuntimeError, match=r"^step 10: DeepSpeed's overflow check \(bf16\) skipped 30 updates"):
        update(torch.nn.Linear(2, 2))


# Run: each step's prompts, the averages of a step's statistics, the finite checks


def stream(num_steps, per_step, num_prompts, seed):
    return [i for step in range(num_steps) for i in _step_prompt_indices(step, per_step, num_prompts, seed)]


@pytest.mark.parametrize("num_prompts,per_step", [(10, 2), (10, 4), (7, 3), (4, 10), (5, 5), (1, 3)])
def test_step_prompt_indices_every_epoch_is_a_permutation(num_prompts, per_step):
    num_epochs = 4
    num_steps = num_epochs * num_prompts // per_step
    order = stream(num_steps, per_step, num_prompts, seed=3)
    assert all(len(_step_prompt_indices(s, per_step, num_prompts, 3)) == per_step for s in range(num_steps))
    for epoch in range(len(order) // num_prompts):
        assert sorted(order[epoch * num_prompts : (epoch + 1) * num_prompts]) == list(range(num_prompts))


def test_step_prompt_indices_do_not_depend_on_batch_size_or_global_rng():
    """The steps cut one fixed stream (a fresh permutation per epoch); a step that straddles an epoch boundary
    takes the end of one permutation and the start of the next."""
    reference = stream(30, 1, 10, seed=5)
    torch.manual_seed(123)
    assert stream(10, 3, 10, seed=5) == reference
    torch.manual_seed(456)
    assert stream(6, 5, 10, seed=5) == reference
    # Step 3 with 3 per step covers stream positions 9, 10, 11: the last of epoch 0 and the first two of epoch 1.
    straddling = _step_prompt_indices(3, 3, 10, 5)
    assert straddling == reference[9:12]
    assert straddling[0] not in reference[:9]
    assert set(reference[:10]) == set(range(10)) and set(reference[10:20]) == set(range(10))


def test_step_prompt_indices_deterministic_and_seed_dependent():
    assert _step_prompt_indices(7, 4, 50, 1) == _step_prompt_indices(7, 4, 50, 1)
    assert stream(5, 4, 50, 1) != stream(5, 4, 50, 2)
    assert stream(5, 4, 50, 1) != list(range(20))  # shuffled
    # consecutive epochs use different permutations
    two_epochs = stream(2, 50, 50, 1)
    assert two_epochs[:50] != two_epochs[50:]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_step_prompt_indices_split_one_order_between_processes(world_size):
    """The processes' slices of a step, side by side, are the step's slice of one order over the dataset: a fresh
    permutation every epoch (each index once per epoch, steps crossing an epoch's end included), the same for any
    split of the same prompts per step, a pure function of (seed, step)."""
    per_rank, num_prompts, seed = 6 // world_size, 10, 3
    whole = []  # the order a single process with every prompt of the step walks, by a plain loop
    for epoch in range(6):
        whole += torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    for step in range(8):
        parts = [
            grpo_math._step_prompt_indices(step, per_rank, num_prompts, seed, rank, world_size)
            for rank in range(world_size)
        ]
        assert sum(parts, []) == whole[step * 6 : (step + 1) * 6]
    assert sorted(whole[:10]) == list(range(10)) and sorted(whole[10:20]) == list(range(10))


def test_average_stats_and_reduce_metrics_take_the_largest_of_a_max():
    """Per micro-batch statistics are averaged, a name ending in _max keeps the largest; over processes the same
    (reduce_metrics, one process here: the values come back as they are, in float64)."""
    stats = {"policy/ratio": [1.0, 2.0, 4.5], "objective/logprob_ratio_max": [1.5, 3.25, 2.0], "x_min": [2.0, 0.5]}
    assert grpo_math._average_stats(stats) == {"policy/ratio": 2.5, "objective/logprob_ratio_max": 3.25, "x_min": 0.5}

    class OneProcess:
        device = "cpu"

        def gather(self, tensor):
            return torch.cat([tensor, tensor * torch.tensor([[2.0, 0.5, 0.5]], dtype=tensor.dtype)])  # a 2nd process

    reduced = grpo_math._reduce_metrics(
        OneProcess(), {"b_max": 1.0, "a": 3.0, "c_min": 4.0}
    )  # sorted: a, b_max, c_min
    assert reduced == {"a": (3.0 + 6.0) / 2, "b_max": 1.0, "c_min": 2.0}


class FakeAccelerator:
    """What check_finite asks of an Accelerator: the device, and gather over processes (here: this process's value
    and another process's)."""

    device = torch.device("cpu")

    def __init__(self, other_finite):
        self.other = torch.tensor([1.0 if other_finite else 0.0])

    def gather(self, tensor):
        return torch.cat([tensor, self.other])


def test_check_finite_stops_every_process_when_one_sees_a_non_finite_value():
    """Collective: the process whose own loss is finite stops too when another's is not (else it would wait in the
    next all-reduce forever)."""
    grpo_math._check_finite(FakeAccelerator(True), torch.tensor([1.0, 2.0]), "loss/policy", 3, None)
    with pytest.raises(RuntimeError, match="step 4: non-finite loss/policy \\(on another process\\)"):
        grpo_math._check_finite(FakeAccelerator(False), torch.tensor([1.0, 2.0]), "loss/policy", 3, "ckpt")
    with pytest.raises(RuntimeError, match="nan"):
        grpo_math._check_finite(FakeAccelerator(True), torch.tensor([float("nan")]), "loss/policy", 3, "ckpt")


# The models


def test_disable_dropout_zeroes_every_dropout_module():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout(0.1))
    )
    grpo_math._disable_dropout(model).train()
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]
    x = torch.randn(8, 4)
    assert torch.equal(model(x), model(x))


def test_policy_state_dict_merges_lora(tiny_model_dir):
    """The weights pushed to vLLM: HF names, LoRA merged in, adapters left unmerged afterwards."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    names = set(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        before = model(ids).logits
        state = grpo_math._policy_state_dict(model)
        after = model(ids).logits
    assert set(state) == names
    torch.testing.assert_close(before, after, rtol=1e-5, atol=1e-5)  # unmerged again
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    merged.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, before, atol=1e-5, rtol=1e-5)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert grpo_math._policy_state_dict(plain).keys() == names


def test_policy_state_dict_leaves_lora_base_weights_untouched(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
        LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    for _ in range(3):
        grpo_math._policy_state_dict(model)
    changed = [n for n, p in model.named_parameters() if n in frozen and not torch.equal(p, frozen[n])]
    assert not changed, f"frozen base weights changed: {changed}"


# The Sampler: stop ids, HF generate, the response mask, the left padding of prompts, vLLM's weight sync


def test_stop_token_ids_reads_every_eos_of_the_generation_config(tiny_model_dir, tmp_path):
    """Qwen2.5 and Llama-3.1 list several EOS ids in generation_config.json, where vLLM stops: every backend, the
    mask and the missing-EOS checks use the same set."""
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with open(folder / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [7, 2, 11]}, f)
    assert grpo_math._stop_token_ids(tokenizer, str(folder)) == [2, 7, 11]
    (folder / "generation_config.json").unlink()
    assert grpo_math._stop_token_ids(tokenizer, str(folder)) == [tokenizer.eos_token_id] == [2]


@pytest.fixture
def eos_model(tiny_model_dir):
    """The tiny model with the EOS embedding (tied: also its output row) made 3x that of token 22145, which the
    tiny model's greedy decoding picks after the prompt below: EOS becomes the greedy choice at every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[2] = 3 * model.model.embed_tokens.weight[22145]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


EOS_PROMPTS = [[1, 4093, 198, 2683, 314], [1, 9690, 198, 2683]]


def test_hf_generate_stops_at_eos(eos_model):
    responses, lengths = grpo_math._hf_generate(eos_model, EOS_PROMPTS, 2, 6, 0.0, 1.0, 2, [2])
    assert responses.shape == (4, 6)
    assert lengths.tolist() == [1, 1, 1, 1]
    assert (responses[:, 0] == 2).all()
    mask = grpo_math._response_mask(responses, lengths, [2])
    assert mask.sum(1).tolist() == [1.0] * 4


def test_hf_generate_stops_at_any_stop_id(tiny_model_dir):
    """The tiny model greedily repeats token 22145 after this prompt: listed as a second stop id, it ends the
    completion there, as vLLM would."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = EOS_PROMPTS[:1]
    assert grpo_math._hf_generate(model, prompt, 2, 4, 0.0, 1.0, 2, [2])[0].tolist() == [[22145] * 4] * 2
    responses, lengths = grpo_math._hf_generate(model, prompt, 2, 4, 0.0, 1.0, 2, [2, 22145])
    assert lengths.tolist() == [1, 1]
    assert grpo_math._response_mask(responses, lengths, [2, 22145]).sum(1).tolist() == [1.0, 1.0]


EOS = 2


@pytest.mark.parametrize(
    "tokens,length,expected",
    [
        ([2, 5, 6, 7], 4, [1, 0, 0, 0]),  # EOS first: only the EOS token is kept
        ([5, 2, 6, 7], 4, [1, 1, 0, 0]),  # EOS in the middle, kept itself
        ([5, 6, 7, 8], 3, [1, 1, 1, 0]),  # no EOS: the length decides
        ([5, 6, 7, 2], 3, [1, 1, 1, 0]),  # EOS after the length: ignored
        ([5, 2, 2, 7], 4, [1, 1, 0, 0]),  # two EOS: the first one ends it
        ([5, 6, 7, 8], 0, [0, 0, 0, 0]),  # empty
        ([5, 6, 7, 2], 4, [1, 1, 1, 1]),  # EOS last
    ],
)
def test_response_mask_by_hand(tokens, length, expected):
    responses, lengths = torch.tensor([tokens]), torch.tensor([length])
    assert _response_mask(responses, lengths, [EOS]).tolist() == [[float(x) for x in expected]]
    assert _response_mask(responses, lengths, [EOS]).dtype == torch.float32


@pytest.mark.parametrize("stop_ids", [[EOS], [EOS, 4]])
def test_response_mask_random_matches_loop(stop_ids):
    """Any of the stop ids ends a response (models with several EOS ids, e.g. Llama-3.1's three)."""
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        responses = torch.randint(0, 5, (16, 9), generator=g)  # EOS (2) is frequent
        lengths = torch.randint(0, 10, (16,), generator=g)
        got = _response_mask(responses, lengths, stop_ids)
        for b in range(16):
            seen_eos = False
            for t in range(9):
                keep = t < lengths[b].item() and not seen_eos
                assert got[b, t].item() == float(keep), (b, t)
                if t < lengths[b].item() and responses[b, t].item() in stop_ids:
                    seen_eos = True


def test_left_pad():
    ids, mask = _left_pad([[5, 6, 7], [8], [9, 10]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


WEIGHT_SYNC_SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM
import grpo_math

model_dir = sys.argv[1]
llm = LLM(model=model_dir, dtype="bfloat16", seed=0, enforce_eager=True, max_model_len=128,
          distributed_executor_backend="uni", enable_prefix_caching=True, logprobs_mode="processed_logprobs")
dtype = llm.llm_engine.model_config.dtype
prompts = [[1, 9690, 198, 5248, 314, 216, 35, 1232, 216, 36, 47], [1, 4093, 198, 2683, 314]]

def greedy():
    responses, lengths, _ = grpo_math._vllm_generate(llm, prompts, 1, 12, 0.0, 1.0, 2, [2])
    return responses.tolist()

original_state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
torch.manual_seed(0)
perturbed_state = {k: v + 0.05 * torch.randn_like(v) for k, v in original_state.items()}
result = {"original": greedy()}
grpo_math._vllm_sync_weights(llm, perturbed_state, dtype)
result["perturbed"] = greedy()
grpo_math._vllm_sync_weights(llm, original_state, dtype)
result["restored"] = greedy()
print("RESULT " + json.dumps(result))
llm.llm_engine.engine_core.shutdown()
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_weight_sync_changes_and_restores_greedy_output(tiny_model_dir, tmp_path):
    require_vllm()
    script = tmp_path / "weight_sync.py"
    script.write_text(textwrap.dedent(WEIGHT_SYNC_SCRIPT))
    output = run_checked([sys.executable, str(script), tiny_model_dir], vllm_env(), timeout=300)
    result = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
    assert result["perturbed"] != result["original"], "the engine did not take the new weights"
    assert result["restored"] == result["original"], "restoring the weights did not restore the output"


# The shared-prompt forward: the same log-probs and gradients as each completion with its own copy of the prompt.


def random_tiny_llama(attention, seed=0):
    """A random Llama of conftest.MICRO_CONFIG (2 layers, vocabulary 211), float32, the given attention backend."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**MICRO_CONFIG, attn_implementation=attention)).float()


def grouped_batch(group_sizes, width=6, seed=0):
    """Left-padded prompts of different lengths, each repeated for its group's completions, and right-padded
    responses of lengths 1..width: (input_ids [B, P + width], attention_mask, P)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 211, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in group_sizes
    ]
    rows = [p for p, n in zip(prompts, group_sizes) for _ in range(n)]
    prompt_ids, prompt_mask = _left_pad(rows, 0)
    lengths = torch.randint(1, width + 1, (len(rows),), generator=g)
    lengths[0] = width  # the longest response fills the width, as training_batch cuts it
    responses = torch.randint(3, 211, (len(rows), width), generator=g)
    response_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    input_ids = torch.cat([prompt_ids, responses * response_mask], 1)
    return input_ids, torch.cat([prompt_mask, response_mask], 1), prompt_ids.shape[1]


def logprobs_and_grads(model, input_ids, attention_mask, context_length, shared_prompt):
    """Log-probs of the responses and the parameter gradients of a random weighting of them."""
    model.zero_grad()
    logprobs_fn = (
        functools.partial(grpo_math.response_logprobs, packed=grpo_math.shared_prompt_logits)
        if shared_prompt
        else response_logprobs
    )
    logprobs, _ = logprobs_fn(model, input_ids, attention_mask, context_length, 0.7)
    mask = attention_mask[:, context_length:].float()
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(1))
    (logprobs * weights * mask).sum().backward()
    return logprobs.detach() * mask, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("group_sizes", [[8, 8], [4, 1, 3], [1, 1, 1], [5]])
@pytest.mark.parametrize("order", ["grouped", "shuffled"])
def test_shared_prompt_logprobs_and_gradients_equal_the_unshared(attention, group_sizes, order):
    """Groups of G and of 1, prompts and responses of different lengths, fp32; "shuffled": a group's rows are not
    consecutive (online DPO's micro-batches hold the chosen rows, then the rejected ones)."""
    model = random_tiny_llama(attention)
    input_ids, attention_mask, context_length = grouped_batch(group_sizes)
    if order == "shuffled":
        permutation = torch.randperm(len(input_ids), generator=torch.Generator().manual_seed(2))
        input_ids, attention_mask = input_ids[permutation], attention_mask[permutation]
    shared, shared_grads = logprobs_and_grads(model, input_ids, attention_mask, context_length, True)
    alone, alone_grads = logprobs_and_grads(model, input_ids, attention_mask, context_length, False)
    torch.testing.assert_close(shared, alone, atol=1e-5, rtol=0)
    for name, grad in alone_grads.items():
        scale = grad.abs().max().item() + 1e-12
        assert (shared_grads[name] - grad).abs().max().item() <= 1e-4 * scale, name
    # And against each row computed alone, without any padding (an independent reference).
    for i in range(len(input_ids)):
        real = attention_mask[i] > 0
        row = input_ids[i][real].unsqueeze(0)
        prompt_length = int(attention_mask[i, :context_length].sum())
        with torch.no_grad():
            plain = torch.log_softmax(model(row).logits[0, prompt_length - 1 : -1].double() / 0.7, -1)
        expected = [plain[t, token].item() for t, token in enumerate(row[0, prompt_length:].tolist())]
        assert shared[i, : len(expected)].tolist() == pytest.approx(expected, abs=1e-5)


def test_shared_prompt_gradients_with_gradient_checkpointing():
    model = random_tiny_llama("sdpa")
    input_ids, attention_mask, context_length = grouped_batch([4, 3])
    alone, alone_grads = logprobs_and_grads(model, input_ids, attention_mask, context_length, False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    shared, shared_grads = logprobs_and_grads(model, input_ids, attention_mask, context_length, True)
    torch.testing.assert_close(shared, alone, atol=1e-5, rtol=0)
    for name, grad in alone_grads.items():
        assert (shared_grads[name] - grad).abs().max().item() <= 1e-4 * (grad.abs().max().item() + 1e-12), name


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_logprobs_do_not_depend_on_the_order_of_the_rows(attention):
    """Bit for bit: async_rlhf scores a batch in rollout order and trains on it chosen rows first, and the ratio
    must be exactly 1 at lag 0."""
    model = random_tiny_llama(attention).eval()
    input_ids, attention_mask, context_length = grouped_batch([2, 2, 2, 2])
    permutation = torch.randperm(len(input_ids), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ordered = shared_prompt_logprobs(model, input_ids, attention_mask, context_length, 1.0)[0]
        permuted = shared_prompt_logprobs(
            model, input_ids[permutation], attention_mask[permutation], context_length, 1.0
        )[0]
    assert torch.equal(permuted, ordered[permutation])


def test_shared_prompt_computes_each_prompt_once():
    model = random_tiny_llama("sdpa")
    seen = []
    model.model.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    input_ids, attention_mask, context_length = grouped_batch([8, 8], width=6)
    with torch.no_grad():
        shared_prompt_logprobs(model, input_ids, attention_mask, context_length, 1.0)
        response_logprobs(model, input_ids, attention_mask, context_length, 1.0)
    response_tokens = attention_mask[:, context_length:].sum(1).view(2, 8).sum(1)  # each group's real tokens
    packed_length = context_length + int(response_tokens.max())  # no padding between a group's responses
    assert seen == [torch.Size([2, packed_length]), torch.Size([16, context_length + 6])]
    assert 2 * packed_length < 0.7 * 16 * (context_length + 6)


def test_prompt_groups_gather_the_rows_of_each_prompt_whatever_their_order():
    prompts = [[0, 5, 6], [0, 5, 6], [5, 6, 7], [0, 5, 6], [0, 5, 6], [0, 5, 6]]
    prompt_mask = [[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    responses = [[9, 9], [8, 1], [7, 7], [8, 0], [3, 3], [3, 3]]
    ids, mask = (
        torch.tensor([p + r for p, r in zip(prompts, responses)]),
        torch.tensor([m + [1, 1] for m in prompt_mask]),
    )
    group, slot = grpo_math._prompt_groups(ids, mask, 3)
    # rows 0, 1, 3 share a prompt; rows 4, 5 have the same ids with other padding (another prompt); row 2 is alone
    assert group[0] == group[1] == group[3] and group[4] == group[5] and len(set(group.tolist())) == 3
    assert slot[[3, 1, 0]].tolist() == [0, 1, 2]  # by content: [8, 0] < [8, 1] < [9, 9]
    assert slot[2] == 0 and sorted(slot[[4, 5]].tolist()) == [0, 1]
    for seed in range(5):  # the same rows in any order: the same group members in the same slots
        permutation = torch.randperm(6, generator=torch.Generator().manual_seed(seed))
        permuted_group, permuted_slot = grpo_math._prompt_groups(ids[permutation], mask[permutation], 3)
        assert permuted_group.tolist() == group[permutation].tolist()
        assert permuted_slot[permutation.argsort()][:4].tolist() == slot[:4].tolist()
