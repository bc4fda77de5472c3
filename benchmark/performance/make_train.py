"""README's `make train` row, measured: `/usr/bin/time -v make train ARGS="--seed N"` after set-up, with nothing else
running on the machine; writes the command, the host, the date and time's report to --out, which
tests/docs/test_readme.py reads against README's row and docs/running.md.

    python -m benchmark.performance.make_train --seed 19 --out benchmark/results/make_train.txt
"""

import argparse
import datetime
import os
import subprocess
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host():
    """The CPU's model name and the number of cores, from /proc/cpuinfo."""
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.performance.make_train", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seed", type=int, default=19, help="grpo_math.py's --seed")
    parser.add_argument("--out", required=True, help="the report's file")
    args = parser.parse_args(argv)
    with tempfile.NamedTemporaryFile(mode="r", suffix=".time") as report:
        command = ["/usr/bin/time", "-v", "-o", report.name, "make", "train", f"ARGS=--seed {args.seed}"]
        with open(os.devnull, "w") as quiet:
            subprocess.run(command, cwd=REPO_ROOT, stdout=quiet, stderr=quiet)
        timed = report.read()
    with open(args.out, "w") as f:
        f.write(f'# command: /usr/bin/time -v make train ARGS="--seed {args.seed}"\n')
        f.write(f"# host: {host()}\n# date: {datetime.date.today()}\n# alone: nothing else running\n{timed}")


if __name__ == "__main__":
    main()
