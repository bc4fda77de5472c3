"""The price_list tasks' environment for grpo_tools.py --tool_format native, in a file of its own: what items cost at
one of three shops, looked up and added with two tools of typed arguments. grpo_tools' ENVIRONMENTS loads it by name
(price_list: PriceList, price_list_one: PriceListOne), or by path:

    python grpo_tools.py --tool_format native --environment price_list_one --dataset_path assets/data/price_list_one
    python grpo_tools.py --tool_format native --environment environments/price_list.py:PriceListOne \
        --dataset_path assets/data/price_list_one

make assets writes the tasks' questions with price_list_rows (docs/grpo_tools.md, "The second environment").
"""

import numpy as np


def _call(*calls):
    """An assistant message making these calls, (name, arguments) each."""
    calls = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def _result(name, content):
    return {"role": "tool", "name": name, "content": content}


def price_exchange(shop, *items):
    """One exchange of the price_list task, as EXAMPLES shows it: the question about (quantity, item) pairs at a shop,
    a `price` call for each item in one turn, their results, for two items an `add` call and its result, the answer."""
    costs = [PriceList.price(shop, item, quantity) for quantity, item in items]
    messages = [
        {"role": "user", "content": f"{price_question(shop, items)} Give the final answer after 'Answer:'."},
        _call(*[("price", {"shop": shop, "item": item, "quantity": quantity}) for quantity, item in items]),
        *[_result("price", str(cost)) for cost in costs],
    ]
    if len(costs) == 2:
        messages += [_call(("add", {"a": costs[0], "b": costs[1]})), _result("add", str(sum(costs)))]
    return messages + [{"role": "assistant", "content": f"Answer: {sum(costs)}"}]


def price_question(shop, items):
    """ "At the east shop, what do 2 rulers cost, in cents?", or "... 2 rulers and 5 erasers cost together, ..." """
    listed = " and ".join(f"{quantity} {item}s" for quantity, item in items)
    return f"At the {shop} shop, what do {listed} cost{' together' if len(items) > 1 else ''}, in cents?"


class PriceList:
    """The price_list tasks' environment (their questions: make assets): what one or two kinds of items cost at one of
    three shops, whose prices the policy looks up (no prompt holds them) and adds. Two tools of several typed
    arguments; its EXAMPLES show two-item questions: two `price` calls, then `add`."""

    PRICES = {  # cents
        "north": {"pencil": 35, "notebook": 240, "eraser": 55, "ruler": 120, "stapler": 890, "marker": 145},
        "south": {"pencil": 40, "notebook": 215, "eraser": 60, "ruler": 105, "stapler": 935, "marker": 130},
        "east": {"pencil": 30, "notebook": 260, "eraser": 45, "ruler": 135, "stapler": 860, "marker": 155},
    }
    # Three exchanges, as the calculator's: after one, SmolLM2-135M writes a <tool_response> itself, never a call;
    # shown two-item exchanges, it makes two calls for a one-item question too (docs/grpo_tools.md).
    SHOWN = {
        2: [("east", (2, "ruler"), (5, "eraser")), ("north", (3, "pencil"), (4, "marker")),
            ("south", (6, "notebook"), (2, "stapler"))],
        1: [("east", (2, "ruler")), ("north", (4, "marker")), ("south", (6, "notebook"))],
    }  # fmt: skip

    ITEMS = 2  # the kind of question the examples show

    def __init__(self):
        self.EXAMPLES = [price_exchange(shop, *pairs) for shop, *pairs in self.SHOWN[self.ITEMS]]

    def reset(self, question):
        """Called with its question before a trajectory's first turn (the prices do not change; nothing added)."""

    @classmethod  # so that price_exchange and price_list_rows price with the tool itself
    def price(cls, shop: str, item: str, quantity: int) -> int:
        """The price in cents of some items at a shop.

        Args:
            shop: the shop: north, south or east
            item: pencil, notebook, eraser, ruler, stapler or marker
            quantity: how many
        """
        if shop not in cls.PRICES or item not in cls.PRICES[shop]:
            raise KeyError(f"no {item!r} at a shop {shop!r}")
        return cls.PRICES[shop][item] * quantity

    def add(self, a: int, b: int) -> int:
        """The sum of two whole numbers.

        Args:
            a: the first
            b: the second
        """
        return a + b


class PriceListOne(PriceList):
    """The one-item task's: its EXAMPLES make one `price` call; `add` is offered and not needed."""

    ITEMS = 1


def price_list_rows(seed, count, items=2):
    """`count` distinct questions of the price_list tasks about `items` (1 or 2) kinds of items at a shop
    (price_question; quantities 2-9, two items in PRICES' order) with their answers, from a seeded stream."""
    rng, rows = np.random.default_rng(seed), {}
    shops, names = list(PriceList.PRICES), list(PriceList.PRICES["north"])
    while len(rows) < count:
        shop, quantities = str(rng.choice(shops)), rng.integers(2, 10, items)
        chosen = sorted(rng.choice(names, items, replace=False), key=names.index)  # one order: no fact in both splits
        pairs = [(int(q), str(item)) for q, item in zip(quantities, chosen)]
        question, answer = price_question(shop, pairs), sum(PriceList.price(shop, item, q) for q, item in pairs)
        rows.setdefault(question, {"question": question, "answer": str(answer)})
    return list(rows.values())
