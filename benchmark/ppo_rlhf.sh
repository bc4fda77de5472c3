#!/usr/bin/env bash
# The published figures of ppo_rlhf.py: the reward model (`python reward_modeling.py`, saved to runs/reward_model),
# then 2 seeds of the default PPO run, the learning curves (mean ± std over seeds) and the table of final metrics.
#   bash benchmark/ppo_rlhf.sh                      # one seed at a time (a 2-core CPU machine)
#   bash benchmark/ppo_rlhf.sh --workers 2 --track  # extra arguments go to benchmark.run
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

python reward_modeling.py
python -m benchmark.run --script ppo_rlhf.py --seeds 1 2 "$@"

python -m benchmark.registry plot --experiments "ppo=runs/arith_1d__ppo__[12]__*" \
    --metric objective/scores objective/accuracy eval/score eval/accuracy --smooth 5 \
    --out benchmark/results/ppo_rlhf_step.png
python -m benchmark.registry plot --experiments "ppo=runs/arith_1d__ppo__[12]__*" \
    --metric eval/score eval/accuracy --x time --out benchmark/results/ppo_rlhf_time.png
python -m benchmark.registry table --experiments "ppo=runs/arith_1d__ppo__[12]__*" \
    --metrics eval/score eval/accuracy objective/scores objective/kl --out benchmark/results/ppo_rlhf.md
