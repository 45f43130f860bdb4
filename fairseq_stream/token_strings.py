"""fairseq's ``Dictionary.string`` and ``Dictionary.encode_line`` over Python lists: tokens to text and back.

**Tokens to text.** ``Dictionary.string`` over a list of ints, for the 1-D integer tensors fairseq-generate hands it.

fairseq-generate turns three token tensors a sentence into text (source,
target, hypothesis), and fairseq's ``Dictionary.string`` walks each tensor
element by element: every token becomes a 0-d tensor, compared with the
unknown word's index and used as a list index through tensor operators. On
the Multi30k test set that was 0.38 s of the parent's CPU per 1,000
sentences (issue 50: with ``--cpu-workers`` the parent shares the cores with
the workers). Read as a list of ints once (``tolist``), the same rules give
the same string at a tenth of the cost.

The rules are fairseq 0.12's, in its order: the ignored ids (the caller's,
EOS unless ``include_eos``, BOS where the dictionary has one) are dropped;
the unknown word's index becomes ``unk_string`` or ``self.unk_string(escape_unk)``;
any other id ``symbols[id]`` when below the dictionary's size, else the
unknown word (``Dictionary.__getitem__``); the words are joined by
``separator`` and ``data_utils.post_process`` removes the BPE. Anything else
(2-D tensors, lists, tensors other than int64 and int32, XLA tensors, a
dictionary whose ``__getitem__`` is its own) goes to fairseq's function unchanged.
tests/test_token_strings.py holds the two equal, string for string.

**Text to tokens.** fairseq-generate with a target and ``--remove-bpe`` (or
``--replace-unk``) encodes each sentence's target and best hypothesis again for
its BLEU scorer, and fairseq-interactive encodes each input line: fairseq's
``encode_line`` writes every id into a tensor one element at a time (``ids[i] =
idx``, a tensor operator a word), 39 us a Multi30k sentence. Here the ids go
to a list and become one int32 tensor: 11 us, the same ids, and the same
``add_symbol`` / ``index`` and ``consumer`` calls in the same order (so a
dictionary that grows grows the same). A dictionary whose ``add_symbol`` or
``index`` is its own keeps fairseq's function.
"""

from typing import Callable

import torch
from fairseq.tokenizer import tokenize_line

# fairseq compares a 0-d tensor with the dictionary's size in the tensor's type: narrower types wrap the size
# (a uint8 id 255 is past a 300-word dictionary there), so they keep fairseq's own function.
_INTEGER_TYPES = (torch.int64, torch.int32)


def dictionary_string(original: Callable, self, tensor, bpe_symbol=None, escape_unk=False,
                      extra_symbols_to_ignore=None, unk_string=None, include_eos=False, separator=" "):
    """``Dictionary.string``'s text for ``tensor``; fairseq's own ``original`` where the fast rules do not apply."""
    if not _plain_ids(self, tensor):
        return original(self, tensor, bpe_symbol, escape_unk, extra_symbols_to_ignore, unk_string,
                        include_eos, separator)
    from fairseq.data import data_utils

    ignored = set(extra_symbols_to_ignore or [])
    if not include_eos:
        ignored.add(self.eos())
    if hasattr(self, "bos_index"):
        ignored.add(self.bos())
    unk, symbols = self.unk(), self.symbols
    size = len(symbols)
    words = []
    for i in tensor.tolist():
        if i in ignored:
            continue
        if i == unk:
            words.append(unk_string if unk_string is not None else self.unk_string(escape_unk))
        else:
            words.append(symbols[i] if i < size else self.unk_word)
    return data_utils.post_process(separator.join(words), bpe_symbol)


def _plain_ids(dictionary, tensor) -> bool:
    """Whether ``tensor`` is a 1-D int64 or int32 tensor that ``tolist`` reads exactly, and ``dictionary`` looks
    words up as fairseq's ``Dictionary`` does (the rule written out above)."""
    from fairseq.data.dictionary import Dictionary

    return (torch.is_tensor(tensor) and tensor.dim() == 1 and tensor.dtype in _INTEGER_TYPES
            and tensor.device.type in ("cpu", "cuda")
            and type(dictionary).__getitem__ is Dictionary.__getitem__
            and isinstance(getattr(dictionary, "symbols", None), list))


def dictionary_encode_line(original: Callable, self, line, line_tokenizer=tokenize_line, add_if_not_exist=True,
                           consumer=None, append_eos=True, reverse_order=False):
    """``Dictionary.encode_line``'s int32 ids for ``line``; fairseq's own ``original`` for a dictionary of its own rules."""
    from fairseq.data.dictionary import Dictionary

    kind = type(self)
    if kind.add_symbol is not Dictionary.add_symbol or kind.index is not Dictionary.index:
        return original(self, line, line_tokenizer, add_if_not_exist, consumer, append_eos, reverse_order)
    words = line_tokenizer(line)
    if reverse_order:
        words = list(reversed(words))
    ids = []
    for word in words:
        idx = self.add_symbol(word) if add_if_not_exist else self.index(word)
        if consumer is not None:
            consumer(word, idx)
        ids.append(idx)
    if append_eos:
        ids.append(self.eos_index)
    return torch.tensor(ids, dtype=torch.int32)
