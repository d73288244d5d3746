"""A pytest plugin for the GPU check: each failure's traceback printed as it happens, so that a
part stopped at its time limit still shows why the tests that failed before the stop failed
(pytest prints the tracebacks only at the end of a run).

    python -m pytest -p pytest_failures_now ...   # with tools/ on PYTHONPATH
"""

import pytest


@pytest.hookimpl(trylast=True)  # after the terminal's outcome word, on the test's own line
def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n----- {report.nodeid} failed ({report.when}) -----\n"
              f"{report.longreprtext[-4000:]}\n----- end -----", flush=True)
