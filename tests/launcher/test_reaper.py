"""The launcher's reaper: what `kvferry up` started does not outlive it, even a process that
ignores SIGTERM (vLLM while it starts up), and a group it stopped itself is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvferry.launcher.reaper import TAG_ENV, Reaper
from tests.polling import alive

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(120)")


def _group(env: dict[str, str] | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True, text=True,
                         env=env)
    assert p.stdout is not None and p.stdout.readline() == "up\n"  # its SIGTERM handler is set
    return p


def test_a_launcher_that_dies_takes_what_it_started_with_it_even_what_ignores_sigterm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TAG_ENV, raising=False)  # the Reaper sets it; undone after the test
    reaper = Reaper(grace=0.5)
    untagged = {k: v for k, v in os.environ.items() if k != TAG_ENV}  # only the pipe's list speaks here
    tracked, forgotten = _group(untagged), _group(untagged)
    try:
        reaper.track(tracked)
        reaper.track(forgotten)
        reaper.forget(forgotten.pid)  # as after the launcher stopped it (here: left running to see)
        # The launcher's end of the pipe closes, as when the kernel reaps a SIGKILLed launcher.
        assert reaper.proc.stdin is not None
        reaper.proc.stdin.close()
        assert tracked.wait(10) == -signal.SIGKILL  # SIGTERM ignored, SIGKILL after the grace
        assert reaper.proc.wait(10) == 0
        time.sleep(0.2)  # a sleep (window): the forgotten group is not killed meanwhile
        assert alive(forgotten.pid), "a group the launcher had stopped itself must be left alone"
    finally:
        for p in (tracked, forgotten):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if reaper.proc.poll() is None:
            reaper.proc.kill()


def test_a_process_started_but_not_yet_told_to_the_reaper_is_reaped_by_its_tag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher killed between a restart's Popen and its `track`: the process carries the
    launcher's tag (inherited from its environment), and the reaper finds it by that."""
    monkeypatch.delenv(TAG_ENV, raising=False)
    reaper = Reaper(grace=0.5)
    untold = None
    try:
        assert os.environ[TAG_ENV] == reaper.tag  # what the launcher starts from now on inherits it
        untold = _group()  # started, never tracked
        assert reaper.proc.stdin is not None
        reaper.proc.stdin.close()
        assert untold.wait(10) == -signal.SIGKILL
        assert reaper.proc.wait(10) == 0
    finally:
        if untold is not None and untold.poll() is None:
            os.killpg(untold.pid, signal.SIGKILL)
            untold.wait(5)
        if reaper.proc.poll() is None:
            reaper.proc.kill()
