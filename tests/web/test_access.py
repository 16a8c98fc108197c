"""Dashboard tokens and session cookies: pure, no database."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from queue_manager.errors import ConfigurationError
from queue_manager.manager.auth import TokenStore
from queue_manager.web.access import Sessions, WebTokens

ROOT = Path(__file__).resolve().parents[2]


def test_the_compose_token_file_serves_managers_and_dashboard_alike() -> None:
    tokens = WebTokens.load(ROOT / "deploy" / "tokens.toml")
    admin = tokens.lookup("compose-dashboard-admin-change-me")
    viewer = tokens.lookup("compose-dashboard-viewer-change-me")
    assert admin is not None and admin.admin and viewer is not None and not viewer.admin
    assert tokens.lookup("compose-demo-secret-change-me") is None  # a receiver's secret is no login
    assert TokenStore.load(ROOT / "deploy" / "tokens.toml").lookup("compose-demo-secret-change-me") is not None


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ([], "defines no \\[\\[web_token\\]\\]"),
        ([{"name": "a", "secret": "short", "scope": "admin"}], "at least 16"),
        ([{"name": "a", "secret": "x" * 16, "scope": "root"}], "'scope' must be"),
        ([{"name": "a", "secret": "x" * 16}], "'scope' must be"),
        ([{"name": "a", "secret": "x" * 16, "secret_sha256": "0" * 64, "scope": "read"}], "exactly one"),
        ([{"name": "a", "secret_sha256": "XYZ", "scope": "read"}], "64 lowercase hex"),
        ([{"name": "a", "secret": "x" * 16, "scope": "read", "queues": ["*"]}], "unknown keys"),
        (
            [{"name": "a", "secret": "x" * 16, "scope": "read"}, {"name": "a", "secret": "y" * 16, "scope": "read"}],
            "used twice",
        ),
        (
            [{"name": "a", "secret": "x" * 16, "scope": "read"}, {"name": "b", "secret": "x" * 16, "scope": "admin"}],
            "same secret",
        ),
    ],
)
def test_bad_tokens_are_refused_with_the_reason(entries: list[dict[str, object]], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        WebTokens.from_entries(entries)


def test_a_digest_logs_in_and_a_session_outlives_neither_its_signature_nor_its_token() -> None:
    secret = "a-secret-of-sixteen+"
    tokens = WebTokens.from_entries(
        [{"name": "ops", "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(), "scope": "admin"}]
    )
    sessions = Sessions(tokens, "signing-key")
    issued = sessions.issue(secret)
    assert issued is not None and sessions.issue("wrong-secret-000000") is None
    cookie, user = issued
    assert sessions.read(cookie) == user and user.csrf
    assert sessions.read(cookie[:-2] + "xx") is None
    assert Sessions(tokens, "another-key").read(cookie) is None
    rotated = WebTokens.from_entries([{"name": "ops", "secret": "a-new-secret-000000", "scope": "admin"}])
    assert Sessions(rotated, "signing-key").read(cookie) is None


def test_the_docs_token_example_runs_and_both_tokens_log_in(tmp_path: Path) -> None:
    """docs/dashboard.md's "Running it": the lines up to the token file, run by bash as written
    (the digest's one-liner included), make a file whose admin secret and hashed read-only secret
    both log in."""
    import re
    import subprocess

    block = re.search(r"## Running it\n\n```bash\n(.*?)```", (ROOT / "docs" / "dashboard.md").read_text(), re.S)
    assert block is not None
    lines = block.group(1).splitlines()
    script = "\n".join(lines[1 : lines.index("TOML") + 1])  # after the pip line, up to the heredoc's end
    subprocess.run(["bash", "-euc", script], cwd=tmp_path, check=True)
    tokens = WebTokens.load(tmp_path / "tokens.toml")
    admin, reader = tokens.lookup("a-long-secret-for-alice"), tokens.lookup("the-on-call-secret-0042")
    assert admin is not None and admin.admin and reader is not None and reader.name == "oncall-readonly"
    assert not reader.admin and "the-on-call-secret-0042" not in (tmp_path / "tokens.toml").read_text()
