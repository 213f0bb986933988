#!/usr/bin/env python3
"""Wait until every server answers /health or its process has died (or the limit passes).
Usage: wait_all.py LIMIT_S PORT:PID [PORT:PID ...]"""
import os
import sys
import time
import urllib.request

limit = time.time() + max(30, int(sys.argv[1]))
pending = dict(a.split(":") for a in sys.argv[2:])
t0 = time.time()
while pending and time.time() < limit:
    for port, pid in list(pending.items()):
        try:
            os.kill(int(pid), 0)
        except OSError:
            print(f"[wait_all] port {port}: server died after {time.time() - t0:.0f}s", flush=True)
            pending.pop(port)
            continue
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3).status == 200:
                print(f"[wait_all] port {port}: healthy after {time.time() - t0:.0f}s", flush=True)
                pending.pop(port)
        except Exception:
            pass
    time.sleep(2)
print(f"[wait_all] still starting at the limit: {sorted(pending)}", flush=True)
