"""benchmark/performance/memory_plan.py: parameter counts against the models transformers builds from the same config,
the saved activations against autograd's, hand-computed rows, ZeRO sharding, LoRA and the command line. No weights."""

import json
import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

from benchmark.performance import memory_plan as mp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO_ROOT, "grpo_math.py")
TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY |= dict(intermediate_size=128, tie_word_embeddings=True)
# By hand: embeddings 1000 * 64; per layer q, o 64 * 64 each, k, v 64 * 32 each, MLP 3 * 64 * 128, 2 norms of 64;
# the final norm 64. Qwen2 adds the q, k, v biases (64 + 32 + 32 per layer).
TINY_LLAMA = 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
assert TINY_LLAMA == 138_048


def numel(model_class, config):
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


@pytest.mark.parametrize("tied", [True, False])
def test_num_params_matches_transformers(tied):
    llama, qwen = LlamaConfig(**{**TINY, "tie_word_embeddings": tied}), Qwen2Config(**TINY, num_labels=1)
    qwen.tie_word_embeddings = tied
    assert mp.num_params(llama) == numel(LlamaForCausalLM, llama) == TINY_LLAMA + (not tied) * 1000 * 64
    assert mp.num_params(qwen) == numel(Qwen2ForCausalLM, qwen) == TINY_LLAMA + 2 * 128 + (not tied) * 1000 * 64
    llama.num_labels = 1  # sequence classifiers: no LM head, a [1, hidden] score head
    assert mp.num_params(llama, mp.SCORE) == numel(LlamaForSequenceClassification, llama) == TINY_LLAMA + 64
    assert mp.num_params(qwen, mp.SCORE) == numel(Qwen2ForSequenceClassification, qwen) == TINY_LLAMA + 256 + 64


def test_qwen_1_5b_config():
    config = mp.read_config(os.path.join(REPO_ROOT, "benchmark", "configs", "qwen2.5-1.5b"))
    assert mp.num_params(config) == 1_543_714_304  # Qwen2.5-1.5B's published count


def test_lora_params_match_peft():
    peft = pytest.importorskip("peft")
    config = LlamaConfig(**TINY)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules=list(targets)))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # r * (in + out): q, o 64 + 64, k, v 64 + 32, gate, up, down 64 + 128; 2 layers
    assert mp.lora_params(config, 4, targets) == trained == 2 * 4 * (2 * 128 + 2 * 96 + 3 * 192)
    # The scripts' default, all-linear: peft takes the same 7 layers, never the output head (lm_head, score).
    config.num_labels = 1  # the scripts' reward and value models
    for auto, task_type in ((LlamaForCausalLM, "CAUSAL_LM"), (LlamaForSequenceClassification, "SEQ_CLS")):
        lora = peft.LoraConfig(r=4, target_modules="all-linear", task_type=task_type)
        model = peft.get_peft_model(auto(config), lora)
        adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
        assert adapters == mp.lora_params(config, 4, ("all-linear",)) == trained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_match_autograd(dtype):
    """Bytes autograd saves inside the decoder layers (each storage once, weights left out) for a left-padded batch,
    as the scripts run, against the plan's activations and attention mask biases."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation="sdpa")).to(dtype)
    weights, saved, inside = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}, [False]

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids, mask = torch.randint(0, 1000, (3, 40)), torch.ones(3, 40, dtype=torch.long)
    mask[0, :5] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask).logits.float().sum().backward()
    w = dtype.itemsize
    planned = (
        mp.activation_elements(model.config, 3 * 40, w, False) * w + mp.mask_bytes(3, 40, 2, w, False) - 3 * 40 * 40
    )
    # (the bool mask itself is made outside the layers: 3 x 40 x 40 bytes less)
    print(f"saved {sum(saved.values())} planned {planned}")
    assert abs(sum(saved.values()) - planned) / planned < 0.02, (sum(saved.values()), planned)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    with open(folder / "config.json", "w") as f:
        json.dump({**LlamaConfig(**TINY).to_dict(), "architectures": ["LlamaForCausalLM"]}, f)
    return str(folder)


def rows_of(tiny_folder, *argv, **kwargs):
    rows = mp.plan(GRPO, ["--model_name_or_path", tiny_folder, "--no-vllm", *argv], **kwargs)
    return {row.component.split(":")[0]: row.gib * mp.GIB for row in rows}


def test_rows_by_hand(tiny_folder):
    rows = rows_of(tiny_folder, prompt_length=32)  # fp32, beta 0.04: a reference
    assert rows["weights"] == rows["reference policy"] == 4 * TINY_LLAMA
    assert "reference policy" not in rows_of(tiny_folder, "--importance_sampling_level", "sequence")  # GSPO: beta 0
    assert rows["AdamW state (2 x trained)"] == 2 * rows["gradients"] == 8 * TINY_LLAMA
    assert rows["logits x3"] == 3 * 8 * 64 * 1000 * 4  # micro_batch_size 8, response_length 64, vocab, fp32
    # The bool mask, and an fp32 bias per layer. At R = 64 the script's rule does not pack a model this small (the
    # dense pairs of one 544-token sequence cost more than the 7 prompt copies saved): 8 sequences of P + R tokens.
    assert rows["attention mask bias"] == 8 * 96**2 * (1 + 2 * 4)
    # At R = 8 it packs: the micro-batch of 8 is one group of G = 8, one sequence of P + 8 R = 32 + 64 tokens.
    packed = rows_of(tiny_folder, "--response_length", "8", prompt_length=32)
    assert packed["attention mask bias"] == 1 * 96**2 * (1 + 2 * 4)
    assert rows["HF generate KV cache"] == 300 * 96 * 2 * 2 * 32 * 4  # 300 held-out prompts x (P + R), K and V


def test_zero_shards_by_num_gpus(tiny_folder):
    one = rows_of(tiny_folder)
    for zero, sharded in [(1, {"AdamW state (2 x trained)"}), (2, {"AdamW state (2 x trained)", "gradients"})]:
        rows = rows_of(tiny_folder, num_gpus=4, zero=zero)
        for name in ("weights", "AdamW state (2 x trained)", "gradients", "reference policy"):
            assert rows[name] == pytest.approx(one[name] / (4 if name in sharded else 1))
    zero3 = rows_of(tiny_folder, num_gpus=4, zero=3)
    assert zero3["weights"] == pytest.approx(one["weights"] / 4)
    assert zero3["reference policy"] == one["reference policy"]  # frozen models are whole on every process
    assert "DDP gradient buckets" in rows_of(tiny_folder, num_gpus=4) and "DDP gradient buckets" not in one


def test_lora_trains_adapters_only(tiny_folder):
    rows = rows_of(tiny_folder, "--lora_r", "8")
    adapters = mp.lora_params(LlamaConfig(**TINY), 8, mp.load_args(GRPO, []).lora_target_modules)
    assert rows["AdamW state (2 x trained)"] == 2 * 4 * adapters and rows["gradients"] == 4 * adapters
    assert rows["weights"] == 4 * TINY_LLAMA and "reference policy" not in rows  # the reference: adapters off


def test_command_line(tiny_folder, capsys):
    config = os.path.join(REPO_ROOT, "benchmark", "accelerate_configs", "deepspeed_zero3.yaml")
    argv = ["grpo_math.py", "--model_name_or_path", tiny_folder, "--config_file", config, "--dtype", "bfloat16"]
    rows = mp.main([os.path.join(REPO_ROOT, argv[0]), *argv[1:], "--device_gib", "80"])
    out = capsys.readouterr().out
    assert "8 GPU(s) x 80 GiB, ZeRO-3" in out and "fits in 80 GiB" in out and "vLLM engine" in out
    assert mp.total(rows) > 0.3 * 80  # vLLM's share
    mp.main([GRPO, "--model_name_or_path", tiny_folder, "--device_gib", "0.5"])
    assert "does not fit in 0.5 GiB" in capsys.readouterr().out


def test_vllm_sleep_frees_the_engine_share_for_the_update(tiny_folder):
    """Awake, the engine's share is held beside the update (static); asleep while training (--vllm_sleep), the
    update and the engine never hold memory together: total = static + max(update, engine share)."""
    argv = [GRPO, ["--model_name_or_path", tiny_folder, "--vllm"]]
    awake, asleep = mp.plan(*argv), mp.plan(argv[0], argv[1] + ["--vllm_sleep"])
    share = 0.3 * 80
    assert [r.phase for r in awake if r.component == "vLLM engine"] == ["static"]
    assert [r.phase for r in asleep if r.component == "vLLM engine"] == ["generate"]
    update = sum(r.gib for r in awake if r.phase == "train")
    assert update < share  # a tiny model: its update is smaller than the share
    assert mp.total(awake) - mp.total(asleep) == pytest.approx(update)
