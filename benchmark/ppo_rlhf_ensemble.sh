#!/usr/bin/env bash
# Issue 47: reward-model ensembles against over-optimisation (Coste et al., arXiv 2310.02743) on the arithmetic
# pipeline, the verifier's accuracy as the gold score. In progress: this file grows with the experiment.
#   1. The ensemble: 5 reward models that share their pairs (--data_seed 1: the default reward model's) and differ
#      in --seed (score-head init and data order), the paper's setting; member k goes to runs/reward_ensemble/member_k,
#      the folder ppo_rlhf.py --reward_model_path reads as an ensemble. A member whose model is there is skipped
#      (an interrupted one: `python reward_modeling.py --resume runs/<its run folder> ...` with the same flags).
#   bash benchmark/ppo_rlhf_ensemble.sh             # one run at a time (a 2-core CPU machine): ~8 min a member
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

for k in 0 1 2 3 4; do
    [ -f "runs/reward_ensemble/member_$k/config.json" ] && continue
    python reward_modeling.py --seed "$((k + 1))" --data_seed 1 --exp_name rm_member --reward_model_dir "runs/reward_ensemble/member_$k"
done
