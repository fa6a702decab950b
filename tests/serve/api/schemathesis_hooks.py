"""Schemathesis hooks for fuzzing `gpucloud serve` (loaded through SCHEMATHESIS_HOOKS).

A random `model` name is answered 404 before anything else is looked at; naming the served
model lets the generated requests reach validation, the engine and the response code.
"""

from __future__ import annotations

import schemathesis

MODEL = "tiny"


@schemathesis.hook
def map_case(context, case):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    return case
