"""The Spark adapter: one place that builds the session.

``get_spark(settings)`` returns the process' session: ``local[2]`` unless ``settings.spark_master``
names another master, with few shuffle partitions in local mode, no UI, no console progress bar
and Spark's own logs turned down to errors. Spark never reads S3 itself here (there is no
hadoop-aws jar): every S3 access happens with boto3 inside Python tasks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from core.settings import Settings

LOG4J = Path(__file__).with_name("log4j2.properties")


def is_local(master: str) -> bool:
    return master.startswith("local")


def get_spark(settings: Settings, *, app_name: str = "hardelete-reconciler",
              shuffle_partitions: int | None = None,
              extra_conf: dict[str, str] | None = None) -> Any:
    """The (shared) SparkSession for these settings.

    Spark allows one active session per process; a second call returns the same session, so
    the test suite and the CLI share one JVM.
    """
    from pyspark.sql import SparkSession

    master = settings.spark_master or "local[2]"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if shuffle_partitions is None:
        shuffle_partitions = settings.spark_shuffle_partitions or (4 if is_local(master) else 200)
    java_opts = (f"-Dlog4j2.configurationFile=file:{LOG4J}" if LOG4J.exists() else "")
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.driver.extraJavaOptions", java_opts)
        .config("spark.python.worker.reuse", "true")
        # Tasks talk to S3 and Redis: a failed task is not retried blindly in local mode,
        # the run fails and deletes nothing (SPEC safety 6).
        .config("spark.task.maxFailures", "1" if is_local(master) else "4")
    )
    if is_local(master):
        builder = builder.config("spark.driver.memory", "2g")
    # On a cluster, nothing of the driver's filesystem is assumed on the executors (their log
    # configuration is the cluster's own); in local mode the executor is the driver's JVM.
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
