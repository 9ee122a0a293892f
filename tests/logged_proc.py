"""A Python child process (`python ARGS`) whose output goes to a log file the test reads back, in a
session of its own so stopping it stops what it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvferry.launcher.vllm_proc import stop_group


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> None:
        stop_group(self.proc, 10)
