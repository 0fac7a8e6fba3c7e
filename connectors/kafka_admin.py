"""Topic management: create the traces and feedback topics up front.

Creating topics explicitly (instead of relying on broker auto-creation) sets
the configured partition count and avoids losing records sent while a broker
auto-creates a topic (seen with Tansu: 10 sent, 1 kept).
"""

from __future__ import annotations

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import KafkaError, KafkaTimeoutError, TopicAlreadyExistsError
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from connectors.config import KafkaConfig
from connectors.errors import BrokerUnavailableError


@retry(
    retry=retry_if_exception_type((KafkaTimeoutError, OSError)),  # raised when it cannot bootstrap
    wait=wait_exponential(multiplier=0.5, max=5),
    stop=stop_after_delay(60),
    reraise=True,
)
def _admin(cfg: KafkaConfig) -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers, request_timeout_ms=cfg.request_timeout_ms)


def ensure_topics(cfg: KafkaConfig, topics: list[str] | None = None) -> list[str]:
    """Create ``cfg.traces_topic`` and ``cfg.feedback_topic`` (or ``topics``) when missing.

    Each new topic gets ``cfg.partitions`` partitions and
    ``cfg.replication_factor`` replicas; existing topics are left as they are.

    Returns:
        The topics this call created.

    Raises:
        BrokerUnavailableError: no broker answered within 60 s, or creation failed.
    """
    wanted = topics or [cfg.traces_topic, cfg.feedback_topic]
    try:
        admin = _admin(cfg)
    except (KafkaTimeoutError, OSError) as err:
        raise BrokerUnavailableError(
            f"no Kafka broker reachable at {cfg.bootstrap_servers} for 60 s: {err}; is the broker running?"
        ) from err
    try:
        existing = set(admin.list_topics())
        missing = [t for t in wanted if t not in existing]
        if missing:
            new = [
                NewTopic(t, num_partitions=cfg.partitions, replication_factor=cfg.replication_factor) for t in missing
            ]
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass  # another worker created it meanwhile
        return missing
    except KafkaError as err:
        raise BrokerUnavailableError(f"could not create topics {wanted} on {cfg.bootstrap_servers}: {err}") from err
    finally:
        admin.close()


def ensure_routes_topic(cfg: KafkaConfig) -> bool:
    """Create ``cfg.routes_topic`` when missing: one partition (one total order of route changes),
    ``cleanup.policy=compact`` (the broker keeps at least the newest record per key, so reading it from the
    beginning yields every model's current route). An existing topic is left as it is.

    Returns:
        True when this call created it.

    Raises:
        BrokerUnavailableError: no broker answered within 60 s, or creation failed.
    """
    try:
        admin = _admin(cfg)
    except (KafkaTimeoutError, OSError) as err:
        raise BrokerUnavailableError(
            f"no Kafka broker reachable at {cfg.bootstrap_servers} for 60 s: {err}; is the broker running?"
        ) from err
    try:
        if cfg.routes_topic in set(admin.list_topics()):
            return False
        topic = NewTopic(
            cfg.routes_topic,
            num_partitions=1,
            replication_factor=cfg.replication_factor,
            topic_configs={"cleanup.policy": "compact"},
        )
        try:
            admin.create_topics([topic])
        except TopicAlreadyExistsError:
            return False  # another controller created it meanwhile
        return True
    except KafkaError as err:
        raise BrokerUnavailableError(
            f"could not create the routes topic {cfg.routes_topic!r} on {cfg.bootstrap_servers}: {err}"
        ) from err
    finally:
        admin.close()


def consumer_group_lag(cfg: KafkaConfig) -> dict[str, int]:
    """Records not yet committed by ``cfg.group_id``, per ``topic:partition`` (end offset - committed offset).

    Reads committed offsets through a consumer that carries the group id but
    never subscribes (so it does not join the group or trigger a rebalance).
    On Tansu the end offset is the base offset of the last batch + 1
    (a Tansu quirk), so this can under-report there; on Kafka it is exact.

    Raises:
        BrokerUnavailableError: the broker could not be asked.
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = None
    try:
        consumer = KafkaConsumer(
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=cfg.group_id,
            enable_auto_commit=False,
            request_timeout_ms=cfg.request_timeout_ms,
        )
        partitions = [
            TopicPartition(topic, p)
            for topic in (cfg.traces_topic, cfg.feedback_topic)
            for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        ends = consumer.end_offsets(partitions)
        return {f"{tp.topic}:{tp.partition}": max(0, ends[tp] - (consumer.committed(tp) or 0)) for tp in partitions}
    except KafkaError as err:
        raise BrokerUnavailableError(
            f"could not read the lag of group {cfg.group_id!r} at {cfg.bootstrap_servers}: {err}"
        ) from err
    finally:
        if consumer is not None:
            consumer.close(autocommit=False)
