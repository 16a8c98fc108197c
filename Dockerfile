# The project image: the `qm` command, the receiver library and the Spark jobs.
#   docker build -t queue-manager:local .      (docker-compose.yml builds it for you)
#   docker run --rm queue-manager:local --help
# Checked by tests/unit/test_compose.py (no Docker engine in CI).

# bookworm: it still ships openjdk-17 (the Spark runner's Java)
FROM python:3.12-slim-bookworm

# Java 17 and Debian's PostgreSQL JDBC driver (/usr/share/java/postgresql.jar) for `qm spark ...`;
# procps: Spark's launch scripts call `ps`
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        openjdk-17-jre-headless libpostgresql-jdbc-java procps \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QM_JDBC_JAR=/usr/share/java/postgresql.jar

WORKDIR /opt/qm
COPY pyproject.toml README.md alembic.ini ./
COPY alembic ./alembic
COPY queue_manager ./queue_manager
COPY receivers ./receivers
COPY spark_jobs ./spark_jobs
# Editable (-e), on purpose: `qm migrate` finds alembic.ini and alembic/ beside the packages
# (queue_manager/db/migrate.py, _ROOT), which a plain `pip install .` into site-packages loses.
RUN pip install -e ".[spark,web]"

# an unprivileged user; /var/lib/qm is the Spark runner's work directory (a volume in compose)
RUN useradd --system --uid 10001 --create-home --home-dir /home/qm qm \
    && mkdir -p /var/lib/qm \
    && chown qm:qm /var/lib/qm
USER qm
WORKDIR /home/qm

ENTRYPOINT ["qm"]
CMD ["--help"]
