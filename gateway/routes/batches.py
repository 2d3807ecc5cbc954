"""OpenAI's Batch API: create a batch from an uploaded file, follow it, list, cancel.

Creating one only records it (`validating`) and returns; the `BatchFeeder` of whichever
gateway takes it up validates and drives it, so the status and results of any batch are
served by any gateway of the fleet. `/v1/rerank` is accepted as an endpoint beyond
OpenAI's list.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import Conflict, ObjectNotFound
from gateway.batch_records import TERMINAL, batch_object, new_batch_id
from gateway.request import validation_error
from gateway.routes.files import owned_file
from gateway.routes.objects import (
    after_cursor,
    answers_errors,
    caller,
    json_response,
    page,
    query_int,
)
from gateway.services import Services

ROUTE = "/v1/batches"
WINDOW_S = {"24h": 24 * 3600}


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/rerank"]
    completion_window: Literal["24h"]
    # OpenAI's Metadata: at most 16 pairs, keys to 64 characters, values to 512
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(default=None, max_length=16)


async def _owned(services: Services, owner: str, batch_id: str) -> dict[str, str]:
    record = await services.batch_records.get(batch_id)
    if record is None or record["owner"] != owner:
        raise ObjectNotFound(f"no batch {batch_id!r}", param="batch_id")
    return record


@answers_errors
async def create(request: Request) -> Response:
    services, owner = caller(request)
    try:
        body = CreateBatch.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc) from None
    await owned_file(services, owner, body.input_file_id)
    now = int(time.time())
    record = {
        "id": new_batch_id(),
        "owner": owner,
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "status": "validating",
        "created_at": str(now),
        "expires_at": str(now + WINDOW_S[body.completion_window]),
        "metadata": orjson.dumps(body.metadata).decode() if body.metadata else "",
        "total": "0",
        "completed": "0",
        "failed": "0",
    }
    kept_s = WINDOW_S[body.completion_window] + services.settings.batch_output_ttl_s
    await services.batch_records.create(record, kept_s)
    services.batches_changed.set()
    return json_response(batch_object(record))


@answers_errors
async def retrieve(request: Request) -> Response:
    services, owner = caller(request)
    record = await _owned(services, owner, request.path_params["batch_id"])
    return json_response(batch_object(record))


@answers_errors
async def listing(request: Request) -> Response:
    """Newest first, as OpenAI lists them, `limit` (1..100, 20) past the `after` cursor."""
    services, owner = caller(request)
    limit = query_int(request.query_params.get("limit"), 20, 100, "limit")
    ids = list(reversed(await services.batch_records.owned(owner)))
    chosen, more = after_cursor(ids, request.query_params.get("after"), limit)
    records = [await services.batch_records.get(batch_id) for batch_id in chosen]
    return page([batch_object(r) for r in records if r is not None], more)


@answers_errors
async def cancel(request: Request) -> Response:
    """`cancelling` at once; its driver stops feeding, hangs up on the lines in flight and
    writes `cancelled` within a second or two. A finished batch cannot be cancelled (409)."""
    services, owner = caller(request)
    batch_id = request.path_params["batch_id"]
    record = await _owned(services, owner, batch_id)
    if record["status"] in TERMINAL or record["status"] == "finalizing":
        raise Conflict(f"batch {batch_id!r} is {record['status']}: it cannot be cancelled")
    if not record.get("cancelling_at"):
        record["cancelling_at"] = str(int(time.time()))
        await services.batch_records.update(batch_id, cancelling_at=record["cancelling_at"])
    return json_response(batch_object(record))


def install(app: FastAPI) -> None:
    schema = {
        "requestBody": {
            "content": {"application/json": {"schema": CreateBatch.model_json_schema()}},
            "required": True,
        }
    }
    app.add_api_route(
        ROUTE, create, methods=["POST"], summary="Create a batch", openapi_extra=schema
    )
    app.add_api_route(ROUTE, listing, methods=["GET"], summary="List batches, newest first")
    app.add_api_route(ROUTE + "/{batch_id}", retrieve, methods=["GET"], summary="A batch")
    app.add_api_route(
        ROUTE + "/{batch_id}/cancel", cancel, methods=["POST"], summary="Cancel a batch"
    )
