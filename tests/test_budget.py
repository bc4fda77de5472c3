"""benchmark/budget.py (python -m benchmark.budget): its counts against the modules themselves, and the fence on a
small file whose numbers are known."""

import dataclasses
import importlib
import inspect
import os

from conftest import REPO_ROOT

from benchmark import budget


def test_counts_match_the_imported_scripts():
    rows, shared = budget.report()
    assert set(rows) == set(budget.BUDGET)
    for name, row in rows.items():
        module = importlib.import_module(name)
        with open(os.path.join(REPO_ROOT, f"{name}.py")) as f:
            lines = f.read().splitlines()
        assert row["total"] == len(lines) and row["above"] + row["below"] == row["total"]
        assert lines[row["above"]] == "# " + "=" * 117 and lines[row["above"] + 1] == budget.FENCE
        assert row["main"] == len(inspect.getsourcelines(module.main)[0])
        assert row["args_fields"] == len(dataclasses.fields(module.Args))
        assert row["args_fields"] + row["run_args_fields"] == len(dataclasses.fields(module.Config))
        assert all(hasattr(module, definition) for definition in shared)
    assert not set(shared) & set(budget.SCRIPT_OWN) and "Sampler" not in shared  # async_rlhf has its own generator


def test_a_small_file(tmp_path):
    source = [
        "from dataclasses import dataclass",
        "",
        "@dataclass",
        "class Args:",
        "    lr: float = 1.0",
        '    """the learning rate"""',
        "",
        "def main(args):",
        "    return args.lr",
        "",
        "# " + "=" * 117,
        budget.FENCE,
        "# " + "=" * 117,
        "",
        "@dataclass",
        "class RunArgs:",
        "    seed: int = 1",
        "    output_dir: str = 'runs'",
    ]
    (tmp_path / "a.py").write_text("\n".join(source) + "\n")
    row = budget.measure(str(tmp_path / "a.py"))
    assert (row["total"], row["above"], row["below"], row["main"]) == (18, 10, 8, 2)
    assert (row["args_fields"], row["run_args_fields"]) == (1, 2)
    assert row["definitions"] == {"Args": 4, "main": 2, "RunArgs": 4}
