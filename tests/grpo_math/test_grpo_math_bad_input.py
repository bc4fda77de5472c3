"""Bad input stops grpo_math.main with one clear line naming the argument, before any model is loaded."""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
from conftest import GOOD_ROWS, REPO_ROOT, NoModelLoads, one_line_error, subprocess_env, write_rows, write_task

import grpo_math


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(grpo_math, "AutoModelForCausalLM", NoModelLoads)


def assert_one_line_error(args, *names):
    return one_line_error(grpo_math.main, args, *names)


def test_missing_model_path(make_args, no_model, tmp_path):
    assert_one_line_error(make_args(model_name_or_path=str(tmp_path / "no_such_model")), "--model_name_or_path")


def test_missing_model_path_relative(make_args, no_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = assert_one_line_error(make_args(model_name_or_path="assets/NoSuchModel"), "--model_name_or_path")
    assert "make assets" in message


def test_missing_model_path_that_looks_like_a_hub_id(make_args, no_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(make_args(model_name_or_path="models/smol"), "--model_name_or_path")


def test_missing_dataset_path(make_args, no_model, tmp_path):
    assert_one_line_error(make_args(dataset_path=str(tmp_path / "no_such_task")), "--dataset_path")


def test_missing_extra_eval_path(make_args, no_model, tmp_path):
    assert_one_line_error(make_args(extra_eval_path=str(tmp_path / "no_such_eval")), "--extra_eval_path")


def test_dataset_without_question_answer_columns(make_args, no_model, tmp_path):
    folder = tmp_path / "other_columns"
    folder.mkdir()
    for split in ("train", "test"):
        with open(folder / f"{split}.jsonl", "w") as f:
            for i in range(8):
                f.write(json.dumps({"problem": f"What is {i} + 1?", "solution": str(i + 1)}) + "\n")
    message = assert_one_line_error(make_args(dataset_path=str(folder)), "--question_column", "--answer_column")
    assert "problem" in message  # the columns the file does have
    # Naming the columns makes the same data usable (checked without loading a model: it fails only there).
    with pytest.raises(AssertionError, match="model loaded"):
        grpo_math.main(make_args(dataset_path=str(folder), question_column="problem", answer_column="solution"))


def test_extra_eval_set_without_the_columns(make_args, no_model, tmp_path):
    folder = tmp_path / "extra"
    folder.mkdir()
    with open(folder / "test.jsonl", "w") as f:
        f.write(json.dumps({"q": "1 + 1", "a": "2"}) + "\n")
    assert_one_line_error(make_args(extra_eval_path=str(folder)), "--extra_eval_path", "--question_column")


def test_empty_dataset(make_args, no_model, tmp_path):
    folder = write_task(tmp_path / "empty", num_train=0, num_test=4)
    assert_one_line_error(make_args(dataset_path=folder), "--dataset_path")


@pytest.mark.parametrize("num_generations", [1, 0])
def test_num_generations_below_two(make_args, no_model, num_generations):
    assert_one_line_error(make_args(num_generations=num_generations), "--num_generations")


def test_num_minibatches_must_divide_the_batch(make_args, no_model):
    # prompts_per_rank 2 * num_generations 4 = 8 completions: 3 minibatches do not divide it
    assert_one_line_error(make_args(num_minibatches=3), "--num_minibatches")


def test_micro_batch_size_must_divide_the_minibatch(make_args, no_model):
    assert_one_line_error(make_args(micro_batch_size=3), "--micro_batch_size")
    assert_one_line_error(make_args(num_minibatches=2, micro_batch_size=8), "--micro_batch_size")


@pytest.mark.parametrize(
    "name,value",
    [
        ("prompts_per_rank", 0),
        ("micro_batch_size", 0),
        ("num_minibatches", 0),
        ("num_iterations", 0),
        ("total_steps", 0),
        ("response_length", 0),
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("beta", -0.1),
        ("tis_cap", -1.0),
        ("mis_range", (2.0, 0.5)),
        ("mis_range", (-1.0, 2.0)),
        ("cispo_cap", 0.0),
        ("overlong_buffer", -1),
        ("overlong_buffer", 12),  # the fast settings' response_length: the penalty would start before any token
        ("clip_eps_low", 1.0),
        ("clip_eps_high", -0.1),
        ("prompt_template", "no placeholder"),
    ],
)
def test_out_of_range_values(make_args, no_model, name, value):
    assert_one_line_error(make_args(**{name: value}), f"--{name}")


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mis_level_without_mis_range_is_refused(make_args, no_model, level):
    """--mis_level sets the level of the ratio --mis_range masks; without a range it was silently ignored."""
    assert_one_line_error(make_args(mis_level=level), "--mis_level")
    ranged, plain = make_args(mis_range=(0.5, 2.0)), make_args()
    grpo_math.check_args(ranged)
    grpo_math.check_args(plain)
    assert ranged.mis_level == "token" and plain.mis_level is None  # a range alone masks at the token level


def test_prompts_longer_than_max_prompt_length(make_args, no_model):
    assert_one_line_error(make_args(max_prompt_length=4), "--max_prompt_length")


def test_tokenizer_without_chat_template_needs_prompt_template(make_args, no_model, model_without_chat_template):
    assert_one_line_error(make_args(model_name_or_path=model_without_chat_template), "--prompt_template")


@pytest.mark.slow
def test_prompt_template_replaces_the_chat_template(make_args, model_without_chat_template):
    args = make_args(
        model_name_or_path=model_without_chat_template, prompt_template="Question: {question}\nAnswer:", total_steps=1
    )
    run_dir = grpo_math.main(args)
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        prompt = json.loads(f.readline())["prompt"]
    assert prompt.startswith("Question: What is") and prompt.endswith("Answer:")


def test_resume_of_a_folder_that_is_not_a_run(make_args, no_model, tmp_path):
    (tmp_path / "not_a_run").mkdir()
    assert_one_line_error(make_args(resume=str(tmp_path / "not_a_run")), "--resume")
    assert_one_line_error(make_args(resume=str(tmp_path / "missing")), "--resume")


def test_resume_of_a_run_without_checkpoint(make_args, no_model, tmp_path):
    run_dir = tmp_path / "killed_early"
    run_dir.mkdir()
    saved = asdict(make_args())  # the computed fields as main() records them
    saved.update(world_size=1, batch_size=8, minibatch_size=8, gradient_accumulation_steps=2, run_name="killed_early")
    with open(run_dir / "config.json", "w") as f:
        json.dump({"args": saved, "git_sha": "", "vllm": False}, f)
    assert_one_line_error(make_args(resume=str(run_dir)), "--resume")


@pytest.mark.slow
def test_vllm_requested_but_not_importable_falls_back_to_hf_generate(make_args, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.warns(UserWarning, match="vLLM is not installed"):
        run_dir = grpo_math.main(make_args(vllm=True, total_steps=1))
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    assert config["vllm"] is False and config["args"]["vllm"] is True
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [line["global_step"] for line in lines] == [0, 1]
    assert "objective/logprob_gap" not in lines[1]


def run_cli(*flags):
    return subprocess.run(
        [sys.executable, "grpo_math.py", *flags],
        cwd=REPO_ROOT,
        env={**subprocess_env(), "COLUMNS": "250"},  # wide enough that no help line wraps
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    help_text = proc.stdout.replace("-", "_")  # tyro prints --num-generations; --num_generations works too
    for flag in ("--num_generations", "--loss_type", "--no-vllm", "--resume", "--scale_rewards", "--lora_r"):
        assert flag.replace("-", "_") in help_text, flag
    assert "completions per prompt" in proc.stdout  # the field docstrings are the help


def test_cli_rejects_an_unknown_choice():
    proc = run_cli("--loss_type", "sum")
    assert proc.returncode == 2
    output = (proc.stdout + proc.stderr).replace("-", "_")
    assert "__loss_type" in output and "token_mean" in output


# Faults a new user meets: each one stops the run with one line naming the file, line or argument.


def test_malformed_json_line_names_the_file_and_line(make_args, no_model, tmp_path):
    folder = write_rows(tmp_path / "task", GOOD_ROWS[:2] + ['{"question": "What is 1 + 1?", "answer": '] + GOOD_ROWS)
    message = assert_one_line_error(make_args(dataset_path=folder), "train.jsonl line 3", "not valid JSON")
    assert folder in message
    folder = write_rows(tmp_path / "lists", GOOD_ROWS[:4] + ['["What is 1 + 1?", "2"]'])
    assert_one_line_error(make_args(dataset_path=folder), "train.jsonl line 5", "not an object")


def test_answer_column_missing_from_some_rows(make_args, no_model, tmp_path):
    rows = GOOD_ROWS[:5] + [{"question": "What is 9 + 9?"}] + GOOD_ROWS[5:] + [{"question": "What is 1 + 9?"}]
    message = assert_one_line_error(make_args(dataset_path=write_rows(tmp_path / "task", rows)), "--answer_column")
    assert "answer (2 of 18 rows)" in message and "row 6" in message


@pytest.mark.parametrize("bad_gold", [None, "", "n/a"])
def test_gold_answers_the_verifier_cannot_check_are_refused_with_counts(make_args, no_model, tmp_path, bad_gold):
    rows = [{**row, "answer": bad_gold} for row in GOOD_ROWS]
    message = assert_one_line_error(make_args(dataset_path=write_rows(tmp_path / "task", rows)), "--answer_column")
    assert "16 of 16 gold answers" in message and "row 1" in message and "at most 10%" in message


def test_a_few_uncheckable_gold_answers_are_reported_not_refused(make_args, no_model, tmp_path):
    rows = [{**row, "answer": None} if i == 3 else row for i, row in enumerate(GOOD_ROWS)]  # 1 of 16 < 10%
    with pytest.warns(UserWarning, match="1 of 16 gold answers"), pytest.raises(AssertionError, match="model loaded"):
        grpo_math.main(make_args(dataset_path=write_rows(tmp_path / "task", rows, GOOD_ROWS)))


def test_a_null_gold_rewards_nothing():
    """A null gold used to become the string "None", which "Answer: None" matched: a reward the policy could hack."""
    for completion in ("Answer: None", "Answer: ", "None", ""):
        assert grpo_math.verify_answer(grpo_math.extract_answer(completion), grpo_math._gold_answer(None)) == 0.0
    assert grpo_math.verify_answer(grpo_math.extract_answer("Answer: 7"), grpo_math._gold_answer(7)) == 1.0


@pytest.mark.parametrize("question", [3, ["What", "is", "1 + 1?"], None, "  "])
def test_questions_that_are_not_text(make_args, no_model, tmp_path, question):
    rows = GOOD_ROWS[:7] + [{"question": question, "answer": "2"}] + GOOD_ROWS[7:]
    message = assert_one_line_error(make_args(dataset_path=write_rows(tmp_path / "task", rows)), "question")
    assert "1 of 17 rows" in message and "row 8" in message and "not text" in message


def test_embedded_defaults_load_from_another_working_directory(make_args, no_model, tmp_path, monkeypatch):
    """`cd ~ && python <repo>/grpo_math.py`: the assets/ defaults are found next to the script."""
    defaults = grpo_math.Config()
    if not os.path.isdir(os.path.join(REPO_ROOT, defaults.model_name_or_path)):
        pytest.skip("the embedded assets are not built (make assets)")
    monkeypatch.chdir(tmp_path)
    args = make_args(model_name_or_path=defaults.model_name_or_path, dataset_path=defaults.dataset_path)
    with pytest.raises(AssertionError, match="model loaded"):  # every check passed: it got as far as the model
        grpo_math.main(args)
    assert args.model_name_or_path == os.path.join(REPO_ROOT, defaults.model_name_or_path)


def test_no_eval_question_fits_max_prompt_length(make_args, no_model, tmp_path):
    long_rows = [{"question": "What is " + " + ".join(["1"] * 200) + "?", "answer": "200"} for _ in range(4)]
    folder = write_rows(tmp_path / "task", GOOD_ROWS, long_rows)
    message = assert_one_line_error(make_args(dataset_path=folder), "--max_prompt_length", "split test")
    assert "only 0 prompts fit" in message


def test_output_dir_that_is_a_file(make_args, no_model, tmp_path):
    (tmp_path / "a_file").write_text("")
    assert_one_line_error(make_args(output_dir=str(tmp_path / "a_file")), "--output_dir")


def test_hub_dataset_offline(make_args, no_model):
    message = assert_one_line_error(
        make_args(dataset_path="no-such-org/no-such-dataset"), "no-such-org/no-such-dataset"
    )
    assert "offline" in message


def test_hub_model_offline(make_args, no_model):
    message = assert_one_line_error(make_args(model_name_or_path="no-such-org/no-such-model"), "--model_name_or_path")
    assert "offline" in message and "cached" in message


def test_run_folders_are_never_shared(tmp_path):
    names = [grpo_math._new_run_folder(str(tmp_path / "runs"), "task__exp__1__1700000000") for _ in range(3)]
    assert names == ["task__exp__1__1700000000", "task__exp__1__1700000000_2", "task__exp__1__1700000000_3"]
    assert sorted(os.listdir(tmp_path / "runs")) == sorted(names)


def test_trackers_get_the_config(make_args, monkeypatch):
    """--track: wandb (a stand-in that records what accelerate's WandBTracker would get) receives the config's own
    values (tuples and None intact), the run name as id and name, resume="allow" and the run folder; TensorBoard's
    hparams, which take numbers and text only, get the rest as text; metrics go to both."""
    from accelerate import Accelerator

    calls = {}

    class RecordingWandB:
        name = "wandb"

        def __init__(self, project, **kwargs):
            calls["init"] = (project, kwargs)

        def start(self):
            pass

        def store_init_configuration(self, values):
            calls["config"] = values

        def log(self, values, step):
            calls.setdefault("log", []).append((step, values))

        def finish(self):
            calls["finished"] = True

    monkeypatch.setattr(grpo_math, "WandBTracker", RecordingWandB)
    args = make_args(track=True, wandb_tags=("a",), system_prompt=None)
    run = grpo_math.Run(args, Accelerator(cpu=True), grpo_math.RESUMABLE_ARGS)
    run.start({})
    run.log(0, {"eval/accuracy": 0.5})
    run.finish()
    project, kwargs = calls["init"]
    assert project == "cleanrlhf" and kwargs["id"] == kwargs["name"] == args.run_name and kwargs["resume"] == "allow"
    assert kwargs["dir"] == run.dir and kwargs["tags"][0] == "a"
    assert calls["config"]["lora_target_modules"] == ("all-linear",) and calls["config"]["system_prompt"] is None
    assert calls["log"] == [(0, {"eval/accuracy": 0.5})] and calls["finished"]
    (hparams,) = [os.path.join(d, f) for d, _, files in os.walk(run.dir) for f in files if f == "hparams.yml"]
    with open(hparams) as f:
        text = f.read()
    assert "lora_target_modules: ('all-linear',)" in text and "system_prompt: None" in text, text


def test_top_p_below_one_with_vllm(make_args, no_model):
    """vLLM's log-probs under --top_p < 1 are over the nucleus, the trainer's over the whole vocabulary (TIS)."""
    assert_one_line_error(make_args(vllm=True, top_p=0.9), "--top_p 0.9", "--no-vllm")
    with pytest.raises(AssertionError, match="model loaded"):  # HF generate: nothing compares log-probs
        grpo_math.main(make_args(vllm=False, top_p=0.9))


def test_vllm_sleep_needs_a_gpu(make_args, no_model):
    """vLLM's sleep mode is CUDA / ROCm / XPU only: refused on CPU before any model loads."""
    assert_one_line_error(make_args(vllm=True, vllm_sleep=True), "--vllm_sleep", "GPU")


def test_k1_is_not_offered_for_the_kl_in_the_loss():
    """k1's gradient has expectation zero under the policy's samples: in the loss it regularises nothing."""
    import tyro

    with pytest.raises(SystemExit):
        tyro.cli(grpo_math.Config, args=["--kl_estimator", "k1"])
    assert tyro.cli(grpo_math.Config, args=["--kl_estimator", "k2"]).kl_estimator == "k2"
