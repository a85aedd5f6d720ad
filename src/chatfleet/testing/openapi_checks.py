"""Every schemathesis check, positive and negative, over a served OpenAPI document: the failures as
lines (test helper; schemathesis, hypothesis and requests come with the test extras)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def schemathesis_failures(url: str, examples: int, timeout: float,
                          exclude: Callable[[Any], list[Any]] | None = None) -> list[str]:
    """Run each operation of ``url``/openapi.json with ``examples`` derandomized cases per generation
    mode, each response through every check; ``exclude(response)`` names checks to skip for one
    response (a refusal of a rule no schema can state). Returns one line per failed case."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures: list[str] = []
    session = requests.Session()

    def check(op: Any, mode: GenerationMode) -> None:
        @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            try:
                response = case.call(base_url=url, session=session, timeout=timeout)
                case.validate_response(response, excluded_checks=exclude(response) if exclude else [])
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - a failure group: every failed check
                body = repr(getattr(case, "body", None))[:400]
                failures.append(f"{op.method.upper()} {op.path} {mode.name}: {str(exc)[:700]}\n  body: {body}")

        try:
            run()
        except Unsatisfiable:  # nothing to vary in an operation without parameters
            pass

    for op in _operations(schema):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            check(op, mode)
    return failures


def operation_paths(url: str) -> set[str]:
    """The paths ``url``/openapi.json documents."""
    import schemathesis

    return {op.path for op in _operations(schemathesis.openapi.from_url(url + "/openapi.json"))}


def _operations(schema: Any) -> list[Any]:
    """Every operation of ``schema``; one schemathesis cannot read fails the caller."""
    out = []
    for result in schema.get_all_operations():
        ok = getattr(result, "ok", None)
        if ok is None:
            raise AssertionError(f"an operation of the document cannot be read: {result.err()}")
        out.append(ok())
    return out
