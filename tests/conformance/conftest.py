"""Prints the coverage each sweep test records, at the end of the run.

The tests record it with ``record_property("coverage", text)``: a property
travels back from pytest-xdist's workers, where a print would be lost.
"""


def pytest_terminal_summary(terminalreporter):
    texts = [
        value
        for key in ("passed", "failed")
        for report in terminalreporter.stats.get(key, [])
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", [])
        if name == "coverage"
    ]
    if texts:
        terminalreporter.section("conformance sweep coverage")
        for text in sorted(texts):
            terminalreporter.write_line(text)
