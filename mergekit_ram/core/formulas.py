"""RAM+'s scalar formulas on plain numbers (no torch): rho (Eq. 2) and lambda (Eq. 6, RAM+s).

`statistics` reduces counts with them and `kernel` offers them beside the tensor math.
"""

from __future__ import annotations

import math


def rho(shared: float, unique: float) -> float:
    """Eq. 2: shared / unique entries of one agent; +inf when it has no unique entry."""
    return shared / unique if unique else math.inf


def lambda_clip(rho_t: float, r: float, alpha: float) -> float:
    """Eq. 6: lambda = 1 + r * clip(rho, 0, alpha). r = 0 is plain RAM."""
    if r == 0:
        return 1.0
    return 1.0 + r * min(max(rho_t, 0.0), alpha)


def lambda_soft(rho_t: float, r: float) -> float:
    """RAM+s (App. E, Eq. 8-9): lambda = 1 + r * rho / (1 + rho), below 1 + r."""
    share = 1.0 if math.isinf(rho_t) else max(rho_t, 0.0) / (1.0 + max(rho_t, 0.0))
    return 1.0 + r * share
