#!/usr/bin/env bash
# The published async-vs-sync figure of async_rlhf.py: the same program, seed, prompts and number of learner steps,
# generation and learning in turn (--sync) and at the same time (max_staleness 1), one after the other on one
# machine. HF generate in the generator (on 2 CPU cores it gains nothing from a second thread, while training does:
# the split that lets the two overlap), the default reward-model judge (`python reward_modeling.py` first).
#   bash benchmark/async_rlhf.sh
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

python async_rlhf.py --sync --no-vllm --total_steps 12 --eval_every 0 --exp_name async_bench_sync "$@"
python async_rlhf.py --no-vllm --total_steps 12 --eval_every 0 --exp_name async_bench_async "$@"

python -m benchmark.registry table --experiments "sync=runs/arith_1d__async_bench_sync__*" \
    "async=runs/arith_1d__async_bench_async__*" --metrics eval/score eval/accuracy objective/scores \
    --out benchmark/results/async_vs_sync.md
python -m benchmark.registry perf --experiments "sync=runs/arith_1d__async_bench_sync__*" \
    "async=runs/arith_1d__async_bench_async__*" --out benchmark/results/async_vs_sync_perf
python -m benchmark.registry plot --experiments "sync=runs/arith_1d__async_bench_sync__*" \
    "async=runs/arith_1d__async_bench_async__*" --metric objective/scores eval/score --x time --smooth 3 \
    --out benchmark/results/async_vs_sync_time.png
