"""Option values are checked by their field's type before any checkpoint loads: the Python API and bulk alike."""

import pytest

from fairseq_stream.errors import FairseqStreamError

# (keyword arguments, the one-line error): each once failed inside translate() or after the checkpoints loaded.
BAD = [
    (dict(lenpen="abc"), "lenpen takes a number, got 'abc'"),
    (dict(lenpen=None), "lenpen takes a number, got None"),
    (dict(unkpen="x"), "unkpen takes a number, got 'x'"),
    (dict(beam=2.5), "beam takes an integer, got 2.5"),
    (dict(beam="five"), "beam takes an integer, got 'five'"),
    (dict(beam=True), "beam takes an integer, got True"),
    (dict(nbest=0), "nbest must be at least 1, got 0"),
    (dict(nbest=-1), "nbest must be at least 1, got -1"),
    (dict(max_len_a="1.2x"), "max_len_a takes a number, got '1.2x'"),
    (dict(max_len_b=[50]), "max_len_b takes an integer, got [50]"),
    (dict(prune_ap="wide"), "prune_ap takes a number or None, got 'wide'"),
    (dict(sampling="maybe"), "sampling takes true or false, got 'maybe'"),
    (dict(stream_refill_unit="words"), "stream_refill_unit must be one of sentences, rows, got 'words'"),
    (dict(pool="many"), "pool takes an integer, got 'many'"),
    (dict(pool=None), "pool takes an integer, got None"),
    (dict(batch_size=2.0), "batch_size takes an integer or None, got 2.0"),
    (dict(maxi_batch="2x"), "maxi_batch takes an integer, got '2x'"),
    (dict(cpu="maybe"), "cpu takes true or false, got 'maybe'"),
    (dict(search=["var"]), "search takes a string, got ['var']"),
    (dict(bpe=["sentencepiece"]), "bpe takes a string or None, got ['sentencepiece']"),
]


def translator(toy, path, **kwargs):
    from fairseq_stream.api import Translator

    kwargs.setdefault("data", str(toy.data_bin))
    return Translator(path, **kwargs)


@pytest.mark.parametrize("kwargs, says", BAD)
def test_a_bad_api_option_is_one_line_before_loading(toy, tmp_path, kwargs, says):
    # The checkpoint does not exist: the option's error must come first.
    with pytest.raises(FairseqStreamError) as err:
        translator(toy, str(tmp_path / "missing.pt"), **kwargs)
    assert str(err.value) == says


@pytest.mark.parametrize("paths, says", [
    (5, "paths takes a checkpoint file or a list of them, got 5"),
    ([], "paths takes at least one checkpoint file, got []"),
    (["a.pt", 5], "paths takes checkpoint files as str or os.PathLike, got 5"),
])
def test_bad_checkpoint_paths_are_one_line(toy, paths, says):
    with pytest.raises(FairseqStreamError) as err:
        translator(toy, paths)
    assert str(err.value) == says


# Those bulk can be given: an option's text (bulk's own flags, --beam, --pool ..., are argparse's).
BULK = [(k, s) for k, s in BAD
        if all(isinstance(v, str) for v in k.values()) and not {"pool", "maxi_batch", "cpu", "beam"} & set(k)]


@pytest.mark.parametrize("kwargs, says", BULK)
def test_bulk_option_texts_get_the_same_error(kwargs, says):
    """One checker: bulk's ``--option KEY=VALUE`` says what the API says, after naming the option text."""
    from fairseq_stream.bulk import options

    (key, value), = kwargs.items()
    with pytest.raises(FairseqStreamError) as err:
        options.checked("var-stream", ["{}={}".format(key, value)])
    assert str(err.value) == "--option {}={}: {}".format(key, value, says)


def test_bulk_refuses_nbest_below_1_with_its_type():
    from fairseq_stream.bulk import options

    with pytest.raises(FairseqStreamError) as err:
        options.checked("var-stream", ["nbest=0"])
    assert str(err.value) == "--option nbest=0: nbest must be at least 1, got '0'"


def test_strings_are_read_as_the_command_line_reads_them(toy):
    """``beam="2"`` is 2, ``max_len_a="1.2"`` is 1.2 ...: the same translations as the typed values give."""
    sentences = (toy.raw / "test.src").read_text().splitlines()[:6]

    def run(**kwargs):
        t = translator(toy, str(toy.transformer), search="fixed", pool=3, cpu=True, **kwargs)
        return sorted((r.index, r.text, r.score, [h["tokens"].tolist() for h in r.hypotheses])
                      for r in t.translate(sentences))

    typed = run(beam=2, max_len_a=1.2, max_len_b=3, lenpen=1.0, unkpen=0, nbest=2, unnormalized=False)
    texts = run(beam="2", max_len_a="1.2", max_len_b="3", lenpen="1", unkpen="0", nbest="2", unnormalized="false")
    assert texts == typed
    assert all(len(hyps) == 2 for _, _, _, hyps in typed)  # nbest=2 kept two, as "2" did
