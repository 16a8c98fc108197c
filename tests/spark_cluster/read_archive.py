"""``spark-submit read_archive.py OUTPUT``: the ids of every archived row per shard, and how many
rows carry their trace context as the test's events do, as one JSON line (the cluster tests' check)."""

from __future__ import annotations

import json
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_jobs.archive import read_archive

spark = SparkSession.builder.getOrCreate()
rows = read_archive(spark, sys.argv[1])
ids: dict[str, list[int]] = {}
for r in rows.select("shard", "id").collect():
    ids.setdefault(r["shard"], []).append(int(r["id"]))
# the test's events: every other one (odd "i") has a context derived from i
i = F.get_json_object("payload", "$.i").cast("long")
odd = i % 2 == 1
traced = rows.filter(
    odd
    & (F.col("traceparent") == F.format_string("00-%032x-%016x-01", i + 1, i + 1))
    & (F.col("tracestate") == F.concat(F.lit("qm=t"), i.cast("string")))
    & (F.col("baggage") == F.concat(F.lit("i="), i.cast("string")))
).count()
untraced_ok = rows.filter(~odd & F.col("traceparent").isNull() & F.col("baggage").isNull()).count()
expected = rows.filter(odd).count()
print(json.dumps({"ids": ids, "traced": traced + untraced_ok - rows.filter(~odd).count(), "traced_expected": expected}))
spark.stop()
