"""The bulk job's files: input chunks, their outputs and manifests, atomic writes, the merge.

A job translates a plain-text input in chunks of ``chunk_size`` lines (lines
end at ``\\n``). Chunk ``i`` is written to ``WORK/chunks/i.jsonl`` (one JSON
object per input line, in input order: ``{"text": ..., "score": ...}``) and
then described by ``WORK/chunks/i.json``, its manifest: the SHA-256 of its
input bytes, of the job's settings, of the output file, and its line count.
Both are written atomically (a temporary file, fsync, rename), the manifest
last, so a chunk counts as done only when its manifest matches: a rank killed
mid-chunk leaves at most a temporary file, and a re-run redoes any chunk
whose manifest is missing, stale (other input or settings) or whose output
does not match it.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional

from fairseq_stream.errors import FairseqStreamError

FORMATS = ("text", "scores", "generate")


@dataclass
class InputIndex:
    """Where each chunk of the input starts, in bytes; ``offsets[-1]`` is the file size."""

    path: str
    chunk_size: int
    offsets: List[int]
    lines: int

    @property
    def chunks(self) -> int:
        return len(self.offsets) - 1

    def chunk_lines(self, i: int) -> int:
        return min(self.chunk_size, self.lines - i * self.chunk_size)

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "chunk_size": self.chunk_size, "offsets": self.offsets,
                           "lines": self.lines})

    @classmethod
    def from_json(cls, text: str) -> "InputIndex":
        return cls(**json.loads(text))


def index_input(path: str, chunk_size: int) -> InputIndex:
    """Split ``path`` into chunks of ``chunk_size`` lines (one read of the file).

    A last line without ``\\n`` is a line; an empty file has no chunks.
    """
    if chunk_size < 1:
        raise FairseqStreamError("--chunk-size must be at least 1, got {}".format(chunk_size))
    offsets, lines, position = [0], 0, 0
    try:
        with open(path, "rb") as f:
            for raw in f:
                position += len(raw)
                lines += 1
                if lines % chunk_size == 0:
                    offsets.append(position)
    except OSError as e:
        raise FairseqStreamError("cannot read input file {}: {}".format(path, e.strerror or e)) from None
    if offsets[-1] != position:
        offsets.append(position)
    return InputIndex(os.path.abspath(path), chunk_size, offsets, lines)


def read_chunk(index: InputIndex, i: int):
    """(the chunk's bytes, its lines as text without line ends); a line that is not UTF-8 is an error naming it."""
    start, end = index.offsets[i], index.offsets[i + 1]
    with open(index.path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    lines = []
    for number, raw in enumerate(data.split(b"\n")[: index.chunk_lines(i)], i * index.chunk_size + 1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as e:
            raise FairseqStreamError(
                "input line {} is not valid UTF-8 (byte 0x{:02x} at byte offset {} of the line); re-encode "
                "the input as UTF-8".format(number, raw[e.start], e.start)) from None
    return data, lines


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunk_paths(work_dir: str, i: int):
    """(output path, manifest path) of chunk ``i``."""
    stem = os.path.join(work_dir, "chunks", "{:07d}".format(i))
    return stem + ".jsonl", stem + ".json"


def write_atomic(path: str, data: bytes):
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    directory = os.path.dirname(path) or "."
    tmp = "{}.tmp.{}".format(path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def write_chunk(work_dir: str, i: int, input_sha: str, settings_sha: str, results: List[dict]):
    """Write chunk ``i``'s output (``results`` in input order), then its manifest."""
    out_path, manifest_path = chunk_paths(work_dir, i)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results).encode("utf-8")
    write_atomic(out_path, data)
    manifest = {"input_sha256": input_sha, "settings_sha256": settings_sha, "lines": len(results),
                "output_sha256": sha256(data)}
    write_atomic(manifest_path, json.dumps(manifest).encode("utf-8"))


def chunk_done(work_dir: str, i: int, input_sha: str, settings_sha: str, lines: int) -> bool:
    """Whether chunk ``i`` holds a finished output of this input and these settings."""
    out_path, manifest_path = chunk_paths(work_dir, i)
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        with open(out_path, "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return False
    return (isinstance(manifest, dict) and manifest.get("input_sha256") == input_sha
            and manifest.get("settings_sha256") == settings_sha and manifest.get("lines") == lines
            and manifest.get("output_sha256") == sha256(data) and data.count(b"\n") == lines)


def settings_digest(settings: dict) -> str:
    """SHA-256 of the settings that decide what a chunk's output is."""
    return sha256(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))


def merge(index: InputIndex, work_dir: str, settings_sha: str, output: str, fmt: str = "text"):
    """Write every chunk's output, in input order, to ``output`` (atomically) in format ``fmt``.

    Raises:
        FairseqStreamError: a chunk is missing or does not match this input
            and these settings (the message names the first few).
    """
    if fmt not in FORMATS:
        raise FairseqStreamError("--format must be one of {}, got {}".format(", ".join(FORMATS), fmt))
    missing = []
    for i in range(index.chunks):
        data, _ = read_chunk(index, i)
        if not chunk_done(work_dir, i, sha256(data), settings_sha, index.chunk_lines(i)):
            missing.append(i)
    if missing:
        raise FairseqStreamError(
            "{} of {} chunks are not done for this input and these settings (chunk {}{}); run the "
            "translation again with the same options to finish them".format(
                len(missing), index.chunks, ", ".join(map(str, missing[:5])), ", ..." if len(missing) > 5 else ""))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = "{}.tmp.{}".format(output, os.getpid())
    with open(tmp, "w", encoding="utf-8") as out:
        for i in range(index.chunks):
            _, sources = read_chunk(index, i) if fmt == "generate" else (None, None)
            for j, record in enumerate(_records(work_dir, i)):
                out.write(_formatted(i * index.chunk_size + j, record, sources[j] if sources else None, fmt))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, output)


def _records(work_dir: str, i: int) -> Iterator[dict]:
    with open(chunk_paths(work_dir, i)[0], encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _formatted(n: int, record: dict, source: Optional[str], fmt: str) -> str:
    if fmt == "text":
        return record["text"] + "\n"
    if fmt == "scores":
        return "{}\t{}\n".format(record["score"], record["text"])
    return "S-{n}\t{src}\nH-{n}\t{score}\t{text}\n".format(n=n, src=source, score=record["score"], text=record["text"])
