"""The estimators' docstrings: their Examples run as doctests, and their numpydoc Parameters and Attributes
sections name every constructor parameter (with its true default) and every fitted attribute."""

from __future__ import annotations

import ast
import doctest
import inspect
import re

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import policy.predictor
from policy.predictor import FailurePredictor

SECTIONS = ("Parameters", "Attributes", "See Also", "Notes", "Examples")
"""numpydoc sections every estimator documents, in this order."""

ONLY_WITH_NAMED_COLUMNS = {"feature_names_in_"}
"""Documented attributes that `fit` sets only for a DataFrame `X` with string column names."""

_ENTRY = re.compile(r"^([A-Za-z_]\w*) : (\S.*)$")


def _sections(cls: type) -> dict[str, str]:
    """The docstring's numpydoc sections (a title line underlined with dashes) by title, and "" for the summary
    and extended description before the first one."""
    lines = (inspect.getdoc(cls) or "").splitlines()
    starts = [i for i in range(len(lines) - 1) if lines[i] and lines[i + 1] == "-" * len(lines[i])]
    out = {"": "\n".join(lines[: starts[0] if starts else len(lines)])}
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        out[lines[i]] = "\n".join(lines[i + 2 : end])
    return out


def _entries(section: str) -> dict[str, str]:
    """`name : type` entries of a Parameters or Attributes section, in order: name -> type line."""
    return {m[1]: m[2] for line in section.splitlines() if (m := _ENTRY.match(line))}


def _fitted_attributes(est: FailurePredictor) -> set[str]:
    return {k for k in vars(est) if k.endswith("_") and not k.startswith("_")}


def _tiny_data(n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(n, 4))
    y = (X[:, 0] + rng.normal(scale=0.5, size=n) > 1.2).astype(int)
    return X, y


def test_docstring_examples_run() -> None:
    tests = [t for t in doctest.DocTestFinder().find(policy.predictor) if t.examples]
    assert "policy.predictor.FailurePredictor" in {t.name for t in tests}
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    # One thread: the example's fits take milliseconds, but OpenMP threads contending on a loaded CI box can
    # stretch them past a second; the results do not depend on the thread count.
    with threadpool_limits(limits=1):
        for test in tests:
            runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)
    assert results.attempted >= 5


@pytest.mark.parametrize("cls", [FailurePredictor])
def test_docstring_has_summary_and_numpydoc_sections_in_order(cls: type) -> None:
    sections = _sections(cls)
    head = sections[""].splitlines()
    assert head and head[0].endswith(".") and len(head) > 2 and head[1] == "" and head[2], "summary + description"
    titles = [t for t in sections if t]
    assert titles == list(SECTIONS)
    assert ">>> " in sections["Examples"]


@pytest.mark.parametrize("cls", [FailurePredictor])
def test_parameters_section_documents_every_init_parameter_with_its_default(cls: type) -> None:
    documented = _entries(_sections(cls)["Parameters"])
    signature = inspect.signature(cls.__init__)  # type: ignore[misc]
    params = {name: p.default for name, p in signature.parameters.items() if name != "self"}
    assert list(documented) == list(params), "Parameters must list every __init__ parameter, in signature order"
    for name, default in params.items():
        m = re.search(r"default=(.+)$", documented[name])
        assert m, f"{name}: no default= in {documented[name]!r}"
        assert ast.literal_eval(m[1]) == default, f"{name}: documented default {m[1]}, actual {default!r}"


def test_attributes_section_documents_every_fitted_attribute() -> None:
    documented = set(_entries(_sections(FailurePredictor)["Attributes"]))
    X, y = _tiny_data()
    # Both ways through `fit`: calibrated on the later rows, and the trees alone (calibration off).
    calibrated = FailurePredictor(max_iter=5).fit(X, y)
    uncalibrated = FailurePredictor(max_iter=5, calibration=None).fit(X, y)
    assert calibrated.calibrated_ and not uncalibrated.calibrated_
    for est in (calibrated, uncalibrated):
        fitted = _fitted_attributes(est)
        assert fitted - documented == set(), "fitted attributes missing from Attributes"
        # And nothing documented that fit no longer sets (stale docs).
        assert documented - ONLY_WITH_NAMED_COLUMNS - fitted == set(), "documented attributes fit does not set"
    # Nothing ending in `_` before fit: the fitted attributes are exactly what fit adds.
    assert _fitted_attributes(FailurePredictor()) == set()
