"""``streamring`` command line: a thin layer over the library API.

The commands and their options are :func:`build_parser`'s; :func:`synopsis` renders them as the synopsis
of docs/cli.md (a test holds the page to it). Without a launcher, ``run`` and ``stress`` start
``--ranks`` local ranks themselves (the embedded default); under ``mpirun`` they use the ranks that
exist. Exit codes: 0 success, 1 a check failed or a rank raised, 2 bad arguments or config.
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_config
from .verify.names import EP_INJECT_MODES, LAYERS, MODEL_INJECT_MODES, QUEUE_INJECT_MODES
from .ring.policies import INJECT_MODES, PROGRESS_POLICIES, SOURCE_ORDERS

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
#: What a CPU rank of each command imports before its first step: the local launcher's preload server
#: imports these once per job and starts the ranks as its forks (streamring.host.preload).
RANK_MODULES = {
    "run": ("streamring.cli", "streamring.host.rank_main", "streamring.runner", "torch", "streamring.moe.layer",
            "streamring.moe.math", "streamring.moe.bitwise", "streamring.moe.ep_buffer"),
    "stress": ("streamring.cli", "streamring.host.rank_main", "streamring.verify.stress"),
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help="YAML config (default: the embedded default config)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override a config key, dotted (ring.num_slots=3); repeatable")
    p.add_argument("--ranks", type=int, metavar="N",
                   help="local ranks to start when no launcher is used (config: ranks)")
    p.add_argument("--backend", choices=["cpu", "nvshmem"], help="symmetric-heap backend (config: backend)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="streamring", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="stream the MoE layer through the ring and compare with the batch path")
    _common(p)
    p = sub.add_parser("stress", help="protocol stress with random delays; exit 0 iff no violation")
    _common(p)
    p.add_argument("--inject", choices=INJECT_MODES, help="deliberately break one protocol step")
    _add_model_check(sub)
    _add_gpu_check(sub)
    sub.add_parser("check-env", help="print what streamring finds on this machine")
    p = sub.add_parser("timeline", help="draw the device timeline of a streamed forward as a PNG")
    p.add_argument("input", metavar="JSON", help="bench/ep_layer.py --timeline-json output, or one timeline")
    p.add_argument("--out", metavar="PNG", default="timeline.png")
    p.add_argument("--tokens", type=int, nargs="+", action="extend", metavar="N",
                   help="only the timelines of these token counts (--tokens 1024 4096; repeatable)")
    return ap


def _add_model_check(sub) -> None:
    """``streamring model-check``: the protocol model's size (ranks, slots, chunks, epochs), its layer and the
    mutation it checks."""
    p = sub.add_parser("model-check", help="explore every interleaving of the protocol model")
    p.add_argument("--layer", choices=LAYERS + ("queue",), default="ring",
                   help="ring: the ring protocol as the stress harness runs it (default); ep: plus the "
                        "expert-parallel GPU layer's handoffs (early input_consumed ack, remote combine and its "
                        "arrived counters, the owner's reduce; each rank begins its next epoch on its own); queue: "
                        "the persistent consumer's work queue on one PE (blocks published ready and sealed, CTAs "
                        "claiming L1/L2 tiles, L2 after its block's L1, arrivals, the owner's reduce)")
    p.add_argument("--inject", choices=MODEL_INJECT_MODES + QUEUE_INJECT_MODES, metavar="MODE",
                   help="check a deliberately broken protocol; must fail with a counter-example: "
                        f"{', '.join(INJECT_MODES)} (ring steps, --layer ring or ep); {', '.join(EP_INJECT_MODES)} "
                        f"(--layer ep only); {', '.join(QUEUE_INJECT_MODES)} (--layer queue only)")
    p.add_argument("--json", metavar="PATH",
                   help="write the result as JSON (sizes, states, transitions, time, every property, "
                        "the whole counter-example trace)")
    p.add_argument("--ranks", type=int, default=2, metavar="R",
                   help="ranks, each with a route and a layout producer and a consumer (--layer ep: also a "
                        "compute and the owner's reduce) (default 2)")
    p.add_argument("--slots", type=int, default=2, metavar="S", help="ring slots per rank (default 2)")
    p.add_argument("--chunks", type=int, default=3, metavar="C",
                   help="chunks per rank and epoch, one token each; odd ranks have one token fewer, so "
                        "their last chunk is empty (--layer queue: dispatch steps, the blocks' rows split over "
                        "them in order) (default 3)")
    p.add_argument("--epochs", type=int, default=2, metavar="E",
                   help="stream epochs over the same buffers, nothing cleared between them (default 2)")
    p.add_argument("--topk", type=int, default=None, metavar="K",
                   help="--layer ep: routed entries (token, k) per token, each to the rank "
                        "(owner + k * (token + epoch)) %% ranks (default 2)")
    p.add_argument("--ctas", type=int, default=2, metavar="N", help="--layer queue: CTAs of the persistent grid (default 2)")
    p.add_argument("--blocks", type=int, default=3, metavar="B",
                   help="--layer queue: expert blocks, filled in order over the chunks, the last one partial "
                        "(ready only at the seal) (default 3)")
    p.add_argument("--block-rows", type=int, default=2, metavar="M", help="--layer queue: rows of a full block (default 2)")
    p.add_argument("--tiles", type=int, default=2, metavar="T", help="--layer queue: N-tiles of L1 and of L2 per block (default 2)")
    p.add_argument("--group", type=int, default=2, metavar="G",
                   help="--layer queue: blocks per group of the item order (queue_order) (default 2)")
    p.add_argument("--source-order", choices=SOURCE_ORDERS, default="rank",
                   help="consumer order over the sources of a chunk (stress.source_order): rank (default) "
                        "or ready (any source whose chunk is ready first)")


def _add_gpu_check(sub) -> None:
    """``streamring gpu-check``: the GPU self-test's policies, replays, ring size and negative controls."""
    p = sub.add_parser("gpu-check", help="GPU self-test: the device ring under every progress policy, 10^4 CUDA-graph "
                                         "replays each, negative controls (needs a GPU and nvshmem4py)")
    p.add_argument("--policies", default="all", metavar="P,..|all", help=f"comma list of {list(PROGRESS_POLICIES)} or 'all'")
    p.add_argument("--replays", type=int, default=10000, metavar="N", help="graph replays per policy (each one ring epoch)")
    p.add_argument("--slots", type=int, default=4, metavar="S", help="ring slots")
    p.add_argument("--chunks", type=int, default=6, metavar="C", help="chunks per epoch")
    p.add_argument("--producer-sms", type=int, default=16, metavar="N", help="green_ctx: SMs of the producer (multiple of 8)")
    p.add_argument("--controls", action="store_true",
                   help="also run the negative controls (each inject mode must be detected)")
    p.add_argument("--control-replays", type=int, default=40, metavar="N", help="replays of each negative control")
    p.add_argument("--deadline-s", type=float, default=10.0, metavar="S", help="deadline of every device wait")
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="PEs to start when no launcher is used (under mpirun/torchrun: the job's ranks)")
    p.add_argument("--json", metavar="PATH", help="write every check's result as JSON")


def _option_synopsis(a: argparse.Action) -> str:
    if not a.option_strings:  # a positional argument
        return a.metavar or a.dest.upper()
    flag = max(a.option_strings, key=len)
    if a.nargs == 0:
        return f"[{flag}]"
    value = a.metavar or ("|".join(map(str, a.choices)) if a.choices else a.dest.upper())
    many = isinstance(a, argparse._AppendAction) or a.nargs in ("+", "*")
    return f"[{flag} {value}{' ...' if many else ''}]"


def synopsis(width: int = 110) -> str:
    """The synopsis of every command, one entry per command (wrapped at ``width``), from :func:`build_parser`:
    what docs/cli.md shows (tests/unit/test_docs_cli.py holds the page to it)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    pad = max(map(len, sub.choices)) + len("streamring ") + 1
    lines = []
    for name, p in sub.choices.items():
        words = [_option_synopsis(a) for a in p._actions if not isinstance(a, argparse._HelpAction)]
        line = f"streamring {name}".ljust(pad)
        for w in words:
            if len(line) + 1 + len(w) > width and line.strip() != f"streamring {name}":
                lines.append(line.rstrip())
                line = " " * pad
            line += w + " "
        lines.append(line.rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "check-env":
        from .host.envcheck import check_env

        return check_env()
    if args.command == "timeline":
        return _timeline(args)
    if args.command == "model-check":
        return _model_check(args)
    if args.command == "gpu-check":
        return _gpu_check(args, argv)
    return _run_job(args, argv)


def _timeline(args) -> int:
    """``streamring timeline``: draw the timelines (those of ``--tokens``) and print one overlap line per timeline;
    an input without a matching timeline is a usage error."""
    from .timeline import TimelineError, draw, load_timelines, overlap_summary

    try:
        tls = load_timelines(args.input)
        if args.tokens:
            tls = [t for t in tls if t["tokens"] in args.tokens]
            if not tls:
                raise TimelineError(f"{args.input}: no timeline for tokens {args.tokens}")
    except TimelineError as exc:
        print(f"streamring timeline: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = draw(tls, args.out)
    for t in tls:
        s = overlap_summary(t)
        print(f"{t['tokens']} tokens, {len(t['chunks'])} chunks, {t['policy']}: "
              f"{s['chunks_published_during_prev_blocks']} of {s['chunks_after_first']} later chunks published "
              f"while the previous chunk's blocks computed (lead us: "
              f"{', '.join(f'{v:+.0f}' for v in s['publish_lead_us'])}); first chunk dispatched at "
              f"{s['first_chunk_exposed_us']:.0f} us of {s['forward_us']:.0f} us")
    print(f"wrote {out}")
    return EXIT_OK


def _model_check(args) -> int:
    """``streamring model-check``: the work queue's model (``--layer queue``) or the ring's (ring, ep); a queue
    mutation asked of the ring's model is a usage error."""
    from .host import report

    if args.layer == "queue":
        from .verify.queue import queue_check_main

        return queue_check_main(args, report)
    if args.inject in QUEUE_INJECT_MODES:
        print(f"streamring model-check: --inject {args.inject} breaks a handoff of the work queue: it needs "
              f"--layer queue", file=sys.stderr)
        return EXIT_USAGE
    from .verify.search import model_check_main

    return model_check_main(args, report)


def _run_job(args, argv: list[str]) -> int:
    """``streamring run`` / ``stress``: load the config, then start the ranks here (no launcher) or run as
    one rank of the job a launcher started (torchrun with the CPU backend: its heap is checked first)."""
    try:
        overrides = list(args.overrides)
        if getattr(args, "inject", None):
            overrides.append(f"stress.inject={args.inject}")
        cfg = load_config(args.config, overrides, ranks=args.ranks, backend=args.backend)
    except ConfigError as exc:
        print(f"streamring: {exc}", file=sys.stderr)
        return EXIT_USAGE

    from .host.launch import LaunchError, Launcher, detect_launcher

    launcher = detect_launcher()
    if launcher is Launcher.LOCAL:
        return _spawn_job(args, argv, cfg)
    if launcher is Launcher.TORCHRUN and cfg.backend == "cpu":
        from .host.bootstrap import make_heap

        try:
            make_heap(cfg, launcher)
        except LaunchError as exc:
            print(f"streamring: {exc}", file=sys.stderr)
            return EXIT_USAGE
    from .host.rank_main import rank_main

    return rank_main(args.command, cfg, json_path=args.json)


def _spawn_job(args, argv: list[str], cfg) -> int:
    """Start ``cfg.ranks`` local ranks of this command line and return the job's exit code. Everything knowable
    before a rank starts is reported once, here (exit 2); a stress run with a mutation whose ranks ended with
    errors gets its verdict from them, said last."""
    from .host.launch import LaunchError, spawn_local
    from .host.prelaunch import job_problems

    problems = job_problems(args.command, cfg, cfg.ranks, args.json, ranks_on_this_node=cfg.ranks)
    for p in problems:
        print(f"streamring: {p}", file=sys.stderr)
    if problems:
        return EXIT_USAGE
    try:
        preload = RANK_MODULES[args.command] if cfg.backend == "cpu" else ()
        errors: dict = {}
        rc = spawn_local(cfg.ranks, argv, preload=preload, errors=errors)
    except LaunchError as exc:
        print(f"streamring: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "stress" and cfg.stress.inject != "none" and errors:
        # the ranks ended with errors, not with rank 0's report and its verdict: say it last, from them
        from .verify.inject_verdict import stress_error_verdict

        print(stress_error_verdict(cfg.stress.inject, [errors[r] for r in sorted(errors)]), file=sys.stderr)
    return rc


def _gpu_check(args, argv: list[str]) -> int:
    """``streamring gpu-check``: start ``--ranks`` PEs (no launcher) or run on this rank."""
    policies = PROGRESS_POLICIES if args.policies == "all" else tuple(p.strip() for p in args.policies.split(","))
    bad = [p for p in policies if p not in PROGRESS_POLICIES]
    if bad:
        print(f"streamring gpu-check: --policies: unknown {bad}; allowed: {list(PROGRESS_POLICIES)} or 'all'",
              file=sys.stderr)
        return EXIT_USAGE
    from .device.nvshmem_boot import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:  # knowable before any rank starts: say it once
        print(f"streamring gpu-check: {reason}", file=sys.stderr)
        return EXIT_USAGE
    from .host.launch import LaunchError, Launcher, detect_launcher, spawn_local

    launcher = detect_launcher()
    if launcher is Launcher.LOCAL and args.ranks > 1:
        try:
            return spawn_local(args.ranks, argv)
        except LaunchError as exc:
            print(f"streamring: {exc}", file=sys.stderr)
            return EXIT_USAGE
    from .host.rank_main import gpu_check_main

    return gpu_check_main(launcher, policies=policies, replays=args.replays, slots=args.slots, chunks=args.chunks,
                          producer_sms=args.producer_sms, controls=args.controls,
                          control_replays=args.control_replays, deadline_s=args.deadline_s, json_path=args.json)


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    entry()
