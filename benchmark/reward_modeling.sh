#!/usr/bin/env bash
# The published figures of reward_modeling.py: one run of the default (seed 1), the reward model that ppo_rlhf.py,
# dpo_online.py and async_rlhf.py read from runs/reward_model (docs/reward_modeling.md); its config.json and
# metrics.jsonl copied to benchmark/results/reward_modeling/ (committed), then the curves and the table of held-out
# pair accuracy before and after training, made from the copy. One seed is published.
#   bash benchmark/reward_modeling.sh               # the published run took 480 s (2026-11-27)
#   bash benchmark/reward_modeling.sh --track       # extra arguments go to benchmark.statistics.run
# Every command that runs a script is on its own line: tests/benchmark/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmark/python.sh  # `python` is the venv's

python -m benchmark.statistics.run --script reward_modeling.py --seeds 1 "$@"

OUT=benchmark/results/reward_modeling
python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_1d__reward_model__1__*
python -m benchmark.statistics.registry plot --experiments "reward_model=$OUT/arith_1d__reward_model__1__*" \
    --metric objective/accuracy loss/reward_model eval/accuracy eval/margin --smooth 8 \
    --out benchmark/results/reward_modeling_step.png
python -m benchmark.statistics.registry table --experiments "reward_model=$OUT/arith_1d__reward_model__1__*" \
    --metrics eval/accuracy eval/margin objective/train_set_accuracy --out benchmark/results/reward_modeling.md
