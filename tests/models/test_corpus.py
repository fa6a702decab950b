import inspect
import json

from gpucloud.models import corpus
from gpucloud.models.corpus import stdlib_text

SOURCE = b'''#!/usr/bin/env python
# a comment before the module docstring
"""Module docstring, long enough to keep."""

X = """an assigned string is not a docstring at all"""


class Thing:  # a comment
    r"""Class docstring with a raw \\n backslash."""

    def method(self,
               arg):
        """Method docstring:

        Dedented like inspect.cleandoc:
            an indented example
        """
        return """a returned string is not a docstring either"""
'''


def test_docstrings_are_found_and_other_strings_are_not():
    docs = list(corpus._docstrings(SOURCE))
    assert docs == [
        "Module docstring, long enough to keep.",
        "Class docstring with a raw \\n backslash.",
        "Method docstring:\n\nDedented like inspect.cleandoc:\n    an indented example",
    ]


def test_text_holds_real_stdlib_docstrings_and_is_deterministic():
    text = stdlib_text()
    assert 1_000_000 < len(text.encode()) < 20_000_000
    assert inspect.getdoc(json.dumps) in text
    assert inspect.getdoc(inspect.cleandoc) in text
    assert stdlib_text(50_000) == text[: len(stdlib_text(50_000))]


def test_max_bytes_caps_the_utf8_size():
    for cap in (0, 1, 100, 12_345):
        chunk = stdlib_text(cap)
        assert len(chunk.encode()) <= cap
    assert len(stdlib_text(12_345).encode()) > 10_000  # cut at a docstring, not far before
