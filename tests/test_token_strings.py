"""``Dictionary.string`` over ints (fairseq_stream/token_strings.py): fairseq's own strings, string for string.

The plugin installs it in place of fairseq's (fairseq_glue.py); fairseq's
function stays reachable as ``__wrapped__``. Both are run on the toy's
dictionaries, on its valid set's real sentences and on random ids that hit
every rule (the ignored ids, the unknown word, ids past the dictionary's end,
negative ids), under every combination of the arguments fairseq passes.
"""

import copy
import itertools
import os

import pytest
import torch

import fairseq_stream  # noqa: F401  (installs the glue)
from fairseq.data import data_utils
from fairseq.data.dictionary import Dictionary
from fairseq_stream.fairseq_glue import PATCHED

OPTIONS = list(itertools.product(
    [None, "sentencepiece", "@@ ", "subword_nmt", "none"],  # bpe_symbol
    [False, True],  # escape_unk
    [None, "eos-and-pad", "empty"],  # extra_symbols_to_ignore
    [None, "UNK"],  # unk_string
    [False, True],  # include_eos
    [" ", "|"],  # separator
))


@pytest.fixture(scope="module")
def dictionaries(toy):
    return {side: Dictionary.load(os.path.join(toy.data_bin, "dict.{}.txt".format(side))) for side in ("src", "tgt")}


def sentences(toy, dictionary, side, count=12):
    data = data_utils.load_indexed_dataset(os.path.join(toy.data_bin, "valid.src-tgt." + side), dictionary)
    return [data[i] for i in range(count)]


def random_ids(dictionary, count=12):
    generator = torch.Generator().manual_seed(0)
    n = len(dictionary)
    special = torch.tensor([dictionary.unk(), dictionary.eos(), dictionary.pad(), dictionary.bos(), n, n + 3, -1, -n])
    out = []
    for _ in range(count):
        body = torch.randint(-n, n + 4, (int(torch.randint(0, 15, (1,), generator=generator)),), generator=generator)
        out.append(torch.cat([body, special[torch.randperm(len(special), generator=generator)[:4]]]))
    return out + [torch.empty(0, dtype=torch.long)]


def both(dictionary, tensor, options):
    bpe, escape, ignore, unk_string, include_eos, separator = options
    extra = {None: None, "eos-and-pad": {dictionary.eos(), dictionary.pad()}, "empty": set()}[ignore]
    args = (tensor, bpe, escape, extra, unk_string, include_eos, separator)
    return dictionary.string(*args), Dictionary.string.__wrapped__(dictionary, *args)


def test_the_plugin_installs_it(dictionaries):
    assert getattr(Dictionary.string, PATCHED, False)


@pytest.mark.parametrize("side", ["src", "tgt"])
def test_every_string_is_fairseqs(toy, dictionaries, side):
    d = dictionaries[side]
    tensors = sentences(toy, d, side) + random_ids(d)
    tensors += [t.int() for t in tensors[:4]] + [t.clamp(0, 255).to(torch.uint8) for t in tensors[-4:]]
    for options in OPTIONS:
        for tensor in tensors:
            ours, fairseqs = both(d, tensor, options)
            assert ours == fairseqs, (options, tensor.tolist())


def test_what_it_does_not_read_as_ints_goes_to_fairseqs_own(dictionaries):
    d = dictionaries["tgt"]
    rows = torch.stack([t[:6] for t in random_ids(d)[:3]])
    for tensor in [rows, rows[0].tolist(), rows[0].float(), torch.tensor(d.unk())]:
        for options in OPTIONS[::7]:
            try:
                fairseqs = Dictionary.string.__wrapped__(d, tensor, *options)
            except Exception as error:  # fairseq's own error: ours must raise the same
                with pytest.raises(type(error)):
                    d.string(tensor, *options)
                continue
            assert d.string(tensor, *options) == fairseqs


def test_an_id_below_the_dictionary_fails_as_in_fairseq(dictionaries):
    d = dictionaries["tgt"]
    tensor = torch.tensor([4, -len(d) - 1])
    with pytest.raises(IndexError):
        Dictionary.string.__wrapped__(d, tensor)
    with pytest.raises(IndexError):
        d.string(tensor)


# --- Dictionary.encode_line ---------------------------------------------------------------------------


def lines_to_encode(toy):
    with open(os.path.join(toy.raw, "valid.src")) as f:
        lines = [f.readline() for _ in range(8)]
    # Words of no dictionary, runs of whitespace, tabs, an empty and a blank line.
    return lines + ["s3  unheard-of\tword s3 \n", "", "   ", "unheard-of unheard-of", "s1\u00a0s2"]


def encode_both(dictionary, line, options):
    add, eos, reverse, with_consumer = options
    calls = {"ours": [], "fairseq": []}
    fresh = {"ours": copy.deepcopy(dictionary), "fairseq": copy.deepcopy(dictionary)}
    out = {}
    for who, encode in (("ours", lambda d, **kw: d.encode_line(line, **kw)),
                        ("fairseq", lambda d, **kw: Dictionary.encode_line.__wrapped__(d, line, **kw))):
        consumer = (lambda word, idx, seen=calls[who]: seen.append((word, idx))) if with_consumer else None
        out[who] = encode(fresh[who], add_if_not_exist=add, consumer=consumer, append_eos=eos, reverse_order=reverse)
    return out, calls, fresh


@pytest.mark.parametrize("side", ["src", "tgt"])
def test_every_encoded_line_is_fairseqs(toy, dictionaries, side):
    d = dictionaries[side]
    assert getattr(Dictionary.encode_line, PATCHED, False)
    for line in lines_to_encode(toy):
        for options in itertools.product([True, False], [True, False], [False, True], [False, True]):
            out, calls, grown = encode_both(d, line, options)
            assert out["ours"].dtype == out["fairseq"].dtype == torch.int32, (line, options)
            assert out["ours"].tolist() == out["fairseq"].tolist(), (line, options)
            assert calls["ours"] == calls["fairseq"], (line, options)
            # add_if_not_exist: the same words added, in the same order, with the same counts.
            for field in ("symbols", "count", "indices"):
                assert getattr(grown["ours"], field) == getattr(grown["fairseq"], field), (line, options, field)


def test_a_dictionary_with_its_own_lookup_keeps_fairseqs_encode_line(dictionaries):
    class Lowercased(Dictionary):
        def index(self, sym):
            return super().index(sym.lower())

    d = Lowercased()
    d.add_symbol("s1")
    assert d.encode_line("S1 s2", add_if_not_exist=False).tolist() == [d.index("s1"), d.unk(), d.eos()]
