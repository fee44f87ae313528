"""Access: the API key, the Host check, and API docs that need no network."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from conftest import MODEL

from declattn.server.access import host_allowed, host_name

openai = pytest.importorskip("openai")

KEY = "sk-test-\u00e9-key"  # not ASCII: the header's bytes are compared, not its decoding
CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def keyed(server_factory: Any) -> Any:
    return server_factory(kv_blocks=32, api_key=KEY)


def _bearer(key: str) -> dict[str, bytes]:
    return {"Authorization": f"Bearer {key}".encode()}


def _unauthorised(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    assert KEY not in r.text and r.headers["www-authenticate"] == "Bearer"


def test_a_request_without_the_key_is_refused(keyed: Any) -> None:
    _unauthorised(httpx.post(keyed.url + CHAT, json=BODY))
    _unauthorised(httpx.post(keyed.url + CHAT, json=BODY, headers=_bearer(KEY + "x")))
    _unauthorised(httpx.post(keyed.url + CHAT, json=BODY, headers=_bearer(KEY[:-1])))
    _unauthorised(httpx.post(keyed.url + CHAT, json=BODY,
                             headers={"Authorization": b"Basic " + KEY.encode()}))
    _unauthorised(httpx.get(keyed.url + "/v1/models"))
    _unauthorised(httpx.get(keyed.url + "/openapi.json"))


def test_the_key_lets_a_request_in(keyed: Any) -> None:
    r = httpx.post(keyed.url + CHAT, json=BODY, headers=_bearer(KEY), timeout=120)
    assert r.status_code == 200, r.text
    lower = {"Authorization": f"bearer {KEY}".encode()}  # the scheme is case-insensitive
    assert httpx.get(keyed.url + "/v1/models", headers=lower).status_code == 200


def test_health_and_metrics_are_open_by_default(keyed: Any) -> None:
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_open_paths_are_configurable(server_factory: Any) -> None:
    """Nothing open: /health and /metrics need the key too; the OpenAI client's
    ``api_key`` is the key."""
    closed = server_factory(kv_blocks=16, api_key="k2", open_paths=())
    assert httpx.get(closed.url + "/health").status_code == 401
    assert httpx.get(closed.url + "/metrics").status_code == 401
    assert httpx.get(closed.url + "/health", headers=_bearer("k2")).status_code == 200
    client = openai.OpenAI(base_url=closed.v1, api_key="k2", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError, match="API key"):
        openai.OpenAI(base_url=closed.v1, api_key="k3", max_retries=0).models.list()


def test_allowed_hosts(server_factory: Any) -> None:
    srv = server_factory(kv_blocks=16, allowed_hosts=("127.0.0.1", "*.example.test"))
    assert httpx.get(srv.url + "/health").status_code == 200  # Host: 127.0.0.1:port
    ok = httpx.get(srv.url + "/health", headers={"Host": "api.example.test:443"})
    assert ok.status_code == 200
    for host in ["evil.test", "example.test.evil", "localhost", "\u00ff\u00fe"]:
        r = httpx.get(srv.url + "/v1/models", headers={"Host": host.encode("latin-1")})
        assert r.status_code == 400, (host, r.text)
        assert r.json()["error"]["code"] == "invalid_host"


@pytest.mark.parametrize(("host", "name"), [
    ("127.0.0.1:8000", "127.0.0.1"), ("[::1]:8000", "::1"), ("::1", "::1"),
    ("Example.COM", "example.com"), ("a.b:80", "a.b"),
])
def test_host_name(host: str, name: str) -> None:
    assert host_name(host) == name


def test_host_patterns() -> None:
    assert host_allowed("x.y.example.com", ("*.example.com",))
    assert not host_allowed("example.com", ("*.example.com",))
    assert not host_allowed("badexample.com", ("*.example.com",))
    assert host_allowed("anything", ("*",))
    assert not host_allowed("anything", ())


def test_docs_work_offline(keyed: Any) -> None:
    """No page the server serves loads anything from another host: FastAPI's /docs and
    /redoc (JavaScript from a CDN) are off, and the schema is served."""
    headers = _bearer(KEY)
    schema = httpx.get(keyed.url + "/openapi.json", headers=headers)
    assert schema.status_code == 200 and CHAT in schema.json()["paths"]
    for path in ["/docs", "/redoc", "/docs/oauth2-redirect"]:
        assert httpx.get(keyed.url + path, headers=headers).status_code == 404
    for route in keyed.app.routes:
        if "GET" in getattr(route, "methods", ()) and "{" not in route.path:
            text = httpx.get(keyed.url + route.path, headers=headers).text
            assert not re.search(r"https?://(?!127\.0\.0\.1)", text), route.path
