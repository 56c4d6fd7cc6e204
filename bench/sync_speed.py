"""Speed of ``opskit sync`` (issue 8), two measurements, each side by side with a baseline:

1. Deciding "nothing to do" for a run with ``--files`` files already published: opskit's manifest (``stat`` only)
   against the same decision made by hashing every file (CRC32C), as a sync without a manifest would have to.
2. Upload throughput to the GCS emulator (``gcp-storage-emulator``, started here in memory): ``GcsTarget.put_batch``
   with ``--workers`` parallel transfers against a plain sequential loop of google-cloud-storage uploads of the same
   files; directly, and through a proxy that holds each request ``--rtt-ms`` (a login node's round trip to GCS,
   which is what parallel transfers hide; the emulator itself is one Python process on a shared 2-core machine).

    python bench/sync_speed.py [--files 10000] [--upload-files 64] [--upload-kb 1024] [--workers 8] [--rtt-ms 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from remote_services import FaultProxy, start_gcs_emulator  # noqa: E402

from opskit.run.paths import RunPaths  # noqa: E402
from opskit.targets import open_target  # noqa: E402
from opskit.targets.base import TargetOptions, crc32c_of_file  # noqa: E402
from opskit.upkeep.sync import candidates, changed_files, load_manifest, sync  # noqa: E402


def make_run(root: Path, files: int) -> RunPaths:
    run = RunPaths(root / "run")
    run.logs.mkdir(parents=True)
    run.main_log.write_text("iteration 1 | lm loss: 9.0 |\n" * 1000)
    for i in range(files - 1):
        folder = run.tensorboard / f"job{i // 500:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"events.out.tfevents.{i}.node").write_bytes(os.urandom(2048))
    return run


def median_time(call, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def no_change(root: Path, files: int) -> None:
    run = make_run(root, files)
    url = f"file://{root / 'share'}"
    first = sync(run, ["logs", "tensorboard"], url)
    assert len(first.copied) == files, len(first.copied)
    ours = median_time(lambda: sync(run, ["logs", "tensorboard"], url))
    manifest = load_manifest(run.sync_manifest(url))

    def by_hashing() -> None:  # what deciding costs without size/mtime: read and checksum every file
        for key, path in candidates(run, ["logs", "tensorboard"]).items():
            assert crc32c_of_file(path) == manifest[key]["crc32c"]

    baseline = median_time(by_hashing, repeat=3)
    assert changed_files(candidates(run, ["logs", "tensorboard"]), manifest)[0] == {}
    print(f"no-change sync of {files:,} files: {ours:.3f} s (manifest, stat only); hashing every file: "
          f"{baseline:.3f} s; ratio {baseline / ours:.1f}x")


def upload(root: Path, count: int, kb: int, workers: int, rtt_ms: float) -> None:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    proc, endpoint = start_gcs_emulator(root / "gcs")
    proxy = FaultProxy(endpoint, delay_s=rtt_ms / 1000)
    os.environ["STORAGE_EMULATOR_HOST"] = proxy.endpoint if rtt_ms else endpoint
    try:
        client = storage.Client(project="bench", credentials=AnonymousCredentials())
        bucket = client.create_bucket("bench")
        folder = root / "upload"
        folder.mkdir()
        files = {}
        for i in range(count):
            files[f"tensorboard/events.{i}"] = folder / f"events.{i}"
            files[f"tensorboard/events.{i}"].write_bytes(os.urandom(kb * 1024))
        total_mb = count * kb / 1024

        start = time.perf_counter()
        for key, path in files.items():  # the baseline: one plain upload after another
            bucket.blob(f"plain/{key}").upload_from_filename(str(path))
        plain = time.perf_counter() - start

        target = open_target("gs://bench/opskit", options=TargetOptions(workers=workers))
        start = time.perf_counter()
        result = target.put_batch(files, "bench")
        ours = time.perf_counter() - start
        assert not result.failed and len(result.done) == count, result.failed
        print(f"GCS emulator (+{rtt_ms:g} ms per request) upload of {count} x {kb} KiB ({total_mb:.0f} MiB): "
              f"sequential {total_mb / plain:.1f} "
              f"MiB/s ({plain:.2f} s); opskit {workers} workers (resumable, CRC32C checked) {total_mb / ours:.1f} "
              f"MiB/s ({ours:.2f} s); ratio {plain / ours:.2f}x")
    finally:
        proxy.close()
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--upload-files", type=int, default=64)
    parser.add_argument("--upload-kb", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rtt-ms", type=float, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        no_change(Path(root), args.files)
    for rtt_ms in sorted({0, args.rtt_ms}):
        with tempfile.TemporaryDirectory() as root:
            upload(Path(root), args.upload_files, args.upload_kb, args.workers, rtt_ms)


if __name__ == "__main__":
    main()
