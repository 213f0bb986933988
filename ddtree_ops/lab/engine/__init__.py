"""The lab engine: the CPU stand-in for `sglang.launch_server` on the lab hosts.

In the repository it is `ddtree_ops.lab.engine`; `lab up` copies it onto every lab host as the
top-level package `ddtree_lab_engine` of the host's SGLang venv, where systemd starts it as

    /opt/sglang/venv/bin/python -m ddtree_lab_engine ARGS

with exactly the ARGS production passes to `python -m sglang.launch_server`. It parses them with
the host's installed SGLang (`prepare_server_args`, pristine or patched), decodes a tiny Llama-shaped
model (`model.py`) with a noisy-oracle draft (`draft.py`), runs DDTree through the host's installed
`sglang.srt.speculative.ddtree_utils` (`decoding.py`), and serves SGLang 0.5.13.post1's HTTP names
and shapes (`api.py`, `http_server.py`). It imports only the standard library, torch, tokenizers,
safetensors and the host's sglang — never ddtree_ops.

Fault switches (environment, read at start; the table is `faults.SWITCHES`):

    DDTREE_LAB_START_DELAY_S=S               wait S seconds before loading (503 meanwhile)
    DDTREE_LAB_FAULT_FAIL_AT_START=1         exit 1 after parsing the arguments
    DDTREE_LAB_FAULT_NEVER_HEALTHY=1         serve, but /health and /health_generate stay 503
    DDTREE_LAB_FAULT_CRASH_AFTER_REQUESTS=N  die (exit 1) once N /generate requests were answered
    DDTREE_LAB_FAULT_WRONG_TOKENS_AFTER=N    full mode: bonus tokens from output index N on are wrong
    DDTREE_LAB_FAULT_LOW_ACCEPTANCE=1        the draft ranks the target's token last (accept length 1)
    DDTREE_LAB_FAULT_HANG_ON_MIXED=1         stall for good once greedy and sampled requests run together
    DDTREE_LAB_DRAIN_TIMEOUT_S=S             SIGTERM waits at most S s for in-flight requests (default 20)
"""
