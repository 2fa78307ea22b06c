"""What genpipe's Kafka clients ask of a broker's metadata (no broker)."""

from __future__ import annotations

import pytest
from aiokafka.protocol import metadata


# (the request versions that carry the flag, those this aiokafka has)
VERSIONS = [v for v in range(4, 20) if hasattr(metadata, f"MetadataRequest_v{v}")]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_metadata_request_never_asks_the_broker_to_create_a_topic(version):
    """aiokafka asks for auto-creation in every metadata request that names topics; on a
    broker with Kafka's default auto.create.topics.enable=true, `genpipe tail --topic
    resutls` (a typo), a replay's source or a client's reply topic not made yet were
    created with the broker's default partitions, and waited on, where "does not exist
    (create it with `genpipe topics create`)" is what genpipe says (and what its test
    brokers, made without auto-creation, answer). The consumers', producers' and admin
    clients' requests alike."""
    from aiokafka import client
    from aiokafka.admin import client as admin_client

    import workers.kafka.clients  # noqa: F401  (every genpipe client is made there)

    struct = getattr(metadata, f"MetadataRequest_v{version}")
    for request in (client.MetadataRequest(["genpipe.resutls"]), admin_client.MetadataRequest(["genpipe.x"])):
        built = request.build(struct)
        assert built.allow_auto_topic_creation is False
