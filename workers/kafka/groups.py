"""Who is consuming: the live members of the workers' consumer groups.

`genpipe submit` uses it to tell a user at once that no generate or derender worker is
running, instead of a silent wait for its timeout.

aiokafka (0.14) pairs DescribeGroups request v3 with the v2 response layout, which lacks
the v3 `authorized_operations` field; Kafka 4 brokers no longer serve v0, so the
version negotiated is v3 and every describe fails with "Buffer underrun decoding
string". Pairing v3 with its own response layout is the whole fix.
"""

from __future__ import annotations

import asyncio

from aiokafka.errors import GroupAuthorizationFailedError, GroupCoordinatorNotAvailableError, KafkaError
from aiokafka.protocol import admin as _protocol

from workers.kafka.clients import make_admin
from workers.kafka.settings import KafkaSettings

if getattr(_protocol, "DescribeGroupsResponse_v3", None) is not None and \
        _protocol.DescribeGroupsRequest_v3.RESPONSE_TYPE is not _protocol.DescribeGroupsResponse_v3:
    _protocol.DescribeGroupsRequest_v3.RESPONSE_TYPE = _protocol.DescribeGroupsResponse_v3


async def group_members(settings: KafkaSettings, group_ids: list[str], timeout_s: float = 10.0) -> dict[str, int]:
    """Live members of each group (0 for a group that is empty or does not exist, -1 for
    one this client may not describe). Raises KafkaError / asyncio.TimeoutError when the
    broker cannot say."""
    return {g: n for g, (_, n) in (await group_states(settings, group_ids, timeout_s)).items()}


async def group_states(settings: KafkaSettings, group_ids: list[str],
                       timeout_s: float = 10.0) -> dict[str, tuple[str, int]]:
    """(state, live members) of each group: state "Stable" once a rebalance is over
    ("Dead" / "Empty" with 0 members for a group with none)."""
    admin = make_admin(settings.with_client_id(f"{settings.client_id}-groups"))
    states = {group_id: ("Dead", 0) for group_id in group_ids}

    async def describe(group_id: str) -> None:
        # One group at a time: a group this client may not describe fails its
        # coordinator's lookup, and with it a call for all of them.
        while True:
            try:
                responses = await admin.describe_consumer_groups([group_id])
                break
            except GroupAuthorizationFailedError:
                states[group_id] = (UNAUTHORIZED, -1)
                return
            except GroupCoordinatorNotAvailableError:
                # A cluster no group has used yet makes its offsets topic first (a second
                # or so): asked again, within the caller's time
                await asyncio.sleep(0.2)
        for response in responses:
            for group in response.groups:
                error_code, described, state, _protocol_type, _assignor, members = group[:6]
                if described == group_id and error_code == 0:
                    states[group_id] = (state, len(members))
                elif described == group_id and error_code == GroupAuthorizationFailedError.errno:
                    states[group_id] = (UNAUTHORIZED, -1)
    try:  # (a start that failed left the client open: each /health call added one)
        await asyncio.wait_for(admin.start(), timeout_s)
        await asyncio.wait_for(asyncio.gather(*(describe(g) for g in group_ids)), timeout_s)
    finally:
        await admin.close()
    return states


UNAUTHORIZED = "Unauthorized"  # a group this client may not describe (ACLs): members -1, unknown


async def missing_workers(settings: KafkaSettings, groups: dict[str, str] | None = None, *,
                          raise_errors: bool = False) -> list[str]:
    """The worker groups (group id -> role; default: this prefix's `<prefix>-generate`
    and `<prefix>-derender`) that have no member right now, as phrases for a user ("no
    generate worker"); [] when each has members or (unless `raise_errors`) the broker
    cannot say. A group this client may not describe is not said to be missing: it
    cannot be told (without the grant, the gateway's /health said 503 for good)."""
    if groups is None:
        groups = {f"{settings.topic_prefix}-generate": "generate", f"{settings.topic_prefix}-derender": "derender"}
    try:
        members = await group_members(settings, list(groups))
    except (KafkaError, asyncio.TimeoutError, OSError):
        if raise_errors:
            raise
        return []
    return [f"no {role} worker (consumer group {group} has no members)"
            for group, role in groups.items() if members.get(group) == 0]
