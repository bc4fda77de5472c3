#!/usr/bin/env bash
# The published figures of dpo_online.py: the reward model (`python reward_modeling.py`, saved to runs/reward_model,
# skipped when it is there), then the default online DPO run over seeds, and its curves next to ppo_rlhf.py's on the
# same reward model and prompts (run benchmark/ppo_rlhf.sh first for those), by step and by wall-clock time.
#   bash benchmark/dpo_online.sh                    # one seed at a time (a 2-core CPU machine)
#   bash benchmark/dpo_online.sh --workers 2        # extra arguments go to benchmark.run
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -d runs/reward_model ] || python reward_modeling.py
python -m benchmark.run --script dpo_online.py --seeds 1 "$@"

python -m benchmark.registry plot --experiments "ppo_rlhf=runs/arith_1d__ppo__[12]__*" \
    "dpo_online=runs/arith_1d__dpo_online__[12]__*" --metric eval/score eval/accuracy objective/scores objective/kl \
    --smooth 5 --out benchmark/results/ppo_vs_dpo_step.png
python -m benchmark.registry plot --experiments "ppo_rlhf=runs/arith_1d__ppo__[12]__*" \
    "dpo_online=runs/arith_1d__dpo_online__[12]__*" --metric eval/score eval/accuracy objective/scores objective/kl \
    --smooth 5 --x time --out benchmark/results/ppo_vs_dpo_time.png
python -m benchmark.registry table --experiments "ppo_rlhf=runs/arith_1d__ppo__[12]__*" \
    "dpo_online=runs/arith_1d__dpo_online__[12]__*" --metrics eval/score eval/accuracy objective/kl \
    --out benchmark/results/ppo_vs_dpo.md

# The peer comparison: TRL's online DPO trainer against dpo_online.py (HF generate and vLLM), 20 steps of the
# default batch, judged by the same reward model (runs/reward_model).
python -m benchmark.peer_trl_dpo --steps 20 --seeds 1
