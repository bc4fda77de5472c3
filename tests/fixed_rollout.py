"""A fixed rollout for the invariant tests, and a launcher that runs a script on it.

The completions depend only on the prompt's tokens and the sample's index in its group: never on the process, the
batch it is in, the model or a random stream. Runs launched differently (1 or N processes, micro-batch sizes,
DeepSpeed) then train on exactly the same data and must compute the same numbers (loss, grad norm, lr, weights).

As a program it runs a script's main() with its HF sampler (and the rewards named in PATCHES) replaced:
    accelerate launch --multi_gpu --num_processes 2 tests/fixed_rollout.py grpo_math.py --no-vllm ...
several runs one after the other in one launch (one process group, the imports paid once), separated by ---:
    accelerate launch ... tests/fixed_rollout.py grpo_math.py --output_dir a ... --- ppo_rlhf.py --output_dir b ...
In-process tests call patch(module, monkeypatch.setattr) and then module.main(args).

For the fault-injection tests the program can also overflow a gradient and turn off DeepSpeed's gradient norm:
    INF_GRADIENT=1                     the final norm's gradient times inf in every backward (the loss stays finite)
    DEEPSPEED_COMPUTE_GRAD_NORM=false  zero_optimization.compute_grad_norm false (ZeRO-1/2, --max_grad_norm 0)
and kill itself (SIGKILL) at a chosen point, and count the points:
    KILL_AT=backward:7        before the 7th backward pass: inside a training step
    KILL_AT=save_state:2      once the 2nd checkpoint's files are written, before the checkpoint is finished
    KILL_AT=save_pretrained:1 once the first model folder of the final save is written
"""

import collections
import importlib
import os
import signal
import sys
import zlib

import torch


def fixed_generate(model, prompts, n, response_length, temperature, top_p, pad_token_id, stop_ids):
    """Stands in for hf_generate (same signature and returns): completion j of a prompt is a seeded function of
    (prompt tokens, j). Lengths 1..response_length; half of the completions end with the first stop id."""
    stop_ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids)
    responses = torch.full((len(prompts) * n, response_length), pad_token_id, dtype=torch.long)
    lengths = torch.full((len(prompts) * n,), response_length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        for j in range(n):
            g = torch.Generator().manual_seed(zlib.crc32(repr((list(prompt), j)).encode()))
            length = int(torch.randint(1, response_length + 1, (1,), generator=g))
            tokens = torch.randint(300, 3000, (length,), generator=g)  # ordinary word pieces of the SmolLM2 vocab
            ends = bool(torch.rand(1, generator=g) < 0.5)
            if ends:
                tokens[-1] = stop_ids[0]
            lengths[i * n + j] = length
            responses[i * n + j, :length] = tokens
    return responses, lengths


def fixed_turns(
    model, tokenizer, contexts, max_tokens, temperature, top_p, pad_token_id, stop_ids, stop_strings=("</calc>",)
):
    """Stands in for grpo_tools' hf_turns (same signature and returns): a scripted policy whose turn is a seeded
    function of (the context's tokens, how many earlier contexts of this call were the same: the sample's index in
    its group on the first turn). A turn is a few ordinary word pieces then, at random, a tool call of a product of
    two numbers of 1-3 digits (results of different lengths), a call the calculator refuses (malformed, or a
    division by zero), or an answer ending with the first stop id; cut at max_tokens. Without stop_strings (grpo_tools
    --tool_format native) a call is a Hermes <tool_call> (a malformed one is not JSON) and its turn ends with the
    first stop id, the model's end of turn."""
    stop_ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids)
    seen, turns = collections.Counter(), []
    for context, limit in zip(contexts, max_tokens):
        key = repr(list(context))
        g = torch.Generator().manual_seed(zlib.crc32(f"{key} {seen[key]}".encode()))
        seen[key] += 1
        words = torch.randint(300, 3000, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        kind = int(torch.randint(0, 4, (1,), generator=g))
        a, b = (int(torch.randint(1, 10**3, (1,), generator=g)) for _ in range(2))
        if stop_strings:
            refused = "<calc>(1 +</calc>" if a % 2 else f"<calc>{a}/0</calc>"
            call = f"<calc>{a} * {b}</calc>"
        else:
            native = '<tool_call>{"name": "calculate", "arguments": {"expression": "%s"}}</tool_call>'
            refused = "<tool_call>{(1 +}</tool_call>" if a % 2 else native % f"{a}/0"
            call = native % f"{a} * {b}"
        ending = [call, refused, f"Answer: {a}", f"Answer: {a * b}"][kind]
        ended = kind >= 2 or not stop_strings
        ids = words + tokenizer(ending, add_special_tokens=False).input_ids + ([stop_ids[0]] if ended else [])
        turns.append((ids[:limit], None))
    return turns


def space_reward(completions, golds, format_reward):
    """grpo_math's compute_rewards on the fixed rollout: the fraction of characters that are spaces (varied within
    a group, so the advantages are not zero)."""
    rewards = torch.tensor([c.count(" ") / max(1, len(c)) for c in completions], dtype=torch.float32)
    return rewards, (rewards > 0.5).float(), torch.zeros(len(completions))


# Script module -> {attribute: replacement} on top of _hf_generate.
PATCHES = {
    "grpo_math": {"compute_rewards": space_reward},
    "grpo_tools": {"compute_rewards": space_reward, "_hf_turns": fixed_turns},
}


def patch(module, setter=setattr):
    """Replace the module's HF sampler (and its PATCHES) by the fixed rollout."""
    setter(module, "_hf_generate", fixed_generate)
    for name, replacement in PATCHES.get(module.__name__, {}).items():
        setter(module, name, replacement)


def counted_call(original, name, kill_before, kill_at, calls):
    """`original` counting its calls in calls[name], and killing this process at the call kill_at names
    ("name:n"): before it when kill_before, else after it."""

    def call(*args, **kwargs):
        calls[name] += 1
        kill = kill_at == f"{name}:{calls[name]}"
        if kill and kill_before:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return call


def install_faults(script):
    """The faults the environment asks for (INF_GRADIENT, DEEPSPEED_COMPUTE_GRAD_NORM), on the script's loaders
    (a script that is not one of the seven, such as a test's probe, need not have them when none is asked for)."""

    def overflowing(load_model):
        def load(*args, **kwargs):
            model = load_model(*args, **kwargs)
            model.model.norm.weight.register_hook(lambda grad: grad * float("inf"))
            return model

        return load

    def without_norm(make_accelerator):
        def make(*args, **kwargs):
            accelerator = make_accelerator(*args, **kwargs)
            accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["compute_grad_norm"] = False
            return accelerator

        return make

    if os.environ.get("INF_GRADIENT") == "1":
        script._load_model = overflowing(script._load_model)
    if os.environ.get("DEEPSPEED_COMPUTE_GRAD_NORM") == "false":
        script._make_accelerator = without_norm(script._make_accelerator)


def install_kill_points(kill_at, calls, setter=setattr):
    """Count the calls of each kill point in `calls` and SIGKILL this process at the one kill_at names (or None)."""
    import accelerate
    import transformers

    for owner, name, kill_before in (
        (accelerate.Accelerator, "backward", True),
        (accelerate.Accelerator, "save_state", False),
        (transformers.PreTrainedModel, "save_pretrained", False),
    ):
        setter(owner, name, counted_call(getattr(owner, name), name, kill_before, kill_at, calls))


if __name__ == "__main__":
    import tyro
    from accelerate.state import AcceleratorState, GradientState, PartialState

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        # On the CPU accelerator DeepSpeed's process group JIT-compiles its shared-memory all-reduce (a C++ build
        # against torch's headers: 5-10 minutes on 2 busy cores, in every test session's fresh cache), which only
        # DeepSpeed inference's tensor-parallel all-reduce uses: training reduces with torch.distributed.
        # (`deepspeed.comm.torch` as an attribute is the torch package, which deepspeed.comm imports: go by name.)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    install_kill_points(os.environ.get("KILL_AT"), collections.Counter())
    runs = [[]]
    for arg in sys.argv[1:]:
        runs.append([]) if arg == "---" else runs[-1].append(arg)
    for i, (name, *flags) in enumerate(runs):
        script = importlib.import_module(os.path.basename(name).removesuffix(".py"))
        originals = dict(vars(script))  # put back after the run, so that the next one patches afresh
        patch(script)
        install_faults(script)
        destroy = PartialState.destroy_process_group  # end_training's; the next run needs the process group
        if i < len(runs) - 1:
            PartialState.destroy_process_group = lambda self, group=None: None
        script.main(tyro.cli(script.Config, args=flags))
        PartialState.destroy_process_group = destroy
        vars(script).update(originals)
        # The next run builds its own Accelerator (and DeepSpeed config) in the same process group.
        AcceleratorState._reset_state()
        GradientState._reset_state()
