"""Each script's size against the budget of issue 28 (the fence is a budget), read from the files with `ast`:

    python -m benchmark.budget            # a markdown table; --json for the numbers

total lines, lines above the fence (up to the `# ====` line that opens it) and below, main()'s lines, the fields
of Args (above the fence: what the algorithm reads) and of RunArgs (below: the rest of the command line), and the
definitions whose name is in all six scripts (each script's own Args, RunArgs, main, check_args and evaluate aside)
with the lines they take in each: a copy a user gets in every file.
"""

import argparse
import ast
import json
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The fence's text line and the names each script has its own version of (not copies); tests/test_drift.py uses both.
FENCE = "# PLUMBING: everything below serves main() and is not needed to follow the algorithm; a reader may stop here."
SCRIPT_OWN = ("Args", "RunArgs", "main", "check_args", "evaluate")
# script: (total lines, lines above the fence), the targets of issue 28
BUDGET = {
    "grpo_math": (950, 430),
    "reward_modeling": (1100, 430),
    "ppo_rlhf": (1000, 430),
    "dpo_online": (1000, 430),
    "ppo_prm_clip": (1150, 480),
    "async_rlhf": (1250, 600),
}


def fields(tree, name):
    """The dataclass fields of the module-level class `name` (ClassVar annotations are not fields), or []."""
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    body = cls.body if cls is not None else []
    return [s.target.id for s in body if isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)]


def measure(path):
    with open(path) as f:
        source = f.read()
    lines, tree = source.splitlines(), ast.parse(source)
    above = lines.index(FENCE) - 1  # the line before the fence's first `# ====` line
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    definitions = {
        n.name: n.end_lineno - n.lineno + 1 + len(n.decorator_list)
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef))
    }
    return dict(
        total=len(lines),
        above=above,
        below=len(lines) - above,
        main=main.end_lineno - main.lineno + 1,
        args_fields=len(fields(tree, "Args")),
        run_args_fields=len(fields(tree, "RunArgs")),
        definitions=definitions,
    )


def report(root=REPO_ROOT):
    rows = {name: measure(os.path.join(root, f"{name}.py")) for name in BUDGET}
    shared = set.intersection(*(set(row["definitions"]) for row in rows.values())) - set(SCRIPT_OWN)
    for row in rows.values():
        row["copied_lines"] = sum(row["definitions"][name] for name in shared)
    return rows, sorted(shared)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--root", default=REPO_ROOT, help="the folder with the six scripts")
    args = parser.parse_args(argv)
    rows, shared = report(args.root)
    if args.json:
        print(json.dumps({"scripts": rows, "in_all_six": shared}, indent=1))
        return rows
    print("| script | total (target) | above the fence (target) | below | main() | Args / RunArgs fields | copied |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        total, above = BUDGET[name]
        print(
            f"| {name}.py | {row['total']} ({total}) | {row['above']} ({above}) | {row['below']} | {row['main']} "
            f"| {row['args_fields']} / {row['run_args_fields']} | {row['copied_lines']} |"
        )
    print(f"\n{len(shared)} definitions are in all six scripts: {', '.join(shared)}")
    return rows


if __name__ == "__main__":
    main()
