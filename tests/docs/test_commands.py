"""Commands that a user copies must run: every command line that runs one of the six scripts, in README.md, docs/*.md,
benchmark/*.sh and the scripts' module docstrings, is parsed by that script's own command line (its `tyro.cli` call,
built as its `__main__` block builds it) without loading a model or calling main().

Where a command is found:
- markdown: fenced code blocks (a command may start anywhere on a line: `... && python x.py`) and inline code spans
  (`` `python x.py --flag` ``, also when the span runs over a line break);
- benchmark/*.sh: every line that is not a comment, and the inline code spans of the comments;
- a script's module docstring: every line (its inline code spans taken out first), and its inline code spans.
Lines ending in a backslash are joined to the next one. The id of a command is `file:line:script` (the line where the
command starts), with the values of the shell loop variables it was expanded with, if any.

The forms recognised (the script is the first argument that names one of the six scripts; what follows it is the
script's arguments, up to `&&`, `||`, `;`, `|` or a `#` comment):
    python X.py ...  /  .venv/bin/python X.py ...  /  python3 X.py ...
    accelerate launch [launcher flags] [wrapper.py] X.py ...  /  python -m accelerate.commands.launch ...
    torchrun [launcher flags] X.py ...
    make train [ARGS="..."]                         (runs grpo_math.py $(ARGS), see the Makefile)
    python -m benchmark.statistics.run --script X.py [launcher flags] [-- X's args]
                                                    (the launcher's own flags are parsed by its parser; the script gets
                                                    what benchmark.statistics.run would give it for the first seed:
                                                    --seed S, the arguments after `--`, and --track --wandb_tags with
                                                    --track)
    python -m benchmark.performance.memory_plan [plan flags] X.py ...  (the plan's own flags taken out by its parser)
Placeholders:
- a literal `...` argument (elided arguments) is dropped;
- `<anything>` (e.g. `<sft model>`) is replaced by the word `placeholder` (an arbitrary path or name);
- `"$@"` / `$*` (the arguments a shell file passes on) is dropped;
- a `$VAR` / `${VAR}` set by a `for VAR in a b c; do` loop of the same shell file: the command is checked once per
  value (every combination when it uses several loop variables); `${VAR:-default}` gets its default; any other
  variable takes its value from SHELL_VALUES below, and a variable found in neither fails the command with its name;
- an arithmetic expansion of two integers, written without spaces (`$((2*$n))`, `$((32/$n))`), takes its value
  after the variables (integer division, as in bash).
"""

import ast
import collections
import contextlib
import dataclasses
import functools
import glob
import importlib
import io
import itertools
import os
import re
import shlex
import typing

import pytest
import tyro
from conftest import REPO_ROOT

from benchmark.checks import budget
from benchmark.performance import memory_plan
from benchmark.statistics import run as launcher

SCRIPTS = tuple(f"{name}.py" for name in budget.BUDGET)  # every script, named once in benchmark/checks/budget.py
MARKDOWN_FILES = ["README.md"] + sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(f"{REPO_ROOT}/docs/*.md"))
SHELL_FILES = sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(f"{REPO_ROOT}/benchmark/*.sh"))
# Plausible values of shell variables that no loop of the file sets (benchmark/gpu_check.sh's work folders).
SHELL_VALUES = {
    "SEED": "1",
    "W": "/tmp/gpu_check_work",
    "M": "/tmp/gpu_check_work/models",
    # docs/running.md's SLURM recipe
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "HEAD": "10.0.0.1",
    # benchmark/ppo_prm_clip.sh's pilot: the PRM of the loop's cell (the verifier, or the learned PRM's folder)
    "PRM": "verifier",
}

# Where a command starts: a Python interpreter (any path, e.g. .venv/bin/python), accelerate launch, torchrun or
# make train, as a word of its own.
RUNNER = re.compile(
    r"(?<![\w./~-])((?:[\w.~-]*/)*python(?:3(?:\.\d+)?)?|accelerate\s+launch|torchrun|make\s+train)(?![\w.-])"
)
PYTHON = re.compile(r"(?:.*/)?python(?:3(?:\.\d+)?)?")
PLACEHOLDER = re.compile(r"<(?=\S)[^<>\n]*(?<=\S)>")
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::-([^}]*))?\}|(\w+))")
ARITHMETIC = re.compile(r"\$\(\((\d+)([-+*/])(\d+)\)\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
SHELL_LOOP = re.compile(r"\bfor\s+(\w+)\s+in\s+([^;\n]*);\s*do\b")
# Shell words that may come before a command in the same segment (`...; do python x.py`).
SHELL_KEYWORDS = {"do", "then", "else", "elif", "if", "while", "until", "time", "exec", "!", "{", "("}


@dataclasses.dataclass
class Command:
    path: str  # relative to the repo root
    line: int  # where the command starts
    text: str  # the command as written (continuation lines joined)
    script: str  # which of SCRIPTS it runs
    argv: list = None  # the script's arguments
    launcher_argv: list = None  # benchmark.statistics.run's own arguments (the script's come from it), else None
    error: str = None  # why the command could not be read (an unknown shell variable, unbalanced quotes)
    binding: str = ""  # the values of the shell loop variables it was expanded with: "seed=1,mode=raw"

    @property
    def id(self):
        return f"{self.path}:{self.line}:{self.script}" + (f":{self.binding}" if self.binding else "")


# ---------------------------------------------------------------------------------------------------------------
# Finding the commands


def logical_lines(text, first_line=1):
    """[(line number, text)]: lines ending in a backslash joined to the next one."""
    out, pending, start = [], None, None
    for number, line in enumerate(text.split("\n"), first_line):
        if pending is None:
            start, pending = number, ""
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = None
    if pending is not None:
        out.append((start, pending))
    return out


def inline_spans(text, first_line=1):
    """[(line number, code)] of the inline code spans of a text (a span may run over a line break)."""
    spans = INLINE_CODE.finditer(text)
    return [(first_line + text.count("\n", 0, m.start()), m.group(1).replace("\n", " ")) for m in spans]


def blank_inline_spans(text):
    """The text with its inline code spans replaced by spaces (line breaks kept, so that line numbers hold)."""
    return INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def split_tokens(text):
    """Shell words of a command line; `&&`, `||`, `;` and `|` are words of their own, a `#` comment is dropped."""
    lexer = shlex.shlex(PLACEHOLDER.sub("placeholder", text), posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    return list(lexer)


def expansions(tokens, loops):
    """[(loop bindings, tokens)]: shell variables replaced as the module docstring says (one entry per combination of
    the values of the loop variables the tokens use). Raises KeyError naming a variable with no value."""
    tokens = [t for t in tokens if t not in ("$@", "$*", "...", "…")]
    names = {m.group(3) or m.group(1) for t in tokens for m in VARIABLE.finditer(t)}
    used = [name for name in loops if name in names]
    out = []
    for values in itertools.product(*(loops[name] for name in used)):
        binding = dict(zip(used, values))

        def value(m, binding=binding):
            name, default = m.group(3) or m.group(1), m.group(2)
            if name in binding:
                return binding[name]
            if default is not None:
                return default
            if name in SHELL_VALUES:
                return SHELL_VALUES[name]
            raise KeyError(f"${name}")

        out.append((binding, [ARITHMETIC.sub(arithmetic, VARIABLE.sub(value, t)) for t in tokens]))
    return out


def arithmetic(m):
    """The value of a matched `$((a op b))` of two integers, as bash computes it (integer division)."""
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op])


def script_index(tokens):
    """Index of the first token that names one of the scripts, or None."""
    return next((i for i, t in enumerate(tokens) if os.path.normpath(t) in SCRIPTS), None)


def read_segment(segment):
    """(script, argv, launcher_argv) for one simple command that runs a script, else None."""
    while segment and (segment[0] in SHELL_KEYWORDS or re.fullmatch(r"\w+=.*", segment[0])):
        segment = segment[1:]  # `do python x.py`, `OMP_NUM_THREADS=1 python x.py`
    if not segment:
        return None
    head, rest = segment[0], segment[1:]
    if head == "make":
        if "train" not in rest:
            return None
        make_args = next((t.split("=", 1)[1] for t in rest if t.startswith("ARGS=")), "")
        return "grpo_math.py", shlex.split(make_args), None
    if PYTHON.fullmatch(head) and rest[:2] == ["-m", "benchmark.statistics.run"]:
        own, _ = launcher.split_argv(rest[2:])
        script = launcher.flag_value(own, "script")
        return (os.path.normpath(script), None, rest[2:]) if script and os.path.normpath(script) in SCRIPTS else None
    if (
        PYTHON.fullmatch(head)
        and rest[:2] == ["-m", "benchmark.performance.memory_plan"]
        and script_index(rest) is not None
    ):
        own, script_argv = memory_plan.arg_parser().parse_known_args(rest[2:])
        return os.path.normpath(own.script), script_argv, None
    if PYTHON.fullmatch(head) and rest[:2] == ["-m", "accelerate.commands.launch"]:
        rest = rest[2:]
    elif PYTHON.fullmatch(head) and rest[:1] == ["-m"]:
        return None  # another module: runs no script
    elif head == "accelerate" and rest[:1] == ["launch"]:
        rest = rest[1:]
    elif not (PYTHON.fullmatch(head) or head == "torchrun"):
        return None
    i = script_index(rest)
    return None if i is None else (os.path.normpath(rest[i]), rest[i + 1 :], None)


def commands_in(path, line, text, loops=None):
    """The commands that run a script in one piece of code text (a logical line or an inline code span)."""
    m = RUNNER.search(text)
    if m is None:
        return []
    text = text[m.start() :].strip()
    try:
        tokens = split_tokens(text)
    except ValueError as error:  # unbalanced quotes: an error only where a script is named
        found = [s for s in SCRIPTS if re.search(rf"(?<![\w-]){re.escape(s)}", text)]
        return [Command(path, line, text, s, error=f"cannot split into shell words: {error}") for s in found[:1]]
    segments = [[]]
    for token in tokens:
        if token and set(token) <= set("&|;"):
            segments.append([])
        else:
            segments[-1].append(token)
    out = []
    for segment in segments:
        try:
            expanded = expansions(segment, loops or {})
        except KeyError as error:
            run = read_segment([t for t in segment if "$" not in t])
            if run is not None:
                message = f"shell variable {error.args[0]} has no value: give it one in SHELL_VALUES"
                out.append(Command(path, line, text, run[0], error=message))
            continue
        for binding, tokens in expanded:
            run = read_segment(tokens)
            if run is None:
                continue
            script, argv, launcher_argv = run
            binding = ",".join(f"{name}={value}" for name, value in binding.items())
            out.append(Command(path, line, text, script, argv, launcher_argv, binding=binding))
    return out


def markdown_commands(path):
    """Commands of a markdown file: in fenced code blocks (but not ```python ones) and in inline code spans."""
    with open(os.path.join(REPO_ROOT, path)) as f:
        lines = f.read().split("\n")
    out, prose, prose_start, fence, block, block_start = [], [], 1, None, [], None
    for number, line in enumerate(lines, 1):
        if fence is None and line.lstrip().startswith("```"):
            out += [c for n, span in inline_spans("\n".join(prose), prose_start) for c in commands_in(path, n, span)]
            fence, block, block_start = line.lstrip()[3:].strip(), [], number + 1
        elif fence is not None and line.lstrip().startswith("```"):
            if fence.lower() != "python":
                for n, text in logical_lines("\n".join(block), block_start):
                    out += commands_in(path, n, text)
            fence, prose, prose_start = None, [], number + 1
        elif fence is not None:
            block.append(line)
        else:
            prose.append(line)
    out += [c for n, span in inline_spans("\n".join(prose), prose_start) for c in commands_in(path, n, span)]
    return out


def shell_commands(path):
    """Commands of a shell file: its lines that are not comments, and the inline code spans of its comments; the
    variables of its `for` loops take each of their values in turn (a name two loops bind, every value of both)."""
    with open(os.path.join(REPO_ROOT, path)) as f:
        text = f.read()
    loops = collections.defaultdict(list)
    for m in SHELL_LOOP.finditer(text):
        loops[m.group(1)] += [value for value in shlex.split(m.group(2)) if value not in loops[m.group(1)]]
    out = []
    for number, line in logical_lines(text):
        if line.lstrip().startswith("#"):
            out += [c for n, span in inline_spans(line, number) for c in commands_in(path, n, span)]
        else:
            out += commands_in(path, number, line, loops)
    return out


def docstring_commands(script):
    """Commands of a script's module docstring, read from the source (its lines and backslashes as written)."""
    with open(os.path.join(REPO_ROOT, script)) as f:
        source = f.read()
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant), f"{script} has no module docstring"
    text = "\n".join(source.split("\n")[: node.end_lineno])
    out = [c for n, span in inline_spans(text) for c in commands_in(script, n, span)]
    for number, line in logical_lines(blank_inline_spans(text)):
        out += commands_in(script, number, line)
    return sorted(out, key=lambda c: c.line)


def all_commands():
    commands = {path: markdown_commands(path) for path in MARKDOWN_FILES}
    commands.update({path: shell_commands(path) for path in SHELL_FILES})
    commands.update({script: docstring_commands(script) for script in SCRIPTS})
    return commands


COMMANDS = all_commands()


# ---------------------------------------------------------------------------------------------------------------
# Parsing a command with the script's own command line


def main_block(tree):
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
        ):
            return node.body
    return None


def tyro_call(node):
    """The outermost tyro.cli-like call (tyro.cli, tyro.extras.*_cli*) under an AST node, or None."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            name = ast.unparse(sub.func)
            if name.startswith("tyro.") and "cli" in name.rsplit(".", 1)[-1]:
                return sub
    return None


@functools.cache
def script_cli(script):
    """A function argv -> the parsed config, built as the script's `__main__` block builds its command line: the
    block's statements before the one that calls tyro run first (in a copy of the module's namespace), then that
    tyro call is evaluated with args=argv. main() is never called."""
    module = importlib.import_module(script[: -len(".py")])
    with open(os.path.join(REPO_ROOT, script)) as f:
        body = main_block(ast.parse(f.read()))
    assert body, f"{script} has no `if __name__ == '__main__':` block"
    index = next((i for i, stmt in enumerate(body) if tyro_call(stmt) is not None), None)
    assert index is not None, f"{script}'s __main__ block calls no tyro.cli: teach tests/docs/test_commands.py its CLI"
    namespace = dict(vars(module))
    exec(compile(ast.Module(body=body[:index], type_ignores=[]), script, "exec"), namespace)
    call = tyro_call(body[index])
    call.keywords = [k for k in call.keywords if k.arg != "args"] + [
        ast.keyword(arg="args", value=ast.Name(id="__argv__", ctx=ast.Load()))
    ]
    code = compile(ast.fix_missing_locations(ast.Expression(body=call)), script, "eval")

    def parse(argv):
        return eval(code, {**namespace, "__argv__": list(argv)})

    return parse


def parse_error(script, argv):
    """None if the script's command line accepts argv (--help counts), else what it printed."""
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            script_cli(script)(argv)
    except SystemExit as exit:
        if exit.code not in (0, None) or not {"--help", "-h"} & set(argv):
            return f"exit code {exit.code}:\n{output.getvalue()}"
    return None


def script_argv(command):
    """The arguments the script gets (for benchmark.statistics.run: those of the first seed, after parsing the
    launcher's)."""
    if command.launcher_argv is None:
        return command.argv
    own, script_args = launcher.split_argv(command.launcher_argv)
    output = io.StringIO()
    try:
        with contextlib.redirect_stderr(output):
            args = launcher.build_parser().parse_args(own)
    except SystemExit:
        pytest.fail(f"{command.id}: benchmark.statistics.run refuses {shlex.join(own)}:\n{output.getvalue()}")
    full = launcher.build_command(args.script, args.seeds[0], script_args, track=args.track, sha="0" * 40)
    return full[full.index(args.script) + 1 :]


FLAT = [command for path in COMMANDS for command in COMMANDS[path]]


def unique_ids(commands):
    """Command ids, the second command of one script on one line (`python x.py`, then `make train`) with #2."""
    seen, ids = collections.Counter(), []
    for command in commands:
        seen[command.id] += 1
        ids.append(command.id if seen[command.id] == 1 else f"{command.id}#{seen[command.id]}")
    return ids


IDS = unique_ids(FLAT)


@pytest.mark.parametrize("command", FLAT, ids=IDS)
def test_command_parses(command):
    written = " ".join(command.text.split())
    assert command.error is None, f"{command.id}: {command.error}\n  {written}"
    argv = script_argv(command)
    error = parse_error(command.script, argv)
    assert error is None, f"{command.id}: {command.script} refuses {shlex.join(argv)}\n  {written}\n{error}"


def test_commands_are_found_everywhere():
    """The extraction cannot pass by finding nothing: every source has the commands it is known to have."""
    counts = {path: len(commands) for path, commands in COMMANDS.items()}
    by_script = {path: collections.Counter(c.script for c in commands) for path, commands in COMMANDS.items()}
    assert counts["README.md"] >= 3 and counts["docs/running.md"] >= 12, counts  # README's detail is in running.md
    for script in SCRIPTS:
        name = script[: -len(".py")]
        # Each docstring: its CPU commands and its GPU (accelerate launch) ones.
        assert by_script[script][script] >= 3, f"{script}'s docstring: {by_script[script]}"
        assert any(c.text.startswith("accelerate launch") for c in COMMANDS[script]), f"{script}: no accelerate"
        assert by_script[f"docs/{name}.md"][script] >= 1, f"docs/{name}.md runs no {script}: {by_script}"
        assert by_script[f"benchmark/{name}.sh"][script] >= 1, f"benchmark/{name}.sh runs no {script}: {by_script}"
    forms = {c.text.split()[0].rsplit("/", 1)[-1] for c in FLAT} | {
        "benchmark.statistics.run" for c in FLAT if c.launcher_argv
    }
    assert {"python", "accelerate", "make", "benchmark.statistics.run"} <= forms, forms
    assert len(FLAT) >= 80, counts


def test_extraction_of_each_form():
    text = (
        "Run it:\n"
        "    python reward_modeling.py && .venv/bin/python ppo_rlhf.py --no-vllm   # a comment's quote\n"
        "    accelerate launch --num_processes 8 ppo_rlhf.py --model_name_or_path <sft model> \\\n"
        "        --instruction '' ...\n"
        "Two processes: accelerate launch --multi_gpu tests/fixed_rollout.py grpo_math.py --no-vllm ...\n"
        "    python -m benchmark.statistics.registry plot --out x.png\n"
        "    [ -d runs ] || torchrun --nproc_per_node 2 dpo_online.py --seed $SEED\n"
    )
    found = [(c.line, c.script, c.argv) for n, line in logical_lines(text) for c in commands_in("t", n, line)]
    assert found == [
        (2, "reward_modeling.py", []),
        (2, "ppo_rlhf.py", ["--no-vllm"]),
        (3, "ppo_rlhf.py", ["--model_name_or_path", "placeholder", "--instruction", ""]),
        (5, "grpo_math.py", ["--no-vllm"]),
        (7, "dpo_online.py", ["--seed", "1"]),
    ]
    make_span, flag_span = inline_spans('Pass `make train ARGS="--seed 2\n--no-vllm"` and\n`--prm`.', 10)
    assert flag_span == (12, "--prm") and commands_in("t", *flag_span) == []
    (make,) = commands_in("t", *make_span)
    assert (make.line, make.script, make.argv) == (10, "grpo_math.py", ["--seed", "2", "--no-vllm"])
    loops = {"seed": ["1", "2"], "mode": ["raw", "clip"]}
    line = 'python -m benchmark.statistics.run --script ppo_prm_clip.py --seeds "$seed" "$@" -- --reward_mode "$mode"'
    runs = commands_in("t", 4, line, loops)
    assert [c.id for c in runs] == [
        f"t:4:ppo_prm_clip.py:seed={s},mode={m}" for s, m in itertools.product(("1", "2"), ("raw", "clip"))
    ]
    assert script_argv(runs[1]) == ["--seed", "1", "--reward_mode", "clip"]
    (half,) = commands_in(
        "t", 1, "python ppo_rlhf.py --seed $((2*$seed)) --total_steps $((32/$seed))", {"seed": ["3"]}
    )
    assert script_argv(half) == ["--seed", "6", "--total_steps", "10"]
    (unknown,) = commands_in("t", 1, "python grpo_math.py --seed $NOPE", loops)
    assert "$NOPE" in unknown.error


def test_a_shell_variable_two_loops_bind_takes_the_values_of_both(tmp_path):
    script = tmp_path / "two_loops.sh"
    script.write_text(
        "for n in 1 4; do\n    python ppo_rlhf.py --num_minibatches $n\ndone\n"
        "for n in 1 16; do\n    python ppo_rlhf.py --num_minibatches $n --no-whiten_advantages\ndone\n"
    )
    found = [(c.line, script_argv(c)[1]) for c in shell_commands(str(script))]
    assert sorted(found) == [(2, n) for n in ("1", "16", "4")] + [(5, n) for n in ("1", "16", "4")]


def test_parse_catches_a_bad_flag():
    """tyro's booleans are flags: `--whiten_rewards False` is refused, `--no-whiten_rewards` is accepted."""
    assert "False" in parse_error("ppo_rlhf.py", ["--dtype", "bfloat16", "--whiten_rewards", "False"])
    assert parse_error("ppo_rlhf.py", ["--dtype", "bfloat16", "--no-whiten_rewards"]) is None
    assert parse_error("grpo_math.py", ["--learning_rat", "1"]) is not None
    assert parse_error("grpo_math.py", ["--help"]) is None


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_command_line_is_args_then_run_args(script, capsys):
    """Config joins the algorithm's Args (above the fence) and RunArgs (below): no flag in both, every field of
    either in Config, and --help lists every Args flag before the first RunArgs one."""
    module = importlib.import_module(script.removesuffix(".py"))
    algorithm = [f.name for f in dataclasses.fields(module.Args)]
    run = [f.name for f in dataclasses.fields(module.RunArgs)]
    assert not set(algorithm) & set(run)
    assert [f.name for f in dataclasses.fields(module.Config)] == algorithm + run
    with pytest.raises(SystemExit):
        tyro.cli(module.Config, args=["--help"])
    text = capsys.readouterr().out
    flag = lambda name: re.search(rf"--{name.replace('_', '-')}(?![\w-])", text)  # noqa: E731
    # The computed fields (world_size, run_name, ...) are tyro.conf.Suppress: in config.json, never flags.
    computed = [f.name for f in dataclasses.fields(module.Config) if typing.get_origin(f.type) is typing.Annotated]
    assert "run_name" in computed and "world_size" in computed and not any(flag(name) for name in computed)
    where = {name: flag(name) for name in algorithm + run if name not in computed}
    assert all(where.values()), [name for name, found in where.items() if not found]
    assert max(where[name].start() for name in algorithm if name in where) < min(
        where[name].start() for name in run if name in where
    )
