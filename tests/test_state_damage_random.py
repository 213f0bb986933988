"""Randomised: damage one state-dir file between random operations, as an adversary would (issue 11).

Between random push / killed push / rollback / unlock operations, one file under the state dir is
corrupted, truncated, deleted or replaced by a symlink (to a copy of itself outside, so following it
would "work"). After every operation:
  - every payload file in site-packages is byte-identical to its pristine or a patched version;
  - every pristine copy the test did not attack is intact (the agent never spoils one);
  - a refusal names the file and a repair; the agent never crashes.
When an operation is refused, the operator does what the hint says (unlock, rollback --to pristine),
as they would. At the end that same repair brings the host back to exactly pristine.
Seeded and bounded (a few dozen agent calls per seed).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.release_fixtures import PRISTINE, make_bundle
from tests.test_agent_release import KILL_ENV, Host
from tests.test_state_damage import try_push

STEPS = 16
COMMANDS = ("ddtree-ops", "push", "rollback", "unlock", "pip install", "--adopt")
NAMES_A_FILE = {"state_damaged", "pristine_lost", "files_mixed", "backup_damaged", "verify_failed", "foreign"}


def damage(rng: random.Random, host: Host, outside: Path) -> Path | None:
    files = sorted(p for p in host.state_dir.rglob("*") if p.is_file() and not p.is_symlink())
    if not files:
        return None
    victim = rng.choice(files)
    how = rng.choice(["corrupt", "truncate", "delete", "symlink"])
    data = victim.read_bytes()
    if how == "corrupt":
        victim.write_bytes(rng.choice([b"{", b"[]", b"{}", b'{"files": 3}', bytes(rng.randrange(256) for _ in range(40))]))
    elif how == "truncate":
        victim.write_bytes(data[: rng.randrange(max(1, len(data)))])
    elif how == "delete":
        victim.unlink()
    else:
        copy = outside / f"{len(list(outside.iterdir()))}-{victim.name}"
        copy.write_bytes(data)
        victim.unlink()
        victim.symlink_to(copy)
    return victim


def check_refusal(ans: dict) -> str | None:
    """The hint's repair, if any; fails the test on a crash or a refusal that names no repair."""
    if ans["ok"]:
        return None
    err = ans["error"]
    assert err["code"] not in ("agent_crash", "bad_request"), err
    hint = err.get("hint") or ""
    assert any(c in hint for c in COMMANDS), err
    if err["code"] in NAMES_A_FILE:
        assert "/" in err["message"] or err.get("path"), err
    if err["code"] == "state_damaged":
        assert err["path"] in err["message"] and "repair:" in hint, err
    if "unlock" in hint:
        return "unlock"
    return "pristine" if "rollback --to pristine" in hint else None


def check_site(host: Host, versions: dict[str, set[bytes]]) -> None:
    for rel, allowed in versions.items():
        p = host.site / rel
        now = p.read_bytes() if p.exists() else None
        assert now in allowed, f"{rel} is neither pristine nor patched: {now!r}"


def check_pristine_copies(host: Host, attacked: set[Path]) -> None:
    root = host.state_dir / "pristine" / "files"
    for rel, data in PRISTINE.items():
        copy = root / rel
        if copy in attacked:
            if copy.is_file() and not copy.is_symlink() and copy.read_bytes() == data:
                attacked.discard(copy)  # healed from verified bytes
            continue
        if copy.exists() or copy.is_symlink():
            assert not copy.is_symlink() and copy.read_bytes() == data, f"pristine copy of {rel} spoiled"


@pytest.mark.parametrize("seed", [11, 2026])
def test_random_damage_between_random_operations(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    host = Host(tmp_path)
    before = host.snapshot()
    outside = tmp_path / "outside"
    outside.mkdir()
    bundles = [make_bundle(tmp_path / "d1", "1.0.0", tag="v1"),
               make_bundle(tmp_path / "d2", "2.0.0", tag="v2",
                           patched_paths=("sglang/srt/server_args.py", "sglang/srt/speculative/dflash_info.py"))]
    versions: dict[str, set[bytes | None]] = {}
    for b in bundles:
        for rel, data in b.patched.items():
            versions.setdefault(rel, {PRISTINE.get(rel)}).add(data)
    attacked: set[Path] = set()

    def unlock() -> dict:
        ans = host.call("unlock", force=True)
        return host.call("recover", repair=True) if ans["ok"] else ans

    def run(op: str) -> dict:
        if op.startswith("push"):
            b = rng.choice(bundles)
            if op == "push-killed":
                try:
                    return try_push(host, b, env={**os.environ, KILL_ENV: "1"})
                except AssertionError as exc:  # killed after one file, as asked
                    assert "gave no answer" in str(exc), exc
                    return {"ok": True}
            return try_push(host, b)
        if op == "unlock":
            return unlock()
        return host.call("rollback", to=op)

    for _ in range(STEPS):
        if rng.random() < 0.6:
            victim = damage(rng, host, outside)
            if victim is not None and "pristine" in victim.parts:
                attacked.add(victim)
        repair = check_refusal(run(rng.choice(["push", "push", "push-killed", "previous", "pristine", "unlock"])))
        check_site(host, versions)
        check_pristine_copies(host, attacked)
        for _ in range(3):  # the operator follows the hint
            if repair is None:
                break
            repair = check_refusal(unlock() if repair == "unlock" else host.call("rollback", to="pristine"))
            check_site(host, versions)
            check_pristine_copies(host, attacked)
    # The documented repair converges: unlock, then rollback --to pristine restores every original.
    check_refusal(unlock())
    final = host.call("rollback", to="pristine")
    if not final["ok"]:
        # Only acceptable when the test itself destroyed every copy of an original.
        assert final["error"]["code"] == "pristine_lost" and attacked, final
        return
    assert host.snapshot() == before
