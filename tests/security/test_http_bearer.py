"""The Bearer scheme in any case (RFC 7235), one token check for both edges: unit cases, and gRPC live."""

from __future__ import annotations

import grpc
import pytest
from sloserve.frontend.bearer import bearer_matches
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.live_server import live_server

pytestmark = pytest.mark.timeout(60)
TOKEN = "t0ken-with-sym/+="


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {TOKEN}", True),
        (f"bearer {TOKEN}", True),
        (f"BEARER {TOKEN}", True),
        (f"Bearer   {TOKEN} ", True),
        (None, False),
        (TOKEN, False),
        (f"Basic {TOKEN}", False),
        (f"Bearer {TOKEN}x", False),
        ("Bearer", False),
        (f"Bearer{TOKEN}", False),
        (f"Bearer {TOKEN[:-1]}", False),
    ],
)
def test_bearer_matches(header, ok):
    assert bearer_matches(header, TOKEN) is ok


@pytest.mark.parametrize("scheme", ["bearer", "BEARER"])
async def test_grpc_takes_the_scheme_in_any_case(scheme):
    async with live_server(auth_token=TOKEN) as (_, stub, _):
        assert (
            await stub.Info(pb.InfoRequest(), metadata=(("authorization", f"{scheme} {TOKEN}"),))
        ).model
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Info(pb.InfoRequest(), metadata=(("authorization", f"{scheme} {TOKEN}x"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
