"""Schemathesis hooks for fuzzing the control plane (loaded through SCHEMATHESIS_HOOKS).

`GET /jobs/{id}/logs?follow=true` streams a job's output until the job ends, by design; the
fuzz server's jobs never start (its node is cordoned), so such a request would only end at
the fuzzer's timeout. The fuzzer asks for the logs as they are instead.
"""

from __future__ import annotations

import schemathesis

_TRUE = {"true", "1", "on", "yes", "t", "y"}  # what a bool query parameter reads as true


@schemathesis.hook
def map_case(context, case):
    query = case.query if isinstance(case.query, dict) else {}
    if case.path.endswith("/logs") and str(query.get("follow")).lower() in _TRUE:
        query["follow"] = "false"
    return case
