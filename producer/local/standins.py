"""Embedded stand-ins for backing services, each in a helper process, for the demo and the tests.

- Kafka: librdkafka's built-in mock cluster (a Kafka-protocol broker, in memory) — real Kafka in production.
- S3: moto's S3 server, spoken to with the same minio client as MinIO in production. moto keeps objects in
  memory; with ``persist_dir`` the helper restores a snapshot of every bucket from that folder when it starts
  and writes one back when it stops (both through the S3 API, with the minio client), so objects outlive it.

``start_service`` launches ``python -m producer.local.standins <kind>``, which prints ``READY <host:port>`` once
it serves and exits when its stdin closes (or on SIGTERM), so a stand-in never outlives the process that started
it. A helper ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the process that started
the helper decides when it stops (a persisting S3 helper must write its snapshot first).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ServiceKind = Literal["kafka", "s3"]

log = logging.getLogger(__name__)

# Credentials the S3 helper uses for its own snapshot and restore (moto accepts any).
_HELPER_KEY = "chorus-embedded"
_MANIFEST = "manifest.json"
_META_PREFIX = "x-amz-meta-"


class EmbeddedServiceError(RuntimeError):
    pass


@dataclass
class EmbeddedService:
    kind: ServiceKind
    address: str
    process: subprocess.Popen[bytes]
    # The folder an S3 helper snapshots its buckets to when it stops (None: in memory only).
    persist_dir: Path | None = None
    log_path: Path | None = None

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self, timeout: float | None = None) -> None:
        """Close the helper's stdin (it then snapshots, if it persists, and exits); kill it after ``timeout``."""
        if timeout is None:
            timeout = 120.0 if self.persist_dir is not None else 10.0
        if self.process.poll() is not None:
            return
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


def start_service(
    kind: ServiceKind,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ready_timeout: float = 60.0,
    persist_dir: Path | None = None,
    log_path: Path | None = None,
) -> EmbeddedService:
    """Start one stand-in and return once it serves. ``persist_dir`` (S3 only) keeps objects across runs;
    ``log_path`` receives the helper's stderr (appended)."""
    if persist_dir is not None and kind != "s3":
        raise ValueError("only the S3 stand-in persists")
    argv = [sys.executable, "-m", "producer.local.standins", kind, "--host", host, "--port", str(port)]
    if persist_dir is not None:
        argv += ["--persist-dir", str(persist_dir)]
    log_file: IO[bytes] | None = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = log_path.open("ab")
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file if log_file is not None else subprocess.DEVNULL,
        )
    finally:
        if log_file is not None:
            log_file.close()  # the child holds its own descriptor
    assert process.stdout is not None
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            where = f"; see {log_path}" if log_path is not None else ""
            raise EmbeddedServiceError(
                f"embedded {kind} exited with status {process.returncode} before it served{where}"
            )
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            line = process.stdout.readline().decode().strip()
            if line.startswith("READY "):
                return EmbeddedService(
                    kind=kind,
                    address=line.split(" ", 1)[1],
                    process=process,
                    persist_dir=persist_dir,
                    log_path=log_path,
                )
    process.kill()
    process.wait(timeout=10)
    raise EmbeddedServiceError(f"embedded {kind} did not become ready within {ready_timeout:.0f} s")


# --- S3 snapshots ---------------------------------------------------------------------------------------------


class SnapshotObject(BaseModel):
    model_config = ConfigDict(frozen=True)

    bucket: str
    key: str
    file: str = Field(description="file name under objects/")
    size: int = Field(ge=0)
    etag: str
    content_type: str
    metadata: dict[str, str] = Field(default_factory=dict, description="user metadata, without x-amz-meta-")


class SnapshotManifest(BaseModel):
    """What a snapshot folder holds: ``manifest.json`` (this) and ``objects/<file>`` per object."""

    version: Literal[1] = 1
    saved_at: datetime
    buckets: list[str]
    objects: list[SnapshotObject]

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)


def read_snapshot(directory: Path) -> SnapshotManifest | None:
    """The manifest of the snapshot in ``directory``, or None if there is none.

    A snapshot is replaced by renaming (``<dir>.new`` → ``<dir>``, the old one parked at ``<dir>.old``); if a
    crash interrupted the swap, the complete one that is left is used.
    """
    for candidate in (directory, directory.with_name(directory.name + ".old")):
        if (candidate / _MANIFEST).is_file():
            if candidate != directory:
                shutil.rmtree(directory, ignore_errors=True)
                candidate.rename(directory)
            return SnapshotManifest.model_validate_json((directory / _MANIFEST).read_bytes())
    return None


def _object_file(bucket: str, key: str) -> str:
    # Keys may hold any character; file names are a digest of bucket and key.
    return hashlib.sha256(f"{bucket}\0{key}".encode()).hexdigest()


def snapshot_s3(client: Any, directory: Path) -> SnapshotManifest:
    """Copy every object of every bucket the minio ``client`` sees into ``directory`` (replacing what it held).

    Objects unchanged since the previous snapshot (same key, size and ETag) are hard-linked, not downloaded.
    """
    previous = read_snapshot(directory)
    unchanged = {(o.bucket, o.key): o for o in previous.objects} if previous else {}
    new = directory.with_name(directory.name + ".new")
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(new, ignore_errors=True)
    (new / "objects").mkdir(parents=True)
    buckets = sorted(b.name for b in client.list_buckets())
    entries: list[SnapshotObject] = []
    for bucket in buckets:
        for obj in client.list_objects(bucket, recursive=True):
            key = obj.object_name or ""
            etag = (obj.etag or "").strip('"')
            name = _object_file(bucket, key)
            before = unchanged.get((bucket, key))
            if before is not None and before.etag == etag and before.size == (obj.size or 0):
                try:
                    os.link(directory / "objects" / before.file, new / "objects" / name)
                    entries.append(before.model_copy(update={"file": name}))
                    continue
                except OSError:
                    pass  # not there after all, or no hard links here: download it
            response = client.get_object(bucket, key)
            try:
                data = response.read()
                headers = {k.lower(): v for k, v in response.headers.items()}
            finally:
                response.close()
                response.release_conn()
            (new / "objects" / name).write_bytes(data)
            entries.append(
                SnapshotObject(
                    bucket=bucket,
                    key=key,
                    file=name,
                    size=len(data),
                    etag=etag,
                    content_type=headers.get("content-type", "application/octet-stream"),
                    metadata={
                        k[len(_META_PREFIX) :]: v for k, v in headers.items() if k.startswith(_META_PREFIX)
                    },
                )
            )
    manifest = SnapshotManifest(saved_at=datetime.now(UTC), buckets=buckets, objects=entries)
    # The manifest is written last: a folder with a manifest is a complete snapshot.
    (new / _MANIFEST).write_text(manifest.model_dump_json(indent=1))
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    new.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    return manifest


def restore_s3(client: Any, directory: Path) -> SnapshotManifest | None:
    """Create the buckets and put the objects of the snapshot in ``directory`` (None if there is none)."""
    import io

    manifest = read_snapshot(directory)
    if manifest is None:
        return None
    for bucket in manifest.buckets:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    for obj in manifest.objects:
        data = (directory / "objects" / obj.file).read_bytes()
        client.put_object(
            obj.bucket,
            obj.key,
            io.BytesIO(data),
            length=len(data),
            content_type=obj.content_type,
            metadata=dict(obj.metadata) or None,
        )
    return manifest


def _helper_client(address: str) -> Any:
    from minio import Minio

    return Minio(address, access_key=_HELPER_KEY, secret_key=_HELPER_KEY, secure=False)


# --- the helper process ---------------------------------------------------------------------------------------


def _serve_kafka(host: str, port: int) -> str:
    from confluent_kafka import Producer

    # Kept referenced for the life of the process: the mock cluster lives inside this client.
    global _mock_client
    config: dict[str, str | int] = {"test.mock.num.brokers": 1}
    _mock_client = Producer(config)
    brokers = _mock_client.list_topics(timeout=10).brokers
    if not brokers:
        raise EmbeddedServiceError("librdkafka's mock cluster reported no broker")
    broker = next(iter(brokers.values()))
    return f"{broker.host}:{broker.port}"


def _serve_s3(host: str, port: int) -> str:
    from moto.server import ThreadedMotoServer

    global _s3_server
    _s3_server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    _s3_server.start()
    bound_host, bound_port = _s3_server.get_host_and_port()
    return f"{bound_host}:{bound_port}"


_mock_client: object = None
_s3_server: object = None


class _Stop(Exception):
    pass


def _on_sigterm(_signum: int, _frame: object) -> None:
    raise _Stop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m producer.local.standins")
    parser.add_argument("kind", choices=["kafka", "s3"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--persist-dir", type=Path, default=None, help="S3: snapshot folder (restore, save)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("werkzeug", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    persist: Path | None = args.persist_dir if args.kind == "s3" else None
    try:
        address = (
            _serve_kafka(args.host, args.port) if args.kind == "kafka" else _serve_s3(args.host, args.port)
        )
        if persist is not None:
            restored = restore_s3(_helper_client(address), persist)
            if restored is None:
                log.info("no s3 snapshot in %s", persist)
            else:
                log.info(
                    "s3 snapshot restored: %d objects, %d bytes from %s",
                    len(restored.objects),
                    restored.total_bytes,
                    persist,
                )
        print(f"READY {address}", flush=True)
        # Serve until the parent closes our stdin (or dies, which closes it too), or SIGTERM.
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except _Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the snapshot is not interrupted halfway
    if persist is not None and _s3_server is not None:
        saved = snapshot_s3(_helper_client(address), persist)
        log.info(
            "s3 snapshot saved: %d objects, %d bytes in %s", len(saved.objects), saved.total_bytes, persist
        )


if __name__ == "__main__":
    main()
