"""Per-GPU memory plan of a script's command, from its Args and the models' config.json (no weight is loaded).

    python -m benchmark.performance.memory_plan grpo_math.py --model_name_or_path Qwen/Qwen2.5-Math-1.5B-Instruct \
        --response_length 512 --dtype bfloat16 --model_config benchmark/configs/qwen2.5-1.5b
    python -m benchmark.performance.memory_plan ppo_rlhf.py \
        --config_file benchmark/accelerate_configs/deepspeed_zero3.yaml

The plan's own flags (main() below) may go anywhere; the other arguments are the script's, parsed by tyro into its
Args as the script parses them. Rows are "static" (held all run), "train" (the update) or "generate" (HF generate's
KV cache, which async_rlhf's generator thread holds during the update: "train" there); total = static +
max(train, generate). Weights, gradients and AdamW's two states are in --dtype (mixed_precision is "no" in every
accelerate config: fp32 weights are their own master copy; torch's AdamW allocates zeros_like(param)); ZeRO-1
shards the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the trained weights too; frozen models are whole on
every process. The logits [rows, R, V] in fp32 (.float() / temperature) count 3 times: the tensor logsumexp saves,
its gradient, and one temporary of that size (exp() in logsumexp's forward and backward, the entropy's softmax).
P is --max_prompt_length unless --prompt_length is given, R is --response_length. See benchmark/results/memory_plan.md.
"""

import argparse
import importlib.util
import os
import sys
import warnings
from typing import NamedTuple

import yaml

GIB = 2**30
CAUSAL, SCORE = "lm", "score"


class Row(NamedTuple):
    component: str
    gib: float
    phase: str = "static"
    note: str = ""


def load_args(script, argv):
    """The script's Args from argv, parsed by tyro as the script does, with the defaults that depend on other flags
    filled as its check_args fills them (grpo_math's resolve_defaults: beta); the module is imported, main() is not
    run."""
    import tyro

    name = os.path.basename(script).removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, script)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    args = tyro.cli(sys.modules[name].Config, args=list(argv))
    if hasattr(sys.modules[name], "resolve_defaults"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the script's warning that it filled GSPO's defaults
            sys.modules[name].resolve_defaults(args)
    return args


def read_config(path, override=None):
    """transformers' config of a local folder or a hub id in the cache (never downloaded); None if not found."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(override or path, local_files_only=True)
    except (OSError, ValueError):
        return None


def dims(c):
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.hidden_size, c.num_hidden_layers, heads * head_dim, kv * head_dim, c.intermediate_size, c.vocab_size


def num_params(c, head=CAUSAL):
    """Parameters of a decoder-only model from its config: embeddings, layers, final norm, and the LM head (none
    when tied to the embeddings) or a one-output score head (sequence classifiers, no bias)."""
    h, layers, q, kv, inter, vocab = dims(c)
    bias = getattr(c, "attention_bias", False)
    qkv_bias = (c.model_type == "qwen2" or bias) * (q + 2 * kv)  # Qwen2: q, k, v always have biases, o never
    attn = 2 * h * q + 2 * h * kv + qkv_bias + (bias and c.model_type != "qwen2") * h
    mlp = 3 * h * inter + getattr(c, "mlp_bias", False) * (2 * inter + h)
    qk_norm = 2 * q // c.num_attention_heads if c.model_type == "qwen3" else 0
    layer = attn + mlp + 2 * h + qk_norm
    out = h if head == SCORE else (0 if c.tie_word_embeddings else vocab * h)
    return vocab * h + layers * layer + h + out


def lora_params(c, r, targets):
    """Adapter parameters: r * (in + out) for each targeted linear layer of each decoder layer (all-linear: all 7)."""
    h, layers, q, kv, inter, _ = dims(c)
    shapes = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h), gate_proj=(h, inter))
    shapes |= dict(up_proj=(h, inter), down_proj=(inter, h))
    targets = shapes if tuple(targets) == ("all-linear",) else targets
    return layers * sum(r * sum(shapes[t]) for t in targets if t in shapes)


def activation_elements(c, tokens, dtype_bytes, checkpointing):
    """Elements (of the model's dtype) autograd keeps for backward in the decoder layers, as HF's Llama / Qwen2 code
    saves them (tests/benchmark/test_memory_plan.py counts them): each RMSNorm its input, the normalised input and the
    scaled output (3h; 4h in bf16, where the input is upcast to fp32); q, k, v after RoPE, with k and v repeated to
    every query head (GQA is left to SDPA only without a mask, and the scripts always pass one) and the attention
    output (4 q); the MLP's gate, silu, up and their product (4I). With checkpointing: the layer inputs (h each) and
    one layer recomputed during backward."""
    h, layers, q, kv, inter, _ = dims(c)
    layer = 2 * (3 if dtype_bytes == 4 else 4) * h + 4 * q + 4 * inter
    return tokens * (layers * h + layer) if checkpointing else tokens * layers * layer


def mask_bytes(sequences, length, layers, dtype_bytes, checkpointing):
    """The 4D attention mask: one bool [S, 1, L, L] for the forward, and in every layer the float bias SDPA converts
    it to (in the query's dtype), which backward keeps; with checkpointing only the layer being recomputed has one."""
    return sequences * length**2 * (1 + dtype_bytes * (1 if checkpointing else layers))


def parse_zero(config_file):
    """(ZeRO stage, num_processes) of an accelerate config file (stage 0: DDP or one process)."""
    with open(config_file) as f:
        config = yaml.safe_load(f)
    return int((config.get("deepspeed_config") or {}).get("zero_stage", 0)), int(config.get("num_processes", 1))


def workload(name, a, prompt_length):
    """(rows per micro-batch, group size G, prompt length P, response length R, sequence length of the update,
    sequences generated at once: a step's batch or the held-out prompts, whichever is larger)."""
    p, r = prompt_length or a.max_prompt_length, a.response_length
    evals = getattr(a, "num_eval_prompts", 0)
    if name == "grpo_math":
        g = a.num_generations
        return a.micro_batch_size, g, p, r, p + r, max(a.prompts_per_rank * a.oversample * g, evals)
    if name == "dpo_online":
        return 2 * a.micro_batch_size, 2, p, r, p + r, max(2 * a.prompts_per_rank, evals)
    if name == "async_rlhf":
        n = 2 if a.loss == "dpo" else a.rloo_k
        return a.micro_batch_size * n, n, p, r, p + r, max(n * a.prompts_per_rank, evals)
    if name == "reward_modeling":  # pairs (chosen and rejected) or --prm completions, up to max_length tokens
        rows = a.micro_batch_size * (1 if a.prm else 2)
        return rows, 1, p, r, min(a.max_length, p + r), a.generation_batch_prompts * a.num_samples_per_prompt
    return a.micro_batch_size, 1, p, r, p + r, max(a.prompts_per_rank, evals)  # PPO: one completion per prompt


def models(name, a, policy_config, config_of, use_vllm):
    """(trained, frozen): the models main() loads, each (label, config, head, note)."""
    head = SCORE if name == "reward_modeling" else CAUSAL
    trained, frozen = [("policy" if head == CAUSAL else "reward model", policy_config, head, "")], []
    if name in ("ppo_rlhf", "ppo_prm_clip"):  # trained in full, also when the policy has LoRA
        c, note = config_of(
            a.value_model_path or (a.reward_model_path if name == "ppo_rlhf" else a.model_name_or_path)
        )
        trained.append(("value model", c, SCORE, note))
    has_reference = a.beta > 0 if name == "grpo_math" else name != "reward_modeling"
    if has_reference and a.lora_r == 0:  # with LoRA the reference is the policy with its adapters off
        frozen.append(("reference policy", policy_config, CAUSAL, ""))
    if name == "ppo_rlhf" or getattr(a, "judge", "") == "reward_model":
        c, note = config_of(a.reward_model_path)
        frozen.append(("reward model (frozen)", c, SCORE, note))
    if name == "ppo_prm_clip" and a.prm != "verifier":  # reward_modeling.py --prm (a classifier) or Math-Shepherd
        c, note = config_of(a.prm)
        learned = any(x.endswith("ForSequenceClassification") for x in c.architectures or [])
        frozen.append(("PRM", c, SCORE if learned else CAUSAL, note))
    if name == "async_rlhf":  # the weights the learner publishes, and the generator's own model for HF generate
        frozen.append(("published weights (generator's copy)", policy_config, CAUSAL, "LoRA merged"))
        if not use_vllm:
            frozen.append(("generator's HF policy copy", policy_config, CAUSAL, ""))
    return trained, frozen


def plan(script, argv, device_gib=80.0, num_gpus=1, zero=0, cpu=False, prompt_length=None, config=None, runtime=None):
    """Rows (component, GiB, phase, note) of one process's memory for `script argv` on num_gpus GPUs (or on CPU)."""
    name, a = os.path.basename(script).removesuffix(".py"), load_args(script, argv)
    policy_config = read_config(a.model_name_or_path, config)
    if policy_config is None:
        raise SystemExit(f"no config.json for {a.model_name_or_path} here: pass --model_config FOLDER")

    def config_of(path):  # a reward / value / PRM folder not written yet: the policy's architecture
        found = read_config(path, config if path == a.model_name_or_path else None)
        return (found, "") if found else (policy_config, f"{path} not found: the policy's architecture assumed")

    n, w, lora = max(1, num_gpus), 4 if a.dtype == "float32" else 2, a.lora_r > 0
    use_vllm = a.vllm and not (name == "async_rlhf" and n > 1)  # async_rlhf: vLLM with one process only
    trained, frozen = models(name, a, policy_config, config_of, use_vllm)
    gib = lambda count, nbytes=w: count * nbytes / GIB
    full = sum(num_params(c, head) for _, c, head, _ in trained)
    train_params = full
    if lora:  # the policy's adapters (and peft's trainable copy of a new score head); a value model in full
        c, head = trained[0][1:3]
        train_params += lora_params(c, a.lora_r, a.lora_target_modules) - num_params(c, head)
        train_params += c.hidden_size if head == SCORE else 0
    labels = " + ".join(t[0] for t in trained)
    rows = [Row(f"weights: {labels}", gib(full) / (n if zero >= 3 else 1), note=f"{full / 1e6:.1f}M params")]
    if lora:
        what = "LoRA adapters" + " + value model" * (len(trained) > 1)
        rows.append(Row("  of which trained", 0.0, note=f"{train_params / 1e6:.2f}M params: {what}"))
    rows.append(Row("AdamW state (2 x trained)", 2 * gib(train_params) / (n if zero >= 1 else 1)))
    rows.append(Row("gradients", gib(train_params) / (n if zero >= 2 else 1), "train"))
    if n > 1 and zero == 0:
        rows.append(Row("DDP gradient buckets", gib(train_params), "train", "a second copy of the gradients"))
    for label, c, head, note in frozen:
        rows.append(Row(label, gib(num_params(c, head)), note=note or f"{num_params(c, head) / 1e6:.1f}M params"))
    # reward_modeling shuts its engine down before it trains; --vllm_sleep frees the engine's memory while training
    sleep = getattr(a, "vllm_sleep", False)  # async_rlhf has none: its engine generates while the learner trains
    phase = "generate" if name == "reward_modeling" or sleep else "static"
    if use_vllm and cpu:
        kv_cache = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 2))  # the scripts' default
        engine = kv_cache + gib(num_params(policy_config), 4 if "32" in (a.vllm_dtype or a.dtype) else 2)
        rows.append(Row("vLLM-cpu engine", engine, phase, "VLLM_CPU_KVCACHE_SPACE (2 GiB) + its weights"))
    elif use_vllm:
        share = a.vllm_gpu_memory_utilization * device_gib
        note = "gpu_memory_utilization x device" + ", asleep while training (--vllm_sleep)" * sleep
        rows.append(Row("vLLM engine", share, phase, note))
    # CPU: 0.34 GiB to import a script, 0.84-1.0 GiB beside the tensors in two runs (results/memory_plan.md)
    runtime = runtime if runtime is not None else (0.9 if cpu else 0.5)
    rows.append(Row("runtime", runtime, note="Python, libraries, heap" if cpu else "CUDA context, cuBLAS workspace"))

    # The update: one micro-batch's forward and backward through each trained model.
    rows_mb, group, p, r, seq, generated = workload(name, a, prompt_length)
    shared = getattr(a, "shared_prompt", False) and min(rows_mb, group) > 1
    for label, c, head, _ in trained:
        packed = shared and head == CAUSAL and packs(sys.modules[name], c, rows_mb, group, p, r)
        sequences, length = (max(1, rows_mb // group), p + min(rows_mb, group) * r) if packed else (rows_mb, seq)
        act = activation_elements(c, sequences * length, w, a.gradient_checkpointing)
        how = "layer inputs + 1 layer (checkpointing)" if a.gradient_checkpointing else "every layer"
        rows.append(Row(f"activations: {label}", gib(act), "train", f"{sequences} x {length} tokens, {how}"))
        mask = mask_bytes(sequences, length, c.num_hidden_layers, w, a.gradient_checkpointing)
        kind = "packed groups (shared_prompt)" if packed else "padding"
        note = f"[{sequences}, 1, {length}, {length}] bool + a bias per layer, {kind}"
        rows.append(Row(f"attention mask bias: {label}", gib(mask, 1), "train", note))
        if head == CAUSAL:
            note = f"[{rows_mb}, {r}, {c.vocab_size}] fp32: saved, gradient, temporary"
            rows.append(Row("logits x3", 3 * gib(rows_mb * r * c.vocab_size, 4), "train", note))
    if not use_vllm:  # HF generate: the KV cache of every sequence generated at once (a step's batch or eval)
        _, layers, _, kv, _, _ = dims(policy_config)
        phase = "train" if name == "async_rlhf" and not a.sync else "generate"  # async: generates while it learns
        cache = gib(generated * (p + r) * layers * 2 * kv)
        rows.append(Row("HF generate KV cache", cache, phase, f"{generated} sequences x {p + r} tokens"))
        if zero >= 3 and name != "async_rlhf":  # the Sampler gathers the policy's shards
            rows.append(Row("HF generate: ZeRO-3 weights gathered", gib(full) * (1 - 1 / n), phase))
    return rows


def packs(module, c, rows, group, p, r):
    """Whether the script packs a micro-batch into one sequence per group (the prompt, then the G responses), by its
    own rules (shared_prompt_exact, shared_prompt_pays) with every response R tokens long (the upper bound)."""
    import torch

    groups = torch.arange(rows) // min(rows, group)
    lengths = torch.full((rows,), r)
    return module._shared_prompt_exact(c, p + r) and module._shared_prompt_pays(c, groups, lengths, p, p + r)


def total(rows):
    phase = lambda name: sum(row.gib for row in rows if row.phase == name)
    return phase("static") + max(phase("train"), phase("generate"))


def arg_parser():
    """The plan's own flags; what it does not know are the script's arguments (parse_known_args)."""
    parser = argparse.ArgumentParser(
        description=__doc__, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("script", help="grpo_math.py, reward_modeling.py, ppo_rlhf.py, ... (its arguments follow)")
    parser.add_argument("--device_gib", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument("--num_gpus", type=int, default=None, help="processes, one per GPU (default: config file, 1)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, help="DeepSpeed ZeRO stage")
    parser.add_argument("--config_file", help="an accelerate config (its zero_stage and num_processes)")
    parser.add_argument("--cpu", action="store_true", help="a CPU process: no vLLM GPU share, runtime 0.9 GiB")
    parser.add_argument("--prompt_length", type=int, help="P, the longest prompt's tokens (max_prompt_length)")
    parser.add_argument("--model_config", help="a folder with the policy's config.json (offline, no hub)")
    parser.add_argument("--runtime_gib", type=float, help="memory outside the tensors (Python, torch, CUDA context)")
    return parser


def main(argv=None):
    o, rest = arg_parser().parse_known_args(argv)
    zero, processes = parse_zero(o.config_file) if o.config_file else (0, 1)
    zero, num_gpus = o.zero if o.zero is not None else zero, o.num_gpus or processes
    rows = plan(o.script, rest, o.device_gib, num_gpus, zero, o.cpu, o.prompt_length, o.model_config, o.runtime_gib)
    where = "CPU" if o.cpu else f"{num_gpus} GPU(s) x {o.device_gib:g} GiB, ZeRO-{zero}"
    print(f"memory plan of one process: {' '.join(sys.argv[1:] if argv is None else argv)}\non {where}\n")
    width = max(len(row.component) for row in rows)
    print(f"{'component':<{width}}  {'phase':<8}  {'GiB':>7}  note")
    for row in rows:
        print(f"{row.component:<{width}}  {row.phase:<8}  {row.gib:7.2f}  {row.note}")
    need, label = total(rows), "total = static + max(train, generate)"
    verdict = "fits" if need <= o.device_gib else "does not fit"
    print(f"{label:<{width + 10}}  {need:7.2f}  {verdict} in {o.device_gib:g} GiB")
    return rows


if __name__ == "__main__":
    main()
