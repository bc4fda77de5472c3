"""Bad input stops ppo_rlhf.main with one clear line naming the argument, before any model is loaded."""

import functools

import pytest
from conftest import NoModelLoads, one_line_error, write_score_model_config, write_task
from transformers import AutoTokenizer

import ppo_rlhf


@pytest.fixture
def other_vocabulary_tokenizer(tiny_model_dir):
    """The policy's tokenizer with one token more: a model reading it would see other ids than the policy's."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.add_tokens(["<only_the_reward_model_knows>"]) == 1
    return tokenizer


@pytest.fixture
def args_for(make_config, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ppo_rlhf, "AutoModelForCausalLM", NoModelLoads)
    monkeypatch.setattr(ppo_rlhf, "AutoModelForSequenceClassification", NoModelLoads)
    reward_dir = write_score_model_config(tmp_path / "rm", tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    return functools.partial(make_config, ppo_rlhf, fast=False, reward_model_path=reward_dir)


def assert_one_line_error(args, *names):
    return one_line_error(ppo_rlhf.main, args, *names)


def test_value_model_is_checked_too(args_for, tiny_model_dir):
    assert_one_line_error(args_for(value_model_path=tiny_model_dir), "--value_model_path")


def test_value_model_with_another_vocabulary(args_for, other_vocabulary_tokenizer, tmp_path):
    folder = write_score_model_config(tmp_path / "other_vocab", tokenizer=other_vocabulary_tokenizer)
    assert_one_line_error(args_for(value_model_path=folder), "--value_model_path", "another vocabulary")


def test_dataset_without_the_prompt_column(args_for, tmp_path):
    folder = write_task(tmp_path / "task")
    assert_one_line_error(args_for(dataset_path=folder, question_column="prompt"), "--question_column", "question")


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(prompts_per_rank=6, num_minibatches=4), "--num_minibatches"),
        (dict(prompts_per_rank=8, num_minibatches=2, micro_batch_size=3), "--micro_batch_size"),
        (dict(temperature=0.0), "--temperature"),
        (dict(lam=1.5), "--lam"),
        (dict(kl_coef=-0.1), "--kl_coef"),
        (dict(tis_cap=-1.0), "--tis_cap"),
        (dict(prompt_template="no placeholder"), "--prompt_template"),
        (dict(model_name_or_path="assets/no-such-model"), "--model_name_or_path"),
    ],
)
def test_bad_numbers_and_paths(args_for, overrides, name):
    assert_one_line_error(args_for(**overrides), name)
