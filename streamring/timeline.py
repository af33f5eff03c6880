"""Draw the device timeline of a streamed forward (``streamring timeline``).

Input: the JSON written by ``bench/ep_layer.py --timeline-json`` (its ``timelines``
list), or one timeline object as returned by
:func:`streamring.moe.debug.timeline`. Every time is in microseconds from
the forward's start, read from the GPU's ``%globaltimer`` by stamp kernels on the streams.

One figure per timeline, one row per lane:

* ``produce c``: from the end of chunk c-1's production (or 0) to chunk c's layout publish, with
  ticks at the route and layout publications (and grey ones at the producer's own steps when stamped:
  writable, routed, own routes, quantized);
* ``dispatch c``: acquire of chunk c to its slot acknowledgement (rows copied into blocks);
* ``blocks c``: the GEMMs of the blocks chunk c made ready (start: after the dispatch and after
  the previous chunk's blocks, which share the GEMM stream), with the block count;
* ``seal + combine``: the partial blocks after the end-of-stream seal, then the combine;
* for comparison, the batch path as measured in the same run (producer, then MoE).
"""

from __future__ import annotations

import json
from pathlib import Path

from .moe.timeline_events import CHUNK_EVENTS, OPTIONAL_EVENTS, PRODUCER_STEPS, TAIL_EVENTS


class TimelineError(ValueError):
    """The input is not a timeline this command can draw (the message says what is missing)."""


def load_timelines(path: str | Path) -> list[dict]:
    """Timelines in a benchmark JSON (``timelines`` list) or a single timeline object."""
    p = Path(path)
    if not p.is_file():
        raise TimelineError(f"{p}: no such file")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise TimelineError(f"{p}: not JSON ({exc})") from exc
    items = data.get("timelines") if isinstance(data, dict) and "timelines" in data else [data]
    if not isinstance(items, list) or not items:
        raise TimelineError(f"{p}: 'timelines' is empty (run the benchmark with --timeline-json)")
    good = []
    for i, t in enumerate(items):
        if not isinstance(t, dict):
            raise TimelineError(f"{p}: timeline {i} is not an object")
        if t.get("error"):
            continue  # a config whose timeline could not be recorded: reported by the benchmark
        for key in ("chunks", "tail", "tokens", "policy"):
            if key not in t:
                raise TimelineError(f"{p}: timeline {i} has no '{key}' field (expected the output of "
                                    f"streamring.moe.debug.timeline(buffer))")
        for c, ch in enumerate(t["chunks"]):
            missing = [e for e in CHUNK_EVENTS if e not in ch and e not in OPTIONAL_EVENTS]
            if missing:
                raise TimelineError(f"{p}: timeline {i} chunk {c} lacks events {missing}; expected {list(CHUNK_EVENTS)}")
        missing = [e for e in TAIL_EVENTS if e not in t["tail"]]
        if missing:
            raise TimelineError(f"{p}: timeline {i} tail lacks events {missing}; expected {list(TAIL_EVENTS)}")
        good.append(t)
    if not good:
        raise TimelineError(f"{p}: every timeline in the file carries an error")
    return good


def lanes(t: dict) -> list[tuple[str, float, float, str]]:
    """The bars of one timeline: (lane label, start us, end us, kind)."""
    bars = []
    prev_prod = 0.0
    prev_blocks = 0.0
    for c, ch in enumerate(t["chunks"]):
        bars.append((f"produce {c}", ch.get("produce_start", prev_prod), ch["layout_published"], "producer"))
        prev_prod = ch["layout_published"]
        bars.append((f"dispatch {c}", ch["acquired"], ch["dispatched_acked"], "dispatch"))
        start = max(ch["dispatched_acked"], prev_blocks)
        bars.append((f"blocks {c} ({ch.get('blocks_ready', '?')})", start, ch["blocks_done"], "blocks"))
        prev_blocks = ch["blocks_done"]
    tail = t["tail"]
    bars.append((f"seal blocks ({tail.get('seal_blocks', '?')})", prev_blocks, tail["seal_blocks_done"], "blocks"))
    bars.append(("combine", tail["seal_blocks_done"], tail["combine_done"], "combine"))
    return bars


COLORS = {"producer": "#4C72B0", "dispatch": "#DD8452", "blocks": "#55A868", "combine": "#C44E52",
          "batch-producer": "#8DA0CB", "batch-moe": "#A6D854"}


def draw(timelines: list[dict], out: str | Path) -> Path:
    """Draw every timeline (one panel each) into the PNG ``out``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(timelines)
    heights = [0.32 * (len(lanes(t)) + 3) + 0.8 for t in timelines]
    fig, axes = plt.subplots(n, 1, figsize=(12, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, t in zip(axes[:, 0], timelines):
        bars = lanes(t)
        labels = []
        y = 0
        bm = t.get("batch_ms")
        if isinstance(bm, dict):
            ax.barh(y, bm["producer"] * 1e3, left=0, color=COLORS["batch-producer"], height=0.6)
            ax.barh(y, bm["total"] * 1e3 - bm["producer"] * 1e3, left=bm["producer"] * 1e3, color=COLORS["batch-moe"],
                    height=0.6)
            labels.append(f"batch path ({bm['total']:.2f} ms)")
            y += 1
        elif bm:  # the batch forward's median time only
            ax.barh(y, bm * 1e3, left=0, color=COLORS["batch-moe"], height=0.6)
            labels.append(f"batch path ({bm:.2f} ms)")
            y += 1
        for label, a, b, kind in bars:
            ax.barh(y, max(b - a, 0.5), left=a, color=COLORS[kind], height=0.6)
            labels.append(label)
            y += 1
        for c, ch in enumerate(t["chunks"]):  # publication ticks on the producer lanes
            row = (1 if bm else 0) + 3 * c
            for ev in ("route_published", "layout_published"):
                ax.plot([ch[ev], ch[ev]], [row - 0.35, row + 0.35], color="black", lw=0.8)
            for ev in PRODUCER_STEPS:  # the producer's own steps, when stamped
                if ev in ch:
                    ax.plot([ch[ev], ch[ev]], [row - 0.25, row + 0.25], color="grey", lw=0.6)
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("device time since the forward's start (us, %globaltimer)")
        sm = t.get("streamed_ms")
        who = f"PE {t['rank']} of {t['ranks']}: " if "rank" in t else ""
        ax.set_title(who + f"{t['tokens']} tokens, {len(t['chunks'])} chunks of {t.get('chunk_tokens')}, "
                     f"{t.get('num_slots')} slots, block_m {t.get('block_m')}, policy {t['policy']}"
                     + (f" - streamed {sm:.2f} ms (graph median)" if sm else ""), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def overlap_summary(t: dict) -> dict:
    """What the stamps say about overlap: for each chunk c >= 1, whether it was published while
    the blocks of chunk c-1 were still computing, and by how much (us; negative: after)."""
    ch = t["chunks"]
    lead = [ch[c - 1]["blocks_done"] - ch[c]["layout_published"] for c in range(1, len(ch))]
    return {"chunks_published_during_prev_blocks": sum(1 for v in lead if v > 0), "chunks_after_first": len(lead),
            "publish_lead_us": lead, "first_chunk_exposed_us": ch[0]["dispatched_acked"],
            "forward_us": t["tail"]["combine_done"]}
