"""One local SparkSession for the whole analysis suite (a session takes seconds to start)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# Spark's Python workers must run this interpreter (the project's .venv).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable


@pytest.fixture(scope="package")
def spark() -> Iterator[object]:
    """A local[2] session for the tests of this package; its JVM is stopped
    after them (an idle one took a sixth of a core through the rest of CI)."""
    from pyspark.sql import SparkSession

    from analysis.source import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("drgate-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    session.stop()
    if gateway is not None:
        gateway.shutdown()
        proc = getattr(gateway, "proc", None)
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
            if proc.stdin is not None:  # the pipe the JVM watched
                proc.stdin.close()
        SparkContext._gateway = None
        SparkContext._jvm = None
