#!/usr/bin/env bash
# The published figures of grpo_tools.py: the tool policy against GRPO without a tool on the same
# problems (assets/data/mul_2t3d: products of two numbers of 2-3 digits), same steps and batch (30 steps of 4 prompts
# x 8 samples), 3 seeds each. grpo_math.py keeps its own defaults otherwise (its instruction, 64 response tokens);
# grpo_tools.py gives a trajectory 96 tokens, the policy's and the calculator's together.
#   bash benchmark/grpo_tools.sh                    # one run at a time (a 2-core CPU machine)
# --resume_unfinished: a seed that finished is skipped and an interrupted one resumes from its checkpoint, so the file
# can be run again across sessions until every run is done.
# Every command that runs a script is on its own line: tests/benchmark/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmark/python.sh  # `python` is the venv's

# ---------------------------------------------------------------------------------------------------------------------
# add_example and chain: their gates failed (docs/grpo_tools.md), so only their probes ran; chain's replacement,
# chain_g16, ran (3 seeds, 2026-11-28/29), then chain_3t (1 seed). Each runs only when named;
# the published experiment at the end stays what `bash benchmark/grpo_tools.sh` runs:
#   bash benchmark/grpo_tools.sh add_example    # a tool task RL must learn: mul_2t3d, an addition example shown
#   bash benchmark/grpo_tools.sh prompt_probes  # its replacement's probes: no example shown
#   bash benchmark/grpo_tools.sh chain          # several calls: one operation per call, 2-3 terms, 4 held out
#   bash benchmark/grpo_tools.sh chain_g16      # its replacement: the chained example, groups of 16, 60 steps
#   bash benchmark/grpo_tools.sh chain_3t       # the same on 3-term products only (1 seed)
#   bash benchmark/grpo_tools.sh chain_prompts  # chain's gate on three more prompts
#   bash benchmark/grpo_tools.sh chain_arms     # add_example's other arms on that task: probes of step 0
# Seeds: 5 where a run costs <= 15 min (add_example's runs are the published run's size: 11-12 min on the 2 cores),
# else 3 (chain: 128-token trajectories of up to 4 calls, 300 + 500 held-out prompts at each evaluation).
# benchmark/claims/tool_probe.py writes each probe's folder (probe.json, and a metrics.jsonl that
# benchmark.statistics.registry reads as a run's evaluation) straight into $CHAIN; the runs are copied there once
# finished. $'\n' is the examples' line break. A run's example is written out in its command
# (tests/docs/test_commands.py parses it); a probe's is Q/A below.
CHAIN=benchmark/results/grpo_tools_chain
# The untrained policy under --tool_format native (SmolLM2 with the Hermes tool template make assets writes, its
# own ignoring tools=) beside calc, greedy and at T 1 (4 samples a prompt), on the first 100 held-out prompts; and the
# second environment, price_list (its task from make assets). Each probe's folder (probe.json, config.json,
# metrics.jsonl) goes to benchmark/results/grpo_tools_native_probes/. Native shows each environment's three
# exchanges; the native probes with one exchange shown (code before 9d0a0cc) are in its one_exchange/, and the native
# and price_list probes made before the tool-call parse of bfd07e5 (unclosed calls, <think>, Llama's bare JSON) in its
# before_parse/.
#   bash benchmark/grpo_tools.sh native_probes  # ~2-6 min a probe (vLLM, 2 cores)
if [[ ${1:-} == native_probes ]]; then
    PROBES=benchmark/results/grpo_tools_native_probes
    for format in calc native; do
        python -m benchmark.claims.tool_probe --exp_name "${format}_greedy" --tool_format "$format" --temperature 0 \
            --num_prompts 100 --output_dir "$PROBES"
        python -m benchmark.claims.tool_probe --exp_name "${format}_t1" --tool_format "$format" --temperature 1 \
            --samples_per_prompt 4 --num_prompts 100 --output_dir "$PROBES"
    done
    for temperature in 0 1; do
        python -m benchmark.claims.tool_probe --exp_name "price_list_t$temperature" --tool_format native \
            --environment price_list --dataset_path assets/data/price_list --response_length 192 \
            --temperature "$temperature" --samples_per_prompt $((temperature == 0 ? 1 : 4)) --num_prompts 100 \
            --output_dir "$PROBES"
    done
    exit 0
fi

# The native format against calc on the same task, budget (30 steps, --response_length 96) and seeds; the calc arm
# is the committed runs of the main part (benchmark/results/grpo_tools/: today's calc code path gives the same
# trajectories).
#   bash benchmark/grpo_tools.sh native  # ~15-25 min a run on 2 cores
if [[ ${1:-} == native ]]; then
    shift
    python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 --resume_unfinished "$@" -- \
        --tool_format native --exp_name native
    OUT=benchmark/results/grpo_tools_native
    python -m benchmark.statistics.registry copy --out "$OUT" runs/mul_2t3d__*native__[123]__*
    ARMS=("calc=benchmark/results/grpo_tools/mul_2t3d__tools__*" "native=$OUT/mul_2t3d__*native__*")
    python -m benchmark.statistics.registry table --experiments "${ARMS[@]}" \
        --metrics eval/accuracy eval/call_rate objective/accuracy tools/calls tools/failed_calls tools/truncated \
        --out benchmark/results/grpo_tools_native.md
    python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline calc --metrics eval/accuracy \
        eval/call_rate objective/accuracy --out benchmark/results/grpo_tools_native_paired.md
    python -m benchmark.statistics.registry plot --experiments "${ARMS[@]}" --metric eval/accuracy objective/accuracy \
        eval/call_rate --out benchmark/results/grpo_tools_native.png
    exit 0
fi

# The two-tool environment on a task the 135M policy can start on: price_list_one (one item at a shop: one
# `price` call of three typed arguments, `add` offered and not needed; each of the 144 questions there is, 48 held
# out), its three one-item exchanges shown (price_list's two-item task: 0 of 400 right at T 1). First the untrained
# policy's probes on all 48 held-out questions (greedy and T 1, 4 samples), to
# benchmark/results/grpo_tools_native_probes/; then 3 seeds at the calc runs' budget (30 steps of 4 prompts x 8), 128
# tokens a trajectory (one call and its answer take ~60), evaluated on all 48 every 10 steps.
#   bash benchmark/grpo_tools.sh price_list_one  # probes done (skipped when their folder exists); runs untimed
if [[ ${1:-} == price_list_one ]]; then
    shift
    PROBES=benchmark/results/grpo_tools_native_probes
    for temperature in 0 1; do
        [ -n "$(ls -d "$PROBES"/price_list_one__price_list_one_t"$temperature"__* 2>/dev/null)" ] && continue
        python -m benchmark.claims.tool_probe --exp_name "price_list_one_t$temperature" --tool_format native \
            --environment price_list_one --dataset_path assets/data/price_list_one --response_length 128 \
            --temperature "$temperature" --samples_per_prompt $((temperature == 0 ? 1 : 4)) --output_dir "$PROBES"
    done
    python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 --resume_unfinished "$@" -- \
        --tool_format native --environment price_list_one --dataset_path assets/data/price_list_one \
        --response_length 128 --exp_name price_one
    OUT=benchmark/results/grpo_tools_price_list_one
    python -m benchmark.statistics.registry copy --out "$OUT" runs/price_list_one__*price_one__[123]__*
    ARM=("price_list_one=$OUT/price_list_one__*price_one__*")
    python -m benchmark.statistics.registry table --experiments "${ARM[@]}" --metrics eval/accuracy eval/call_rate \
        objective/accuracy tools/calls tools/failed_calls tools/truncated --out "$OUT.md"
    python -m benchmark.statistics.registry plot --experiments "${ARM[@]}" --metric eval/accuracy objective/accuracy \
        tools/failed_calls --out "$OUT.png"
    exit 0
fi

if [[ ${1:-} == add_example ]]; then
    Q="Calculate 23 + 41. Give the final answer after 'Answer:'."  # the addition example, shown instead of 23 * 41
    A="<calc>23 + 41</calc><result>64</result>"$'\n'"Answer: 64"
    # (0) The task must leave RL room: the step-0 policy's greedy accuracy on the 300 held-out products with the
    # addition example is <= 0.5 (exit status 3 above it: stop here and choose another prompt).
    python -m benchmark.claims.tool_probe --exp_name add_greedy --temperature 0 --max_accuracy 0.5 \
        --output_dir "$CHAIN" --examples "$Q" "$A"
    # (1) Two arms on the same prompt and budget (30 steps of 4 prompts x 8 samples at T 1, 96 tokens, 3 calls, greedy
    # evaluation on the 300 held-out products every 10 steps), 5 seeds: the working calculator, and the tool disabled
    # (every call answered `error: unavailable` through the same tokens path).
    python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 4 5 --resume_unfinished -- \
        --exp_name add_tool --examples "Calculate 23 + 41. Give the final answer after 'Answer:'." \
        "<calc>23 + 41</calc><result>64</result>"$'\n'"Answer: 64"
    python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 4 5 --resume_unfinished -- \
        --tool unavailable --exp_name add_unavailable \
        --examples "Calculate 23 + 41. Give the final answer after 'Answer:'." \
        "<calc>23 + 41</calc><result>64</result>"$'\n'"Answer: 64"
    # (2) Sharpening without RL: the step-0 policy sampled at T 0.5 on the same held-out products, 4 samples each, one
    # probe per seed (paired with the runs' seeds). Its greedy limit, T 0, is each run's own step-0 evaluation.
    for SEED in 1 2 3 4 5; do
        python -m benchmark.claims.tool_probe --exp_name add_sharpen_t05 --temperature 0.5 --samples_per_prompt 4 \
            --seed "$SEED" --output_dir "$CHAIN" --examples "$Q" "$A"
    done
    # (3) The claims: the tool arm's final greedy accuracy and call rate beat the disabled tool's, the sharpened
    # policy's (T 0.5) and its own step 0 (T 0); held only when the 95% t interval over the 5 seeds clears 0.
    python -m benchmark.statistics.registry copy --out "$CHAIN" runs/mul_2t3d__add_tool__[1-5]__* \
        runs/mul_2t3d__add_unavailable__[1-5]__*
    TOOL="tool=$CHAIN/mul_2t3d__add_tool__*"
    OFF="unavailable=$CHAIN/mul_2t3d__add_unavailable__*"
    SHARP="sharpen=$CHAIN/mul_2t3d__add_sharpen_t05__*"
    python -m benchmark.statistics.registry table --experiments "$TOOL" "$OFF" "$SHARP" \
        --metrics eval/accuracy eval/call_rate objective/accuracy tools/call_rate \
        --out benchmark/results/grpo_tools_add_example.md
    python -m benchmark.statistics.registry paired --experiments "$TOOL" "$OFF" --baseline unavailable \
        --metrics eval/accuracy eval/call_rate --at_least 0 \
        --out benchmark/results/grpo_tools_add_example_unavailable.md
    python -m benchmark.statistics.registry paired --experiments "$TOOL" "$SHARP" --baseline sharpen \
        --metrics eval/accuracy eval/call_rate --at_least 0 --out benchmark/results/grpo_tools_add_example_sharpen.md
    python -m benchmark.statistics.registry change --experiments "$TOOL" --metrics eval/accuracy eval/call_rate \
        --window 1 --at_least 0 --out benchmark/results/grpo_tools_add_example_step0.md
    python -m benchmark.statistics.registry plot --experiments "$TOOL" "$OFF" --metric eval/accuracy eval/call_rate \
        objective/accuracy tools/call_rate --smooth 5 --out benchmark/results/grpo_tools_add_example.png
    exit 0
fi
# add_example's gate failed on 2026-11-28 (the add_greedy probe above: greedy accuracy 0.837, call rate 0.907 with
# the addition example), so the prompt leaves RL no room. The probes of the replacement: no example at all,
# greedy on the held-out products, then sampled at T 1 on 64 training prompts x 8.
if [[ ${1:-} == prompt_probes ]]; then
    python -m benchmark.claims.tool_probe --exp_name noexample_greedy --temperature 0 --max_accuracy 0.5 \
        --output_dir "$CHAIN" --examples
    python -m benchmark.claims.tool_probe --exp_name noexample_t1 --temperature 1 --prompts train --num_prompts 64 \
        --samples_per_prompt 8 --output_dir "$CHAIN" --examples
    # 3-term products (chain's task) with the one-call example and no limit on the operations a call holds: does
    # the policy put every factor in its call? (chain's gates, with one operation a call, are in its block below)
    python -m benchmark.assets.prepare_assets --only tasks
    python -m benchmark.claims.tool_probe --exp_name terms3_example1 --prompts train --terms 3 --num_prompts 64 \
        --samples_per_prompt 4 --dataset_path assets/data/mul_2t3t2d --max_turns 4 --response_length 128 \
        --output_dir "$CHAIN" --examples "Calculate 23 * 41. Give the final answer after 'Answer:'." \
        "<calc>23 * 41</calc><result>943</result>"$'\n'"Answer: 943"
    python -m benchmark.claims.tool_probe --exp_name terms3_example1_greedy --temperature 0 --terms 3 \
        --dataset_path assets/data/mul_2t3t2d --max_turns 4 --response_length 128 --max_accuracy 0.5 \
        --output_dir "$CHAIN" --examples "Calculate 23 * 41. Give the final answer after 'Answer:'." \
        "<calc>23 * 41</calc><result>943</result>"$'\n'"Answer: 943"
    # chain's second gate (one operation a call, the chained example) at 8 samples a prompt: a chain rate below 1/64?
    python -m benchmark.claims.tool_probe --exp_name chain_example2_x8 --prompts train --terms 3 --num_prompts 64 \
        --samples_per_prompt 8 --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 \
        --response_length 128 --output_dir "$CHAIN" \
        --examples "Calculate 12 * 34 * 5. Give the final answer after 'Answer:'." \
        "<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    # The replacement's room for RL: the step-0 policy's greedy accuracy on the held-out 3-term products with the
    # chained example (<= 0.5 wanted: a greedy policy already right would leave only sharpening to learn).
    python -m benchmark.claims.tool_probe --exp_name chain_example2_greedy --temperature 0 --terms 3 \
        --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 --max_accuracy 0.5 \
        --output_dir "$CHAIN" --examples "Calculate 12 * 34 * 5. Give the final answer after 'Answer:'." \
        "<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    exit 0
fi
if [[ ${1:-} == chain ]]; then
    # Adds mul_2t3t2d and mul_4t2d (the tasks already built are kept).
    python -m benchmark.assets.prepare_assets --only tasks
    Q="Calculate 23 * 41. Give the final answer after 'Answer:'."  # grpo_tools' own example: one call
    A="<calc>23 * 41</calc><result>943</result>"$'\n'"Answer: 943"
    # (0) The gate: 64 samples at T 1 (the training temperature) of 3-term training products, one operation per call,
    # the one-call example shown; >= 3% right, else (exit status 3) the same with a chained two-call example shown.
    gate=0
    python -m benchmark.claims.tool_probe --exp_name chain_gate_example1 --prompts train --terms 3 --num_prompts 64 \
        --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 \
        --min_accuracy 0.03 --output_dir "$CHAIN" --examples "$Q" "$A" || gate=$?
    if [[ $gate == 0 ]]; then
        EXAMPLE=example1
        # (1) Trained on 2- and 3-term products, the 4-term ones held out (eval_extra), 3 seeds.
        python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 --resume_unfinished -- \
            --exp_name chain_example1 --dataset_path assets/data/mul_2t3t2d --extra_eval_path assets/data/mul_4t2d \
            --max_operations 1 --max_turns 4 --response_length 128
    elif [[ $gate == 3 ]]; then
        EXAMPLE=example2
        Q="Calculate 12 * 34 * 5. Give the final answer after 'Answer:'."  # a chained two-call example
        A="<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
        python -m benchmark.claims.tool_probe --exp_name chain_gate_example2 --prompts train --terms 3 \
            --num_prompts 64 --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 \
            --response_length 128 --min_accuracy 0.03 --output_dir "$CHAIN" \
            --examples "$Q" "$A"  # set -e: a second failure stops here
        python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 --resume_unfinished -- \
            --exp_name chain_example2 --dataset_path assets/data/mul_2t3t2d --extra_eval_path assets/data/mul_4t2d \
            --max_operations 1 --max_turns 4 --response_length 128 \
            --examples "Calculate 12 * 34 * 5. Give the final answer after 'Answer:'." \
            "<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    else
        exit "$gate"
    fi
    # (2) The held-out 2-3 term products by number of terms (accuracy, >= 2 calls), greedy, before and after
    # training: the step-0 policy and each seed's trained policy (runs/.../model), with the runs' shown example.
    for SEED in 1 2 3; do
        python -m benchmark.claims.tool_probe --exp_name "chain_${EXAMPLE}_step0" --temperature 0 --seed "$SEED" \
            --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 \
            --output_dir "$CHAIN" --examples "$Q" "$A"
        python -m benchmark.claims.tool_probe --exp_name "chain_${EXAMPLE}_final" --temperature 0 --seed "$SEED" \
            --model_name_or_path runs/mul_2t3t2d__chain_"$EXAMPLE"__"$SEED"__*/model \
            --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 \
            --output_dir "$CHAIN" --examples "$Q" "$A"
    done
    # (3) The claims: the 3-term held-out accuracy and rate of >= 2 calls rise (trained minus step 0, greedy); on the
    # training samples the rate of >= 2 calls rises (last 5 steps minus first 5); the 4-term held-out accuracy ends
    # above its step-0 value (so above 0). Held only when the 95% t interval over the 3 seeds clears 0.
    python -m benchmark.statistics.registry copy --out "$CHAIN" runs/mul_2t3t2d__chain_"$EXAMPLE"__[1-3]__*
    RUNS="chain=$CHAIN/mul_2t3t2d__chain_${EXAMPLE}__*"
    python -m benchmark.statistics.registry table --experiments "$RUNS" --metrics eval/accuracy eval_extra/accuracy \
        eval/call_rate tools/multi_call_rate objective/accuracy --out benchmark/results/grpo_tools_chain.md
    python -m benchmark.statistics.registry paired --experiments "final=$CHAIN/mul_2t3t2d__chain_${EXAMPLE}_final__*" \
        "step0=$CHAIN/mul_2t3t2d__chain_${EXAMPLE}_step0__*" --baseline step0 --metrics eval/accuracy_3_terms \
        eval/multi_call_rate_3_terms --at_least 0 --out benchmark/results/grpo_tools_chain_terms.md
    python -m benchmark.statistics.registry change --experiments "$RUNS" \
        --metrics tools/multi_call_rate objective/accuracy --window 5 --at_least 0 \
        --out benchmark/results/grpo_tools_chain_change.md
    python -m benchmark.statistics.registry change --experiments "$RUNS" --metrics eval_extra/accuracy eval/accuracy \
        --window 1 --at_least 0 --out benchmark/results/grpo_tools_chain_heldout.md
    python -m benchmark.statistics.registry plot --experiments "$RUNS" --metric eval/accuracy eval_extra/accuracy \
        tools/multi_call_rate tools/calls --smooth 5 --out benchmark/results/grpo_tools_chain.png
    exit 0
fi

# chain's gates both failed on 2026-11-28 (chain_gate_example1: 0 of 64; chain_gate_example2: 0 of 64; at 8 samples a
# prompt chain_example2_x8: 2 of 512 right, 1.8% with >= 2 calls; greedy chain_example2_greedy: 0 of 150, never two
# calls), so the block above stops at its second gate. The replacement: the chained example and
# groups of 16 (a success in 1/256 samples reaches a group 6% of the time instead of 3%), the same 32 trajectories a
# step as the published run, over 60 steps; evaluations at steps 0, 20, 40 and 60 (300 held-out 2-3 term products,
# all 500 held-out 4-term ones). 3 seeds.
if [[ ${1:-} == chain_g16 ]]; then
    python -m benchmark.assets.prepare_assets --only tasks
    Q="Calculate 12 * 34 * 5. Give the final answer after 'Answer:'."
    A="<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 --resume_unfinished -- \
        --exp_name chain_g16 --dataset_path assets/data/mul_2t3t2d --extra_eval_path assets/data/mul_4t2d \
        --max_operations 1 --max_turns 4 --response_length 128 --prompts_per_rank 2 --num_generations 16 \
        --total_steps 60 --eval_every 20 --examples "Calculate 12 * 34 * 5. Give the final answer after 'Answer:'." \
        "<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    # The 300 held-out 2-3 term products (the runs' eval set) by number of terms, greedy, before and after training:
    # the step-0 policy once (greedy decoding does not depend on the seed: the checks pair it with every seed, with
    # --fixed_baseline), each seed's model.
    python -m benchmark.claims.tool_probe --exp_name chain_g16_step0 --temperature 0 --seed 1 \
        --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 \
        --output_dir "$CHAIN" --examples "$Q" "$A"
    for SEED in 1 2 3; do
        python -m benchmark.claims.tool_probe --exp_name chain_g16_final --temperature 0 --seed "$SEED" \
            --model_name_or_path runs/mul_2t3t2d__chain_g16__"$SEED"__*/model \
            --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 \
            --output_dir "$CHAIN" --examples "$Q" "$A"
    done
    # The claims, held only when the 95% t interval over the 3 seeds clears 0: the 3-term held-out accuracy and rate
    # of >= 2 calls rise (the probes, trained minus step 0); the held-out accuracy (2-3 terms) and the 4-term one rise
    # (the runs' first and last evaluations); on the training samples the rate of >= 2 calls and the accuracy rise
    # (last 5 steps minus first 5).
    python -m benchmark.statistics.registry copy --out "$CHAIN" runs/mul_2t3t2d__chain_g16__[1-3]__*
    RUNS="chain_g16=$CHAIN/mul_2t3t2d__chain_g16__*"
    python -m benchmark.statistics.registry table --experiments "$RUNS" --metrics eval/accuracy eval_extra/accuracy \
        eval/call_rate tools/multi_call_rate objective/accuracy --out benchmark/results/grpo_tools_chain.md
    python -m benchmark.statistics.registry paired --experiments "final=$CHAIN/mul_2t3t2d__chain_g16_final__*" \
        "step0=$CHAIN/mul_2t3t2d__chain_g16_step0__*" --baseline step0 --fixed_baseline \
        --metrics eval/accuracy_3_terms eval/multi_call_rate_3_terms eval/accuracy_2_terms --at_least 0 \
        --count_above 0.5 --out benchmark/results/grpo_tools_chain_terms.md
    python -m benchmark.statistics.registry change --experiments "$RUNS" --metrics eval/accuracy eval_extra/accuracy \
        --window 1 --at_least 0 --out benchmark/results/grpo_tools_chain_heldout.md
    python -m benchmark.statistics.registry change --experiments "$RUNS" \
        --metrics tools/multi_call_rate objective/accuracy --window 5 --at_least 0 \
        --out benchmark/results/grpo_tools_chain_change.md
    python -m benchmark.statistics.registry plot --experiments "$RUNS" --metric eval/accuracy eval_extra/accuracy \
        tools/multi_call_rate objective/accuracy --smooth 5 --out benchmark/results/grpo_tools_chain.png
    exit 0
fi
# The same runs on 3-term products only (mul_3t2d: mul_2t3t2d's 3-term rows, split for split): in chain_g16
# one seed of three learned the chain. With no 2-term prompt, a 3-term group's rare right chain (2 in 512 samples at
# step 0) comes twice as often a step, and no group rewards answering after one call. The same budget (60 steps of
# 2 prompts x 16 samples); greedy evaluation at steps 0, 30 and 60 on the same 150 held-out 3-term products
# (--num_eval_prompts 150: the first 150 of mul_3t2d's test split are chain_g16's) and the 500 4-term ones.
# Seed 1 only (2026-11-29): its first right answer came at step 58 (1 in 1920 samples; until then every group had
# no signal, so the policy stayed the step-0 one), so the design rests on a rarer event than the mixed runs, and
# seeds 2-3 were not run; with one seed there is no check, only its table.
if [[ ${1:-} == chain_3t ]]; then
    python -m benchmark.assets.prepare_assets --only tasks
    Q="Calculate 12 * 34 * 5. Give the final answer after 'Answer:'."
    A="<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 --resume_unfinished -- --exp_name chain_3t \
        --dataset_path assets/data/mul_3t2d --num_eval_prompts 150 --extra_eval_path assets/data/mul_4t2d \
        --max_operations 1 --max_turns 4 --response_length 128 --prompts_per_rank 2 --num_generations 16 \
        --total_steps 60 --eval_every 30 --examples "Calculate 12 * 34 * 5. Give the final answer after 'Answer:'." \
        "<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    # The trained policy on chain_g16's 300 held-out 2-3 term products, greedy (its step-0 probe,
    # chain_g16_step0, is these runs' step 0 too: the same prompt, products and flags).
    python -m benchmark.claims.tool_probe --exp_name chain_3t_final --temperature 0 --seed 1 \
        --model_name_or_path runs/mul_3t2d__chain_3t__1__*/model \
        --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 \
        --output_dir "$CHAIN" --examples "$Q" "$A"
    python -m benchmark.statistics.registry copy --out "$CHAIN" runs/mul_3t2d__chain_3t__1__*
    RUNS="chain_3t=$CHAIN/mul_3t2d__chain_3t__*"
    python -m benchmark.statistics.registry table --experiments "$RUNS" "final=$CHAIN/mul_2t3t2d__chain_3t_final__*" \
        "step0=$CHAIN/mul_2t3t2d__chain_g16_step0__*" --metrics eval/accuracy eval_extra/accuracy \
        tools/multi_call_rate objective/accuracy eval/accuracy_3_terms eval/accuracy_2_terms \
        --out benchmark/results/grpo_tools_chain_3t.md
    exit 0
fi

# A prompt the step-0 policy chains from: chain's gate (>= 3% right at T 1 on 3-term training products, one
# operation a call), probed on 128 prompts x 8 for three prompts beyond the chained example alone (2 in 512): two
# chained examples; the chained example with a system prompt that says a call takes one operation; both. A prompt
# that passes is then probed greedy on the 150 held-out 3-term products (<= 0.5: room for RL, not sharpening).
if [[ ${1:-} == chain_prompts ]]; then
    Q1="Calculate 12 * 34 * 5. Give the final answer after 'Answer:'."
    A1="<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    Q2="Calculate 26 * 3 * 47. Give the final answer after 'Answer:'."
    A2="<calc>26 * 3</calc><result>78</result><calc>78 * 47</calc><result>3666</result>"$'\n'"Answer: 3666"
    S="You can use a calculator: write <calc>expression</calc> and its result follows as <result>value</result>."
    S+=" A call takes one operation: for more, call it again on its result."
    PROBE=(--prompts train --terms 3 --num_prompts 128 --samples_per_prompt 8 --dataset_path assets/data/mul_2t3t2d
        --max_operations 1 --max_turns 4 --response_length 128 --min_accuracy 0.03 --output_dir "$CHAIN")
    GREEDY=(--temperature 0 --terms 3 --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4
        --response_length 128 --max_accuracy 0.5 --output_dir "$CHAIN")
    python -m benchmark.claims.tool_probe --exp_name gate_two_examples "${PROBE[@]}" \
        --examples "$Q1" "$A1" "$Q2" "$A2" &&
        python -m benchmark.claims.tool_probe --exp_name greedy_two_examples "${GREEDY[@]}" \
            --examples "$Q1" "$A1" "$Q2" "$A2" || true
    python -m benchmark.claims.tool_probe --exp_name gate_system "${PROBE[@]}" --system_prompt "$S" \
        --examples "$Q1" "$A1" &&
        python -m benchmark.claims.tool_probe --exp_name greedy_system "${GREEDY[@]}" --system_prompt "$S" \
            --examples "$Q1" "$A1" || true
    python -m benchmark.claims.tool_probe --exp_name gate_system_two "${PROBE[@]}" --system_prompt "$S" \
        --examples "$Q1" "$A1" "$Q2" "$A2" &&
        python -m benchmark.claims.tool_probe --exp_name greedy_system_two "${GREEDY[@]}" --system_prompt "$S" \
            --examples "$Q1" "$A1" "$Q2" "$A2" || true
    exit 0
fi

# add_example's other arms on the task that replaced it (chain_g16's: the chained example, 2-3 term products, one
# operation a call), as probes of the step-0 policy: sharpening without RL (T 0.5, 4 samples on each of the 300
# held-out products), and the signal a run with the tool disabled would get (every call answered `error:
# unavailable`; T 1 on 128 x 8 training products of 2-3 terms): a group with no right answer has zero advantage.
if [[ ${1:-} == chain_arms ]]; then
    Q="Calculate 12 * 34 * 5. Give the final answer after 'Answer:'."
    A="<calc>12 * 34</calc><result>408</result><calc>408 * 5</calc><result>2040</result>"$'\n'"Answer: 2040"
    python -m benchmark.claims.tool_probe --exp_name chain_sharpen_t05 --temperature 0.5 --samples_per_prompt 4 \
        --dataset_path assets/data/mul_2t3t2d --max_operations 1 --max_turns 4 --response_length 128 \
        --output_dir "$CHAIN" --examples "$Q" "$A"
    python -m benchmark.claims.tool_probe --exp_name chain_unavailable_t1 --tool unavailable --prompts train \
        --num_prompts 128 --samples_per_prompt 8 --dataset_path assets/data/mul_2t3t2d --max_operations 1 \
        --max_turns 4 --response_length 128 --output_dir "$CHAIN" --examples "$Q" "$A"
    # The tool arm (each seed's trained policy, greedy) against the sharpened step-0 policy, paired with every seed
    # (--fixed_baseline: the probe's own sampling error, s.e. 0.019 on 1200 samples, is left out of the interval).
    python -m benchmark.statistics.registry paired --experiments "tool=$CHAIN/mul_2t3t2d__chain_g16_final__*" \
        "sharpen=$CHAIN/mul_2t3t2d__chain_sharpen_t05__*" --baseline sharpen --fixed_baseline \
        --metrics eval/accuracy eval/accuracy_3_terms eval/accuracy_2_terms --at_least 0 \
        --out benchmark/results/grpo_tools_chain_sharpen.md
    exit 0
fi

# The published experiment, what a plain `bash benchmark/grpo_tools.sh` runs.

python -m benchmark.statistics.run --script grpo_tools.py --seeds 1 2 3 --resume_unfinished -- --exp_name tools
python -m benchmark.statistics.run --script grpo_math.py --seeds 1 2 3 --resume_unfinished -- \
    --dataset_path assets/data/mul_2t3d --exp_name notool

# The runs' config.json and metrics.jsonl to benchmark/results/grpo_tools/ (committed); the table, the checks and the
# curves from the copies. (a) the tool policy's final held-out accuracy minus GRPO's without a tool, seed by seed,
# >= 0; (b) the tool policy's call rate on its training samples, the mean of its last 5 steps minus its first 5,
# >= 0. Held / not held only when the 95% t interval of the mean over seeds clears the bound, else inconclusive.
OUT=benchmark/results/grpo_tools
python -m benchmark.statistics.registry copy \
    --out "$OUT" runs/mul_2t3d__tools__[123]__* runs/mul_2t3d__notool__[123]__*
ARMS=("tool=$OUT/mul_2t3d__tools__*" "no tool=$OUT/mul_2t3d__notool__*")
python -m benchmark.statistics.registry table --experiments "${ARMS[@]}" --metrics eval/accuracy objective/accuracy \
    objective/response_length --out benchmark/results/grpo_tools.md
python -m benchmark.statistics.registry paired --experiments "${ARMS[@]}" --baseline "no tool" \
    --metrics eval/accuracy --at_least 0 --out benchmark/results/grpo_tools_paired.md
python -m benchmark.statistics.registry change --experiments "tool=$OUT/mul_2t3d__tools__*" --metrics tools/call_rate \
    objective/accuracy tools/answer_copies_result --window 5 --at_least 0 --out benchmark/results/grpo_tools_change.md
python -m benchmark.statistics.registry plot --experiments "${ARMS[@]}" --metric eval/accuracy objective/accuracy \
    --smooth 5 --out benchmark/results/grpo_tools_step.png
python -m benchmark.statistics.registry plot --experiments "tool=$OUT/mul_2t3d__tools__*" --metric tools/call_rate \
    tools/answer_copies_result tools/failed_calls objective/accuracy_with_call --smooth 5 \
    --out benchmark/results/grpo_tools_calls.png
