"""`mergekit_ram.core.formulas`: rho (Eq. 2) and lambda (Eq. 6, RAM+s) on plain numbers, against the equations."""

import math

import pytest

from mergekit_ram.core import formulas

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


@pytest.mark.parametrize(
    ("shared", "unique", "expected"),
    [(0, 5, 0.0), (10, 5, 2.0), (3, 4, 0.75), (7, 0, math.inf), (0, 0, math.inf)],
)
def test_rho_is_shared_over_unique(shared, unique, expected):
    assert formulas.rho(shared, unique) == expected


@pytest.mark.parametrize(
    ("rho", "r", "alpha", "expected"),
    [
        (0.5, 0.1, 2.0, 1.05),  # inside the clip
        (9.85, 0.1, 2.0, 1.2),  # clipped at alpha: the example's code agent
        (math.inf, 0.1, 2.0, 1.2),  # no unique entry: clipped, and it multiplies nothing
        (-1.0, 0.1, 2.0, 1.0),  # clipped at 0
        (3.0, 0.0, 2.0, 1.0),  # r = 0 is plain RAM
        (math.inf, 0.0, 2.0, 1.0),  # r = 0 never meets inf * 0
    ],
)
def test_lambda_clip_is_eq6(rho, r, alpha, expected):
    assert formulas.lambda_clip(rho, r, alpha) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(("rho", "expected"), [(0.0, 1.0), (1.0, 1.05), (3.0, 1.075), (math.inf, 1.1), (-2.0, 1.0)])
def test_lambda_soft_is_rams(rho, expected):
    """RAM+s: 1 + r * rho / (1 + rho), approaching 1 + r and never above it."""
    assert formulas.lambda_soft(rho, 0.1) == pytest.approx(expected, abs=1e-15)
    assert formulas.lambda_soft(rho, 0.1) <= 1.1


def test_formulas_need_no_torch():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(formulas.__file__).read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "math"}, imported
