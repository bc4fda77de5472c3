"""Each script's size against its budget (the fence is a budget), read from the files with `ast`:

    python -m benchmark.checks.budget            # a markdown table; --json for the numbers

total lines, lines above the fence (up to the `# ====` line that opens it) and below, main()'s lines, the fields
of Args (above the fence: what the algorithm reads) and of RunArgs (below: the rest of the command line), and the
definitions whose name is in every script (each script's own Args, RunArgs, main, check_args and evaluate aside)
with the lines they take in each: a copy a user gets in every file. Then the reading figures against their
targets: the lines of main()'s longest loop (the training loop) and the line it starts at, the deepest nesting of
blocks (for, while, if, with, try) in main(), and the definitions below the fence that main() and the functions above
the fence it calls reach (what a reader must open below the fence to follow the algorithm).
"""

import argparse
import ast
import io
import json
import os
import re
import subprocess
import tokenize

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The fence's text line and the names each script has its own version of (not copies); tests/kit/test_drift.py uses
# both.
FENCE = "# PLUMBING: everything below serves main() and is not needed to follow the algorithm; a reader may stop here."
SCRIPT_OWN = ("Args", "RunArgs", "main", "check_args", "evaluate")
# {script: {kept: definitions that stay above the fence, task: the task's functions (they may call a parser below the
# fence), args: every Args field}}: what the cleaning may not move (tests/benchmark/test_budget.py holds each script
# to it).
with open(os.path.join(REPO_ROOT, "benchmark", "checks", "above_fence.json")) as f:
    ABOVE_FENCE = json.load(f)
BLOCKS = (ast.For, ast.While, ast.If, ast.With, ast.Try)
# script: (total lines, lines above the fence), the first size targets
BUDGET = {
    "grpo_math": (950, 430),
    "reward_modeling": (1100, 430),
    "ppo_rlhf": (1000, 430),
    "dpo_online": (1000, 430),
    "ppo_prm_clip": (1150, 480),
    "async_rlhf": (1250, 600),
    "grpo_tools": (1250, 600),  # the seventh script, budgeted at the largest of the six
}


# The reading targets: the training loop's lines, main's block depth, below-fence names main reaches (the kit's public
# face), the loop's first line (main right after Args), total lines. A loop that writes its epoch / minibatch /
# micro-batch schedule and its optimizer calls may take 130 lines, 5 blocks deep (CleanRL's ppo.py loop is 125).
READING = {
    "grpo_math": (130, 5, 6, 200, 1470),
    "dpo_online": (130, 5, 6, 200, 1545),
    "ppo_rlhf": (130, 5, 6, 200, 1500),
    "reward_modeling": (130, 5, 6, 200, 1680),
    "ppo_prm_clip": (130, 5, 6, 220, 1720),
    "async_rlhf": (130, 5, 6, 260, 1780),
    "grpo_tools": (130, 5, 6, 260, 1650),
}


def block_depth(node, depth=0):
    """The deepest nesting of blocks (for, while, if, with, try) under `node`."""
    return max(
        [depth] + [block_depth(child, depth + isinstance(child, BLOCKS)) for child in ast.iter_child_nodes(node)]
    )


def below_fence_reached(tree, fence_line, task=()):
    """The names of the module-level definitions after `fence_line` that main() uses, directly or through the
    functions above the fence that it uses, not through the task's (`task`: they may call a parser below)."""
    defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    below = {n.name for n in defined if n.lineno > fence_line}
    above = {n.name: n for n in defined if n.lineno < fence_line and isinstance(n, ast.FunctionDef)}
    seen, todo, reached = set(), ["main"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in above or name in task:
            continue
        seen.add(name)
        for node in ast.walk(above[name]):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id in below:
                    reached.add(node.id)
                elif node.id in above:
                    todo.append(node.id)
    return sorted(reached)


def math_reaches_below(tree, fence_line, task=()):
    """{function: [names]}: the definitions below the fence that a function above it, other than main and the task's
    (`task`, which may call a parser below), uses directly: the math takes what it needs as arguments."""
    below = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno > fence_line}
    found = {}
    for node in tree.body:
        above = isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.lineno < fence_line
        if above and node.name != "main" and node.name not in task:
            used = {x.id for x in ast.walk(node) if isinstance(x, ast.Name) and x.id in below}
            if used:
                found[node.name] = sorted(used)
    return found


def below_reaches_above(tree, fence_line):
    """{definition below the fence: [names above it that it uses]} (to be none but Args, which Config joins):
    the kit is given what it needs from the algorithm (a function or a value passed in), never reaches up for it.
    A definition's own names (its parameters, locals, nested definitions, imports) do not count."""
    above = set()
    for node in tree.body:
        if node.lineno < fence_line and isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            above.add(node.name)
        elif node.lineno < fence_line and isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            above |= {t.id for t in targets if isinstance(t, ast.Name)}
    above -= {"Args", "main"}
    found = {}
    for node in tree.body:
        if node.lineno < fence_line or isinstance(node, ast.If):  # not `if __name__ == "__main__": main(...)`
            continue
        own = set()
        for x in ast.walk(node):
            if isinstance(x, ast.arg):
                own.add(x.arg)
            elif isinstance(x, ast.Name) and not isinstance(x.ctx, ast.Load):
                own.add(x.id)
            elif isinstance(x, (ast.FunctionDef, ast.ClassDef)) and x is not node:
                own.add(x.name)
            elif isinstance(x, (ast.Import, ast.ImportFrom)):
                own |= {(a.asname or a.name).split(".")[0] for a in x.names}
        used = {x.id for x in ast.walk(node) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
        if used & above - own:
            name = node.name if hasattr(node, "name") else ast.unparse(node).split("=")[0].strip()
            found[name] = sorted(used & above - own)
    return found


def plumbing_order(tree, fence_line):
    """The order of the definitions below the fence: RunArgs, Config and RESUMABLE_ARGS, then each one
    in the order main() first uses it (directly or through a function above the fence), followed at once by what it
    uses that is not placed yet (depth first), then the ones main never reaches, in their order in the file. A class
    comes after its base classes (they must exist when it is defined). A name counts where it appears as a name or
    an attribute (run.timed reaches a `timed`)."""
    units = {}
    for node in tree.body:
        name = getattr(node, "name", None)
        if name is None and isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        if name and node.lineno > fence_line:
            units[name] = node
    above = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.lineno < fence_line}
    placed, seen = [name for name in ("RunArgs", "Config", "RESUMABLE_ARGS") if name in units], set()

    def visit(name):
        node = units.get(name) if name not in placed else None
        if node is None and (name not in above or name in seen):
            return
        for base in getattr(node, "bases", []):
            visit(getattr(base, "id", None))
        if name in placed:
            return
        placed.append(name) if node is not None else seen.add(name)
        found = [(x.lineno, x.col_offset, x.id) for x in ast.walk(node or above[name]) if isinstance(x, ast.Name)]
        found += [
            (x.lineno, x.col_offset, x.attr) for x in ast.walk(node or above[name]) if isinstance(x, ast.Attribute)
        ]
        for _, _, used in sorted(found):
            visit(used)

    visit("main")
    return placed + [name for name in units if name not in placed]


def fields(tree, name):
    """The dataclass fields of the module-level class `name` (ClassVar annotations are not fields), or []."""
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    body = cls.body if cls is not None else []
    return [s.target.id for s in body if isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)]


# The spring cleaning's targets: characters above the fence (up to the fence's text line, the `# ====` line
# included) at most 0.75x these, 0.55x for grpo_tools; comments and docstrings at most 25% of them; no function
# docstring over 120 words; no history mention outside a changelog.
ABOVE_CHARS_BEFORE = {
    "grpo_math": 41491,
    "reward_modeling": 45475,
    "ppo_rlhf": 47494,
    "dpo_online": 43114,
    "ppo_prm_clip": 60232,
    "async_rlhf": 51508,
    "grpo_tools": 80084,
}
PROSE_TARGETS = dict(chars={k: 0.55 if k == "grpo_tools" else 0.75 for k in ABOVE_CHARS_BEFORE}, share=0.25, words=120)
# A mention of how the tree was built: an issue or item number, a note of what did not work earlier, or a results name
# that carries a number.
HISTORY = re.compile(
    r"\bissues? #?\d+|\bitem \d+\b|failed\sbefore|issue\d+|(?:pilot|power|stale|noisy|verifier|prm|offpolicy|_v)6\d\b",
    re.I,
)


def prose(path):
    """What a reader meets above the fence: its characters (up to the fence's text line), the share of them that is
    comments and module, class and function docstrings (Args' field docstrings are --help text: code), and the
    longest function docstring in words, with its name."""
    with open(path) as f:
        source = f.read()
    head = source[: source.index(FENCE)]
    tree = ast.parse(source)
    docstrings = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.append((getattr(node, "name", None), node, ast.get_source_segment(source, first)))
    above = [(name, node, text) for name, node, text in docstrings if source.index(text) < len(head)]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(head).readline) if t.type == tokenize.COMMENT]
    functions = [
        (len(node.body[0].value.value.split()), name)
        for name, node, _ in above
        if name and not isinstance(node, ast.ClassDef)
    ]
    words, longest = max(functions, default=(0, None))
    return dict(
        chars=len(head),
        prose_share=(sum(map(len, comments)) + sum(len(text) for _, _, text in above)) / len(head),
        docstring_words=words,
        longest_docstring=longest,
    )


def history_mentions(root=REPO_ROOT, changelog=("CHANGELOG.md",)):
    """{file: count} of HISTORY mentions (names of files and folders included) in the tracked text files outside a
    changelog."""
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    found = {}
    for name in files:
        if os.path.basename(name) in changelog or not name.endswith(
            (".py", ".md", ".sh", ".toml", ".txt", "Makefile")
        ):
            continue
        with open(os.path.join(root, name), errors="replace") as f:
            count = len(HISTORY.findall(f.read())) + len(HISTORY.findall(name))
        if count:
            found[name] = count
    return found


def measure(path):
    with open(path) as f:
        source = f.read()
    lines, tree = source.splitlines(), ast.parse(source)
    task = ABOVE_FENCE.get(os.path.basename(path).removesuffix(".py"), {}).get("task", ())
    above = lines.index(FENCE) - 1  # the line before the fence's first `# ====` line
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    definitions = {
        n.name: n.end_lineno - n.lineno + 1 + len(n.decorator_list)
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef))
    }
    loops = [n for n in ast.walk(main) if isinstance(n, (ast.For, ast.While))]
    loop = max(loops, key=lambda n: n.end_lineno - n.lineno, default=None)
    return dict(
        loop=loop.end_lineno - loop.lineno + 1 if loop else 0,
        loop_start=loop.lineno if loop else 0,
        depth=block_depth(main),
        below_reached=below_fence_reached(tree, above + 2, task),
        math_reaches=math_reaches_below(tree, above + 2, task),
        kit_reaches=below_reaches_above(tree, above + 2),
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
    parser.add_argument("--root", default=REPO_ROOT, help="the folder with the scripts")
    args = parser.parse_args(argv)
    rows, shared = report(args.root)
    if args.json:
        print(json.dumps({"scripts": rows, "in_every_script": shared}, indent=1))
        return rows
    print("| script | total (target) | above the fence (target) | below | main() | Args / RunArgs fields | copied |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        total, above = BUDGET[name]
        print(
            f"| {name}.py | {row['total']} ({total}) | {row['above']} ({above}) | {row['below']} | {row['main']} "
            f"| {row['args_fields']} / {row['run_args_fields']} | {row['copied_lines']} |"
        )
    print(f"\n{len(shared)} definitions are in every script: {', '.join(shared)}")
    print("\nReading figures: now (target)\n")
    print(
        "| script | training loop lines | block depth in main | below-fence names reached | loop starts at | total |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        now = (row["loop"], row["depth"], len(row["below_reached"]), row["loop_start"], row["total"])
        cells = " | ".join(f"{value} ({target})" for value, target in zip(now, READING[name]))
        print(f"| {name}.py | {cells} |")
    print(
        "\nWhat main reaches below the fence (the kit's public face), and what the other functions above it reach:\n"
    )
    for name, row in rows.items():
        print(f"- {name}.py: {', '.join(row['below_reached'])}; {row['math_reaches'] or 'nothing'}")
    print(
        "\nAbove the fence: characters (x of before; target), comments and docstrings, the longest function "
        "docstring\n"
    )
    print("| script | characters | x before (target) | prose share (target) | longest docstring, words (target) |")
    print("| --- | --- | --- | --- | --- |")
    for name in rows:
        row = prose(os.path.join(args.root, f"{name}.py"))
        ratio, target = row["chars"] / ABOVE_CHARS_BEFORE[name], PROSE_TARGETS["chars"][name]
        print(
            f"| {name}.py | {row['chars']} | {ratio:.2f} ({target}) | {row['prose_share']:.2f} "
            f"({PROSE_TARGETS['share']}) | {row['docstring_words']} `{row['longest_docstring']}` "
            f"({PROSE_TARGETS['words']}) |"
        )
    mentions = history_mentions(args.root)
    print(f"\nHistory mentions outside a changelog: {sum(mentions.values())} in {len(mentions)} files (target 0)")
    return rows


if __name__ == "__main__":
    main()
