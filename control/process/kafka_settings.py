"""The librdkafka settings a user gives rove for their Kafka cluster: TLS, SASL and
any other client setting (`security.protocol`, `ssl.ca.location`, `sasl.mechanism`,
`sasl.username`, `sasl.password`, ...).

They come from a properties file, as Kafka's own clients read theirs
(`client.properties`): one `key=value` per line, `#` or `!` starting a comment. Its
path is given with `--kafka-config FILE` or in `ROVE_KAFKA_CONFIG`, never the secrets
themselves: a command line is readable by every user of the machine (`ps`), a file
can be mode 0600 or a mounted Kubernetes Secret.

The settings rove makes itself on its consumers (`OWNED`) cannot be changed: they
are what its exactly-once reading rests on. `parse` is pure; `load` reads the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException

from rove.control.errors import ConfigError

#: The environment variable naming the file (what `rove run --kafka-config` sets for
#: the workers; the bridge reads it when `--kafka-config` is not given).
ENV = "ROVE_KAFKA_CONFIG"

#: Settings rove makes itself: the brokers (`--bootstrap`), its groups and offsets.
OWNED = frozenset(
    {
        "bootstrap.servers",
        "metadata.broker.list",
        "group.id",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "enable.partition.eof",
        "auto.offset.reset",
        "allow.auto.create.topics",
        "logger",
        "error_cb",
    }
)

#: Words in a key whose value is a secret: never logged.
_SECRET_WORDS = ("password", "secret", "token", "key.pem", "private")


def parse(text: str, source: str) -> dict[str, str]:
    """The settings of a properties file's `text` (`source` names it in errors).

    Raises:
        ConfigError: a line is not `key=value`, a key comes twice, or a key is one rove
            makes itself. The message names the line, never a value.
    """
    settings: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key or any(c.isspace() for c in key):
            raise ConfigError(
                f"{source}, line {number}: not a `key=value` setting (librdkafka's "
                "properties, one per line; # starts a comment)"
            )
        if key in OWNED:
            raise ConfigError(
                f"{source}, line {number}: {key} is set by rove itself (the brokers come "
                "from --bootstrap / --kafka-bootstrap; groups and offsets are rove's): "
                "remove it"
            )
        if key in settings:
            raise ConfigError(f"{source}, line {number}: {key} is set twice")
        settings[key] = value.strip()
    return settings


def load(path: str | None = None, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The settings in the file at `path`, else at `$ROVE_KAFKA_CONFIG`; none without either.

    Raises:
        ConfigError: the file cannot be read, or `parse` refuses it.
    """
    where = path or env.get(ENV, "")
    if not where:
        return {}
    try:
        text = Path(where).read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the Kafka settings file {where} ({exc.strerror or exc}): "
            f"check the path given to --kafka-config or in {ENV}"
        ) from exc
    return parse(text, f"the Kafka settings file {where}")


def shown(settings: Mapping[str, str]) -> dict[str, str]:
    """`settings` fit for a log line: every secret's value hidden."""
    return {
        k: "***" if any(w in k.lower() for w in _SECRET_WORDS) else v for k, v in settings.items()
    }


def merged(settings: Mapping[str, str], own: Mapping[str, Any]) -> dict[str, Any]:
    """A consumer's configuration: the user's `settings` under rove's `own`."""
    return {**settings, **own}


def consumer(settings: Mapping[str, str], own: Mapping[str, Any]) -> Consumer:
    """A librdkafka consumer with the user's `settings` under rove's `own`.

    Raises:
        ConfigError: librdkafka refuses a setting (it names it).
    """
    try:
        return Consumer(merged(settings, own))
    except KafkaException as exc:
        error = exc.args[0]
        said = error.str() if isinstance(error, KafkaError) else str(error)
        raise ConfigError(
            f"the Kafka client refuses its settings: {said} (check the file given to "
            f"--kafka-config or in {ENV})"
        ) from exc


def kept_error(kept: str, error: KafkaError) -> str:
    """The client error worth saying after `error` came: the newest, except that "all
    brokers are down" does not hide why (a refused login, a certificate)."""
    if error.code() == KafkaError._ALL_BROKERS_DOWN and kept:
        return kept
    return str(error.str())


def last_error(said: str) -> str:
    """What to add to a message about brokers that do not answer: the Kafka client's
    own last error (a refused login, a certificate it does not trust), if any."""
    return f"; the Kafka client's last error: {said}" if said else ""
