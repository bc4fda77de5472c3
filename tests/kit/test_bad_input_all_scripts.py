"""The faults of the shared data loading and run folder, tried on every script: one line naming the file, line or
argument, before any model is loaded. grpo_math.py has the same and more in test_grpo_math_bad_input.py."""

import functools
import json

import pytest
from conftest import GOOD_ROWS, NoModelLoads, one_line_error, write_rows, write_score_model_config

import async_rlhf
import dpo_online
import grpo_tools
import ppo_prm_clip
import ppo_rlhf
import reward_modeling

SCRIPTS = {
    "dpo_online": dpo_online,
    "ppo_rlhf": ppo_rlhf,
    "ppo_prm_clip": ppo_prm_clip,
    "async_rlhf": async_rlhf,
    "reward_modeling": reward_modeling,
    "grpo_tools": grpo_tools,
}


@pytest.fixture(params=sorted(SCRIPTS))
def script_args(request, make_config, monkeypatch):
    """(module, make(**overrides) -> its Config on the tiny models (make_config's, without the fast settings), with
    every model load failing)."""
    module = SCRIPTS[request.param]
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, NoModelLoads)
    values = dict(max_prompt_length=128) if module is reward_modeling else {}
    return module, functools.partial(make_config, module, fast=False, **values)


def test_malformed_json_line(script_args, tmp_path):
    module, make = script_args
    folder = write_rows(tmp_path / "task", GOOD_ROWS[:3] + ['{"question": "What is'] + GOOD_ROWS)
    one_line_error(module.main, make(dataset_path=folder), "train.jsonl line 4", "not valid JSON")


def test_column_missing_from_some_rows(script_args, tmp_path):
    module, make = script_args
    rows = GOOD_ROWS[:9] + [{"answer": "3"}] + GOOD_ROWS[9:]
    message = one_line_error(module.main, make(dataset_path=write_rows(tmp_path / "task", rows)), "--question_column")
    assert "1 of 17 rows" in message and "row 10" in message


def test_question_that_is_not_text(script_args, tmp_path):
    module, make = script_args
    rows = GOOD_ROWS[:5] + [{"question": ["What", "is", "2?"], "answer": "2"}] + GOOD_ROWS[5:]
    message = one_line_error(module.main, make(dataset_path=write_rows(tmp_path / "task", rows)), "question")
    assert "not text" in message and "row 6" in message


def test_no_eval_question_fits_max_prompt_length(script_args, tmp_path):
    module, make = script_args
    long_rows = [{"question": "What is " + " + ".join(["1"] * 200) + "?", "answer": "200"} for _ in range(4)]
    folder = write_rows(tmp_path / "task", GOOD_ROWS, long_rows)
    one_line_error(module.main, make(dataset_path=folder, max_prompt_length=128), "--max_prompt_length", "split test")


def test_output_dir_that_is_a_file(script_args, task_dir, tmp_path):
    module, make = script_args
    (tmp_path / "a_file").write_text("")
    one_line_error(module.main, make(dataset_path=task_dir, output_dir=str(tmp_path / "a_file")), "--output_dir")


def test_hub_dataset_offline(script_args):
    module, make = script_args
    message = one_line_error(
        module.main, make(dataset_path="no-such-org/no-such-dataset"), "no-such-org/no-such-dataset"
    )
    assert "offline" in message


def test_resume_of_a_run_folder_without_a_finished_checkpoint(script_args, task_dir, tmp_path):
    """A run killed before its first checkpoint was renamed (only step_N.tmp) has nothing to resume: one line."""
    module, make = script_args
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000001.tmp").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"args": {"run_name": "run"}}))
    one_line_error(
        module.main, make(dataset_path=task_dir, resume=str(run_dir)), str(run_dir), "no finished checkpoint"
    )


def test_top_p_below_one_with_vllm(script_args, task_dir):
    """vLLM's log-probs under --top_p < 1 are renormalised over the nucleus, the trainer's are not: the importance
    weights and the logprob gap would be off from the first token. Refused where they are compared."""
    module, make = script_args
    if module is reward_modeling:  # its sampled pairs are scored by the verifier only: nothing compares log-probs
        pytest.skip("reward_modeling compares no sampler log-probs")
    one_line_error(module.main, make(dataset_path=task_dir, vllm=True, top_p=0.9), "--top_p 0.9", "--no-vllm")
    with pytest.raises(AssertionError, match="model loaded"):  # HF generate: no log-probs compared, it goes on
        module.main(make(dataset_path=task_dir, vllm=False, top_p=0.9))


def test_vllm_sleep_needs_a_gpu(script_args, task_dir):
    """vLLM's sleep mode is CUDA / ROCm / XPU only (vllm/config/model.py raises once the engine starts to load):
    refused with one line before any model loads; with HF generate the flag has nothing to do and the run goes on."""
    module, make = script_args
    # async_rlhf generates while it learns; reward_modeling shuts its engine down
    if not hasattr(module.Config, "vllm_sleep"):
        pytest.skip(f"{module.__name__} has no colocated engine to put to sleep")
    one_line_error(module.main, make(dataset_path=task_dir, vllm=True, vllm_sleep=True), "--vllm_sleep", "GPU")
    with pytest.raises(AssertionError, match="model loaded"):
        module.main(make(dataset_path=task_dir, vllm=False, vllm_sleep=True))


# The reward model's checks, on the three scripts that read one (--reward_model_path): one line, before any load.

JUDGED = {"dpo_online": dpo_online, "ppo_rlhf": ppo_rlhf, "async_rlhf": async_rlhf}


@pytest.fixture(params=sorted(JUDGED))
def judged_args(request, make_config, tiny_model_dir, tmp_path, monkeypatch):
    """(module, make(**overrides) -> its Config judged by a reward model folder that looks loadable; every model
    load fails)."""
    from transformers import AutoTokenizer

    module = JUDGED[request.param]
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(module, name, NoModelLoads)
    reward_dir = write_score_model_config(tmp_path / "rm", tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    values = dict(fast=False, reward_model_path=reward_dir)
    values |= {"judge": "reward_model"} if hasattr(module.Config, "judge") else {}
    return module, functools.partial(make_config, module, **values)


def test_missing_reward_model_says_how_to_make_it(judged_args, tmp_path):
    module, make = judged_args
    message = one_line_error(module.main, make(reward_model_path=str(tmp_path / "nope")), "--reward_model_path")
    assert "python reward_modeling.py" in message
    assert "--judge verifier" in message or not hasattr(module.Config, "judge")  # the run without one


def test_default_reward_model_not_trained_yet(judged_args, tmp_path, monkeypatch):
    """The default, runs/reward_model, is relative and looks like a hub id ("org/name"): before
    `python reward_modeling.py` has made it, the run says so and does not try the hub."""
    module, make = judged_args
    monkeypatch.chdir(tmp_path)
    assert module.Config.reward_model_path == "runs/reward_model"
    message = one_line_error(module.main, make(reward_model_path="runs/reward_model"), "--reward_model_path")
    assert "runs/reward_model" in message and "python reward_modeling.py" in message


@pytest.mark.parametrize(
    "num_labels, architecture, words",
    [(2, "LlamaForSequenceClassification", "2 labels"), (1, "LlamaForCausalLM", "LlamaForCausalLM")],
)
def test_reward_model_that_is_not_a_one_label_classifier(judged_args, tmp_path, num_labels, architecture, words):
    module, make = judged_args
    folder = write_score_model_config(tmp_path / "other", num_labels, architecture)
    one_line_error(module.main, make(reward_model_path=folder), "--reward_model_path", words)


def test_reward_model_with_another_vocabulary(judged_args, tiny_model_dir, tmp_path):
    """A reward model whose tokenizer has one token more than the policy's would read the policy's token ids as other
    tokens: its scores garbage without any error."""
    from transformers import AutoTokenizer

    module, make = judged_args
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.add_tokens(["<only_the_judge_knows>"]) == 1
    folder = write_score_model_config(tmp_path / "other_vocab", tokenizer=tokenizer)
    one_line_error(module.main, make(reward_model_path=folder), "--reward_model_path", "another vocabulary")


def test_reward_model_without_a_tokenizer(judged_args, tmp_path):
    module, make = judged_args
    folder = write_score_model_config(tmp_path / "no_tokenizer")
    one_line_error(module.main, make(reward_model_path=folder), "--reward_model_path", "no loadable tokenizer")
