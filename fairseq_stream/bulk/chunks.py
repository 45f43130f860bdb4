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

The merged output (:func:`merge`) replaces a regular file atomically and is
written into anything else (a device, a fifo, a pipe), never replacing it.
"""

import hashlib
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch

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


def write_atomic(path: str, data: bytes, what: str = "chunk file"):
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part.

    Raises:
        FairseqStreamError: the file could not be written (``what`` names it).
    """
    try:
        with _atomic_file(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise FairseqStreamError("cannot write {} {}: {}".format(what, path, e.strerror or e)) from None


class _atomic_file:
    """``with _atomic_file(path, mode) as f``: a temporary file next to ``path``, fsynced and renamed over it.

    On an error the temporary file is removed and ``path`` is untouched. A
    file that is replaced keeps its permission bits.
    """

    def __init__(self, path: str, mode: str, **kwargs):
        self.path, self.mode, self.kwargs = path, mode, kwargs
        self.tmp = "{}.tmp.{}".format(path, os.getpid())

    def __enter__(self):
        self.file = open(self.tmp, self.mode, **self.kwargs)
        return self.file

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if exc_type is None:
                _keep_mode(self.path, self.tmp)
                os.replace(self.tmp, self.path)
                _fsync_directory(os.path.dirname(self.path) or ".")  # the rename itself survives a crash
        except BaseException:
            _remove(self.tmp)
            raise
        if exc_type is not None:
            _remove(self.tmp)
        return False


def _keep_mode(old: str, new: str):
    try:
        os.chmod(new, stat.S_IMODE(os.stat(old).st_mode))
    except FileNotFoundError:
        pass


def _fsync_directory(directory: str):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str):
    try:
        os.unlink(path)
    except OSError:
        pass


def write_chunk(work_dir: str, i: int, input_sha: str, settings_sha: str, results: List[dict],
                long_lines: str = "error", long_count: int = 0):
    """Write chunk ``i``'s output (``results`` in input order), then its manifest.

    ``long_count`` lines of the chunk were longer than the model's positions
    and handled by ``long_lines`` (skip or truncate); the manifest records
    both, so that a re-run with another ``--long-lines`` redoes this chunk.
    """
    out_path, manifest_path = chunk_paths(work_dir, i)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results).encode("utf-8")
    write_atomic(out_path, data)
    manifest = {"input_sha256": input_sha, "settings_sha256": settings_sha, "lines": len(results),
                "output_sha256": sha256(data)}
    if long_count:
        manifest["long_lines"] = {"mode": long_lines, "count": long_count}
    write_atomic(manifest_path, json.dumps(manifest).encode("utf-8"))


def chunk_manifest(work_dir: str, i: int, input_sha: str, settings_sha: str, lines: int,
                   long_lines: Optional[str] = None) -> Optional[dict]:
    """Chunk ``i``'s manifest if the chunk holds a finished output of this input and these settings, else None.

    The output file must hash to the manifest's ``output_sha256`` (a file
    altered after it was written is redone, whatever its line count). With
    ``long_lines`` given, a chunk whose over-long lines were handled in
    another way does not count either.
    """
    out_path, manifest_path = chunk_paths(work_dir, i)
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        with open(out_path, "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    if not (isinstance(manifest, dict) and manifest.get("input_sha256") == input_sha
            and manifest.get("settings_sha256") == settings_sha and manifest.get("lines") == lines
            and manifest.get("output_sha256") == sha256(data) and data.count(b"\n") == lines):
        return None
    long = manifest.get("long_lines")
    if long is not None and long_lines is not None and long.get("mode") != long_lines:
        return None
    return manifest


def chunk_done(work_dir: str, i: int, input_sha: str, settings_sha: str, lines: int,
               long_lines: Optional[str] = None) -> bool:
    """Whether chunk ``i`` holds a finished output of this input and these settings (see :func:`chunk_manifest`)."""
    return chunk_manifest(work_dir, i, input_sha, settings_sha, lines, long_lines) is not None


def settings_digest(settings: dict) -> str:
    """SHA-256 of the settings that decide what a chunk's output is."""
    return sha256(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))


# --- the merged output ---------------------------------------------------------------------------

@dataclass
class OutputTarget:
    """Where the merged output goes and how it is written.

    A regular file (or a path that does not exist yet) is replaced
    atomically: ``path`` is then the file itself, symbolic links resolved,
    so a link keeps pointing at the new file. Anything else (a device such as
    /dev/null, a fifo, a pipe or file named through /dev/fd, /dev/stdout or
    /proc) is opened and written into, never replaced: ``streamed`` is True.
    """

    path: str
    streamed: bool
    kind: str  # "regular file", "new file", "character device", "fifo", ...


def output_target(output: str) -> OutputTarget:
    """How ``output`` would be written (see :class:`OutputTarget`).

    Raises:
        FairseqStreamError: ``output`` is a directory, a read-only file (not
            replaced unasked) or a symbolic link to nothing (writing through
            it would create its target and the folders on its way).
    """
    if _through_proc(output):
        # /dev/stdout, /dev/fd/N, /proc/self/fd/N: an open file of this process (or /proc itself);
        # resolving or renaming over it would write somewhere else than the caller meant.
        return OutputTarget(output, True, "path under /proc or /dev/fd")
    try:
        st = os.stat(output)  # follows symbolic links
    except FileNotFoundError:
        if os.path.islink(output):
            raise FairseqStreamError("--output {} is a symbolic link to {}, which does not exist; remove the link "
                                     "or create its target".format(output, os.readlink(output))) from None
        return OutputTarget(os.path.realpath(output), False, "new file")
    except OSError as e:
        raise FairseqStreamError("cannot use --output {}: {}".format(output, e.strerror or e)) from None
    if stat.S_ISDIR(st.st_mode):
        raise FairseqStreamError("--output {} is a directory; name a file in it".format(output))
    if stat.S_ISREG(st.st_mode):
        _refuse_read_only(output, st)
        return OutputTarget(os.path.realpath(output), False, "regular file")
    return OutputTarget(output, True, _file_kind(st.st_mode))


def _refuse_read_only(output: str, st: os.stat_result):
    """A regular file that its permissions keep from being written is not replaced.

    The rename that replaces it needs only its folder to be writable, and
    root may write anything, so its mode bits are checked as well as access.
    """
    if stat.S_IMODE(st.st_mode) & 0o222 and os.access(output, os.W_OK):
        return
    raise FairseqStreamError("--output {} is read-only (mode {:o}); make it writable (chmod u+w) or remove it to "
                             "have it replaced".format(output, stat.S_IMODE(st.st_mode)))


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _through_proc(path: str) -> bool:
    """Whether ``path`` or a symbolic link on the way to it lies under /proc or /dev/fd."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if p == "/proc" or p.startswith(("/proc/", "/dev/fd/")):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return False


def check_output(output: str):
    """Fail now, not after the translation, where ``output`` cannot be written.

    A regular or new file: its directory must take a new file (checked by
    creating and removing one). A device or a /proc path must open for
    writing; a fifo is not opened (that would wait for a reader).
    """
    target = output_target(output)
    try:
        if not target.streamed:
            directory = os.path.dirname(target.path) or "."
            os.makedirs(directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=os.path.basename(target.path) + ".probe.", dir=directory)
            os.close(fd)
            os.unlink(probe)
        elif target.kind != "fifo":
            os.close(os.open(target.path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as e:
        raise FairseqStreamError("cannot write --output {}: {}".format(output, e.strerror or e)) from None
    return target


def merge(index: InputIndex, work_dir: str, settings_sha: str, output: str, fmt: str = "text") -> dict:
    """Write every chunk's output, in input order, to ``output`` in format ``fmt``.

    A regular file is replaced atomically; a device, fifo or pipe is written
    into (see :func:`output_target`). Returns a summary: ``{"lines": input
    lines, "long_lines": {mode: count}}`` (over-long lines skipped or
    truncated, from the chunks' manifests).

    Raises:
        FairseqStreamError: a chunk is missing or does not match this input
            and these settings (the message names the first few and the
            folder looked in), or the output cannot be written.
    """
    if fmt not in FORMATS:
        raise FairseqStreamError("--format must be one of {}, got {}".format(", ".join(FORMATS), fmt))
    manifests = _finished_manifests(index, work_dir, settings_sha)
    target = output_target(output)
    try:
        if target.streamed:
            fd = os.open(target.path, os.O_WRONLY | os.O_APPEND)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                _write_merged(out, index, work_dir, fmt)
        else:
            os.makedirs(os.path.dirname(target.path) or ".", exist_ok=True)
            with _atomic_file(target.path, "w", encoding="utf-8") as out:
                _write_merged(out, index, work_dir, fmt)
    except OSError as e:
        raise FairseqStreamError("cannot write --output {}: {}".format(output, e.strerror or e)) from None
    long_lines = {}
    for manifest in manifests:
        long = manifest.get("long_lines")
        if long:
            long_lines[long["mode"]] = long_lines.get(long["mode"], 0) + long["count"]
    return {"lines": index.lines, "long_lines": long_lines}


def _finished_manifests(index: InputIndex, work_dir: str, settings_sha: str) -> List[dict]:
    """Every chunk's manifest; an error naming the work directory if any chunk is not done."""
    folder = os.path.join(work_dir, "chunks")
    if index.chunks and not (os.path.isdir(folder) and any(n.endswith(".json") for n in os.listdir(folder))):
        raise FairseqStreamError(
            "no finished chunk in {}: if the translation wrote its chunks elsewhere, give its --work-dir "
            "(the default is OUTPUT.chunks, next to --output)".format(folder))
    manifests, missing = [], []
    for i in range(index.chunks):
        data, _ = read_chunk(index, i)
        manifest = chunk_manifest(work_dir, i, sha256(data), settings_sha, index.chunk_lines(i))
        if manifest is None:
            missing.append(i)
        manifests.append(manifest)
    if missing:
        raise FairseqStreamError(
            "{} of {} chunks in {} are not done for this input and these settings (chunk {}{}); run the "
            "translation again with the same options to finish them".format(
                len(missing), index.chunks, folder, ", ".join(map(str, missing[:5])),
                ", ..." if len(missing) > 5 else ""))
    return manifests


def _write_merged(out, index: InputIndex, work_dir: str, fmt: str):
    for i in range(index.chunks):
        _, sources = read_chunk(index, i) if fmt == "generate" else (None, None)
        for j, record in enumerate(_records(work_dir, i)):
            out.write(_formatted(i * index.chunk_size + j, record, sources[j] if sources else None, fmt))
    out.flush()
    if stat.S_ISREG(os.fstat(out.fileno()).st_mode):
        os.fsync(out.fileno())  # devices and pipes have nothing to sync (fsync fails with EINVAL)


def _records(work_dir: str, i: int) -> Iterator[dict]:
    with open(chunk_paths(work_dir, i)[0], encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _score(score) -> str:
    # A skipped over-long line has no score.
    return "nan" if score is None else str(score)


def generate_score(score) -> str:
    """An H- line's score as fairseq-generate prints it: base 2, from the float32 natural-log score.

    fairseq-generate prints ``hypo["score"] / math.log(2)``, a float32 tensor
    divided by a Python float; the same torch operation on the same float32
    value gives the same bits, so the text is the same as fairseq's.
    """
    if score is None:
        return "nan"
    return "{}".format((torch.tensor(score, dtype=torch.float32) / math.log(2)).item())


def _formatted(n: int, record: dict, source: Optional[str], fmt: str) -> str:
    if fmt == "text":
        return record["text"] + "\n"
    if fmt == "scores":
        return "{}\t{}\n".format(_score(record["score"]), record["text"])
    # generate: every hypothesis of an n-best list (nbest > 1), else the best one.
    hypotheses = record.get("hypotheses") or [[record["score"], record["text"]]]
    # The source as fairseq prints it, its tokens split on whitespace: a tab inside the line would add a field.
    return "S-{n}\t{src}\n".format(n=n, src=" ".join((source or "").split())) + "".join(
        "H-{n}\t{score}\t{text}\n".format(n=n, score=generate_score(score), text=text)
        for score, text in hypotheses)
