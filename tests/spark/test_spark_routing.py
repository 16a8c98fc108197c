"""Spark SQL routing (spark_jobs.routing) must reproduce the Python reference and the vectors exactly."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed: run `make setup`")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from queue_manager.domain import routing
from queue_manager.domain.topology import KeyRange
from queue_manager.errors import ConfigurationError, TopologyError
from spark_jobs import routing as sr
from spark_jobs import session as ss

pytestmark = pytest.mark.spark

VECTORS_PATH = Path(__file__).resolve().parents[1] / "vectors" / "routing_vectors.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
SHAPES: list[tuple[int, int]] = [(n, k) for n, k in VECTORS["shapes"]]
VECTOR_TENANTS: list[str] = [v["tenant"] for v in VECTORS["vectors"]]
BY_TENANT: dict[str, dict[str, Any]] = {v["tenant"]: v for v in VECTORS["vectors"]}
# generated tenants: ASCII, non-ASCII (2-, 3- and 4-byte UTF-8) and awkward characters
GENERATED_TENANTS: list[str] = [f"{prefix}{i}" for i in range(125) for prefix in ("tenant-", "é-", "日本-", "🚀\t'\"")]
RANGE_SPECS = ["-80", "80-", "-", "-40", "40-80", "80-c0", "c0-", "4000-8000", "-0001", "fffe-", "7f-81"]


@pytest.fixture(scope="module")
def tenants_df(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([(t,) for t in VECTOR_TENANTS], "tenant string")


def test_md5_keyspace_and_shuffle_sets_match_vectors(tenants_df: DataFrame) -> None:
    t = F.col("tenant")
    cols = [
        sr.tenant_md5(t).alias("md5"),
        sr.keyspace_hex(t).alias("keyspace_hex"),
        sr.keyspace_id(t).alias("keyspace_id"),
        *[sr.shuffle_set(t, n, k).alias(f"s_{n}_{k}") for n, k in SHAPES],
    ]
    rows = tenants_df.select(t, *cols).collect()
    assert sorted(r["tenant"] for r in rows) == sorted(VECTOR_TENANTS)
    for r in rows:
        vec = BY_TENANT[r["tenant"]]
        assert r["md5"] == vec["md5"], r["tenant"]
        assert r["keyspace_hex"] == vec["keyspace_hex"], r["tenant"]
        assert isinstance(r["keyspace_id"], Decimal)
        assert str(r["keyspace_id"]) == vec["keyspace_id"], r["tenant"]
        for n, k in SHAPES:
            assert r[f"s_{n}_{k}"] == vec["shuffle"][f"{n}/{k}"], (r["tenant"], n, k)


def test_keyspace_id_type_is_unsigned_64_bit(tenants_df: DataFrame) -> None:
    dtype = tenants_df.select(sr.keyspace_id(F.col("tenant")).alias("kid")).schema["kid"].dataType
    assert dtype.simpleString() == "decimal(20,0)"
    extremes = tenants_df.sparkSession.createDataFrame([("0" * 16,), ("f" * 16,)], "h string")
    got = [r[0] for r in extremes.select(F.conv("h", 16, 10).cast("decimal(20,0)")).collect()]
    assert got == [Decimal(0), Decimal(2**64 - 1)]


@pytest.mark.parametrize(("n", "k"), [(16, 4), (10, 3), (7, 2), (1024, 5), (16, 16), (2, 1), (64, 8)])
def test_in_shuffle_set_matches_vectors(spark: SparkSession, tenants_df: DataFrame, n: int, k: int) -> None:
    # every partition 0..n-1 plus two out-of-range ones, for every vector tenant
    parts = spark.range(-1, n + 1).select(F.col("id").cast("int").alias("p"))
    df = tenants_df.crossJoin(parts)
    rows = df.select("tenant", "p", sr.in_shuffle_set(F.col("tenant"), F.col("p"), n, k).alias("m")).collect()
    assert len(rows) == len(VECTOR_TENANTS) * (n + 2)
    got: dict[str, list[int]] = {t: [] for t in VECTOR_TENANTS}
    for r in rows:
        assert r["m"] is not None
        if not 0 <= r["p"] < n:
            assert r["m"] is False, (r["tenant"], r["p"])
        elif r["m"]:
            got[r["tenant"]].append(r["p"])
    for t in VECTOR_TENANTS:
        assert sorted(got[t]) == BY_TENANT[t]["shuffle"][f"{n}/{k}"], (t, n, k)


def test_generated_tenants_match_python(spark: SparkSession) -> None:
    shapes = [(16, 4), (1024, 1), (1024, 16), (10, 3), (1000, 7)]
    df = spark.createDataFrame([(t,) for t in GENERATED_TENANTS], "tenant string")
    t = F.col("tenant")
    rows = df.select(
        t,
        sr.keyspace_id(t).alias("kid"),
        *[sr.shuffle_set(t, n, k).alias(f"s_{n}_{k}") for n, k in shapes],
    ).collect()
    assert len(rows) == len(GENERATED_TENANTS)
    for r in rows:
        assert int(r["kid"]) == routing.keyspace_id(r["tenant"])
        for n, k in shapes:
            assert tuple(r[f"s_{n}_{k}"]) == routing.shuffle_set(r["tenant"], n, k), (r["tenant"], n, k)


def test_in_shuffle_set_null_and_bad_shape(spark: SparkSession) -> None:
    df = spark.createDataFrame([("acme", None), (None, 3), ("acme", 1)], "tenant string, p int")
    got = [r[0] for r in df.select(sr.in_shuffle_set(F.col("tenant"), F.col("p"), 16, 4)).collect()]
    assert got[0] is None and got[1] is None
    assert got[2] is routing.in_shuffle_set("acme", 1, 16, 4)
    with pytest.raises(ConfigurationError):
        sr.in_shuffle_set(F.col("tenant"), F.col("p"), 4, 5)
    with pytest.raises(ConfigurationError):
        sr.shuffle_set(F.col("tenant"), 2000, 4)


def test_in_key_range_matches_python(spark: SparkSession) -> None:
    all_tenants = VECTOR_TENANTS + GENERATED_TENANTS
    ranges = [KeyRange.parse(s) for s in RANGE_SPECS]
    df = spark.createDataFrame([(t,) for t in all_tenants], "tenant string")
    t = F.col("tenant")
    rows = df.select(t, *[sr.in_key_range(t, kr.start, kr.end).alias(f"r{i}") for i, kr in enumerate(ranges)]).collect()
    assert len(rows) == len(all_tenants)
    hits = [0] * len(ranges)
    for r in rows:
        for i, kr in enumerate(ranges):
            assert r[f"r{i}"] is kr.contains(r["tenant"]), (r["tenant"], RANGE_SPECS[i])
            hits[i] += bool(r[f"r{i}"])
    # the halves split the tenants and both sides are populated
    assert hits[0] + hits[1] == len(all_tenants)
    assert 0 < hits[0] < len(all_tenants)


def test_in_key_range_rejects_unnormalised_bounds() -> None:
    for start, end in [("80", ""), ("", "8000000000000000ff"), ("A000000000000000", ""), ("zz", "")]:
        with pytest.raises(TopologyError):
            sr.in_key_range(F.col("tenant"), start, end)


def test_find_jdbc_jar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    jar = tmp_path / "postgresql.jar"
    jar.write_bytes(b"PK")
    monkeypatch.setenv(ss.JDBC_JAR_ENV, str(jar))
    assert ss.find_jdbc_jar() == str(jar)
    monkeypatch.setenv(ss.JDBC_JAR_ENV, str(tmp_path / "missing.jar"))
    with pytest.raises(ConfigurationError):
        ss.find_jdbc_jar()
    monkeypatch.delenv(ss.JDBC_JAR_ENV)
    expected = ss.DEBIAN_JDBC_JAR if Path(ss.DEBIAN_JDBC_JAR).is_file() else None
    assert ss.find_jdbc_jar() == expected


def test_session_is_sized_for_a_small_machine(spark: SparkSession) -> None:
    conf = spark.sparkContext.getConf()
    assert spark.sparkContext.master == "local[2]"
    assert spark.conf.get("spark.sql.shuffle.partitions") == "4"
    assert conf.get("spark.ui.enabled") == "false"
    assert conf.get("spark.driver.memory") == "1g"
