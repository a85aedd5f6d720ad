"""The client host of test_netns_hosts.py, run inside its own network namespace.

argv: GATEWAY1 GATEWAY2 ENGINE_LEFT ENGINE_STAYS SESSION... Opens one long stream per session
(alternating gateways); prints STARTED once each has its first event, then waits for a line on
stdin (the test has cut a host off); collects every stream's end, sends each session's next turn
through the other gateway, waits for both gateways to forget the lost replica, and prints one
JSON line with everything seen.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx

TOKENS = 120


def stream(gateway: str, session: str, started: threading.Semaphore, out: dict) -> None:
    seen = {"status": None, "replica": None, "tokens": 0, "done": False, "error": None, "exception": None}
    first = True
    body = {"model": "fake", "stream": True, "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": f"hello from {session}"}]}
    try:
        with httpx.stream("POST", gateway + "/v1/chat/completions", json=body,
                          headers={"X-Session-ID": session}, timeout=60) as r:
            seen["status"], seen["replica"] = r.status_code, r.headers.get("x-chatfleet-replica")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if first:
                    first = False
                    started.release()
                data = line[6:]
                if data == "[DONE]":
                    seen["done"] = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    seen["error"] = event["error"].get("message")
                for choice in event.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        seen["tokens"] += 1
    except Exception as exc:  # noqa: BLE001 - reported, judged by the test
        seen["exception"] = f"{type(exc).__name__}: {exc}"
    if first:
        started.release()
    out[session] = seen


def main() -> None:
    g1, g2, lost, stays, *sessions = sys.argv[1:]
    gateways = (g1, g2)
    deadline = time.monotonic() + 120
    while True:  # both gateways up, each with both replicas discovered and healthy
        try:
            ready = all(sum(r["healthy"] for r in httpx.get(g + "/gateway/status", timeout=5).json()["replicas"]) == 2
                        for g in gateways)
        except (httpx.HTTPError, ValueError, KeyError):
            ready = False
        if ready:
            break
        if time.monotonic() > deadline:
            print("NOT READY", flush=True)
            return
        time.sleep(0.2)
    started = threading.Semaphore(0)
    streams: dict[str, dict] = {}
    threads = [threading.Thread(target=stream, args=(gateways[i % 2], s, started, streams))
               for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for _ in sessions:
        started.acquire()
    print("STARTED", flush=True)
    sys.stdin.readline()
    for t in threads:
        t.join(120)
    after = {}
    for i, s in enumerate(sessions):
        body = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": f"again {s}"}]}
        try:
            r = httpx.post(gateways[(i + 1) % 2] + "/v1/chat/completions", json=body,
                           headers={"X-Session-ID": s}, timeout=60)
            after[s] = {"status": r.status_code, "replica": r.headers.get("x-chatfleet-replica")}
        except httpx.HTTPError as exc:
            after[s] = {"status": None, "exception": f"{type(exc).__name__}: {exc}"}
    healed = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not healed:
        try:
            members = [{r["url"] for r in httpx.get(g + "/gateway/status", timeout=5).json()["replicas"]}
                       for g in gateways]
            healed = all(m == {stays} for m in members)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    print(json.dumps({"streams": streams, "after": after, "healed": healed, "lost": lost}), flush=True)


if __name__ == "__main__":
    main()
