"""``scripts/download_wmt19.sh``: fetch, check and unpack the WMT'19 ensemble, offline.

The archives here have the published layout (NAME/model1.pt..model4.pt,
dict.SRC.txt, dict.en.txt, bpecodes) built from the real toy checkpoints and
dictionaries, served through ``WMT19_URL_BASE=file://...`` (curl reads
file:// URLs), so every path of the script runs without network: download
and unpack, skip when present, resume a .part, no network, an archive copied
in by hand, corrupt, truncated and incomplete archives, SHA-256, undersized
models, usage errors.
"""

import hashlib
import shutil
import tarfile

import pytest

from conftest import REPO, run_tool

SCRIPT = REPO / "scripts" / "download_wmt19.sh"
NAMES = {"de-en": ("wmt19.de-en.joined-dict.ensemble", "de"), "ru-en": ("wmt19.ru-en.ensemble", "ru")}
# The toy checkpoints are about 2.5 MB; the script's default minimum (100 MB)
# is for the real ones.
SMALL = {"WMT19_MIN_MODEL_BYTES": "100000"}
OFFLINE = dict(SMALL, WMT19_URL_BASE="file:///nonexistent")
OFFLINE_MESSAGE = "download_wmt19.sh: cannot download file:///nonexistent/{}.tar.gz (no network?). Offline: copy"


def expected_files(src):
    return ["model1.pt", "model2.pt", "model3.pt", "model4.pt", "dict.{}.txt".format(src), "dict.en.txt", "bpecodes"]


@pytest.fixture(scope="module")
def mirror(toy, tmp_path_factory):
    """{pair: (archive path, {file name: bytes})}: one archive per pair in one mirror directory."""
    root = tmp_path_factory.mktemp("mirror")
    models = [toy.transformer, toy.transformer2, toy.transformer, toy.transformer2]
    out = {}
    for pair, (name, src) in NAMES.items():
        unpacked = root / "layout" / name
        unpacked.mkdir(parents=True)
        for i, model in enumerate(models, 1):
            shutil.copy(model, unpacked / "model{}.pt".format(i))
        shutil.copy(toy.data_bin / "dict.src.txt", unpacked / "dict.{}.txt".format(src))
        shutil.copy(toy.data_bin / "dict.tgt.txt", unpacked / "dict.en.txt")
        # fastBPE's format (pair, count); the script only checks that it is there.
        (unpacked / "bpecodes").write_text("s 1 900\nt 1 850\ns1 0 400\n")
        archive = root / "{}.tar.gz".format(name)
        with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
            tar.add(unpacked, arcname=name)
        out[pair] = (archive, {f: (unpacked / f).read_bytes() for f in expected_files(src)})
    return out


def download(*args, env=None, check=False):
    return run_tool(["bash", SCRIPT] + list(args), env=env, check=check)


def one_line_error(proc):
    """The script's single stderr line (asserts there is exactly one)."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_downloads_checks_unpacks_then_skips(mirror, tmp_path):
    archive, files = mirror["de-en"]
    env = dict(SMALL, WMT19_URL_BASE="file://{}".format(archive.parent))
    proc = download("de-en", tmp_path / "models", env=env, check=True)
    dest = tmp_path / "models" / "wmt19.de-en.joined-dict.ensemble"
    assert {f: (dest / f).read_bytes() for f in files} == files
    assert sorted(p.name for p in dest.iterdir()) == sorted(files)
    assert (tmp_path / "models" / archive.name).read_bytes() == archive.read_bytes()
    assert not list((tmp_path / "models").glob("*.part")) and not list((tmp_path / "models").glob(".*unpack*"))
    assert "next: scripts/newstest.sh de-en 2018 var-stream --models {}".format(dest) in proc.stdout
    assert proc.stderr == ""

    again = download("de-en", tmp_path / "models", env=env, check=True)
    assert again.stdout.strip() == "download_wmt19.sh: {} already present, skipped".format(dest)


def test_resumes_a_partial_download(mirror, tmp_path):
    archive, _ = mirror["ru-en"]
    (tmp_path / (archive.name + ".part")).write_bytes(archive.read_bytes()[:100000])
    download("ru-en", tmp_path, env=dict(SMALL, WMT19_URL_BASE="file://{}".format(archive.parent)), check=True)
    assert (tmp_path / archive.name).read_bytes() == archive.read_bytes()
    assert (tmp_path / "wmt19.ru-en.ensemble" / "dict.ru.txt").exists()
    assert not (tmp_path / (archive.name + ".part")).exists()


def test_no_network_says_how_to_work_offline(tmp_path):
    proc = download("ru-en", tmp_path, env=OFFLINE)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(OFFLINE_MESSAGE.format("wmt19.ru-en.ensemble"))
    assert "--text-dir DIR in scripts/newstest.sh" in lines[0]
    assert len(lines) == 2 and lines[1].strip().startswith("(curl: (37)")  # curl's own reason, one line
    assert list(tmp_path.iterdir()) == []  # no .part, no archive, no directory


def test_uses_an_archive_copied_in_by_hand(mirror, tmp_path):
    archive, files = mirror["de-en"]
    shutil.copy(archive, tmp_path / archive.name)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    proc = download("de-en", tmp_path, env=dict(OFFLINE, WMT19_SHA256=digest.upper()), check=True)
    assert "using {}".format(tmp_path / archive.name) in proc.stdout
    dest = tmp_path / "wmt19.de-en.joined-dict.ensemble"
    assert {f: (dest / f).read_bytes() for f in files} == files


def test_wrong_sha256_is_one_line(mirror, tmp_path):
    archive, _ = mirror["de-en"]
    shutil.copy(archive, tmp_path / archive.name)
    proc = download("de-en", tmp_path, env=dict(OFFLINE, WMT19_SHA256="0" * 64))
    assert proc.returncode == 1
    assert "has SHA-256" in one_line_error(proc) and "expected " + "0" * 64 in proc.stderr
    assert not (tmp_path / "wmt19.de-en.joined-dict.ensemble").exists()


@pytest.mark.parametrize("damage", ["truncated", "not gzip"])
def test_corrupt_archive_is_one_line_and_not_unpacked(mirror, tmp_path, damage):
    archive, _ = mirror["de-en"]
    data = archive.read_bytes()
    (tmp_path / archive.name).write_bytes(data[: len(data) // 2] if damage == "truncated" else b"<html>404</html>\n")
    proc = download("de-en", tmp_path, env=OFFLINE)
    assert proc.returncode == 1
    assert "is corrupt or truncated" in one_line_error(proc)
    assert not (tmp_path / "wmt19.de-en.joined-dict.ensemble").exists()


def test_truncated_download_is_one_line(mirror, tmp_path):
    """A server that sends half the archive: curl succeeds, the archive check catches it."""
    archive, _ = mirror["ru-en"]
    served = tmp_path / "served"
    served.mkdir()
    data = archive.read_bytes()
    (served / archive.name).write_bytes(data[: len(data) // 3])
    proc = download("ru-en", tmp_path / "out", env=dict(SMALL, WMT19_URL_BASE="file://{}".format(served)))
    assert proc.returncode == 1
    assert "is corrupt or truncated" in one_line_error(proc)


def test_archive_of_the_other_pair_is_refused(mirror, tmp_path):
    # The ru-en archive renamed to the de-en name: it holds none of the de-en members.
    archive, _ = mirror["ru-en"]
    shutil.copy(archive, tmp_path / "wmt19.de-en.joined-dict.ensemble.tar.gz")
    proc = download("de-en", tmp_path, env=OFFLINE)
    assert proc.returncode == 1
    assert "has no wmt19.de-en.joined-dict.ensemble/model1.pt" in one_line_error(proc)


def test_too_small_model_names_the_file(mirror, tmp_path):
    archive, _ = mirror["de-en"]
    shutil.copy(archive, tmp_path / archive.name)
    proc = download("de-en", tmp_path, env={"WMT19_URL_BASE": "file:///nonexistent"})  # default 100 MB minimum
    assert proc.returncode == 1
    line = one_line_error(proc)
    assert "wmt19.de-en.joined-dict.ensemble/model1.pt is only" in line and "WMT19_MIN_MODEL_BYTES" in line


@pytest.mark.parametrize("args,message", [
    ([], "usage: download_wmt19.sh PAIR DIR"),
    (["de-en"], "usage: download_wmt19.sh PAIR DIR"),
    (["de-en", "a", "b"], "usage: download_wmt19.sh PAIR DIR"),
    (["xx-yy", "dir"], "download_wmt19.sh: unknown pair 'xx-yy' (choose de-en or ru-en)"),
])
def test_usage_errors_exit_2(tmp_path, args, message):
    proc = download(*args, env=OFFLINE)
    assert proc.returncode == 2
    assert one_line_error(proc).startswith(message)
    assert proc.stdout == ""


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_header_and_exits_0(flag):
    """--help was taken for a missing DIR: the usage line, status 2."""
    proc = download(flag, env=OFFLINE)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("Fetch fairseq's published WMT'19 transformer ensemble")
    assert "Usage: scripts/download_wmt19.sh PAIR DIR" in proc.stdout
    assert "WMT19_MIN_MODEL_BYTES" in proc.stdout and "set -euo" not in proc.stdout
