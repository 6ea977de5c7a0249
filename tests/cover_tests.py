"""A pytest plugin recording which lines of the project each test runs: `-p tests.cover_tests`
with STARPO_COVER_DIR=DIR (one coverage data file per xdist worker, one context per test).
`.ci/oldest_selection.py` reads them to choose the tests CI runs at the oldest pins. Needs the
`coverage` package, which the suite itself does not (a maintainer's tool, not a requirement)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("starpo", "envs", "launch", "configs")
_cov = None


def pytest_configure(config):
    global _cov
    import coverage

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _cov = coverage.Coverage(data_file=os.path.join(os.environ["STARPO_COVER_DIR"], f"cov.{worker}"),
                             source=[os.path.join(ROOT, s) for s in SOURCES])
    _cov.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _cov.switch_context(item.nodeid)
    yield
    _cov.switch_context("")


def pytest_unconfigure(config):
    _cov.stop()
    _cov.save()
