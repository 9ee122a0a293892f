"""The HTTP API's request and response bodies, typed so /openapi.json and /docs describe them.

Request fields are strict (no coercion: `"copy": "yes"` is refused, not read as true); a body that
fails them is answered 400 `{"error": ...}` with the message controller/http_api.py gives per field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from kvferry.controller.registry import CPU

TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 31)]
Position = Annotated[list[StrictStr], Field(description="[instance_id, location], e.g. [\"vllm-a\", "
                                                        "\"LocalCPUBackend\"]")]


class RequestBody(BaseModel):
    """Unknown keys are ignored, as LMCache's controller does."""

    model_config = ConfigDict(extra="ignore")


class LookupBody(RequestBody):
    tokens: list[TokenId] = Field(description="the prompt's token ids (POST /tokenize on the vLLM server)")


class MoveRequest(RequestBody):
    # Field order is the order errors are reported in (the first one wins).
    tokens: list[TokenId] = Field(description="the prompt's token ids (POST /tokenize on the vLLM server)")
    # `copy_`: pydantic's BaseModel has a method named copy.
    copy_: StrictBool = Field(False, alias="copy", description="keep the chunks on the source too")
    old_position: Position | None = None
    new_position: Position | None = None


class CheckFinishRequest(RequestBody):
    # Any JSON value is read as its text: an unknown id is a 404, not a 400.
    event_id: Annotated[str, BeforeValidator(str)] = ""


class ClearRequest(RequestBody):
    instance_id: StrictStr | None = Field(None, description="the instance to clear; all of them when left out")
    location: StrictStr = CPU


class ErrorBody(BaseModel):
    error: str


class LookupAnswer(BaseModel):
    event_id: str
    layout_info: dict[str, tuple[str, int]] = Field(
        description="instance_id -> [location, tokens of the prompt's prefix it holds]")


class MoveResponse(BaseModel):
    num_tokens: int
    event_id: str


class MoveEvent(BaseModel):
    """A move's state, kept by the controller (the last 1000) and served as it is."""

    model_config = ConfigDict(populate_by_name=True)

    event_id: str
    status: Literal["pending", "running", "done", "failed"]
    num_tokens: int
    from_: str = Field(alias="from")
    to: str
    copy_: bool = Field(alias="copy")
    nbytes: int | None = None
    error: str | None = None


class ClearResponse(BaseModel):
    event_id: str
    status: Literal["done", "failed"]
    num_chunks: int
    error: str | None = None


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded"]
    instances: list[str]
    loops: dict[str, dict[str, Any]]
    counters: dict[str, int]
    index: dict[str, int]


class StateResponse(BaseModel):
    instances: list[dict[str, Any]]
    transfers: list[dict[str, Any]]
    events: list[dict[str, Any]]
