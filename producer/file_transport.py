"""The embedded stack's Celery broker: kombu's ``filesystem://`` transport with atomic message files.

kombu's filesystem transport puts a message by creating its ``*.msg`` file and then writing into it, and a
consumer takes the oldest ``*.msg`` file it lists, moves it away and reads it, without the writer's lock. A
consumer that lists the folder between the create and the write reads an empty message; kombu's JSON decode
fails, and Celery stops the worker as an unrecoverable error (exit status 0: ``chorus bench serve --trace fresh
--rate 3`` lost its worker mid-pass this way, with the queue polled every 20 ms). Here a message is written to a
dot-named temporary file the consumer's listing never matches and renamed to its ``*.msg`` name (atomic on
POSIX), so a consumer sees a whole message or none. A message file that still cannot be decoded (written by
something else, a full disk) is logged and skipped instead of stopping the worker.

Selected by ``producer.broker.celery_config`` through Celery's ``broker_transport`` setting (an explicit
transport wins over the ``filesystem://`` URL's scheme), in every process that builds the embedded broker's app.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

log = logging.getLogger(__name__)

# The class path Celery's ``broker_transport`` names.
TRANSPORT_PATH = "producer.file_transport:AtomicFilesystemTransport"


class AtomicChannel(filesystem.Channel):
    # kombu's own signatures differ between its base channel (message) and the filesystem one (payload)
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # kombu's name form (the consumer sorts names: creation time first), in zero-padded nanoseconds rather
        # than milliseconds, so messages put within one millisecond keep their order too.
        name = f"{time.monotonic_ns():020d}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        temporary = os.path.join(self.data_folder_out, f".{name}.tmp")
        try:
            with open(temporary, "wb") as out:
                out.write(str_to_bytes(dumps(payload)))
            os.replace(temporary, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue: Any, timeout: Any = None) -> Any:
        while True:  # each failed decode has taken its file off the queue: the next listing moves on
            try:
                return super()._get(queue)
            except ValueError as exc:
                log.error(
                    "unreadable message file skipped on the embedded broker",
                    extra={"queue": queue, "error": str(exc)[:200]},
                )


class AtomicFilesystemTransport(filesystem.Transport):
    Channel = AtomicChannel
