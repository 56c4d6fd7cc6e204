"""How often to save: the interval that loses the least to saves and failures, and what any interval loses.

First-order model (J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974;
J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006, whose
first-order term is the same): with saves every ``tau`` seconds of training that each stop training ``C`` seconds,
and failures every ``M`` seconds on average, each failure redoes half an interval on average and costs a restart
``R``, so the share of wall time lost is ``C / tau + (tau / 2 + R) / M``, least at ``tau = sqrt(2 C M)``. Valid while
``tau`` and ``C`` are well below ``M`` (hours against days: a pretraining's case).

tr11's figures (its chronicles: a save takes 40 s, an iteration 105 s; about one hardware failure a week) give
``sqrt(2 * 40 * 604800) = 6956`` s, 66 iterations, against the 300 and then 200 it used.
"""

from __future__ import annotations

import math


def optimal_save_interval(save_s: float, mtbf_s: float) -> float:
    """Young/Daly's interval in seconds of training between saves: ``sqrt(2 C M)``.

    Args:
        save_s: seconds a save stops training (``C``), > 0.
        mtbf_s: mean seconds between failures (``M``), > 0.

    Raises:
        ValueError: a non-positive ``save_s`` or ``mtbf_s``.
    """
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"save cost {save_s} s and mean time between failures {mtbf_s} s must be > 0")
    return math.sqrt(2 * save_s * mtbf_s)


def lost_fraction(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The share of wall time lost to saves and failures at a save every ``interval_s`` seconds of training:
    ``C / tau + (tau / 2 + R) / M`` (module docstring). 0.0115 is 1.15%.

    Raises:
        ValueError: a non-positive ``interval_s`` or ``mtbf_s``.
    """
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"interval {interval_s} s and mean time between failures {mtbf_s} s must be > 0")
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


PREFLIGHT_MARGIN = 0.2
"""The pre-flight's default: a node whose GEMM is slower than the nodes' median by more than this share, measured
twice, is kept out (``slurm.preflight_margin``, ``opskit preflight --margin``)."""
