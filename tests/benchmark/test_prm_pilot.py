"""The PRM pilot's registered criterion (benchmark/claims/prm_pilot.py) against the rule written out here."""

import json
import os
import random

from benchmark.claims import prm_pilot


def write_run(root, name, seed, evals):
    """A run folder whose metrics.jsonl has one evaluation line per (step, accuracy, steps a response)."""
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"args": {"seed": seed}}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step, accuracy, steps in evals:
            f.write(json.dumps({"global_step": step, "eval/accuracy": accuracy, "eval/num_steps": steps}) + "\n")
            f.write(json.dumps({"global_step": step, "objective/accuracy": 0.5}) + "\n")  # a training line
    return path


def test_criterion_is_the_registered_rule(tmp_path):
    rng = random.Random(0)
    for i in range(300):
        acc0, steps0 = rng.uniform(0.1, 0.5), rng.uniform(1, 5)
        acc1, steps1 = acc0 + rng.choice([-0.1, -0.05, -0.04, -0.039, 0.0, 0.03]), steps0 + rng.choice([-1, 0, 0.5])
        path = write_run(tmp_path, f"t__pilot__{i}__{i}", i, [(0, acc0, steps0), (5, 0.9, 9.0), (30, acc1, steps1)])
        row = prm_pilot.run_row(prm_pilot.find_runs(path)[0], 0.04)
        expected = (acc0 - acc1 >= 0.04 - 1e-9) and steps1 > steps0  # the rule, written here
        assert row[-1] == expected, (acc0, acc1, steps0, steps1)
        assert row[:2] == (i, 30)


def test_a_cell_needs_both_seeds(tmp_path):
    hacked, kept = [(0, 0.30, 3.0), (30, 0.20, 5.0)], [(0, 0.30, 3.0), (30, 0.29, 5.0)]
    write_run(tmp_path, "t__a__1__1", 1, hacked)
    write_run(tmp_path, "t__a__2__2", 2, hacked)
    write_run(tmp_path, "t__b__1__3", 1, hacked)
    write_run(tmp_path, "t__b__2__4", 2, kept)
    write_run(tmp_path, "t__c__1__5", 1, hacked)
    cells = [(label, str(tmp_path / f"t__{label}__*")) for label in "abc"]
    text = prm_pilot.pilot_table(cells)
    assert "- a: shown (2 runs)" in text
    assert "- b: not shown (2 runs)" in text
    assert "- c: not shown (1 runs)" in text  # one seed is not enough
    assert "| b | 2 | 30 | 0.300 -> 0.290 (-0.010) | 3.00 -> 5.00 | no |" in text
