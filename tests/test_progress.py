"""Progress lines: planning that takes a while says when it starts and when it ends, on stderr unless logging is
configured, and follows the logging configuration when it is."""

import logging
import subprocess
import sys

import torch

import sublinear
import sublinear.progress as progress

from conftest import PLAIN, ResidualNet


def test_planning_past_the_threshold_says_when_it_starts_and_ends(monkeypatch, caplog):
    monkeypatch.setattr(progress, "PROGRESS_AFTER_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="sublinear.progress"):
        compiled = sublinear.compile(ResidualNet(), config=PLAIN)
        compiled(torch.randn(2, 3, 8, 8)).sum().backward()
        compiled(torch.randn(2, 3, 8, 8)).sum().backward()  # nothing planned: nothing said
    lines = [r.getMessage() for r in caplog.records if r.name == "sublinear.progress"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("sublinear: planning ResidualNet")
    assert lines[1].startswith("sublinear: planned ResidualNet in ") and "1 graph(s)" in lines[1] \
        and "blocks: predicted peak" in lines[1] and "step time x" in lines[1]


def test_short_planning_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="sublinear.progress"):
        work = progress.PlanningProgress("a model")
        work.begin()
        work.end(lambda: "done")
    assert not [r for r in caplog.records if r.name == "sublinear.progress"]


_SCRIPT = """
import logging, sys, time
import sublinear.progress as progress
if sys.argv[1] == "configured":
    logging.basicConfig()  # WARNING and above: progress lines are INFO
progress.PROGRESS_AFTER_SECONDS = 0.0
work = progress.PlanningProgress("Net")
work.begin()
time.sleep(0.2)
work.end(lambda: "1 graph(s), 3 blocks")
"""


def test_lines_go_to_stderr_unless_logging_is_configured():
    def stderr(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True,
                              timeout=60).stderr

    quiet = stderr("unconfigured").splitlines()
    assert quiet[0].startswith("sublinear: planning Net") and quiet[1].startswith("sublinear: planned Net in")
    assert stderr("configured") == ""
