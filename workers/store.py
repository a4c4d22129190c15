"""The S3 adapter (minio client): the only module that talks to the object store.

Workers write videos and donor trajectories here; objects are addressed by ``s3://bucket/key`` URIs in
results and in the donor index.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import certifi
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, S3Error, ServerError
from urllib3.exceptions import HTTPError

from workers.settings import WorkerSettings

if TYPE_CHECKING:
    from pydantic import SecretStr

log = logging.getLogger(__name__)

# Failures that are not an S3 error document: the connection (urllib3), or an answer that is not S3's — an HTML
# 413/429/502 page from a proxy or load balancer, an empty or non-XML body (minio's InvalidResponseError and
# ServerError, which are not S3Error).
TRANSPORT_ERRORS = (HTTPError, InvalidResponseError, ServerError)


class ObjectMissing(KeyError):
    """The object does not exist (deleted, evicted, or never written)."""


class StoreError(RuntimeError):
    """The object store failed or returned something unusable."""


class ObjectCorrupt(StoreError):
    """The object was read whole but its bytes do not match the sha256 stored with it: retrying cannot help."""


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    uri: str


class ObjectStore:
    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        access_key: str | None,
        secret_key: str | None,
        secure: bool = False,
        region: str = "us-east-1",
        timeout_s: float = 30.0,
        write_retry_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.bucket = bucket
        self.endpoint = endpoint
        self.secure = secure
        self.write_retry_s = write_retry_s
        self._sleep = sleep
        self.client = Minio(
            endpoint,
            access_key=access_key,
            secret_key=secret_key,
            secure=secure,
            region=region,
            http_client=_http_client(timeout_s),
        )

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> ObjectStore:
        return cls(
            settings.s3_address,
            settings.s3_bucket,
            access_key=settings.s3_access_key.get_secret_value() if settings.s3_access_key else None,
            secret_key=settings.s3_secret_key.get_secret_value() if settings.s3_secret_key else None,
            secure=settings.s3_tls,
            region=settings.s3_region,
            timeout_s=settings.s3_timeout_s,
            write_retry_s=settings.s3_write_retry_s,
        )

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def key_of(self, uri: str) -> str:
        prefix = f"s3://{self.bucket}/"
        if not uri.startswith(prefix):
            raise StoreError(f"{uri!r} is not an object of bucket {self.bucket!r}")
        return uri[len(prefix) :]

    def ensure_bucket(self) -> None:
        try:
            if not self.client.bucket_exists(self.bucket):
                self.client.make_bucket(self.bucket)
        except S3Error as exc:
            # Another worker may have created it between the check and the create.
            if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise StoreError(f"cannot create bucket {self.bucket!r}: {exc}") from exc
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"object store {self.endpoint} unreachable: {exc}") from exc

    def put(
        self, key: str, data: bytes, content_type: str = "application/octet-stream", *, retry: bool = True
    ) -> StoredObject:
        """Write one object, retrying a failed write with backoff for up to ``write_retry_s`` seconds.

        Writes are idempotent (same key, same bytes), so a retry after a write that did land is harmless; a store
        that is down for less than the retry window costs time, not the request.
        """
        deadline = time.monotonic() + (self.write_retry_s if retry else 0.0)
        pause = 0.25
        while True:
            try:
                return self._put_once(key, data, content_type)
            except StoreError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning(
                    "object store write failed; retrying",
                    extra={"key": key, "retry_in_s": round(min(pause, left), 2), "error": str(exc)[:300]},
                )
                self._sleep(min(pause, left))
                pause = min(pause * 2, 5.0)

    def _put_once(self, key: str, data: bytes, content_type: str) -> StoredObject:
        try:
            self.client.put_object(
                self.bucket,
                key,
                io.BytesIO(data),
                length=len(data),
                content_type=content_type,
                metadata={"sha256": hashlib.sha256(data).hexdigest()},
            )
        except (S3Error, *TRANSPORT_ERRORS) as exc:
            raise StoreError(f"cannot write {self.uri(key)}: {exc}") from exc
        return StoredObject(key=key, size=len(data), uri=self.uri(key))

    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket"):
                raise ObjectMissing(self.uri(key)) from exc
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        try:
            return response.read()
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        finally:
            response.close()
            response.release_conn()

    def get_verified(self, key: str) -> bytes:
        """Like ``get``, and checks the sha256 that ``put`` stored with the object (``StoreError`` if it differs).

        Objects written by other clients carry no checksum and are returned as they are.
        """
        try:
            response = self.client.get_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket"):
                raise ObjectMissing(self.uri(key)) from exc
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        try:
            data = response.read()
            claimed = response.headers.get("x-amz-meta-sha256")
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        finally:
            response.close()
            response.release_conn()
        if claimed is not None and hashlib.sha256(data).hexdigest() != claimed:
            raise ObjectCorrupt(f"{self.uri(key)} does not match its stored sha256")
        return data

    def exists(self, key: str) -> bool:
        try:
            self.client.stat_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
                return False
            raise StoreError(f"cannot stat {self.uri(key)}: {exc}") from exc
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"cannot stat {self.uri(key)}: {exc}") from exc
        return True

    def delete(self, key: str) -> None:
        """Delete one object (one that is not there is no error)."""
        try:
            self.client.remove_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket"):
                return
            raise StoreError(f"cannot delete {self.uri(key)}: {exc}") from exc
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"cannot delete {self.uri(key)}: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[StoredObject]:
        for obj in self.client.list_objects(self.bucket, prefix=prefix, recursive=True):
            name = obj.object_name or ""
            yield StoredObject(key=name, size=obj.size or 0, uri=self.uri(name))

    def delete_prefix(self, prefix: str, *, first: str | None = None) -> int:
        """Delete every object under ``prefix``; returns how many were deleted. ``first``, if given, is deleted
        before the others are listed: a writer still adding objects under the prefix can look for it once it is
        done, and delete what it added after the listing."""
        try:
            deleted_first = 0
            if first is not None and self.exists(first):
                self.client.remove_object(self.bucket, first)
                deleted_first = 1
            keys = [o.key for o in self.list(prefix)]
            errors = list(self.client.remove_objects(self.bucket, (DeleteObject(k) for k in keys)))
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                return 0
            raise StoreError(f"cannot delete under {self.uri(prefix)}: {exc}") from exc
        except TRANSPORT_ERRORS as exc:
            raise StoreError(f"cannot delete under {self.uri(prefix)}: {exc}") from exc
        if errors:
            raise StoreError(f"could not delete {len(errors)} objects under {prefix!r}: {errors[0]}")
        return deleted_first + len(keys)

    def presigned_get(self, key: str, expires: timedelta = timedelta(hours=1)) -> str:
        return self.client.presigned_get_object(self.bucket, key, expires=expires)


def _http_client(timeout_s: float) -> urllib3.PoolManager:
    """The minio client's own defaults, but with a bounded timeout per call (its default is 300 s)."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=min(timeout_s, 5.0), read=timeout_s),
        maxsize=10,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=2, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
    )


_STORES: dict[tuple[object, ...], ObjectStore] = {}
_STORES_LOCK = threading.Lock()  # a threads pool's first orders start together


def store_for(settings: WorkerSettings) -> ObjectStore:
    """One store per process and endpoint/bucket, with the bucket created on first use."""
    # Everything the store is made from: settings with other credentials or timeouts get a store of their own.
    key = (
        settings.s3_address,
        settings.s3_bucket,
        settings.s3_tls,
        settings.s3_region,
        _digest(settings.s3_access_key),  # kept by hash: a cache key holds no credential
        _digest(settings.s3_secret_key),
        settings.s3_timeout_s,
        settings.s3_write_retry_s,
    )
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = ObjectStore.from_settings(settings)
            store.ensure_bucket()
            _STORES[key] = store
    return store


def _digest(secret: SecretStr | None) -> str | None:
    return None if secret is None else hashlib.sha256(secret.get_secret_value().encode()).hexdigest()
