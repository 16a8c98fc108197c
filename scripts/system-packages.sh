#!/usr/bin/env bash
# The system packages the tests need beyond Python, installed when missing: the one place that
# knows them (`make setup` runs it, and so `make demo`, `make test` and CI).
#
#   Java 17+   a local Spark session (the Spark tests, `qm spark ...`)
#   the PostgreSQL JDBC driver jar (/usr/share/java/postgresql.jar, or $QM_JDBC_JAR)
#   ps         Spark's launch scripts call it
#   chromium   the dashboard's browser tests (tests/web/test_browser.py), headless
#   nodejs, npm  the TypeScript receiver (clients/typescript), built by make setup and run by the
#              conformance suite (make conformance, in make test)
#
# As root, with apt-get: installs what is missing (Debian's packages). As another user: prints one
# line naming what is missing and the command that installs it, and succeeds; the Spark tests are
# then skipped with that reason. With nothing missing it does nothing, quickly.
set -euo pipefail

need=()
java_ok() {
  local java major
  if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then
    java="$JAVA_HOME/bin/java"  # what pyspark starts when JAVA_HOME is set
  else
    java=$(command -v java 2>/dev/null) || return 1
  fi
  # "17.0.15" or "21" from: openjdk version "17.0.15" 2025-04-15
  major=$("$java" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1)
  [ -n "$major" ] && [ "$major" -ge 17 ]
}
java_ok || need+=(openjdk-17-jre-headless)
if [ -n "${QM_JDBC_JAR:-}" ]; then
  [ -f "$QM_JDBC_JAR" ] || { echo "setup: QM_JDBC_JAR=$QM_JDBC_JAR is not a file (point it at the PostgreSQL JDBC jar, or unset it)" >&2; exit 1; }
else
  [ -f /usr/share/java/postgresql.jar ] || need+=(libpostgresql-jdbc-java)
fi
command -v ps >/dev/null 2>&1 || need+=(procps)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)

[ ${#need[@]} -eq 0 ] && exit 0

install="apt-get install -y ${need[*]}"
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: missing ${need[*]} (the Spark, browser or TypeScript tests will be skipped): as root, run: $install" >&2
  exit 0
fi
echo "setup: installing ${need[*]} (Debian packages)" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
