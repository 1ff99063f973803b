import logging
import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_quiet() -> None:
    # Several test processes share 2 cores; one thread each keeps timings sane.
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _own_start_up_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs (and the processes tests start, which inherit the environment) measure afresh and never write to the
    # user's ~/.cache: each test has a start-up cache folder of its own.
    monkeypatch.setenv("LIGHTNING_NASPIPE_CACHE", str(tmp_path_factory.mktemp("naspipe_cache")))


# -- test kinds ----------------------------------------------------------------------------------------------------
# Every test module's kind (tests/README.md explains them and which to run when). A test that differs from its
# module says so with an explicit kind marker (e.g. @pytest.mark.multiprocess), which wins over the map.
#   unit          pure Python / torch: no Trainer fit and no engine run (short helper processes allowed)
#   inprocess     a Lightning Trainer or the engine runs in this process (stages as threads included)
#   multiprocess  starts stage processes (gloo); always also marked slow
#   scenario      plain Trainer against NASPipe on a user's habits: usage scenarios, recipes, examples, CLI
KINDS = ("unit", "inprocess", "multiprocess", "scenario")
_UNIT = """actions affinity arguments auto_layout block_cost block_timing constraints distillation docs elastic_blocks
    export failures fingerprint forked freezing grad_norm host_rng init latency layers layout lookahead optim partition
    placement planner private_apis processes profile_cache replicas residency sampling schedule schedule_rules
    schedule_ties search_plot searchers space_spec stage_table stalls supernet swapping verify_report weight_grads
    wire kinds benchmarks_index streamed links bounds timing latency_spaces replica_update table_passes malloc"""
_INPROCESS = """batch_hooks boundary callback cells checkpoint_io clipping compat data elastic engine finders loop_state
    loss_log loss_state microbatch mixin namespaces offload progress replicas_engine search startup step_sampling
    stepping strategy telemetry ties elastic_transformer eval_shards"""
_MULTIPROCESS = "distributed pipeline pipeline_cells replicas_stages ties_stages transport"
_SCENARIO = "cli examples recipes_stages usage usage_stages verify"
KIND_OF_MODULE = {f"test_{name}": kind for kind, names in zip(KINDS, (_UNIT, _INPROCESS, _MULTIPROCESS, _SCENARIO))
                  for name in names.split()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    fast_processes = []
    for item in items:
        kinds = [kind for kind in KINDS if item.get_closest_marker(kind) is not None]
        if not kinds:
            if item.path.stem not in KIND_OF_MODULE:
                continue  # test_kinds.py names it
            kinds = [KIND_OF_MODULE[item.path.stem]]
            item.add_marker(kinds[0])
        if "multiprocess" in kinds and item.get_closest_marker("slow") is None:
            fast_processes.append(item.nodeid)
    # Refused at collection, so that `-m "not slow"` never starts stage processes.
    if fast_processes:
        raise pytest.UsageError(f"multiprocess tests must also be marked slow: {fast_processes}")
