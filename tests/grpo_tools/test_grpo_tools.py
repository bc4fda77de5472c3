"""grpo_tools.py: the calculator against a reference written here and on bad input, the multi-turn rollout and its
loss mask, the trainer's log-probs against a plain per-trajectory forward, and runs on the tiny model (on-policy
ratio 1, KL 0, accumulation = one micro-batch, 2 processes = 1) with a scripted policy (tests/fixed_rollout.py)."""

import decimal
import functools
import inspect
import json
import math
import os
import random
import re
import sys
from fractions import Fraction

import fixed_rollout
import pytest
import torch
from conftest import (
    FAST,
    REPO_ROOT,
    SMOLLM2_DIR,
    NoModelLoads,
    accelerate_command,
    fast_cli_flags,
    free_port,
    one_line_error,
    read_metrics,
    require_vllm,
    run_checked,
    subprocess_env,
    write_rows,
)

import grpo_tools
from grpo_tools import CALL, RESULT, calculator, multi_turn_rollout, tool_call

CALC_END = (CALL[1],)  # --tool_format calc's turns end once a token completes a call


def calc(tokenizer, make_environment=grpo_tools.Calculator, **kwargs):
    """--tool_format calc: the <calc> format of ToolCalls, over a fresh make_environment() per trajectory."""
    return grpo_tools.ToolCalls(tokenizer, make_environment, call_format="calc", **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# The calculator


def random_expression(rng, depth=0):
    """An arithmetic expression in the calculator's grammar: numbers (integers, decimals), + - * / ^ **, signs,
    parentheses, spaces here and there."""
    if depth > 3 or rng.random() < 0.3:
        number = str(rng.randint(0, 999)) if rng.random() < 0.8 else f"{rng.randint(0, 99)}.{rng.randint(0, 99)}"
        return ("-" if rng.random() < 0.15 else "") + number
    kind = rng.random()
    if kind < 0.15:
        return f"({random_expression(rng, depth + 1)})"
    if kind < 0.25:
        return f"({random_expression(rng, depth + 1)}){rng.choice(['^', '**'])}{rng.randint(0, 3)}"  # no towers
    op = rng.choice(["+", "-", "*", "/"])
    space = " " if rng.random() < 0.5 else ""
    return f"{random_expression(rng, depth + 1)}{space}{op}{space}{random_expression(rng, depth + 1)}"


def reference_value(expression):
    """The value by Python's own arithmetic on exact Fractions (an independent evaluator: the test builds the
    expression, so evaluating it is safe here), or None on a division by zero."""
    exact = re.sub(r"\d+(?:\.\d*)?", lambda m: f"Fraction('{m.group(0)}')", expression.replace("^", "**"))
    try:
        return eval(exact, {"Fraction": Fraction})  # noqa: S307
    except ZeroDivisionError:
        return None


def reference_text(value):
    """The calculator's format worked out here with decimal arithmetic: rounded to 6 decimals (half to even), no
    trailing zeros, no decimal point for an integer."""
    with decimal.localcontext(decimal.Context(prec=80)):
        exact = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
        text = f"{exact.quantize(decimal.Decimal('0.000001'), rounding=decimal.ROUND_HALF_EVEN):f}"
    text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def test_calculator_against_python_arithmetic_on_random_expressions():
    rng, checked = random.Random(0), 0
    for _ in range(2000):
        expression = random_expression(rng)
        value, got = reference_value(expression), calculator(expression)
        if value is None:
            assert got == "error: division by zero", expression
            continue
        expected = reference_text(value)
        if len(expected) > 24:
            assert got == "error: result too long", expression
            continue
        assert got == expected, (expression, value)
        checked += 1
    assert checked > 1500
    # Precedence and associativity the way arithmetic has them (as Python's ** does).
    for expression, expected in [("-2^2", "-4"), ("2^3^2", "512"), ("2^-1", "0.5"), ("(2+3)*4", "20"), ("7/2", "3.5"),
                                 ("1/3", "0.333333"), ("2 ** 10", "1024"), ("-(3 - 5)", "2"), ("10 - 4 - 3", "3"),
                                 ("874 * 404", "353096"), (" 12 ", "12"), ("0.1 + 0.2", "0.3")]:  # fmt: skip
        assert calculator(expression) == expected, expression


@pytest.mark.parametrize(
    "expression, message",
    [
        ("", "empty expression"),
        ("3 +", "incomplete expression"),
        ("(1 + 2", "missing )"),
        ("1 + 2)", "unexpected )"),
        ("2 ** * 3", "unexpected *"),
        ("12 x 4", "unexpected 'x 4'"),
        ("1/0", "division by zero"),
        ("1/(2-2)", "division by zero"),
        ("0^-1", "division by zero"),
        ("2^0.5", "only whole powers"),
        ("9^99999", "power too large"),
        ("10^10^10", "power too large"),
        ("99999999999 * 99999999999 * 99999", "result too long"),
        ("(" * 40 + "1" + ")" * 40, "too many parentheses"),
        ("1+" * 150 + "1", "expression longer than 200 characters"),
        ("__import__('os').system('touch /tmp/pwned')", "unexpected"),
        ("1; import os", "unexpected"),
        ("open('/etc/passwd').read()", "unexpected"),
        ("lambda: 1", "unexpected"),
        ("1e400", "unexpected"),
        ("\u0661 + 1", "unexpected"),  # an Arabic-Indic digit: \d would match it, int() would read it
        ("*".join(["10^200"] * 22), "number too large"),  # 4400 digits: Python's str() of it would raise
        ("(" + "*".join(["10^200"] * 25) + ")^2", "number too large"),
    ],
)
def test_calculator_returns_a_short_error_and_never_raises(expression, message):
    out = calculator(expression)
    assert out.startswith("error: ") and message in out and len(out) < 80, out
    assert not os.path.exists("/tmp/pwned")


def test_tool_call_reads_the_expression_a_turn_ends_with():
    assert tool_call("Let me compute. <calc>12 * 34</calc>") == "12 * 34"
    assert tool_call("<calc>1</calc> then <calc>2 + 3</calc>") == "1"  # a turn ends at its first CALL[1]
    assert tool_call("x <calc>a <calc>5*5</calc><") == "5*5"  # the last CALL[0] before it; overhang after
    assert tool_call("no opening tag</calc>") == ""  # malformed: the calculator answers "empty expression"
    assert tool_call("Answer: 12") is None and tool_call("<calc>12 * 3") is None


# ---------------------------------------------------------------------------------------------------------------
# The rollout and its loss mask


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def scripted_turns(tokenizer, script):
    """A policy_turn that writes script[(row, turn)] for each context (row: the index of the trajectory, found from
    its prompt; turn: how many turns it has had), recording every context it was given."""
    seen, counts = [], {}

    def policy_turn(contexts, max_tokens):
        out = []
        for context, limit in zip(contexts, max_tokens):
            row = context[0]  # each test prompt starts with its own id
            turn = counts.get(row, 0)
            counts[row] = turn + 1
            seen.append((row, turn, list(context), limit))
            ids = tokenizer(script[(row, turn)], add_special_tokens=False).input_ids
            if script[(row, turn)].endswith("<eos>"):
                ids = tokenizer(script[(row, turn)][:-5], add_special_tokens=False).input_ids + [
                    tokenizer.eos_token_id
                ]
            out.append((ids[:limit], [-0.5 - 0.01 * k for k in range(len(ids[:limit]))]))
        return out

    return policy_turn, seen


def test_rollout_appends_tool_output_as_context_and_masks_it_out_of_the_loss(tokenizer):
    """Three trajectories: two calls with results of different lengths, then an answer; a malformed call; calls past
    max_turns. The ids are the turns and the tool outputs back to back, each turn is given exactly the prompt and
    everything before it (token in, token out), and the loss mask is 1 on the policy's tokens only."""
    prompts = [[900, 901], [902, 903, 904], [905]]
    script = {
        (900, 0): "First <calc>12 * 34</calc>",
        (900, 1): "then <calc>(408 + 2)/4</calc>",
        (900, 2): "Answer: 102.5<eos>",
        (902, 0): "<calc>1 +</calc>",
        (902, 1): "Answer: 7<eos>",
        (905, 0): "<calc>2^10</calc><",  # a last token that runs on into the tool's text: "<" is not repeated
        (905, 1): "<calc>3</calc>",
        (905, 2): "<calc>4</calc>",  # the third call: max_turns is 2, so it is not run
    }
    policy_turn, seen = scripted_turns(tokenizer, script)
    rollout = multi_turn_rollout(
        policy_turn, tokenizer, prompts, 1, response_length=64, max_turns=2, stop_ids=(), tools=calc(tokenizer)
    )

    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    def tool(text):
        return enc(f"{RESULT[0]}{text}{RESULT[1]}")

    eos = [tokenizer.eos_token_id]
    expected = {
        0: [(enc("First <calc>12 * 34</calc>"), 1), (tool("408"), 0), (enc("then <calc>(408 + 2)/4</calc>"), 1),
            (tool("102.5"), 0), (enc("Answer: 102.5") + eos, 1)],
        1: [(enc("<calc>1 +</calc>"), 1), (tool("error: incomplete expression"), 0), (enc("Answer: 7") + eos, 1)],
        2: [(enc("<calc>2^10</calc><"), 1), (enc("result>1024</result>"), 0), (enc("<calc>3</calc>"), 1),
            (tool("3"), 0), (enc("<calc>4</calc>"), 1)],
    }  # fmt: skip
    for i, parts in expected.items():
        ids = [t for part, _ in parts for t in part]
        policy = [p for part, p in parts for _ in part]
        n = len(ids)
        assert rollout.ids[i, :n].tolist() == ids and (rollout.ids[i, n:] == tokenizer.pad_token_id).all()
        assert rollout.policy[i].tolist() == policy + [0] * (64 - n)
        assert rollout.real[i].tolist() == [1] * n + [0] * (64 - n)
        # The sampler's log-probs sit on the policy's tokens, 0 on the tool's.
        logps = rollout.sampler_logprobs[i, :n]
        assert (logps[torch.tensor(policy) == 0] == 0).all() and (logps[torch.tensor(policy) == 1] < 0).all()
    # Every turn was given its prompt and the trajectory so far, as ids, and the budget left.
    for row, turn, context, limit in seen:
        i = {900: 0, 902: 1, 905: 2}[row]
        before = [t for part, _ in expected[i][: 2 * turn] for t in part]
        assert context == prompts[i] + before and limit == 64 - len(before)
    assert rollout.calls == [
        [("12 * 34", "408"), ("(408 + 2)/4", "102.5")],
        [("1 +", "error: incomplete expression")],
        [("2^10", "1024"), ("3", "3")],
    ]
    assert rollout.turns == [3, 2, 3]
    assert rollout.answers == ["Answer: 102.5", "Answer: 7", ""]  # a call that is not run is no answer
    assert rollout.unrun_calls == [0, 0, 1] and rollout.truncated.tolist() == [False] * 3  # counted, not cut
    assert rollout.texts[0].startswith("First <calc>12 * 34</calc><result>408</result>then")
    assert rollout.texts[2].startswith("<calc>2^10</calc><result>1024</result><calc>3</calc>")


def test_rollout_stops_at_the_budget_and_cuts_a_tool_output_that_does_not_fit(tokenizer):
    """A trajectory is at most response_length tokens: a tool output is cut to the room left (recorded whole, as the
    tool answered), a call that uses the last token is not run, and a trajectory with no room left ends; the n
    trajectories of a prompt are consecutive."""

    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    long_call, short_call = enc("<calc>123456 * 654321</calc>"), enc("<calc>2 * 3</calc>")
    budget = len(long_call) + 3
    turns = {900: long_call, 901: short_call + enc(" x") * (budget - len(short_call))}  # the second fills the budget

    def policy_turn(contexts, max_tokens):
        return [(turns[context[0]][:m], None) for context, m in zip(contexts, max_tokens)]

    rollout = multi_turn_rollout(
        policy_turn,
        tokenizer,
        [[900], [901]],
        2,
        response_length=budget,
        max_turns=3,
        stop_ids=(),
        tools=calc(tokenizer),
    )
    assert rollout.sampler_logprobs is None and rollout.turns == [1, 1, 1, 1]
    for i in (0, 1):  # the long call, its output cut to 3 tokens
        assert rollout.ids[i, : len(long_call)].tolist() == long_call and rollout.real[i].sum() == budget
        assert rollout.policy[i].tolist() == [1] * len(long_call) + [0] * 3
        assert rollout.calls[i] == [("123456 * 654321", "80779853376")] and rollout.answers[i] == ""
    for i in (2, 3):  # a turn that ends the budget: its call (if any) is not run
        assert rollout.policy[i].tolist() == [1] * budget and rollout.calls[i] == []
    assert rollout.unrun_calls == [0, 0, 1, 1] and rollout.truncated.tolist() == [True] * 4


def test_a_turn_cut_inside_a_call_holds_no_answer_and_cut_trajectories_are_flagged(tokenizer):
    """A turn cut by the budget inside a call ("<calc>874 * 40") is no answer (it would read 40). A trajectory is
    truncated when it ends at the budget other than by a stop token: an answer that ends with EOS on the last token
    is not, one cut before its EOS is."""

    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    eos = tokenizer.eos_token_id
    budget = len(enc("<calc>874 * 40"))
    answer = enc("Answer: 40") + enc(" ok") * budget
    turns = {900: enc("<calc>874 * 40") + enc(" * 2</calc>"), 901: answer[: budget - 1] + [eos], 902: answer}

    def policy_turn(contexts, max_tokens):
        return [(turns[context[0]][:m], None) for context, m in zip(contexts, max_tokens)]

    rollout = multi_turn_rollout(policy_turn, tokenizer, [[900], [901], [902]], 1, budget, 3, [eos], calc(tokenizer))
    assert rollout.answers[0] == "" and rollout.answers[2].startswith("Answer: 40")
    rewards, correct, _ = grpo_tools.compute_rewards(rollout.answers, ["40"] * 3, 0.0)
    assert correct.tolist() == [0.0, 1.0, 1.0]
    assert rollout.truncated.tolist() == [True, False, True] and rollout.unrun_calls == [0, 0, 0]


def test_evaluate_counts_a_trajectory_ended_by_eos_at_the_budget_as_finished(tokenizer):
    """Evaluate ran multi_turn_rollout without the sampler's stop ids, so a greedy answer whose EOS falls on
    the budget's last token was counted cut. Of two held-out trajectories, one ends with EOS on the last token, one is
    cut before its EOS: eval/truncated is 0.5 (the first was counted truncated before)."""
    import contextlib
    from types import SimpleNamespace

    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    eos, budget = tokenizer.eos_token_id, 8
    answer = enc("Answer: 40") + enc(" ok") * budget
    turns = {901: answer[: budget - 1] + [eos], 902: answer}
    sampler = SimpleNamespace(
        turn=lambda contexts, max_tokens, temperature, stop_strings: [
            (turns[c[0]][:m], None) for c, m in zip(contexts, max_tokens)
        ],
        awake=contextlib.nullcontext,
        stop_ids=[eos],
    )
    accelerator = SimpleNamespace(
        process_index=0, num_processes=1, device=torch.device("cpu"), reduce=lambda tensor, reduction: tensor
    )
    args = SimpleNamespace(
        tool="calculator", max_operations=0, response_length=budget, max_turns=2, format_reward=0.0,
        num_samples_logged=0,
    )  # fmt: skip
    sets = {"eval": ([[901], [902]], ["40", "40"])}
    tools = calc(tokenizer, score=grpo_tools.compute_rewards)
    results, _ = grpo_tools.evaluate(sampler, sets, args, accelerator, tokenizer, tools, 0)
    assert results["eval/truncated"] == 0.5 and results["eval/accuracy"] == 1.0 and results["eval/call_rate"] == 0.0


@pytest.mark.parametrize("run_on", ["></", ">>", ">.", ">,", ">)", '>"'])
def test_a_closing_token_that_runs_on_past_the_call_leaves_the_turn(tokenizer, run_on):
    """SmolLM2 has single tokens that complete "</calc>" and run on into other text: "></", ">>", ">.", ... The
    context must read "</calc><result>...", as the prompt's example shows (never "</calc></<result>"): the turn
    ends before that token (it is not a policy token: the conversation never holds it, so nothing trains it) and
    the tool's tokens begin with the ">" it did not keep. The trajectory's ids are then the example's own
    tokenisation of the text, the next turn is given exactly them, and the sampler's log-probs stay aligned."""

    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    written = "First <calc>12 * 34</calc" + run_on  # its last token completes "</calc>" and runs on
    assert tokenizer.decode(enc(written)[-1:]) == run_on and enc(written)[:-1] == enc("First <calc>12 * 34</calc")
    policy_turn, seen = scripted_turns(tokenizer, {(900, 0): written, (900, 1): "Answer: 408<eos>"})
    rollout = multi_turn_rollout(
        policy_turn, tokenizer, [[900]], 1, response_length=40, max_turns=2, stop_ids=(), tools=calc(tokenizer)
    )
    turn, tool = enc(written)[:-1], enc("><result>408</result>")  # the tool writes the call's last ">"
    n = len(turn) + len(tool) + len(enc("Answer: 408")) + 1
    assert rollout.texts[0] == "First <calc>12 * 34</calc><result>408</result>Answer: 408"
    assert rollout.ids[0, :n].tolist() == enc(rollout.texts[0]) + [tokenizer.eos_token_id]  # as if written out
    assert rollout.ids[0, : len(turn) + len(tool)].tolist() == turn + tool
    assert rollout.policy[0, :n].tolist() == [1] * len(turn) + [0] * len(tool) + [1] * (n - len(turn) - len(tool))
    assert seen[1][2] == [900] + turn + tool  # the next turn's context: the kept ids, the dropped token nowhere
    logps = rollout.sampler_logprobs[0]
    assert logps[: len(turn)].tolist() == pytest.approx([-0.5 - 0.01 * k for k in range(len(turn))])
    assert (logps[len(turn) : len(turn) + len(tool)] == 0).all() and rollout.calls == [[("12 * 34", "408")]]


def test_trajectory_metrics_count_calls_failures_copies_and_accuracy_by_call(tokenizer):
    Rollout = grpo_tools.Rollout
    rollout = Rollout(
        ids=None,
        real=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float),
        policy=torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0], [1, 0, 0, 1], [1, 0, 0, 0]], dtype=torch.float),
        sampler_logprobs=None,
        texts=None,
        answers=["Answer: 408", "Answer: 5", "Answer: 9", "Answer: 3"],
        calls=[[("12*34", "408")], [], [("1/0", "error: division by zero"), ("3*3", "9")], []],
        turns=[2, 1, 3, 1],
        unrun_calls=[1, 0, 0, 1],
        truncated=torch.tensor([False, False, True, False]),
        failed_calls=[0, 0, 1, 0],  # as the format reports them (multi_turn_rollout), not read from the outputs
    )
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0])
    m = grpo_tools.trajectory_metrics(correct, correct, torch.ones(4), rollout, 2)
    assert m["tools/calls"] == 0.75 and m["tools/call_rate"] == 0.5 and m["tools/failed_calls"] == pytest.approx(1 / 3)
    assert m["tools/unrun_calls"] == 0.5 and m["tools/truncated"] == 0.25  # the calls not run are counted apart
    assert m["tools/multi_call_rate"] == 0.25  # two calls or more (chains)
    assert m["tools/answer_copies_result"] == 1.0 and m["tools/turns"] == 1.75
    assert m["objective/accuracy_with_call"] == 0.5 and m["objective/accuracy_without_call"] == 0.5
    assert m["tools/policy_tokens"] == 1.75 and m["tools/tool_tokens"] == 0.75
    assert m["objective/zero_std_groups"] == 0.0
    m = grpo_tools.trajectory_metrics(correct, correct, torch.ones(4), rollout._replace(calls=[[]] * 4), 2)
    assert math.isnan(m["tools/failed_calls"]) and math.isnan(m["objective/accuracy_with_call"])


# ---------------------------------------------------------------------------------------------------------------
# The trainer's log-probs: on the ids the sampler saw


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_trainer_logprobs_of_policy_tokens_equal_a_plain_forward_of_each_trajectory(
    tiny_model_dir, tokenizer, shared_prompt
):
    """The batch the trainer builds (prompts left-padded, trajectories with tool outputs of different lengths
    right-padded) gives each policy token the log-prob a plain forward of that trajectory alone, unpadded, gives it:
    the tool tokens are context at their own positions, and the loss mask picks the policy's tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[900, 17, 18, 19, 20], [902, 21]]
    script = {
        (900, 0): "A <calc>7 * 8</calc>", (900, 1): "B <calc>123456789 * 3</calc>", (900, 2): "Answer: 1<eos>",
        (902, 0): "<calc>2^3</calc>", (902, 1): "x y z Answer: 8<eos>",
    }  # fmt: skip
    policy_turn, _ = scripted_turns(tokenizer, script)
    rollout = multi_turn_rollout(
        policy_turn, tokenizer, prompts, 1, response_length=48, max_turns=3, stop_ids=(), tools=calc(tokenizer)
    )
    query_responses, attention_mask, real, _, P = grpo_tools.training_batch(
        prompts, 1, rollout.ids, rollout.real, None, tokenizer.pad_token_id, "cpu"
    )
    mask = rollout.policy[:, : real.shape[1]]
    fn = (
        functools.partial(grpo_tools.response_logprobs, packed=grpo_tools.shared_prompt_logits)
        if shared_prompt
        else grpo_tools.response_logprobs
    )
    with torch.no_grad():
        logprobs, _ = fn(model, query_responses, attention_mask, P, 0.7)
        for i, prompt in enumerate(prompts):
            n = int(rollout.real[i].sum())
            sequence = torch.tensor([prompt + rollout.ids[i, :n].tolist()])
            logits = model(sequence).logits[0, len(prompt) - 1 : -1].double() / 0.7
            expected = torch.log_softmax(logits, -1).gather(1, sequence[0, len(prompt) :, None]).squeeze(1)
            policy = mask[i, :n] > 0
            assert policy.sum() > 0 and (~policy).sum() > 0
            torch.testing.assert_close(logprobs[i, :n][policy].double(), expected[policy], rtol=0, atol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# Runs on the tiny model with the scripted policy


# --tool_format native: its prompts hold the tools' schemas (~350 tokens), its calls are JSON (~25 tokens).
def scripted_run(monkeypatch, make_config, **overrides):
    fixed_rollout.patch(grpo_tools, monkeypatch.setattr)
    return grpo_tools.main(make_config(grpo_tools, **overrides))


@pytest.mark.slow
def test_run_is_on_policy_with_kl_zero_and_logs_the_tool_metrics(make_config, monkeypatch, tmp_path):
    """The scripted policy calls the calculator (results of different lengths, failed calls) and answers. With the
    batch reused (2 passes of 2 minibatches) every step's first minibatch has ratio 1 and approxkl 0 and the later
    ones do not; with one minibatch the KL to the reference is exactly 0 on the first step (no update yet) and not
    after. The tool metrics and the held-out call rate are logged, the tool's example is in every prompt."""
    reuse = dict(num_minibatches=2, micro_batch_size=2, num_iterations=2, output_dir=str(tmp_path / "a"))
    reused = scripted_run(monkeypatch, make_config, total_steps=3, beta=0.04, learning_rate=1e-3, **reuse)
    lines = read_metrics(reused)
    assert [line["global_step"] for line in lines] == [0, 1, 2, 3]
    assert {"eval/accuracy", "eval/call_rate", "eval/accuracy_with_call"} <= set(lines[0])
    for line in lines[1:]:
        assert line["policy/ratio_first_minibatch"] == 1.0 and line["policy/approxkl_first_minibatch"] == 0.0
        assert line["tools/calls"] > 0 and line["tools/tool_tokens"] > 0 and line["tools/policy_tokens"] > 0
        assert 0 <= line["tools/failed_calls"] <= 1 and 1 <= line["tools/turns"] <= 3
    assert max(line["policy/approxkl"] for line in lines[1:]) > 0
    with open(os.path.join(reused, "samples.jsonl")) as f:
        assert all(CALL[0] in json.loads(line)["prompt"] for line in f)  # the tool's example is in every prompt
    lines = read_metrics(scripted_run(monkeypatch, make_config, beta=0.04, learning_rate=1e-3,
                                      output_dir=str(tmp_path / "b")))  # fmt: skip
    assert lines[1]["objective/kl"] == 0.0 and lines[2]["objective/kl"] != 0.0


def strip_flags(flags, *names):
    """flags without --name value pairs (conftest's fast_cli_flags carry FAST["grpo_math"])."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag.lstrip("-").replace("-", "_") in names:
            skip = True
            continue
        out.append(flag)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The samplers on the embedded model, which calls the calculator when shown how


@pytest.fixture(scope="module")
def smollm_prompts():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    args = grpo_tools.Config()
    grpo_tools.check_args(args)  # calc's system prompt and example
    rows = [{"question": f"Calculate {a} * {b}.", "answer": str(a * b)} for a, b in [(874, 404), (57, 912), (36, 41)]]
    prompts, _ = grpo_tools._build_prompts(tokenizer, rows, args, args.examples)
    return tokenizer, prompts


def check_turns_end_at_their_call(tokenizer, rollout):
    """Every executed call's turn ends with the token that completed CALL[1] (nothing generated after it), or the
    token before it when that one ran on into other text, and CALL[1] is followed by RESULT[0], nothing between."""
    assert sum(len(c) for c in rollout.calls) > 0, rollout.texts
    for i, calls in enumerate(rollout.calls):
        ids, policy, real = rollout.ids[i].tolist(), rollout.policy[i].tolist(), rollout.real[i].tolist()
        starts = [k for k in range(1, len(ids)) if policy[k - 1] == 1 and policy[k] == 0 and real[k]]  # tool output
        assert len(starts) == len(calls)
        for k in starts:
            turn_start = max([j for j in range(k) if j == 0 or policy[j - 1] == 0])
            text, after = tokenizer.decode(ids[turn_start:k]), tokenizer.decode(ids[turn_start:])
            assert CALL[1] not in tokenizer.decode(ids[turn_start : k - 1]), text
            assert after.split(CALL[1], 1)[1].startswith(RESULT[0]), after
        assert CALL[1] + "<" + RESULT[0] not in rollout.texts[i]  # the tool's text continues the call's last token
        complete = sum(output == calculator(expression) for expression, output in calls)  # not cut by the budget
        assert rollout.texts[i].count(RESULT[0]) >= complete, rollout.texts[i]


@pytest.mark.slow
def test_hf_turns_stop_at_the_call_on_the_embedded_model(smollm_prompts):
    from transformers import AutoModelForCausalLM

    tokenizer, prompts = smollm_prompts
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()
    stop_ids = grpo_tools._stop_token_ids(tokenizer, SMOLLM2_DIR)
    torch.manual_seed(0)

    def turn(contexts, max_tokens):
        return grpo_tools._hf_turns(
            model, tokenizer, contexts, max_tokens, 1.0, 1.0, tokenizer.pad_token_id, stop_ids, CALC_END
        )

    rollout = multi_turn_rollout(
        turn, tokenizer, prompts, 2, response_length=48, max_turns=2, stop_ids=(), tools=calc(tokenizer)
    )
    check_turns_end_at_their_call(tokenizer, rollout)


@pytest.mark.slow
def test_vllm_turns_stop_at_the_call_and_their_logprobs_are_the_trainers(smollm_prompts, tmp_path, monkeypatch):
    """vLLM's turns on the embedded model: calls are run, each turn ends at its call, and the sampler's log-probs of
    the policy's tokens are the trainer's (within vLLM's CPU float32 kernels) on the batch the trainer builds."""
    require_vllm()
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    tokenizer, prompts = smollm_prompts
    args = grpo_tools.Config(vllm=True, seed=1)
    llm = grpo_tools._start_vllm(args, SMOLLM2_DIR, 0, 1, sorted(os.sched_getaffinity(0)))
    stop_ids = grpo_tools._stop_token_ids(tokenizer, SMOLLM2_DIR)
    try:

        def turn(contexts, max_tokens):
            return grpo_tools._vllm_turns(llm, tokenizer, contexts, max_tokens, 1.0, 1.0, stop_ids, CALC_END)

        rollout = multi_turn_rollout(
            turn, tokenizer, prompts, 4, response_length=48, max_turns=2, stop_ids=(), tools=calc(tokenizer)
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    check_turns_end_at_their_call(tokenizer, rollout)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()
    query_responses, attention_mask, real, sampler_logprobs, P = grpo_tools.training_batch(
        prompts, 4, rollout.ids, rollout.real, rollout.sampler_logprobs, tokenizer.pad_token_id, "cpu"
    )
    mask = rollout.policy[:, : real.shape[1]] > 0
    with torch.no_grad():
        logprobs, _ = grpo_tools.response_logprobs(model, query_responses, attention_mask, P, 1.0)
    gap = (logprobs - sampler_logprobs).abs()[mask]
    assert gap.mean() < 1e-3 and gap.max() < 0.05, (gap.mean(), gap.max())


# ---------------------------------------------------------------------------------------------------------------
# The loss: a plain loop in float64


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean"])
def test_trajectory_loss_against_a_plain_loop_over_the_policy_tokens(loss_type):
    """The loss and its statistics worked out token by token in float64, surrogate, truncated IS, KL and entropy
    bonus: only the tokens the mask keeps (the policy's) count. A tool token's values change nothing, not even
    ones whose ratio or KL would be inf: the loss and its gradient stay finite."""
    torch.manual_seed(0)
    b, R, V = 3, 7, 5
    logits = torch.randn(b, R, V, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (b, R))
    logprobs = torch.log_softmax(logits, -1).gather(2, labels[..., None]).squeeze(2)
    old, ref, sampled = (logprobs.detach() + torch.randn(b, R, dtype=torch.float64) * 0.3 for _ in range(3))
    advantages = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]], dtype=torch.float64)
    flags = dict(clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0, entropy_coef=0.01, beta=0.04, kl_estimator="k3",
                 loss_type=loss_type, response_length=R)  # fmt: skip
    tokens = float(mask.sum())
    loss, stats = grpo_tools.trajectory_loss(logprobs, old, ref, sampled, advantages, mask, logits, tokens, b, **flags)
    per_row, kl_sum = [0.0] * b, 0.0
    for i in range(b):
        for t in range(R):
            if not mask[i, t]:
                continue
            lp, a = float(logprobs[i, t]), float(advantages[i])
            ratio = math.exp(lp - old[i, t])
            surrogate = -min(ratio * a, min(max(ratio, 1 - 0.2), 1 + 0.28) * a)
            tis = min(math.exp(old[i, t] - sampled[i, t]), 2.0)
            log_r = lp - float(ref[i, t])
            kl = math.exp(-log_r) + log_r - 1
            e = [math.exp(float(x)) for x in logits[i, t]]
            entropy = -sum(q * math.log(q) for q in [x / sum(e) for x in e])
            per_row[i] += surrogate * tis + 0.04 * kl - 0.01 * entropy
            kl_sum += kl
    if loss_type == "token_mean":
        expected = sum(per_row) / tokens
    else:
        expected = sum(per_row[i] / float(mask[i].sum()) for i in range(b)) / b
    assert float(loss) == pytest.approx(expected, rel=1e-10)
    assert stats["objective/kl"] == pytest.approx(kl_sum / tokens, rel=1e-12)
    # Tool tokens with values that would make their ratio and KL inf: nothing changes, no NaN.
    wild = [x.masked_fill(mask == 0, -1e4) for x in (old, ref, sampled)]
    again, _ = grpo_tools.trajectory_loss(logprobs, *wild, advantages, mask, logits, tokens, b, **flags)
    assert float(again) == pytest.approx(float(loss), rel=1e-12)
    again.backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.slow
def test_the_loss_gets_the_policy_tokens_of_the_rollout_as_its_mask(make_config, monkeypatch):
    """In a run, trajectory_loss's mask is the rollout's policy mask row for row: 0 on every tool token, 1 on every
    token the policy wrote; the attention mask the batch gets covers them all."""
    rollouts, masks = [], []
    rollout_fn, loss_fn = grpo_tools.multi_turn_rollout, grpo_tools.trajectory_loss

    def spy_rollout(*args, **kwargs):
        rollouts.append(rollout_fn(*args, **kwargs))
        return rollouts[-1]

    def spy_loss(*args, **kwargs):
        masks.append(args[5].cpu())
        return loss_fn(*args, **kwargs)

    attention_masks, batch_fn = [], grpo_tools.training_batch

    def spy_batch(*args, **kwargs):
        out = batch_fn(*args, **kwargs)
        attention_masks.append(out[1].cpu())
        return out

    spy_loss.__signature__ = inspect.signature(loss_fn)  # main reads the loss's flags from it

    fixed_rollout.patch(grpo_tools, monkeypatch.setattr)
    monkeypatch.setattr(grpo_tools, "multi_turn_rollout", spy_rollout)
    monkeypatch.setattr(grpo_tools, "trajectory_loss", spy_loss)
    monkeypatch.setattr(grpo_tools, "training_batch", spy_batch)
    grpo_tools.main(make_config(grpo_tools, total_steps=1, eval_every=0, micro_batch_size=8))
    train = rollouts[1]  # the first is the evaluation before training
    (mask,) = masks
    assert torch.equal(mask, train.policy[:, : mask.shape[1]])
    tool = (train.real - train.policy)[:, : mask.shape[1]]
    assert tool.sum() > 0 and (mask[tool > 0] == 0).all()
    # The attention mask covers every token of the trajectory, the tool's included.
    (attention_mask,) = attention_masks
    assert torch.equal(attention_mask[:, -mask.shape[1] :].float(), train.real[:, : mask.shape[1]])


@pytest.mark.slow
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_mask_truncated_leaves_the_trajectories_cut_at_the_budget_out_of_the_loss(
    make_config, monkeypatch, mask_truncated
):
    """--mask_truncated (TRL's mask_truncated_completions): the loss mask of a trajectory cut at the budget is all
    0, the others' are their policy tokens; off by default, when every trajectory keeps its policy tokens."""
    rollouts, masks, rollout_fn, loss_fn = [], [], grpo_tools.multi_turn_rollout, grpo_tools.trajectory_loss

    def spy_rollout(*args, **kwargs):
        rollouts.append(rollout_fn(*args, **kwargs))
        return rollouts[-1]

    def spy_loss(*args, **kwargs):
        masks.append(args[5].cpu())
        return loss_fn(*args, **kwargs)

    spy_loss.__signature__ = inspect.signature(loss_fn)  # main reads the loss's flags from it
    fixed_rollout.patch(grpo_tools, monkeypatch.setattr)
    monkeypatch.setattr(grpo_tools, "multi_turn_rollout", spy_rollout)
    monkeypatch.setattr(grpo_tools, "trajectory_loss", spy_loss)
    args = make_config(grpo_tools, total_steps=1, eval_every=0, micro_batch_size=8, response_length=16)
    assert args.mask_truncated is False
    args.mask_truncated = mask_truncated
    grpo_tools.main(args)
    train, (mask,) = rollouts[1], masks  # the first rollout is the evaluation before training
    cut = train.truncated
    assert 0 < cut.sum() < len(cut), cut  # the scripted policy's trajectories: some cut at 16 tokens, some not
    policy = train.policy[:, : mask.shape[1]]
    assert torch.equal(mask[~cut], policy[~cut])
    assert torch.equal(mask[cut], torch.zeros_like(policy[cut]) if mask_truncated else policy[cut])


def test_zero3_with_hf_generate_is_refused_in_one_line(tiny_model_dir, tokenizer):
    """Under ZeRO-3 HF generate gathers the policy in every turn, a collective, and processes take different numbers
    of turns: the sampler refuses the combination with one line."""
    from types import SimpleNamespace

    zero3 = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    args = grpo_tools.Config(model_name_or_path=tiny_model_dir, vllm=False)
    with pytest.raises(SystemExit) as exc:
        grpo_tools.TurnSampler(args, zero3, None, tokenizer)
    assert str(exc.value.code).startswith("error: DeepSpeed ZeRO-3 needs vLLM here") and "\n" not in str(
        exc.value.code
    )
    zero2 = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    assert grpo_tools.TurnSampler(args, zero2, None, tokenizer).llm is None


# ---------------------------------------------------------------------------------------------------------------
# The samplers at their edges, with stand-ins for vLLM's engine and HF generate


class StandInEngine:
    """vLLM's LLM as grpo_tools drives it, without a model: each turn of a trajectory writes a call,
    CALL[0] 6 * 7 CALL[1], until the trajectory has made `calls` of them, then "Answer: 42" and EOS. It counts its
    generate calls, sleeps, wake-ups and weight loads, and refuses to generate asleep. With several processes a sleep
    and a wake-up are collectives, as vLLM's are with enable_nccl_comm_suspend: every process checks that all of
    them make the same one (a process that sleeps more often than another breaks or hangs the run)."""

    def __init__(self, tokenizer, calls):
        from types import SimpleNamespace

        self.tokenizer, self.calls, self.asleep = tokenizer, calls, False
        self.counts = dict.fromkeys(["generate", "sleep", "wake_up", "reload_weights"], 0)
        shutdown = SimpleNamespace(shutdown=lambda: None)
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32), engine_core=shutdown)

    def generate(self, requests, params, use_tqdm=True):
        from types import SimpleNamespace

        assert not self.asleep, "generate() on a sleeping engine"
        self.counts["generate"] += 1
        outputs = []
        for request, p in zip(requests, params):
            trajectory = self.tokenizer.decode(request["prompt_token_ids"]).rsplit("<|im_start|>assistant", 1)[1]
            text = f"{CALL[0]}6 * 7{CALL[1]}" if trajectory.count(RESULT[0]) < self.calls else "Answer: 42"
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            ids = (ids + [self.tokenizer.eos_token_id] * text.startswith("Answer"))[: p.max_tokens]
            logprobs = None if p.logprobs is None else [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return outputs

    def sleep(self, level):
        assert not self.asleep and level == 1
        self.collective("sleep")
        self.asleep = True

    def wake_up(self):
        assert self.asleep
        self.collective("wake_up")
        self.asleep = False

    def collective(self, name):
        self.counts[name] += 1
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, (name, self.counts[name]))
            if len(set(every)) > 1:
                raise RuntimeError(f"the processes' engines are out of step: {every}")

    def collective_rpc(self, method, kwargs):
        self.counts[method] += 1

    def reset_prefix_cache(self):
        pass


def fake_vllm():
    """The vllm package as grpo_tools imports it, for the stand-in engine: SamplingParams keeps its arguments."""
    import types

    module = types.ModuleType("vllm")
    module.SamplingParams = types.SimpleNamespace
    return module


def install_stand_in_engine(monkeypatch, calls):
    """grpo_tools samples from a StandInEngine per process (calls: {rank: the calls each trajectory makes}) and takes
    --vllm_sleep on CPU (refused there: vLLM's sleep mode needs a GPU). Returns the list of engines started."""
    from transformers import AutoTokenizer

    engines, check = [], grpo_tools._check_common_args

    def start_vllm(args, model_name_or_path, rank, world_size, cores, sleep=False):
        engines.append(StandInEngine(AutoTokenizer.from_pretrained(model_name_or_path), calls[rank]))
        return engines[-1]

    def check_common_args(args, *rest, **kwargs):
        sleep, args.vllm_sleep = args.vllm_sleep, False
        check(args, *rest, **kwargs)
        args.vllm_sleep = sleep

    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())
    monkeypatch.setattr(grpo_tools, "_start_vllm", start_vllm)
    monkeypatch.setattr(grpo_tools, "_check_common_args", check_common_args)
    return engines


@pytest.mark.slow
def test_vllm_sleep_sleeps_once_per_rollout_not_once_per_turn(make_config, monkeypatch):
    """With --vllm_sleep the engine sleeps after each rollout (training and evaluation), not after each of its turns
    (every turn would re-process its context after the caches were dropped), and wakes once before the next use."""
    engines = install_stand_in_engine(monkeypatch, calls={0: 2})
    rollouts, rollout_fn = [], grpo_tools.multi_turn_rollout

    def spy(*args, **kwargs):
        rollouts.append(rollout_fn(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(grpo_tools, "multi_turn_rollout", spy)
    grpo_tools.main(make_config(grpo_tools, vllm=True, vllm_sleep=True, total_steps=2, eval_every=0))
    (engine,) = engines
    assert all(turns == 3 for rollout in rollouts for turns in rollout.turns)  # 2 calls, then the answer
    assert engine.counts["generate"] == 3 * len(rollouts) and len(rollouts) == 4  # evaluation, 2 steps, evaluation
    assert engine.counts["sleep"] == len(rollouts) and engine.counts["wake_up"] == len(rollouts) - 1
    assert engine.counts["reload_weights"] == 2 and engine.asleep


TWO_PROCESSES_PROGRAM = """
import importlib, json, os
import pytest, tyro
import grpo_tools

args = tyro.cli(grpo_tools.Config)
tests = importlib.import_module(os.environ["TEST_MODULE"])  # this file, for its stand-in engine
engines = tests.install_stand_in_engine(pytest.MonkeyPatch(), calls={0: 2, 1: 0})
grpo_tools.main(args)
with open(os.path.join(os.environ["COUNTS_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(engines[0].counts, f)
"""


@pytest.mark.slow
def test_two_processes_whose_trajectories_make_different_numbers_of_calls_do_not_hang(
    tiny_model_dir, task_dir, tmp_path
):
    """2 processes, each with its engine: process 0's trajectories make 2 calls (3 turns), process 1's answer at
    once (1 turn). Each process calls its engine's collectives (sleep, wake-up, weight load) as often as the other,
    whatever its number of turns, so the run ends (a sleep per turn would leave process 0 in a collective process 1
    never joins)."""
    program, out = tmp_path / "two_processes.py", str(tmp_path / "runs")
    program.write_text(TWO_PROCESSES_PROGRAM)
    values = {**FAST["grpo_tools"], "vllm": True, "vllm_sleep": True, "eval_every": 0}
    flags = strip_flags(fast_cli_flags(tiny_model_dir, task_dir, out, **values), "oversample")
    env = subprocess_env()
    here = os.path.dirname(os.path.abspath(__file__))  # this test's folder: the program imports this module
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests"), here, env["PYTHONPATH"]])
    env["COUNTS_DIR"], env["TEST_MODULE"] = str(tmp_path), __name__
    cmd = [accelerate_command(), "launch", "--multi_gpu", "--dynamo_backend", "no", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--main_process_port", str(free_port())]
    run_checked(cmd + [str(program), *flags], env, timeout=300)
    counts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert counts[0]["generate"] == 3 * counts[1]["generate"] > 0  # 3 turns per rollout against 1
    for name in ("sleep", "wake_up", "reload_weights"):
        assert counts[0][name] == counts[1][name] > 0, name


def test_vllm_turns_are_cut_at_the_token_that_completes_the_call(tokenizer, monkeypatch):
    """vLLM matches its stop string on its own incremental detokenisation and can return tokens past the one that
    completed CALL[1], with their log-probs: the turn is cut there, as HF's are, so that they are not trained as the
    policy's before the tool's output. The request asks for the stop string, kept in the output."""
    from types import SimpleNamespace

    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())

    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    eos = tokenizer.eos_token_id
    call, answer = enc("A <calc>2 * 3</calc>"), enc("Answer: 6") + [eos]
    returned = {7: call + enc(" and on"), 8: answer}
    assert returned[7][: len(call)] == call

    class Engine:
        def generate(self, requests, params, use_tqdm=True):
            assert all(p.stop == [CALL[1]] and p.include_stop_str_in_output for p in params)
            outputs = []
            for request in requests:
                ids = returned[request["prompt_token_ids"][0]]
                logprobs = [{t: SimpleNamespace(logprob=-0.1 * (k + 1))} for k, t in enumerate(ids)]
                outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
            return outputs

    turns = grpo_tools._vllm_turns(Engine(), tokenizer, [[7, 1], [8, 1]], [32, 32], 1.0, 1.0, [eos], CALC_END)
    assert turns[0] == (call, pytest.approx([-0.1 * (k + 1) for k in range(len(call))]))
    assert turns[1] == (answer, pytest.approx([-0.1 * (k + 1) for k in range(len(answer))]))


def test_hf_turns_find_the_end_of_a_call_in_linear_time(tokenizer):
    """hf_turns cuts each row at its first stop id or at the token that completes CALL[1], decoding a bounded number
    of tokens per token of the rows (not every prefix of them: quadratic in the length)."""
    from transformers import GenerationConfig

    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    long_turn = enc(" word") * 400 + enc(" <calc>2 * 3</calc>")
    rows = [long_turn + enc(" more") * 20, enc("Answer: 6") + [eos]]
    rows[1] += [pad] * (len(rows[0]) - len(rows[1]))

    class Generator(torch.nn.Module):  # HF generate's stand-in: the rows after the contexts
        def __init__(self):
            super().__init__()
            self.weight, self.generation_config = torch.nn.Parameter(torch.zeros(1)), GenerationConfig()

        def generate(self, input_ids, attention_mask, generation_config, **kwargs):
            assert generation_config.stop_strings == [CALL[1]]
            return torch.cat([input_ids, torch.tensor(rows)], 1)

    decoded = []

    class Counting:  # the tokenizer, counting the tokens it decodes
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, ids, **kwargs):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    limits = [len(rows[0])] * 2
    turns = grpo_tools._hf_turns(Generator(), Counting(), [[5, 6], [7]], limits, 1.0, 1.0, pad, [eos], CALC_END)
    assert turns == [(long_turn, None), (enc("Answer: 6") + [eos], None)]
    assert sum(decoded) <= 10 * len(rows[0]), sum(decoded)  # the old scan of every prefix: 80000 tokens


# ---------------------------------------------------------------------------------------------------------------
# The tool's arms (--tool unavailable), one operation per call (--max_operations), and the probe


@pytest.mark.parametrize(
    "expression, operations",
    [
        ("12", 0), ("-12", 0), ("+-+3", 0), ("(-12)", 0), ("((7))", 0),  # a sign or parentheses: no operation
        ("-3 * 4", 1), ("3 * -4", 1), ("-(3 * 4)", 1), ("((12 * 34))", 1), ("(-3) * (4)", 1), ("1 - -1", 1),
        ("2^3", 1), ("2**-3", 1), ("-2^2", 1), ("(2)^(3)", 1), ("7/2", 1), ("1.5 + .5", 1),
        ("12 * 34 * 5", 2), ("(12 * 34) * 5", 2), ("12 * (34 * 5)", 2), ("2^3^2", 2), ("-(1 + 2) * -3", 2),
        ("4 / 2 * 3", 2), ("1 + 2 - 3 + 4", 3), ("1 + 2 +", 2),
    ],
)  # fmt: skip
def test_max_operations_counts_the_binary_operations_of_a_call(expression, operations):
    """--max_operations 1: one operation per call; a sign before a term and parentheses are none, a power is one.
    An expression with more gets a short error (before it is computed), one within the limit its value as without
    a limit; 0 is no limit."""
    assert grpo_tools.Arithmetic(expression).operations() == operations
    unlimited = calculator(expression)
    assert calculator(expression, max_operations=0) == unlimited
    for limit in (1, 2):
        expected = "error: at most " + ("one operation" if limit == 1 else "2 operations") + " per call"
        assert calculator(expression, max_operations=limit) == (expected if operations > limit else unlimited)


def test_the_unavailable_tool_answers_every_call_through_the_calculators_path(tokenizer):
    """The unavailable calculator (--tool unavailable) answers each call `error: unavailable` where the calculator
    would have answered: the same calls, turns and policy tokens, the output in the same RESULT tags as tool tokens,
    the same budget; only the output's text differs. Calculator(1) computes one operation per call."""
    prompts = [[900, 901], [902]]
    script = {
        (900, 0): "First <calc>12 * 34</calc>",
        (900, 1): "then <calc>408 * 2 * 1</calc>",
        (900, 2): "Answer: 816<eos>",
        (902, 0): "Answer: 5<eos>",
    }
    rollouts = {}
    Calculator = grpo_tools.Calculator
    for name, tool in [("calculator", Calculator), ("one", lambda: Calculator(1)),
                       ("unavailable", lambda: Calculator(unavailable=True))]:  # fmt: skip
        policy_turn, seen = scripted_turns(tokenizer, script)
        rollouts[name] = multi_turn_rollout(policy_turn, tokenizer, prompts, 1, 64, 3, (), calc(tokenizer, tool))
    assert rollouts["calculator"].calls[0] == [("12 * 34", "408"), ("408 * 2 * 1", "816")]
    assert rollouts["one"].calls[0] == [("12 * 34", "408"), ("408 * 2 * 1", "error: at most one operation per call")]
    unavailable = [("12 * 34", "error: unavailable"), ("408 * 2 * 1", "error: unavailable")]
    assert rollouts["unavailable"].calls == [unavailable, []]
    assert rollouts["unavailable"].texts[0] == (
        "First <calc>12 * 34</calc><result>error: unavailable</result>then <calc>408 * 2 * 1</calc>"
        "<result>error: unavailable</result>Answer: 816"
    )
    working, unavailable = rollouts["calculator"], rollouts["unavailable"]
    assert unavailable.turns == working.turns and unavailable.answers == working.answers
    assert unavailable.policy.sum(1).tolist() == working.policy.sum(1).tolist()  # the same policy tokens
    policy_ids = [ids[mask > 0].tolist() for ids, mask in zip(working.ids, working.policy)]
    assert policy_ids == [ids[mask > 0].tolist() for ids, mask in zip(unavailable.ids, unavailable.policy)]
    tool_ids = (unavailable.ids[0][(unavailable.real[0] - unavailable.policy[0]) > 0]).tolist()
    enc = tokenizer(f"{RESULT[0]}{grpo_tools.UNAVAILABLE}{RESULT[1]}", add_special_tokens=False).input_ids
    assert tool_ids == enc * 2


class Upper:
    """An environment of one tool of one string argument, which --tool_format calc can call."""

    def reset(self, question):
        pass

    def upper(self, text: str) -> str:
        """The text in capitals.

        Args:
            text: any text
        """
        return text.upper()


def test_calc_is_a_format_of_the_one_tool_system(tokenizer, tiny_model_dir, task_dir):
    """--tool_format calc calls any environment's one tool of one string argument: <calc>abc</calc> runs Upper.upper
    with text "abc", its result in RESULT tags as tool tokens. An environment of other tools (price_list_one: price of
    three arguments, add of two) stops in one line before any model loads."""
    script = {(900, 0): "<calc>abc</calc>", (900, 1): "Answer: ABC<eos>"}
    policy_turn, _ = scripted_turns(tokenizer, script)
    rollout = multi_turn_rollout(policy_turn, tokenizer, [[900]], 1, 64, 2, (), calc(tokenizer, Upper))
    assert rollout.calls == [[("abc", "ABC")]] and rollout.failed_calls == [0]
    assert rollout.texts[0] == "<calc>abc</calc><result>ABC</result>Answer: ABC"
    tool_ids = rollout.ids[0][(rollout.real[0] - rollout.policy[0]) > 0].tolist()
    assert tool_ids == tokenizer(f"{RESULT[0]}ABC{RESULT[1]}", add_special_tokens=False).input_ids
    bad = grpo_tools.Config(model_name_or_path=tiny_model_dir, dataset_path=task_dir, environment="price_list_one")
    bad.vllm = False
    with pytest.MonkeyPatch.context() as m:
        m.setattr(grpo_tools, "AutoModelForCausalLM", NoModelLoads)
        one_line_error(grpo_tools.main, bad, "--tool_format calc", "one string argument")


def test_the_tool_flags_parse_and_are_checked_in_one_line(tiny_model_dir, task_dir):
    import tyro

    args = tyro.cli(grpo_tools.Config, args=["--tool", "unavailable", "--max_operations", "1"])
    assert (args.tool, args.max_operations) == ("unavailable", 1)
    assert (grpo_tools.Config().tool, grpo_tools.Config().max_operations) == ("calculator", 0)
    with pytest.raises(SystemExit):
        tyro.cli(grpo_tools.Config, args=["--tool", "abacus"])
    bad = grpo_tools.Config(model_name_or_path=tiny_model_dir, dataset_path=task_dir, max_operations=-1, vllm=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(grpo_tools, "AutoModelForCausalLM", NoModelLoads)
        one_line_error(grpo_tools.main, bad, "--max_operations", ">= 0")


def product_turns(record=None):
    """Stands in for hf_turns (same signature and returns): a scripted policy of the products "Calculate a * b * ...":
    with an even first factor it chains one call per operation, each on the last result (<calc>a * b</calc>, then
    <calc>{result} * c</calc>, ...), and answers the last result; with an odd one it answers 0 without a call; a
    question that is not a product is answered 2. record, a list, gets each call's temperature."""

    def turns(model, tokenizer, contexts, max_tokens, temperature, top_p, pad_token_id, stop_ids, stop_strings=()):
        if record is not None:
            record.append(temperature)
        out = []
        for context, limit in zip(contexts, max_tokens):
            text = tokenizer.decode(context)
            question = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            results = re.findall(r"<result>([^<]*)</result>", text.rsplit("<|im_start|>assistant\n", 1)[1])
            product = re.match(r"Calculate ([\d *]+)\.", question)
            factors = product[1].split(" * ") if product else None
            if factors is None or int(factors[0]) % 2:
                turn = "Answer: 0" if factors else "Answer: 2"
            elif len(results) < len(factors) - 1:
                turn = f"{CALL[0]}{results[-1] if results else factors[0]} * {factors[len(results) + 1]}{CALL[1]}"
            else:
                turn = f"Answer: {results[-1]}"
            ids = tokenizer(turn, add_special_tokens=False).input_ids + [stop_ids[0]] * turn.startswith("Answer")
            out.append((ids[:limit], None))
        return out

    return turns


PRODUCT_ROWS = [
    {"question": "Calculate 12 * 3.", "answer": "36"},  # right, one call
    {"question": "Calculate 7 * 5.", "answer": "35"},  # wrong, no call
    {"question": "Calculate 4 * 5 * 6.", "answer": "120"},  # right, two calls
    {"question": "Calculate 9 * 2 * 3.", "answer": "54"},  # wrong, no call
    {"question": "Calculate 2 * 2 * 2.", "answer": "8"},  # right, two calls
    {"question": "Tom has 3 apples and eats 1. How many are left?", "answer": "2"},  # right, no call, no terms
]


@pytest.fixture
def make_probe_args(make_config, tmp_path):
    from benchmark.claims import tool_probe

    values = dict(dataset_path=write_rows(tmp_path / "products", PRODUCT_ROWS), output_dir=str(tmp_path / "probes"))
    values |= dict(response_length=64, num_eval_prompts=0)
    return functools.partial(make_config, grpo_tools, config_class=tool_probe.ProbeConfig, **values)


def test_probe_reads_the_terms_of_a_question_and_sums_its_trajectories():
    from benchmark.claims.tool_probe import probe_results, question_terms

    assert [question_terms(q["question"]) for q in PRODUCT_ROWS] == [2, 2, 3, 3, 3, None]
    assert question_terms("What is 3 + 1?") == 2 and question_terms("Calculate 2.5 * (3 - 1).") == 3
    assert question_terms("Calculate.") is None and question_terms("It costs 3 dollars and 4 cents.") is None
    # Two prompts, K = 2: prompt 0 right once (2 calls, one failed), prompt 1 never (no call; cut at the budget).
    records = [
        dict(prompt=0, terms=3, correct=1.0, calls=2, failed=1, truncated=False),
        dict(prompt=0, terms=3, correct=0.0, calls=1, failed=0, truncated=False),
        dict(prompt=1, terms=2, correct=0.0, calls=0, failed=0, truncated=True),
        dict(prompt=1, terms=2, correct=0.0, calls=0, failed=0, truncated=False),
    ]
    results = probe_results(records)
    assert results["accuracy"] == 0.25 and results["accuracy_se"] == pytest.approx(0.25)  # std(0.5, 0) / sqrt(2)
    assert (
        results["prompts_with_success"] == 0.5 and results["call_rate"] == 0.5 and results["multi_call_rate"] == 0.25
    )
    assert (
        results["calls"] == 0.75 and results["failed_calls"] == pytest.approx(1 / 3) and results["truncated"] == 0.25
    )
    assert results["by_terms"]["3"]["accuracy"] == 0.5 and results["by_terms"]["2"]["call_rate"] == 0.0
    assert math.isnan(probe_results(records[2:])["failed_calls"])


def test_probe_prompts_are_grpo_tools_own(make_probe_args, tmp_path):
    """The probe's prompts are grpo_tools' (load_tool_prompts): the held-out set the runs evaluate on (the first
    --num_eval_prompts), the training set, with a prompt over --max_prompt_length dropped in both; then --terms and
    --num_prompts choose among them, with the terms of each."""
    from transformers import AutoTokenizer

    from benchmark.claims.tool_probe import check_probe_args, probe_prompts

    add = (
        "Calculate 23 + 41. Give the final answer after 'Answer:'.",
        "<calc>23 + 41</calc><result>64</result>\nAnswer: 64",
    )
    args = make_probe_args(num_eval_prompts=4, examples=(add,))
    check_probe_args(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tools = grpo_tools.make_tool_format(args, tokenizer)
    train, train_golds, sets = grpo_tools.load_tool_prompts(args, tokenizer, 1, tools)
    assert probe_prompts(args, tokenizer, tools) == (*sets["eval"], [2, 2, 3, 3])  # the first 4 held-out prompts
    assert "<calc>23 + 41</calc>" in tokenizer.decode(sets["eval"][0][0])  # the shown example is --examples'
    args.prompts = "train"
    assert probe_prompts(args, tokenizer, tools) == (train, train_golds, [2, 2, 3, 3, 3, None])
    args.terms, args.num_prompts = 3, 2
    prompts, golds, terms = probe_prompts(args, tokenizer, tools)
    assert (prompts, golds, terms) == ([train[2], train[3]], ["120", "54"], [3, 3])
    # A long question is dropped by grpo_tools (--max_prompt_length), and the terms stay with their prompts.
    long_rows = [{"question": "Calculate 2 * 3. " + "Think. " * 200, "answer": "6"}, *PRODUCT_ROWS]
    args.terms, args.num_prompts = 0, 0
    args.dataset_path = write_rows(tmp_path / "long", long_rows)
    args.max_prompt_length = 200
    prompts, golds, terms = probe_prompts(args, tokenizer, tools)
    assert golds == ["36", "35", "120", "54", "8", "2"] and terms == [2, 2, 3, 3, 3, None]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_probe_on_a_scripted_policy(make_probe_args, monkeypatch, capsys, temperature):
    """The probe on a scripted policy whose trajectories are known (product_turns): accuracy, call rate, >= 2 calls
    and each number of terms, counted by hand; every turn sampled at the probe's temperature (0: greedy); K samples
    per prompt; a folder that benchmark.statistics.registry reads as a run's evaluation; the markdown row."""
    from benchmark.claims import tool_probe
    from benchmark.statistics import registry

    temperatures = []
    monkeypatch.setattr(grpo_tools, "_hf_turns", product_turns(temperatures))
    folder = tool_probe.main(make_probe_args(temperature=temperature, samples_per_prompt=2, max_operations=1))
    assert set(temperatures) == {temperature}
    with open(os.path.join(folder, "probe.json")) as f:
        results = json.load(f)
    assert results["num_prompts"] == 6 and results["num_samples"] == 12
    assert results["accuracy"] == pytest.approx(4 / 6) and results["call_rate"] == pytest.approx(3 / 6)
    assert results["multi_call_rate"] == pytest.approx(2 / 6) and results["failed_calls"] == 0.0
    assert results["calls"] == pytest.approx(5 / 6) and results["gate"]["passed"]
    assert results["by_terms"]["2"] | {"accuracy_se": 0} == results["by_terms"]["2"] | dict(
        num_prompts=2, num_samples=4, accuracy=0.5, accuracy_se=0, prompts_with_success=0.5, call_rate=0.5,
        multi_call_rate=0.0, calls=0.5, failed_calls=0.0, truncated=0.0,
    )  # fmt: skip
    assert results["by_terms"]["3"]["multi_call_rate"] == pytest.approx(2 / 3)
    assert "<result>20</result><calc>20 * 6</calc><result>120</result>" in results["samples"][4]["completion"]
    run = registry.load_run(folder)
    assert run["seed"] == 1 and run["exp_name"] == "probe" and run["lines"][0]["global_step"] == 0
    assert run["lines"][0]["eval/accuracy"] == pytest.approx(4 / 6)
    assert run["lines"][0]["eval/multi_call_rate_3_terms"] == pytest.approx(2 / 3)
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith(f"| probe | eval, 6 x 2 at T {temperature:g} | 0.667 (s.e. ")
    assert "3 terms: 0.667 / 0.667" in row


def test_probe_passes_the_tool_flags_and_its_gate_exits_3(make_probe_args, monkeypatch, capsys):
    """--tool unavailable reaches the probe's rollout (every call answered with the error, the chain breaks: only
    the word problem is right) and --max_operations too (a whole product in one call is refused); outside
    --min_accuracy / --max_accuracy the probe exits with status 3 after writing its folder."""
    from benchmark.claims import tool_probe

    monkeypatch.setattr(grpo_tools, "_hf_turns", product_turns())
    folder = tool_probe.main(make_probe_args(tool="unavailable", max_accuracy=0.5))
    with open(os.path.join(folder, "probe.json")) as f:
        results = json.load(f)
    assert results["accuracy"] == pytest.approx(1 / 6) and results["failed_calls"] == 1.0
    with pytest.raises(SystemExit) as exc:
        tool_probe.main(make_probe_args(min_accuracy=0.9, prompts="train", terms=3, exp_name="gate"))
    assert exc.value.code == 3 and "gate: accuracy 0.6667 outside [0.9, 1.0]" in capsys.readouterr().err
    (gate,) = [d for d in os.listdir(make_probe_args().output_dir) if "__gate__" in d]
    with open(os.path.join(make_probe_args().output_dir, gate, "probe.json")) as f:
        assert json.load(f)["gate"] == dict(min_accuracy=0.9, max_accuracy=1.0, passed=False)


def test_probe_refuses_bad_flags_in_one_line(make_probe_args):
    from benchmark.claims import tool_probe

    one_line_error(tool_probe.main, make_probe_args(temperature=-1.0), "--temperature", ">= 0")
    one_line_error(tool_probe.main, make_probe_args(samples_per_prompt=0), "--samples_per_prompt")
    one_line_error(tool_probe.main, make_probe_args(prompts="eval_extra"), "--extra_eval_path")
    one_line_error(tool_probe.main, make_probe_args(min_accuracy=0.5, max_accuracy=0.2), "--min_accuracy")
    one_line_error(tool_probe.main, make_probe_args(terms=5), "--terms")


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool, max_operations, output",
    [("calculator", 0, "24"), ("calculator", 1, "error: at most one operation per call"),
     ("unavailable", 0, "error: unavailable")],
)  # fmt: skip
def test_run_answers_calls_with_the_tool_the_flags_name(make_config, monkeypatch, tool, max_operations, output):
    """--tool and --max_operations reach the training rollout and the evaluation: a scripted policy that calls
    <calc>2 * 3 * 4</calc> reads the calculator's 24, the one-operation error or `error: unavailable`."""

    def turns(model, tokenizer, contexts, max_tokens, temperature, top_p, pad_token_id, stop_ids, stop_strings=()):
        out = []
        for context, limit in zip(contexts, max_tokens):
            called = RESULT[0] in tokenizer.decode(context).rsplit("<|im_start|>assistant\n", 1)[1]
            text = "Answer: 24" if called else f"{CALL[0]}2 * 3 * 4{CALL[1]}"
            ids = tokenizer(text, add_special_tokens=False).input_ids + [stop_ids[0]] * called
            out.append((ids[:limit], None))
        return out

    monkeypatch.setattr(grpo_tools, "_hf_turns", turns)
    run = grpo_tools.main(make_config(grpo_tools, total_steps=1, tool=tool, max_operations=max_operations))
    lines = read_metrics(run)
    assert lines[1]["tools/calls"] == 1.0 and lines[1]["tools/failed_calls"] == float(output.startswith("error"))
    assert lines[1]["eval/call_rate"] == 1.0
    with open(os.path.join(run, "samples.jsonl")) as f:  # the evaluation's trajectories
        completions = [json.loads(line)["completion"] for line in f]
    assert completions and all(f"{RESULT[0]}{output}{RESULT[1]}" in c for c in completions)


def test_chain_tasks_hold_no_zero_product_and_no_3_term_training_question_starts_a_4_term_one():
    """prepare_assets' mul_2t3t2d (train) and mul_4t2d (held out): no product with a factor 0 (KEEP), and the 4-term
    stream starts at its own seed (TASK_SEEDS; reasoning-gym's item i is Random(seed + i), so with the same seed a
    4-term question would begin with the 3 factors of a training one). The tasks built before are untouched."""
    pytest.importorskip("reasoning_gym")
    from benchmark.assets import prepare_assets as pa

    assert set(pa.TASK_SEEDS) | set(pa.KEEP) == {"mul_2t3t2d", "mul_4t2d"}
    ((name, config),) = pa.TASKS["mul_4t2d"]
    held_out, _ = pa.distinct_questions(name, config, pa.TASK_SEEDS["mul_4t2d"], 300, pa.KEEP["mul_4t2d"])
    ((name, config),) = pa.TASKS["mul_2t3t2d"]
    train, _ = pa.distinct_questions(name, config, pa.SEED, 300, pa.KEEP["mul_2t3t2d"])
    assert all(row["answer"] != "0" for row in held_out + train)
    assert {row["question"].count(" * ") for row in held_out} == {3} and {
        r["question"].count(" * ") for r in train
    } == {1, 2}
    starts = {row["question"].rsplit(" * ", 1)[0] + "." for row in held_out}
    assert not starts & {row["question"] for row in train}
    same_seed, _ = pa.distinct_questions(*pa.TASKS["mul_4t2d"][0], pa.SEED, 300)
    assert {row["question"].rsplit(" * ", 1)[0] + "." for row in same_seed} & {row["question"] for row in train}


def test_mul_3t2d_is_the_3_term_rows_of_mul_2t3t2d_split_for_split(tmp_path):
    """prepare_assets' SUBSETS: mul_3t2d's train and test are mul_2t3t2d's rows with 3 factors, in their order, so its
    held-out products stay held out (the 3-term runs are probed on mul_2t3t2d's test split)."""
    from benchmark.assets import prepare_assets as pa

    rng = random.Random(0)
    source = {}
    for split in ("train", "test"):
        rows = []
        for _ in range(40):
            factors = [str(rng.randint(1, 99)) for _ in range(rng.choice((2, 3)))]
            question = f"Calculate {' * '.join(factors)}."
            rows.append({"question": question, "answer": str(math.prod(map(int, factors))), "task": "mul"})
        source[split] = rows
        (tmp_path / "data" / "mul_2t3t2d").mkdir(parents=True, exist_ok=True)
        pa.write_jsonl(rows, tmp_path / "data" / "mul_2t3t2d" / f"{split}.jsonl")
    pa.prepare_subsets(tmp_path)
    for split, rows in source.items():
        with open(tmp_path / "data" / "mul_3t2d" / f"{split}.jsonl") as f:
            got = [json.loads(line) for line in f]
        want = [row for row in rows if len(re.findall(r"\d+", row["question"])) == 3]
        assert got == want and 0 < len(want) < len(rows)
