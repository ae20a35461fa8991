"""Spark sources fed by Python tasks: a small list of work items (prefixes, manifest keys,
files) is spread over partitions, and each task turns its items into Arrow record batches
(``mapInArrow``), so rows cross from Python to the JVM in columnar batches and nothing is
collected on the driver."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

BATCH_ROWS = 50_000


def batches_of(rows: Iterable[tuple[Any, ...]], names: Sequence[str], schema: Any,
               size: int = BATCH_ROWS) -> Iterator[Any]:
    """Group row tuples into ``pyarrow.RecordBatch`` es of ``schema``."""
    import pyarrow as pa

    cols: list[list[Any]] = [[] for _ in names]
    for row in rows:
        for i, v in enumerate(row):
            cols[i].append(v)
        if len(cols[0]) >= size:
            yield pa.RecordBatch.from_arrays([pa.array(c, type=schema.field(n).type)
                                              for c, n in zip(cols, names, strict=True)],
                                             schema=schema)
            cols = [[] for _ in names]
    if cols[0]:
        yield pa.RecordBatch.from_arrays([pa.array(c, type=schema.field(n).type)
                                          for c, n in zip(cols, names, strict=True)],
                                         schema=schema)


def arrow_schema(ddl: str) -> Any:
    """'key string, size long' -> a pyarrow schema (the few types used here)."""
    import pyarrow as pa

    types = {"string": pa.string(), "long": pa.int64(), "boolean": pa.bool_(),
             "int": pa.int32()}
    fields = []
    for part in ddl.split(","):
        name, typ = part.split()
        fields.append(pa.field(name, types[typ]))
    return pa.schema(fields)


def distributed(spark: Any, items: Sequence[tuple[Any, ...]], item_ddl: str,
                produce: Callable[[dict[str, Any]], Iterable[tuple[Any, ...]]],
                out_ddl: str, partitions: int | None = None) -> Any:
    """A DataFrame of ``out_ddl`` rows produced, inside tasks, from each work item.

    ``produce(item_as_dict)`` runs in a Python worker and yields row tuples; any exception
    fails the Spark job (and so the run). (``mapInArrow`` would move rows in columnar batches,
    but PySpark requires pandas for it, which this project does not install.)
    """
    names = [part.split()[0] for part in item_ddl.split(",")]
    n = partitions or max(1, min(len(items), 256))
    if not items:
        return spark.createDataFrame([], out_ddl)

    def run(it: Iterator[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
        for item in it:
            yield from produce(dict(zip(names, item, strict=True)))

    rdd = spark.sparkContext.parallelize(list(items), n).mapPartitions(run)
    return spark.createDataFrame(rdd, out_ddl, verifySchema=False)
