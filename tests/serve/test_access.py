"""Access control of the real app in-process: API and admin keys, the Host allow-list, the bodies taken, and a
good query answered after every refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from vlfit.errors import ConfigError
from vlfit.serve.access import AccessPolicy, allowed_hosts, exposure_warning, read_key
from vlfit.serve.app import create_app
from vlfit.serve.engine import SearchEngine

KEY, ADMIN = "k-" + "7" * 30, "a-" + "9" * 30
LOCAL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def engine(served_index: Path) -> SearchEngine:
    return SearchEngine(str(served_index))


def _client(engine: SearchEngine, policy: AccessPolicy, client_host: str = "127.0.0.1") -> TestClient:
    app = create_app(engine, reload_interval=0, access=policy)
    return TestClient(app, base_url=LOCAL, client=(client_host, 50000))


def _search(client: TestClient, key: str | None = None, **headers: str):
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return client.post("/api/search", json={"text": "a red circle", "k": 2}, headers=headers)


def test_with_a_key_every_route_but_the_page_and_health_needs_it(engine) -> None:
    with _client(engine, AccessPolicy(api_key=KEY)) as client:
        assert client.get("/").status_code == 200  # the page asks for the key
        assert client.get("/api/health").status_code == 200
        for answer in (_search(client), _search(client, "wrong"), client.get("/metrics"), client.get("/api/image/0")):
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
            assert "API key" in answer.json()["error"]
        assert _search(client, KEY).status_code == 200
        assert _search(client, **{"X-API-Key": KEY}).status_code == 200
        assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_reload_needs_the_admin_key_and_without_keys_a_loopback_client(engine) -> None:
    with _client(engine, AccessPolicy(api_key=KEY, admin_key=ADMIN)) as client:
        refused = client.post("/api/reload", headers={"Authorization": f"Bearer {KEY}"})
        assert refused.status_code == 401 and "--admin_key" in refused.json()["error"]
        assert client.post("/api/reload", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert _search(client, ADMIN).status_code == 200  # the admin key is taken wherever the API key is
    with _client(engine, AccessPolicy(), client_host="192.0.2.7") as client:
        refused = client.post("/api/reload")
        assert refused.status_code == 403 and "loopback" in refused.json()["error"]
        assert _search(client).status_code == 200
    with _client(engine, AccessPolicy()) as client:
        assert client.post("/api/reload").status_code == 200


def test_a_foreign_host_header_is_refused_before_anything_runs(engine) -> None:
    """DNS rebinding: a page of evil.example that resolves to 127.0.0.1 sends its own name as Host."""
    with _client(engine, AccessPolicy(allowed_hosts=allowed_hosts(None, "127.0.0.1"))) as client:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            answer = _search(client, Host=host)
            assert answer.status_code == 400 and "--allowed_hosts" in answer.json()["error"], host
            assert client.get("/api/image/0", headers={"Host": host}).status_code == 400
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
            assert _search(client, Host=host).status_code == 200, host
    with _client(engine, AccessPolicy(allowed_hosts=("*",))) as client:
        assert _search(client, Host="anything.example").status_code == 200


def test_json_routes_take_only_json_bodies(engine) -> None:
    """A cross-site ``text/plain`` form post needs no preflight: it must never reach the JSON parser."""
    with _client(engine, AccessPolicy()) as client:
        body = '{"text": "a red circle", "k": 2}'
        for kind in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Content-Type": kind} if kind else {}
            answer = client.post("/api/search", content=body, headers=headers)
            assert answer.status_code == 415 and "application/json" in answer.json()["error"], kind
        answer = client.post("/api/reload", content="{}", headers={"Content-Type": "multipart/form-data; boundary=x"})
        assert answer.status_code == 415
        assert client.post("/api/search", content=body, headers={"Content-Type": "application/json"}).status_code == 200


def test_keys_come_from_the_flag_a_file_or_the_environment_and_are_never_shown(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("VLFIT_API_KEY", raising=False)
    assert read_key(None, None, "VLFIT_API_KEY", "--api_key") is None
    monkeypatch.setenv("VLFIT_API_KEY", "from-env")
    assert read_key(None, None, "VLFIT_API_KEY", "--api_key") == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored\n")
    assert read_key(None, str(key_file), "VLFIT_API_KEY", "--api_key") == "from-file"
    assert read_key("from-flag", str(key_file), "VLFIT_API_KEY", "--api_key") == "from-flag"
    with pytest.raises(ConfigError, match=r"--api_key_file .*missing: no such file"):
        read_key(None, str(tmp_path / "missing"), "VLFIT_API_KEY", "--api_key")
    with pytest.raises(ConfigError, match=r"--api_key is blank"):
        read_key("  ", None, "VLFIT_API_KEY", "--api_key")
    assert KEY not in repr(AccessPolicy(api_key=KEY)) and "api_key" in repr(AccessPolicy(api_key=KEY))


def test_results_and_health_name_files_relative_to_the_indexed_folder(tiny_checkpoint, tmp_path) -> None:
    """No answer shows the server's directories, unless asked (--show_absolute_paths, for local use)."""
    import vlfit
    from tests.inference.several_captions import jpeg

    images = tmp_path / "private" / "photos"
    (images / "trips").mkdir(parents=True)
    for number in range(4):
        (images / "trips" / f"p{number}.jpg").write_bytes(jpeg(number))
    vlfit.Index.build(str(tiny_checkpoint), str(tmp_path / "index"), images=str(images))
    for absolute in (False, True):
        engine = SearchEngine(str(tmp_path / "index"), absolute_paths=absolute)
        with TestClient(create_app(engine, reload_interval=0, access=AccessPolicy()), base_url=LOCAL) as client:
            results = _search(client).json()["results"]
            health = client.get("/api/health").json()
        shown = {result["path"] for result in results} | {result["item"] for result in results}
        if absolute:
            assert all(path.startswith(str(images)) for path in shown)
            assert health["index"] == str((tmp_path / "index").resolve()) and str(tiny_checkpoint) in health["model"]
        else:
            assert shown <= {f"trips/p{number}.jpg" for number in range(4)} and len(results) == 2
            assert str(tmp_path) not in str(health) and health["index"] == "index"


def test_binding_beyond_loopback_without_a_key_is_warned_about() -> None:
    assert "--api_key" in exposure_warning("0.0.0.0", AccessPolicy())
    assert exposure_warning("0.0.0.0", AccessPolicy(api_key=KEY)) is None
    assert exposure_warning("127.0.0.1", AccessPolicy()) is None and exposure_warning("::1", AccessPolicy()) is None
    assert allowed_hosts(None, "0.0.0.0") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts(None, "10.0.0.5")[-1] == "10.0.0.5" and allowed_hosts(["Search.Example"], "x") == (
        "search.example",
    )


def test_tls_files_go_together_and_must_exist(tmp_path) -> None:
    from vlfit.commands.serve import ServeArguments

    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="--ssl_certfile and --ssl_keyfile go together"):
        ServeArguments(index="i", ssl_certfile=str(cert))
    with pytest.raises(ConfigError, match=r"--ssl_keyfile .*missing.pem: no such file"):
        ServeArguments(index="i", ssl_certfile=str(cert), ssl_keyfile=str(tmp_path / "missing.pem"))
    settings = ServeArguments(index="i", api_key=KEY)
    assert KEY not in repr(settings) and settings.access().api_key == KEY
