#!/usr/bin/env bash
# Issue 47: reward-model ensembles against over-optimisation (Coste et al., arXiv 2310.02743) on the arithmetic
# pipeline, the verifier's accuracy as the gold score. In progress: this file grows with the experiment.
#   1. The ensemble: 5 reward models that share their pairs (--data_seed 1: the default reward model's) and differ
#      in --seed (score-head init and data order), the paper's setting; member k goes to runs/reward_ensemble/member_k,
#      the folder ppo_rlhf.py --reward_model_path reads as an ensemble. A member whose model is there is skipped
#      (an interrupted one: `python reward_modeling.py --resume runs/<its run folder> ...` with the same flags).
#   2. How the members do on their shared held-out pairs, alone and combined, and how often they agree.
#   3. The pilot: where PPO on one reward model (member_0, which is the default reward model: seed 1, its pairs)
#      over-optimises. Issue 31 saw seed 3's verifier accuracy fall from step 10 (0.642) to step 40 (0.500): seed 3
#      for 80 steps, evaluated every 10. Interrupted: `python ppo_rlhf.py --resume runs/<its run folder>`.
#   bash benchmark/ppo_rlhf_ensemble.sh             # one run at a time (a 2-core CPU machine): ~8 min a member
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -f runs/reward_ensemble/member_0/config.json ] ||
    python reward_modeling.py --seed 1 --data_seed 1 --exp_name rm_member --reward_model_dir runs/reward_ensemble/member_0
[ -f runs/reward_ensemble/member_1/config.json ] ||
    python reward_modeling.py --seed 2 --data_seed 1 --exp_name rm_member --reward_model_dir runs/reward_ensemble/member_1
[ -f runs/reward_ensemble/member_2/config.json ] ||
    python reward_modeling.py --seed 3 --data_seed 1 --exp_name rm_member --reward_model_dir runs/reward_ensemble/member_2
[ -f runs/reward_ensemble/member_3/config.json ] ||
    python reward_modeling.py --seed 4 --data_seed 1 --exp_name rm_member --reward_model_dir runs/reward_ensemble/member_3
[ -f runs/reward_ensemble/member_4/config.json ] ||
    python reward_modeling.py --seed 5 --data_seed 1 --exp_name rm_member --reward_model_dir runs/reward_ensemble/member_4
python -m benchmark.registry copy --out benchmark/results/reward_ensemble runs/arith_1d__rm_member__[12345]__*
python -m benchmark.reward_ensemble --ensemble runs/reward_ensemble --out benchmark/results/reward_ensemble.md

ls -d runs/arith_1d__ens_pilot_single__3__* > /dev/null 2>&1 ||
    python ppo_rlhf.py --seed 3 --total_steps 80 --save_every 10 --reward_model_path runs/reward_ensemble/member_0 --exp_name ens_pilot_single
