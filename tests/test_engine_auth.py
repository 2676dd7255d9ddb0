"""Who may call what on an engine: our classification of endpoints and the embedded engine's key
check, against SGLang 0.5.23's own route decorators and decision function (the referee)."""

from __future__ import annotations

import ast
import importlib.util
import itertools
from pathlib import Path

import pytest

from slimrl.rollout.embedded.server import ServerArgs, request_allowed
from slimrl.weight_sync.engines import ADMIN_ENDPOINTS, auth_header

EMBEDDED_ROUTES = (
    "generate", "health", "health_generate", "ping", "ready", "get_model_info", "model_info",
    "get_server_info", "server_info", "get_load", "v1/loads", *sorted(ADMIN_ENDPOINTS),
)  # fmt: skip


def sglang_auth_levels() -> dict[str, str]:
    """Path -> auth level of every route SGLang's HTTP server declares, read from its source."""
    spec = importlib.util.find_spec("sglang")  # read, not imported (importing it takes seconds)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "srt" / "entrypoints" / "http_server.py"
    levels: dict[str, str] = {}
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        paths, level = [], "normal"
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call) or not deco.args:
                continue
            name = ast.unparse(deco.func)
            if name.startswith("app.") and isinstance(deco.args[0], ast.Constant):
                paths.append(str(deco.args[0].value).strip("/"))
            elif name == "auth_level":
                level = ast.unparse(deco.args[0]).split(".")[-1].lower()
        for path in paths:
            levels[path] = level
    return levels


def test_admin_endpoints_are_sglangs_admin_level_routes() -> None:
    levels = sglang_auth_levels()
    assert {p for p in EMBEDDED_ROUTES if levels.get(p) == "admin_optional"} == set(ADMIN_ENDPOINTS)
    assert all(levels.get(p, "normal") == "normal" for p in EMBEDDED_ROUTES if p not in ADMIN_ENDPOINTS)


@pytest.mark.parametrize(("api_key", "admin_key"), [(None, None), ("K", None), (None, "A"), ("K", "A")])
def test_embedded_engine_decides_like_sglang(api_key: str | None, admin_key: str | None) -> None:
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    args = ServerArgs(model_path="unused", api_key=api_key, admin_api_key=admin_key)
    paths = [*EMBEDDED_ROUTES, "metrics", "health/deep"]
    headers = [None, "Bearer K", "Bearer A", "bearer K", "Basic K", "Bearer", "Bearer K2"]
    for path, header in itertools.product(paths, headers):
        level = AuthLevel.ADMIN_OPTIONAL if path in ADMIN_ENDPOINTS else AuthLevel.NORMAL
        expected = decide_request_auth(
            method="POST", path=f"/{path}", authorization_header=header, api_key=api_key,
            admin_api_key=admin_key, auth_level=level,
        ).allowed  # fmt: skip
        assert request_allowed(f"/{path}", header, args) == expected, (path, header)


@pytest.mark.parametrize(("api_key", "admin_key"), [(None, None), ("K", None), (None, "A"), ("K", "A")])
def test_clients_send_the_key_sglang_accepts_for_each_endpoint(
    api_key: str | None, admin_key: str | None
) -> None:
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    for path in EMBEDDED_ROUTES:
        level = AuthLevel.ADMIN_OPTIONAL if path in ADMIN_ENDPOINTS else AuthLevel.NORMAL
        header = auth_header(path, api_key, admin_key).get("Authorization")
        assert decide_request_auth(
            method="POST", path=f"/{path}", authorization_header=header, api_key=api_key,
            admin_api_key=admin_key, auth_level=level,
        ).allowed, path  # fmt: skip
