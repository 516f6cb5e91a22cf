"""A librdkafka mock cluster for tests, held by tests/scripts/kafka_mock.py.

The mock is a real Kafka-protocol server on loopback, but it lives in the
process that created it: a helper process holds it, prints its bootstrap
address and produces records on request.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MOCK = Path(__file__).parent / "scripts" / "kafka_mock.py"


class KafkaCluster:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(MOCK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.bootstrap = self.proc.stdout.readline().strip()
        assert self.bootstrap, "the mock cluster did not start"

    def produce(self, topic: str, partition: int, n: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"produce {topic} {partition} {n}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def bulk(self, topic: str, partition: int, n: int, size: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"bulk {topic} {partition} {n} {size}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def garbage(self, topic: str, partition: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"garbage {topic} {partition}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class ClickStream:
    """The online example's producer (`examples/online.py produce --mock`): it holds a mock
    cluster and writes `records` drifting click records at `rate` a second; its output
    goes to `log_dir`, attached to a failed test's report."""

    grace_s = 5.0

    def __init__(self, log_dir: Path, records: int, rate: float, topic: str = "clicks") -> None:
        from tests.support import ROOT, _registered

        self.name = "click stream producer"
        self.topic = topic
        self.log_path = log_dir / "producer.log"
        with self.log_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, str(ROOT / "examples" / "online.py"), "produce", "--mock"),
                    *("--topic", topic, "--records", str(records), "--rate", str(rate)),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        _registered(self)
        assert self.proc.stdout is not None
        self.bootstrap = self.proc.stdout.readline().strip()
        assert self.bootstrap, "the producer's mock cluster did not start"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def produced(self) -> bool:
        return "produced" in self.log()

    async def more(self, records: int, rate: float) -> None:
        """Write `records` more into the same cluster (a second producer, that one ends)."""
        import asyncio

        from tests.support import ROOT, patience

        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, str(ROOT / "examples" / "online.py"), "produce"),
            *("--bootstrap", self.bootstrap, "--topic", self.topic),
            *("--records", str(records), "--rate", str(rate)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), patience(records / rate + 60))
        said = err.decode(errors="replace")
        assert proc.returncode == 0 and f"produced {records}" in said, said[-3000:]

    def stop(self) -> int:
        self.proc.kill()
        return self.proc.wait()
