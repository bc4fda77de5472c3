"""Drift test: a helper duplicated across scripts must be identical in every copy, and no script imports another.

The scripts are the top-level *.py files of the repository (grpo_math.py, ppo_rlhf.py, reward_modeling.py,
dpo_online.py, ppo_prm_clip.py, async_rlhf.py). Module-level functions with the same name in two or more scripts
are compared by their source text.
"""

import ast
import glob
import os

from conftest import REPO_ROOT


def script_paths(root=REPO_ROOT):
    return sorted(p for p in glob.glob(os.path.join(root, "*.py")) if os.path.basename(p) not in ("setup.py",))


def module_functions(path):
    """{name: source} of the module-level functions (and async functions) of a Python file."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    return {
        node.name: ast.get_source_segment(source, node)
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


# Every script has its own entry point and its own argument check: same name by convention, different by design.
SCRIPT_OWN = ("main", "check_args")


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


def test_checker_ignores_methods_and_nested_functions(tmp_path):
    a = write(tmp_path / "a.py", "class C:\n    def f(self):\n        return 1\n")
    b = write(
        tmp_path / "b.py", "class C:\n    def f(self):\n        return 2\n\ndef g():\n    def f():\n        return 3\n"
    )
    assert helper_drift([a, b]) == []


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
