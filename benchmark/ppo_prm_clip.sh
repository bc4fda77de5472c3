#!/usr/bin/env bash
# The published figures of ppo_prm_clip.py (issue 5): the five reward arms (success only, raw process rewards, Clip,
# Delta, Clip-Delta) with the verifier PRM, same seeds, steps and prompts; then the accuracy and length curves and
# the table of final accuracy and steps per response.
#   bash benchmark/ppo_prm_clip.sh                  # one run at a time (2 cores: 11-14 min a run, ~2 h in all)
#   bash benchmark/ppo_prm_clip.sh --workers 2      # extra arguments go to benchmark.run
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

# The arms run with --prm_coef 1.5 --temperature 1.0: at the script's defaults (0.5, 0.7) every arm, raw included,
# converges to one-step answers and raw's hacking does not show (docs/ppo_prm_clip.md). Seed-major
# order, so that a cut-short session still has every arm of seed 1.
for seed in 1 2; do
    for mode in none raw clip delta clip_delta; do
        python -m benchmark.run --script ppo_prm_clip.py --seeds "$seed" "$@" -- --reward_mode "$mode" \
            --prm_coef 1.5 --temperature 1.0 --total_steps 20 --eval_every 5 --save_every 0 --exp_name "prm_$mode"
    done
done

EXPERIMENTS=()
for mode in none raw clip delta clip_delta; do EXPERIMENTS+=("$mode=runs/arith_1d__prm_${mode}__*"); done
python -m benchmark.registry plot --experiments "${EXPERIMENTS[@]}" \
    --metric eval/accuracy objective/num_steps objective/response_length --smooth 3 \
    --out benchmark/results/ppo_prm_clip_step.png
python -m benchmark.registry table --experiments "${EXPERIMENTS[@]}" \
    --metrics eval/accuracy eval/num_steps eval/eos_fraction objective/num_steps objective/response_length \
    --out benchmark/results/ppo_prm_clip.md
