"""Agent op `smoke`: does the installed payload work under the host's own SGLang interpreter?

Steps, each in a fresh subprocess of this interpreter (sys.executable) with a timeout, so a
hanging import or a crashing extension cannot take the agent down and every step's output
is captured on its own:
  import       the DDTree modules and every patched SGLang module of the current release
  server_args  prepare_server_args accepts valid DDTree flags and refuses each bad combination
               with a message naming the flag; the cases are those of the installed SGLang's worker
               generation (worker_of): on a v2 base (0.5.14 on) shadow-linear is accepted and full is
               refused with the payload's "not available yet", validated where that base resolves (0.5.17:
               ServerArgs.__post_init__; 0.5.23: its resolution hook)
  tree         build_ddtree on a tiny CPU case whose answer is worked out by hand below
Answer: {"passed": bool, "steps": [{name, passed, seconds, detail, output}], "sglang_version", "worker"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import backup, state

DEFAULT_TIMEOUT_S = 240.0
OUTPUT_TAIL = 4000
MARK = "DDTREE-SMOKE-RESULT "

# Always imported: our own modules (they exist only when a release is installed).
DDTREE_MODULES = ["sglang.srt.speculative.ddtree_args", "sglang.srt.speculative.ddtree_utils"]

# Every step starts with this: sys_path (tests' fake trees) goes first, like facts' sys_path.
PRELUDE = r"""
import json, sys
SPEC = json.loads(sys.argv[1])
sys.path[:0] = SPEC.get("sys_path") or []
"""

IMPORT_CODE = PRELUDE + r"""
import importlib, time, traceback
out = {}
for name in SPEC["modules"]:
    t = time.monotonic()
    try:
        importlib.import_module(name)
        out[name] = {"ok": True, "seconds": round(time.monotonic() - t, 2)}
    except ModuleNotFoundError as exc:
        # A third-party module that upstream SGLang imports but this venv lacks (e.g. setproctitle
        # on a CPU-only lab host) is not the payload's fault: reported, fatal only when strict.
        ours = (exc.name or "").split(".")[0] == "sglang"
        out[name] = {"ok": not ours and not SPEC.get("strict"), "missing_dependency": None if ours else exc.name,
                     "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-1500:]}
    except BaseException as exc:
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-1500:]}
print("DDTREE-SMOKE-RESULT " + json.dumps(out))
sys.exit(0 if all(v["ok"] for v in out.values()) else 1)
"""

# Both server-args steps parse with that SGLang's own prepare_server_args, then `resolve(sa)` (their base's
# validation step), and report a refusal as text.
SERVER_ARGS_PARSE = r"""
def parse(extra):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            sa = prepare_server_args(base + extra)
            resolve(sa)
        return sa, None
    except SystemExit as exc:
        return None, f"argparse exit {exc.code}: {err.getvalue().strip()[-400:]}"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
"""

# The end of both server-args steps: each case parsed, checked, reported (`field(sa, name)` reads a setting as
# the base resolves it).
SERVER_ARGS_CASES = r"""
cases, ok = [], True
for name, extra, want in valid:
    sa, err = parse(extra)
    bad = err or ", ".join(f"{k}={field(sa, k)!r} (want {v!r})" for k, v in want.items() if field(sa, k) != v)
    cases.append({"case": name, "expect": "accepted", "ok": not bad, "detail": bad or "accepted"})
    ok = ok and not bad
for name, extra, flag in invalid:
    sa, err = parse(extra)
    good = err is not None and flag in err
    cases.append({"case": name, "expect": f"refused naming {flag}", "ok": good,
                  "detail": err or "ACCEPTED (should have been refused)"})
    ok = ok and good
print("DDTREE-SMOKE-RESULT " + json.dumps(cases))
sys.exit(0 if ok else 1)
"""

# Valid and invalid DDTree combinations. Each invalid case names the flag its refusal must
# mention, so a refusal for an unrelated reason (e.g. a missing model) does not count.
SERVER_ARGS_CODE = PRELUDE + r"""
import contextlib, io
from sglang.srt.server_args import prepare_server_args
base = SPEC["base"]
dflash = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", SPEC["draft"],
          "--speculative-num-draft-tokens", "16"]
def resolve(sa):  # 0.5.13.post1 validates inside prepare_server_args
    pass
""" + SERVER_ARGS_PARSE + r"""
valid = [
    ("shadow-linear, defaults", dflash + ["--speculative-ddtree-mode", "shadow-linear"],
     {"speculative_ddtree_mode": "shadow-linear", "speculative_ddtree_budget": 15}),
    ("full, triton, budget 64, topk-cap 8", dflash + ["--speculative-ddtree-mode", "full", "--attention-backend",
     "triton", "--page-size", "1", "--speculative-ddtree-budget", "64", "--speculative-ddtree-topk-cap", "8"],
     {"speculative_ddtree_mode": "full", "speculative_ddtree_budget": 64, "speculative_ddtree_topk_cap": 8}),
    ("shadow-linear, keep-chain", dflash + ["--speculative-ddtree-mode", "shadow-linear",
     "--speculative-ddtree-keep-chain"],
     {"speculative_ddtree_mode": "shadow-linear", "speculative_ddtree_budget": 15,
      "speculative_ddtree_keep_chain": True}),
    ("full, budget auto, maximum 63", dflash + ["--speculative-ddtree-mode", "full", "--attention-backend", "triton",
     "--page-size", "1", "--speculative-ddtree-budget", "auto", "--speculative-ddtree-budget-max", "63"],
     {"speculative_ddtree_mode": "full", "speculative_ddtree_budget": "auto", "speculative_ddtree_budget_max": 63}),
]
invalid = [
    ("ddtree without DFLASH", ["--speculative-ddtree-mode", "shadow-linear"], "--speculative-algorithm DFLASH"),
    ("unknown mode", dflash + ["--speculative-ddtree-mode", "bushy"], "--speculative-ddtree-mode"),
    ("budget 0", dflash + ["--speculative-ddtree-mode", "full", "--attention-backend", "triton",
     "--speculative-ddtree-budget", "0"], "--speculative-ddtree-budget"),
    ("budget 513", dflash + ["--speculative-ddtree-mode", "shadow-linear", "--speculative-ddtree-budget", "513"],
     "--speculative-ddtree-budget"),
    ("topk-cap above budget", dflash + ["--speculative-ddtree-mode", "shadow-linear", "--speculative-ddtree-budget",
     "8", "--speculative-ddtree-topk-cap", "9"], "--speculative-ddtree-topk-cap"),
    ("budget with mode off", dflash + ["--speculative-ddtree-budget", "8"], "--speculative-ddtree-mode"),
    ("budget maximum without auto", dflash + ["--speculative-ddtree-mode", "shadow-linear", "--speculative-ddtree-budget",
     "8", "--speculative-ddtree-budget-max", "8"], "--speculative-ddtree-budget-max"),
    ("allow-hybrid-unsafe (refused)", dflash + ["--speculative-ddtree-mode", "full",
     "--attention-backend", "triton", "--page-size", "1", "--speculative-ddtree-allow-hybrid-unsafe"],
     "--speculative-ddtree-allow-hybrid-unsafe"),
    ("full on flashinfer", dflash + ["--speculative-ddtree-mode", "full", "--attention-backend", "flashinfer"],
     "--attention-backend"),
    ("keep-chain with budget below the depth", dflash + ["--speculative-ddtree-mode", "shadow-linear",
     "--speculative-ddtree-budget", "8", "--speculative-ddtree-keep-chain"], "--speculative-ddtree-keep-chain"),
]
def field(sa, name):
    return getattr(sa, name, None)
""" + SERVER_ARGS_CASES

# The same checks on a v2 base (SGLang 0.5.14 on; the payload's glue is ddtree_v2_args). ServerArgs is parsed by
# that SGLang's own prepare_server_args. Its DFLASH step refuses a CPU device, so the DDTree check is reached with
# a stand-in for upstream's `handle_speculative_decoding` that resolves DFLASH's block size as the real step does
# on a GPU: on 0.5.23 through SGLang's run_hook (resolve_once's steps; the payload wraps that step), on 0.5.17 by
# replacing the step __post_init__ calls (the payload's check runs right after it). Full mode parses where the
# payload serves it (ddtree_v2_args.PROVEN_TREE_BASES) and is refused elsewhere with its "not available yet".
SERVER_ARGS_V2_CODE = PRELUDE + r"""
import contextlib, io
import sglang.srt.speculative.ddtree_v2_args  # the payload's glue (0.5.23: its patch registers the hooks)
base = SPEC["base"]
dflash = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", SPEC["draft"],
          "--speculative-num-draft-tokens", "16"]
try:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result
    from sglang.srt.arg_groups.resolution_hooks import run_hook
except ImportError:  # 0.5.17: __post_init__ resolves by assignment
    import sglang.srt.arg_groups.speculative_hook as _hook
    def handle_speculative_decoding(server_args):
        algorithm = (server_args.speculative_algorithm or "").upper() or None
        server_args.speculative_algorithm = algorithm
        if algorithm == "DFLASH":
            server_args.speculative_num_draft_tokens = int(server_args.speculative_num_draft_tokens or 16)
    _hook.handle_speculative_decoding = handle_speculative_decoding
    def resolve(sa):
        pass
    def field(sa, name):
        return getattr(sa, name, None)
else:
    def handle_speculative_decoding(server_args):
        if (resolution_result(server_args, "speculative_algorithm") or "").upper() == "DFLASH":
            block = resolution_result(server_args, "speculative_num_draft_tokens") or 16
            declare_resolution(server_args, "smoke: DFLASH block size", speculative_num_draft_tokens=int(block))
    def resolve(sa):
        run_hook(handle_speculative_decoding, sa)
    field = resolution_result
from sglang.srt.server_args import prepare_server_args
""" + SERVER_ARGS_PARSE + r"""
valid = [
    ("shadow-linear, defaults", dflash + ["--speculative-ddtree-mode", "shadow-linear"],
     {"speculative_ddtree_mode": "shadow-linear", "speculative_ddtree_budget": 15}),
    ("shadow-linear, budget 31, topk-cap 4", dflash + ["--speculative-ddtree-mode", "shadow-linear",
     "--speculative-ddtree-budget", "31", "--speculative-ddtree-topk-cap", "4"],
     {"speculative_ddtree_mode": "shadow-linear", "speculative_ddtree_budget": 31, "speculative_ddtree_topk_cap": 4}),
    ("shadow-linear, budget auto, maximum 63", dflash + ["--speculative-ddtree-mode", "shadow-linear",
     "--speculative-ddtree-budget", "auto", "--speculative-ddtree-budget-max", "63"],
     {"speculative_ddtree_mode": "shadow-linear", "speculative_ddtree_budget": "auto",
      "speculative_ddtree_budget_max": 63}),
]
invalid = [
    ("ddtree without DFLASH", ["--speculative-ddtree-mode", "shadow-linear"], "--speculative-algorithm DFLASH"),
    ("unknown mode", dflash + ["--speculative-ddtree-mode", "bushy"], "--speculative-ddtree-mode"),
    ("budget 513", dflash + ["--speculative-ddtree-mode", "shadow-linear", "--speculative-ddtree-budget", "513"],
     "--speculative-ddtree-budget"),
    ("topk-cap above budget", dflash + ["--speculative-ddtree-mode", "shadow-linear", "--speculative-ddtree-budget",
     "8", "--speculative-ddtree-topk-cap", "9"], "--speculative-ddtree-topk-cap"),
    ("budget with mode off", dflash + ["--speculative-ddtree-budget", "8"], "--speculative-ddtree-mode"),
    ("budget maximum without auto", dflash + ["--speculative-ddtree-mode", "shadow-linear", "--speculative-ddtree-budget",
     "8", "--speculative-ddtree-budget-max", "8"], "--speculative-ddtree-budget-max"),
    ("allow-hybrid-unsafe", dflash + ["--speculative-ddtree-mode", "shadow-linear",
     "--speculative-ddtree-allow-hybrid-unsafe"], "--speculative-ddtree-allow-hybrid-unsafe"),
]
glue = sglang.srt.speculative.ddtree_v2_args
full = dflash + ["--speculative-ddtree-mode", "full", "--attention-backend", "triton", "--disable-overlap-schedule"]
if glue.base_version() in getattr(glue, "PROVEN_TREE_BASES", ()):
    valid.append(("full (served on this base)", full, {"speculative_ddtree_mode": "full", "speculative_ddtree_budget": 15}))
else:
    invalid.append(("full (not available yet on this base)", full, "not available yet"))
""" + SERVER_ARGS_CASES

# Hand-checked case (batch 1, depth 2, vocab 4), probabilities not logits so it reads easily:
#   position 1: token 0 .10, token 1 .70, token 2 .15, token 3 .05
#   position 2: token 0 .60, token 1 .05, token 2 .05, token 3 .30
# Path scores: (1) .70, (1,0) .42, (1,3) .21, (2) .15, (0) .10, (2,0) .09, ...
# budget 4 -> nodes 1:(1) 2:(1,0) 3:(1,3) 4:(2), i.e. tokens [1,0,3,2], parents [-1,0,1,1,0],
# depths [0,1,2,2,1]; node 3 sees {0,1,3}; first children 0->1, 1->2; siblings 1->4, 2->3.
# budget 2 -> tokens [1,0]. topk_cap 1 with budget 4 -> only (1), (1,0): 3 nodes in all.
# Keep-chain: position 1 .50/.45/.04/.01, position 2 .40/.30/.20/.10: budget 2 takes (0), (1) (.50,
# .45); with keep_chain the top-1 chain (0), (0,0) (.50, .20) instead: tokens [0,0], parents [-1,0,1].
TREE_CODE = PRELUDE + r"""
import math
import torch
from sglang.srt.speculative.ddtree_utils import build_ddtree
p = torch.tensor([[[.10, .70, .15, .05], [.60, .05, .05, .30]]], dtype=torch.float32)
logits = p.log()
checks = []
def check(name, got, want):
    checks.append({"check": name, "ok": got == want, "got": got, "want": want})
t = build_ddtree(logits, 4)
check("budget4 num_nodes", int(t.num_nodes[0]), 5)
check("budget4 token_ids", t.token_ids[0].tolist(), [1, 0, 3, 2])
check("budget4 parents", t.parents[0].tolist(), [-1, 0, 1, 1, 0])
check("budget4 depths", t.depths[0].tolist(), [0, 1, 2, 2, 1])
check("budget4 mask row 3", t.tree_mask[0, 3].tolist(), [True, True, False, True, False])
check("budget4 first child", t.retrive_next_token[0].tolist(), [1, 2, -1, -1, -1])
check("budget4 next sibling", t.retrive_next_sibling[0].tolist(), [-1, 4, 3, -1, -1])
want_scores = [0.0, math.log(.7), math.log(.7) + math.log(.6), math.log(.7) + math.log(.3), math.log(.15)]
check("budget4 scores", all(abs(a - b) < 1e-5 for a, b in zip(t.scores[0].tolist(), want_scores)), True)
t2 = build_ddtree(logits, 2)
check("budget2 token_ids", t2.token_ids[0].tolist()[:2], [1, 0])
t3 = build_ddtree(logits, 4, topk_cap=1)
check("topk_cap1 num_nodes", int(t3.num_nodes[0]), 3)
check("topk_cap1 token_ids", t3.token_ids[0].tolist()[:2], [1, 0])
chain = torch.tensor([[[.50, .45, .04, .01], [.40, .30, .20, .10]]], dtype=torch.float32).log()
check("chain case budget2 token_ids", build_ddtree(chain, 2).token_ids[0].tolist(), [0, 1])
t4 = build_ddtree(chain, 2, keep_chain=True)
check("keep_chain token_ids", t4.token_ids[0].tolist(), [0, 0])
check("keep_chain parents", t4.parents[0].tolist(), [-1, 0, 1])
check("keep_chain score", abs(float(t4.scores[0, 2]) - math.log(.2)) < 1e-5, True)
print("DDTREE-SMOKE-RESULT " + json.dumps(checks))
sys.exit(0 if all(c["ok"] for c in checks) else 1)
"""


# A parse-only model: prepare_server_args reads config.json (architecture, sizes) and nothing
# else, so a tiny Qwen3 config lets the flags be checked on any host, GPU or not, offline.
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
    "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}


def _run_step(name: str, code: str, arg: dict, timeout_s: float) -> dict:
    started = time.monotonic()
    # Never reach out to a model hub from a production host during a smoke test.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"") if isinstance(exc.stdout, bytes) else \
            (exc.stdout or "") + (exc.stderr or "")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return {"name": name, "passed": False, "seconds": round(time.monotonic() - started, 2),
                "detail": f"timed out after {timeout_s:.0f}s", "output": out[-OUTPUT_TAIL:]}
    detail: object = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            try:
                detail = json.loads(line[len(MARK):])
            except ValueError:
                detail = line
    output = (proc.stdout.replace("\n" + MARK, "\n") + proc.stderr) if proc.returncode else proc.stderr
    return {"name": name, "passed": proc.returncode == 0 and detail is not None,
            "seconds": round(time.monotonic() - started, 2), "returncode": proc.returncode,
            "detail": detail, "output": output[-OUTPUT_TAIL:]}


def _patched_modules(request: dict) -> list[str]:
    """Python modules of the current release's manifest (sglang/x/y.py -> sglang.x.y)."""
    mods = list(request.get("modules") or [])
    sd = request.get("state_dir")
    if not mods and isinstance(sd, str) and sd.startswith("/"):
        # Validated like every state read: a damaged state.json fails smoke with its repair.
        cur = state.load(Path(sd))["current"]
        for rel in sorted(backup.read(Path(sd), cur)["files"] if cur else []):
            if rel.endswith(".py") and rel.startswith("sglang/"):
                name = rel[:-3].replace("/", ".")
                mods.append(name[: -len(".__init__")] if name.endswith(".__init__") else name)
    return sorted(set(DDTREE_MODULES) | set(mods))


def worker_of(version: str | None) -> str:
    """The DFLASH worker generation of an SGLang version: v1 (`dflash_worker.py`) up to 0.5.13.post1,
    v2 (`DFlashWorkerV2`, validation in resolve_once) from 0.5.14 on; v1 when the version is unknown."""
    import re

    nums = [int(n) for n in re.findall(r"\d+", (version or "").split("+")[0])[:3]]
    return "v2" if len(nums) == 3 and tuple(nums) >= (0, 5, 14) else "v1"


def _installed_version(sys_path: list[str]) -> str | None:
    from .atomic import AgentError
    from .layout import find_base

    try:
        return find_base("sglang", sys_path or None)[0]
    except AgentError:
        return None  # not installed: the import step says so


def op_smoke(request: dict) -> dict:
    timeout_s = float(request.get("timeout_s", DEFAULT_TIMEOUT_S))
    sys_path = [str(p) for p in request.get("sys_path") or []]
    wanted = request.get("steps") or ["import", "server_args", "tree"]
    version = _installed_version(sys_path)
    worker = worker_of(version)
    sd = request.get("state_dir")
    if isinstance(sd, str) and sd.startswith("/") and version is not None:
        from . import stale

        old = stale.stale_releases(Path(sd), version)
        if old:  # SGLang changed under the release: its modules are another version's payload
            d = stale.describe(version, old)
            step = {"name": "release", "passed": False, "seconds": 0.0, "detail": f"{d['message']}; {d['hint']}",
                    "output": ""}
            return {"passed": False, "failed_steps": ["release"], "steps": [step], "warnings": [],
                    "python": sys.executable, "sglang_version": version, "worker": worker, "stale": d}
    steps = []
    with tempfile.TemporaryDirectory(prefix="ddtree-smoke-") as tmp:
        model = Path(tmp) / "tiny-qwen3"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_CONFIG))
        if "import" in wanted:
            steps.append(_run_step("import", IMPORT_CODE, {"sys_path": sys_path, "strict": bool(request.get("strict")),
                                                           "modules": _patched_modules(request)}, timeout_s))
        if "server_args" in wanted:
            base = ["--model-path", str(model), "--device", "cpu"]
            steps.append(_run_step("server_args", SERVER_ARGS_V2_CODE if worker == "v2" else SERVER_ARGS_CODE,
                                   {"sys_path": sys_path, "base": base, "draft": str(model)}, timeout_s))
        if "tree" in wanted:
            steps.append(_run_step("tree", TREE_CODE, {"sys_path": sys_path}, timeout_s))
    failed = [s["name"] for s in steps if not s["passed"]]
    warnings = [f"{mod}: not importable here, missing dependency {v['missing_dependency']!r} (not part of the payload)"
                for s in steps if s["name"] == "import" and isinstance(s["detail"], dict)
                for mod, v in s["detail"].items() if v.get("missing_dependency")]
    return {"passed": not failed, "failed_steps": failed, "steps": steps, "warnings": warnings,
            "python": sys.executable, "sglang_version": version, "worker": worker}
