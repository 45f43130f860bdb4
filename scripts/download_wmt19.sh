#!/usr/bin/env bash
# Fetch fairseq's published WMT'19 transformer ensemble for one pair, check it, unpack it.
#
# Usage: scripts/download_wmt19.sh PAIR DIR        PAIR: de-en or ru-en
#
# Produces DIR/NAME/ holding model1.pt..model4.pt, dict.SRC.txt, dict.en.txt
# and bpecodes, where NAME is wmt19.de-en.joined-dict.ensemble or
# wmt19.ru-en.ensemble (fairseq's examples/wmt19/README.md). The archive
# DIR/NAME.tar.gz is kept: delete it to save disk once the model is unpacked.
#
# * Skipped when DIR/NAME/ is already complete (every file, models big enough).
# * Offline: copy NAME.tar.gz (or the unpacked NAME/) into DIR from a machine
#   with network; an archive found in DIR is used without downloading.
# * Downloads go to DIR/NAME.tar.gz.part, renamed only when complete, so an
#   interrupted download is never taken for an archive; a later run resumes it.
# * The archive must list every expected member (tar -tzf) before it is
#   unpacked, and match a SHA-256 when one is known.
#
# Environment:
#   WMT19_URL_BASE         where the archives are (default: fairseq's server;
#                          any curl URL, file:// included, for mirrors)
#   WMT19_SHA256           expected SHA-256 of the archive (checked if set)
#   WMT19_MIN_MODEL_BYTES  smallest acceptable model*.pt (default 100 MB; the
#                          real ones are over 1 GB each)
set -euo pipefail

PROG=download_wmt19.sh
URL_BASE=${WMT19_URL_BASE:-https://dl.fbaipublicfiles.com/fairseq/models}
MIN_MODEL_BYTES=${WMT19_MIN_MODEL_BYTES:-100000000}

# SHA-256 of each archive. Empty = unknown: fairseq publishes no checksums
# for these files, and none was recorded here from a verified download. Set
# WMT19_SHA256 to check an archive against a hash you trust.
declare -A SHA256=(
    [wmt19.de-en.joined-dict.ensemble]=""
    [wmt19.ru-en.ensemble]=""
)

fail() {
    echo "$PROG: $*" >&2
    exit 1
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    # The header above is the help: every comment line up to the first blank one.
    sed -n '2,/^$/{/^#/s/^# \{0,1\}//p}' "$0"
    exit 0
fi
if [[ $# -ne 2 ]]; then
    echo "usage: $PROG PAIR DIR   (PAIR: de-en or ru-en)" >&2
    exit 2
fi
PAIR=$1
DIR=${2%/}
case $PAIR in
    de-en) NAME=wmt19.de-en.joined-dict.ensemble; SRC=de ;;
    ru-en) NAME=wmt19.ru-en.ensemble; SRC=ru ;;
    *)
        echo "$PROG: unknown pair '$PAIR' (choose de-en or ru-en)" >&2
        exit 2
        ;;
esac
[[ $MIN_MODEL_BYTES =~ ^[0-9]+$ ]] || fail "WMT19_MIN_MODEL_BYTES must be a number of bytes, got '$MIN_MODEL_BYTES'"

FILES=(model1.pt model2.pt model3.pt model4.pt "dict.$SRC.txt" dict.en.txt bpecodes)
DEST=$DIR/$NAME
ARCHIVE=$DIR/$NAME.tar.gz
URL=${URL_BASE%/}/$NAME.tar.gz

# What is wrong with the unpacked model directory $1, as one phrase; nothing if it is complete.
problem_in() {
    local f size
    for f in "${FILES[@]}"; do
        if [[ ! -f $1/$f ]]; then
            echo "$1/$f is missing"
            return
        fi
        size=$(stat -c %s "$1/$f")
        if [[ $f == model*.pt && $size -lt $MIN_MODEL_BYTES ]]; then
            echo "$1/$f is only $size bytes (a real model is over 1 GB; minimum WMT19_MIN_MODEL_BYTES=$MIN_MODEL_BYTES)"
            return
        elif [[ $size -eq 0 ]]; then
            echo "$1/$f is empty"
            return
        fi
    done
}

# Download $URL to $ARCHIVE through a .part file; one line (and curl's reason) if it fails.
download() {
    local part=$ARCHIVE.part err rc=0
    err=$(mktemp)
    echo "$PROG: downloading $URL"
    curl -fL --retry 2 --connect-timeout 30 -sS -C - -o "$part" "$URL" 2>"$err" || rc=$?
    # A .part that cannot be resumed (already complete, or longer than the
    # file: curl 33 or 36, HTTP 416) is started over once; on other failures
    # it is kept, for the next run to resume.
    if [[ $rc -eq 33 || $rc -eq 36 || ($rc -eq 22 && $(cat "$err") == *416*) ]]; then
        rm -f "$part"
        rc=0
        curl -fL --retry 2 --connect-timeout 30 -sS -o "$part" "$URL" 2>"$err" || rc=$?
    fi
    if [[ $rc -ne 0 ]]; then
        [[ -s $part ]] || rm -f "$part"
        echo "$PROG: cannot download $URL (no network?). Offline: copy the archive to $ARCHIVE (or an unpacked $DEST/) from a machine with network and run again; the test sets come from --text-dir DIR in scripts/newstest.sh" >&2
        [[ -s $err ]] && echo "  ($(tail -n 1 "$err"))" >&2
        rm -f "$err"
        exit 1
    fi
    rm -f "$err"
    mv "$part" "$ARCHIVE"
}

# Fail unless $ARCHIVE matches the known (or given) SHA-256.
check_hash() {
    local want=${WMT19_SHA256:-${SHA256[$NAME]}} got
    [[ -n $want ]] || return 0
    got=$(sha256sum "$ARCHIVE" | cut -d' ' -f1)
    [[ ${got,,} == "${want,,}" ]] || fail "$ARCHIVE has SHA-256 $got, expected $want: delete it and run again"
}

# The archive's member names for the expected files, one a line; fails on a corrupt archive.
members() {
    local listing err f name
    listing=$(mktemp)
    err=$(mktemp)
    if ! tar -tzf "$ARCHIVE" >"$listing" 2>"$err"; then
        local why
        why=$(grep -v -e '^[[:space:]]*$' -e '^tar: Error is not recoverable' "$err" | head -n 1)
        rm -f "$listing" "$err"
        fail "$ARCHIVE is corrupt or truncated (${why:-tar failed}): delete it and run again"
    fi
    for f in "${FILES[@]}"; do
        # Archives made with "tar -C dir ." name members ./NAME/...
        name=$(grep -m 1 -x -F -e "$NAME/$f" -e "./$NAME/$f" "$listing" || true)
        if [[ -z $name ]]; then
            rm -f "$listing" "$err"
            fail "$ARCHIVE has no $NAME/$f: not the $PAIR ensemble, or incomplete; delete it and run again"
        fi
        echo "$name"
    done
    rm -f "$listing" "$err"
}

# Unpack the expected members into $DEST through a scratch directory, so a
# failed unpack leaves no half-written model behind.
unpack() {
    local names f
    mapfile -t names < <(members)
    [[ ${#names[@]} -eq ${#FILES[@]} ]] || exit 1  # members() failed and said why
    # Global, for the EXIT trap to find it after a fail.
    SCRATCH=$(mktemp -d "$DIR/.$NAME.unpack.XXXXXX")
    trap 'rm -rf "$SCRATCH"' EXIT
    echo "$PROG: unpacking $ARCHIVE"
    tar -xzf "$ARCHIVE" -C "$SCRATCH" --no-same-owner "${names[@]}" 2>/dev/null \
        || fail "cannot unpack $ARCHIVE: delete it and run again"
    mkdir -p "$DEST"
    for f in "${FILES[@]}"; do
        mv -f "$SCRATCH/$NAME/$f" "$DEST/$f"
    done
    rm -rf "$SCRATCH"
    trap - EXIT
}

if [[ -d $DEST ]]; then
    problem=$(problem_in "$DEST")
    if [[ -z $problem ]]; then
        echo "$PROG: $DEST already present, skipped"
        exit 0
    fi
    echo "$PROG: $DEST incomplete ($problem); unpacking it again"
fi

mkdir -p "$DIR"
if [[ -f $ARCHIVE ]]; then
    echo "$PROG: using $ARCHIVE (already in $DIR)"
else
    download
fi
check_hash
unpack

problem=$(problem_in "$DEST")
[[ -z $problem ]] || fail "$problem"
echo "$PROG: $PAIR ensemble in $DEST (${FILES[*]}); the archive $ARCHIVE can be deleted"
echo "next: scripts/newstest.sh $PAIR 2018 var-stream --models $DEST"
