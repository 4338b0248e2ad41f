"""``pacmpi bench masks``: identical masks under non-IID data, and every injected fault caught
in the step it makes masks differ, on every rank, with nothing summed wrongly."""
import json
from pathlib import Path

import pytest

from pacmpi.experiments.bench_masks import (
    FAULTS,
    BenchConfig,
    caught_in_step,
    class_groups,
    injection_step,
    linear_milestones,
)

from mpi_util import SHARED_TIMEOUT, run_scenarios, shared_workdir

SCENARIOS = "bench_masks_scenarios.py"


def test_class_groups_are_disjoint_blocks_covering_every_class():
    assert class_groups(4) == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
    assert class_groups(2) == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]
    with pytest.raises(ValueError, match="11 ranks"):
        class_groups(11)


def test_linear_milestones_reach_the_final_ratio_at_the_last_reprune():
    milestones = linear_milestones(60, 5, 0.8)
    assert [s for s, _ in milestones] == list(range(5, 60, 5))
    assert milestones[-1][1] == pytest.approx(0.8)
    assert all(a[1] < b[1] for a, b in zip(milestones, milestones[1:]))
    assert injection_step(BenchConfig(steps=60, prune_every=5), 60) == 20


@pytest.mark.parametrize("kwargs, bad", [({"prune_every": 0}, "prune_every"),
                                         ({"final_ratio": 1.0}, "final_ratio"),
                                         ({"inject_step": 7, "prune_every": 5}, "inject_step")])
def test_config_names_the_bad_value(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        BenchConfig(**kwargs)


def _row(step, disagree=0, raised=(), resyncs=0):
    return {"step": step, "mask_disagree": disagree, "raised": list(raised), "resyncs": resyncs}


def test_caught_in_step_rejects_late_partial_and_spurious_detections():
    assert caught_in_step([_row(0), _row(1, 1, [0, 1])], 2, "raise")
    assert not caught_in_step([_row(0, 1), _row(1, 1, [0, 1])], 2, "raise")  # one step late
    assert not caught_in_step([_row(0, 1, [1])], 2, "raise")                  # not every rank
    assert not caught_in_step([_row(0, 0, [0, 1])], 2, "raise")               # nothing differed
    assert caught_in_step([_row(0), _row(1, 1, resyncs=1)], 2, "resync")
    assert not caught_in_step([_row(0, 1)], 2, "resync")
    assert not caught_in_step([_row(0, 0, resyncs=1)], 2, "resync")


@pytest.mark.mpi
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks", [2, 4])
def test_short_run_masks_agree_and_every_fault_is_caught_in_its_step(ranks):
    run_scenarios(SCENARIOS, ranks).check("test_short_run")
    report = json.loads((Path(shared_workdir()) / f"bench_masks_{ranks}.json").read_text())
    assert report["all_checks_held"]

    clean = report["baseline"]["summary"]
    assert clean["steps_run"] == 32
    assert clean["mask_disagreement_steps"] == clean["weight_disagreement_steps"] == 0
    assert clean["resyncs"] == 0 and clean["detected_steps"] == []
    assert clean["final_density"] == pytest.approx(0.2, abs=1e-3)
    assert clean["dense_steps"] == 7  # one fallback per re-prune, then packed again

    rows = {(r["fault"], r["on_mismatch"], r["control"]): r for r in report["fault_table"]}
    assert len(rows) == 3 * len(FAULTS)
    last, every = ranks - 1, list(range(ranks))
    for fault in FAULTS:
        control = rows[fault, "raise", True]
        assert control["first_weight_disagreement"] is None
        assert control["first_mask_disagreement"] is control["detection_step"] is None
        assert control["resyncs"] == 0
        for policy in ("raise", "resync"):
            row = rows[fault, policy, False]
            assert row["checks_held"], row
            assert row["detection_step"] == row["first_mask_disagreement"], row
            if row["detection_step"] is None:
                continue
            if policy == "raise":
                assert row["ranks_raised"] == every and row["offending_ranks"] == [last], row
            else:
                assert row["resync_steps"][0] == row["detection_step"], row

    for policy in ("raise", "resync"):
        tie, lr, order = (rows[f, policy, False] for f in FAULTS)
        # The nudged weight is one ULP off in the injection step, which is caught at once.
        assert tie["first_weight_disagreement"] == tie["detection_step"] == tie["inject_step"]
        # The optimizer step of the step before a re-prune: weights differ after it, and the
        # re-prune's masks differ and are caught in that step.
        assert lr["first_weight_disagreement"] == lr["detection_step"] == lr["inject_step"] + 1
        if ranks == 2:
            # a + b == b + a: reversing two partial sums changes nothing.
            assert order["first_weight_disagreement"] is None
        else:
            assert order["first_weight_disagreement"] == order["inject_step"] + 1
