#!/usr/bin/env bash
# Reward-model ensembles against over-optimisation (Coste et al., arXiv 2310.02743) on the arithmetic
# pipeline, the verifier's accuracy as the gold score (results: docs/ppo_rlhf.md, "Reward-model ensembles").
#   1. The ensemble: 5 reward models that share their pairs (--data_seed 1: the default reward model's) and differ
#      in --seed (score-head init and data order), the paper's setting; member k goes to runs/reward_ensemble/member_k,
#      the folder ppo_rlhf.py --reward_model_path reads as an ensemble. A member whose model is there is skipped
#      (an interrupted one: `python reward_modeling.py --resume runs/<its run folder> ...` with the same flags).
#   2. How the members do on their shared held-out pairs, alone and combined, and how often they agree.
#   3. The experiment: PPO with the mean, WCO and UWO of the 5 members, online DPO with their WCO, 3 seeds each.
#   (4. the checks and figures, 5. the cost of five members.) 6. Best-of-n with the 5 members: no PPO.
#   bash benchmark/ppo_rlhf_ensemble.sh   # one run at a time (a 2-core CPU machine): ~8 min a member, 23-26 min a
#                                         # PPO run with five members (docs/ppo_rlhf.md)
# Every command that runs a script is on its own line: tests/benchmark/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmark/python.sh  # `python` is the venv's

# Best-of-n (step 6) in Coste et al.'s noisy setting: five members that differ in their pairs
# (--data_seed k: each samples its own completions and pairs) and their seed, each trained with every training
# label flipped with probability 0.25 (--label_noise; the held-out pairs keep the verifier's labels); step 6's
# sampling command into its own folder (the same prompts and seed), scored by these members and analysed as step 6.
#   bash benchmark/ppo_rlhf_ensemble.sh noisy      # ~11 min a member, ~18 min sampling, ~32 min scoring (2 cores)
if [[ ${1:-} == noisy ]]; then
    for k in 0 1 2 3 4; do
        [ -f "runs/reward_ensemble_noisy/member_$k/config.json" ] ||
            python reward_modeling.py --seed $(($k+1)) --data_seed $(($k+1)) --label_noise 0.25 \
                --exp_name rm_noisy_member --reward_model_dir "runs/reward_ensemble_noisy/member_$k"
    done
    python -m benchmark.statistics.registry copy --out benchmark/results/reward_ensemble_noisy \
        runs/arith_1d__rm_noisy_member__[12345]__*
    python -m benchmark.claims.best_of_n sample --out_dir runs/best_of_n_noisy --num_samples 64 --temperature 1 \
        --num_prompts 128
    python -m benchmark.claims.best_of_n score --out_dir runs/best_of_n_noisy --ensemble runs/reward_ensemble_noisy
    python -m benchmark.claims.best_of_n analyse --out_dir runs/best_of_n_noisy --uwo_coef 0.25 0.5 1 2 4 \
        --bootstrap 2000 --splits 200 --out benchmark/results/best_of_n_noisy
    exit 0
fi

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
python -m benchmark.statistics.registry copy \
    --out benchmark/results/reward_ensemble runs/arith_1d__rm_member__[12345]__*
[ -f benchmark/results/reward_ensemble.md ] ||  # ~7 min: remove the file to make it again
    python -m benchmark.claims.reward_ensemble --ensemble runs/reward_ensemble --uwo_coef 0.25 0.5 1 2 4 \
        --out benchmark/results/reward_ensemble.md

# 3. The experiment: 40 steps, 3 seeds, the budget of PPO against online DPO (PPO at its defaults; online DPO with 4
#    prompts x 2 completions a step, the same 8 completions). The single-reward-model arms are those runs (member_0
#    is the default reward model; benchmark/dpo_online.sh made them, committed under benchmark/results/ppo_vs_dpo/),
#    whose first steps today's code repeats (docs/ppo_rlhf.md: `python ppo_rlhf.py --seed 3 --exp_name repro_ppo
#    --reward_model_path runs/reward_ensemble/member_0` and `python dpo_online.py --seed 1 --prompts_per_rank 4
#    --total_steps 40 --exp_name repro_dpo --reward_model_path runs/reward_ensemble/member_0`, each stopped after step
#    3; their logs are in benchmark/results/ensemble_repro/). UWO's lambda 1 is chosen from the members'
#    held-out scores above (docs/ppo_rlhf.md says why). --resume_unfinished: a seed that finished is skipped, an
#    interrupted one resumes from its checkpoint, so the file can be run again across sessions until all are done.
python -m benchmark.statistics.run --script ppo_rlhf.py --seeds 1 2 3 --resume_unfinished -- \
    --exp_name ens_ppo_wco --reward_model_path runs/reward_ensemble --reward_ensemble wco
python -m benchmark.statistics.run --script ppo_rlhf.py --seeds 1 2 3 --resume_unfinished -- \
    --exp_name ens_ppo_uwo --reward_model_path runs/reward_ensemble --reward_ensemble uwo --uwo_coef 1
python -m benchmark.statistics.run --script dpo_online.py --seeds 1 2 3 --resume_unfinished -- \
    --exp_name ens_dpo_wco --reward_model_path runs/reward_ensemble --reward_ensemble wco --prompts_per_rank 4 --total_steps 40
python -m benchmark.statistics.run --script ppo_rlhf.py --seeds 1 2 3 --resume_unfinished -- \
    --exp_name ens_ppo_mean --reward_model_path runs/reward_ensemble --reward_ensemble mean

# 4. The runs' config.json and metrics.jsonl to benchmark/results/reward_ensemble_runs/ (committed), then the table,
#    the checks and the figure from the copies. The paper's claims, each from the paired differences over seeds
#    (held / not held only when the 95% t interval clears the bound, else inconclusive):
#    (a) WCO and UWO end no lower than the single reward model (final accuracy, difference >= -0.02) and do not show
#        its late fall (the fall from a run's own peak to its end, single minus ensemble >= 0: `--statistic fall`
#        with the ensemble as the baseline);
#    (b) little cost: the ensembles' peak within noise of the single's (peak difference >= -0.02);
#    (c) PPO with an ensemble reaches online DPO on one reward model (final accuracy difference >= -0.02).
OUT=benchmark/results/reward_ensemble_runs
python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_1d__ens_*__[123]__*
ARMS=("ppo single=benchmark/results/ppo_vs_dpo/arith_1d__ppo_vs_dpo_ppo__*" "ppo mean=$OUT/arith_1d__ens_ppo_mean__*"
    "ppo wco=$OUT/arith_1d__ens_ppo_wco__*" "ppo uwo=$OUT/arith_1d__ens_ppo_uwo__*"
    "dpo single=benchmark/results/ppo_vs_dpo/arith_1d__ppo_vs_dpo_dpo__*" "dpo wco=$OUT/arith_1d__ens_dpo_wco__*")
python -m benchmark.statistics.registry table --experiments "${ARMS[@]}" \
    --metrics eval/accuracy eval/score objective/kl --out benchmark/results/reward_ensemble_table.md
python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline "ppo single" \
    --metrics eval/accuracy --at_least -0.02 --out benchmark/results/reward_ensemble_final.md
python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline "ppo single" \
    --metrics eval/accuracy --at_least -0.02 --statistic peak --out benchmark/results/reward_ensemble_peak.md
python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline "ppo wco" \
    --metrics eval/accuracy --at_least 0 --statistic fall --out benchmark/results/reward_ensemble_fall_wco.md
python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline "ppo uwo" \
    --metrics eval/accuracy --at_least 0 --statistic fall --out benchmark/results/reward_ensemble_fall_uwo.md
python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline "dpo single" \
    --metrics eval/accuracy --at_least -0.02 --out benchmark/results/reward_ensemble_vs_dpo.md
#    Conservatism or a better reward model: the mean of the five is more accurate on held-out pairs than member_0, the
#    single arm's (0.757 against 0.696), so the conservative arms are compared with the mean too (difference >= 0).
python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline "ppo mean" \
    --metrics eval/accuracy --at_least 0 --out benchmark/results/reward_ensemble_vs_mean.md
python -m benchmark.statistics.registry frontier --experiments "${ARMS[@]}" --y eval/accuracy --x objective/kl \
    --x_at_step0 0 --out benchmark/results/reward_ensemble_frontier.png
python -m benchmark.statistics.registry plot --experiments "${ARMS[@]}" \
    --metric eval/accuracy eval/score objective/kl --out benchmark/results/reward_ensemble_step.png

# 5. The cost of five members: 4 steps of PPO with one reward model and with the five (WCO), twice each, alternating,
#    nothing else on the cores (made on 2026-11-27 with the experiment above paused by SIGSTOP; the peak memory is
#    /usr/bin/time -v's maximum resident set size). Step 1 scores the same samples in both (the policy has not moved).
if [ ! -d benchmark/results/reward_ensemble_cost ]; then
    for rep in 1 2; do
        python ppo_rlhf.py --total_steps 4 --eval_every 0 --save_every 0 --num_eval_prompts 8 --output_dir runs/ensemble_cost \
            --exp_name "k1_$rep" --reward_model_path runs/reward_ensemble/member_0
        python ppo_rlhf.py --total_steps 4 --eval_every 0 --save_every 0 --num_eval_prompts 8 --output_dir runs/ensemble_cost \
            --exp_name "k5_$rep" --reward_model_path runs/reward_ensemble --reward_ensemble wco
    done
    python -m benchmark.statistics.registry copy \
        --out benchmark/results/reward_ensemble_cost runs/ensemble_cost/arith_1d__k*
fi
python -m benchmark.statistics.registry perf \
    --experiments "one reward model=benchmark/results/reward_ensemble_cost/arith_1d__k1_*" \
    "five, WCO=benchmark/results/reward_ensemble_cost/arith_1d__k5_*" --out benchmark/results/reward_ensemble_cost

# 6. Best-of-n with the five members: Coste et al.'s cleanest setting, no PPO and so no seed noise.
#    64 responses per held-out prompt from the initial policy at temperature 1, on a seeded subset of 128 of the 282
#    prompts that ppo_rlhf.py evaluates on (all 282 would take ~2.2x the scoring time below), each response scored
#    once by every member of step 1's runs/reward_ensemble; then for n = 1..64 the verifier accuracy of what each rule
#    picks (each member, the mean, WCO, WCO on standardised members, UWO at 5 lambdas) against the best-of-n KL, with
#    prompt-bootstrap intervals, and the checks: does a member's curve turn down, do WCO / UWO flatten it, does the
#    members' disagreement predict the verifier's errors among the picks (benchmark/claims/best_of_n.py). The first two
#    measure each drop at the peak the other half of the prompts chose, averaged over 200 seeded random halvings
#    (--splits: one halving is one draw, and a verdict can flip with it; --splits 1 gives the one-split table). Each stage resumes
#    where it stopped (rerun the line). OUT.jsonl (a line per prompt: verdicts, EOS, member scores) is committed with
#    the table and figure: `analyse --from_responses benchmark/results/best_of_n.jsonl` remakes them.
python -m benchmark.claims.best_of_n sample --out_dir runs/best_of_n --num_samples 64 --temperature 1 --num_prompts 128
python -m benchmark.claims.best_of_n score --out_dir runs/best_of_n --ensemble runs/reward_ensemble
python -m benchmark.claims.best_of_n analyse --out_dir runs/best_of_n --uwo_coef 0.25 0.5 1 2 4 --bootstrap 2000 \
    --splits 200 --out benchmark/results/best_of_n
