"""Presentation: the per-agent table and the card's cells."""

from __future__ import annotations

import math

import pytest

from mergekit_ram.core.statistics import AgentStats
from mergekit_ram.reporting import tables

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def test_format_table_columns_and_values():
    rows = [AgentStats("a", active=10, unique=4, numel=100, pair=3), AgentStats("b", active=5, unique=0, numel=100)]
    text = tables.format_table(rows, r=0.1, alpha=2.0, labels={"a": "agent-a"})
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["agent", "active"] and "lambda (r=0.1, alpha=2)" in lines[0]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["agent-a", "10", "10.00%", "40.0%", "30.0%", "30.0%", "1.5", "1.1500"]
    assert lines[3].split()[6:] == ["inf", "1.2000"]  # no unique entry: rho inf, lambda clipped at alpha


def test_soft_rule_label():
    text = tables.format_table([AgentStats("a", 2, 1, 4)], r=0.2, alpha=2.0, rule="soft")
    assert "lambda (soft, r=0.2)" in text


def test_format_number():
    assert tables.format_number(math.inf) == "inf" and tables.format_number(1.23456) == "1.235"


def test_a_label_is_escaped_in_a_markdown_cell():
    assert tables.cell("a|b") == "a\\|b"


def test_agent_rows_for_counted_given_and_uncounted_agents():
    report = {
        "agents": [
            {"label": "a", "density": 0.5, "unique_share": 0.25, "shared_with_1_share": 0.5,
             "shared_with_2plus_share": 0.25, "rho": 3.0, "rho_source": "counted", "lambda": 1.2},
            {"label": "b", "rho": "inf", "rho_source": "given", "lambda": None},
        ]
    }
    assert tables.agent_rows(report) == [
        ["a", "50.00%", "25.00%", "50.00%", "25.00%", "3", "1.2000"],
        ["b", "—", "—", "—", "—", "inf (given)", "—"],
    ]
