"""Fault switches: environment variables read once at engine start (set them in the unit's
environment, e.g. per host from an inventory, to rehearse a failure).

`SWITCHES` is the one list of them; tests and promote's tests import the names from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

START_DELAY_S = "DDTREE_LAB_START_DELAY_S"
FAIL_AT_START = "DDTREE_LAB_FAULT_FAIL_AT_START"
NEVER_HEALTHY = "DDTREE_LAB_FAULT_NEVER_HEALTHY"
CRASH_AFTER_REQUESTS = "DDTREE_LAB_FAULT_CRASH_AFTER_REQUESTS"
WRONG_TOKENS_AFTER = "DDTREE_LAB_FAULT_WRONG_TOKENS_AFTER"
LOW_ACCEPTANCE = "DDTREE_LAB_FAULT_LOW_ACCEPTANCE"
HANG_ON_MIXED = "DDTREE_LAB_FAULT_HANG_ON_MIXED"
DRAIN_TIMEOUT_S = "DDTREE_LAB_DRAIN_TIMEOUT_S"
LIE = "DDTREE_LAB_FAULT_LIE"
PAUSE_WHILE = "DDTREE_LAB_FAULT_PAUSE_WHILE"
# What a lying server answers to /generate in full mode (a broken payload or proxy, not SGLang).
LIES = {
    "meta-list": "`meta_info` is a list, not an object",
    "empty-output": "`output_ids` is empty (and stays so)",
    "no-output-ids": "the answer has no `output_ids` at all",
    "drip": "the reply is sent one byte every half second, never finishing",
}

SWITCHES: dict[str, str] = {
    START_DELAY_S: "seconds to wait before loading (a slow model load): /health answers 503 meanwhile",
    FAIL_AT_START: "1: exit with status 1 after parsing the arguments (a load-time crash)",
    NEVER_HEALTHY: "1: serve, but /health and /health_generate answer 503 forever",
    CRASH_AFTER_REQUESTS: "N: the process dies (status 1) once N /generate requests have been answered",
    WRONG_TOKENS_AFTER: "N: full mode only: every bonus token from output index N on is wrong (a lossy payload)",
    LOW_ACCEPTANCE: "1: the draft ranks the target's token last everywhere (accept length 1)",
    HANG_ON_MIXED: "1: the scheduler stalls for good once greedy and sampled requests run together "
    "(as upstream DFLASH 0.5.13.post1 was seen to on the H200)",
    DRAIN_TIMEOUT_S: "seconds SIGTERM waits for in-flight requests before exiting anyway (default 20)",
    LIE: "full mode only, /generate answers a lie: " + "; ".join(f"{k}: {v}" for k, v in LIES.items()),
    PAUSE_WHILE: "PATH: the scheduler makes no decode step while PATH exists (requests stay in flight for as "
    "long as a test needs, without racing a clock)",
}


class FaultConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Faults:
    start_delay_s: float = 0.0
    fail_at_start: bool = False
    never_healthy: bool = False
    crash_after_requests: int | None = None
    wrong_tokens_after: int | None = None
    low_acceptance: bool = False
    hang_on_mixed: bool = False
    drain_timeout_s: float = 20.0
    lie: str | None = None
    pause_while: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Faults:
        env = os.environ if env is None else env
        return cls(
            start_delay_s=_number(env, START_DELAY_S, float, 0.0),
            fail_at_start=_flag(env, FAIL_AT_START),
            never_healthy=_flag(env, NEVER_HEALTHY),
            crash_after_requests=_number(env, CRASH_AFTER_REQUESTS, int, None),
            wrong_tokens_after=_number(env, WRONG_TOKENS_AFTER, int, None),
            low_acceptance=_flag(env, LOW_ACCEPTANCE),
            hang_on_mixed=_flag(env, HANG_ON_MIXED),
            drain_timeout_s=_number(env, DRAIN_TIMEOUT_S, float, 20.0),
            lie=_choice(env, LIE, LIES),
            pause_while=env.get(PAUSE_WHILE) or None,
        )

    def active(self) -> list[str]:
        """Human-readable list of the switches that are on, for the start-up log."""
        on = []
        for name, value in self.__dict__.items():
            default = Faults.__dataclass_fields__[name].default
            if value != default:
                on.append(f"{name}={value}")
        return on


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise FaultConfigError(f"{name} must be 1 or 0, got {env[name]!r}")


def _choice(env: Mapping[str, str], name: str, choices: Mapping[str, str]) -> str | None:
    value = env.get(name, "").strip()
    if value and value not in choices:
        raise FaultConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value or None


def _number(env: Mapping[str, str], name: str, kind: type, default):  # type: ignore[no-untyped-def]
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise FaultConfigError(f"{name} must be a {kind.__name__}, got {raw!r}") from None
    if value < 0:
        raise FaultConfigError(f"{name} must be >= 0, got {raw!r}")
    return value
