"""Run a script over seeds as tracked runs, a few at a time (CleanRL's benchmark style).

    python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 --workers 2 [--track] [--dry_run] \
        -- <script args>
    python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 --num_processes 4 \
        --accelerate_config benchmark/accelerate_configs/multi_gpu.yaml -- --vllm_dtype bfloat16

Each seed runs as `python <script> --seed S <script args>` (inside `accelerate launch` when --accelerate_config or
--num_processes is given; with --track, `--track --wandb_tags <git sha>` is added), at most --workers at a time.
With --resume_unfinished (for experiments that span sessions) a seed whose run folder, same --exp_name, is there from
an earlier launch is skipped when its metrics reached --total_steps and resumed from its checkpoint (`--resume
<folder>`) when not. Every command is printed before it starts; its stdout and stderr go to
runs/_logs/{script}__{seed}__{unix_time}.log. A failing seed does not stop the others; the summary at the end gives
each seed's exit code, run folder and wall-clock, and the launcher exits with 1 when any seed failed. Nothing else is
written: the run folders are the scripts' own (runs/{run_name}/config.json records the git sha), and `python -m
benchmark.statistics.registry` reads them.
"""

import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def split_argv(argv):
    """Launcher arguments and script arguments, split at the first `--`."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def git_sha(cwd=REPO_ROOT):
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True)
        return out.stdout.strip()
    except OSError:
        return ""


def git_dirty(cwd=REPO_ROOT):
    """Whether tracked files differ from HEAD (the sha then does not name the code that ran)."""
    try:
        return subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=cwd, capture_output=True).returncode == 1
    except OSError:
        return False


def flag_index(args, name):
    """Index of --name (or its dashed spelling, or --name=value) in a list of arguments, or None."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(args):
        if arg in spellings or arg.split("=", 1)[0] in spellings:
            return i
    return None


def flag_value(args, name, default=None):
    """The value given to --name in a list of arguments (the last occurrence wins, as in argparse)."""
    value = default
    for i, arg in enumerate(args):
        spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
        if "=" in arg and arg.split("=", 1)[0] in spellings:
            value = arg.split("=", 1)[1]
        elif arg in spellings and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
    return value


def with_tracking(script_args, tag):
    """Script arguments with --track and `tag` added to --wandb_tags (after the user's own tags, if any)."""
    args = list(script_args)
    if flag_index(args, "track") is None:
        args.append("--track")
    i = flag_index(args, "wandb_tags")
    if i is None:
        return args + ["--wandb_tags", tag]
    if "=" in args[i]:  # --wandb_tags=a -> --wandb_tags a
        flag, first = args[i].split("=", 1)
        args[i : i + 1] = [flag, first]
    j = i + 1
    while j < len(args) and not args[j].startswith("--"):
        j += 1
    args.insert(j, tag)
    return args


def build_command(
    script, seed, script_args, track=False, sha="", accelerate_config=None, num_processes=None, main_process_port=None
):
    """The argv of one seed's run."""
    args = ["--seed", str(seed), *script_args]
    if track:
        args = with_tracking(args, sha or "no-git")
    if accelerate_config is None and num_processes is None:
        return [sys.executable, script, *args]
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if accelerate_config is not None:
        launch += ["--config_file", accelerate_config]
    if num_processes is not None:
        launch += ["--num_processes", str(num_processes)]
    if main_process_port is not None:
        launch += ["--main_process_port", str(main_process_port)]
    return [*launch, script, *args]


def list_dirs(folder):
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def run_seed_of(path):
    return run_args(path).get("seed")


def find_run_folder(output_dir, seed, existing, log_text="", exp_name=None):
    """The run folder a seed created: a folder of output_dir not in `existing` whose config.json has this seed (and
    exp_name, when given); if several, the one the log names, else the newest. None when there is none."""
    candidates = []
    for name in sorted(list_dirs(output_dir) - existing):
        path = os.path.join(output_dir, name)
        if run_seed_of(path) != seed:
            continue
        if exp_name is not None:
            with open(os.path.join(path, "config.json")) as f:
                if json.load(f)["args"].get("exp_name") != exp_name:
                    continue
        candidates.append(path)
    named = [path for path in candidates if os.path.basename(path) in log_text]
    if named:
        candidates = named
    if not candidates:
        return None
    return max(candidates, key=lambda p: os.path.getmtime(os.path.join(p, "config.json")))


def earlier_run(output_dir, seed, exp_name):
    """An earlier launch's run folder for this seed and exp_name (the newest) and its state: "finished" when its
    metrics.jsonl reached the config's total_steps, "resumable" when it has a checkpoint, else "empty" (killed before
    its first checkpoint: a fresh run replaces nothing). (None, None) when there is none."""
    folders = [
        path
        for path in (os.path.join(output_dir, name) for name in sorted(list_dirs(output_dir)))
        if run_seed_of(path) == seed and run_args(path).get("exp_name") == exp_name
    ]
    if not folders:
        return None, None
    folder = max(folders, key=lambda p: os.path.getmtime(os.path.join(p, "config.json")))
    steps = []
    if os.path.isfile(os.path.join(folder, "metrics.jsonl")):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            steps = [json.loads(line).get("global_step") for line in f if line.strip()]
    total = run_args(folder).get("total_steps")
    if total is not None and total in steps:
        return folder, "finished"
    checkpoints = os.path.join(folder, "checkpoints")
    return folder, "resumable" if os.path.isdir(checkpoints) and os.listdir(checkpoints) else "empty"


def run_args(path):
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def format_seconds(seconds):
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{seconds:.1f} s"


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.statistics.run",
        description=__doc__.splitlines()[0],
        epilog="Everything after `--` goes to the script.",
    )
    parser.add_argument("--script", required=True, help="the script to run, e.g. grpo_math.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="one run per seed")
    parser.add_argument("--workers", type=int, default=1, help="how many runs at a time")
    parser.add_argument("--track", action="store_true", help="pass --track and --wandb_tags <git sha> to the script")
    parser.add_argument("--dry_run", action="store_true", help="only print the commands")
    parser.add_argument("--accelerate_config", default=None, help="run inside `accelerate launch --config_file FILE`")
    parser.add_argument("--num_processes", type=int, default=None, help="accelerate launch --num_processes N")
    parser.add_argument(
        "--main_process_port",
        type=int,
        default=29500,
        help="with accelerate and more than one worker, seed i gets port main_process_port + i",
    )
    parser.add_argument(
        "--resume_unfinished",
        action="store_true",
        help="skip a seed whose run (same --exp_name) finished in an earlier launch; resume one that has a checkpoint",
    )
    parser.add_argument("--log_dir", default="runs/_logs", help="where each seed's stdout/stderr goes")
    return parser


def main(argv=None):
    own, script_args = split_argv(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(own)
    if len(set(args.seeds)) != len(args.seeds):
        sys.exit(f"error: --seeds has repeats: {args.seeds}")
    if flag_index(script_args, "seed") is not None:
        sys.exit("error: give seeds with --seeds, not --seed after `--`")
    if args.workers < 1:
        sys.exit("error: --workers must be at least 1")
    if not os.path.isfile(args.script):
        sys.exit(f"error: --script {args.script} is not a file")

    output_dir = flag_value(script_args, "output_dir", "runs")
    exp_name = flag_value(script_args, "exp_name")
    earlier = {}
    if args.resume_unfinished:
        if exp_name is None or flag_index(script_args, "resume") is not None:
            sys.exit("error: --resume_unfinished needs --exp_name after `--` (and no --resume)")
        earlier = {seed: earlier_run(output_dir, seed, exp_name) for seed in args.seeds}
        for seed, (folder, state) in earlier.items():
            if state is not None:
                print(f"[seed {seed}] {folder}: {state}", flush=True)
        args.seeds = [seed for seed in args.seeds if earlier[seed][1] != "finished"]
        if not args.seeds:
            print("every seed finished in an earlier launch")
            return 0

    sha = git_sha()
    accelerate = args.accelerate_config is not None or args.num_processes is not None
    commands = {
        seed: build_command(
            args.script,
            seed,
            [*script_args, "--resume", earlier[seed][0]]
            if seed in earlier and earlier[seed][1] == "resumable"
            else script_args,  # fmt: skip
            track=args.track,
            sha=sha,
            accelerate_config=args.accelerate_config,
            num_processes=args.num_processes,
            main_process_port=args.main_process_port + i if accelerate and args.workers > 1 else None,
        )
        for i, seed in enumerate(args.seeds)
    }
    if args.dry_run:
        for command in commands.values():
            print(shlex.join(command))
        return 0

    if args.track and git_dirty():
        print(f"warning: tracked files differ from HEAD {sha[:12]}: the wandb tag names the last commit", flush=True)
    existing = list_dirs(output_dir)
    os.makedirs(args.log_dir, exist_ok=True)
    script_name = os.path.splitext(os.path.basename(args.script))[0]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print_lock = threading.Lock()

    def run(seed):
        log_path = os.path.join(args.log_dir, f"{script_name}__{seed}__{int(time.time())}.log")
        command = commands[seed]
        with print_lock:
            print(f"[seed {seed}] {shlex.join(command)}\n[seed {seed}] log: {log_path}", flush=True)
        start = time.time()
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            try:
                returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            except OSError as error:
                log.write(f"{error}\n")
                returncode = 127
        elapsed = time.time() - start
        with open(log_path, errors="replace") as log:
            log_text = log.read()
        folder = flag_value(command, "resume") or find_run_folder(output_dir, seed, existing, log_text, exp_name)
        with print_lock:
            print(f"[seed {seed}] exit code {returncode} after {format_seconds(elapsed)}", flush=True)
        return {"seed": seed, "returncode": returncode, "run_dir": folder, "seconds": elapsed, "log": log_path}

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(run, args.seeds))

    rows = [
        ["seed", "exit code", "run folder", "wall-clock", "log"],
        *(
            [str(r["seed"]), str(r["returncode"]), r["run_dir"] or "not found", format_seconds(r["seconds"]), r["log"]]
            for r in results
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"\nsummary: {args.script}, git sha {sha[:12] or 'unknown'}")
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    failed = [r["seed"] for r in results if r["returncode"] != 0]
    if failed:
        print(f"FAILED: seed(s) {' '.join(map(str, failed))} of {len(results)} (see their logs)")
        return 1
    print(f"all {len(results)} seed(s) succeeded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
