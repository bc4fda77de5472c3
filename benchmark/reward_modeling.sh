#!/usr/bin/env bash
# The published figures of reward_modeling.py: 3 seeds of the default run, then the learning curves (mean ± std over
# seeds) and the table of held-out pair accuracy before and after training. The seeds' models stay in their run
# folders (--reward_model_dir None): runs/reward_model, which ppo_rlhf.py reads, is left alone.
#   bash benchmark/reward_modeling.sh               # one seed at a time (a 2-core CPU machine)
#   bash benchmark/reward_modeling.sh --workers 3   # extra arguments go to benchmark.run
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m benchmark.run --script reward_modeling.py --seeds 1 2 3 "$@" -- --reward_model_dir None

python -m benchmark.registry plot --experiments "reward_model=runs/arith_1d__reward_model__[123]__*" \
    --metric objective/accuracy loss/reward_model eval/accuracy eval/margin --smooth 8 \
    --out benchmark/results/reward_modeling_step.png
python -m benchmark.registry table --experiments "reward_model=runs/arith_1d__reward_model__[123]__*" \
    --metrics eval/accuracy eval/margin objective/train_set_accuracy --out benchmark/results/reward_modeling.md
