"""Names of the per-chunk device timestamps of a streamed forward (shared by the GPU pipeline,
which records them, and ``streamring timeline``, which draws them; no GPU imports here)."""

# row c of the stamp table: chunk c
# inside the producer: after the straggler delay and the slot's reuse wait (it may write), after the router
# and top-k (or the caller's routing), after its own view of the routes, after the FP8 layout (the route and
# layout publications follow the last two)
PRODUCER_STEPS = ("writable", "routed", "own_routes", "quantized")
CHUNK_EVENTS = ("route_published", "layout_published", "acquired", "dispatched_acked", "blocks_done",
                "produce_start") + PRODUCER_STEPS
# after the GEMM call of a chunk's first dispatch step, when the chunk has more than one step (where the first
# source's blocks are done while a later source may still be pending)
FIRST_STEP_EVENTS = ("first_blocks_done",)
CHUNK_EVENTS = CHUNK_EVENTS + FIRST_STEP_EVENTS
# events older result files, or chunks of one dispatch step, may lack (drawn when present)
OPTIONAL_EVENTS = ("produce_start",) + PRODUCER_STEPS + FIRST_STEP_EVENTS
# last row: the whole forward
TAIL_EVENTS = ("start", "producer_done", "seal_blocks_done", "combine_done")
# int64 words per row (padded so that every row starts 64-byte aligned)
STAMP_STRIDE = 16
