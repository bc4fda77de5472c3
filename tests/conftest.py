"""Shared fixtures: a tiny random Llama with the real SmolLM2 tokenizer, a tiny arithmetic task, fast Args.

Every cache a library could write (Hugging Face, vLLM, wandb, triton, torch) goes to a temporary folder, set
here at import time, before any test module imports transformers or the scripts.
"""

import atexit
import contextlib
import functools
import glob
import importlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

_CACHE_ROOT = tempfile.mkdtemp(prefix="cleanrlhf-tests-")
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
for _name, _sub in (
    ("HF_HOME", "hf"),
    ("VLLM_CACHE_ROOT", "vllm"),
    ("WANDB_DIR", "wandb"),
    ("WANDB_CACHE_DIR", "wandb-cache"),
    ("WANDB_CONFIG_DIR", "wandb-config"),
    ("TRITON_CACHE_DIR", "triton"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
    ("XDG_CACHE_HOME", "xdg-cache"),
    ("MPLCONFIGDIR", "matplotlib"),
):
    os.environ[_name] = os.path.join(_CACHE_ROOT, _sub)
    os.makedirs(os.environ[_name], exist_ok=True)
os.environ["WANDB_MODE"] = "offline"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# One thread: the tiny model gains nothing from more, and on a busy 2-core machine OpenMP spin-waits made HF
# generate ~10x slower with two threads. Subprocesses inherit it (the vLLM one sets its own binding).
os.environ["OMP_NUM_THREADS"] = "1"

import random  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_DIR = os.path.join(REPO_ROOT, "assets", "SmolLM2-135M-Instruct")
TOOL_TEMPLATE = "tool_chat_template.jinja"  # grpo_tools reads it in a model folder whose template ignores tools=
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# The tiny model's LlamaConfig (build_tiny_model adds SmolLM2's vocabulary, special tokens, RoPE and norm epsilon):
# head_dim 32, the smallest head size vLLM's CPU attention accepts (16 is refused with "Unsupported CPU attention
# configuration: head_dim=16").
TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
# The in-memory random model of the unit tests of the log-prob code (test_kit.py, test_model_families.py,
# which passes it to other families' configs too): no tokenizer, never saved, smaller than TINY_CONFIG; those tests'
# numbers come from this shape.
MICRO_CONFIG = dict(
    vocab_size=211,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# Keys whose values depend on the wall clock.
TIMING_PREFIXES = ("time/", "perf/")


def pytest_collection_modifyitems(items):
    """The longest tests (marked launches) first: with a worker per core, one of them started last would leave the
    other core idle for minutes at the end."""
    items.sort(key=lambda item: item.get_closest_marker("launches") is None)


def build_tiny_model(path):
    """A 2-layer random Llama with the SmolLM2 vocabulary, special tokens and chat template, saved at `path`."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    real = AutoConfig.from_pretrained(SMOLLM2_DIR)
    config = LlamaConfig(
        **TINY_CONFIG,
        vocab_size=real.vocab_size,
        rms_norm_eps=real.rms_norm_eps,
        rope_parameters=real.rope_parameters,
        bos_token_id=real.bos_token_id,
        eos_token_id=real.eos_token_id,
        pad_token_id=real.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(SMOLLM2_DIR).save_pretrained(path)
    shutil.copyfile(
        os.path.join(REPO_ROOT, "benchmark", "assets", "smollm2_tools.jinja"), os.path.join(path, TOOL_TEMPLATE)
    )
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    if not os.path.isfile(os.path.join(SMOLLM2_DIR, "config.json")):
        pytest.fail(
            f"{SMOLLM2_DIR} is missing: run `make assets` first (the tests take the tokenizer and config from it)",
            pytrace=False,
        )
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


def write_task(folder, num_train=64, num_test=16, seed=0):
    """train.jsonl / test.jsonl of one-digit additions with question/answer columns."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", num_train), ("test", num_test)):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                a, b = rng.randint(0, 9), rng.randint(0, 9)
                f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return str(folder)


def write_rows(folder, train_rows, test_rows=None):
    """train.jsonl / test.jsonl from lists of rows (a str row is written as the raw line); test = train if None."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train_rows), ("test", train_rows if test_rows is None else test_rows)):
        with open(folder / f"{split}.jsonl", "w") as f:
            f.writelines((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    return str(folder)


GOOD_ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(16)]


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("task") / "arith")


WORDS = "apple river stone cloud seven blue quiet table green window".split()


def write_preferences(folder, num_train=64, num_test=32, seed=0):
    """A preference dataset (TRL string format) with an obvious feature: chosen responses end in ' good', rejected
    ones in ' bad', after a random filler of the same kind."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", num_train), ("test", num_test)):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                filler = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))  # noqa: E731
                prompt = f"What is {rng.randint(0, 9)} + {rng.randint(0, 9)}? "
                f.write(json.dumps({"prompt": prompt, "chosen": filler() + " good", "rejected": filler() + " bad"}))
                f.write("\n")
    return str(folder)


@pytest.fixture(scope="module")
def preference_dir(tmp_path_factory):
    return write_preferences(tmp_path_factory.mktemp("preferences") / "good_bad")


# Each script's fast settings on the tiny model (its defaults otherwise): make_config's, and the flags of the
# subprocess runs.
FAST = {
    "grpo_math": dict(
        num_eval_prompts=8,
        vllm=False,
        response_length=12,
        prompts_per_rank=2,
        num_generations=4,
        micro_batch_size=4,
        total_steps=2,
        save_every=0,
        max_prompt_length=128,
        beta=0.0,  # no reference model: the beta > 0 paths have tests of their own
        oversample=1,  # one group sampled per trained group: dynamic sampling has a test of its own
    ),
    "grpo_tools": dict(
        num_eval_prompts=4,
        vllm=False,
        response_length=40,
        prompts_per_rank=2,
        num_generations=4,
        micro_batch_size=4,
        total_steps=2,
        save_every=0,
        beta=0.0,
        max_turns=2,
        max_prompt_length=256,  # the tool's description and example come before the question
    ),
    "dpo_online": dict(
        num_eval_prompts=4,
        vllm=False,
        response_length=8,
        prompts_per_rank=4,
        micro_batch_size=2,
        total_steps=2,
        save_every=0,
        max_prompt_length=128,
        missing_eos_penalty=None,  # the random tiny policy never says EOS in 8 tokens: read the reward model instead
    ),
    "ppo_rlhf": dict(
        num_eval_prompts=8,
        vllm=False,
        response_length=12,
        prompts_per_rank=8,
        micro_batch_size=4,
        num_minibatches=2,
        num_ppo_epochs=2,
        total_steps=2,
        save_every=0,
        max_prompt_length=128,
        missing_eos_penalty=None,  # the random tiny policy never says EOS in 12 tokens: read the reward model instead
    ),
    # The tiny random policy writes random tokens; a space as the step separator gives it many steps per response
    # (most tokens start with a space).
    "ppo_prm_clip": dict(
        num_eval_prompts=4,
        vllm=False,
        response_length=12,
        prompts_per_rank=4,
        micro_batch_size=2,
        num_minibatches=2,
        num_ppo_epochs=1,
        total_steps=2,
        save_every=0,
        max_prompt_length=128,
        step_separator=" ",
        kl_coef=0.0,
    ),
    "reward_modeling": dict(
        vllm=False,
        num_train_epochs=2.0,
        pairs_per_rank=8,
        micro_batch_size=4,
        learning_rate=1e-3,
        eval_batch_size=16,
        response_length=8,
        num_samples_per_prompt=4,
        max_pairs_per_prompt=2,
        generation_batch_prompts=8,
        max_prompt_length=128,
    ),
    "async_rlhf": dict(
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
    ),
}
# The scripts whose runs read a reward model (--reward_model_path): make_config gives them the tiny one.
REWARD_MODEL_SCRIPTS = ("dpo_online", "ppo_rlhf", "async_rlhf")


def fast_cli_flags(model_dir, data_dir, output_dir, **overrides):
    """grpo_math's fast settings as command-line flags, for subprocess runs of grpo_math.py."""
    values = {
        **FAST["grpo_math"],
        "model_name_or_path": model_dir,
        "dataset_path": data_dir,
        "output_dir": output_dir,
        **overrides,
    }
    return cli_flags(values)


@pytest.fixture
def make_config(request, tiny_model_dir, tmp_path):
    """make(script, **overrides) -> script.Config (script: the module or its name) on the tiny model: the task
    (reward_modeling: the good/bad preference pairs), outputs under tmp_path ("runs", reward_modeling's
    "reward_model"), the tiny reward model for the REWARD_MODEL_SCRIPTS, then FAST[script], then `overrides`.
    fast=False puts vllm=False alone in place of FAST[script] (the bad-input tests: the script's defaults);
    config_class: a subclass of script.Config to build instead. The task, preference pairs and reward model are
    built at the first call that needs them (with the torch RNG left as it was), as the test's module defines them."""

    def make(script, fast=True, config_class=None, **overrides):
        module = importlib.import_module(script) if isinstance(script, str) else script
        name = module.__name__
        values = {"model_name_or_path": tiny_model_dir, "output_dir": str(tmp_path / "runs")}
        fixtures = {"dataset_path": "preference_dir" if name == "reward_modeling" else "task_dir"}
        if name in REWARD_MODEL_SCRIPTS:
            fixtures["reward_model_path"] = "tiny_reward_model_dir"
        if name == "reward_modeling":  # its saved models too, never the repo's runs/ (--prm_dir's default: runs/prm)
            values |= {"reward_model_dir": str(tmp_path / "reward_model"), "prm_dir": str(tmp_path / "prm")}
        with torch.random.fork_rng(devices=[]):
            values |= {key: request.getfixturevalue(f) for key, f in fixtures.items() if key not in overrides}
        values |= FAST[name] if fast else {"vllm": False}
        return (config_class or module.Config)(**{**values, **overrides})

    return make


@pytest.fixture
def make_args(make_config):
    """make_args(**overrides) -> grpo_math.Config: make_config's, for grpo_math's tests."""
    return functools.partial(make_config, "grpo_math")


def read_metrics(run_dir):
    """metrics.jsonl of a run as a list of dicts."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def without_timing(lines):
    """Metrics lines without the wall-clock keys (time, time/*, perf/*)."""
    return [{k: v for k, v in line.items() if k != "time" and not k.startswith(TIMING_PREFIXES)} for line in lines]


def space_reward(completions, golds, format_reward):
    """A toy reward the tiny random model can learn in a few steps: the fraction of characters that are spaces.
    Same signature and return types as grpo_math.compute_rewards."""
    rewards = torch.tensor([c.count(" ") / max(1, len(c)) for c in completions], dtype=torch.float32)
    return rewards, (rewards > 0.5).float(), torch.zeros(len(completions))


def subprocess_env():
    """The environment for subprocess launches: this session's cache folders and the repo on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a stack dump on SIGABRT, which the tests send to a hung subprocess
    return env


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_model_dir, tmp_path_factory):
    return build_tiny_reward_model(tiny_model_dir, str(tmp_path_factory.mktemp("tiny-reward-model")))


def build_tiny_reward_model(model_dir, path):
    """The tiny Llama at model_dir as a one-label sequence classifier (a reward model as reward_modeling.py saves
    it): pad token set, a seeded random score head, config.bias = 0.0, saved with the tokenizer at `path`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.no_grad():
        model.score.weight.normal_(0, 1 / (model.config.hidden_size + 1) ** 0.5)
    model.config.bias = 0.0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def biased_reward_model_dir(tiny_reward_model_dir, tmp_path_factory):
    """The tiny reward model with config.bias = 0.7, as reward_modeling.py stores a mean training score of 0.7."""
    path = tmp_path_factory.mktemp("biased-rm") / "rm"
    shutil.copytree(tiny_reward_model_dir, path)
    with open(path / "config.json") as f:
        config = json.load(f)
    with open(path / "config.json", "w") as f:
        json.dump({**config, "bias": 0.7}, f)
    return str(path)


@pytest.fixture(scope="session")
def distinct_ensemble(tiny_reward_model_dir, tmp_path_factory):
    """An ensemble of two reward models that disagree: the tiny reward model, and a copy with another score head
    (seed 1) and config.bias 0.2."""
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path_factory.mktemp("distinct-ensemble")
    shutil.copytree(tiny_reward_model_dir, folder / "member_0")
    shutil.copytree(tiny_reward_model_dir, folder / "member_1")
    model = AutoModelForSequenceClassification.from_pretrained(folder / "member_1")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        with torch.no_grad():
            model.score.weight.normal_(0, 1 / (model.config.hidden_size + 1) ** 0.5)
    model.config.bias = 0.2
    model.save_pretrained(folder / "member_1", safe_serialization=True)
    return str(folder)


def write_score_model_config(folder, num_labels=1, architecture="LlamaForSequenceClassification", tokenizer=None):
    """A score model's folder without weights (bad-input runs stop before any load): its config.json, and
    `tokenizer` saved next to it when given."""
    folder.mkdir()
    config = {"model_type": "llama", "architectures": [architecture], "num_labels": num_labels}
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


class NoModelLoads:
    """Stands in for the Auto* model classes in bad-input tests: a check that comes after a model load fails."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError("model loaded")


def one_line_error(main, args, *names):
    """main(args) must stop with SystemExit("error: ...") on one line that names every one of `names`."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    message = exc.value.code
    assert isinstance(message, str), f"exit code {message!r} instead of a message"
    assert "\n" not in message.strip(), f"not one line: {message!r}"
    assert message.startswith("error: "), message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    return message


def cli_flags(values):
    """Args values as command-line flags, for subprocess runs."""
    flags = []
    for key, value in values.items():
        if isinstance(value, bool):
            flags.append(f"--{key}" if value else f"--no-{key}")
        else:
            flags += [f"--{key}", str(value)]
    return flags


def train_lines(lines):
    """The metrics.jsonl lines of training steps (step 0 is the evaluation before training)."""
    return [line for line in lines if line["global_step"] > 0]


@pytest.fixture
def model_without_chat_template(tiny_model_dir, tmp_path):
    """The tiny model's folder with the chat template removed from its tokenizer (bad-input tests)."""
    folder = tmp_path / "no_template_model"
    shutil.copytree(tiny_model_dir, folder)
    if (folder / "chat_template.jinja").exists():
        (folder / "chat_template.jinja").unlink()
    with open(folder / "tokenizer_config.json") as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    return str(folder)


# Helpers of the end-to-end tests of every script


def only_run_dir(output_dir):
    runs = [d for d in glob.glob(os.path.join(output_dir, "*")) if os.path.isdir(d)]
    assert len(runs) == 1, runs
    return runs[0]


def vllm_env():
    env = subprocess_env()
    env.pop("OMP_NUM_THREADS", None)  # vLLM binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def require_deepspeed():
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        pytest.skip(f"deepspeed is not importable (pip install -e '.[deepspeed]'): {e}")


def require_vllm():
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install (e.g. CUDA-linked torchvision)
        pytest.skip(f"vllm is not importable: {e}")


def signal_processes(processes, sig):
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)


def run_checked(cmd, env, timeout, cwd=REPO_ROOT):
    """Run a command and, on timeout, kill it with every process it started (the stacks of where they hung in the
    output); output goes to a file so that a timeout still shows what was printed."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torch's elastic agent starts each worker in a session of its own, out of reach of killpg: the workers
            # of a timed-out launch outlived their test, spinning in a collective beside the next tests.
            launcher = psutil.Process(proc.pid)  # a zombie until waited for: still readable
            family = [launcher, *launcher.children(recursive=True)]
            signal_processes(family, signal.SIGABRT)  # with PYTHONFAULTHANDLER=1 every Python process prints its stack
            psutil.wait_procs(family, timeout=10)
            signal_processes(family, signal.SIGKILL)
            proc.wait()
            returncode = f"timeout after {timeout}s"
        log.seek(0)
        output = log.read()
    assert returncode == 0, f"{' '.join(cmd)} failed ({returncode}):\n{output[-8000:]}"
    return output


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Golden-trajectory invariants: runs launched differently must compute the same numbers (tests named
# test_invariant_*, `pytest -k invariant` runs them alone).


def accelerate_command():
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    if not os.path.exists(accelerate):
        accelerate = shutil.which("accelerate")
    assert accelerate, "the accelerate command is not installed next to the python running the tests"
    return accelerate


def launch_fixed_rollouts(runs, num_processes=2, config_file=None, mixed_precision="no", env=None):
    """One `accelerate launch` of tests/fixed_rollout.py with num_processes CPU processes running each of `runs`,
    (script, flags, output_dir), one after the other on the fixed rollout (the same completions whatever the launch;
    with --vllm the engines sample and only the PATCHES apply); returns their run folders after checking the world
    size and the kind of launch each run got."""
    cmd = [accelerate_command(), "launch"]
    cmd += ["--config_file", config_file] if config_file else ["--multi_gpu", "--dynamo_backend", "no"]
    cmd += ["--num_processes", str(num_processes), "--num_machines", "1", "--mixed_precision", mixed_precision]
    cmd += ["--main_process_port", str(free_port()), os.path.join(REPO_ROOT, "tests", "fixed_rollout.py")]
    for i, (script, flags, _) in enumerate(runs):
        cmd += [*(["---"] if i else []), script, *flags]
    run_checked(cmd, env or subprocess_env(), timeout=300 + 150 * len(runs))
    run_dirs = []
    for _, _, output_dir in runs:
        run_dirs.append(only_run_dir(output_dir))
        with open(os.path.join(run_dirs[-1], "config.json")) as f:
            config = json.load(f)
        # --multi_gpu without Accelerator(cpu=True) starts unconnected rank-0 processes with no error, and cpu=True
        # under a DeepSpeed config silently runs DDP instead.
        assert config["args"]["world_size"] == num_processes
        assert config["distributed_type"] == ("DEEPSPEED" if config_file else "MULTI_CPU")
    return run_dirs


def launch_fixed_rollout(script, flags, output_dir, **launch):
    """launch_fixed_rollouts of one run: its run folder."""
    return launch_fixed_rollouts([(script, flags, output_dir)], **launch)[0]


def assert_same_trajectory(reference_dir, other_dir, keys, rel=1e-5, abs_=1e-7):
    """The logged metrics `keys` of every line agree (relative tolerance rel, absolute abs_), step by step."""
    reference, other = read_metrics(reference_dir), read_metrics(other_dir)
    assert [line["global_step"] for line in reference] == [line["global_step"] for line in other]
    compared = set()  # keys may name metrics of several modes (dpo/rloo, bt/prm): each run logs its own
    for ref_line, line in zip(reference, other):
        for key in keys:
            if key in ref_line or key in line:
                assert line[key] == pytest.approx(ref_line[key], rel=rel, abs=abs_), (line["global_step"], key)
                compared.add(key)
    # A renamed metric must not leave the comparison empty: a trajectory compared by its lr also compares a loss.
    assert compared and ("lr" not in keys or {"lr", "loss/"} <= {key[:5] for key in compared}), sorted(compared)


def assert_eval_ref_perplexity_is_worked_out_here(module, engine_class, args, model_dir, setattr_):
    """eval/ref_perplexity = the reference's perplexity (temperature 1, whatever --temperature) of the held-out
    completions, worked out here one sequence at a time (no padding) in float64, at step 0 and after an update (the
    reference stays). The run (args: total_steps 1, num_eval_prompts 4) samples from the fixed rollout, whose
    completions (1 to response_length tokens, half ending with EOS) make the mask matter; engine_class.generate (the
    script's sampler or generator) is wrapped to record the greedy (evaluation) calls."""
    import fixed_rollout
    from transformers import AutoModelForCausalLM

    fixed_rollout.patch(module, setattr_)
    original, records = engine_class.generate, []  # (prompt token ids, response token ids up to the mask's end)

    def generate(self, prompts, n, temperature):
        out = original(self, prompts, n, temperature)
        if temperature == 0.0:
            for prompt, response, row in zip(prompts, out[0].tolist(), out[1].tolist()):
                records.append((list(prompt), [t for t, m in zip(response, row) if m]))
        return out

    setattr_(engine_class, "generate", generate)
    lines = read_metrics(module.main(args))
    assert len(records) == 8 and [line["global_step"] for line in lines] == [0, 1]  # two evaluations of 4 prompts
    assert len({len(response) for _, response in records[:4]}) > 1  # responses of different lengths
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    for line, pairs in ((lines[0], records[:4]), (lines[-1], records[4:])):
        values = []
        for prompt, response in pairs:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0], -1)
            tokens = [logp[len(prompt) - 1 + j, token].item() for j, token in enumerate(response)]
            values.append(math.exp(-sum(tokens) / len(tokens)) if tokens else 1.0)
        assert line["eval/ref_perplexity"] == pytest.approx(sum(values) / len(values), rel=1e-4)


def assert_same_weights(reference_file, other_file, initial_file, rel=1e-4):
    """The trained weights agree: the difference of the two updates is at most `rel` of the update itself (Adam's
    first steps are close to lr * sign(g): a gradient entry at rounding-noise level may flip, so an absolute
    tolerance on single entries says less than the norm of the whole difference)."""
    from safetensors.torch import load_file

    reference, other, initial = load_file(reference_file), load_file(other_file), load_file(initial_file)
    for files in ((reference, other), (other, reference)):
        # A tied weight (lm_head = embed_tokens) may be saved once or twice; a second copy must be the first one.
        for name in set(files[1]) - set(files[0]):
            assert any(torch.equal(files[1][name], files[1][k]) for k in files[0]), f"{name} is saved by one run only"
    reference = {name: tensor for name, tensor in reference.items() if name in other}
    moved = diff = 0.0
    for name, tensor in reference.items():
        start = initial[name].double()
        moved += (tensor.double() - start).pow(2).sum().item()
        diff += (tensor.double() - other[name].double()).pow(2).sum().item()
    assert moved > 0, "the weights did not move: the comparison would not show anything"
    assert diff**0.5 <= rel * moved**0.5, f"|w_a - w_b| = {diff**0.5:.3e} against an update of {moved**0.5:.3e}"


@pytest.fixture
def bf16_autocast(monkeypatch):
    """In-process runs as `accelerate launch --mixed_precision bf16` starts them (accelerate autocasts the prepared
    model's forward); accelerate's state is a process-wide singleton, so it is reset before and after."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    yield
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    AcceleratorState._reset_state()


# Fault injection: a run killed (SIGKILL) at random points and resumed each time must end as the uninterrupted run.
