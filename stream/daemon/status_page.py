"""The status page the metrics server serves: one self-contained HTML page, its JSON, and annotated JPEGs.

    GET /                 the page (inline CSS and JS, nothing fetched from elsewhere)
    GET /status.json      {"time": unix seconds, "streams": [row, ...]} (rows: Runner.status_rows()); a shard adds
                          "shard": {shard, index, count, streams, skipped} (stream.core.shard)
    GET /frame/<id>.jpg   the stream's latest snapshot with its boxes drawn

The page polls /status.json every 500 ms and updates its table in place (streams added at run time get a row,
removed ones lose it); each stream's frame is fetched again once the previous one has arrived. Every value
goes into the DOM as text, never as HTML: stream ids, sources and errors come from users and files.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

POLL_MS = 500


def status_json(rows: list[dict[str, Any]], shard: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"time": round(time.time(), 3), "streams": rows}
    if shard is not None:  # which shard this daemon is, and the configured streams it left to the others
        out["shard"] = shard
    return out


def draw(image: np.ndarray, detections: list[dict[str, Any]], source_size: tuple[int, int]) -> np.ndarray:
    """The model-size RGB image back at the source's aspect ratio (BGR, for cv2), with boxes and labels.

    The model input is the source stretched to the model's size; the picture is stretched back so that its
    longer side keeps the image's longer side. Boxes (source pixels) are scaled to it and drawn by
    `drawing.draw`, as in annotated videos.
    """
    import cv2

    from stream.sinks.drawing import draw as draw_boxes

    src_w, src_h = max(1, int(source_size[0])), max(1, int(source_size[1]))
    side = max(image.shape[0], image.shape[1])
    k = side / max(src_w, src_h)
    out_w, out_h = max(1, round(src_w * k)), max(1, round(src_h * k))
    rgb: np.ndarray = np.ascontiguousarray(image, dtype=np.uint8)  # cv2's stubs give resize any numeric dtype
    if rgb.shape[:2] != (out_h, out_w):
        rgb = cv2.resize(rgb, (out_w, out_h), interpolation=cv2.INTER_AREA)
    else:
        rgb = rgb.copy()
    sx, sy = out_w / src_w, out_h / src_h
    scaled = [
        {**d, "box": [d["box"][0] * sx, d["box"][1] * sy, d["box"][2] * sx, d["box"][3] * sy]} for d in detections
    ]
    return cv2.cvtColor(draw_boxes(rgb, scaled), cv2.COLOR_RGB2BGR)


def frame_jpeg(
    image: np.ndarray, detections: list[dict[str, Any]], source_size: tuple[int, int], quality: int = 80
) -> bytes:
    """draw(), encoded as JPEG."""
    import cv2

    ok, buf = cv2.imencode(".jpg", draw(image, detections, source_size), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return buf.tobytes()


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>stream: status</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; }
  #meta { color: #666; margin-bottom: 1em; }
  #meta.down { color: #b00; font-weight: bold; }
  table { border-collapse: collapse; background: #fff; }
  th, td { padding: .3em .7em; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
  th:first-child, td:first-child, td.state, td.error { text-align: left; }
  td.error { color: #b00; white-space: normal; max-width: 30em; }
  td.state.streaming { color: #070; } td.state.failed { color: #b00; }
  #frames { display: flex; flex-wrap: wrap; align-items: flex-start; gap: 1em; margin-top: 1.5em; }
  figure { margin: 0; background: #fff; padding: .5em; border: 1px solid #ddd; }
  figure img { display: block; max-width: 480px; min-width: 160px; min-height: 90px; background: #eee; }
  figcaption { margin-top: .3em; color: #444; }
</style>
</head>
<body>
<h1>stream: status</h1>
<div id="meta">connecting&hellip;</div>
<table>
  <thead><tr><th>stream</th><th>state</th><th>frames</th><th>fps</th><th>latency p50</th><th>latency p99</th>
  <th>detections</th><th>dropped</th><th>reconnects</th><th>error</th></tr></thead>
  <tbody id="rows"></tbody>
</table>
<div id="frames"></div>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const COLS = ["state", "frames", "fps", "latency_p50_ms", "latency_p99_ms", "detections", "dropped", "reconnects",
              "error"];
const streams = new Map();  // id -> {row, cells, figure, img, caption, busy, url}

function fmt(key, v) {
  if (v === null || v === undefined) return key === "error" ? "" : "\\u2013";
  if (key.startsWith("latency")) return v.toFixed(1) + " ms";
  if (key === "fps") return v.toFixed(1);
  return String(v);
}

function add(id) {
  const row = document.createElement("tr");
  row.dataset.stream = id;
  const name = document.createElement("td");
  name.textContent = id;
  row.appendChild(name);
  const cells = {};
  for (const k of COLS) {
    const td = document.createElement("td");
    td.className = k;
    td.dataset.k = k;
    row.appendChild(td);
    cells[k] = td;
  }
  document.getElementById("rows").appendChild(row);
  const figure = document.createElement("figure");
  figure.dataset.stream = id;
  const img = document.createElement("img");
  img.alt = "latest frame of " + id;
  const caption = document.createElement("figcaption");
  caption.textContent = id + ": waiting for a frame";
  figure.append(img, caption);
  document.getElementById("frames").appendChild(figure);
  const s = {row, cells, figure, img, caption, busy: false, url: null};
  streams.set(id, s);
  return s;
}

async function refreshFrame(id, s) {
  if (s.busy) return;  // one request per stream at a time
  s.busy = true;
  try {
    const r = await fetch("frame/" + encodeURIComponent(id) + ".jpg?t=" + Date.now(), {cache: "no-store"});
    if (!r.ok) { if (!s.url) s.caption.textContent = id + ": " + (await r.text()).trim(); return; }
    const url = URL.createObjectURL(await r.blob());
    await new Promise((resolve) => { s.img.onload = s.img.onerror = resolve; s.img.src = url; });
    if (s.url) URL.revokeObjectURL(s.url);
    s.url = url;
    s.caption.textContent = id;
  } catch (e) {
    // the daemon is gone or busy: try again on the next poll
  } finally {
    s.busy = false;
  }
}

async function poll() {
  const meta = document.getElementById("meta");
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    const data = await r.json();
    const seen = new Set();
    for (const row of data.streams) {
      seen.add(row.id);
      const s = streams.get(row.id) || add(row.id);
      for (const k of COLS) s.cells[k].textContent = fmt(k, row[k]);
      s.cells.state.className = "state " + row.state;
      s.row.title = row.source || "";
      refreshFrame(row.id, s);
    }
    for (const [id, s] of streams) {
      if (seen.has(id)) continue;
      s.row.remove();
      s.figure.remove();
      if (s.url) URL.revokeObjectURL(s.url);
      streams.delete(id);
    }
    meta.className = "";
    const shard = data.shard ? "shard " + data.shard.shard + " (left to the other shards: " +
      (data.shard.skipped.join(", ") || "none") + "), " : "";
    meta.textContent = shard + data.streams.length + " streams, updated " + new Date(data.time * 1000).toLocaleTimeString();
  } catch (e) {
    meta.className = "down";
    meta.textContent = "the daemon does not answer (" + e + "); retrying";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
poll();
</script>
</body>
</html>
""".replace("__POLL_MS__", str(POLL_MS))
