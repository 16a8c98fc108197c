"""The fleet's command lines and token files (queue_manager.local.fleet), read back by what reads them."""

from __future__ import annotations

from pathlib import Path

from queue_manager.cli.main import build_parser
from queue_manager.local import fleet
from queue_manager.manager.auth import TokenStore
from queue_manager.web.access import WebTokens


def test_flags_spell_each_option_once_repeat_sequences_and_leave_out_none_and_false() -> None:
    assert fleet.flags(lease_ttl=2.0, drain_timeout=2, async_fires=True, idle_slices=None, keep=False) == [
        "--lease-ttl",
        "2.0",
        "--drain-timeout",
        "2",
        "--async-fires",
    ]
    assert fleet.flags(tenant=["a", "b"]) == ["--tenant", "a", "--tenant", "b"]


def test_the_manager_command_line_is_what_qm_manager_parses(tmp_path: Path) -> None:
    argv = fleet.manager_argv(
        tmp_path / "t.toml", "s1", tmp_path / "k.toml", port=8766, lease_ttl=2.0, async_fires=True
    )
    args = build_parser().parse_args(argv)
    assert (args.topology, args.shard, args.tokens, args.port) == (
        str(tmp_path / "t.toml"),
        "s1",
        str(tmp_path / "k.toml"),
        8766,
    )
    assert args.lease_ttl == 2.0 and args.async_fires is True
    assert fleet.qm(*argv)[1:4] == ["-m", "queue_manager.cli.main", "manager"]


def test_the_receiver_command_line_is_what_qm_receive_parses(tmp_path: Path) -> None:
    argv = fleet.receiver_argv(
        "orders",
        "myapp:handle",
        topology=tmp_path / "t.toml",
        managers={"s0": ["ws://a:1/", "ws://b:2/"], "s1": ["ws://c:3/"]},
        concurrency=8,
        tenant=["acme", "globex"],
    )
    args = build_parser().parse_args(argv)
    assert (args.queue, args.handler, args.topology) == ("orders", "myapp:handle", str(tmp_path / "t.toml"))
    assert args.manager == ["s0=ws://a:1/", "s0=ws://b:2/", "s1=ws://c:3/"]
    assert (args.concurrency, args.tenant) == (8, ["acme", "globex"])
    # with a topology file that records the managers, no --manager at all
    assert "--manager" not in fleet.receiver_argv("orders", "myapp:handle", topology=tmp_path / "t.toml")


def test_a_token_file_is_read_back_by_the_manager_and_the_dashboard_and_only_its_owner_reads_it(
    tmp_path: Path,
) -> None:
    path = fleet.write_tokens(
        tmp_path / "tokens.toml",
        [
            fleet.Token("all", "secret-all-queues-0001"),
            fleet.Token("vip", 'secret-"quoted"-0002', ("orders",), ("acme", "globex")),
        ],
        [fleet.WebToken("ops", "web-secret-000000001", "read")],
    )
    assert path.stat().st_mode & 0o777 == 0o600
    store = TokenStore.load(path)
    vip = store.lookup('secret-"quoted"-0002')
    assert vip is not None and vip.name == "vip"
    assert vip.queues == frozenset({"orders"}) and vip.tenants == frozenset({"acme", "globex"})
    everything = store.lookup("secret-all-queues-0001")
    assert everything is not None and everything.queues is None and everything.tenants is None
    assert WebTokens.load(path).lookup("web-secret-000000001") is not None
    assert TokenStore.from_entries([fleet.Token("all", "secret-all-queues-0001").entry()]).lookup(
        "secret-all-queues-0001"
    )
