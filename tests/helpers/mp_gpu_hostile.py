"""A hostile peer on the device: the EP layer's checked acquire refuses every corrupt metadata word.

Run by tests/gpu/test_gpu_hostile.py on a GPU (and by the GPU check): one PE with
``python tests/helpers/mp_gpu_hostile.py SCENARIO ...``, several with ``mpiexec -n N python ...`` (one GPU
per PE, or several PEs on one GPU under MPS). The GPU form of tests/helpers/mp_ring_rules.py's table.

* ``hostile_table``: the last PE (the hostile one) publishes chunk 1 of epoch 3 (slot 1, token base 4,
  3 valid tokens of 4), then overwrites one word it controls at a time, between host barriers (no
  result depends on timing): its metadata words (chunk index, token base, valid count, both
  generations, the timestamps), a ``topk_idx`` entry, and the route/layout generation words it
  signals into every PE. Every PE then runs the device check of the EP layer on that chunk:
  ``ring_acquire_checked`` and ``ring_wait_any`` (rank and ready source order, both transports) for
  the metadata and generation rows, ``ep_gather`` for the ``topk_idx`` rows. Each row must end in its
  documented status word (RE_META naming the source, chunk and word; RE_NEWER_GEN; an acquire
  timeout for an older generation, which is "not yet"; the ``bad_routes`` count for an expert id
  outside [-1, E)), or in no error where the value is legal (a valid count in [0, C]: consumers learn
  the count from this word, since a peer's count varies per forward); the count the check learned is
  the word's value when accepted and 0 when refused; and nothing is written into any ring.
  Out-of-bounds reads are compute-sanitizer's part (launch/sanitize.sh runs this table under it).
* ``layer_broken``: an :class:`~streamring.moe.ep_buffer.EPBuffer` whose hostile peer corrupts its valid
  count past its slot (then, rebuilt, a ``topk_idx`` entry) in a real forward: every PE reports it and
  the buffer refuses ``forward``, ``capture`` and ``replay`` until it is closed and rebuilt; the rebuilt
  buffer computes what a clean one does, bit for bit.

Each scenario prints ``SCENARIO OK <name>`` on PE 0 when every PE agrees; else every failed row and
exit status 1. The row table and its judge are plain Python (tests/gpu/test_gpu_hostile.py checks them
on the CPU).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
U64 = (1 << 64) - 1

# the ring of the table: E experts, top-K, C tokens per slot, S slots; chunk CH of epoch EPOCH
E, K, C, S = 12, 3, 4, 2
EPOCH, CH, NCH = 3, 1, 2
BASE, VALID = CH * C, 3  # chunk 1: token base 4, 3 valid tokens (a partial chunk)


@dataclass(frozen=True)
class Row:
    """One corruption: ``target`` is ("meta", word) | ("topk", token, k) | ("gen", "route"|"layout");
    ``want`` is "ok", ("meta", field name), "newer", "older" or "bad_route"."""

    label: str
    target: tuple
    value: int
    want: object


def hostile_rows() -> list[Row]:
    """Every word a peer controls, at boundary values on both sides (the CPU table's values)."""
    from streamring.device.ringdesc import META_FIELD_NAMES
    from streamring.ring.layout import (
        MAX_EPOCH, MAX_SEQ, META_BASE, META_CHUNK, META_LAYOUT_GEN, META_LAYOUT_NS, META_ROUTE_GEN, META_ROUTE_NS,
        META_VALID, gen_str, make_gen,
    )

    g = make_gen(EPOCH, CH + 1)
    old_epoch_same_seq = make_gen(EPOCH - 1, CH + 1)
    common = {E, -1, -2, BASE - 1, BASE + 1, VALID + 1, old_epoch_same_seq}
    gens = common | {0, make_gen(EPOCH, CH), make_gen(EPOCH, CH + 1 + S), make_gen(EPOCH + 1, CH + 1), INT64_MAX}
    meta = {META_CHUNK: common | {CH - 1, CH + 1, INT64_MAX}, META_BASE: common | {0, C, INT64_MIN},
            META_VALID: common | {0, VALID - 1, C, C + 1, INT64_MAX}, META_ROUTE_GEN: gens, META_LAYOUT_GEN: gens}
    published = {META_CHUNK: CH, META_BASE: BASE, META_VALID: VALID, META_ROUTE_GEN: g, META_LAYOUT_GEN: g}
    rows = [Row("(every word as published)", ("none",), 0, "ok")]
    for word, values in meta.items():
        field = META_FIELD_NAMES[word]
        for v in sorted(values):
            if v != published[word]:
                # a valid count is the peer's to choose within the slot (it varies per forward): any value of
                # [0, C] is taken as it is; everything else of a word is refused
                legal = word == META_VALID and 0 <= v <= C
                rows.append(Row(f"meta {field} = {v}", ("meta", word), v, "ok" if legal else ("meta", field)))
    # timestamps and the spare word feed statistics only: any value is harmless
    for word in (META_ROUTE_NS, META_LAYOUT_NS, 7):
        for v in (-1, INT64_MAX):
            rows.append(Row(f"meta word {word} = {v}", ("meta", word), v, "ok"))
    # topk_idx: -1 is a legal (masked) route; below -1 and from E on are corrupt, counted and dropped
    for v in (E, E + 1, -2, INT64_MIN, INT64_MAX):
        rows.append(Row(f"topk_idx[1][2] = {v}", ("topk", 1, 2), v, "bad_route"))
    for v in (-1, 0, E - 1):
        rows.append(Row(f"topk_idx[1][2] = {v}", ("topk", 1, 2), v, "ok"))
    rows.append(Row(f"topk_idx[{VALID}][0] = {E} (beyond the valid rows)", ("topk", VALID, 0), E, "ok"))
    # the generation words the peer signals into every consumer: newer is a violation, older "not yet"
    for kind in ("route", "layout"):
        for v in (make_gen(EPOCH, CH + 1 + S), make_gen(EPOCH, CH), make_gen(EPOCH + 1, CH + 1),
                  make_gen(MAX_EPOCH, 1), U64):
            rows.append(Row(f"{kind}_ready_gen := {gen_str(v)}", ("gen", kind), v, "newer"))
        for v in (0, old_epoch_same_seq, make_gen(EPOCH - 1, MAX_SEQ)):
            rows.append(Row(f"{kind}_ready_gen := {gen_str(v)}", ("gen", kind), v, "older"))
    return rows


def checks_of(row: Row) -> tuple[str, ...]:
    """The device checks a row goes through: the acquire of both source orders, or the route gather."""
    return ("gather",) if row.target[0] == "topk" else ("acquire", "ready")


def judge_row(row: Row, check: str, st: dict, bad: int, evil: int, entry_out: int | None = None,
              local_experts: int | None = None) -> list[str]:
    """What is wrong with device status ``st`` (``decode_status``) and dropped-route count ``bad`` after
    ``check`` of ``row`` (``entry_out``: the gather's output of the corrupted entry); [] when right."""
    from streamring.device.ringdesc import ERROR_CODES

    err = st.get("first_error")
    want = row.want
    problems = []
    value = row.value & U64
    if want == "ok":
        if err is not None or st.get("violations") or st.get("timeouts") or bad:
            problems.append(f"refused a legal value: status {st}, dropped routes {bad}")
        return problems
    if want == "bad_route":
        if bad != 1:
            problems.append(f"dropped routes = {bad}, expected 1")
        if entry_out is not None and local_experts is not None and entry_out != local_experts:
            problems.append(f"the corrupt entry came out as local expert {entry_out}, not dropped "
                            f"({local_experts})")
        if err is not None:
            problems.append(f"unexpected ring error {err}")
        return problems
    if err is None:
        return [f"accepted: no error in the status words ({st})"]
    code = err["code"]
    if isinstance(want, tuple):  # ("meta", field)
        expect = (ERROR_CODES["RE_META"], evil, CH, want[1], hex(value))
        got = (code, err["src"], err["chunk"], err["field"], err["seen"])
        if got != expect:
            problems.append(f"status word (code, src, chunk, field, seen) = {got}, expected {expect}")
        if not st.get("violations"):
            problems.append("no violation counted")
    elif want == "newer":
        expect = (ERROR_CODES["RE_NEWER_GEN"], evil, CH, hex(value))
        got = (code, err["src"], err["chunk"], err["seen"])
        if got != expect:
            problems.append(f"status word (code, src, chunk, seen) = {got}, expected {expect}")
    elif want == "older":
        # "not yet": the consumer keeps waiting until its deadline, then records where it waited
        expect = (ERROR_CODES["RE_ACQUIRE_TIMEOUT"], evil, CH)
        got = (code, err["src"], err["chunk"])
        if got != expect:
            problems.append(f"status word (code, src, chunk) = {got}, expected {expect} (a timeout: older is "
                            f"'not yet')")
        if check == "acquire" and err["seen"] != hex(value):
            problems.append(f"the timeout's last seen generation is {err['seen']}, expected {hex(value)}")
    return problems


# ------------------------------------------------------------------------------------------------
# On the GPU
# ------------------------------------------------------------------------------------------------
def _i64(v: int) -> int:
    v &= U64
    return v - (1 << 64) if v >= 1 << 63 else v


def hostile_table(heap) -> list[str]:
    import torch

    from streamring.device import ep_triton as KT
    from streamring.device.ringdesc import RING_LAYOUT, RING_ROUTE
    from streamring.device.verbs import SignalOp
    from streamring.ring.device import DeviceRing
    from streamring.ring.layout import RingLayout

    R, me = heap.num_ranks, heap.rank
    evil = R - 1
    dev = heap.device
    L = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=C, hidden=128, topk=K, num_experts=E)
    slot = CH % S
    e_loc = E // R
    valid_tab = torch.full((NCH, R), C, dtype=torch.int32, device=dev)
    valid_tab[CH] = VALID
    failures = []
    rows = hostile_rows()
    for transport in ("p2p", "nv"):
        ring = DeviceRing(heap, L, NCH, transport=transport, deadline_s=0.05, name=f"hostile-{transport}")
        ring.set_epoch(EPOCH)
        st_ = torch.cuda.current_stream()
        loc64 = ring.region.local.view(torch.int64)
        locf = ring.region.local.view(torch.float32)
        t = torch.arange(BASE, BASE + C, device=dev)[:, None]
        k = torch.arange(K, device=dev)[None, :]
        idx = ((me + t * K + k) % (E + 1) - 1).to(torch.int64)  # every value of [-1, E): -1 a masked route
        loc64[L.topk_idx_off(slot) // 8: L.topk_idx_off(slot) // 8 + C * K] = idx.flatten()
        locf[L.topk_weights_off(slot) // 4: L.topk_weights_off(slot) // 4 + C * K] = 0.5
        ring.publish(st_, CH, RING_ROUTE, VALID)
        ring.publish(st_, CH, RING_LAYOUT, VALID)
        torch.cuda.synchronize(dev)
        heap.barrier()
        pending = torch.zeros(1, dtype=torch.int64, device=dev)
        chosen = torch.zeros(1, dtype=torch.int32, device=dev)
        src_list = torch.tensor([evil], dtype=torch.int32, device=dev)
        out_e = torch.zeros(C * K, dtype=torch.int32, device=dev)
        out_w = torch.zeros(C * K, dtype=torch.float32, device=dev)
        bad = torch.zeros(1, dtype=torch.int32, device=dev)
        if ring.p2p_ok:
            delta = ring.peers_t - ring.buf
            d64, d32 = (delta // 8).contiguous(), (delta // 4).contiguous()

        def word_off(target):
            if target[0] == "meta":
                return L.meta_off(slot) + target[1] * 8
            if target[0] == "topk":
                return L.topk_idx_off(slot, target[1]) + target[2] * 8
            return (L.route_gen_off if target[1] == "route" else L.layout_gen_off)(evil, slot)

        def set_word(target, value):
            """The hostile PE writes its own slot's word, or signals the generation into every PE."""
            off = word_off(target)
            if target[0] == "gen":
                for pe in range(R):
                    heap.signal_op(ring.region, off, value & U64, SignalOp.SET, pe)
            else:
                loc64[off // 8] = _i64(value)
                torch.cuda.synchronize(dev)

        for row in rows:
            for check in checks_of(row):
                if check == "gather" and (transport != "p2p" or not ring.p2p_ok):
                    continue  # the gather kernel is transport-free: once, through the peer pointers
                heap.barrier()
                restore = None
                if me == evil and row.target[0] != "none":
                    off = word_off(row.target)
                    restore = int(loc64[off // 8].item()) if row.target[0] != "gen" else None
                    set_word(row.target, row.value)
                heap.barrier()
                ring.status_t.zero_()
                bad.zero_()
                valid_tab[CH, evil] = VALID  # the gather reads the count an acquire learned
                before = ring.region.local.clone()
                if check == "acquire":
                    ring.acquire_checked(st_, CH, valid_tab, src0=evil, sources=1)
                elif check == "ready":
                    pending.fill_(1 << evil)
                    ring.wait_any(st_, CH, valid_tab, pending, False, chosen)
                else:
                    KT.ep_gather(ring.region.local.view(torch.int64), locf, d64, d32, src_list, valid_tab, CH,
                                 me * e_loc, L.topk_idx_off(slot) // 8, L.topk_weights_off(slot) // 4, out_e, out_w,
                                 bad, num_ranks=R, tokens_per_slot=C, topk=K, local_experts=e_loc, num_experts=E)
                torch.cuda.synchronize(dev)
                st = ring.status()
                entry = None
                if row.target[0] == "topk":
                    entry = int(out_e[row.target[1] * K + row.target[2]].item())
                    # a legal id routes to me only when it is one of my experts
                problems = judge_row(row, check, st, int(bad.item()), evil, entry if row.want == "bad_route" else None,
                                     e_loc)
                if check in ("acquire", "ready"):
                    from streamring.ring.layout import META_VALID

                    learned = int(valid_tab[CH, evil].item())
                    want_learned = 0 if row.want != "ok" else (row.value if row.target == ("meta", META_VALID)
                                                                else VALID)
                    if learned != want_learned:
                        problems.append(f"the check learned a valid count of {learned}, expected {want_learned}")
                if not torch.equal(before, ring.region.local):
                    problems.append("the check wrote into this PE's ring")
                if check == "ready" and row.want != "ok" and int(chosen.item()) != evil:
                    problems.append(f"ready order chose source {int(chosen.item())}, the only pending one is {evil}")
                if problems:
                    failures.append(f"PE {me}, {transport}, {check}: {row.label}: " + "; ".join(problems))
                heap.barrier()
                if me == evil and row.target[0] != "none":
                    if row.target[0] == "gen":
                        from streamring.ring.layout import make_gen

                        set_word(row.target, make_gen(EPOCH, CH + 1))
                    else:
                        set_word(row.target, restore)
        heap.barrier()
        # restored: the chunk passes every check again (the table broke nothing)
        ring.status_t.zero_()
        for src in range(R):
            ring.acquire_checked(st_, CH, valid_tab, src0=src, sources=1)
        torch.cuda.synchronize(dev)
        st = ring.status()
        if st["first_error"] is not None or st["violations"] or st["timeouts"]:
            failures.append(f"PE {me}, {transport}: after the table, the restored chunk is refused: {st}")
        heap.barrier()
        ring.close()
    n = len(rows)
    print_once(heap, f"hostile peer on the device: {n} rows x checks refused or accepted as required on {R} PEs "
                     f"(p2p and nv transports)")
    return failures


def layer_broken(heap) -> list[str]:
    """The buffer refuses to go on after a hostile peer's corrupt word, until closed and rebuilt."""
    import torch

    from streamring.device.ringdesc import META_VALID
    from streamring.moe.ep_buffer import EPBuffer
    from streamring.moe.tuning import EPTuning
    from streamring.moe.math import MoEShape
    from streamring.moe.weights import MoEWeights

    R, me = heap.num_ranks, heap.rank
    evil = R - 1
    dev = heap.device
    shape = MoEShape(hidden=512, intermediate=256, num_experts=16, topk=4, router="deepseek_v3", n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)
    mw = MoEWeights.random_fp8(shape, 7, dev)
    T = 97
    g = torch.Generator(device=dev)
    g.manual_seed(11 + me)
    x = torch.randn(T, shape.hidden, generator=g, device=dev).to(torch.bfloat16)
    failures = []

    def make():
        buf = EPBuffer(heap, shape, max_tokens_per_rank=T, num_slots=2, tokens_per_slot=40, deadline_s=0.5,
                       gemm="triton", tuning=EPTuning(block_m=16, policy="spin_kernel"), name="hostile-layer")
        return buf, buf.prepare_weights(mw)

    def corrupt_once(buf, what):
        """On the hostile PE: between its route and layout publications of chunk 0 (so every consumer
        sees it: they read only after the layout generation), overwrite a word it published. Chunk 0
        holds 40 tokens, a full slot: its valid count + 1 is past the slot."""
        path = buf.paths["stream"]
        real = buf.pipeline.producer.layout
        done = []

        def hooked(x_rows, slot, n):
            if not done:
                done.append(1)
                if what == "valid":
                    words = path.ring.region.local.view(torch.int64)
                    i = path.ring.layout.meta_off(0) // 8 + META_VALID
                    words[i] = words[i] + 1
                else:
                    path.slots[0]["topk_idx"][0, 0] = shape.num_experts
            return real(x_rows, slot, n)

        if me == evil:
            buf.pipeline.producer.layout = hooked

    def expect_refusal(buf, w, graph, what):
        msgs = []
        for name, call in (("forward", lambda: buf.forward(x, w, streaming=True)),
                           ("capture", lambda: buf.capture(x, w, torch.zeros_like(x), streaming=True)),
                           ("replay", lambda: buf.replay(graph))):
            try:
                call()
                msgs.append(f"{what}: {name} was not refused")
            except RuntimeError as exc:
                if "build a new EPBuffer" not in str(exc):
                    msgs.append(f"{what}: {name} refused without saying how to recover: {exc}")
        return msgs

    buf, w = make()
    y = torch.zeros_like(x)
    buf.forward(x, w, streaming=True, out=y)
    heap.barrier()
    graph = buf.capture(x, w, y, streaming=True)
    heap.barrier()
    buf.replay(graph)
    clean = y.clone()
    heap.barrier()
    # 1. the hostile peer's valid count, one above its slot
    corrupt_once(buf, "valid")
    buf.forward(x, w, streaming=True, out=y)
    torch.cuda.synchronize(dev)
    st = buf.status()
    err = st["first_error"] or {}
    got = (err.get("what"), err.get("src"), err.get("chunk"), err.get("field"))
    if got != ("metadata mismatch", evil, 0, "valid count") or not st["violations"]:
        failures.append(f"PE {me}: corrupt valid count: status {st}, expected RE_META from source {evil}, chunk 0, "
                        f"valid count")
    failures += [f"PE {me}: {m}" for m in expect_refusal(buf, w, graph, "after a corrupt valid count")]
    del graph
    heap.barrier()
    buf.close()
    # 2. rebuilt: clean again, and bit for bit what the first buffer computed
    buf, w = make()
    buf.forward(x, w, streaming=True, out=y)
    heap.barrier()
    graph = buf.capture(x, w, y, streaming=True)
    heap.barrier()
    y.zero_()
    buf.replay(graph)
    if not torch.equal(y.view(torch.int16), clean.view(torch.int16)):
        failures.append(f"PE {me}: the rebuilt buffer's output differs from the first clean one")
    heap.barrier()
    # 3. a corrupt expert id: dropped and counted on every PE, and the buffer refuses to go on
    corrupt_once(buf, "topk")
    buf.forward(x, w, streaming=True, out=y)
    torch.cuda.synchronize(dev)
    st = buf.status()
    if st["bad_routes"] < 1:
        failures.append(f"PE {me}: corrupt topk_idx from source {evil}: bad_routes {st['bad_routes']}, expected >= 1")
    failures += [f"PE {me}: {m}" for m in expect_refusal(buf, w, graph, "after a corrupt topk_idx")]
    del graph
    heap.barrier()
    buf.close()
    print_once(heap, f"the buffer refuses to go on after a hostile peer's word, until rebuilt, on {R} PEs")
    return failures


def print_once(heap, text: str) -> None:
    if heap.rank == 0:
        print(text, flush=True)


SCENARIOS = {"hostile_table": hostile_table, "layer_broken": layer_broken}


def main(argv: list[str]) -> int:
    unknown = [a for a in argv if a not in SCENARIOS]
    if not argv or unknown:
        print(f"usage: mp_gpu_hostile.py SCENARIO ...; scenarios: {list(SCENARIOS)} (unknown: {unknown})",
              file=sys.stderr)
        return 2
    from streamring.device.nvshmem import NvshmemHeap
    from streamring.host.launch import detect_launcher

    heap = NvshmemHeap.bootstrap(launcher=detect_launcher().value)
    code = 0
    for name in argv:
        try:
            mine = SCENARIOS[name](heap)
        except Exception as exc:  # noqa: BLE001 - a crash mid-table: the other PEs wait in a collective
            import traceback

            traceback.print_exc()
            if heap.num_ranks > 1:
                from streamring.host.bootstrap import abort_job

                abort_job(exc)  # ends every PE of the job, non-zero
            mine = [f"PE {heap.rank}: {type(exc).__name__}: {exc}"]
        every = [f for fs in heap.allgather_obj(mine) for f in fs]
        if heap.rank == 0:
            if every:
                print(f"SCENARIO FAILED {name}: {len(every)} problems\n  " + "\n  ".join(every), flush=True)
            else:
                print(f"SCENARIO OK {name}", flush=True)
        code |= bool(every)
    heap.close()
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
