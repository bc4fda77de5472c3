"""Every table and figure that the committed runs can remake, remade from them alone, without training.

    python -m benchmark.checks.tables          # remake each into a temporary folder; fail if a committed table differs
    python -m benchmark.checks.tables --write  # remake them in place
    python -m benchmark.checks.tables --list   # every output of benchmark/*.sh: remade here, or why not

The commands are those of benchmark/*.sh (all but gpu_check.sh, a GPU measurement), its main part and each named
block (`bash FILE NAME`), found by running each with `python` replaced by a shell function that records its arguments
and runs nothing. A `python -m benchmark.statistics.registry table | change | paired | perf | plot | frontier` command,
or a claim check (benchmark.claims.prm_checks, benchmark.claims.offpolicy), is remade when every --experiments glob
matches committed run folders (config.json and metrics.jsonl under benchmark/results/), a
`python -m benchmark.claims.best_of_n analyse` from its committed OUT.jsonl (--from_responses); the others need
training (their runs are not committed) or are measurements (throughput, determinism, peer timings), whose raw JSON is
committed beside the table. Markdown and JSON are compared byte for byte. A PNG is remade, not compared: its bytes
depend on matplotlib's version. The README's scripts table is checked by tests/docs/test_readme.py against the same
committed runs.
"""

import argparse
import contextlib
import filecmp
import glob
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile

from benchmark.checks import budget
from benchmark.statistics import registry

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMITTED = "benchmark/results/"
REMADE = ("table", "change", "paired", "perf", "plot", "frontier")
# Claim checks and power plans from LABEL=GLOB --experiments, like table.
CHECKS = (
    "benchmark.claims.prm_checks",
    "benchmark.claims.prm_pilot",
    "benchmark.claims.offpolicy",
    "benchmark.statistics.power",
)
MEASUREMENTS = ("gpu_check.sh",)  # shell files that only measure on a GPU; nothing in them is remade here

# `python` as a shell function: it appends its arguments (unit separators between, a record separator after) to
# $RECORD and runs nothing, so a shell file's loops, variables and arrays expand as they would in a real run.
RECORDER = r"""python() { printf '%s\037' "$@" >> "$RECORD"; printf '\036' >> "$RECORD"; }
export -f python
exec bash "$0" "$@"
"""


def shell_calls(path, block=None):
    """The argument lists `python` is called with in one shell file, in order, with its variables expanded: its main
    part, or with `block` the part run by `bash FILE BLOCK` (an `if [[ ${1:-} == BLOCK ]]` ... `exit 0`)."""
    with tempfile.NamedTemporaryFile(suffix=".calls") as record:
        env = {**os.environ, "RECORD": record.name}
        argv = ["bash", "-c", RECORDER, path] + ([block] if block else [])
        subprocess.run(argv, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
        text = open(record.name).read()
    return [call.split("\037")[:-1] for call in text.split("\036")[:-1]]


def outputs(command):
    """The files one registry command writes."""
    out = command.out
    if out is None:
        return []
    return [out + ".md", out + ".json"] if command.command == "perf" else [out]


def not_committed(specs):
    """None when every LABEL=GLOB of --experiments matches committed run folders (under benchmark/results/), else why
    the command is not remade: runs elsewhere (runs/) are a machine's own, not the repository's."""
    patterns = [registry.parse_experiment(spec)[1] for spec in specs]
    missing = [p for p in patterns if not p.startswith(COMMITTED) or not glob.glob(os.path.join(REPO_ROOT, p))]
    return f"its runs are not committed ({missing[0]})" if missing else None


def classify():
    """[(shell file, argv, outputs, None or why it is not remade)] for every command of benchmark/*.sh that writes
    into benchmark/results/; a registry command that writes an output a later one writes again is left out."""
    rows = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "benchmark", "*.sh"))):
        name = os.path.basename(path)
        if name in MEASUREMENTS:
            continue
        blocks = re.findall(r"^if \[\[ \$\{1:-\} == (\w+) \]\]", open(path).read(), re.MULTILINE)
        for argv in [argv for block in [None, *blocks] for argv in shell_calls(path, block)]:
            if argv[:2] == ["-m", "benchmark.statistics.registry"] and argv[2] in REMADE:
                command = registry.build_parser().parse_args(argv[2:])
                files = outputs(command)
                if files:  # a command without --out only prints
                    rows.append((name, argv, files, not_committed(command.experiments)))
            elif argv[:2] in (["-m", module] for module in CHECKS):  # claim checks read committed runs too
                out = argv[argv.index("--out") + 1]
                files = [out] if out.endswith(".md") else [out + ".md", out + ".png"]
                start = argv.index("--experiments") + 1
                specs = argv[start : next((i for i in range(start, len(argv)) if argv[i].startswith("--")), None)]
                rows.append((name, argv, files, not_committed(specs)))
            elif argv[:3] == ["-m", "benchmark.claims.best_of_n", "analyse"]:  # remade from its committed OUT.jsonl
                out = argv[argv.index("--out") + 1]
                why = None if os.path.isfile(out + ".jsonl") else f"its responses are not committed ({out}.jsonl)"
                rows.append((name, from_responses(argv, out + ".jsonl"), [out + ".md", out + ".png"], why))
            elif "--out" in argv and argv[argv.index("--out") + 1].startswith(COMMITTED):
                module = argv[1] if argv[0] == "-m" else argv[0]
                # `copy` fills benchmark/results/ with the runs themselves
                if module != "benchmark.statistics.registry":
                    why = f"a measurement or a run of trained models ({module})"
                    rows.append((name, argv, [argv[argv.index("--out") + 1]], why))
    last = {}
    for i, (_, _, files, _) in enumerate(rows):
        last.update({f: i for f in files})
    return [row for i, row in enumerate(rows) if any(last[f] == i for f in row[2])]


def from_responses(argv, responses):
    """A best_of_n analyse command reading the committed per-prompt file instead of the run folder."""
    argv = list(argv)
    if "--out_dir" in argv:
        del argv[argv.index("--out_dir") : argv.index("--out_dir") + 2]
    return [*argv, "--from_responses", responses]


def remake(argv, folder):
    """Run one registry (or best_of_n analyse) command with its outputs placed in `folder` (None: where the shell
    file puts them)."""
    if folder is not None:
        argv = list(argv)
        out = argv[argv.index("--out") + 1]
        argv[argv.index("--out") + 1] = os.path.join(folder, out)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        importlib.import_module(argv[1]).main(argv[2:])  # registry, best_of_n analyse, or a claim check


# README's table of scripts: one result each, worked out from the committed runs ({name[initial]}: the mean step-0
# value, {name[final]}: the final value as mean ± std over seeds, {name[seeds]}: their number, {name[time]}: the mean
# wall-clock, {name[steps]}: the last step), with each script's lines (above the fence / total) read from the script.
R = COMMITTED
SCRIPTS = {
    "grpo_math.py": (
        "GRPO on math with verifiable rewards (+ DAPO, Dr. GRPO, GSPO, CISPO options)",
        "held-out accuracy {a[initial]} → {a[final]} in {a[steps]} steps ({a[seeds]} seeds)",
        dict(a=(R + "grpo_math_default/add_2t2d__grpo_p4__*", "eval/accuracy")),
    ),
    "reward_modeling.py": (
        "a Bradley-Terry reward model, or a step-level PRM (`--prm`)",
        "held-out pair accuracy {a[initial]} → {a[final]} ({a[seeds]} seed)",
        dict(a=(R + "reward_modeling/arith_1d__reward_model__*", "eval/accuracy")),
    ),
    "ppo_rlhf.py": (
        "PPO against a learned reward model",
        "verifier accuracy {a[initial]} → {a[final]} ({a[seeds]} seeds)",
        dict(a=(R + "ppo_vs_dpo/arith_1d__ppo_vs_dpo_ppo__*", "eval/accuracy")),
    ),
    "dpo_online.py": (
        "online DPO judged by a reward model",
        "verifier accuracy {a[initial]} → {a[final]} at PPO's number of samples ({a[seeds]} seeds)",
        dict(a=(R + "ppo_vs_dpo/arith_1d__ppo_vs_dpo_dpo__*", "eval/accuracy")),
    ),
    "ppo_prm_clip.py": (
        "PPO with process rewards refined by Clip / Delta",
        "accuracy {clip[initial]} → {clip[final]} with Clip, {none[final]} with the final reward alone, {raw[final]} "
        "with raw process rewards ({clip[seeds]} seeds; the claims' set, made with the step verifier of 2026-11-29, "
        "which read every decimal as rounded)",
        dict(
            clip=(R + "ppo_prm_clip_claims/arith_2t3t1d__prm65_clip__*", "eval/accuracy"),
            none=(R + "ppo_prm_clip_claims/arith_2t3t1d__prm65_none__*", "eval/accuracy"),
            raw=(R + "ppo_prm_clip_claims/arith_2t3t1d__prm65_raw__*", "eval/accuracy"),
        ),
    ),
    "async_rlhf.py": (
        "asynchronous off-policy RLHF (online DPO or RLOO) with bounded staleness",
        "{a[time]} against `--sync`'s {s[time]} for 12 steps, accuracy {a[final]} against {s[final]} ({a[seeds]} "
        "seeds)",
        dict(
            a=(R + "async_rlhf/arith_1d__async_bench_async__*", "eval/accuracy"),
            s=(R + "async_rlhf/arith_1d__async_bench_sync__*", "eval/accuracy"),
        ),
    ),
    "grpo_tools.py": (
        "GRPO over multi-turn trajectories with tools, called in the model's chat-template format or `<calc>` tags",
        "held-out accuracy {t[initial]} → {t[final]} with the calculator ({t[initial]} at step 0: the call its prompt "
        "shows, imitated), {n[initial]} → {n[final]} without ({t[seeds]} seeds); a price look-up through native "
        "calls {p[initial]} → {p[final]} ({p[seeds]} seeds)",
        dict(
            t=(R + "grpo_tools/mul_2t3d__tools__*", "eval/accuracy"),
            n=(R + "grpo_tools/mul_2t3d__notool__*", "eval/accuracy"),
            p=(R + "grpo_tools_price_list_one/price_list_one__*price_one__*", "eval/accuracy"),
        ),
    ),
}
README_BEGIN = "<!-- the table of scripts: python -m benchmark.checks.tables --write remakes it -->"
README_END = "<!-- end of the table of scripts -->"


def figures(pattern, metric):
    """{initial, final, seeds, time, steps} of the committed runs a glob matches, as README's table writes them."""
    runs = registry.find_runs(os.path.join(REPO_ROOT, pattern))
    summary = registry.summarize(runs, [metric])
    return dict(
        steps=max(registry.final_step(run["lines"]) for run in runs),
        initial=f"{summary[metric]['initial'][0]:.3f}",  # the mean of the step-0 evaluations
        final=registry.format_mean_std(summary[metric]["final"]),
        seeds=summary["seeds"],
        time=registry.format_seconds(summary["wall_clock"][0]),
    )


def readme_table():
    """README's table of scripts, from the committed runs and the scripts."""
    rows = ["| script | what it does | lines: above the fence / total | one result on CPU (details: docs) |"]
    rows.append("| --- | --- | --- | --- |")
    for script, (what, result, experiments) in SCRIPTS.items():
        size = budget.measure(os.path.join(REPO_ROOT, script))
        text = result.format(**{k: figures(*v) for k, v in experiments.items()})
        docs = f"docs/{script.removesuffix('.py')}.md"
        rows.append(
            f"| [`{script}`]({script}) | {what} | {size['above']} / {size['total']} | {text}: [{docs}]({docs}) |"
        )
    return "\n".join(rows) + "\n"


def readme_with_table(text):
    """README.md's text with the table of scripts between its two markers made again."""
    start, end = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    return text[:start] + "\n" + readme_table() + text[end:]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmark.checks.tables", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="remake the committed tables and figures in place")
    parser.add_argument("--list", action="store_true", help="list every output and whether it is remade here")
    args = parser.parse_args(argv)
    with contextlib.chdir(REPO_ROOT):
        check(args)


def check(args):
    rows = classify()
    if args.list:
        for name, _, files, why in rows:
            print(f"{name}: {', '.join(files)}: {why or 'remade from the committed runs'}")
        written = {f for _, _, files, _ in rows for f in files}
        for path in sorted(glob.glob(COMMITTED + "*.*")):
            if path not in written and not any(path.startswith(f + "/") or path.startswith(f + ".") for f in written):
                print(f"(no shell file): {path}: not remade (no command that ran writes it; a guard may skip one)")
        return
    remade = [(argv, files) for _, argv, files, why in rows if why is None]
    differ = []
    with tempfile.TemporaryDirectory() as folder:
        for argv, files in remade:
            remake(argv, None if args.write else folder)
            for f in files:
                if args.write or f.endswith(".png"):
                    continue
                if not os.path.exists(f) or not filecmp.cmp(f, os.path.join(folder, f), shallow=False):
                    differ.append(f)
    kept = sum(why is not None for *_, why in rows)
    print(f"{len(remade)} commands remade ({sum(len(f) for _, f in remade)} files); {kept} outputs need training or")
    print("a measurement (python -m benchmark.checks.tables --list)")
    readme = os.path.join(REPO_ROOT, "README.md")
    text = open(readme).read()
    if args.write:
        with open(readme, "w") as f:
            f.write(readme_with_table(text))
    elif readme_with_table(text) != text:
        differ.append("README.md (the table of scripts)")
    if differ:
        sys.exit("error: these committed tables differ from what their committed runs give:\n  " + "\n  ".join(differ))


if __name__ == "__main__":
    main()
