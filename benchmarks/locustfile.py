"""Locust load for kvferry's proxy (or any OpenAI server): streaming completions and chat.

    locust -f benchmarks/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:9000

Environment: KVFERRY_LOCUST_MODEL (default "tiny"), KVFERRY_LOCUST_MAX_TOKENS (default 16). A
stream counts as failed unless it ends with `data: [DONE]` and carries no error event.
"""

from __future__ import annotations

import json
import os
import random

from locust import FastHttpUser, between, task

MODEL = os.environ.get("KVFERRY_LOCUST_MODEL", "tiny")
MAX_TOKENS = int(os.environ.get("KVFERRY_LOCUST_MAX_TOKENS", "16"))
WORDS = "the river mountain king dragon story cache token prefill decode transfer buffer page".split()


def prompt() -> str:
    return " ".join(random.choice(WORDS) for _ in range(random.randint(20, 200)))


class OpenAIUser(FastHttpUser):
    wait_time = between(0, 0.05)

    def _stream(self, path: str, body: dict, name: str) -> None:
        with self.client.post(path, json=body, catch_response=True, name=name) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            done = False
            for line in (r.text or "").splitlines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if '"error"' in line and "error" in json.loads(line[6:]):
                    r.failure(line[:200])
                    return
            if not done:
                r.failure("stream ended without [DONE]")
            else:
                r.success()

    @task(3)
    def completion(self) -> None:
        self._stream("/v1/completions", {"model": MODEL, "prompt": prompt(), "max_tokens": MAX_TOKENS,
                                         "stream": True}, "completions (stream)")

    @task(1)
    def chat(self) -> None:
        self._stream("/v1/chat/completions", {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": True,
                                              "messages": [{"role": "user", "content": prompt()}]}, "chat (stream)")
