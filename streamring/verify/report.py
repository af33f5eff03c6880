"""A model check's result and how it is printed: the summary, the properties table, the
counter-example's trace (its last steps on the console, every step in ``--json``), the verdict.

The tables are drawn by :mod:`streamring.host.report`, which the CLI hands in (``report``): this
package sits below host in the layering (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .inject_verdict import model_check_verdict

from .state import PROPERTY_TEXT

NOT_CHECKED = "NOT CHECKED (stopped at the first violation)"
TRACE_PRINT_MAX = 40  # console lines of a counter-example; --json has every step


@dataclass
class CheckResult:
    """The verdict of a check: sizes, what was explored, each property's result, the counter-example."""

    config: dict
    states: int = 0
    transitions: int = 0
    time_s: float = 0.0
    exhaustive: bool = True
    properties: dict = field(default_factory=dict)
    counterexample: dict | None = None
    serialised: dict | None = None
    final_reachable: bool | None = None
    terminal_states: int = 0
    violations_found: int = 0
    reduction: str = ""

    @property
    def ok(self) -> bool:
        return self.exhaustive and all(v == "PASS" for v in self.properties.values())

    def to_dict(self) -> dict:
        return {
            "command": "model-check",
            "config": self.config,
            "states": self.states,
            "transitions": self.transitions,
            "time_s": round(self.time_s, 3),
            "exhaustive": self.exhaustive,
            "reduction": self.reduction,
            "properties": dict(self.properties),
            "final_reachable": self.final_reachable,
            "counterexample": self.counterexample,
            "serialised": self.serialised,
            "ok": self.ok,
        }


def summary_lines(res: CheckResult) -> list[str]:
    c = res.config
    if res.exhaustive:
        kind = "exhaustive" + (", over the reduced graph" if c["por"] else "")
    elif res.counterexample is not None:
        kind = "stopped at the first violation"
    else:
        kind = f"BOUNDED at {c['max_states']} states: not a proof"
    layer = "" if c.get("layer", "ring") == "ring" else f"layer=ep (topk {c['topk']}), "
    return [
        f"streamring model-check: {c['ranks']} ranks x {c['slots']} slots x {c['chunks']} chunks x "
        f"{c['epochs']} epochs, {layer}inject={c['inject']}",
        f"explored {res.states} states, {res.transitions} transitions in {res.time_s:.2f}s ({kind})",
        f"reduction: {res.reduction}",
    ]


def print_properties(out, column, properties: dict, meaning: dict) -> None:
    """The properties table of a check (``out``: a :class:`~streamring.host.report.Report`; ``column``: its
    :class:`~streamring.host.report.Column`)."""
    from rich.text import Text

    rows = []
    for p, v in properties.items():
        style = "green" if v == "PASS" else ("red" if v == "FAIL" else "yellow")
        rows.append([p, meaning[p], Text(v, style=style)])
    out.table("properties", [column("property", justify="left"), column("meaning", justify="left", wrap=True),
                             column("result", justify="left")], rows)


def print_counterexample(out, ce: dict, how: str) -> None:
    """A counter-example's message and the last TRACE_PRINT_MAX steps of its trace (``how`` it was found)."""
    out.line(f"counter-example [{', '.join(ce['properties'])}]: {ce['message']}")
    out.line(f"  {how}, {ce['steps']} steps:")
    trace = ce["trace"]
    first = max(0, len(trace) - TRACE_PRINT_MAX)
    if first:
        out.line(f"  ... {first} earlier steps not shown (all in --json)")
    for i, line in enumerate(trace[first:], start=first + 1):
        out.line(f"  {i:3d}. {line}")


def print_verdict(out, res: CheckResult) -> None:
    out.line(f"PASS: every property holds ({len(res.properties)} checked in {res.states} states)" if res.ok else
             f"FAIL: {', '.join(p for p, v in res.properties.items() if v == 'FAIL') or 'the check'} failed")


def print_result(res: CheckResult, report) -> None:
    """Print ``res`` (``report``: :mod:`streamring.host.report`, handed in by the CLI)."""
    out = report.Report()
    for line in summary_lines(res):
        out.line(line)
    print_properties(out, report.Column, res.properties, PROPERTY_TEXT)
    ce = res.counterexample
    if ce:
        print_counterexample(out, ce, "shortest path (BFS)" if not res.config["por"] else
                             "path in the reduced graph, then shortened until no single step can be dropped")
    ser = res.serialised
    if ser and ser["result"] != "PASS":
        out.line(f"serialised schedule: {ser['error']}")
        for line in ser["trace_tail"]:
            out.line(f"    {line}")
    print_verdict(out, res)


def finish(res: CheckResult, print_fn, report, json_path) -> int:
    """The end of a ``streamring model-check`` run: ``print_fn(res, report)`` prints the tables, ``res`` goes
    to ``json_path`` as JSON when given; returns the exit code (0 iff every property holds, 1 on a
    counter-example)."""
    print_fn(res, report)
    if json_path:
        Path(json_path).write_text(json.dumps(res.to_dict(), indent=2))
    mode = res.config.get("inject") or "none"
    if mode != "none":  # the last line says whether a FAIL above is the expected result
        print(model_check_verdict(mode, res.counterexample is not None, res.exhaustive), flush=True)
    return 0 if res.ok else 1
