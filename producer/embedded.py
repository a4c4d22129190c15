"""Embedded stand-ins for backing services, each in a helper process, for the demo and the tests.

- Kafka: librdkafka's built-in mock cluster (a Kafka-protocol broker, in memory) — real Kafka in production.
- S3: moto's S3 server, spoken to with the same minio client as MinIO in production.

``start_service`` launches ``python -m producer.embedded <kind>``, which prints ``READY <host:port>`` once it
serves and exits when its stdin closes, so a stand-in never outlives the process that started it.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

ServiceKind = Literal["kafka", "s3"]


class EmbeddedServiceError(RuntimeError):
    pass


@dataclass
class EmbeddedService:
    kind: ServiceKind
    address: str
    process: subprocess.Popen[bytes]

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)


def start_service(
    kind: ServiceKind, *, host: str = "127.0.0.1", port: int = 0, ready_timeout: float = 60.0
) -> EmbeddedService:
    process = subprocess.Popen(
        [sys.executable, "-m", "producer.embedded", kind, "--host", host, "--port", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EmbeddedServiceError(
                f"embedded {kind} exited with status {process.returncode} before it served"
            )
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            line = process.stdout.readline().decode().strip()
            if line.startswith("READY "):
                return EmbeddedService(kind=kind, address=line.split(" ", 1)[1], process=process)
    process.kill()
    raise EmbeddedServiceError(f"embedded {kind} did not become ready within {ready_timeout:.0f} s")


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m producer.embedded")
    parser.add_argument("kind", choices=["kafka", "s3"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    address = _serve_kafka(args.host, args.port) if args.kind == "kafka" else _serve_s3(args.host, args.port)
    print(f"READY {address}", flush=True)
    # Serve until the parent closes our stdin (or dies, which closes it too).
    while os.read(sys.stdin.fileno(), 4096):
        pass


if __name__ == "__main__":
    main()
