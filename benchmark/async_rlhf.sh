#!/usr/bin/env bash
# The published figures of async_rlhf.py, on the embedded task (arith_1d) with the default reward model
# (`python reward_modeling.py` first, saved to runs/reward_model; the verifier's accuracy is the gold score):
#   1. async against --sync at equal learner steps, seeds 1-3, one run at a time on an otherwise idle machine;
#   2. the off-policyness sweep of Noukhovitch et al.: N minibatches (optimizer updates) per generated batch, so
#      that the last minibatch is N - 1 updates stale, for online DPO, RLOO and PPO, N in 1 2 4 8 16, seeds 1-3, and
#      two PPO controls (no advantage whitening at N = 1 and 16; N = 1 with 8 responses an update);
#   3. the runs' config.json and metrics.jsonl copied to benchmark/results/async_rlhf/ (committed), and the figures,
#      tables and checks made from the copies.
#   bash benchmark/async_rlhf.sh      # ~10 min a run in part 1, ~5 in part 2 (2 cores): ~5 h in all
# Every command that runs a script is on its own line: tests/benchmark/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmark/python.sh  # `python` is the venv's
[ -d runs/reward_model ] || python reward_modeling.py

# Part 2's sweep where staleness moves the policy (docs/power_plan.md). First a pilot: seed 1 of online DPO
# and RLOO at N = 16 (part 2's flags) and raised learning rates, for the stalest minibatch's approximate KL to the
# sampler (policy/approxkl_last_minibatch; part 2's largest at lr 1e-5: 0.010) and the accuracy. 17-26 min a run
# (one core of two, 2026-11-29/30).
#   bash benchmark/async_rlhf.sh stale_pilot
if [[ ${1:-} == stale_pilot ]]; then
    # Round 1: both objectives at 3e-5 and 1e-4. At 1e-4 both collapse (held-out accuracy 0.096 and 0.245 from
    # 0.496); at 3e-5 online DPO's stalest KL is 0.284, RLOO's 0.022. Round 2: RLOO between the two.
    for lr in 3e-5 1e-4; do
        python -m benchmark.statistics.run --script async_rlhf.py --seeds 1 --resume_unfinished -- --sync --no-vllm \
            --loss dpo --num_minibatches 16 --prompts_per_rank 32 --micro_batch_size 2 --total_steps 2 --eval_every 0 \
            --learning_rate "$lr" --exp_name "pilot66_dpo_lr${lr}_n16"
    done
    for lr in 3e-5 1e-4 6e-5; do
        python -m benchmark.statistics.run --script async_rlhf.py --seeds 1 --resume_unfinished -- --sync --no-vllm \
            --loss rloo --rloo_k 2 --num_minibatches 16 --prompts_per_rank 32 --micro_batch_size 2 --total_steps 2 \
            --eval_every 0 --learning_rate "$lr" --exp_name "pilot66_rloo_lr${lr}_n16"
    done
    OUT=benchmark/results/async_rlhf_stale_pilot
    python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_1d__pilot66_*__1__*
    EXPERIMENTS=()
    for lr in 3e-5 1e-4; do
        EXPERIMENTS+=("dpo lr $lr=$OUT/arith_1d__pilot66_dpo_lr${lr}_n16__*")
    done
    for lr in 3e-5 6e-5 1e-4; do
        EXPERIMENTS+=("rloo lr $lr=$OUT/arith_1d__pilot66_rloo_lr${lr}_n16__*")
    done
    python -m benchmark.statistics.registry table --experiments "${EXPERIMENTS[@]}" \
        --metrics policy/approxkl_last_minibatch eval/accuracy eval/score eval/ref_perplexity \
        --out benchmark/results/async_rlhf_stale_pilot.md
    exit 0
fi

# The sweep the pilot chose: part 2's design (N = 1 and 16, the same 32 updates on the same prompts) at one
# learning rate per objective, each where its own stalest minibatch KL is >= 10x part 2's at lr 1e-5 (RLOO 0.0024,
# the largest 0.010) and it still learns: online DPO at 3e-5 (pilot KL 0.284), RLOO at 6e-5 (0.146 at step 1, 0.029
# at step 2). Seeds 1-4, seed-major; seed 1 at N = 16 is the pilot's run of the same flags (run stale_pilot first),
# copied beside the others. The claim's check: benchmark.claims.offpolicy (online DPO's drop from N = 1 to 16 the
# smaller). ~20 min a run on one core of two.
#   bash benchmark/async_rlhf.sh stale
if [[ ${1:-} == stale ]]; then
    for seed in 1 2 3 4; do
        for n in 1 16; do
            [[ $seed == 1 && $n == 16 ]] && continue
            python -m benchmark.statistics.run --script async_rlhf.py --seeds "$seed" --resume_unfinished -- --sync \
                --no-vllm --loss dpo --num_minibatches "$n" --prompts_per_rank $((2*$n)) --micro_batch_size 2 \
                --total_steps $((32/$n)) --eval_every 0 --learning_rate 3e-5 --exp_name "stale66_dpo_lr3e-5_n$n"
            python -m benchmark.statistics.run --script async_rlhf.py --seeds "$seed" --resume_unfinished -- --sync \
                --no-vllm --loss rloo --rloo_k 2 --num_minibatches "$n" --prompts_per_rank $((2*$n)) \
                --micro_batch_size 2 --total_steps $((32/$n)) --eval_every 0 --learning_rate 6e-5 \
                --exp_name "stale66_rloo_lr6e-5_n$n"
        done
    done
    OUT=benchmark/results/async_rlhf_stale
    python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_1d__stale66_*__[1-4]__* \
        runs/arith_1d__pilot66_dpo_lr3e-5_n16__1__* runs/arith_1d__pilot66_rloo_lr6e-5_n16__1__*
    python -m benchmark.claims.offpolicy --experiments "online DPO=$OUT/arith_1d__*66_dpo_lr3e-5_n*" \
        "RLOO=$OUT/arith_1d__*66_rloo_lr6e-5_n*" --out benchmark/results/offpolicy_stale
    exit 0
fi

# 1. Async against --sync: the same program, seed, prompts and number of learner steps; generation and learning in
# turn (--sync) and at the same time (max_staleness 1). HF generate in the generator (on 2 CPU cores it gains
# nothing from a second thread, while training does: the split that lets the two overlap).
for seed in 1 2 3; do
    python async_rlhf.py --sync --no-vllm --total_steps 12 --eval_every 0 --seed "$seed" --exp_name async_bench_sync
    python async_rlhf.py --no-vllm --total_steps 12 --eval_every 0 --seed "$seed" --exp_name async_bench_async
done

# 2. Off-policyness: with N minibatches per batch the batch holds N x the prompts and there are 32 / N batches, so
# that every run of an objective makes the same 32 optimizer updates on the same prompts in the same order (2 an
# update with 2 completions each for DPO and RLOO: 64 prompts; 4 with 1 completion for PPO: 128, the first 64 the
# same; 4 completions per update either way). What else changes with N: the generation batch (N x larger), and PPO
# whitens its advantages over the whole batch. --sync: every batch comes from the current weights; PPO with one epoch
# (more would add staleness). Each script's defaults otherwise (lr 1e-5; T 0.9 for async_rlhf.py, 0.7 for
# ppo_rlhf.py). Disk: each run keeps checkpoints and weights, 2-7 GiB (45 runs: ~150 GiB); a finished run needs only
# its config.json and metrics.jsonl, which part 3 copies.
for seed in 1 2 3; do
    for n in 1 16 4 2 8; do
        python async_rlhf.py --sync --no-vllm --loss dpo --num_minibatches "$n" --prompts_per_rank $((2*$n)) \
            --micro_batch_size 2 --total_steps $((32/$n)) --eval_every 0 --seed "$seed" --exp_name "offpolicy_dpo_n$n"
        python async_rlhf.py --sync --no-vllm --loss rloo --rloo_k 2 --num_minibatches "$n" \
            --prompts_per_rank $((2*$n)) --micro_batch_size 2 --total_steps $((32/$n)) --eval_every 0 --seed "$seed" \
            --exp_name "offpolicy_rloo_n$n"
        python ppo_rlhf.py --no-vllm --num_ppo_epochs 1 --num_minibatches "$n" --prompts_per_rank $((4*$n)) \
            --micro_batch_size 4 --total_steps $((32/$n)) --eval_every 0 --seed "$seed" --exp_name "offpolicy_ppo_n$n"
    done
done
# Controls for PPO, whose batch (what it whitens its advantages over) is one minibatch of 4 responses at N = 1:
# its advantages left as GAE gives them, at both ends of N; and N = 1 with 8 responses an update (2 micro-batches of
# 4, 256 samples), the batch of N = 2.
for seed in 1 2 3; do
    for n in 1 16; do
        python ppo_rlhf.py --no-vllm --num_ppo_epochs 1 --num_minibatches "$n" --prompts_per_rank $((4*$n)) \
            --micro_batch_size 4 --total_steps $((32/$n)) --eval_every 0 --no-whiten_advantages --seed "$seed" \
            --exp_name "offpolicy_ppo_nowhiten_n$n"
    done
    python ppo_rlhf.py --no-vllm --num_ppo_epochs 1 --num_minibatches 1 --prompts_per_rank 8 --micro_batch_size 4 \
        --total_steps 32 --eval_every 0 --seed "$seed" --exp_name offpolicy_ppo_batch8_n1
done

# 3. Copies of the runs, then the figures and tables from the copies.
OUT=benchmark/results/async_rlhf
python -m benchmark.statistics.registry copy --out "$OUT" runs/arith_1d__async_bench_*__[123]__* \
    runs/arith_1d__offpolicy_*__[123]__*
SPEED=("sync=$OUT/arith_1d__async_bench_sync__*" "async=$OUT/arith_1d__async_bench_async__*")
python -m benchmark.statistics.registry table --experiments "${SPEED[@]}" \
    --metrics eval/score eval/accuracy objective/scores --out benchmark/results/async_vs_sync.md
python -m benchmark.statistics.registry paired --experiments "${SPEED[@]}" --baseline sync \
    --metrics eval/score eval/accuracy wall_clock --out benchmark/results/async_vs_sync_paired.md
# The paper's two claims for async against --sync as checks: faster (async - sync wall-clock seconds <= 0;
# the runs made one at a time on an otherwise idle machine) and no accuracy loss (async - sync >= -0.02).
python -m benchmark.statistics.registry paired --experiments "${SPEED[@]}" --baseline sync --metrics wall_clock \
    --at_most 0 --out benchmark/results/async_vs_sync_faster.md
python -m benchmark.statistics.registry paired --experiments "${SPEED[@]}" --baseline sync --metrics eval/accuracy \
    --at_least -0.02 --out benchmark/results/async_vs_sync_accuracy.md
python -m benchmark.statistics.registry perf --experiments "${SPEED[@]}" --out benchmark/results/async_vs_sync_perf
python -m benchmark.statistics.registry plot --experiments "${SPEED[@]}" --metric objective/scores eval/score \
    --x time --smooth 3 --out benchmark/results/async_vs_sync_time.png
python -m benchmark.claims.offpolicy --experiments "online DPO=$OUT/arith_1d__offpolicy_dpo_n*" \
    "RLOO=$OUT/arith_1d__offpolicy_rloo_n*" "PPO=$OUT/arith_1d__offpolicy_ppo_n[0-9]*" \
    --out benchmark/results/offpolicy
python -m benchmark.claims.offpolicy --experiments "PPO=$OUT/arith_1d__offpolicy_ppo_n[0-9]*" \
    "PPO, advantages not whitened=$OUT/arith_1d__offpolicy_ppo_nowhiten_n*" \
    "PPO, 8 responses an update=$OUT/arith_1d__offpolicy_ppo_batch8_n*" --baseline PPO \
    --out benchmark/results/offpolicy_ppo_controls
