"""``declattn serve``'s flags: the limits, timeouts and key they give the server."""

from __future__ import annotations

import pytest

from declattn.cli import build_parser
from declattn.cli.common import UserError
from declattn.cli.serve_cmd import API_KEY_ENV, server_config
from declattn.server.app import ServerConfig


def _config(*flags: str) -> ServerConfig:
    return server_config(build_parser().parse_args(["serve", "--model", "smollm2-135m", *flags]))


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = _config()
    assert config.max_request_bytes == 16 * 1024 * 1024
    assert config.body_timeout_s == 30.0 and config.header_timeout_s == 10.0
    assert config.prepare_workers == 4
    assert config.api_key is None and config.allowed_hosts is None
    assert config.open_paths == ("/health", "/metrics")
    assert config.freeze_heap  # the process only serves: its start-up heap is frozen
    assert not ServerConfig(model_id="m").freeze_heap  # an app embedded elsewhere: off


def test_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = _config("--max-request-bytes", "1000", "--body-timeout", "2.5",
                     "--header-timeout", "3", "--prepare-workers", "2", "--api-key", "k",
                     "--open-paths", "", "--allowed-hosts", "a.test, *.b.test")
    assert (config.max_request_bytes, config.body_timeout_s, config.header_timeout_s) == (
        1000, 2.5, 3.0)
    assert config.prepare_workers == 2 and config.api_key == "k"
    assert config.open_paths == () and config.allowed_hosts == ("a.test", "*.b.test")


def test_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _config().api_key == "from-env"
    assert _config("--api-key", "flag").api_key == "flag"  # the flag wins
    monkeypatch.setenv(API_KEY_ENV, "")
    assert _config().api_key is None  # set but empty: no key


@pytest.mark.parametrize("flags", [
    ["--max-request-bytes", "0"], ["--body-timeout", "0"], ["--header-timeout", "-1"],
    ["--prepare-workers", "0"], ["--api-key", " "],
])
def test_bad_values(flags: list[str]) -> None:
    with pytest.raises(UserError):
        _config(*flags)
