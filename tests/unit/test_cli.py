"""The `seedance` command line: help lists every flag, errors exit 2 with a message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from seedance.cli import build_parser, main

REQUIRED_FLAGS = [
    "--model", "--host", "--port", "--tcp-port", "--streaming-enabled", "--kv-cache-dtype",
    "--dtype", "--device", "--block-size", "--max-batch-size", "--max-num-batched-tokens",
    "--max-concurrent-requests", "--max-queued-requests", "--kv-cache-gb",
    "--gpu-memory-utilization", "--enable-prefix-caching", "--attention-backend", "--log-level",
    "--trace-output", "--tls-cert", "--tls-key", "--drain-timeout",
    "--no-torch-compile-fallback", "--config",
]


def test_serve_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    missing = [flag for flag in REQUIRED_FLAGS if flag not in text]
    assert missing == []
    assert "{auto,fp32,fp16,bf16}" in text
    assert "{auto,torch,triton}" in text
    assert "{auto,cpu,cuda}" in text


def test_invalid_flag_value_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--block-size", "7"]) == 2
    assert "--block-size" in capsys.readouterr().err


def test_unknown_choice_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--device", "tpu"])
    assert info.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_chat_requires_a_prompt() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat"])


def test_python_dash_m_seedance_reports_its_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "seedance", "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("seedance ")


def test_readme_flag_table_lists_every_flag() -> None:
    from pathlib import Path

    from seedance.config import FLAGS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [flag.name for flag in FLAGS if f"`{flag.name}" not in readme]
    assert missing == []
