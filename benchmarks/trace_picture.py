"""Draw one trace as a timeline (SVG, no plotting library): one row per span, children under their
parent, each bar from its start to its end, coloured by the process (service) that recorded it.

    KVFERRY_TEST_TRACE_DUMP=/tmp/trace.json pytest tests/e2e/test_traces_vllm.py -k one_traced
    python benchmarks/trace_picture.py /tmp/trace.json docs/trace.svg

The input is kvferry.testing.otlp_receiver's JSON (a list of spans); prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
from html import escape

ROW, LABEL_W, BAR_W, PAD = 22, 420, 640, 10
COLOURS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#9d755d", "#eeca3b"]


def ordered(spans: list[dict]) -> list[tuple[int, dict]]:
    """(depth, span), parents before children, siblings by start time; spans whose parent is not
    in the trace (the client's) are roots."""
    ids = {s["span_id"] for s in spans}
    kids: dict[str, list[dict]] = {}
    for s in spans:
        kids.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    out: list[tuple[int, dict]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(kids.get(parent, []), key=lambda x: x["start_ns"]):
            out.append((depth, s))
            walk(s["span_id"], depth + 1)
    walk("", 0)
    return out


def label(s: dict) -> str:
    a = s["attributes"]
    extra = ""
    if "kvferry.kv.bytes" in a:
        extra = f" {a['kvferry.kv.bytes'] / 1024:.0f} KiB"
    elif s["name"] == "route":
        extra = f" {a.get('kvferry.route.reason', '')}"
    elif "kvferry.instance" in a:
        extra = f" {a['kvferry.instance']}"
    return f"{s['name']}{extra} [{s['service']}]"


def svg(spans: list[dict]) -> str:
    rows = ordered(spans)
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s["end_ns"] for s in spans)
    scale = BAR_W / max(1, t1 - t0)
    services = list(dict.fromkeys(s["service"] for _, s in rows))
    colour = {svc: COLOURS[i % len(COLOURS)] for i, svc in enumerate(services)}
    h = PAD * 2 + ROW * (len(rows) + 3)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + BAR_W + 2 * PAD + 70}" height="{h}" '
           'font-family="monospace" font-size="12">', '<rect width="100%" height="100%" fill="white"/>']
    for i, (depth, s) in enumerate(rows):
        y = PAD + ROW * i
        x = LABEL_W + PAD + (s["start_ns"] - t0) * scale
        w = max(1.5, (s["end_ns"] - s["start_ns"]) * scale)
        ms = (s["end_ns"] - s["start_ns"]) / 1e6
        out.append(f'<text x="{PAD + 12 * depth}" y="{y + 15}">{escape(label(s))}</text>')
        stroke = ' stroke="#c00" stroke-width="2"' if s.get("status") == 2 else ""
        out.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="{ROW - 8}" '
                   f'fill="{colour[s["service"]]}"{stroke}/>')
        out.append(f'<text x="{x + w + 4:.1f}" y="{y + 15}" fill="#555">{ms:.1f} ms</text>')
    y = PAD + ROW * (len(rows) + 1)
    x = PAD
    for svc in services:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{colour[svc]}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 11}">{escape(svc)}</text>')
        x += 24 + 8 * len(svc)
    out.append(f'<text x="{PAD}" y="{y + ROW + 11}" fill="#555">the whole trace: {(t1 - t0) / 1e6:.1f} ms; '
               'a red outline: a span that failed</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spans", help="the trace's spans (JSON, kvferry.testing.otlp_receiver.dump)")
    ap.add_argument("out", help="the SVG to write")
    args = ap.parse_args()
    with open(args.spans) as f:
        spans = json.load(f)
    with open(args.out, "w") as f:
        f.write(svg(spans))
    print(json.dumps({"spans": len(spans), "services": sorted({s["service"] for s in spans}),
                      "ms": (max(s["end_ns"] for s in spans) - min(s["start_ns"] for s in spans)) / 1e6}))


if __name__ == "__main__":
    main()
