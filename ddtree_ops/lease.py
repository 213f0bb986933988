"""A run's hold on one host: the host lock it took, kept fresh by heartbeat for as long as the run
lives, and the confirm deadline of the promote stage it has in flight, renewed the same way.

One daemon thread per held host sends the agent op `heartbeat` every `interval_s` on the host's SSH
connection (a channel of its own, beside whatever call the run is waiting on). When the run dies,
hangs past its own deadlines' reach or loses the network, the beats stop: the lock goes stale one
TTL later and the stage's watchdog on the host puts the previous unit back at its deadline. So the
lock's TTL and the confirm window only have to cover a few missed beats, never the longest wait.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig
    from ddtree_ops.ssh import HostSession

BEATS_PER_WINDOW = 4
MIN_INTERVAL_S = 0.5


def beat_interval(host: HostConfig) -> float:
    """A few beats in every lock TTL and every confirm window, so one lost beat is never fatal."""
    return max(MIN_INTERVAL_S, min(host.lock_ttl_s, host.confirm_timeout_s) / BEATS_PER_WINDOW)


@dataclass
class HostLease:
    session: HostSession
    host: HostConfig
    lock_id: str
    interval_s: float
    stage: str | None = None  # unit id of the stage in flight, whose deadline the beats renew
    lost: str | None = None  # what the host said when this run's lock or stage was no longer its own
    beats: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> HostLease:
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"ddtree-lease-{self.host.name}")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 30)

    def follow(self, unit_id: str | None) -> None:
        """Renew this stage's confirm deadline with every beat from now on (None: no stage)."""
        self.stage = unit_id

    def beat(self, *, extend_s: float | None = None, pause: bool = False) -> dict[str, Any]:
        """One heartbeat now; raises AgentCallError when the host refuses it."""
        from ddtree_ops.agent.client import call_agent

        args: dict[str, Any] = {"state_dir": self.host.state_dir, "lock_id": self.lock_id}
        if self.stage:
            args.update(unit_id=self.stage, extend_s=extend_s or self.host.confirm_timeout_s, pause=pause)
        answer = call_agent(self.session, "heartbeat", args, timeout=max(10.0, 2 * self.interval_s))
        self.beats += 1
        if answer.get("stage") in ("gone", "expired"):
            self.lost = (f"stage {self.stage} is no longer in flight on the host ({answer.get('reason') or 'undone'}): "
                         "the host puts its previous unit back by itself")
        return answer

    def _loop(self) -> None:
        from ddtree_ops.agent.client import AgentCallError

        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except AgentCallError as exc:
                if exc.code == "lock_lost":
                    self.lost = exc.message
                self.failures.append(f"{time.strftime('%H:%M:%S')} {exc.message}")
            except Exception as exc:  # a lost connection: the next beat tries again; the TTL decides
                self.failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")
