"""grpo_tools' native tool calls (--tool_format native): the environment's tools as JSON schemas, the calls parsed in
the Hermes and Llama 3.1 formats and run with their errors by kind, the tokens between turns as the chat template
renders tool messages (SmolLM2's Hermes template, and fixtures of Qwen2.5's and Qwen3's: tests/chat_templates.py),
and rollouts of a scripted policy: the trained tokens are exactly the sampled ones, tool tokens stay out of the loss,
and a template that renders earlier turns again differently changes nothing that is trained."""

import functools
import json
import os
import re
import shutil
from typing import Literal

import chat_templates
import pytest
import torch
from conftest import REPO_ROOT, read_metrics

import grpo_tools
from environments import price_list
from grpo_tools import Calculator, ToolCalls, multi_turn_rollout, parse_tool_calls, run_tool_call

# SmolLM2's tool template, as make assets writes it beside the model (its own template ignores tools=)
HERMES_TEMPLATE = open(os.path.join(REPO_ROOT, "benchmark", "assets", "smollm2_tools.jinja")).read()
TEMPLATES = {"hermes": HERMES_TEMPLATE, "qwen2.5": chat_templates.QWEN25, "qwen3": chat_templates.QWEN3}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Shop:
    """A test environment: two tools with several typed arguments, one that raises."""

    def __init__(self):
        self.questions = []

    def reset(self, question):
        self.questions.append(question)

    def price(self, item: str, quantity: int, discount: float | None = None) -> float:
        """The price of some items.

        Args:
            item: the item's name
            quantity: how many
            discount: a fraction taken off, if any
        """
        if item not in ("pen", "book"):
            raise KeyError(item)
        return {"pen": 1.5, "book": 12.0}[item] * quantity * (1 - (discount or 0))

    def pay(self, amount: float, card: bool) -> str:
        """Pay an amount.

        Args:
            amount: what to pay
            card: by card, else cash
        """
        return f"paid {amount} by {'card' if card else 'cash'}"


def paint(colour: Literal["red", "blue"]) -> str:
    """Paint the wall.

    Args:
        colour: which paint
    """
    return f"painted {colour}"


def test_tool_schemas_are_the_public_methods_but_reset_and_reward():
    schemas = {s["function"]["name"]: s["function"] for s in grpo_tools.tool_schemas(Shop())}
    assert sorted(schemas) == ["pay", "price"]
    price = schemas["price"]["parameters"]
    assert price["required"] == ["item", "quantity"]
    assert price["properties"]["quantity"]["type"] == "integer"
    assert price["properties"]["item"]["description"] == "the item's name"
    assert [s["function"]["name"] for s in grpo_tools.tool_schemas(Calculator())] == ["calculate"]


CALL = '{"name": "calculate", "arguments": {"expression": "2 * 3"}}'


@pytest.mark.parametrize(
    "text, call_format, calls",
    [
        ("Answer: 12", "hermes", []),
        (f"<tool_call>\n{CALL}\n</tool_call>", "hermes", [("calculate", {"expression": "2 * 3"})]),
        ('I will compute.\n<tool_call>\n{"name": "price", "arguments": {"item": "pen", "quantity": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "pay", "arguments": {"amount": 4.5, "card": true}}\n</tool_call>', "hermes",
         [("price", {"item": "pen", "quantity": 3}), ("pay", {"amount": 4.5, "card": True})]),
        ("<tool_call>\n{name: calculate}\n</tool_call>", "hermes", [(None, "bad_json")]),  # not JSON
        ('<tool_call>{"arguments": {}}</tool_call>', "hermes", [(None, "bad_json")]),  # no name
        ('<tool_call>{"name": "calculate", "arguments": "2 * 3"}</tool_call>', "hermes", [(None, "bad_json")]),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>[1]</tool_call>', "hermes",
         [("a", {}), (None, "bad_json")]),
        # opened, not closed: read to the end of the turn (vLLM's Hermes parser), a call if its JSON is whole
        (f"<tool_call>\n{CALL}\n", "hermes", [("calculate", {"expression": "2 * 3"})]),
        (f"<tool_call>{CALL}</tool_call><tool_call>{CALL}", "hermes", [("calculate", {"expression": "2 * 3"})] * 2),
        ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1', "hermes", [(None, "bad_json")]),
        # reasoning is not read: a call inside <think>...</think> is a thought
        (f"<think>\nmaybe <tool_call>{CALL}</tool_call>\n</think>\n\nAnswer: 6", "hermes", []),
        (f"<think>\nno</think>\n<tool_call>{CALL}</tool_call>", "hermes", [("calculate", {"expression": "2 * 3"})]),
        # ... but an unclosed <think> is no reasoning (TRL's Qwen3 schema; vLLM's qwen3 parser ends it at the call)
        (f"<think>\nmaybe <tool_call>{CALL}</tool_call>", "hermes", [("calculate", {"expression": "2 * 3"})]),
        ('<tool_call>{"name": "f", "arguments": {"s": "<think>x</think>"}}</tool_call>', "hermes",
         [("f", {"s": "<think>x</think>"})]),  # tags inside a call's arguments are the call's
        ("<tool_call></tool_call>", "hermes", [(None, "bad_json")]),
        ('<tool_call>{"name": "tick"}</tool_call>', "hermes", [("tick", {})]),  # no arguments: none
        ('<tool_call>{"name": "tick", "arguments": null}</tool_call>', "hermes", [(None, "bad_json")]),
        # JSON that Python's parser refuses other than by JSONDecodeError: a bad call, not a crash
        ('<tool_call>{"name": "f", "arguments": {"n": ' + "1" * 4301 + "}}</tool_call>", "hermes",
         [(None, "bad_json")]),
        ("<tool_call>" + "[" * 5000 + "</tool_call>", "hermes", [(None, "bad_json")]),
        (CALL, "hermes", []),  # a bare JSON object is no call in the Hermes format
        # Llama 3.1 ("json"): the turn is the call, its arguments under "parameters", maybe after <|python_tag|>
        ('{"name": "calculate", "parameters": {"expression": "7 - 1"}}', "json",
         [("calculate", {"expression": "7 - 1"})]),
        ('<|python_tag|>{"name": "pay", "parameters": {"amount": 1, "card": false}}', "json",
         [("pay", {"amount": 1, "card": False})]),
        ('{"name": "calculate", "parameters": {"expression": }', "json", [(None, "bad_json")]),
        ("{1, 2} is a set", "json", []),  # JSON-like text that names no tool is no call
        # as vLLM's llama3_json parser: text before the call, several calls separated by ';'
        ('I will look it up. {"name": "calculate", "parameters": {"expression": "7 - 1"}}', "json",
         [("calculate", {"expression": "7 - 1"})]),
        ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": {"y": 1}}}', "json",
         [("a", {}), ("b", {"x": {"y": 1}})]),
        ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": ', "json", [("a", {}), (None, "bad_json")]),
        (f"<tool_call>{CALL}</tool_call>", "json", [("calculate", {"expression": "2 * 3"})]),  # text around JSON
    ],
)  # fmt: skip
def test_parse_tool_calls(text, call_format, calls):
    assert parse_tool_calls(text, call_format) == calls


@pytest.mark.parametrize("name", [*TEMPLATES, "llama3.1", "qwen3-thinking"])
def test_the_call_format_and_open_reasoning_are_read_from_the_template(tokenizer, name):
    templates = {**TEMPLATES, "llama3.1": chat_templates.LLAMA31, "qwen3-thinking": chat_templates.QWEN3_THINKING}
    expected = {"llama3.1": ("json", False), "qwen3-thinking": ("hermes", True)}.get(name, ("hermes", False))
    assert ToolCalls(tokenizer, Shop, templates[name]).reading == expected


# Calls written in formats that parse_tool_calls does not read (Qwen3.5's XML, Gemma's `call:`), ChatML otherwise.
OTHER_FORMATS = {
    "xml": "<tool_call>\n<function={{ c.function.name }}>\n</function>\n</tool_call>",
    "gemma": "<|tool_call>call:{{ c.function.name }}{}<tool_call|>",
}
NEITHER = "neither a Hermes <tool_call> block nor Llama 3.1's JSON"  # the stop's message
CHATML = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.tool_calls %}{%- for c in m.tool_calls %}CALL"
    "{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


TOOL_CALL_BLOCK = (
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
)


@pytest.mark.parametrize("name", OTHER_FORMATS)
def test_a_template_whose_calls_are_read_neither_way_stops_in_one_line(tokenizer, name):
    with pytest.raises(SystemExit, match=NEITHER):
        _ = ToolCalls(tokenizer, Shop, CHATML.replace("CALL", OTHER_FORMATS[name])).reading
    assert ToolCalls(tokenizer, Shop, CHATML.replace("CALL", TOOL_CALL_BLOCK)).reading == ("hermes", False)


def published_template(name):
    """A model's published chat template, as TRL ships it (trl/chat_templates/: the bench extra that `make test`
    installs)."""
    trl = pytest.importorskip("trl")
    return open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja")).read()


@pytest.mark.parametrize("ours, published", [("qwen2.5", "qwen2_5"), ("qwen3", "qwen3"), ("hermes", "qwen2_5")])
def test_the_fixtures_and_hermes_template_render_a_tool_conversation_as_the_published_templates(
    tokenizer, ours, published
):
    """tests/chat_templates.py's Qwen fixtures and HERMES_TEMPLATE against the templates the models publish: a
    conversation with a system turn, a call, two tool results and the answer renders the same."""
    conversation = [
        {"role": "system", "content": "You are a shop's assistant."},
        {"role": "user", "content": "What do 3 pens cost, paid by card?"},
        grpo_tools.call_message(("price", {"item": "pen", "quantity": 3}), ("pay", {"amount": 4.5, "card": True})),
        grpo_tools.tool_message("price", "4.5"),
        grpo_tools.tool_message("pay", "paid 4.5 by card"),
        {"role": "assistant", "content": "Answer: 4.5"},
    ]
    render = functools.partial(tokenizer.apply_chat_template, conversation, tokenize=False)
    tools = grpo_tools.tool_schemas(Shop())
    assert render(tools=tools, chat_template=TEMPLATES[ours]) == render(
        tools=tools, chat_template=published_template(published)
    )


@pytest.mark.parametrize(
    "published, expected",
    [("qwen2_5", "hermes"), ("qwen3", "hermes"), ("qwen3_instruct_2507", "hermes"), ("llama3_1", "json"),
     ("llama3_2", "json"), ("qwen3_5_think", NEITHER), ("glm4moe", NEITHER), ("gemma4", NEITHER),
     ("gptoss", NEITHER), ("deepseekv3", "cannot render a tool call \\(TypeError")],
)  # fmt: skip
def test_published_templates_calls_are_read_or_stop_the_run(tiny_model_dir, published, expected):
    """Hermes (Qwen2.5, Qwen3) and Llama 3.1/3.2's JSON are read; Qwen3.5's XML, GLM-4.5's, Gemma 4's and
    GPT-OSS's formats stop the run in one line, as does DeepSeek-V3's, which raises on arguments that are not a
    string. Llama's header and end tokens, special to its tokenizer, are here."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    llama = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": llama + ["<|python_tag|>"]})
    make = functools.partial(ToolCalls, tokenizer, Shop, published_template(published))
    if expected in ("hermes", "json"):
        assert make().reading == (expected, False)
    else:
        with pytest.raises(SystemExit, match=expected):  # read as the format is made
            make()


def help(topic: str) -> str:
    """Help on a topic.

    Args:
        topic: what to explain
    """
    return f"help on {topic}"


def test_hermes_template_replaces_a_template_that_ignores_tools_whatever_the_tools_names(
    make_config, monkeypatch, tokenizer
):
    """SmolLM2's template ignores tools=; its system prompt holds "help" (a "helpful AI assistant"), so a tool named
    help is no sign that the tools were rendered: the renders with and without tools= are compared."""
    from transformers.utils import get_json_schema

    assert "help" in tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    monkeypatch.setitem(grpo_tools.ENVIRONMENTS, "help", lambda args: grpo_tools.Tools(help))
    args = make_config(grpo_tools, **NATIVE, environment="help", examples=())
    grpo_tools.check_args(args)
    tools = grpo_tools.make_tool_format(args, tokenizer)
    assert tools.template_kwargs["chat_template"] == HERMES_TEMPLATE
    prompt = tokenizer.decode(grpo_tools.load_tool_prompts(args, tokenizer, 1, tools)[0][0])
    assert json.dumps(get_json_schema(help)) in prompt


def test_a_turn_that_starts_in_reasoning_has_its_reasoning_not_read(tokenizer):
    """Qwen3-Thinking-2507's generation prompt opens <think>: the turn's text up to its </think> is reasoning."""
    tools = ToolCalls(tokenizer, Shop, chat_templates.QWEN3_THINKING)
    assert tokenizer.decode(native_prompt(tokenizer, tools)).endswith("<|im_start|>assistant\n<think>\n")
    pay = '{"name": "pay", "arguments": {"amount": 1, "card": true}}'
    assert tools.calls(f"maybe <tool_call>{CALL}</tool_call>\n</think>\n\n<tool_call>{pay}</tool_call>") == [
        ("pay", {"amount": 1, "card": True})
    ]
    assert ToolCalls(tokenizer, Shop, chat_templates.QWEN3).calls(f"x</think><tool_call>{pay}</tool_call>") == [
        ("pay", {"amount": 1, "card": True})
    ]
    assert tools.calls(f"maybe <tool_call>{pay}</tool_call>") == []  # the reasoning never ends: all of it is


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_a_turn_that_never_leaves_its_reasoning_runs_no_call(tokenizer):
    """Under a template whose generation prompt opens <think>, a turn that never writes </think> is reasoning to its
    end: the call in it is a thought, not run, and the turn is the trajectory's last."""
    tools = ToolCalls(tokenizer, Shop, chat_templates.QWEN3_THINKING)
    thought = '<tool_call>{"name": "pay", "arguments": {"amount": 1, "card": true}}</tool_call>'
    prompt = native_prompt(tokenizer, tools)
    turn = scripted_turns(tokenizer, [thought, "Answer: 1"])
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 200, 2, [end], tools)
    assert rollout.calls == [[]] and rollout.turns == [1] and rollout.unrun_calls == [0]


def test_run_tool_call_returns_errors_as_results_and_counts_them_by_kind():
    env = Shop()
    schemas = grpo_tools.tool_schemas(env)
    assert run_tool_call(env, schemas, "price", {"item": "pen", "quantity": 3}) == ("4.5", None)
    assert run_tool_call(env, schemas, "price", {"item": "book", "quantity": 1, "discount": 0.5}) == ("6.0", None)
    assert run_tool_call(env, schemas, "price", {"item": "book", "quantity": 2, "discount": None}) == ("24.0", None)
    assert run_tool_call(env, schemas, "pay", {"amount": 3, "card": False}) == ("paid 3 by cash", None)
    assert run_tool_call(env, schemas, "price", {"item": "pen", "quantity": 2.0}) == ("3.0", None)  # 2.0 is 2
    env = grpo_tools.Tools(paint, Shop().price, Shop().pay)  # the cases below call all three
    schemas = grpo_tools.tool_schemas(env)
    assert run_tool_call(env, schemas, "paint", {"colour": "red"}) == ("painted red", None)
    cases = [
        ((None, "bad_json"), "bad_json"),
        (("refund", {"amount": 1}), "unknown_tool"),
        (("price", {"item": "pen"}), "bad_arguments"),  # quantity missing
        (("price", {"item": "pen", "quantity": 1, "colour": "red"}), "bad_arguments"),  # unexpected
        (("price", {"item": "pen", "quantity": "3"}), "bad_arguments"),  # a string for an integer
        (("price", {"item": "pen", "quantity": 2.5}), "bad_arguments"),  # a number for an integer
        (("paint", {"colour": "green"}), "bad_arguments"),  # not one of its enum
        (("price", {"item": "pen", "quantity": True}), "bad_arguments"),  # a bool is not an integer here
        (("pay", {"amount": "4", "card": True}), "bad_arguments"),
        (("pay", {"amount": 4, "card": 1}), "bad_arguments"),  # an integer for a boolean
        (("price", {"item": "lamp", "quantity": 1}), "raised"),
    ]
    for (name, arguments), kind in cases:
        text, got = run_tool_call(env, schemas, name, arguments)
        assert got == kind and text.startswith("error: "), (name, arguments, text)
    assert "KeyError" in run_tool_call(env, schemas, "price", {"item": "lamp", "quantity": 1})[0]
    # get_json_schema marks an Optional argument "nullable" (OpenAPI's word), which JSON Schema does not read: None
    # is still accepted for it, and for no other argument
    discount = next(s for s in schemas if s["function"]["name"] == "price")["function"]["parameters"]
    assert discount["properties"]["discount"].get("nullable") is True
    assert run_tool_call(env, schemas, "price", {"item": "pen", "quantity": 2, "discount": None}) == ("3.0", None)
    assert run_tool_call(env, schemas, "price", {"item": "pen", "quantity": None})[1] == "bad_arguments"
    text = run_tool_call(env, schemas, "price", {"quantity": "3", "colour": "red", "size": 1})[0]
    assert text == "error: bad arguments for price: missing item; unexpected colour, size; quantity must be integer"
    assert run_tool_call(env, schemas, "paint", {"colour": "green"})[0] == (
        "error: bad arguments for paint: colour must be one of ['red', 'blue']"
    )


class Lab:
    """A test environment whose tools succeed with text that reads like an error, fail with text that does not,
    return a dict, and are written with async def."""

    def reset(self, question):
        pass

    def measure(self, what: str) -> str:
        """Measure something.

        Args:
            what: the quantity
        """
        if what == "nothing":
            raise ValueError("nothing to measure")
        return "errors in measurement: 3" if what == "noise" else "Error: 12 (the name of a band)"

    def weigh(self, item: str) -> dict:
        """Weigh an item.

        Args:
            item: what to weigh
        """
        return {"item": item, "grams": 12.5}

    async def fetch(self, key: str) -> str:
        """Fetch a value.

        Args:
            key: its key
        """
        return f"value of {key}"


def test_a_calls_outcome_is_what_it_did_not_what_its_text_says(tokenizer):
    """A tool that succeeds with "errors in measurement: 3" or "Error: ..." is a success; one that raises with a
    message that looks like none is a failure; tools/failed_calls counts the calls that failed."""
    schemas = grpo_tools.tool_schemas(Lab())
    assert run_tool_call(Lab(), schemas, "measure", {"what": "noise"}) == ("errors in measurement: 3", None)
    assert run_tool_call(Lab(), schemas, "measure", {"what": "x"}) == ("Error: 12 (the name of a band)", None)
    assert run_tool_call(Lab(), schemas, "measure", {"what": "nothing"})[1] == "raised"
    tools = ToolCalls(tokenizer, Lab, HERMES_TEMPLATE)
    calls = [f'<tool_call>{{"name": "measure", "arguments": {{"what": "{w}"}}}}</tool_call>' for w in ("noise", "x")]
    script = ["\n".join(calls + ['<tool_call>{"name": "measure", "arguments": {"what": "nothing"}}</tool_call>']), "6"]
    prompt = native_prompt(tokenizer, tools)
    turn = scripted_turns(tokenizer, script)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 400, 2, [end], tools)
    assert len(rollout.calls[0]) == 3 and rollout.failed_calls == [1] and rollout.errors["raised"] == [1]
    metrics = grpo_tools.trajectory_metrics(torch.ones(1), torch.ones(1), torch.ones(1), rollout, 1)
    assert metrics["tools/failed_calls"] == pytest.approx(1 / 3)


def test_a_dict_result_is_sent_as_json_and_an_async_tool_is_awaited():
    schemas = grpo_tools.tool_schemas(Lab())
    text, kind = run_tool_call(Lab(), schemas, "weigh", {"item": "pen"})
    assert kind is None and json.loads(text) == {"item": "pen", "grams": 12.5}
    assert run_tool_call(Lab(), schemas, "fetch", {"key": "k"}) == ("value of k", None)


def test_a_tool_without_a_docstring_and_a_tokenizer_without_a_template_stop_in_one_line(
    make_config, monkeypatch, tiny_model_dir
):
    from transformers import AutoTokenizer

    class Bare:
        def reset(self, question):
            pass

        def look(self, x: int) -> int:
            return x

    with pytest.raises(SystemExit, match="tool 'look' cannot be described to the model: it needs type hints"):
        grpo_tools.tool_schemas(Bare())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    args = make_config(grpo_tools, **NATIVE)
    with pytest.raises(
        SystemExit, match=f"the tokenizer of {re.escape(args.model_name_or_path)} has no chat template"
    ):
        grpo_tools.make_tool_format(args, tokenizer)


class Dice:
    """A test environment whose reset draws its state at random and shows it."""

    def reset(self, question):
        import random

        self.face = random.randint(1, 10**9)
        return f"You rolled {self.face}."

    def roll(self) -> int:
        """The face rolled."""
        return self.face


def test_a_reset_that_shows_another_state_each_time_stops_in_one_line(tokenizer):
    tools = ToolCalls(tokenizer, Dice, HERMES_TEMPLATE)
    with pytest.raises(SystemExit, match="reset returned two texts for one question"):
        tools.ask("Which face?")


@pytest.mark.parametrize("name", TEMPLATES)
def test_tool_response_tokens_are_what_the_template_writes_after_the_call(tokenizer, name):
    """The tokens after the policy's end of turn: the rest of the assistant's message, one user turn with every
    result in <tool_response> blocks, the next assistant header (Qwen3, thinking off: its empty think block); worked
    out here as text, in the format the published templates write."""
    kwargs = dict(tools=grpo_tools.tool_schemas(Shop()), chat_template=TEMPLATES[name], enable_thinking=False)
    messages = [{"role": "tool", "name": "price", "content": "4.5"}, {"role": "tool", "name": "pay", "content": "ok"}]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = grpo_tools.tool_response_ids(tokenizer, messages, end, kwargs)
    expected = "\n<|im_start|>user\n<tool_response>\n4.5\n</tool_response>\n<tool_response>\nok\n</tool_response>"
    expected += "<|im_end|>\n<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if name == "qwen3" else "")
    assert tokenizer.decode(ids) == expected
    assert ids == tokenizer(expected, add_special_tokens=False).input_ids  # special tokens as themselves


def scripted_turns(tokenizer, script, header="<|im_start|>assistant"):
    """A policy turn function (contexts, max_tokens) -> [(ids, None)] that writes, for each context, the next text of
    `script` (by the number of turns in the context so far, counted by assistant headers after the prompt's),
    ending it with <|im_end|>, and records the contexts it saw."""
    seen = []

    def turn(contexts, max_tokens):
        out = []
        for context, limit in zip(contexts, max_tokens):
            seen.append(list(context))
            k = tokenizer.decode(context).count(header) - turn.prompt_headers
            ids = tokenizer(script[k], add_special_tokens=False).input_ids + [
                tokenizer.convert_tokens_to_ids("<|im_end|>")
            ]
            out.append((ids[:limit], None))
        return out

    turn.seen = seen
    return turn


def native_prompt(tokenizer, tools, question="What do 3 pens cost, paid by card?"):
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **tools.template_kwargs
    )


@pytest.mark.parametrize("name", TEMPLATES)
def test_native_rollout_trains_exactly_the_sampled_tokens(tokenizer, name):
    """Two calls in one turn, then the answer: the trajectory is the first turn's sampled ids, the template's tokens
    for the two results, the second turn's sampled ids; the loss mask is 1 on the sampled ids alone, and the second
    turn was sampled on exactly the trajectory so far."""
    tools = ToolCalls(tokenizer, Shop, TEMPLATES[name])
    tools.template_kwargs["enable_thinking"] = False
    first = (
        '<tool_call>\n{"name": "price", "arguments": {"item": "pen", "quantity": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "pay", "arguments": {"amount": 4.5, "card": true}}\n</tool_call>'
    )
    script = [first, "Answer: 4.5"]
    prompt = native_prompt(tokenizer, tools)
    turn = scripted_turns(tokenizer, script)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 200, 3, [end], tools)
    turn_ids = [tokenizer(t, add_special_tokens=False).input_ids + [end] for t in script]
    results = [
        {"role": "tool", "name": "price", "content": "4.5"},
        {"role": "tool", "name": "pay", "content": "paid 4.5 by card"},
    ]
    between = grpo_tools.tool_response_ids(tokenizer, results, end, tools.template_kwargs)
    expected = turn_ids[0] + between + turn_ids[1]
    length = len(expected)
    assert rollout.ids[0, :length].tolist() == expected and rollout.real[0].sum() == length
    assert rollout.policy[0, :length].tolist() == [1.0] * len(turn_ids[0]) + [0.0] * len(between) + [1.0] * len(
        turn_ids[1]
    )
    assert turn.seen[1] == prompt + turn_ids[0] + between  # token in, token out
    assert rollout.calls[0] == [
        ('price({"item": "pen", "quantity": 3})', "4.5"),
        ('pay({"amount": 4.5, "card": true})', "paid 4.5 by card"),
    ]
    assert rollout.answers == ["Answer: 4.5"] and rollout.turns == [2] and not rollout.truncated[0]
    assert rollout.errors == {kind: [0] for kind in grpo_tools.ToolCalls.error_kinds}
    assert [env.questions for env in tools.environments] == [[None]]  # one per trajectory, reset once (no question:
    # the prompt was not built by load_tool_prompts)


def test_chat_template_kwargs_reach_every_prompt(make_config, tokenizer, tmp_path):
    """--chat_template_kwargs go to apply_chat_template with the tools: Qwen3's template (the fixture) writes the
    empty think block of thinking-off after the generation prompt only with enable_thinking false."""
    template = tmp_path / "qwen3.jinja"
    template.write_text(chat_templates.QWEN3)
    prompts = {}
    for kwargs in ("{}", '{"enable_thinking": false}'):
        options = dict(chat_template=str(template), chat_template_kwargs=kwargs, max_prompt_length=1280)
        args = make_config(grpo_tools, **{**NATIVE, **options})
        grpo_tools.check_args(args)
        tools = grpo_tools.make_tool_format(args, tokenizer)
        prompts[kwargs] = tokenizer.decode(grpo_tools.load_tool_prompts(args, tokenizer, 1, tools)[0][0])
    assert not prompts["{}"].endswith("<think>\n\n</think>\n\n")
    assert prompts['{"enable_thinking": false}'] == prompts["{}"] + "<think>\n\n</think>\n\n"


class Quiz(Shop):
    """Shop, whose reset adds a line to the prompt after the question."""

    def reset(self, question):
        super().reset(question)
        return f"(Prices for: {question.split()[1]})"


def test_reset_gets_each_trajectorys_question_and_its_text_follows_the_question(make_config, monkeypatch, tokenizer):
    """An environment a user adds above the fence (here by ENVIRONMENTS): reset(question)'s text follows the question
    in every prompt, and each trajectory's own environment is reset with its prompt's question."""
    monkeypatch.setitem(grpo_tools.ENVIRONMENTS, "quiz", lambda args: Quiz())
    args = make_config(grpo_tools, **NATIVE, environment="quiz")
    tools = grpo_tools.make_tool_format(args, tokenizer)
    train_prompts, _, sets = grpo_tools.load_tool_prompts(args, tokenizer, 1, tools)
    with open(os.path.join(args.dataset_path, "train.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f]
    assert [tools.questions[tuple(p)] for p in train_prompts] == questions
    for prompt, question in zip(train_prompts, questions):
        asked = f"{question}\n\n(Prices for: {question.split()[1]}) {args.instruction}<|im_end|>"
        assert tokenizer.decode(prompt).endswith(f"{asked}\n<|im_start|>assistant\n")
    turn = scripted_turns(tokenizer, ["Answer: 1"])
    turn.prompt_headers = tokenizer.decode(train_prompts[0]).count("<|im_start|>assistant")
    multi_turn_rollout(turn, tokenizer, train_prompts[:2], 2, 64, 2, [], tools)
    assert [env.questions for env in tools.environments] == [[q] for q in questions[:2] for _ in range(2)]


def convert(value: float, unit: str, to: str) -> float:
    """Convert a length.

    Args:
        value: the length
        unit: its unit, m or ft
        to: the unit wanted, m or ft
    """
    return value * {"m": 1.0, "ft": 0.3048}[unit] / {"m": 1.0, "ft": 0.3048}[to]


def test_a_plain_function_becomes_a_tool_by_passing_it(make_config, monkeypatch, tokenizer):
    """Tools(f): a user's typed, documented function is the environment's one tool, its schema transformers' own
    (get_json_schema), in every prompt the template renders, and called by name like a method; added above the fence
    by a line in ENVIRONMENTS."""
    from transformers.utils import get_json_schema

    monkeypatch.setitem(grpo_tools.ENVIRONMENTS, "units", lambda args: grpo_tools.Tools(convert))
    args = make_config(grpo_tools, **NATIVE, environment="units", examples=())
    grpo_tools.check_args(args)
    tools = grpo_tools.make_tool_format(args, tokenizer)
    assert tools.schemas == [get_json_schema(convert)]
    prompt = tokenizer.decode(grpo_tools.load_tool_prompts(args, tokenizer, 1, tools)[0][0])
    assert json.dumps(get_json_schema(convert)) in prompt
    env = tools.make_environment()
    assert run_tool_call(env, tools.schemas, "convert", {"value": 10, "unit": "ft", "to": "m"}) == ("3.048", None)
    assert run_tool_call(env, tools.schemas, "convert", {"value": 10, "unit": "ft"})[1] == "bad_arguments"


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # one trajectory: its group's std is undefined
def test_native_rollout_counts_failed_calls_and_answers_with_the_error(tokenizer):
    """Each failed call is answered with its error text (the policy reads it) and counted by kind."""
    tools = ToolCalls(tokenizer, Shop, HERMES_TEMPLATE)
    script = [
        '<tool_call>{"name": "price", "arguments": {"item": "lamp", "quantity": 1}}</tool_call>\n'
        '<tool_call>{"name": "refund", "arguments": {}}</tool_call>',  # a tool that raises; no such tool
        '<tool_call>{"name": "price", "arguments": {"item": "pen", "quantity": "2"}}</tool_call>\n'
        "<tool_call>oops</tool_call>",  # a string for an integer; not JSON
        "Answer: 3",
    ]
    prompt = native_prompt(tokenizer, tools)
    turn = scripted_turns(tokenizer, script)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 400, 3, [end], tools)
    assert rollout.errors == {"bad_json": [1], "unknown_tool": [1], "bad_arguments": [1], "raised": [1]}
    assert [output.split(":")[0] for _, output in rollout.calls[0]] == ["error"] * 4
    assert "<tool_response>\nerror: KeyError: 'lamp'\n</tool_response>" in rollout.texts[0]
    assert rollout.answers == ["Answer: 3"] and rollout.turns == [3]
    metrics = grpo_tools.trajectory_metrics(torch.ones(1), torch.ones(1), torch.ones(1), rollout, 1)
    assert all(metrics[f"tools/errors/{kind}"] == 1.0 for kind in grpo_tools.ToolCalls.error_kinds)


def test_native_rollout_stops_at_max_turns_and_at_the_budget(tokenizer):
    tools = ToolCalls(tokenizer, Shop, HERMES_TEMPLATE)
    call = '<tool_call>{"name": "pay", "arguments": {"amount": 1, "card": true}}</tool_call>'
    prompt = native_prompt(tokenizer, tools)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = scripted_turns(tokenizer, [call] * 5)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 400, 2, [end], tools)
    assert rollout.turns == [3] and len(rollout.calls[0]) == 2 and rollout.unrun_calls == [1]
    assert rollout.answers == [""] and not rollout.truncated[0]  # ended by a call past max_turns
    turn = scripted_turns(tokenizer, [call] * 5)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    short = multi_turn_rollout(turn, tokenizer, [prompt], 1, 30, 2, [end], tools)  # the first turn does not fit
    assert short.truncated[0] and short.real[0].sum() == 30 and short.turns == [1]
    assert short.unrun_calls == [1] and short.calls == [[]]  # its turn is cut before the end of turn: not run
    sampled = len(tokenizer(call, add_special_tokens=False).input_ids) + 1  # the turn and its <|im_end|>
    turn = scripted_turns(tokenizer, [call] * 5)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    cut = multi_turn_rollout(turn, tokenizer, [prompt], 1, sampled + 5, 2, [end], tools)  # 5 of the results fit
    assert cut.truncated[0] and cut.policy[0].tolist() == [1.0] * sampled + [0.0] * 5  # the tool's: not trained
    assert cut.calls[0] == [('pay({"amount": 1, "card": true})', "paid 1 by card")]  # what the tool answered


def test_llama_json_rollout_answers_the_turn_that_is_the_call_with_an_ipython_turn(tokenizer):
    """Llama 3.1's format (the fixture): the turn is the call; its result is the template's ipython turn, then the
    next assistant header; trained tokens are the sampled ones."""
    tools = ToolCalls(tokenizer, Shop, chat_templates.LLAMA31)
    header = "<|start_header_id|>assistant"
    script = ['{"name": "price", "parameters": {"item": "pen", "quantity": 3}}', "Answer: 4.5"]
    prompt = native_prompt(tokenizer, tools)
    turn = scripted_turns(tokenizer, script, header)
    turn.prompt_headers = tokenizer.decode(prompt).count(header)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 200, 3, [end], tools)
    turn_ids = [tokenizer(t, add_special_tokens=False).input_ids + [end] for t in script]
    between = (
        "<|start_header_id|>ipython<|end_header_id|>\n\n4.5<|im_end|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    between = tokenizer(between, add_special_tokens=False).input_ids
    length = len(turn_ids[0] + between + turn_ids[1])
    assert rollout.ids[0, :length].tolist() == turn_ids[0] + between + turn_ids[1] and rollout.real[0].sum() == length
    assert rollout.policy[0, :length].tolist() == [1.0] * len(turn_ids[0]) + [0.0] * len(between) + [1.0] * len(
        turn_ids[1]
    )
    assert rollout.calls[0] == [('price({"item": "pen", "quantity": 3})', "4.5")] and rollout.answers == [
        "Answer: 4.5"
    ]


@pytest.fixture(scope="module")
def llama_tokenizer(tiny_model_dir):
    """SmolLM2's tokenizer with Llama 3's header and end tokens as special tokens, to render its published template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    llama = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": llama + ["<|python_tag|>"]})
    return tokenizer


@pytest.mark.parametrize("end_token", ["<|eom_id|>", "<|eot_id|>"])
def test_a_llama_call_ended_by_eom_runs_on_the_published_template(llama_tokenizer, end_token):
    """Llama 3.1's published template with tools= puts the model in "Environment: ipython", where a call ends with
    <|eom_id|> (the template itself writes <|eot_id|> after a custom tool's call): either way the call runs, its
    result is the template's ipython turn, then the next assistant header; the trained tokens are the sampled ones."""
    tokenizer = llama_tokenizer
    tools = ToolCalls(tokenizer, Shop, published_template("llama3_1"))
    prompt = native_prompt(tokenizer, tools)
    assert "Environment: ipython" in tokenizer.decode(prompt)
    end, eot = tokenizer.convert_tokens_to_ids(end_token), tokenizer.convert_tokens_to_ids("<|eot_id|>")
    script = [
        tokenizer(
            '{"name": "price", "parameters": {"item": "pen", "quantity": 3}}', add_special_tokens=False
        ).input_ids
        + [end],
        tokenizer("Answer: 4.5", add_special_tokens=False).input_ids + [eot],
    ]
    turns = iter(script)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|eom_id|>", "<|eot_id|>")]
    rollout = multi_turn_rollout(lambda c, m: [(next(turns), None)], tokenizer, [prompt], 1, 200, 3, stops, tools)
    # The template writes a tool's content through tojson (a string is iterable to Jinja): "4.5", quoted.
    between = '<|start_header_id|>ipython<|end_header_id|>\n\n"4.5"<|eot_id|>'
    between += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    between = tokenizer(between, add_special_tokens=False).input_ids
    expected = script[0] + between + script[1]
    assert rollout.ids[0, : len(expected)].tolist() == expected and rollout.real[0].sum() == len(expected)
    assert rollout.policy[0, : len(expected)].tolist() == [1.0] * len(script[0]) + [0.0] * len(between) + [1.0] * len(
        script[1]
    )
    assert rollout.calls[0] == [('price({"item": "pen", "quantity": 3})', "4.5")] and rollout.unrun_calls == [0]
    assert rollout.answers == ["Answer: 4.5"]


def test_an_unclosed_call_runs_and_a_call_in_reasoning_does_not(tokenizer):
    """Hermes: a call whose </tool_call> the turn never writes is run (vLLM's parser reads it to the end of the
    turn); a call inside <think> is a thought: the turn is the answer."""
    tools = ToolCalls(tokenizer, Shop, HERMES_TEMPLATE)
    call = '{"name": "pay", "arguments": {"amount": 1, "card": true}}'
    script = [f"<tool_call>\n{call}\n", "Answer: 1"]
    prompt = native_prompt(tokenizer, tools)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = scripted_turns(tokenizer, script)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 200, 2, [end], tools)
    assert rollout.calls[0] == [('pay({"amount": 1, "card": true})', "paid 1 by card")] and rollout.turns == [2]
    thought = f"<think>\n<tool_call>{call}</tool_call>\n</think>\nAnswer: 1"
    turn = scripted_turns(tokenizer, [thought])
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 200, 2, [end], tools)
    assert rollout.calls[0] == [] and rollout.turns == [1] and rollout.answers == [thought]


def test_a_template_that_renders_earlier_turns_again_changes_nothing_trained(tokenizer):
    """Qwen3 (thinking off): the generation prompt holds an empty <think> block, which the template drops from that
    turn once it is no longer the last. Rendering the conversation again would put other tokens where the policy's
    were; the rollout keeps the sampled ones and the prompt's, and only appends the template's tokens for the tool
    turn."""
    tools = ToolCalls(tokenizer, Shop, chat_templates.QWEN3)
    tools.template_kwargs["enable_thinking"] = False
    script = [
        '<tool_call>\n{"name": "price", "arguments": {"item": "book", "quantity": 2}}\n</tool_call>',
        "Answer: 24",
    ]
    prompt = native_prompt(tokenizer, tools)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    turn = scripted_turns(tokenizer, script)
    turn.prompt_headers = tokenizer.decode(prompt).count("<|im_start|>assistant")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = multi_turn_rollout(turn, tokenizer, [prompt], 1, 200, 3, [end], tools)
    ours = prompt + rollout.ids[0, : int(rollout.real[0].sum())].tolist()
    call = {"type": "function", "function": {"name": "price", "arguments": {"item": "book", "quantity": 2}}}
    conversation = [
        {"role": "user", "content": "What do 3 pens cost, paid by card?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "price", "content": "24.0"},
        {"role": "assistant", "content": "Answer: 24"},
    ]
    again = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **tools.template_kwargs)
    assert again[: len(ours)] != ours  # rendered again, the first assistant turn loses its <think> block
    assert tokenizer.decode(ours).count("<think>") == 2 and tokenizer.decode(again).count("<think>") == 1
    mask = rollout.policy[0, : int(rollout.real[0].sum())]
    trained = [t for t, m in zip(rollout.ids[0].tolist(), mask.tolist()) if m]
    assert trained == [t for s in script for t in tokenizer(s, add_special_tokens=False).input_ids + [end]]


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_call_ended_by_a_stop_token_that_closes_no_turn_ends_the_trajectory(tokenizer, name):
    """Qwen's generation config stops at <|endoftext|> beside <|im_end|>; no turn of the template ends with it, so
    the template writes no tool turn after it (Qwen3's would have had to render the turn again): the calls are not
    run, the trajectory is the sampled turn alone, trained, and counted as a turn with calls not run."""
    tools = ToolCalls(tokenizer, Shop, TEMPLATES[name])
    tools.template_kwargs["enable_thinking"] = False
    end, text_end = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    messages = [{"role": "tool", "name": "price", "content": "4.5"}]
    assert grpo_tools.tool_response_ids(tokenizer, messages, text_end, tools.template_kwargs) is None
    assert grpo_tools.tool_response_ids(tokenizer, messages, end, tools.template_kwargs)  # <|im_end|> closes a turn
    sampled = tokenizer('<tool_call>{"name": "price", "arguments": {"item": "pen", "quantity": 3}}</tool_call>',
                        add_special_tokens=False).input_ids + [text_end]  # fmt: skip
    prompt = native_prompt(tokenizer, tools)
    rollout = multi_turn_rollout(
        lambda c, m: [(sampled, None)], tokenizer, [prompt], 1, 200, 3, [end, text_end], tools
    )
    assert rollout.ids[0, : len(sampled)].tolist() == sampled and rollout.real[0].sum() == len(sampled)
    assert rollout.policy[0].sum() == len(sampled) and rollout.turns == [1] and rollout.unrun_calls == [1]
    assert rollout.calls == [[]] and rollout.answers == [""] and not rollout.truncated[0]


class Ticker:
    """A test environment with its own reward: right when its tool was called as often as the question says."""

    def reset(self, question):
        self.wanted, self.ticks = question.count("tick"), 0

    def tick(self) -> int:
        """Count one more."""
        self.ticks += 1
        return self.ticks

    def reward(self, answer, gold):
        return float(self.ticks == self.wanted)


def test_an_environment_with_a_reward_scores_its_own_trajectory(tokenizer):
    """An environment's reward(answer, gold) replaces the verifier for its trajectory, read from that trajectory's
    own environment after the rollout: both trajectories call once and answer the gold answer, only the one whose
    question asks one tick is right. Without the method, the verifier's score (1 for both)."""
    tools = ToolCalls(tokenizer, Ticker, HERMES_TEMPLATE, score=grpo_tools.compute_rewards)
    prompts = [native_prompt(tokenizer, tools, q) for q in ("Say tick.", "Say tick tick.")]
    tools.questions = {tuple(p): q for p, q in zip(prompts, ("Say tick.", "Say tick tick."))}
    turn = scripted_turns(tokenizer, ['<tool_call>{"name": "tick", "arguments": {}}</tool_call>', "Answer: 1"])
    turn.prompt_headers = tokenizer.decode(prompts[0]).count("<|im_start|>assistant")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = multi_turn_rollout(turn, tokenizer, prompts, 1, 200, 3, [end], tools)
    assert rollout.answers == ["Answer: 1"] * 2 and [len(c) for c in rollout.calls] == [1, 1]
    rewards, correct, formatted = tools.rewards(rollout.answers, ["1", "1"], 0.5)
    assert correct.tolist() == [1.0, 0.0] and rewards.tolist() == [1.5, 0.5] and formatted.tolist() == [1.0, 1.0]
    tools.environments = [Shop(), Shop()]  # no reward method: the verifier's
    assert tools.rewards(rollout.answers, ["1", "1"], 0.0)[1].tolist() == [1.0, 1.0]


NATIVE = dict(tool_format="native", max_prompt_length=640, response_length=64)


@pytest.mark.slow
def test_native_run_is_on_policy_with_kl_zero_and_logs_the_errors_by_kind(make_config, monkeypatch, tmp_path):
    """A run under --tool_format native with the scripted policy (tests/fixed_rollout.py: Hermes calls, some not
    JSON, some the calculator refuses): ratio 1 and approxkl 0 on each step's first minibatch, KL 0 before the first
    update, the tool and error metrics logged, and every prompt renders the calculator's schema and the example's
    call in the Hermes template (SmolLM2's own ignores tools=)."""
    import fixed_rollout

    fixed_rollout.patch(grpo_tools, monkeypatch.setattr)
    args = make_config(grpo_tools, **NATIVE, total_steps=2, beta=0.04, learning_rate=1e-3, micro_batch_size=2)
    lines = read_metrics(grpo_tools.main(args))
    for line in lines[1:]:
        assert line["policy/ratio_first_minibatch"] == 1.0 and line["policy/approxkl_first_minibatch"] == 0.0
        assert line["tools/calls"] > 0 and line["tools/tool_tokens"] > 0
        assert {f"tools/errors/{kind}" for kind in grpo_tools.ToolCalls.error_kinds} <= set(line)
    assert lines[1]["objective/kl"] == 0.0 and lines[2]["objective/kl"] != 0.0
    assert sum(line["tools/errors/bad_json"] for line in lines[1:]) > 0
    with open(os.path.join(args.output_dir, args.run_name, "samples.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    assert prompts and all('"name": "calculate"' in p and "<tool_call>" in p for p in prompts)
    assert args.system_prompt is None and args.max_prompt_length == 640


def test_price_list_tasks_and_environment_agree_with_prices_written_here(tmp_path, monkeypatch):
    """The second environment's tasks: each answer is the items' prices (written here from the shops' lists) times
    their quantities, the questions distinct and each pair of items in one order; its tools answer the same, and its
    shown exchanges (two-item ones for price_list, one-item ones for price_list_one) call them as a policy must.
    make assets' one-item task holds each one-item question there is, a third of them held out."""
    prices = {
        ("north", "pencil"): 35, ("north", "notebook"): 240, ("north", "eraser"): 55, ("north", "ruler"): 120,
        ("north", "stapler"): 890, ("north", "marker"): 145, ("south", "pencil"): 40, ("south", "notebook"): 215,
        ("south", "eraser"): 60, ("south", "ruler"): 105, ("south", "stapler"): 935, ("south", "marker"): 130,
        ("east", "pencil"): 30, ("east", "notebook"): 260, ("east", "eraser"): 45, ("east", "ruler"): 135,
        ("east", "stapler"): 860, ("east", "marker"): 155,
    }  # fmt: skip
    env = price_list.PriceList()
    two = re.compile(r"At the (\w+) shop, what do (\d) (\w+)s and (\d) (\w+)s cost together, in cents\?")
    one = re.compile(r"At the (\w+) shop, what do (\d) (\w+)s cost, in cents\?")
    rows = price_list.price_list_rows(seed=3, count=300)
    assert len({row["question"] for row in rows}) == 300 and rows == price_list.price_list_rows(seed=3, count=300)
    for row in rows:
        shop, q1, item1, q2, item2 = two.fullmatch(row["question"]).groups()
        assert item1 != item2 and int(row["answer"]) == int(q1) * prices[shop, item1] + int(q2) * prices[shop, item2]
        assert env.add(env.price(shop, item1, int(q1)), env.price(shop, item2, int(q2))) == int(row["answer"])
    singles = price_list.price_list_rows(seed=3, count=144, items=1)  # 3 shops x 6 items x quantities 2-9: all
    assert len({row["question"] for row in singles}) == 144
    for row in singles:
        shop, q, item = one.fullmatch(row["question"]).groups()
        assert int(row["answer"]) == int(q) * prices[shop, item] == env.price(shop, item, int(q))
    schemas = grpo_tools.tool_schemas(env)
    assert run_tool_call(env, schemas, "price", {"shop": "west", "item": "pen", "quantity": 1})[1] == "raised"
    assert run_tool_call(env, schemas, "add", {"a": 2, "b": "3"})[1] == "bad_arguments"
    for name, items in (("price_list", 2), ("price_list_one", 1)):  # each environment shows its kind of question
        shown = grpo_tools.ENVIRONMENTS[name](None).EXAMPLES
        assert len(shown) == 3
        for messages in shown:
            shop, *pairs = (one if items == 1 else two).match(messages[0]["content"]).groups()
            gold = sum(int(q) * prices[shop, item] for q, item in zip(pairs[::2], pairs[1::2]))
            assert messages[-1] == {"role": "assistant", "content": f"Answer: {gold}"}
            env_calls = [c["function"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
            results = [m["content"] for m in messages if m["role"] == "tool"]
            assert [str(getattr(env, c["name"])(**c["arguments"])) for c in env_calls] == results
            assert [c["name"] for c in env_calls] == ["price"] * items + ["add"] * (items - 1)

    from benchmark.assets import prepare_assets

    monkeypatch.setattr(prepare_assets, "TEST_SIZE", 5)
    fake = lambda seed, count, items=2: [{"question": f"{items}-{k}", "answer": str(k)} for k in range(count)]  # noqa: E731
    monkeypatch.setattr(price_list, "price_list_rows", fake)
    prepare_assets.prepare_price_list(tmp_path)
    lines = {
        (name, split): [json.loads(line)["question"] for line in open(tmp_path / "data" / name / f"{split}.jsonl")]
        for name in ("price_list", "price_list_one") for split in ("train", "test")
    }  # fmt: skip
    assert len(lines["price_list", "test"]) == 5 and len(lines["price_list", "train"]) == 2000
    assert lines["price_list_one", "test"] + lines["price_list_one", "train"] == [f"1-{k}" for k in range(144)]
    assert len(lines["price_list_one", "test"]) == 48


@pytest.mark.slow
def test_native_run_on_the_price_list_environment(make_config, monkeypatch, tmp_path):
    """--environment price_list: its example (two price calls in one turn, then add) is shown in the Hermes
    template, its tools are described; the scripted policy's calculator calls are unknown tools there, counted."""
    import fixed_rollout

    rows = price_list.price_list_rows(seed=0, count=40)
    task = tmp_path / "price_list"
    task.mkdir()
    for split, part in (("train", rows[:30]), ("test", rows[30:])):
        (task / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    fixed_rollout.patch(grpo_tools, monkeypatch.setattr)
    options = {**NATIVE, "max_prompt_length": 1152}  # two tools, three exchanges of three calls each
    args = make_config(grpo_tools, **options, environment="price_list", dataset_path=str(task))
    lines = read_metrics(grpo_tools.main(args))
    assert sum(line["tools/errors/unknown_tool"] for line in lines[1:]) > 0
    with open(os.path.join(args.output_dir, args.run_name, "samples.jsonl")) as f:
        prompt = json.loads(f.readline())["prompt"]
    assert '"name": "price"' in prompt and '"name": "add"' in prompt and prompt.count("<tool_call>") >= 4


@pytest.mark.parametrize(
    "overrides, names",
    [
        (dict(environment="weather"), ["--environment", "calculator", "price_list"]),
        (dict(chat_template="no/such/template.jinja"), ["--chat_template", "no such file"]),
        (dict(examples=(("Calculate 1 * 2.", "<tool_call>..."),)), ["--examples", "EXAMPLE"]),
        (dict(prompt_template="Q: {question}\nA:"), ["--prompt_template", "chat template"]),
        (dict(tool_format="calc", chat_template="x.jinja"), ["--chat_template", "native"]),
        (dict(chat_template_kwargs='{"enable_thinking": false'), ["--chat_template_kwargs", "JSON object"]),
        (dict(chat_template_kwargs="[1]"), ["--chat_template_kwargs", "JSON object"]),
    ],
)
def test_bad_native_flags_stop_in_one_line_before_any_model_loads(make_config, monkeypatch, overrides, names):
    from conftest import NoModelLoads, one_line_error

    monkeypatch.setattr(grpo_tools, "AutoModelForCausalLM", NoModelLoads)
    one_line_error(grpo_tools.main, make_config(grpo_tools, **{**NATIVE, **overrides}), *names)


@pytest.mark.slow
def test_vllm_and_hf_turns_stop_at_the_end_of_turn_alike_under_native(monkeypatch):
    """The embedded model under --tool_format native (no stop string): vLLM's and HF generate's greedy turns end at
    the same place, the end-of-turn token or the budget, with nothing after it, and are the same tokens."""
    from conftest import SMOLLM2_DIR, require_vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_vllm()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    args = grpo_tools.Config(tool_format="native", vllm=True, seed=1)
    tools = grpo_tools.make_tool_format(args, tokenizer)
    rows = [{"question": f"Calculate {a} * {b}.", "answer": str(a * b)} for a, b in [(874, 404), (57, 912), (36, 41)]]
    prompts, _ = grpo_tools._build_prompts(tokenizer, rows, args, tools.examples, tools.template_kwargs)
    stop_ids = grpo_tools._stop_token_ids(tokenizer, SMOLLM2_DIR)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()
    hf = grpo_tools._hf_turns(model, tokenizer, prompts, [40] * 3, 0.0, 1.0, tokenizer.pad_token_id, stop_ids, ())
    llm = grpo_tools._start_vllm(args, SMOLLM2_DIR, 0, 1, sorted(os.sched_getaffinity(0)))
    try:
        vllm = grpo_tools._vllm_turns(llm, tokenizer, prompts, [40] * 3, 0.0, 1.0, stop_ids, ())
    finally:
        llm.llm_engine.engine_core.shutdown()
    for (a, _), (b, _) in zip(hf, vllm):
        for ids in (a, b):
            assert len(ids) == 40 or ids[-1] in stop_ids
            assert not any(t in stop_ids for t in ids[:-1])
        assert a == b, (tokenizer.decode(a), tokenizer.decode(b))


UNITS = '''
class Units:
    """Lengths in metres: an environment of one tool with two typed arguments."""

    def reset(self, question):
        pass

    def to_metres(self, value: float, unit: Literal["cm", "km"]) -> float:
        """A length in metres.

        Args:
            value: the length
            unit: its unit
        """
        return value / 100 if unit == "cm" else value * 1000


'''


def test_a_new_tool_and_environment_are_written_above_the_fence_alone(make_config, tmp_path, tokenizer):
    """A copy of grpo_tools.py gains an environment with a new tool of two typed arguments: a class and its
    ENVIRONMENTS line, both above the fence, nothing below it edited. The copy offers the tool to the model and runs a
    call to it; the same class in a file of its own runs by --environment FILE.py:CLASS, the script unedited."""
    import importlib.util

    from benchmark.checks.budget import FENCE

    with open(grpo_tools.__file__) as f:
        above, below = f.read().split(FENCE)
    entry = 'ENVIRONMENTS = {\n    "units": lambda args: Units(),\n'
    (tmp_path / "copy_of_grpo_tools.py").write_text(
        above.replace("ENVIRONMENTS = {\n", UNITS + entry, 1) + FENCE + below
    )
    (tmp_path / "units.py").write_text("from typing import Literal\n\n" + UNITS)
    spec = importlib.util.spec_from_file_location("copy_of_grpo_tools", tmp_path / "copy_of_grpo_tools.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    for module, environment in ((copy, "units"), (grpo_tools, f"{tmp_path / 'units.py'}:Units")):
        args = make_config(grpo_tools, config_class=module.Config, **NATIVE, environment=environment, examples=())
        module.check_args(args)
        tools = module.make_tool_format(args, tokenizer)
        (schema,) = [s["function"] for s in tools.schemas]
        assert schema["name"] == "to_metres" and schema["parameters"]["required"] == ["value", "unit"]
        assert schema["parameters"]["properties"]["unit"]["enum"] == ["cm", "km"]
        prompt = tokenizer.decode(module.load_tool_prompts(args, tokenizer, 1, tools)[0][0])
        assert json.dumps(schema["parameters"]["properties"]["unit"]) in prompt  # described to the model
        tools.begin([[0]], 1)
        turn = '<tool_call>{"name": "to_metres", "arguments": {"value": 250, "unit": "cm"}}</tool_call>'
        assert tools.calls(turn) == [("to_metres", {"value": 250, "unit": "cm"})]
        assert module.run_tool_call(tools.environments[0], tools.schemas, *tools.calls(turn)[0]) == ("2.5", None)
    with pytest.raises(SystemExit, match="^error: --environment .*units.py:Meters: .* defines no class 'Meters'$"):
        args = make_config(grpo_tools, **NATIVE, environment=f"{tmp_path / 'units.py'}:Meters", examples=())
        grpo_tools.check_args(args)
        grpo_tools.make_tool_format(args, tokenizer)
    with pytest.raises(SystemExit, match="^error: --environment nowhere.py:Units: no such file$"):
        grpo_tools.check_args(make_config(grpo_tools, **NATIVE, environment="nowhere.py:Units", examples=()))


def test_a_template_that_ignores_tools_takes_the_model_folders_tool_template_or_stops(
    make_config, tmp_path, tiny_model_dir, tokenizer
):
    """SmolLM2's template ignores tools=: native calls use the tool template in the model's folder (make assets writes
    it for the embedded model), and a folder without one stops in one line naming --chat_template."""
    from conftest import TOOL_TEMPLATE

    args = make_config(grpo_tools, **NATIVE, examples=())
    grpo_tools.check_args(args)
    assert grpo_tools.make_tool_format(args, tokenizer).template_kwargs["chat_template"] == HERMES_TEMPLATE
    bare = shutil.copytree(tiny_model_dir, tmp_path / "bare")
    os.remove(bare / TOOL_TEMPLATE)
    args = make_config(grpo_tools, **NATIVE, examples=(), model_name_or_path=str(bare))
    grpo_tools.check_args(args)
    with pytest.raises(
        SystemExit, match=r"^error: the chat template of .*bare renders no tools: --chat_template FILE"
    ):
        grpo_tools.make_tool_format(args, tokenizer)
