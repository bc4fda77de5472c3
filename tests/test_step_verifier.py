"""The step verifier (step_arithmetic, in ppo_prm_clip.py and its copy in reward_modeling.py, which labels --prm) on
steps as models write them. A prefix scores its worst step, so one right step called wrong zeroes every later label.
The rule (issue 54): a right step is never called wrong, a wrong step never right; what cannot be read is unchecked
(None). Words that are numbers ("half", "twice", "a dozen") may be read or left unchecked, never called wrong."""

import importlib

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
]


@pytest.mark.parametrize("script", ["ppo_prm_clip", "reward_modeling"])  # reward_modeling.py --prm labels with it
@pytest.mark.parametrize("step, verdict", VERIFIER_TABLE)
def test_step_verifier_table(step, verdict, script):
    assert importlib.import_module(script).step_arithmetic(step) is verdict


def test_step_verifier_table_size():
    assert len(VERIFIER_TABLE) >= 80 and len({step for step, _ in VERIFIER_TABLE}) == len(VERIFIER_TABLE)
    assert {verdict for _, verdict in VERIFIER_TABLE} == {True, False, None}
