"""Errors raised by the connectors package.

Every error has one root, :class:`ConnectorError`, and subclasses that also
inherit the matching built-in type, so callers may catch either.
"""

from __future__ import annotations


class ConnectorError(Exception):
    """Root of every error raised by ``connectors``."""


class ConnectorConfigError(ConnectorError, ValueError):
    """A connector setting is invalid (bad topic name, unreachable path, ...)."""


class BrokerUnavailableError(ConnectorError, ConnectionError):
    """The Kafka cluster could not be reached after the configured retries."""


class DeliveryError(ConnectorError, ConnectionError):
    """The broker did not acknowledge a produced record (``acks=all``); it may not be stored."""


class BufferStorageError(ConnectorError, OSError):
    """The reward buffer or dead-letter store could not write or read a file."""


class ReplayError(ConnectorError, ValueError):
    """A replay/backfill file could not be read as trace events."""
