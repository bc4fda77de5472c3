#!/usr/bin/env bash
# The published figures of ppo_prm_clip.py (issue 5): the five reward arms (success only, raw process rewards, Clip,
# Delta, Clip-Delta) with the verifier PRM, same seeds, steps and prompts; then the accuracy and length curves and
# the table of final accuracy and steps per response.
#   bash benchmark/ppo_prm_clip.sh                  # one run at a time (a 2-core CPU machine: ~15 min a run)
#   bash benchmark/ppo_prm_clip.sh --workers 2      # extra arguments go to benchmark.run
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m benchmark.run --script ppo_prm_clip.py --seeds 1 2 "$@" -- --reward_mode none --exp_name prm_none
python -m benchmark.run --script ppo_prm_clip.py --seeds 1 2 "$@" -- --reward_mode raw --exp_name prm_raw
python -m benchmark.run --script ppo_prm_clip.py --seeds 1 2 "$@" -- --reward_mode clip --exp_name prm_clip
python -m benchmark.run --script ppo_prm_clip.py --seeds 1 2 "$@" -- --reward_mode delta --exp_name prm_delta
python -m benchmark.run --script ppo_prm_clip.py --seeds 1 2 "$@" -- --reward_mode clip_delta --exp_name prm_clip_delta

EXPERIMENTS=()
for mode in none raw clip delta clip_delta; do EXPERIMENTS+=("$mode=runs/arith_1d__prm_${mode}__*"); done
python -m benchmark.registry plot --experiments "${EXPERIMENTS[@]}" \
    --metric eval/accuracy objective/num_steps objective/response_length --smooth 3 \
    --out benchmark/results/ppo_prm_clip_step.png
python -m benchmark.registry table --experiments "${EXPERIMENTS[@]}" \
    --metrics eval/accuracy eval/num_steps objective/num_steps --out benchmark/results/ppo_prm_clip.md
