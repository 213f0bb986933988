"""A stand-in lab host for the CPU tests of the lab engine: imports the (patched) sglang once, then
answers JSON lines on stdin.

First line out: the wheel's own definitions the engine's HTTP answers must match ("contract").
Then, per request line:
  {"op": "spawn", "argv": [...], "env": {...}, "log": PATH}  → {"pid": N}: a forked engine
      (`launch.main(argv)`), stdout/stderr to PATH; forking after the import makes a start cost
      about a second instead of sglang's import
  {"op": "wait", "pid": N, "timeout": S}  → {"code": exit status or null while running}
  {"op": "validate", "body": {...}}       → {"ok": bool, "error": str}: the body as the wheel's
      GenerateReqInput, normalised as the tokenizer manager does
Run with PYTHONPATH=<patched site>:<repo>.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import sglang
from sglang.srt.managers import io_struct
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, prepare_server_args, set_global_server_args_for_scheduler
from sglang.srt.speculative.ddtree_worker import DDTreeController, DDTreeStats

from ddtree_ops.lab.engine import launch

SRT = Path(sglang.__file__).parent / "srt"


def _function_dict_keys(source: str, name: str) -> list[str]:
    """Keys of the first dict literal in the function `name` (http_server's model_info)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and node.name == name:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    return [k.value for k in sub.keys if isinstance(k, ast.Constant)]
    raise SystemExit(f"no dict in {name}")


def contract(model_dir: str) -> dict:
    http_source = (SRT / "entrypoints/http_server.py").read_text()
    metrics_source = (SRT / "observability/metrics_collector.py").read_text()
    tm_source = (SRT / "managers/tokenizer_manager.py").read_text()
    args = prepare_server_args(["--model-path", f"{model_dir}/target", "--device", "cpu",
                                "--speculative-algorithm", "DFLASH",
                                "--speculative-draft-model-path", f"{model_dir}/draft",
                                "--speculative-ddtree-mode", "full", "--attention-backend", "triton"])
    set_global_server_args_for_scheduler(args)
    controller = object.__new__(DDTreeController)
    controller.mode, controller.budget, controller.topk_cap, controller.stats = "full", 15, None, DDTreeStats()
    controller.verify_graph_width, controller.verify_graph_max_bs = 16, 48
    controller.keep_chain = controller.verify_kernels = False
    controller._build_graphs = controller.profile = controller.auto = controller.hybrid = None
    controller.build_budgets = [15]
    controller.budget_auto = False
    reporter = SimpleNamespace(last_gen_throughput=1.0, spec_total_num_forward_ct=2, spec_total_num_accept_tokens=5)
    fake = SimpleNamespace(
        metrics_reporter=reporter,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(weight_load_mem_usage=0.0, graph_mem_usage=0.0)),
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: SimpleNamespace(mem_usage=0.0)),
        max_total_num_tokens=1, max_running_requests=1, max_req_input_len=1,
        spec_algorithm=SimpleNamespace(is_none=lambda: False),
        draft_worker=SimpleNamespace(_ddtree=controller),
    )
    state = Scheduler.get_internal_state(fake, io_struct.GetInternalStateReq()).internal_state
    return {
        "version": sglang.__version__,
        "routes": sorted(set(re.findall(r'@app\.(?:get|post|api_route)\(\s*"([^"]+)"', http_source))),
        "model_info_keys": _function_dict_keys(http_source, "model_info"),
        "server_info_extra_keys": ["internal_states", "version", "kv_events"],
        "init_info_keys": sorted(Scheduler.get_init_info(fake)),
        "server_args_fields": sorted(f.name for f in dataclasses.fields(ServerArgs)),
        "internal_state_keys": sorted(state),
        "ddtree_keys": sorted(state["ddtree"]),
        "finish_length": FINISH_LENGTH(7).to_json(),
        "finish_token": FINISH_MATCHED_TOKEN(2).to_json(),
        "generate_fields": sorted(f.name for f in dataclasses.fields(io_struct.GenerateReqInput)),
        "sampling_params": sorted(set(inspect.signature(SamplingParams.__init__).parameters) - {"self"}),
        "tokenizer_manager_literals": sorted(set(re.findall(r'"([a-z0-9_]+)"', tm_source))),
        "metric_names": sorted(set(re.findall(r'name="(sglang:[a-z_]+)"', metrics_source))),
        "health_check_timeout": re.search(r'HEALTH_CHECK_TIMEOUT = int\(os\.getenv\("SGLANG_HEALTH_CHECK_TIMEOUT", (\d+)\)\)',
                                          http_source).group(1),
    }


def validate(body: dict) -> dict:
    try:
        obj = io_struct.GenerateReqInput(**body)
        obj.normalize_batch_and_arguments()
        return {"ok": True}
    except Exception as e:  # the wheel's own refusal, whatever its type
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def spawn(argv: list[str], env: dict[str, str], log: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(env)
        code = launch.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_EXITED: dict[int, int] = {}


def wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while pid not in _EXITED:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _EXITED[pid] = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return _EXITED[pid]


def main() -> None:
    out = sys.stdout
    print(json.dumps({"contract": contract(sys.argv[1])}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "spawn":
            reply = {"pid": spawn(req["argv"], req["env"], req["log"])}
        elif req["op"] == "wait":
            reply = {"code": wait(req["pid"], req["timeout"])}
        elif req["op"] == "validate":
            reply = validate(req["body"])
        else:
            reply = {"error": f"unknown op {req['op']}"}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
