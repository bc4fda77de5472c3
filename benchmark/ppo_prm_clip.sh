#!/usr/bin/env bash
# The published figures of ppo_prm_clip.py: the reward arms (success only, raw process rewards, Clip,
# Delta, Clip-Delta) at the script's defaults (arith_2t3t1d, one step per line, prm_coef 0.5, missing_eos_penalty -1,
# T 0.5, 30 steps of 8 prompts, the whole 500-problem held-out split every 5 steps), seeds 1-3, first with the
# verifier PRM, then with a PRM learned by reward_modeling.py --prm; then the curves, the tables and the paired
# comparisons with success only. The committed runs (benchmark/results/ppo_prm_clip/) were made at a1df256 with the
# step verifier of 2026-11-26, whose rules differ from today's: run again, this makes a new set
# (a new git sha in each config.json), to be compared with them, not pooled.
#   bash benchmark/ppo_prm_clip.sh                  # one run at a time (2 cores: ~15 min a run, ~6 h in all)
#   bash benchmark/ppo_prm_clip.sh --workers 2      # extra arguments go to benchmark.statistics.run
# A run cut short resumes with `python ppo_prm_clip.py --resume runs/<its folder>` (checkpoints every 10 steps).
# Every command that runs a script is on its own line: tests/benchmark/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmark/python.sh  # `python` is the venv's

# The claims' set (docs/power_plan.md): the verifier PRM's five arms on the step verifier of 2026-11-29, seeds 1-4,
# a fresh set never pooled with the committed 2026-11-26 runs: exp_name prm65_*, copies in ppo_prm_clip_claims/.
# Seed-major; a run a stop interrupted resumes (--resume_unfinished). ~2 h a seed on 2 cores.
#   bash benchmark/ppo_prm_clip.sh claims
if [[ ${1:-} == claims ]]; then
    shift
    for seed in 1 2 3 4; do
        for mode in none raw clip delta clip_delta; do
            python -m benchmark.statistics.run --script ppo_prm_clip.py --seeds "$seed" --resume_unfinished "$@" -- \
                --reward_mode "$mode" --save_every 10 --keep_checkpoints 1 --exp_name "prm65_$mode"
        done
    done
    OUT=benchmark/results/ppo_prm_clip_claims
    python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_2t3t1d__prm65_*__[1-4]__*
    EXPERIMENTS=()
    for mode in none raw clip delta clip_delta; do
        EXPERIMENTS+=("$mode=$OUT/arith_2t3t1d__prm65_${mode}__*")
    done
    python -m benchmark.statistics.registry table --experiments "${EXPERIMENTS[@]}" \
        --metrics eval/accuracy eval/num_steps eval/response_length eval/eos_fraction objective/num_steps \
        --out benchmark/results/ppo_prm_clip_claims.md
    python -m benchmark.statistics.registry plot --experiments "${EXPERIMENTS[@]}" \
        --metric eval/accuracy eval/num_steps objective/num_steps --out benchmark/results/ppo_prm_clip_claims_step.png
    python -m benchmark.claims.prm_checks --experiments "${EXPERIMENTS[@]}" \
        --out benchmark/results/ppo_prm_clip_claims_checks.md
    exit 0
fi

# The pilot (docs/ppo_prm_clip.md, "The pilot: is raw hacked anywhere here?"): raw process rewards only, at
# prm_coef 3 and 1.5, with the verifier PRM and with a PRM learned on the verifier's labels (reward_modeling.py --prm,
# retrained with the verifier of 2026-12-07), seeds 101-102, every run from one commit (a worktree pinned for the
# whole pilot); then the registered criterion per cell. One run at a time; a run cut short resumes (--resume_unfinished).
#   bash benchmark/ppo_prm_clip.sh pilot
if [[ ${1:-} == pilot ]]; then
    shift
    for prm in verifier learned; do
        if [ "$prm" = learned ] && [ ! -f runs/prm_pilot/config.json ]; then
            python reward_modeling.py --prm --temperature 0.5 --response_length 96 --num_train_prompts 500 \
                --num_eval_prompts 100 --exp_name pilot_learned_prm --prm_dir runs/prm_pilot
        fi
        PRM=$([ "$prm" = verifier ] && echo verifier || echo runs/prm_pilot)
        for coef in 3 1.5; do
            for seed in 101 102; do
                python -m benchmark.statistics.run --script ppo_prm_clip.py --seeds "$seed" --resume_unfinished "$@" \
                    -- --reward_mode raw --prm "$PRM" --prm_coef "$coef" --save_every 10 --keep_checkpoints 1 \
                    --exp_name "pilot_${prm}_$coef"
            done
        done
    done
    OUT=benchmark/results/prm_pilot
    python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_2t3t1d__pilot_*
    CELLS=()
    for prm in verifier learned; do
        for coef in 3 1.5; do CELLS+=("${prm}_$coef=$OUT/arith_2t3t1d__pilot_${prm}_${coef}__*"); done
    done
    python -m benchmark.claims.prm_pilot --experiments "${CELLS[@]}" --out benchmark/results/prm_pilot.md
    python -m benchmark.statistics.registry plot --experiments "${CELLS[@]}" --metric eval/accuracy eval/num_steps \
        --out benchmark/results/prm_pilot_step.png
    exit 0
fi

# The power plan for the PRM claims (docs/power_plan.md), remade from the committed runs: for each claim, the
# per-seed paired values, the seeds the one verdict rule needs for 80% power at the observed mean and std, and the
# minimum detectable effect at the seeds there are (benchmark/statistics/power.py); the 2026-11-26 set and the claims'
# set, never pooled. The fix against raw is one Holm family of three arms, as prm_checks' (d).
#   bash benchmark/ppo_prm_clip.sh power_plan
if [[ ${1:-} == power_plan ]]; then
    for set in verifier claims; do
        [ "$set" = verifier ] && RUNS=benchmark/results/ppo_prm_clip/arith_2t3t1d__prm_ ||
            RUNS=benchmark/results/ppo_prm_clip_claims/arith_2t3t1d__prm65_
        OUT=benchmark/results/power_plan/prm_$set
        python -m benchmark.statistics.power --experiments "none=${RUNS}none__*" "raw=${RUNS}raw__*" --baseline none \
            --metric eval/num_steps --ratio --at_least 1.5 --out "${OUT}_a_steps.md"
        python -m benchmark.statistics.power --experiments "none=${RUNS}none__*" "raw=${RUNS}raw__*" --baseline none \
            --metric eval/accuracy --at_most 0 --out "${OUT}_a_accuracy.md"
        ARMS=("raw=${RUNS}raw__*" "clip=${RUNS}clip__*" "delta=${RUNS}delta__*" "clip_delta=${RUNS}clip_delta__*")
        python -m benchmark.statistics.power --experiments "${ARMS[@]}" --baseline raw --metric eval/num_steps \
            --ratio --at_most 1 --holm --out "${OUT}_d_steps.md"
        python -m benchmark.statistics.power --experiments "${ARMS[@]}" --baseline raw --metric eval/accuracy \
            --at_least 0 --holm --out "${OUT}_d_accuracy.md"
        ARMS=("none=${RUNS}none__*" "${ARMS[@]:1}")
        python -m benchmark.statistics.power --experiments "${ARMS[@]}" --baseline none --metric eval/num_steps \
            --ratio --at_least 0.8 --at_most 1.2 --out "${OUT}_b_steps.md"
        python -m benchmark.statistics.power --experiments "${ARMS[@]}" --baseline none --metric eval/accuracy \
            --at_least -0.02 --at_most 0.02 --out "${OUT}_b_accuracy.md"
    done
    exit 0
fi

# 0. The task's preflight (docs/ppo_prm_clip.md "The task"): 4 sampled and 1 greedy response to each of 100 held-out
# prompts, what the verifier finds in them (~5 min).
python -m benchmark.claims.prm_preflight --num_prompts 100 --out benchmark/results/prm_preflight.json

# 1. The verifier PRM. Seed-major order, so that a cut-short session still has every arm of the first seeds.
for seed in 1 2 3; do
    for mode in none raw clip delta clip_delta; do
        python -m benchmark.statistics.run --script ppo_prm_clip.py --seeds "$seed" "$@" -- --reward_mode "$mode" \
            --save_every 10 --keep_checkpoints 1 --exp_name "prm_$mode"
    done
done

# 2. A learned PRM: trained on the verifier's step labels of completions sampled like the policy's (T 0.5, 96
# tokens; 4 per problem for 500 of the 1394 training problems, ~35 min; 100 held-out problems for its evaluation),
# then the arms with it. Success only does not read the PRM: its runs are the ones above.
python reward_modeling.py --prm --temperature 0.5 --response_length 96 --num_train_prompts 500 \
    --num_eval_prompts 100 --exp_name learned_prm --prm_dir runs/prm
for seed in 1 2 3; do
    for mode in raw clip delta; do
        python -m benchmark.statistics.run --script ppo_prm_clip.py --seeds "$seed" "$@" -- --reward_mode "$mode" \
            --prm runs/prm --save_every 10 --keep_checkpoints 1 --exp_name "lprm_$mode"
    done
done

# 3. The runs' config.json and metrics.jsonl copied to benchmark/results/ppo_prm_clip/ (committed), then from the
# copies: curves, tables, paired differences with success only (seed by seed).
OUT=benchmark/results/ppo_prm_clip
python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_2t3t1d__prm_*__[123]__* \
    runs/arith_2t3t1d__lprm_*__[123]__*
for kind in verifier learned; do
    prefix=$([ "$kind" = verifier ] && echo prm || echo lprm)
    EXPERIMENTS=("none=$OUT/arith_2t3t1d__prm_none__*")  # success only does not read the PRM: one baseline for both
    for mode in raw clip delta clip_delta; do
        if compgen -G "$OUT/arith_2t3t1d__${prefix}_${mode}__*" > /dev/null; then
            EXPERIMENTS+=("$mode=$OUT/arith_2t3t1d__${prefix}_${mode}__*")
        fi
    done
    RESULTS="benchmark/results/ppo_prm_clip_$kind"
    python -m benchmark.statistics.registry plot --experiments "${EXPERIMENTS[@]}" \
        --metric eval/accuracy eval/num_steps objective/num_steps objective/response_length --out "${RESULTS}_step.png"
    python -m benchmark.statistics.registry table --experiments "${EXPERIMENTS[@]}" \
        --metrics eval/accuracy eval/num_steps eval/response_length eval/eos_fraction objective/num_steps \
        objective/response_length objective/prm_score_sum --out "$RESULTS.md"
    python -m benchmark.statistics.registry paired --experiments "${EXPERIMENTS[@]}" --baseline none \
        --metrics eval/accuracy eval/num_steps eval/response_length --out "${RESULTS}_paired.md"
    python -m benchmark.claims.prm_checks --experiments "${EXPERIMENTS[@]}" --out "${RESULTS}_checks.md"
done

# 4. Superseded (EARLIER=1 bash benchmark/ppo_prm_clip.sh): the tables of docs/ppo_prm_clip.md's two "Earlier"
# sections, on arith_1d, 2026-11-22 and 2026-11-23, whose runs were not kept: the five arms (seeds 1-2,
# prm_coef 1.5, T 1.0, 20 steps; benchmark/results/ppo_prm_clip.md) and three arms at the defaults of then (seed 1,
# prm_coef 0.5, T 0.7, 30 steps; ppo_prm_clip_defaults.md). The defaults of then are spelled out (arith_1d, steps at
# a blank line, no missing-EOS penalty, 100 held-out problems every 10 steps); the code has changed since (the
# verifier and answer parser among others), so the figures will not repeat to the digit.
if [ "${EARLIER:-0}" = 1 ]; then
    for seed in 1 2; do
        for mode in none raw clip delta clip_delta; do
            python -m benchmark.statistics.run --script ppo_prm_clip.py --seeds "$seed" "$@" -- --reward_mode "$mode" \
                --dataset_path assets/data/arith_1d --step_separator $'\n\n' --missing_eos_penalty None \
        --instruction "Solve it step by step. Separate the steps with a blank line and end with 'Answer: <number>'." \
                --num_eval_prompts 100 --prm_coef 1.5 --temperature 1.0 --total_steps 20 --eval_every 5 \
                --save_every 0 --exp_name "prm_$mode"
        done
    done
    for mode in none raw clip_delta; do
        python -m benchmark.statistics.run --script ppo_prm_clip.py --seeds 1 "$@" -- --reward_mode "$mode" \
            --dataset_path assets/data/arith_1d --step_separator $'\n\n' --missing_eos_penalty None \
        --instruction "Solve it step by step. Separate the steps with a blank line and end with 'Answer: <number>'." \
            --num_eval_prompts 100 --temperature 0.7 --eval_every 10 --exp_name "prm_default_$mode"
    done
    EXPERIMENTS=()
    for mode in none raw clip delta clip_delta; do EXPERIMENTS+=("$mode=runs/arith_1d__prm_${mode}__*"); done
    python -m benchmark.statistics.registry plot --experiments "${EXPERIMENTS[@]}" \
        --metric eval/accuracy objective/num_steps objective/response_length --smooth 3 \
        --out benchmark/results/ppo_prm_clip_step.png
    python -m benchmark.statistics.registry table --experiments "${EXPERIMENTS[@]}" \
        --metrics eval/accuracy eval/num_steps eval/eos_fraction objective/num_steps objective/response_length \
        --out benchmark/results/ppo_prm_clip.md
    EXPERIMENTS=()
    for mode in none raw clip_delta; do EXPERIMENTS+=("$mode=runs/arith_1d__prm_default_${mode}__*"); done
    python -m benchmark.statistics.registry plot --experiments "${EXPERIMENTS[@]}" \
        --metric eval/accuracy eval/num_steps objective/num_steps objective/response_length \
        --out benchmark/results/ppo_prm_clip_defaults_step.png
    python -m benchmark.statistics.registry table --experiments "${EXPERIMENTS[@]}" \
        --metrics eval/accuracy eval/num_steps objective/num_steps eval/response_length \
        --out benchmark/results/ppo_prm_clip_defaults.md
fi
