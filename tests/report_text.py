"""A pytest hook the suite's conftest installs: a report goes to xdist's controller as UTF-8,
which cannot hold a lone surrogate. A test of hostile file names (one holding "\\ud800") whose
captured log or failure named such a file ended the whole run with an INTERNALERROR; the report
shows such characters escaped instead."""
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every report's captured sections, and a failure's text, as UTF-8 can carry them."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(title, utf8_text(text)) for title, text in report.sections]
    if report.longrepr is not None and utf8_text(str(report.longrepr)) != str(report.longrepr):
        report.longrepr = utf8_text(str(report.longrepr))


def utf8_text(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
