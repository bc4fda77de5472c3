"""The step verifier (step_arithmetic, in ppo_prm_clip.py and its copy in reward_modeling.py, which labels --prm) on
steps as models write them. A prefix scores its worst step, so one right step called wrong zeroes every later label.
The rule (issue 54): a right step is never called wrong, a wrong step never right; what cannot be read is unchecked
(None). Words that are numbers ("half", "twice", "a dozen") may be read or left unchecked, never called wrong."""

import importlib
import math
import random

import pytest

# Each verdict was written by hand: True (right), False (wrong), None (cannot be read). "failed before" marks the rows
# the verifier got wrong before issue 54 (its verdict in parentheses).
VERIFIER_TABLE = [
    # A word or a fraction before the number (it read "Half of 20 = 10" as "20 = 10").
    ("Half of 20 = 10", None),  # failed before (False)
    ("half of 20 = 10, so she keeps 20 - 10 = 10 apples.", True),  # failed before (False)
    ("1/2 of 20 = 10", True),  # failed before (False)
    ("1/2 of 20 = 12", False),
    ("3/4 of 20 = 15", True),  # failed before (False)
    ("She spends 1/3 of 60 = 20 dollars on food.", True),  # failed before (False)
    ("He gives away 2/5 of 30 = 13 marbles.", False),
    ("\\( \\frac{1}{2} \\) of 20 = 10", True),  # failed before (False)
    ("Twice 5 = 10", None),  # failed before (False)
    ("Twice 5 + 2 = 12", None),  # failed before (False)
    ("Double 7 = 14", None),  # failed before (False)
    ("A third of 30 = 10", None),  # failed before (False)
    ("Each friend gets 1/4 of the 20 = 5 cookies.", None),  # failed before (False)
    ("The sum of 3 and 4 = 7", None),  # failed before (False)
    ("5 more than 3 * 2 = 11", None),  # failed before (False)
    ("Multiply 9 by 6 = 54", None),  # failed before (False)
    ("She bought 3 packs of 12 = 36 pencils.", None),  # failed before (False)
    ("A dozen eggs = 12 eggs", None),
    ("Twice as many as 12 is 2 * 12 = 24.", True),
    # Percentages.
    ("20 / 80 = 25%", True),  # failed before (False)
    ("1/4 = 0.25 = 25%", True),  # failed before (False)
    ("That is a 3/12 = 25% increase.", True),  # failed before (False)
    ("20 / 80 = 20%", False),
    ("20 / 80 = 0.25%", False),  # failed before (True): the "%" was not read
    ("(20 / 80) * 100 = 25%", True),
    ("100 * 0.25 = 25%", True),
    ("The price rose by 12 / 48 * 100 = 25 percent.", True),
    ("1/3 = 33.33%", True),  # failed before (False)
    ("1/3 = 33%", True),  # failed before (False): a percentage stands for the values that round to it
    ("1/3 = 34%", False),
    ("The chance of two in a row is 50% * 50% = 25%.", True),  # GSM8K, failed before (False)
    ("100% - 40% = 60%", True),  # GSM8K, failed before (None)
    ("100% - 40% = 50%", False),  # failed before (None)
    ("He got 45 / 50 * 100 = 90% of the questions right.", True),
    ("So 30% of 50 = 15 students.", True),
    ("So 30% of 50 = 20 students.", False),
    ("The tax is 8% * $25 = $2.", True),
    ("The sale price is $80 + 20% = $96.", None),  # 20% of 80, not 0.2
    ("10 % 3 = 1", None),  # failed before (False): a remainder
    ("7 puppies / 20 puppies * 100% = 35%", None),  # GSM8K
    # Notation it cannot read: unchecked, not wrong.
    ("3:4 = 0.75", None),  # failed before (False)
    ("The ratio is 3:5, so the boys are 3/8 * 40 = 15.", True),
    ("3:5 = 3/5 = 0.6", True),  # failed before (False)
    ("9:00 to 5:00 = 8 hours", None),  # failed before (False)
    ("7:30 + 2 = 9:30", None),  # failed before (False)
    ("12:00 - 8:45 = 3:15", None),  # failed before (False)
    ("He worked from 9 to 5, so 17 - 9 = 8 hours.", True),
    ("10 ÷ 4 = 2 R 2", None),  # failed before (False)
    ("10 ÷ 4 = 2 remainder 2", None),  # failed before (False)
    ("7 / 2 = 3 and a half", None),  # failed before (False)
    ("7 / 2 = 3 and 1/2", None),  # failed before (False)
    ("10 ÷ 4 = 2.5", True),
    ("10 mod 3 = 1", None),  # failed before (False)
    ("2/3 = 0.666... = 66.67%", None),  # failed before (False): neither rounded nor exact
    ("10 / 3 = 3.(3)", None),  # failed before (False)
    ("\\( 1{,}000 + 500 = 1{,}500 \\)", True),  # failed before (False)
    ("\\( 1{,}000 + 500 = 1{,}600 \\)", False),
    ("2,5 + 1 = 3,5", None),  # failed before (False): a decimal comma
    ("12,5 * 2 = 25", None),  # failed before (False)
    ("1,00,000 + 1 = 100,001", None),  # failed before (False)
    ("100,000 + 1 = 100,001", True),
    ("$1,200 - $200 = $1,000", True),
    ("2 hours 30 minutes = 150 minutes", None),
    ("Let \\( n = 5 \\), then \\( n^2 = 25 \\).", None),
    ("2x + 3 = 11, so 2x = 8 and x = 4.", None),
    ("If x = 4, then 2 * 4 + 3 = 11.", True),
    ("If x = 4, then 2 * 4 + 3 = 12.", False),
    ("y = 3 * 4 = 12", True),
    ("a_2 = a_1 + 3 = 8", None),
    ("x^2 = 9", None),
    ("a_1 = 5", None),
    # Wrong steps that passed as unchecked.
    ("Then -3 + 5 = 3.", False),  # failed before (None): the sign after a word was read as a minus
    ("Then -3 + 5 = 2.", True),  # failed before (None)
    ("\\$12 + \\$3 = \\$16", False),  # failed before (None): the backslash
    ("\\$12 + \\$3 = \\$15", True),  # failed before (None)
    ("3 hours * 60 minutes = 190 minutes", False),  # failed before (None): units between the operands
    ("3 hours * 60 minutes = 180 minutes", True),  # failed before (None)
    ("4 boxes * 12 pencils = 46 pencils", False),  # failed before (None)
    ("6 feet * 12 inches = 72 inches", True),  # failed before (None)
    ("5 apples + 3 apples = 9 apples", False),  # failed before (None)
    ("10 dollars - 3 dollars = 7 dollars", True),  # failed before (None)
    ("1 hour + 30 minutes = 90 minutes", None),  # a conversion
    ("2 hours * 60 minutes = 7200 seconds", None),
    ("120 minutes / 60 minutes = 2 hours", None),
    ("3 apples + 2 oranges = 5 fruits", None),
    ("2 hours * 60 = 120 minutes", None),
    ("3 hours * 60 minutes = 180 minutes = 3 hours", None),
    ("1 kg + 500 g = 1500 g", None),
    ("\\( 12 \\text{ apples} + 3 \\text{ apples} = 15 \\text{ apples} \\)", True),  # failed before (None)
    ("- 15 + 27 = 42", True),  # failed before (False): a list bullet, not a minus
    ("- 15 + 27 = 41", False),
    # GSM8K prose, LaTeX, Markdown.
    ("Natalia sold 48/2 = 24 clips in May.", True),
    ("Natalia sold 48/2 = 25 clips in May.", False),
    ("Weng earns 12/60 = $0.2 per minute.", True),
    ("She still needs 100 - 50 - 30 - 15 = $5.", True),
    ("She still needs 100 - 50 - 30 - 15 = $15.", False),
    ("Julie read 12 x 2 = 24 pages today.", True),
    ("Half of the remaining pages is 84 / 2 = 42 pages.", True),
    ("Half of the remaining pages is 84 / 2 = 40 pages.", False),
    ("There are 80/100 * 10 = 8 more purple flowers than yellow.", True),
    ("So in total Mark has 28 + 7 = 36 plants.", False),
    ("The small cubes used 8 times 1/2 equals 4 ounces.", True),  # GSM8K, failed before (None)
    ("Peter used 12 plus 14 plus 4 equals 31 ounces.", False),  # failed before (None)
    ("He is 3 years older, so 12 + 3 = 15 years old.", True),
    ("Profit = 150 - 120 = 30, which is 30 / 120 = 25% of the cost.", True),  # failed before (False)
    ("The temperature fell by 5 - (-3) = 8 degrees.", True),
    ("$2.50 * 4 = $10.50", False),
    ("3 * $1.99 = $5.97", True),
    ("**Step 2:** 48 / 2 = **24**", True),
    ("\\( \\frac{3}{4} \\times 20 = 15 \\)", True),
    ("$\\frac{20}{80} \\times 100 = 25\\%$", True),
    ("\\( 0.25 = 25\\% \\)", True),  # failed before (False)
    ("\\[ 48 \\div 2 = 24 \\]", True),
    ("\\sqrt{49} = 8", False),
    ("The answer is \\(\\boxed{18}\\).", None),
    ("Total: \\( 48 + 24 = \\boxed{72} \\)", True),  # failed before (None)
    ("Total: \\( 48 + 24 = \\boxed{73} \\)", False),  # failed before (None)
    # The project's measurements (FACTS).
    ("2^3 = 8", True),
    ("5^2 = 25", True),
    ("√16 = 4", True),
    ("10 / 3 = 3.33", True),
    # Issue 65: a rounded operand, a running total, a floor in context. "failed before" marks the rows issue 54's
    # verifier got wrong (a rounding interval was given to a side that is a lone number only).
    ("33.3% of 90 = 30", True),  # failed before (False)
    ("16.67% of 60 = 10", True),  # failed before (False)
    ("0.67 * 30 = 20", True),  # failed before (False)
    ("0.333 * 3 = 1", True),  # failed before (False)
    ("Each gets 10 / 3 = 3.33, and 3 * 3.33 = 10", True),  # failed before (False)
    ("He pays 3 * 1.33 = 4 dollars.", True),  # failed before (False)
    ("33% of 90 = 30", True),  # failed before (False): a whole percentage is rounded too
    ("66.7% * 12 = 8", True),  # failed before (False)
    ("12 x 66.7% = 8", True),  # failed before (False)
    ("0.67 * 30 = 21", False),
    ("33.3% of 90 = 31", False),
    ("0.333 * 3 = 1.1", False),
    ("3 * 1.33 = 4.5", False),
    ("2.5 * 4 = 11", False),
    ("The tip is 15% of $40 = $7.", False),
    ("20 + 5 = 25 + 10 = 35", True),  # failed before (False)
    ("3 * 4 = 12 + 2 = 14 - 4 = 10", True),  # failed before (False)
    ("10 / 3 = 3.33 * 3 = 10", True),  # failed before (False)
    ("20 + 5 = 25 + 10 = 45", False),
    ("3 * 4 = 12 + 2 = 14 - 4 = 11", False),
    ("5 * 3 = 15 + 2", False),  # a running total must end on two equal sides
    ("2 * 3 = 6 = 7", False),
    ("25 / 4 = 6 full bags", None),  # failed before (False)
    ("25 / 4 = 7 bags", None),  # failed before (False): a ceiling
    ("25 / 4 = 9 bags", False),
    ("24 / 4 = 6 bags", True),
    ("25 / 4 = 6", False),  # no word after it: a whole number is exact
]


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])  # reward_modeling.py --prm labels with it
@pytest.mark.parametrize("step, verdict", VERIFIER_TABLE)
def test_step_verifier_table(step, verdict, script):
    assert importlib.import_module(script).step_arithmetic(step) is verdict


def test_step_verifier_table_size():
    assert len(VERIFIER_TABLE) >= 140 and len({step for step, _ in VERIFIER_TABLE}) == len(VERIFIER_TABLE)
    assert {verdict for _, verdict in VERIFIER_TABLE} == {True, False, None}


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])
def test_a_step_with_rounded_numbers_is_never_called_wrong(script):
    """Issue 65, over random steps: an operand written rounded to d1 decimals (or as a percentage), the result rounded
    to d2 >= 1 decimals (a whole number is exact), either from the rounded operand or from the exact one, is never
    wrong; a result further from every value
    the written numbers allow than the rounding of its own digits is wrong. The bound is computed here by a plain
    float64 loop over a grid of the operand's interval."""
    step_arithmetic = importlib.import_module(script).step_arithmetic
    rng = random.Random(65)
    for _ in range(400):
        x, y, d1, d2 = rng.uniform(0.01, 50), rng.randint(1, 40), rng.randint(1, 3), rng.randint(1, 3)
        op = rng.choice("+-*/")
        written = round(x, d1)
        exact = {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op]
        from_written = {"+": written + y, "-": written - y, "*": written * y, "/": written / y}[op]
        for result in (exact, from_written):
            step = f"{written:.{d1}f} {op} {y} = {result:.{d2}f}"
            assert step_arithmetic(step) is True, step
        half = 0.5 * 10**-d1
        grid = [written - half + 2 * half * i / 100 for i in range(101)]
        values = [{"+": v + y, "-": v - y, "*": v * y, "/": v / y}[op] for v in grid]
        wrong = max(values) + 0.5 * 10**-d2 + 10 ** -(d2 - 1)  # one unit of its last digit past the widest value
        step = f"{written:.{d1}f} {op} {y} = {wrong:.{d2}f}"
        assert step_arithmetic(step) is False, step
        percent = round(100 * x / 50, d1 - 1)  # "p% of y", p rounded to d1 - 1 decimals
        step = f"{percent:.{d1 - 1}f}% of {y} = {percent / 100 * y:.{d2}f}"
        assert step_arithmetic(step) is True, step


def test_arithmetic_interval_holds_every_value_its_numbers_allow():
    """arithmetic_interval against sampling: each operand of a random expression of three rounded or exact numbers is
    drawn from its rounding interval (its ends included), and the expression evaluated in float64; the interval holds
    every draw, and its ends are reached by one (the operations are monotonic between the ends)."""
    import ppo_prm_clip

    rng = random.Random(7)
    for _ in range(200):
        numbers = [(rng.uniform(1, 20), rng.randint(0, 2)) for _ in range(3)]
        texts = [f"{v:.{d}f}" for v, d in numbers]
        ops = [rng.choice("+-*/") for _ in range(2)]
        expression = f"({texts[0]} {ops[0]} {texts[1]}) {ops[1]} {texts[2]}"
        got = ppo_prm_clip.arithmetic_interval(expression)
        ends = [
            [float(t)] if d == 0 else [float(t) - 0.5 * 10**-d, float(t) + 0.5 * 10**-d]
            for t, (_, d) in zip(texts, numbers)
        ]
        draws = []
        for a in ends[0] + [float(texts[0])]:
            for b in ends[1] + [float(texts[1])]:
                for c in ends[2] + [float(texts[2])]:
                    first = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[ops[0]]
                    draws.append({"+": first + c, "-": first - c, "*": first * c, "/": first / c}[ops[1]])
        assert got[0] <= min(draws) + 1e-9 and got[1] >= max(draws) - 1e-9, expression
        assert math.isclose(got[0], min(draws), rel_tol=1e-9, abs_tol=1e-9), expression
        assert math.isclose(got[1], max(draws), rel_tol=1e-9, abs_tol=1e-9), expression
    assert ppo_prm_clip.arithmetic_interval("rounded(33) / 100") == pytest.approx((0.325, 0.335))
    assert ppo_prm_clip.arithmetic_interval("0.67 * 30") == pytest.approx((19.95, 20.25))
    assert ppo_prm_clip.arithmetic_interval("(-1.5) ^ 2") == pytest.approx((2.1025, 2.4025))
    assert ppo_prm_clip.arithmetic_interval("(0.0 - 1) ^ 2") == pytest.approx((0.9025, 1.1025))


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])
def test_a_result_too_long_to_read_is_unchecked_not_an_error(script):
    step_arithmetic = importlib.import_module(script).step_arithmetic
    assert step_arithmetic("25 / 4 = " + "9" * 250 + " bags") is None  # arithmetic_interval reads at most 200 chars
    assert step_arithmetic("25 / 4 = " + "9" * 250) is None
