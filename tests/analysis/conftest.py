"""One local SparkSession for the whole analysis suite (a session takes seconds to start)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# Spark's Python workers must run this interpreter (the project's .venv).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
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
    session.stop()
