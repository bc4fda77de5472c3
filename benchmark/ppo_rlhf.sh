#!/usr/bin/env bash
# The published figures of ppo_rlhf.py (docs/ppo_rlhf.md):
#   1. one run of the default (seed 1, 2026-11-23, on the reward model of that day's code: held-out score 1.259 at
#      step 0) and its curves. Its run folder was not committed: the plot needs the run made again, and with today's
#      reward model (1.329 at step 0) the numbers differ;
#   2. seeds 1-3 on today's reward model: these are the PPO runs of benchmark/dpo_online.sh (`--exp_name
#      ppo_vs_dpo_ppo`), committed under benchmark/results/ppo_vs_dpo/; the last line lists their final values.
#   bash benchmark/ppo_rlhf.sh                      # one run at a time (a 2-core CPU machine)
#   bash benchmark/ppo_rlhf.sh --track              # extra arguments go to benchmark.statistics.run
# Every command that runs a script is on its own line: tests/benchmark/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmark/python.sh  # `python` is the venv's

[ -d runs/reward_model ] || python reward_modeling.py
python -m benchmark.statistics.run --script ppo_rlhf.py --seeds 1 "$@"
python -m benchmark.statistics.registry plot --experiments "ppo=runs/arith_1d__ppo__1__*" \
    --metric objective/scores objective/accuracy eval/score eval/accuracy objective/kl objective/entropy --smooth 5 \
    --out benchmark/results/ppo_rlhf_step.png

python -m benchmark.statistics.registry list --runs_dir benchmark/results/ppo_vs_dpo \
    --filter "arith_1d__ppo_vs_dpo_ppo__*" --metrics eval/score eval/accuracy
