"""The docs stay true to the code: every config key documented, README a short guide, no dead links."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from kvferry.common.config import IGNORED_KEYS, KVFerryConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# [text](target) and [text]: target; targets with a scheme or only an anchor are not files.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    targets = [a or b for a, b in LINK.findall(text)]
    return [t for t in targets if not EXTERNAL.match(t) and not t.startswith("#")]


def test_every_config_key_is_in_the_reference() -> None:
    reference = (DOCS / "configuration.md").read_text(encoding="utf-8")
    keys = [f.name for f in msgspec.structs.fields(KVFerryConfig)]
    missing = [k for k in keys if f"`{k}`" not in reference]
    assert not missing, f"docs/configuration.md does not document these config keys: {missing}"


def test_every_ignored_key_is_listed_as_ignored() -> None:
    reference = (DOCS / "configuration.md").read_text(encoding="utf-8")
    section = reference.partition("## Accepted and ignored")[2].partition("\n## ")[0]
    missing = [k for k in IGNORED_KEYS if f"`{k}`" not in section]
    assert not missing, f"docs/configuration.md 'Accepted and ignored' misses: {missing}"


def test_readme_is_a_short_guide() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; keep it <= 300 and move details to docs/"
    assert any("make test" in line for line in lines), "README.md must show `make test` (CI runs it)"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_relative_links_point_to_files(page: Path) -> None:
    dead = []
    for target in _relative_links(page):
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            dead.append(target)
    assert not dead, f"{page.relative_to(ROOT)} links to missing files: {dead}"
