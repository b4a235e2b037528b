"""The fleet planner's settings for tests: a coarse curve grid (4 batch x 2 context points,
3 prompt sizes), so a plan takes well under a second; the integer programs are the same."""

from __future__ import annotations

from policies.fleetplan import CurveGrid, PlannerSettings

COARSE = PlannerSettings(
    grid=CurveGrid(
        batch_per_gpu=(1, 8, 32, 128),
        context_tokens=(1024, 8192),
        prefill_per_gpu=(64, 1024, 8192),
    )
)
"""Default settings but the coarse grid."""
