"""The configuration tree: defaults, TOML + flag precedence, and errors that name the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from seedance.config import (
    ConfigError,
    SeedanceConfig,
    add_flags,
    build_config,
    config_from_args,
    parse_bool,
)


def parse(*argv: str) -> SeedanceConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults_match_the_documented_values() -> None:
    config = parse()
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8000
    assert config.server.tcp_port is None
    assert config.server.drain_timeout == 30.0
    assert config.engine.model == "seedance-tiny"
    assert config.engine.block_size == 64
    assert config.engine.max_batch_size == 64
    assert config.engine.enable_prefix_caching is True
    assert config.protocol.max_frame == 1 << 20
    assert config.protocol.window == 256
    assert (config.protocol.heartbeat.connection, config.protocol.heartbeat.session,
            config.protocol.heartbeat.stream) == (30.0, 15.0, 8.0)


def test_flags_set_their_fields() -> None:
    config = parse(
        "--model", "null", "--port", "9001", "--tcp-port", "9002", "--streaming-enabled", "false",
        "--kv-cache-dtype", "fp16", "--attention-backend", "torch", "--block-size", "16",
        "--enable-prefix-caching", "false", "--no-torch-compile-fallback", "--enforce-eager",
        "--heartbeat-stream", "5", "--resume-grace", "2.5",
    )
    assert config.engine.model == "null"
    assert (config.server.port, config.server.tcp_port) == (9001, 9002)
    assert config.server.streaming_enabled is False
    assert config.engine.kv_cache_dtype == "fp16"
    assert config.engine.attention_backend == "torch"
    assert config.engine.block_size == 16
    assert config.engine.enable_prefix_caching is False
    assert config.engine.no_torch_compile_fallback is True
    assert config.engine.enforce_eager is True
    assert config.protocol.heartbeat.stream == 5.0
    assert config.protocol.resume_grace == 2.5


def test_bool_flag_without_value_means_true() -> None:
    assert parse("--streaming-enabled").server.streaming_enabled is True


def test_flags_override_the_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "seedance.toml"
    path.write_text(
        '[server]\nport = 1234\nhost = "0.0.0.0"\n[engine]\nmax_batch_size = 8\n'
        "[protocol.heartbeat]\nstream = 4\n"
    )
    config = parse("--config", str(path), "--port", "4321")
    assert config.server.port == 4321
    assert config.server.host == "0.0.0.0"
    assert config.engine.max_batch_size == 8
    assert config.protocol.heartbeat.stream == 4.0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--block-size", "7"], "--block-size"),
        (["--max-batch-size", "0"], "--max-batch-size"),
        (["--port", "70000"], "--port"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--kv-cache-gb", "0"], "--kv-cache-gb"),
        (["--window", "0"], "--window"),
        (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens"),
        (["--tls-cert", "/no/such/cert.pem", "--tls-key", "/no/such/key.pem"], "--tls-cert"),
        (["--tls-key", "/no/such/key.pem"], "--tls-cert"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--heartbeat-stream", "50"], "--heartbeat-stream"),
    ],
)
def test_invalid_values_are_rejected_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(*argv)
    assert flag in str(info.value)


def test_toml_type_error_names_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[engine]\nblock_size = "sixty-four"\n')
    with pytest.raises(ConfigError, match="--block-size"):
        parse("--config", str(path))


def test_unknown_toml_key_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[engine]\nblocksize = 64\n")
    with pytest.raises(ConfigError, match=r"engine\.blocksize"):
        parse("--config", str(path))


def test_missing_and_malformed_config_files_name_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--config: cannot read"):
        parse("--config", str(tmp_path / "absent.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\nport = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse("--config", str(broken))


def test_build_config_accepts_a_partial_tree() -> None:
    config = build_config({"engine": {"model": "null"}})
    assert config.engine.model == "null"
    assert config.server.port == 8000


@pytest.mark.parametrize(("text", "value"), [("true", True), ("Yes", True), ("1", True),
                                             ("off", False), ("FALSE", False), ("0", False)])
def test_parse_bool_accepts_common_spellings(text: str, value: bool) -> None:
    assert parse_bool(text) is value


def test_parse_bool_rejects_other_text() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bool("maybe")
