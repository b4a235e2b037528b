"""PuLP front end for the MILP solvers: HiGHS (highspy) by default, CBC as fallback.

PuLP's HiGHS adapter does not pass a starting solution to HiGHS nor expose its proven
bound, so :class:`_WarmHiGHS` hands HiGHS the variables' initial values before the run
and reads ``mip_dual_bound`` after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pulp

from policies.errors import SolverError


@dataclass(frozen=True)
class MilpOutcome:
    """Result of one MILP solve.

    Attributes:
        status: ``optimal`` | ``time_limit`` | ``infeasible`` | other solver status text.
        objective: objective of the incumbent, or inf when none.
        bound: proven lower bound on the objective (equals objective when optimal).
        solver: ``HiGHS`` or ``CBC``.
    """

    status: str
    objective: float
    bound: float
    solver: str


_BANNER_SILENCED = [False]


def _silence_highs_banner() -> None:
    """HiGHS prints a banner to the C-level stdout the first time a solver object is made
    in a process, which would corrupt ``-o json`` output; make that first object with
    file descriptor 1 pointed at /dev/null."""
    if _BANNER_SILENCED[0]:
        return
    import os
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()  # type: ignore[no-untyped-call]
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    _BANNER_SILENCED[0] = True


class _WarmHiGHS(pulp.HiGHS):  # type: ignore[misc]
    """HiGHS through highspy with a warm start and the proven bound read back."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dual_bound = -math.inf
        self.model_status = ""

    def callSolver(self, lp: Any) -> None:  # noqa: N802 - PuLP's name
        model = lp.solverModel
        # A partial start (the integer columns): HiGHS completes the continuous columns
        # with an LP and keeps the result as its first incumbent when feasible.
        given = [
            (i, float(v.varValue)) for i, v in enumerate(lp.variables()) if v.varValue is not None
        ]
        if given:
            import numpy as np

            idx = np.array([i for i, _ in given], dtype=np.int32)
            val = np.array([x for _, x in given], dtype=np.float64)
            model.setSolution(len(given), idx, val)
        model.run()
        info = model.getInfo()
        self.model_status = model.modelStatusToString(model.getModelStatus())
        self.dual_bound = float(info.mip_dual_bound)


def solve_milp(
    prob: pulp.LpProblem,
    *,
    solver: str,
    time_limit_s: float,
    mip_gap: float,
    warm: bool,
    relax: bool = False,
) -> MilpOutcome:
    """Solve ``prob`` (a minimisation) and report status, objective and bound; with
    ``relax`` solve its LP relaxation (integrality dropped), whose optimum bounds the MILP.

    Raises:
        SolverError: the solver could not run.
    """
    use_highs = solver == "highs" and pulp.HiGHS().available()
    if use_highs:
        _silence_highs_banner()
        s = _WarmHiGHS(mip=not relax, msg=False, timeLimit=time_limit_s, gapRel=mip_gap, threads=1)
        prob.solve(s)
        status = s.model_status.lower()
        status = "optimal" if status == "optimal" else "time_limit" if "time" in status else status
        obj = pulp.value(prob.objective)
        objective = float(obj) if obj is not None else math.inf
        bound = s.dual_bound
        if status == "optimal" and not math.isfinite(bound):
            bound = objective
        if not math.isfinite(bound):  # pure LP: the dual bound is the objective
            bound = objective if status == "optimal" else -math.inf
        return MilpOutcome(status, objective, bound, "HiGHS")
    try:
        cbc = pulp.PULP_CBC_CMD(
            mip=not relax, msg=False, timeLimit=time_limit_s, gapRel=mip_gap, warmStart=warm
        )
        prob.solve(cbc)
    except pulp.PulpSolverError as exc:  # pragma: no cover - depends on the install
        raise SolverError(f"CBC failed: {exc}") from exc
    status = pulp.LpStatus[prob.status].lower()
    obj = pulp.value(prob.objective)
    objective = float(obj) if obj is not None else math.inf
    # CBC through PuLP does not report its bound; only an optimal status proves one.
    bound = objective if status == "optimal" else -math.inf
    return MilpOutcome(status, objective, bound, "CBC")
