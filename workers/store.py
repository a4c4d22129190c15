"""The S3 adapter (minio client): the only module that talks to the object store.

Workers write videos and donor trajectories here; objects are addressed by ``s3://bucket/key`` URIs in
results and in the donor index.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import S3Error
from urllib3.exceptions import HTTPError as TransportError

from workers.settings import WorkerSettings

log = logging.getLogger(__name__)


class ObjectMissing(KeyError):
    """The object does not exist (deleted, evicted, or never written)."""


class StoreError(RuntimeError):
    """The object store failed or returned something unusable."""


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
    ) -> None:
        self.bucket = bucket
        self.endpoint = endpoint
        self.secure = secure
        self.client = Minio(
            endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=region
        )

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> ObjectStore:
        return cls(
            settings.s3_endpoint,
            settings.s3_bucket,
            access_key=settings.s3_access_key.get_secret_value() if settings.s3_access_key else None,
            secret_key=settings.s3_secret_key.get_secret_value() if settings.s3_secret_key else None,
            secure=settings.s3_secure,
            region=settings.s3_region,
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

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> StoredObject:
        try:
            self.client.put_object(
                self.bucket,
                key,
                io.BytesIO(data),
                length=len(data),
                content_type=content_type,
                metadata={"sha256": hashlib.sha256(data).hexdigest()},
            )
        except (S3Error, TransportError) as exc:
            raise StoreError(f"cannot write {self.uri(key)}: {exc}") from exc
        return StoredObject(key=key, size=len(data), uri=self.uri(key))

    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket"):
                raise ObjectMissing(self.uri(key)) from exc
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        except TransportError as exc:
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        try:
            return response.read()
        except TransportError as exc:
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
        except TransportError as exc:
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        try:
            data = response.read()
            claimed = response.headers.get("x-amz-meta-sha256")
        except TransportError as exc:
            raise StoreError(f"cannot read {self.uri(key)}: {exc}") from exc
        finally:
            response.close()
            response.release_conn()
        if claimed is not None and hashlib.sha256(data).hexdigest() != claimed:
            raise StoreError(f"{self.uri(key)} does not match its stored sha256")
        return data

    def exists(self, key: str) -> bool:
        try:
            self.client.stat_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
                return False
            raise StoreError(f"cannot stat {self.uri(key)}: {exc}") from exc
        except TransportError as exc:
            raise StoreError(f"cannot stat {self.uri(key)}: {exc}") from exc
        return True

    def list(self, prefix: str = "") -> Iterator[StoredObject]:
        for obj in self.client.list_objects(self.bucket, prefix=prefix, recursive=True):
            name = obj.object_name or ""
            yield StoredObject(key=name, size=obj.size or 0, uri=self.uri(name))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many were deleted."""
        try:
            keys = [o.key for o in self.list(prefix)]
            errors = list(self.client.remove_objects(self.bucket, (DeleteObject(k) for k in keys)))
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                return 0
            raise StoreError(f"cannot delete under {self.uri(prefix)}: {exc}") from exc
        except TransportError as exc:
            raise StoreError(f"cannot delete under {self.uri(prefix)}: {exc}") from exc
        if errors:
            raise StoreError(f"could not delete {len(errors)} objects under {prefix!r}: {errors[0]}")
        return len(keys)

    def presigned_get(self, key: str, expires: timedelta = timedelta(hours=1)) -> str:
        return self.client.presigned_get_object(self.bucket, key, expires=expires)


_STORES: dict[tuple[str, str, bool], ObjectStore] = {}


def store_for(settings: WorkerSettings) -> ObjectStore:
    """One store per process and endpoint/bucket, with the bucket created on first use."""
    key = (settings.s3_endpoint, settings.s3_bucket, settings.s3_secure)
    store = _STORES.get(key)
    if store is None:
        store = ObjectStore.from_settings(settings)
        store.ensure_bucket()
        _STORES[key] = store
    return store
