"""Bad input stops dpo_online.main with one clear line naming the argument, before any model is loaded."""

import functools
import json

import pytest
from conftest import NoModelLoads, one_line_error, write_score_model_config, write_task
from transformers import AutoTokenizer

import dpo_online


@pytest.fixture
def args_for(make_config, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(dpo_online, "AutoModelForCausalLM", NoModelLoads)
    monkeypatch.setattr(dpo_online, "AutoModelForSequenceClassification", NoModelLoads)
    reward_dir = write_score_model_config(tmp_path / "rm", tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    return functools.partial(make_config, dpo_online, fast=False, reward_model_path=reward_dir)


def assert_one_line_error(args, *names):
    return one_line_error(dpo_online.main, args, *names)


def test_verifier_judge_needs_no_reward_model(args_for, tmp_path):
    """With --judge verifier a missing reward model is no error: the run goes on to load the policy."""
    with pytest.raises(AssertionError, match="model loaded"):
        dpo_online.main(args_for(judge="verifier", reward_model_path=str(tmp_path / "nope")))


def test_verifier_judge_on_a_dataset_without_answers(args_for, tmp_path):
    folder = tmp_path / "no_answers"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps({"question": "Say hi."}) + "\n")
    assert_one_line_error(args_for(judge="verifier", dataset_path=str(folder)), "--judge verifier", "--answer_column")


def test_dataset_without_the_prompt_column(args_for, tmp_path):
    folder = write_task(tmp_path / "task")
    assert_one_line_error(args_for(dataset_path=folder, question_column="prompt"), "--question_column", "question")


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(beta=0.0), "--beta"),
        (dict(beta=-0.1, loss_type="ipo"), "--beta"),
        (dict(prompts_per_rank=6, num_minibatches=4), "--num_minibatches"),
        (dict(prompts_per_rank=8, num_minibatches=2, micro_batch_size=3), "--micro_batch_size"),
        (dict(prompts_per_rank=0), "--prompts_per_rank"),
        (dict(temperature=0.0), "--temperature"),
        (dict(top_p=1.5), "--top_p"),
        (dict(tis_cap=-1.0), "--tis_cap"),
        (dict(prompt_template="no placeholder"), "--prompt_template"),
        (dict(model_name_or_path="assets/no-such-model"), "--model_name_or_path"),
        (dict(keep_checkpoints=0), "--keep_checkpoints"),
    ],
)
def test_bad_numbers_and_paths(args_for, overrides, name):
    assert_one_line_error(args_for(**overrides), name)


def test_resume_refuses_changed_args(args_for, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.json").write_text('{"global_step": 2, "episode": 16}')
    saved = dict(vars(args_for()), run_name="r", world_size=1, minibatch_size=8, gradient_accumulation_steps=2)
    (run / "config.json").write_text(json.dumps({"args": saved, "git_sha": "", "vllm": False}))
    assert_one_line_error(args_for(resume=str(run), beta=0.5), "--beta", "0.5", "0.1")
