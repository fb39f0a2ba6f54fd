"""Smoke: `python -m bench.turn_latency --smoke` runs every phase end to end
against real processes (tiny counts) and reports the upgrade figures. No
timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_turn_latency_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.turn_latency", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = proc.stdout
    assert "ONE-STEP TURN: SendMessage -> SESSION_WAITING" in report
    assert "UPGRADE TURN: SendMessage -> SESSION_WAITING" in report
    assert "control: same-deployment turn, same session" in report
    assert "upgrade turn p50 <= 2 x one-step turn p50" in report
    figures = json.loads(out.read_text())
    upgrade = figures["upgrade"]
    assert upgrade["turn"]["n"] >= 1
    assert upgrade["turn"]["n"] + upgrade["not_handed_off"] == upgrade["iterations"] == 4
    assert upgrade["control"]["n"] == 4
    assert "upgrade_p50_over_turn_p50" in figures["targets"]
    assert figures["sequential"]["turn"]["n"] == 5


def test_metrics_compare_bench_smoke(tmp_path: Path) -> None:
    """--metrics-compare: both stacks run their turns, the metrics-on one is
    scraped, and the ratios are reported."""
    out = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.turn_latency", "--smoke", "--metrics-compare"]
        + ["--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ratio on/off: p50 " in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert figures["turns_each"] == 4 and figures["blocks"] == 2
    assert figures["off"]["turn"]["n"] == figures["on"]["turn"]["n"] == 4
    # (4 turns a side can fall within one /proc tick of CPU: then no CPU ratio)
    assert figures["p50_ratio"] > 0
    assert figures["cpu_ratio"] is None or figures["cpu_ratio"] >= 0
    assert figures["off"]["services_cpu_ms_per_turn"] >= 0


def test_tracing_compare_bench_smoke(tmp_path: Path) -> None:
    """--tracing-compare: all three stacks run their turns, the traced one
    exports spans to the bench's collector, and the ratios are reported."""
    out = tmp_path / "tracing.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.turn_latency", "--smoke", "--tracing-compare"]
        + ["--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ratio metrics on, tracing on / all off: p50 " in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert figures["turns_each"] == 4 and figures["blocks"] == 2
    assert [figures[side]["turn"]["n"] for side in ("off", "metrics", "tracing")] == [4, 4, 4]
    assert figures["spans_exported"] > 0
    assert figures["tracing_p50_ratio"] > 0
    assert figures["tracing_cpu_ratio"] is None or figures["tracing_cpu_ratio"] > 0


def test_long_session_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "long.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.long_session", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "commit p50 late/early <= 1.1" in proc.stdout
    assert "upgrade turn p50 <= 2.0 x control p50" in proc.stdout
    figures = json.loads(out.read_text())
    early, late = figures["points"]["early"], figures["points"]["late"]
    # Bytes per commit do not grow with the session's age: the snapshot is bounded.
    assert late["written"]["snapshot"] - early["written"]["snapshot"] <= 8
    assert late["written"]["history_head"] > early["written"]["history_head"]
    assert figures["turn_young"]["n"] == figures["turn_old"]["n"] == 10


def test_topology_bench_smoke(tmp_path: Path) -> None:
    """`python -m bench.topology --smoke`: the three topologies (one etcd
    member or three; one or two replicas of each service) start, serve turns
    and report both ratios."""
    out = tmp_path / "topology.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.topology", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "one-step turn p50, 3 etcd members / 1:" in proc.stdout
    assert "throughput, 2 replicas of each / 1:" in proc.stdout
    figures = json.loads(out.read_text())
    (round_,) = figures["rounds"]
    assert set(round_) == {"1x/1", "1x/3", "2x/1"}
    assert all(round_[t]["turn"]["n"] == 5 for t in round_)
    assert set(figures["ratios"][0]) == {"p50_3_members_over_1", "throughput_2x_over_1x"}


def test_children_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "children.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.children", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "SUBAGENT TURN: asks a one-step subagent" in proc.stdout
    assert "subagent turn p50 <= 2.5 x plain turn p50" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["plain"]["n"] == figures["subagent"]["n"] == figures["continue"]["n"] == 4
    assert figures["targets"]["subagent_p50_over_plain_p50"] > 0


def test_tls_overhead_bench_smoke(tmp_path: Path) -> None:
    """`python -m bench.tls_overhead --smoke`: both stacks (TLS on every hop
    and on etcd with auth; plaintext) start, run turns, and the ratios are
    reported. No timing is asserted."""
    out = tmp_path / "tls.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.tls_overhead", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "turn p50, TLS / plaintext" in proc.stdout
    figures = json.loads(out.read_text())
    for mode in ("tls", "plaintext"):
        assert figures["modes"][mode]["turn"]["n"] == 5
        assert figures["modes"][mode]["turns_per_s"] > 0
    assert figures["ratios"]["turn_p50_tls_over_plaintext"] > 0


def test_inbox_cleanup_bench_smoke(tmp_path: Path) -> None:
    """bench.inbox_cleanup: every way runs its turns on a real etcd and is
    reported against the one that deletes nothing."""
    out = tmp_path / "cleanup.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.inbox_cleanup", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "in_txn / none p50: " in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert set(figures) == {"none", "in_txn", "in_txn_from_start", "after"}
    assert all(way["p50_ms"] > 0 for way in figures.values())


def test_storage_bench_smoke(tmp_path: Path) -> None:
    """bench.storage: both stacks run their turns, the store's session is
    counted quiet (sealed whole) at both points, loads and catch-up reads
    are timed, and the targets are reported."""
    out = tmp_path / "storage.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.storage", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "keys (quiet) late/early <= 1.1" in proc.stdout, proc.stdout
    assert "store cost: " in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    early, late = figures["points"]["early"], figures["points"]["late"]
    assert (early["turn"], late["turn"]) == (20, 60)
    # Quiet, the session holds its stream's last event, no history entry and
    # no delivery id in etcd: the rest is sealed.
    for point in (early, late):
        assert point["parts"]["ev"]["keys"] == 1, point["parts"]
        assert "dlv" not in point["parts"] and "h" not in point["parts"]
        assert point["db_size"] > 0 and point["active"]["keys"] >= point["keys"]
    # The stack without the store keeps every event in etcd.
    assert figures["off_end"]["parts"]["ev"]["keys"] >= figures["off_end"]["turn"]
    assert figures["pairs"] == 3 and figures["store_cost"]["p50_ratio"] > 0
    loaded = figures["loads"]
    assert loaded["cold"]["entries"] == loaded["warm"]["entries"] == 10
    assert loaded["cold"]["n"] == loaded["off"]["n"] == 3
    assert figures["catch_up"]["on"]["events"] > figures["off_end"]["turn"]
    interleaved = figures["interleaved"]
    assert interleaved["young"]["n"] == interleaved["old"]["n"] == 10
    assert (interleaved["young_from"], interleaved["old_from"]) == (10, 60)


def test_fleet_storage_bench_smoke(tmp_path: Path) -> None:
    """bench.fleet_storage: the sessions are written, sealed whole, and the
    per-session figures and the 8 GiB estimate are reported."""
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fleet_storage", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "sessions in 8 GiB, half free" in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    after = figures["after"]
    # Sealed whole: one event key per session, no history entry in etcd.
    assert after["event_keys"] == 20 and after["history_keys"] == 0
    assert 0 < figures["per_session"]["kv_bytes"] < 8 * 1024
    assert figures["objects"] >= 20 and figures["sessions_in_8gib"] > 0


def test_scaling_bench_smoke(tmp_path: Path) -> None:
    """`python -m bench.scaling --smoke`: levels 1 and 4 each run their turns
    and their etcd-alone pairs, and every level has positive figures."""
    out = tmp_path / "scaling.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scaling", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    levels = figures["levels"]
    assert [level["sessions"] for level in levels] == [1, 4]
    for level in levels:
        assert level["ran"], level
        # --turns 6, at least 2 per session.
        assert level["turns"] == max(6, 2 * level["sessions"])
        assert level["turn"]["n"] == level["turns"]
        assert level["turns_per_s"] > 0 and level["etcd_alone"]["pairs_per_s"] > 0
        assert level["turn"]["p50_ms"] > 0 and level["turn"]["p99_ms"] > 0
        assert level["over_etcd_alone"] > 0
        assert level["services_cpu_ms_per_turn"] > 0
        assert level["cpu_ms_per_turn"]["bench client"] >= 0
        assert level["not_finalized"] == 0


def test_scaling_refuses_levels_over_a_limit() -> None:
    """A level over a stack or client limit is not run; the reason names the
    limit. Pure: no stack."""
    from bench.scaling import StackLimits

    limits = StackLimits(
        follow_streams=1000, max_streams=600, max_unary=300, nofile=1024, open_fds=20
    )
    assert limits.refusal(256) == ""
    assert "BATON_MAX_CONCURRENT_RPCS" in limits.refusal(512)
    assert "BATON_MAX_CONCURRENT_STREAMS" in limits.refusal(700)
    assert "BATON_MAX_FOLLOW_STREAMS" in limits.refusal(1001)
    assert StackLimits(0, 10**5, 2000, 1024, 20).refusal(1500) == ""  # 0: no follow limit
    assert "file descriptors" in StackLimits(1000, 10**5, 2000, 300, 100).refusal(1)


@pytest.mark.parametrize("switch", ["streams", "inbox-feed"])
def test_commit_stream_bench_smoke(tmp_path: Path, switch: str) -> None:
    """`python -m bench.commit_stream --smoke [--switch inbox-feed]`: both
    stacks (commits streamed, commits unary; or inbox streams on the feed,
    one each) start, run turns, and the ratios and the commits per message
    are reported. No timing is asserted."""
    out = tmp_path / "commits.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.commit_stream",
            "--smoke",
            "--switch",
            switch,
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "commits per CommitSteps message" in proc.stdout
    figures = json.loads(out.read_text())
    for mode in ("streamed", "unary"):
        assert figures["modes"][mode]["turn"]["n"] == 5
        assert figures["modes"][mode]["turns_per_s"] > 0
    assert figures["commits_per_message"] >= 1


def test_message_costs_bench_smoke(tmp_path: Path) -> None:
    """`python -m bench.message_costs --smoke`: every kind of message is
    measured (a server process, a TLS etcd), and the one-step turn's
    messages are added up from docs/hops.json. No timing is asserted."""
    out = tmp_path / "costs.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.message_costs", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Health.Check hops" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["calls"] == 50
    for kind in ("health_check", "unary", "stream_pair"):
        assert set(figures["grpc"][kind]) == {"server_ms", "client_ms"}
    assert set(figures["etcd"]) == {"txn_write", "watch_response", "watch_before_answer"}
    order = figures["etcd"]["watch_before_answer"]
    assert order["writes"] > 0 and 0 <= order["watch_first"] <= order["writes"]
    turn = figures["one_step_turn"]
    assert abs(turn["total_ms"] - sum(turn["parts_ms"].values())) < 0.001
    assert len(turn["parts_ms"]) == 4  # the edge, streams, etcd txns, watch responses


def test_message_costs_reports_no_ratio_over_a_unit_of_zero() -> None:
    """A smoke run's 50 Health.Checks can fall within one /proc clock tick:
    the report says n/a instead of dividing by 0 (CI failed on it once)."""
    from bench.message_costs import _in_units

    assert _in_units(0.5, 0.0).strip() == "n/a"
    assert _in_units(0.5, 0.25).strip() == "2.00"


def test_idle_rss_bench_smoke(tmp_path: Path) -> None:
    """bench.idle_rss on a few sessions: they park, the owner's RSS is read
    at both counts, and --idle-cpu reads the three processes' idle CPU."""
    out = tmp_path / "idle.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.idle_rss",
            "--sessions",
            "30",
            "--baseline",
            "10",
            "--settle",
            "0.5",
            "--idle-cpu",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "idle CPU with 30 parked sessions over 1s" in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert figures["sessions"] == 30 and figures["rss_bytes"] > 0
    for name in ("hooks", "owner", "etcd"):
        assert figures[f"idle_cpu_ms_per_s_{name}"] >= 0


def test_live_rss_bench_smoke(tmp_path: Path) -> None:
    """`python -m bench.live_rss --smoke`: both stacks (inbox streams on the
    feed, one StreamInbox each) start sessions that stay live, and the memory
    and CPU per live session are reported. No figure is asserted."""
    out = tmp_path / "live.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.live_rss", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "live (unparked) sessions on one owner" in proc.stdout
    figures = json.loads(out.read_text())
    assert set(figures["modes"]) == {"feed", "per-session"}
    for mode in figures["modes"].values():
        assert set(mode["rss_bytes_per_session"]) == {"hooks", "owner", "anchor"}
        assert mode["create_seconds"] > 0


def _peer_line(
    seq_p50: float, run_tps: float, server: float, service: float, other: float = 0.2
) -> dict[str, Any]:
    """A Restate peer's run.sh result, with the keys bench.peer reads
    (`other`: CPU ms per turn that other processes burnt)."""
    phase = {"server": 1.0, "service": 0.5, "client": 0.1, "other": other}
    return {
        "peer": "restate",
        "restate_server": "restate-server 1.7.12",
        "a_seq_send": {"p50_ms": 3.5, "cpu_ms_per_turn": phase},
        "b_tp_send": {"turns_per_s": 800.0, "clients": 32, "cpu_ms_per_turn": phase},
        "c_seq_send_run": {"p50_ms": seq_p50, "cpu_ms_per_turn": phase},
        "d_tp_send_run": {
            "turns_per_s": run_tps,
            "clients": 32,
            "cpu_ms_per_turn": {**phase, "server": server, "service": service},
        },
        "state_check": {"match": True},
    }


def _baton_figures(turn_p50: float, tps: float, cpu: dict[str, float]) -> dict[str, Any]:
    """bench.turn_latency --json output, the keys bench.peer reads."""
    return {
        "load_start": "1.00 1.00 1.00",
        "load_end": "1.50 1.00 1.00",
        "sequential": {"turn": {"p50_ms": turn_p50}},
        "throughput": {"sessions": 32, "turns_per_s": tps, "per_turn": {"cpu_ms": cpu}},
    }


def test_peer_table_from_recorded_pairs(tmp_path: Path) -> None:
    """`python -m bench.peer --from DIR`: per-pair ratios (Baton / Restate
    send_run) of turn p50, turns/s and servers' + store's CPU per turn, and
    their medians, from recorded outputs. Pure: no stack, no peer."""
    cpu = {"hooks": 1.0, "anchor": 0.5, "owner": 1.0, "ingress": 0.5, "etcd": 1.0}
    pairs = [
        (_peer_line(5.0, 400.0, 2.0, 1.5), _baton_figures(6.0, 380.0, cpu)),
        (_peer_line(4.0, 500.0, 2.0, 2.0), _baton_figures(6.0, 400.0, cpu)),
        (_peer_line(6.0, 450.0, 2.5, 1.5, other=3.0), _baton_figures(4.5, 540.0, cpu)),
    ]
    for n, (peer, baton) in enumerate(pairs, 1):
        # run.sh's stdout: its JSON line last
        (tmp_path / f"restate-{n}.json").write_text("noise\n" + json.dumps(peer) + "\n")
        (tmp_path / f"baton-{n}.json").write_text(json.dumps(baton))
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peer", "--from", str(tmp_path), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert [p["ratios"]["turn_p50"] for p in summary["pairs"]] == [1.2, 1.5, 0.75]
    assert [p["ratios"]["turns_per_s"] for p in summary["pairs"]] == [0.95, 0.8, 1.2]
    # Baton: four services (3.0) + etcd (1.0); Restate: server + service.
    assert [p["ratios"]["cpu_ms_per_turn"] for p in summary["pairs"]] == [1.143, 1.0, 1.0]
    assert summary["median_ratio"] == {"turn_p50": 1.2, "turns_per_s": 0.95, "cpu_ms_per_turn": 1.0}
    ok = summary["target_ok"]
    assert ok == {"turn_p50": False, "turns_per_s": False, "cpu_ms_per_turn": True}
    assert "| sequential one-step turn p50 | 6.00 / 6.00 / 4.50 ms |" in proc.stdout
    assert "**1.20×**" in proc.stdout
    # Other processes' CPU during the peer's run marks a pair perturbed.
    assert [p["perturbed"] for p in summary["pairs"]] == [False, False, True]
    assert "- pair 3 (PERTURBED):" in proc.stdout and "- pair 2:" in proc.stdout


@pytest.mark.timeout(200)  # two bench.turn_latency --smoke runs
def test_peer_pairs_alternate_with_a_stand_in_peer(tmp_path: Path) -> None:
    """`python -m bench.peer --peer DIR --pairs 2`: the peer's run.sh and
    bench.turn_latency run in turn, their outputs are kept, and the table
    compares them. The peer is a stand-in printing a recorded line (the
    real one needs npm and the network); bench.turn_latency runs --smoke."""
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    line = json.dumps(_peer_line(5.0, 400.0, 2.0, 1.5))
    (peer_dir / "run.sh").write_text(f"echo starting >&2\necho '{line}'\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peer", "--peer", str(peer_dir), "--pairs", "2"]
        + ["--out", str(out), "--baton-args", "--smoke --upgrade-turns 0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for n in (1, 2):
        assert json.loads((out / f"restate-{n}.json").read_text())["peer"] == "restate"
        assert json.loads((out / f"baton-{n}.json").read_text())["sequential"]["turn"]["n"] == 5
    assert "| 32 concurrent sessions, turns/s |" in proc.stdout
    assert proc.stdout.count("state check ok") == 2


def test_live_stream_bench_smoke(tmp_path: Path) -> None:
    """bench.live_stream: plain and streaming turns run, every delta reaches
    the live follower, and the figures are reported (no timing asserted)."""
    out = tmp_path / "live.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.live_stream", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "STREAMING TURN: SendMessage -> SESSION_WAITING" in proc.stdout
    assert "owner item -> follower" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["plain"]["turn"]["n"] == 5
    streaming = figures["streaming"]
    assert streaming["turn"]["n"] == 3
    # 3 turns of 100 deltas; under load an item may be dropped (then announced).
    assert streaming["deltas_seen"] == 300 or streaming["dropped"] > 0
    assert streaming["item_to_follower"]["n"] >= 3
    assert streaming["delta_to_follower"]["n"] == streaming["deltas_seen"]
    assert "services_cpu_ms_per_delta" in figures
