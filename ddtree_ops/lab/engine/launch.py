"""Start-up: the same ARGS as `python -m sglang.launch_server`, parsed by the host's own SGLang.

Order, as a GPU server meets them: parse (SGLang's `prepare_server_args`, so an unknown or
out-of-range flag fails with SGLang's message and argparse's exit status) → the fault switches →
the payload's full-mode refusal (`ddtree_utils.full_mode_refusal` on the target's config.json,
raised as its `DDTreeRefused`) → bind the port (503 while loading) → the start delay → load the
models → ready. SIGTERM/SIGINT: /health turns 503, in-flight /generate requests finish (at most
DDTREE_LAB_DRAIN_TIMEOUT_S), then the process exits (0 drained, 1 not).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from .faults import DRAIN_TIMEOUT_S, FaultConfigError, Faults

logger = logging.getLogger("ddtree_lab_engine")


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
    )


def _ddtree_module(server_args: Any) -> ModuleType | None:
    """The payload's ddtree_utils when a DDTree mode is on (a pristine SGLang never gets here:
    its argparse does not know the flag)."""
    if (getattr(server_args, "speculative_ddtree_mode", "off") or "off") == "off":
        return None
    from sglang.srt.speculative import ddtree_utils

    return ddtree_utils


def _v2_payload() -> bool:
    """Whether the host's payload is a v2 base's (SGLang 0.5.14+), whose shadow-linear worker builds no trees."""
    import importlib.util

    return importlib.util.find_spec("sglang.srt.speculative.ddtree_v2_shadow") is not None


def refuse_full_mode(server_args: Any, ddtree: ModuleType | None, model_config: dict) -> None:
    """Raise the payload's DDTreeRefused where its worker would refuse full mode at start."""
    if ddtree is None or server_args.speculative_ddtree_mode != "full":
        return
    reason = ddtree.full_mode_refusal(model_config)
    if reason:
        raise ddtree.DDTreeRefused(reason)


def build(server_args: Any, faults: Faults, ddtree: ModuleType | None) -> tuple[Any, ...]:
    """Load the models and make the decoder and scheduler (the slow part of a start)."""
    import torch

    from .decoding import Corruption, Decoder
    from .draft import DraftModel
    from .model import TinyLM, read_config
    from .scheduler import Scheduler

    model_config = read_config(server_args.model_path)
    model = TinyLM.load(server_args.model_path)
    context_len = int(server_args.context_length or model_config["max_position_embeddings"])
    draft = None
    block_size = 1
    if server_args.speculative_algorithm:
        if str(server_args.speculative_algorithm).upper() != "DFLASH":
            raise SystemExit(f"ddtree_lab_engine: only --speculative-algorithm DFLASH is emulated, "
                             f"got {server_args.speculative_algorithm}")
        draft = DraftModel.load(server_args.speculative_draft_model_path, low_acceptance=faults.low_acceptance)
        block_size = int(server_args.speculative_num_draft_tokens)
    budget = getattr(server_args, "speculative_ddtree_budget", None)
    auto = None
    if ddtree is not None and budget == "auto":  # the payload's ddtree_args normalised it (auto + its maximum)
        from sglang.srt.speculative import ddtree_auto_budget

        budget = int(server_args.speculative_ddtree_budget_max)
        if server_args.speculative_ddtree_mode == "full":
            auto = ddtree_auto_budget.AutoBudget(ddtree_auto_budget.auto_candidates(budget, block_size),
                                                 capture_bs=[1], max_running=int(server_args.max_running_requests or 48))
    decoder = Decoder(
        model,
        capacity=context_len + max(block_size, int(budget or 0) + 1) + 1,
        draft=draft,
        block_size=max(block_size, 2),
        mode=getattr(server_args, "speculative_ddtree_mode", "off") or "off",
        budget=budget,
        topk_cap=getattr(server_args, "speculative_ddtree_topk_cap", None),
        keep_chain=bool(getattr(server_args, "speculative_ddtree_keep_chain", False)),
        ddtree=ddtree,
        corruption=Corruption(faults.wrong_tokens_after if ddtree is not None else None),
        auto=auto,
        shadow_builds_trees=ddtree is None or not _v2_payload(),
    )
    scheduler = Scheduler(decoder, faults, int(server_args.max_running_requests or 48))
    tokenizer = _tokenizer(server_args.tokenizer_path or server_args.model_path)
    torch.set_num_threads(1)  # tiny matrices: more threads only contend for the lab's few cores
    return model_config, tokenizer, decoder, scheduler, context_len


def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _setup_logging()
    t0 = time.monotonic()
    import sglang
    from sglang.srt.server_args import prepare_server_args

    from .server_args import resolve

    # SGLang's own parse: bad flags fail here, as in production; on a v2 base the payload's resolution
    # hooks then check the DDTree flags (and refuse what the base cannot serve), as resolve_once would.
    server_args = resolve(prepare_server_args(argv))
    try:
        faults = Faults.from_env()
    except FaultConfigError as e:
        logger.error("ddtree_lab_engine: %s", e)
        return 2
    if faults.active():
        logger.warning("ddtree_lab_engine: fault switches on: %s", ", ".join(faults.active()))
    if faults.fail_at_start:
        logger.error("ddtree_lab_engine: fault DDTREE_LAB_FAULT_FAIL_AT_START: failing the start")
        return 1
    ddtree = _ddtree_module(server_args)
    from .model import read_config

    refuse_full_mode(server_args, ddtree, read_config(server_args.model_path))

    from .api import EngineApi, Status
    from .http_server import EngineHTTPServer

    status = Status(never_healthy=faults.never_healthy)
    api = EngineApi(server_args, sglang.__version__, status, lie=faults.lie)
    httpd = EngineHTTPServer((server_args.host, int(server_args.port)), api)
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logger.info("ddtree_lab_engine: serving http://%s:%s (loading)", server_args.host, server_args.port)

    if faults.start_delay_s and stop.wait(faults.start_delay_s):
        return _shutdown(httpd, status, faults)
    model_config, tokenizer, decoder, scheduler, context_len = build(server_args, faults, ddtree)
    api.attach(model_config=model_config, tokenizer=tokenizer, decoder=decoder, scheduler=scheduler,
               context_len=context_len)
    scheduler.start()
    status.starting = False
    mode = getattr(server_args, "speculative_ddtree_mode", "off")
    logger.info(
        "ddtree_lab_engine: ready in %.1f s (algorithm=%s ddtree_mode=%s context=%d)",
        time.monotonic() - t0, server_args.speculative_algorithm, mode, context_len,
    )
    logger.info("The server is fired up and ready to roll!")
    stop.wait()
    return _shutdown(httpd, status, faults)


def _shutdown(httpd: Any, status: Any, faults: Faults) -> int:
    status.draining = True
    logger.info("ddtree_lab_engine: SIGTERM: draining (at most %.0f s, %s)", faults.drain_timeout_s, DRAIN_TIMEOUT_S)
    drained = httpd.wait_idle(faults.drain_timeout_s)
    httpd.shutdown()
    if not drained:
        logger.error("ddtree_lab_engine: in-flight requests did not finish within %.0f s; exiting anyway",
                     faults.drain_timeout_s)
        return 1
    logger.info("ddtree_lab_engine: drained; exiting")
    return 0
