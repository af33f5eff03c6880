"""The random arrival skew of ``bench.ep_layer``: every PE's producer delayed by a fresh uniform draw in
``[0, skew_ms]`` at every replay, reproducible from a seed, so that every path of a run sees the same draws
and ``bench.cost_model`` can replay the draws a measured row was timed with.

numpy only (the cost model's check runs without torch's GPU parts)."""

from __future__ import annotations

import numpy as np

WARM_REPLAYS = 2  # warm-up replays before each timed round (bench.common.timed_rounds's default): not kept


def skew_seed(tokens_per_rank: int, experts_per_pe: int) -> int:
    """The draws' seed of one size and load: the same for every path measured at them."""
    return 31 * int(tokens_per_rank) + int(experts_per_pe)


def skew_delays_ms(skew_ms: float, replay: int, ranks: int, seed: int) -> list[float]:
    """Every PE's producer delay (ms) at replay ``replay`` (warm-ups counted) of a random-skew case."""
    return np.random.default_rng([seed, replay]).uniform(0.0, skew_ms, ranks).tolist()


def timed_skew_draws(skew_ms: float, replays: int, ranks: int, seed: int) -> list[list[float]]:
    """The delays of the ``replays`` timed replays of a round (after its ``WARM_REPLAYS`` warm-ups), in order."""
    return [skew_delays_ms(skew_ms, WARM_REPLAYS + j, ranks, seed) for j in range(replays)]
