"""Drift test: a definition duplicated across scripts must be identical in every copy, every script has the same
fence between its algorithm and its plumbing, and no script imports another.

The scripts are the top-level *.py files of the repository (grpo_math.py, ppo_rlhf.py, reward_modeling.py,
dpo_online.py, ppo_prm_clip.py, async_rlhf.py, grpo_tools.py). Module-level functions and classes with the same name in
two or more scripts are compared by their source text (a class with its methods); a script that needs a variant gives
it another name.
"""

import ast
import glob
import os

from conftest import REPO_ROOT

from benchmark.checks.budget import FENCE as PLUMBING
from benchmark.checks.budget import SCRIPT_OWN


def script_paths(root=REPO_ROOT):
    return sorted(p for p in glob.glob(os.path.join(root, "*.py")) if os.path.basename(p) not in ("setup.py",))


def module_functions(path):
    """{name: source} of the module-level functions and classes of a Python file (a decorator is part of it)."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    definitions = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            definitions[node.name] = "\n".join(lines[start - 1 : node.end_lineno])
    return definitions


# The line between a script's algorithm (above) and its plumbing (below), the same in every script; its text and the
# names each script has its own version of (SCRIPT_OWN) are defined once, in benchmark/checks/budget.py.
FENCE = (
    "# " + "=" * 117,
    PLUMBING,
    "# A definition with the same name is identical in every script that has it (tests/kit/test_drift.py checks).",
    "# " + "=" * 117,
)


def fence_line(path):
    """The line number (1-based) where the fence starts, or None if the script has no fence or a different one."""
    with open(path) as f:
        lines = f.read().splitlines()
    for i in range(len(lines) - len(FENCE) + 1):
        if tuple(lines[i : i + len(FENCE)]) == FENCE:
            return i + 1
    return None


def helper_drift(paths):
    """Messages naming every helper whose copies differ, and the scripts that hold the differing copies."""
    copies = {}  # name -> {script: source}
    for path in paths:
        for name, source in module_functions(path).items():
            if name in SCRIPT_OWN:
                continue
            copies.setdefault(name, {})[os.path.basename(path)] = source
    problems = []
    for name, by_script in sorted(copies.items()):
        if len(by_script) < 2:
            continue
        variants = {}
        for script, source in sorted(by_script.items()):
            variants.setdefault(source, []).append(script)
        if len(variants) > 1:
            groups = " vs ".join("[" + ", ".join(scripts) + "]" for scripts in variants.values())
            problems.append(f"helper {name!r} differs between {groups}")
    return problems


def cross_imports(paths):
    """Messages naming every script that imports another top-level script."""
    names = {os.path.splitext(os.path.basename(p))[0] for p in paths}
    problems = []
    for path in paths:
        me = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in names and top != me:
                    problems.append(f"{os.path.basename(path)} imports {top} (line {node.lineno})")
    return problems


def test_there_are_scripts():
    scripts = [os.path.basename(p) for p in script_paths()]
    assert "grpo_math.py" in scripts, scripts


def test_duplicated_helpers_are_identical():
    problems = helper_drift(script_paths())
    assert not problems, "\n".join(problems)


def test_every_script_has_the_fence_after_main():
    for path in script_paths():
        line = fence_line(path)
        assert line is not None, f"{os.path.basename(path)} has no fence (tests/kit/test_drift.py FENCE)"
        with open(path) as f:
            tree = ast.parse(f.read())
        main = next(node for node in tree.body if getattr(node, "name", None) == "main")
        assert main.end_lineno < line, f"{os.path.basename(path)}: main() must end above the fence"


def test_no_script_imports_another():
    problems = cross_imports(script_paths())
    assert not problems, "\n".join(problems)


# The checkers themselves, on synthetic scripts, so that the tests above can fail.

HELPER = '''
def masked_mean(values, mask, dim=None):
    """Mean where mask is 1."""
    return (values * mask).sum() / mask.sum()
'''


def write(path, text):
    path.write_text(text)
    return str(path)


def test_checker_passes_identical_copies(tmp_path):
    a = write(tmp_path / "a.py", "import torch\n" + HELPER + "\ndef only_in_a():\n    return 1\n")
    b = write(tmp_path / "b.py", "import math\n\nX = 1\n" + HELPER + "\ndef only_in_b():\n    return 2\n")
    assert helper_drift([a, b]) == []


def test_checker_compares_classes_with_their_methods_and_ignores_nested_functions(tmp_path):
    a = write(tmp_path / "a.py", "class C:\n    def f(self):\n        return 1\n")
    b = write(tmp_path / "b.py", "class C:\n    def f(self):\n        return 2\n")
    assert len(helper_drift([a, b])) == 1 and "'C'" in helper_drift([a, b])[0]
    c = write(tmp_path / "c.py", "def g():\n    def f():\n        return 1\n    return f\n")
    d = write(tmp_path / "d.py", "def f():\n    return 2\n\ndef g():\n    def f():\n        return 1\n    return f\n")
    assert helper_drift([c, d]) == []


def test_fence_checker(tmp_path):
    fence = "\n".join(FENCE)
    assert fence_line(write(tmp_path / "a.py", f"def main():\n    pass\n\n\n{fence}\n")) == 5
    assert fence_line(write(tmp_path / "b.py", fence.replace("PLUMBING", "Plumbing") + "\n")) is None


def test_checker_names_both_scripts_on_one_character_difference(tmp_path):
    a = write(tmp_path / "first_script.py", HELPER)
    b = write(tmp_path / "second_script.py", HELPER.replace("mask.sum()", "mask.sum(0)"))
    c = write(tmp_path / "third_script.py", HELPER)
    problems = helper_drift([a, b, c])
    assert len(problems) == 1
    assert "masked_mean" in problems[0]
    assert "first_script.py" in problems[0] and "second_script.py" in problems[0]
    assert "third_script.py" in problems[0]


def test_checker_sees_docstring_and_signature_changes(tmp_path):
    a = write(tmp_path / "a.py", HELPER)
    b = write(tmp_path / "b.py", HELPER.replace("Mean where", "Mean wherever"))
    c = write(tmp_path / "c.py", HELPER.replace("dim=None", "dim=0"))
    assert len(helper_drift([a, b])) == 1
    assert len(helper_drift([a, c])) == 1


def test_cross_import_checker(tmp_path):
    a = write(tmp_path / "alpha.py", "import os\nimport torch.nn\n")
    b = write(tmp_path / "beta.py", "from alpha import masked_mean\n")
    c = write(tmp_path / "gamma.py", "def f():\n    import beta\n    return beta\n")
    problems = cross_imports([a, b, c])
    assert len(problems) == 2
    assert any(p.startswith("beta.py imports alpha") for p in problems)
    assert any(p.startswith("gamma.py imports beta") for p in problems)
    assert cross_imports([a]) == []


def test_checker_skips_each_script_own_main_and_check_args(tmp_path):
    a = write(tmp_path / "a.py", HELPER + "\ndef main(args):\n    return 1\n\ndef check_args(args):\n    pass\n")
    b = write(tmp_path / "b.py", HELPER + "\ndef main(args):\n    return 2\n\ndef check_args(args):\n    return 0\n")
    assert helper_drift([a, b]) == []
    c = write(tmp_path / "c.py", HELPER.replace("mask.sum()", "mask.sum(0)") + "\ndef main(args):\n    return 3\n")
    assert len(helper_drift([a, c])) == 1


def test_plumbing_is_in_the_order_main_calls_it():
    """Below the fence, a reader who follows main's next call finds it further down: the definitions are in the order
    main first reaches them, each followed by what it uses (benchmark/checks/budget.py's plumbing_order, the same rule
    in every script)."""
    import ast

    from benchmark.checks.budget import plumbing_order

    for path in script_paths():
        with open(path) as f:
            tree = ast.parse(f.read())
        start = fence_line(path)
        below = [n for n in tree.body if n.lineno > start + 3 and not isinstance(n, ast.If)]  # not __main__
        below = [n.targets[0].id if isinstance(n, ast.Assign) else n.name for n in below]
        expected = plumbing_order(tree, start + 1)
        assert below == expected, (os.path.basename(path), [(a, b) for a, b in zip(below, expected) if a != b][:3])
