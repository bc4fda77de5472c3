"""quiet_harmless_logs: the four harmless library messages stay out of the console, every other warning shows.

Each message is taken from the installed library's own source (so a reworded message fails here rather than
reaching the console again) and logged on the logger that library uses.
"""

import importlib
import importlib.util
import logging

import pytest

from benchmark.checks import budget

SCRIPTS = tuple(f"{name}.py" for name in budget.BUDGET)  # every script, named once in benchmark/checks/budget.py

# (logger = module name, a line of the message in that module's source, the message as it is logged)
HARMLESS = [
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        '"%s: Failed to load weights"',
        "RotaryEmbedding: Failed to load weights",
    ),
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        '"%s: Failed to load weights"',
        "Llama3RotaryEmbedding: Failed to load weights",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        '"`torch.set_num_threads` after the thread binding, skip it."',
        "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
    ),
    ("vllm.v1.worker.cpu_worker", '"%s is not found in LD_PRELOAD. "', "libiomp is not found in LD_PRELOAD. For best"),
    ("vllm.v1.worker.cpu_worker", '"%s is not found in LD_PRELOAD. "', "libtcmalloc is not found in LD_PRELOAD. See"),
    (
        "accelerate.utils.other",
        'f"Removed shared tensor {warn_names} while saving.',
        "Removed shared tensor {'lm_head.weight'} while saving. This should be OK",
    ),
]


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def source(module):
    with open(importlib.util.find_spec(module).origin) as f:
        return f.read()


@pytest.fixture
def loggers():
    """The three loggers with a collecting handler and no filters, restored afterwards."""
    names = sorted({name for name, _, _ in HARMLESS})
    collect, saved = Collect(), {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = (logger.filters[:], logger.disabled, logger.level)
        logger.filters, logger.disabled = [], False
        logger.setLevel(logging.WARNING)
        logger.addHandler(collect)
    yield collect
    for name in names:
        logger = logging.getLogger(name)
        logger.removeHandler(collect)
        logger.filters, logger.disabled, logger.level = saved[name]


@pytest.mark.parametrize("name, line, text", HARMLESS)
def test_the_silenced_messages_are_the_libraries_own(name, line, text):
    assert line in source(name), f"{name} no longer logs {line!r}: update quiet_harmless_logs in every script"


@pytest.mark.parametrize("script", SCRIPTS)
def test_harmless_messages_are_silenced_and_real_warnings_are_not(script, loggers):
    module = importlib.import_module(script.removesuffix(".py"))
    for name, _, text in HARMLESS:  # before: every message reaches the handler
        logging.getLogger(name).warning(text)
    assert len(loggers.messages) == len(HARMLESS)
    loggers.messages.clear()
    module._quiet_harmless_logs()
    for name, _, text in HARMLESS:
        logging.getLogger(name).warning(text)
    assert loggers.messages == []
    real = [
        ("vllm.model_executor.model_loader.reload.layerwise", "QKVParallelLinear: Failed to load weights"),
        ("vllm.v1.worker.cpu_worker", "libiomp5 could not bind threads"),
        ("accelerate.utils.other", "Removed shared tensor {'model.embed_tokens.weight'} while saving"),
    ]
    for name, text in real:
        logging.getLogger(name).warning(text)
    assert loggers.messages == [text for _, text in real]
