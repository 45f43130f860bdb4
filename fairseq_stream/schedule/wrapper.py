"""What fairseq reads of a generator besides ``generate``, for our generators that wrap a decoder.

fairseq-generate and fairseq-interactive read a generator's ``eos`` and
``symbols_to_strip_from_output``, and our tools its decoding statistics
(``stats``); a generator around a decoder (the streaming generator, the
``--cpu-workers`` one) answers with the decoder's.
"""


class DecoderWrapper:
    """A fairseq generator around ``self.decoder``, whose ``eos``, stripped symbols and ``stats`` it gives."""

    decoder = None  # set by the subclass: the decoder, or a generator around one

    @property
    def stats(self):
        return self.decoder.stats

    @property
    def eos(self):
        return self.decoder.eos

    @property
    def symbols_to_strip_from_output(self):
        return self.decoder.symbols_to_strip_from_output
