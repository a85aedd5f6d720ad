import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from chatfleet.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    RateLimitError,
    ServerOverloadedError,
)
from chatfleet.protocol.errors import (
    error_event,
    error_payload,
    error_response,
    install_exception_handlers,
    to_chatfleet_error,
)
from chatfleet.protocol.openai import ChatCompletionRequest, ErrorResponse
from chatfleet.protocol.sse import iter_sse


def test_payload_shape():
    p = error_payload(ModelNotFoundError("no model 'x'", param="model"))
    assert p == {"error": {"message": "no model 'x'", "type": "invalid_request_error",
                           "param": "model", "code": "model_not_found"}}
    ErrorResponse.model_validate(p)


def test_status_and_retry_after():
    assert error_response(ServerOverloadedError("full")).status_code == 503
    r = error_response(RateLimitError("slow down", retry_after_s=2.2))
    assert r.status_code == 429 and r.headers["retry-after"] == "3"


def test_validation_error_maps_to_400_with_param():
    with pytest.raises(ValidationError) as ei:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3})
    err = to_chatfleet_error(ei.value)
    assert err.status_code == 400 and err.param == "max_tokens" and "max_tokens" in err.message


def test_json_decode_and_unknown():
    try:
        json.loads("{bad")
    except json.JSONDecodeError as e:
        assert to_chatfleet_error(e).status_code == 400
    assert to_chatfleet_error(RuntimeError("boom")).status_code == 500


def test_error_event_is_sse():
    (ev,) = list(iter_sse([error_event(InvalidRequestError("bad"))]))
    assert ev.json()["error"]["message"] == "bad"


def _app():
    app = FastAPI()
    install_exception_handlers(app)

    @app.post("/chat")
    async def chat(req: ChatCompletionRequest):
        return {"ok": True}

    @app.get("/full")
    async def full():
        raise ServerOverloadedError("queue full")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("boom")

    return app


@pytest.mark.parametrize(
    "content,status",
    [(b"{not json", 400), (b'{"messages": []}', 400), (b'{"messages": [{"role": "user", "content": 3}]}', 400),
     (b"", 400)],
)
def test_handlers_on_app(content, status):
    client = TestClient(_app(), raise_server_exceptions=False)
    r = client.post("/chat", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


def test_handlers_other_statuses():
    client = TestClient(_app(), raise_server_exceptions=False)
    assert client.get("/full").status_code == 503
    assert client.get("/full").json()["error"]["code"] == "queue_full"
    assert client.get("/nope").status_code == 404
    assert client.get("/nope").json()["error"]["type"] == "not_found_error"
    r = client.get("/boom")
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
