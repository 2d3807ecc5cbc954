"""OpenAI's Files API: upload a batch's input, read a batch's output, list and delete.

Each file belongs to the API key that uploaded it (or to the batch whose key it was): other
keys get 404, as for a file that does not exist. Only `purpose=batch` is taken.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from common.errors import InvalidRequest, ObjectNotFound
from gateway.files import FileMeta, file_meta, new_file_id
from gateway.routes.objects import (
    after_cursor,
    answers_errors,
    caller,
    json_response,
    page,
    query_int,
)
from gateway.services import Services

ROUTE = "/v1/files"
MAX_LIST = 10_000


async def owned_file(services: Services, owner: str, file_id: str) -> FileMeta:
    meta = await services.files.meta(file_id)
    if meta is None or meta.owner != owner:
        raise ObjectNotFound(f"no file {file_id!r}", param="file_id")
    return meta


@answers_errors
async def create(request: Request) -> Response:
    services, owner = caller(request)
    async with request.form(max_files=1, max_fields=4) as form:
        unknown = sorted(set(form.keys()) - {"file", "purpose"})
        if unknown:  # e.g. `expires_after`: refused, not ignored (a file is kept until deleted)
            raise InvalidRequest(f"{unknown[0]} is not supported here", param=unknown[0])
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise InvalidRequest(
                "purpose must be 'batch': this server stores batch input files", param="purpose"
            )
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("send the file as the multipart field `file`", param="file")
        data = await upload.read()
        filename = upload.filename or "upload.jsonl"
    limit = services.settings.max_file_bytes
    if len(data) > limit:
        message = f"file of {len(data)} bytes exceeds max_file_bytes ({limit})"
        raise InvalidRequest(message, param="file")
    if not data:
        raise InvalidRequest("the file is empty", param="file")
    meta = file_meta(new_file_id(), len(data), filename, "batch", owner)
    await services.files.put(meta, data)
    return json_response(meta.object())


@answers_errors
async def listing(request: Request) -> Response:
    services, owner = caller(request)
    query = request.query_params
    limit = query_int(query.get("limit"), MAX_LIST, MAX_LIST, "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    purpose = query.get("purpose")
    found = [m for m in await services.files.list(owner) if purpose in (None, m.purpose)]
    if order == "desc":
        found.reverse()
    ids, more = after_cursor([m.id for m in found], query.get("after"), limit)
    by_id = {m.id: m for m in found}
    return page([by_id[file_id].object() for file_id in ids], more)


@answers_errors
async def retrieve(request: Request) -> Response:
    services, owner = caller(request)
    meta = await owned_file(services, owner, request.path_params["file_id"])
    return json_response(meta.object())


@answers_errors
async def content(request: Request) -> Response:
    services, owner = caller(request)
    meta = await owned_file(services, owner, request.path_params["file_id"])
    try:
        data = await services.files.content(meta.id)
    except FileNotFoundError:
        raise ObjectNotFound(f"no file {meta.id!r}", param="file_id") from None
    return Response(data, media_type="application/jsonl")


@answers_errors
async def delete(request: Request) -> Response:
    services, owner = caller(request)
    meta = await owned_file(services, owner, request.path_params["file_id"])
    await services.files.delete(meta.id)
    return json_response({"id": meta.id, "object": "file", "deleted": True})


def install(app: FastAPI) -> None:
    app.add_api_route(ROUTE, create, methods=["POST"], summary="Upload a batch input file")
    app.add_api_route(ROUTE, listing, methods=["GET"], summary="List files")
    app.add_api_route(ROUTE + "/{file_id}", retrieve, methods=["GET"], summary="A file")
    app.add_api_route(ROUTE + "/{file_id}", delete, methods=["DELETE"], summary="Delete a file")
    app.add_api_route(
        ROUTE + "/{file_id}/content", content, methods=["GET"], summary="A file's bytes"
    )
