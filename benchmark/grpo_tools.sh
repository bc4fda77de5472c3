#!/usr/bin/env bash
# The published figures of grpo_tools.py (issue 48): the tool policy against GRPO without a tool on the same
# problems (assets/data/mul_2t3d: products of two numbers of 2-3 digits), same steps and batch (30 steps of 4 prompts
# x 8 samples), 3 seeds each. grpo_math.py keeps its own defaults otherwise (its instruction, 64 response tokens);
# grpo_tools.py gives a trajectory 96 tokens, the policy's and the calculator's together.
#   bash benchmark/grpo_tools.sh                    # one run at a time (a 2-core CPU machine)
# --resume_unfinished: a seed that finished is skipped and an interrupted one resumes from its checkpoint, so the file
# can be run again across sessions until every run is done.
# Every command that runs a script is on its own line: tests/test_benchmark.py checks its flags against --help.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m benchmark.run --script grpo_tools.py --seeds 1 2 3 --resume_unfinished -- --exp_name tools
python -m benchmark.run --script grpo_math.py --seeds 1 2 3 --resume_unfinished -- \
    --dataset_path assets/data/mul_2t3d --exp_name notool

# The runs' config.json and metrics.jsonl to benchmark/results/grpo_tools/ (committed); the table, the checks and the
# curves from the copies. (a) the tool policy's final held-out accuracy minus GRPO's without a tool, seed by seed,
# >= 0; (b) the tool policy's call rate on its training samples, the mean of its last 5 steps minus its first 5,
# >= 0. Held / not held only when the 95% t interval of the mean over seeds clears the bound, else inconclusive.
OUT=benchmark/results/grpo_tools
python -m benchmark.registry copy --out "$OUT" runs/mul_2t3d__tools__[123]__* runs/mul_2t3d__notool__[123]__*
ARMS=("tool=$OUT/mul_2t3d__tools__*" "no tool=$OUT/mul_2t3d__notool__*")
python -m benchmark.registry table --experiments "${ARMS[@]}" --metrics eval/accuracy objective/accuracy \
    objective/response_length --out benchmark/results/grpo_tools.md
python -m benchmark.registry paired --experiments "${ARMS[@]}" --baseline "no tool" --metrics eval/accuracy \
    --at_least 0 --out benchmark/results/grpo_tools_paired.md
python -m benchmark.registry change --experiments "tool=$OUT/mul_2t3d__tools__*" --metrics tools/call_rate \
    objective/accuracy tools/answer_copies_result --window 5 --at_least 0 --out benchmark/results/grpo_tools_change.md
python -m benchmark.registry plot --experiments "${ARMS[@]}" --metric eval/accuracy objective/accuracy --smooth 5 \
    --out benchmark/results/grpo_tools_step.png
python -m benchmark.registry plot --experiments "tool=$OUT/mul_2t3d__tools__*" --metric tools/call_rate \
    tools/answer_copies_result tools/failed_calls objective/accuracy_with_call --smooth 5 \
    --out benchmark/results/grpo_tools_calls.png
