"""Run the examples in the compression package's docstrings."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "fedagg.compression.base",
    "fedagg.compression.codec",
    "fedagg.compression.error_feedback",
    "fedagg.compression.payload",
    "fedagg.compression.quantize",
    "fedagg.compression.spec",
    "fedagg.compression.support",
    "fedagg.compression.topk",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
