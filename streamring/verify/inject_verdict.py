"""The last line of a run with a deliberately injected bug (``--inject MODE``, ``run.inject``): whether the
checks caught it, as intended, or missed it.

Such a run keeps its exit status (non-zero when a check failed, which is what the injection must
produce); this line says that a FAIL above it is the expected result, or that the bug went unseen.
Plain strings only (no imports): the CLI, every rank's report and the model checkers use it.
"""

from __future__ import annotations

#: The stress mutations whose catch can be the owner's drain timing out instead of a recorded violation: their
#: consumer reads a slot before its publish, and may acknowledge the chunk before its owner cleared the mask
#: for it; the owner's clearing wipes that acknowledgement and its drain waits for it until the watchdog fires.
DRAIN_CATCHES = ("skip-acquire", "ignore-epoch")
#: What that watchdog's message says (streamring.ring.protocol, the owner's drain).
DRAIN_WAIT = "for drain: acknowledgements"


def _caught(command: str, mode: str, how: str) -> str:
    return (f"streamring {command}: the injected bug ({mode}) was caught, as intended: {how}; the FAIL and the "
            f"non-zero exit status are the expected result of --inject")


def _missed(command: str, mode: str, how: str) -> str:
    return f"streamring {command}: the injected bug ({mode}) was MISSED: {how}"


def stress_verdict(mode: str, violations: int, kinds: dict) -> str:
    """The verdict of a ``stress --inject`` run whose ranks all finished: caught iff a violation was seen."""
    if violations:
        what = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
        return _caught("stress", mode, f"{violations} violation{'s' if violations != 1 else ''} ({what})")
    return _missed("stress", mode, "no violation in this run (exit status 0); a longer or busier run gives it more "
                                   "chances, e.g. --config configs/stress-basic.yaml")


def stress_error_caught(mode: str, error: str) -> bool:
    """Whether a rank's error ends a ``stress --inject mode`` run as the injection's catch (the owner's drain
    waiting for acknowledgements a consumer that read before the publish could not give)."""
    return mode in DRAIN_CATCHES and "WatchdogError" in error and DRAIN_WAIT in error


def stress_error_verdict(mode: str, errors: list[str]) -> str:
    """The verdict of a ``stress --inject`` run whose ranks ended with ``errors`` (their first lines)."""
    if any(stress_error_caught(mode, e) for e in errors):
        return _caught("stress", mode, "a consumer read a slot before its publish, so its owner's drain waited for "
                                       "acknowledgements that could not come and the watchdog fired")
    first = errors[0].splitlines()[0][:200] if errors else "no rank said why"
    return (f"streamring stress: the run with the injected bug ({mode}) failed before its checks could judge it "
            f"({first}): neither caught nor missed")


def run_verdict(mode: str, ok: bool) -> str:
    """The verdict of a ``run`` with ``run.inject``: caught iff an output check failed."""
    if not ok:
        return _caught("run", mode, "an output check failed (above)")
    return _missed("run", mode, "every output passed its checks")


def model_check_verdict(mode: str, counterexample: bool, exhaustive: bool) -> str:
    """The verdict of a ``model-check --inject`` run: caught iff the search found a counter-example."""
    if counterexample:
        return _caught("model-check", mode, "the search found the counter-example above")
    if not exhaustive:
        return (f"streamring model-check: the search stopped before it covered every state: the injected bug "
                f"({mode}) was neither caught nor ruled out")
    return _missed("model-check", mode, "every property held in every reachable state")
