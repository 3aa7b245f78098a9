"""The suite's pytest plugin (entry point `pytest11`): the --fd-platform option and a result table for `fd check`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fd", "fd-backends conformance suite")
    group.addoption("--fd-platform", default=None, help="platform the generic conformance module checks (fd check)")
    group.addoption(
        "--fd-model", default=None, help="architecture the model conformance module checks (fd check --model)"
    )


@dataclass
class Row:
    check: str
    outcome: str
    detail: str = ""


@dataclass
class ResultTable:
    """Collects one row per check: passed, skipped with its reason, or failed with its message."""

    rows: list[Row] = field(default_factory=list)
    # Set by `fd check`'s signal handlers. The interrupt they raise can be caught on its way out (Paddle
    # re-raises what interrupts a dy2static program as a SystemError), so the session stops on the flag.
    interrupted: str | None = None
    session: Any = None

    @pytest.hookimpl
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    @pytest.hookimpl
    def pytest_runtest_logfinish(self) -> None:
        if self.interrupted and self.session is not None:
            self.session.shouldstop = f"interrupted by {self.interrupted}"

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.split("::", 1)[-1]
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.rows.append(Row(name, "skipped", reason.removeprefix("Skipped: ")))
            elif report.failed:
                self.rows.append(Row(name, "failed", _first_line(report)))
            else:
                # A check may report what it measured (record_property("figures", ...)): shown beside its pass.
                self.rows.append(Row(name, "passed", str(dict(report.user_properties).get("figures", ""))))

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.rows.append(Row(f"collecting {report.nodeid or 'the suite'}", "failed", _first_line(report)))

    def counts(self) -> dict[str, int]:
        return {o: sum(r.outcome == o for r in self.rows) for o in ("passed", "skipped", "failed")}


def _first_line(report: pytest.TestReport | pytest.CollectReport) -> str:
    crash: Any = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    return message.strip().splitlines()[0] if message.strip() else "failed"
