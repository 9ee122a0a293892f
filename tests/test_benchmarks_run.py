"""The cheap benchmarks still run against today's code and print their JSON (their numbers are
judged in docs/benchmarks.md, not here): a benchmark that imports a moved name or builds a
message with an old signature fails here instead of on the next measuring day."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_bench(*args: str) -> dict:
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernels_bench_runs() -> None:
    out = run_bench("benchmarks/kernels_bench.py", "--json", "--device", "cpu", "--max-mib", "1", "--reps", "1",
                    "--cache-mib", "8", "--batch", "2")
    assert [r["chunk_bytes"] for r in out["rows"]] == [64 << 10, 256 << 10, 1 << 20]
    assert all(r["gather_gbps"] > 0 and r["scatter_gbps"] > 0 for r in out["rows"])


def test_transfer_bench_runs() -> None:
    pytest.importorskip("nixl", reason="the transfer bench needs NIXL")
    out = run_bench("benchmarks/transfer_bench.py", "--json", "--chunk-mib", "1", "--batch", "2", "--reps", "1")
    (row,) = out["rows"]
    assert row["chunk_bytes"] == 1 << 20 and row["batch"] == 2
    assert row["raw_nixl_write_gbps"] > 0 and row["kvferry_gbps"] > 0 and row["kvferry_secret_gbps"] > 0
    assert row["raw_p50_ms"] > 0 and row["raw_sender_done_p50_ms"] > 0  # raw timed to its notification, and to done


def test_transfer_bench_hetero_tp2_to_tp1_runs() -> None:
    pytest.importorskip("nixl", reason="the transfer bench needs NIXL")
    out = run_bench("benchmarks/transfer_bench.py", "--json", "--hetero-tp", "--chunk-mib", "1", "--batch", "2",
                    "--reps", "1")
    (row,) = out["rows"]
    assert row["senders"] == 2 and row["batch"] == 2 and row["runs_per_chunk_per_sender"] == 16
    assert row["raw_nixl_write_gbps"] > 0 and row["kvferry_gbps"] > 0 and row["ratio"] > 0


def test_vllm_compat_bench_runs_for_the_installed_vllm() -> None:
    """The API check's script (make vllm-compat), without downloads: the installed vLLM only."""
    out = run_bench("benchmarks/vllm_compat.py", "--installed-only")
    (row,) = out["releases"]
    assert out["ok"] and row["version"] == out["installed"] and row["how"] == "installed" and row["problems"] == []


def test_discovery_bench_runs(etcd_available) -> None:
    out = run_bench("benchmarks/discovery_bench.py", "--json", "--rounds", "1", "--requests", "40",
                    "--concurrency", "4")
    assert out["errors"] == 0 and 0 < out["join_to_routed_p50_s"] < 5 and out["balance_max_over_min"] >= 1
    assert sum(out["balance_requests"].values()) == 80


def test_c1_segments_bench_runs() -> None:
    """Each request's segments come from the stubs' traces (KVFERRY_STUB_TRACE) and the client's clock."""
    out = run_bench("benchmarks/c1_segments.py", "--requests", "5", "--rounds", "1", "--warm", "2",
                    "--no-vllm-router")
    s = out["summary"]
    assert set(s) == {"direct", "kvferry"}
    assert s["kvferry"]["n"] == 5 and s["direct"]["n"] == 5
    # P in -> D in is causal per request (the decode leg goes only after the prefill's answer came);
    # `3 middle` alone is not: the stub stamps its answer written only when it runs again, which on
    # a busy machine can be after the decoder was entered. The added total is a difference of two
    # 5-request medians, which a loaded machine can invert.
    k = s["kvferry"]
    assert k["2+3 P in -> D in"] > 0 and math.isfinite(k["3 middle (P written -> D in)"])
    assert math.isfinite(k["added total"])


def test_proxy_bench_runs() -> None:
    out = run_bench("benchmarks/proxy_bench.py", "--json", "--requests", "40", "--concurrency", "1,4",
                    "--no-vllm-router", "--decoder-first", "--workers", "1", "--prompt-words", "16")
    assert out["zero_errors"] == {"kvferry": True, "kvferry_decoder_first": True}
    assert all(out[t][c]["requests"] == 40 and out[t][c]["cpu_ms_per_request"] > 0
               for t in ("kvferry", "kvferry_decoder_first") for c in ("1", "4"))


def test_proxy_bench_runs_with_lmcache_flags() -> None:
    """Every kvferry target started with LMCache's disagg_proxy_server.py flags serves the load."""
    out = run_bench("benchmarks/proxy_bench.py", "--json", "--requests", "20", "--concurrency", "2",
                    "--no-vllm-router", "--workers", "1", "--prompt-words", "16", "--lmcache-flags")
    assert out["setup"]["lmcache_flags"] is True and out["zero_errors"] == {"kvferry": True}
    assert out["kvferry"]["2"]["requests"] == 20


def test_scale_bench_quick_runs() -> None:
    """The routing and index curves' shape checks (ratios, not times) pass on today's code."""
    out = run_bench("benchmarks/scale_bench.py", "--quick", "--json", "--only", "routing,index")
    assert out["ok"] and {c["name"] for c in out["checks"]} == {
        "routing.routing_p99_ratio_1024_vs_16", "routing.proxy_cpu_ratio_1024_vs_2",
        "index.index_bytes_per_block_spread", "index.bounded_rss_ratio_last_vs_first"}
    assert [p["instances"] for p in out["curves"]["routing"]["points"]] == [2, 16, 128, 1024]
    assert all(p["held_blocks"] == out["curves"]["index"]["bound_blocks"]
               for p in out["curves"]["index"]["bounded_points"])
    assert out["routing_p99_ratio_1024_vs_16"] > 0 and out["index_bytes_per_block_spread"] >= 1


def test_scale_bench_quick_discovery_and_transfer_run() -> None:
    """The discovery curve (real etcd, proxies, registrations) and the transfer curve (real NIXL)
    measure every point and pass their shape checks; the 1,000 x 10 key belongs to full runs only."""
    pytest.importorskip("nixl", reason="the transfer curve needs NIXL")
    out = run_bench("benchmarks/scale_bench.py", "--quick", "--json", "--only", "discovery,transfer")
    assert out["ok"], [c for c in out["checks"] if not c["ok"]]
    assert {c["name"] for c in out["checks"]} == {
        "discovery.every_point_measured", "transfer.transfer_ratio_64_vs_8"}
    d = out["curves"]["discovery"]
    assert "join_to_routed_p50_s_1000" not in d and d["join_to_routed_largest"]["instances"] == 100
    assert all(p["join_to_routed_p50_s"] > 0 for p in d["points"])
    assert out["transfer_ratio_64_vs_8"] > 0


def test_trace_picture_draws_a_dumped_trace(tmp_path: Path) -> None:
    """benchmarks/trace_picture.py draws what kvferry.testing.otlp_receiver.dump writes (docs/trace.svg)."""
    from kvferry.testing.otlp_receiver import ReceivedSpan, dump

    t = "ab" * 16
    spans = [ReceivedSpan(t, "01" * 8, "ff" * 8, "POST /v1/completions", 2, 0, 9_000_000, {}, "kvferry-proxy", {}, 0),
             ReceivedSpan(t, "02" * 8, "01" * 8, "prefill", 3, 1_000_000, 4_000_000, {"kvferry.instance": "p0"},
                  "kvferry-proxy", {}, 0),
             ReceivedSpan(t, "03" * 8, "02" * 8, "kv.transfer", 1, 2_000_000, 3_500_000, {"kvferry.kv.bytes": 1 << 20},
                  "kvferry-prefiller", {}, 2)]
    dump(spans, str(tmp_path / "trace.json"))
    out = run_bench("benchmarks/trace_picture.py", str(tmp_path / "trace.json"), str(tmp_path / "trace.svg"))
    assert out == {"spans": 3, "services": ["kvferry-prefiller", "kvferry-proxy"], "ms": 9.0}
    svg = (tmp_path / "trace.svg").read_text()
    assert svg.startswith("<svg") and "kv.transfer 1024 KiB [kvferry-prefiller]" in svg and "prefill p0" in svg
