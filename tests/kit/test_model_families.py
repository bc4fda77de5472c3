"""Exact on the model families and lengths users launch, not only on the embedded Llama.

Tiny random configs of Qwen2 (with and without a sliding window), Mistral, Gemma-3-style mixed layer types and
Phi-3: the shared-prompt forward gives each row's own log-probs and gradients (or falls back where packing would
see across a window); packing is skipped where it costs more than it saves; HF generate applies none of the
sampling fields a checkpoint's generation_config.json carries.
"""

import json
import os
import shutil

import pytest
import torch
from conftest import MICRO_CONFIG
from test_kit import grouped_batch, logprobs_and_grads, shared_prompt_logprobs

import grpo_math
from grpo_math import _shared_prompt_exact, _shared_prompt_pays


def family_config(family, window):
    """A tiny config of `family`; window: the sliding window (None: the family's full-attention form)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    if family == "llama":
        return LlamaConfig(**MICRO_CONFIG)
    if family == "qwen2":
        if window is None:
            return Qwen2Config(**MICRO_CONFIG)
        return Qwen2Config(**MICRO_CONFIG, use_sliding_window=True, sliding_window=window, max_window_layers=0)
    if family == "mistral":
        return MistralConfig(**MICRO_CONFIG, sliding_window=window)
    if family == "gemma3":  # one sliding layer, one full one, as gemma-3 alternates them (5:1)
        layer_types = ["sliding_attention", "full_attention"] if window else None
        return Gemma3TextConfig(**MICRO_CONFIG, head_dim=8, sliding_window=window or 4096, layer_types=layer_types)
    if family == "phi3":
        return Phi3Config(**MICRO_CONFIG, sliding_window=window, pad_token_id=0)
    raise ValueError(family)


def family_model(family, window, attention="sdpa"):
    from transformers import AutoModelForCausalLM

    config = family_config(family, window)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def rows_alone(model, input_ids, attention_mask, context_length, temperature=0.7):
    """Each row's response log-probs from a plain forward of its real tokens alone (no padding, no packing)."""
    out = []
    for i in range(len(input_ids)):
        real = attention_mask[i] > 0
        row = input_ids[i][real].unsqueeze(0)
        start = int(attention_mask[i, :context_length].sum())
        with torch.no_grad():
            plain = torch.log_softmax(model(row).logits[0, start - 1 : -1].double() / temperature, -1)
        out.append([plain[t, token].item() for t, token in enumerate(row[0, start:].tolist())])
    return out


FAMILIES = [
    ("llama", None),
    ("qwen2", None),
    ("qwen2", 4),
    ("mistral", 4),
    ("gemma3", 4),
    ("phi3", 4),
    ("mistral", 64),  # a window wider than every sequence masks nothing: packed
]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family,window", FAMILIES)
def test_shared_prompt_equals_unshared_and_each_row_alone_on_model_families(family, window, attention):
    """Left-padded prompts of 1-8 tokens, groups of 4, 1 and 3, responses of 1-6 tokens, fp32: shared = unshared =
    each row alone within 1e-5, gradients within 1e-4 of the largest."""
    model = family_model(family, window, attention)
    input_ids, attention_mask, context_length = grouped_batch([4, 1, 3], width=6, seed=1)
    shared, shared_grads = logprobs_and_grads(model, input_ids, attention_mask, context_length, True)
    alone, alone_grads = logprobs_and_grads(model, input_ids, attention_mask, context_length, False)
    torch.testing.assert_close(shared, alone, atol=1e-5, rtol=0)
    for name, grad in alone_grads.items():
        assert (shared_grads[name] - grad).abs().max().item() <= 1e-4 * (grad.abs().max().item() + 1e-12), name
    for i, expected in enumerate(rows_alone(model, input_ids, attention_mask, context_length)):
        assert shared[i, : len(expected)].tolist() == pytest.approx(expected, abs=1e-5), i


@pytest.mark.parametrize("family,window", FAMILIES)
def test_packing_is_used_exactly_where_no_window_binds(family, window):
    """A window of 4 over sequences of up to 14 tokens: the packed forward would let sliding layers see the whole
    sequence (transformers takes a ready 4D mask as it is), so it is not used; with no window, or one wider than
    every sequence, it is (one forward of 2 packed sequences instead of 8 rows)."""
    model = family_model(family, window).eval()
    input_ids, attention_mask, context_length = grouped_batch([4, 1, 3], width=6, seed=1)
    longest = int(attention_mask.sum(1).max())
    binds = window is not None and window <= longest
    assert _shared_prompt_exact(model.config, longest) is not binds
    shapes = []
    model.model.register_forward_hook(lambda m, a, kw, out: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        shared_prompt_logprobs(model, input_ids, attention_mask, context_length, 1.0)
    assert shapes[0][0] == (len(input_ids) if binds else 3)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma3", "phi3"])
def test_packing_across_a_sliding_window_would_change_the_logprobs(family, monkeypatch):
    """Why the rule exists (and the defect before it): forced to pack, a model with a window of 4 gives other
    log-probs than each row alone."""
    model = family_model(family, 4).eval()
    input_ids, attention_mask, context_length = grouped_batch([4, 1, 3], width=6, seed=1)
    monkeypatch.setattr(grpo_math, "_shared_prompt_exact", lambda config, longest: True)
    with torch.no_grad():
        packed = shared_prompt_logprobs(model, input_ids, attention_mask, context_length, 0.7)[0]
    worst = max(
        abs(packed[i, t].item() - value)
        for i, row in enumerate(rows_alone(model, input_ids, attention_mask, context_length))
        for t, value in enumerate(row)
    )
    assert worst > 1e-3


def test_shared_prompt_exact_refuses_alibi_and_other_layer_types():
    from transformers import BloomConfig, LlamaConfig

    assert not _shared_prompt_exact(BloomConfig(), 10)
    config = LlamaConfig(**MICRO_CONFIG)
    config.layer_types = ["full_attention", "linear_attention"]
    assert not _shared_prompt_exact(config, 10)
    config.layer_types = ["full_attention", "chunked_attention"]
    config.attention_chunk_size = 8
    assert not _shared_prompt_exact(config, 8) and _shared_prompt_exact(config, 7)


# The long-response rule: packing must never cost more than it saves.


def flops_by_loop(config, rows, context_length, width):
    """An independent count: every layer of every packed sequence and unpacked row, token by token and pair by pair.
    rows: [(group, response length)]. Returns (packed, unpacked)."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    weights = hidden * head_dim * heads * 2 + hidden * head_dim * kv * 2 + 3 * hidden * config.intermediate_size
    logit = 2 * hidden * config.vocab_size
    totals = {}
    for group, length in rows:
        totals[group] = totals.get(group, 0) + length
    longest = context_length + max(totals.values())
    packed = unpacked = 0.0
    for _ in range(config.num_hidden_layers):
        for _ in totals:  # each group: a sequence of the longest group's length, every pair of positions
            packed += longest * 2 * weights + longest * longest * 4 * hidden
        for _ in rows:  # each row: width positions, half the pairs (causal)
            unpacked += width * 2 * weights + width * width / 2 * 4 * hidden
    packed += len(totals) * (longest - context_length) * logit
    unpacked += len(rows) * (width - context_length) * logit
    return packed, unpacked


def test_shared_prompt_pays_against_a_loop_count():
    from transformers import LlamaConfig

    generator = torch.Generator().manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    for _ in range(20):
        groups, per_group = int(torch.randint(1, 5, (1,), generator=generator)), 8
        width_r = int(torch.randint(8, 1500, (1,), generator=generator))
        context = int(torch.randint(8, 300, (1,), generator=generator))
        lengths = torch.randint(0, width_r + 1, (groups * per_group,), generator=generator)
        lengths[0] = width_r
        group = torch.arange(groups).repeat_interleave(per_group)
        packed, unpacked = flops_by_loop(
            config, list(zip(group.tolist(), lengths.tolist())), context, context + width_r
        )
        assert _shared_prompt_pays(config, group, lengths, context, context + width_r) == (packed < unpacked)


def test_packing_stops_paying_at_long_responses():
    """SmolLM2-135M's shape, 8 completions of a 48-token prompt, lengths uniform in [R/2, R] (as the benchmark):
    packed at R = 64 and 256, not at 512 and beyond."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    verdicts = {}
    for r in (64, 256, 512, 1024, 4096):
        lengths = torch.linspace(r // 2, r, 8).round().long()
        verdicts[r] = _shared_prompt_pays(config, torch.zeros(8, dtype=torch.long), lengths, 48, 48 + r)
    assert verdicts == {64: True, 256: True, 512: False, 1024: False, 4096: False}


def test_all_empty_responses_do_not_raise():
    """A batch whose completions are all empty (the first token was EOS and truncated away): the log-probs are
    computed (and masked), not an indexing error."""
    model = grpo_math_tiny_llama()
    input_ids, attention_mask, context_length = grouped_batch([4, 4], width=3)
    attention_mask[:, context_length:] = 0
    with torch.no_grad():
        logprobs, _ = shared_prompt_logprobs(model, input_ids, attention_mask, context_length, 1.0)
    assert logprobs.shape == (8, 3) and torch.isfinite(logprobs).all()


def grpo_math_tiny_llama():
    return family_model("llama", None).eval()


# HF generate applies the script's sampling fields only, whatever the checkpoint's generation_config.json says.

QWEN25_INSTRUCT_SAMPLING = {
    "repetition_penalty": 1.3,
    "top_k": 20,
    "top_p": 0.8,
    "temperature": 0.7,
    "do_sample": True,
}


@pytest.fixture
def model_with_sampling_config(tiny_model_dir, tmp_path):
    """The tiny model with Qwen2.5-Instruct's sampling fields in generation_config.json (its repetition penalty
    raised from 1.05 to 1.3 so that greedy decoding visibly changes)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "with-sampling"
    shutil.copytree(tiny_model_dir, folder)
    path = os.path.join(folder, "generation_config.json")
    config = json.load(open(path)) if os.path.exists(path) else {}
    with open(path, "w") as f:
        json.dump({**config, **QWEN25_INSTRUCT_SAMPLING, "eos_token_id": 2}, f)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.generation_config.repetition_penalty == 1.3
    return model


def argmax_decoding(model, prompt, steps):
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            if token == 2:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


def test_hf_generate_greedy_ignores_the_checkpoints_sampling_fields(model_with_sampling_config):
    """Greedy hf_generate equals plain argmax decoding (a fault: transformers filled the repetition penalty in
    from generation_config.json, and the tiny model's greedy tokens changed)."""
    model = model_with_sampling_config
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 3117]
    expected = argmax_decoding(model, prompt, 12)
    responses, lengths = grpo_math._hf_generate(model, [prompt], 1, 12, 0.0, 1.0, 2, [2])
    assert responses[0, : int(lengths[0])].tolist() == expected
    assert model.generation_config.repetition_penalty == 1.3  # the model's own config is left as it was


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_hf_generate_sampling_uses_no_logits_processor_the_trainer_lacks(model_with_sampling_config, top_p):
    """Sampling at temperature 0.8: a temperature warper, and top-p only when asked; no repetition penalty, no top-k
    (the trainer's log-probs are the full softmax of logits / temperature)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    model = model_with_sampling_config
    built = []
    original = model._get_logits_processor
    model._get_logits_processor = lambda *a, **kw: built.append(original(*a, **kw)) or built[-1]
    grpo_math._hf_generate(model, [[1, 9690, 198, 2683]], 2, 4, 0.8, top_p, 2, [2])
    kinds = {type(p) for p in built[0]}
    assert kinds == ({TemperatureLogitsWarper, TopPLogitsWarper} if top_p < 1 else {TemperatureLogitsWarper})


def test_installed_vllm_reload_weights_takes_the_keywords_the_sync_passes():
    """pyproject pins vllm to 0.32, the version read and run: its model runner (the CUDA worker's and the CPU
    worker's, which inherits it) reloads weights from an iterator in checkpoint format, as vllm_sync_weights calls."""
    import inspect

    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    parameters = inspect.signature(GPUModelRunner.reload_weights).parameters
    assert {"weights_iterator", "is_checkpoint_format"} <= set(parameters)


# vLLM's sleep mode for a colocated engine (--vllm_sleep): the engine never generates or takes weights asleep.


class SleepyEngine:
    """Stands in for vllm.LLM: records what the Sampler calls, and fails on a generation or weight load while asleep
    (vLLM would run them on freed memory)."""

    def __init__(self):
        self.calls, self.asleep = [], False
        self.llm_engine = type("E", (), {"model_config": type("C", (), {"dtype": torch.float32})()})()

    def sleep(self, level):
        assert not self.asleep and level == 1  # level 1 keeps the weights (in CPU memory): eval needs no new sync
        self.asleep = True
        self.calls.append("sleep")

    def wake_up(self, tags=None):
        assert self.asleep and tags is None
        self.asleep = False
        self.calls.append("wake_up")

    def run(self, what):
        assert not self.asleep, f"{what} while asleep"
        self.calls.append(what)


@pytest.mark.parametrize("sleep", [True, False])
def test_vllm_sleeps_between_generations_and_wakes_before_it_generates_or_takes_weights(
    sleep, tiny_model_dir, monkeypatch
):
    """The Sampler's order with --vllm_sleep (an evaluation, a rollout, an update's weight sync, a rollout): the
    engine sleeps after every generation and is awake for every generation and every weight load; without it, it
    never sleeps. The real sleep mode needs CUDA; this checks the calls the Sampler makes."""
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    def fake_generate(llm, prompts, n, *rest):
        llm.run("generate")
        rows = len(prompts) * n
        return torch.full((rows, 4), 5), torch.full((rows,), 4), torch.zeros(rows, 4)

    monkeypatch.setattr(grpo_math, "_vllm_generate", fake_generate)
    monkeypatch.setattr(grpo_math, "_vllm_sync_weights", lambda llm, state, dtype: llm.run("sync"))
    args = grpo_math.Config(model_name_or_path=tiny_model_dir, vllm=False, vllm_sleep=sleep)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = torch.nn.Linear(2, 2)
    sampler = grpo_math.Sampler(args, Accelerator(cpu=True), policy, tokenizer, tiny_model_dir)
    sampler.llm = engine = SleepyEngine()
    sampler.generate([[1, 2]], 1, 0.0)  # evaluation at step 0
    sampler.generate([[1, 2], [3]], 2, 1.0)  # the step's rollout
    sampler.sync_weights()  # after the update
    sampler.generate([[1, 2]], 2, 1.0)
    expected = ["generate", "sleep", "wake_up", "generate", "sleep", "wake_up", "sync", "generate", "sleep"]
    assert engine.calls == (expected if sleep else ["generate", "generate", "sync", "generate"])
    assert engine.asleep == sleep
