"""The controller's web page: one server-rendered HTML document (no scripts, no build step)."""

from __future__ import annotations

import time
from html import escape

from kvferry.common.units import fmt_bytes


def _ago(at: float) -> str:
    return f"{max(0.0, time.time() - at):.0f} s ago"


def _table(head: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f"<p class=empty>{escape(empty)}</p>"
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def render(state: dict, refresh_s: int = 2) -> str:
    inst_rows = []
    for inst in state["instances"]:
        for t in inst["tiers"]:
            workers = "<br>".join(
                f"rank {w['worker_id']}: {escape(w['host'])}:{w['p2p_init_port']}/{w['p2p_lookup_port']} "
                f"(worker port {w['worker_port']}, heartbeat {w['heartbeat_age_s']:.1f} s ago)"
                for w in inst["workers"])
            cap = t["capacity_bytes"]
            inst_rows.append([
                f"<b class=instance>{escape(inst['instance_id'])}</b>"
                + ("" if inst["complete"] else " <i>(ranks missing)</i>"),
                workers, escape(t["location"]), str(t["chunks"]),
                f"{fmt_bytes(t['bytes'])}" + (f" of {fmt_bytes(cap)}" if cap else "")])
    tr_rows = [[_ago(t["at"]), escape(t["kind"]), escape(t["from"]), escape(t["to"]), str(t["chunks"]),
                fmt_bytes(t["bytes"]), f"{t['ms']:.1f}", f"{t['gbps']:.2f}", "ok" if t["ok"] else "<b>failed</b>"]
               for t in state["transfers"]]
    ev_rows = [[_ago(e["at"]), escape(e["kind"]), escape(e["instance"]), escape(e["detail"])]
               for e in state["events"]]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_s}">
<title>kvferry controller</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #bbb; padding: 4px 10px; text-align: left; vertical-align: top; }}
th {{ background: #eef; }} .empty {{ color: #777; }}
</style></head>
<body>
<h1>kvferry controller</h1>
<h2>Instances ({len(state['instances'])})</h2>
{_table(["instance", "workers (p2p init/lookup)", "tier", "chunks", "bytes"], inst_rows,
        "No instance has registered yet (enable_controller: true in its config).")}
<h2>Recent transfers</h2>
{_table(["when", "kind", "from", "to", "chunks", "bytes", "ms", "GB/s", "result"], tr_rows, "None yet.")}
<h2>Recent events</h2>
{_table(["when", "event", "instance", "detail"], ev_rows, "None yet.")}
</body></html>
"""
