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
