#!/usr/bin/env bash
# The GPU check recorded in docs/launch_paths.md ("On a GPU"). On one GPU, with HF generate:
#  1. every script a few steps under bf16 autocast (accelerate launch --mixed_precision bf16) on random Qwen2-shaped
#     models with the embedded tokenizer (grpo_math twice: a second pass over the batch, and a sliding window of 32
#     with 128-token responses); the table gives each run's first-step KL / ratio / approxkl (0 / 1 / 0 expected);
#  2. grpo_math in bf16 weights with 512-token responses on a Qwen2.5-Math-1.5B-shaped model: torch's CUDA peak
#     against `python -m benchmark.performance.memory_plan` for the same command.
# Needs torch, transformers, accelerate and the scripts' other dependencies; assets/data and the tokenizer files of
# assets/SmolLM2-135M-Instruct (its weights are not read). Writes summary.md and gpu_check.tgz (logs, metrics) to
# $OUT. STEPS, LEN, EVAL, MP (mixed precision), LIMIT (seconds per run) and PEAK (0: skip part 2) shrink it for a
# dry run on a CPU; LENGTHS=1 adds part 3.
#     OUT=/tmp/gpu_check bash benchmark/gpu_check.sh
set -euo pipefail
OUT=${OUT:-/tmp/gpu_check}
W=/tmp/gpu_check_work
M=$W/models
rm -rf $W && mkdir -p $OUT $W/logs $W/runs
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) > $W/logs/versions.txt 2>&1
python3 -m benchmark.performance.gpu_check build $M assets/SmolLM2-135M-Instruct ${PEAK:-1} >> $W/logs/versions.txt

common="--no-vllm --total_steps ${STEPS:-3} --save_every 0 --eval_every ${STEPS:-3} --num_eval_prompts ${EVAL:-16}"
common="$common --response_length ${LEN:-128}"
launch() {  # launch NAME SCRIPT ARGS...: one process, bf16 autocast, its run under $W/runs/NAME
    local name=$1 start=$SECONDS rc=0
    shift
    timeout ${LIMIT:-300} python3 -m accelerate.commands.launch --num_processes 1 --num_machines 1 \
        --mixed_precision ${MP:-bf16} --dynamo_backend no "$@" --output_dir $W/runs/$name \
        > $W/logs/$name.log 2>&1 || rc=$?
    echo "$name: rc $rc, $((SECONDS - start)) s" >> $W/logs/rc.txt
}
launch grpo_two_passes grpo_math.py $common --model_name_or_path $M/qwen2 --num_iterations 2 &
launch grpo_window32 grpo_math.py $common --model_name_or_path $M/qwen2-window32 &
launch ppo_rlhf ppo_rlhf.py $common --model_name_or_path $M/qwen2 --reward_model_path $M/qwen2-reward &
launch dpo_online dpo_online.py $common --model_name_or_path $M/qwen2 --reward_model_path $M/qwen2-reward &
launch async_rlhf async_rlhf.py $common --model_name_or_path $M/qwen2 --reward_model_path $M/qwen2-reward &
launch ppo_prm_clip ppo_prm_clip.py $common --model_name_or_path $M/qwen2 &
launch rm_pairs reward_modeling.py --no-vllm --model_name_or_path $M/qwen2 --dataset_path $M/preferences \
    --reward_model_dir $W/reward_model &
launch rm_prm reward_modeling.py --no-vllm --model_name_or_path $M/qwen2 --prm --num_train_prompts 16 \
    --num_eval_prompts 4 --response_length ${LEN:-128} --prm_dir $W/prm &
wait

peak_and_plan() {  # grpo_math.py ARGS: torch's CUDA peak in that run; prints the memory plan of the same command
    local start=$SECONDS rc=0
    timeout ${LIMIT:-300} python3 -m benchmark.performance.gpu_check peak $W/logs/peak.json grpo_math.py "$@" \
        > $W/logs/peak_1.5b.log 2>&1 || rc=$?
    echo "peak_1.5b: rc $rc, $((SECONDS - start)) s" >> $W/logs/rc.txt
    python3 -m benchmark.performance.memory_plan --model_config $M/qwen2-1.5b grpo_math.py "$@" || true
}
if [ "${PEAK:-1}" = 1 ]; then
    peak_and_plan --no-vllm --model_name_or_path $M/qwen2-1.5b --dtype bfloat16 --response_length 512 --total_steps 2 \
        --save_every 0 --eval_every 0 --num_eval_prompts 32 --output_dir $W/runs/peak_1.5b > $W/logs/plan.txt 2>&1
fi
# 3. Optional (LENGTHS=1): the shared-prompt forward against the unpacked one by response length, on the GPU
# (benchmark/results/gpu_check_h100/shared_prompt_length.md, 2026-11-26; those sweeps stopped at their time limits).
if [ "${LENGTHS:-0}" = 1 ]; then
    python3 -m benchmark.performance.perf_shared_prompt_length --device cuda --dtype bfloat16 --layers 0 \
        --model_config benchmark/configs/qwen2.5-1.5b --lengths 128 256 512 1024 2048 \
        --out $OUT/shared_prompt_length_qwen2.5-1.5b || true
    python3 -m benchmark.performance.perf_shared_prompt_length --device cuda --lengths 64 256 512 1024 \
        --out $OUT/shared_prompt_length_smollm2 || true
fi
python3 -m benchmark.performance.gpu_check summary $W/runs > $OUT/summary.md
{ echo; cat $W/logs/versions.txt $W/logs/rc.txt $W/logs/peak.json $W/logs/plan.txt 2>/dev/null || true; } \
    >> $OUT/summary.md
tar czf $OUT/gpu_check.tgz -C $W --exclude '*.safetensors' --exclude '*.bin' --exclude '*.pt' logs runs
cat $OUT/summary.md
