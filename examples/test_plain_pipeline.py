"""examples/plain_pipeline.py: every schedule trains an nn.Sequential like one process."""

from __future__ import annotations

import titan_pipeline as tp
from titan_testing import run_distributed


def test_every_schedule_trains_like_one_process_with_adamw_on_2_ranks(example):
    plain_pipeline = example("plain_pipeline")
    schedules = sorted(tp.SCHEDULES)
    # the example's own entry point after init_process_group, on 2 gloo ranks
    reports = run_distributed(plain_pipeline.compare, 2, schedules, 3, timeout=300)
    assert reports[0] == reports[1]  # every rank reports the same numbers
    for name in schedules:
        r = reports[0][name]
        assert r["same_losses_on_every_rank"], name  # broadcast_losses=True
        # fp32 sums in another order (microbatches, stage boundaries): equal to rounding
        assert r["max_loss_diff"] < 1e-6, (name, r)
        assert r["max_weight_diff"] < 1e-6, (name, r)
        assert r["losses"][-1] < r["losses"][0], (name, r["losses"])
