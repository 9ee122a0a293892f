"""A real Prometheus for tests of kvferry's dashboard and alerts (Debian's ``prometheus`` package,
which brings ``promtool``; ``make prometheus`` installs it where apt is usable).

`PrometheusServer` scrapes the given targets every second on loopback, its data in a folder of its
own that `stop()` removes; `query` runs PromQL on its HTTP API. `check_exprs` has promtool parse
bare PromQL expressions (a dashboard's queries) as the recording rules of a throwaway rules file;
`dashboard_queries` reads a Grafana dashboard's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvferry.common.netutil import free_port
from kvferry.launcher.services import Proc, StoreStartError


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def promtool_binary() -> str | None:
    return shutil.which("promtool")


def _exe(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise StoreStartError(f"{name} not found: install Prometheus (Debian/Ubuntu: apt-get install prometheus; "
                              "`make prometheus` does it)")
    return exe


class PromQLError(RuntimeError):
    """Prometheus refused a query (its error names what)."""


class PrometheusServer(Proc):
    """Prometheus on a free loopback port scraping `jobs` (job name -> ["host:port", ...], each
    target's /metrics) every `scrape_interval`, with `rule_files` loaded. Stop it with `stop()`,
    which also removes its folder (config and TSDB)."""

    def __init__(self, jobs: dict[str, list[str]], rule_files: list[Path] | None = None,
                 scrape_interval: str = "1s", ready_timeout: float = 30.0) -> None:
        exe = _exe("prometheus")
        self.folder = Path(tempfile.mkdtemp(prefix="kvferry-prometheus-"))
        port = free_port()
        config = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                             "scrape_timeout": scrape_interval},
                  "rule_files": [str(p) for p in rule_files or []],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                                     for job, targets in jobs.items()]}
        (self.folder / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        argv = [exe, f"--config.file={self.folder / 'prometheus.yml'}", f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        try:
            super().__init__(f"prometheus :{port}", argv, port, self.folder / "prometheus.log")
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise StoreStartError(f"prometheus exited with {self.proc.returncode}: "
                                      f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise StoreStartError(f"prometheus at {self.url} not ready within {timeout:g} s")
            time.sleep(0.1)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant query's result (a vector's samples: ``{"metric": {...}, "value": [t, "v"]}``);
        PromQLError when Prometheus refuses it."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise PromQLError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        result = body["data"]["result"]
        return result if isinstance(result, list) else [{"metric": {}, "value": result}]

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets, each with its `health` ("up", "down", "unknown") and `lastError`."""
        got: list[dict[str, Any]] = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return got

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule, each with its `name`, `health` ("ok", "err", "unknown": not evaluated
        yet), `lastError` and `state` (an alert's: "inactive", "pending", "firing")."""
        groups = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    def stop(self, timeout: float = 10.0) -> None:
        if hasattr(self, "proc"):
            super().stop(timeout)
        shutil.rmtree(self.folder, ignore_errors=True)


def check_exprs(exprs: dict[str, str]) -> None:
    """promtool parses each PromQL expression (name -> expr): they become recording rules of a
    throwaway rules file, which `promtool check rules` reads. AssertionError with promtool's words."""
    exe = _exe("promtool")
    rules = [{"record": f"kvferry_check:expr_{i}", "expr": expr} for i, expr in enumerate(exprs.values())]
    with tempfile.TemporaryDirectory(prefix="kvferry-promtool-") as d:
        path = Path(d) / "exprs.yml"
        path.write_text(json.dumps({"groups": [{"name": "exprs", "rules": rules}]}, indent=1))
        r = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        names = "\n".join(f"  expr_{i}: {name}" for i, name in enumerate(exprs))
        raise AssertionError(f"promtool check rules failed:\n{r.stdout}{r.stderr}\nexpressions:\n{names}")


def dashboard_queries(path: Path, rate_interval: str = "5m") -> dict[str, str]:
    """Every query of a Grafana dashboard's panels (rows' collapsed panels too), keyed
    "panel title / refId", with Grafana's ``$__rate_interval`` made `rate_interval` (plain PromQL)."""
    dash = json.loads(path.read_text())
    out: dict[str, str] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out[f"{p['title']} / {t['refId']}"] = t["expr"].replace("$__rate_interval", rate_interval)
    walk(dash["panels"])
    return out
