"""The step verifier (step_arithmetic, in ppo_prm_clip.py and its copy in reward_modeling.py, which labels --prm) on
steps as models write them. A prefix scores its worst step, so one right step called wrong zeroes every later label.
The rule is two-sided: a right step is never called wrong, a wrong step never right; what cannot be read is unchecked
(None). Words that are numbers ("half", "twice", "a dozen") may be read or left unchecked, never called wrong."""

import importlib
import math
import random
from fractions import Fraction

import pytest

# Each verdict was written by hand: True (right), False (wrong), None (cannot be read).
VERIFIER_TABLE = [
    # A word or a fraction before the number (it read "Half of 20 = 10" as "20 = 10").
    ("Half of 20 = 10", None),
    ("half of 20 = 10, so she keeps 20 - 10 = 10 apples.", True),
    ("1/2 of 20 = 10", True),
    ("1/2 of 20 = 12", False),
    ("3/4 of 20 = 15", True),
    ("She spends 1/3 of 60 = 20 dollars on food.", True),
    ("He gives away 2/5 of 30 = 13 marbles.", False),
    ("\\( \\frac{1}{2} \\) of 20 = 10", True),
    ("Twice 5 = 10", None),
    ("Twice 5 + 2 = 12", None),
    ("Double 7 = 14", None),
    ("A third of 30 = 10", None),
    ("Each friend gets 1/4 of the 20 = 5 cookies.", None),
    ("The sum of 3 and 4 = 7", None),
    ("5 more than 3 * 2 = 11", None),
    ("Multiply 9 by 6 = 54", None),
    ("She bought 3 packs of 12 = 36 pencils.", None),
    ("A dozen eggs = 12 eggs", None),
    ("Twice as many as 12 is 2 * 12 = 24.", True),
    # Percentages.
    ("20 / 80 = 25%", True),
    ("1/4 = 0.25 = 25%", True),
    ("That is a 3/12 = 25% increase.", True),
    ("20 / 80 = 20%", False),
    ("20 / 80 = 0.25%", False),
    ("(20 / 80) * 100 = 25%", True),
    ("100 * 0.25 = 25%", True),
    ("The price rose by 12 / 48 * 100 = 25 percent.", True),
    ("1/3 = 33.33%", True),
    ("1/3 = 33%", True),
    ("1/3 = 34%", False),
    ("The chance of two in a row is 50% * 50% = 25%.", True),  # GSM8K
    ("100% - 40% = 60%", True),  # GSM8K
    ("100% - 40% = 50%", False),
    ("He got 45 / 50 * 100 = 90% of the questions right.", True),
    ("So 30% of 50 = 15 students.", True),
    ("So 30% of 50 = 20 students.", False),
    ("The tax is 8% * $25 = $2.", True),
    ("The sale price is $80 + 20% = $96.", None),  # 20% of 80, not 0.2
    ("10 % 3 = 1", None),
    ("7 puppies / 20 puppies * 100% = 35%", None),  # GSM8K
    # Notation it cannot read: unchecked, not wrong.
    ("3:4 = 0.75", None),
    ("The ratio is 3:5, so the boys are 3/8 * 40 = 15.", True),
    ("3:5 = 3/5 = 0.6", True),
    ("9:00 to 5:00 = 8 hours", None),
    ("7:30 + 2 = 9:30", None),
    ("12:00 - 8:45 = 3:15", None),
    ("He worked from 9 to 5, so 17 - 9 = 8 hours.", True),
    ("10 ÷ 4 = 2 R 2", None),
    ("10 ÷ 4 = 2 remainder 2", None),
    ("7 / 2 = 3 and a half", None),
    ("7 / 2 = 3 and 1/2", None),
    ("10 ÷ 4 = 2.5", True),
    ("10 mod 3 = 1", None),
    ("2/3 = 0.666... = 66.67%", None),
    ("10 / 3 = 3.(3)", None),
    ("\\( 1{,}000 + 500 = 1{,}500 \\)", True),
    ("\\( 1{,}000 + 500 = 1{,}600 \\)", False),
    ("2,5 + 1 = 3,5", None),
    ("12,5 * 2 = 25", None),
    ("1,00,000 + 1 = 100,001", None),
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
    ("Then -3 + 5 = 3.", False),
    ("Then -3 + 5 = 2.", True),
    ("\\$12 + \\$3 = \\$16", False),
    ("\\$12 + \\$3 = \\$15", True),
    ("3 hours * 60 minutes = 190 minutes", False),
    ("3 hours * 60 minutes = 180 minutes", True),
    ("4 boxes * 12 pencils = 46 pencils", False),
    ("6 feet * 12 inches = 72 inches", True),
    ("5 apples + 3 apples = 9 apples", False),
    ("10 dollars - 3 dollars = 7 dollars", True),
    ("1 hour + 30 minutes = 90 minutes", None),  # a conversion
    ("2 hours * 60 minutes = 7200 seconds", None),
    ("120 minutes / 60 minutes = 2 hours", None),
    ("3 apples + 2 oranges = 5 fruits", None),
    ("2 hours * 60 = 120 minutes", None),
    ("3 hours * 60 minutes = 180 minutes = 3 hours", None),
    ("1 kg + 500 g = 1500 g", None),
    ("\\( 12 \\text{ apples} + 3 \\text{ apples} = 15 \\text{ apples} \\)", True),
    ("- 15 + 27 = 42", True),
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
    ("The small cubes used 8 times 1/2 equals 4 ounces.", True),  # GSM8K
    ("Peter used 12 plus 14 plus 4 equals 31 ounces.", False),
    ("He is 3 years older, so 12 + 3 = 15 years old.", True),
    ("Profit = 150 - 120 = 30, which is 30 / 120 = 25% of the cost.", True),
    ("The temperature fell by 5 - (-3) = 8 degrees.", True),
    ("$2.50 * 4 = $10.50", False),
    ("3 * $1.99 = $5.97", True),
    ("**Step 2:** 48 / 2 = **24**", True),
    ("\\( \\frac{3}{4} \\times 20 = 15 \\)", True),
    ("$\\frac{20}{80} \\times 100 = 25\\%$", True),
    ("\\( 0.25 = 25\\% \\)", True),
    ("\\[ 48 \\div 2 = 24 \\]", True),
    ("\\sqrt{49} = 8", False),
    ("The answer is \\(\\boxed{18}\\).", None),
    ("Total: \\( 48 + 24 = \\boxed{72} \\)", True),
    ("Total: \\( 48 + 24 = \\boxed{73} \\)", False),
    # The project's measurements (FACTS).
    ("2^3 = 8", True),
    ("5^2 = 25", True),
    ("√16 = 4", True),
    ("10 / 3 = 3.33", True),
    # Rounded numbers: an operand that rounds a simple fraction, a rounded result, a running total, a floor in context.
    ("33.3% of 90 = 30", True),
    ("16.67% of 60 = 10", True),
    ("0.67 * 30 = 20", True),
    ("0.333 * 3 = 1", True),
    ("Each gets 10 / 3 = 3.33, and 3 * 3.33 = 10", True),
    ("He pays 3 * 1.33 = 4 dollars.", True),
    ("33% of 90 = 30", True),
    ("66.7% * 12 = 8", True),
    ("12 x 66.7% = 8", True),
    ("0.67 * 30 = 21", False),
    ("33.3% of 90 = 31", False),
    ("0.333 * 3 = 1.1", False),
    ("3 * 1.33 = 4.5", False),
    ("2.5 * 4 = 11", False),
    ("The tip is 15% of $40 = $7.", False),
    ("0.5 + 0.5 = 1.1", False),  # a written number is exact: 0.5 is no rounding of anything
    ("2.5 * 4 = 10.2", False),
    ("$4.50 + $3.25 = $7.76", False),
    ("0.1 * 1000 = 140", False),
    ("50% of 200 = 101", False),
    ("20% of 5000 = 1020", False),
    ("1.5 * 60 = 92", False),
    ("0.67 * 3 = 2.00", False),  # written to the digits 0.67 * 3 = 2.01 has: exact
    ("0.67 * 3 = 2", True),  # a whole result of a rounded operand: 2/3 * 3
    ("0.45 * 2 = 0.91", False),  # 0.9 exactly, though 0.45 rounds 5/11
    ("2.5 * 4.5 = 11.3", True),  # 11.25 rounded to its last digit
    ("2.5 * 4.5 = 11.4", False),
    ("10 / 4 = 2.6", False),
    ("1 / 8 = 0.13", True),
    ("0.3 * 30 = 10", False),  # one decimal is no rounding of 1/3
    ("0.33 * 30 = 10", True),
    ("14% of 70 = 10", True),  # 1/7 of 70
    ("1/3 * 100 = 33%", True),
    ("20 + 5 = 25 + 10 = 35", True),
    ("3 * 4 = 12 + 2 = 14 - 4 = 10", True),
    ("10 / 3 = 3.33 * 3 = 10", True),
    ("20 + 5 = 25 + 10 = 45", False),
    ("3 * 4 = 12 + 2 = 14 - 4 = 11", False),
    ("5 * 3 = 15 + 2", False),  # a running total must end on two equal sides
    ("2 * 3 = 6 = 7", False),
    ("25 / 4 = 6 full bags", None),
    ("25 / 4 = 7 bags", None),
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


def simplest_fraction(written, decimals):
    """The reference: by a plain loop over q = 1..12 and the numerators around q times the value, the first fraction
    p/q within half a unit of the written value's last decimal, or None."""
    value = Fraction(written)
    for q in range(1, 13):
        for p in range(math.floor(value * q) - 1, math.ceil(value * q) + 2):
            if abs(Fraction(p, q) - value) * 2 * 10**decimals <= 1:
                return Fraction(p, q)
    return None


def decimal_text(value, decimals=None):
    """A terminating Fraction written with `decimals` decimals (default: the fewest that hold it in full)."""
    if decimals is None:
        decimals = 0
        while (value * 10**decimals).denominator != 1:
            decimals += 1
    scaled = value * 10**decimals
    assert scaled.denominator == 1
    digits = str(abs(scaled.numerator)).rjust(decimals + 1, "0")
    return ("-" if scaled < 0 else "") + (digits[:-decimals] + "." + digits[-decimals:] if decimals else digits)


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])
def test_a_wrong_result_of_exact_decimals_is_always_wrong(script):
    """Over random steps of decimals (denominators 2^a 5^b, as every written decimal), each written exactly, and a
    result written in full (right) or one unit off in its last digit (wrong). The results are computed here with
    Fraction."""
    step_arithmetic = importlib.import_module(script).step_arithmetic
    rng = random.Random(82)
    checked = 0
    for _ in range(1000):
        x = Fraction(rng.randint(1, 9999), 10 ** rng.randint(0, 3))
        y = Fraction(rng.randint(1, 999), 10 ** rng.randint(0, 2))
        op = rng.choice("+-*/%")
        result = x / 100 * y if op == "%" else {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op]
        if result.denominator // math.gcd(result.denominator, 10**12) != 1:
            continue  # a quotient with no finite decimal
        written = (
            f"{decimal_text(x)}% of {decimal_text(y)}" if op == "%" else f"{decimal_text(x)} {op} {decimal_text(y)}"
        )
        full = decimal_text(result)
        decimals = len(full.partition(".")[2])
        assert step_arithmetic(f"{written} = {full}") is True, f"{written} = {full}"
        for off in (-1, 1):
            step = f"{written} = {decimal_text(result + Fraction(off, 10**decimals), decimals)}"
            assert step_arithmetic(step) is False, step
        checked += 1
    assert checked > 800


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])
def test_an_operand_rounding_a_simple_fraction_is_read_as_it(script):
    """Over random steps whose operand rounds p/q (q in 3, 6, 7, 9, 11, 12) to 2-3 decimals or as a percentage: a
    result that rounds (p/q op y) to fewer digits than the written operands need is right, one that misses that
    rounding by a whole unit of its last digit is wrong. The reference fraction is found here by a plain loop."""
    step_arithmetic = importlib.import_module(script).step_arithmetic
    rng = random.Random(83)
    checked = 0
    for _ in range(600):
        q = rng.choice([3, 6, 7, 9, 11, 12])
        p = rng.choice([p for p in range(1, 4 * q) if math.gcd(p, q) == 1])
        y, d1, op, as_percent = rng.randint(2, 60), rng.randint(2, 3), rng.choice("+-*/"), rng.random() < 0.3
        written = f"{float(Fraction(p, q)):.{d1}f}"
        if simplest_fraction(written, d1) != Fraction(p, q):
            continue  # a simpler fraction rounds to the same digits: the step reads that one
        operand = f"{float(100 * Fraction(p, q)):.{d1 - 2}f}% of" if as_percent else f"{written} {op}"
        if as_percent:
            op, written = "*", str(Fraction(f"{float(100 * Fraction(p, q)):.{d1 - 2}f}") / 100)
        value = {"+": Fraction(p, q) + y, "-": Fraction(p, q) - y, "*": Fraction(p, q) * y, "/": Fraction(p, q) / y}[
            op
        ]
        from_written = {"+": Fraction(written) + y, "-": Fraction(written) - y, "*": Fraction(written) * y}.get(
            op, Fraction(written) / y
        )
        for d2 in range(0, d1):
            unit = Fraction(1, 10**d2)
            if (from_written / unit).denominator == 1:
                continue  # the written operand gives a result to these digits: it is checked exactly
            nearest = round(value / unit) * unit
            if abs(value - nearest) == unit / 2:
                continue  # a tie
            step = f"{operand} {y} = {float(nearest):.{d2}f}"
            assert step_arithmetic(step) is True, step
            step = f"{operand} {y} = {float(nearest + unit):.{d2}f}"
            assert step_arithmetic(step) is False, step
            checked += 1
    assert checked > 300


def test_rounded_operand_against_a_plain_loop():
    import ppo_prm_clip

    assert ppo_prm_clip.rounded_operand("0.67") == Fraction(2, 3)
    assert ppo_prm_clip.rounded_operand("3.33") == Fraction(10, 3)
    assert ppo_prm_clip.rounded_operand("16.67", 100) == Fraction(1, 6)
    assert ppo_prm_clip.rounded_operand("33.3", 100) == ppo_prm_clip.rounded_operand("33", 100) == Fraction(1, 3)
    for written in ("0.5", "0.1", "2.5", "0.3", "0.25", "0.125", "1.00", "7"):
        assert ppo_prm_clip.rounded_operand(written) is None, written
    for written in ("20", "50", "10", "25", "12.5"):
        assert ppo_prm_clip.rounded_operand(written, 100) is None, written
    rng = random.Random(5)
    for _ in range(300):
        decimals = rng.randint(2, 3)
        written = f"{rng.uniform(0, 10):.{decimals}f}"
        reference = simplest_fraction(written, decimals)
        if reference is not None and reference.denominator // math.gcd(reference.denominator, 10**4) == 1:
            reference = None  # 2^a 5^b: the number is exact as written
        assert ppo_prm_clip.rounded_operand(written) == reference, written


def test_arithmetic_value_is_exact():
    """arithmetic_value against Fraction arithmetic written here: random expressions of three decimals, exact; a root
    or a fractional power is a float; what is not arithmetic is None."""
    import ppo_prm_clip

    rng = random.Random(7)
    for _ in range(300):
        texts = [f"{rng.uniform(1, 20):.{rng.randint(0, 3)}f}" for _ in range(3)]
        a, b, c = (Fraction(t) for t in texts)
        ops = [rng.choice("+-*/") for _ in range(2)]
        first = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[ops[0]]
        expected = {"+": first + c, "-": first - c, "*": first * c, "/": first / c}[ops[1]]
        assert ppo_prm_clip.arithmetic_value(f"({texts[0]} {ops[0]} {texts[1]}) {ops[1]} {texts[2]}") == expected
    assert ppo_prm_clip.arithmetic_value("0.1 * 1000") == 100
    assert ppo_prm_clip.arithmetic_value("(-1.5) ^ 2") == Fraction(9, 4)
    assert ppo_prm_clip.arithmetic_value("10^(-3)") == Fraction(1, 1000)
    assert ppo_prm_clip.arithmetic_value("√(9/4)") == Fraction(3, 2)
    assert math.isclose(ppo_prm_clip.arithmetic_value("√2"), math.sqrt(2))
    assert ppo_prm_clip.arithmetic_value("1000000 + 1") != 1000000


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])
def test_a_result_too_long_to_read_is_unchecked_not_an_error(script):
    step_arithmetic = importlib.import_module(script).step_arithmetic
    assert step_arithmetic("25 / 4 = " + "9" * 250 + " bags") is None  # arithmetic_value reads at most 200 chars
    assert step_arithmetic("25 / 4 = " + "9" * 250) is None
    assert step_arithmetic("10^306.5 = 1.0001") is False  # a float near the largest, divided by the result's unit
