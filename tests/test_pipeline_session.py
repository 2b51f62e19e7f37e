"""The JVM that ``get_session`` starts says only what matters on stderr: Java's warning of the
incubating vector module, which Spark 4's launcher always adds, is dropped; the rest is passed on.
(The demo's test runs the whole job and finds no such line in its output.)"""

from __future__ import annotations

import io

import pytest

from stablewatch.pipeline import session


def test_the_jvm_warning_of_incubator_modules_is_dropped_the_rest_passed_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stderr = io.BytesIO(
        b"WARNING: Using incubator modules: jdk.incubator.vector\n"
        b"26/11/26 01:15:06 ERROR Executor: something that matters\n"
        b"WARNING: Using incubator modules: jdk.incubator.vector, jdk.incubator.foreign\n"
        b"no newline at the end"
    )
    session._pass_on(stderr)
    assert capsys.readouterr().err == (
        "26/11/26 01:15:06 ERROR Executor: something that matters\n"
        "WARNING: Using incubator modules: jdk.incubator.vector, jdk.incubator.foreign\n"  # not the known line
        "no newline at the end"
    )
