"""README.md is the front door: its first screen says what, how and how long; every number in it that the repository
can work out (the table of scripts, the run time of `make train`) is worked out here; every committed table that the
committed runs give is remade from them (`make tables`); every link in README.md and docs/ leads to a file."""

import glob
import os
import re
import sys

import pytest
from conftest import REPO_ROOT

from benchmark.checks import tables
from benchmark.statistics import registry


def read(path):
    with open(os.path.join(REPO_ROOT, path)) as f:
        return f.read()


def test_the_first_screen_says_what_how_and_how_long():
    first_screen = "\n".join(read("README.md").splitlines()[:20])
    assert "make train" in first_screen and "make test" in first_screen
    assert re.search(r"\| `make train` \| \d+ min", first_screen) and re.search(
        r"\| `make test` \| \d+-\d+ min", first_screen
    )
    assert "2-core" in first_screen and "Python 3.11" in first_screen and "GB of memory" in first_screen


def test_the_table_of_scripts_is_made_from_the_committed_runs_and_the_scripts():
    text = read("README.md")
    assert tables.readme_with_table(text) == text, "python -m benchmark.checks.tables --write makes the table again"
    for script in tables.SCRIPTS:
        assert f"[`{script}`]({script})" in text


def test_the_make_train_time_is_a_measurement_alone_with_its_command():
    """README's `make train` time and peak memory are read from the committed measurement (benchmark/results/
    make_train.txt: the command, the host, nothing else running, and /usr/bin/time -v's output), as docs/running.md
    gives them."""
    row = next(line for line in read("README.md").splitlines() if line.startswith("| `make train` |"))
    measured = read("benchmark/results/make_train.txt")
    command = re.search(r"^# command: (.+)$", measured, re.M)[1]
    assert command.startswith("/usr/bin/time -v make train") and "# alone: nothing else running" in measured
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", measured)
    seconds = int(clock[1] or 0) * 3600 + int(clock[2]) * 60 + float(clock[3])
    peak_gib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", measured)[1]) / 2**20
    assert re.search(r"Exit status: 0$", measured, re.M)
    minutes = re.match(r"\| `make train` \| (\d+) min after set-up", row)
    assert minutes and int(minutes[1]) == round(seconds / 60), row
    assert f"{round(seconds)} s" in row and f"peak memory {peak_gib:.1f} GiB" in row, row
    assert "measured alone" in row and "benchmark/results/make_train.txt" in row
    running = " ".join(read("docs/running.md").split())
    assert f"{round(seconds)} s in all" in running
    assert "committed runs" not in row


def test_plus_minus_and_the_verdicts_are_defined_once():
    text = read("README.md")
    assert text.count("**±** is the standard deviation over seeds") == 1
    assert all(f"**{word}** when" in text for word in ("held", "not held")) and "**inconclusive** otherwise" in text


def test_every_committed_t_verdict_has_its_exact_sign_flip_p():
    """Each claim check on paired seeds (registry paired / change with a bound, prm_checks, offpolicy's claim, power's
    verdict now) prints the exact sign-flip p beside its t verdict, and README says what it is and that 1/16 is its
    smallest value at n = 4."""
    text = " ".join(read("README.md").split())
    assert "exact paired sign-flip p" in text and "1/16 at n = 4 paired seeds" in text
    checked = []
    for _, argv, files, why in tables.classify():
        bounded = any(flag in argv for flag in ("--at_least", "--at_most"))
        claim = argv[:2] in (["-m", "benchmark.claims.prm_checks"], ["-m", "benchmark.statistics.power"]) or (
            argv[:2] == ["-m", "benchmark.claims.offpolicy"] and "--baseline" not in argv
        )
        if why is None and (bounded or claim):
            for path in [f for f in files if f.endswith(".md")]:
                table = read(path)
                if "held**" in table or "inconclusive" in table:
                    assert "sign-flip p" in table, path
                    checked.append(path)
    assert "benchmark/results/async_vs_sync_faster.md" in checked and "benchmark/results/offpolicy_stale.md" in checked
    assert "benchmark/results/ppo_prm_clip_claims_checks.md" in checked and len(checked) > 20


@pytest.mark.slow
def test_make_tables_remakes_the_committed_tables_from_the_committed_runs(capsys):
    tables.main([])
    assert re.search(r"^\d+ commands remade", capsys.readouterr().out)


def test_make_tables_reads_the_named_blocks_and_remakes_the_claim_checks():
    """A shell file's named blocks (`bash benchmark/X.sh NAME`) are read as its main part is, and the claim checks
    (prm_checks, offpolicy) are remade from their committed runs like a registry table."""
    remade = {f: (name, argv) for name, argv, files, why in tables.classify() if why is None for f in files}
    assert remade["benchmark/results/ppo_prm_clip_verifier_checks.md"][1][1] == "benchmark.claims.prm_checks"
    assert remade["benchmark/results/offpolicy.md"][1][1] == "benchmark.claims.offpolicy"
    assert remade["benchmark/results/async_vs_sync_faster.md"][1][-4:-2] == ["--at_most", "0"]
    # grpo_tools.sh chain_3t: a named block's table.
    assert remade["benchmark/results/grpo_tools_chain_3t.md"][0] == "grpo_tools.sh"


def test_make_tables_fails_when_a_committed_table_differs(monkeypatch):
    """One committed table made again with other numbers: the check names it."""
    made = []

    def markdown_table(experiments, metrics, digits=3):
        made.append(1)
        return "| a table with other numbers |\n"

    monkeypatch.setattr(registry, "markdown_table", markdown_table)
    commands = [row for row in tables.classify() if row[3] is None and row[1][2] == "table"][:1]
    monkeypatch.setattr(tables, "classify", lambda: commands)
    with pytest.raises(SystemExit) as error:
        tables.main([])
    assert made and commands[0][2][0] in str(error.value.code)


def test_every_relative_link_leads_to_a_file():
    broken = []
    for path in ["README.md", *sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(f"{REPO_ROOT}/docs/*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", read(path)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = os.path.normpath(os.path.join(REPO_ROOT, os.path.dirname(path), target.split("#")[0]))
            if not os.path.exists(file):
                broken.append(f"{path}: {target}")
    assert not broken, broken


def test_the_set_up_sizes_are_what_make_setup_and_make_assets_leave():
    """README's 3.0 GB of .venv and 263 MB of assets/, within 10% of what this machine's set-up left (the tests run
    from that .venv, after make assets)."""

    def megabytes(folder):
        sizes = (os.lstat(os.path.join(root, f)).st_size for root, _, files in os.walk(folder) for f in files)
        return sum(sizes) / 2**20

    row = next(line for line in read("README.md").splitlines() if line.startswith("| set-up"))
    venv_gb, assets_mb = re.search(r"`\.venv/` of ([\d.]+) GB and `assets/` of (\d+) MB", row).groups()
    assets = os.path.join(REPO_ROOT, "assets")
    if not os.path.isdir(assets) or not os.path.isfile(os.path.join(sys.prefix, "pyvenv.cfg")):
        pytest.skip("not run from make setup's .venv after make assets")
    assert megabytes(assets) == pytest.approx(float(assets_mb), rel=0.1)
    assert megabytes(sys.prefix) / 1024 == pytest.approx(float(venv_gb), rel=0.1)


def test_the_rows_say_what_their_numbers_are():
    """grpo_tools' step-0 accuracy is the call its prompt shows, imitated (not learned), and ppo_prm_clip's row gives
    the claims' set, named by the step verifier it was made with; the README's rows say so."""
    rows = {
        line.split("`]")[0].split("[`")[-1]: line for line in read("README.md").splitlines() if line.startswith("| [`")
    }
    assert "at step 0: the call its prompt shows, imitated" in rows["grpo_tools.py"]
    assert "the claims' set, made with the step verifier of 2026-11-29" in rows["ppo_prm_clip.py"]
    claims = [line for line in read("README.md").splitlines() if line.startswith("| PRM Clip / Delta")]
    assert claims and "the step verifier of 2026-11-29" in claims[0]


def test_the_async_verdicts_carry_their_caveats_and_the_caveats_hold():
    """Async "faster" and "no accuracy loss": README's rows say they were registered after their runs and that
    `--sync` ran first, which the committed runs' start times show for every seed. The stale setting's table in
    docs/async_rlhf.md is each N = 16 run's stalest-minibatch KL at its two batches, as the committed runs logged it,
    beside the rule as registered."""
    rows = [
        line for line in read("README.md").splitlines() if line.startswith(("| Asynchronous RLHF", "| ... at no acc"))
    ]
    assert len(rows) == 2 and all("registered after its runs" in row and "`--sync`" in row for row in rows), rows
    runs = registry.find_runs(os.path.join(REPO_ROOT, "benchmark/results/async_rlhf/arith_1d__async_bench_*"), True)
    starts = {(run["exp_name"], run["seed"]): run["stamp"] for run in runs}
    assert len(starts) == 6
    assert all(starts["async_bench_sync", seed] < starts["async_bench_async", seed] for seed in (1, 2, 3))
    text = read("docs/async_rlhf.md")
    for label, pattern in (
        ("online DPO, lr 3e-5", "*66_dpo_lr3e-5_n16__*"),
        ("RLOO, lr 6e-5", "*66_rloo_lr6e-5_n16__*"),
    ):
        found = registry.find_runs(os.path.join(REPO_ROOT, "benchmark/results/async_rlhf_stale", pattern))
        cells = []
        for run in found:
            kl = registry.metric_series(run["lines"], "policy/approxkl_last_minibatch")[1]
            cells.append(" / ".join(f"{v:.3f}" for v in kl))
        assert [run["seed"] for run in found] == [1, 2, 3, 4]
        assert f"| {label}: batch 1 / batch 2 | " + " | ".join(cells) + " |" in text, cells
    registered = "registered the setting as a learning rate at which the stalest minibatch's approximate KL to its"
    assert registered + " sampler is >= 0.1" in " ".join(text.split())


def test_a_standard_error_is_never_written_with_plus_minus():
    """± is a standard deviation over seeds (README); an interval's standard error is "(s.e. x)", never
    "-0.079 ± 0.037, 95% interval ...", a standard error written as ±."""
    for path in ["README.md", *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]:
        text = " ".join(read(os.path.relpath(path, REPO_ROOT)).split())
        assert not re.search(r"\d ± \d+\.\d+\)?,? 95% interval", text), path
