"""What a test can ask vLLM's KV event publisher directly: how many batches its replay socket holds
(its answer to a replay from seq 0, as a subscriber asks), so a test waits for a batch to be
published instead of sleeping."""

from __future__ import annotations

import zmq

END_SEQ = -1  # the replay answer's end marker


def replay_holds(replay_endpoint: str, timeout_ms: int = 2000) -> int:
    """Batches the publisher would replay from seq 0 now; 0 when it does not answer in time."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        n = 0
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            if int.from_bytes(frames[-2], "big", signed=True) == END_SEQ:
                return n
            n += 1
        return 0
    finally:
        sock.close(linger=0)
